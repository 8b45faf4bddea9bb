"""Airlock: the component that applies the survival ladder to the jobs on this node.

It listens (`airlock.signals`): v1 ``memory.pressure_level`` and ``memory.oom_control``
eventfds or v2 ``memory.events`` on the jobs' budget, PSI triggers on the node and on the
jobs' subtree, the BPF pressure events of the agent's event bus, and a short tick that reads
the budget's usage. On every signal it asks the ladder (`airlock.ladder.decide`, pure) what to
do and does it, lowest survival value first:

- **suspend**: ``cgroup.freeze`` (stops growth; frees nothing);
- **recover**: ``cgroup.thaw``, highest value first, one per step, once calm (hysteresis);
- **re-address**: send the checkpoint signal, then ``agent.migrate.mover.readdress(job)`` when the
  migration layer is present; when it is not, an event says so and the budget runs on;
- **kill**: ``cgroup.kill`` with the work lost (seconds since the last checkpoint) recorded;
- **cut**: a job being stopped (in its grace, e.g. ignoring SIGTERM) is killed under pressure
  before any running job is touched: it ends anyway, and its stop records its end as before.

Every decision is an ``airlock`` event with its reason (``laminarctl events --kind airlock``).

The node's budget (config ``[airlock]``): ``budget_mb`` limits everything under the cgroup root,
``class_budget_mb`` limits each class's parent, and with ``hold_allocator`` (default) the v1
OOM killer is disabled on the root and on the protected classes' parents so that, at the limit,
the kernel makes the allocating task wait while Airlock decides instead of killing by size.
On a v2 host (no oom_kill_disable) ``memory.high`` just below each such limit throttles the
allocator instead (`cgroups.v2_hold_bytes`), and ``memory.events.local`` of the root and of each
class parent tells Airlock, as v1's ``oom_control`` eventfds do. The unprotected
classes' parents are capped so that they can never fill the budget the protected jobs live in
(`Airlock.cap_unprotected`): their storms wait at their own caps, also while the agent is down.

Policy: ``GET/PUT /v1/policy``, ``POST /v1/policy/validate`` (`airlock.policy`). Status:
``GET /v1/airlock``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import select
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar.policy import admission, ladder
from laminar.policy.endcause import EndCause

from ..config import Field, register_section
from ..runtime.holds import Hold, Holds, holds_of
from ..userbounds import UidSlots
from .cgroups import (
    CgroupError,
    CgroupTree,
    parse_keyed,
    read_memory_in_use,
    read_memory_limit,
    read_memory_usage,
    read_memory_waits,
    v2_hold_bytes,
)
from .policy import Policy, PolicyError, PolicyStore
from .signals import PriPoller, PsiTrigger, V1Eventfd, mem_available, psi_window, read_psi

if TYPE_CHECKING:
    from ..components import AirlockAgent, MemberInfo, MembersForAirlock

log = logging.getLogger("laminar.airlock")

# A fresh tick reads usage and PSI averages between event wake-ups. 50 ms: memory grows by
# at most a few hundred MiB in that time; the event sources (eventfd, PSI, BPF) wake us sooner.
TICK_S = 0.05
# Policy texts a user may have parsed at once (POST /v1/policy/validate with {"text": ...}: each
# is a child process, policy.parse_bounded), and all users together; past it 429 at once.
POLICY_PARSES_PER_UID = 1
POLICY_PARSES_ALL_USERS = 4
# The tick while no job runs: only keeps PSI triggers and caps in step (footprint of an idle node).
IDLE_TICK_S = 1.0
# Edge signals (a PSI trigger, a memory reclaim tracepoint, pressure_level medium) count as "stall
# now" for this long; critical ones (oom_control, pressure_level critical) likewise.
STALL_HOLD_S = 0.2
# At most one evaluation per this interval (a storm raises thousands of tracepoint events).
MIN_EVAL_GAP_S = 0.005
# Room kept for the protected classes above what they use now: the budget's share above the
# policy's usage.critical, and at least this much. v1's oom_kill_disable holds page faults at
# a full budget, but kernel-side charges (the page cache of a log or checkpoint write, socket
# buffers, a new cgroup) fail with ENOMEM instead: a protected job must never meet a full
# budget because transients filled it (e.g. while the agent restarts).
PROTECTED_HEADROOM_MIN = 16 << 20
# A class cap is rewritten only when it moves by more than this (cgroupfs writes every tick
# would be churn; 4 MiB is a few ms of growth in a storm).
CAP_SLACK_BYTES = 4 << 20


def _class_budgets(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "must be a table of class = MiB"
    for k, mb in v.items():
        if k not in ("long-resident", "standard", "transient"):
            return f"unknown class {k!r}; classes are long-resident, standard, transient"
        if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
            return f"{k} = {mb!r}: expected MiB as an integer > 0"
    return None


CONFIG_FIELDS = {
    "budget_mb": Field(int, 0, "memory budget of all jobs on this node in MiB (0: none)",
                       lambda v: None if v >= 0 else "must be >= 0"),
    "class_budget_mb": Field(dict, {}, "per-class memory budgets in MiB, e.g. {transient = 2048}", _class_budgets),
    "hold_allocator": Field(bool, True, "on v1, disable the kernel OOM killer on the budget so tasks wait while "
                                        "Airlock decides"),
}
register_section("airlock", CONFIG_FIELDS)

# Each job's rung survives an agent restart (crash or upgrade): without it a job frozen by the
# previous process would look "running" to the new one, never be recovered and never escalate.
# `since` is wall time (monotonic clocks do not survive a restart).
RUNG_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS airlock_rungs (
        job_id TEXT PRIMARY KEY,
        rung TEXT NOT NULL,
        since REAL NOT NULL,
        hops INTEGER NOT NULL,
        reason TEXT NOT NULL)""",
]

# BPF pressure event types (bpf/laminar.h LM_EV_*)
EV_DIRECT_RECLAIM_BEGIN, EV_MEMCG_RECLAIM_BEGIN, EV_OOM_VICTIM = 1, 3, 5


