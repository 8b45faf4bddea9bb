"""The agent's look at a job's checkpoint directory (laminar.runtime.ckpt_scan) and the limits of
a check of a job's checkpoint (jobkit.Limits), on real directories: links, FIFOs, many entries,
a sparse file. No privileges: links to /etc/shadow and hung mounts are the kernel test's
(tests/kernel/test_ckpt_dir_attack.py); here a link to a directory stands for them."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from laminar import jobkit
from laminar.migrate import ckpt_driver as cd
from laminar.runtime import ckpt_scan as cs


def old(p: Path) -> None:
    """Puts ``p``'s modification time an hour back (a directory not changed lately: not racy)."""
    t = time.time() - 3600
    os.utime(p, (t, t), follow_symlinks=False)


def test_a_listing_takes_checkpoint_directories_only_and_follows_nothing(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    ck = jobkit.Checkpointer("j", d, install_signal=False, keep=10)
    real = [ck.save(b"x", step=n) for n in (3, 1, 20)]
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "ckpt-99").mkdir(parents=True)
    (d / "ckpt-50").symlink_to(elsewhere / "ckpt-99")  # a link of a checkpoint's name: none
    os.mkfifo(d / "ckpt-60")  # a FIFO: never opened
    (d / "ckpt-70").write_text("a file")
    (d / "ckpt-7x").mkdir()  # not a checkpoint's name
    (d / "notes").mkdir()
    got = cs.scan_dir(d)
    assert got is not None and got.paths() == sorted(real, key=lambda p: int(p.name[5:]))
    assert got.entries == 8 and not got.truncated
    assert jobkit.list_checkpoints(d) == got.paths()  # the job's own view agrees, links not followed either


