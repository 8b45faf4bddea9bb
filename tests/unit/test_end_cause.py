"""Why a job ended is data (issue 32): :mod:`laminar.policy.endcause`, the jobs table's
``end_cause`` column, the end paths that set it, and the decision that reads it.

- An older agent's database (the first release's ``jobs`` table, ended jobs in it) upgrades with
  every record kept as it was and a cause for each ended one, derived from its state and the
  agent's own words where they say (``unknown`` where not: a stopper's own reason).
- Every place in the agent that ends a job says why (a source scan: a ``stop`` without a cause,
  or with a cause of another state than the one it sets, fails here).
- The ``needs`` answer's ``stopped_for_good`` (the job's keeper resumes it elsewhere) follows the
  job's end cause: it used to match the words of its reason (a window that ended, a cgroup gone).

Real pieces: a SQLite store; the replicas part's ``answer_needs`` on a stand-in component
(``needs_source``) holding only what it reads; the job manager stand-in (``Jobs``) only answers
``get``. The end paths on a real agent: tests/kernel/test_job_end_cause.py.
"""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path
from typing import Any

import pytest
from standin_agent import standin_agent

import laminar
from laminar.components import MigrateAgent
from laminar.migrate.replicas import Replicas
from laminar.policy import endcause
from laminar.policy.endcause import STATE_OF, EndCause
from laminar.runtime import record
from laminar.store import Store

# The jobs table as the first release made it (before started, limits, provenance, end_cause).
FIRST_RELEASE_JOBS = """CREATE TABLE jobs (
    id TEXT PRIMARY KEY, num INTEGER UNIQUE NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
    pid INTEGER, cgroup_id INTEGER, owner_uid INTEGER NOT NULL, owner_gid INTEGER NOT NULL,
    gpus TEXT NOT NULL, created REAL NOT NULL, ended REAL, exit_code INTEGER, reason TEXT,
    work_lost_s REAL)"""

# (state, reason, exit code, owner, the cause the upgrade gives it): the reasons as the agent wrote them
OLD_ROWS: list[tuple[str, str, int | None, int, str | None]] = [
    ("exited", "exit code 0", 0, 0, "exited_zero"),
    ("exited", "exit code 3", 3, 1000, "exited_nonzero"),
    ("exited", "airlock: recovered (calm for 10s)", -9, 0, "exited_nonzero"),  # its last reason was Airlock's
    ("exited", "exited (adopted: exit code unknown)", None, 0, "exited_code_unknown"),
    ("stopped", "stopped by uid 1000", None, 1000, "stopped_by_user"),
    ("stopped", "stopped by uid 0", None, 1000, "stopped_by_operator"),
    ("stopped", "done with it", None, 1000, "unknown"),  # a stopper's own words: who stopped it is not said
    ("stopped", "node 3 finished n3-job-1 itself (exit 0) while this node, cut off from it, ran it again: a rerun "
                "of a finished job", None, 0, "unknown"),
    ("reclaimed", "airlock reclaimed: pressure critical: suspended job of lowest survival value 0.1 reclaimed to "
                  "free 512 MiB", None, 0, "airlock_kill"),
    ("reclaimed", "node 2 reclaimed: the notice window ended before the job moved", None, 0, "window_ended"),
    ("reclaimed", "node 2 reclaimed: the notice window ended while the agent was down, before the job moved (its "
                  "traffic was cut then)", None, 0, "window_ended"),
    ("reclaimed", "node 2 reclaimed with no room in the zone: ckpt-4 held by node 3, which resumes the job when "
                  "room frees", None, 0, "held_elsewhere"),
    ("reclaimed", "node 2 reclaimed: the job was handed over to node 3 before the agent restarted (node 3 runs it, "
                  "or keeps it and resumes it when this node's window ends)", None, 0, "handed_over"),
    ("reclaimed", "node 2 reclaimed with no room and no keeper in the zone: ckpt-4 archived in /a/n2-job-1; the "
                  "first agent with room resumes it", None, 0, "archived"),
    ("reclaimed", "node 2 reclaimed with no room, no keeper and no keeper in the zone: hung; ckpt-4 is published "
                  "there if it answers before the node goes, and the first agent with room resumes it", None, 0,
     "archived"),
    ("reclaimed", "node 2 reclaimed: ckpt-4 is in the archive, or on its way there; the first agent with room "
                  "resumes it", None, 0, "archived"),
    ("lost", record.LOST_WITH_CGROUP, None, 0, "lost_with_cgroup"),
    ("lost", "ended while the agent was down (exit code unknown)", None, 0, "ended_while_down"),
    ("migrated", "migrated to node 3 as job-7 (from ckpt-4)", None, 0, "migrated"),
    ("migrated", "node 3 runs it as job-9: it took the job over while it heard nothing from node 2 (a partition); "
                 "stopped here so that it runs once", None, 0, "superseded"),
    ("failed", "start failed: command 'nope': No such file or directory", None, 0, "start_failed"),
    ("failed", "agent stopped while the job was starting", None, 0, "start_failed"),
    ("requeued", "node 2 returned to pool p (plan 1): requeued from ckpt-4", None, 0, "requeued"),
    ("running", "", None, 0, None),
    ("queued", "waiting for room in its class", None, 0, None),
]


