"""A local user cannot stall the agent's event loop, nor make it hold unbounded state for them.

Issue 31, items 1 and 3 (the API side). Every test runs a real laminard (tests/agentproc.py) and
makes each attack as a real local user (tests/userrig.py ``local_user``; the attacks themselves
are tests/loopattacks.py: raw HTTP on the public socket, raw TCP on the metrics port), while
root asks ``status`` and flips a job's kill-switch every 100 ms on the admin socket
(tests/liveness.py ``RootLiveness``, liveness bound BOUND_S). Each asserts what the user is
told (a refusal naming the value and what is allowed), that nothing was created or kept beyond
the bound, and that the refusal is counted by reason (``api.refused_by_reason`` in
``laminarctl status -o json``). Figures (seconds of stall before and after) are
bench/diag/loop_stall.py's.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import loopattacks as la
import pytest
from agentproc import AgentProc, api_json, wait_until
from liveness import RootLiveness, admin_path
from userrig import User, local_user

pytestmark = [pytest.mark.kernel, pytest.mark.serial]

BOUND_S = 2.0  # root's status and kill-switch answer within this during every attack (liveness)
METRICS_PORT = 19479
SLEEP = ["/bin/sleep", "600"]


@contextlib.contextmanager
def running(tmp: Path, veth: Any, agent_toml: str = "", extra_toml: str = "", metrics: bool = False) -> Iterator[AgentProc]:
    a = AgentProc(tmp, veth.ifname_a, veth.a, agent_toml=agent_toml, extra_toml=extra_toml)
    if metrics:
        a.config_path.write_text(a.config_path.read_text().replace('listen = ""', f'listen = "127.0.0.1:{METRICS_PORT}"'))
    try:
        a.start()
        yield a
    finally:
        a.cleanup()


@contextlib.contextmanager
def watched(a: AgentProc, job: str) -> Iterator[RootLiveness]:
    """RootLiveness beside the block, for at least half a second more than it (an attack refused
    at once is over before root has asked three times)."""
    with RootLiveness(a.sock, job) as live:
        yield live
        time.sleep(0.5)


def root_job(a: AgentProc) -> str:
    code, job = api_json(a.sock, "POST", "/v1/jobs", json.dumps({"command": SLEEP, "name": "lm-t-root"}))
    assert code == 201, job
    wait_until(lambda: a.json("job", "show", job["id"])["state"] == "running", 30, "root's job running", a.log)
    return str(job["id"])


def refused(a: AgentProc) -> dict[str, int]:
    """``api.refused_by_reason`` of the agent's status ({} from an agent that has none)."""
    return dict(a.json("status").get("api", {}).get("refused_by_reason", {}))


def jobs_of(a: AgentProc, uid: int, live_only: bool = True) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    before = None
    while True:
        q = f"/v1/jobs?all={0 if live_only else 1}&limit=1000" + (f"&before={before}" if before else "")
        page = api_json(a.sock, "GET", q)[1]
        if not page:
            return [j for j in out if j["owner_uid"] == uid]
        out += page
        before = min(j["num"] for j in page)


def run_as(user: User, fn: Any, *args: Any, netns: str | None = None, timeout: float = 300) -> dict[str, Any]:
    return la.run_as(user, netns, fn, *args, timeout=timeout)


# -- 1. parsers: linear, bounded --------------------------------------------------------------------

def test_user_strings_are_read_in_linear_time_and_numbers_are_bounded(veth_pair: Any, tmp_path: Path) -> None:
    """C1, C3, M3. The memory size regex backtracked over spaces (16 KB: 4.8 s of loop; the
    1 MiB body cap: hours); a 400-digit memory, "²" GPUs, a placement's 1e400 MiB, [] as a GPU
    model answered 500; an elastic_max of 10**12 was accepted (on a GPU node, a tuple of that many
    options built on the loop every second). Each is now a 400 at once, naming the value (cut)
    and what is allowed."""
    with running(tmp_path, veth_pair) as a, local_user("loop-parse") as user:
        job = root_job(a)
        before = refused(a)
        with watched(a, job) as live:
            spaces = run_as(user, la.memory_regex, str(a.sock), 40_000)
            hostile = run_as(user, la.huge_numbers, str(a.sock))
            elastic = run_as(user, la.submit, str(a.sock), {"command": SLEEP, "elastic_min": 1, "elastic_max": 10 ** 12})
        live.check(BOUND_S)
        assert spaces["codes"] == {"400": 1}, spaces
        assert "at most 32 characters" in spaces["errors"][0] and "40002 characters" in spaces["errors"][0]
        assert hostile["codes"] == {"400": 14}, hostile  # none 500, none accepted
        assert all(len(e) < 400 for e in hostile["errors"]), hostile["errors"]
        assert any("must be between 1 MiB" in e for e in hostile["errors"]) or any(
            "at most 32 characters" in e for e in hostile["errors"])
        assert elastic["codes"] == {"400": 1} and "max <= 1024" in elastic["errors"][0], elastic
        assert jobs_of(a, user.uid) == [], "a refused submission left a job"
        after = refused(a)
        assert after.get("job_invalid", 0) - before.get("job_invalid", 0) >= 10, after
        assert after.get("placement_invalid", 0) - before.get("placement_invalid", 0) >= 5, after
        assert a.json("status")["api"]["internal_errors"] == 0


