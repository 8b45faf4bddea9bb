"""Admission by class capacity under the real agent: a full class queues jobs instead of failing them.

Each test starts its own laminard (`agentproc.AgentProc`: own state dir, socket, pins and cgroup
root ``laminar-t-<hex>``) whose transient class has a memory cap (``[airlock] class_budget_mb``,
also the kernel limit on the class's parent cgroup), and drives it only as a user would, with
``laminarctl``. The jobs are Python processes that allocate and write real memory, so the class
really is full when the next job comes. What they show (docs/airlock.md, "Admission"):

1. a job submitted into a class filled to its cap is accepted and queued (not failed), with the
   reason in ``jobs`` and ``job show``; stopping one member starts it, and it runs to completion;
   a queued job can be stopped; raising the cap by policy starts the queue at once;
2. ``kill -9`` of the agent keeps the queue and its order (priority first): after the restart the
   jobs are still queued and start, in that order, as room frees;
3. a job whose limit exceeds the cap is refused at submit, naming the limit and the cap.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, agent_factory, wait_until

# serial: its memory pressure is felt machine-wide (node PSI, MemAvailable); run alone (Makefile)
pytestmark = [pytest.mark.kernel, pytest.mark.serial]

CAP_MB = 300
CONFIG = f"[airlock]\nclass_budget_mb = {{transient = {CAP_MB}}}\n"

# Allocates and writes MIB MiB (really charged), then either exits 0 (argv[2] == "exit") or
# holds it and rewrites a progress file every 50 ms until killed.
HOLD = r"""
import os, sys, time
b = bytearray(int(sys.argv[1]) << 20)
for i in range(0, len(b), 4096):
    b[i] = 1
if sys.argv[2] == "exit":
    sys.exit(0)
n = 0
while True:
    n += 1
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(0.05)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    p = tmp_path / "hold.py"
    p.write_text(HOLD)
    return p


