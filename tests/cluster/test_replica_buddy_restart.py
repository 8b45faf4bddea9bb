"""A source agent that restarts still knows each job's buddy (kept in its store), so when the
job's guard goes to another node after the restart, the old buddy is released. Before, the
buddy map was in memory only: after a restart the source prestaged to a freshly chosen node and
released nobody, so two nodes guarded the job (until the old one's ``needs`` check, 10 minutes
later by default) and both would have resumed it had the source died.

Three real agents in one zone (tests/cluster/harness.py), each in its own network namespace.
The job on node A is a real process that writes one jobkit checkpoint and runs on (it keeps
running across the restart of A's agent, which adopts it). After the restart, A's connections to
the old buddy X fail (a blackhole route to A in X's namespace), so the checkpoint goes to Y;
then the route is removed.
"""

from __future__ import annotations

import pytest
from harness import wait_until
from test_migration import job_state, make_cluster, migrate_config, submit, verified_steps  # noqa: F401  (fixture)
from test_replica_drop_source import buddies, guard_of, replica
from test_replica_resume_owner import JOB

pytestmark = pytest.mark.cluster


def test_a_restarted_source_releases_the_buddy_it_had_before_the_restart(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=3, gpus=0, zone_extra=migrate_config())
    a = c.nodes[0]
    jid = submit(a, "--name", "one-ckpt", "--", "/usr/bin/python3", "-c", JOB, gpus=0)
    key = f"n{a.node_id}-{jid}"
    x = wait_until(lambda: guard_of(c.nodes[1:], key), 60, "the job's checkpoint to be prestaged to a buddy")
    y = next(nd for nd in c.nodes[1:] if nd is not x)
    wait_until(lambda: buddies(a).get(jid) == x.node_id, 30, "A to record its buddy")

    x.netns.run("ip", "route", "add", "blackhole", f"{a.addr}/32")
    a.agent.kill9()
    a.agent.start()
    assert job_state(a, jid)["state"] == "running"  # adopted
    assert buddies(a).get(jid) == x.node_id  # remembered across the restart
    # the prestage after the restart cannot reach X: the checkpoint goes to Y, and X is released
    wait_until(lambda: (r := replica(y, key)) is not None and r["state"] == "guarding" and 7 in verified_steps(y, key),
               120, "the checkpoint to go to Y, which guards the job")
    wait_until(lambda: buddies(a).get(jid) == y.node_id, 30, "A to record Y as the job's buddy")
    x.netns.run("ip", "route", "del", "blackhole", f"{a.addr}/32")
    wait_until(lambda: (r := replica(x, key)) is None or (r["state"] == "released" and not verified_steps(x, key)),
               60, "X's guard to be released")
    assert replica(y, key)["state"] == "guarding"  # type: ignore[index]
