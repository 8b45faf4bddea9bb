"""A partition longer than ``orphan_after_s`` ends with the job running once.

With ``orphan_after_s`` set, a buddy that hears nothing from a job's source for that long takes
it for gone and resumes the job from its replica. When the silence was a partition, the source
never stopped its copy: from the take-over on, two copies of the job run. Before, nothing
reconciled them once the partition healed, and both ran to their ends. Now the guard, hearing
the source again, tells it (control op ``superseded``); the source stops its copy (state
``migrated``; event phase ``superseded``) and the resumed copy runs on alone.

Two real agents in one zone (tests/cluster/harness.py), one declared (fake) GPU each. The job on
A is a real process that writes one jobkit checkpoint and runs on. The partition is a blackhole
route to B in A's namespace (A's datagrams and connections no longer reach B; A's job runs on),
removed to heal it.
"""

from __future__ import annotations

import pytest
from agentproc import VENV_BIN
from harness import wait_until
from test_migration import (  # noqa: F401  (fixture)
    find_migrated,
    job_state,
    make_cluster,
    migrate_config,
    submit,
    verified_steps,
)
from test_replica_buddy_change import JOB, replica

pytestmark = pytest.mark.cluster


def test_after_a_partition_longer_than_orphan_after_s_the_source_stops_its_copy(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=2, gpus=1, zone_extra=migrate_config(
        orphan_after_s=2, retry_base_s=0.3, retry_max_s=0.6))
    a, b = c.nodes
    jid = submit(a, "--name", "split", "--", str(VENV_BIN / "python"), "-c", JOB)
    key = f"n{a.node_id}-{jid}"
    wait_until(lambda: (r := replica(b, key)) is not None and r["state"] == "guarding" and 7 in verified_steps(b, key),
               60, "B to hold and guard the job's checkpoint")

    # A falls silent for B: B takes it for gone and resumes the job; A's copy runs on
    a.netns.run("ip", "route", "add", "blackhole", f"{b.addr}/32")
    try:
        found = wait_until(lambda: find_migrated(c, key), 30, "B to resume the job")
        nd, resumed = found
        assert nd is b
        wait_until(lambda: job_state(b, resumed["id"])["state"] == "running", 30, "B's copy to run")
        assert job_state(a, jid)["state"] == "running"  # two copies: the partition's cost
    finally:
        a.netns.run("ip", "route", "del", "blackhole", f"{b.addr}/32")

    # healed: B tells A, A stops its copy; B's runs on alone
    wait_until(lambda: job_state(a, jid)["state"] == "migrated", 30, "A to stop its copy once B told it")
    shown = job_state(a, jid)
    assert f"node {b.node_id}" in shown["reason"] and resumed["id"] in shown["reason"], shown
    assert job_state(b, resumed["id"])["state"] == "running"
    ev_a = [e for e in a.json("events", "--kind", "migrate") if e.get("phase") == "superseded"]
    assert [(e["job"], e["node"], e["their_job"]) for e in ev_a] == [(jid, b.node_id, resumed["id"])], ev_a
    ev_b = [e for e in b.json("events", "--kind", "migrate") if e.get("phase") == "superseded-there"]
    assert [(e["key"], e["stopped"]) for e in ev_b] == [(key, jid)], ev_b
    # told once: a later round does not ask again, and nothing else on A is stopped
    assert [j["id"] for j in a.json("jobs", "--active")] == []
    assert [j["id"] for j in b.json("jobs", "--active")] == [resumed["id"]]
