"""Agent-to-agent checkpoint transfer over TCP: chunked, checksummed, resumable, authenticated,
encrypted.

A checkpoint is a directory written by :mod:`laminar.jobkit` (``ckpt-<step>/`` with
``MANIFEST.json``). The source agent sends it to the destination agent's transfer endpoint;
the destination commits it under ``<root>/checkpoints/<job>/<ckpt>/`` only after verifying all
of it, and only a committed checkpoint is ever handed to ``LAMINAR_RESUME_FROM``.

Protocol (one TCP connection; each message is a 4-byte big-endian length, a JSON header, and
for ``chunk`` the raw bytes the header announces):

1. ``hello {v, zone, node, nonce_c}`` -> ``challenge {nonce_s, mac_s}`` -> ``auth {mac_c}`` -> ``ok``:
   mutual HMAC-SHA256 challenge-response with the zone key (:mod:`laminar.zone.keys`), so
   neither side talks checkpoints with a node outside the zone. Both MACs cover the hello's
   claims (version, zone, node: :func:`hello_identity`), so a peer on the path cannot change
   them; and since the key is the zone's, a destination given ``sources`` (the agent: the
   zone roster, ``zone.check_source``) refuses a sender whose connection does not come from
   the roster address of the node it names (``wrong_source``, counted). Everything after ``ok``, both
   ways, travels in AES-256-GCM records (:class:`_Channel`): keys per connection and direction
   from HKDF-SHA256 of the zone key and both nonces (:func:`derive_keys`), the record's number
   as nonce; a changed, replayed, reordered or missing record ends the connection, counted in
   ``STATS.records_rejected``. A peer of another PROTOCOL_VERSION is refused with an error
   naming both (a zone's agents upgrade together; docs/protocol.md);
2. ``offer {manifest, mac}``: the *transfer manifest* lists the files (name, size, SHA-256),
   the chunk size and every chunk's SHA-256; its digest is the SHA-256 of its canonical JSON and
   ``mac`` is HMAC(zone key, digest), so the destination knows the manifest, and through it
   every byte, comes from a zone member. The destination first checks its free disk
   (:func:`offer_room`: the checkpoint, what transfers in progress still lack, a margin) and
   refuses an offer that does not fit (``error`` with ``reason: no-room``, :class:`NoRoomError`
   at the sender, fatal: try another destination); so it does when its disk fills later (another
   writer took the room): a write that fails with ENOSPC or EDQUOT ends the transfer with a
   no-room refusal naming the error (EIO: a fatal error naming it), the chunks persisted so far
   kept for a resume. The answer is ``have {chunks}`` (the chunks the
   destination already holds, persisted: this is how a transfer resumes after a broken
   connection, a dead sender or a restarted destination) or ``committed`` if it has it all;
3. ``chunk {i, len}`` + bytes for each missing chunk; the destination checks that it fits the
   manifest, writes it at its offset in a partial file, and records it as held only after the
   data is on disk (fdatasync, then an fsync'd append to ``have.log``); it reports progress with
   ``ack {bytes}``;
4. ``done`` -> the destination splits the partial file into the checkpoint's files (the
   first, the largest, is the partial file itself, moved, when its bytes were hashed in order
   as they were written), checks every file against the manifest and the job's manifest (and,
   when one fails, every chunk, to name them), and answers ``need {chunks}`` (chunks missing,
   or that failed on the way, on disk or in the copy: the partial file is put back and the
   sender sends them again) or, after an atomic commit (files fsync'd, a ``VERIFIED`` marker,
   rename), ``committed {digest, path, mac}``: the MAC (zone key, this connection's server
   nonce, digest, path) lets the sender believe only the destination that it is delivered.
   Each byte is hashed once, in worker threads (docs/protocol.md, "Cost").

A connection may instead carry one *control message* after the handshake (``ctl {op, body,
mac}`` -> ``ctl-ok {result, mac}``; :func:`send_control`): the MACs cover the op, the body (or
result) and the server's nonce of this connection, so neither is forgeable, replayable, or
turned into another operation on the way; it is answered as asked by the hello's node,
authenticated and checked as above. An agent from before these MACs fails them with a
clear error (both sides of a zone run the same version).

Before the peer has authenticated, the endpoint reads at most MAX_HANDSHAKE bytes per message,
the whole handshake within HANDSHAKE_DEADLINE_S, and a :class:`laminar.zone.gate.Gate` decides who
may connect at all and how many connections each address and member holds (the agent's: only
roster addresses with ``zone.check_source``). After it, headers are small (CTL_MAX) but for an
offer's and a guard's, a chunk's payload is read only once an offer was accepted and only up to
its chunk size, and large JSON is parsed only under MAX_SEPARATORS (see :func:`_recv`). Partial
transfers no connection has touched for INCOMING_STALE_S, and a commit's temporary left by a
crash, are removed (:meth:`Receiver.sweep`, at start and after each commit). The reclaim component uses
it to forward a reclaim notice and to hand a job's guard (its spec) to the node holding its
replicas (:mod:`laminar.migrate.reclaim`).

The sender re-hashes every chunk it reads (in a thread, ahead of the socket) and checks the
files against the job's own manifest before it sends ``done`` (:func:`check_source`, in a
thread beside the transfer: the first byte leaves after the chunks' hashes alone), so a
checkpoint corrupted on the source disk is refused there, never committed. A checkpoint the job saves again meanwhile (jobkit replaces the
directory) is told apart from a corrupt one by its files' identities (inode, size, mtime):
the sender builds its manifest again and sends the new one, at most
MAX_SOURCE_CHANGES times (:func:`send_checkpoint`).

Shaping: the sender calls a :class:`FlowHook` with the connection's 5-tuple, the bytes to send
and the deadline, so the node's shaper can put the flow in its class and the kill-switch can
cut it at the window's end (engineer H5's ``laminar.net.transfers``; see
:func:`default_flow_hook`); ``rate_bps`` paces the sender in user space as well. While it sends,
the sender tells the hook every ACK_POLL_S how many of those bytes the peer's TCP has
acknowledged (``tcpi_bytes_acked`` from TCP_INFO, or the bytes written less SIOCOUTQ on a kernel
without it), so the shaper decides on confirmed bytes rather than an estimate.

Command line (used by the kernel tests; the agent uses :class:`Receiver` and
:func:`send_checkpoint`)::

    python -m laminar.migrate.transfer serve --root /var/lib/laminar/xfer --listen 10.0.0.2:7480 --key-file zone.keys
    python -m laminar.migrate.transfer send --to 10.0.0.2:7480 --job j1 --ckpt /ck/j1/ckpt-40 --key-file zone.keys
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import errno
import functools
import hashlib
import hmac
import inspect
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
import struct
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn, Protocol

from laminar import jobkit, listen
from laminar.zone.gate import Gate, GatedListener, Slot

# `cryptography` (OpenSSL) is imported at the first connection, not with the agent: it adds
# ~7 MiB of resident memory that an agent that never transfers does not need.

log = logging.getLogger("laminar.transfer")

PROTOCOL_VERSION = 3  # the wire protocol (hello); 2: every message after the handshake in AES-GCM records;
# 3: the hello (version, zone, node) under both handshake MACs, and its node checked against the connection's address
MANIFEST_VERSION = 1  # the transfer manifest's format (its digest, TRANSFER.json of committed copies): unchanged
RECORD_MAX = 1 << 20  # plaintext bytes per record: AES-GCM holds the GIL, 0.6 ms per MiB here (see _Channel)
RECORD_TAG = 16
MARGIN_FRACTION = 0.05  # the receiver keeps this much of its filesystem free beyond what it accepts...
MARGIN_CAP = 1 << 30  # ...but never more than 1 GiB (the holder ranking's holder_reserve_mb default)
DEFAULT_CHUNK = 1 << 20  # 1 MiB: a lost connection costs at most this much again per chunk in flight
MAX_CHUNK = 64 << 20
MAX_HEADER = 16 << 20  # a manifest of 10 GB in 1 MiB chunks is ~700 KB of JSON
MAX_HANDSHAKE = 4096  # hello/challenge/auth: what a peer that has not authenticated may make us read
# After the handshake a Receiver reads headers of at most CTL_MAX bytes, but for the two that
# carry much: an offer (its manifest, up to MAX_HEADER) and a guard control message (a job's
# spec, which fits a hand-over frame: laminar.zone.wire.MAX_FRAME). Which one a header is shows
# in its first bytes (the sender's JSON names "t" first: LARGE_HEADERS), read before the rest.
CTL_MAX = 64 << 10
GUARD_MAX = (1 << 20) + CTL_MAX
LARGE_HEADERS = {b'{"t":"offer",': MAX_HEADER, b'{"t":"ctl","op":"guard",': GUARD_MAX}
# JSON over CTL_MAX bytes is parsed only when it has at most MAX_SEPARATORS ',' and ':' (a
# manifest of 10,000 files and 250,000 chunks has ~280,000), in a worker thread. json.loads
# holds the GIL all along, so the thread does not free the event loop: the bound does. Parsing
# costs per value, not per byte (16 MiB of one-digit numbers: 0.5 s; 16 MiB of chunk hashes:
# 0.03 s), and 2^19 separators take at most ~30 ms (bench: tests/unit/test_xfer_flood.py).
MAX_SEPARATORS = 1 << 19
# Headers over CTL_MAX being read and parsed at once, per member and in all: each holds up to
# MAX_HEADER bytes and the objects parsed from them; more wait their turn (a header arrives in
# milliseconds on a LAN), so a member's 32 authenticated connections hold 2 of them, not 32.
LARGE_PER_MEMBER = 2
LARGE_TOTAL = 8
MAX_FILES = 10_000  # files a checkpoint may have to be transferred (the manifest's digest costs per file)
HANDSHAKE_DEADLINE_S = 10.0  # the whole handshake (hello to auth) of a Receiver's peer, one deadline
_COPY_BLOCK = 4 << 20  # what a commit reads at a time from the partial file
PERSIST_EVERY = 8  # chunks between fdatasync + have.log appends
_HASH_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))  # threads hashing chunks beside the one hashing files: a core is left to the event loop
MAX_NEED_ROUNDS = 5  # re-send rounds before a transfer is declared failed
MAX_SOURCE_CHANGES = 5  # manifests built again because the checkpoint changed under the sender, before it gives up
HANDSHAKE_TIMEOUT_S = 10.0  # each handshake message (the sender's side): the peer's agent may be busy (a loaded event loop)
# A connection a destination has not accepted in this long is a silent peer (its host gone, a
# blackhole: nothing answers the SYN). Linux sends the SYN again 1 s and 3 s after the first; on
# a LAN (and on any path of RTT < 1 s) 4 s covers both, so only a peer that answers none of three
# SYNs counts as silent; it was HANDSHAKE_TIMEOUT_S (10 s) before 2026-11-23.
CONNECT_TIMEOUT_S = 4.0
IO_TIMEOUT_S = 60.0
INCOMING_STALE_S = 24 * 3600.0  # a partial transfer untouched this long is abandoned (its sender never came back)
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # ASCII, and used with fullmatch (F10: "$" let "\n" in)
VERIFIED = "VERIFIED"
TRANSFER_MANIFEST = "TRANSFER.json"
# A committed copy whose files keep the identity recorded at its commit (inode, size, mtime, ctime:
# any write, truncation, replacement or link moves one) is not hashed again this long after it:
# the move's hand-over checks it seconds after the commit hashed it, and a second full read
# there is downtime (1.1 s per GiB here). Older copies (a guard's replica, kept for days) are
# hashed again: the disk may have rotted them. jobkit hashes once more in the job at resume.
TRUST_UNCHANGED_S = 600.0


class TransferError(Exception):
    """A transfer that cannot go on: authentication failed, bad manifest, corrupt source,
    peer error, or too many failed rounds. The message says which. ``fatal``: trying again
    cannot help (authentication, a corrupt source, a conflicting checkpoint)."""

    def __init__(self, msg: str, fatal: bool = False) -> None:
        super().__init__(msg)
        self.fatal = fatal


class SourceChangedError(TransferError):
    """The checkpoint changed under the sender (a job re-saved the same step: jobkit replaces
    its directory with new files): the manifest no longer describes what is on disk. Not
    fatal: :func:`send_checkpoint` builds the manifest again and sends what is there now, at
    most MAX_SOURCE_CHANGES times."""


class PeerSilentError(TransferError):
    """The destination said nothing: it did not accept the connection in CONNECT_TIMEOUT_S, or
    did not answer the handshake in HANDSHAKE_TIMEOUT_S (its host gone, a blackhole, its agent
    hung). Not fatal (it may come back); :func:`send_checkpoint` tries such a peer again only
    ``silent_retries`` times, so a caller with another destination (a prestage) goes there
    after one timeout instead of the whole retry ladder."""


class RefusedMessage(TransferError):
    """A message refused for its size or shape before it was parsed or its payload read
    (:func:`_recv`); ``reason`` names the counter a Receiver counts it under
    (:data:`REFUSED_REASONS`): ``too_large``, ``too_dense`` (JSON of more than MAX_SEPARATORS
    separators), ``chunk_before_offer``. Not fatal."""

    def __init__(self, msg: str, reason: str) -> None:
        super().__init__(msg)
        self.reason = reason


REFUSED_REASONS = ("too_large", "too_dense", "chunk_before_offer")


class RecordError(TransferError):
    """A record after the handshake failed authentication (modified, replayed, reordered,
    dropped on the way, or not a record at all). The connection ends; nothing it carried
    from then on is used. Not fatal: a new connection (new keys) may get through."""


class NoRoomError(TransferError):
    """The destination refused an offer: its receive root lacks the disk space. ``need`` and
    ``avail`` are bytes. Fatal for this destination: the caller picks another."""

    def __init__(self, msg: str, need: int, avail: int) -> None:
        super().__init__(msg, fatal=True)
        self.need = need
        self.avail = avail


@dataclass
class TransferStats:
    """Process-wide counters of this module (both sides): ``records_rejected``, records that
    failed authentication (each ends its connection); ``offers_refused_no_room``, offers a
    Receiver here refused for disk space; ``wrong_source``, connections a Receiver here refused
    because they did not come from the roster address of the node their hello named
    (:class:`Receiver`'s ``sources``). Read them, never reset them (tests take deltas)."""

    records_rejected: int = 0
    offers_refused_no_room: int = 0
    wrong_source: int = 0


STATS = TransferStats()


class StatsCollector:
    """STATS for a prometheus_client registry (``registry.register(StatsCollector())``):
    ``laminar_transfer_records_rejected_total``,
    ``laminar_transfer_offers_refused_no_room_total`` and
    ``laminar_transfer_wrong_source_total``."""

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("laminar_transfer_records_rejected", "checkpoint-transfer records that failed "
                                  "authentication (changed, replayed, reordered or dropped on the way); each ended "
                                  "its connection", value=STATS.records_rejected)
        yield CounterMetricFamily("laminar_transfer_offers_refused_no_room", "checkpoint offers this agent refused "
                                  "for lack of disk space", value=STATS.offers_refused_no_room)
        yield CounterMetricFamily("laminar_transfer_wrong_source", "checkpoint-transfer connections this agent "
                                  "refused: not from the roster address of the node their hello named (or a node "
                                  "the roster does not list)", value=STATS.wrong_source)


def mac(key: bytes, label: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 over a domain label and parts (hex): one key, separate meanings."""
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:
        h.update(struct.pack(">I", len(p)))
        h.update(p)
    return h.hexdigest()


# -- the transfer manifest --------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    job_id: str
    ckpt_id: str
    chunk_size: int
    files: tuple[tuple[str, int, str], ...]  # (name, size, sha256)
    chunks: tuple[str, ...]
    # the sender's side only, never on the wire: what the files were when the manifest was
    # built (:func:`_source_state`), so a change under the sender is seen (empty: unknown)
    source: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    # the sender's side only: the files' SHA-256 are the job's MANIFEST.json's word, not yet
    # checked against the disk (build_manifest(check_files=False): :func:`check_source` does it)
    unchecked: bool = field(default=False, compare=False, repr=False)

    @functools.cached_property
    def total_bytes(self) -> int:
        return sum(f[1] for f in self.files)

    def body(self) -> dict[str, Any]:
        return {
            "v": MANIFEST_VERSION,
            "job_id": self.job_id,
            "ckpt_id": self.ckpt_id,
            "chunk_size": self.chunk_size,
            "files": [list(f) for f in self.files],
            "chunks": list(self.chunks),
        }

    @functools.cached_property
    def digest(self) -> str:  # computed once: a manifest of 100 GB in 1 MiB chunks is ~7 MB of JSON
        return hashlib.sha256(json.dumps(self.body(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def chunk_len(self, i: int) -> int:
        return min(self.chunk_size, self.total_bytes - i * self.chunk_size)

    @classmethod
    def from_body(cls, b: Any) -> Manifest:
        """Parses and checks a manifest received from a peer; raises TransferError."""
        try:
            if b["v"] != MANIFEST_VERSION:
                raise TransferError(f"transfer: manifest version {b['v']!r}, expected {MANIFEST_VERSION}")
            if len(b["files"]) > MAX_FILES:
                raise TransferError(f"transfer: the manifest lists {len(b['files'])} files, more than the {MAX_FILES} a "
                                    "transfer takes")
            m = cls(
                job_id=str(b["job_id"]),
                ckpt_id=str(b["ckpt_id"]),
                chunk_size=int(b["chunk_size"]),
                files=tuple((str(n), int(s), str(h)) for n, s, h in b["files"]),
                chunks=tuple(str(c) for c in b["chunks"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"transfer: malformed manifest: {e!r}") from None
        for name in (m.job_id, m.ckpt_id, *(f[0] for f in m.files)):
            if not isinstance(name, str) or not _SAFE.fullmatch(name) or name in (VERIFIED, TRANSFER_MANIFEST):
                raise TransferError(f"transfer: unsafe name {name!r} in manifest (letters, digits, '_', '.', '-')")
        if not 0 < m.chunk_size <= MAX_CHUNK:
            raise TransferError(f"transfer: chunk_size {m.chunk_size} out of range 1..{MAX_CHUNK}")
        expect = (m.total_bytes + m.chunk_size - 1) // m.chunk_size
        if len(m.chunks) != expect or any(s < 0 for _, s, _ in m.files):
            raise TransferError(f"transfer: manifest lists {len(m.chunks)} chunks, its sizes need {expect}")
        return m


class _SpanReadError(OSError):
    """A read of the concatenation that the storage refused (EIO, ...): ``span`` is the index
    of the file in the spans, ``offset`` where in that file the read failed."""

    def __init__(self, e: OSError, span: int, offset: int) -> None:
        super().__init__(e.errno, e.strerror)
        self.span, self.offset = span, offset

    def describe(self, root: Path, names: list[str]) -> str:
        """``<root>/<file>: a read from byte <offset> failed: <error>``: what a TransferError says."""
        return f"{root}/{names[self.span]}: a read from byte {self.offset} failed: [Errno {self.errno}] {self.strerror}"


def _pread_spans(spans: list[tuple[int, int, int]], start: int, view: memoryview) -> int:
    """Reads the concatenation of files (``spans``: fd, offset in the concatenation, size)
    from ``start`` into ``view``; the bytes read (fewer when a file is shorter than listed).
    Raises _SpanReadError naming the file and offset when the storage fails a read."""
    end, got = start + len(view), 0
    for j, (fd, off, size) in enumerate(spans):
        lo, hi = max(start, off), min(end, off + size)
        while lo < hi:
            try:
                k = os.preadv(fd, [view[lo - start:hi - start]], lo - off)
            except OSError as e:
                raise _SpanReadError(e, j, lo - off) from e
            if k <= 0:
                break
            lo += k
            got += k
    return got


PREFETCH_BYTES = 8 << 20  # what the sender reads and hashes ahead of the socket (at least one chunk)


class _Source:
    """The sender's reads of a checkpoint's chunks: each chunk read (``preadv`` into one of a
    few reused buffers) and checked against the manifest in a worker thread (hashlib lets go
    of the GIL), up to PREFETCH_BYTES ahead of the socket, so the disk and SHA-256 run beside
    the event loop's encryption and sends. Each chunk is hashed again right before it is
    sent: a checkpoint corrupted on the source disk since the manifest is refused
    (TransferError, fatal), never shipped; one whose files are other files, or were written,
    since the manifest (``Manifest.source``: a re-save) raises SourceChangedError, when the
    files are opened or at the chunk that differs. Use as a context manager (it holds the
    files open)."""

    def __init__(self, root: Path, m: Manifest) -> None:
        self.m = m
        self.root = root
        self.fds: list[int] = []
        self.spans: list[tuple[int, int, int]] = []  # (fd, offset in the concatenation, size)
        self.idents: list[tuple[int, ...] | None] = [None] * len(m.files)  # each file as the manifest saw it
        if m.source:
            seen = dict(m.source[1])
            self.idents = [seen.get(name) for name, _, _ in m.files]
        off = 0
        try:
            for j, (name, size, _) in enumerate(m.files):
                try:
                    fd = os.open(root / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                except FileNotFoundError:
                    if m.source:  # gone since the manifest: mid re-save, or removed
                        raise SourceChangedError(f"transfer: {root}/{name} is gone since its manifest was built") from None
                    raise
                self.fds.append(fd)
                self.spans.append((fd, off, size))
                off += size
                if self.idents[j] is not None and _ident(os.fstat(fd)) != self.idents[j]:
                    raise SourceChangedError(f"transfer: {root}/{name} is another file than when its manifest was "
                                             "built (the job saved this checkpoint again)")
        except (OSError, TransferError):
            self.close()
            raise
        self.depth = max(1, min(8, PREFETCH_BYTES // max(1, m.chunk_size)))
        # one thread: chunk after chunk, ahead of the socket; more would take the cores the
        # event loops need (a 2-core node stalled its loops 5-15 ms with the default pool's six)
        self.ex = ThreadPoolExecutor(1, thread_name_prefix="lm-xfer-read")
        self.free = [bytearray(m.chunk_size) for _ in range(min(self.depth + 1, max(1, len(m.chunks))))]

    def __enter__(self) -> _Source:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the files after the reads already queued (the one thread runs them in order)."""
        fds, self.fds = self.fds, []

        def close_fds() -> None:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

        ex = getattr(self, "ex", None)
        if ex is None:
            close_fds()
            return
        with contextlib.suppress(RuntimeError):  # already shut down: nothing was left open
            ex.submit(close_fds)
        ex.shutdown(wait=False)

    def load(self, i: int, buf: bytearray) -> memoryview:
        """Chunk ``i`` read into ``buf`` and checked (a worker thread); raises TransferError."""
        n = self.m.chunk_len(i)
        view = memoryview(buf)[:n]
        try:
            got = _pread_spans(self.spans, i * self.m.chunk_size, view)
        except _SpanReadError as e:
            # The source's storage failed (EIO: a bad sector, a lost disk or mount). Not fatal:
            # the next attempt resumes where the destination is (the storage may be back).
            raise TransferError(f"transfer: cannot read chunk {i} of {self.m.job_id}/{self.m.ckpt_id} on the source: "
                                f"{e.describe(self.root, [f[0] for f in self.m.files])}") from None
        if got != n or hashlib.sha256(view).hexdigest() != self.m.chunks[i]:
            for fd, ident in zip(self.fds, self.idents, strict=False):
                if ident is not None and _ident(os.fstat(fd)) != ident:  # written since: a change, not rot
                    raise SourceChangedError(f"transfer: chunk {i} of {self.m.ckpt_id} changed on the source disk "
                                             "since its manifest was built (a file was written since)")
            raise TransferError(f"transfer: refusing to send chunk {i} of {self.m.ckpt_id}: it changed on the source "
                                "disk", fatal=True)
        return view

    async def chunks(self, ids: list[int]) -> Any:
        """Yields (i, view) for each chunk of ``ids`` in order; a view is valid until the next."""
        loop = asyncio.get_running_loop()
        todo = iter(ids)
        ahead: list[tuple[int, bytearray, asyncio.Future[memoryview]]] = []
        try:
            while True:
                while self.free and len(ahead) < self.depth:
                    i = next(todo, None)
                    if i is None:
                        break
                    buf = self.free.pop()
                    ahead.append((i, buf, loop.run_in_executor(self.ex, self.load, i, buf)))
                if not ahead:
                    return
                i, buf, fut = ahead.pop(0)
                view = await fut
                yield i, view
                del view
                self.free.append(buf)
        finally:
            for _i, _buf, fut in ahead:  # a thread may still be reading into its buffer: it is dropped
                fut.cancel()
            ahead.clear()


def _ident(st: os.stat_result) -> tuple[int, ...]:
    """What tells one version of a file from another: a re-save makes new files (inode), a
    write in place moves mtime. Not ctime: a hard link made or removed moves it (the agent's
    snapshots link the job's files, and jobkit removes old checkpoints), the bytes stay."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _source_state(p: Path) -> tuple[Any, ...]:
    """The checkpoint directory ``p`` as it is now: its own identity and each file's (name,
    :func:`_ident`), sidecars left out; equal before and after a read means the read saw one
    version of every file. Raises OSError (gone: mid re-save, or removed) and
    SourceChangedError (replaced while listed)."""
    d0 = _ident(os.lstat(p))
    names = sorted(x.name for x in p.iterdir() if x.name not in jobkit.SIDECARS)
    files = tuple((n, _ident(os.lstat(p / n))) for n in names)
    if _ident(os.lstat(p)) != d0:
        raise SourceChangedError(f"transfer: {p} was replaced while it was listed")
    return d0, files


def build_manifest(ckpt_dir: str | os.PathLike[str], job_id: str, chunk_size: int = DEFAULT_CHUNK, *,
                   check_files: bool = True) -> Manifest:
    """The transfer manifest of a jobkit checkpoint directory. Checks the files against the
    job's own MANIFEST.json first (raises TransferError: a corrupt source is never shipped).
    Raises SourceChangedError when the checkpoint changed while it was read (a job that saved
    the same step again: its file hashes and its chunks' would describe two versions); the
    manifest remembers the files it describes (``source``), so the sender sees a change after.

    ``check_files=False`` (what :func:`send_checkpoint` does): only the chunks are hashed
    (every thread on them); the files' SHA-256 are taken from the job's MANIFEST.json, sizes
    checked, and the manifest is marked ``unchecked``: the caller runs :func:`check_source`
    beside the transfer and sends ``done`` only once it passed. The first byte leaves after
    one parallel pass instead of a sequential pass over the largest file."""
    p = Path(ckpt_dir)
    try:
        jobkit.read_manifest(p)  # a directory that is not a checkpoint fails before any hashing
    except jobkit.CheckpointError as e:
        raise TransferError(f"transfer: refusing to send {p}: {e}", fatal=True) from None
    if not 0 < chunk_size <= MAX_CHUNK:
        raise TransferError(f"transfer: chunk_size {chunk_size} out of range 1..{MAX_CHUNK}")
    before = _source_state(p)
    if len(before[1]) > MAX_FILES:
        raise TransferError(f"transfer: refusing to send {p}: {len(before[1])} files, more than the {MAX_FILES} a "
                            "transfer takes (save the job's state in fewer files)", fatal=True)

    def changed() -> bool:
        try:
            return _source_state(p) != before
        except (OSError, SourceChangedError):
            return True

    try:
        # the largest file first: the destination moves the first file into place rather than
        # copying it out of the partial file (Receiver._commit)
        sizes = sorted(((n, ident[2]) for n, ident in before[1]), key=lambda f: (-f[1], f[0]))
        m = _hash_checkpoint(p, job_id, chunk_size, sizes, check_files)
    except (TransferError, OSError) as e:
        if changed():  # what failed was reading two versions, not a corrupt source
            raise SourceChangedError(f"transfer: {p} changed while its manifest was built ({e})") from None
        raise
    if changed():
        raise SourceChangedError(f"transfer: {p} changed while its manifest was built (the job saved it again)")
    return replace(m, source=before)


def _hash_checkpoint(p: Path, job_id: str, chunk_size: int, sizes: list[tuple[str, int]],
                     check_files: bool = True) -> Manifest:
    """:func:`build_manifest`'s two passes over the files ``sizes`` lists (name, size); the
    chunks' alone without ``check_files``."""
    m0 = Manifest(job_id, p.name, chunk_size, tuple((n, z, "") for n, z in sizes), ())
    nchunks = (m0.total_bytes + chunk_size - 1) // chunk_size
    k = max(1, min(_HASH_THREADS + (0 if check_files else 1), nchunks))

    def hash_chunks(lo: int, hi: int) -> list[str]:
        out = []
        fds = [os.open(p / n, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW) for n, _ in sizes]
        try:
            spans = [(fd, sum(z for _, z in sizes[:j]), sizes[j][1]) for j, fd in enumerate(fds)]
            buf = memoryview(bytearray(chunk_size))
            for i in range(lo, hi):
                n = m0.chunk_len(i)
                if _pread_spans(spans, i * chunk_size, buf[:n]) != n:
                    raise TransferError(f"transfer: refusing to send {p}: a file shrank while it was read", fatal=True)
                out.append(hashlib.sha256(buf[:n]).hexdigest())
        except _SpanReadError as e:  # the storage failed a read (EIO): named, as jobkit's check names it
            raise TransferError(f"transfer: refusing to send {p}: {e.describe(p, [n for n, _ in sizes])}",
                                fatal=True) from None
        finally:
            for fd in fds:
                os.close(fd)
        return out

    if not check_files:
        try:
            claims = {f["name"]: f for f in jobkit.read_manifest(p)["files"]}
        except jobkit.CheckpointError as e:
            raise TransferError(f"transfer: refusing to send {p}: {e}", fatal=True) from None
        for n, z in sizes:
            if n in claims and claims[n].get("size") != z:
                raise TransferError(f"transfer: refusing to send {p}: {n} has {z} bytes, its manifest says "
                                    f"{claims[n].get('size')}", fatal=True)
        missing = sorted(set(claims) - {n for n, _ in sizes})
        if missing:
            raise TransferError(f"transfer: refusing to send {p}: {missing[0]} is missing", fatal=True)
        extra = sorted(n for n, _ in sizes if n not in claims and n != jobkit.MANIFEST)
        if extra:
            raise TransferError(f"transfer: refusing to send {p}: files not in its manifest: {extra}", fatal=True)
        with ThreadPoolExecutor(k, thread_name_prefix="lm-xfer-manifest") as ex:
            parts = [ex.submit(hash_chunks, j * nchunks // k, (j + 1) * nchunks // k) for j in range(k)]
            chunks = [c for f in parts for c in f.result()]
        files = [(n, z, str(claims[n]["sha256"]) if n in claims else jobkit.file_sha256(p / n)) for n, z in sizes]
        m = Manifest(job_id, p.name, chunk_size, tuple(files), tuple(chunks), unchecked=True)
        Manifest.from_body(m.body())
        return m
    # Two SHA-256 passes, side by side in threads (hashlib lets go of the GIL): jobkit's over
    # each file it lists, which checks them against the job's manifest and gives their
    # hashes, and the chunks'.
    with ThreadPoolExecutor(k + 1, thread_name_prefix="lm-xfer-manifest") as ex:
        job = ex.submit(jobkit.verify_checkpoint, p)
        parts = [ex.submit(hash_chunks, j * nchunks // k, (j + 1) * nchunks // k) for j in range(k)]
        try:
            listed = {f["name"]: f["sha256"] for f in job.result()["files"]}
        except jobkit.CheckpointError as e:
            raise TransferError(f"transfer: refusing to send {p}: {e}", fatal=True) from None
        chunks = [c for f in parts for c in f.result()]
    files = [(n, z, listed[n] if n in listed else jobkit.file_sha256(p / n)) for n, z in sizes]
    m = Manifest(job_id, p.name, chunk_size, tuple(files), tuple(chunks))
    Manifest.from_body(m.body())  # same checks as the receiver: unsafe names fail here
    return m


def check_source(ckpt_dir: str | os.PathLike[str], m: Manifest) -> None:
    """The check an ``unchecked`` manifest's files still need: every file against the job's
    MANIFEST.json (jobkit's, one pass over each) and those hashes against ``m``. Raises
    SourceChangedError when the checkpoint is another since ``m`` was built (a re-save: send
    the new one), TransferError (fatal) when it is the same and does not match (corrupt on the
    source disk: never shipped whole, never committed)."""
    p = Path(ckpt_dir)

    def changed() -> bool:
        try:
            return bool(m.source) and _source_state(p) != m.source
        except (OSError, SourceChangedError):
            return True

    try:
        listed = {f["name"]: f["sha256"] for f in jobkit.verify_checkpoint(p)["files"]}
    except jobkit.CheckpointError as e:
        if changed():
            raise SourceChangedError(f"transfer: {p} changed while it was sent ({e})") from None
        raise TransferError(f"transfer: refusing to send {p}: {e}", fatal=True) from None
    if changed():
        raise SourceChangedError(f"transfer: {p} changed while it was sent (the job saved it again)")
    for name, _size, sha in m.files:
        if name in listed and listed[name] != sha:
            raise TransferError(f"transfer: refusing to send {p}: {name} does not match the SHA-256 it was sent "
                                "under", fatal=True)


# -- framing --------------------------------------------------------------------------------


def _canon(v: Any) -> bytes:
    return json.dumps(v, sort_keys=True, separators=(",", ":")).encode()


def _committed(key: bytes, ns: bytes, m: Manifest, path: Path) -> dict[str, Any]:
    """The destination's ``committed`` answer, MAC'd with this connection's nonce: a peer on
    the path cannot tell the sender a checkpoint is delivered."""
    return {"t": "committed", "digest": m.digest, "path": str(path),
            "mac": mac(key, b"laminar-committed", ns, m.digest.encode(), str(path).encode())}


def _check_committed(hdr: dict[str, Any], key: bytes, ns: bytes, m: Manifest) -> str:
    """The committed path of a ``committed`` answer whose MAC checks; raises TransferError."""
    path, digest = str(hdr.get("path", "")), str(hdr.get("digest", ""))
    want = mac(key, b"laminar-committed", ns, m.digest.encode(), path.encode())
    if digest != m.digest or not hmac.compare_digest(str(hdr.get("mac", "")), want):
        raise TransferError(f"transfer: {m.job_id}/{m.ckpt_id}: 'committed' answer without a valid MAC (tampered with "
                            "on the way, or the destination runs an older protocol)", fatal=True)
    return path


async def _send(w: asyncio.StreamWriter, hdr: dict[str, Any], payload: bytes = b"") -> None:
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    w.write(struct.pack(">I", len(raw)) + raw)
    if payload:
        w.write(payload)
    await w.drain()


class _Reader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


async def _recv(r: _Reader, timeout: float = IO_TIMEOUT_S, limit: int = MAX_HEADER, *,
                large: dict[bytes, int] | None = None, chunk_max: int | None = None,
                large_turn: Callable[[], contextlib.AbstractAsyncContextManager[Any]] | None = None,
                ) -> tuple[dict[str, Any], bytes]:
    """One message from ``r`` (the plain stream during the handshake, a :class:`_Channel`
    after it). ``limit``: the largest header read (MAX_HANDSHAKE before the peer has
    authenticated); ``large``: headers that may be longer, by their first bytes, each with its
    own limit (:data:`LARGE_HEADERS`); ``chunk_max``: the largest chunk payload read (None, the
    default: a chunk is refused here, before its payload is read). A header over CTL_MAX bytes
    is read and parsed in its turn (``large_turn()``, held meanwhile: :meth:`Receiver._large_turn`),
    and only when it has at most MAX_SEPARATORS separators, in a worker thread. Raises
    TransferError for a message too large or not a JSON object, and for the peer's ``error``
    (NoRoomError when it is a refusal for disk space)."""
    async with asyncio.timeout(timeout):  # each read: no task per read as with wait_for
        n = struct.unpack(">I", await r.readexactly(4))[0]
    head = b""
    if n > limit:
        allowed = large or {}
        if allowed and n <= max(allowed.values()):
            async with asyncio.timeout(timeout):
                head = await r.readexactly(min(n, max(map(len, allowed))))
        if not any(head.startswith(p) and n <= most for p, most in allowed.items()):
            when = " before authentication" if limit <= MAX_HANDSHAKE else ""
            but = "".join(f", {p.decode()}...: {most}" for p, most in allowed.items())
            raise RefusedMessage(f"transfer: header of {n} bytes exceeds {limit}{when}"
                                 + (f" (the most for one starting {but[2:]})" if but else ""), "too_large")
    try:
        if n > CTL_MAX:
            async with large_turn() if large_turn is not None else contextlib.nullcontext():
                async with asyncio.timeout(timeout):
                    raw = head + await r.readexactly(n - len(head))
                seps = raw.count(b",") + raw.count(b":")
                if seps > MAX_SEPARATORS:
                    raise RefusedMessage(f"transfer: a header of {n} bytes with {seps} JSON separators, more than "
                                         f"{MAX_SEPARATORS}: refused unparsed", "too_dense")
                hdr = await asyncio.to_thread(json.loads, raw)
                del raw
        else:
            async with asyncio.timeout(timeout):
                raw = head + await r.readexactly(n - len(head))
            hdr = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise TransferError(f"transfer: malformed message (not JSON): {e!r}") from None
    if not isinstance(hdr, dict) or "t" not in hdr:
        raise TransferError("transfer: message without a type")
    payload = b""
    if hdr.get("t") == "chunk":
        ln = hdr.get("len", -1)
        if chunk_max is None:
            raise RefusedMessage("transfer: a chunk before an offer: refused, its payload unread", "chunk_before_offer")
        if not isinstance(ln, int) or not 0 <= ln <= chunk_max:
            raise RefusedMessage(f"transfer: chunk length {ln} out of range 0..{chunk_max}", "too_large")
        async with asyncio.timeout(timeout):
            payload = await r.readexactly(ln)
    if hdr["t"] == "error":
        msg = f"transfer: peer error: {hdr.get('msg')}"
        if hdr.get("reason") == "no-room":
            try:
                raise NoRoomError(msg, int(hdr["need"]), int(hdr["avail"]))
            except (KeyError, TypeError, ValueError):
                pass
        raise TransferError(msg, fatal=bool(hdr.get("fatal")))
    return hdr, payload


def derive_keys(key: bytes, nonce_c: bytes, nonce_s: bytes) -> tuple[bytes, bytes]:
    """The two AES-256-GCM keys of one connection, (client to server, server to client):
    HKDF-SHA256 with the zone key as input key material, both sides' fresh handshake nonces
    (client's, then server's) as salt, and one label per direction as info."""
    from cryptography.hazmat.primitives.hashes import SHA256
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    def one(label: bytes) -> bytes:
        return HKDF(algorithm=SHA256(), length=32, salt=nonce_c + nonce_s, info=label).derive(key)

    return one(b"laminar-xfer-v2 client->server"), one(b"laminar-xfer-v2 server->client")


class _RecordBuffer(asyncio.BufferedProtocol):
    """What a connection receives after the handshake, read by the kernel straight into one
    preallocated buffer (``recv_into``), so a record's bytes are copied once on their way to
    AES-GCM instead of three times (StreamReader's bytearray, ``readexactly``'s bytes, the
    bytearray's shift). It takes the transport over from the StreamReaderProtocol (with what
    the StreamReader still held) and passes flow control and the connection's end on to it,
    so the StreamWriter's ``drain`` and ``wait_closed`` work as before. A view from
    :meth:`take` is valid until the next await.

    The buffer starts at START bytes and grows (doubling) while the peer sends faster than
    records are taken, up to two records' worth; it is SIZE once the connection carries a
    checkpoint (:meth:`bulk`, after the receiver accepted its offer). An authenticated
    connection that carries a control message, or none, holds little (it was SIZE, zero-filled,
    for every connection: 20 idle ones held 160 MiB)."""

    SIZE = 8 * (RECORD_MAX + RECORD_TAG + 4)
    START = 128 << 10
    SMALL = 2 * (RECORD_MAX + RECORD_TAG + 4)  # the most it grows to before bulk(): a whole record and the next's start
    LOW = 64 << 10  # free space below which the buffer is compacted, then grown or reading paused if still short
    READ = 512 << 10  # the most one recv_into takes

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.old = w.transport.get_protocol()
        self.transport: Any = w.transport  # a socket transport: it reads too
        held = bytes(getattr(r, "_buffer", b""))  # the handshake's peer waits for our answer: normally empty
        getattr(r, "_buffer", bytearray()).clear()
        self.cap = self.SMALL
        self.buf = bytearray(max(self.START, 2 * len(held)))
        self.mv = memoryview(self.buf)
        self.buf[:len(held)] = held
        self.start, self.end = 0, len(held)
        self.eof = bool(getattr(r, "_eof", False))
        self.exc: BaseException | None = r.exception()
        self.waiter: asyncio.Future[None] | None = None
        # StreamReader pauses the socket past twice its limit (a peer that sent on behind its
        # handshake): taken over as paused, so need() resumes it (else the rest never arrives)
        self.paused = bool(getattr(r, "_paused", False))
        self.transport.set_protocol(self)

    PRIVATE = ("_buffer", "_eof", "_paused")  # what is taken over from asyncio.StreamReader (not its API)

    @staticmethod
    def usable(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        """Whether this connection can be taken over: a socket transport and a StreamReader
        with the private state read above (a Python whose StreamReader lost one of them gets
        the slow path, ``readexactly``, rather than a guess: a reader taken over as not
        paused when it was would wait for ever)."""
        t = getattr(w, "transport", None)
        return (isinstance(getattr(r, "_buffer", None), bytearray) and isinstance(getattr(r, "_eof", None), bool)
                and isinstance(getattr(r, "_paused", None), bool) and t is not None
                and hasattr(t, "set_protocol") and not t.is_closing())

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _compact(self) -> None:
        if self.start:
            k = self.end - self.start
            self.mv[0:k] = self.mv[self.start:self.end]  # one memmove; the buffer is never resized
            self.start, self.end = 0, k

    def bulk(self) -> None:
        """The connection carries a checkpoint: the buffer is SIZE from now on (records arrive
        back to back; a large buffer reads them in fewer, larger reads and moves its bytes
        seldom, as every connection's did before)."""
        self.cap = max(self.cap, self.SIZE)
        self._grow(self.SIZE)

    def _grow(self, at_least: int) -> bool:
        """A larger buffer (at least ``at_least`` bytes, at most ``cap`` unless a record needs
        more), its bytes moved to the start; False when it is at ``cap`` already. Views taken
        before keep the old buffer alive as long as they are held."""
        size = max(at_least, min(self.cap, 2 * len(self.buf)))
        if size <= len(self.buf):
            return False
        k = self.end - self.start
        new = bytearray(size)
        new[:k] = self.mv[self.start:self.end]
        self.buf, self.mv = new, memoryview(new)
        self.start, self.end = 0, k
        return True

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self.buf) - self.end < self.LOW:
            self._compact()
        return self.mv[self.end:self.end + self.READ]  # one read copies at most this much: the loop runs between

    def buffer_updated(self, nbytes: int) -> None:
        self.end += nbytes
        if len(self.buf) - self.end < self.LOW:
            self._compact()
            if len(self.buf) - self.end < self.LOW and not self._grow(0) and not self.paused:
                self.paused = True
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        self.eof = True
        self._wake()
        return self.old.eof_received()  # type: ignore[attr-defined,no-any-return]

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.exc = exc
        self._wake()
        self.old.connection_lost(exc)

    def pause_writing(self) -> None:
        self.old.pause_writing()  # type: ignore[attr-defined]

    def resume_writing(self) -> None:
        self.old.resume_writing()  # type: ignore[attr-defined]

    async def need(self, n: int) -> None:
        """Waits until ``n`` bytes are buffered (``n`` at most a record). Raises
        asyncio.IncompleteReadError when the connection ends first (ConnectionError when it
        broke)."""
        while self.end - self.start < n:
            if self.eof:
                if self.exc is not None:
                    raise ConnectionResetError(str(self.exc))
                raise asyncio.IncompleteReadError(bytes(self.mv[self.start:self.end]), n)
            if len(self.buf) - self.start < n:
                self._compact()
                if len(self.buf) < n:
                    self._grow(n)
            if self.paused:
                self.paused = False
                self.transport.resume_reading()
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def take(self, n: int) -> memoryview:
        v = self.mv[self.start:self.start + n]
        self.start += n
        if self.start == self.end:
            self.start = self.end = 0
        return v


class _Channel:
    """Every message after the handshake, both ways, in AES-256-GCM records.

    A record on the wire is a 4-byte big-endian length L and L bytes of ciphertext with its
    16-byte tag; the plaintext is at most RECORD_MAX bytes of the message stream (the same
    length-prefixed JSON messages as the handshake's, a chunk's bytes after its header). The
    nonce is the record's number in its direction (12 bytes big-endian, from 0), the AAD its
    length prefix; each direction has its own key (:func:`derive_keys`), so a nonce is never
    used twice under one key. A record that fails (changed, replayed, reordered, one missing
    before it, too long) raises RecordError, counted in ``STATS.records_rejected`` and by
    ``on_reject``, and the channel refuses everything after it.

    On the event loop: AES-GCM here (cryptography 50, AES-NI) is about 0.1 ms per MiB either
    way, so records of at most 1 MiB keep each stop far under a millisecond and the sender
    yields between them; a record is sealed into one reused buffer (``encrypt_into``) and
    written with its length in one call, and records are received by :class:`_RecordBuffer`."""

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, tx_key: bytes, rx_key: bytes,
                 on_reject: Callable[[], None] | None = None) -> None:
        self.r, self.w = r, w
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._tx, self._rx = AESGCM(tx_key), AESGCM(rx_key)
        self._ntx = self._nrx = 0
        self.written = 0  # bytes handed to the transport (records with their length prefixes)
        self._buf: bytes = b""
        self._pos = 0
        self._broken: str | None = None
        self._lock = asyncio.Lock()
        self.on_reject = on_reject
        self._out = bytearray(0)  # grown to the largest record sealed yet (a receiver's: small answers)
        self._in = _RecordBuffer(r, w) if _RecordBuffer.usable(r, w) else None

    def bulk(self) -> None:
        """This connection carries a checkpoint now: its receive buffer may grow to its full size."""
        if self._in is not None:
            self._in.bulk()

    def path(self) -> str:
        """How this connection's records are read, for the log: the fast path or the slow."""
        if self._in is not None:
            return "fast path (recv_into one buffer)"
        return (f"slow path (StreamReader.readexactly: this Python's asyncio.StreamReader lacks "
                f"{'/'.join(_RecordBuffer.PRIVATE)}, or the transport cannot be taken over)")

    @classmethod
    def client(cls, r: asyncio.StreamReader, w: asyncio.StreamWriter, key: bytes, nc: bytes, ns: bytes) -> _Channel:
        c2s, s2c = derive_keys(key, nc, ns)
        return cls(r, w, c2s, s2c)

    @classmethod
    def server(cls, r: asyncio.StreamReader, w: asyncio.StreamWriter, key: bytes, nc: bytes, ns: bytes,
               on_reject: Callable[[], None] | None = None) -> _Channel:
        c2s, s2c = derive_keys(key, nc, ns)
        return cls(r, w, s2c, c2s, on_reject)

    def _seal(self, data: bytes | memoryview) -> None:
        n = len(data) + RECORD_TAG
        if len(self._out) < 4 + n:
            self._out = bytearray(min(4 + RECORD_MAX + RECORD_TAG, max(4 + n, 2 * len(self._out))))
        out = memoryview(self._out)[:4 + n]
        struct.pack_into(">I", out, 0, n)
        # the transport sends it now or copies what the socket did not take: the buffer is free again
        self._tx.encrypt_into(self._ntx.to_bytes(12, "big"), data, out[:4], out[4:])
        self._ntx += 1
        self.w.write(out)
        self.written += len(out)

    async def send(self, hdr: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> None:
        """One message (a header, and a chunk's bytes), in as many records as it takes."""
        await self.send_encoded(json.dumps(hdr, separators=(",", ":")).encode(), payload)

    async def send_encoded(self, raw: bytes, payload: bytes | bytearray | memoryview = b"") -> None:
        """:meth:`send` of a header already encoded as JSON (an offer: MBs, encoded in a thread)."""
        async with self._lock:  # records of two messages never interleave
            head = memoryview(struct.pack(">I", len(raw)) + raw)
            # one record, but an offer's manifest (past ~15k chunks) or a have/need list of
            # many chunks is longer than RECORD_MAX: then in several, as a chunk's bytes are
            self._seal(head[:RECORD_MAX])
            for off in range(RECORD_MAX, len(head), RECORD_MAX):
                await self.w.drain()
                self._seal(head[off:off + RECORD_MAX])
            view = memoryview(payload)
            for off in range(0, len(view), RECORD_MAX):
                self._seal(view[off:off + RECORD_MAX])
                await self.w.drain()
                await asyncio.sleep(0)  # the loop runs between records (drain may not yield)
            await self.w.drain()

    async def _record(self) -> bytes:
        if self._broken is not None:
            raise RecordError(self._broken)
        src = self._in
        if src is None:
            ln = await self.r.readexactly(4)
        else:
            await src.need(4)
            ln = bytes(src.take(4))
        n = struct.unpack(">I", ln)[0]
        if not RECORD_TAG <= n <= RECORD_MAX + RECORD_TAG:
            self._reject(f"a record of {n} bytes (at most {RECORD_MAX + RECORD_TAG})")
        if src is None:
            ct: bytes | memoryview = await self.r.readexactly(n)
        else:
            await src.need(n)
            ct = src.take(n)
        from cryptography.exceptions import InvalidTag

        try:
            pt = self._rx.decrypt(self._nrx.to_bytes(12, "big"), ct, ln)
        except InvalidTag:
            self._reject(f"record {self._nrx} failed authentication")
        self._nrx += 1
        return pt

    def _reject(self, why: str) -> NoReturn:
        self._broken = (f"transfer: {why} (changed, replayed, reordered or dropped on the way); "
                        "the connection is abandoned")
        STATS.records_rejected += 1
        if self.on_reject is not None:
            self.on_reject()
        raise RecordError(self._broken)

    async def readexactly(self, n: int) -> bytes:
        """``n`` bytes of the decrypted message stream. Raises RecordError,
        asyncio.IncompleteReadError (connection closed)."""
        parts: list[bytes] = []
        while n > 0:
            if self._pos >= len(self._buf):
                self._buf, self._pos = await self._record(), 0
            take = min(n, len(self._buf) - self._pos)
            if self._pos == 0 and take == len(self._buf):
                parts.append(self._buf)
            else:
                parts.append(self._buf[self._pos:self._pos + take])
            self._pos += take
            n -= take
        return parts[0] if len(parts) == 1 else b"".join(parts)


# -- progress and shaping hooks ---------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    job_id: str
    ckpt_id: str
    done_bytes: int  # persisted at the destination
    total_bytes: int
    elapsed_s: float

    @property
    def fraction(self) -> float:
        return 1.0 if self.total_bytes == 0 else self.done_bytes / self.total_bytes


@dataclass(frozen=True)
class Flow:
    """A transfer's TCP 5-tuple as the source sees it (local -> remote), IPv4 or IPv6.

    Addresses are kept as the packets carry them, so the flow hook registers the 5-tuple the data
    plane sees: a zone (``fe80::1%eth0``, part of an IPv6 socket's name) is dropped, and an
    IPv4-mapped address (``::ffff:10.0.0.2``, a dual-stack socket's name for an IPv4 peer) becomes
    its IPv4 address (the packets are IPv4). Raises ValueError for an address that is neither."""

    saddr: str
    sport: int
    daddr: str
    dport: int
    proto: str = "tcp"

    def __post_init__(self) -> None:
        from laminar.zone.membership import canonical_ip

        for name in ("saddr", "daddr"):
            raw = str(getattr(self, name))
            try:
                object.__setattr__(self, name, canonical_ip(raw))
            except ValueError:
                raise ValueError(f"flow {name} {raw!r} is not an IPv4 or IPv6 address") from None

    @classmethod
    def of_socket(cls, sockname: Any, peername: Any, proto: str = "tcp") -> Flow:
        """The flow of a connected socket from its ``getsockname()``/``getpeername()`` (an IPv4
        pair or an IPv6 4-tuple with flow info and scope id)."""
        return cls(str(sockname[0]), int(sockname[1]), str(peername[0]), int(peername[1]), proto)


class FlowHook(Protocol):
    """What the shaper and kill-switch need from a transfer (H5's transfer registry).
    ``register`` and ``unregister`` may return awaitables (the registry does netlink work on
    its own thread); they are awaited. ``progress`` is called on the loop, at most every
    ACK_POLL_S and once at the commit, with the registered bytes the peer's TCP has acknowledged
    (growing, at most the registered total; the total once the destination committed); never
    when the kernel cannot say (see :class:`_AckMeter`). It must not block."""

    def register(self, flow: Flow, job_id: str, total_bytes: int, deadline_monotonic: float | None) -> Any: ...

    def progress(self, handle: Any, acked_bytes: int) -> None: ...

    def unregister(self, handle: Any) -> Any: ...


# The sender reports to its flow hook what the peer's TCP has acknowledged, at most this often
# (and once more when the destination has committed): bytes written into the socket are not yet
# on the wire, and bytes the shaper's leaf sent may still be lost; acknowledged bytes are neither.
ACK_POLL_S = 0.2
_TCP_INFO_LEN = 256  # asks for more than any kernel's struct tcp_info has: the kernel returns what it has
_TCPI_BYTES_ACKED = 120  # offset of __u64 tcpi_bytes_acked in struct tcp_info (Linux 4.1+)
_SIOCOUTQ = 0x5411  # TIOCOUTQ: a TCP socket's bytes written and not yet acknowledged


def bytes_acked_of(info: bytes) -> int | None:
    """``tcpi_bytes_acked`` of a ``TCP_INFO`` answer, or None when the kernel's struct tcp_info is
    too short to have it (kernels before 4.1)."""
    if len(info) < _TCPI_BYTES_ACKED + 8:
        return None
    return int(struct.unpack_from("=Q", info, _TCPI_BYTES_ACKED)[0])


def tcp_bytes_acked(sock: Any) -> int | None:
    """Bytes of this TCP connection's stream the peer has acknowledged so far (the kernel's
    ``tcpi_bytes_acked``: one getsockopt, exact, never more than the peer's TCP received; the SYN
    and a FIN count one each, so take differences), or None when the kernel does not say (no such
    field, not a TCP socket)."""
    import socket as _socket

    try:
        info = sock.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError, ValueError):
        return None
    return bytes_acked_of(info)


def tcp_unacked_bytes(sock: Any) -> int | None:
    """Bytes written into this TCP socket that the peer has not acknowledged yet (``SIOCOUTQ``:
    unsent plus in flight), or None when the kernel does not say."""
    import array
    import fcntl

    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), _SIOCOUTQ, buf, True)
    except (OSError, AttributeError, ValueError):
        return None
    return int(buf[0])


class _AckMeter:
    """How many chunk payload bytes the peer's TCP has acknowledged, for the flow hook.

    The channel counts every byte it hands the transport (``_Channel.written``); the meter marks
    where each chunk's payload records lie in that stream, and maps the stream position the peer
    has acknowledged to payload bytes (a record's length prefix, a chunk's header and the AES-GCM
    tags are not payload). The acknowledged position comes from ``tcpi_bytes_acked`` (counted from
    where it stood when the meter started, when everything written before had been answered), or,
    on a kernel without it, from the bytes handed to the socket less ``SIOCOUTQ``. ``read`` returns
    None when the kernel says neither: the hook is then not told (the shaper keeps its estimate)."""

    def __init__(self, sock: Any, ch: _Channel) -> None:
        self.sock, self.ch = sock, ch
        self.chunks: collections.deque[tuple[int, int, int]] = collections.deque()  # (payload start, len, payload before)
        self.payload = 0  # chunk payload bytes written so far
        self.done = 0  # payload bytes of the chunks already wholly acknowledged
        self.base_acked = tcp_bytes_acked(sock)
        self.base_pos = self._in_kernel() - (tcp_unacked_bytes(sock) or 0)
        self.outq = self.base_acked is None and tcp_unacked_bytes(sock) is not None

    def _in_kernel(self) -> int:
        """Channel bytes the socket has taken (what the transport still buffers is not in it)."""
        tr = getattr(self.ch.w, "transport", None)
        buffered = tr.get_write_buffer_size() if tr is not None else 0
        return self.ch.written - int(buffered)

    def chunk_sent(self, n: int) -> None:
        """A chunk of ``n`` payload bytes has just gone to the channel: its header record, then its
        payload records, end at ``ch.written``."""
        wire = sum(4 + min(RECORD_MAX, n - off) + RECORD_TAG for off in range(0, n, RECORD_MAX))
        self.chunks.append((self.ch.written - wire, n, self.payload))
        self.payload += n

    def position(self) -> int | None:
        """The channel stream position up to which the peer has acknowledged, or None."""
        if self.base_acked is not None:
            now = tcp_bytes_acked(self.sock)
            return None if now is None else self.base_pos + now - self.base_acked
        if self.outq:
            q = tcp_unacked_bytes(self.sock)
            return None if q is None else self._in_kernel() - q
        return None

    def read(self) -> int | None:
        """Chunk payload bytes the peer has acknowledged (never more than written), or None."""
        pos = self.position()
        if pos is None:
            return None
        while self.chunks:
            start, n, before = self.chunks[0]
            x = pos - start
            got = 0
            for off in range(0, n, RECORD_MAX):
                rl = min(RECORD_MAX, n - off)
                if x >= 4 + rl + RECORD_TAG:
                    got += rl
                    x -= 4 + rl + RECORD_TAG
                else:
                    got += min(rl, max(0, x - 4))
                    break
            if got < n:
                return before + got
            self.chunks.popleft()
            self.done = before + n
        return self.done


def default_flow_hook(agent: Any) -> FlowHook | None:
    """The agent's transfer registry (``agent.transfers``, laminar.net.transfers) when it has
    one with register/progress/unregister, else None (the transfer then runs unshaped)."""
    reg = getattr(agent, "transfers", None)
    if reg is not None and all(hasattr(reg, a) for a in ("register", "progress", "unregister")):
        return reg  # type: ignore[no-any-return]
    return None


# -- sender ---------------------------------------------------------------------------------


@dataclass
class SendResult:
    job_id: str
    ckpt_id: str
    digest: str
    total_bytes: int
    sent_bytes: int  # chunk bytes put on the wire across all attempts
    skipped_bytes: int  # already held by the destination when the (last) attempt began
    attempts: int
    remote_path: str


class _Pacer:
    def __init__(self, rate_bps: float | None) -> None:
        self.rate = rate_bps
        self.t0 = time.monotonic()
        self.sent = 0

    async def pace(self, n: int) -> None:
        if not self.rate:
            return
        self.sent += n
        ahead = self.sent * 8 / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            await asyncio.sleep(ahead)


# a destination of another version answers our hello with one of these (v1: the first; v2 on: the second)
_OLD_HELLO = (re.compile(r"expected hello v(\d+), got 'hello' v"),
              re.compile(r"the source speaks transfer protocol v\d+, this agent v(\d+)"))


def version_mismatch(peer: object, side: str) -> str:
    """The error for a peer of another protocol version: names both versions and the fix."""
    return (f"transfer: the {side} speaks transfer protocol v{peer}, this agent v{PROTOCOL_VERSION} (since v2 "
            "checkpoint bytes are encrypted between agents, since v3 the sender's node id is authenticated and "
            "checked against its address); a zone's agents must be upgraded together")


def hello_identity(v: object, zone: object, node: object) -> bytes:
    """What a ``hello`` claims, as both handshake MACs cover it: the protocol version, the zone
    (whose key the destination uses) and the sender's node id, exactly as they travel (their
    canonical JSON). A peer on the path without the key cannot change any of them: the
    destination's ``challenge`` MAC would not match at the sender, nor the sender's ``auth``
    MAC at the destination."""
    return _canon([v, zone, node])


CHALLENGE_MACS_MAX = 8  # extra server proofs a client looks at: 3 zone keys (a rotation) x (pair key, zone key)


async def _client_handshake(r: asyncio.StreamReader, w: asyncio.StreamWriter, key: bytes, zone: int,
                            node: str) -> tuple[_Channel, bytes]:
    """Mutual authentication with the zone key, over the hello's claims too
    (:func:`hello_identity`); returns the encrypted channel for the rest of the connection and
    the server's nonce (binds later MACs to this connection). Raises TransferError (fatal,
    naming both versions, for a destination of another version; fatal for a destination that
    refuses this node's address, ``wrong_source``)."""
    nc = secrets.token_bytes(32)
    ident = hello_identity(PROTOCOL_VERSION, zone, node)
    await _send(w, {"t": "hello", "v": PROTOCOL_VERSION, "zone": zone, "node": node, "nonce": nc.hex()})
    try:
        hdr, _ = await _recv(r, HANDSHAKE_TIMEOUT_S, MAX_HANDSHAKE)
    except TransferError as e:
        for pat in _OLD_HELLO:
            old = pat.search(str(e))
            if old and old.group(1) != str(PROTOCOL_VERSION):
                raise TransferError(version_mismatch(old.group(1), "destination"), fatal=True) from None
        raise
    if hdr["t"] != "challenge":
        raise TransferError(f"transfer: expected challenge, got {hdr['t']!r}")
    try:
        ns = bytes.fromhex(hdr["nonce"])
        # macs: a zone key rotation, node keys (pair keys, then zone keys) during their roll-out
        smacs = [str(hdr["mac"]), *(x for x in (hdr.get("macs") or [])[:CHALLENGE_MACS_MAX]
                                    if isinstance(x, str) and x.isascii())]
    except (KeyError, TypeError, ValueError) as e:
        raise TransferError(f"transfer: malformed challenge (nonce and mac must be hex strings): {e!r}") from None
    want = mac(key, b"laminar-xfer-server", nc, ns, ident)
    if not any(hmac.compare_digest(m, want) for m in smacs):
        raise TransferError("transfer: the destination failed authentication (not a member of this zone, another key, "
                            "or the hello was changed on the way)", fatal=True)
    await _send(w, {"t": "auth", "mac": mac(key, b"laminar-xfer-client", ns, nc, ident)})
    hdr, _ = await _recv(r, HANDSHAKE_TIMEOUT_S, MAX_HANDSHAKE)
    if hdr["t"] != "ok":
        raise TransferError(f"transfer: expected ok, got {hdr['t']!r}")
    return _Channel.client(r, w, key, nc, ns), ns


async def send_checkpoint(
    host: str,
    port: int,
    ckpt_dir: str | os.PathLike[str],
    job_id: str,
    key: bytes,
    *,
    zone: int = 0,
    node: str = "",
    chunk_size: int = DEFAULT_CHUNK,
    rate_bps: float | None = None,
    deadline_monotonic: float | None = None,
    retries: int = 5,
    retry_delay_s: float = 0.5,
    silent_retries: int | None = None,
    progress: Callable[[Progress], None] | None = None,
    flow_hook: FlowHook | None = None,
    manifest: Manifest | None = None,
    local_host: str | None = None,
) -> SendResult:
    """Sends the jobkit checkpoint ``ckpt_dir`` of ``job_id`` to the receiver at host:port and
    returns once the destination has verified and committed it. Reconnects after a broken
    connection (up to ``retries`` more attempts, and never past ``deadline_monotonic``),
    sending only the chunks the destination does not hold. Raises TransferError on
    authentication failure, a corrupt source, or when attempts or time run out.
    ``silent_retries``: attempts after one whose destination said nothing
    (:class:`PeerSilentError`, raised once they are used up); None: as ``retries``. At the
    defaults a silent destination costs 6 timeouts and 5 delays (about 27 s connecting to a
    vanished host, 63 s handshaking with a hung agent); a caller that can send elsewhere
    passes 0.

    A checkpoint that changes under the sender (the job saves the same step again: jobkit
    replaces the directory) is seen when its manifest is built, or when a connection opens
    its files (:class:`SourceChangedError`): the manifest is built again and what is there
    now is sent, from the start (the destination drops a partial of another digest under
    the same name). After MAX_SOURCE_CHANGES such changes it gives up (TransferError, fatal,
    naming the count): a job that re-saves faster than its checkpoint can be sent must not
    keep the sender busy for ever. ``manifest``: built by the caller (it is built again if
    the checkpoint changed since). ``node``: this node's id, authenticated in the handshake;
    ``local_host``: the address the connections leave from (this node's roster address on a
    host with several: the destination checks it against ``node``'s; None: the route's)."""
    src = Path(ckpt_dir)
    changes = 0

    async def rebuild(why: TransferError | None) -> Manifest:
        """A manifest of what ``src`` holds now; ``why``: the change that makes it needed."""
        nonlocal changes
        while True:
            if why is not None:
                changes += 1
                if changes >= MAX_SOURCE_CHANGES:
                    raise TransferError(f"transfer: {job_id}/{src.name}: the checkpoint changed under the sender "
                                        f"{changes} times (the job saves it again faster than it is sent); giving up. "
                                        f"Last: {why}", fatal=True)
                log.info("transfer %s/%s: the checkpoint changed under the sender (%s); building its manifest again",
                         job_id, src.name, why)
                await asyncio.sleep(retry_delay_s)
            try:
                # hashing a checkpoint of many GB takes seconds: never on the agent's event loop;
                # the files' own check runs beside the transfer (check_source, before "done")
                return await asyncio.to_thread(functools.partial(build_manifest, ckpt_dir, job_id, chunk_size,
                                                                 check_files=False))
            except SourceChangedError as e:
                why = e
            except (TransferError, OSError) as e:
                if why is None or (isinstance(e, TransferError) and (src / jobkit.MANIFEST).is_file()):
                    raise  # the first look, or a checkpoint that is there and not valid: no re-save explains it
                why = SourceChangedError(f"{e}")  # gone mid re-save (the directory renamed away): look again

    checking: asyncio.Future[None] | None = None  # check_source of an unchecked manifest, beside the transfer

    def check(m: Manifest) -> asyncio.Future[None] | None:
        nonlocal checking
        if checking is not None:
            checking.cancel()  # the thread finishes on its own; its answer is not wanted
        checking = asyncio.ensure_future(asyncio.to_thread(check_source, src, m)) if m.unchecked else None
        return checking

    m = manifest if manifest is not None else await rebuild(None)
    try:
        return await _send_all(host, port, src, job_id, m, key, zone, node, rate_bps, deadline_monotonic, retries,
                               retry_delay_s, silent_retries, progress, flow_hook, local_host, rebuild, check)
    finally:
        if checking is not None:
            checking.cancel()
            with contextlib.suppress(BaseException):
                await checking


async def _send_all(
    host: str, port: int, src: Path, job_id: str, m: Manifest, key: bytes, zone: int, node: str, rate_bps: float | None,
    deadline_monotonic: float | None, retries: int, retry_delay_s: float, silent_retries: int | None,
    progress: Callable[[Progress], None] | None, flow_hook: FlowHook | None, local_host: str | None,
    rebuild: Callable[[TransferError | None], Awaitable[Manifest]],
    check: Callable[[Manifest], asyncio.Future[None] | None],
) -> SendResult:
    """:func:`send_checkpoint`'s attempts, from the manifest ``m`` on."""
    source_ok = check(m)
    offer = await asyncio.to_thread(_offer, m, key)  # the manifest's JSON (MBs) and digest: not on the loop
    t0 = time.monotonic()
    res = SendResult(job_id, m.ckpt_id, m.digest, m.total_bytes, 0, 0, 0, "")
    last: Exception | None = None
    attempt = 0
    silent = 0
    while attempt <= retries:
        if deadline_monotonic is not None and time.monotonic() >= deadline_monotonic:
            break
        res.attempts += 1
        try:
            await _send_once(host, port, src, m, offer, key, zone, node, rate_bps, deadline_monotonic, progress, flow_hook,
                             res, t0, local_host, source_ok)
            return res
        except SourceChangedError as e:  # not a failed attempt: another checkpoint to send
            m = await rebuild(e)
            source_ok = check(m)
            offer = await asyncio.to_thread(_offer, m, key)
            res.digest, res.total_bytes = m.digest, m.total_bytes
            continue
        except PeerSilentError as e:
            silent += 1
            if silent_retries is not None and silent > silent_retries:
                raise PeerSilentError(f"{e} (attempt {res.attempts}; not tried again: silent_retries={silent_retries})"
                                      ) from None
            last = e
        except TransferError as e:
            if e.fatal:
                raise
            last = e
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            last = e
        attempt += 1
        log.info("transfer %s/%s: attempt %d failed: %r", job_id, m.ckpt_id, res.attempts, last)
        await asyncio.sleep(retry_delay_s)
    raise TransferError(f"transfer: {job_id}/{m.ckpt_id} not delivered after {res.attempts} attempts: {last!r}")


def _offer(m: Manifest, key: bytes) -> bytes:
    """The ``offer`` message of ``m``, encoded (its digest computed and kept in ``m``)."""
    return json.dumps({"t": "offer", "manifest": m.body(), "mac": mac(key, b"laminar-manifest", m.digest.encode())},
                      separators=(",", ":")).encode()


async def _send_once(
    host: str, port: int, src: Path, m: Manifest, offer: bytes, key: bytes, zone: int, node: str, rate_bps: float | None,
    deadline: float | None, progress: Callable[[Progress], None] | None, flow_hook: FlowHook | None,
    res: SendResult, t0: float, local_host: str | None = None, source_ok: asyncio.Future[None] | None = None,
) -> None:
    """One connection's attempt. ``source_ok``: the source's check (:func:`check_source`) of an
    unchecked manifest, awaited before ``done`` (its error ends the transfer: the destination
    commits nothing)."""
    from laminar.zone.membership import host_port

    rd = _Source(src, m)  # opens the files first: SourceChangedError (before any byte is sent) when they changed
    where = host_port(host, port)  # [fd00::1]:7443 for IPv6
    try:
        r, w = await asyncio.wait_for(_connect(host, port, local_host), CONNECT_TIMEOUT_S)
    except TimeoutError:
        rd.close()
        raise PeerSilentError(f"transfer: {where} did not accept a connection in {CONNECT_TIMEOUT_S:g} s") from None
    except BaseException:
        rd.close()
        raise
    handle = None
    reader_task: asyncio.Task[None] | None = None
    acks_task: asyncio.Task[None] | None = None
    registered = 0  # the bytes the flow hook was told this attempt sends
    told = [0]  # the acknowledged bytes the flow hook was last told
    try:
        try:
            ch, ns = await _client_handshake(r, w, key, zone, node)
        except TimeoutError:
            raise PeerSilentError(f"transfer: {where} did not answer the handshake in "
                                  f"{HANDSHAKE_TIMEOUT_S:g} s") from None

        def committed(h: dict[str, Any]) -> None:
            """The destination holds the whole checkpoint, verified: its answer's MAC is checked."""
            res.remote_path = _check_committed(h, key, ns, m)
            if flow_hook is not None and handle is not None and told[0] < registered:
                flow_hook.progress(handle, registered)  # all of it: the destination says so
                told[0] = registered
            if progress:
                progress(Progress(m.job_id, m.ckpt_id, m.total_bytes, m.total_bytes, time.monotonic() - t0))

        if res.attempts == 1:
            log.info("transfer %s/%s to %s: records read by the %s", m.job_id, m.ckpt_id, where, ch.path())
        await ch.send_encoded(offer)
        hdr, _ = await _recv(ch)
        if hdr["t"] == "committed":
            return committed(hdr)
        if hdr["t"] != "have":
            raise TransferError(f"transfer: expected have, got {hdr['t']!r}")
        have = set(int(i) for i in hdr["chunks"])
        missing = [i for i in range(len(m.chunks)) if i not in have]
        res.skipped_bytes = sum(m.chunk_len(i) for i in have if 0 <= i < len(m.chunks))
        if flow_hook is not None:
            sock = w.get_extra_info("sockname")
            peer = w.get_extra_info("peername")
            registered = sum(m.chunk_len(i) for i in missing)
            handle = flow_hook.register(Flow.of_socket(sock, peer), m.job_id, registered, deadline)
            if inspect.isawaitable(handle):
                handle = await handle
        meter: _AckMeter | None = None
        if flow_hook is not None and handle is not None:
            raw = w.get_extra_info("socket")
            meter = _AckMeter(raw, ch) if raw is not None else None
            if meter is not None:
                acks_task = asyncio.create_task(_report_acks(meter, flow_hook, handle, registered, told))
        replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def read_replies() -> None:
            while True:
                h, _ = await _recv(ch, timeout=3600)
                if h["t"] == "ack":
                    if progress:
                        progress(Progress(m.job_id, m.ckpt_id, int(h["bytes"]), m.total_bytes, time.monotonic() - t0))
                else:
                    await replies.put(h)

        reader_task = asyncio.create_task(read_replies())
        pacer = _Pacer(rate_bps)
        with rd:
            for _round in range(MAX_NEED_ROUNDS + 1):
                try:
                    async for i, data in rd.chunks(missing):
                        await ch.send({"t": "chunk", "i": i, "len": len(data)}, data)
                        res.sent_bytes += len(data)
                        if meter is not None:
                            meter.chunk_sent(len(data))
                        await pacer.pace(len(data))
                        if reader_task.done():
                            reader_task.result()  # surfaces the peer's error or a broken connection
                    if source_ok is not None:
                        await _source_checked(source_ok, reader_task)
                    await ch.send({"t": "done"})
                except (OSError, asyncio.IncompleteReadError) as e:
                    # The peer may have said why before it closed (an error, a record that
                    # failed): its reason beats "connection lost".
                    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                        await asyncio.wait_for(asyncio.shield(reader_task), 1.0)
                    if reader_task.done() and not reader_task.cancelled() and reader_task.exception() is not None:
                        raise reader_task.exception() from None  # type: ignore[misc]
                    raise e
                get = asyncio.ensure_future(replies.get())
                await asyncio.wait({get, reader_task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    reader_task.result()
                    raise TransferError("transfer: connection closed before the destination answered")
                h = get.result()
                if h["t"] == "committed":
                    return committed(h)
                if h["t"] != "need":
                    raise TransferError(f"transfer: expected need or committed, got {h['t']!r}")
                missing = sorted(int(i) for i in h["chunks"])
                log.warning("transfer %s/%s: destination needs %d chunks again", m.job_id, m.ckpt_id, len(missing))
        raise TransferError(f"transfer: {m.job_id}/{m.ckpt_id}: chunks still failing after {MAX_NEED_ROUNDS} rounds")
    finally:
        rd.close()
        if acks_task is not None:
            acks_task.cancel()
            with contextlib.suppress(BaseException):
                await acks_task
        if reader_task is not None:
            reader_task.cancel()
            with contextlib.suppress(BaseException):
                await reader_task
        if flow_hook is not None and handle is not None:
            done = flow_hook.unregister(handle)
            if inspect.isawaitable(done):
                with contextlib.suppress(Exception):
                    await done
        w.close()
        with contextlib.suppress(Exception):
            await w.wait_closed()


async def _source_checked(source_ok: asyncio.Future[None], reader_task: asyncio.Task[None]) -> None:
    """Waits for the source's check (raises its error), or for the connection to fail first."""
    await asyncio.wait({source_ok, reader_task}, return_when=asyncio.FIRST_COMPLETED)
    if not source_ok.done():
        reader_task.result()  # the peer's error or a broken connection
        raise TransferError("transfer: the destination closed the connection while the source was checked")
    source_ok.result()


async def _report_acks(meter: _AckMeter, hook: FlowHook, handle: Any, total: int, told: list[int]) -> None:
    """Tells ``hook`` every ACK_POLL_S how many payload bytes the peer has acknowledged, when it
    grew past ``told[0]`` (kept there; at most ``total``, the bytes registered: chunks sent again
    after a ``need`` count again)."""
    while True:
        await asyncio.sleep(ACK_POLL_S)
        n = meter.read()
        if n is None:  # the kernel does not say (any more): the shaper keeps its own estimate
            return
        n = min(n, total)
        if n > told[0]:
            hook.progress(handle, n)
            told[0] = n


def _connect(host: str, port: int, local_host: str | None) -> Awaitable[tuple[asyncio.StreamReader,
                                                                             asyncio.StreamWriter]]:
    """A connection to host:port leaving from ``local_host`` (any port) when given."""
    return asyncio.open_connection(host, port, local_addr=(local_host, 0) if local_host else None)


async def send_control(
    host: str, port: int, key: bytes, op: str, body: Any, *, zone: int = 0, node: str = "",
    timeout: float = HANDSHAKE_TIMEOUT_S, local_host: str | None = None,
) -> Any:
    """Sends one control message (``op`` with a JSON ``body``) to a :class:`Receiver` and
    returns its answer. The message is MAC'd with the zone key and the server's nonce of this
    connection, so it can be neither forged nor replayed; ``node`` (this node's id, which the
    destination answers as) is authenticated in the handshake, and checked there against the
    connection's address, which leaves from ``local_host`` when given (as
    :func:`send_checkpoint`). Raises TransferError (peer refused, authentication) or
    OSError/TimeoutError (unreachable)."""
    r, w = await asyncio.wait_for(_connect(host, port, local_host), timeout)
    try:
        ch, ns = await asyncio.wait_for(_client_handshake(r, w, key, zone, node), timeout)
        raw = _canon(body)
        await ch.send({"t": "ctl", "op": op, "body": body, "mac": mac(key, b"laminar-ctl", ns, op.encode(), raw)})
        hdr, _ = await _recv(ch, timeout)
        if hdr["t"] != "ctl-ok":
            raise TransferError(f"transfer: expected ctl-ok, got {hdr['t']!r}")
        result = hdr.get("result")
        if not hmac.compare_digest(str(hdr.get("mac", "")), mac(key, b"laminar-ctl-ok", ns, op.encode(), _canon(result))):
            raise TransferError(f"transfer: the answer to control {op!r} has no valid MAC (tampered with on the way, "
                                "or the peer runs an older protocol)", fatal=True)
        return result
    finally:
        w.close()
        with contextlib.suppress(Exception):
            await w.wait_closed()


# -- receiver -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Committed:
    job_id: str
    ckpt_id: str
    path: Path
    digest: str
    peer_node: str


KeyLookup = Callable[[int], bytes | None]


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


def _copy_range(src: int, dst: int, n: int, src_off: int, dst_off: int) -> int:
    """Copies ``n`` bytes between files at the given offsets; the bytes copied (fewer at the
    source's end). In the kernel (copy_file_range: no round trip through this process, a
    reflink where the filesystem shares blocks) when it can, else by pread/pwrite."""
    done = 0
    try:
        while done < n:
            k = os.copy_file_range(src, dst, n - done, src_off + done, dst_off + done)
            if k == 0:
                return done
            done += k
        return done
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM) or done:
            raise
    block = os.pread(src, n, src_off)
    os.pwrite(dst, block, dst_off)
    return len(block)


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


_NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # the receive root is full: another destination may have room
_DISK_ERRNOS = (*_NO_ROOM_ERRNOS, errno.EIO)  # what a destination refuses a transfer for, naming it, when it writes


def _errno_name(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e.errno))


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


class _KeyLocks:
    """One asyncio.Lock per checkpoint being received, so that two connections offering the
    same checkpoint are served one after the other. An entry lives only while a connection
    holds or waits on its lock: the map has at most one entry per connection, not one per
    checkpoint ever offered (an agent receiving checkpoints for months keeps no trace of them)."""

    def __init__(self) -> None:
        self._m: dict[tuple[str, str], list[Any]] = {}  # key -> [its lock, connections holding or waiting]

    def __len__(self) -> int:
        return len(self._m)

    def held(self) -> set[tuple[str, str]]:
        """The keys whose lock a connection holds now."""
        return {k for k, (lock, _n) in self._m.items() if lock.locked()}

    @contextlib.asynccontextmanager
    async def hold(self, key: tuple[str, str], timeout: float) -> Any:
        """Holds ``key``'s lock for the body; waits at most ``timeout`` seconds for it, then
        raises TransferError (busy). The entry is dropped when its last user leaves, whether
        it held the lock, timed out or was cancelled."""
        ent = self._m.get(key)
        if ent is None:
            ent = self._m[key] = [asyncio.Lock(), 0]
        ent[1] += 1
        try:
            try:
                async with asyncio.timeout(timeout):  # Lock.acquire passes a wake-up on when cancelled
                    await ent[0].acquire()
            except TimeoutError:
                raise TransferError(f"transfer: {key[0]}/{key[1]} is busy with another connection") from None
            try:
                yield
            finally:
                ent[0].release()
        finally:
            ent[1] -= 1
            if not ent[1]:
                del self._m[key]


class Receiver:
    """The transfer endpoint of an agent: receives, verifies and commits checkpoints under
    ``root``. ``keys`` maps a zone id to its key (``ZoneKeys.get``) or is one key for all.
    ``on_commit`` is called with each committed checkpoint; ``on_progress`` with progress;
    ``on_control(node, op, body)`` answers authenticated control messages (:func:`send_control`).
    ``margin_bytes``: disk kept free beyond what offers take (None: :func:`offer_room`'s
    default, 5% of the filesystem, at most 1 GiB); an offer that does not fit is refused
    (NoRoomError at the sender).

    The sender's ``node`` (and ``zone``) in its hello are covered by both handshake MACs
    (:func:`hello_identity`), so nobody on the path changes them; but the key is the zone's,
    so any member could still claim another node's id. ``sources(node)`` (None: not checked)
    binds a node id to an address: it gives the canonical IP (:func:`laminar.zone.membership.
    canonical_ip`) that node's connections must come from, or None for a node id the roster
    does not list (or one that is not a number). A connection whose peer IP differs, after
    the client authenticated and before ``ok``, is refused with a fatal error naming both
    addresses, and counted (``wrong_source`` here, ``STATS.wrong_source``): it carries
    nothing, no control message and no checkpoint.

    Who may hold the port is the ``gate``'s to decide (:mod:`laminar.zone.gate`; the agent's
    admits only roster addresses with ``zone.check_source``, a share each; None: every address
    a stranger, a share each): a connection refused there is reset unread. The handshake has
    one deadline (HANDSHAKE_DEADLINE_S), and the node a hello names is checked against the
    connection's address before any MAC is computed. Once authenticated, the connection takes
    one of its member's slots (``gate.authenticate``; refused past it, non-fatal: try again
    later). Its first message is a control message (at most CTL_MAX bytes, a ``guard`` at most
    GUARD_MAX) or an offer (at most MAX_HEADER); a chunk before an offer is refused unread, and
    a chunk's payload is read only up to the manifest's chunk size.

    Counters: ``records_rejected`` (records that failed authentication, each ended its
    connection), ``refused_no_room``, ``wrong_source``; ``gate.stats()`` (connections refused
    by reason)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        keys: bytes | KeyLookup,
        on_commit: Callable[[Committed], Awaitable[None] | None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_control: Callable[[str, str, Any], Any] | None = None,
        margin_bytes: int | None = None,
        sources: Callable[[int], str | None] | None = None,
        pair_keys: Callable[[int, tuple[bytes, ...]], tuple[bytes, ...]] | None = None,
        gate: Gate | None = None,
        may_offer: Callable[[str, str], str | None] | None = None,
    ) -> None:
        if margin_bytes is not None and (isinstance(margin_bytes, bool) or not isinstance(margin_bytes, int)
                                         or margin_bytes < 0):
            raise ValueError(f"Receiver: margin_bytes={margin_bytes!r}, expected an integer >= 0 or None")
        self.margin_bytes = margin_bytes
        self.records_rejected = 0
        self.refused_no_room = 0
        self.wrong_source = 0
        # (the sender's node, the offer's job key) -> None, or why that node may not send that key's
        # checkpoints here (laminar.zone.authority.offer_refusal): refused before a byte is taken
        self.may_offer = may_offer
        self.refused_authority = 0
        self.sources = sources
        # node keys (laminar.zone.keys.PairKeys): (the node a hello names, the zone's keys) -> the
        # keys its proof may verify under: its pair keys, and the zone keys too unless required
        self.pair_keys = pair_keys
        self._active: dict[tuple[str, str], tuple[Path, int]] = {}  # accepted offers: partial file, total bytes
        self.root = Path(root)
        self.on_control = on_control
        self.keys: KeyLookup = (lambda _z, k=keys: k) if isinstance(keys, bytes) else keys  # type: ignore[misc]
        self.on_commit = on_commit
        self.on_progress = on_progress
        self.gate = gate if gate is not None else Gate()
        self.refused: collections.Counter[str] = collections.Counter()  # messages refused unparsed, by reason
        # member -> (its turns at large headers, connections using or waiting for one): _large_turn
        self._large: dict[str, tuple[asyncio.Semaphore, int]] = {}
        self._large_total = asyncio.Semaphore(LARGE_TOTAL)
        self.server: GatedListener | None = None
        self.port: int | None = None  # the port it listens on (kept while a relisten finds it taken)
        self._locks = _KeyLocks()
        self.committed: list[Committed] = []

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: any free port); returns the bound port. First removes what
        a crash left (:meth:`sweep` with ``at_start``)."""
        (self.root / "incoming").mkdir(parents=True, exist_ok=True)
        (self.root / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.sweep(at_start=True)
        await self._bind(host, port)
        assert self.port is not None
        return self.port

    async def _bind(self, host: str, port: int) -> None:
        # '::' (with a port): every address of both families (an '::' socket alone is IPv6 only)
        srv = GatedListener(self.gate, self._handle, "transfer port")
        self.port = await srv.start(None if host == "::" and port else host, port)
        self.server = srv

    async def _close(self) -> None:
        if self.server is not None:
            self.server.close()  # transfers being received go on
            self.server = None

    async def relisten(self, host: str) -> None:
        """Listen on ``host`` at the same port instead (the zone's roster address once usable:
        ZoneComponent.on_rebind); transfers being received go on. When ``host`` cannot be bound
        the old address is listened on again and the OSError raised; when neither can be,
        nothing listens until the next call (:func:`laminar.listen.relisten`)."""
        await listen.relisten(self.server, self.port, host, self._bind, self._close)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    def stats(self) -> dict[str, int]:
        """Connections refused or cut by reason, and held now (:meth:`laminar.zone.gate.Gate.stats`),
        with ``wrong_source`` (a hello naming a node whose roster address is not the peer's) and
        messages refused unparsed by reason (:data:`REFUSED_REASONS`)."""
        return {**self.gate.stats(), "wrong_source": self.wrong_source,
                **{r: self.refused[r] for r in REFUSED_REASONS}}

    def sweep(self, at_start: bool = False, now: float | None = None) -> list[Path]:
        """Removes what interrupted transfers left and returns it: a partial transfer
        (``incoming/<job>/<ckpt>/``) no connection is receiving whose files are all older than
        INCOMING_STALE_S (a younger one is how a transfer resumes, across restarts too), job
        directories left empty under ``incoming/``, and, ``at_start`` (nothing is being
        committed), commit temporaries ``checkpoints/<job>/.tmp-*`` of a destination that died
        mid-commit. Links are removed as links; nothing outside ``root`` is touched."""
        now = time.time() if now is None else now
        gone: list[Path] = []
        busy = self._locks.held()
        for jd in _subdirs(self.root / "incoming"):
            for cd in _subdirs(jd):
                if (jd.name, cd.name) in busy:
                    continue
                try:
                    newest = max([cd.lstat().st_mtime, *(x.lstat().st_mtime for x in cd.iterdir())])
                except OSError:
                    continue
                if now - newest >= INCOMING_STALE_S:
                    shutil.rmtree(cd, ignore_errors=True)
                    gone.append(cd)
            with contextlib.suppress(OSError):
                jd.rmdir()  # only when empty
        if at_start:
            for jd in _subdirs(self.root / "checkpoints"):
                for t in jd.glob(".tmp-*"):
                    if t.is_dir() and not t.is_symlink():
                        shutil.rmtree(t, ignore_errors=True)
                    else:
                        t.unlink(missing_ok=True)
                    gone.append(t)
        for g in gone:
            log.info("transfer: removed %s (left by an interrupted transfer)", g)
        return gone

    def final_dir(self, job_id: str, ckpt_id: str) -> Path:
        return self.root / "checkpoints" / job_id / ckpt_id

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, ip: str, slot: Slot) -> None:
        peer = w.get_extra_info("peername")
        ch: _Channel | None = None  # after the handshake: everything goes through it
        member: Slot | None = None
        try:
            try:
                async with asyncio.timeout(HANDSHAKE_DEADLINE_S):
                    node, key, nc, ns = await self._handshake(r, w, ip)
            except TimeoutError:
                self.gate.count("slow")
                raise
            slot.release()  # authenticated: its handshake slot goes back, one of its member's is taken
            ch = _Channel.server(r, w, key, nc, ns, self._count_reject)
            member = self.gate.authenticate(node)
            if member is None:
                raise TransferError(f"transfer: node {node} has {self.gate.authenticated.per_key} connections here "
                                    "already (or this node has its most); try again later")
            # a control message or an offer; a chunk here is refused before its payload is read
            hdr, _ = await _recv(ch, limit=CTL_MAX, large=LARGE_HEADERS, large_turn=lambda: self._large_turn(node))
            if hdr["t"] == "ctl":
                await self._control(ch, hdr, node, key, ns)
                return
            if hdr["t"] != "offer":
                raise TransferError(f"transfer: expected offer, got {hdr['t']!r}")
            # checked and its digest computed in a worker thread: ~7 MB of JSON for 100 GiB in 1 MiB chunks
            m = await asyncio.to_thread(_offered, hdr, key)
            why = self.may_offer(node, m.job_id) if self.may_offer is not None else None
            if why is not None:
                self.refused_authority += 1
                raise TransferError(f"transfer: {m.job_id}/{m.ckpt_id} refused: {why}", fatal=True)
            async with self._locks.hold((m.job_id, m.ckpt_id), IO_TIMEOUT_S):
                await self._receive(ch, m, node, key, ns)
        except (TransferError, ValueError, KeyError, TypeError) as e:
            log.warning("transfer from %s: %s", peer, e)
            if isinstance(e, RefusedMessage):
                self.refused[e.reason] += 1
            err: dict[str, Any] = {"t": "error", "msg": str(e), "fatal": getattr(e, "fatal", False)}
            if isinstance(e, NoRoomError):
                err.update(reason="no-room", need=e.need, avail=e.avail)
            with contextlib.suppress(Exception):
                await (ch.send(err) if ch is not None else _send(w, err))
            if ch is not None and ch._in is not None:
                await _linger(ch._in, w)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ConnectionError) as e:
            log.info("transfer from %s: connection lost: %r", peer, e)
        finally:
            if member is not None:
                member.release()
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()

    @contextlib.asynccontextmanager
    async def _large_turn(self, node: str) -> AsyncIterator[None]:
        """A turn to read and parse a header over CTL_MAX of ``node``'s: at most LARGE_PER_MEMBER
        of one member at once, LARGE_TOTAL in all; waits at most IO_TIMEOUT_S for it."""
        mine, users = self._large.get(node) or (asyncio.Semaphore(LARGE_PER_MEMBER), 0)
        self._large[node] = (mine, users + 1)
        try:
            async with asyncio.timeout(IO_TIMEOUT_S):
                await mine.acquire()
                try:
                    await self._large_total.acquire()
                except BaseException:
                    mine.release()
                    raise
            try:
                yield
            finally:
                self._large_total.release()
                mine.release()
        finally:
            sem, users = self._large[node]
            if users > 1:
                self._large[node] = (sem, users - 1)
            else:
                del self._large[node]  # nobody waits: the map holds only members reading now

    def _count_reject(self) -> None:
        self.records_rejected += 1

    async def _control(self, ch: _Channel, hdr: dict[str, Any], node: str, key: bytes, ns: bytes) -> None:
        body = hdr.get("body")
        op = hdr.get("op")
        if not isinstance(op, str):
            raise TransferError(f"transfer: control message without an op (a string): {op!r}", fatal=True)
        # The MAC covers the op too: otherwise a "guard" could be turned into a "release" on the way.
        if not hmac.compare_digest(str(hdr.get("mac", "")), mac(key, b"laminar-ctl", ns, op.encode(), _canon(body))):
            raise TransferError("transfer: control message rejected: its MAC does not match", fatal=True)
        if self.on_control is None:
            raise TransferError(f"transfer: this endpoint takes no control messages (op {op!r})", fatal=True)
        try:
            res = self.on_control(node, op, body)
            if asyncio.iscoroutine(res):
                res = await res
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"transfer: control {op!r} refused: {e}", fatal=True) from None
        await ch.send({"t": "ctl-ok", "result": res, "mac": mac(key, b"laminar-ctl-ok", ns, op.encode(), _canon(res))})

    def _check_source(self, node: str, ip: str) -> None:
        """Refuses (TransferError, fatal; counted) a connection from ``ip`` whose hello named
        ``node`` when ``sources`` binds ``node`` to another address or knows no such node."""
        if self.sources is None:
            return
        from laminar.zone.membership import canonical_ip

        n = int(node) if node.isascii() and node.isdigit() else None
        want = None if n is None else self.sources(n)
        try:
            got = canonical_ip(ip)
        except ValueError:
            got = ip
        if want == got:
            return
        self.wrong_source += 1
        STATS.wrong_source += 1
        why = (f"node {node!r} is not in this node's zone roster" if want is None else
               f"node {n}'s transfer connections come from {want} (its [[zone.nodes]] address), this one from {got}")
        log.warning("transfer: refused a connection from %s claiming node %r: %s (wrong_source)", ip, node, why)
        raise TransferError(f"transfer: {why}: refused (wrong_source; zone.check_source = false turns the check off "
                            "for NAT'd or multi-homed nodes)", fatal=True)

    async def _handshake(self, r: asyncio.StreamReader, w: asyncio.StreamWriter,
                         ip: str = "?") -> tuple[str, bytes, bytes, bytes]:
        """Mutual authentication, over the hello's claims too (:func:`hello_identity`): (the
        peer's node, the zone key, client nonce, server nonce). A hello of another version is
        refused with an error naming both (fatal: an old sender does not retry); with
        ``sources``, a hello naming a node whose roster address is not ``ip`` (the connection's
        peer) is refused before any MAC is computed."""
        hdr, _ = await _recv(r, HANDSHAKE_TIMEOUT_S, MAX_HANDSHAKE)
        if hdr["t"] != "hello":
            raise TransferError(f"transfer: expected hello v{PROTOCOL_VERSION}, got {hdr.get('t')!r}")
        if hdr.get("v") != PROTOCOL_VERSION:
            raise TransferError(version_mismatch(hdr.get("v"), "source"), fatal=True)
        try:
            zone = hdr.get("zone", 0)
            if isinstance(zone, bool) or not isinstance(zone, int):
                raise TypeError(f"zone {zone!r} is not an integer")
            nc = bytes.fromhex(hdr["nonce"])
            node = hdr.get("node", "")
            if not isinstance(node, str):
                raise TypeError(f"node {node!r} is not a string")
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"transfer: malformed hello (zone: an integer, node: a string, nonce: a hex string): "
                                f"{e!r}") from None
        key = self.keys(zone)
        if key is None:
            raise TransferError(f"transfer: no key for zone {zone}", fatal=True)
        if len(nc) < 16:
            raise TransferError("transfer: client nonce too short")
        # whether the node it names may connect from here, before any MAC work: the claim is not
        # proven yet, but a connection that cannot be that node's is refused at no cost
        self._check_source(node, ip)
        ns = secrets.token_bytes(32)
        ident = hello_identity(hdr.get("v"), zone, node)
        # during a zone key rotation the zone lists more keys (laminar.zone.keys.ZoneKey.accepted), and the
        # source signs with its current one, which may be any of them: prove each, accept the source's proof
        # under any, and use the key that verified from here on (session keys, manifest and commit MACs)
        keys = tuple(getattr(key, "accepted", (key,)))
        if self.pair_keys is not None and node.isascii() and node.isdigit():
            # a node with a node key: its pair key with this node (laminar.zone.keys.PairKeys), as
            # the zone's datagrams; with node_keys = require, nothing else
            keys = self.pair_keys(int(node), keys)
        extra = {"macs": [mac(k, b"laminar-xfer-server", nc, ns, ident) for k in keys[1:]]} if len(keys) > 1 else {}
        await _send(w, {"t": "challenge", "nonce": ns.hex(), "mac": mac(keys[0], b"laminar-xfer-server", nc, ns, ident),
                        **extra})
        auth, _ = await _recv(r, HANDSHAKE_TIMEOUT_S, MAX_HANDSHAKE)
        got = str(auth.get("mac", ""))
        verified = next((k for k in keys if hmac.compare_digest(got, mac(k, b"laminar-xfer-client", ns, nc, ident))),
                        None)
        if auth["t"] != "auth" or verified is None:
            raise TransferError("transfer: client failed authentication (another key, or its hello was changed on the "
                                "way)", fatal=True)
        key = bytes(verified)
        await _send(w, {"t": "ok"})  # the last message in the clear
        return node, key, nc, ns

    def receiving(self, job_id: str) -> bool:
        """Whether a checkpoint of ``job_id`` (a replica key) is being received or committed now."""
        return (any(k[0] == job_id for k in self._active)
                or any(k[0] == job_id for k in self._locks.held()))

    def free_for_offers(self) -> int:
        """Bytes an offer may take now without being refused for room (before its 4 MiB commit
        block): the receive root's free space less what transfers in progress still lack and
        the margin; 0 at least. What a ``space`` answer should say. Raises OSError."""
        r = offer_room(0, 0, self._reserved(None), *self._fs())
        return max(0, r.avail - r.need)

    def _fs(self) -> tuple[int, int, int | None]:
        st = os.statvfs(self.root / "incoming")
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, self.margin_bytes

    def _reserved(self, mine: tuple[str, str] | None) -> int:
        return sum(max(0, total - _allocated(p)) for k, (p, total) in self._active.items() if k != mine)

    def _room(self, m: Manifest, partial: Path) -> Room:
        """What accepting ``m`` takes from the receive root's filesystem, measured now."""
        return offer_room(m.total_bytes, _allocated(partial), self._reserved((m.job_id, m.ckpt_id)), *self._fs())

    async def _receive(self, ch: _Channel, m: Manifest, node: str, key: bytes, ns: bytes) -> None:
        final = self.final_dir(m.job_id, m.ckpt_id)
        if final.exists():
            try:
                # hashing a checkpoint of many GB takes seconds: in a worker thread, never on the
                # agent's event loop (probes, heartbeats, kill-switches); so are verify_all and
                # the commit below
                await asyncio.to_thread(verified_checkpoint, final)
                old = await asyncio.to_thread(lambda: json.loads((final / TRANSFER_MANIFEST).read_text()))
            except (TransferError, OSError, ValueError) as e:
                # Not restorable (changed or lost files at rest, a half-removed copy): "committed"
                # would tell the sender it is delivered while nothing here can be resumed from.
                log.warning("transfer %s/%s: the committed copy no longer verifies (%s); receiving it again",
                            m.job_id, m.ckpt_id, e)
                shutil.rmtree(final)
            else:
                if old.get("body", {}).get("files") == [list(f) for f in m.files]:  # same bytes, any chunking
                    await ch.send(_committed(key, ns, m, final))
                    return
                raise TransferError(f"transfer: {m.job_id}/{m.ckpt_id} is already committed with other content",
                                    fatal=True)
        d = self.root / "incoming" / m.job_id / m.ckpt_id
        room = self._room(m, d / "data.partial")
        if not room.fits:
            self.refused_no_room += 1
            STATS.offers_refused_no_room += 1
            raise NoRoomError(
                f"transfer: no room for {m.job_id}/{m.ckpt_id} ({m.total_bytes} bytes) under {self.root}: needs "
                f"{room.need} bytes (this checkpoint {room.own}, transfers in progress {room.reserved}, margin "
                f"{room.margin}), {room.avail} bytes available", room.need, room.avail)
        # no await between the check and this: two offers cannot both count the same free space
        self._active[(m.job_id, m.ckpt_id)] = (d / "data.partial", m.total_bytes)
        ch.bulk()  # an accepted offer: its chunks come back to back
        try:
            await self._receive_into(ch, m, node, key, ns, d)
        except OSError as e:
            if e.errno not in _DISK_ERRNOS:
                raise
            raise self._disk_refusal(m, d, e) from None
        finally:
            self._active.pop((m.job_id, m.ckpt_id), None)  # its reservation goes with it

    def _disk_refusal(self, m: Manifest, d: Path, e: OSError) -> TransferError:
        """The error that tells the sender why this destination stopped writing ``m``: the
        disk filled (ENOSPC, EDQUOT: another writer took the room the offer's check saw;
        NoRoomError, fatal, counted as a refusal for room) or failed (EIO: fatal). The chunks
        persisted so far stay in ``d`` (a later offer resumes from them when there is room;
        :meth:`sweep` removes them after INCOMING_STALE_S)."""
        held = 0
        with contextlib.suppress(OSError, ValueError):
            held = sum(1 for x in (d / "have.log").read_text().split() if x.isdigit())
        kept = min(m.total_bytes, held * m.chunk_size)
        what = (f"transfer: {m.job_id}/{m.ckpt_id}: writing under {self.root} failed with {_errno_name(e)} "
                f"({e.strerror}); about {kept} of {m.total_bytes} bytes are kept for a resume")
        log.warning("%s", what)
        if e.errno not in _NO_ROOM_ERRNOS:
            return TransferError(f"{what}; this destination's disk is failing", fatal=True)
        self.refused_no_room += 1
        STATS.offers_refused_no_room += 1
        try:
            room = self._room(m, d / "data.partial")
        except OSError:
            return NoRoomError(f"{what}; no room left", m.total_bytes, 0)
        return NoRoomError(f"{what}; no room left: needs {room.need} bytes, {room.avail} bytes available",
                           room.need, room.avail)

    async def _receive_into(self, ch: _Channel, m: Manifest, node: str, key: bytes, ns: bytes, d: Path) -> None:
        inc = await asyncio.to_thread(_Incoming, d, m)  # writes the manifest beside the partial (MBs)
        t0 = time.monotonic()
        log.info("transfer %s/%s from %s: records read by the %s", m.job_id, m.ckpt_id, node or "?", ch.path())
        try:
            await ch.send({"t": "have", "chunks": sorted(inc.have)})
            while True:
                # chunks (a payload of at most the manifest's chunk size, read after its header
                # is checked) and done: small headers
                hdr, payload = await _recv(ch, limit=CTL_MAX, chunk_max=m.chunk_size)
                if hdr["t"] == "chunk":
                    i = int(hdr["i"])
                    if not 0 <= i < len(m.chunks) or len(payload) != m.chunk_len(i):
                        raise TransferError(f"transfer: chunk {i} of {len(payload)} bytes does not fit the manifest")
                    # Checked at "done" (_commit), each byte hashed once: the first file's as it
                    # is written when its chunks come in order (_Incoming.write), the rest read
                    # back from the committed files. Written and persisted off the loop.
                    inc.write(i, payload)
                    if len(inc.writing) >= PERSIST_EVERY:
                        await inc.settle()
                        inc.store()
                        await self._ack(ch, inc, t0)
                    await asyncio.sleep(0)  # records already buffered do not wait: the loop runs between chunks
                elif hdr["t"] == "done":
                    await inc.settle()
                    inc.store()
                    await inc.settle()
                    missing = set(range(len(m.chunks))) - inc.have
                    got = missing if missing else await asyncio.to_thread(self._commit, inc, node)
                    if isinstance(got, set):  # missing, or failed their SHA-256 (on the way, on disk)
                        inc.forget(got & inc.have)
                        await ch.send({"t": "need", "chunks": sorted(got)})
                        continue
                    path = got
                    await ch.send(_committed(key, ns, m, path))
                    c = Committed(m.job_id, m.ckpt_id, path, m.digest, node)
                    self.committed.append(c)
                    with contextlib.suppress(OSError):
                        self.sweep()
                    if self.on_commit is not None:
                        res = self.on_commit(c)
                        if asyncio.iscoroutine(res):
                            await res
                    return
                else:
                    raise TransferError(f"transfer: unexpected {hdr['t']!r}")
        finally:
            try:
                with contextlib.suppress(Exception):
                    await inc.settle()
                    inc.store()  # what arrived whole is kept for the next attempt (verified at its done)
                    await inc.settle()
            finally:
                inc.close()

    async def _ack(self, ch: _Channel, inc: _Incoming, t0: float) -> None:
        done = inc.held_bytes()
        await ch.send({"t": "ack", "bytes": done})
        if self.on_progress is not None:
            self.on_progress(Progress(inc.m.job_id, inc.m.ckpt_id, done, inc.m.total_bytes, time.monotonic() - t0))

    def _commit(self, inc: _Incoming, node: str) -> Path | set[int]:
        """Splits the partial file into the checkpoint's files, checks every file against the
        transfer manifest and the job's manifest (and, when one fails, every chunk, to name
        the ones to send again), marks VERIFIED and renames into place; returns the committed
        path, or the chunks that failed (the partial file is put back as it was: the sender
        sends them again).

        The files are written from the last to the first, each from its end backwards in
        blocks, and the partial file is cut behind every block: the commit needs one block of
        disk beyond the checkpoint, not a second copy of it (a storage holder is chosen for
        room for one). The first file (the largest: :func:`build_manifest` puts it first) is
        not copied when its bytes were hashed as they were written, in order, on this
        connection (:meth:`_Incoming.streamed_sha256`) and match: once the others are cut off,
        the partial file *is* that file, and it is moved into place. Every other file is read
        back from where it was assembled: a byte that changed on the way, on the disk since
        it arrived, or in the copy is found before anything is marked verified. (The moved
        file's bytes are the ones hashed; a byte that rots on disk later is caught where the
        job loads it: :meth:`laminar.jobkit.Checkpointer.resume` hashes what it deserializes.)
        What was cut is forgotten (have.log) when the commit fails otherwise, so the sender
        sends it again; a crash mid-commit leaves the cut chunks zero (or, once the partial
        file was moved, none), which the next attempt's check asks for again. Raises
        TransferError, or OSError when the disk fills or fails (ENOSPC, EDQUOT, EIO: the
        caller refuses the transfer naming it)."""
        m = inc.m
        final = self.final_dir(m.job_id, m.ckpt_id)
        tmp = final.parent / f".tmp-{m.ckpt_id}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        starts, off = [], 0
        for _, size, _ in m.files:
            starts.append(off)
            off += size
        cut = m.total_bytes
        sha = inc.streamed_sha256()
        part = inc.dir / "data.partial"
        keep = m.files[0][0] if sha is not None and sha == m.files[0][2] else None  # the file moved, not copied
        if keep is not None and os.stat(inc.dir).st_dev != os.stat(tmp).st_dev:
            keep = None  # incoming/ on another file system than checkpoints/ (a mount): a rename cannot move it
        moved = False

        def put_back() -> None:  # the moved file becomes the partial file again (the same inode: inc.fd)
            nonlocal moved
            if moved:
                os.rename(tmp / m.files[0][0], part)
                moved = False

        def fail(msg: str, fatal: bool = False) -> TransferError:
            with contextlib.suppress(OSError):
                put_back()
            shutil.rmtree(tmp, ignore_errors=True)
            if cut < m.total_bytes and m.chunk_size:
                with contextlib.suppress(OSError):
                    inc.forget({i for i in inc.have if (i + 1) * m.chunk_size > cut})
                    os.ftruncate(inc.fd, m.total_bytes)
            return TransferError(f"transfer: {m.job_id}/{m.ckpt_id}: {msg}", fatal=fatal)

        try:
            for (name, size, _sha), start in reversed(list(zip(m.files, starts, strict=True))):
                if name == keep and start == 0:
                    continue
                fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                try:
                    end = size
                    while end > 0:
                        lo = max(0, end - _COPY_BLOCK)
                        if _copy_range(inc.fd, fd, end - lo, start + lo, lo) != end - lo:
                            raise fail(f"the partial file is shorter than {name} needs")
                        os.ftruncate(inc.fd, start + lo)
                        cut = start + lo
                        end = lo
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if keep is not None:
                os.ftruncate(inc.fd, m.files[0][1])
                cut = m.files[0][1]
                os.fchmod(inc.fd, 0o644)  # as the copied files: the job may run as another user
                os.fsync(inc.fd)
                os.rename(part, tmp / keep)
                moved = True
            bad, job = _check_assembled(tmp, m, {keep: m.files[0][2]} if keep is not None else {})
        except OSError as e:
            err = fail(f"commit failed: {e}")
            if e.errno in _DISK_ERRNOS:
                raise  # the disk filled or failed: the sender is told why (Receiver._disk_refusal)
            raise err from None
        if bad:
            try:
                put_back()
                _unassemble(tmp, m, starts, inc.fd, skip=keep)
            except OSError as e:
                raise fail(f"chunks {sorted(bad)[:8]} failed their SHA-256 and the partial file could not be "
                           f"restored: {e}") from None
            cut = m.total_bytes
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("transfer %s/%s: %d chunks failed their SHA-256 (on the way or on disk); asking again",
                        m.job_id, m.ckpt_id, len(bad))
            return bad
        # Every chunk matches the MAC'd manifest: sending again cannot help with what is left.
        if isinstance(job, jobkit.CheckpointError):
            raise fail(f"not a valid checkpoint: {job}", fatal=True)
        for name, _size, sha in m.files:
            if job.get(name) != sha:
                raise fail(f"{name} does not match its SHA-256 in the transfer manifest (the manifest is "
                           "inconsistent)", fatal=True)
        ids = {name: _identity(os.lstat(tmp / name)) for name, _size, _sha in m.files}
        meta = {"digest": m.digest, "body": m.body(), "from_node": node, "committed": time.time(), "ids": ids}
        # The transfer's own records live beside the job's files, outside the job's manifest.
        (tmp / TRANSFER_MANIFEST).write_text(json.dumps(meta))
        with open(tmp / VERIFIED, "w") as f:
            f.write(m.digest + "\n")
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, final)
        fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)
        shutil.rmtree(inc.dir, ignore_errors=True)
        return final