# -- 2. what a job spec may hold -------------------------------------------------------------------

def test_a_job_spec_is_capped_whole_and_per_item(veth_pair: Any, tmp_path: Path) -> None:
    """H3. Nothing but the 1 MiB body bounded a spec: 256 live jobs of one user with 1 MiB envs
    held 2.2 GB of the agent, and every GET /v1/jobs encoded them all. Now command, env, cwd and
    resume_from together are at most 64 KiB (jobs.SPEC_BYTES_MAX), with caps per item; the
    refusal names the size and the cap, on every path that builds a spec (a placement too)."""
    from laminar.runtime import spec as J

    def spec(extra: int) -> dict[str, Any]:
        # command 11 + 4 bytes, two env entries of 30,003 and one filling up to the cap (+ extra)
        env = {"A": "a" * 30_000, "B": "b" * 30_000}
        env["C"] = "c" * (J.SPEC_BYTES_MAX - 15 - 2 * 30_003 - 3 + extra)
        return {"command": SLEEP, "env": env}

    with running(tmp_path, veth_pair) as a, local_user("loop-spec") as user:
        job = root_job(a)
        before = refused(a)
        with watched(a, job) as live:
            over = run_as(user, la.submit, str(a.sock), spec(1))
            items = [run_as(user, la.submit, str(a.sock), s) for s in (
                {"command": ["/bin/true"] * (J.ARGV_ITEMS_MAX + 1)},
                {"command": ["/bin/true", "x" * (J.ARG_BYTES_MAX + 1)]},
                {"command": ["/bin/true"], "env": {f"E{i}": "" for i in range(J.ENV_NAMES_MAX + 1)}},
                {"command": ["/bin/true"], "env": {"V": "v" * (J.ENV_VALUE_BYTES_MAX + 1)}},
                {"command": ["/bin/true"], "cwd": "/" + "d" * J.PATH_BYTES_MAX},
                {"command": ["/bin/true"], "resume_from": "/" + "r" * J.PATH_BYTES_MAX},
            )]
            placed = run_as(user, la.submit_placement, str(a.sock), {"spec": spec(1)})
            exact = run_as(user, la.submit, str(a.sock), spec(0))
        live.check(BOUND_S)
        assert over["codes"] == {"400": 1} and over["errors"][0].startswith(
            f"job spec: {J.SPEC_BYTES_MAX + 1} bytes, at most {J.SPEC_BYTES_MAX}"), over
        wants = [f"{J.ARGV_ITEMS_MAX + 1} arguments, at most {J.ARGV_ITEMS_MAX}",
                 f"argument 1 is {J.ARG_BYTES_MAX + 1} bytes, at most {J.ARG_BYTES_MAX}",
                 f"{J.ENV_NAMES_MAX + 1} names, at most {J.ENV_NAMES_MAX}",
                 f"value of {J.ENV_VALUE_BYTES_MAX + 1} bytes, at most {J.ENV_VALUE_BYTES_MAX}",
                 f"cwd: {J.PATH_BYTES_MAX + 1} bytes, at most {J.PATH_BYTES_MAX}",
                 f"resume_from: {J.PATH_BYTES_MAX + 1} bytes, at most {J.PATH_BYTES_MAX}"]
        for got, want in zip(items, wants, strict=True):
            assert got["codes"] == {"400": 1} and want in got["errors"][0], (want, got)
        assert placed["codes"] == {"400": 1} and f"{J.SPEC_BYTES_MAX + 1} bytes" in placed["errors"][0], placed
        assert exact["codes"] == {"201": 1}, exact  # at the cap: taken
        assert len(jobs_of(a, user.uid)) == 1
        assert refused(a).get("spec_too_large", 0) - before.get("spec_too_large", 0) == 8


