"""How many jobs a local user may pile up, and how long ended jobs' records are kept, under a
real laminard and real other local users.

Before: any local user could submit jobs in a loop (``POST /v1/jobs`` is open to every uid):
the queue, the store and ``GET /v1/jobs`` grew without bound, and every ended job's row was kept
forever. Now config ``[jobs] max_per_user`` limits the jobs a user has that have not ended
(queued, running, suspended, or still being stopped): one more is refused with 429 naming the
limit and the count, and nothing is created; root is not limited. ``keep_ended`` and
``keep_ended_s`` bound the ended jobs' records the agent keeps (the oldest ended go first); a
job that has not ended is never pruned, a job number is never given twice, and a record another
component still holds (a keeper keeping the job's replica) is kept.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import NOBODY, AgentProc, api_json, wait_until
from conftest import VethPair
from jobrig import job_manager
from userrig import call_as, local_user

from laminar.runtime.record import Job
from laminar.runtime.spec import JobSpec, QuotaError

pytestmark = pytest.mark.kernel

LIMIT = 2
KEEP = 3


@pytest.fixture
def limited_agent(veth_pair: VethPair, tmp_path: Path) -> Iterator[AgentProc]:
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a,
                  extra_toml=f"[jobs]\nmax_per_user = {LIMIT}\nkeep_ended = {KEEP}\n")
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


def ended_or_gone(agent: AgentProc, job_id: str) -> bool:
    status, out = api_json(agent.sock, "GET", f"/v1/jobs/{job_id}")
    return status == 404 or bool(out.get("ended"))


def submit_root(agent: AgentProc, command: list[str], wait_end: bool = True) -> str:
    status, out = api_json(agent.sock, "POST", "/v1/jobs", json.dumps({"command": command, "class": "transient"}))
    assert status == 201, out
    if wait_end:
        wait_until(lambda: ended_or_gone(agent, out["id"]), 30, f"{out['id']} to end", agent.log)
    return str(out["id"])


def test_ended_jobs_beyond_keep_ended_are_pruned_oldest_first_never_a_live_or_referenced_one(
        limited_agent: AgentProc) -> None:
    agent = limited_agent
    long = submit_root(agent, ["sleep", "600"], wait_end=False)
    held = submit_root(agent, ["true"])
    # a keeper keeps held's replica (the migration layer's record): held is kept whatever its age
    db = sqlite3.connect(agent.state_dir / "laminar.db", timeout=30)
    try:
        with db:
            db.execute("INSERT INTO migrate_keepers VALUES (?, 7, strftime('%s','now'))", (held,))
    finally:
        db.close()
    quick = [submit_root(agent, ["true"]) for _ in range(5)]
    ids = [r[0] for r in rows(agent)]
    # the KEEP newest ended are kept, the referenced one and the running one too
    assert ids == [long, held, *quick[-KEEP:]], (ids, quick)
    listed = [j["id"] for j in api_json(agent.sock, "GET", "/v1/jobs")[1]]
    assert listed == ids, listed
    assert api_json(agent.sock, "GET", f"/v1/jobs/{quick[0]}")[0] == 404

    # the running job ends: now the newest ended; the oldest of the others goes
    status, out = api_json(agent.sock, "POST", f"/v1/jobs/{long}/stop", '{"grace_s": 0}')
    assert status == 201, out
    wait_until(lambda: [r[0] for r in rows(agent)] == [long, held, *quick[-KEEP + 1:]], 20,
               "the oldest ended job to be pruned", lambda: f"{rows(agent)}\n{agent.log()}")

    # no longer referenced: held counts like any other (the oldest ended)
    db = sqlite3.connect(agent.state_dir / "laminar.db", timeout=30)
    try:
        with db:
            db.execute("DELETE FROM migrate_keepers WHERE job_id = ?", (held,))
    finally:
        db.close()
    last = submit_root(agent, ["true"])
    assert [r[0] for r in rows(agent)] == [long, *quick[-KEEP + 2:], last], rows(agent)


def test_ended_jobs_older_than_keep_ended_s_are_pruned_and_no_number_is_given_twice(tmp_path: Path) -> None:
    """The age rule, and keep_ended = 0 (every record pruned as its job ends, the newest too):
    the next job's number is still past every number given (a reused number would reuse the
    pruned job's id, log, checkpoint directory and replica key)."""
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            jobs.keep_ended_s = 3600.0
            old = await jobs.submit(JobSpec(["true"], name="lm-t-old").validate())
            await jobs.wait(old.id, 30)
            await asyncio.sleep(0.2)
            young = await jobs.submit(JobSpec(["true"], name="lm-t-young").validate())
            await jobs.wait(young.id, 30)
            assert jobs.pruner.prune_ended() == 0 and jobs.get(old.id) is not None
            ended_old, ended_young = jobs.get(old.id).ended, jobs.get(young.id).ended  # type: ignore[union-attr]
            assert ended_old is not None and ended_young is not None and ended_young > ended_old
            # an hour after old ended, before young's hour is up: old goes, young stays
            assert jobs.pruner.prune_ended(now=3600 + (ended_old + ended_young) / 2) == 1
            assert jobs.get(old.id) is None and jobs.get(young.id) is not None

            jobs.keep_ended = 0
            assert jobs.pruner.prune_ended() == 1 and jobs.get(young.id) is None
            after = await jobs.submit(JobSpec(["true"], name="lm-t-after").validate())
            assert after.num == young.num + 1, (after.num, young.num)
            await jobs.wait(after.id, 30)
            assert jobs.get(after.id) is None  # pruned as it ended
            again = await jobs.submit(JobSpec(["sleep", "600"], name="lm-t-again").validate())
            assert again.num == after.num + 1
            assert jobs.pruner.prune_ended() == 0 and jobs.get(again.id) is not None  # running: never pruned

    asyncio.run(main())


def test_concurrent_submissions_cannot_pass_the_limit_together(tmp_path: Path) -> None:
    """Each submission awaits its path probe (run as the owner) between the first check and the
    store: the limit is checked again with no await before the job is stored."""
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            jobs.max_per_user = LIMIT
            got = await asyncio.gather(*(jobs.submit(JobSpec(["sleep", "600"], name=f"lm-t-c{i}").validate(),
                                                     owner_uid=NOBODY, owner_gid=NOBODY, quota=True)
                                         for i in range(LIMIT + 3)), return_exceptions=True)
            made = [g for g in got if isinstance(g, Job)]
            refused = [g for g in got if isinstance(g, QuotaError)]
            assert len(made) == LIMIT and len(refused) == 3, got
            assert len(jobs.list()) == LIMIT
            # root is not limited
            for i in range(LIMIT + 1):
                await jobs.submit(JobSpec(["sleep", "600"], name=f"lm-t-r{i}").validate(), quota=True)

    asyncio.run(main())
