"""A keeper that took its source for dead after a silence (``orphan_after_s``) and waits for room
does not revive the job once the source is heard from again and says the job runs there: it
keeps it again. Before, the waiting keeper kept looking for room and, once room freed, started
a second copy of a job that had never stopped running on its source.

Two real agents in one zone (tests/cluster/harness.py), one declared (fake) GPU each. Node B's
GPU is taken by a job of its own, so B can only hold A's job's checkpoint (a storage keeper)
and has no room to resume it. The job on A is a real process that writes one jobkit checkpoint
and runs on. The silence is a blackhole route to B in A's namespace (A's datagrams no longer
reach B; A keeps running its job), removed to heal it.
"""

from __future__ import annotations

import time

import pytest
from agentproc import VENV_BIN
from harness import wait_until
from test_migration import (  # noqa: F401  (fixture)
    fill,
    find_migrated,
    job_state,
    make_cluster,
    migrate_config,
    submit,
    verified_steps,
)
from test_replica_keeper_change import JOB, replica

pytestmark = pytest.mark.cluster


def test_a_waiting_keeper_keeps_again_when_its_source_comes_back_with_the_job_running(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=2, gpus=1, zone_extra=migrate_config(
        orphan_after_s=2, retry_base_s=0.3, retry_max_s=0.6, keeper_reserve_mb=0))
    a, b = c.nodes
    fillers = fill(c, [b])
    time.sleep(1.5)  # a few summary rounds (0.3 s): B's full GPU reaches A
    jid = submit(a, "--name", "one-ckpt", "--", str(VENV_BIN / "python"), "-c", JOB)
    key = f"n{a.node_id}-{jid}"
    wait_until(lambda: (r := replica(b, key)) is not None and r["state"] == "keeping" and 7 in verified_steps(b, key),
               60, "B to hold and keeper the job's checkpoint")

    # A falls silent for B: B takes it for dead, finds no room for the job and waits
    a.netns.run("ip", "route", "add", "blackhole", f"{b.addr}/32")
    wait_until(lambda: (r := replica(b, key)) is not None and r["state"] == "waiting", 30,
               "B to take A for dead and wait for room")
    assert job_state(a, jid)["state"] == "running"  # the job never stopped on A

    # A is heard from again: B asks it, learns the job runs there, and keeps it again
    a.netns.run("ip", "route", "del", "blackhole", f"{b.addr}/32")
    wait_until(lambda: (r := replica(b, key)) is not None and r["state"] == "keeping", 30,
               "B to keep the job again once A answered")
    ev = [e for e in b.json("events", "--kind", "migrate") if e.get("phase") == "keeping-again"]
    assert [(e["key"], e["src_state"]) for e in ev] == [(key, "running")], ev
    assert 7 in verified_steps(b, key)  # the replica stays: the keeper goes on

    # room frees on B: the keeper does not start a second copy of the job
    b.ctl("job", "stop", fillers[b.node_id])
    wait_until(lambda: job_state(b, fillers[b.node_id])["state"] == "stopped", 30, "B's GPU to free")
    time.sleep(3)  # several of the retry schedule's looks (0.6 s) and keeper rounds (0.2 s)
    assert find_migrated(c, key) is None
    assert job_state(a, jid)["state"] == "running" and replica(b, key)["state"] == "keeping"  # type: ignore[index]
