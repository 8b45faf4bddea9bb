"""Self-fencing: a node cut off from its whole zone stops running the jobs the zone will resume
elsewhere, before the zone does (``migrate.fence_after_s``; 0, the default: off).

With ``orphan_after_s`` set, a job's keeper (or, with ``archive_dir``, any node) that hears nothing
from the job's node for that long takes the node for gone and resumes the job. When the silence
is a partition, the node's own copy runs on: two copies run from the take-over until the
partition heals and the resuming node tells the source (control op ``superseded``), which then
stops its copy. A job whose steps have effects outside it (it writes results to shared storage,
logs to an experiment tracker, calls a service) does them twice meanwhile.

With ``fence_after_s`` (less than ``orphan_after_s``), a node that has heard no other member of
the roster for that long freezes (cgroup freezer) every job the zone would resume elsewhere: one
with a keeper (or an old keeper still owed a release), or with a periodic copy in the archive.
Event phase ``fenced``; the job's state shows ``suspended`` (reason ``fenced: ...``). A cut-off node hears
nobody, so it fences before the others' silence reaches ``orphan_after_s``; from the take-over
on, only the resumed copy runs. The same node, while it hears nobody, takes nothing over either
(:meth:`Takeover.source_dead` answers alive): it is the one cut off, not the others. Nor
does a silence declare a source dead while this node heard no other member during it
(:meth:`Fence.cannot_tell`): a silence after a reclaim notice (``dead_after_s``) is shorter than
``fence_after_s``.

Once it hears a member again it settles each fenced job before thawing it:

- it asks the job's keeper, and any old keeper still owed a release (a keeper changed just before
  the partition still keeps), (control op ``taken``, ``{key}``; answered ``{key, runs, state}``)
  whether it took the job over (a keeper that passed the job on when it was reclaimed says to
  whom, ``passed_to``, and that node is asked too): ``runs`` (the id of its copy) stops the fenced copy here (state
  ``migrated``, event phase ``superseded``, as the op ``superseded``); a keeper that does not
  answer keeps the job fenced until it does, or until it counts as gone itself (silent for
  ``orphan_after_s`` while this node hears others: the rule every take-over uses);
- with an archive, a claim of the job there (``claimed-*``, ``running-*``, or the sweep's
  ``.done`` marker) keeps it fenced until the claimer tells this node that it runs it (op
  ``superseded``: stopped) or gives the claim back; a copy this node resumed itself (the key
  the job manager stored as its origin) whose claim another node took meanwhile (a dead runner's claim: it
  counted this node gone) is stopped: the archive's claim is the lock, and it lost it (unless
  the claim's running record names this very copy: the claimer placed the job here);
- else it is thawed (event phase ``unfenced``): the partition ended before anyone took it over.

The freeze is the fence's hold (``fence``, laminar/runtime/holds.py): the job manager keeps the
job frozen while any hold remains. A job Airlock holds suspended is fenced too (Airlock leaves
a job the fence holds alone: :meth:`AirlockManager.moving`, and a restarted Airlock does not
reattach it) and left frozen at the end, under Airlock's hold. The fenced jobs are kept in the
store (meta ``migrate.fenced``): an agent restarted meanwhile settles them the same way.

What it costs: a node whose peers all fail at once (not a partition) freezes its own jobs until
one comes back; in a zone of two nodes a partition fences both sides, and neither takes the
other's jobs over until it heals (no side can tell a partition from a departure). A node that
hears some members but not a job's keeper (a partial partition) does not fence; its keeper does
not take the job over either, because the members it asks heard the node lately (vouch.py).

:class:`Fence` is a part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``fence``),
built with the component (what it uses of it: :class:`FenceHost`); it holds the fenced jobs
(:attr:`Fence.fenced_jobs`). The component's watch loop calls :meth:`Fence.tick` each round and
its start :meth:`Fence.restore`; the keeper asks :meth:`Fence.isolated`, :meth:`Fence.cannot_tell`
and :meth:`Fence.unheard_since` before it takes a silent source for gone, and the vouching
(vouch.py) asks :meth:`Fence.isolated`; the control op ``taken`` is answered by
:meth:`Fence.answer_taken`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from laminar.migrate.archive_claims import ARCHIVE_CLAIM_STALE_S
from laminar.migrate.constants import valid_key
from laminar.migrate.errors import MigrateError
from laminar.migrate.transfer import TransferError
from laminar.runtime.holds import Hold, Holds, holds_of

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.archive import Archive
    from laminar.migrate.prestage import Prestage
    from laminar.migrate.replicas import Replicas
    from laminar.migrate.takeover import Takeover

log = logging.getLogger("laminar.migrate")

TAKEN_ASK_MAX = 8
"""Most keepers a fenced job's node asks (``taken``), following keepers passed on."""