# -- 3. policy text -------------------------------------------------------------------------------

def test_policy_text_is_capped_and_parsed_off_the_loop_with_a_time_bound(veth_pair: Any, tmp_path: Path) -> None:
    """C2, M3. POST /v1/policy/validate is any user's. Its TOML was parsed on the loop: dotted
    keys are quadratic (32 KB: 3.7 s of stall; 1 MiB: an hour) and nested arrays a
    RecursionError (500). Now text is at most 64 KiB (413), parsed in a child killed after 2 s
    (422 saying so), one at a time per user (429); the policy in force never changes."""
    with running(tmp_path, veth_pair) as a, local_user("loop-policy") as user:
        job = root_job(a)
        version = a.json("policy", "show")["version"]
        before = refused(a)
        with watched(a, job) as live:
            dotted = run_as(user, la.policy_dotted, str(a.sock), 60_000)
            big = run_as(user, la.policy_nested, str(a.sock), 100_000)
            nested = run_as(user, la.policy_nested, str(a.sock), 20_000)
            parallel = run_as(user, la.policy_parallel, str(a.sock), 6, 60_000)
            # root's own document: nested deeper than validate's copy recursed (a 500 before)
            deep: Any = 1
            for _ in range(900):
                deep = {"x": deep}
            root_put = api_json(admin_path(a.sock), "PUT", "/v1/policy", json.dumps({"rungs": deep}))
        live.check(BOUND_S)
        assert dotted["codes"] == {"422": 1} and "took longer than 2 s to parse" in dotted["errors"][0], dotted
        assert big["codes"] == {"413": 1} and "at most 65536" in big["errors"][0], big
        assert nested["codes"] == {"422": 1} and "nested too deeply" in nested["errors"][0], nested
        assert parallel["codes"] == {"422": 1, "429": 5}, parallel
        assert any("at most 1 per user" in e for e in parallel["errors"]), parallel
        assert root_put[0] == 422 and ("nested too deeply" in root_put[1]["error"] or "unknown" in root_put[1]["error"])
        assert a.json("policy", "show")["version"] == version
        ok = api_json(a.sock, "POST", "/v1/policy/validate", json.dumps({"text": "[thresholds]\n\"memory.some\" = 0.2\n"}))
        assert ok[0] == 201 and ok[1]["valid"], ok
        after = refused(a)
        for reason, n in (("policy_parse_timeout", 2), ("policy_too_large", 1), ("uid_policy_parses", 5)):
            assert after.get(reason, 0) - before.get(reason, 0) >= n, (reason, after)


# -- 4. metrics endpoint --------------------------------------------------------------------------

def test_idle_metrics_connections_of_a_user_are_bounded(veth_pair: Any, tmp_path: Path) -> None:
    """C4. The exporter ran a thread per connection with no timeout and no cap: 500 idle
    connections of one user were 500 threads and descriptors of the agent. Now the agent's own
    loop serves it: CONNS_PER_UID per user (who owns the socket: inet_diag), closed at once past
    it and after request_timeout_s idle; root still scrapes and the API answers."""
    from laminar import metrics

    with running(tmp_path, veth_pair, agent_toml="request_timeout_s = 2.0", metrics=True) as a, \
            local_user("loop-metrics") as user:
        job = root_job(a)
        pid = la.laminard_pid(a)
        threads0, fds0 = la.agent_threads(pid), la.agent_fds(pid)
        before = refused(a)
        with watched(a, job) as live:
            run = la.start_as(user, veth_pair.a.path, la.idle_connections, ("127.0.0.1", METRICS_PORT), 300, 4.0)
            time.sleep(1.5)  # all connected and held
            threads, fds = la.agent_threads(pid), la.agent_fds(pid)
            scrape = veth_pair.a.run(sys.executable, "-c", "import urllib.request; print(urllib.request.urlopen("
                                     f"'http://127.0.0.1:{METRICS_PORT}/metrics', timeout=10).read().decode())")
            out = run.result(60)
        live.check(BOUND_S)
        assert out["connected"] >= 250, out
        assert threads <= threads0 + 2, f"the agent's threads went from {threads0} to {threads} under {out}"
        assert fds <= fds0 + metrics.CONNS_PER_UID + 16, f"the agent's descriptors went from {fds0} to {fds}"
        assert out["closed_by_agent"] == out["connected"], out  # past the cap at once, the rest after 2 s idle
        assert 'laminar_events_total{kind="agent"}' in scrape.stdout
        after = refused(a)
        assert after.get("metrics_uid_connections", 0) - before.get("metrics_uid_connections", 0) >= 250, after
        assert after.get("metrics_request_timeout", 0) - before.get("metrics_request_timeout", 0) >= 1, after


