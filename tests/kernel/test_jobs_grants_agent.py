"""Who may claim Airlock's top class, under a real laminard, as real other local users.

Before: any local user could submit ``--class long-resident --priority 100``, and Airlock then
suspended and reclaimed everyone else's jobs first. Now the agent's ``[grants]`` decide: a user
without a grant gets standard and transient up to priority 50; a grant (here to a group the
second user holds as a supplementary group) allows more; root anything. A submission beyond the
caller's grant is refused with 403 (``laminarctl submit`` exits 4), naming the class and
priority asked and what the caller may use, and nothing is created.
"""

from __future__ import annotations

import grp
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from agentproc import AgentProc
from conftest import VethPair
from userrig import User, call_as, local_user

pytestmark = pytest.mark.kernel


@pytest.fixture
def users() -> Iterator[tuple[User, User]]:
    with local_user("plain") as plain, local_user("ops", extra_group=True) as ops:
        yield plain, ops


@pytest.fixture
def granted_agent(veth_pair: VethPair, tmp_path: Path, users: tuple[User, User]) -> Iterator[AgentProc]:
    _, ops = users
    group = grp.getgrgid(ops.groups[1]).gr_name
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a, extra_toml=(
        f'[[grants.grant]]\ngroups = ["{group}"]\nclasses = ["long-resident", "standard"]\npriority_max = 90\n'))
    try:
        a.start()
        yield a
    finally:
        a.cleanup()


def stored_jobs(agent: AgentProc) -> int:
    db = sqlite3.connect(agent.state_dir / "laminar.db")
    try:
        return int(db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
    finally:
        db.close()


def spec(job_class: str, priority: int, name: str) -> dict[str, object]:
    return {"command": ["sleep", "600"], "name": name, "class": job_class, "priority": priority}


def test_a_submission_beyond_the_callers_grant_is_refused_and_creates_nothing(
        granted_agent: AgentProc, users: tuple[User, User]) -> None:
    agent = granted_agent
    plain, ops = users
    refused = [
        (plain, "long-resident", 50, "standard, transient up to priority 50"),
        (plain, "standard", 51, "standard, transient up to priority 50"),
        (ops, "long-resident", 91, "long-resident, standard up to priority 90 (granted to group"),
        (ops, "transient", 51, "standard, transient up to priority 50"),  # the grant has no transient
    ]
    for user, cls, prio, may in refused:
        status, out, _ = call_as(user, agent.sock, "POST", "/v1/jobs", spec(cls, prio, f"lm-s7-{cls}"))
        assert status == 403, (user.name, cls, prio, out)
        assert f"class {cls} at priority {prio}" in out["error"] and f"uid {user.uid}" in out["error"], out
        assert may in out["error"], out
    assert agent.json("jobs") == [] and stored_jobs(agent) == 0, "a refused submission left a job behind"
    assert not [p for p in (agent.state_dir / "logs").iterdir()], "a refused submission left a log"

    # the CLI: exit 4 (permission), the agent's message
    r = agent.ctl("submit", "--class", "long-resident", "--priority", "80", "--", "sleep", "600",
                  user=plain.uid, check=False)
    assert r.returncode == 4, (r.returncode, r.stderr)
    assert "class long-resident at priority 80" in r.stderr and "standard, transient up to priority 50" in r.stderr

    allowed = [(plain, "standard", 50), (plain, "transient", 10), (ops, "long-resident", 90), (ops, "standard", 90),
               (None, "long-resident", 100)]
    for user, cls, prio in allowed:
        status, out, _ = call_as(user, agent.sock, "POST", "/v1/jobs", spec(cls, prio, f"lm-s7-ok-{cls}"))
        assert status == 201, (user, cls, prio, out)
        assert out["class"] == cls and out["priority"] == prio
        assert out["owner_uid"] == (user.uid if user else 0)
    assert stored_jobs(agent) == len(allowed)
    assert agent.json("status")["jobs"]["grants"][1]["priority_max"] == 90
    for j in agent.json("jobs"):
        agent.ctl("job", "stop", j["id"], "--grace", "0")


def test_a_zone_placement_is_bound_by_the_callers_grant(granted_agent: AgentProc, users: tuple[User, User]) -> None:
    """``POST /v1/placements`` (``laminarctl zone submit``) is a local user asking for a job too:
    the origin checks the grant before it probes; a refused placement probes nothing and places
    nothing, an allowed one runs with the class asked."""
    agent = granted_agent
    plain, ops = users
    status, out, _ = call_as(plain, agent.sock, "POST", "/v1/placements",
                             {"spec": spec("long-resident", 80, "lm-s7-zone-refused")})
    assert status == 403, out
    assert "class long-resident at priority 80" in out["error"] and "standard, transient up to priority 50" in out["error"]
    assert agent.json("jobs") == [] and stored_jobs(agent) == 0
    status, out, _ = call_as(ops, agent.sock, "POST", "/v1/placements",
                             {"spec": spec("long-resident", 90, "lm-s7-zone-ok")})
    assert status in (200, 201), out
    jobs = agent.json("jobs")
    assert [(j["class"], j["priority"], j["owner_uid"]) for j in jobs] == [("long-resident", 90, ops.uid)]
    for j in jobs:
        agent.ctl("job", "stop", j["id"], "--grace", "0")