def test_a_directory_that_is_a_link_is_no_listing(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert cs.scan_dir(tmp_path / "link") is None
    assert cs.scan_dir(tmp_path / "missing") is None


def test_a_listing_reads_at_most_its_entries_and_keeps_the_highest_numbers(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    for n in range(3000):
        (d / f"ckpt-{n}").mkdir()
    got = cs.scan_dir(d, max_entries=500, keep=4)
    assert got is not None and got.entries == 500 and got.truncated
    assert len(got.ckpts) == 4
    steps = [int(n[5:]) for n, _ in got.ckpts]
    assert steps == sorted(steps)  # oldest first, as list_checkpoints
    full = cs.scan_dir(d, keep=4)
    assert full is not None and not full.truncated and [n for n, _ in full.ckpts] == [
        "ckpt-2996", "ckpt-2997", "ckpt-2998", "ckpt-2999"]


def test_an_unchanged_directory_is_not_read_again(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    jobkit.Checkpointer("j", d, install_signal=False).save(b"x", step=1)
    old(d)
    first = cs.scan_dir(d)
    assert first is not None and not first.racy
    (d / "ckpt-9").mkdir()
    os.utime(d, ns=(first.key[2], first.key[2]))  # its key put back: what a read would now find differs
    again = cs.scan_dir(d, first)
    assert again is not None and again.ckpts == first.ckpts and again.at >= first.at  # not read: the key held
    old(d)  # a change of the key: read again
    assert [n for n, _ in cs.scan_dir(d, first).ckpts] == ["ckpt-1", "ckpt-9"]  # type: ignore[union-attr]


def test_a_recent_change_is_read_again_whatever_the_key(tmp_path: Path) -> None:
    """A file system's timestamps are coarse: a second change within the same tick does not move
    the directory's mtime. A listing taken less than RACY_S after a change is not trusted."""
    d = tmp_path / "ck"
    jobkit.Checkpointer("j", d, install_signal=False).save(b"x", step=1)
    first = cs.scan_dir(d)
    assert first is not None and first.racy
    (d / "ckpt-2").mkdir()
    os.utime(d, ns=(first.key[2], first.key[2]))
    assert [n for n, _ in cs.scan_dir(d, first).ckpts] == ["ckpt-1", "ckpt-2"]  # type: ignore[union-attr]


def test_the_scanner_sets_the_jobs_last_checkpoint_time_and_groups_owners(tmp_path: Path) -> None:
    jobs = [SimpleNamespace(id=f"job-{i}", ckpt_dir=tmp_path / f"j{i}", owner_uid=i % 2, ckpt_seen=None)
            for i in range(4)]
    for j in jobs[:3]:
        jobkit.Checkpointer(j.id, j.ckpt_dir, install_signal=False).save(b"x", step=1)
    scanner = cs.CkptScanner()

    async def main() -> None:
        await scanner.refresh_all(jobs)

    asyncio.run(main())
    for j in jobs[:3]:
        listing = scanner.cached(j.id)
        assert listing is not None and [n for n, _ in listing.ckpts] == ["ckpt-1"]
        assert j.ckpt_seen == pytest.approx(os.lstat(j.ckpt_dir).st_mtime)
    assert scanner.cached("job-3") is None and jobs[3].ckpt_seen is None  # no directory
    assert scanner.lane.stats()["done"] == 2  # one thread per owner, not per job
    scanner.keep_only(["job-0"])
    assert scanner.cached("job-1") is None and scanner.cached("job-0") is not None


def test_a_check_refuses_a_sparse_file_and_a_huge_declared_size_unread(tmp_path: Path) -> None:
    ck = jobkit.Checkpointer("j", tmp_path / "ck", install_signal=False, keep=10)
    good = ck.save(b"state", step=1)
    sparse = ck.save(b"x", step=2)
    big = 4 << 30
    with open(sparse / "state.bin", "r+b") as f:  # 4 GiB of holes, the manifest says so
        f.truncate(big)
    m = jobkit.read_manifest(sparse)
    m["files"][0]["size"] = big
    (sparse / jobkit.MANIFEST).write_text(__import__("json").dumps(m))
    limits = jobkit.Limits(max_bytes=1 << 40, refuse_sparse=True)
    t0 = time.monotonic()
    with pytest.raises(jobkit.CheckpointError, match="sparse"):
        jobkit.verify_checkpoint(sparse, limits=limits)
    with pytest.raises(jobkit.CheckpointError, match="declares 4294967\\d+ bytes, more than the 1024"):
        jobkit.verify_checkpoint(sparse, limits=jobkit.Limits(max_bytes=1024))
    assert time.monotonic() - t0 < 2.0  # refused, not hashed
    assert jobkit.latest_checkpoint(tmp_path / "ck", limits=limits) == good


def test_a_check_stops_at_its_deadline_and_tries_a_few_newest_only(tmp_path: Path) -> None:
    ck = jobkit.Checkpointer("j", tmp_path / "ck", install_signal=False, keep=100)
    ck.save(os.urandom(4 << 20), step=1)
    with pytest.raises(jobkit.CheckpointError, match="ran out of time"):
        jobkit.verify_checkpoint(tmp_path / "ck" / "ckpt-1", limits=jobkit.Limits(deadline=time.monotonic() - 1))
    bad = [ck.save(b"x", step=n) for n in range(2, 12)]
    for p in bad:
        (p / "state.bin").write_bytes(b"y")  # each fails its manifest
    tried: list[str] = []
    real = jobkit.verify_checkpoint

    def spy(p: Path, **kw: object) -> object:
        tried.append(Path(p).name)
        return real(p, **kw)  # type: ignore[arg-type]

    jobkit.verify_checkpoint = spy  # type: ignore[assignment]
    try:
        s = {"verify_tries": 3, "verify_max_bytes": 1 << 40, "verify_timeout_s": 60.0}
        got, _, info = cd.check_newest(jobkit.list_checkpoints(tmp_path / "ck"), s)
    finally:
        jobkit.verify_checkpoint = real  # type: ignore[assignment]
    assert got is None and info is None and tried == ["ckpt-11", "ckpt-10", "ckpt-9"]


def test_a_checks_error_names_a_few_extra_files_not_a_million(tmp_path: Path) -> None:
    p = jobkit.Checkpointer("j", tmp_path / "ck", install_signal=False).save(b"x", step=1)
    for i in range(500):
        (p / f"junk-{i}").touch()
    with pytest.raises(jobkit.CheckpointError) as e:
        jobkit.verify_checkpoint(p)
    assert "and more" in str(e.value) and len(str(e.value)) < 600
