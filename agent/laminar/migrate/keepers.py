"""Storage keepers and keeps passed on (:class:`Keepers`, a part of
:class:`laminar.migrate.reclaim.ReclaimComponent`: its ``keepers``).

**No room anywhere: storage keepers.** When no peer can run a job during the window (none has
the GPUs, memory or CPUs free, or every reservation is refused), its final checkpoint still
leaves the node: the agent asks the live peers for their free disk (control message ``space``,
less their ``keeper_reserve_mb``), ranks them with :func:`laminar.policy.keeper.choose_keeper`
(disk, transfer vs what is left of the window, survival, the job's keeper first at equal
odds), sends the checkpoint to the best one (same transfer, shaped to the window), stops the
job (state ``reclaimed``, ``work_lost_s`` = time trained after the checkpoint) and hands that
peer the keeper with ``take_over``. The move's phase is ``held``. Prestaging uses a keeper too
when no peer has room (the keeper then only stores the replicas).

**A keeper reclaimed.** A keeper that is itself reclaimed passes every job it holds for a
stopped source (``waiting``, or ``take_over``) on to the best keeper among its live peers
(state ``passed``: :meth:`Keepers.pass_keepers`). With ``archive_dir`` the archive keeps what no live peer can
(:mod:`laminar.migrate.archive`). The part holds no state of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar import jobkit
from laminar.airlock.cgroups import set_frozen_async
from laminar.components import jobs_of
from laminar.migrate.archive_lane import ArchiveWait
from laminar.migrate.archive_stopped import ARCHIVE_WAIT_MARGIN_S
from laminar.migrate.errors import MigrateError
from laminar.migrate.mover import MOVE_SILENT_RETRIES
from laminar.migrate.transfer import PeerSilentError, TransferError, latest_verified, send_checkpoint
from laminar.policy import custody
from laminar.policy import destination as dst
from laminar.policy.endcause import EndCause
from laminar.policy.keeper import KeeperCandidate, choose_keeper
from laminar.zone import authority as au

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.archive import Archive
    from laminar.migrate.mover import Move, Mover
    from laminar.migrate.prestage import Prestage
    from laminar.migrate.takeover import Takeover

log = logging.getLogger("laminar.migrate")


class KeepersHost(Protocol):
    """What :class:`Keepers` uses of the component that holds it (ReclaimComponent and its parts)."""

    _archive_keeps: set[str]
    _xfer_local: str | None
    agent: MigrateAgent
    archive: Archive
    counts: dict[str, int]
    takeover: Takeover
    mover: Mover
    prestage: Prestage
    root: Path | None
    s: dict[str, Any]

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _peer(self, node: int) -> tuple[str, int, bytes, int]: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    def job_key(self, job: Any) -> str: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Keepers:
    """No room anywhere: storage keepers, and the keepers this node passes on when it is reclaimed
    (see the module's doc): a part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``keepers``).
    ``host``: the component."""

    def __init__(self, host: KeepersHost) -> None:
        self.host = host

    async def _disk_free(self, nodes: list[int], need_bytes: int) -> dict[int, float | None]:
        """Each node's free disk for checkpoints (its answer to ``space``; None: no answer)."""
        async def ask(n: int) -> float | None:
            try:
                res = await self.host._control(n, "space", {"bytes": int(need_bytes)}, timeout=2.0)
                return float(res["free_bytes"])
            except (MigrateError, TransferError, OSError, TimeoutError, KeyError, TypeError, ValueError) as e:
                log.info("migrate: node %d did not say its free disk space: %s", n, e)
                return None

        answers = await asyncio.gather(*(ask(n) for n in nodes))
        return dict(zip(nodes, answers, strict=True))

    async def rank(self, key: str, size: int, window_s: float | None, prefer: int | None) -> list[Any]:
        """Live peers that could hold a checkpoint of ``size`` bytes (not suspect, not draining,
        not under a reclaim notice), ranked by :func:`laminar.policy.keeper.choose_keeper`
        with their own answers about free disk space."""
        cands = self.host.mover.candidates(dst.Resources())
        free = await self._disk_free([int(c.node) for c in cands], size)
        hc = [KeeperCandidate(c.node, c.zone, free[int(c.node)], c.path_bps, float(c.survival or 0.0)) for c in cands]
        z = self.host.zone
        return choose_keeper(hc, float(size), window_s, margin=float(self.host.s["notice_margin"]),
                             src_zone=None if z is None else str(z.zone),
                             prefer=() if prefer is None else (str(prefer),))

    async def hold(self, job: Any, mv: Move, ckpt: Path, size: int, xfer_deadline: float | None, why: str,
                    window_end: float) -> None:
        """No peer can run ``job`` now: send its final checkpoint to the best storage keeper,
        hand it the keeper (as a keeper's: it takes the job over at this node's window end, should
        this agent die now), stop the job here (state ``reclaimed``) and tell the keeper to take
        it over (``take_over``), so it places the job as soon as room frees. Raises MigrateError
        when no keeper takes it. With ``archive_dir``, the copy beside the keeper is archived
        before the keeper is told to take over, so its take-over claims the record (one node
        runs the job).
        The archive (a copy beside the keeper, or the job's only one when no keeper takes it) is
        waited for until ARCHIVE_WAIT_MARGIN_S before ``window_end`` (the reclaim's window, not
        the transfer's plan: the copy comes after the transfer), never longer
        (:meth:`StoppedCopies.publish_until`): one that does not answer by then publishes nothing later."""
        mv.phase = "hold"
        window = None if xfer_deadline is None else max(0.0, xfer_deadline - time.monotonic())
        ranked = await self.rank(self.host.job_key(job), size, window, self.host.prestage.keeper.get(job.id))
        mv.ranked += [{"node": int(r.candidate.node), "feasible": r.feasible, "keeper": True,
                       "reasons": list(r.reasons)} for r in ranked]
        errors = [why]
        if not any(r.feasible for r in ranked):
            errors.append("no keeper: " + ("; ".join(f"node {r.candidate.node}: {', '.join(r.reasons)}"
                                                      for r in ranked[:4]) or "no live peer in the zone"))
        silent = self.host.prestage.silent_peers()  # a node a move or a prestage found silent lately: left out
        for r in (r for r in ranked if r.feasible and int(r.candidate.node) not in silent):
            node = int(r.candidate.node)
            mv.dest = node
            self.host._emit(f"{job.id}: no room for it in the zone ({why}); sending {ckpt.name} to node {node} to hold",
                       job=job.id, node=node, phase="hold")
            try:
                await self.host.mover.send(job, ckpt, node, xfer_deadline, mv, silent_retries=MOVE_SILENT_RETRIES,
                                 manifest=mv.manifest)
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                if isinstance(e, PeerSilentError):
                    self.host.prestage.mark_silent(node)
                errors.append(f"keeper {node}: {e}")
                continue
            # The keeper keeps the job before it stops here (as a keeper: it takes the job over
            # when this node's window ends, which the keeper carries): an agent crash between the
            # stop and the take-over below leaves the job its keeper. Told to take over only
            # once the job is stopped, it never runs it beside this node.
            old = self.host.prestage.keeper.get(job.id)
            try:
                await self.host.mover.send_keeper(job, node, ckpt.name)
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                errors.append(f"keeper {node} has {ckpt.name} but did not take the keeper: {e}")
                continue
            self.host.prestage.set_keeper(job.id, node)
            if old is not None and old != node:  # its keeper of an older checkpoint is not needed (not awaited:
                self.host._spawn(self.host.prestage.release(old, self.host.job_key(job)))  # a silent old keeper delays nothing)
            lost = max(0.0, self.host.mover.frozen_at.pop(job.id, time.time()) - ckpt.stat().st_mtime)
            with contextlib.suppress(Exception):  # stopped before the keeper may resume it
                await jobs_of(self.host.agent).stop(job.id, f"node {self.host.node_id} reclaimed with no room in the zone: "
                                           f"{ckpt.name} held by node {node}, which resumes the job when room frees",
                                           grace_s=1.0, state="reclaimed", work_lost_s=round(lost, 3),
                                           cause=EndCause.HELD_ELSEWHERE)
            if self.host.archive.root() is not None:  # the keeper is one node: the archive outlives it
                # archived before the keeper is told to take over: its take-over then claims the
                # record (the lock); told first, it could place the job from its replica while the
                # archive held nothing, and the record published after would be claimed by any
                # agent with room (the job twice)
                try:
                    await self.host.archive.stopped.publish_until(f"archiving {job.id}", self.host.job_key(job), ckpt, {
                        "key": self.host.job_key(job), "src_node": self.host.node_id, "src_job": job.id,
                        "request": self.host.mover.request(job, True)}, window_end - ARCHIVE_WAIT_MARGIN_S)
                except (OSError, jobkit.CheckpointError, MigrateError) as e:
                    # a hung one publishes nothing later (given up): the keeper alone keeps the job
                    log.warning("migrate: archiving %s failed: %s", job.id, e)
                    self.host._emit(f"{job.id}: not archived beside keeper {node}: {e}", job=job.id, node=node,
                               phase="hold")
            try:
                await self.host.mover.send_keeper(job, node, ckpt.name, take_over=True)
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                raise MigrateError(f"keeper {node} keeps {ckpt.name} but was not told to take the job over now: "
                                   f"{e}; it takes it over when this node's window ends") from None
            mv.phase = "held"
            self.host.counts["held"] += 1
            self.host._emit(f"{job.id}: {ckpt.name} held by node {node}; it resumes the job when room frees",
                       job=job.id, node=node, ckpt=ckpt.name, phase="held")
            return
        if self.host.archive.root() is not None:
            # no live peer keeps it: the archive does, and any agent with room claims it
            keeper = self.host.prestage.keeper.get(job.id)
            key = self.host.job_key(job)
            record = {"key": key, "src_node": self.host.node_id, "src_job": job.id, "request": self.host.mover.request(job, True)}
            late_ok = keeper is None
            # given up only if this wait is cut (a shorter window, the agent's stop): the job is
            # then thawed and moved again, and a copy published later would be a second one
            aw = ArchiveWait() if late_ok else None
            if late_ok:  # a restart takes the copy up again, never publishing it twice (StoppedCopies.restore_late_copies)
                self.host.archive.stopped.late_row_add(key, job.id, ckpt, record)

            def settled(e: BaseException | None) -> None:
                self.host.archive.stopped.late_row_drop(key)
                self.late_copy_settled(mv, e)
            try:
                # with no keeper, a late copy is still wanted: it is the job's only one once this
                # node is gone (published if the storage answers before then)
                path = await self.host.archive.stopped.publish_until(f"archiving {job.id}", key, ckpt, record,
                                                 window_end - ARCHIVE_WAIT_MARGIN_S, late_ok=late_ok,
                                                 settled=settled if late_ok else None,
                                                 mark=(lambda: self.host.archive.stopped.late_mark(key)) if late_ok else None, wait=aw)
            except asyncio.CancelledError:
                if aw is not None and aw.given_up:
                    self.host.archive.stopped.late_row_drop(key)  # nothing is published: the job is thawed (Mover.move)
                elif aw is not None:  # its record was being put in place: the job stays frozen, stopped
                    self.host._archive_keeps.add(job.id)  # by the window's end, a new plan or a restart
                raise
            except MigrateError as e:
                if not late_ok:  # a hung archive: as with none, the move fails (its job thawed)
                    errors.append(f"{e}: nothing archived; its keeper, node {keeper}, still keeps it")
                    raise MigrateError("; ".join(errors)) from None
                self.host.archive.stopped.late_row_late(key)  # before the stop: a restart that finds the job reclaimed takes it up
                self.host._archive_keeps.add(job.id)
                mv.phase, mv.dest = "archiving", None  # before the stop: the copy may land meanwhile
                # Its copy goes on past the window, and the job stops now: thawed, it would run on
                # here beside the copy any agent with room claims once it is published (the job
                # twice), and its steps from here are lost at the window's end anyway.
                lost = max(0.0, self.host.mover.frozen_at.pop(job.id, time.time()) - ckpt.stat().st_mtime)
                with contextlib.suppress(Exception):
                    await jobs_of(self.host.agent).stop(job.id, f"node {self.host.node_id} reclaimed with no room, no keeper and no "
                                               f"keeper in the zone: {e}; {ckpt.name} is published there if it answers "
                                               "before the node goes, and the first agent with room resumes it",
                                               grace_s=1.0, state="reclaimed", work_lost_s=round(lost, 3),
                                               cause=EndCause.ARCHIVED)
                self.host._archive_keeps.discard(job.id)
                self.host.counts["archive_late"] = self.host.counts.get("archive_late", 0) + 1
                self.host._emit(f"{job.id}: {'; '.join(errors)}; {e}: {ckpt.name} is still being archived (an event "
                           "says when it is there)", job=job.id, ckpt=ckpt.name, phase="archiving")
                return
            except BaseException:
                if late_ok:
                    self.host.archive.stopped.late_row_drop(key)
                raise
            self.host._archive_keeps.add(job.id)  # cut in the stop, the job is not thawed (Mover.move): the archive resumes it
            lost = max(0.0, self.host.mover.frozen_at.pop(job.id, time.time()) - ckpt.stat().st_mtime)
            with contextlib.suppress(Exception):
                await jobs_of(self.host.agent).stop(job.id, f"node {self.host.node_id} reclaimed with no room and no keeper in the "
                                           f"zone: {ckpt.name} archived in {path.parent}; the first agent with room "
                                           "resumes it", grace_s=1.0, state="reclaimed", work_lost_s=round(lost, 3),
                                           cause=EndCause.ARCHIVED)
            self.host._archive_keeps.discard(job.id)
            if late_ok:  # after the stop: a restart before it finds the record published and the job here
                self.host.archive.stopped.late_row_drop(key)
            old = self.host.prestage.forget_keeper(job.id)
            if old is not None:
                await self.host.prestage.release(old, self.host.job_key(job))
            mv.phase, mv.dest = "archived", None
            self.host.counts["archived"] += 1
            self.host._emit(f"{job.id}: {'; '.join(errors)}; {ckpt.name} archived in {path.parent}", job=job.id,
                       ckpt=ckpt.name, phase="archived")
            return
        raise MigrateError("; ".join(errors))

    async def stop_archived(self, job: Any, mv: Move) -> None:
        """A job whose move (an earlier plan's, cut by a shorter window) archived its checkpoint,
        or was archiving it, before it could stop the job (``_archive_keeps``): stopped here
        (``reclaimed``), never moved again (the archive's record is claimable: it would run twice)."""
        with contextlib.suppress(Exception):
            await set_frozen_async(job.cgroup, False, 2.0)  # a frozen job is not killed by a signal until it thaws
        what = mv.ckpt or "its checkpoint"
        try:
            await jobs_of(self.host.agent).stop(job.id, f"node {self.host.node_id} reclaimed: {what} is in the archive, or on its "
                                       "way there; the first agent with room resumes it", grace_s=0, state="reclaimed",
                                       cause=EndCause.ARCHIVED)
        except Exception as e:
            log.warning("migrate: stopping %s, archived before a new plan: %s", job.id, e)
        self.host._archive_keeps.discard(job.id)
        self.host._emit(f"{job.id}: {what} archived (or on its way there) by an earlier plan's move, cut before it "
                   "stopped the job; stopped here, not moved again", job=job.id, phase="archive-stop")

    def late_copy_settled(self, mv: Move, error: BaseException | None) -> None:
        """The end of a move's copy that went on past its window's wait (phase ``archiving``):
        in the archive now (``error`` None), the move reads ``archived``, as one whose copy
        landed in time; refused by the storage, it reads ``failed`` with the error, and a
        ``migrate`` event (phase ``failed``) says the job's checkpoint is nowhere else."""
        if mv.phase != "archiving":
            return
        if error is None:
            mv.phase = "archived"
            self.host.counts["archived"] += 1
            return
        mv.phase, mv.error = "failed", f"archiving {mv.ckpt or 'its checkpoint'} failed after the window's wait: {error}"
        self.host.counts["failed"] += 1
        self.host._emit(f"{mv.job}: {mv.error}; the job's checkpoint is only on this node (its ckpt directory)",
                   job=mv.job, phase="failed", error=str(error))

    async def pass_keepers(self, deadline_mono: float, withdrawn: asyncio.Event | None = None) -> None:
        """This node is reclaimed: every job it keeps whose source has stopped it (a held
        checkpoint, ``take_over``, or a keeper waiting for room) goes on to the best storage
        keeper among the live peers, with its newest verified checkpoint and the keeper, so the
        job is not lost with this node. (A keeper of a job that still runs at its source needs
        nothing: the source sees this node's notice and picks another keeper.) ``withdrawn`` set
        (the reclaim was cancelled): the keepers not passed yet stay here."""
        db = self.host.agent.store.db
        rows = db.execute("SELECT * FROM migrate_replicas WHERE state IN ('keeping', 'waiting')").fetchall()
        for row in rows:
            if withdrawn is not None and withdrawn.is_set():
                return
            key = row["key"]
            try:
                req = json.loads(row["request"])
            except ValueError:
                continue
            if row["state"] != "waiting" and not req.get("take_over"):
                continue
            # a take-over in flight ends first (it may place the job); one that still waits (on a hung
            # archive: its claim) when the window is nearly over keeps the keeper here, and the next go on
            until = deadline_mono - ARCHIVE_WAIT_MARGIN_S
            while key in self.host.takeover.taking and time.monotonic() < until and not (withdrawn and withdrawn.is_set()):
                await asyncio.sleep(0.05)
            if key in self.host.takeover.taking:
                if not (withdrawn and withdrawn.is_set()):
                    busy = self.host.archive.lane.busy
                    self.host._emit(f"{key}: could not pass its keeper on before this node left: its take-over in flight "
                               "did not end within the window" + (f" (the archive's lane waits on: {busy[0]})"
                                                                  if busy else ""), key=key, phase="failed")
                continue
            row = db.execute("SELECT * FROM migrate_replicas WHERE key=?", (key,)).fetchone()
            if row is None or row["state"] not in ("keeping", "waiting"):
                continue
            self.host.takeover.taking.add(key)
            try:
                await self._pass_one(row, req, deadline_mono)
            except Exception as e:  # the next keeper is tried; this one is lost with the node
                log.warning("migrate: passing the keeper of %s on failed: %s", key, e)
                self.host._emit(f"{key}: could not pass its keeper on before this node left: {e}", key=key, phase="failed")
            finally:
                self.host.takeover.taking.discard(key)

    async def _pass_one(self, row: Any, req: dict[str, Any], deadline_mono: float) -> None:
        key = row["key"]
        assert self.host.root is not None
        refused = self.host.takeover.chain_refusal(row, req)
        if refused is not None:  # a keeper this node may not act on is not passed on either (no laundering)
            raise MigrateError(f"not passed on: {refused}")
        senders = au.checkpoint_senders(key, self.host.takeover.keeper_sender(key, int(row["src_node"])), int(row["src_node"]))
        path = await asyncio.to_thread(latest_verified, self.host.root, key, senders)  # may hash it whole: not on the loop
        if path is None:
            return
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        window = max(0.0, deadline_mono - time.monotonic())
        ranked = [r for r in await self.rank(key, size, window, None)
                  if r.feasible and int(r.candidate.node) != int(row["src_node"])]
        errors = []
        for r in ranked:
            node = int(r.candidate.node)
            try:
                addr, port, zkey, zone = self.host._peer(node)
                await send_checkpoint(addr, port, path, key, zkey, zone=zone, node=str(self.host.node_id),
                                      chunk_size=int(self.host.s["chunk_kb"]) << 10, local_host=self.host._xfer_local,
                                      rate_bps=float(self.host.s["rate_mbit"]) * 1e6 or None, deadline_monotonic=deadline_mono)
                await self.host._control(node, "keeper", {"key": key, "src_node": int(row["src_node"]),
                                                    "src_job": row["src_job"], "ckpt": path.name,
                                                    "request": {**req, "take_over": True}})
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                errors.append(f"node {node}: {e}")
                continue
            self.host.takeover.set_replica(key, custody.Event.PASS, f"node {node}")
            self.host._emit(f"{key}: this node is reclaimed; {path.name} and the job's keeper passed on to node {node}",
                       key=key, node=node, ckpt=path.name, phase="passed")
            return
        if self.host.archive.root() is not None:
            try:
                # a late copy is still wanted (it is the job's only one once this node is gone) and
                # consistent: this keeper stays, and its own take-over goes through the archive's
                # claim, queued on the lane behind that copy, as does any other node's
                await self.host.archive.stopped.publish_until(f"archiving {key}", key, path, {
                    "key": key, "src_node": int(row["src_node"]), "src_job": row["src_job"],
                    "request": {**req, "take_over": True}}, deadline_mono - ARCHIVE_WAIT_MARGIN_S, late_ok=True)
            except MigrateError as e:
                raise MigrateError("; ".join([*errors, f"{e}: its copy is published if the archive answers later "
                                              "(the job is then claimed from there); this node keeps the keeper "
                                              "meanwhile"])) from None
            self.host.takeover.set_replica(key, custody.Event.ARCHIVE)
            self.host._emit(f"{key}: this node is reclaimed and no live peer can hold it; {path.name} archived", key=key,
                       ckpt=path.name, phase="archived")
            return
        raise MigrateError("; ".join(errors) or "no live peer can hold it")
