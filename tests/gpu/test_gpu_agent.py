"""The whole agent on a GPU node: a real laminard (BPF data plane, cgroups, every component) and
laminarctl showing the node's GPUs and running a GPU job. Skips where NVML finds no GPU, or
with the missing piece named where the agent itself cannot run here (root, cgroup2, kernel
BTF, bpffs, the BPF objects, libbpf, ``unshare``).

The agent runs in a network namespace of its own (``unshare --net``) with its data plane on that
namespace's loopback, so nothing is attached to the machine's own interfaces; laminarctl
reaches it over its Unix socket. It is the `agentproc.AgentProc` the kernel tests use; where the
checkout has no ``.venv`` (a GPU node with a system Python), small ``laminard``/``laminarctl``
scripts that run this interpreter stand in for the venv's entry points.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agentproc
import pytest
from agentproc import AgentProc
from gpucheck import JOB, last_json, nvml_or_skip, runtime_or_skip, smi_gpus

pytestmark = pytest.mark.gpu


def agent_or_skip() -> None:
    """Skips naming what the full agent lacks here."""
    runtime_or_skip()
    if not Path("/sys/kernel/btf/vmlinux").exists():
        pytest.skip("no kernel BTF at /sys/kernel/btf/vmlinux (the BPF objects are CO-RE)")
    if not any(line.split()[2] == "bpf" for line in Path("/proc/self/mounts").read_text().splitlines()):
        pytest.skip("no bpffs mounted (mount -t bpf bpf /sys/fs/bpf)")
    objs = agentproc.REPO / "agent/laminar/bpf/objects"
    if not (objs / "netguard.bpf.o").exists():
        pytest.skip(f"BPF objects not built in {objs} (make bpf)")
    for mod in ("cffi",):
        try:
            __import__(mod)
        except ImportError:
            pytest.skip(f"python package {mod} not installed")
    try:
        ctypes.CDLL("libbpf.so.1")
    except OSError as e:
        pytest.skip(f"libbpf.so.1 not loadable: {e}")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) not installed: no network namespace for the agent")


class OwnNet:
    """Runs a command in a fresh network namespace (only loopback): the agent's uplink is `lo`."""

    def argv(self, *argv: str) -> list[str]:
        return ["unshare", "--net", "--", *argv]


def entry_points(tmp: Path) -> Path:
    """The venv's bin dir if it has laminard, else a dir of scripts running this interpreter."""
    if (agentproc.VENV_BIN / "laminard").exists():
        return agentproc.VENV_BIN
    d = tmp / "bin"
    d.mkdir(exist_ok=True)
    for name, mod in (("laminard", "laminar.agent"), ("laminarctl", "laminarctl.main")):
        p = d / name
        p.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; from {mod} import main; sys.exit(main())' \"$@\"\n")
        p.chmod(0o755)
    return d


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    nvml_or_skip()
    agent_or_skip()
    monkeypatch.setattr(agentproc, "VENV_BIN", entry_points(tmp_path))
    monkeypatch.setenv("COLUMNS", "250")  # rich lays tables out this wide: names stay on one line
    a = AgentProc(tmp_path, "lo", netns=OwnNet(), node="gpu-t")
    try:
        a.start(timeout=120)
        yield a
    finally:
        a.cleanup()


def job_env_args() -> list[str]:
    out = []
    for k in ("PYTHONPATH", "LD_LIBRARY_PATH"):
        if os.environ.get(k):
            out += ["--env", f"{k}={os.environ[k]}"]
    return out


def test_laminarctl_shows_the_gpus_and_runs_a_gpu_job(agent: AgentProc) -> None:
    smi = smi_gpus()
    st = agent.json("status")
    inv = st["jobs"]["gpus"]
    assert inv["source"] == "nvml"
    assert [(g["index"], g["name"]) for g in inv["gpus"]] == [(s.index, s.name) for s in smi]
    human = agent.ctl("status").stdout
    assert all(s.name in human for s in smi), human

    job: dict[str, Any] = agent.json("submit", "--name", "gpu-job", "--gpus", "1", *job_env_args(), "--",
                                     sys.executable, "-c", JOB)
    try:
        assert job["state"] == "running" and job["gpus"] == [smi[0].index]
        ready = Path(job["ckpt_dir"]) / "ready"
        end = time.monotonic() + 180
        while not ready.exists() and time.monotonic() < end:
            assert agent.json("job", "show", job["id"])["state"] == "running", Path(job["log"]).read_text()
            time.sleep(0.2)
        view = last_json(Path(job["log"]).read_text())
        assert view is not None and view["count"] == 1 and view["uuids"] == [smi[0].uuid], Path(job["log"]).read_text()
        listed = {j["id"]: j for j in agent.json("jobs", "--active")}
        assert listed[job["id"]]["gpus"] == [smi[0].index]
        if len(smi) == 1:  # the node's only GPU is taken: a second GPU job is refused, not given it
            r = agent.ctl("-o", "json", "submit", "--gpus", "1", "--", sys.executable, "-c", "pass", check=False)
            assert r.returncode != 0 and "only 0 free" in r.stderr, (r.returncode, r.stdout, r.stderr)
            assert [j["id"] for j in agent.json("jobs", "--active")] == [job["id"]]
        (Path(job["ckpt_dir"]) / "go").touch()
        end = time.monotonic() + 120
        while agent.json("job", "show", job["id"])["state"] == "running" and time.monotonic() < end:
            time.sleep(0.2)
        done = agent.json("job", "show", job["id"])
        assert done["state"] == "exited" and done["exit_code"] == 0, done
    finally:
        subprocess.run(agent.argv(str(agentproc.VENV_BIN / "laminarctl"), "--socket", str(agent.sock), "job", "stop",
                                  job["id"]), capture_output=True, timeout=60)
