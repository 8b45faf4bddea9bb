"""What the archive keeps and what goes (Sweep.sweep, the claim's ``resumed`` note,
the resumed copy's mark in a live record, the stale-claim look): real files in a temporary
directory standing for the shared archive, real jobkit checkpoints verified against their
manifests, components with different node ids standing for agents that share the archive (two
of them sweeping at once in threads)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from archiverig import agent_of, mark_done, presigned, record, reseal, zone_of
from test_migrate_archive_live import files

from laminar.jobkit import Checkpointer, verify_checkpoint
from laminar.migrate.archive_claims import ARCHIVE_CLAIM_STALE_S
from laminar.migrate.archive_gc import (
    ARCHIVE_DONE,
    ARCHIVE_DONE_EXPIRE_EVERY_S,
    ARCHIVE_DONE_KEEP_S,
    ARCHIVE_TMP_STALE_S,
    ARCHIVE_TRASH,
)
from laminar.migrate.archive_view import LIVE_RECORD
from laminar.migrate.reclaim import ReclaimComponent
from laminar.runtime.spec import JobSpec

OLD = ARCHIVE_TMP_STALE_S + 60  # seconds: older than the limit


def ckpt_of(tmp: Path, name: str, step: int, data: bytes = b"weights") -> Path:
    return Checkpointer(job_id=name, ckpt_dir=tmp / name, install_signal=False, keep=5).save(data, step=step)


def age(path: Path, seconds: float) -> None:
    """Backdates ``path`` and everything under it (links themselves, not their targets)."""
    t = time.time() - seconds
    for top, dirs, fs in [] if path.is_symlink() else os.walk(path, followlinks=False):
        for n in dirs + fs:
            os.utime(os.path.join(top, n), (t, t), follow_symlinks=False)
    os.utime(path, (t, t), follow_symlinks=False)


def keeper_rec(key: str) -> dict[str, Any]:
    return record(key)


def claimed_and_running(arch: Path, tmp: Path, key: str, runner: ReclaimComponent, job: str) -> Path:
    """The job's node (``key``'s) archives it (a stopped job's keeper record); ``runner`` claims
    it and resumes it as ``job`` (what Claims.claim_and_resume does): the directory a claim leaves behind."""
    agent_of(int(key[1:].split("-")[0]), arch, keys=runner.agent.zone.keys).archive.stopped.publish(key, ckpt_of(tmp, key, 7),
                                                                                   keeper_rec(key))
    assert runner.archive.claims.claim(key)
    runner.archive.claims.claim_done(key, f"node {runner.node_id}", (runner.node_id, job))
    return arch / key


@pytest.fixture
def arch(tmp_path: Path) -> Path:
    return tmp_path / "arch"


def test_a_claim_leaves_its_checkpoint_and_a_running_record_naming_the_resumed_job(arch: Path, tmp_path: Path) -> None:
    b = agent_of(2, arch)
    d = claimed_and_running(arch, tmp_path, "n1-job-1", b, "job-5")
    assert files(d) == ["ckpt-7", "running-2.json"]  # what a claim used to leave forever
    r = json.loads((d / "running-2.json").read_text())["body"]
    assert r["resumed"]["node"] == 2 and r["resumed"]["job"] == "job-5" and r["record"]["body"]["ckpt"] == "ckpt-7"
    assert r["writer"] == 2 and r["record"]["body"]["writer"] == 1  # node 2's run record, holding node 1's record
    assert b.archive.runner("n1-job-1") == "2"


def test_the_claimed_dir_goes_once_the_resumed_jobs_own_checkpoint_is_archived(arch: Path, tmp_path: Path) -> None:
    a, b = agent_of(1, arch), agent_of(2, arch)
    b.agent.events = SimpleNamespace(emit=lambda *args, **kw: None)  # events are not what is tested here
    d1 = claimed_and_running(arch, tmp_path, "n1-job-1", b, "job-5")
    # node 2's resumed job, before it wrote a checkpoint: the one it resumed from is archived under
    # its own key (the periodic round), marked as that copy
    job = SimpleNamespace(id="job-5", spec=JobSpec(command=["train"], resume_from=str(d1 / "ckpt-7")),
                          owner_uid=0, owner_gid=0, gpus=[])
    asyncio.run(b.archive.periodic.copy_periodic(job, d1 / "ckpt-7"))
    d2 = arch / "n2-job-5"
    assert json.loads((d2 / LIVE_RECORD).read_text())["body"]["resumed_copy"] is True
    for sweeper in (a, b):  # the job may still be loading it: no agent removes it
        assert sweeper.archive.gc.sweep()["removed"] == {}
    assert files(d1) == ["ckpt-7", "running-2.json"]
    # the job writes its own checkpoint; it is archived: its newer state is safe without node 2
    own = ckpt_of(tmp_path, "job-5", 9, b"weights-9")
    asyncio.run(b.archive.periodic.copy_periodic(job, own))
    assert json.loads((d2 / LIVE_RECORD).read_text())["body"]["resumed_copy"] is False
    assert a.archive.gc.sweep()["removed"] == {"n1-job-1": "superseded"}  # any agent may remove it
    assert not d1.exists()
    assert files(d2) == ["ckpt-9", LIVE_RECORD] and verify_checkpoint(d2 / "ckpt-9")["step"] == 9
    assert a.counts["archive_gc_dirs"] == 1 and b.counts.get("archive_gc_dirs", 0) == 0
    assert os.listdir(arch / ARCHIVE_TRASH) == []


def test_the_claimed_dir_goes_when_the_resumed_job_ends_where_it_runs(arch: Path, tmp_path: Path) -> None:
    a, b = agent_of(1, arch), agent_of(2, arch)
    d = claimed_and_running(arch, tmp_path, "n1-job-1", b, "job-5")
    assert b.archive.gc.sweep({"n1-job-1": {"job-4"}})["removed"] == {}  # another job of node 2 ended
    assert a.archive.gc.sweep({"n1-job-1": {"job-5"}})["removed"] == {}  # node 1 does not run it
    assert d.exists()
    assert b.archive.gc.sweep({"n1-job-1": {"job-5"}})["removed"] == {"n1-job-1": "ended"}
    assert not d.exists() and b.counts["archive_gc_dirs"] == 1


def test_a_running_record_from_before_the_resumed_note_goes_only_at_its_runners_end(arch: Path, tmp_path: Path) -> None:
    a, b = agent_of(1, arch), agent_of(2, arch)
    k = "n1-job-1"
    a.archive.stopped.publish(k, ckpt_of(tmp_path, k, 7), keeper_rec(k))
    assert b.archive.claims.claim(k)
    b.archive.claims.claim_done(k, "node 2")  # no (node, job): where it runs is unknown to other agents
    assert a.archive.gc.sweep({k: {"job-5"}})["removed"] == {}
    assert b.archive.gc.sweep()["removed"] == {}
    assert b.archive.gc.sweep({k: {"job-5"}})["removed"] == {k: "ended"}


def test_a_claim_whose_claimant_died_is_kept_and_recoverable(arch: Path, tmp_path: Path) -> None:
    a, b, c = (agent_of(n, arch) for n in (1, 2, 3))
    key = "n1-job-1"
    a.archive.stopped.publish(key, ckpt_of(tmp_path, key, 7), keeper_rec(key))
    assert b.archive.claims.claim(key)  # node 2 claims it and dies before the job ran anywhere
    d = arch / key
    age(d / "claimed-2.json", ARCHIVE_CLAIM_STALE_S + 5)  # (its mtime says nothing)
    assert c.archive.claims.stale_claims(arch, time.time()) == []
    reseal(b, d / "claimed-2.json", ts=time.time() - ARCHIVE_CLAIM_STALE_S - 5)  # its signed note does
    for sweeper in (a, b, c):  # even with every temporary counted stale and the job "ended" everywhere
        assert sweeper.archive.gc.sweep({key: {"job-5"}}, tmp_stale_s=0)["removed"] == {}
    assert files(d) == ["ckpt-7", "claimed-2.json"]
    verify_checkpoint(d / "ckpt-7")
    assert [k for k, _ in c.archive.claims.stale_claims(arch, time.time())] == [key]  # the round's look finds it
    spawned: list[Any] = []
    c.archive.claims.claim_and_resume = lambda key, **kw: key  # type: ignore[method-assign,assignment]
    c._spawn = spawned.append  # type: ignore[method-assign,assignment]
    c.archive.claims.kept_here = lambda key: False  # type: ignore[method-assign]
    look = c.archive.look(arch, [], [], True, frozenset({3}), frozenset(), time.time())
    assert [k for k, _ in look["stale"]] == [key]
    c.archive.claims.start_claims(look, time.time())
    assert spawned == [key]  # and tries it
    c.takeover.taking.clear()
    assert b.archive.claims.stale_claims(arch, time.time()) == []  # its own claim is no other node's stale one
    assert c.archive.claims.claim(key)  # and takes it over (the stale-claim rule)
    c.archive.claims.claim_done(key, "node 3", (3, "job-8"))
    assert c.archive.claims.stale_claims(arch, time.time()) == []
    assert a.archive.gc.sweep()["removed"] == {}  # runs at node 3, nothing newer archived yet: kept


def test_a_successor_without_a_verified_checkpoint_of_its_own_keeps_the_claimed_dir(arch: Path, tmp_path: Path) -> None:
    a, b = agent_of(1, arch), agent_of(2, arch)
    d = claimed_and_running(arch, tmp_path, "n1-job-1", b, "job-5")
    b.archive.periodic.publish_live("n2-job-5", ckpt_of(tmp_path, "job-5", 9, b"own"), record("n2-job-5"))
    (arch / "n2-job-5" / "ckpt-9" / "state.bin").write_bytes(b"bit rot")  # fails its manifest
    assert a.archive.gc.sweep()["removed"] == {} and a.archive.gc.sweep()["removed"] == {}
    assert d.exists() and ("n2-job-5", "ckpt-9") in a.archive.gc.gc_unverified  # not hashed on every sweep


def test_stale_temporaries_go_young_ones_and_published_ones_stay(arch: Path, tmp_path: Path) -> None:
    a, b = agent_of(1, arch), agent_of(2, arch)
    key = "n1-job-1"
    a.archive.stopped.publish(key, ckpt_of(tmp_path, key, 7), keeper_rec(key))
    d = arch / key
    # crashed writers: a partial copy, a partial keeper record, a renamed-away live record
    (d / ".tmp-ckpt-9-3-1").mkdir()
    (d / ".tmp-ckpt-9-3-1" / "state.bin").write_bytes(b"half a checkpoint")
    (d / ".guard-3-1.tmp").write_text('{"key": ')
    (d / ".live-3-1.old").write_text("{}")
    for p in (".tmp-ckpt-9-3-1", ".guard-3-1.tmp", ".live-3-1.old"):
        age(d / p, OLD)
    # young ones: a copy in progress (an old directory whose file is being written now), a fresh record
    (d / ".tmp-ckpt-10-4-2").mkdir()
    (d / ".tmp-ckpt-10-4-2" / "state.bin").write_bytes(b"being written")
    age(d / ".tmp-ckpt-10-4-2", OLD)
    (d / ".tmp-ckpt-10-4-2" / "state.bin").write_bytes(b"being written, more")
    (d / ".live-4-2.tmp").write_text("{}")
    # an empty job directory left long ago, and a checkpoint with no record (a publish in
    # progress, or a crash's only copy)
    (arch / "n5-job-1").mkdir()
    age(arch / "n5-job-1", OLD)
    bare = arch / "n6-job-1"
    bare.mkdir()
    os.rename(ckpt_of(tmp_path, "bare", 3), bare / "ckpt-3")
    age(bare, OLD)
    # tombstones a crash left mid-removal: an old one goes, a young one is another agent's at work
    trash = arch / ARCHIVE_TRASH
    trash.mkdir()
    old_t = trash / f"n7-job-1.9.{time.time_ns() - int(OLD * 1e9)}"
    young_t = trash / f"n8-job-1.9.{time.time_ns()}"
    for t in (old_t, young_t):
        t.mkdir()
        (t / "x").write_text("x")

    res = b.archive.gc.sweep()
    assert res["removed"] == {"n5-job-1": "empty"}
    assert res["temporaries"] == 3 and res["tombstones"] == 1
    assert files(d) == [".live-4-2.tmp", ".tmp-ckpt-10-4-2", "ckpt-7", "guard.json"]
    verify_checkpoint(d / "ckpt-7")
    assert files(bare) == ["ckpt-3"]
    assert sorted(os.listdir(trash)) == [young_t.name]
    assert b.counts["archive_gc_temporaries"] == 4 and b.counts["archive_gc_dirs"] == 1
    # a writer whose temporary was taken fails its rename: nothing half-written is published
    with pytest.raises(FileNotFoundError):
        os.rename(d / ".tmp-ckpt-9-3-1", d / "ckpt-9")
    assert a.archive.gc.sweep()["temporaries"] == 0  # nothing stale left


def test_nothing_outside_the_archive_is_touched_and_links_are_not_followed(arch: Path, tmp_path: Path) -> None:
    a, b = agent_of(1, arch), agent_of(2, arch)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"a user's data")
    theirs = ckpt_of(tmp_path, "theirs", 9, b"someone else's")  # a valid checkpoint outside the archive
    d = claimed_and_running(arch, tmp_path, "n1-job-1", b, "job-5")
    os.symlink(outside, d / "ckpt-8")  # links inside a directory that goes
    os.symlink(outside / "precious.bin", d / "notes.bin")
    os.symlink(outside, d / ".tmp-ckpt-3-1-1")  # an old temporary that is a link
    age(d / ".tmp-ckpt-3-1-1", OLD)
    # the resumed job's key is a link to a valid checkpoint outside: not a copy in the archive
    os.symlink(theirs.parent.parent / "theirs-key", arch / "n2-job-5")
    (theirs.parent.parent / "theirs-key").mkdir()
    os.rename(theirs, theirs.parent.parent / "theirs-key" / "ckpt-9")
    (theirs.parent.parent / "theirs-key" / LIVE_RECORD).write_text(json.dumps({"ckpt": "ckpt-9"}))
    # a job directory that is a link out of the archive, looking removable
    os.symlink(outside, arch / "n3-job-3")
    (outside / "running-3.json").write_text(json.dumps({"resumed": {"node": 1, "job": "job-1"}}))
    res = a.archive.gc.sweep({"n3-job-3": {"job-1"}})
    assert res["removed"] == {} and res["temporaries"] == 1  # the link itself went
    assert a.counts["archive_unverified_link"] == 2  # the two key directories that are links: never followed
    assert d.exists() and os.path.islink(arch / "n2-job-5") and os.path.islink(arch / "n3-job-3")
    res = b.archive.gc.sweep({"n1-job-1": {"job-5"}, "n3-job-3": {"job-1"}})
    assert res["removed"] == {"n1-job-1": "ended"}
    assert sorted(os.listdir(outside)) == ["precious.bin", "running-3.json"]
    assert (outside / "precious.bin").read_bytes() == b"a user's data"
    verify_checkpoint(theirs.parent.parent / "theirs-key" / "ckpt-9")
    assert os.listdir(arch / ARCHIVE_TRASH) == []
    with pytest.raises(ValueError, match="not an entry of the archive"):
        a.archive.gc.tombstone(arch, outside / "precious.bin")
    assert (outside / "precious.bin").exists()


def test_a_trash_directory_that_is_a_link_out_stops_every_removal(arch: Path, tmp_path: Path) -> None:
    a = agent_of(2, arch)
    outside = tmp_path / "outside"
    outside.mkdir()
    d = claimed_and_running(arch, tmp_path, "n1-job-1", a, "job-5")
    os.symlink(outside, arch / ARCHIVE_TRASH)
    assert a.archive.gc.sweep({"n1-job-1": {"job-5"}})["removed"] == {}
    assert files(d) == ["ckpt-7", "running-2.json"] and os.listdir(outside) == []


def test_two_agents_sweeping_at_once_remove_each_directory_once(arch: Path, tmp_path: Path) -> None:
    owner, b = agent_of(1, arch), agent_of(2, arch)
    keys = [f"n1-job-{i}" for i in range(24)]
    ck = ckpt_of(tmp_path, "shared", 7)
    for i, k in enumerate(keys):
        owner.archive.stopped.publish(k, ck, keeper_rec(k))
        assert b.archive.claims.claim(k)
        b.archive.claims.claim_done(k, "node 2", (2, f"job-{100 + i}"))
        b.archive.periodic.publish_live(f"n2-job-{100 + i}", ckpt_of(tmp_path, f"own-{i}", 9), record(f"n2-job-{100 + i}"))
    kept = "n1-job-99"
    owner.archive.stopped.publish(kept, ck, keeper_rec(kept))  # unclaimed: stays whatever happens
    sweepers = [agent_of(3, arch), agent_of(4, arch)]
    results: list[dict[str, Any]] = []
    go = threading.Barrier(len(sweepers))

    def sweep(c: ReclaimComponent) -> None:
        go.wait()
        results.append(c.archive.gc.sweep())

    threads = [threading.Thread(target=sweep, args=(c,)) for c in sweepers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    removed = [set(r["removed"]) for r in results]
    assert removed[0].isdisjoint(removed[1]) and removed[0] | removed[1] == set(keys)
    assert sum(c.counts["archive_gc_dirs"] for c in sweepers) == len(keys)
    assert sorted(os.listdir(arch)) == sorted([ARCHIVE_TRASH, ARCHIVE_DONE, kept]
                                              + [f"n2-job-{100 + i}" for i in range(24)])
    assert os.listdir(arch / ARCHIVE_TRASH) == []
    assert sorted(os.listdir(arch / ARCHIVE_DONE)) == sorted(keys)  # each claimed key's marker, whole
    assert all(owner.archive.done(arch, k) == "2" for k in keys)
    assert files(arch / kept) == ["ckpt-7", "guard.json"]
    for i in range(24):
        verify_checkpoint(arch / f"n2-job-{100 + i}" / "ckpt-9")


def test_a_job_that_ends_removes_its_copies_through_a_tombstone(arch: Path, tmp_path: Path) -> None:
    a = agent_of(1, arch)
    a.archive.periodic.publish_live("n1-job-1", ckpt_of(tmp_path, "k", 5), record("n1-job-1"))
    assert a.archive.periodic.drop_live("n1-job-1")
    assert sorted(os.listdir(arch)) == [ARCHIVE_TRASH] and os.listdir(arch / ARCHIVE_TRASH) == []


def test_no_archive_configured_sweeps_nothing(tmp_path: Path) -> None:
    c = agent_of(1, tmp_path)
    c.s = {"archive_dir": ""}
    assert c.archive.gc.sweep() == {"removed": {}, "temporaries": 0, "tombstones": 0}


def test_a_job_whose_runner_died_before_anything_newer_was_archived_is_claimed_again(arch: Path, tmp_path: Path) -> None:
    a, b, c = (agent_of(n, arch) for n in (1, 2, 3))
    seen: dict[int, Any] = {}  # node -> its membership state (last_seen); absent: never heard from
    for x in (a, b, c):
        x.s.update(orphan_after_s=60.0, dead_after_s=10.0)
        x.agent.zone = zone_of(x.agent.zone.node_id)
        x.agent.zone.networked = True
        x.agent.zone.membership.state = seen
    key = "n1-job-1"
    d = claimed_and_running(arch, tmp_path, key, b, "job-5")
    seen[2] = SimpleNamespace(last_seen=time.time())
    assert c.archive.claims.dead_runs(arch, time.time()) == []  # node 2 runs it and is heard from
    seen[2] = SimpleNamespace(last_seen=time.time() - 61)
    assert c.archive.claims.dead_runs(arch, time.time()) == [(key, 2)]  # silent past orphan_after_s, nothing newer
    assert b.archive.claims.dead_runs(arch, time.time()) == []  # a node's own running record is not another's to take
    # once the job's own record is in the archive (its periodic copy), that is how it is recovered
    succ = arch / "n2-job-5"
    succ.mkdir()
    (succ / LIVE_RECORD).write_text(json.dumps(record("n2-job-5")))  # unsigned: says nothing
    assert c.archive.claims.dead_runs(arch, time.time()) == [(key, 2)]
    b.archive.periodic.publish_live("n2-job-5", ckpt_of(tmp_path, "own", 8), record("n2-job-5"))
    assert c.archive.claims.dead_runs(arch, time.time()) == []
    (succ / LIVE_RECORD).unlink()
    # one node wins the claim; the checkpoint it resumes from is the one the dead node ran from
    assert c.archive.claims.claim(key, dead_runner=2) and not a.archive.claims.claim(key, dead_runner=2)
    assert files(d) == ["ckpt-7", "claimed-3.json"]
    note = json.loads((d / "claimed-3.json").read_text())["body"]  # node 3's claim: node 2's running record it took
    assert note["from"] == "running-2.json" and note["taken"]["body"]["record"]["body"]["ckpt"] == "ckpt-7"
    verify_checkpoint(d / "ckpt-7")
    c.archive.claims.claim_done(key, "node 3", (3, "job-9"))
    resumed = json.loads((d / "running-3.json").read_text())["body"]["resumed"]
    assert (resumed["node"], resumed["job"]) == (3, "job-9")
    seen[3] = SimpleNamespace(last_seen=time.time())
    assert a.archive.claims.dead_runs(arch, time.time()) == []  # node 3 runs it now and is heard from


def test_a_keeper_that_missed_a_claim_the_sweep_removed_stands_down_and_publishes_nothing(arch: Path,
                                                                                      tmp_path: Path) -> None:
    """A keeper of ``n1-job-1`` (its node reclaimed the job with no room; the keeper waits for room)
    missed the claim: node 2 resumed the job from the archive as its job-5, whose own newer
    checkpoint is archived, and the sweep removed ``n1-job-1``'s directory. Before, the keeper
    found nothing archived at its next look, published its older checkpoint again (a copy that
    outlives it) and another agent resumed the job a second time (bench/chaos.py, a full zone).
    The sweep's marker (``.done/n1-job-1``) says it is archived and who ran it: the keeper
    stands down, and nothing of the key is published again."""
    key = "n1-job-1"
    b = agent_of(2, arch)
    claimed_and_running(arch, tmp_path, key, b, "job-5")
    b.archive.periodic.publish_live("n2-job-5", ckpt_of(tmp_path, "own", 9), record("n2-job-5"))  # its own newer state is safe
    assert agent_of(3, arch).archive.gc.sweep()["removed"] == {key: "superseded"}
    assert not (arch / key).exists()
    keeper = agent_of(4, arch)
    assert keeper.archive.claims.claim_archived(key) == (True, "2", False)  # "node 2 runs it": the keeper stands down
    assert keeper.archive.stopped.publish_unless_archived(key, ckpt_of(tmp_path, "held", 7), keeper_rec(key)) is None
    assert not (arch / key).exists()  # nothing published again: nothing to claim a second time
    # a key never claimed is archived as before, with the record its node signed for its keeper
    other = ckpt_of(tmp_path, "other", 3)
    assert keeper.archive.stopped.publish_unless_archived("n1-job-2", other, presigned(agent_of(1, arch), "n1-job-2", other))
    assert keeper.archive.claims.claim_archived("n1-job-2") == (True, None, True)
    # and never without one: only the job's node speaks for its job
    with pytest.raises(OSError, match="no signed record"):
        keeper.archive.stopped.publish_unless_archived("n1-job-3", other, keeper_rec("n1-job-3"))
    assert not (arch / "n1-job-3" / "guard.json").exists()


def test_done_markers_expire_by_their_signed_time_looked_over_once_an_hour(arch: Path, tmp_path: Path) -> None:
    """The sweep keeps each ``.done`` marker ARCHIVE_DONE_KEEP_S (30 days, by the time it signed) and then removes it;
    it looks the markers over once an hour, not at every sweep (``archive_gc_s``, seconds): on
    shared storage their listing grows with the claims."""
    a = agent_of(2, arch)
    done = arch / ARCHIVE_DONE
    keep = ARCHIVE_DONE_KEEP_S
    now = time.time()
    mark_done(a, "n1-job-1", 2, at=now - keep - 60)
    for k in ("n1-job-2", "n1-job-3"):
        mark_done(a, k, 2, at=now)
    (done / "n1-job-4").write_text(json.dumps({"key": "n1-job-4", "runner": "2"}))  # unsigned: no marker at all
    age(done / "n1-job-4", keep + 60)
    assert a.archive.done(arch, "n1-job-4") is None
    age(done / "n1-job-3", keep + 60)  # its file's mtime says nothing: its signed time does
    a.archive.gc.sweep(now=now)
    assert sorted(os.listdir(done)) == ["n1-job-2", "n1-job-3", "n1-job-4"]  # past the keep: gone; others stay
    mark_done(a, "n1-job-2", 2, at=now - keep - 60)
    a.archive.gc.sweep(now=now + 10)  # the next sweep, minutes later: not looked over again yet
    assert sorted(os.listdir(done)) == ["n1-job-2", "n1-job-3", "n1-job-4"]
    a.archive.gc.sweep(now=now + ARCHIVE_DONE_EXPIRE_EVERY_S + 1)
    assert sorted(os.listdir(done)) == ["n1-job-3", "n1-job-4"]  # (one that does not verify is an operator's)
    assert a.archive.done(arch, "n1-job-3") == "2"
