"""Periodic checkpoints in the archive (PeriodicCopies.publish_live/drop_live and the claim of a
live record): real files in a temporary directory, components with different node ids standing
for agents that share the archive (tests/archiverig.py: signed records), real jobkit checkpoints."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from archiverig import agent_of, mark_done, record, reseal

from laminar.jobkit import Checkpointer, CheckpointError, verify_checkpoint
from laminar.migrate import archive_fs
from laminar.migrate.archive_gc import ARCHIVE_TMP_STALE_S
from laminar.migrate.archive_view import LIVE_RECORD

K = "n1-job-1"


@pytest.fixture
def job(tmp_path: Path) -> Checkpointer:
    return Checkpointer(job_id="j1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=3)


def rec(keeper: int | None = 2) -> dict[str, object]:
    return record(K, keeper, periodic=True)


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_the_newest_complete_periodic_checkpoint_is_kept(tmp_path: Path, job: Checkpointer) -> None:
    a = agent_of(1, tmp_path / "arch")
    d = tmp_path / "arch" / K
    c5 = job.save(b"weights-5", step=5)
    assert a.archive.periodic.publish_live(K, c5, rec()) == d / "ckpt-5"
    assert files(d) == ["ckpt-5", LIVE_RECORD]
    c10 = job.save(b"weights-10", step=10)
    assert a.archive.periodic.publish_live(K, c10, rec()) == d / "ckpt-10"
    assert files(d) == ["ckpt-10", LIVE_RECORD]  # the older one is gone, no temporary left
    verify_checkpoint(d / "ckpt-10")
    r = json.loads((d / LIVE_RECORD).read_text())["body"]
    assert r["ckpt"] == "ckpt-10" and r["src_node"] == 1 and r["buddy"] == 2 and r["writer"] == 1


def test_a_corrupt_or_partial_copy_is_never_published(tmp_path: Path, job: Checkpointer) -> None:
    a = agent_of(1, tmp_path / "arch")
    d = tmp_path / "arch" / K
    a.archive.periodic.publish_live(K, job.save(b"weights-5", step=5), rec())
    bad = job.save(b"weights-10", step=10)
    (bad / "state.bin").write_bytes(b"tampered")
    with pytest.raises(CheckpointError):
        a.archive.periodic.publish_live(K, bad, rec())
    assert files(d) == ["ckpt-5", LIVE_RECORD]  # the record still names the complete one
    assert json.loads((d / LIVE_RECORD).read_text())["body"]["ckpt"] == "ckpt-5"
    # a leftover of the same name without its manifest (a crash mid-copy) is replaced, not trusted
    c15 = job.save(b"weights-15", step=15)
    (d / "ckpt-15").mkdir()
    (d / "ckpt-15" / "state.bin").write_bytes(b"half")
    a.archive.periodic.publish_live(K, c15, rec())
    verify_checkpoint(d / "ckpt-15")
    assert files(d) == ["ckpt-15", LIVE_RECORD]


def test_a_job_that_ends_removes_its_archived_copies(tmp_path: Path, job: Checkpointer) -> None:
    a = agent_of(1, tmp_path / "arch")
    a.archive.periodic.publish_live(K, job.save(b"w", step=5), rec())
    assert a.archive.periodic.drop_live(K)
    assert not (tmp_path / "arch" / K).exists()
    assert not a.archive.periodic.drop_live(K)  # nothing left to remove


def test_only_a_claim_for_a_dead_job_takes_a_live_record_and_it_is_the_lock(tmp_path: Path, job: Checkpointer) -> None:
    a, b, c = (agent_of(n, tmp_path / "arch") for n in (1, 2, 3))
    d = tmp_path / "arch" / K
    a.archive.periodic.publish_live(K, job.save(b"w5", step=5), rec())
    assert not c.archive.claims.claim(K)  # a live record is no stopped job's keeper record
    assert c.archive.claims.claim(K, live=True)  # node 3 decided node 1 and its keeper are gone
    assert not b.archive.claims.claim(K, live=True)  # one winner
    # node 1 was not dead after all (slow): its next archive does not publish a second record
    assert a.archive.periodic.publish_live(K, job.save(b"w10", step=10), rec()) is None
    assert sorted(p.name for p in d.glob("*.json")) == ["claimed-3.json"]
    assert "ckpt-5" in files(d)  # the claimed record's checkpoint is kept
    assert not a.archive.periodic.drop_live(K)  # the job ending at node 1 does not remove what node 3 claimed
    assert "ckpt-5" in files(d)
    c.archive.claims.unclaim(K)  # node 3 found no room: given back as it was, a running job's live record
    assert sorted(p.name for p in d.glob("*.json")) == [LIVE_RECORD]
    # not a stopped job's keeper record, which any agent with room claims at once: node 1 (slow,
    # not dead) still runs the job, and only its and its keeper's death make it claimable
    assert not b.archive.claims.claim(K)
    assert b.archive.claims.claim(K, live=True)
    b.archive.claims.unclaim(K)
    assert sorted(p.name for p in d.glob("*.json")) == [LIVE_RECORD]
    # node 1 goes on publishing its periodic checkpoints (a keeper record would have stopped that)
    assert a.archive.periodic.publish_live(K, job.save(b"w15", step=15), rec()) is not None


def test_a_dead_runners_record_is_given_back_as_it_was(tmp_path: Path, job: Checkpointer) -> None:
    a, c = (agent_of(n, tmp_path / "arch") for n in (1, 3))
    d = tmp_path / "arch" / K
    a.archive.periodic.publish_live(K, job.save(b"w5", step=5), rec())
    assert a.archive.claims.claim(K, live=True)
    a.archive.claims.claim_done(K, "node 1", (1, "job-9"))  # node 1 resumed it from the archive, then died
    assert c.archive.claims.claim(K, dead_runner=1)
    c.archive.claims.unclaim(K)  # no room at node 3: the dead runner's record again, not a keeper record
    assert sorted(p.name for p in d.glob("*.json")) == ["running-1.json"]
    assert not c.archive.claims.claim(K) and not c.archive.claims.claim(K, live=True)
    assert c.archive.claims.claim(K, dead_runner=1)


def test_a_stopped_jobs_keeper_record_given_back_is_a_keeper_record(tmp_path: Path, job: Checkpointer) -> None:
    a, c = (agent_of(n, tmp_path / "arch") for n in (1, 3))
    d = tmp_path / "arch" / K
    a.archive.stopped.publish(K, job.save(b"w5", step=5), rec() | {"periodic": False})
    assert c.archive.claims.claim(K)
    c.archive.claims.unclaim(K)
    assert sorted(p.name for p in d.glob("*.json")) == ["guard.json"]


def test_a_stopped_jobs_keeper_record_replaces_its_live_record(tmp_path: Path, job: Checkpointer) -> None:
    a = agent_of(1, tmp_path / "arch")
    d = tmp_path / "arch" / K
    a.archive.periodic.publish_live(K, job.save(b"w5", step=5), rec())
    final = job.save(b"w7", step=7)
    a.archive.stopped.publish(K, final, record(K))
    assert sorted(p.name for p in d.glob("*.json")) == ["guard.json"]  # one claimable record
    assert json.loads((d / "guard.json").read_text())["body"]["ckpt"] == "ckpt-7"
    assert not [p for p in d.iterdir() if p.name.startswith(".")]
    # a periodic checkpoint written later does not re-arm a live record beside it
    assert a.archive.periodic.publish_live(K, job.save(b"w9", step=9), rec()) is None
    assert not (d / LIVE_RECORD).exists()


def test_the_rule_follows_the_learned_unannounced_share(tmp_path: Path) -> None:
    a = agent_of(1, tmp_path / "arch")
    assert a.archive.periodic.periodic_due()  # the prior: every departure may come without notice
    for _ in range(200):
        a.evidence.notice_odds.observe(announced=True)
    assert a.evidence.notice_odds.unannounced_frac < 0.02 and not a.archive.periodic.periodic_due()
    a.s["archive_dir"] = ""
    a.evidence.notice_odds = type(a.evidence.notice_odds)()
    assert not a.archive.periodic.periodic_due()  # no archive configured


def test_a_live_record_waits_for_the_newer_copy_its_node_still_makes_and_no_longer(
        tmp_path: Path, job: Checkpointer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1's reclaim window ended (it counts as dead) while its agent, still heard from,
    copies the job's final checkpoint into the archive (late: the archive hung). Node 3, with room,
    does not claim the job's older live record while that copy goes on, for at most the progress
    the copy holds (rent-or-buy); a silent node 1, or no newer copy, is not waited for."""
    arch = tmp_path / "arch"
    a, c = agent_of(1, arch), agent_of(3, arch)
    d = arch / K
    a.archive.periodic.publish_live(K, job.save(b"w5", step=5), rec(keeper=None))
    live = json.loads((d / LIVE_RECORD).read_text())["body"]
    reseal(a, d / LIVE_RECORD, ts=live["ts"] - 30.0)  # the periodic copy was 30 s before the final checkpoint's
    final = job.save(b"w10", step=10)

    # node 1's copy of ckpt-10 is under way: its temporary is made, its copy hangs
    go, copying = threading.Event(), threading.Event()
    copy = archive_fs.copy_checkpoint

    def slow_copy(src: int, dst: int | None, raw: bytes, where: str, *a: Any) -> Any:
        if dst is not None and where.endswith("ckpt-10"):
            copying.set()
            assert go.wait(30)
        return copy(src, dst, raw, where, *a)

    monkeypatch.setattr(archive_fs, "copy_checkpoint", slow_copy)
    t = threading.Thread(target=a.archive.stopped.publish, args=(K, final, record(K)))
    t.start()
    try:
        assert copying.wait(30)
        wall = time.time()
        c.s.update(dead_after_s=10.0, orphan_after_s=60.0)
        c.notices = {1: (wall - 1.0, wall - 7.0)}  # node 1's window ended a second ago
        heard = {1: wall}
        c._last_seen = lambda n: heard.get(n, -1.0)  # type: ignore[method-assign]
        c.archive.claims.kept_here = lambda key: False  # type: ignore[method-assign]
        events: list[dict[str, Any]] = []
        c._emit = lambda msg, **f: events.append({"message": msg, **f})  # type: ignore[method-assign]
        claimed: list[tuple[str, bool]] = []
        c.archive.claims.claim_and_resume = lambda key, live=False, **kw: (key, live)  # type: ignore[method-assign,assignment]
        c._spawn = claimed.append  # type: ignore[method-assign,assignment]

        def round_() -> None:
            c.archive.claims.start_claims(c.archive.look(arch, [], [], True, frozenset({3}), frozenset(), time.time()), time.time())

        assert c.takeover.source_dead(1, time.time()) == "node 1's reclaim window ended"
        round_()
        assert claimed == [] and [e["phase"] for e in events] == ["archive-live-wait"]
        assert "ckpt-10" in events[0]["message"] and events[0]["ckpt"] == "ckpt-5"
        c.archive.claims.live_waits[K] -= 20.0  # 20 s in: the copy holds about 30 s of progress
        round_()
        assert claimed == [] and len(events) == 1
        c.archive.claims.live_waits[K] -= 11.0  # past the progress it would save: the older record is claimed
        round_()
        assert claimed == [(K, True)] and events[-1]["phase"] == "archive-live-waited"
        assert c.archive.claims.live_waits == {}

        claimed.clear()
        c.takeover.taking.clear()  # (that take-over found no room and gave the record back)
        heard[1] = time.time() - 11.0  # node 1 silent past dead_after_s: not waited for
        round_()
        assert claimed == [(K, True)]
    finally:
        go.set()
        t.join(30)
    # the newer copy landed (nothing claimed it in this test): its keeper record replaced the live one
    assert sorted(p.name for p in d.glob("*.json")) == ["guard.json"]
    claimed.clear()
    look = c.archive.look(arch, [], [], True, frozenset({3}), frozenset(), time.time())
    assert look["lives"] == [] and look["keepers"] == [K]