# -- 5. job list: paged, bounded ------------------------------------------------------------------

def test_the_job_list_is_paged_and_a_user_cannot_make_it_costly(veth_pair: Any, tmp_path: Path) -> None:
    """H2, H3. GET /v1/jobs decoded, deep-copied and encoded every live job and up to 100,000
    ended ones on the loop for every request: with 16 jobs of one user holding 1 MiB envs, 8
    requests stalled the loop 29 s. Now such a spec is refused, and a page holds at most 1000
    jobs and 1 MiB of specs; following the pages lists every job exactly once."""
    from laminar.runtime import jobtable as J

    with running(tmp_path, veth_pair) as a, local_user("loop-list") as user:
        job = root_job(a)
        huge = run_as(user, la.big_env_jobs, str(a.sock), 1, 1000 << 10)
        assert huge["codes"] == {"400": 1}, huge
        many = run_as(user, la.big_env_jobs, str(a.sock), 48, 60 << 10)
        assert many["codes"] == {"201": 48}, many
        with watched(a, job) as live:
            got = run_as(user, la.get_many, str(a.sock), "/v1/jobs?limit=1000", 8)
        live.check(BOUND_S)
        assert got["codes"] == {"200": 8}, got
        seen: list[str] = []
        before = None
        while True:
            status, raw = la.raw_request(a.sock, "GET", "/v1/jobs?limit=1000" + (f"&before={before}" if before else ""))
            assert status == 200 and len(raw) <= 2 * J.LIST_PAGE_BYTES, (status, len(raw))
            page = json.loads(raw)
            if not page:
                break
            seen += [j["id"] for j in page]
            before = min(j["num"] for j in page)
        assert len(seen) == len(set(seen)) == 49 and job in seen
        assert len(set(seen)) > 0 and all(j["state"] == "running" for j in jobs_of(a, user.uid))
        r = a.ctl("-o", "json", "jobs", "--active")
        assert len(json.loads(r.stdout)) == 49


# -- 6. events: pages and followers ---------------------------------------------------------------

def test_event_pages_are_bounded_and_a_follower_that_does_not_read_is_dropped(veth_pair: Any, tmp_path: Path) -> None:
    """M2. GET /v1/events?limit=10000 decoded 10,000 rows on the loop (32 at once: 3.8 s of
    stall), and an event stream whose reader stopped held up to 10,000 events and its connection
    for good. Now a page is at most 1000 events, decoded in chunks; a stream that takes no line
    within request_timeout_s is closed."""
    with running(tmp_path, veth_pair, agent_toml="request_timeout_s = 2.0") as a, local_user("loop-events") as user:
        job = root_job(a)
        db = sqlite3.connect(str(a.state_dir / "laminar.db"), timeout=30)
        with db:
            db.executemany("INSERT INTO events(ts, kind, message, fields) VALUES(?, 'job', ?, ?)",
                           [(time.time(), f"job job-{i} exited", json.dumps({"job": f"job-{i}"})) for i in range(5000)])
        db.close()
        pid = la.laminard_pid(a)
        fds0 = la.agent_fds(pid)
        big = run_as(user, la.get_many, str(a.sock), "/v1/events?limit=10000", 1)
        assert big["codes"] == {"400": 1} and "1..1000" in big["errors"][0], big
        with watched(a, job) as live:
            pages = run_as(user, la.get_many, str(a.sock), "/v1/events?limit=1000", 32)
            followers = la.start_as(user, None, la.follow_no_read, str(a.sock), 8, 8.0)
            time.sleep(0.5)
            for i in range(1500):  # events for the streams: root flips a kill-switch
                api_json(admin_path(a.sock), "POST", "/v1/killswitch",
                         json.dumps({"action": "on" if i % 2 == 0 else "off", "scope": "job", "job": job}))
            ends = followers.result(120)
        live.check(BOUND_S)
        assert pages["codes"] == {"200": 32}, pages
        assert sum(n for k, n in ends["ends"].items() if k.startswith("closed=True")) == 8, ends
        wait_until(lambda: la.agent_fds(pid) <= fds0 + 4, 20, "the streams' descriptors closed")


