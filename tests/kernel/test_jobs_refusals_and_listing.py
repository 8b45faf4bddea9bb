"""A real laminard, real local users: job requests a user can make that hurt the agent or other
users, and what `laminarctl jobs` shows them.

- A spec with a list of 120,000 GPU indices (it fits the API's 1 MiB body) is refused at once,
  naming the limit; it used to reach a quadratic duplicate check that held the agent's event
  loop for minutes.
- `laminarctl jobs` shows a job's stop reason as it is: a user who stopped their own job with
  the reason ``[/]`` used to make the table fail for everyone (root included) with
  "internal error: MarkupError", and ``[red]x[/red]`` was shown as ``x``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from agentproc import AgentProc, api_json, api_request, wait_until
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


def test_jobs_table_shows_a_stop_reason_as_written(agent: AgentProc) -> None:
    reasons = ["[/]", "[red]mine[/red]"]
    with local_user("mark") as user:
        ids = []
        for reason in reasons:
            status, job, raw = call_as(user, agent.sock, "POST", "/v1/jobs", {"command": ["/bin/sleep", "1000"]})
            assert status == 201, raw
            status, out, raw = call_as(user, agent.sock, "POST", f"/v1/jobs/{job['id']}/stop",
                                       {"reason": reason, "grace_s": 0})
            assert status == 201 and out["reason"] == reason, raw
            ids.append(job["id"])

        def ended() -> Any:
            return all(j["state"] == "stopped" for j in agent.json("jobs") if j["id"] in ids)

        wait_until(ended, 30, "both jobs stopped", agent.log)
        r = agent.ctl("jobs", check=False)
        assert r.returncode == 0, r.stderr
        for reason in reasons:
            assert reason in r.stdout, r.stdout
        by_json = {j["id"]: j["reason"] for j in json.loads(agent.ctl("-o", "json", "jobs").stdout)}
        assert [by_json[i] for i in ids] == reasons


@pytest.mark.parametrize("path, status, needle", [
    # numbers no job or event can have: answered as such, not as "internal error: OverflowError"
    ("/v1/jobs/99999999999999999999", 404, "no job"),
    ("/v1/jobs/" + "1" * 5000, 404, "no job"),
    ("/v1/jobs/99999999999999999999/stop", 404, "no job"),
    ("/v1/events?since=1000000000000000000000000000000", 400, "since"),
    ("/v1/events?since=-5", 400, "since"),
])
def test_ids_past_any_job_or_event_are_a_clear_answer(agent: AgentProc, path: str, status: int, needle: str) -> None:
    method = "POST" if path.endswith("/stop") else "GET"
    code, raw = api_request(agent.sock, method, path, "{}" if method == "POST" else None)
    assert code == status and needle in json.loads(raw)["error"], raw[:300]


@pytest.mark.parametrize("reason", ["x" * 100_000, ["a", "list"]])
def test_a_stop_reason_too_long_to_keep_is_refused_and_the_job_runs_on(agent: AgentProc, reason: Any) -> None:
    """A stop's reason is kept with the job and in two events (the log keeps 50,000): a user
    who stopped jobs with 1 MiB reasons could fill the agent's disk. A list was taken as text."""
    with local_user("why") as user:
        status, job, raw = call_as(user, agent.sock, "POST", "/v1/jobs", {"command": ["/bin/sleep", "1000"]})
        assert status == 201, raw
        status, out, raw = call_as(user, agent.sock, "POST", f"/v1/jobs/{job['id']}/stop", {"reason": reason})
        assert status == 400 and "at most 1000 characters" in out["error"] and len(raw) < 1000, raw[:300]
        assert agent.json("job", "show", job["id"])["state"] == "running"
        r = agent.ctl("job", "stop", job["id"], "--reason", "x" * 1001, check=False)
        assert r.returncode == 2 and "at most 1000" in r.stderr, r.stderr
        status, out, raw = call_as(user, agent.sock, "POST", f"/v1/jobs/{job['id']}/stop",
                                   {"reason": "y" * 1000, "grace_s": 0})
        assert status == 201 and out["reason"] == "y" * 1000, raw[:300]


def test_the_job_list_is_bounded_to_the_newest_ended_jobs(agent: AgentProc) -> None:
    """The store keeps every job. GET /v1/jobs read and answered all of them: with 20,000 ended
    jobs about 3 s of the agent's event loop per request (any user's `laminarctl jobs` in a
    loop held the kill-switch off). Now one page: the newest 200 jobs (?limit= up to 1000), live
    ones where their numbers fall; ?before= the lowest number of a page gives the next, and an
    empty page ends. `laminarctl jobs` follows the pages: the live jobs and the newest 200 ended
    ones; the table says when older ones are left out."""
    import sqlite3

    live = agent.json("submit", "--", "/bin/sleep", "1000")
    spec = json.dumps({"command": ["/bin/true"], "class": "standard"} | {
        k: v for k, v in live["spec"].items() if k not in ("command", "class")})
    db = sqlite3.connect(str(agent.state_dir / "laminar.db"), timeout=30)
    try:
        with db:  # 300 ended jobs, as an agent that ran them would have them
            db.executemany("INSERT INTO jobs(id, num, spec, state, owner_uid, owner_gid, gpus, created, ended, "
                           "exit_code, reason) VALUES(?, ?, ?, 'exited', 0, 0, '[]', ?, ?, 0, 'exit code 0')",
                           [(f"job-{n}", n, spec, 1e9 + n, 1e9 + n + 1) for n in range(1000, 1300)])
    finally:
        db.close()
    code, jobs = api_json(agent.sock, "GET", "/v1/jobs")
    assert code == 200 and [j["num"] for j in jobs] == list(range(1100, 1300)), (len(jobs), jobs[:1])
    code, jobs = api_json(agent.sock, "GET", "/v1/jobs?before=1100&limit=1000")
    assert code == 200 and [j["num"] for j in jobs] == [live["num"], *range(1000, 1100)]
    assert next(j for j in jobs if j["id"] == live["id"])["state"] == "running"
    assert api_json(agent.sock, "GET", f"/v1/jobs?before={live['num']}")[1] == []
    code, jobs = api_json(agent.sock, "GET", "/v1/jobs?limit=1000")
    assert code == 200 and len(jobs) == 301
    for bad in ("abc", "-1", "0", "1001", "100001", "00000000000000000000123456789"):
        code, out = api_json(agent.sock, "GET", f"/v1/jobs?limit={bad}")
        assert code == 400 and "limit" in out["error"], out
    for bad in ("x", "-1", "9" * 19):
        code, out = api_json(agent.sock, "GET", f"/v1/jobs?before={bad}")
        assert code == 400 and "before" in out["error"], out
    r = agent.ctl("jobs")
    assert "older ended jobs not shown" in r.stdout and "job-1299" in r.stdout and "job-1099 " not in r.stdout
    assert len(json.loads(agent.ctl("-o", "json", "jobs", "--last", "1000").stdout)) == 301
    assert len(json.loads(agent.ctl("-o", "json", "jobs", "--last", "5").stdout)) == 6
    assert agent.json("job", "show", "job-1000")["state"] == "exited"