def test_a_live_record_with_no_newer_copy_or_only_a_stale_one_is_claimed_at_once(
        tmp_path: Path, job: Checkpointer) -> None:
    arch = tmp_path / "arch"
    a = agent_of(1, arch)
    d = arch / K
    a.archive.periodic.publish_live(K, job.save(b"w5", step=5), rec(keeper=None))
    look = lambda: agent_of(3, arch).archive.look(arch, [], [], True, frozenset({3}), frozenset(), time.time())  # noqa: E731
    assert look()["lives"] == [(K, 1, None, None)]
    (d / ".tmp-ckpt-3-1-5").mkdir()  # an older checkpoint's copy: not newer
    (d / ".tmp-ckpt-9-2-5").mkdir()  # another node's
    assert look()["lives"] == [(K, 1, None, None)]
    stale = d / ".tmp-ckpt-9-1-5"
    stale.mkdir()
    assert look()["lives"][0][3][:2] == ("ckpt-5", "ckpt-9")
    # node 1 alive (it runs the job): its record is not claimable, and not looked into
    assert agent_of(3, arch).archive.look(arch, [], [], True, frozenset({1, 3}), frozenset(), time.time())["lives"] == []
    old = time.time() - ARCHIVE_TMP_STALE_S - 60
    os.utime(stale, (old, old))  # a crashed writer's leftover
    assert look()["lives"] == [(K, 1, None, None)]



