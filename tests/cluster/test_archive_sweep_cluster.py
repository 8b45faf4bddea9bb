"""What the archive keeps and what goes, between real agents (``migrate.archive_dir``: a directory
of the test that every agent's namespace sees, as an NFS mount would be seen).

1. Periodic checkpoints on (``prestage_unannounced = 0``): A is reclaimed with no room and no
   keeper, its job is archived, B claims it when room frees and resumes it. Once the resumed job
   wrote a checkpoint of its own and it is archived under the job's new key, the claimed
   directory goes (``superseded``) while the job still runs; the job finishes with the weights
   of an uninterrupted run, its own archived copies go at its end, and nothing is left in the
   archive.
2. Periodic checkpoints off (``prestage_unannounced = 1``: never due): the claimed directory is
   the job's only copy outside the pool, so it stays while the job runs (after the job's own
   checkpoints too: swept over twice then) and goes when the job ends, removed by the agent that
   runs it (``ended``).
3. A claim whose node died before the job ran (left on the storage the way the agent writes it:
   node 3's job record and its claim, ``claimed-3.json``, noted longer than ARCHIVE_CLAIM_STALE_S
   ago, signed with the zone's key; node 3 is gone) is not removed: an agent with room takes it
   over, resumes the job from its checkpoint (a real one of the same training run), and the job
   ends with an uninterrupted run's weights.
4. The node that claimed and runs the job dies before anything newer of the job was archived
   (periodic checkpoints off, ``orphan_after_s`` set): the claimed checkpoint is the job's newest
   safe state, so another agent claims it again from the dead node's running record and the job
   ends with an uninterrupted run's weights, once.

Tests 1, 2 and 4 start the same way (:func:`archived_and_claimed`), which is also the archive's
own end-to-end case (it was ``test_migrate_archive.py``'s first test, merged here to spare a
cluster): no peer can run or hold the job (every peer's only GPU taken, none offering disk), so
at A's reclaim the final checkpoint goes to the archive with the job's keeper record (replacing
its live record where periodic copies were archived), nobody runs it while there is no room,
and the first peer with room claims it and resumes it from the archived checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from archiverig import body_of
from harness import Cluster, Node, wait_until
from test_migrate_archive import archived, finish
from test_migration import (  # noqa: F401  (fixtures: make_cluster, reference_sha)
    CKPT_EVERY,
    fill,
    find_migrated,
    gone,
    job_log,
    job_state,
    make_cluster,
    migrate_config,
    reference_sha,
    steps_of,
    submit,
    train_cmd,
)

from laminar.jobkit import latest_checkpoint
from laminar.migrate.archive_auth import ArchiveAuth, owner_body
from laminar.migrate.archive_claims import ARCHIVE_CLAIM_STALE_S
from laminar.migrate.archive_gc import ARCHIVE_DONE, ARCHIVE_TMP_STALE_S, ARCHIVE_TRASH
from laminar.migrate.mover import _manifest_facts
from laminar.runtime.spec import JobSpec
from laminar.zone.keys import parse_keys

pytestmark = pytest.mark.cluster

# Every agent sweeps the archive this often (``archive_gc_s``; 10 s by default): what the tests
# wait to go goes within a second, and what must stay is swept over many times while it stays.
SWEEP_S = 1.0
# A's reclaim notice. The final checkpoint is asked for late in the window (its planned cost
# before notice_margin of the window); with no transfer (no peer can take it) a short window
# leaves about the same time after the signal (~3 s) as a long one, and the archive comes sooner.
NOTICE = "5s"


def gc_counts(c: Cluster) -> dict[str, int]:
    """The archive sweep's counts summed over the live agents."""
    out: dict[str, int] = {}
    for nd in c.nodes:
        if nd.agent.proc is None or nd.agent.proc.poll() is not None:
            continue
        for k, v in nd.json("status")["migrate"]["counts"].items():
            if k.startswith("archive_gc_"):
                out[k] = out.get(k, 0) + int(v)
    return out


def empty_archive(arch: Path) -> bool:
    """Nothing left in the archive but the (empty) tombstone directory and the markers of
    claimed keys that ended or were superseded (``.done``: small files, kept 30 days)."""
    names = set(os.listdir(arch))
    return names <= {ARCHIVE_TRASH, ARCHIVE_DONE} and not (ARCHIVE_TRASH in names and os.listdir(arch / ARCHIVE_TRASH)) \
        and all(p.is_file() and p.stat().st_size < 4096 for p in (arch / ARCHIVE_DONE).glob("*"))


def swept(arch: Path, i: int) -> None:
    """Until an agent swept the archive once more: a directory with nothing in it, older than
    ARCHIVE_TMP_STALE_S (a crashed writer's), goes at the next sweep (``archive_gc_empty``)."""
    marker = arch / f"lmt-swept-{i}"
    marker.mkdir()
    old = time.time() - ARCHIVE_TMP_STALE_S - 60
    os.utime(marker, (old, old))
    wait_until(lambda: not marker.exists(), 30, f"a sweep of the archive (marker {marker.name} gone)", every=0.2)


