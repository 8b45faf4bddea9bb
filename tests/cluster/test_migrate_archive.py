"""The archive, the keeper of last resort (``migrate.archive_dir``: storage outside the pool,
shared by the zone's agents; here a directory of the test on the host's disk, which every
agent's namespace sees, as an NFS mount would be seen).

1. No live peer can run or hold A's job (every peer's only GPU is taken, and none offers disk:
   ``keeper_reserve_mb`` larger than its disk): at A's reclaim the final checkpoint goes to
   the archive with the job's keeper record; when room frees on a peer, that peer claims the
   record and resumes the job from the archived checkpoint. This case is the common start of
   the archive sweep's tests (``test_archive_sweep_cluster.archived_and_claimed``, asserted
   there once per test, with periodic archive copies on and off): one cluster less here.
2. A job whose final checkpoint went to a keeper is archived as well (by its source beside
   the keeper, and by any keeper that finds no room); the keeper, waiting for room, dies
   without notice (agent SIGKILLed, namespace deleted): the job is not lost, another node
   claims it from the archive when room frees there.

Both end with the weights of an uninterrupted run (the real PyTorch job
examples/train_mnistlike.py on CPU) and exactly one copy of the job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, Node, wait_until
from test_migration import (  # noqa: F401  (fixtures: make_cluster, reference_sha)
    alive,
    assert_continuous,
    fill,
    find_migrated,
    gone,
    job_log,
    job_state,
    make_cluster,
    migrate_config,
    reference_sha,
    submit,
    train_cmd,
)

pytestmark = pytest.mark.cluster


def finish(c: Cluster, key: str, where: Node, start: int, reference: str) -> None:
    found = wait_until(lambda: find_migrated(c, key), 60, "the job to resume from the archive", every=0.3)
    nd, job = found
    assert nd is where, (nd.node_id, where.node_id)
    wait_until(lambda: job_state(nd, job["id"])["state"] == "exited", 120, "the resumed job to finish")
    assert job_state(nd, job["id"])["exit_code"] == 0
    log = job_log(nd, job["id"])
    assert_continuous(log, start)
    assert [e for e in log if e["event"] == "done"][0]["weights_sha256"] == reference
    copies = [j for n in c.nodes if alive(n) for j in n.json("jobs")
              if (j.get("origin") or {}).get("migrated_from") == key]
    assert len(copies) == 1, copies


def archived(arch: Path, key: str) -> dict[str, Any]:
    d = arch / key
    return {"files": sorted(p.name for p in d.glob("*.json")) if d.is_dir() else [],
            "ckpts": sorted(int(p.name[5:]) for p in d.glob("ckpt-*")) if d.is_dir() else []}


def test_a_waiting_keeper_archives_and_its_death_loses_nothing(make_cluster, reference_sha, tmp_path):  # noqa: F811
    arch = tmp_path / "archive"
    c = make_cluster(zones=1, per_zone=4, gpus=1, zone_extra=migrate_config(
        retry_base_s=0.5, retry_max_s=2.0, keeper_reserve_mb=0, archive_dir=f'"{arch}"',
        archive_gc_s=1.0))  # the archive sweep every second (default 10 s): what the job's end frees goes soon
    a, peers = c.nodes[0], c.nodes[1:]
    fillers = fill(c, peers)
    jid = submit(a, "--name", "train", "--", *train_cmd(0.1, after_resume=0))
    key = f"n{a.node_id}-{jid}"
    wait_until(lambda: any(e["event"] == "checkpoint" for e in job_log(a, jid)), 60, "the job's first checkpoint")

    a.ctl("reclaim", "--notice", "8s")
    wait_until(lambda: a.json("migrations") and a.json("migrations")[0]["phase"] in ("held", "failed"), 60,
               "the final checkpoint to leave A")
    move = a.json("migrations")[0]
    assert move["phase"] == "held", move
    held = int(move["ckpt"].removeprefix("ckpt-"))
    h = c.nodes[move["dest"] - 1]
    # the archive keeps a copy that outlives the keeper, whose keeper waits for room
    wait_until(lambda: (r := next((r for r in h.json("replicas") if r["key"] == key), None)) is not None
               and r["state"] == "waiting", 30, "the keeper to wait for room")
    wait_until(lambda: archived(arch, key)["files"] == ["guard.json"] and held in archived(arch, key)["ckpts"], 30,
               "the job to be archived")
    gone(a)
    gone(h)  # the keeper leaves without notice
    x = next(nd for nd in peers if nd is not h)
    x.ctl("job", "stop", fillers[x.node_id])
    finish(c, key, x, held, reference_sha)
    # the job ended where it was resumed: the claimed directory goes (Sweep.sweep)
    wait_until(lambda: not (arch / key).exists(), 60, "the claimed directory to go", every=0.3)