FENCE_META = "migrate.fenced"
"""Store meta: {job id: when it was fenced (wall clock)}."""


def check_fence_settings(s: dict[str, Any]) -> None:
    """Raises ValueError when ``fence_after_s`` cannot work with the other settings."""
    fence = float(s.get("fence_after_s") or 0.0)
    if fence <= 0:
        return
    orphan = float(s.get("orphan_after_s") or 0.0)
    if orphan <= 0:
        raise ValueError(f"fence_after_s = {fence:g} needs orphan_after_s > 0 (with orphan_after_s = 0 nothing is "
                         "resumed elsewhere after a silence: there is nothing to fence against)")
    if fence >= orphan:
        raise ValueError(f"fence_after_s = {fence:g} must be less than orphan_after_s = {orphan:g} (a node cut off "
                         "must freeze its jobs before the zone resumes them elsewhere)")


class FenceHost(Protocol):
    """What :class:`Fence` uses of the component that holds it (ReclaimComponent and its parts)."""

    _started: float
    _superseding: set[str]
    agent: MigrateAgent
    archive: Archive
    evacuating: set[str]
    takeover: Takeover
    prestage: Prestage
    replicas: Replicas
    s: dict[str, Any]

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _holds(self) -> Holds: ...
    def _last_seen(self, node: int) -> float: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    def job_key(self, job: Any) -> str: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Fence:
    """A cut-off node's freeze of the jobs the zone resumes elsewhere (see the module's doc): a
    part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``fence``). ``host``: the
    component."""

    def __init__(self, host: FenceHost) -> None:
        self.host = host
        self.fenced_jobs: dict[str, float] = {}  # job id -> when this node froze it, cut off from its zone
        self._unfencing: set[str] = set()  # fenced jobs being settled now (_unfence)

    def restore(self) -> None:
        """At start: the jobs fenced before the restart (they are still frozen)."""
        self.fenced_jobs, self._unfencing = {}, set()
        got = self.host.agent.store.get_meta(FENCE_META)
        if isinstance(got, dict):
            self.fenced_jobs = {str(k): float(v) for k, v in got.items() if isinstance(v, (int, float))}
        holds = self.host._holds()
        for jid in self.fenced_jobs:  # (the job manager kept them too; an upgrade's did not)
            holds.reattach(jid, Hold.FENCE)

    def _save_fenced(self) -> None:
        with contextlib.suppress(Exception):
            if self.fenced_jobs:
                self.host.agent.store.set_meta(FENCE_META, dict(self.fenced_jobs))
            else:
                self.host.agent.store.del_meta(FENCE_META)

    def heard_last(self, but: int | None = None) -> float | None:
        """When this node last heard any other member of the roster (``but`` that one too) (-1:
        none since the start), or None when it has none (a one-node zone)."""
        z = self.host.zone
        others = [n for n in z.membership.state if n not in (self.host.node_id, but)] if z is not None else []
        return max(self.host._last_seen(n) for n in others) if others else None

    def isolated(self, now: float) -> bool:
        """Fencing is on and this node has heard no other member of the roster for
        ``fence_after_s`` (nor since this agent started)."""
        after = float(self.host.s.get("fence_after_s") or 0.0)
        heard = self.heard_last() if after > 0 else None
        return heard is not None and now - max(heard, self.host._started) >= after

    def unheard_since(self, src: int, end: float) -> bool:
        """Fencing is on and this node has heard no member of the roster but ``src`` since
        ``end`` (``src``'s reclaim window's end, wall clock): it may be the one cut off, and have
        missed what ``src`` said before its end (its reclaim withdrawn, its job moved to a third
        node and this keeper released), so that end declares nothing yet
        (:meth:`Takeover.source_dead`); once another member is heard after it, the keeper asks
        ``src`` first when ``src`` is heard too (:meth:`Takeover.missed_news`). A zone of two
        has nobody else to hear: the end declares ``src`` gone, as without fencing. Found by the
        soak (seed 29): a node cut off 5 s before a reclaim was withdrawn resumed the job at the
        old window's end, beside the copy that ran on at its source."""
        if float(self.host.s.get("fence_after_s") or 0.0) <= 0:
            return False
        heard = self.heard_last(but=src)
        return heard is not None and heard < end

    def cannot_tell(self, src: int, now: float, within: float) -> bool:
        """Fencing is on and this node has not heard other members for ``within`` (at most
        ``fence_after_s``) past ``src``'s last word: it cannot tell ``src``'s departure from its
        own isolation, so ``src``'s silence declares nothing (:meth:`Takeover.source_dead`). Found by the soak: a
        reclaim notice's short silence (``dead_after_s``, 3 s) let a node cut off 3 s before
        resume a job its source still ran, before the node's own fence (10 s) could hold it."""
        after = float(self.host.s.get("fence_after_s") or 0.0)
        z = self.host.zone
        if after <= 0 or z is None:
            return False
        others = [n for n in z.membership.state if n not in (self.host.node_id, src)]
        if not others:
            return True  # (a zone of two: nobody else to hear)
        # the others must have been heard that long past the source's last word: its silence is
        # then one this node could have heard end (a source that fell silent just before this node
        # was cut off is otherwise taken for gone a few seconds into the cut)
        heard = max(self.host._last_seen(n) for n in others)
        return heard - max(self.host._last_seen(src), self.host._started) < min(within, after)

    def tick(self, now: float) -> None:
        """Fences what the zone would resume elsewhere while this node is cut off; a fenced job
        is settled (:meth:`_unfence`) once a member is heard from after it was fenced (not merely
        once this node is no longer cut off: an agent restarted meanwhile has heard nobody yet)."""
        if float(self.host.s.get("fence_after_s") or 0.0) <= 0 and not self.fenced_jobs:
            return
        if self.isolated(now):
            self._fence(now)
            return
        heard = self.heard_last()
        for jid, since in list(self.fenced_jobs.items()):
            if (heard is None or heard > since) and jid not in self._unfencing:
                self._unfencing.add(jid)
                self.host._spawn(self._unfence(jid))

    def _fence(self, now: float) -> None:
        jobs = self.host.agent.jobs
        if jobs is None:
            return
        new = []
        holds = holds_of(jobs)
        for job in list(jobs.active()):
            if job.id in self.fenced_jobs:
                with contextlib.suppress(Exception):  # thawed meanwhile (a stop cut short): frozen again
                    holds.hold(job.id, Hold.FENCE)
                continue
            if job.id in self.host.evacuating or job.id in self.host._superseding:
                continue  # (a move under way freezes and settles the job itself)
            key = self.host.job_key(job)
            if (job.id not in self.host.prestage.keeper and job.id not in self.host.archive.periodic.live
                    and not any(k == key for _, k in self.host.prestage.releases)):
                continue  # nothing elsewhere would resume it (no keeper, old or new, no archived copy): it runs on
            try:
                holds.hold(job.id, Hold.FENCE)  # asked for now; taken once every task stops
            except Exception as e:  # its cgroup gone: it ended
                log.warning("migrate: fencing %s: %s", job.id, e)
                continue
            self.fenced_jobs[job.id] = now
            new.append(job.id)
        after = float(self.host.s["fence_after_s"])
        for jid in new:  # what `laminarctl jobs` shows (and what a restart reattaches it as: frozen)
            self._set_job_state(jid, "suspended", f"fenced: node {self.host.node_id} heard no member of its zone "
                                f"for {after:g} s (migrate.fence_after_s); thawed once it hears one and nobody took "
                                "the job over")
        if new:
            self._save_fenced()
            self.host._emit(f"node {self.host.node_id} heard no member of its zone for {after:g} s (fence_after_s): "
                            f"frozen, so that a job resumed elsewhere meanwhile does not run twice: {', '.join(new)}",
                            phase="fenced", jobs=new, fence_after_s=after)

    async def _unfence(self, jid: str) -> None:
        """Settles a fenced job once a member is heard from again (see the module's doc). Never raises."""
        try:
            await self._unfence_one(jid)
        except Exception:
            log.exception("migrate: settling fenced %s", jid)
        finally:
            self._unfencing.discard(jid)

    def drop(self, jid: str) -> None:
        """Forgets the fence of ``jid`` (its hold dropped without a thaw: settled, or stopped)."""
        self.host._holds().drop(jid, Hold.FENCE)
        if self.fenced_jobs.pop(jid, None) is not None:
            self._save_fenced()

    async def _unfence_one(self, jid: str) -> None:
        jobs = self.host.agent.jobs
        job = jobs.get(jid) if jobs is not None else None
        if job is None or not job.active:
            self.drop(jid)
            return
        if jid in self.host._superseding:
            return  # being stopped: a node runs it
        key = self.host.job_key(job)
        if self.host.archive.root() is not None:
            claimer = await self.host.archive.lane.call(f"claims of fenced {jid}", self.archive_claimer, key)
            if claimer is not None:
                return  # the claimer tells this node it runs the job (superseded), or gives the claim back
            # a copy this node resumed (of another node's job, or from the archive) whose claim
            # another node took meanwhile (it counted this node gone: a dead runner's claim): the
            # archive's claim is the lock, and this copy lost it
            # (the origin the job manager stored: never the job's env, which its user writes; a
            # key, so it names a directory under the archive root and never a path outside it)
            origin = str(getattr(getattr(job, "origin", None), "migrated_from", None) or "")
            if not valid_key(origin):
                origin = ""
            runner = await self.host.archive.lane.call(f"who runs {origin}", self.host.archive.runner, origin) \
                if origin else None
            if runner is not None and runner != str(self.host.node_id) and \
                    await self.host.archive.lane.call(f"where {origin} runs", self._placed_here_by_claim, origin, jid):
                # the claimer placed the claimed job here (no room there): this copy is the claim's
                # own. Before, it was stopped for the claim, and nobody ran the job any more
                # (bench/chaos.py --partial-partitions, seed 34: a job lost)
                runner = None
            if runner is not None and runner != str(self.host.node_id):
                if not runner.isdigit() or jid in self.host._superseding or not job.active:
                    return  # (a marker of an older agent names no node: left frozen for the operator)
                self.host._superseding.add(jid)
                await self.host.replicas.stop_superseded(job, int(runner), f"its claim of {origin}", origin, vouched=False)
                if not job.active:
                    self.drop(jid)
                return
        # its keeper, and the old keepers still owed a release: a keeper changed just before the
        # partition (the old one, cut off from this node earlier, still keeps and may take over)
        ask = sorted(({self.host.prestage.keeper[jid]} if jid in self.host.prestage.keeper else set())
                     | {n for n, k in self.host.prestage.releases if k == key} - {self.host.node_id})
        for node in ask:  # (grows: a keeper passed on is asked where it went)
            try:
                ans = await self.host._control(node, "taken", {"key": key}, timeout=3.0)
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                if self.host.takeover.source_dead(node, time.time()) is None:
                    log.info("migrate: fenced %s stays frozen until node %d, which keeps it, answers: %s",
                             jid, node, e)
                    return
                continue  # gone by the rule every take-over uses: its copy, if any, went with it
            runs = ans.get("runs") if isinstance(ans, dict) and ans.get("key") == key else None
            if jid in self.host._superseding or not job.active:
                return  # the keeper's own ``superseded`` came first (its stop settles the fence)
            to = ans.get("passed_to") if isinstance(ans, dict) and ans.get("key") == key else None
            if isinstance(to, int) and not isinstance(to, bool) and to not in ask and to != self.host.node_id \
                    and len(ask) < TAKEN_ASK_MAX:
                # the keeper, reclaimed meanwhile, passed it on (with a take-over): ask there too.
                # Before, the fenced copy was thawed on the first keeper's "not taken" while the
                # second resumed the job (bench/chaos.py --partial-partitions, seed 32)
                ask.append(to)
            if runs:
                runner = ans.get("node")
                runner = int(runner) if isinstance(runner, int) and not isinstance(runner, bool) else node
                self.host._superseding.add(jid)  # (on the word of its keeper: it runs the job, or placed it there)
                await self.host.replicas.stop_superseded(job, runner, str(runs), key)
                self.drop(jid)
                return
        holds = holds_of(jobs)
        holds.reattach(jid, Hold.FENCE)  # (fenced: held, whatever took the record in)
        others = holds.others(jid, Hold.FENCE)
        held = Hold.AIRLOCK.value in others
        try:
            if holds.release(jid, Hold.FENCE):  # thawed unless another holds it (Airlock's suspend)
                self._set_job_state(jid, "running", f"unfenced: node {self.host.node_id} hears its zone again and "
                                    "nobody took the job over")
        except Exception as e:
            log.warning("migrate: thawing fenced %s: %s", jid, e)
        since = self.fenced_jobs.get(jid, time.time())
        self.drop(jid)
        self.host._emit(f"{jid}: node {self.host.node_id} hears its zone again and nobody took the job over: "
                        + ("left frozen (Airlock holds it suspended)" if held else
                           f"left frozen (held: {', '.join(others)})" if others else "thawed")
                        + f" after {time.time() - since:.1f} s fenced", job=jid, phase="unfenced", airlock_held=held,
                        fenced_s=round(time.time() - since, 3))

    def _set_job_state(self, jid: str, state: str, reason: str) -> None:
        jobs = self.host.agent.jobs
        job = jobs.get(jid) if jobs is not None else None
        if jobs is None or job is None or not job.active or not hasattr(jobs, "set_state"):
            return
        try:
            jobs.set_state(job, state, reason)
        except Exception as e:  # (the store: the state shown is wrong, the job is not)
            log.warning("migrate: recording %s %s: %s", jid, state, e)

    def _placed_here_by_claim(self, key: str, jid: str) -> bool:
        """Whether a claim of ``key`` in the archive runs as this node's job ``jid``: a verified
        running record's ``resumed`` names them (the claimer placed it here). Blocking: the lane."""
        v = self.host.archive.view_or_none()
        if v is None:
            return False
        with v:
            return any((s.body.get("resumed") or {}).get("node") == self.host.node_id
                       and (s.body.get("resumed") or {}).get("job") == jid for s in v.runs(key))

    def archive_claimer(self, key: str) -> str | None:
        """The node that claimed ``key`` in the archive (a verified claim this agent has not seen
        go stale), runs it from there, or ran it (the sweep's ``.done`` marker, once the resumed
        job's own copies made the key's directory needless), or None (blocking: the lane). A
        file that does not verify names nobody: one planted there keeps no job frozen."""
        v = self.host.archive.view_or_none()
        if v is None:
            return None
        with v:
            claims = [str(c.node) for c in v.claims(key) if c.name.startswith("claimed-")
                      and self.host.archive.claims.claim_age(v, key, c) <= ARCHIVE_CLAIM_STALE_S]
            who = [n for n in (*claims, self.host.archive.runner_in(v, key))
                   if n is not None and n != str(self.host.node_id)]
            return who[0] if who else None

    def answer_taken(self, node: str, key: str) -> dict[str, Any]:
        """Control op ``taken``: the job's node (fenced while cut off, now heard again) asks its
        keeper whether it took ``key`` over. ``{key, runs, node, state}``: ``runs`` the id of the
        job that runs it and ``node`` where (this node, or the node it placed the job on when it
        had no room: state ``placed``), None when none; ``state`` this node's keeper of it (None:
        none). Only the job's own node is answered about it. Raises ValueError for another asker."""
        try:
            asker = int(node)
        except ValueError:
            raise ValueError(f"taken: the asking node {node!r} is not a node id") from None
        if not key.startswith(f"n{asker}-"):
            raise ValueError(f"taken: node {asker} asks about {key!r}, not one of its jobs")
        row = self.host.agent.store.db.execute("SELECT state, src_node, job_id FROM migrate_replicas WHERE key=?",
                                          (key,)).fetchone()
        if row is None or int(row["src_node"]) != asker:
            return {"key": key, "runs": None, "state": None}
        if row["state"] == "placed":  # taken over and placed on another node (no room here)
            placed = self.host.archive.placed_as(key)
            if placed is not None:
                return {"key": key, "runs": placed[1], "node": placed[0], "state": "placed"}
        if row["state"] == "passed":  # this node was reclaimed and passed the keeper on (``Keepers._pass_one``)
            to = str(row["job_id"] or "").removeprefix("node ")
            return {"key": key, "runs": None, "state": "passed", "passed_to": int(to) if to.isdigit() else None}
        runs = self.host.takeover.runs_here(key) if row["state"] == "resumed" else None
        return {"key": key, "runs": runs, "node": self.host.node_id if runs else None, "state": str(row["state"])}
