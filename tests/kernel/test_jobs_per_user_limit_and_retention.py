"""How many jobs a local user may pile up, under a real laminard and real other local users.

Before: any local user could submit jobs in a loop (``POST /v1/jobs`` is open to every uid):
the queue, the store and ``GET /v1/jobs`` grew without bound, and every ended job's row was kept
forever. Now config ``[jobs] max_per_user`` limits the jobs a user has that have not ended
(queued, running, suspended, or still being stopped): one more is refused with 429 naming the
limit and the count, and nothing is created; root is not limited.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, api_json, wait_until
from conftest import VethPair
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel

LIMIT = 2


@pytest.fixture
def limited_agent(veth_pair: VethPair, tmp_path: Path) -> Iterator[AgentProc]:
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a,
                  extra_toml=f"[jobs]\nmax_per_user = {LIMIT}\n")
    try:
        a.start()
        yield a
    finally:
        a.cleanup()


def rows(agent: AgentProc, where: str = "1") -> list[tuple[str, str, Any]]:
    db = sqlite3.connect(agent.state_dir / "laminar.db")
    try:
        return [tuple(r) for r in db.execute(f"SELECT id, state, ended FROM jobs WHERE {where} ORDER BY num")]
    finally:
        db.close()


def spec(name: str, command: list[str] | None = None) -> dict[str, object]:
    return {"command": command or ["sleep", "600"], "name": name, "class": "transient"}


def test_a_user_at_the_limit_is_refused_counting_stopping_jobs_root_is_not(limited_agent: AgentProc) -> None:
    agent = limited_agent
    with local_user("quota") as user, local_user("other") as other:
        ids = []
        # the second ignores SIGTERM (its sleep inherits the ignored signal): its stop takes the grace
        for n, cmd in enumerate((["sleep", "600"], ["sh", "-c", "trap '' TERM; sleep 600"])):
            status, out, _ = call_as(user, agent.sock, "POST", "/v1/jobs", spec(f"lm-t-q{n}", cmd))
            assert status == 201, out
            ids.append(out["id"])
        before = rows(agent)

        status, out, _ = call_as(user, agent.sock, "POST", "/v1/jobs", spec("lm-t-q-over"))
        assert status == 429, out
        assert f"uid {user.uid} has {LIMIT} jobs" in out["error"] and f"limit is {LIMIT}" in out["error"], out
        assert "jobs.max_per_user" in out["error"], out
        assert rows(agent) == before, "a refused submission left a job behind"

        # the CLI: refused, the agent's message
        r = agent.ctl("submit", "--class", "transient", "--", "sleep", "600", user=user.uid, check=False)
        assert r.returncode != 0 and f"limit is {LIMIT}" in r.stderr, (r.returncode, r.stderr)

        # another user and root are not held by this user's count
        status, out, _ = call_as(other, agent.sock, "POST", "/v1/jobs", spec("lm-t-q-other"))
        assert status == 201, out
        for _ in range(LIMIT + 1):
            status, out = api_json(agent.sock, "POST", "/v1/jobs", '{"command": ["sleep", "600"], "class": "transient"}')
            assert status == 201, out

        # a job being stopped (in its grace, ignoring SIGTERM) has not ended: it still counts
        stopped: dict[str, Any] = {}
        t = threading.Thread(target=lambda: stopped.update(
            r=api_json(agent.sock, "POST", f"/v1/jobs/{ids[1]}/stop", '{"grace_s": 4}', timeout=60)))
        t.start()
        try:
            wait_until(lambda: api_json(agent.sock, "GET", f"/v1/jobs/{ids[1]}")[1]["state"] == "stopped", 20,
                       "the stop to begin", agent.log)
            assert api_json(agent.sock, "GET", f"/v1/jobs/{ids[1]}")[1]["ended"] is None
            status, out, _ = call_as(user, agent.sock, "POST", "/v1/jobs", spec("lm-t-q-while-stopping"))
            assert status == 429, out
        finally:
            t.join(60)
        assert stopped["r"][0] == 201 and stopped["r"][1]["ended"], stopped
        # ended: room for one more
        status, out, _ = call_as(user, agent.sock, "POST", "/v1/jobs", spec("lm-t-q-after"))
        assert status == 201, out
