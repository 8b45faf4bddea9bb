"""A transfer with a deadline that is not a finite number of seconds within a week gets a 400.

Python's JSON reader takes ``NaN`` and ``Infinity``; ``POST /v1/net/transfers`` with
``"deadline_s": NaN`` (or Infinity, or 1e10: 317 years, past SQLite's 64-bit integers once in
nanoseconds) failed inside the registry with ``500 internal error: ValueError: cannot convert
float NaN to integer`` (OverflowError for the others) instead of saying which value was wrong.
Real laminard with shaping on a veth in a netns.
"""

from __future__ import annotations

import pytest
from agentproc import AgentProc, api_json

pytestmark = pytest.mark.kernel



@pytest.mark.parametrize("deadline", ["NaN", "Infinity", "1e10"])
def test_a_deadline_that_is_no_real_time_is_refused(shaping_agent: AgentProc, deadline: str) -> None:
    job = shaping_agent.json("submit", "--name", "lm-t-bad", "--", "sleep", "600")
    body = (f'{{"job": "{job["id"]}", "flow": "tcp:10.79.0.1:40000->10.79.0.2:7000", "total_bytes": 1000000, '
            f'"deadline_s": {deadline}}}')
    status, out = api_json(shaping_agent.sock, "POST", "/v1/net/transfers", body)
    assert status == 400, out
    assert "deadline_s" in out["error"], out
    assert shaping_agent.json("net", "transfers")["transfers"] == []
