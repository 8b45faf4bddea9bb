"""A reclaimed job with no room, no keeper and no keeper in the zone has one keeper left, the
archive (``migrate.archive_dir``); when the archive hangs past the window's wait, the job stops
and its copy goes on (the move reads ``archiving``). Here A's agent is killed (SIGKILL) while
that copy waits on the hung storage, and started again while the storage still hangs: it takes
the copy up (its record was never published: ``migrate_late_copies``), the copy lands once the
storage answers, and the
first agent with room resumes the job from the archive, once, with the weights of an
uninterrupted run. Before, the restart ended the copy for good, and the job's only checkpoint
stayed in its ckpt directory on the node being taken back. B has room before the copy lands and
may see the job's older live record (a periodic copy) first: it waits for the newer copy of A's,
which A, heard from past its window, is making (a fresh-clone CI run resumed from the older one).

The hung storage is real: ``archive_dir`` is a writable FUSE mount (tests/fuserig.py) whose
server stops itself at the first ``mkdir`` of a copy's temporary name (``.tmp-ckpt-*``), so
every later call on the mount waits in the kernel until :meth:`fuserig.EioMount.heal`, and is
stopped again (:meth:`fuserig.EioMount.hang`) before the restarted agent starts; the
agents are real, each in its own network namespace, the job a real PyTorch training run.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from fuserig import eio_mount
from harness import wait_until
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


def job_beside_a_full_node(make_cluster: Any, fs: Any, keeper_reserve_mb: int) -> tuple[  # noqa: F811
        Any, Any, Any, dict[int, str], str, str]:
    """Two agents A and B sharing the archive ``fs`` (a writable FUSE mount), B's only GPU taken
    (no room for A's job in the zone), prestage off (no keeper): A's training job has written its
    first checkpoint. ``keeper_reserve_mb``: 0, B offers its disk (a keeper); large, none.
    (cluster, A, B, B's filler job by node, the job's id on A, its key)."""
    c = make_cluster(zones=1, per_zone=2, gpus=1, zone_extra=migrate_config(
        prestage='"off"', retry_base_s=0.5, retry_max_s=2.0, keeper_reserve_mb=keeper_reserve_mb,
        archive_dir=f'"{fs.path}"', archive_gc_s=1.0))
    a, b = c.nodes
    fillers = fill(c, [b])
    jid = submit(a, "--name", "train", "--", *train_cmd(0.2, after_resume=0))
    key = f"n{a.node_id}-{jid}"
    wait_until(lambda: any(e["event"] == "checkpoint" for e in job_log(a, jid)), 60, "the job's first checkpoint")
    assert not [r for r in b.json("replicas") if r["key"] == key], "B keeps the job (prestage is off)"
    return c, a, b, fillers, jid, key


def test_a_late_archive_copy_cut_by_an_agent_kill_is_taken_up_after_its_restart_and_the_job_resumes_once(
        make_cluster, reference_sha, tmp_path):  # noqa: F811
    backing = tmp_path / "archive"
    backing.mkdir()
    with eio_mount(backing, writable=True) as fs:
        try:
            # no room on B, and no disk offered (keeper_reserve_mb): no keeper
            c, a, b, fillers, jid, key = job_beside_a_full_node(make_cluster, fs, keeper_reserve_mb=1 << 29)

            a.ctl("reclaim", "--notice", "6s")
            fs.hang_at(".tmp-ckpt-")  # the archive's copy of the final checkpoint begins, and hangs there
            wait_until(lambda: a.json("migrations") and a.json("migrations")[0]["phase"] in ("archiving", "failed",
                                                                                               "archived"),
                       60, "A's move to stop the job with its copy still going")
            move = a.json("migrations")[0]
            assert move["phase"] == "archiving", move
            assert fs.hung_at, "the archive's copy never began (nothing hung)"
            assert job_state(a, jid)["state"] == "reclaimed"
            ckpt = move["ckpt"]

            # The agent dies with its copy waiting on the storage. A request the FUSE server has
            # read and not answered holds its thread uninterruptibly, SIGKILL or not (a dead NFS
            # server's hard mount is killable): the storage answers that one request, and the
            # killed process ends there, before its next step. It hangs again before A starts.
            os.kill(a.agent.proc.pid, signal.SIGKILL)
            time.sleep(0.5)
            fs.heal()
            a.agent.proc.wait(30)
            # (a periodic copy made while the job ran may be there, with its live record)
            assert not (backing / key / "guard.json").exists(), "the record was published before the kill"
            fs.hang()
            a.agent.start()  # (its start does not wait for the hung archive)
            taken = wait_until(lambda: [e for e in a.json("events", "--kind", "migrate", "--limit", "1000")
                                        if e.get("phase") == "archiving" and e.get("job") == jid
                                        and "taken up again" in e.get("message", "")], 60,
                               "the restarted A to take the copy up")
            assert taken and taken[0]["ckpt"] == ckpt, taken
            assert a.json("migrations")[0]["phase"] == "archiving"

            b.ctl("job", "stop", fillers[b.node_id])  # room frees on B while the archive still hangs
            fs.heal()
            wait_until(lambda: a.json("migrations")[0]["phase"] == "archived", 60, "the copy to land")
            landed = [e for e in a.json("events", "--kind", "migrate", "--limit", "1000")
                      if e.get("phase") == "archived-late" and e.get("job") == jid]
            assert landed, "no archived-late event"

            nd, job = wait_until(lambda: find_migrated(c, key), 60, "the job resumed from the archive", every=0.3)
            first = wait_until(lambda: [e for e in job_log(nd, job["id"]) if e["event"] == "start"], 60,
                               "the resumed job's start", every=0.3)
            assert int(first[0]["step"]) == int(ckpt.removeprefix("ckpt-")), (first, ckpt)  # from the final one
            finish(c, key, nd, int(first[0]["step"]), reference_sha)  # one copy, an uninterrupted run's weights
            recs = {p.name: p.read_bytes() for p in (backing / key).glob("*.json")} if (backing / key).is_dir() else {}
            assert "guard.json" not in recs, recs  # claimed, not claimable again
        finally:
            fs.heal()  # the agents stop with their storage answering
