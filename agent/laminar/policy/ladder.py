"""The survival ladder: pure decisions, no kernel, no clock of its own.

Airlock's manager (mechanism) and the simulator (``laminar.sim``) call the same functions:

- `survival_value(job, policy)`: how much keeping a job alive is worth. It grows with the
  job's lifecycle class weight, its priority and the work at risk since its last checkpoint,
  and falls with the memory it would free (its memory in use: clean page cache, which the
  kernel drops anyway, is not counted). The lowest value yields first. A member of a
  multi-node job (`JobView.members` > 1) is valued for the whole job: its work at risk counts
  once per member (every member rolls back to the job's last checkpoint when one is killed, and
  a suspension stalls them all), its memory only as what this node would get back. A member is
  never re-addressed (its node is part of the job's rendezvous): its suspension escalates to a kill.
- `pressure_level(signals, policy)`: NONE (recoverable), STEADY (the hysteresis band), HIGH or
  CRITICAL, from the budget's usage, PSI and discrete kernel signals (stalls only while the
  budget or the machine is at least ``recover_below`` full: below, they are a job's own limit).
- `decide(now, level, jobs, policy, memo)`: the next actions. Under HIGH the lowest-value
  running job is suspended (freeze: stops its growth, frees nothing); under CRITICAL the
  allocator already waits at the limit, so when no running candidate is left the lowest-value
  suspended job is escalated at once. Each rung has a time budget; a job suspended longer than
  its budget while the node has not recovered is escalated on its own: re-addressed
  (checkpoint, hand to the migration layer, at most ``max_hops``) when the policy allows, then
  killed (``cgroup.kill``, work lost recorded), one kill per ``KILL_SETTLE_S``. Once the node has been calm for ``hold_s``
  and below ``recover_below``, suspended jobs are thawed one per ``step_s``, highest value
  first (in-situ recovery); a re-addressed job (already thawed) simply leaves its rung then.
- A job being stopped (its SIGTERM sent, its grace running: `JobView.stopping`) is ending anyway
  and is no candidate for suspension; under HIGH or CRITICAL its grace is cut short first
  (``CUT``: the mechanism kills it), before any running job is suspended or killed, and the
  ladder then waits ``KILL_SETTLE_S`` for its memory to come back (that wait at most once per
  ``CUT_HOLD_S``: later cuts go beside the ladder's other decisions). Once per job; never a
  protected class's job.
- `oom_score_adj(job_class, priority)`: the kernel's fallback order mirrors the ladder, so if
  the OOM killer ever acts first it takes transients first. Values are >= 0, which needs no
  CAP_SYS_RESOURCE (lowering oom_score_adj below its current value does).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

NONE, STEADY, HIGH, CRITICAL = 0, 1, 2, 3
LEVEL_NAMES = {NONE: "none", STEADY: "steady", HIGH: "high", CRITICAL: "critical"}

# Rung names; a job's `rung` is None while it runs untouched.
SUSPEND, READDRESS, KILL, RECOVER = "suspend", "readdress", "kill", "recover"
# The action on a job being stopped: its stop's grace is cut short (killed now; it ends as its
# stop said, e.g. stopped by its owner).
CUT = "cut"

# After a kill under CRITICAL, wait this long for the killed job's memory to be freed before
# killing another (cgroup.kill is asynchronous; freeing 1 GiB takes ~100 ms).
KILL_SETTLE_S = 0.25
# Cuts hold the ladder off (KILL_SETTLE_S for the cut jobs' memory) at most once per this
# long; a cut within it is taken beside what the ladder decides (a stream of stops cannot stall it).
CUT_HOLD_S = 1.0

# Under HIGH (not CRITICAL) another job is suspended only while usage still grows: by more
# than GROWTH_EPS of the budget since the last suspension, and at most every SUSPEND_STEP_S.
# Freezing stops growth; once usage is flat, suspending more would only stall useful work.
GROWTH_EPS = 0.01
SUSPEND_STEP_S = 0.05

# oom_score_adj bands per class (priority spreads a job inside its band; higher priority lower).
OOM_BANDS = {"long-resident": (0, 100), "standard": (300, 500), "transient": (700, 1000)}


@dataclass(frozen=True)
class JobView:
    """What the ladder knows about a job at one instant."""

    id: str
    job_class: str
    priority: int
    work_at_risk_s: float
    memory_bytes: int
    rung: str | None = None       # None (running), SUSPEND or READDRESS
    rung_since: float | None = None
    hops: int = 0                 # re-addressing attempts so far
    stopping: bool = False        # being stopped (SIGTERM sent, in its grace): ending anyway
    members: int = 1              # a multi-node job's member: how many members the job has


@dataclass(frozen=True)
class Signals:
    """Pressure inputs at one instant. `usage` is the share of the node's job budget in use,
    clean page cache not counted (the kernel drops it on demand; None when there is no
    budget); PSI values are avg10 fractions (0..1)."""

    usage: float | None = None
    psi_some: float = 0.0
    psi_full: float = 0.0
    under_oom: bool = False          # a task waits at a limit (v1 oom_control) or memory.events oom
    critical_event: bool = False     # v1 pressure_level critical, OOM victim event
    stall_event: bool = False        # PSI trigger fired / memory reclaim began recently (edge signals)
    node_usage: float | None = None  # share of the machine's memory not available (MemAvailable)
    charged: float | None = None     # share of the budget charged, clean page cache included


@dataclass(frozen=True)
class Action:
    """One decision: `kind` is SUSPEND, READDRESS, KILL, RECOVER or CUT; `reason` says why."""

    kind: str
    job_id: str
    reason: str
    value: float = 0.0


@dataclass
class Memo:
    """The ladder's memory between calls (owned by the caller): when the node was last under
    pressure and when a job was last thawed, for hysteresis."""

    last_pressure: float = float("-inf")
    last_recover: float = float("-inf")
    last_kill: float = float("-inf")
    last_suspend: float = float("-inf")
    usage_at_suspend: float | None = None
    acted: dict[str, float] = field(default_factory=dict)
    last_cut: float = float("-inf")
    cut: dict[str, float] = field(default_factory=dict)  # jobs whose stop's grace was cut, and when


def survival_value(job: JobView, policy: dict[str, Any]) -> float:
    """Higher is more worth keeping. Monotone: increasing in class weight, priority, work at
    risk and (for a member of a multi-node job) the job's member count; decreasing in memory
    freed. The work at risk of a member counts for every member of its job."""
    weight = float(policy["class_weights"].get(job.job_class, 1.0))
    prio = 1.0 + max(0, job.priority) / 100.0
    at_risk = max(0.0, job.work_at_risk_s) * max(1, job.members)
    work = 1.0 + float(policy["work_weight_per_hour"]) * at_risk / 3600.0
    mem = 1.0 + float(policy["memory_weight_per_gib"]) * max(0, job.memory_bytes) / float(1 << 30)
    return weight * prio * work / mem


def rank(jobs: Iterable[JobView], policy: dict[str, Any]) -> list[tuple[float, JobView]]:
    """Jobs with their values, lowest value first (ties: larger memory first, then id)."""
    scored = [(survival_value(j, policy), j) for j in jobs]
    scored.sort(key=lambda vj: (vj[0], -vj[1].memory_bytes, vj[1].id))
    return scored


def pressure_level(s: Signals, policy: dict[str, Any]) -> int:
    """NONE, STEADY, HIGH or CRITICAL for these signals under `policy`.

    Stalls (PSI, memory reclaim and OOM events) count only while the budget or the machine is at
    least ``recover_below`` full: below that a stall comes from a limit of its own (a job at
    its ``--memory``, e.g. a data loader whose file is larger than its limit, or a cgroup that
    is not a job), which no suspension or kill of other jobs can lift. A task waiting at the
    budget or a class cap (``under_oom``) and the budget's usage count at any level."""
    t = policy["thresholds"]
    usage = s.usage if s.usage is not None else 0.0
    # the budget counts as full here with its page cache: a thrash on hot file pages at the
    # budget is pressure although its clean cache is not memory in use
    short = max(usage, s.charged or 0.0, s.node_usage or 0.0) >= policy["hysteresis"]["recover_below"]
    if s.under_oom or usage >= t["usage.critical"] or (
            short and (s.critical_event or s.psi_full >= t["memory.full"] > 0)):
        return CRITICAL
    if usage >= t["usage.high"] or (short and (s.stall_event or s.psi_some >= t["memory.some"] > 0)):
        return HIGH
    if usage < policy["hysteresis"]["recover_below"]:
        return NONE
    return STEADY