def old_database(path: Path) -> Store:
    """A store whose jobs table is the first release's, with OLD_ROWS in it (ended ones ended,
    the one being stopped, row 5, not yet)."""
    store = Store(path)
    with store.tx() as db:
        db.execute(FIRST_RELEASE_JOBS)
        for n, (state, reason, code, owner, _) in enumerate(OLD_ROWS, 1):
            ended = None if state in ("running", "queued") or n == 5 else 1000.0 + n
            db.execute("INSERT INTO jobs VALUES (?, ?, ?, ?, NULL, NULL, ?, ?, '[]', ?, ?, ?, ?, NULL)",
                       (f"job-{n}", n, json.dumps({"command": ["x"]}), state, owner, owner, 900.0 + n, ended, code,
                        reason))
    return store


def test_an_older_database_upgrades_with_every_record_kept_and_a_cause_for_each_ended_job(tmp_path: Path) -> None:
    store = old_database(tmp_path / "laminar.db")
    try:
        before = [dict(r) for r in store.db.execute("SELECT * FROM jobs ORDER BY num").fetchall()]
        store.ensure_schema("jobs", record.SCHEMA)  # what the job manager's start runs first
        had = record.upgrade_columns(store)
        assert "end_cause" not in had and "started" not in had
        after = [dict(r) for r in store.db.execute("SELECT * FROM jobs ORDER BY num").fetchall()]
        assert len(after) == len(before) == len(OLD_ROWS)
        for old, new in zip(before, after, strict=True):
            if old["reason"].startswith("airlock reclaimed: "):  # Airlock's kill: its own state now
                assert new["state"] == "killed" and new["end_cause"] == "airlock_kill"
                old = {**old, "state": "killed"}
            assert {k: new[k] for k in old} == old  # nothing else changed
        assert sum(r["state"] == "killed" for r in after) == 1
        assert [r["end_cause"] for r in after] == [want for *_, want in OLD_ROWS]
        # run again (the next start): nothing changes, a cause set since is not derived again
        with store.tx() as db:
            db.execute("UPDATE jobs SET end_cause='stopped_by_operator' WHERE id='job-7'")
        assert record.upgrade_columns(store) >= {"end_cause", "started", "limits"}
        again = [dict(r) for r in store.db.execute("SELECT * FROM jobs ORDER BY num").fetchall()]
        assert again[6]["end_cause"] == "stopped_by_operator" and again[:6] == after[:6]
    finally:
        store.close()


def test_each_cause_belongs_to_one_end_state_and_reads_back() -> None:
    assert set(STATE_OF) == set(EndCause) - {EndCause.UNKNOWN}
    assert set(STATE_OF.values()) <= set(record.STATES) - set(record.LIVE_STATES)
    for c in EndCause:
        assert endcause.parse(str(c)) is c and json.dumps(c) == f'"{c.value}"'
    assert endcause.parse(None) is None and endcause.parse("") is None
    assert endcause.parse("a_newer_agents_word") is EndCause.UNKNOWN
    assert endcause.stopped_by(1000, 1000) is EndCause.STOPPED_BY_USER
    assert endcause.stopped_by(0, 0) is EndCause.STOPPED_BY_USER  # root's own job
    assert endcause.stopped_by(0, 1000) is EndCause.STOPPED_BY_OPERATOR