def archived_and_claimed(make_cluster: Any, arch: Path, step_sleep: float, go: Path,  # noqa: F811
                         **extra: Any) -> tuple[Cluster, str, Node, dict[str, Any], int]:
    """A's job archived at its reclaim (no peer has room or disk), A gone, B's GPU freed: B claims
    and resumes it. (cluster, key, B, the resumed job, the step it resumed from).

    The job sleeps ``step_sleep`` per step, wherever it runs, until the test creates ``go``: it
    runs slowly while the test watches, and trains the rest at full speed once the test saw what
    it waited for (it would only wait out the sleeps)."""
    c = make_cluster(zones=1, per_zone=3, gpus=1, zone_extra=migrate_config(
        retry_base_s=0.5, retry_max_s=2.0, keeper_reserve_mb=1 << 29, archive_dir=f'"{arch}"',
        archive_gc_s=SWEEP_S, **extra))
    a, peers = c.nodes[0], c.nodes[1:]
    fillers = fill(c, peers)
    jid = submit(a, "--name", "train", "--", *train_cmd(step_sleep, sleep_until=go))
    key = f"n{a.node_id}-{jid}"
    wait_until(lambda: any(e["event"] == "checkpoint" for e in job_log(a, jid)), 60, "the job's first checkpoint")
    a.ctl("reclaim", "--notice", NOTICE)
    wait_until(lambda: a.json("migrations") and a.json("migrations")[0]["phase"] in ("archived", "failed"), 60,
               "the final checkpoint to leave A")
    move = a.json("migrations")[0]
    assert move["phase"] == "archived", move
    assert any(r.get("keeper") and not r["feasible"] for r in move["ranked"]), move["ranked"]  # no peer had disk
    held = int(move["ckpt"].removeprefix("ckpt-"))
    # the keeper record and the final checkpoint (a node with no room may hold a claim of it for a
    # moment, renamed back once it found none: claimed-<node>.json, then guard.json again)
    wait_until(lambda: archived(arch, key)["files"] == ["guard.json"], 30, "the archive's keeper record")
    st = archived(arch, key)
    assert st["files"] == ["guard.json"] and held in st["ckpts"], st
    assert job_state(a, jid)["state"] == "reclaimed"
    assert len([s for s in steps_of(job_log(a, jid)) if s > held]) <= CKPT_EVERY  # lost: only the steps after it
    gone(a)
    assert find_migrated(c, key) is None  # nobody has room yet: nobody runs it
    b = peers[0]
    b.ctl("job", "stop", fillers[b.node_id])
    found = wait_until(lambda: find_migrated(c, key), 60, "B to claim the archived job", every=0.3)
    assert found[0] is b
    wait_until(lambda: archived(arch, key)["files"] == [f"running-{b.node_id}.json"], 30, "the claim to run")
    # the claim becomes its running record, which says where the job runs (``resumed``)
    run_rec = arch / key / f"running-{b.node_id}.json"
    rec = wait_until(lambda: (r := body_of(run_rec)) and r.get("resumed") and r, 30,
                     "the running record to say where the job runs")
    assert rec["resumed"]["node"] == b.node_id and rec["resumed"]["job"] == found[1]["id"], rec  # where it runs
    return c, key, b, found[1], held


def test_the_claimed_directory_goes_once_the_resumed_jobs_own_checkpoint_is_archived(
        make_cluster, reference_sha, tmp_path):  # noqa: F811
    arch = tmp_path / "archive"
    go = tmp_path / "go"
    c, key, b, job, held = archived_and_claimed(make_cluster, arch, 0.2, go, prestage_unannounced=0.0)
    own = arch / f"n{b.node_id}-{job['id']}"

    def own_checkpoint_archived() -> bool:
        r = body_of(own / "live.json")
        return r is not None and not r.get("resumed_copy") and int(r["ckpt"].removeprefix("ckpt-")) > held

    wait_until(own_checkpoint_archived, 60, "the resumed job's own checkpoint in the archive", every=0.2)
    wait_until(lambda: not (arch / key).exists(), 60, "the claimed directory to go", every=0.3)
    assert gc_counts(c).get("archive_gc_superseded") == 1, gc_counts(c)  # the job still runs (slowly)
    go.touch()  # the rest of the run at full speed
    finish(c, key, b, held, reference_sha)  # the job did not need it: same final weights, one copy
    assert gc_counts(c).get("archive_gc_ended", 0) == 0
    wait_until(lambda: empty_archive(arch), 30, "the ended job's own copies to go")


