"""Any local user may list the replicas a node holds (``GET /v1/migrate/replicas``); that must not
decode the agent's whole jobs table on the event loop (issue 31 item 1; audit H1).

Before, the listing asked for "the local jobs resumed from this checkpoint" once per replica key,
each time through ``JobManager.list()``: every stored job's spec decoded, 0.45 s per call at
10,000 small ended records, so 50 keys cost about 22 s of the loop per request of any user (root's
status and kill-switch waited that long). Now the agent asks the store by an indexed column (the
``resume_from`` the agent gave a job, laminar.runtime.provenance): no spec is decoded.

A real laminard; its store holds 9,000 ended jobs (a history the defaults keep) and 50 replica
keys; a real unprivileged user lists the replicas again and again while RootLiveness asks root's
``status`` and flips a kill-switch (liveness bound 2 s; the figure itself belongs to a benchmark).
"""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
from agentproc import AgentProc, wait_until
from liveness import RootLiveness
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel

ENDED = 9000
KEYS = 50


def seed(agent: AgentProc) -> None:
    """Ended jobs' records (numbers past the agent's own) and replica keys on disk, as a long
    history and a busy keeper leave them."""
    env = {f"LMT_VAR_{i}": "x" * 40 for i in range(40)}  # a spec of a few KiB: what decoding costs
    spec = json.dumps({"command": ["/bin/true"], "name": "", "memory_mb": None, "cpus": None, "gpus": 0,
                       "priority": 50, "checkpoint_signal": "SIGUSR1", "env": env, "cwd": None, "lent": False,
                       "elastic_min": None, "elastic_max": None, "resume_from": None, "class": "standard"})
    now = time.time()
    db = sqlite3.connect(agent.state_dir / "laminar.db", timeout=30)
    try:
        with db:
            db.executemany("INSERT INTO jobs(id, num, spec, state, owner_uid, owner_gid, gpus, created, ended, reason) "
                           "VALUES (?, ?, ?, 'exited', 0, 0, '[]', ?, ?, 'exit code 0')",
                           [(f"job-{n}", n, spec, now - 60, now - 30) for n in range(1000, 1000 + ENDED)])
    finally:
        db.close()
    for i in range(KEYS):
        d = agent.state_dir / "xfer" / "checkpoints" / f"n9-job-{i}" / "ckpt-1"
        d.mkdir(parents=True)
        (d / "data").write_bytes(b"x")


def test_listing_replicas_with_a_long_job_history_keeps_the_loop_live(agent: AgentProc) -> None:
    live_job = str(agent.json("submit", "--name", "lmt-root", "--", "/bin/sleep", "600")["id"])
    wait_until(lambda: agent.json("job", "show", live_job)["state"] == "running", 30, "root's job to run")
    seed(agent)
    took: list[float] = []
    with local_user("repl") as user, RootLiveness(agent.sock, live_job) as live:
        end = time.monotonic() + 5.0
        while time.monotonic() < end or len(took) < 3:
            t0 = time.monotonic()
            status, rows, raw = call_as(user, agent.sock, "GET", "/v1/migrate/replicas")
            took.append(time.monotonic() - t0)
            assert status == 200, raw
            listed = rows["replicas"] if isinstance(rows, dict) else rows
            assert len([r for r in listed if r.get("src_node") == 9]) == KEYS, raw[:300]  # (keys redacted for a user)
            if len(took) >= 50:
                break
    live.check(bound_s=2.0)
    print(f"GET /v1/migrate/replicas, {KEYS} keys, {ENDED} ended jobs: {len(took)} requests, "
          f"slowest {max(took):.3f} s")
