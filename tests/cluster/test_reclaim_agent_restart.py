"""A reclaimed node whose agent restarts inside the notice window still moves its job.

Two agents in one zone; a real training job (examples/train_mnistlike.py, jobkit checkpoints)
runs on node A. A is reclaimed with a window long enough for one agent restart, and its agent
is restarted at once, before the plan signals the job (as late as is safe). Before, the restarted
agent had forgotten the reclaim: the job kept running on A (to die with the node) and A took
placements again. Now the agent restores the reclaim from its store: A drains again, the plan is
made over what is left of the window, and the job checkpoints, moves to B and runs there
(its origin, ``migrated_from``), leaving A as ``migrated``.
"""

from __future__ import annotations

import json

import pytest
from harness import wait_until
from test_migration import find_migrated, job_state, make_cluster, migrate_config, train_cmd  # noqa: F401  (fixture)

pytestmark = pytest.mark.cluster

NOTICE_S = 20  # one agent restart on a loaded 2-core VM, then the plan's checkpoint and transfer


def test_a_job_still_moves_when_the_reclaimed_agent_restarts_in_the_window(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=2, gpus=0, zone_extra=migrate_config(prestage='"off"'))
    a, b = c.nodes
    job = json.loads(a.ctl("-o", "json", "submit", "--name", "lm-t-train", "--", *train_cmd(0.1)).stdout)
    jid, key = job["id"], f"n{a.node_id}-{job['id']}"
    wait_until(lambda: job_state(a, jid)["state"] == "running", 30, "the job to run on node A")
    res = json.loads(a.ctl("-o", "json", "reclaim", "--notice", f"{NOTICE_S}s", "--reason", "lm-t owner").stdout)
    assert [s["job_id"] for s in res["reclaim"]["plan"]] == [jid], res

    a.agent.stop()
    a.agent.start()
    assert job_state(a, jid)["state"] == "running", "the job outlives its agent's restart"
    rc = a.json("reclaim", "status")["reclaim"]
    assert rc is not None and rc.get("restored") and [s["job_id"] for s in rc["plan"]] == [jid], rc

    found = wait_until(lambda: find_migrated(c, key), NOTICE_S + 30, "the job to run on node B")
    nd, moved = found
    assert nd.node_id == b.node_id and moved["state"] in ("running", "exited"), moved
    assert job_state(a, jid)["state"] == "migrated"
    events = a.json("events", "--kind", "migrate", "--limit", "200")
    assert any(e.get("phase") == "reclaim-restored" for e in events)
