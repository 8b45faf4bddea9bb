"""A job that saves the same checkpoint step again while the sender reads it (real jobkit saves
on real files, a real Receiver and sender over loopback).

jobkit saves ``ckpt-<step>`` by writing a new directory and renaming it over the old one, so a
re-save of the same step replaces every file. The sender builds its transfer manifest in two
passes side by side (jobkit's check of each file, whose SHA-256 the manifest takes, and the
chunks' SHA-256), then opens the files again to send them. A re-save between those reads made
a manifest that described two versions, or files that no longer matched it: the transfer
failed (at the destination's final check: "the manifest is inconsistent", or at the source:
"it changed on the source disk"), fatal. Now the sender sees the change (each file's inode,
size, mtime; the directory's), builds the manifest again and sends what is there now, at
most MAX_SOURCE_CHANGES times; the destination still commits only what matches one manifest.

The re-save is placed between the passes by wrapping jobkit.verify_checkpoint (the first pass)
so it waits until the chunk pass has its files open: the placement is the test's, the save and
the files are real.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from xferrig import KEY, make_ckpt, rot, with_receiver

from laminar import jobkit
from laminar.migrate import transfer as T
from laminar.migrate.transfer import (
    Receiver,
    TransferError,
    manifest,
    send,
    send_checkpoint,
    verified_checkpoint,
)

KB = 1 << 10


def resave(ck: Path, data: bytes) -> None:
    """What the job does: saves the same step again (a new directory renamed over the old)."""
    step = int(ck.name[5:])
    jobkit.Checkpointer(job_id="j1", ckpt_dir=ck.parent, install_signal=False).save(data, step=step)


def between_the_passes(monkeypatch: pytest.MonkeyPatch, ck: Path, times: int) -> list[bytes]:
    """Re-saves ``ck`` inside the manifest's jobkit pass, once the chunk pass has opened the
    files, ``times`` times (one per manifest built); returns the states saved, in order."""
    saved: list[bytes] = []
    chunk_pass = threading.Event()
    real_verify, real_pread = jobkit.verify_checkpoint, manifest._pread_spans

    def pread(spans: Any, start: int, view: memoryview) -> int:
        if threading.current_thread().name.startswith("lm-xfer-manifest"):
            chunk_pass.set()
        return real_pread(spans, start, view)

    def verify(path: Any, **kw: Any) -> Any:
        if len(saved) < times and Path(path) == ck:
            assert chunk_pass.wait(10), "the chunk pass never started"
            chunk_pass.clear()
            saved.append(os.urandom((ck / "state.bin").stat().st_size))
            resave(ck, saved[-1])
        return real_verify(path, **kw)

    monkeypatch.setattr(manifest, "_pread_spans", pread)
    monkeypatch.setattr(jobkit, "verify_checkpoint", verify)
    return saved


def test_a_resave_between_the_manifest_passes_sends_the_new_checkpoint(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_ckpt(tmp_path, 600 * KB)
    saved = between_the_passes(monkeypatch, ck, times=1)

    async def body(rcv: Receiver, port: int) -> T.SendResult:
        return await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=64 * KB, retries=0)

    res = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert len(saved) == 1
    got = verified_checkpoint(res.remote_path)
    assert (got / "state.bin").read_bytes() == saved[0]  # the new one, whole
    assert (got / jobkit.MANIFEST).read_bytes() == (ck / jobkit.MANIFEST).read_bytes()
    jobkit.verify_checkpoint(got)


def test_a_resave_after_the_manifest_was_built_sends_the_new_checkpoint(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path, 600 * KB)
    m = T.build_manifest(ck, "j1", 64 * KB)
    new = os.urandom(600 * KB)
    resave(ck, new)  # the caller's manifest now describes files that are gone

    async def body(rcv: Receiver, port: int) -> T.SendResult:
        return await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=64 * KB, retries=0, manifest=m)

    res = asyncio.run(with_receiver(tmp_path / "rcv", body))
    got = verified_checkpoint(res.remote_path)
    assert (got / "state.bin").read_bytes() == new
    assert res.digest != m.digest


def test_a_resave_after_the_offer_restarts_the_transfer_and_the_destination_commits_only_the_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old checkpoint is offered (the destination sets up its partial), then the job saves
    again before the sender opens its files: the destination receives the new one from the
    start; nothing of the old one is committed."""
    ck = make_ckpt(tmp_path, 600 * KB)
    new = os.urandom(600 * KB)
    real_source = send._Source
    offers: list[str] = []

    def source(root: Path, m: T.Manifest) -> Any:
        offers.append(m.digest)
        if len(offers) == 1:
            resave(ck, new)
        return real_source(root, m)

    monkeypatch.setattr(send, "_Source", source)

    async def body(rcv: Receiver, port: int) -> tuple[T.SendResult, list[Any]]:
        res = await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=64 * KB, retries=0)
        return res, list(rcv.committed)

    res, committed = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert len(offers) == 2 and offers[0] != offers[1] == res.digest
    assert [c.digest for c in committed] == [res.digest]
    assert (verified_checkpoint(res.remote_path) / "state.bin").read_bytes() == new