@pytest.fixture
def make_agent(veth_pair: Any, tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    with agent_factory(tmp_path, veth_pair, CONFIG) as make:
        yield make


def progress(p: Path) -> int:
    try:
        return int(p.read_text())
    except (OSError, ValueError):
        return 0


def submit(agent: AgentProc, name: str, memory: str, argv: list[str], priority: int = 50) -> dict[str, Any]:
    return agent.json("submit", "--name", name, "--class", "transient", "--memory", memory, "--priority",
                      str(priority), "--", *argv)


def show(agent: AgentProc, job_id: str) -> dict[str, Any]:
    return agent.json("job", "show", job_id)


def story(agent: AgentProc) -> str:
    return "\n".join(f"{e['ts']:.3f} {e['message']}" for e in agent.json("events", "--kind", "job", "--limit", "200"))


def fill(agent: AgentProc, script: Path, tmp: Path, n: int = 3) -> list[dict[str, Any]]:
    """n jobs of 100 MiB limit each holding 75 MiB of written memory (plus the interpreter): the
    class full by its members' limits and most of the way there by its usage."""
    out = []
    for i in range(n):
        prog = tmp / f"member{i}.progress"
        out.append(submit(agent, f"m{i}", "100M", [sys.executable, str(script), "75", str(prog)]))
        wait_until(lambda p=prog: progress(p) > 0, 20, f"member {i} to hold its memory", lambda: story(agent))
    return out


def class_usage_mb(agent: AgentProc) -> int:
    d = Path("/sys/fs/cgroup/memory") / agent.cgroup_root / "transient"
    return int((d / "memory.usage_in_bytes").read_text()) >> 20


def test_full_class_queues_the_next_job_which_starts_when_room_frees(make_agent: Any, script: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # one table row per job
    agent = make_agent()
    assert agent.json("status")["airlock"]["admission"]["class_caps_mb"] == {"transient": CAP_MB}
    members = fill(agent, script, tmp_path)
    if Path("/sys/fs/cgroup/memory").is_dir():  # hybrid host: the class parent really is near its cap
        assert class_usage_mb(agent) >= CAP_MB * 3 // 4, class_usage_mb(agent)

    # One more: accepted, queued (no process, no cgroup), and it says why.
    r = agent.ctl("submit", "--name", "next", "--class", "transient", "--memory", "100M", "--",
                  sys.executable, str(script), "50", "exit")
    said = r.stdout + r.stderr
    assert r.returncode == 0 and f"queued: waiting for class transient: needs 100 MiB, 0 MiB free under its cap of {CAP_MB} MiB" in said, said
    nxt = next(j for j in agent.json("jobs") if j["name"] == "next")
    assert nxt["state"] == "queued" and nxt["pid"] is None and nxt["cgroup_id"] == 0, nxt
    assert nxt["reason"] == f"waiting for class transient: needs 100 MiB, 0 MiB free under its cap of {CAP_MB} MiB"
    assert nxt["queue"] == {"position": 1, "needs_mb": 100, "free_mb": 0, "cap_mb": CAP_MB, "never": False}
    assert not Path(nxt["cgroup"]).exists()
    row = next(line for line in agent.ctl("jobs").stdout.splitlines() if line.startswith(nxt["id"] + " "))
    assert "queued" in row and "waiting for class transient" in row, row
    assert "waiting for class transient" in agent.ctl("job", "show", nxt["id"]).stdout

    # A second queued job is stoppable while queued; it never ran and lost nothing.
    extra = submit(agent, "extra", "100M", [sys.executable, str(script), "10", "exit"])
    assert extra["state"] == "queued" and "1 job(s) ahead" in extra["reason"], extra
    stopped = agent.json("job", "stop", extra["id"])
    assert stopped["state"] == "stopped" and stopped["pid"] is None and stopped["work_lost_s"] == 0, stopped
    time.sleep(1.0)
    assert show(agent, extra["id"])["state"] == "stopped"
    assert show(agent, nxt["id"])["state"] == "queued"  # nothing freed room yet

    # Stopping one member frees 100 MiB: the queued job starts and runs to completion.
    agent.json("job", "stop", members[0]["id"], "--grace", "0")
    done = wait_until(lambda: (j := show(agent, nxt["id"]))["state"] == "exited" and j, 30,
                      "the queued job to start and run to completion", lambda: story(agent))
    assert done["exit_code"] == 0 and done["reason"] == "exit code 0", done
    assert done["started"] is not None and done["started"] >= done["created"]
    started = [e for e in agent.json("events", "--kind", "job", "--limit", "200")
               if e.get("job") == nxt["id"] and "started" in e["message"]]
    assert started and started[0]["queued_s"] > 0, started
    for m in members[1:]:  # (Airlock may have suspended one for a while: the class sits near its cap)
        assert show(agent, m["id"])["state"] in ("running", "suspended")

    # A policy cap above the config's changes nothing (the smaller holds); the next job starts
    # when a member ends.
    a = submit(agent, "a", "100M", [sys.executable, str(script), "10", str(tmp_path / "a.progress")])
    b = submit(agent, "b", "100M", [sys.executable, str(script), "10", "exit"])
    assert a["state"] == "running" and b["state"] == "queued", (a, b)  # room for exactly one
    pol = tmp_path / "policy.json"
    pol.write_text(json.dumps({"class_caps_mb": {"transient": CAP_MB + 100}}))
    agent.ctl("policy", "set", str(pol))
    assert agent.json("status")["airlock"]["admission"]["class_caps_mb"] == {"transient": CAP_MB}
    time.sleep(1.0)
    assert show(agent, b["id"])["state"] == "queued"
    agent.json("job", "stop", a["id"], "--grace", "0")
    wait_until(lambda: show(agent, b["id"])["state"] == "exited", 30, "job b to start once a ended")
    assert not [e for e in agent.json("events", "--kind", "job", "--limit", "300") if e.get("state") == "failed"]


def test_policy_cap_raise_starts_the_queue(make_agent: Any, script: Path, tmp_path: Path) -> None:
    agent = make_agent("")  # no config cap: the policy's class_caps_mb alone
    pol = tmp_path / "p1.json"
    pol.write_text(json.dumps({"class_caps_mb": {"transient": 200}, "job_default_mb": {"transient": 100}}))
    agent.ctl("policy", "set", str(pol))
    prog = tmp_path / "m.progress"
    # No --memory: the class's default becomes the job's limit (and its charge).
    m = agent.json("submit", "--name", "m", "--class", "transient", "--", sys.executable, str(script), "80", str(prog))
    assert m["state"] == "running" and m["spec"]["memory_mb"] == 100, m
    m2 = submit(agent, "m2", "100M", [sys.executable, str(script), "80", str(tmp_path / "m2.progress")])
    q = submit(agent, "q", "100M", [sys.executable, str(script), "10", "exit"])
    assert m2["state"] == "running" and q["state"] == "queued", (m2, q)
    pol.write_text(json.dumps({"class_caps_mb": {"transient": 300}, "job_default_mb": {"transient": 100}}))
    agent.ctl("policy", "set", str(pol))
    wait_until(lambda: show(agent, q["id"])["state"] == "exited", 30, "the queued job to start after the cap rose",
               lambda: story(agent))
    assert show(agent, q["id"])["exit_code"] == 0
    # the members were not harmed (Airlock may suspend one for a while: the class sits at its cap)
    assert show(agent, m["id"])["state"] in ("running", "suspended")
    assert show(agent, m2["id"])["state"] in ("running", "suspended")


def test_agent_kill9_keeps_the_queue_and_its_order(make_agent: Any, script: Path, tmp_path: Path) -> None:
    agent = make_agent()
    members = fill(agent, script, tmp_path)
    low = submit(agent, "low", "100M", [sys.executable, str(script), "10", "exit"], priority=20)
    high = submit(agent, "high", "100M", [sys.executable, str(script), "10", str(tmp_path / "high.progress")],
                  priority=80)
    assert low["state"] == "queued" and high["state"] == "queued"
    assert show(agent, high["id"])["queue"]["position"] == 1 and show(agent, low["id"])["queue"]["position"] == 2

    agent.kill9()
    time.sleep(0.5)
    agent.start()
    after = {j["id"]: j for j in agent.json("jobs")}
    for m in members:
        assert after[m["id"]]["state"] == "running" and after[m["id"]]["reattached"], after[m["id"]]
    for q in (low, high):
        assert after[q["id"]]["state"] == "queued", after[q["id"]]
        assert after[q["id"]]["reason"].startswith("waiting for class transient: needs 100 MiB, 0 MiB free")
    assert after[high["id"]]["queue"]["position"] == 1

    # Room for one: the higher priority goes first although it was submitted later.
    agent.json("job", "stop", members[0]["id"], "--grace", "0")
    wait_until(lambda: progress(tmp_path / "high.progress") > 0, 30, "the high-priority queued job to run",
               lambda: story(agent))
    assert show(agent, low["id"])["state"] == "queued"
    assert show(agent, high["id"])["state"] == "running"
    agent.json("job", "stop", members[1]["id"], "--grace", "0")
    done = wait_until(lambda: (j := show(agent, low["id"]))["state"] == "exited" and j, 30,
                      "the low-priority job to start and finish", lambda: story(agent))
    assert done["exit_code"] == 0


def test_job_larger_than_the_cap_is_refused_at_submit(make_agent: Any, script: Path) -> None:
    agent = make_agent()
    r = agent.ctl("submit", "--name", "huge", "--class", "transient", "--memory", "400M", "--",
                  sys.executable, str(script), "10", "exit", check=False)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "memory 400 MiB" in r.stderr and f"cap of {CAP_MB} MiB" in r.stderr and "could never start" in r.stderr, \
        r.stderr
    assert [j for j in agent.json("jobs") if j["name"] == "huge"] == []
    # Another class has no cap: the same job is admitted there.
    ok = agent.json("submit", "--name", "std", "--class", "standard", "--memory", "400M", "--",
                    sys.executable, str(script), "10", "exit")
    assert ok["state"] == "running", ok
