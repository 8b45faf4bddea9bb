"""The authenticated connection of a checkpoint transfer: the MACs (:func:`mac`, the
``committed`` answer's), the framing of a message (a length, a JSON header, a chunk's bytes:
:func:`_send` before the handshake, :func:`_recv` both before and after it, its size limits),
what both handshakes prove (:func:`hello_identity`, :func:`version_mismatch`), the session keys
(:func:`derive_keys`) and the AES-256-GCM records everything after the handshake travels in
(:class:`_Channel`, read through :class:`_RecordBuffer`). The handshakes themselves are each
side's: :func:`laminar.migrate.transfer.send._client_handshake` and
:meth:`laminar.migrate.transfer.receive.Receiver._handshake`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol

from laminar.migrate.transfer.errors import STATS, NoRoomError, RecordError, RefusedMessage, TransferError
from laminar.migrate.transfer.manifest import Manifest

# `cryptography` (OpenSSL) is imported at the first connection, not with the agent: it adds
# ~7 MiB of resident memory that an agent that never transfers does not need.


PROTOCOL_VERSION = 3  # the wire protocol (hello); 2: every message after the handshake in AES-GCM records;
# 3: the hello (version, zone, node) under both handshake MACs, and its node checked against the connection's address
RECORD_MAX = 1 << 20  # plaintext bytes per record: AES-GCM holds the GIL, 0.6 ms per MiB here (see _Channel)
RECORD_TAG = 16
MAX_HEADER = 16 << 20  # a manifest of 10 GB in 1 MiB chunks is ~700 KB of JSON
MAX_HANDSHAKE = 4096  # hello/challenge/auth: what a peer that has not authenticated may make us read
# After the handshake a Receiver reads headers of at most CTL_MAX bytes, but for the two that
# carry much: an offer (its manifest, up to MAX_HEADER) and a keeper control message (a job's
# spec, which fits a hand-over frame: laminar.zone.wire.MAX_FRAME). Which one a header is shows
# in its first bytes (the sender's JSON names "t" first: LARGE_HEADERS), read before the rest.
CTL_MAX = 64 << 10
KEEPER_MAX = (1 << 20) + CTL_MAX
LARGE_HEADERS = {b'{"t":"offer",': MAX_HEADER, b'{"t":"ctl","op":"keeper",': KEEPER_MAX,
                 b'{"t":"ctl","op":"guard",': KEEPER_MAX}  # old spelling of the op, from an older peer (one release)
# JSON over CTL_MAX bytes is parsed only when it has at most MAX_SEPARATORS ',' and ':' (a
# manifest of 10,000 files and 250,000 chunks has ~280,000), in a worker thread. json.loads
# holds the GIL all along, so the thread does not free the event loop: the bound does. Parsing
# costs per value, not per byte (16 MiB of one-digit numbers: 0.5 s; 16 MiB of chunk hashes:
# 0.03 s), and 2^19 separators take at most ~30 ms (bench: tests/unit/test_xfer_flood.py).
MAX_SEPARATORS = 1 << 19
HANDSHAKE_TIMEOUT_S = 10.0  # each handshake message (the sender's side): the peer's agent may be busy (a loaded event loop)
IO_TIMEOUT_S = 60.0


def mac(key: bytes, label: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 over a domain label and parts (hex): one key, separate meanings."""
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:
        h.update(struct.pack(">I", len(p)))
        h.update(p)
    return h.hexdigest()


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
