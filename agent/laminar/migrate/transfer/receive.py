"""The transfer endpoint of an agent (:class:`Receiver`): who may connect (the gate, the
server's handshake, ``sources``), control messages, offers and the room they need, the chunks
received into an :class:`~laminar.migrate.transfer.incoming._Incoming`, and the commit that
splits the partial file into the checkpoint's files, checks them and renames them into place
(:meth:`Receiver._commit`); :meth:`Receiver.sweep` removes what interrupted transfers left."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from laminar import jobkit, listen
from laminar.migrate.transfer.channel import (
    CTL_MAX,
    HANDSHAKE_TIMEOUT_S,
    IO_TIMEOUT_S,
    LARGE_HEADERS,
    MAX_HANDSHAKE,
    PROTOCOL_VERSION,
    _canon,
    _Channel,
    _committed,
    _RecordBuffer,
    _recv,
    _send,
    hello_identity,
    mac,
    version_mismatch,
)
from laminar.migrate.transfer.committed import Committed, _identity, verified_checkpoint
from laminar.migrate.transfer.errors import REFUSED_REASONS, STATS, NoRoomError, RefusedMessage, TransferError
from laminar.migrate.transfer.incoming import (
    _COPY_BLOCK,
    PERSIST_EVERY,
    Room,
    _allocated,
    _Incoming,
    offer_room,
)
from laminar.migrate.transfer.manifest import (
    _HASH_THREADS,
    TRANSFER_MANIFEST,
    VERIFIED,
    Manifest,
    _pread_spans,
)
from laminar.migrate.transfer.progress import Progress
from laminar.zone.gate import Gate, GatedListener, Slot

log = logging.getLogger("laminar.transfer")


# Headers over CTL_MAX being read and parsed at once, per member and in all: each holds up to
# MAX_HEADER bytes and the objects parsed from them; more wait their turn (a header arrives in
# milliseconds on a LAN), so a member's 32 authenticated connections hold 2 of them, not 32.
LARGE_PER_MEMBER = 2
LARGE_TOTAL = 8
HANDSHAKE_DEADLINE_S = 10.0  # the whole handshake (hello to auth) of a Receiver's peer, one deadline
INCOMING_STALE_S = 24 * 3600.0  # a partial transfer untouched this long is abandoned (its sender never came back)


KeyLookup = Callable[[int], bytes | None]


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


_NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # the receive root is full: another destination may have room
_DISK_ERRNOS = (*_NO_ROOM_ERRNOS, errno.EIO)  # what a destination refuses a transfer for, naming it, when it writes


def _errno_name(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e.errno))


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
    later). Its first message is a control message (at most CTL_MAX bytes, a ``keeper`` at most
    KEEPER_MAX) or an offer (at most MAX_HEADER); a chunk before an offer is refused unread, and
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
        the zone's ``rebind.on_rebind``); transfers being received go on. When ``host`` cannot be bound
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
        # The MAC covers the op too: otherwise a "keeper" could be turned into a "release" on the way.
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
        disk beyond the checkpoint, not a second copy of it (a storage keeper is chosen for
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
