"""A partial partition is not a departure: when only the link between a job's node and its
keeper goes down (both still hear the third member), the keeper does not resume the job after
``orphan_after_s``: it asks the other members when they last heard the node (control op
``heard``, laminar/migrate/vouch.py), and the third one heard it a moment ago. Before, the keeper
resumed the job and both copies ran until the link came back.

Three real agents in one zone (tests/cluster/harness.py), one declared (fake) GPU each, no
fencing; the job is a real process that writes one jobkit checkpoint and then appends its pid to
a file every 50 ms (its steps). The partial partition is blackhole routes between the job's
node and its keeper only, both ways, removed to heal it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from agentproc import VENV_BIN
from harness import wait_until
from test_fence import STEPS, cut, heal, phases, steps_by
from test_migration import (  # noqa: F401  (fixture)
    find_migrated,
    job_state,
    make_cluster,
    migrate_config,
    submit,
    verified_steps,
)
from test_replica_keeper_change import replica

pytestmark = pytest.mark.cluster

ORPHAN_S = 4.0


def test_a_keeper_cut_off_from_the_jobs_node_alone_does_not_resume_the_job(make_cluster, tmp_path: Path) -> None:  # noqa: F811
    steps = tmp_path / "steps"
    c = make_cluster(zones=1, per_zone=3, gpus=1, zone_extra=migrate_config(
        orphan_after_s=ORPHAN_S, retry_base_s=0.3, retry_max_s=0.6))
    a = c.nodes[0]
    jid = submit(a, "--name", "partial", "--", str(VENV_BIN / "python"), "-c", STEPS, str(steps))
    key = f"n{a.node_id}-{jid}"
    keeper = wait_until(lambda: next((nd for nd in c.nodes if nd is not a and (r := replica(nd, key)) is not None
                                     and r["state"] == "keeping" and 7 in verified_steps(nd, key)), None),
                       60, "a peer to hold and keeper the job's checkpoint")
    wait_until(lambda: steps_by(steps), 30, "the job to step")
    pid_a = str(job_state(a, jid)["pid"])

    cut(a, [keeper])  # A and its keeper no longer hear each other; both hear the third node
    try:
        cut_at = time.time()
        while time.time() < cut_at + 3 * ORPHAN_S:  # well past orphan_after_s of silence
            time.sleep(0.2)
        assert find_migrated(c, key) is None, "the keeper resumed a job that runs on at its node"
        ev = phases(keeper, "heard-elsewhere")  # the third node heard A a moment ago
        assert [e["node"] for e in ev] == [a.node_id], ev
        assert keeper.json("status")["migrate"]["heard_elsewhere"] == [a.node_id]
        held = steps_by(steps).get(pid_a, 0)
        wait_until(lambda: steps_by(steps).get(pid_a, 0) > held + 5, 30, "A's job to step on")
    finally:
        heal(a, [keeper])

    wait_until(lambda: keeper.json("status")["migrate"]["heard_elsewhere"] == [], 30,
               "the keeper to forget the word once it hears A again")
    time.sleep(2.0)  # ten keeper rounds (poll_s 0.2): nothing is resumed after the heal either
    assert find_migrated(c, key) is None
    assert job_state(a, jid)["state"] == "running"
    assert set(steps_by(steps)) == {pid_a}, "another copy of the job stepped"