# -- 7. status under a flood ----------------------------------------------------------------------

def test_root_status_stays_cheap_while_users_ask_in_a_loop(veth_pair: Any, tmp_path: Path) -> None:
    """L1. GET /v1/status counts BPF map entries key by key (about 10,000 syscalls), dumps tc
    filters and reads PSI: any user may ask in a loop. Now a user gets a copy at most 1 s old,
    encoded once, and the map counts are taken at most every second; root's stays fresh."""
    with running(tmp_path, veth_pair) as a, local_user("loop-status") as user:
        job = root_job(a)
        with watched(a, job) as live:
            out = run_as(user, la.hammer, str(a.sock), "/v1/status", 32, 4.0)
        live.check(BOUND_S)
        assert out["codes"].get("200", 0) > 100, out
        s = a.json("status")
        assert s["api"]["requests"] > 100 and "refused_by_reason" in s["api"]


# -- 8. stored history and events per user ---------------------------------------------------------

def test_one_user_cannot_push_out_others_history_nor_flush_the_event_log(veth_pair: Any, tmp_path: Path) -> None:
    """H7. Ended jobs' records were kept per node (keep_ended), events 50,000 for all: one user
    submitting in a loop pushed every other user's history and the audit trail out. Now a
    user keeps at most keep_ended_per_user ended records, pruned first, with their logs and
    checkpoint directories; events their jobs cause have a budget (user_events_burst), past
    which they are not stored and one event says so."""
    toml = "[jobs]\nkeep_ended = 40\nkeep_ended_per_user = 10\n"
    with running(tmp_path, veth_pair, agent_toml="user_events_burst = 30\nuser_events_per_s = 0.001",
                 extra_toml=toml) as a, local_user("loop-hist-a") as ua, local_user("loop-hist-b") as ub:
        job = root_job(a)
        mine = [api_json(a.sock, "POST", "/v1/jobs", json.dumps({"command": ["/bin/true"]}))[1]["id"] for _ in range(5)]
        theirs = [run_as(ub, la.submit, str(a.sock), {"command": ["/bin/true"]}) for _ in range(3)]
        assert all(t["codes"] == {"201": 1} for t in theirs)

        def ended() -> dict[int, int]:
            db = sqlite3.connect(str(a.state_dir / "laminar.db"), timeout=30)
            try:
                return dict(db.execute("SELECT owner_uid, COUNT(*) FROM jobs WHERE ended IS NOT NULL "
                                       "GROUP BY owner_uid").fetchall())
            finally:
                db.close()

        wait_until(lambda: ended().get(0, 0) == 5 and ended().get(ub.uid, 0) == 3, 30, "the first jobs ended")
        with watched(a, job) as live:
            flood = run_as(ua, la.submit_many, str(a.sock), {"command": ["/bin/true"]}, 60)
        live.check(BOUND_S)
        assert flood["codes"] == {"201": 60}, flood
        wait_until(lambda: not jobs_of(a, ua.uid), 60, "the user's jobs ended")
        wait_until(lambda: ended().get(ua.uid, 0) <= 10, 30, "the user's records pruned to 10", lambda: str(ended()))
        counts = ended()
        assert counts.get(0) == 5 and counts.get(ub.uid) == 3, counts  # nobody else's history went
        for i in mine:
            assert a.json("job", "show", i)["state"] == "exited"
        kept = {r["id"] for r in jobs_of(a, ua.uid, live_only=False)}
        pruned = set(flood["ids"]) - kept
        assert len(pruned) >= 50, (len(pruned), kept)

        def files_left() -> set[str]:
            return {i for i in pruned if (a.state_dir / "logs" / f"{i}.log").exists() or (a.state_dir / "ckpt" / i).exists()}

        wait_until(lambda: not files_left(), 30, "the pruned jobs' logs and checkpoint directories removed",
                   lambda: str(sorted(files_left())))
        assert all((a.state_dir / "logs" / f"{i}.log").exists() for i in mine)  # root's stay
        events = api_json(a.sock, "GET", "/v1/events?limit=1000&kind=agent")[1]
        assert any(e.get("uid") == ua.uid and "spent its budget" in e["message"] for e in events), events[-5:]
        db = sqlite3.connect(str(a.state_dir / "laminar.db"), timeout=30)
        try:
            stored = db.execute("SELECT COUNT(*) FROM events WHERE kind='job' AND fields LIKE '%\"state\"%' AND "
                                "message LIKE 'job job-% started%'").fetchone()[0]
        finally:
            db.close()
        assert stored <= 5 + 3 + 1 + 30, stored  # root's, B's, root's sleeper, and A's budget
        assert a.json("status")["api"]["events_not_stored"] > 0


