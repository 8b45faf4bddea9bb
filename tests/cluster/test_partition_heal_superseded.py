"""A partition longer than ``orphan_after_s`` ends with the job running once.

With ``orphan_after_s`` set, a keeper that hears nothing from a job's source for that long takes
it for gone and resumes the job from its replica. When the silence was a partition, the source
never stopped its copy: from the take-over on, two copies of the job run. Before, nothing
reconciled them once the partition healed, and both ran to their ends. Now the keeper, hearing
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
from test_migrate_archive_periodic import live
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


def test_after_a_partition_longer_than_orphan_after_s_the_source_stops_its_copy(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=2, gpus=1, zone_extra=migrate_config(
        orphan_after_s=2, retry_base_s=0.3, retry_max_s=0.6))
    a, b = c.nodes
    jid = submit(a, "--name", "split", "--", str(VENV_BIN / "python"), "-c", JOB)
    key = f"n{a.node_id}-{jid}"
    wait_until(lambda: (r := replica(b, key)) is not None and r["state"] == "keeping" and 7 in verified_steps(b, key),
               60, "B to hold and keeper the job's checkpoint")

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
    assert shown["end_cause"] == "superseded", shown
    assert f"node {b.node_id}" in shown["reason"] and resumed["id"] in shown["reason"], shown
    assert job_state(b, resumed["id"])["state"] == "running"
    ev_a = [e for e in a.json("events", "--kind", "migrate") if e.get("phase") == "superseded"]
    assert [(e["job"], e["node"], e["their_job"]) for e in ev_a] == [(jid, b.node_id, resumed["id"])], ev_a
    ev_b = [e for e in b.json("events", "--kind", "migrate") if e.get("phase") == "superseded-there"]
    assert [(e["key"], e["stopped"]) for e in ev_b] == [(key, jid)], ev_b
    # told once: a later round does not ask again, and nothing else on A is stopped
    assert [j["id"] for j in a.json("jobs", "--active")] == []
    assert [j["id"] for j in b.json("jobs", "--active")] == [resumed["id"]]


def test_after_a_partition_the_node_that_claimed_the_job_from_the_archive_tells_its_source(
        make_cluster, tmp_path):  # noqa: F811
    """Node X is cut off from A (the job's node) and B (its keeper) both: to X both are gone, so X
    claims the job's live record from the archive and resumes it, while A's copy runs on (B
    still hears A: it takes nothing over). Healed, X tells A, which stops its copy. Before, X
    kept no keeper row of a job it claimed from the archive, so nothing told A."""
    arch = tmp_path / "archive"
    c = make_cluster(zones=1, per_zone=3, gpus=1, zone_extra=migrate_config(
        orphan_after_s=2, retry_base_s=0.3, retry_max_s=0.6, archive_dir=f'"{arch}"', archive_gc_s=1.0))
    a, b, x = c.nodes
    jid = submit(a, "--name", "split-archive", "--", str(VENV_BIN / "python"), "-c", JOB)
    key = f"n{a.node_id}-{jid}"

    def ready() -> bool:  # the checkpoint archived (live.json) and kept by A's keeper
        r = live(arch, key)
        keeper = None if r is None else r.get("buddy")
        return keeper is not None and any(nd.node_id == keeper and (g := replica(nd, key)) is not None
                                         and g["state"] == "keeping" for nd in (b, x))

    wait_until(ready, 60, "the job's checkpoint archived and kept by its keeper", every=0.2)
    keeper = int(live(arch, key)["buddy"])  # type: ignore[index]
    if keeper == x.node_id:  # the cut-off node must be neither the job's node nor its keeper
        b, x = x, b
    cut = [(a, x), (b, x), (x, a), (x, b)]  # (in whose namespace, route to whom): both ways
    for nd, to in cut:
        nd.netns.run("ip", "route", "add", "blackhole", f"{to.addr}/32")
    try:
        found = wait_until(lambda: (f := find_migrated(c, key)) is not None and f[0] is x and f, 60,
                           "X to claim the job from the archive and resume it")
        _, resumed = found
        wait_until(lambda: job_state(x, resumed["id"])["state"] == "running", 30, "X's copy to run")
        assert job_state(a, jid)["state"] == "running"  # two copies: the partition's cost
        assert replica(x, key)["state"] == "resumed"  # type: ignore[index]
    finally:
        for nd, to in cut:
            nd.netns.run("ip", "route", "del", "blackhole", f"{to.addr}/32")

    wait_until(lambda: job_state(a, jid)["state"] == "migrated", 30, "A to stop its copy once X told it")
    assert f"node {x.node_id}" in job_state(a, jid)["reason"]
    assert job_state(x, resumed["id"])["state"] == "running"
    ev = [e for e in a.json("events", "--kind", "migrate") if e.get("phase") == "superseded"]
    assert [(e["job"], e["node"]) for e in ev] == [(jid, x.node_id)], ev


FINISH = """
import os, sys, time
from laminar.jobkit import Checkpointer
Checkpointer(install_signal=False).save(b"weights-7", step=7)
while not (os.path.exists(sys.argv[1]) and "LM_MIGRATED_FROM" not in os.environ):
    time.sleep(0.1)  # the copy on its own node finishes once told; a resumed copy never does by itself
"""


def test_a_job_its_source_finished_during_the_partition_is_stopped_where_it_was_taken_over(
        make_cluster, tmp_path):  # noqa: F811
    """The source's copy finishes (exit 0) while cut off; the keeper took the job over meanwhile
    and runs it again. Healed, the keeper learns the job was finished and stops its rerun."""
    c = make_cluster(zones=1, per_zone=2, gpus=1, zone_extra=migrate_config(
        orphan_after_s=2, retry_base_s=0.3, retry_max_s=0.6))
    a, b = c.nodes
    go = tmp_path / "finish"
    jid = submit(a, "--name", "finishes", "--", str(VENV_BIN / "python"), "-c", FINISH, str(go))
    key = f"n{a.node_id}-{jid}"
    wait_until(lambda: (r := replica(b, key)) is not None and r["state"] == "keeping" and 7 in verified_steps(b, key),
               60, "B to hold and keeper the job's checkpoint")
    a.netns.run("ip", "route", "add", "blackhole", f"{b.addr}/32")
    try:
        _, resumed = wait_until(lambda: find_migrated(c, key), 30, "B to resume the job")
        wait_until(lambda: job_state(b, resumed["id"])["state"] == "running", 30, "B's copy to run")
        go.touch()
        wait_until(lambda: job_state(a, jid)["state"] == "exited", 30, "A's copy to finish")
        assert job_state(a, jid)["exit_code"] == 0
    finally:
        a.netns.run("ip", "route", "del", "blackhole", f"{b.addr}/32")
    wait_until(lambda: job_state(b, resumed["id"])["state"] == "stopped", 30, "B to stop its rerun once A answered")
    assert "finished" in job_state(b, resumed["id"])["reason"]
    ev = [e for e in b.json("events", "--kind", "migrate") if e.get("phase") == "superseded-done-there"]
    assert [(e["key"], e["job"]) for e in ev] == [(key, resumed["id"])], ev
    assert job_state(a, jid)["state"] == "exited"


def test_a_keeper_that_placed_the_job_on_another_node_tells_the_source_for_that_node(make_cluster):  # noqa: F811
    """The keeper has no room when A falls silent (its only GPU taken meanwhile): it takes the job
    over by placing it on the third node (replica state ``placed``). That node runs the job from a
    hand-over and keeps no keeper row, so before, nobody told A, and A's copy ran on beside it to
    its end (bench/chaos.py --fence-after-s, seed 27). Now the keeper tells A for it."""
    c = make_cluster(zones=1, per_zone=3, gpus=1, zone_extra=migrate_config(
        orphan_after_s=2, retry_base_s=0.3, retry_max_s=0.6))
    a = c.nodes[0]
    jid = submit(a, "--name", "split-placed", "--", str(VENV_BIN / "python"), "-c", JOB)
    key = f"n{a.node_id}-{jid}"
    keeper = wait_until(lambda: next((nd for nd in c.nodes[1:] if (r := replica(nd, key)) is not None
                                     and r["state"] == "keeping" and 7 in verified_steps(nd, key)), None),
                       60, "a peer to hold and keeper the job's checkpoint")
    other = next(nd for nd in c.nodes[1:] if nd is not keeper)
    fill(c, [keeper])  # no room on the keeper any more
    cut = [(a, keeper), (a, other), (keeper, a), (other, a)]
    for nd, to in cut:
        nd.netns.run("ip", "route", "add", "blackhole", f"{to.addr}/32")
    try:
        found = wait_until(lambda: find_migrated(c, key), 60, "the keeper to place the job elsewhere")
        nd, placed = found
        assert nd is other, f"the job resumed on node {nd.node_id}, not placed on node {other.node_id}"
        assert replica(keeper, key)["state"] == "placed"  # type: ignore[index]
        wait_until(lambda: job_state(other, placed["id"])["state"] == "running", 30, "the placed copy to run")
        assert job_state(a, jid)["state"] == "running"  # two copies: the partition's cost (no fencing)
    finally:
        for nd, to in cut:
            nd.netns.run("ip", "route", "del", "blackhole", f"{to.addr}/32", check=False)

    wait_until(lambda: job_state(a, jid)["state"] == "migrated", 30, "A to stop its copy once the keeper told it")
    assert f"node {other.node_id} runs it as {placed['id']}" in job_state(a, jid)["reason"]
    assert job_state(other, placed["id"])["state"] == "running"
    ev = [e for e in a.json("events", "--kind", "migrate") if e.get("phase") == "superseded"]
    assert [(e["job"], e["node"], e["their_job"]) for e in ev] == [(jid, other.node_id, placed["id"])], ev