def test_a_live_record_written_lately_by_a_node_only_silent_is_not_claimed(tmp_path: Path, job: Checkpointer) -> None:
    """Node 1 is silent in the zone (a partition) but still writes its job's live record to the
    archive: a record younger than ``orphan_after_s`` says its node is alive, so node 3 does not
    claim it (bench/chaos.py --long-partitions: a partitioned node's new record was claimed a
    second after it was written, and the job ran twice). A node whose reclaim window ended is
    asked before the claim instead (``Claims.claim_and_resume``'s ``ask``), and an older record is claimable."""
    arch = tmp_path / "arch"
    agent_of(1, arch).archive.periodic.publish_live(K, job.save(b"w5", step=5), rec(keeper=None))
    c = agent_of(3, arch)
    c.s["orphan_after_s"] = 30.0
    look = lambda: c.archive.look(arch, [], [], True, frozenset({3}), frozenset(), time.time())  # noqa: E731
    assert look()["lives"] == []
    now = time.time()
    c.notices = {1: (now - 1.0, now - 10.0)}  # its reclaim window ended a second ago
    assert look()["lives"] == [(K, 1, None, None)]
    c.notices = {}
    os.utime(arch / K / LIVE_RECORD, (now - 31.0, now - 31.0))  # a file's mtime is anyone's to set: not read
    assert look()["lives"] == []
    reseal(agent_of(1, arch), arch / K / LIVE_RECORD, ts=now - 31.0)  # written 31 s ago: its node may be gone
    assert look()["lives"] == [(K, 1, None, None)]


