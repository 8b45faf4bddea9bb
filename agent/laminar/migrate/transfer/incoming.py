"""A checkpoint being received, on the destination's disk: the room an offer needs
(:func:`offer_room`, policy), and :class:`_Incoming`, its persisted state (the manifest, the
partial file its chunks are written into off the loop, the have-log that says which are on
disk), from which a transfer resumes after a broken connection, a dead sender or a restarted
destination."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar.migrate.transfer.manifest import Manifest

MARGIN_FRACTION = 0.05  # the receiver keeps this much of its filesystem free beyond what it accepts...
MARGIN_CAP = 1 << 30  # ...but never more than 1 GiB (the keeper ranking's keeper_reserve_mb default)
_COPY_BLOCK = 4 << 20  # what a commit reads at a time from the partial file
PERSIST_EVERY = 8  # chunks between fdatasync + have.log appends


@dataclass(frozen=True)
class Room:
    """What accepting an offer takes from the receive root's filesystem (bytes)."""

    own: int  # this checkpoint: what it lacks on disk, plus one commit block
    reserved: int  # what the transfers in progress still lack on disk
    margin: int  # kept free beyond both
    avail: int  # free for this agent now (statvfs f_bavail)

    @property
    def need(self) -> int:
        return self.own + self.reserved + self.margin

    @property
    def fits(self) -> bool:
        return self.need <= self.avail


def offer_room(total_bytes: int, on_disk: int, reserved: int, fs_bytes: int, avail: int,
               margin_bytes: int | None = None) -> Room:
    """The disk an offer needs (policy; :meth:`Receiver._room` measures the inputs).
    ``on_disk``: bytes of this checkpoint's partial file already allocated (a resumed transfer
    needs only the rest); ``reserved``: what other transfers in progress still lack; the
    margin is ``margin_bytes``, or MARGIN_FRACTION of the filesystem's size (``fs_bytes``)
    capped at MARGIN_CAP. The commit needs one block (4 MiB) beyond the checkpoint
    (:meth:`Receiver._commit`). Raises ValueError for a negative input."""
    for name, v in (("total_bytes", total_bytes), ("on_disk", on_disk), ("reserved", reserved),
                    ("fs_bytes", fs_bytes), ("avail", avail), ("margin_bytes", margin_bytes or 0)):
        if v < 0:
            raise ValueError(f"offer_room: {name}={v} must be >= 0")
    margin = margin_bytes if margin_bytes is not None else min(MARGIN_CAP, int(fs_bytes * MARGIN_FRACTION))
    own = max(0, total_bytes - on_disk) + min(_COPY_BLOCK, total_bytes)
    return Room(own, reserved, margin, avail)


def _pwrite_all(fd: int, data: bytes | memoryview, off: int) -> int:
    """Writes all of ``data`` at ``off`` (a short write, as a filling disk gives, is followed
    by the rest or by the error that stopped it); raises OSError (ENOSPC when the disk takes
    nothing more)."""
    view, done = memoryview(data), 0
    while done < len(view):
        k = os.pwrite(fd, view[done:], off + done)
        if k <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += k
    return done


