"""Holds: the one place a job is frozen and thawed (cgroup freezer).

Several components freeze a job for reasons of their own: Airlock suspends it under memory
pressure, a move freezes it once its final checkpoint is there, a node cut off from its zone
fences it, the origin of a multi-node job freezes every member while one member's node has it
suspended. Each takes a *hold* with its reason; the job is frozen while any hold remains and
thawed when the last one is released, so no component needs to know whether another one froze
the job too (before, each read the others' sets to decide whether its thaw was safe)::

    holds = jobs.holds                         # (a job, or its id)
    holds.hold("job-3", Hold.AIRLOCK)          # frozen now (the freeze asked for; not waited for)
    await holds.hold_wait("job-3", Hold.MOVE, 2.0)   # a second hold: already frozen
    holds.release("job-3", Hold.AIRLOCK)       # False: the move still holds it, it stays frozen
    await holds.release_wait("job-3", Hold.MOVE, 2.0)  # True: the last hold, thawed

The freeze itself is the cgroup's (``JobCgroup.freeze``/``thaw`` with ``timeout=None`` or 0 on
the loop, :func:`laminar.airlock.cgroups.set_frozen_async` to wait for it without blocking the
loop: a task in uninterruptible sleep freezes only once it wakes).

The holds are kept in the store (meta ``jobs.holds``: {job id: {reason: since, wall clock}}), so
an agent restarted meanwhile finds them before Airlock and migration restore their own state
(Airlock leaves alone a frozen job another component holds). A job that ended loses its holds
(its stop thaws it whatever holds it: a frozen job takes no SIGTERM).

What a release of a reason not held does: nothing, counted (``release_not_held``).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from typing import Any

log = logging.getLogger("laminar.jobs")

HOLDS_META = "jobs.holds"
"""Store meta: {job id: {reason: when it was taken (wall clock)}}."""

LEGACY_FENCE_META = "migrate.fenced"
"""What a version before holds kept of the fenced jobs ({job id: since}): taken as fence holds
once, when the store has no ``jobs.holds`` yet (an upgrade on a node cut off from its zone)."""


class Hold(enum.StrEnum):
    """Why a job is held frozen. One value per component that freezes jobs."""

    AIRLOCK = "airlock"
    """Airlock's suspend rung (memory pressure): released when it recovers or re-addresses the job."""
    MOVE = "move"
    """A move (a reclaim's, a loan return's, Airlock's re-address): from its final checkpoint until
    the job runs elsewhere (stopped here) or the move fails (released), through a hand-over whose
    answer is awaited (settled by its destination's answer or the operator's ``job settle``)."""
    FENCE = "fence"
    """A node cut off from its zone (``migrate.fence_after_s``): until it hears a member again and
    nobody took the job over."""
    MEMBERS = "members"
    """A member of a multi-node job frozen because its job is (the origin's ORDER freeze: another
    member's node suspended its own, issue 33): taken and released only through
    ``JobManager.freeze_member``/``thaw_member``, never by this node's Airlock recovering."""


