"""Periodic checkpoints on a real agent: laminard signals real jobkit jobs at the hazard's interval.

The agent's hazard prior is raised to 100 departures per node-hour (MTBF 36 s) so the Daly
interval of a job with a tiny checkpoint is a few seconds. Two co-resident jobs that honour the
contract get checkpoint signals and commit checkpoints about once per planned interval, their
signals staggered (never in the same instant); a job that opted out and one without the
contract (it would die of SIGUSR1) are never signalled.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until

pytestmark = pytest.mark.kernel

JOB = '''
import json, sys, time
from laminar import jobkit
out = open(sys.argv[1], "a")
ck = jobkit.Checkpointer()
step = 0
while True:
    time.sleep(0.05)
    step += 1
    if ck.requested():
        ck.save(b"w" * 4096, step=step)
        out.write(json.dumps({"ckpt": step, "ts": time.time()}) + "\\n")
        out.flush()
'''

# The test watches until each contract job got two checkpoint signals and committed them (the
# first comes one interval, a few seconds, after the job was first seen); this is only the limit.
TIMEOUT_S = 90.0


@pytest.fixture
def agent(veth_pair: Any, tmp_path: Path) -> Iterator[AgentProc]:
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a, extra_toml=(
        "[migrate]\nhazard_prior_rate_per_h = 100.0\nmin_interval_s = 1.0\nmax_interval_s = 30.0\n"
        "ckpt_pause_s = 0.2\nstagger_gap_s = 1.0\npoll_s = 0.2\n"))
    try:
        a.start()
        yield a
    finally:
        a.cleanup()


def periodic(a: AgentProc) -> list[dict[str, Any]]:
    return [e for e in a.json("events", "--kind", "migrate") if e.get("phase") == "periodic"]


def test_jobs_get_staggered_checkpoint_signals_at_the_planned_interval(agent: AgentProc, tmp_path: Path) -> None:
    script = tmp_path / "ckjob.py"
    script.write_text(JOB)
    logs = {n: tmp_path / f"{n}.jsonl" for n in ("a", "b", "optout")}
    t0 = time.monotonic()
    ids = {n: agent.json("submit", "--name", f"ck-{n}", *(["--no-periodic-checkpoints"] if n == "optout" else []),
                         "--", sys.executable, str(script), str(logs[n]))["id"] for n in logs}
    plain = agent.json("submit", "--name", "plain", "--", sys.executable, "-c", "import time; time.sleep(600)")["id"]

    def saved(n: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in logs[n].read_text().splitlines()] if logs[n].exists() else []

    def watched() -> bool:
        """Each contract job committed two signalled checkpoints and the agent counted them (the
        job logs a save only after a signal: the cheap look first, the agent's view then)."""
        if not logs["optout"].exists() or any(len(saved(n)) < 2 for n in ("a", "b")):
            return False
        rows = {r["job"]: r for r in agent.json("checkpoints")["jobs"]}
        evs = periodic(agent)
        for n in ("a", "b"):
            sig = [e for e in evs if e["job"] == ids[n]]
            row = rows.get(ids[n])
            if row is None or len(sig) < 2 or row["commits"] < len(sig) - 1 or row["latency_s"] is None:
                return False
        return True

    wait_until(watched, TIMEOUT_S, "two committed checkpoint signals for each contract job")
    plan = {r["job"]: r for r in agent.json("checkpoints")["jobs"]}
    events = periodic(agent)
    window = time.monotonic() - t0  # the signals above all came within this
    jobs = {j["id"]: j for j in agent.json("jobs")}

    for n in ("a", "b"):
        row = plan[ids[n]]
        assert row["driven"], row
        iv = row["interval_s"]
        assert 1.0 <= iv <= 10.0, row  # a few seconds: MTBF 36 s, a tiny checkpoint
        assert row["mtbf_s"] == pytest.approx(36.0, rel=0.2), row
        sig = [e for e in events if e["job"] == ids[n]]
        done = saved(n)
        # about one per interval over the window (generous: the first waits a whole interval)
        assert len(sig) >= 2, (row, sig)
        assert len(sig) <= window / 1.0 + 1, (window, sig)  # never more often than min_interval_s
        assert len(done) >= len(sig) - 1, (done, sig)  # the job received them and committed
        assert row["commits"] >= len(sig) - 1 and row["latency_s"] is not None, row
        assert all(e["interval_s"] > 0 and "MTBF" in e["message"] for e in sig)

    # staggered: no signal of a and one of b in the same round; each pair at least half the gap apart
    ta = [e["signal_at"] for e in events if e["job"] == ids["a"]]
    tb = [e["signal_at"] for e in events if e["job"] == ids["b"]]
    assert min(abs(x - y) for x in ta for y in tb) >= 0.5, [(e["job"], e["signal_at"] - events[0]["signal_at"],
                                                             e["interval_s"], e["delay_s"]) for e in events]

    assert not [e for e in events if e["job"] in (ids["optout"], plain)]
    assert plan[ids["optout"]]["skip"].startswith("opted out"), plan[ids["optout"]]
    assert "does not catch SIGUSR1" in plan[plain]["skip"], plan[plain]
    assert logs["optout"].read_text() == ""  # it never checkpointed
    assert jobs[plain]["state"] == "running", jobs[plain]  # never sent a signal that would kill it

    out = agent.ctl("checkpoints").stdout
    assert ids["a"] in out and "EVERY s" in out