def _allocated(path: Path) -> int:
    """Bytes of disk ``path`` holds (0 when it does not exist): a partial file is sparse."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


class _Incoming:
    """The persisted state of one checkpoint being received: manifest, partial data, have-log."""

    def __init__(self, d: Path, m: Manifest) -> None:
        self.dir = d
        self.m = m
        d.mkdir(parents=True, exist_ok=True)
        mf = d / "manifest.json"
        if mf.exists():
            try:
                old = json.loads(mf.read_text())
                same = old.get("digest") == m.digest
            except (OSError, json.JSONDecodeError):
                same = False
            if not same:  # another checkpoint under the same name: start over
                for x in d.iterdir():
                    x.unlink()
        if not mf.exists():
            tmp = d / "manifest.json.tmp"
            tmp.write_text(json.dumps({"digest": m.digest, "body": m.body()}))
            os.replace(tmp, mf)
        self.fd = os.open(d / "data.partial", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, m.total_bytes)
        self.have: set[int] = set()
        logp = d / "have.log"
        if logp.exists():
            for line in logp.read_text().split():
                if line.isdigit() and int(line) < len(m.chunks):
                    self.have.add(int(line))
        self.held = sum(m.chunk_len(i) for i in self.have)  # kept up to date: an ack reads it on the loop
        self.log = open(logp, "a")
        self.ex = ThreadPoolExecutor(1, thread_name_prefix="lm-xfer-write")  # writes in order, one core at most
        # fdatasync and the have.log appends in a thread of their own: a batch's writes go on
        # into the page cache while the batch before it is flushed (on the same thread, every
        # flush stopped the writes, and the receive behind them, for the disk's latency).
        self.sync_ex = ThreadPoolExecutor(1, thread_name_prefix="lm-xfer-sync")
        self.writing: list[tuple[int, asyncio.Future[int]]] = []  # chunks being written, not yet persisted
        self.inflight: asyncio.Future[list[int]] | None = None  # the batch being persisted
        # The first file's SHA-256 over the bytes as they are written (the very buffers given to
        # pwrite, in the write thread, in order), while its chunks arrive in order from chunk 0
        # on this connection: the commit then moves the partial file into place as that file
        # instead of copying it out and reading it back (Receiver._commit). None once that
        # cannot hold: a chunk out of order, a chunk held from an earlier connection, a chunk
        # forgotten.
        self.first = m.files[0][1] if m.files else 0
        self.stream: Any = hashlib.sha256() if self.first > 0 and 0 not in self.have else None
        self.stream_next = 0  # the chunk the stream takes next
        self.streamed = 0  # bytes of the first file fed to the stream (in the write thread)

    def held_bytes(self) -> int:
        """The bytes of the chunks held (persisted), kept as chunks are added and forgotten: an
        ack every PERSIST_EVERY chunks must not cost the loop a pass over all of them."""
        return self.held

    def write(self, i: int, data: bytes) -> None:
        """Writes chunk ``i`` at its offset, in a worker thread (the loop goes on receiving),
        and feeds the first file's part of it to the stream's hash there when it is the chunk
        the stream takes next (``data`` is immutable: what is hashed is what was written)."""
        loop = asyncio.get_running_loop()
        off = i * self.m.chunk_size
        h = None
        if self.stream is not None and off < self.first:
            if i == self.stream_next:
                h, self.stream_next = self.stream, i + 1
            else:
                self.stream = None
        self.writing.append((i, loop.run_in_executor(self.ex, self._write, h, data, off)))

    def _write(self, h: Any, data: bytes, off: int) -> int:
        n = _pwrite_all(self.fd, data, off)
        if h is not None:
            k = min(len(data), self.first - off)
            h.update(memoryview(data)[:k])
            self.streamed += k
        return n

    def streamed_sha256(self) -> str | None:
        """The first file's SHA-256 as its bytes were written, when all of them were, in order,
        on this connection (call once the writes are settled); else None."""
        if self.stream is None or self.streamed != self.first:
            return None
        return str(self.stream.hexdigest())

    def store(self) -> None:
        """Persists the chunks written since the last call: once their writes are done, an
        fdatasync and then the fsync'd have.log lines that say they are there, in a worker
        thread; :meth:`settle` waits for it (one batch in flight: the next is received
        meanwhile)."""
        if self.writing:
            w, self.writing = self.writing, []
            self.inflight = asyncio.ensure_future(self._store(w))

    async def _store(self, w: list[tuple[int, asyncio.Future[int]]]) -> list[int]:
        res = await asyncio.gather(*(f for _, f in w), return_exceptions=True)
        for r in res:
            if isinstance(r, BaseException):
                raise r
        ids = [i for i, _ in w]
        await asyncio.get_running_loop().run_in_executor(self.sync_ex, self._sync, ids)
        return ids

    def _sync(self, ids: list[int]) -> None:
        os.fdatasync(self.fd)
        self.log.write("".join(f"{i}\n" for i in ids))
        self.log.flush()
        os.fsync(self.log.fileno())

    async def settle(self) -> None:
        """Waits for the batch in flight and counts it as held (raises its OSError)."""
        f, self.inflight = self.inflight, None
        if f is not None:
            new = set(await f) - self.have
            self.have |= new
            self.held += sum(self.m.chunk_len(i) for i in new)

    def forget(self, bad: set[int]) -> None:
        gone = bad & self.have
        if gone:
            self.stream = None  # sent again, out of order: the commit reads the first file back
        self.have -= gone
        self.held -= sum(self.m.chunk_len(i) for i in gone)
        self.log.close()
        tmp = self.dir / "have.log.tmp"
        tmp.write_text("".join(f"{i}\n" for i in sorted(self.have)))
        os.replace(tmp, self.dir / "have.log")
        self.log = open(self.dir / "have.log", "a")

    def close(self) -> None:
        """Closes the files, once the batch in flight (if any) is written."""
        busy = [f for f in (self.inflight, *(w for _, w in self.writing)) if f is not None and not f.done()]
        if busy:
            busy[0].add_done_callback(lambda _f: self.close())
            return
        self.ex.shutdown(wait=False)
        self.sync_ex.shutdown(wait=False)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.log.close()
