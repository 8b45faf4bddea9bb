"""A reclaimed node's *queued* jobs are placed elsewhere, and none starts on the node.

Two agents in one zone. On node A the transient class has a 300 MiB cap: a filler of 200 MiB
holds it and a second job of 200 MiB waits in A's queue. A is reclaimed. Before, the queued job
was left alone: when the window ended and the filler was stopped, the freed room started the
queued job on the reclaimed node (a node about to go, where it would die with it). Now A holds its queue at the
notice and places the queued job again through the zone: it runs on B, carries where it came
from, and leaves A's queue as ``requeued``.
"""

from __future__ import annotations

import time

import pytest
from harness import wait_until
from test_migration import job_state, make_cluster, migrate_config, submit  # noqa: F401  (fixture: make_cluster)

pytestmark = pytest.mark.cluster


def test_a_reclaimed_nodes_queued_job_is_placed_elsewhere_and_never_starts_there(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=2, gpus=1, zone_extra=migrate_config(prestage='"off"'))
    a, b = c.nodes
    # A runs with Airlock (the harness leaves it out), whose class caps make the queue
    a.agent.stop()
    a.agent.airlock = True
    with open(a.agent.config_path, "a") as f:
        f.write("\n[airlock]\nclass_budget_mb = {transient = 300}\n")
    a.agent.start()
    c.wait_converged()
    job = ("--class", "transient", "--memory", "200M")
    filler = submit(a, "--name", "lm-t-filler", *job, "--", "sleep", "3600", gpus=0)
    wait_until(lambda: job_state(a, filler)["state"] == "running", 30, "the filler to run")
    queued = submit(a, "--name", "lm-t-queued", *job, "--", "sleep", "3600", gpus=0)
    assert job_state(a, queued)["state"] == "queued"

    notice_s = 6
    a.ctl("reclaim", "--notice", f"{notice_s}s", "--reason", "owner needs it")

    def on_b() -> dict | None:  # type: ignore[type-arg]
        for j in b.json("jobs"):
            if j["state"] == "running" and j.get("name") == "lm-t-queued":
                return dict(j)
        return None

    moved = wait_until(on_b, 30, "the queued job to run on node B")
    shown = b.json("job", "show", moved["id"])
    assert shown["origin"]["requeued_from"] == f"n{a.node_id}-{queued}", shown["origin"]
    left = job_state(a, queued)
    assert left["state"] == "requeued", left
    assert f"node {b.node_id}" in left["reason"], left

    # the window ends: the filler is stopped, and nothing starts on A in its place
    time.sleep(notice_s + 2)
    assert job_state(a, filler)["state"] == "reclaimed"
    running_on_a = [j for j in a.json("jobs") if j["state"] in ("running", "suspended")]
    assert running_on_a == [], running_on_a
    events = a.json("events", "--kind", "migrate", "--limit", "200")
    assert any(e.get("new_job") == moved["id"] for e in events), events
