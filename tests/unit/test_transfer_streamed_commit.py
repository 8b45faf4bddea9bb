"""The destination's commit of a transfer whose largest file arrived in order (real jobkit
checkpoints, a real Receiver and sender over loopback).

Before, the commit copied every file out of the partial file and then read all of it back
twice (every chunk's SHA-256 beside jobkit's of every file): for a checkpoint of N GiB about
1.2 s per GiB on this machine, after the last byte arrived and before the job could restart.
Now the sender puts the largest file first, the destination hashes that file's bytes as it
writes them while its chunks come in order on one connection, and the commit moves the partial
file into place as that file (no copy, no second read); the other files are still copied and
read back, and the chunks are hashed only when a file fails, to name the ones to send again.

What a user relies on, and what these tests hold the commit to: the bytes committed are the
source's, a byte that went wrong in the first file or in another one is never committed (it is
asked for again), and an in-order transfer commits without copying or reading back its largest
file. The corruption is the sender's (a byte flipped in a chunk after the sender's own check,
as a bit flip in its memory would): the records' AES-GCM seal covers the wire, so a flip there
ends the connection instead (tests/kernel/test_transfer.py).
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
from laminar.migrate.transfer import Receiver, receive, send_checkpoint, verified_checkpoint
from laminar.migrate.transfer.send import _Source

KB = 1 << 10
CHUNK = 64 * KB


def flip_once(monkeypatch: pytest.MonkeyPatch, chunk: int, at: int) -> list[int]:
    """The sender flips byte ``at`` of chunk ``chunk`` the first time it sends it, after its
    own check; returns the list of chunks flipped (one entry once it happened)."""
    real, done = _Source.load, []

    def load(self: Any, i: int, buf: bytearray) -> memoryview:
        view = real(self, i, buf)
        if i == chunk and not done:
            view[at] ^= 0x55
            done.append(i)
        return view

    monkeypatch.setattr(_Source, "load", load)
    return done


def send(ck: Path, root: Path) -> T.SendResult:
    async def body(rcv: Receiver, port: int) -> T.SendResult:
        return await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=CHUNK, retries=0)

    return asyncio.run(with_receiver(root, body))


def same_as_source(res: T.SendResult, ck: Path) -> None:
    got = verified_checkpoint(res.remote_path)
    for f in ck.iterdir():
        assert (got / f.name).read_bytes() == f.read_bytes(), f.name
    jobkit.verify_checkpoint(got)


def test_the_manifest_lists_the_largest_file_first(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path, 600 * KB)
    m = T.build_manifest(ck, "j1", CHUNK)
    assert [f[0] for f in m.files] == ["state.bin", jobkit.MANIFEST]  # by name, MANIFEST.json came first


def test_an_in_order_transfer_commits_without_copying_or_reading_back_its_largest_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_ckpt(tmp_path, 600 * KB)
    copied, hashed, real_copy, real_verify = [], [], receive._copy_range, jobkit.verify_checkpoint

    def copy_range(src: int, dst: int, n: int, src_off: int, dst_off: int) -> int:
        copied.append(n)
        return real_copy(src, dst, n, src_off, dst_off)

    def verify(p: Any, **kw: Any) -> Any:
        hashed.append(dict(kw.get("hashed") or {}))
        return real_verify(p, **kw)

    monkeypatch.setattr(receive, "_copy_range", copy_range)
    monkeypatch.setattr(jobkit, "verify_checkpoint", verify)
    res = send(ck, tmp_path / "rcv")
    same_as_source(res, ck)
    assert sum(copied) == (ck / jobkit.MANIFEST).stat().st_size  # only the small file was copied out
    assert {"state.bin"} in [set(h) for h in hashed]  # the commit's check: hashed when written, not read again
    assert res.sent_bytes == res.total_bytes
    st = os.stat(Path(res.remote_path) / "state.bin")
    assert st.st_mode & 0o777 == 0o644  # readable as the copied files are (the job may run as another user)


def test_a_bad_byte_in_the_largest_file_is_asked_for_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_ckpt(tmp_path, 600 * KB)
    flipped = flip_once(monkeypatch, chunk=3, at=100)
    res = send(ck, tmp_path / "rcv")
    assert flipped == [3]
    assert res.sent_bytes == res.total_bytes + CHUNK  # chunk 3 went twice
    same_as_source(res, ck)


def test_a_bad_byte_in_another_file_is_asked_for_again_and_the_moved_file_put_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 600 * KB  # state.bin ends inside chunk 9, where MANIFEST.json begins
    ck = make_ckpt(tmp_path, size)
    last = size // CHUNK
    flipped = flip_once(monkeypatch, chunk=last, at=size - last * CHUNK + 5)  # a byte of MANIFEST.json
    res = send(ck, tmp_path / "rcv")
    assert flipped == [last]
    assert res.sent_bytes == res.total_bytes + (res.total_bytes - last * CHUNK)  # the last chunk went twice
    same_as_source(res, ck)
    assert not list((tmp_path / "rcv").glob("checkpoints/j1/.tmp-*"))


# -- the sender: the files' check beside the transfer ----------------------------------------


def test_the_first_byte_leaves_before_the_source_files_are_checked(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """send_checkpoint hashes the chunks, offers, and sends while jobkit's check of the files
    runs; ``done`` waits for that check. Held here until the destination acknowledges chunks
    (before, the manifest waited for it: no byte left until it was released)."""
    ck = make_ckpt(tmp_path, 2400 * KB)  # 38 chunks: an ack counts what was persisted a batch of 8 before
    release, real = threading.Event(), jobkit.verify_checkpoint

    def held(p: Any, **kw: Any) -> Any:
        if Path(p) == ck:
            assert release.wait(30), "never released"
        return real(p, **kw)

    monkeypatch.setattr(jobkit, "verify_checkpoint", held)
    seen: list[int] = []

    def progress(pr: T.Progress) -> None:
        if not release.is_set():
            seen.append(pr.done_bytes)  # the destination's acks while the check is held
        if pr.done_bytes > 0:
            release.set()

    async def body(rcv: Receiver, port: int) -> T.SendResult:
        try:
            return await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=CHUNK, retries=0,
                                         progress=progress)
        finally:
            release.set()

    res = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert seen and seen[-1] > 0  # chunks held at the destination while the check was held
    same_as_source(res, ck)


def test_a_source_that_rotted_under_its_manifest_is_refused_before_done_and_never_committed(tmp_path: Path) -> None:
    """A byte of the state changed on the source disk with no sign of a write (the mtime put
    back): the chunks are hashed from what is there, the files' hashes are the job's word.
    The files' check fails beside the transfer: fatal, named, and the destination commits
    nothing (it never got ``done``)."""
    ck = make_ckpt(tmp_path, 600 * KB)
    rot(ck / "state.bin", 200 * KB)
    committed: list[Any] = []

    async def body(rcv: Receiver, port: int) -> None:
        rcv.on_commit = committed.append
        with pytest.raises(T.TransferError, match=r"refusing to send .*state\.bin does not match") as e:
            await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=CHUNK, retries=3, retry_delay_s=0.01)
        assert e.value.fatal and not isinstance(e.value, T.SourceChangedError)

    asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert committed == [] and not list((tmp_path / "rcv").glob("checkpoints/j1/ckpt-*"))