def test_placement_records_are_pruned(veth_pair: Any, tmp_path: Path) -> None:
    """H7. A record per POST /v1/placements (any user's) went to zone_submitted and was never
    deleted. Now the newest SUBMITTED_KEEP, none older than SUBMITTED_KEEP_S, are kept."""
    from laminar.zone.component import SUBMITTED_KEEP, SUBMITTED_KEEP_S

    with running(tmp_path, veth_pair) as a, local_user("loop-placed") as user:
        now = time.time()
        db = sqlite3.connect(str(a.state_dir / "laminar.db"), timeout=30)
        with db:
            db.executemany("INSERT INTO zone_submitted VALUES (?, 'x', 'failed', 1, 0, NULL, '', '{}', ?)",
                           [(10_000_000 + i, now - SUBMITTED_KEEP_S - 10 if i < 100 else now - 1000 + i * 0.01)
                            for i in range(SUBMITTED_KEEP + 150)])
        db.close()
        out = run_as(user, la.submit_placement, str(a.sock), {"spec": {"command": SLEEP}})
        assert out["codes"] == {"201": 1}, out
        db = sqlite3.connect(str(a.state_dir / "laminar.db"), timeout=30)
        try:
            n, oldest = db.execute("SELECT COUNT(*), MIN(created) FROM zone_submitted").fetchone()
        finally:
            db.close()
        assert n == SUBMITTED_KEEP and oldest > now - SUBMITTED_KEEP_S, (n, oldest)


# -- 9. work a user's requests hold: probes, worker threads -----------------------------------------

def test_path_probes_of_one_user_on_their_hung_mount_are_bounded(veth_pair: Any, tmp_path: Path) -> None:
    """H6.4. A submission's cwd is probed as its owner in a child killed after 10 s; on the
    user's own hung mount each submission left a child (and, on Python 3.11, a thread waiting for
    it) for as long as the mount hung, one more per submission. Now a user has at most
    PROBES_PER_UID probes not yet reaped: the next submission is refused at once (429)."""
    from fuserig import eio_mount

    from laminar.runtime import launch as J

    backing = tmp_path / "backing"
    (backing / "work").mkdir(parents=True)
    with eio_mount(backing) as fs, running(tmp_path, veth_pair) as a, local_user("loop-probe") as user:
        job = root_job(a)
        pid = la.laminard_pid(a)
        threads0 = la.agent_threads(pid)
        fs.hang()
        try:
            with watched(a, job) as live:
                out = run_as(user, la.submit_parallel, str(a.sock),
                             {"command": ["/bin/true"], "cwd": str(fs.path / "work")}, 12)
                threads = la.agent_threads(pid)
            live.check(BOUND_S)
        finally:
            fs.heal()
        assert out["codes"].get("429", 0) == 12 - J.PROBES_PER_UID, out
        assert any("path probes" in e and "at most 4 per user" in e for e in out["errors"]), out
        assert out["codes"].get("400", 0) == J.PROBES_PER_UID, out  # the storage did not answer in time
        assert threads <= threads0 + 2, (threads0, threads)
        assert jobs_of(a, user.uid) == []