def _offered(hdr: dict[str, Any], key: bytes) -> Manifest:
    """The manifest of an ``offer``, checked and its MAC verified (computes its digest: run it
    in a worker thread). Raises TransferError."""
    m = Manifest.from_body(hdr.get("manifest"))
    if not hmac.compare_digest(str(hdr.get("mac", "")), mac(key, b"laminar-manifest", m.digest.encode())):
        raise TransferError("transfer: manifest rejected: its MAC does not match the zone key", fatal=True)
    return m


def _check_assembled(d: Path, m: Manifest, hashed: dict[str, str]) -> tuple[set[int], dict[str, str] | jobkit.CheckpointError]:
    """The chunks of ``m`` the files in ``d`` do not hold, and each file's SHA-256 (or why
    ``d`` is not a valid jobkit checkpoint). First jobkit's check of every file it lists, whose
    hashes it gives (only MANIFEST.json, which lists the others, is hashed on its own; a file
    in ``hashed`` was hashed as it was written and is not read again); only when a file does
    not match the transfer manifest, or the checkpoint is not valid, are the chunks' SHA-256
    taken, in threads, to name the ones to send again (none: what was received is what the
    manifest says, and sending again cannot help). Raises OSError."""
    try:
        listed = {f["name"]: f["sha256"] for f in jobkit.verify_checkpoint(d, hashed=hashed)["files"]}
        job: dict[str, str] | jobkit.CheckpointError = {
            name: listed[name] if name in listed else hashed.get(name) or jobkit.file_sha256(d / name)
            for name, _, _ in m.files}
    except jobkit.CheckpointError as e:
        job = e
    if isinstance(job, dict) and all(job.get(name) == sha for name, _, sha in m.files):
        return set(), job
    fds = [os.open(d / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW) for name, _, _ in m.files]
    try:
        spans, off = [], 0
        for fd, (_, size, _) in zip(fds, m.files, strict=True):
            spans.append((fd, off, size))
            off += size

        def bad_among(lo: int, hi: int) -> set[int]:
            bad: set[int] = set()
            buf = memoryview(bytearray(m.chunk_size))
            for i in range(lo, hi):
                n = m.chunk_len(i)
                if _pread_spans(spans, i * m.chunk_size, buf[:n]) != n \
                        or hashlib.sha256(buf[:n]).hexdigest() != m.chunks[i]:
                    bad.add(i)
            return bad

        n = len(m.chunks)
        k = max(1, min(_HASH_THREADS, n))
        with ThreadPoolExecutor(k, thread_name_prefix="lm-xfer-check") as ex:  # hashlib lets go of the GIL
            parts = [ex.submit(bad_among, a * n // k, (a + 1) * n // k) for a in range(k)]
            return set().union(*(f.result() for f in parts)), job
    finally:
        for fd in fds:
            os.close(fd)


def _unassemble(d: Path, m: Manifest, starts: list[int], part: int, skip: str | None = None) -> None:
    """Moves the files assembled in ``d`` back into the partial file ``part`` (the way the
    commit took them, block by block from each file's end, cutting the file behind: one block
    of disk beyond the checkpoint) and syncs it; ``skip`` is the first file when the commit
    moved the partial file itself into place (the caller has moved it back). Raises OSError."""
    for (name, size, _), start in zip(m.files, starts, strict=True):
        if name == skip and start == 0:
            continue
        fd = os.open(d / name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            end = size
            while end > 0:
                lo = max(0, end - _COPY_BLOCK)
                if _copy_range(fd, part, end - lo, lo, start + lo) != end - lo:
                    raise OSError(f"{name} is shorter than it was assembled")
                os.ftruncate(fd, lo)
                end = lo
        finally:
            os.close(fd)
    os.ftruncate(part, m.total_bytes)
    os.fdatasync(part)


LINGER_S = 1.0  # how long an endpoint that refused a peer reads on, so its error reaches the peer


async def _linger(src: _RecordBuffer, w: asyncio.StreamWriter) -> None:
    """After an error to an authenticated peer: half-closes and discards what the peer still
    sends, until it closes or LINGER_S: closing with unread bytes would send a reset, and a
    reset may drop the error on its way to the peer, which would see "connection reset"
    instead of the reason."""
    with contextlib.suppress(Exception):
        if w.can_write_eof():
            w.write_eof()
        async with asyncio.timeout(LINGER_S):
            while True:
                await src.need(1)
                src.take(src.end - src.start)


def _subdirs(d: Path) -> list[Path]:
    """The directories in ``d`` (not links to them); [] when ``d`` cannot be listed."""
    try:
        return [x for x in d.iterdir() if x.is_dir() and not x.is_symlink()]
    except OSError:
        return []


def _identity(st: os.stat_result) -> list[int]:
    """What a write, a truncation, a replacement or a new link of a file changes."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def verified_checkpoint(path: str | os.PathLike[str], now: float | None = None) -> Path:
    """``path`` if it is a committed transfer whose files still match (VERIFIED marker, the
    transfer manifest's digest, every file's SHA-256); raises TransferError otherwise. The
    agent calls this right before setting LAMINAR_RESUME_FROM. A file still holding the identity
    recorded at the commit (:data:`TRUST_UNCHANGED_S` at most after it, by ``now``, wall clock)
    is not hashed again: it has not been written, truncated, replaced or linked since it was
    hashed; any other is."""
    p = Path(path)
    try:
        meta = json.loads((p / TRANSFER_MANIFEST).read_text())
        marker = (p / VERIFIED).read_text().strip()
    except (OSError, json.JSONDecodeError) as e:
        raise TransferError(f"transfer: {p} is not a committed checkpoint: {e}") from None
    if not isinstance(meta, dict):
        raise TransferError(f"transfer: {p}: {TRANSFER_MANIFEST} is not a transfer record")
    m = Manifest.from_body(meta.get("body"))
    if m.digest != meta.get("digest") or marker != m.digest:
        raise TransferError(f"transfer: {p}: manifest digest does not match its VERIFIED marker")
    committed = meta.get("committed")
    age = math.inf
    if isinstance(committed, (int, float)) and not isinstance(committed, bool):
        age = (time.time() if now is None else now) - committed
    recorded = meta.get("ids")
    ids: dict[str, Any] = recorded if 0 <= age < TRUST_UNCHANGED_S and isinstance(recorded, dict) else {}
    for name, size, sha in m.files:
        f = p / name
        try:
            st = f.lstat()
            same = stat.S_ISREG(st.st_mode) and st.st_size == size and (
                ids.get(name) == _identity(st) or jobkit.file_sha256(f) == sha)  # a link or pipe: OSError
        except OSError:
            same = False
        if not same:
            raise TransferError(f"transfer: {p}: {name} changed since it was verified")
    return p


def sent_by(path: Path) -> str | None:
    """The node a committed checkpoint came from (its TRANSFER.json ``from_node``), None when unknown."""
    try:
        meta = json.loads((path / TRANSFER_MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    got = meta.get("from_node") if isinstance(meta, dict) else None
    return str(got) if got is not None else None


def latest_verified(root: str | os.PathLike[str], job_id: str,
                    senders: Collection[str] | None = None) -> Path | None:
    """The newest committed, still-valid checkpoint of ``job_id`` under a receiver's root;
    with ``senders``, only one those nodes sent (a copy another member pushed under the key is
    never resumed from: laminar.zone.authority.checkpoint_senders)."""
    d = Path(root) / "checkpoints" / job_id
    cands = sorted((p for p in d.glob("ckpt-*") if p.is_dir()), key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else -1)
    for p in reversed(cands):
        if senders is not None and sent_by(p) not in senders:
            continue
        try:
            return verified_checkpoint(p)
        except TransferError:
            continue
    return None


# -- command line (tests, operators debugging a path) -----------------------------------------


def _load_key(path: str, zone: int) -> bytes:
    from laminar.zone.keys import load_keys

    k = load_keys(path).get(zone)
    if k is None:
        raise SystemExit(f"transfer: {path} holds no key for zone {zone}")
    return k


def _hostport(v: str) -> tuple[str, int]:
    host, _, port = v.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [fd00::2]:7480: an IPv6 address with a port
        host = host[1:-1]
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{v!r}: expected HOST:PORT ([IPv6]:PORT for an IPv6 address)")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laminar.migrate.transfer", description="checkpoint transfer endpoint")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--root", required=True)
    s.add_argument("--listen", type=_hostport, required=True)
    s.add_argument("--key-file", required=True)
    s.add_argument("--once", action="store_true", help="exit after the first commit")
    c = sub.add_parser("send")
    c.add_argument("--to", type=_hostport, required=True)
    c.add_argument("--ckpt", required=True)
    c.add_argument("--job", required=True)
    c.add_argument("--key-file", required=True)
    c.add_argument("--rate-bps", type=float)
    c.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    c.add_argument("--retries", type=int, default=5)
    for p in (s, c):
        p.add_argument("--zone", type=int, default=0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    key = _load_key(a.key_file, a.zone)

    if a.cmd == "serve":
        async def serve() -> None:
            done = asyncio.Event()

            def commit(cm: Committed) -> None:
                print(json.dumps({"event": "committed", "job": cm.job_id, "ckpt": cm.ckpt_id, "path": str(cm.path),
                                  "digest": cm.digest}), flush=True)
                if a.once:
                    done.set()

            def prog(p: Progress) -> None:
                print(json.dumps({"event": "progress", "bytes": p.done_bytes, "total": p.total_bytes}), flush=True)

            rcv = Receiver(a.root, key, on_commit=commit, on_progress=prog)
            port = await rcv.start(*a.listen)
            print(json.dumps({"event": "listening", "port": port}), flush=True)
            await done.wait()
            await rcv.stop()

        asyncio.run(serve())
        return 0

    def prog(p: Progress) -> None:
        print(json.dumps({"event": "progress", "bytes": p.done_bytes, "total": p.total_bytes}), flush=True)

    try:
        res = asyncio.run(send_checkpoint(a.to[0], a.to[1], a.ckpt, a.job, key, zone=a.zone, rate_bps=a.rate_bps,
                                          chunk_size=a.chunk_size, retries=a.retries, progress=prog))
    except TransferError as e:
        print(json.dumps({"event": "failed", "error": str(e)}), flush=True)
        return 2
    print(json.dumps({"event": "sent", **{k: v for k, v in vars(res).items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