def test_without_a_newer_archived_state_the_claimed_directory_stays_until_the_job_ends(
        make_cluster, reference_sha, tmp_path):  # noqa: F811
    arch = tmp_path / "archive"
    go = tmp_path / "go"
    c, key, b, job, held = archived_and_claimed(make_cluster, arch, 0.1, go, prestage_unannounced=1.0)
    ck = Path(job_state(b, job["id"])["ckpt_dir"])
    wait_until(lambda: (p := latest_checkpoint(ck)) is not None and int(p.name[5:]) > held, 60,
               "the resumed job's own checkpoint")
    for i in range(2):  # swept over (twice) while the job runs past its own checkpoint: it stays
        swept(arch, i)
    assert archived(arch, key)["files"] == [f"running-{b.node_id}.json"] and held in archived(arch, key)["ckpts"]
    assert not (arch / f"n{b.node_id}-{job['id']}").exists()  # periodic archiving is not due
    go.touch()  # the rest of the run at full speed
    finish(c, key, b, held, reference_sha)
    wait_until(lambda: not (arch / key).exists(), 60, "the ended job's claimed directory to go", every=0.3)
    counts = gc_counts(c)
    assert counts.get("archive_gc_ended") == 1 and counts.get("archive_gc_superseded", 0) == 0, counts
    assert counts.get("archive_gc_empty") == 2, counts  # swept()'s markers, nothing else
    assert b.json("status")["migrate"]["counts"]["archive_gc_ended"] == 1  # the agent that ran it
    # a removal renames the directory into the tombstone first, then removes it there
    wait_until(lambda: empty_archive(arch), 30, "the tombstone to be emptied", every=0.2)


def test_a_claim_whose_node_died_before_the_job_ran_is_kept_and_taken_over(
        make_cluster, reference_sha, tmp_path):  # noqa: F811
    arch = tmp_path / "archive"
    start = 45
    # a real checkpoint of the training run at step 45 (the run stopped there, outside any agent)
    cmd = train_cmd(0.0)
    cmd[cmd.index("--steps") + 1] = str(start)
    subprocess.run(cmd, env={"PATH": "/usr/bin:/bin", "LAMINAR_CKPT_DIR": str(tmp_path / "pre")},
                   capture_output=True, text=True, timeout=300, check=True)
    ckpt = latest_checkpoint(tmp_path / "pre")
    assert ckpt is not None and ckpt.name == f"ckpt-{start}"
    c = make_cluster(zones=1, per_zone=3, gpus=0, zone_extra=migrate_config(
        retry_base_s=0.5, retry_max_s=2.0, archive_dir=f'"{arch}"', archive_gc_s=SWEEP_S, prestage_unannounced=1.0))
    gone(c.nodes[2])
    # what node 3 left when it claimed its job-1000's record and died before running it, signed
    # as its agent signs (the zone's key)
    key = "n3-job-1000"
    d = arch / key
    d.mkdir(parents=True)
    os.chmod(d, 0o700)
    shutil.copytree(ckpt, d / ckpt.name)
    spec = JobSpec(command=train_cmd(0.05, after_resume=0), name="train").validate().as_dict()
    spec.pop("gpus")
    auth = ArchiveAuth(3, 1, parse_keys(c.keys_file.read_text()))
    rec = {"key": key, "src_node": 3, "src_job": "job-1000",
           "request": {"spec": spec, "owner_uid": 0, "owner_gid": 0, "gpus": 0}}
    owner = json.loads(auth.seal(owner_body("guard", rec, ckpt.name, *_manifest_facts(ckpt), time.time())))
    (d / "claimed-3.json").write_bytes(auth.seal({"kind": "claim", "key": key, "taken": owner, "from": "guard.json",
                                                  "ts": time.time() - ARCHIVE_CLAIM_STALE_S - 60}))
    nd, job = wait_until(lambda: find_migrated(c, key), 60, "an agent to take the stale claim over", every=0.3)
    runs = archived(arch, key)["files"]
    assert runs == [f"running-{nd.node_id}.json"], runs  # taken over by rename: one winner, the checkpoint kept
    finish(c, key, nd, start, reference_sha)
    wait_until(lambda: not d.exists(), 60, "the ended job's claimed directory to go", every=0.3)
    # a removal renames the directory into the tombstone first, then removes it there
    wait_until(lambda: empty_archive(arch), 30, "the tombstone to be emptied", every=0.2)


def test_a_job_whose_runner_died_before_anything_newer_was_archived_is_claimed_again(
        make_cluster, reference_sha, tmp_path):  # noqa: F811
    arch = tmp_path / "archive"
    go = tmp_path / "go"
    c, key, b, job, held = archived_and_claimed(make_cluster, arch, 0.1, go, prestage_unannounced=1.0,
                                                orphan_after_s=3.0)
    ck = Path(job_state(b, job["id"])["ckpt_dir"])
    wait_until(lambda: (p := latest_checkpoint(ck)) is not None and int(p.name[5:]) > held, 60,
               "the resumed job's own checkpoint (not archived: periodic archiving is not due)")
    gone(b)  # B leaves without notice, with the only progress past the claimed checkpoint
    go.touch()  # where it resumes next, the run trains at full speed
    third = c.nodes[2]
    for j in third.json("jobs"):
        if j["name"] == "filler" and j["state"] == "running":
            third.ctl("job", "stop", j["id"])
    finish(c, key, third, held, reference_sha)  # from the claimed checkpoint, one copy, same weights
    # what is left is the third node's running record, unless the sweep (every SWEEP_S) already
    # removed the ended job's directory: the next line waits for that
    assert archived(arch, key)["files"] in ([f"running-{third.node_id}.json"], [])
    wait_until(lambda: not (arch / key).exists(), 60, "the ended job's claimed directory to go", every=0.3)