def test_a_copy_still_running_after_its_key_was_claimed_and_swept_publishes_no_live_record(
        tmp_path: Path, job: Checkpointer) -> None:
    """Node 2, cut off, runs on a job whose key another node claimed, ran and whose directory the
    sweep removed (leaving ``.done/<key>``): its next periodic copy must not publish a live
    record there, which a third node would claim and run again (bench/chaos.py)."""
    arch = tmp_path / "arch"
    mark_done(agent_of(3, arch), K, 1)
    assert agent_of(2, arch).archive.periodic.publish_live(K, job.save(b"w5", step=5), rec(keeper=None)) is None
    assert not (arch / K / LIVE_RECORD).exists()


def test_an_ended_jobs_live_record_claimed_meanwhile_is_dropped_once_given_back(tmp_path: Path, job: Checkpointer) -> None:
    """Node 1's job ends (stopped: another node runs it now) while node 3, which took node 1 for
    gone, holds a claim of its live record and has not run it. The drop cannot take the record
    then; before, it was never tried again, and when node 3 gave the claim back (no room) the
    ended job's record was claimable again: a node resumed a lineage that had ended
    (bench/chaos.py --fence-after-s, seed 29). Now the round says to drop it again, and the next
    one does."""
    arch = tmp_path / "arch"
    a, c = agent_of(1, arch), agent_of(3, arch)
    key = "n1-job-1"
    a.archive.periodic.publish_live(key, job.save(b"w5", step=5), rec())
    assert c.archive.claims.claim(key, live=True)

    def look() -> dict[str, object]:
        return a.archive.look(arch, ["job-1"], [], False, frozenset(), frozenset(), time.time())

    first = look()
    assert first["dropped"] == [] and first["drop_again"] == ["job-1"]
    c.archive.claims.unclaim(key)  # no room at node 3: given back as a live record
    assert (arch / key / LIVE_RECORD).exists()
    second = look()
    assert second["dropped"] == ["job-1"] and second["drop_again"] == []
    assert not (arch / key).exists() or not (arch / key / LIVE_RECORD).exists()
    # a claim its node runs is that node's: not tried again
    a.archive.periodic.publish_live("n1-job-2", job.save(b"w6", step=6), record("n1-job-2", periodic=True))
    assert c.archive.claims.claim("n1-job-2", live=True)
    c.archive.claims.claim_done("n1-job-2", "node 3")
    third = a.archive.look(arch, ["job-2"], [], False, frozenset(), frozenset(), time.time())
    assert third["dropped"] == [] and third["drop_again"] == []


def test_a_job_that_ended_leaves_a_marker_that_stands_its_keeper_down(tmp_path: Path, job: Checkpointer) -> None:
    """Node 1's job ends (exit 0) while node 1 is cut off from its keeper, node 2, which misses
    the release. Before, the keeper took the ended job over once node 1 had been silent for
    orphan_after_s and ran its last steps, and its end, a second time (bench/chaos.py
    --fence-after-s, seed 31). Now the round that drops the ended job's live record leaves the
    archive's done marker naming node 1, and the keeper's take-over meets it: it stands down."""
    arch = tmp_path / "arch"
    a, b = agent_of(1, arch), agent_of(2, arch)
    key = "n1-job-1"
    a.archive.periodic.publish_live(key, job.save(b"w5", step=5), rec())
    look = a.archive.look(arch, ["job-1"], [], False, frozenset(), frozenset(), time.time())
    assert look["dropped"] == ["job-1"]
    assert a.archive.done(arch, key) == "node 1"
    assert b.archive.claims.claim_archived(key) == (True, "node 1", False)  # archived, run there: not claimed
    assert b.archive.claims.claim_archived("n1-job-9") == (False, None, False)  # (a key that never ended: as before)
