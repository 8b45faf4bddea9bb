"""What a job sees of the node's GPUs, under the real agent (declared GPUs: this machine has no
GPU; tests/gpu checks the same on a real one through NVML).

1. a job given GPUs sees exactly those (``CUDA_VISIBLE_DEVICES``, in NVML's PCI order), and a
   job given none sees none (``CUDA_VISIBLE_DEVICES=""``), not every GPU of the node;
2. the GPUs that queued jobs will take when they start count at submit: a GPU job that could
   only start by taking one of them is refused at once, naming the queued job, rather than
   accepted and failed when its turn comes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, agent_factory, wait_until
from test_admission_queue import CONFIG, HOLD, fill, story

pytestmark = pytest.mark.kernel

# Writes its CUDA environment to argv[1] as JSON, then exits (argv[2] == "exit") or holds until
# the file argv[2] exists.
ENV = r"""
import json, os, sys, time
keys = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while sys.argv[2] != "exit" and not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
"""


@pytest.fixture
def make_agent(veth_pair: Any, tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    with agent_factory(tmp_path, veth_pair, "[gpus]\ndeclared = 2\n\n" + CONFIG) as make:
        yield make


def env_job(agent: AgentProc, tmp: Path, name: str, *opts: str, hold: Path | None = None,
            check: bool = True) -> Any:
    """Submit a job that writes what CUDA would see to ``tmp/<name>.json`` and exits, or holds
    until ``hold`` exists; the job's JSON (``check``: else the CompletedProcess)."""
    script = tmp / "env.py"
    if not script.exists():
        script.write_text(ENV)
    argv = ("submit", "--name", name, *opts, "--", sys.executable, str(script), str(tmp / f"{name}.json"),
            str(hold) if hold is not None else "exit")
    return agent.json(*argv) if check else agent.ctl(*argv, check=False)


def seen_env(path: Path, agent: AgentProc) -> dict[str, Any]:
    wait_until(path.exists, 20, f"the job to write {path.name}", lambda: story(agent))
    return json.loads(path.read_text())


def test_a_job_sees_exactly_its_gpus_and_one_without_sees_none(make_agent: Any, tmp_path: Path) -> None:
    agent = make_agent()
    release = tmp_path / "release"
    held = env_job(agent, tmp_path, "gpu", "--gpus", "1", hold=release)
    assert held["gpus"] == [0], held
    assert seen_env(tmp_path / "gpu.json", agent) == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    plain = env_job(agent, tmp_path, "plain")
    assert plain["gpus"] == [], plain
    assert seen_env(tmp_path / "plain.json", agent) == {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    # the second GPU goes to the next GPU job, never the first one's
    other = env_job(agent, tmp_path, "gpu2", "--gpus", "1", hold=release)
    assert other["gpus"] == [1] and seen_env(tmp_path / "gpu2.json", agent)["CUDA_VISIBLE_DEVICES"] == "1"
    release.write_text("")


def test_gpus_of_queued_jobs_count_at_submit(make_agent: Any, tmp_path: Path) -> None:
    agent = make_agent()
    hold = tmp_path / "hold.py"
    hold.write_text(HOLD)
    release = tmp_path / "release"
    first = env_job(agent, tmp_path, "gpu", "--gpus", "1", hold=release)
    assert first["gpus"] == [0], first
    fill(agent, hold, tmp_path)  # the transient class is full to its cap: the next job waits
    queued = env_job(agent, tmp_path, "q-gpu", "--class", "transient", "--memory", "100M", "--gpus", "1")
    assert queued["state"] == "queued", queued
    # GPU 1 is free now but the queued job takes it when it starts: no GPU for this one
    r = env_job(agent, tmp_path, "late", "--gpus", "1", check=False)
    said = r.stdout + r.stderr
    assert r.returncode != 0 and queued["id"] in said and "queued" in said, said
    assert not any(j["name"] == "late" for j in agent.json("jobs")), "a refused job was recorded"
    # and the queued job does get its GPU when room frees
    release.write_text("")
    agent.json("job", "stop", next(j["id"] for j in agent.json("jobs") if j["name"] == "m0"), "--grace", "0")
    got = seen_env(tmp_path / "q-gpu.json", agent)
    assert got["CUDA_VISIBLE_DEVICES"] in ("0", "1"), got
