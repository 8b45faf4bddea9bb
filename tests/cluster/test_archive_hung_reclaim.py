"""A reclaim whose archive hangs (``migrate.archive_dir`` on shared storage that stops answering
in the middle of the copy of the reclaimed job's final checkpoint) does not wait for it past its
window: A's job has no room and no keeper in the zone, so its checkpoint goes to the archive,
whose server stops answering while the copy is made. The move fails before the window ends,
saying that the archive did not answer (its path, the time waited) and that the job's keeper
still keeps it; the window's end stops the job (``reclaimed``), and the keeper, B, keeps its
keeper. When the storage answers again, the copy still in hand on A's archive lane runs to its
end and publishes nothing (a record there would be claimable beside the keeper's take-over: two
copies of the job); B resumes the job once room frees there, and it ends with the weights of an
uninterrupted run, once.

The hung storage is real: ``archive_dir`` is a writable FUSE mount (tests/fuserig.py) whose
server stops itself at the first ``mkdir`` of a copy's temporary name (``.tmp-ckpt-*``:
:meth:`fuserig.EioMount.hang_at`), so every later call on the mount, A's copy first, waits in
the kernel, until :meth:`fuserig.EioMount.heal`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from archiverig import held_record
from fuserig import eio_mount
from harness import Node, wait_until
from test_migrate_archive import finish
from test_migration import (  # noqa: F401  (fixtures: make_cluster, reference_sha)
    fill,
    find_migrated,
    job_log,
    job_state,
    make_cluster,
    migrate_config,
    reference_sha,
    submit,
    train_cmd,
)

pytestmark = pytest.mark.cluster


def archive_rounds(nd: Node) -> int:
    return int(nd.json("status")["migrate"]["archive"]["rounds"])


def records(arch: Path, key: str) -> dict[str, dict[str, Any]]:
    """The job records the archive's files of ``key`` hold (keeper, claimed, running: every
    ``*.json``; each its node's signed keeper or live record) by name."""
    d = arch / key
    return {p.name: held_record(p) or {} for p in d.glob("*.json")} if d.is_dir() else {}


def test_a_reclaim_does_not_wait_for_a_hung_archive_past_its_window_and_its_late_copy_publishes_nothing(
        make_cluster, reference_sha, tmp_path):  # noqa: F811
    backing = tmp_path / "archive"
    backing.mkdir()
    with eio_mount(backing, writable=True) as fs:
        try:
            c = make_cluster(zones=1, per_zone=2, gpus=1, zone_extra=migrate_config(
                retry_base_s=0.5, retry_max_s=2.0, keeper_reserve_mb=1 << 29, archive_dir=f'"{fs.path}"',
                archive_gc_s=1.0))
            a, b = c.nodes
            jid = submit(a, "--name", "train", "--", *train_cmd(0.2, after_resume=0))
            key = f"n{a.node_id}-{jid}"
            # its checkpoints are prestaged to its keeper, B (which had room for it), which keeps the job
            wait_until(lambda: any(r["key"] == key and r["state"] == "keeping" for r in b.json("replicas")), 60,
                       "B keeping a prestaged replica")
            fillers = fill(c, [b])  # now no room on B, and no disk offered (keeper_reserve_mb): no keeper

            a.ctl("reclaim", "--notice", "8s")  # (no periodic copy of the job begins while A is reclaimed)
            fs.hang_at(".tmp-ckpt-")  # the archive's copy of the final checkpoint begins, and hangs there
            wait_until(lambda: a.json("migrations") and a.json("migrations")[0]["phase"] in ("archived", "failed"),
                       60, "A's move to end (the window is 8 s)")
            move = a.json("migrations")[0]
            assert fs.hung_at, "the archive's copy never began (nothing hung)"
            # what hung is the work in hand on A's archive lane: the reclaim's copy itself, or a periodic
            # copy of the job begun just before the notice (its mkdir came after hang_at: seen in CI),
            # with the reclaim's copy queued behind it; the move fails by its window either way (below)
            stalls = wait_until(lambda: [e for e in a.json("events", "--kind", "migrate", "--limit", "1000")
                                         if e.get("phase") == "archive-stalled"], 60, "A's archive reported stalled")
            assert [e["waiting"] for e in stalls] in ([f"archiving {jid}"], [f"periodic copy of {jid}"]), stalls
            assert move["phase"] == "failed", move
            assert f"archive {fs.path} did not answer in" in move["error"], move
            assert f"its keeper, node {b.node_id}, still keeps it" in move["error"], move
            wait_until(lambda: job_state(a, jid)["state"] == "reclaimed", 60, "the window's end to stop the job")
            assert any(r["key"] == key and r["state"] in ("keeping", "waiting") for r in b.json("replicas"))
            rounds = archive_rounds(a)
            # room frees on B while the archive still hangs: B's take-over waits for the archive's claim
            b.ctl("job", "stop", fillers[b.node_id])

            fs.heal()
            # A's lane finishes the copy it had in hand, then looks at the archive again (in order)
            wait_until(lambda: archive_rounds(a) >= rounds + 2, 60, "A's archive rounds after the storage answered")
            # nothing of A's reclaim reached the archive: no record of it, no copy of its final checkpoint
            # (a periodic copy of an earlier checkpoint, made while the job ran, may be there, with its live record)
            recs = records(backing, key)
            assert not [r for r in recs.values() if r.get("writer") == a.node_id and r.get("kind") != "live"], recs
            assert not [r for r in recs.values() if r.get("ckpt") == move["ckpt"] and r.get("writer") == a.node_id]
            left = [p.name for p in (backing / key).iterdir()] if (backing / key).is_dir() else []
            assert not [n for n in left if n.startswith((".tmp-", ".guard-")) and f"-{a.node_id}-" in n], left
            # B resumes it, once (through the archive's claim where the archive holds a periodic copy)
            nd, job = wait_until(lambda: find_migrated(c, key), 60, "the job resumed", every=0.3)
            assert nd is b, nd.node_id
            first = wait_until(lambda: [e for e in job_log(b, job["id"]) if e["event"] == "start"], 60,
                               "the resumed job's start", every=0.3)
            finish(c, key, b, int(first[0]["step"]), reference_sha)
            assert [e for e in job_log(a, jid) if e["event"] == "done"] == []  # it never finished on A
        finally:
            fs.heal()  # the agents stop with their storage answering