def oom_score_adj(job_class: str, priority: int) -> int:
    """The kernel OOM killer's order, mirroring the ladder: transients first, long-resident last."""
    lo, hi = OOM_BANDS.get(job_class, OOM_BANDS["standard"])
    p = min(100, max(0, priority))
    return int(round(hi - (hi - lo) * p / 100))


def _next_rung(job: JobView, policy: dict[str, Any]) -> str:
    if job.members > 1:
        return KILL  # a member runs on its node or nowhere: its job's members and rendezvous are placed
    if job.rung == SUSPEND and policy["readdress"] and job.hops < policy["rungs"]["readdress"]["max_hops"]:
        return READDRESS
    return KILL


def decide(now: float, level: int, jobs: Iterable[JobView], policy: dict[str, Any], memo: Memo,
           usage: float | None = None) -> list[Action]:
    """The actions to take now. Pure but for `memo`, which it updates.

    At most one new suspension per call (each call follows a fresh signal, so a storm is met
    job by job, lowest value first; under HIGH only while `usage` keeps growing), any number
    of budget escalations, and at most one recovery per ``hysteresis.step_s``.
    """
    protected = set(policy["protected"])
    everyone = list(jobs)
    stopping = [j for j in everyone if j.stopping]
    jobs = [j for j in everyone if not j.stopping]
    candidates = [j for j in jobs if j.job_class not in protected]
    ranked = rank(candidates, policy)
    actions: list[Action] = []
    for jid in set(memo.cut) - {j.id for j in stopping}:
        del memo.cut[jid]
    if level >= HIGH:
        memo.last_pressure = now
        # 0. Jobs being stopped hold their memory through their grace (one that ignores SIGTERM
        #    for all of it) although they end anyway: cut their grace short before anything
        #    that runs is touched, largest first, each once; then let their memory come back.
        for j in sorted(stopping, key=lambda j: (-j.memory_bytes, j.id)):
            if j.job_class not in protected and j.id not in memo.cut:
                memo.cut[j.id] = now
                actions.append(Action(CUT, j.id, f"pressure {LEVEL_NAMES[level]}: being stopped, ending anyway; "
                                      f"its grace is cut short to free {j.memory_bytes >> 20} MiB before any running "
                                      "job is suspended or killed"))
        # The hold (this call ends here, then KILL_SETTLE_S before a suspension or a pressure
        # kill) comes at most once per CUT_HOLD_S: any user can stop their own jobs, and one
        # new job in its grace every 200 ms otherwise held the ladder off for good.
        if actions and now - memo.last_cut >= CUT_HOLD_S:
            memo.last_cut = now
            return actions
    hyst = policy["hysteresis"]
    calm = level == NONE and now - memo.last_pressure >= hyst["hold_s"]

    # 1. Budgets: a rung that ran out of time while the node has not recovered (level above
    #    NONE) escalates. At NONE the job waits for recovery, even inside the hold_s window.
    #    Kills are paced like critical ones (one per KILL_SETTLE_S, lowest value first):
    #    jobs suspended together run out together, and the memory of the first kill may be
    #    all the node needed, after which the others recover instead of losing their work.
    if level > NONE:
        kill_ok = now - memo.last_kill >= KILL_SETTLE_S
        for v, j in ranked:
            if j.rung in (SUSPEND, READDRESS) and j.rung_since is not None:
                budget = policy["rungs"][j.rung]["budget_s"]
                if now - j.rung_since >= budget:
                    nxt = KILL if j.rung == READDRESS else _next_rung(j, policy)
                    if nxt == KILL:
                        if not kill_ok:
                            continue
                        kill_ok = False
                    actions.append(Action(nxt, j.id, f"{j.rung} budget {budget:g}s ran out at pressure "
                                          f"{LEVEL_NAMES[level]} (value {v:.3g})", v))

    escalated = {a.job_id for a in actions}
    # 2. Pressure: suspend the lowest-value running job. Under CRITICAL the allocator is at
    #    the limit and freezing frees nothing: also kill the lowest-value suspended job,
    #    one per KILL_SETTLE_S so a single kill's memory can come back first.
    if level < HIGH:
        memo.usage_at_suspend = None
    settling = now - memo.last_cut < KILL_SETTLE_S  # a cut job's memory is coming back
    if level >= HIGH and not settling:
        running = [(v, j) for v, j in ranked if j.rung is None]
        growing = (memo.usage_at_suspend is None or usage is None
                   or usage > memo.usage_at_suspend + GROWTH_EPS)
        may_suspend = level == CRITICAL or (growing and now - memo.last_suspend >= SUSPEND_STEP_S)
        if running and may_suspend:
            v, j = running[0]
            memo.last_suspend = now
            memo.usage_at_suspend = usage
            actions.append(Action(SUSPEND, j.id, f"pressure {LEVEL_NAMES[level]}: lowest survival value "
                                  f"{v:.3g} of {len(running)} running", v))
        if level == CRITICAL and now - memo.last_kill >= KILL_SETTLE_S \
                and not any(a.kind == KILL for a in actions):
            waiting = [(v, j) for v, j in ranked if j.rung in (SUSPEND, READDRESS) and j.id not in escalated]
            if waiting:
                v, j = waiting[0]
                actions.append(Action(KILL, j.id, f"pressure critical: suspended job of lowest survival "
                                      f"value {v:.3g} killed to free {j.memory_bytes >> 20} MiB", v))
    if any(a.kind == KILL for a in actions):
        memo.last_kill = now

    # 3. Recovery: calm for hold_s, below recover_below: thaw the highest-value one per step.
    #    Every suspended job, protected ones included: a job suspended before its class became
    #    protected (a policy change during an episode) would otherwise stay frozen for good.
    #    A re-addressed job (thawed for its checkpoint, waiting for the migration layer) whose
    #    pressure ended before its budget leaves its rung at once: it runs already, and a rung
    #    kept would have it killed at the first stall of a later episode (its budget long
    #    spent) and never suspended again.
    if calm:
        for v, j in rank(jobs, policy):
            if j.rung == READDRESS:
                actions.append(Action(RECOVER, j.id, f"calm for {hyst['hold_s']:g}s and usage below "
                                      f"{hyst['recover_below']:g} while re-addressing: back to running", v))
    if calm and now - memo.last_recover >= hyst["step_s"]:
        suspended = [(v, j) for v, j in rank(jobs, policy) if j.rung == SUSPEND]
        if suspended:
            v, j = suspended[-1]
            memo.last_recover = now
            actions.append(Action(RECOVER, j.id, f"calm for {hyst['hold_s']:g}s and usage below "
                                  f"{hyst['recover_below']:g}: highest survival value {v:.3g} thawed first", v))
    return actions
