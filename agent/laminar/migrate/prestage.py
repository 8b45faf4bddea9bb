"""Prestaging, keepers and releases: how a running job's checkpoints get off its node before they
are needed (:class:`Prestage`, a part of :class:`laminar.migrate.reclaim.ReclaimComponent`; in
long form: docs/migration.md, *When the source dies*).

**When the source dies.** Every job has a *keeper*: the node its checkpoints are prestaged to
(shipped as they are written, when ``ckpt_schedule.notice_fit`` says the final checkpoint would
not fit the expected notice window, or always with ``prestage = "always"``). With each
shipped checkpoint the keeper receives the job's spec (an authenticated control message,
``keeper``), so it holds everything needed to resume the job. A keeper resumes the job from its
newest *verified* replica (:func:`laminar.migrate.transfer.latest_verified`; a checkpoint
whose transfer did not finish was never committed, so it is never used) once the source is
dead: it announced a reclaim and then fell silent in the zone for ``dead_after_s`` and does not
answer when asked (``needs``: one that answers its job lives there is still evacuating it), or
its window ended, or, with ``orphan_after_s`` set, it fell silent without a notice. Exactly one
node keeps a job at a time: a move hands the keeper to the destination (``keeper`` there, then
``release`` to the old keeper), and a node never resumes a job it already runs (the job manager
stored the key as the job's origin). A failed prestage keeps the job's keeper (it still
keeps the older checkpoint) and tries another peer next (PRESTAGE_FAIL_AVOID_S; a keeper that
said nothing, :class:`~laminar.migrate.transfer.PeerSilentError`, costs one timeout and is
avoided by every job's prestage as long: :meth:`Prestage.silent_peers`); the old keeper
of a job whose keeper went elsewhere is released, and a release that does not arrive is sent again
(RELEASE_RETRY_S) until it does, also after a restart (table ``migrate_releases``): two keepers of
one job would both resume it.

What the keeper does with the keeper once the source is dead is :mod:`laminar.migrate.takeover`'s;
what it keeps of the replicas, :mod:`laminar.migrate.replicas`'s.

:class:`Prestage` is the component's ``prestage``, built with the component (what it uses of it:
:class:`PrestageHost`); it holds each job's keeper (:attr:`Prestage.keeper`, kept in
``migrate_keepers``), the checkpoint last shipped to it (:attr:`Prestage.shipped`) and the releases
owed (:attr:`Prestage.releases`). The component's watch loop calls :meth:`Prestage.tick` each
round and its start :meth:`Prestage.restore`; a move calls :meth:`Prestage.supersede` as it
begins, and :meth:`Prestage.set_keeper`, :meth:`Prestage.forget_keeper` and :meth:`Prestage.release`
when it hands the keeper on; a move, a hold or a prestage that finds a peer silent calls
:meth:`Prestage.mark_silent` (and leaves :meth:`Prestage.silent_peers` out); the control op
``dropped`` is answered by :meth:`Prestage.answer_dropped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from laminar import jobkit
from laminar.components import jobs_of
from laminar.migrate import ledger
from laminar.migrate.errors import MigrateError
from laminar.migrate.transfer import PeerSilentError, TransferError

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.checkpoints import Checkpoints
    from laminar.migrate.ckpt_driver import CkptDriver
    from laminar.migrate.fence import Fence
    from laminar.migrate.keepers import Keepers
    from laminar.migrate.mover import Mover
    from laminar.migrate.replicas import Replicas

log = logging.getLogger("laminar.migrate")

# A prestage that failed to a node does not choose it again for the job for this long (another
# peer is tried; it is the last resort). One to which a prestage found the node silent (no
# connection accepted, no handshake answered: transfer.PeerSilentError, after ONE timeout) is not
# chosen for any job's prestage as long, unless the zone hears from it again (Prestage.silent_peers).
PRESTAGE_FAIL_AVOID_S = 60.0

# A ``release`` that did not arrive (the old keeper unreachable then) is sent again this often until
# it does (also after a restart: ``migrate_releases``; to a node gone from the roster once it is
# back in it), or RELEASE_GIVE_UP_S passed since it was first owed (the keeper's own ``needs``
# check then ends it).
RELEASE_RETRY_S = 5.0
RELEASE_GIVE_UP_S = 86400.0

# A keeper whose operator dropped a job's keeper by force (control op ``dropped``) is not chosen
# again as that job's keeper for this long (the drop freed its disk on purpose), unless it is the
# only peer that can take the job's checkpoints.
REPLICA_DROP_AVOID_S = 3600.0


class PrestageHost(Protocol):
    """What :class:`Prestage` uses of the component that holds it (ReclaimComponent and its parts)."""

    _superseding: set[str]
    agent: MigrateAgent
    checkpoints: Checkpoints
    keepers: Keepers
    mover: Mover
    ckpt: CkptDriver | None
    counts: dict[str, int]
    evacuating: set[str]
    fence: Fence
    notices: dict[int, tuple[float, float]]
    replicas: Replicas
    s: dict[str, Any]

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _last_seen(self, node: int) -> float: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    def job_key(self, job: Any) -> str: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Prestage:
    """Prestaging to a job's keeper, the keepers kept in the store, and releases owed to old
    keepers (see the module's doc): a part of :class:`laminar.migrate.reclaim.ReclaimComponent`
    (its ``prestage``). ``host``: the component."""

    def __init__(self, host: PrestageHost) -> None:
        self.host = host
        self.keeper: dict[str, int] = {}  # job id -> node its checkpoints are prestaged to (migrate_keepers)
        self.shipped: dict[str, str] = {}  # job id -> newest checkpoint shipped to the keeper
        self.prestaging: set[str] = set()  # jobs whose prestage runs now
        # job id -> the send of its prestage in flight (a move of the job cancels it: supersede)
        self._prestage_sends: dict[str, asyncio.Task[str]] = {}
        self._moves_begun: dict[str, int] = {}  # job id -> moves of it begun (a prestage they overtook stands down)
        # job id -> {node: until (wall)}: peers not chosen as the job's keeper before then (their
        # operator dropped its keeper, op ``dropped``; a prestage to them failed)
        self._avoid_until: dict[str, dict[int, float]] = {}
        # node -> (when, until) (wall): a prestage found it silent then; suspect for prestages until
        self._silent: dict[int, tuple[float, float]] = {}
        # (node, key) -> (next try, given up at) (monotonic): releases that did not arrive yet
        self.releases: dict[tuple[int, str], tuple[float, float]] = {}
        self._releasing: set[tuple[int, str]] = set()
        self._drops: dict[str, int] = {}  # job id -> how many ``dropped`` messages came for it

    def tick(self, now: float) -> None:
        """One round of the component's watch loop: each release due is sent again
        (:meth:`_release_round`), then each running job's newest checkpoint not yet shipped is
        prestaged (:meth:`_prestage_round`). ``now`` (wall clock) is not read: the releases go by
        the monotonic clock."""
        self._release_round()
        self._prestage_round()

    def _prestage_round(self) -> None:
        if self.host.zone is None:
            return
        # A job that ended here by itself (or was stopped by a person) needs no keeper any more;
        # one reclaimed, lost or migrated keeps it (the keeper resumes it, or the move moved it).
        for jid, node in list(self.keeper.items()):
            job = jobs_of(self.host.agent).get(jid)
            if job is None or (not job.active and job.state in ("exited", "stopped", "failed")):
                self.forget_keeper(jid)
                self.shipped.pop(jid, None)
                self._moves_begun.pop(jid, None)
                self.host._spawn(self.release(node, f"n{self.host.node_id}-{jid}"))
        if self.host.s["prestage"] == "off":
            return
        for job in list(jobs_of(self.host.agent).active()):
            if job.id in self.host.evacuating or job.id in self.prestaging or not job.ckpt_dir:
                continue
            if job.id in self.host.fence.fenced_jobs or job.id in self.host._superseding:
                # fenced (frozen, unsettled) or being stopped for a take-over: a prestage now would
                # hand the keeper to a new keeper, which knows nothing of a take-over, and release
                # the one that may have made it (the one the fence's settling asks). Found by the
                # soak (bench/chaos.py --no-archive, seed 43): a fenced job whose unshipped
                # checkpoint went to a new keeper was thawed on its "not taken" beside the copy
                # its old keeper had placed elsewhere
                continue
            # the listing the checkpoint driver's last scan took (off the loop, bounded): none
            # yet, or unknown this round, is nothing new
            cks = self.host.ckpt.listed(job) if self.host.ckpt is not None else None
            if not cks or self.shipped.get(job.id) == cks[-1].name:
                continue
            if not self.host.checkpoints.should_prestage(job):
                continue
            self.prestaging.add(job.id)
            self.host._spawn(self.ship(job))

    async def ship(self, job: Any) -> None:
        """Ships the job's newest checkpoint to its keeper (a new one by the usual choice when it
        has none, or its keeper is suspect, under a notice, or to be avoided: :meth:`avoided`)
        and hands it the keeper; the old keeper is then released (:meth:`release`, sent again until
        it arrives). A failure keeps the keeper the job had (it still keeps the job's older
        checkpoint) and avoids the node that failed for PRESTAGE_FAIL_AVOID_S."""
        node: int | None = None
        drops = self._drops.get(job.id, 0)
        moves = self._moves_begun.get(job.id, 0)
        try:
            # the newest that passes its check, read once in a worker thread (a checkpoint of
            # many GB took seconds, on the event loop before); the send uses that read's manifest
            # the checkpoint driver's check of the listing (the same one, when both look at once)
            ckpt, manifest = await self.host.checkpoints.newest_checked_once(job)
            if ckpt is None:
                return
            node = self.keeper.get(job.id)
            silent = self.silent_peers()
            avoid = self.avoided(job.id) | silent
            if node is None or node in self.host.notices or node in self.host.zone.membership.suspects or node in avoid:
                ranked = [int(r.candidate.node)
                          for r in self.host.mover.rank_for(job, float(self.host.checkpoints.ckpt_bytes(job)), None, False) if r.feasible]
                choice = [n for n in ranked if n not in avoid]
                if not choice:  # no peer has room for the job: a peer with the disk space holds its replicas
                    keepers = [int(h.candidate.node) for h in
                               await self.host.keepers.rank(self.host.job_key(job), self.host.checkpoints.ckpt_bytes(job), None, None) if h.feasible]
                    # a peer that dropped the job's keeper is the last resort (no other can take it)
                    choice = [n for n in keepers if n not in avoid] or [n for n in ranked or keepers if n not in silent]
                if not choice:
                    return
                node = choice[0]
            # one timeout at a silent keeper, then the next round sends to another peer: never the
            # transfer's whole retry ladder (a minute) with no newer checkpoint off the node
            send = asyncio.ensure_future(self.host.mover.send(job, ckpt, node, None, None, silent_retries=0, manifest=manifest))
            self._prestage_sends[job.id] = send
            try:
                await send
            except asyncio.CancelledError:
                if (task := asyncio.current_task()) is not None and task.cancelling():
                    raise  # this prestage is cancelled (the agent stops), not only its send
                log.info("migrate: prestaging %s to node %d: superseded by a move of the job", job.id, node)
                return
            finally:
                self._prestage_sends.pop(job.id, None)
            if job.id in self.host.evacuating or self._moves_begun.get(job.id, 0) != moves:
                return  # a move (begun since) decides who keeps the job now
            await self.host.mover.send_keeper(job, node, ckpt.name)
            if self._moves_begun.get(job.id, 0) != moves:
                # a move began while the keeper was on its way: the move hands the keeper to its
                # destination; the one just sent is withdrawn
                await self.release(node, self.host.job_key(job))
                return
            if self._drops.get(job.id, 0) != drops and node in self.avoided(job.id):
                # its operator dropped the job's replicas there while this prestage ran: the keeper
                # just sent may name a checkpoint it no longer holds; withdraw it, try another next
                log.info("migrate: node %d dropped %s during its prestage: not its keeper", node, job.id)
                await self.release(node, self.host.job_key(job))
                return
            old = self.keeper.get(job.id)
            self.set_keeper(job.id, node)
            if old is not None and old != node:  # not awaited: an old keeper gone silent held the job's next prestage
                self.host._spawn(self.release(old, self.host.job_key(job)))
            self.shipped[job.id] = ckpt.name
            self.host.counts["prestaged"] += 1
            self.host._emit(f"{job.id}: {ckpt.name} prestaged to node {node}", persist=False, job=job.id, node=node,
                            ckpt=ckpt.name, phase="prestaged")
        except (TransferError, MigrateError, OSError, TimeoutError, jobkit.CheckpointError) as e:
            log.info("migrate: prestaging %s to node %s failed: %s", job.id, node, e)
            if isinstance(e, FileNotFoundError) and job.ckpt_dir and \
                    str(e.filename or "").startswith(str(job.ckpt_dir) + "/"):
                return  # the job's own rotation removed the checkpoint under the send: no fault of the peer's
            if node is not None:  # the keeper stays the job's (it keeps the older checkpoint); try another next
                self.avoid(job.id, node, PRESTAGE_FAIL_AVOID_S)
                if isinstance(e, PeerSilentError):  # and every job's next prestage (and move) avoids it too
                    self.mark_silent(node)
        finally:
            self.prestaging.discard(job.id)

    def supersede(self, job_id: str) -> None:
        """A move of ``job_id`` begins: a prestage of it still sending is cancelled (the move
        needs the uplink, and it decides who keeps the job), and one past its send stands down
        (:meth:`ship` compares ``_moves_begun``)."""
        self._moves_begun[job_id] = self._moves_begun.get(job_id, 0) + 1
        send = self._prestage_sends.get(job_id)
        if send is not None and not send.done():
            send.cancel()

    def avoided(self, job_id: str, now: float | None = None) -> set[int]:
        """Peers not to choose as ``job_id``'s keeper now: their operator dropped its keeper less
        than REPLICA_DROP_AVOID_S ago, or a prestage to them failed less than
        PRESTAGE_FAIL_AVOID_S ago."""
        now = time.time() if now is None else now
        seen = {n: t for n, t in self._avoid_until.get(job_id, {}).items() if now < t}
        if seen:
            self._avoid_until[job_id] = seen
        else:
            self._avoid_until.pop(job_id, None)
        return set(seen)

    def mark_silent(self, node: int) -> None:
        """A prestage, a move or a hold found ``node`` silent
        (:class:`~laminar.migrate.transfer.PeerSilentError`): see :meth:`silent_peers`."""
        now = time.time()
        self._silent[node] = (now, now + PRESTAGE_FAIL_AVOID_S)

    def silent_peers(self, now: float | None = None) -> set[int]:
        """Peers a prestage, a move or a hold found silent (:class:`~laminar.migrate.transfer.PeerSilentError`)
        less than PRESTAGE_FAIL_AVOID_S ago that the zone has not heard from since: no job's
        prestage, move or hold goes to them (the zone's own suspects are not chosen either)."""
        now = time.time() if now is None else now
        self._silent = {n: (t, u) for n, (t, u) in self._silent.items() if now < u and self.host._last_seen(n) <= t}
        return set(self._silent)

    def avoid(self, job_id: str, node: int, for_s: float) -> None:
        until = time.time() + for_s
        d = self._avoid_until.setdefault(job_id, {})
        d[node] = max(d.get(node, 0.0), until)

    def answer_dropped(self, node: str, key: str) -> dict[str, Any]:
        """``node``'s operator dropped the keeper of ``key`` held there by force (control op
        ``dropped``). When ``node`` is the job's keeper here (only then: a node that is not,
        or a job with no keeper known, changes nothing), this node forgets it: the job's newest checkpoint is prestaged again at the next
        round, to the usual keeper choice without ``node`` (REPLICA_DROP_AVOID_S; ``node`` only when
        no other peer can take it). Returns ``{"key", "forgot", "prestages", "why"}``."""
        asker, jid = self.host.replicas.asked_about(node, key, "dropped")
        if jid is None:
            return {"key": key, "forgot": False, "prestages": False, "why": f"{key} is not a job of node {self.host.node_id}"}
        jobs = self.host.agent.jobs
        job = jobs.get(jid) if jobs is not None else None
        if job is None:
            return {"key": key, "forgot": False, "prestages": False,
                    "why": f"node {self.host.node_id} has no record of job {jid}"}
        keeper = self.keeper.get(jid)
        if keeper is None:  # (keepers survive restarts: migrate_keepers) no node's word changes the prestage
            return {"key": key, "forgot": False, "prestages": False,
                    "why": f"job {jid} has no keeper known here: node {asker}'s drop changes nothing"}
        if keeper != asker:
            return {"key": key, "forgot": False, "prestages": False,
                    "why": f"node {keeper} keeps job {jid} now, not node {asker}: nothing changes"}
        self.forget_keeper(jid)
        self.shipped.pop(jid, None)
        self.avoid(jid, asker, REPLICA_DROP_AVOID_S)
        self._drops[jid] = self._drops.get(jid, 0) + 1  # a prestage to it running now must not count
        prestages = bool(job.active) and self.host.s["prestage"] != "off" and job.id not in self.host.evacuating
        if prestages:
            why = f"job {jid} is {job.state}: its newest checkpoint goes to another keeper at the next prestage round"
        else:
            why = (f"job {jid} is {job.state} here and is not prestaged again: unless the archive holds it, no other "
                   "copy of its checkpoint is kept")
        log.warning("migrate: node %d dropped the keeper of %s (an operator's forced drop): %s", asker, key, why)
        self.host._emit(f"{jid}: node {asker} dropped its keeper (an operator's forced drop); {why}", job=jid, key=key,
                        node=asker, phase="keeper-dropped")
        return {"key": key, "forgot": True, "prestages": prestages, "why": why}

    def set_keeper(self, job_id: str, node: int) -> None:
        """``node`` keeps ``job_id`` now (kept in the store: a restarted agent still knows it); a
        release of it still pending is void."""
        self.keeper[job_id] = node
        self.releases.pop((node, f"n{self.host.node_id}-{job_id}"), None)
        with contextlib.suppress(Exception), self.host.agent.store.tx() as db:  # the store is the agent's
            db.execute("INSERT INTO migrate_keepers VALUES (?, ?, ?) ON CONFLICT(job_id) DO UPDATE SET "
                       "node=excluded.node, updated=excluded.updated", (job_id, node, time.time()))
            ledger.drop_release(db, node, f"n{self.host.node_id}-{job_id}")

    def forget_keeper(self, job_id: str) -> int | None:
        """``job_id`` has no keeper any more (here and in the store); returns the one it had."""
        old = self.keeper.pop(job_id, None)
        with contextlib.suppress(Exception), self.host.agent.store.tx() as db:
            db.execute("DELETE FROM migrate_keepers WHERE job_id=?", (job_id,))
        return old

    def owe_release(self, node: int, key: str, db: Any = None) -> None:
        """Records (in the store, ``migrate_releases``) that ``node`` is to be told it no longer
        keeps ``key``, before any try: what a stop or crash cuts is sent again by the next start
        (:meth:`restore`). ``db``: a transaction to write it in (else its own). Never
        raises (the store is the agent's: a failed write leaves the release in memory only)."""
        if db is not None:
            ledger.owe_release(db, node, key, time.time())
            return
        with contextlib.suppress(Exception), self.host.agent.store.tx() as tx:
            ledger.owe_release(tx, node, key, time.time())

    def drop_release(self, pair: tuple[int, str]) -> None:
        self.releases.pop(pair, None)
        with contextlib.suppress(Exception), self.host.agent.store.tx() as db:
            ledger.drop_release(db, *pair)

    def _release_void(self, node: int, key: str) -> bool:
        """Whether ``node`` is ``key``'s job's keeper again (it keeps the job: nothing to release)."""
        prefix = f"n{self.host.node_id}-"
        return key.startswith(prefix) and self.keeper.get(key[len(prefix):]) == node

    def restore(self) -> None:
        """At start: the keepers kept in the store (``migrate_keepers``); each release a stop or
        crash left unsent or unanswered (``migrate_releases``) is due at once
        (:meth:`_release_round`), and given up RELEASE_GIVE_UP_S after it was first owed; one
        whose node is the job's keeper again goes."""
        self.keeper = {str(r["job_id"]): int(r["node"])
                      for r in self.host.agent.store.db.execute("SELECT job_id, node FROM migrate_keepers").fetchall()}
        now, mono = time.time(), time.monotonic()
        for r in self.host.agent.store.db.execute("SELECT node, key, since FROM migrate_releases").fetchall():
            pair = (int(r["node"]), str(r["key"]))
            if self._release_void(*pair):
                self.drop_release(pair)
            else:
                self.releases[pair] = (mono, mono + max(0.0, float(r["since"]) + RELEASE_GIVE_UP_S - now))

    async def release(self, node: int, key: str) -> None:
        """Tells ``node`` it no longer keeps ``key`` (control op ``release``). It is recorded
        first (:meth:`owe_release`); one that does not arrive is sent again every
        RELEASE_RETRY_S (:meth:`_release_round`), also after a restart, until ``node`` answers,
        RELEASE_GIVE_UP_S passed, or ``node`` is the job's keeper again: else the node would go on
        keeping an older checkpoint beside the job's new keeper (or beside the job itself, after a
        ``settle --run-here``), and resume it when this node is declared dead. A node that is not
        in the zone's roster (it left it) is sent it once it is again. Never raises."""
        pair = (node, key)
        if self._release_void(node, key):
            self.drop_release(pair)  # it keeps the job again: nothing to release
            return
        self.owe_release(node, key)
        first = pair not in self.releases
        # owed from now on, also while this first try is on its way (a connect to a node cut off
        # takes seconds): the node is still the job's keeper to the fence's settling (``taken``)
        # and to its ``superseded`` (the answer below may carry one)
        mono = time.monotonic()
        self.releases.setdefault(pair, (mono + RELEASE_RETRY_S, mono + RELEASE_GIVE_UP_S))
        self._releasing.add(pair)
        try:
            ans = await self.host._control(node, "release", {"key": key})
        except (MigrateError, TransferError, OSError, TimeoutError) as e:
            mono = time.monotonic()
            _, give_up = self.releases.get(pair, (None, mono + RELEASE_GIVE_UP_S))
            if mono >= give_up:
                self.drop_release(pair)
                log.warning("migrate: release of %s at node %d failed: %s (given up: its keeper is checked with "
                            "this node after replica_keeper_check_s)", key, node, e)
            else:
                self.releases[pair] = (mono + RELEASE_RETRY_S, give_up)
                with contextlib.suppress(Exception), self.host.agent.store.tx() as db:
                    ledger.release_failed(db, node, key, str(e))
                # once per release (its tries go on every RELEASE_RETRY_S for as long as node is down)
                log.log(logging.INFO if first else logging.DEBUG,
                        "migrate: release of %s at node %d failed: %s (sent again every %g s until it arrives)",
                        key, node, e, RELEASE_RETRY_S)
        else:
            sup = ans.get("superseded") if isinstance(ans, dict) else None
            if isinstance(sup, dict):  # it took the job over and runs it: as control op ``superseded``
                try:  # (before the release is dropped: an old keeper owed it is this job's keeper)
                    self.host.replicas.answer_superseded(str(node), {**sup, "key": key})
                except (ValueError, KeyError, TypeError) as e:
                    log.warning("migrate: node %d's answer to the release of %s: %s", node, key, e)
            self.drop_release(pair)
        finally:
            self._releasing.discard(pair)

    def _release_round(self) -> None:
        """Sends again each release that did not arrive and is due (:meth:`release`), to a node in
        the zone's roster; gives up one owed for RELEASE_GIVE_UP_S."""
        mono = time.monotonic()
        z = self.host.zone
        for pair, (at, give_up) in list(self.releases.items()):
            if pair in self._releasing:
                continue
            if mono >= give_up:
                self.drop_release(pair)
                log.warning("migrate: release of %s at node %d given up after %g s (its keeper is checked with this "
                            "node after replica_keeper_check_s)", pair[1], pair[0], RELEASE_GIVE_UP_S)
            elif mono >= at and z is not None and pair[0] in z.membership.by_node:
                self._releasing.add(pair)
                self.host._spawn(self.release(*pair))