def test_worker_threads_a_user_holds_are_bounded(veth_pair: Any, tmp_path: Path) -> None:
    """H6. A placement's resume_from is verified in a worker thread (hashing every file, as the
    owner); on the user's own hung storage each held a thread of the default pool for as long,
    and the agent's own thread work (job teardown, checks) queued behind them. Now a user's
    requests hold at most WORK_PER_UID worker threads: their next thread work (a placement's
    check, GET /v1/migrate/replicas) is refused at once, and root's goes on."""
    from fuserig import eio_mount

    from laminar.api import WORK_PER_UID
    from laminar.jobkit import Checkpointer

    backing = tmp_path / "backing"
    Checkpointer(job_id="lm-t-loop", ckpt_dir=backing / "ckpts", install_signal=False).save(b"w" * 4096, step=5)
    with eio_mount(backing) as fs, running(tmp_path, veth_pair) as a, local_user("loop-threads") as user:
        job = root_job(a)
        path = fs.path / "ckpts" / "ckpt-5"
        fs.hang()
        placing = []
        try:
            with watched(a, job) as live:
                for _ in range(WORK_PER_UID + 2):
                    placing.append(la.start_as(user, None, la.submit_placement, str(a.sock),
                                               {"spec": {"command": SLEEP, "resume_from": str(path)}, "cpus": 0.1}))
                time.sleep(3)
                theirs = run_as(user, la.get_many, str(a.sock), "/v1/migrate/replicas", 1)
                roots = api_json(a.sock, "GET", "/v1/migrate/replicas")
                status = a.json("status")["api"]
            live.check(BOUND_S)
        finally:
            fs.heal()
        results = [p.result(120) for p in placing]
        assert theirs["codes"] == {"429": 1} and "worker thread" in theirs["errors"][0], theirs
        assert roots[0] == 200
        assert status["threads_in_flight"] == WORK_PER_UID, status
        refusedp = [r for r in results if "busy: uid" in json.dumps(r)]
        assert len(refusedp) == 2, json.dumps(results)
        assert status["refused_by_reason"].get("uid_threads", 0) >= 3, status


