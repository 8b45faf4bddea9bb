"""Every route of the control API against a real second local user (not root, not in the
control group), through a real laminard (tests/agentproc.py, tests/userrig.py).

- Every route that changes state is privileged, or is one of the reviewed per-caller routes
  (submit, stop one's own job, place through the zone, validate a policy without applying it).
  A route added later with another method and no privilege fails the source check here until
  it is reviewed and listed.
- Every privileged route refuses that user with 403, before its handler runs.
- The user cannot stop another user's job; the job keeps running.
- No GET route shows that user the value of another user's job env (a token).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from agentproc import AgentProc, wait_until
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel

AGENT_SRC = Path(__file__).resolve().parents[2] / "agent" / "laminar"
ROUTE = re.compile(r'Route\("(\w+)",\s*"([^"]+)",\s*[\w.]+(?:,\s*privileged=(True|False))?\)')
# The routes that change state without privilege, each checking its caller in its handler.
PER_CALLER = {
    ("POST", "/v1/jobs"),  # as the caller, within the caller's grant ([grants])
    ("POST", "/v1/jobs/{id}/stop"),  # the job's owner, root or the control group
    ("POST", "/v1/placements"),  # as the caller, within the caller's grant (checked at the origin)
    ("POST", "/v1/policy/validate"),  # changes nothing: answers whether a policy is valid
    # the caller's own task of the Slurm job it names (its parent a root-owned slurmstepd of that
    # job), within the caller's grant; a pod's cgroup or another uid: root only (test_adopt_api.py)
    ("POST", "/v1/jobs/adopt"),
    ("POST", "/v1/jobs/adopt/check"),  # changes nothing: answers whether an adoption would be refused
    ("POST", "/v1/jobs/{id}/exit"),  # root only, checked in the handler (test_adopt_api.py: 403 for a user)
}
TOKEN = "lm-sec-route-token-7d1e"


def source_routes() -> list[tuple[str, str, bool]]:
    """(method, path, privileged) of every Route(...) written in the agent's source."""
    out = []
    for f in sorted(AGENT_SRC.rglob("*.py")):
        for m in ROUTE.finditer(f.read_text()):
            out.append((m.group(1), m.group(2), m.group(3) == "True"))
    return out


def test_every_route_that_changes_state_is_privileged_or_reviewed() -> None:
    routes = source_routes()
    assert len(routes) > 30, f"found only {len(routes)} routes in {AGENT_SRC}: the pattern no longer matches"
    open_writes = {(m, p) for m, p, priv in routes if m != "GET" and not priv}
    assert open_writes <= PER_CALLER, (
        f"routes that change state without privilege and no review here: {sorted(open_writes - PER_CALLER)}")
    assert not any(priv for m, p, priv in routes if m == "GET"), "a GET route marked privileged"


def concrete(path: str, job: str) -> str:
    """A route's path with its parameters filled in (a job id where it takes one)."""
    return re.sub(r"\{(\w+)\}", lambda m: job if m.group(1) in ("id", "job") else "lm-sec-x", path)


def test_a_second_user_is_refused_every_privileged_route_and_sees_no_secret(agent: AgentProc) -> None:
    status, job, raw = call_as(None, agent.sock, "POST", "/v1/jobs",
                               {"command": ["sleep", "600"], "name": "lm-sec-root", "env": {"API_TOKEN": TOKEN}})
    assert status == 201, raw
    wait_until(lambda: agent.json("job", "show", job["id"])["state"] == "running", 30, "the job to run")
    routes = source_routes()
    with local_user("routes") as user:
        before = agent.json("status")["agent"]["api_refused"]
        privileged = [(m, p) for m, p, priv in routes if priv]
        assert len(privileged) >= 12
        for method, path in privileged:
            url = concrete(path, job["id"])
            status, out, _ = call_as(user, agent.sock, method, url, {})
            assert status == 403 and "permission denied" in out["error"], f"{method} {url} as uid {user.uid}: {status} {out}"
        assert agent.json("status")["agent"]["api_refused"] - before == len(privileged)

        # another user's job: not stopped, still running
        status, out, _ = call_as(user, agent.sock, "POST", f"/v1/jobs/{job['id']}/stop", {"reason": "not mine"})
        assert status == 403 and "belongs to uid 0" in out["error"], out
        assert agent.json("job", "show", job["id"])["state"] == "running"

        # no GET route shows the token to the other user (root does see it: the check can fail)
        gets = sorted({p for m, p, _ in routes if m == "GET"})
        seen_by_root = []
        for path in gets:
            url = concrete(path, job["id"])
            status, _, raw = call_as(user, agent.sock, "GET", url)
            assert TOKEN.encode() not in raw, f"GET {url} shows another user's job env value to uid {user.uid}"
            if TOKEN.encode() in call_as(None, agent.sock, "GET", url)[2]:
                seen_by_root.append(path)
        status, _, raw = call_as(user, agent.sock, "GET", "/v1/events?limit=1000")
        assert TOKEN.encode() not in raw
        assert "/v1/jobs/{id}" in seen_by_root, seen_by_root
