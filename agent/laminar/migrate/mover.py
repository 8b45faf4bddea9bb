"""One move of one job (:class:`Mover`, a part of :class:`laminar.migrate.reclaim.ReclaimComponent`:
its ``mover``): checkpoint, freeze, rank the destinations, reserve one through the zone, send
the checkpoint, hand the keeper and then the job over, stop it here (:meth:`Mover.move`). A
reclaim's moves have its window (:mod:`laminar.migrate.evacuation`); a loan return's
(:meth:`Mover.move_now`) and Airlock's re-address (:meth:`Mover.readdress`) have none. When no
peer can run the job during a window, :meth:`laminar.migrate.keepers.Keepers.hold` keeps its
checkpoint off the node.

**A move cut during its hand-over.** Once a hand-over's frame may have reached the destination, no
answer is never taken for a refusal (:meth:`Takeover.handover` with ``confirm``): the
same hand-over (idempotent by placement id there) is sent again until the destination says
whether it runs the job, which stays frozen here meanwhile; then it is stopped here (it runs
there) or thawed (it does not). A move without a window (a loan return's :meth:`Mover.move_now`,
Airlock's :meth:`Mover.readdress`) is recorded before its freeze and before its
hand-over (table ``migrate_moves``), so a restart settles one the agent's stop or crash cut
the same way (:meth:`Mover.restore`): never frozen for good, never two
copies, never none.

The job ids being moved (``evacuating``) and each job's latest move (``moves``, a
:class:`Move`) are the component's, which the other parts read; the mover keeps when it froze
each job (``frozen_at``) and the manifests it last sent (``_sent_manifests``, for
:meth:`Mover.send_keeper`'s presigned record).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar import jobkit
from laminar.components import jobs_of
from laminar.migrate import ckpt_driver, ledger
from laminar.migrate.archive_auth import PRESIGNED, ArchiveAuth, manifest_digest, owner_body
from laminar.migrate.constants import DEFAULT_CKPT_BYTES, DEFAULT_REMAINING_S, HOLD_MIN_S, MIGRATED_ENV
from laminar.migrate.errors import HandoverSettled, MigrateError
from laminar.migrate.transfer import (
    Flow,
    Manifest,
    PeerSilentError,
    Progress,
    TransferError,
    send_checkpoint,
)
from laminar.migrate.transfer.manifest import _source_state
from laminar.offloop import LaneBusy
from laminar.policy import destination as dst
from laminar.policy import moves as mp
from laminar.policy.endcause import EndCause
from laminar.runtime.holds import Hold, Holds
from laminar.runtime.provenance import request_origin

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.archive import Archive
    from laminar.migrate.checkpoints import Checkpoints
    from laminar.migrate.ckpt_driver import CkptDriver
    from laminar.migrate.evacuation import Evacuation
    from laminar.migrate.evidence import Evidence
    from laminar.migrate.fence import Fence
    from laminar.migrate.keepers import Keepers
    from laminar.migrate.prestage import Prestage
    from laminar.migrate.settle import Settle
    from laminar.migrate.takeover import Takeover

log = logging.getLogger("laminar.migrate")

TRANSFER_MIN_S = 0.25  # the shortest deadline a late transfer is given

# How long a move waits for its job to be frozen (or thawed), without blocking the loop.
FREEZE_WAIT_S = 2.0

# A move's (or a hold's) transfer to a destination that says nothing (transfer.PeerSilentError: no
# connection accepted in CONNECT_TIMEOUT_S, no handshake answer in HANDSHAKE_TIMEOUT_S) tries it
# this many more times, then goes on to the next candidate: one more try covers a lost SYN or a
# busy agent, the transfer's whole ladder (6 tries: ~26 s connecting, ~63 s handshaking) would
# eat most of a notice window. Other errors keep the ladder.
MOVE_SILENT_RETRIES = 1

SENT_MANIFESTS_KEEP = 4096  # checkpoints last sent, per job key, remembered for the keeper that follows (send_keeper's _presign)


def _same_files(m: Manifest, snap: Path) -> Manifest | None:
    """``m`` (built from the job's checkpoint directory) for its snapshot ``snap``, when ``snap``
    holds the very files ``m`` was built from (the same inode, size and mtime: hard links made
    since), with ``snap``'s own identity as its source; else None (copied, or saved again
    since: the manifest is built again from the snapshot)."""
    if not m.source:
        return None
    try:
        now = _source_state(snap)
    except (OSError, TransferError):
        return None
    return replace(m, source=(now[0], m.source[1])) if now[1] == m.source[1] else None


def _snapshot_file(src: Path, dst: Path) -> None:
    """Puts the regular file ``src`` at ``dst``: a hard link to it (never to what a link points
    to), else a copy read through a descriptor opened without following links and without
    blocking (a pipe swapped in is not waited on), checked to be the regular file lstat saw.
    Raises CheckpointError for anything but a regular file (a link, pipe, device, directory),
    OSError when it cannot be read."""
    st = os.lstat(src)
    if not stat.S_ISREG(st.st_mode):
        raise jobkit.CheckpointError(f"checkpoint {src.parent}: {src.name} is not a regular file (a link, pipe, "
                                     "device or directory); not sent")
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        pass
    else:
        if not stat.S_ISREG(os.lstat(dst).st_mode):  # swapped between the lstat and the link
            os.unlink(dst)
            raise jobkit.CheckpointError(f"checkpoint {src.parent}: {src.name} changed into something other than a "
                                         "regular file; not sent")
        return
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise jobkit.CheckpointError(f"checkpoint {src.parent}: {src.name} changed into something other than a "
                                         "regular file; not sent")
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as fin, open(dst, "xb") as fout:
            shutil.copyfileobj(fin, fout, 4 << 20)
        os.utime(dst, ns=(fst.st_atime_ns, fst.st_mtime_ns))
    finally:
        os.close(fd)


@dataclass
class Move:
    """One job's move (shown by GET /v1/migrations/{job})."""

    job: str
    key: str
    reason: str
    phase: str = "planned"  # planned, checkpoint, reserve, transfer, handover, done, hold, held, archived, archiving, failed
    ckpt: str = ""
    dest: int | None = None
    dest_job: str = ""
    done_bytes: int = 0
    total_bytes: int = 0
    deadline: float | None = None  # wall clock
    error: str = ""
    started: float = field(default_factory=time.time)
    ended: float | None = None
    ranked: list[dict[str, Any]] = field(default_factory=list)
    # the final checkpoint's transfer manifest, built as it was checked: sent as it is (not shown)
    manifest: Manifest | None = field(default=None, repr=False, compare=False)
    # why it moves, as its record in the store says (laminar.policy.moves.Cause; not shown)
    cause: str = field(default="move_now", repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("manifest", "cause")}


