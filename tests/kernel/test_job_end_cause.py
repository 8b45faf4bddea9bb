"""Why a job ended, through a real laminard (issue 32): ``end_cause`` in ``laminarctl -o json job
show``, ``jobs -o json`` and the job's end event, for the ends a user meets every day: a job that
exits 0, one that exits non-zero, one its user stops, one root stops for another user. The
causes, their states and the store's upgrade: tests/unit/test_end_cause.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from agentproc import NOBODY, AgentProc, wait_until

pytestmark = pytest.mark.kernel


def ended(agent: AgentProc, jid: str) -> dict[str, Any]:
    return wait_until(lambda: (lambda j: j if j["ended"] is not None else None)(agent.json("job", "show", jid)),
                      30, f"{jid} to end")


def end_event(agent: AgentProc, jid: str) -> dict[str, Any]:
    return wait_until(lambda: next((e for e in agent.json("events", "--kind", "job", "--limit", "300")
                                    if e.get("job") == jid and "end_cause" in e and "stopping" not in e["message"]),
                                   None), 10, f"{jid}'s end event")


def test_each_end_says_its_cause_in_the_record_the_list_and_the_event(agent: AgentProc) -> None:
    zero = agent.json("submit", "--name", "lm-t-zero", "--", "true")
    three = agent.json("submit", "--name", "lm-t-three", "--", "sh", "-c", "exit 3")
    mine = agent.json("submit", "--name", "lm-t-mine", "--", "sleep", "600")
    theirs = json.loads(agent.ctl("-o", "json", "submit", "--name", "lm-t-theirs", "--", "sleep", "600",
                                  user=NOBODY).stdout)
    own = json.loads(agent.ctl("-o", "json", "submit", "--name", "lm-t-own", "--", "sleep", "600",
                               user=NOBODY).stdout)
    for j in (mine, theirs, own):
        assert agent.json("job", "show", j["id"])["end_cause"] is None  # not ended: no cause
    assert agent.json("job", "stop", mine["id"], "--grace", "0")["end_cause"] == "stopped_by_user"  # root's own
    assert agent.json("job", "stop", theirs["id"], "--grace", "0")["end_cause"] == "stopped_by_operator"
    r = agent.ctl("-o", "json", "job", "stop", own["id"], "--grace", "0", user=NOBODY)
    assert json.loads(r.stdout)["end_cause"] == "stopped_by_user"
    want = {zero["id"]: ("exited", 0, "exited_zero"), three["id"]: ("exited", 3, "exited_nonzero"),
            mine["id"]: ("stopped", None, "stopped_by_user"), theirs["id"]: ("stopped", None, "stopped_by_operator"),
            own["id"]: ("stopped", None, "stopped_by_user")}
    for jid, (state, code, cause) in want.items():
        j = ended(agent, jid)
        assert (j["state"], j["end_cause"]) == (state, cause), j
        if code is not None:
            assert j["exit_code"] == code, j
        assert end_event(agent, jid)["end_cause"] == cause
    listed = {j["id"]: j.get("end_cause") for j in agent.json("jobs", "--last", "50")}
    assert {jid: listed.get(jid) for jid in want} == {jid: w[2] for jid, w in want.items()}
