"""A reclaimed job with no room in the zone goes to a storage keeper: its final checkpoint is sent
there, the job stops, the copy beside the keeper is archived, and the keeper is told to take the
job over. Here A's agent dies (SIGKILL) after the stop and before that take-over, while the
archive's copy hangs, and never comes back (its node was taken). Before, the keeper had the
checkpoint but no keeper of the job (the keeper came with the take-over): nothing resumed the job,
or only from an older periodic copy in the archive. Now the keeper keeps the job before it is
stopped (as a keeper would, with the window's end), takes it over when A's window ends, and,
once room frees on it, resumes the job from its final checkpoint, once, with the weights of an
uninterrupted run.

The hung storage is real: ``archive_dir`` is a writable FUSE mount (tests/fuserig.py) whose
server stops itself at the first ``mkdir`` of a copy's temporary name (``.tmp-ckpt-*``); the
agents are real, each in its own network namespace, the job a real PyTorch training run.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from fuserig import eio_mount
from harness import wait_until
from test_archive_late_copy_restart import job_beside_a_full_node
from test_migrate_archive import finish
from test_migrate_keeper import replica
from test_migration import (  # noqa: F401  (fixtures: make_cluster, reference_sha)
    find_migrated,
    job_log,
    job_state,
    make_cluster,
    reference_sha,
)

pytestmark = pytest.mark.cluster


def test_the_keeper_keeps_the_job_before_it_stops_so_an_agent_crash_before_the_take_over_loses_nothing(
        make_cluster, reference_sha, tmp_path):  # noqa: F811
    backing = tmp_path / "archive"
    backing.mkdir()
    with eio_mount(backing, writable=True) as fs:
        try:
            # no room on B; it offers its disk (keeper_reserve_mb 0): B holds
            c, a, b, fillers, jid, key = job_beside_a_full_node(make_cluster, fs, keeper_reserve_mb=0)

            a.ctl("reclaim", "--notice", "8s")
            fs.hang_at(".tmp-ckpt-")  # the archive's copy beside the keeper begins, and hangs there
            wait_until(lambda: fs.hung_at and job_state(a, jid)["state"] == "reclaimed", 60,
                       "A to send the checkpoint to B, stop the job and archive the copy beside it")
            move = a.json("migrations")[0]
            assert move["phase"] == "hold" and move["dest"] == b.node_id, move  # not told to take over yet
            ckpt = move["ckpt"]
            keeper = replica(b, key)
            assert keeper is not None and keeper["state"] == "keeping" and keeper["ckpt"] == ckpt, keeper

            # A's agent dies here (its node is taken: it never comes back). The FUSE request its
            # archive thread waits on holds the killed process until the storage answers it.
            os.kill(a.agent.proc.pid, signal.SIGKILL)
            time.sleep(0.5)
            fs.heal()
            a.agent.proc.wait(30)
            assert not (backing / key / "guard.json").exists(), "the copy beside the keeper was published"

            # B takes the job over once A's window ends, finds no room, and waits for it
            wait_until(lambda: (replica(b, key) or {}).get("state") == "waiting", 60, "B to take the job over")
            b.ctl("job", "stop", fillers[b.node_id])
            nd, job = wait_until(lambda: find_migrated(c, key), 60, "the job resumed on B", every=0.3)
            assert nd is b
            first = wait_until(lambda: [e for e in job_log(nd, job["id"]) if e["event"] == "start"], 60,
                               "the resumed job's start", every=0.3)
            assert int(first[0]["step"]) == int(ckpt.removeprefix("ckpt-")), (first, ckpt)  # the final one
            finish(c, key, b, int(first[0]["step"]), reference_sha)  # one copy, an uninterrupted run's weights
        finally:
            fs.heal()  # the agents stop with their storage answering