class Airlock:
    """The Airlock component (``agent.airlock``). Standalone use (tests, benchmarks)::

        al = Airlock(jobs=job_manager, store=store, events=bus, budget_mb=1024)
        await al.start(None)
    """

    agent_attr = "airlock"
    status_key = "airlock"

    def __init__(self, *, jobs: Any = None, store: Any = None, events: Any = None, budget_mb: int | None = None,
                 class_budget_mb: dict[str, int] | None = None, hold_allocator: bool = True,
                 policy: dict[str, Any] | None = None, migrate: Any = None, tick_s: float = TICK_S,
                 members: MembersForAirlock | None = None) -> None:
        self.agent: AirlockAgent | None = None  # what Airlock reads of it: laminar.components
        self.jobs = jobs
        self.store = store
        self.events = events
        self.budget_mb = budget_mb
        self.class_budget_mb = class_budget_mb or {}
        self.hold_allocator = hold_allocator
        self._initial_policy = policy
        self.migrate = migrate
        # the members of multi-node jobs (None: the agent's ``members``, read when needed: that
        # component may start after this one; neither: every job is a job of this node alone)
        self._members = members
        self._parses = UidSlots("policy texts being parsed", POLICY_PARSES_PER_UID, POLICY_PARSES_ALL_USERS,
                                "uid_policy_parses")
        self.tick_s = tick_s
        self.policy: Policy | None = None
        self.policies: PolicyStore | None = None
        self.tree: CgroupTree | None = None
        self.memo = ladder.Memo()
        self.rungs: dict[str, tuple[str, float, int]] = {}  # job id -> (rung, since, hops)
        self.level = ladder.NONE
        self.last_stall = float("-inf")
        self.last_critical = float("-inf")
        self.episode_start: float | None = None  # first signal of the current pressure episode
        self.reactions_ms: deque[float] = deque(maxlen=1000)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=200)
        self.psi_note = ""
        self.sources: list[str] = []
        self._poller: PriPoller | None = None
        self._closers: list[Any] = []
        self._task: asyncio.Task[None] | None = None
        self._pending = False
        self._timer: asyncio.TimerHandle | None = None
        self._last_eval = 0.0
        self._unsub: Any = None
        self._job_triggers: dict[str, PsiTrigger] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self._caps: dict[str, int] = {}  # unprotected class -> cap in force (bytes)
        self._held: set[str] = set()  # protected classes waiting at their own class budget
        self._scoped: set[str] = set()  # unprotected classes waiting at their own class budget
        self._class_oom: dict[str, float] = {}  # class -> when its oom_control eventfd last fired
        self._v2_counts: dict[int, dict[str, int]] = {}  # memory.events fd -> its counters last read

    # -- component life ------------------------------------------------------------------------
    async def start(self, agent: AirlockAgent | None) -> None:
        self.agent = agent
        self.loop = asyncio.get_running_loop()
        if agent is not None:
            self.jobs = self.jobs or agent.jobs
            self.store = self.store or agent.store
            self.events = self.events or agent.events
            self.migrate = self.migrate or agent.migrate
            cfg = agent.config.section("airlock")
            if cfg:
                self.budget_mb = cfg.get("budget_mb") or None
                self.class_budget_mb = dict(cfg.get("class_budget_mb") or {})
                self.hold_allocator = bool(cfg.get("hold_allocator", True))
        if self.jobs is None or self.jobs.tree is None:
            raise RuntimeError("Airlock needs the jobs component (laminar.runtime.jobs.JobManager) started first")
        self.tree = self.jobs.tree
        self.policies = PolicyStore(self.store)
        if self._initial_policy is not None:
            self.policy = self.policies.set(self._initial_policy)
        else:
            self.policy = self.policies.current()
        self.store.ensure_schema("airlock_rungs", RUNG_SCHEMA)
        with self.store.tx() as db:  # a store written before the last rung was called ``kill``
            db.execute("UPDATE airlock_rungs SET rung=? WHERE rung='reclaim'", (ladder.KILL,))
        self._apply_budget()
        self._restore_rungs()
        # Admission by class capacity: the job runtime asks us for the caps in force (and starts
        # what fits at once, e.g. jobs left queued by the previous process).
        if hasattr(self.jobs, "set_admission"):
            self.jobs.set_admission(self._limits_for_admission)
        self._open_sources()
        if self.events is not None and hasattr(self.events, "subscribe"):
            self._unsub = self.events.subscribe(self._on_event)
        self._task = self.loop.create_task(self._ticker())
        self._emit(f"airlock started: policy v{self.policy.version}; budget "
                   f"{self.budget_mb or 'none'} MiB; {self.psi_note}; sources: {', '.join(self.sources)}",
                   policy_version=self.policy.version, budget_mb=self.budget_mb, sources=self.sources)

    async def stop(self) -> None:
        """Stops watching and acting: the ticker, a pending evaluation, the event subscription and
        every pressure source (closed). Idempotent: each thing is let go of once, so a second
        call does nothing, and so does a call after a start that failed part-way (or never ran)
        for what that start had not taken yet."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.loop = None
        unsub, self._unsub = self._unsub, None
        if unsub is not None:
            unsub()
        poller, self._poller = self._poller, None
        if poller is not None:
            asyncio.get_running_loop().remove_reader(poller.fileno())
            poller.close()
        for c in self._closers + list(self._job_triggers.values()):
            try:
                c.close()
            except OSError:
                pass
        self._closers.clear()
        self._job_triggers.clear()

    def release_for_unload(self) -> list[str]:
        """``laminarctl bpf unload``, before the agent's cgroups are removed and the agent stops:
        Airlock stops watching and acting (no source, no tick, no evaluation: the removal of a
        v1 memory cgroup signals its eventfds), lifts its memory holds (`_release_holds`) and
        releases its hold on each job it holds suspended (thawed unless another component holds
        it too: runtime/holds.py), since the docs promise jobs keep running after an unload and
        no agent will be there to recover them. A job frozen by a move or a fence is the
        migration layer's and stays as it is.

        Returns the ids of the jobs thawed."""
        if self._task:
            self._task.cancel()
        if self._timer is not None:
            self._timer.cancel()
        self._pending = True  # schedule() arms no evaluation from now on
        if self._poller is not None and self.loop is not None:
            self.loop.remove_reader(self._poller.fileno())
        for c in self._closers + list(self._job_triggers.values()):
            if self._poller is not None:
                self._poller.remove(c.fileno())
            try:
                c.close()
            except OSError:
                pass
        self._closers.clear()
        self._job_triggers.clear()
        self._release_holds()
        thawed: list[str] = []
        for jid, (rung, _, _) in list(self.rungs.items()):
            job = self.jobs.get(jid) if self.jobs is not None else None
            if rung != ladder.SUSPEND or job is None or not job.active:
                continue
            try:
                self._holds().reattach(jid, Hold.AIRLOCK)  # (a suspend rung is Airlock's hold)
                released = self._holds().release(jid, Hold.AIRLOCK)
            except CgroupError as e:
                self._emit(f"airlock: cannot thaw {jid} for bpf unload: {e}", job=jid, error=str(e))
                continue
            self._drop_rung(jid)
            if not released:  # another component holds it frozen (a move, a fence): theirs
                continue
            self.jobs.set_state(job, "running", "airlock: thawed: the data plane was unloaded")
            thawed.append(jid)
        if thawed:
            self._emit(f"airlock: thawed {', '.join(thawed)}: the data plane was unloaded and no agent will "
                       "recover them", jobs=thawed)
        return thawed

    def _release_holds(self) -> None:
        """For ``bpf unload``: lift what only a running Airlock makes safe. On v1 the root and
        the classes hold a task at their limit (oom_kill_disable) until Airlock decides, and
        `cap_unprotected` caps each unprotected class at what its last tick saw; with no agent
        left, a job reaching either would wait there for good. The operator's budget_mb and
        class_budget_mb stay as limits, enforced by the kernel's OOM killer."""
        if self.tree is None:
            return
        for problem in release_holds(self.tree, self.budget_mb, self.class_budget_mb):
            self._emit(f"airlock: {problem}", error=problem)
        self._caps.clear()

    def resume_after_failed_unload(self) -> None:
        """An unload that failed leaves the agent running: Airlock watches and acts again (its
        sources reopened, the ticker restarted; job triggers come back at the next sync; the
        budget, holds and class caps written again)."""
        if self.loop is None or self.tree is None:
            return
        if self._poller is not None:
            self._poller.close()
        self._pending = False
        self.sources.clear()
        if self.policy is not None:
            self._apply_budget()
        self._open_sources()
        self._task = self.loop.create_task(self._ticker())

    def members(self) -> MembersForAirlock | None:
        """The members component (``agent.members``), or None where there is none."""
        if self._members is not None:
            return self._members
        return self.agent.members if self.agent is not None else None

    def _member(self, job_id: str) -> MemberInfo | None:
        members = self.members()
        return members.member_of(job_id) if members is not None else None

    def _tell_members(self, job_id: str, action: str, work_lost_s: float | None = None) -> None:
        """A member of a multi-node job was suspended, recovered or killed here: its job's other
        members follow through its origin (the members component decides). Never raises."""
        members = self.members()
        if members is None or members.member_of(job_id) is None:
            return
        try:
            members.on_airlock(job_id, action, work_lost_s)
        except Exception:
            log.exception("airlock: telling the members component of %s %s failed", action, job_id)

    def _holds(self) -> Holds:
        """The job manager's holds (runtime/holds.py): Airlock's suspend is its ``airlock`` hold."""
        return holds_of(self.jobs)

    # -- rungs (persisted) -------------------------------------------------------------------------
    def _set_rung(self, job_id: str, rung: str, since: float, hops: int, reason: str) -> None:
        """Record a job's rung in memory and in the store (`since` is monotonic)."""
        self.rungs[job_id] = (rung, since, hops)
        wall = time.time() - (time.monotonic() - since)
        try:
            with self.store.tx() as db:
                db.execute("INSERT INTO airlock_rungs(job_id, rung, since, hops, reason) VALUES(?, ?, ?, ?, ?) "
                           "ON CONFLICT(job_id) DO UPDATE SET rung=excluded.rung, since=excluded.since, "
                           "hops=excluded.hops, reason=excluded.reason", (job_id, rung, wall, hops, reason))
        except Exception as e:  # the decision stands; only its survival across a restart is lost
            log.warning("airlock: could not store the rung of %s: %s", job_id, e)

    def _drop_rung(self, job_id: str) -> None:
        self.rungs.pop(job_id, None)
        try:
            with self.store.tx() as db:
                db.execute("DELETE FROM airlock_rungs WHERE job_id=?", (job_id,))
        except Exception as e:
            log.warning("airlock: could not drop the rung of %s: %s", job_id, e)

    def _restore_rungs(self) -> None:
        """After a restart: take over the rungs the previous process left, with the kernel as
        the truth about suspension: frozen, or a freeze requested that has not taken hold yet
        (a task waiting at the held budget freezes once its wait ends).

        - a stored suspend/readdress rung of an active job continues with its original start
          time, so its budget is not reset by a restart;
        - a frozen job with no stored rung (the agent died between freeze and store) is
          suspended as of now, but for one another component holds (a move, a fence: the holds
          the job manager restored, runtime/holds.py), which is that component's to settle;
        - a stored suspend rung of a job that is no longer frozen is dropped;
        - a stored readdress rung of a frozen job (frozen by a migration move that died with
          the previous process) becomes a suspend rung with the same start, so it is thawed
          once calm instead of staying frozen for good (Airlock's hold, unless the move's hold
          is still there: the migration layer settles that move, and thaws the job);
        - a stored kill rung: the kill is finished (a job still alive is killed again) and
          a job the job manager found gone while the agent was down is recorded as killed
          with the stored reason and the work lost, not as lost.
        The ladder then holds off recovery for ``hold_s`` as if pressure had just been seen."""
        assert self.store is not None and self.jobs is not None
        holds = self._holds()
        now, wall = time.monotonic(), time.time()
        rows = self.store.db.execute("SELECT job_id, rung, since, hops, reason FROM airlock_rungs").fetchall()
        stored = {r[0]: (r[1], float(r[2]), int(r[3]), r[4]) for r in rows}
        active = {j.id: j for j in self.jobs.active()}
        for jid, (rung, since_wall, hops, reason) in stored.items():
            job = active.get(jid)
            since = now - max(0.0, wall - since_wall)
            if rung == ladder.KILL:
                self._drop_rung(jid)
                if job is not None:
                    self._set_rung(jid, ladder.KILL, now, hops, reason)
                    lost = job.work_at_risk_s()
                    try:
                        job.cgroup.kill()
                    except CgroupError as e:
                        log.warning("airlock: re-kill %s: %s", jid, e)
                    self._spawn(self._finish_kill(jid, reason, lost))
                    self._emit(f"airlock: kill of {jid} interrupted by a restart; finishing it: {reason}",
                               job=jid, reattached_rung=rung)
                    continue
                old = self.jobs.get(jid)
                if old is not None and old.state == "lost":
                    self.jobs.set_state(old, "killed", f"airlock killed: {reason}", EndCause.AIRLOCK_KILL)
                    self._emit(f"airlock: {jid} was killed as the agent went down: {reason}", job=jid,
                               reattached_rung=rung)
                continue
            if job is None:
                self._drop_rung(jid)
                continue
            try:
                # requested counts: a task waiting at the held budget freezes once its wait ends
                frozen = job.cgroup.frozen() or job.cgroup.freeze_requested()
            except CgroupError:
                frozen = False
            if rung == ladder.SUSPEND and not frozen:
                self._drop_rung(jid)
                holds.drop(jid, Hold.AIRLOCK)
                self.jobs.set_state(job, "running", "airlock: found thawed after a restart")
                continue
            if rung == ladder.READDRESS and frozen:
                # Re-addressing thaws; a freeze now is a move's (the migration layer freezes for its
                # transfer), and that move died with the previous process: nothing else would ever
                # thaw the job. It is suspended as of its rung's start: recovered once calm, else
                # escalated like any suspended job.
                self._set_rung(jid, ladder.SUSPEND, since, hops, "frozen by a move a restart ended")
                if not holds.held(jid):
                    holds.reattach(jid, Hold.AIRLOCK)
                self.jobs.set_state(job, "suspended", "airlock: frozen by a move that a restart ended")
                self._emit(f"airlock: {jid} was being moved (frozen) when the agent went down; suspended, "
                           "to be recovered once calm", job=jid, reattached_rung=ladder.SUSPEND, hops=hops)
                continue
            self.rungs[jid] = (rung, since, hops)
            if rung == ladder.SUSPEND:
                holds.reattach(jid, Hold.AIRLOCK)
            if rung == ladder.SUSPEND and job.state != "suspended":
                self.jobs.set_state(job, "suspended", "airlock: suspended (freeze pending) when the agent started")
            self._emit(f"airlock: {jid} taken over at rung {rung} (for {now - since:.1f} s, {hops} hops) "
                       "after a restart", job=jid, reattached_rung=rung, for_s=round(now - since, 2), hops=hops)
        for jid, job in active.items():
            if jid in self.rungs or holds.others(jid, Hold.AIRLOCK):
                continue
            try:
                frozen = job.cgroup.frozen() or job.cgroup.freeze_requested()
            except CgroupError:
                continue
            if frozen:
                holds.reattach(jid, Hold.AIRLOCK)
                self._set_rung(jid, ladder.SUSPEND, now, 0, "frozen when the agent started")
                self.jobs.set_state(job, "suspended", "airlock: found frozen after a restart")
                self._emit(f"airlock: {jid} found frozen with no recorded rung; suspended as of now", job=jid,
                           reattached_rung=ladder.SUSPEND)
        if any(r[0] in (ladder.SUSPEND, ladder.READDRESS) for r in self.rungs.values()):
            self.memo.last_pressure = now

    def _spawn(self, coro: Any) -> None:
        assert self.loop is not None
        task = self.loop.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # -- budget and sources ----------------------------------------------------------------------
    def _root_memory_dir(self) -> Path:
        assert self.tree is not None
        h = self.tree.hierarchy
        return (h.unified if h.memory_in_v2 else h.v1["memory"]) / self.tree.root_name

    def _capped_classes(self) -> list[str]:
        """The classes `cap_unprotected` caps under the budget and policy in force."""
        if not self.budget_mb or self.tree is None or self.policy is None:
            return []
        prot = set(self.policy["protected"])
        unprot = [c for c in self.tree.classes if c not in prot]
        return unprot if len(unprot) < len(self.tree.classes) else []

    def _apply_budget(self) -> None:
        """Write the memory settings of the root and of every class parent to exactly what the
        config and the policy in force say, including "none": the kernel keeps what an earlier
        process wrote (a budget since removed from the config, a class budget, oom_kill_disable
        under a hold_allocator since turned off, a class cap of a class since protected), and a
        setting left there would hold jobs at a limit nobody asked for."""
        assert self.tree is not None and self.policy is not None
        prot = set(self.policy["protected"])
        capped = self._capped_classes()
        try:
            if self.budget_mb:
                # v2: with hold_allocator, memory.high just below the budget (cgroups.v2_hold_bytes)
                self.tree.set_root_memory(self.budget_mb << 20, oom_kill_disable=self.hold_allocator)
            else:
                self.tree.set_root_memory(None, oom_kill_disable=False)
        except (CgroupError, OSError) as e:
            self._emit(f"airlock: could not apply the node budget: {e}", error=str(e))
        for cls in self.tree.classes:
            if cls in capped:
                continue  # cap_unprotected writes it below
            self._caps.pop(cls, None)
            mb = self.class_budget_mb.get(cls)
            hold = self.hold_allocator and cls in prot
            try:
                if hold and mb and self.tree.hierarchy.memory_in_v2:
                    # v2 cannot hold a task at memory.max (the charge fails: OOM kill), and above
                    # memory.high it only slows down: a protected class is throttled at its
                    # budget and never killed by it (the node's budget stays the hard limit)
                    self.tree.set_class_memory(cls, None, high_bytes=mb << 20)
                else:
                    self.tree.set_class_memory(cls, (mb << 20) if mb else None, oom_kill_disable=hold)
            except CgroupError as e:
                self._emit(f"airlock: could not apply the {cls} class's budget: {e}", error=str(e))
        self.cap_unprotected()

    def cap_unprotected(self) -> dict[str, int]:
        """Keep the protected classes' memory out of the other classes' reach.

        With a node budget and at least one protected class, each unprotected class parent is
        limited to what it uses now plus the budget's free room, where the free room leaves
        the protected classes their usage plus a reserve (usage: memory in use, clean page
        cache not counted; a cap is never written below the class's charge) (the budget above the policy's
        ``usage.critical``, at least `PROTECTED_HEADROOM_MIN`). A storm from one class
        fills its own cap (where, with `hold_allocator`, its tasks wait and Airlock is told
        through the class's oom_control eventfd) and never the budget the protected jobs live
        in, also while the agent is down (the caps stay). Two unprotected classes growing at
        the same moment may together take one free room more than that; then the held root
        budget is the last line, as without caps. (An even split of the free room would close
        that gap but halve the room of the one class that storms while the others idle.)
        Called at start and on every tick; an operator `class_budget_mb` still bounds its
        class. Returns the caps now in force (bytes)."""
        if not self.budget_mb or self.tree is None or self.policy is None:
            return {}
        prot = [c for c in self.tree.classes if c in set(self.policy["protected"])]
        unprot = [c for c in self.tree.classes if c not in prot]
        if not prot or not unprot:
            return {}
        h = self.tree.hierarchy
        budget = self.budget_mb << 20
        try:
            charged = {c: read_memory_usage(h, self.tree.class_memory_dir(c)) for c in self.tree.classes}
            # memory in use: clean page cache is dropped on demand (a protected job reading its
            # data set fills the budget with it) and must not take the other classes' room
            usage = {c: read_memory_in_use(h, self.tree.class_memory_dir(c)) for c in self.tree.classes}
        except (CgroupError, ValueError):
            return dict(self._caps)
        reserve = max(PROTECTED_HEADROOM_MIN, int(budget * (1 - self.policy["thresholds"]["usage.critical"])))
        room = budget - sum(usage[c] for c in prot) - reserve
        share = max(0, room - sum(usage[c] for c in unprot))
        for c in unprot:
            # never below the class's charge: a v1 limit written under it reclaims synchronously
            # (in the agent's loop); its own cache is then dropped as it grows, at its cap
            cap = max(usage[c] + share, charged[c], 1 << 20)
            op = self.class_budget_mb.get(c)
            if op:
                cap = min(cap, op << 20)
            if abs(cap - self._caps.get(c, -(1 << 62))) <= CAP_SLACK_BYTES:
                continue
            try:
                if h.memory_in_v2:  # no oom_kill_disable in v2: memory.high throttles instead,
                    # below the class budget's memory.max (at it, the charge fails first: OOM kill)
                    high = min(cap, v2_hold_bytes(op << 20)) if op and self.hold_allocator else cap
                    self.tree.set_class_memory(c, (op << 20) if op else None, high_bytes=high)
                else:
                    self.tree.set_class_memory(c, cap, oom_kill_disable=self.hold_allocator)
                self._caps[c] = cap
            except CgroupError as e:  # e.g. EBUSY: usage grew past the cap we asked for; next tick
                log.debug("airlock: cap %s at %d MiB: %s", c, cap >> 20, e)
        return dict(self._caps)

    def _open_sources(self) -> None:
        assert self.loop is not None and self.tree is not None
        self._poller = PriPoller()
        window, self.psi_note = psi_window()
        mem_root = self._root_memory_dir()
        h = self.tree.hierarchy
        try:
            t = PsiTrigger("/proc/pressure/memory", window)
            self._poller.add(t.fileno(), "psi:node")
            self._closers.append(t)
            self.sources.append("psi node")
        except OSError as e:
            self._emit(f"airlock: node PSI trigger unavailable: {e}")
        try:
            t = PsiTrigger(h.unified / self.tree.root_name / "memory.pressure", window)
            self._poller.add(t.fileno(), "psi:jobs")
            self._closers.append(t)
            self.sources.append("psi jobs")
        except OSError as e:
            self._emit(f"airlock: jobs PSI trigger unavailable: {e}")
        if not h.memory_in_v2:
            dirs = [("root", mem_root)] + [(c, self.tree.class_memory_dir(c)) for c in self.tree.classes]
            for tag, d in dirs:
                for target, level in (("oom_control", None), ("pressure_level", "medium"), ("pressure_level", "critical")):
                    if tag != "root" and target == "pressure_level":
                        continue
                    try:
                        ev = V1Eventfd(d, target, level)
                    except OSError as e:
                        self._emit(f"airlock: {e}")
                        continue
                    self._poller.add(ev.fileno(), f"v1:{target}:{level or ''}:{tag}", pri=False)
                    self._closers.append(ev)
            self.sources.append("v1 oom_control + pressure_level eventfds")
        else:
            # memory.events.local of the budget and of each class parent (local: memory.events
            # also counts every descendant, and a job at its own --memory is no pressure on the
            # budget): the kernel notifies (POLLPRI, with POLLERR: kernfs) when a counter moves;
            # `high` moves while a task is throttled at that level's memory.high, v2's hold at a
            # limit (what v1's oom_control eventfds say)
            dirs = [("root", mem_root)] + [(c, self.tree.class_memory_dir(c)) for c in self.tree.classes]
            opened = 0
            for tag, d in dirs:
                try:
                    fd = os.open(d / "memory.events.local", os.O_RDONLY)
                except OSError as e:
                    self._emit(f"airlock: {d / 'memory.events.local'} unavailable: {e}")
                    continue
                self._poller.add(fd, f"v2events:{tag}")
                self._closers.append(_Fd(fd))
                self._v2_counts[fd] = _events_of(fd)
                opened += 1
            if opened:
                self.sources.append("v2 memory.events")
        self.sources.append("bpf pressure events")
        self.loop.add_reader(self._poller.fileno(), self._on_poller)

    def _on_poller(self) -> None:
        assert self._poller is not None
        now = time.monotonic()
        signalled = False
        for fd, tag, mask in self._poller.ready_events():
            if tag.startswith("v2events:"):
                # kernfs reports every change of memory.events as POLLPRI|POLLERR, and a removed
                # cgroup the same way: only the read tells them apart (it fails on a removed one)
                try:
                    counts = _events_of(fd)
                except OSError:
                    self._drop_source(fd, tag)
                    continue
                before = self._v2_counts.get(fd, {})
                self._v2_counts[fd] = counts
                moved = {k for k, v in counts.items() if v != before.get(k, 0)}
                if not moved:
                    continue
                # A wake-up, not a verdict: `high` and `max` also move while the kernel drops
                # clean page cache at that limit, which holds nobody. Whether a task waits there
                # is the evaluation's to read (`read_memory_waits`: memory in use at memory.high).
                signalled = True
                if tag == "v2events:root" and moved & {"oom", "oom_kill", "oom_group_kill"}:
                    self.last_critical = now  # the kernel's OOM killer acted at the budget
                continue
            if mask & select.EPOLLERR:
                # The cgroup behind the file is gone (a job that ended before the next sync):
                # not a stall, and level-triggered epoll would repeat it every loop round.
                self._drop_source(fd, tag)
                continue
            if tag.startswith("v1:"):
                ev = next((c for c in self._closers if isinstance(c, V1Eventfd) and c.fileno() == fd), None)
                if ev is not None:
                    ev.drain()
                    if ev.cgroup_gone():
                        # the kernel signals a v1 memcg's eventfds as it removes the cgroup (bpf
                        # unload removes the empty class cgroups): a removal, not pressure
                        self._drop_source(fd, tag, why="its cgroup was removed")
                        continue
                where = tag.rsplit(":", 1)[-1]
                if "oom_control" in tag and where != "root":
                    # a class parent's limit: whose jobs can lift it is for signals() to say
                    if where in self._protected():
                        continue  # a protected class at its own class budget: see signals()
                    self._class_oom[where] = now
                    signalled = True
                    continue
                signalled = True
                if "oom_control" in tag or "critical" in tag:
                    self.last_critical = now
                else:
                    self.last_stall = now
            else:  # PSI trigger
                signalled = True
                self.last_stall = now
        if not signalled:
            return
        self._note_signal(now)
        self.schedule()

    def _drop_source(self, fd: int, tag: str, why: str = "") -> None:
        """Stops watching a source whose file reports an error (its cgroup was removed)."""
        assert self._poller is not None
        self._poller.remove(fd)
        self._v2_counts.pop(fd, None)
        if tag.startswith("psi:job:"):
            t = self._job_triggers.pop(tag[len("psi:job:"):], None)
            if t is not None:
                t.close()
            return
        for c in list(self._closers):
            if c.fileno() == fd:
                self._closers.remove(c)
                try:
                    c.close()
                except OSError:
                    pass
        if why:
            log.info("airlock: pressure source %s no longer watched: %s", tag, why)
            return
        log.warning("airlock: pressure source %s reports an error (its cgroup is gone); no longer watched", tag)

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") != "pressure":
            return
        typ = event.get("type")
        now = time.monotonic()
        cg = event.get("cgroup_id")
        ours = self.jobs is not None and any(j.cgroup_id == cg for j in (*self.jobs.active(), *self._stopping()))
        if typ in (EV_MEMCG_RECLAIM_BEGIN, "memcg_reclaim_begin") and ours:
            self.last_stall = now
        elif typ in (EV_DIRECT_RECLAIM_BEGIN, "direct_reclaim_begin"):
            self.last_stall = now
        elif typ in (EV_OOM_VICTIM, "oom_victim"):
            # An OOM kill in a cgroup that is not ours (another memcg at its own limit) says
            # nothing about this node's job budget: at most a stall, never "critical".
            if not ours:
                self.last_stall = now
            else:
                self.last_critical = now
            if ours:
                self._emit(f"airlock: the kernel chose pid {event.get('pid')} of a job as OOM victim (cgroup {cg})",
                           level="critical", pid=event.get("pid"), cgroup_id=cg)
        else:
            return
        self._note_signal(now)
        self.schedule()

    def _note_signal(self, now: float) -> None:
        if self.episode_start is None:
            self.episode_start = now

    def sync_job_triggers(self) -> None:
        """A PSI trigger on each active job's memory.pressure (opened/closed as jobs come and go)."""
        if self._poller is None or self.jobs is None:
            return
        window, _ = psi_window()
        active = {j.id: j for j in self.jobs.active()}
        for jid in list(self._job_triggers):
            if jid not in active:
                t = self._job_triggers.pop(jid)
                self._poller.remove(t.fileno())
                t.close()
        for jid, j in active.items():
            if jid not in self._job_triggers:
                try:
                    t = PsiTrigger(j.cgroup.memory_pressure_path, window)
                except OSError:
                    continue
                self._job_triggers[jid] = t
                self._poller.add(t.fileno(), f"psi:job:{jid}")

    # -- evaluation --------------------------------------------------------------------------------
    def schedule(self) -> None:
        """Evaluate soon (coalesced: at most one evaluation per MIN_EVAL_GAP_S)."""
        if self._pending or self.loop is None:
            return
        self._pending = True
        delay = max(0.0, self._last_eval + MIN_EVAL_GAP_S - time.monotonic())
        self._timer = self.loop.call_later(delay, self._run_eval)

    def _run_eval(self) -> None:
        self._pending = False
        try:
            self.evaluate()
        except Exception:
            log.exception("airlock: evaluation failed")

    async def _ticker(self) -> None:
        last_sync = time.monotonic()
        while True:
            # With no job to protect there is nothing to read every 50 ms: tick once a second
            # (a job's submission or any pressure signal schedules an evaluation at once).
            idle = self.jobs is None or not (self.jobs.active() or self._stopping())
            await asyncio.sleep(IDLE_TICK_S if idle else self.tick_s)
            if time.monotonic() - last_sync >= 1.0:
                last_sync = time.monotonic()
                self.sync_job_triggers()
            try:
                self.cap_unprotected()
            except Exception:
                log.exception("airlock: capping the unprotected classes failed")
            self.schedule()

    def usage(self, charged: bool = False) -> float | None:
        """Share of the node's job budget in use (the root's usage less its clean page cache,
        `read_memory_in_use`, over its limit; with `charged` the plain usage, cache
        included), or, with no budget, the share of the machine's memory not available."""
        assert self.tree is not None
        d = self._root_memory_dir()
        h = self.tree.hierarchy
        try:
            limit = read_memory_limit(h, d)
            if limit:
                return (read_memory_usage(h, d) if charged else read_memory_in_use(h, d)) / limit
        except (CgroupError, ValueError):
            pass
        avail, total = mem_available()
        return 1 - avail / total if total else None

    def signals(self, now: float) -> ladder.Signals:
        assert self.tree is not None
        some, full = read_psi(self.tree.hierarchy.unified / self.tree.root_name / "memory.pressure")
        under_oom = False
        held: set[str] = set()
        scoped: set[str] = set()
        # A task waits at a limit (v1 under_oom, v2 throttled at memory.high: read_memory_waits;
        # or a class's oom_control / memory.events fired just now). At the root (the budget) or
        # at a class cap that follows the budget's free room, acting on any job lifts it. At a
        # class's own class budget only that class's jobs can (`scoped`), and a protected class
        # held there none: its jobs are never acted on (`held`). A protected class with no budget
        # of its own waits at the node budget's limit, which acting on other jobs lifts.
        prot = self._protected()
        h = self.tree.hierarchy
        root_waits = False
        for name, d in [("", self._root_memory_dir()),
                        *((c, self.tree.class_memory_dir(c)) for c in self.tree.classes)]:
            try:
                waits = read_memory_waits(h, d)
            except (CgroupError, OSError, ValueError):
                waits = False
            if name and now - self._class_oom.get(name, float("-inf")) < STALL_HOLD_S:
                waits = True
            if not waits:
                continue
            if not name:
                root_waits = True
            own = bool(name) and self._at_own_budget(name)
            if name in prot and (root_waits or own):
                # v1 marks every class under a full budget as waiting too, and its oom eventfd
                # fires down the tree: only a class whose limit in force is its own is held there
                if not root_waits:
                    held.add(name)
            elif own:
                scoped.add(name)
            else:
                under_oom = True
        self._note_held(held)
        self._scoped = scoped
        avail, total = mem_available()
        return ladder.Signals(usage=self.usage(), psi_some=some, psi_full=full, under_oom=under_oom,
                              critical_event=now - self.last_critical < STALL_HOLD_S,
                              stall_event=now - self.last_stall < STALL_HOLD_S,
                              node_usage=1 - avail / total if total else None, charged=self.usage(charged=True))

    def _at_own_budget(self, cls: str) -> bool:
        """True when the limit in force on class `cls` is its own class budget (config
        ``class_budget_mb``), not a cap that follows the budget's free room."""
        op = self.class_budget_mb.get(cls)
        if not op:
            return False
        return self._caps.get(cls, op << 20) >= op << 20

    def _protected(self) -> set[str]:
        return set(self.policy["protected"]) if self.policy is not None else set()

    def _note_held(self, held: set[str]) -> None:
        """Says once per hold which protected classes wait at their own class budget."""
        for c in sorted(held - self._held):
            mb = self.class_budget_mb.get(c)
            self._emit(f"airlock: protected class {c} waits at its own memory limit (class_budget_mb "
                       f"{mb if mb else '?'} MiB): Airlock never acts on protected jobs and no other job's memory "
                       f"counts under that limit, so nothing is suspended or killed for it; raise "
                       f"[airlock] class_budget_mb.{c} or stop one of its jobs", held_class=c, class_budget_mb=mb)
        self._held = held

    def moving(self) -> set[str]:
        """Jobs the migration layer is moving now (``agent.migrate.evacuating``): the move's, not
        Airlock's. A thaw mid-move would run the job here past the checkpoint the destination
        resumes from (two copies at once), a kill would record it killed while it resumes
        elsewhere; its memory leaves with it. A move that fails gives it back."""
        mig = self.agent.migrate if self.agent is not None else None
        # and those a fence holds (fence.py): a kill would end a job the zone may resume
        # elsewhere (Airlock's own thaw no longer could run it: the fence's hold keeps it frozen)
        return (set(mig.evacuating) if mig is not None else set()) | self._holds().held_by(Hold.FENCE)

    def _stopping(self) -> list[Any]:
        """Jobs being stopped (SIGTERM sent, in their grace; `JobManager.stopping`), but for
        those Airlock kills itself (already killed)."""
        fn = getattr(self.jobs, "stopping", None)
        if fn is None:
            return []
        return [j for j in fn() if self.rungs.get(j.id, (None,))[0] != ladder.KILL]

    def views(self, now: float) -> list[ladder.JobView]:
        out = []
        wall = time.time()
        moving = self.moving()
        # A job being stopped still holds its memory: the ladder cuts its grace short first.
        for j in self._stopping():
            if j.id in moving:
                continue
            try:
                mem = j.cgroup.memory_in_use()
            except CgroupError:
                continue
            out.append(ladder.JobView(j.id, j.spec.job_class, j.spec.priority, 0.0, mem, stopping=True))
        # A member frozen with its multi-node job (the origin's order: runtime/holds.py MEMBERS)
        # is no candidate while Airlock holds no rung of it: suspending it again frees nothing.
        # One Airlock suspended too stays in view, so that it is recovered (or escalated) here.
        with_job = self._holds().held_by(Hold.MEMBERS) if self.members() is not None else set()
        for j in self.jobs.active():
            rung, since, hops = self.rungs.get(j.id, (None, None, 0))
            if rung == ladder.KILL or j.id in moving or (rung is None and j.id in with_job):
                continue
            try:
                mem = j.cgroup.memory_in_use()  # its clean page cache the kernel drops anyway
            except CgroupError:
                continue
            member = self._member(j.id)
            out.append(ladder.JobView(j.id, j.spec.job_class, j.spec.priority, j.work_at_risk_s(wall), mem,
                                      rung, since, hops, members=member.count if member is not None else 1))
        return out

    def evaluate(self) -> list[ladder.Action]:
        """Read the signals, ask the ladder, apply its actions. Returns them (for tests)."""
        assert self.policy is not None
        now = time.monotonic()
        self._last_eval = now
        # A job that ended while at a rung (stopped by its owner while suspended, ended or moved
        # after a re-address) leaves it: in status, in the store, and in the end-of-episode test
        # below, which a rung left behind kept from ever passing. A kill drops its own.
        active = {j.id for j in self.jobs.active()}
        for jid, (rung, _, _) in list(self.rungs.items()):
            if jid not in active and rung != ladder.KILL:
                self._drop_rung(jid)
        sig = self.signals(now)
        level = ladder.pressure_level(sig, self.policy.doc)
        views = self.views(now)
        scoped = sorted(self._scoped) if level < ladder.CRITICAL else []
        if scoped:
            # Only classes held at their own class budget: critical for their jobs alone (the
            # others' memory is not under that limit; they wait as they are).
            level = ladder.CRITICAL
            views = [v for v in views if v.job_class in self._scoped]
        if level != self.level:
            if level >= ladder.HIGH and self.episode_start is None:
                self.episode_start = now
            self._emit(f"airlock: pressure {ladder.LEVEL_NAMES[self.level]} -> {ladder.LEVEL_NAMES[level]} "
                       f"(usage {sig.usage if sig.usage is None else round(sig.usage, 3)}, psi some {sig.psi_some:.2f}, "
                       f"under_oom {sig.under_oom}"
                       + (f"; only class {', '.join(scoped)}, at its own class budget" if scoped else "") + ")",
                       level=ladder.LEVEL_NAMES[level], usage=sig.usage, psi_some=sig.psi_some,
                       psi_full=sig.psi_full, under_oom=sig.under_oom, scoped_classes=scoped)
            self.level = level
        actions = ladder.decide(now, level, views, self.policy.doc, self.memo, sig.usage)
        for a in actions:
            self._apply(a, now, level, sig)
        if level == ladder.NONE and not any(r[0] in (ladder.SUSPEND, ladder.READDRESS) for r in self.rungs.values()):
            self.episode_start = None
        return actions

    def _apply(self, a: ladder.Action, now: float, level: int, sig: ladder.Signals) -> None:
        job = self.jobs.get(a.job_id)
        if a.kind == ladder.CUT:
            self._cut(job, a, level, sig)
            return
        if job is None or not job.active:
            self._drop_rung(a.job_id)
            return
        reaction_ms = None
        if self.episode_start is not None and a.kind in (ladder.SUSPEND, ladder.KILL):
            reaction_ms = round((now - self.episode_start) * 1000, 2)
            if not any(r[0] in (ladder.SUSPEND, ladder.READDRESS) for r in self.rungs.values()):
                self.reactions_ms.append(reaction_ms)
        fields: dict[str, Any] = {"action": a.kind, "job": job.id, "class": job.spec.job_class,
                                  "priority": job.spec.priority, "value": round(a.value, 4),
                                  "level": ladder.LEVEL_NAMES[level], "usage": sig.usage, "reaction_ms": reaction_ms}
        _, _, hops = self.rungs.get(job.id, (None, 0.0, 0))
        try:
            if a.kind == ladder.SUSPEND:
                self._holds().hold(job.id, Hold.AIRLOCK)  # frozen within ms; a task waiting at the limit later
                self._set_rung(job.id, ladder.SUSPEND, now, hops, a.reason)
                self.jobs.set_state(job, "suspended", f"airlock: {a.reason}")
                self._tell_members(job.id, "suspend")
            elif a.kind == ladder.RECOVER:
                # A re-addressed job was thawed for its checkpoint already; a freeze on it now is
                # the migration layer's (a move in progress), not ours to undo.
                if self.rungs.get(job.id, (None,))[0] != ladder.READDRESS:
                    self._holds().reattach(job.id, Hold.AIRLOCK)  # (a suspend rung is Airlock's hold)
                    self._holds().release(job.id, Hold.AIRLOCK)  # thawed unless another holds it
                self._drop_rung(job.id)
                if self._holds().held(job.id, Hold.MEMBERS):  # frozen with its job still: not ours to thaw
                    self.jobs.set_state(job, "suspended", f"airlock: recovered ({a.reason}); still frozen with "
                                                          "its multi-node job")
                else:
                    self.jobs.set_state(job, "running", f"airlock: recovered ({a.reason})")
                self._tell_members(job.id, "recover")
            elif a.kind == ladder.READDRESS:
                self._set_rung(job.id, ladder.READDRESS, now, hops + 1, a.reason)
                self._readdress(job, a, fields)
            elif a.kind == ladder.KILL:
                lost = job.work_at_risk_s()
                fields["work_lost_s"] = round(lost, 3)
                fields["memory_freed_bytes"] = _safe_usage(job)
                job.cgroup.kill()  # now, synchronously; the stop task records and cleans up
                # Stored after the kill (the hot path), before the stop task records the end:
                # a restart in between finishes the kill instead of calling the job lost.
                self._set_rung(job.id, ladder.KILL, now, hops, a.reason)
                self._spawn(self._finish_kill(job.id, a.reason, lost))
                self._tell_members(job.id, "kill", lost)
        except CgroupError as e:
            fields["error"] = str(e)
        fields["reason"] = a.reason
        self.decisions.append({"ts": time.time(), **fields})
        self._emit(f"airlock: {a.kind} {job.id}: {a.reason}", **fields)

    def _cut(self, job: Any, a: ladder.Action, level: int, sig: ladder.Signals) -> None:
        """Cut a stopping job's grace short: ``cgroup.kill`` now. Its stop (waiting out the
        grace) sees the exit and records the end with the state it gave (stopped, requeued,
        ...), its reason saying that Airlock cut the grace."""
        if job is None or job.active or job.ended is not None or job.id not in {j.id for j in self._stopping()}:
            return
        fields: dict[str, Any] = {"action": a.kind, "job": job.id, "class": job.spec.job_class,
                                  "priority": job.spec.priority, "stop_state": job.state,
                                  "level": ladder.LEVEL_NAMES[level], "usage": sig.usage,
                                  "memory_freed_bytes": _safe_usage(job)}
        try:
            job.cgroup.kill()
            self.jobs.set_state(job, job.state, f"{job.reason}; its grace cut short by Airlock at memory pressure "
                                                f"{ladder.LEVEL_NAMES[level]}")
        except CgroupError as e:
            fields["error"] = str(e)
        fields["reason"] = a.reason
        self.decisions.append({"ts": time.time(), **fields})
        self._emit(f"airlock: cut {job.id}'s stop short: {a.reason}", **fields)

    async def _finish_kill(self, job_id: str, reason: str, lost: float) -> None:
        try:
            await self.jobs.stop(job_id, f"airlock killed: {reason}", grace_s=0, state="killed", work_lost_s=lost,
                                 cause=EndCause.AIRLOCK_KILL)
        except Exception as e:  # already gone: the watcher recorded it
            log.debug("airlock: kill %s: %s", job_id, e)
        self._drop_rung(job_id)

    def _readdress(self, job: Any, a: ladder.Action, fields: dict[str, Any]) -> None:
        """Ask for a checkpoint (the job is thawed so it can handle the signal), then hand it
        to the migration layer when one is present."""
        sent = self.jobs.request_checkpoint(job)
        self._holds().reattach(job.id, Hold.AIRLOCK)  # (thawed as before, unless another component holds it)
        self._holds().release(job.id, Hold.AIRLOCK)
        self.jobs.set_state(job, "running", f"airlock: re-addressing ({a.reason})")
        fields["checkpoint_requested"] = sent
        hook = getattr(getattr(self.migrate, "mover", None), "readdress", None)
        if hook is None:
            fields["migration"] = "absent"
            self._emit(f"airlock: re-addressing {job.id} needs the migration layer (agent.migrate.mover.readdress), "
                       "which is not running; checkpoint requested, the job is killed when the rung's budget ends",
                       job=job.id)
            return
        fields["migration"] = "requested"
        res = hook(job)
        if inspect.isawaitable(res):
            assert self.loop is not None
            self.loop.create_task(_await_quietly(res, job.id))

    # -- policy API --------------------------------------------------------------------------------
    def set_policy(self, doc: Any, uid: int | None = None) -> Policy:
        """Validate whole and store; PolicyError leaves the policy in force unchanged."""
        assert self.policies is not None
        new = self.policies.set(doc, uid, self.class_budget_mb)
        self.policy = new
        # Which classes are protected (held, never capped) and the thresholds the caps and the
        # v2 memory.high follow may have changed: the kernel's settings follow at once.
        self._apply_budget()
        self._emit(f"airlock: policy v{new.version} in force", policy_version=new.version, uid=uid)
        if hasattr(self.jobs, "admit"):
            self.jobs.admit()  # a raised cap starts queued jobs now
        return new

    def _limits_for_admission(self) -> admission.Limits:
        """:meth:`admission_limits` for the job runtime, which asks before it starts jobs, with
        the unprotected classes' caps brought up to date first (:meth:`cap_unprotected`): a job
        about to start in an unprotected class meets a cap that leaves the protected classes
        what they use now, not what they used at the last tick. (The likely cause of a CI
        failure: a long-resident job grew by 150 MiB and three transients were started right
        after, while the agent's loop handled their submissions; a class cap that still left the
        long-resident job its usage from before lets such a storm fill the budget itself, where
        v1's ``oom_kill_disable`` fails kernel-side charges with ENOMEM: the long-resident job
        ended with exit code 1, a failed write.)"""
        try:
            self.cap_unprotected()
        except Exception:
            log.exception("airlock: capping the unprotected classes failed")
        return self.admission_limits()

    def admission_limits(self) -> admission.Limits:
        """The class caps and per-job defaults in force (`airlock.admission`): the config's
        ``class_budget_mb`` and the policy's ``class_caps_mb`` (the smaller), the policy's
        ``job_default_mb``."""
        doc = self.policy.doc if self.policy is not None else {}
        return admission.Limits(admission.class_caps(self.class_budget_mb, doc.get("class_caps_mb")),
                                dict(doc.get("job_default_mb") or {}))

    def status(self) -> dict[str, Any]:
        r = sorted(self.reactions_ms)
        return {"level": ladder.LEVEL_NAMES[self.level], "policy_version": self.policy.version if self.policy else None,
                "budget_mb": self.budget_mb, "usage": self.usage() if self.tree else None, "psi": self.psi_note,
                "class_caps_mb": {c: v >> 20 for c, v in self._caps.items()},
                "admission": self.admission_limits().as_dict(),
                "sources": self.sources,
                "rungs": {k: {"rung": v[0], "for_s": round(time.monotonic() - v[1], 2), "hops": v[2]}
                          for k, v in self.rungs.items()},
                "reaction_p50_ms": r[len(r) // 2] if r else None,
                "reaction_p99_ms": r[min(len(r) - 1, int(len(r) * 0.99))] if r else None,
                "decisions": list(self.decisions)[-20:]}

    def routes(self) -> list[Any]:
        from ..api import ApiError, Request, Route

        async def get_policy(req: Request) -> dict[str, Any]:
            assert self.policy is not None and self.policies is not None
            return {**self.policy.as_dict(), "history": self.policies.history()}

        async def put_policy(req: Request) -> dict[str, Any]:
            try:
                return self.set_policy(req.body, req.peer.uid).as_dict()
            except PolicyError as e:
                raise ApiError(422, str(e), e.reason) from None

        async def validate_policy(req: Request) -> dict[str, Any]:
            from .policy import parse_bounded, validate

            body = req.body
            if isinstance(body, dict) and set(body) == {"text"} and isinstance(body["text"], str):
                # text may be TOML: parsed in a child with a time bound (policy.parse_bounded),
                # one at a time per user (POLICY_PARSES_PER_UID), never on the loop
                api = self.agent.api if self.agent is not None else None
                exempt = api.exempt(req.peer) if api is not None else req.peer.uid == 0
                try:
                    with self._parses.hold(req.peer.uid, exempt=exempt):
                        body = await parse_bounded(body["text"])
                except PolicyError as e:
                    raise ApiError(413 if e.reason == "policy_too_large" else 422, str(e), e.reason) from None
            try:
                return {"valid": True, "policy": validate(body, self.class_budget_mb)}
            except PolicyError as e:
                raise ApiError(422, str(e), e.reason) from None

        async def airlock_status(req: Request) -> dict[str, Any]:
            return self.status()

        return [
            Route("GET", "/v1/policy", get_policy),
            Route("PUT", "/v1/policy", put_policy, privileged=True),
            Route("POST", "/v1/policy/validate", validate_policy),
            Route("GET", "/v1/airlock", airlock_status),
        ]

    def _emit(self, message: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit("airlock", message, **fields)
        else:
            log.info("%s", message)


def _events_of(fd: int) -> dict[str, int]:
    """The counters of an open v2 ``memory.events.local`` (read from its start: reading is also what
    re-arms the kernel's notification). Raises OSError once its cgroup is removed."""
    return {k: int(v) for k, v in parse_keyed(os.pread(fd, 4096, 0).decode()).items() if v.isdigit()}


class _Fd:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        os.close(self.fd)


def release_holds(tree: CgroupTree, budget_mb: int | None, class_budget_mb: dict[str, int]) -> list[str]:
    """``bpf unload`` (the agent's, or ``--force`` with none running): the memory settings of
    the root and of each class parent that still exists become what the config asks for with
    no Airlock left to decide: the budget (``budget_mb``) and each ``class_budget_mb`` stay as
    limits, Airlock's class caps go, and the v1 hold at a limit (oom_kill_disable, under which
    a task waits for Airlock) is off, so the kernel's OOM killer enforces them. Returns what
    could not be written, one line each (a directory gone is no problem)."""
    problems: list[str] = []
    base = tree.hierarchy.unified if tree.hierarchy.memory_in_v2 else tree.hierarchy.v1.get("memory")
    if base is None or not (base / tree.root_name).is_dir():
        return problems
    try:
        tree.set_root_memory((budget_mb << 20) if budget_mb else None, oom_kill_disable=False)
    except (CgroupError, OSError) as e:
        problems.append(f"could not release the node budget's hold: {e}")
    for cls in tree.classes:
        if not (base / tree.root_name / cls).is_dir():
            continue
        mb = class_budget_mb.get(cls)
        try:
            tree.set_class_memory(cls, (mb << 20) if mb else None, oom_kill_disable=False)
        except (CgroupError, OSError) as e:
            problems.append(f"could not release the {cls} class's cap: {e}")
    return problems


def _safe_usage(job: Any) -> int | None:
    try:
        return int(job.cgroup.memory_in_use())
    except CgroupError:
        return None


async def _await_quietly(aw: Any, job_id: str) -> None:
    try:
        await aw
    except Exception as e:
        log.warning("airlock: migrate.mover.readdress(%s) failed: %s", job_id, e)
