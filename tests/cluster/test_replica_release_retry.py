"""When a job's checkpoints go to a new buddy, the old buddy's guard is released even if it could
not be reached at that moment: the release is sent again until it arrives. Before, it was sent
once; a buddy unreachable then went on guarding the job's older checkpoint beside the new buddy,
and had the source died both would have resumed the job (two copies).

Three real agents in one zone (tests/cluster/harness.py), each in its own network namespace.
The job on node A is a real process that writes a jobkit checkpoint at start and another each
time it is asked (SIGUSR1). The old buddy X is cut off from A by a blackhole route to A in X's
namespace (X's answers no longer reach A: A's connections to X time out), so the prestage of
the next checkpoint to X fails and A tries the other peer Y (a failed node is avoided for a
while; before, A forgot X as the job's buddy, so the success at Y released nobody); then the
route is removed.
"""

from __future__ import annotations

import os
import signal

import pytest
from harness import wait_until
from test_migration import job_state, make_cluster, migrate_config, submit, verified_steps  # noqa: F401  (fixture)
from test_replica_drop_source import buddies, guard_of, replica
from test_replica_resume_owner import JOB

pytestmark = pytest.mark.cluster


def test_a_release_the_old_buddy_missed_is_sent_again_until_it_arrives(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=3, gpus=0, zone_extra=migrate_config())
    a = c.nodes[0]
    jid = submit(a, "--name", "ckpt-on-ask", "--", "/usr/bin/python3", "-c", JOB, gpus=0)
    key = f"n{a.node_id}-{jid}"
    x = wait_until(lambda: guard_of(c.nodes[1:], key), 60, "the job's checkpoint to be prestaged to a buddy")
    y = next(nd for nd in c.nodes[1:] if nd is not x)

    x.netns.run("ip", "route", "add", "blackhole", f"{a.addr}/32")
    os.kill(int(job_state(a, jid)["pid"]), signal.SIGUSR1)  # the job writes ckpt-8
    wait_until(lambda: (r := replica(y, key)) is not None and r["state"] == "guarding" and 8 in verified_steps(y, key),
               120, "the new checkpoint to go to Y, which guards the job")
    wait_until(lambda: buddies(a).get(jid) == y.node_id, 30, "A to record Y as the job's buddy")
    # the release could not arrive: A keeps it to send again
    wait_until(lambda: {"node": x.node_id, "key": key} in a.json("status")["migrate"]["releases_pending"], 30,
               "the release to X to fail once")
    assert replica(x, key)["state"] == "guarding"  # type: ignore[index]

    x.netns.run("ip", "route", "del", "blackhole", f"{a.addr}/32")
    wait_until(lambda: (r := replica(x, key)) is None or (r["state"] == "released" and not verified_steps(x, key)),
               60, "X's guard to be released once it can be reached")
    assert replica(y, key)["state"] == "guarding" and 8 in verified_steps(y, key)  # type: ignore[index]
    assert buddies(a).get(jid) == y.node_id
    assert a.json("status")["migrate"]["releases_pending"] == []
