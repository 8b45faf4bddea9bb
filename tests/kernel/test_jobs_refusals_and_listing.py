"""A real laminard, real local users: job requests a user can make that hurt the agent or other
users, and what `laminarctl jobs` shows them.

- A spec with a list of 120,000 GPU indices (it fits the API's 1 MiB body) is refused at once,
  naming the limit; it used to reach a quadratic duplicate check that held the agent's event
  loop for minutes.
"""

from __future__ import annotations

import pytest
from agentproc import AgentProc
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel


def test_a_huge_gpu_list_is_refused_at_once_and_the_agent_keeps_answering(agent: AgentProc) -> None:
    with local_user("gpus") as user:
        status, out, raw = call_as(user, agent.sock, "POST", "/v1/jobs",
                                   {"command": ["/bin/true"], "gpus": list(range(120_000))})
        assert status == 400, raw[:300]
        assert "gpus" in out["error"] and "at most 1024" in out["error"] and len(raw) < 1000, raw[:300]
        status, out, _ = call_as(None, agent.sock, "GET", "/v1/status")
        assert status == 200 and out["agent"]["pid"] > 0
    assert not agent.json("jobs"), "a refused spec left a job behind"