def test_a_submission_commits_once_whatever_the_queue(veth_pair: Any, tmp_path: Path) -> None:
    """H8. Each queued job's wait reason names its position and the class's free MiB; admit()
    stored every changed one in a transaction of its own (an fsync each): a user with 40 queued
    jobs submitting with rising priority made every submission rewrite the rest, 40 fsyncs on
    the loop. Now one transaction per admission pass: the fsyncs per submission do not grow
    with the queue."""
    with running(tmp_path, veth_pair) as a, local_user("loop-admit") as user:
        code, out = api_json(admin_path(a.sock), "PUT", "/v1/policy", json.dumps({"class_caps_mb": {"transient": 100}}))
        assert code == 200, out
        first = run_as(user, la.submit, str(a.sock), {"command": SLEEP, "class": "transient", "memory": "64M"})
        assert first["codes"] == {"201": 1}, first
        pid = la.laminard_pid(a)

        def fsyncs_of_one(priority: int) -> int:
            log = tmp_path / f"strace-{priority}.txt"
            tracer = subprocess.Popen(["strace", "-f", "-qq", "-p", str(pid), "-e", "trace=fsync,fdatasync",
                                       "-o", str(log)], stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached
            try:
                r = run_as(user, la.submit, str(a.sock), {"command": SLEEP, "class": "transient", "memory": "64M",
                                                          "priority": priority})
                assert r["codes"] == {"201": 1}, r
                time.sleep(0.3)
            finally:
                tracer.terminate()
                tracer.wait(10)
            with log.open() as f:
                return sum(1 for line in f if "fsync" in line or "fdatasync" in line)

        small = fsyncs_of_one(1)
        for p in range(2, 42):
            assert run_as(user, la.submit, str(a.sock), {"command": SLEEP, "class": "transient", "memory": "64M",
                                                         "priority": p})["codes"] == {"201": 1}
        large = fsyncs_of_one(45)
        assert len([j for j in jobs_of(a, user.uid) if j["state"] == "queued"]) == 42
        assert large <= small + 3, f"one submission with 1 queued job: {small} fsyncs; with 41: {large}"


# -- 10. all at once --------------------------------------------------------------------------------

def test_every_attack_at_once_and_root_stays_live(veth_pair: Any, tmp_path: Path) -> None:
    """Every attack above by one user at the same time; root's status and kill-switch answer
    within the liveness bound throughout, and the agent's threads stay bounded."""
    with running(tmp_path, veth_pair, agent_toml="request_timeout_s = 3.0", metrics=True) as a, \
            local_user("loop-all") as user:
        job = root_job(a)
        pid = la.laminard_pid(a)
        threads0 = la.agent_threads(pid)
        peak = [threads0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    peak.append(la.agent_threads(pid))
                stop.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        sock = str(a.sock)
        with watched(a, job) as live:
            runs = [la.start_as(user, None, la.memory_regex, sock, 200_000),
                    la.start_as(user, None, la.huge_numbers, sock),
                    la.start_as(user, None, la.policy_parallel, sock, 4, 60_000),
                    la.start_as(user, None, la.policy_nested, sock, 20_000),
                    la.start_as(user, None, la.get_many, sock, "/v1/events?limit=1000", 8, 4),
                    la.start_as(user, None, la.hammer, sock, "/v1/status", 8, 5.0),
                    la.start_as(user, None, la.big_env_jobs, sock, 16, 60 << 10),
                    la.start_as(user, None, la.get_many, sock, "/v1/jobs?limit=1000", 4, 4),
                    la.start_as(user, veth_pair.a.path, la.idle_connections, ("127.0.0.1", METRICS_PORT), 200, 4.0),
                    la.start_as(user, None, la.follow_no_read, sock, 4, 5.0)]
            results = [r.result(300) for r in runs]
        stop.set()
        sampler.join()
        live.check(BOUND_S)
        assert "500" not in json.dumps([r.get("codes", {}) for r in results])
        assert max(peak) <= threads0 + 8, (threads0, max(peak))
        assert a.json("status")["api"]["internal_errors"] == 0
        print(json.dumps({"root_worst_s": live.worst(), "threads": (threads0, max(peak)),
                          "refused": refused(a)}))



def test_privileged_routes_answer_hostile_numbers_with_400_not_500(veth_pair: Any, tmp_path: Path) -> None:
    """M3 for the routes only root and the control group reach: a 10**400 load, notice or count,
    a 1 MiB pool or reason, a flow of 100,000 characters are refused naming the field (400/4xx),
    never a 500 (float(10**400) raised OverflowError), and nothing changes (no reclaim starts)."""
    with running(tmp_path, veth_pair, extra_toml="[shaping]\nlink_mbit = 1000\n") as a:
        job = root_job(a)
        adm = admin_path(a.sock)
        bodies = [
            ("/v1/pool/load", {"load": 10 ** 400}), ("/v1/pool/load", {"load": "0.5"}),
            ("/v1/pool/return", {"pool": "p" * 100_000, "count": 1}), ("/v1/pool/return", {"pool": "x", "count": 10 ** 400}),
            ("/v1/reclaim", {"notice_s": 10 ** 400}), ("/v1/reclaim", {"notice_s": "9" * 400}),
            ("/v1/reclaim", {"notice_s": "1" * 100_000 + "s"}), ("/v1/reclaim", {"notice_s": 60, "node": 10 ** 400}),
            ("/v1/reclaim", {"notice_s": 60, "reason": "r" * 100_000, "node": 10 ** 30}),
            ("/v1/reclaim/cancel", {"node": 10 ** 400}),
            ("/v1/killswitch", {"action": "arm", "scope": "job", "job": job, "at_s": 10 ** 400}),
            ("/v1/killswitch", {"action": "arm", "scope": "all", "at_s": "²"}),
            ("/v1/killswitch/flow", {"flow": "x" * 100_000, "action": "on"}),
            ("/v1/killswitch/flow", {"flow": "tcp:10.0.0.1:1->10.0.0.2:2", "action": "arm", "at_s": 10 ** 400}),
            ("/v1/net/transfers", {"job": job, "flow": "tcp:10.0.0.1:1->10.0.0.2:2", "total_bytes": 10 ** 400,
                                   "deadline_s": 60}),
            ("/v1/net/transfers", {"job": job, "flow": "tcp:10.0.0.1:1->10.0.0.2:2", "total_bytes": 1000,
                                   "deadline_s": 10 ** 400}),
            ("/v1/net/transfers", {"job": "j" * 100_000, "flow": "f" * 100_000, "total_bytes": 1, "deadline_s": 1}),
        ]
        for path, body in bodies:
            code, raw = la.raw_request(adm, "POST", path, json.dumps(body))
            assert 400 <= code < 500 and len(raw) < 2000, (path, code, raw[:300])
        assert a.json("status")["api"]["internal_errors"] == 0
        assert api_json(adm, "GET", "/v1/reclaim")[1]["reclaim"] is None, "a hostile body started a reclaim"
