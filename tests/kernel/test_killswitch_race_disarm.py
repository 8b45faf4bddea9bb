"""``killswitch off --all`` (and ``off --job``) clears every armed deadline, a reclaim's too, and says so.

The rule (docs/operations.md): an operator's "off" is the last word on the node's switches, so
``off --all`` clears the all-jobs cut, every job's cut and every job's armed deadline, the ones a
reclaim armed (``netguard.arm_job``) included. It must not do so silently: the answer and the
``killswitch`` event name the jobs whose deadline it cleared. A real laminard (tests/agentproc.py)
with a real job; the deadline is armed the way a reclaim arms it, through ``arm --job``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from agentproc import AgentProc

pytestmark = pytest.mark.kernel


def test_off_all_names_the_jobs_whose_deadline_it_cleared(veth_pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    agent = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
    try:
        agent.start()
        armed = agent.json("submit", "--name", "armed", "--", "sleep", "60")
        plain = agent.json("submit", "--name", "plain", "--", "sleep", "60")
        agent.ctl("killswitch", "arm", "--job", armed["id"], "--at", "+300s")
        st = agent.json("killswitch", "status")
        rows = {r["job"]: r for r in st["jobs"]}
        assert rows[armed["id"]]["armed_in_s"] is not None and rows[plain["id"]]["armed_in_s"] is None

        res = agent.json("killswitch", "off", "--all")
        assert res["disarmed"] == [armed["id"]], res
        assert armed["id"] in res["message"]
        rows = {r["job"]: r for r in agent.json("killswitch", "status")["jobs"]}
        assert rows[armed["id"]]["armed_in_s"] is None and not rows[armed["id"]]["kill"]
        events = agent.json("events", "--kind", "killswitch")
        assert any(e.get("disarmed") == [armed["id"]] or armed["id"] in e.get("message", "") for e in events), events

        # off --job says the same for the one job; a job with nothing armed clears nothing.
        agent.ctl("killswitch", "arm", "--job", plain["id"], "--at", "+300s")
        assert agent.json("killswitch", "off", "--job", plain["id"])["disarmed"] == [plain["id"]]
        assert agent.json("killswitch", "off", "--job", armed["id"])["disarmed"] == []
    finally:
        agent.cleanup()