class _ShaperHook:
    """Adapts the shaper's transfer registry (``agent.transfers``: add/report/remove, netlink
    on its own thread) to the transfer's FlowHook. Progress is the bytes the destination's TCP
    acknowledged (the sender reads them from its socket), reported to the registry as such
    (``report(..., acked=True)``), so the shaper decides on them instead of its leaf's estimate;
    one report per transfer is under way at a time (the newest value goes next), and a transfer
    is removed only after its reports."""

    def __init__(self, reg: Any, job: Any) -> None:
        self.reg = reg
        self.job = job
        self._want: dict[Any, int] = {}  # handle -> newest acknowledged bytes
        self._told: dict[Any, int] = {}  # handle -> what the registry has
        self._reporting: dict[Any, asyncio.Task[None]] = {}

    async def register(self, flow: Flow, job_id: str, total_bytes: int, deadline_monotonic: float | None) -> Any:
        if deadline_monotonic is None or total_bytes <= 0:
            return None
        from laminar.net.killswitch import FlowKey

        try:
            key = FlowKey("tcp", flow.saddr, flow.sport, flow.daddr, flow.dport)
            t = await self.reg._run(self.reg.add, self.job.id, int(self.job.num), key, total_bytes,
                                    max(0.05, deadline_monotonic - time.monotonic()))
        except Exception as e:  # shaping off, or the deadline is already infeasible: send unshaped
            log.info("migrate: transfer of %s not shaped: %s", self.job.id, e)
            return None
        return t.id

    def progress(self, handle: Any, acked_bytes: int) -> None:
        if handle is None or acked_bytes <= self._want.get(handle, -1):
            return
        self._want[handle] = acked_bytes
        if handle not in self._reporting:
            self._reporting[handle] = asyncio.get_running_loop().create_task(self._report(handle))

    async def _report(self, handle: Any) -> None:
        try:
            while (n := self._want.get(handle, 0)) > self._told.get(handle, -1):
                try:
                    await self.reg._run(self.reg.report, handle, n, acked=True)
                except Exception as e:  # removed meanwhile, or shaping went away: the next one may do
                    log.debug("migrate: progress of transfer %s not reported: %s", handle, e)
                self._told[handle] = n
        finally:
            self._reporting.pop(handle, None)

    async def unregister(self, handle: Any) -> Any:
        if handle is not None:
            task = self._reporting.get(handle)
            if task is not None:  # the last bytes first: the registry says where it ended
                with contextlib.suppress(Exception):
                    await task
            self._want.pop(handle, None)
            self._told.pop(handle, None)
            with contextlib.suppress(Exception):
                await self.reg._run(self.reg.remove, handle)


def _manifest_facts(ckpt: Path) -> tuple[str, int, int]:
    """(SHA-256 of its MANIFEST.json, bytes, files) of the checkpoint ``ckpt`` (a snapshot of
    root's): what an archived record of it signs. Raises OSError/ValueError/CheckpointError."""
    raw = (ckpt / jobkit.MANIFEST).read_bytes()
    files = jobkit.parse_manifest(raw, str(ckpt))["files"]
    return manifest_digest(raw), sum(int(f["size"]) for f in files), len(files)