class Holds:
    """The holds on this node's jobs. ``jobs``: the job manager (``get(job_id)`` gives a job with
    ``cgroup`` and ``active``); ``store``: where the holds survive a restart (None: in memory)."""

    def __init__(self, jobs: Any, store: Any = None) -> None:
        self.jobs = jobs
        self.store = store
        self._held: dict[str, dict[Hold, float]] = {}
        self._given: dict[str, Any] = {}  # job id -> the job last given (see _see)
        self.counts = {"holds": 0, "releases": 0, "thaws": 0, "release_not_held": 0}

    # -- queries --------------------------------------------------------------------------------
    def reasons(self, job_id: str) -> list[str]:
        """The reasons ``job_id`` is held for, sorted (empty: none, or it ended)."""
        self._prune(job_id)
        return sorted(r.value for r in self._held.get(job_id, {}))

    def held(self, job_id: str, reason: Hold | None = None) -> bool:
        """Whether ``job_id`` is held (for ``reason``; None: for any)."""
        self._prune(job_id)
        got = self._held.get(job_id, {})
        return bool(got) if reason is None else reason in got

    def held_by(self, reason: Hold) -> set[str]:
        """The jobs held for ``reason``."""
        return {jid for jid in list(self._held) if self.held(jid, reason)}

    def others(self, job_id: str, reason: Hold) -> list[str]:
        """The reasons other than ``reason`` that hold ``job_id``."""
        return [r for r in self.reasons(job_id) if r != reason.value]

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "held": {jid: self.reasons(jid) for jid in sorted(self._held) if self.reasons(jid)}}

    # -- taking and dropping ----------------------------------------------------------------------
    def hold(self, job: Any, reason: Hold) -> None:
        """Holds ``job`` (a job, or its id) for ``reason`` and asks for the freeze (not waited for) unless one is
        asked for already (another hold's; asked again when something thawed the job under its
        hold). Raises what the cgroup raises (CgroupError: it is gone); the hold is taken all
        the same."""
        job_id = self._see(job)
        cg = self._cgroup(job_id)
        self._add(job_id, reason)
        if cg is not None and not _requested(cg):
            cg.freeze(timeout=None)

    async def hold_wait(self, job: Any, reason: Hold, timeout: float) -> bool:
        """:meth:`hold`, waiting up to ``timeout`` for the kernel to say frozen, off the loop's
        time (:func:`set_frozen_async`). True when frozen, False when not yet (the freeze stays
        asked for: a task in uninterruptible sleep). Raises what the cgroup raises."""
        from ..airlock.cgroups import set_frozen_async

        job_id = self._see(job)
        cg = self._cgroup(job_id)
        self._add(job_id, reason)
        if cg is None:
            return False
        return await set_frozen_async(cg, True, timeout)

    def reattach(self, job: Any, reason: Hold) -> None:
        """Records a hold on a job found frozen for ``reason`` (after a restart, from the
        component's own records); nothing is asked of the kernel."""
        self._add(self._see(job), reason)

    def release(self, job: Any, reason: Hold, timeout: float | None = None) -> bool:
        """Drops ``reason``'s hold on ``job`` (a job, or its id); the last hold gone, thaws it (``timeout``: None,
        asked and not looked at; 0, looked at once; as ``JobCgroup.thaw``). Returns True when it
        was thawed (asked, and with a timeout seen thawed), False when another hold keeps it
        frozen or ``reason`` held it not (a no-op, counted). Raises what the cgroup raises (the
        hold is dropped all the same)."""
        job_id = self._see(job)
        if not self._drop(job_id, reason):
            return False
        if self.held(job_id):
            return False
        cg = self._cgroup(job_id)
        if cg is None:
            return False
        self.counts["thaws"] += 1
        return cg.thaw(timeout=timeout) is not False

    async def release_wait(self, job: Any, reason: Hold, timeout: float) -> bool:
        """:meth:`release`, waiting up to ``timeout`` for the thaw without blocking the loop."""
        from ..airlock.cgroups import set_frozen_async

        job_id = self._see(job)
        if not self._drop(job_id, reason) or self.held(job_id):
            return False
        cg = self._cgroup(job_id)
        if cg is None:
            return False
        self.counts["thaws"] += 1
        return await set_frozen_async(cg, False, timeout)

    def drop(self, job: Any, reason: Hold) -> bool:
        """Forgets ``reason``'s hold without touching the kernel: the job is being stopped frozen
        (another node runs it), or it was found thawed. Returns whether it was held."""
        job_id = self._see(job)
        if reason not in self._held.get(job_id, {}):
            return False
        self._held[job_id].pop(reason)
        if not self._held[job_id]:
            del self._held[job_id]
        self._save()
        return True

    # -- persistence ----------------------------------------------------------------------------
    def load(self) -> None:
        """At start: the holds the previous process left (of jobs still not ended; an upgrade
        from a version before holds: its fenced jobs). Never raises."""
        self._held = {}
        if self.store is None:
            return
        try:
            got = self.store.get_meta(HOLDS_META)
            if got is None:
                legacy = self.store.get_meta(LEGACY_FENCE_META)
                got = {str(k): {Hold.FENCE.value: v} for k, v in legacy.items()} if isinstance(legacy, dict) else {}
        except Exception as e:
            log.warning("jobs: could not read the holds the previous agent left: %s", e)
            return
        if not isinstance(got, dict):
            return
        for jid, rs in got.items():
            if not isinstance(rs, dict):
                continue
            for r, since in rs.items():
                with contextlib.suppress(ValueError):
                    if isinstance(since, (int, float)):
                        self._held.setdefault(str(jid), {})[Hold(r)] = float(since)
        for jid in list(self._held):
            self._prune(jid)

    def _save(self) -> None:
        if self.store is None:
            return
        doc = {jid: {r.value: since for r, since in rs.items()} for jid, rs in self._held.items() if rs}
        try:  # ({} once none is left: the store is past the upgrade from LEGACY_FENCE_META)
            self.store.set_meta(HOLDS_META, doc)
        except Exception as e:  # the hold stands; only its survival across a restart is lost
            log.warning("jobs: could not store the holds: %s", e)

    # -- inside -----------------------------------------------------------------------------------
    def _add(self, job_id: str, reason: Hold) -> bool:
        reason = Hold(reason)
        self.counts["holds"] += 1
        rs = self._held.setdefault(job_id, {})
        if reason in rs:
            return False
        rs[reason] = time.time()
        self._save()
        return True

    def _drop(self, job_id: str, reason: Hold) -> bool:
        self.counts["releases"] += 1
        if not self.drop(job_id, Hold(reason)):
            self.counts["release_not_held"] += 1
            return False
        return True

    def _see(self, job: Any) -> str:
        """The id of ``job`` (a job, or its id); a job given is remembered for a job manager
        with no ``get`` (a unit test's stand-in)."""
        if isinstance(job, str):
            return job
        self._given[job.id] = job
        return str(job.id)

    def _job(self, job_id: str) -> Any:
        get = getattr(self.jobs, "get", None)
        job = get(job_id) if get is not None else None
        return job if job is not None else self._given.get(job_id)

    def _cgroup(self, job_id: str) -> Any:
        job = self._job(job_id)
        return getattr(job, "cgroup", None) if job is not None else None

    def _prune(self, job_id: str) -> None:
        """A job that ended (or that the job manager does not know) holds nothing."""
        if job_id not in self._held:
            return
        job = self._job(job_id)
        if job is None or not getattr(job, "active", True):
            del self._held[job_id]
            self._given.pop(job_id, None)
            self._save()


def _requested(cg: Any) -> bool:
    fn = getattr(cg, "freeze_requested", None)
    if fn is None:
        return False
    try:
        return bool(fn())
    except Exception:
        return False


def holds_of(jobs: Any) -> Holds:
    """The job manager's holds; a stand-in job manager without any (a unit test's) gets a set
    in memory on first use, shared by every component that asks."""
    h = getattr(jobs, "holds", None)
    if isinstance(h, Holds):
        return h
    h = _STAND_IN.get(id(jobs))
    if h is not None and h.jobs is jobs:
        return h
    h = Holds(jobs)
    try:
        jobs.holds = h
    except AttributeError:  # (one that takes no attribute: kept here)
        _STAND_IN[id(jobs)] = h
    return h


_STAND_IN: dict[int, Holds] = {}
