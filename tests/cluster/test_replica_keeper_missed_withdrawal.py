"""A keeper whose agent was down when its source's reclaim was withdrawn does not resume the job a
second time at the old window's end; a keeper whose agent restarted during a real reclaim still
resumes the job once the source is gone.

Before, a keeper that missed the source's ``reclaim-withdrawn`` (its agent stopped when the owner
cancelled the reclaim, back after the old window's end) kept the window's end its keeper message
carried and took the job over at that end: a second copy ran on the keeper while the job ran on
at its source. Now a keeper that may have missed news (its agent started after the keeper's last
message, or it heard nothing from the source for ``dead_after_s`` before the window's end) asks
the source first (control op ``needs``): a job that lives there, on a node without a reclaim,
keeps the keeper keeping and the old window is forgotten; no answer goes on with the take-over.

Two real agents in one zone (tests/cluster/harness.py), no GPUs (the job needs none, so the
keeper B has room to resume it). The job on A is a real process that writes a jobkit checkpoint
at start and one more whenever it is asked (SIGUSR1); the one it writes inside the window is
prestaged to B with the window's end. B's agent is stopped (SIGTERM; the agent, not the node)
before the cancel, so the cancel does not reach it, and started after the window's end.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from typing import Any

import pytest
from agentproc import VENV_BIN
from harness import Node, wait_until
from test_migration import find_migrated, job_state, make_cluster, migrate_config, verified_steps  # noqa: F401
from test_replica_keeper_change import replica
from test_replica_resume_owner import JOB as CKPT_ON_ASK

pytestmark = pytest.mark.cluster

CANCELLED_S = 12  # a checkpoint prestaged with the window's end, B's agent stopped, the cancel: inside it
REAL_S = 8  # the real reclaim's window: a checkpoint prestaged with its end, B's agent stopped


def _events(nd: Node, phase: str) -> list[dict[str, Any]]:
    return [e for e in nd.json("events", "--kind", "migrate", "--limit", "500") if e.get("phase") == phase]


def _stored_window_end(nd: Node, key: str) -> float | None:
    """The window's end B's keeper of ``key`` carries, read from its store (its agent stopped)."""
    db = sqlite3.connect(str(nd.agent.state_dir / "laminar.db"))
    try:
        row = db.execute("SELECT request FROM migrate_replicas WHERE key=?", (key,)).fetchone()
    finally:
        db.close()
    return None if row is None else json.loads(row[0]).get("window_end")


def _kept_with_window(a: Node, b: Node, jid: str, key: str, step: int) -> float:
    """Reclaim of A announced: the job writes checkpoint ``step``, which reaches B with the keeper
    (and the window's end); B's agent is then stopped. Returns the window's end B stored."""
    os.kill(int(job_state(a, jid)["pid"]), signal.SIGUSR1)
    # the keeper message names the checkpoint it keeps and comes after the checkpoint itself: a
    # verified ckpt-<step> alone may still be kept by the message of the step before
    wait_until(lambda: (r := replica(b, key)) is not None and r["state"] == "keeping" and step in verified_steps(b, key)
               and str(r["ckpt"] or "").endswith(f"ckpt-{step}"), 30, f"B to hold and keeper checkpoint {step}")
    b.agent.stop()
    end = _stored_window_end(b, key)
    assert end is not None, "the keeper sent inside the window must carry the window's end"
    return float(end)


def test_a_keeper_that_missed_the_withdrawal_does_not_run_a_second_copy(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=2, gpus=0, zone_extra=migrate_config(dead_after_s=2))
    a, b = c.nodes
    jid = json.loads(a.ctl("-o", "json", "submit", "--name", "lm-t-missed", "--", str(VENV_BIN / "python"), "-c",
                           CKPT_ON_ASK).stdout)["id"]
    key = f"n{a.node_id}-{jid}"
    wait_until(lambda: (r := replica(b, key)) is not None and r["state"] == "keeping" and 7 in verified_steps(b, key),
               60, "B to hold and keeper the job's first checkpoint")

    # the owner withdraws A's reclaim while B's agent is down
    res = a.json("reclaim", "--notice", f"{CANCELLED_S}s", "--reason", "lm-t owner")
    end = _kept_with_window(a, b, jid, key, 8)
    out = a.json("reclaim", "cancel", "--reason", "lm-t plans changed")
    assert out["in_window"] and out["peers_missed"] == [b.node_id], (out, res["reclaim"].get("plan"))
    assert job_state(a, jid)["state"] == "running"
    while time.time() < end + 1.0:
        time.sleep(0.2)

    # B is back after the old window's end: it asks A, which runs the job, and keeps on
    b.agent.start()
    wait_until(lambda: _events(b, "source-alive") or find_migrated(c, key), 30,
               "B to ask A about the job (or to resume it: the bug)")
    assert find_migrated(c, key) is None, "B resumed a second copy of a job that runs on A"
    ev = _events(b, "source-alive")
    assert [(e["key"], e["src_state"], e.get("withdrawn")) for e in ev] == [(key, "running", True)], ev
    time.sleep(2)  # ten keeper rounds (poll_s 0.2): the forgotten window brings no take-over
    assert find_migrated(c, key) is None
    assert job_state(a, jid)["state"] == "running" and replica(b, key)["state"] == "keeping"  # type: ignore[index]

    # a real reclaim: B's agent restarts inside it and comes back after A is gone: B resumes the job
    a.json("reclaim", "--notice", f"{REAL_S}s", "--reason", "lm-t owner, for real")
    end = _kept_with_window(a, b, jid, key, 9)
    wait_until(lambda: job_state(a, jid)["state"] == "reclaimed", REAL_S + 30, "the window's end to stop the job on A")
    a.agent.stop()  # the node is gone: nothing answers for it
    while time.time() < end:
        time.sleep(0.2)
    b.agent.start()
    nd, moved = wait_until(lambda: find_migrated(c, key), 60, "B to resume the job")
    assert nd is b and moved["spec"]["resume_from"].endswith("ckpt-9"), moved
    assert len(_events(b, "source-alive")) == 1, "the gone source must not be taken for alive"
    resumed = _events(b, "resumed")
    assert len(resumed) == 1 and "may have missed its news: no answer" in resumed[0]["message"], resumed
