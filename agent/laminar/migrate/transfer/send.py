"""The sender of a checkpoint transfer: :func:`send_checkpoint` (the client's handshake, the
offer, the chunks the destination lacks, read and checked ahead of the socket by
:class:`_Source`, ``done``, and the attempts again after a broken connection or a re-saved
checkpoint) and :func:`send_control` (one authenticated control message)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import inspect
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar import jobkit
from laminar.migrate.transfer.channel import (
    HANDSHAKE_TIMEOUT_S,
    MAX_HANDSHAKE,
    PROTOCOL_VERSION,
    _canon,
    _Channel,
    _check_committed,
    _recv,
    _send,
    hello_identity,
    mac,
    version_mismatch,
)
from laminar.migrate.transfer.errors import PeerSilentError, SourceChangedError, TransferError
from laminar.migrate.transfer.manifest import (
    DEFAULT_CHUNK,
    Manifest,
    _ident,
    _pread_spans,
    _SpanReadError,
    build_manifest,
    check_source,
)
from laminar.migrate.transfer.progress import Flow, FlowHook, Progress, _AckMeter, _report_acks

log = logging.getLogger("laminar.transfer")


MAX_NEED_ROUNDS = 5  # re-send rounds before a transfer is declared failed
MAX_SOURCE_CHANGES = 5  # manifests built again because the checkpoint changed under the sender, before it gives up
# A connection a destination has not accepted in this long is a silent peer (its host gone, a
# blackhole: nothing answers the SYN). Linux sends the SYN again 1 s and 3 s after the first; on
# a LAN (and on any path of RTT < 1 s) 4 s covers both, so only a peer that answers none of three
# SYNs counts as silent; it was HANDSHAKE_TIMEOUT_S (10 s) before 2026-11-23.
CONNECT_TIMEOUT_S = 4.0


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