def test_a_job_that_resaves_all_the_time_makes_the_sender_give_up_clearly_not_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_ckpt(tmp_path, 300 * KB)
    saved = between_the_passes(monkeypatch, ck, times=100)

    async def body(rcv: Receiver, port: int) -> list[Any]:
        with pytest.raises(TransferError) as e:
            await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=64 * KB, retries=3, retry_delay_s=0.01)
        assert e.value.fatal
        assert f"changed under the sender {send.MAX_SOURCE_CHANGES} times" in str(e.value), str(e.value)
        return list(rcv.committed)

    committed = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert len(saved) == send.MAX_SOURCE_CHANGES  # one manifest per change, then it stopped
    assert committed == []


def test_a_corrupt_source_is_still_refused_at_once_not_taken_for_a_resave(tmp_path: Path) -> None:
    """A byte changed under the manifest with no sign of a write (bit rot). The flip here is a
    write, so the test puts the file's old mtime back: to the sender it is the same file,
    changed. Fatal at once, as before, not retried as a re-save."""
    ck = make_ckpt(tmp_path, 300 * KB)
    m = T.build_manifest(ck, "j1", 64 * KB)
    rot(ck / "state.bin", 100 * KB)

    async def body(rcv: Receiver, port: int) -> None:
        with pytest.raises(TransferError, match="changed on the source disk") as e:
            await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=64 * KB, retries=3, manifest=m)
        assert e.value.fatal and not isinstance(e.value, T.SourceChangedError)

    asyncio.run(with_receiver(tmp_path / "rcv", body))


def test_a_hard_link_made_or_removed_is_not_a_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent snapshots a checkpoint by hard-linking the job's files, and jobkit removes old
    checkpoints: either moves the files' ctime, not their bytes. The sender's manifest stands."""
    ck = make_ckpt(tmp_path, 300 * KB)
    m = T.build_manifest(ck, "j1", 64 * KB)
    os.link(ck / "state.bin", tmp_path / "another-snapshot.bin")
    os.unlink(tmp_path / "another-snapshot.bin")
    builds: list[Path] = []
    real = manifest.build_manifest

    def counted(p: Any, *a: Any) -> T.Manifest:
        builds.append(Path(p))
        return real(p, *a)

    monkeypatch.setattr(send, "build_manifest", counted)

    async def body(rcv: Receiver, port: int) -> T.SendResult:
        return await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=64 * KB, retries=0, manifest=m)

    res = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert builds == [] and res.digest == m.digest and verified_checkpoint(res.remote_path)


def test_a_resave_that_left_a_corrupt_checkpoint_is_refused_at_once_not_retried_as_a_change(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path, 300 * KB)
    m = T.build_manifest(ck, "j1", 64 * KB)
    resave(ck, os.urandom(300 * KB))
    with open(ck / "state.bin", "r+b") as fh:  # the new one does not match its own MANIFEST.json
        fh.write(b"\x00" * 16)

    async def body(rcv: Receiver, port: int) -> None:
        with pytest.raises(TransferError) as e:
            await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=64 * KB, retries=3, manifest=m,
                                  retry_delay_s=0.01)
        assert e.value.fatal and "refusing to send" in str(e.value) and "changed under the sender" not in str(e.value)

    asyncio.run(with_receiver(tmp_path / "rcv", body))