class MoverHost(Protocol):
    """What :class:`Mover` uses of the component that holds it (ReclaimComponent and its parts)."""

    _archive_keeps: set[str]
    _xfer_local: str | None
    agent: MigrateAgent
    archive: Archive
    evidence: Evidence
    checkpoints: Checkpoints
    ckpt: CkptDriver | None
    ckpt_latency: dict[str, float]
    counts: dict[str, int]
    evacuating: set[str]
    evacuation: Evacuation
    fence: Fence
    takeover: Takeover
    keepers: Keepers
    moves: dict[str, Move]
    notices: dict[int, tuple[float, float]]
    prestage: Prestage
    reclaim: dict[str, Any] | None
    root: Path | None
    s: dict[str, Any]
    settle: Settle

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _holds(self) -> Holds: ...
    def _need(self, job: Any) -> tuple[Any, dst.Resources]: ...
    def _peer(self, node: int) -> tuple[str, int, bytes, int]: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    def job_key(self, job: Any) -> str: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Mover:
    """One move of one job, and the records of a move without a window (see the module's doc): a part
    of :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``mover``). ``host``: the component."""

    def __init__(self, host: MoverHost) -> None:
        self.host = host
        self.frozen_at: dict[str, float] = {}  # job id -> when a move froze it (wall clock)
        # key -> (checkpoint name, manifest SHA-256, bytes, files) last sent to a peer: what the
        # keeper that follows it is handed, signed, to publish in the archive (send_keeper's _presign)
        self._sent_manifests: dict[str, tuple[str, str, int, int]] = {}

    def candidates(self, need: dst.Resources) -> list[dst.Candidate]:
        """Every zone member that may take a job: not this node, not suspect, not draining,
        not under a reclaim notice. Free resources from its summary (unknown: assumed to fit;
        the probe decides), survival from its provider's hazard model (the node's owner)."""
        z = self.host.zone
        if z is None:
            return []
        now = time.time()
        path_bps = float(self.host.s["path_mbit"]) * 1e6 / 8
        out = []
        for n, m in z.membership.by_node.items():
            if n == self.host.node_id or n in z.membership.suspects:
                continue
            if n in self.host.notices and self.host.notices[n][0] > now - 3600:
                continue
            st = z.membership.state[n]
            cap = st.last_summary
            if cap is not None and cap.draining:
                continue
            free = need if cap is None else dst.Resources(sum(1 for f in cap.gpu_free if f >= 0.999),
                                                          int(cap.memory_mb) << 20, float(cap.cpus))
            provider = m.owner or "default"
            hz = self.host.evidence.hazards.get(provider) or self.host.evidence.hazards["default"]
            surv = hz.survival(now, DEFAULT_REMAINING_S)
            # Racks are not configured: topology is the zone (rack = zone).
            out.append(dst.Candidate(str(n), str(m.zone), str(m.zone), free, path_bps, survival=surv, provider=provider))
        return out

    def rank_for(self, job: Any, ckpt_bytes: float, window_s: float | None, prestaged: bool) -> list[dst.Ranked]:
        _, need = self.host._need(job)
        z = self.host.zone
        zone = str(z.zone) if z is not None else "0"
        keeper = self.host.prestage.keeper.get(job.id)
        req = dst.MoveRequest(self.host.job_key(job), need, ckpt_bytes, DEFAULT_REMAINING_S, window_s, str(self.host.node_id),
                              zone, zone, frozenset({str(keeper)}) if prestaged and keeper else frozenset())
        ranked = dst.rank(req, self.candidates(need), margin=float(self.host.s["notice_margin"]))
        feasible = [r for r in ranked if r.feasible]
        # The keeper holds the job's fallback checkpoint: prefer it at (nearly) equal cost, so one
        # node keeps the job before and after the move.
        if keeper is not None and feasible and feasible[0].candidate.node != str(keeper):
            for i, r in enumerate(feasible):
                if r.candidate.node == str(keeper) and r.expected_loss_s <= feasible[0].expected_loss_s + 1.0:
                    feasible.insert(0, feasible.pop(i))
                    break
        return feasible + [r for r in ranked if not r.feasible]

    def unhold(self, job: Any, froze: bool, timeout: float | None = None) -> bool:
        """Ends a move's hold on ``job`` (a job, or its id): released (thawed, unless another hold keeps it
        frozen) when the move froze it (``froze``), else dropped as it was (a job found frozen:
        the freeze was not the move's to undo). True when thawed."""
        if froze:
            return self.host._holds().release(job, Hold.MOVE, timeout=timeout)
        self.host._holds().drop(job, Hold.MOVE)
        return False

    async def unhold_wait(self, job: Any, froze: bool, timeout: float) -> bool:
        """:meth:`unhold`, the thaw waited for without blocking the loop."""
        if froze:
            return await self.host._holds().release_wait(job, Hold.MOVE, timeout)
        self.host._holds().drop(job, Hold.MOVE)
        return False

    def restore_holds(self) -> None:
        """At start, after the moves' restore: a move's hold (kept by the job manager) that no
        record of a move accounts for was cut where none was kept (the agent died between the
        freeze and its record, or the job was frozen already): released, so the job is thawed
        unless another hold (Airlock's) keeps it frozen; never frozen for good."""
        if self.host.agent.jobs is None:
            return
        holds = self.host._holds()
        known = set(self.host.evacuation.move_phases()) | set(self.host.evacuating) | set(self.host.archive.stopped.late_stopping) | set(self.host._archive_keeps)
        known |= {str(r["job_id"]) for r in ledger.move_records(self.host.agent.store.db)}
        for jid in sorted(holds.held_by(Hold.MOVE) - known):
            try:
                holds.release(jid, Hold.MOVE, timeout=0)
            except Exception as e:
                log.warning("migrate: releasing the move hold of %s, cut by the agent's stop: %s", jid, e)

    def record(self, job_id: str, event: mp.Event, reason: str = "", thaw: bool | None = None,
                     node: int | None = None, pid: int | None = None, request: dict[str, Any] | None = None,
                     cause: mp.Cause = mp.Cause.MOVE_NOW) -> None:
        """Records where a move without a window (``migrate_moves``, ``cause`` one of
        :data:`ledger.WINDOWLESS`) is, before it gets there (``freeze``: before the freeze;
        ``hand-over``: before the hand-over is sent). A later phase keeps the earlier
        ``reason`` and ``thaw``."""
        with self.host.agent.store.tx() as db:
            ledger.record_move(db, job_id, event, cause=cause, reason=reason, thaw=bool(thaw), node=node, pid=pid,
                               request=request, counts=self.host.counts)

    def drop_record(self, job_id: str) -> None:
        """The record of ``job_id``'s move without a window goes."""
        with self.host.agent.store.tx() as db:
            ledger.drop_moves(db, [job_id], only=ledger.WINDOWLESS, counts=self.host.counts)

    def restore(self) -> None:
        """At start: settles the moves without a window (a loan return's, Airlock's re-address)
        that the agent's stop or crash cut (``migrate_moves``). One cut before its hand-over was
        sent: the job is thawed (when the move froze it) and runs here, with a ``migrate`` event
        (phase ``move-cut``). One whose hand-over may have been sent: the destination is asked
        (:meth:`settle_cut`), the job frozen and left alone by Airlock until it answers.
        A job that ended meanwhile only loses its record."""
        jobs_mgr = self.host.agent.jobs
        for r in ledger.move_records(self.host.agent.store.db, ledger.WINDOWLESS):
            jid = str(r["job_id"])
            job = jobs_mgr.get(jid) if jobs_mgr is not None else None
            if job is None or not job.active:
                self.drop_record(jid)
                continue
            if r["phase"] == "gone":  # an operator settled that its node runs it; the stop here was cut
                self.host.evacuating.add(jid)  # a reclaim restored in this start does not move it meanwhile
                self.host._spawn(self.host.settle.stop_settled(job, int(r["node"]), "the agent's restart"))
                continue
            if r["phase"] == "handover" and r["node"] is not None and r["pid"] is not None:
                self.host.evacuating.add(jid)  # Airlock leaves it frozen (AirlockManager.moving)
                self.host._holds().reattach(job, Hold.MOVE)
                self.host._spawn(self.settle_cut(job, int(r["node"]), int(r["pid"]), json.loads(r["request"]),
                                                  str(r["reason"]), bool(r["thaw"])))
                continue
            self.host._holds().reattach(job, Hold.MOVE)
            with contextlib.suppress(Exception):
                # thawed unless the job was frozen before the move (its other hold keeps it)
                self.unhold(job, bool(r["thaw"]), timeout=0)  # asked; not waited for (on the loop)
            self.drop_record(jid)
            self.host._emit(f"{jid}: its move ({r['reason']}) was cut before its hand-over by the agent's stop; "
                       + ("thawed, it runs here" if r["thaw"] else "it runs here, left as it was before the move"),
                       job=jid, phase="move-cut", reason=str(r["reason"]))

    async def settle_cut(self, job: Any, node: int, pid: int, req: dict[str, Any], reason: str,
                               thaw: bool) -> None:
        """A move whose hand-over to ``node`` (placement ``pid``, request ``req``) may have been
        sent before the agent stopped: ``node`` is asked, with the same hand-over, until it
        answers (:meth:`Takeover.handover`). It runs the job: the copy here is stopped (state
        ``migrated``). It does not: the job is thawed here (when the move froze it) and runs
        on. Either way a ``migrate`` event says so and the record goes; a cancel (the agent
        stops again) leaves the record for the next start. ``node`` cannot be asked (no zone, or
        it left the roster): the job stays frozen here and in ``evacuating`` (no reclaim's move,
        no Airlock re-address of it: ``node`` may run it) until an operator settles it
        (:meth:`Settle.settle_handover`) or a later start asks ``node``."""
        mv = Move(job.id, self.host.job_key(job), reason, phase="handover", dest=node)
        self.host.moves[job.id] = mv
        held = False
        try:
            try:
                dest_job = await self.host.takeover.handover(node, pid, req, confirm=True, sent=True, job_id=job.id)
            except MigrateError as e:
                mv.phase, mv.error = "failed", str(e)
                with contextlib.suppress(Exception):
                    await self.unhold_wait(job, thaw, 2.0)
                self.drop_record(job.id)
                self.host._emit(f"{job.id}: its move to node {node} ({reason}) was cut by the agent's stop during the "
                           f"hand-over; node {node} did not start it ({e}), so it runs here"
                           + (", thawed" if thaw else ""), job=job.id, node=node, phase="move-cut", error=str(e))
                return
            mv.phase, mv.dest_job = "done", dest_job
            self.host.counts["moved"] += 1
            with contextlib.suppress(Exception):
                await jobs_of(self.host.agent).stop(job.id, f"migrated to node {node} as {dest_job} (its hand-over, cut by "
                                           "the agent's stop, was confirmed there after the restart)", grace_s=1.0,
                                           state="migrated", cause=EndCause.MIGRATED)
            self.drop_record(job.id)
            self.host._emit(f"{job.id}: its move to node {node} ({reason}) was cut by the agent's stop during the "
                       f"hand-over; node {node} runs it as {dest_job}, so it is stopped here", job=job.id, node=node,
                       dest_job=dest_job, phase="done")
        except (KeyError, AttributeError) as e:  # no zone, or the node left its roster: asked at the next start
            mv.error = f"cannot ask node {node}: {e!r}"
            self.host._emit(f"{job.id}: its move to node {node} was cut by the agent's stop during the hand-over and node "
                       f"{node} cannot be asked ({e!r}); the job stays frozen here (it may run there) until a start "
                       "that can ask it, or an operator's call", job=job.id, node=node, phase="unconfirmed")
            held = True  # still being moved: the settle (Settle._settle_move) takes it out of evacuating
        finally:
            mv.ended = time.time()
            if not held:
                self.host.evacuating.discard(job.id)

    async def move_now(self, job: Any, reason: str) -> Move:
        """Move ``job`` elsewhere now, without a deadline: checkpoint, reserve, transfer, hand
        over, stop here (state ``migrated``). The loan return's ``migrate`` action. Never
        raises: a failed move (phase ``failed``) leaves the job running here."""
        return await self.move(job, reason, None, final=True, cause=mp.Cause.MOVE_NOW)

    async def readdress(self, job: Any) -> dict[str, Any]:
        """Airlock's re-address rung: move ``job`` elsewhere now, without a deadline (Airlock has
        already sent the checkpoint signal; a new checkpoint is waited for all the same)."""
        return (await self.move(job, "airlock re-address", None, final=True, cause=mp.Cause.READDRESS)).as_dict()

    async def move(self, job: Any, reason: str, deadline_mono: float | None, final: bool = True,
                    transfer_deadline: float | None = None, cause: mp.Cause | None = None) -> Move:
        """Checkpoint, reserve, transfer, hand over, stop here. ``deadline_mono``: the window's
        end; ``transfer_deadline``: when the plan wants the transfer done (what the shaper
        paces to; the rest of the window is for the hand-over); ``cause``: what its record says
        (default: ``reclaim`` with a window, else ``move_now``). Never raises: the outcome is
        in the returned Move (phase done or failed) and in ``migrate`` events."""
        mv = Move(job.id, self.host.job_key(job), reason,
                  deadline=None if deadline_mono is None else time.time() + deadline_mono - time.monotonic(),
                  cause=cause or (mp.Cause.RECLAIM if deadline_mono is not None else mp.Cause.MOVE_NOW))
        self.host.moves[job.id] = mv
        self.host.evacuating.add(job.id)
        self.host.prestage.supersede(job.id)
        self.host.counts["moves"] += 1
        frozen = False
        try:
            if job.id in self.host.fence.fenced_jobs:
                raise MigrateError(f"{job.id} is fenced (node {self.host.node_id} heard none of its zone; "
                                   "migrate.fence_after_s): it moves once its fence is settled, if nobody took it over")
            origin = getattr(job, "origin", None)
            if origin is not None and origin.scheduler is not None:  # adopted (laminar.runtime.adopt)
                raise MigrateError(f"{job.id} was adopted from {origin.scheduler} job {origin.scheduler_ref}: its "
                                   "scheduler starts it elsewhere (a requeue, an eviction), never Laminar's move")
            if self.host.zone is None:
                raise MigrateError("this node is in a one-node zone: there is nowhere to move the job")
            # the newest verified checkpoint: the checkpoint driver's check of the job's listing
            # (nothing read here while it holds: a whole read of a checkpoint of many GB before
            # the final checkpoint is even asked for, seconds of the window; else checked now)
            before_manifest = None
            before_size: int | None = None
            if self.host.ckpt is not None and job.ckpt_dir:
                before, before_manifest = await self.host.ckpt.check(job, manifest=False)
                before_size = self.host.ckpt.verified_bytes(job) if before is not None else None
            else:
                before, _, info = await self.host.checkpoints.check_now(job, manifest=False)
                before_size = info.size_bytes if info is not None else None
            ckpt = before
            held = False

            async def hold(_seen: Path | None = None) -> None:
                """Freezes the job (once): its steps after the checkpoint are lost anyway. Done as
                soon as the final checkpoint is there, before it is checked: the job's cores go to
                the check, and no more steps are thrown away meanwhile (a check reads the whole
                checkpoint: seconds for many GB). Only what this move froze is thawed if it
                fails: a job Airlock had suspended (already frozen) stays as Airlock left it."""
                nonlocal frozen, held
                if held:
                    return
                held = True
                already = False
                with contextlib.suppress(Exception):
                    already = bool(job.cgroup.frozen())
                if deadline_mono is None:  # before the freeze: a restart thaws what a crash cut (restore)
                    self.record(job.id, mp.Event.FREEZE, reason=reason, thaw=not already, cause=mp.Cause(mv.cause))
                took = already
                with contextlib.suppress(Exception):
                    # the move's hold (runtime/holds.py), waited for without blocking the loop: a
                    # task of the job in uninterruptible sleep (its own hung FUSE mount) freezes
                    # only once it wakes
                    took = await self.host._holds().hold_wait(job, Hold.MOVE, FREEZE_WAIT_S)
                    frozen = not already
                if not took:
                    self.host.counts["freeze_timeouts"] = self.host.counts.get("freeze_timeouts", 0) + 1
                    self.host._emit(f"{job.id}: not frozen within {FREEZE_WAIT_S:g} s (a task of it in uninterruptible "
                               "sleep: hung storage?); the freeze stays asked for, the move goes on", job=job.id,
                               phase="freeze-pending")
                if frozen and deadline_mono is not None:  # a reclaim's: a restart thaws it and moves it again
                    self.host.evacuation.note_move(job.id, mp.Event.FREEZE)
                self.frozen_at[job.id] = time.time()

            if final:
                mv.phase = "checkpoint"
                asked_ok = jobs_of(self.host.agent).request_checkpoint(job)
                if asked_ok:
                    self.host._emit(f"{job.id}: checkpoint requested ({reason})", job=job.id, phase=mv.phase)
                else:
                    self.host._emit(f"{job.id}: its process does not catch {job.spec.checkpoint_signal} (sending it would "
                               f"kill it): no final checkpoint ({reason})", job=job.id, phase=mv.phase)
                wait = float(self.host.s["ckpt_wait_s"]) if asked_ok else 0.0
                if deadline_mono is not None:
                    wait = min(wait, max(0.0, deadline_mono - time.monotonic()))
                asked = time.monotonic()
                # frozen once its checkpoint is there; a checkpoint that then fails its check ends
                # the wait (a frozen job saves no other): the last verified one is moved
                new, mv.manifest = await self.host.checkpoints.wait_new(job, before, wait, found=hold, alive=lambda: not held)
                if new is not None:
                    self.host.ckpt_latency[job.id] = time.monotonic() - asked
                elif held:
                    self.host._emit(f"{job.id}: its final checkpoint failed its check; "
                               + ("moving the last one" if before else "it has no other"), job=job.id)
                else:
                    self.host._emit(f"{job.id}: no new checkpoint within {wait:.1f} s; moving the last one"
                               if before else f"{job.id}: no checkpoint within {wait:.1f} s", job=job.id)
                ckpt = new or before
                if new is None:
                    mv.manifest = before_manifest  # (the send checks it holds: _same_files)
            else:
                mv.manifest = before_manifest
            if ckpt is None:
                raise MigrateError("the job has no verified checkpoint to move (does it use laminar.jobkit?)")
            await hold()
            mv.ckpt = ckpt.name
            # its size by its check (the manifest it verified): never a stat of the job's files
            if mv.manifest is not None and mv.manifest.ckpt_id == ckpt.name:
                size = int(mv.manifest.total_bytes)
            else:
                size = before_size if ckpt == before and before_size is not None else DEFAULT_CKPT_BYTES
            window = None if deadline_mono is None else max(0.0, deadline_mono - time.monotonic())
            prestaged = self.host.prestage.shipped.get(job.id) == ckpt.name
            ranked = self.rank_for(job, float(size), window, prestaged)
            mv.ranked = [{"node": int(r.candidate.node), "feasible": r.feasible,
                          "expected_loss_s": None if math.isinf(r.expected_loss_s) else round(r.expected_loss_s, 3),
                          "reasons": list(r.reasons)} for r in ranked]
            feasible = [r for r in ranked if r.feasible]
            xfer = deadline_mono
            if transfer_deadline is not None and deadline_mono is not None:
                # late (the checkpoint took longer than planned): as soon as the shaper can,
                # never past the window
                xfer = min(deadline_mono, max(transfer_deadline, time.monotonic() + TRANSFER_MIN_S))
            errors = []
            if not feasible:
                errors.append("no destination fits: " + "; ".join(
                    f"node {r.candidate.node}: {', '.join(r.reasons)}" for r in ranked[:4]) if ranked else
                    "no destination fits: no live peer in the zone")
            # a node a move or a prestage found silent lately is left out: another job of this
            # reclaim would pay the same timeouts there (it is back once the zone hears from it)
            silent = self.host.prestage.silent_peers()
            errors += [f"node {r.candidate.node}: found silent lately" for r in feasible if int(r.candidate.node) in silent]
            feasible = [r for r in feasible if int(r.candidate.node) not in silent]
            for r in feasible:
                node = int(r.candidate.node)
                try:
                    await self._move_to(job, mv, ckpt, node, xfer)
                    break
                except HandoverSettled:
                    raise  # the operator's call: the job runs here, not on another node
                except (MigrateError, TransferError, OSError, TimeoutError) as e:
                    if isinstance(e, PeerSilentError):
                        self.host.prestage.mark_silent(node)
                    errors.append(f"node {node}: {e}")
                    self.host._emit(f"{job.id}: move to node {node} failed: {e}", job=job.id, node=node)
            else:
                if deadline_mono is None or not self.host.s["keeper"]:
                    raise MigrateError("; ".join(errors))
                # Nowhere to run it during the window: the final checkpoint still leaves the node.
                await self.host.keepers.hold(job, mv, ckpt, size, xfer, "; ".join(errors), deadline_mono)
                return mv
            mv.phase = "done"
            self.host.counts["moved"] += 1
            if deadline_mono is not None:
                self.host.evacuation.forget_move(job.id)
            else:
                self.drop_record(job.id)
            return mv
        except (MigrateError, TransferError, OSError) as e:
            mv.phase, mv.error = "failed", str(e)
            self.host.counts["failed"] += 1
            self.host._emit(f"{job.id}: move failed: {e}", job=job.id, phase="failed", error=str(e))
            await self._undo(job, frozen, windowed=deadline_mono is not None)
            return mv
        except asyncio.CancelledError:  # cut: the window's end, a shorter window, the agent stopping
            # what this move froze is thawed unless its hand-over was sent (the destination may
            # run it; done: it does): a later move of the job, which finds it frozen already, would never thaw it
            # _archive_keeps: its checkpoint is (or goes) in the archive, where any agent with room
            # claims it; the window's end, a new plan (Keepers.stop_archived) or a restart stops it
            if mv.phase not in ("handover", "done") and job.id not in self.host._archive_keeps:
                thawed = not frozen
                with contextlib.suppress(Exception):
                    # asked, and looked at once: this task is being cancelled (no wait here)
                    thawed = self.unhold(job, frozen, timeout=0) or not frozen
                if thawed and deadline_mono is None:  # else its record has a restart thaw it
                    with contextlib.suppress(Exception):
                        self.drop_record(job.id)
            raise
        except Exception as e:  # a bug must not leave the job frozen
            log.exception("migrate: move of %s", job.id)
            mv.phase, mv.error = "failed", repr(e)
            await self._undo(job, frozen, windowed=deadline_mono is not None)
            return mv
        finally:
            mv.ended = time.time()
            self.host.evacuating.discard(job.id)

    async def _undo(self, job: Any, frozen: bool, windowed: bool) -> None:
        """A failed move's undoing: the job thawed if this move froze it, and its move record gone
        (the reclaim's, ``windowed``, or one without a window). Never raises: the move's failure
        is what it answers."""
        with contextlib.suppress(Exception):
            await self.unhold_wait(job, frozen, FREEZE_WAIT_S)
        with contextlib.suppress(Exception):
            if windowed:
                self.host.evacuation.forget_move(job.id)
            else:
                self.drop_record(job.id)

    async def reserve(self, node: int, demand: Any, hold_s: float) -> int:
        """Probe ``node`` and commit its offer through the zone: the placement id holding the
        capacity. Raises MigrateError when it refuses or stays silent."""
        from laminar.zone import wire
        from laminar.zone.component import demand_to_probe

        z = self.host.zone
        t = z.submitter.t
        pid = z.submitter.new_placement_id()
        q = t.expect(pid)
        timeout = max(0.5, 3 * float(z.s["probe_timeout_s"]))
        try:
            for body, want in ((demand_to_probe(demand, pid, max(2.0, float(z.s["lease_s"]))), (wire.Offer, wire.Refuse)),
                               (wire.Commit(pid, int(min(600.0, hold_s) * 1000)), (wire.CommitAck,))):
                t.send(node, body)
                end = time.monotonic() + timeout
                while True:
                    left = end - time.monotonic()
                    if left <= 0:
                        raise MigrateError(f"node {node} did not answer the {type(body).__name__.lower()} in {timeout:.1f} s")
                    try:
                        n, ans = await asyncio.wait_for(q.get(), left)
                    except TimeoutError:
                        continue
                    if n == node and isinstance(ans, want):
                        break
                if isinstance(ans, wire.Refuse):
                    raise MigrateError(f"node {node} refused the reservation (reason {ans.reason})")
                if isinstance(ans, wire.CommitAck) and ans.status != 0:
                    raise MigrateError(f"node {node} did not commit the reservation (status {ans.status})")
            return pid
        except BaseException:
            t.send(node, wire.Release(pid))
            raise
        finally:
            t.forget(pid)

    async def _move_to(self, job: Any, mv: Move, ckpt: Path, node: int, deadline_mono: float | None) -> None:
        from laminar.zone import wire

        demand, _ = self.host._need(job)
        mv.dest = node
        mv.phase = "reserve"
        left = None if deadline_mono is None else deadline_mono - time.monotonic()
        pid = await self.reserve(node, demand, max(HOLD_MIN_S, 2 * (left or 0.0)))
        z = self.host.zone
        try:
            mv.phase = "transfer"
            self.host._emit(f"{job.id}: node {node} reserved; sending {ckpt.name}", job=job.id, node=node, phase=mv.phase)
            remote = await self.send(job, ckpt, node, deadline_mono, mv, silent_retries=MOVE_SILENT_RETRIES,
                                      manifest=mv.manifest)
            mv.phase = "handover"
            old = self.host.prestage.keeper.get(job.id)
            await self.send_keeper(job, node, ckpt.name)  # the destination keeps the job from now on
            self.host.prestage.set_keeper(job.id, node)
            if old is not None and old != node:
                # beside the hand-over, not before it: the job is frozen, and an old keeper gone
                # silent held it up to _control's timeout (a release not answered is sent again)
                self.host._spawn(self.host.prestage.release(old, self.host.job_key(job)))
            spec = job.spec.as_dict()
            spec.pop("gpus", None)
            spec["resume_from"] = remote
            # lent is this node's placement's (the destination marks the job lent if it takes it on
            # loan); the key goes in the request's origin (laminar.runtime.provenance), and in the
            # env too for an agent of an older release, which reads it there
            spec["env"] = {**(spec.get("env") or {}), MIGRATED_ENV: self.host.job_key(job)}
            spec["lent"] = False
            req = {"spec": spec, "owner_uid": job.owner_uid, "owner_gid": job.owner_gid,
                   "origin": request_origin(migrated_from=self.host.job_key(job), resume_given=True)}
            if deadline_mono is not None:  # a reclaim's: once sent, a restart never moves it again
                self.host.evacuation.note_move(job.id, mp.Event.HAND_OVER, node, pid=pid, request=req)
            else:  # a loan return's, Airlock's: a restart asks node whether it took the job (restore)
                self.record(job.id, mp.Event.HAND_OVER, node=node, pid=pid, request=req, cause=mp.Cause(mv.cause))
            dest_job = await self.host.takeover.handover(node, pid, req, confirm=True, job_id=job.id)
        except BaseException:
            z.submitter.t.send(node, wire.Release(pid))
            raise
        # done before the stop here: whoever sees the job read ``migrated`` sees its move done
        # (a cut from here on leaves the job frozen, as at ``handover``: node runs it)
        mv.phase, mv.dest_job = "done", dest_job
        self.host._emit(f"{job.id} moved to node {node} as {dest_job}, resuming from {ckpt.name}", job=job.id, node=node,
                   dest_job=dest_job, ckpt=ckpt.name, phase="done")
        _, lane = self.host.checkpoints.tools()
        try:  # (the job's directory: in its owner's lane, never through a link)
            made = await lane.run(getattr(job, "owner_uid", 0), lambda: os.lstat(ckpt).st_mtime, timeout_s=2.0)
        except (OSError, TimeoutError, LaneBusy):
            made = time.time()
        lost = max(0.0, self.frozen_at.pop(job.id, time.time()) - made)  # trained after it, then frozen
        with contextlib.suppress(Exception):
            await jobs_of(self.host.agent).stop(job.id, f"migrated to node {node} as {dest_job} (from {ckpt.name})",
                                       grace_s=1.0, state="migrated", work_lost_s=round(lost, 3),
                                       cause=EndCause.MIGRATED)

    async def send(self, job: Any, ckpt: Path, node: int, deadline_mono: float | None, mv: Move | None,
                    silent_retries: int | None = None, manifest: Manifest | None = None) -> str:
        """Sends ``ckpt`` to ``node``'s endpoint; returns its committed path there.
        ``silent_retries``: :func:`send_checkpoint`'s (a prestage passes 0, a move
        :data:`MOVE_SILENT_RETRIES`). ``manifest``: ``ckpt``'s, built (files checked) when it
        was found; sent as it is when the snapshot holds the very files it describes (hard
        links: same inode, size and mtime), else built again from the snapshot."""
        addr, port, key, zone = self.host._peer(node)
        hook = _ShaperHook(self.host.agent.transfers, job) if self.host.agent.transfers is not None else None
        last = [0.0]

        def progress(p: Progress) -> None:
            if mv is None:
                return
            mv.done_bytes, mv.total_bytes = p.done_bytes, p.total_bytes
            now = time.monotonic()
            if now - last[0] >= 0.5 or p.done_bytes >= p.total_bytes:
                last[0] = now
                self.host._emit(f"{job.id}: {p.done_bytes}/{p.total_bytes} bytes of {p.ckpt_id} at node {node}",
                           persist=False, job=job.id, node=node, done_bytes=p.done_bytes, total_bytes=p.total_bytes,
                           phase="transfer")

        rate = float(self.host.s["rate_mbit"]) * 1e6 or None
        # the job's directory is read in its owner's lane (storage the owner controls may hang;
        # a thread of the default executor stuck there kept the agent from ever exiting)
        _, lane = self.host.checkpoints.tools()
        try:
            snap = await lane.run(getattr(job, "owner_uid", 0), self._snapshot, ckpt, self.host.job_key(job),
                                  timeout_s=float(self.host.s.get("verify_timeout_s", ckpt_driver.VERIFY_TIMEOUT_S)))
        except (TimeoutError, LaneBusy) as e:
            raise MigrateError(f"{job.id}: its checkpoint {ckpt.name} could not be read in time: {e}") from None
        try:
            if self.host.archive.root() is not None:  # what the keeper that follows is handed, signed (send_keeper's _presign)
                self._sent_manifests.pop(self.host.job_key(job), None)
                with contextlib.suppress(OSError, ValueError, jobkit.CheckpointError):
                    self._sent_manifests[self.host.job_key(job)] = (ckpt.name, *await asyncio.to_thread(_manifest_facts, snap))
                while len(self._sent_manifests) > SENT_MANIFESTS_KEEP:  # (the oldest: of jobs long gone)
                    self._sent_manifests.pop(next(iter(self._sent_manifests)))
            if manifest is not None:
                manifest = await asyncio.to_thread(_same_files, manifest, snap)
            res = await send_checkpoint(addr, port, snap, self.host.job_key(job), key, zone=zone, node=str(self.host.node_id),
                                        chunk_size=int(self.host.s["chunk_kb"]) << 10, rate_bps=rate, local_host=self.host._xfer_local,
                                        deadline_monotonic=deadline_mono, progress=progress, flow_hook=hook,
                                        silent_retries=silent_retries, manifest=manifest)
        finally:
            shutil.rmtree(snap, ignore_errors=True)
        if mv is not None:
            mv.done_bytes = mv.total_bytes = res.total_bytes
        return res.remote_path

    def _snapshot(self, ckpt: Path, key: str) -> Path:
        """A copy of ``ckpt`` the job cannot take away mid-transfer (jobkit removes old
        checkpoints as it writes new ones): hard links (files are never rewritten in place),
        a copy where links fail. Only regular files are taken, and never through a link: the
        directory is the job user's, who may swap a file for a link, a pipe or a device after it
        was verified (the agent is root); such a checkpoint is refused (:func:`_snapshot_file`).
        The copy's shape is checked here (its manifest, every file it lists there with its size,
        nothing else); its bytes are not hashed again here: :func:`send_checkpoint` checks them
        against the manifest beside the transfer (``check_source``), and the destination commits
        nothing before that check passed (a pass here held the first byte back by a read of the
        whole checkpoint, 0.55 s per GiB). Blocking file I/O (callers run it in a thread).
        Raises CheckpointError/OSError when the checkpoint is gone or is not a directory of
        regular files."""
        assert self.host.root is not None
        out = self.host.root / "outgoing" / key / ckpt.name
        tmp = out.with_name(f".tmp-{ckpt.name}-{time.monotonic_ns()}")
        tmp.mkdir(parents=True)
        try:
            for f in ckpt.iterdir():
                _snapshot_file(f, tmp / f.name)
            listed = jobkit.read_manifest(tmp)["files"]
            jobkit.verify_checkpoint(tmp, hashed={f["name"]: str(f.get("sha256")) for f in listed})
            shutil.rmtree(out, ignore_errors=True)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out

    def request(self, job: Any, take_over: bool) -> dict[str, Any]:
        """What a keeper needs to resume ``job``: its spec (GPUs as a count), owner, GPUs."""
        spec = job.spec.as_dict()
        spec.pop("gpus", None)
        req: dict[str, Any] = {"spec": spec, "owner_uid": job.owner_uid, "owner_gid": job.owner_gid,
                               "gpus": self.host._need(job)[1].gpus}
        if take_over:
            req["take_over"] = True
        return req

    async def send_keeper(self, job: Any, node: int, ckpt_name: str, take_over: bool = False) -> None:
        """Hands ``node`` the keeper of ``job`` (its spec and owner). ``take_over``: the job is
        stopped here, so the keeper places it at once (not when this node is declared dead).
        While this node has a reclaim (in its window, or reclaimed: the window ended and the
        reclaim was neither withdrawn nor cleared by a restart) the keeper also learns the
        window's end: it declares this node dead then, even after a restart that lost the zone's
        notice, and a keeper message without it tells the keeper that this node has no reclaim
        (one that came after the notice's window ended is of a node back from its reclaim:
        :meth:`Takeover.notice`). Before, a message sent after the reclaim's own task ended (a
        prestage in flight at the window's end) left it out."""
        spec = job.spec.as_dict()
        spec.pop("gpus", None)
        request: dict[str, Any] = {"spec": spec, "owner_uid": job.owner_uid, "owner_gid": job.owner_gid,
                                   "gpus": self.host._need(job)[1].gpus}
        if self.host.reclaim is not None:
            request["window_end"] = self.host.reclaim["deadline"]
        if take_over:
            request["take_over"] = True
        signed = self._presign(job, request, ckpt_name)
        if signed is not None:
            request[PRESIGNED] = signed
        await self.host._control(node, "keeper", {
            "key": self.host.job_key(job), "src_node": self.host.node_id, "src_job": job.id, "ckpt": ckpt_name,
            "request": request})

    def _presign(self, job: Any, request: dict[str, Any], ckpt_name: str) -> dict[str, Any] | None:
        """The keeper record of ``job`` this node signs for its keeper (with ``archive_dir``): the
        record the keeper publishes in the archive when it finds no room (as this node would;
        :meth:`StoppedCopies._presigned`), naming ``ckpt_name`` as last sent (its manifest's
        SHA-256, bytes and files, noted by :meth:`send`). Only a job's node signs its records,
        so no other node can publish one for it. None when nothing of it was sent lately or this
        node holds no zone key (the keeper then keeps the job without archiving it)."""
        key = self.host.job_key(job)
        sent = self._sent_manifests.get(key)
        auth = ArchiveAuth.of(self.host.agent.zone)
        if self.host.archive.root() is None or sent is None or sent[0] != ckpt_name or auth is None:
            return None
        body = owner_body("guard", {"key": key, "src_node": self.host.node_id, "src_job": job.id, "request": request},
                          ckpt_name, sent[1], sent[2], sent[3], time.time())
        return dict(json.loads(auth.seal(body)))