def _end_calls() -> list[tuple[str, int, dict[str, Any], ast.Call]]:
    """Every call in the agent of ``.stop(job, reason, ...)`` or ``.set_state(job, <end state>, ...)``."""
    out = []
    pkg = Path(laminar.__file__).parent
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and len(node.args) >= 2):
                continue
            kws = {k.arg: k.value for k in node.keywords if k.arg}
            name = node.func.attr
            if name == "stop" or (name == "set_state" and isinstance(node.args[1], ast.Constant)
                                  and node.args[1].value not in record.LIVE_STATES):
                out.append((str(path.relative_to(pkg)), node.lineno, kws, node))
    return out


def test_every_place_that_ends_a_job_says_why_and_its_cause_fits_its_state() -> None:
    calls = _end_calls()
    assert len(calls) >= 20, calls  # (the scan finds them: 20 today)
    for where, line, kws, call in calls:
        if call.func.attr == "set_state":  # type: ignore[attr-defined]
            cause_node = kws.get("cause", call.args[3] if len(call.args) > 3 else None)
            state_node: Any = call.args[1]
        else:
            cause_node, state_node = kws.get("cause"), kws.get("state", ast.Constant("stopped"))
        assert cause_node is not None, f"{where}:{line}: a job's end without its cause"
        if isinstance(cause_node, ast.Attribute) and isinstance(state_node, ast.Constant):
            cause = EndCause[cause_node.attr]
            assert STATE_OF[cause] == state_node.value, f"{where}:{line}: {cause} is a {STATE_OF[cause]} end"


class Jobs:
    """Stand-in job manager: ``get`` only."""

    def __init__(self, job: Any) -> None:
        self.job = job

    def get(self, jid: str) -> Any:
        return self.job if jid == self.job.id else None


def needs_source(job: Any, keeper: int = 1) -> Replicas:
    """Node 2, whose job-1's keeper is held by ``keeper``: its replicas part (``answer_needs``) on a
    stand-in component holding what it reads."""
    prestage = types.SimpleNamespace(keeper={"job-1": keeper}, prestaging=set())  # the component's part (prestage.py)
    src = types.SimpleNamespace(node_id=2, agent=standin_agent(MigrateAgent, jobs=Jobs(job)), prestage=prestage,
                                evacuating=set(), reclaim=None)
    src.takeover = types.SimpleNamespace(runs_here=lambda key: None)  # (the keeper part: this node runs none again)
    return Replicas(src)


@pytest.mark.parametrize(("state", "cause", "reason", "for_good"), [
    # what the keeper resumes: the window ended first, or the cgroup was gone (a reboot), whatever the words
    ("reclaimed", EndCause.WINDOW_ENDED, "node 2 reclaimed: its owner's time was up", True),
    ("lost", EndCause.LOST_WITH_CGROUP, "its cgroup went away", True),
    # what it does not, whatever the words say: Airlock's kill, a job that may have finished by itself
    ("killed", EndCause.AIRLOCK_KILL, "airlock killed: after the notice window ended", False),
    ("lost", EndCause.ENDED_WHILE_DOWN, record.LOST_WITH_CGROUP, False),
    ("reclaimed", EndCause.ARCHIVED, "node 2 reclaimed: ckpt-4 is in the archive", False),
])
def test_stopped_for_good_in_the_needs_answer_is_read_from_the_end_cause_not_the_reason(
        state: str, cause: EndCause, reason: str, for_good: bool) -> None:
    job = types.SimpleNamespace(id="job-1", state=state, reason=reason, end_cause=cause)
    ans = needs_source(job).answer_needs("1", "n2-job-1")
    assert ans["needed"] is True and ans["state"] == state
    assert ans["stopped_for_good"] is for_good, ans
    assert ans["end_cause"] == cause.value  # carried beside the old fields, for the asker's events
    # said only to the node this one knows for the job's keeper
    assert needs_source(job, keeper=3).answer_needs("1", "n2-job-1")["stopped_for_good"] is False
