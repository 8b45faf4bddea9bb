"""workloss: work lost and downtime to reclaims, trace-driven on the SkyPilot spot traces.

Laminar (hazard-timed checkpoints, migration within the notice window, destination chosen by
survival) against Slurm preempt-and-requeue and pipeline-redundancy checkpointing
(Bamboo/Oobleck-style), on the same node timelines, the same jobs and the same abrupt
failures. Each baseline is defined in docs/baselines.md; the model in docs/migration.md.

What is real and what is simulated: node departures are the real 1-node preemption traces
(``--trace``, default ../shared/data/spot-traces; a tick with 1 = preempted); the policy code
is Laminar's own (laminar.migrate.hazard, .ckpt_schedule, .destination: the agent calls the
same functions); the jobs, checkpoint sizes and bandwidths are parameters (below), time is
simulated.

    python bench/workloss.py --quick --json out.json --plot out.png

Keys: workloss_reduction_vs_requeue_pct, workloss_reduction_vs_redundancy_pct,
downtime_reduction_pct (against the baseline with the *least* downtime, so the figure is
the conservative one), plus per-policy totals. Every run models Laminar twice: the headline
keys with ``migrate.archive_dir`` set (storage outside the pool, the storage assumption the
baselines make for their checkpoints: docs/baselines.md), and the same keys (and every
``laminar_*`` key) without it under ``<key>_no_archive``; the baselines' figures are the same
in both (checked). A reduction against a baseline whose total is 0 is undefined: null in the
JSON, with ``<key>_na_reason`` saying why, and "n/a" in text (plot titles, stderr).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))

from laminar.migrate.evidence import NoticeOdds  # noqa: E402
from laminar.migrate.hazard import HazardModel, HazardSum, SpotTrace, load_spot_trace, spot_trace_files  # noqa: E402
from laminar.policy.ckpt_schedule import CkptJob, daly_interval, hazard_interval, notice_fit, notice_schedule  # noqa: E402
from laminar.policy.destination import Candidate, MoveRequest, Resources, rank  # noqa: E402
from laminar.policy.keeper import KeeperCandidate, RetrySchedule, choose_keeper  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/data/spot-traces"
SETS = ("preemption/1-node/aws-04-22-2023", "preemption/1-node/aws-04-19-2023")


@dataclass(frozen=True)
class Params:
    nodes_per_job: int = 4  # S: a pipeline of 4 nodes
    ckpt_gb_per_node: float = 8.0  # checkpoint shard per node
    write_gbps: float = 2.0  # local NVMe write, GB/s
    link_gbps: float = 1.25  # node uplink, GB/s (10 Gbit/s)
    notice_s: float = 120.0  # AWS spot interruption notice
    restart_s: float = 60.0  # process start + checkpoint load
    requeue_delay_s: float = 30.0  # Slurm: requeue, scheduling cycle, prolog
    reconfig_s: float = 30.0  # redundancy: failover / re-plan of the pipeline
    redundancy_overhead: float = 0.10  # redundancy: extra time per iteration (assumption: see baselines.md)
    abrupt_frac: float = 0.10  # departures whose notice never arrives (same for all policies)
    orphan_after_s: float = 10.0  # Laminar: silence before a keeper resumes a job whose node left unannounced
    prestage_unannounced: float = 0.02  # Laminar: migrate.prestage_unannounced (agent default)
    remaining_s: float = 3600.0  # Laminar: the survival horizon the agent ranks destinations with
    rotations: int = 8  # nodes per zone: the zone's trace shifted by 1 h steps
    keeper: bool = True  # Laminar: migrate.keeper (a storage keeper takes the final checkpoint when no node is free)
    retry_base_s: float = 2.0  # Laminar: migrate.retry_base_s (the keeper's first wait for room)
    retry_max_s: float = 30.0  # Laminar: migrate.retry_max_s (the keeper's longest wait)
    archive: bool = False  # Laminar: migrate.archive_dir set (storage outside the pool, as the baselines' shared storage)
    poll_s: float = 0.5  # Laminar: migrate.poll_s (how often an agent with room looks at the archive)
    shrink: bool = False  # NOT BUILT (sensitivity only): the job restarts on the nodes it has (one fewer) rather than wait


@dataclass
class Node:
    name: str
    zone: str
    ups: list[tuple[float, float]]
    starts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.starts = [s for s, _ in self.ups]

    def up_at(self, t: float) -> tuple[float, float] | None:
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and self.ups[i][0] <= t < self.ups[i][1]:
            return self.ups[i]
        return None

    def next_up(self, t: float) -> float:
        if self.up_at(t):
            return t
        i = bisect.bisect_right(self.starts, t)
        return self.starts[i] if i < len(self.starts) else math.inf


DOWN_PARTS = ("wait_capacity", "retry_lag", "final_ckpt_write", "final_transfer", "resume_transfer", "restart", "detect",
              "requeue_delay", "reconfig")


@dataclass
class Result:
    rollback_node_s: float = 0.0
    overhead_node_s: float = 0.0
    downtime_s: float = 0.0
    down: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DOWN_PARTS, 0.0))
    reclaims: int = 0
    useful_node_s: float = 0.0
    migrations: int = 0
    fallbacks: int = 0
    held: int = 0  # Laminar: final checkpoints sent to a storage keeper
    stopped_keeper_lost: int = 0  # Laminar: held checkpoints lost before the job was placed (it starts over)
    prestage_keeper_lost: int = 0  # Laminar: keepers' replicas lost before the job was placed (it starts over)
    keeper_lost_abrupt: int = 0  # ... because the keeper left without notice
    keeper_lost_no_peer: int = 0  # ... because no live peer could take the keeper on
    passes: int = 0  # Laminar: held checkpoints passed on by a keeper that was reclaimed itself
    archive_claims: int = 0  # Laminar (archive): node and keeper gone, the job claimed from its archived periodic checkpoint
    moves_failed: int = 0  # Laminar: moves whose destination left before the checkpoint arrived (the job falls back)
    moves_lost: int = 0  # Laminar: moves whose destination left while restarting the job (after the hand-over)
    dest_lost: int = 0  # ... of which the job had no archived copy either (it starts over)

    @property
    def lost_node_s(self) -> float:
        return self.rollback_node_s + self.overhead_node_s

    tail: list[tuple[str, float]] = field(default_factory=list, repr=False)  # downtime since the job last ran

    def add_down(self, part: str, secs: float) -> None:
        """Downtime of one kind (DOWN_PARTS); the parts add up to ``downtime_s``."""
        self.down[part] += secs
        self.downtime_s += secs
        self.tail.append((part, secs))

    def clip_down(self, t: float, end: float) -> None:
        """The job runs again at ``t`` (its downtime since it last ran, ``tail``, ends there):
        take off what of it lies past ``end``, newest first, so that only the run's time counts."""
        excess = t - end
        for part, secs in reversed(self.tail):
            if excess <= 0:
                break
            cut = min(secs, excess)
            self.down[part] -= cut
            self.downtime_s -= cut
            excess -= cut
        self.tail.clear()


def build_pool(traces: list[SpotTrace], rotations: int) -> tuple[list[Node], float, float]:
    t0 = min(tr.start_ts for tr in traces)
    end = min(tr.start_ts + tr.duration_s for tr in traces)
    pool = []
    for tr in traces:
        for k in range(rotations):
            shift = k * 3600.0
            ups = []
            for s, e in tr.up_intervals():
                s2, e2 = s + shift, e + shift
                if e2 > end:
                    e2 = end + 10 * 86400.0  # past the horizon: up until the end of the run
                ups.append((s2, e2))
            pool.append(Node(f"{tr.name}#{k}", tr.name, ups))
    return pool, t0, end


def pool_job_mtbf(pool: list[Node], end: float, nodes_per_job: int) -> float:
    """The baselines' MTBF of a job of ``nodes_per_job`` nodes: the pool's node-seconds up
    before ``end`` over its departures before ``end``, divided by the job's nodes.

    Up time is clipped at ``end``: :func:`build_pool` stretches the intervals still up at the
    end of the traces 10 days past it (so a node never departs after the run), and counting
    that stretch as exposure overstated the MTBF (by 1.6x on aws-04-22-2023, 2.7x on
    aws-04-19-2023), which gave the baselines' static Daly interval a wrong, longer value."""
    total_up = sum(min(e, end) - s for n in pool for s, e in n.ups if s < end)
    departures = sum(1 for n in pool for s, e in n.ups if e < end)
    return total_up / max(departures, 1) / nodes_per_job


class OnlineHazards:
    """Per-zone hazard models fed with what the zone has seen so far (no look-ahead)."""

    def __init__(self, pool: list[Node]) -> None:
        self.events: dict[str, list[tuple[float, float, float]]] = {}
        for n in pool:
            self.events.setdefault(n.zone, []).extend((e, s, e) for s, e in n.ups)
        for v in self.events.values():
            v.sort()
        self.models = {z: HazardModel(provider=z) for z in self.events}
        self.fed = {z: 0 for z in self.events}

    def at(self, t: float) -> dict[str, HazardModel]:
        for z, evs in self.events.items():
            i = self.fed[z]
            m = self.models[z]
            while i < len(evs) and evs[i][0] <= t:
                _, s, e = evs[i]
                m.observe_exposure(s, e)
                m.observe_reclaim(e)
                i += 1
            self.fed[z] = i
        return self.models


def acquire(pool: list[Node], t: float, k: int, busy: set[str], order: list[Node]) -> tuple[float, list[Node]]:
    """First time >= t at which k free nodes are up, and those nodes (in ``order``)."""
    while t < math.inf:
        up = [n for n in order if n.name not in busy and n.up_at(t)]
        if len(up) >= k:
            return t, up[:k]
        nxt = min((n.next_up(t + 1e-6) for n in pool if n.name not in busy and not n.up_at(t)), default=math.inf)
        t = nxt
    return math.inf, []


def keeper_look(pool: list[Node], order: list[Node], sched: RetrySchedule, t_first: float,
               busy: set[str]) -> tuple[float, float, float]:
    """A keeper that looks for a free node at ``t_first`` and then on ``sched`` (the agent's
    RetrySchedule): (the look that finds one, the wait for capacity, the lag between room
    freeing and that look). (inf, ., .) when no node ever frees."""
    t = t_first
    while True:
        t_free, extra = acquire(pool, t, 1, busy, order)
        if not extra:
            return math.inf, 0.0, 0.0
        t_look = sched.first_at_or_after(t_first, t_free)
        _, up = acquire(pool, t_look, 1, busy, order)
        if up and _ == t_look:  # still free at the look
            return t_look, t_free - t_first, t_look - t_free
        t = t_look


def simulate(policy: str, pool: list[Node], start: float, end: float, p: Params, seed: int) -> Result:
    """One job of ``p.nodes_per_job`` nodes from ``start`` to ``end`` under ``policy``.

    Laminar does what its agent does (laminar.migrate.reclaim): periodic checkpoints at the
    hazard's interval with the learned share of unannounced departures; each checkpoint shipped
    to a keeper while departures without notice are plausible (``prestage_unannounced``) or the
    final one would not fit the window; at a notice, the jobs keep training until the
    timetable's signal, then write the final checkpoint, freeze, move it to the best-ranked
    free node not under a notice (ranked with what the agent knows then: no look-ahead) and
    restart there. A destination that leaves before the checkpoint arrives fails the move (the
    job falls back as below); one that leaves after the hand-over, while restarting the job,
    loses it (claimed from the archive, or started over). No free node: the move fails, the
    job trains on to the window's end and resumes from its keeper's replica when capacity
    returns. Unannounced: the
    keeper resumes the job from its newest replica after ``orphan_after_s`` of silence."""
    order = pool[:]
    random.Random(seed + 1).shuffle(order)
    res = Result()
    size = p.ckpt_gb_per_node * 1e9
    write_s = size / (p.write_gbps * 1e9)
    link = p.link_gbps * 1e9
    S = p.nodes_per_job
    hz = OnlineHazards(pool) if policy == "laminar" else None
    # static Daly for the baselines: checkpoint written synchronously to shared storage over
    # the uplink, MTBF from the pool's average departure rate (given to them: generous)
    job_mtbf = pool_job_mtbf(pool, end, S)
    c_sync = size / link
    tau_static = max(daly_interval(c_sync, job_mtbf), 30.0)
    abrupt_draws: dict[tuple[str, float], bool] = {}
    odds = NoticeOdds()  # what Laminar's agent learns: departures with and without notice
    sched = RetrySchedule(p.retry_base_s, 2.0, p.retry_max_s)  # the keeper's looks for room

    def abrupt(node: Node, d: float) -> bool:
        k = (node.zone, round(d))
        if k not in abrupt_draws:
            # a draw per (scenario, zone, time), whatever the order of the questions: the same
            # departures are abrupt for every policy (Laminar also asks about its keepers' departures)
            abrupt_draws[k] = random.Random(f"{seed}:{k[0]}:{k[1]}").random() < p.abrupt_frac
        return abrupt_draws[k]

    def under_notice(n: Node, t: float) -> bool:
        """Up at ``t`` and already announced as reclaimed (its departure, with notice, lies
        within ``notice_s`` of ``t``). The agent leaves such a node out of every choice: move
        destinations and keepers of either kind (Mover.candidates, which
        rank_for and rank_keepers both use; a draining node binds no offer or hand-over)."""
        up = n.up_at(t)
        return up is not None and up[1] <= t + p.notice_s and not abrupt(n, up[1])

    def live_peer(n: Node, t: float, until: float) -> bool:
        """Up from ``t`` to ``until`` and not under a reclaim notice at ``t`` (the agent leaves
        out peers that announced their reclaim: Mover.candidates)."""
        up = n.up_at(t)
        if up is None or up[1] < until:
            return False
        return not under_notice(n, t)

    keeper_lost_at: list[float] = []  # when keep_keeper last found a keeper gone (for the archive's claim)

    def arch_rule() -> bool:
        """The agent's rule (PeriodicCopies.periodic_due): with the archive, each
        periodic checkpoint (and the one a job restarted from) also goes there while
        departures without notice are plausible, the prestaging rule's unannounced branch."""
        return p.archive and odds.unannounced_frac >= p.prestage_unannounced

    def keep_keeper(keeper: Node, t_at: float, until: float) -> bool:
        """Whether the job's keeper (storage or prestaged: node-local copies) still holds its
        checkpoint at ``until``. A keeper reclaimed with notice passes the checkpoint and the
        keeper on to the live peer with the best odds (Keepers.pass_keepers), or with
        the archive and no live peer, archives it; one that leaves without notice, or finds no
        live peer and no archive, loses them."""
        assert hz is not None
        by = {n.name: n for n in pool}
        while True:
            up = keeper.up_at(t_at)
            g_end = up[1] if up else t_at
            if g_end >= until:
                return True
            if abrupt(keeper, g_end):
                res.keeper_lost_abrupt += 1
                keeper_lost_at.append(g_end)
                return False
            t_pass = max(t_at, g_end - p.notice_s)
            models = hz.at(t_pass)
            peers = [n for n in pool if n is not keeper and live_peer(n, t_pass, t_pass + size / link)]
            hc = [KeeperCandidate(n.name, n.zone, math.inf, link, models[n.zone].survival(t_pass, p.remaining_s))
                  for n in peers]
            nxt = [r for r in choose_keeper(hc, size, g_end - t_pass) if r.feasible]
            if not nxt:
                if p.archive and g_end - t_pass >= size / link:
                    return True  # no live peer: the reclaimed keeper archives it (_pass_one)
                res.keeper_lost_no_peer += 1
                keeper_lost_at.append(g_end)
                return False
            keeper, t_at = by[nxt[0].candidate.node], t_pass + size / link
            res.passes += 1

    def keeper_wait(keeper: Node | None, t_first: float, busy: set[str]) -> tuple[float, float, float, bool]:
        """A stopped job's wait for room: (the look that places it, wait for capacity, lag,
        whether its checkpoint was still there). The keeper looks on its retry schedule; with
        the archive (``p.archive``) a keeper whose first look fails archives the checkpoint
        (``size / link`` later it no longer depends on the keeper; ``keeper`` None: the source
        archived it itself), and any agent with room claims it within ``poll_s``."""
        t_look, wait, lag = keeper_look(pool, order, sched, t_first, busy)
        if not math.isfinite(t_look):
            return t_look, wait, lag, False
        if p.archive and t_look > t_first:
            t_arch = t_first + size / link
            kept = keeper is None or keep_keeper(keeper, t_first, t_arch)
            t_free = t_look - lag
            t_claim = max(t_free, t_arch) + p.poll_s
            if kept and t_claim < t_look:
                t_up, up = acquire(pool, t_claim, 1, busy, order)
                if up and t_up == t_claim:
                    return t_claim, wait, t_claim - t_free, True
            return t_look, wait, lag, kept
        return t_look, wait, lag, keeper is None or keep_keeper(keeper, t_first, t_look + size / link)

    def resume_at_look(t_look: float, wait: float, lag: float, kept: bool, rest: list[Node],
                       busy: set[str]) -> tuple[list[Node], float]:
        """The keeper's look at ``t_look`` found a free node: the job restarts there, from the
        kept checkpoint after its transfer, or (``kept`` False: the copy is gone) from the
        start, its progress so far rolled back. Returns (the job's nodes, when it runs again)."""
        _, extra = acquire(pool, t_look, 1, busy, order)
        res.add_down("wait_capacity", wait)
        res.add_down("retry_lag", lag)
        res.add_down("restart", p.restart_s)
        if kept:
            res.add_down("resume_transfer", size / link)
            return rest + extra[:1], t_look + size / link + p.restart_s
        res.rollback_node_s += max(0.0, res.useful_node_s - res.rollback_node_s - res.overhead_node_s)
        return rest + extra[:1], t_look + p.restart_s

    job = CkptJob("j", size, p.write_gbps * 1e9)
    step = notice_schedule([job], link, p.notice_s)[0]
    fits = notice_fit([job], link, p.notice_s)["j"]

    t, nodes = acquire(pool, start, S, set(), order)
    last_durable = t  # wall time up to which work survives the loss of a node (off-node copy)
    # Laminar with the archive: wall time up to which work survives in the archive (the job's
    # live record; None: no archived copy of the running job)
    arch_durable: float | None = t if policy == "laminar" and arch_rule() else None
    degraded = 0  # redundancy: nodes missing from the pipeline; Laminar with --shrink: nodes it runs without
    while t < end and nodes:
        # nodes lost while the job was down (restarting, waiting) are replaced before it runs:
        # no work to lose, only more waiting
        lost = [n for n in nodes if not n.up_at(t)]
        if lost:
            keep = [n for n in nodes if n.up_at(t)]
            t2, extra = acquire(pool, t, len(lost), {n.name for n in keep}, order)
            if not extra:
                break
            res.add_down("wait_capacity", t2 - t)
            nodes, t = keep + extra, t2
            last_durable = max(last_durable, t) if policy != "redundancy" else last_durable
            continue
        departs = [(n.up_at(t) or (t, t))[1] for n in nodes]
        d_i = min(range(len(nodes)), key=lambda i: departs[i])
        d = min(departs[d_i], end)
        grow_at = math.inf
        if policy == "laminar" and degraded:  # NOT BUILT (--shrink): grow back when the keeper finds a free node
            grow_at, _, _ = keeper_look(pool, order, sched, t, {n.name for n in nodes})
            d = min(d, grow_at)
        if policy == "redundancy" and degraded:
            # a degraded pipeline takes a free node as soon as one is up (Bamboo and Oobleck
            # add joining nodes); until then a second departure exceeds the redundancy
            grow_at, _ = acquire(pool, t, 1, {n.name for n in nodes}, order)
            d = min(d, grow_at)
        # -- run from t to d with periodic checkpoints --------------------------------------
        res.tail.clear()  # the job runs: what went before is inside the run
        prestaged = True
        if policy == "laminar":
            assert hz is not None
            models = hz.at(t)
            jh = HazardSum([models[n.zone] for n in nodes])
            # the agent's rule (Checkpoints.should_prestage): ship each checkpoint to a
            # keeper when the final one would not fit, or departures without notice are plausible
            prestaged = not fits or odds.unannounced_frac >= p.prestage_unannounced
            cost = write_s if fits else write_s + size / link
            tau, _ = hazard_interval(cost, jh, t, rollback_frac=1.0 if not fits else odds.unannounced_frac)
            pause, lag = cost, (size / link if fits else 0.0)  # async copy to the keeper after the local write
        else:
            tau, pause, lag = tau_static, c_sync, 0.0
        span = max(0.0, d - t)
        k = int(span // (tau + pause))
        rate = S - degraded
        res.overhead_node_s += k * pause * rate
        if policy == "redundancy":
            res.overhead_node_s += (span - k * pause) * rate * p.redundancy_overhead / (1 + p.redundancy_overhead)
        if k > 0 and prestaged:
            last_ck_end = t + k * (tau + pause)
            last_durable = max(last_durable, last_ck_end + lag if last_ck_end + lag <= d else last_ck_end - (tau + pause) + lag)
        if policy == "laminar" and k > 0 and arch_rule():
            # each checkpoint is archived after it is committed (after the keeper's copy, over the
            # same uplink, as fast as it: an assumption); a copy not done when the node leaves
            # does not count (the archive publishes only complete ones)
            last_ck_end = t + k * (tau + pause)
            arch_lag = lag + size / link
            cand = last_ck_end if last_ck_end + arch_lag <= d else (last_ck_end - (tau + pause) if k >= 2 else None)
            if cand is not None:
                arch_durable = cand if arch_durable is None else max(arch_durable, cand)
        res.useful_node_s += span * rate
        if d >= end:
            break
        if d == grow_at and policy == "redundancy":  # the free node joins: re-plan the pipeline
            _, extra = acquire(pool, d, 1, {n.name for n in nodes}, order)
            res.add_down("reconfig", p.reconfig_s)
            nodes, degraded = nodes + extra[:1], 0
            t = d + p.reconfig_s
            continue
        if d == grow_at:  # NOT BUILT (--shrink): checkpoint, ship the shard, restart on all nodes
            _, extra = acquire(pool, d, degraded, {n.name for n in nodes}, order)
            res.add_down("final_ckpt_write", write_s)
            res.add_down("resume_transfer", size / link)
            res.add_down("restart", p.restart_s)
            nodes, degraded = nodes + extra, 0
            t = last_durable = d + write_s + size / link + p.restart_s
            continue
        res.reclaims += 1
        gone = nodes[d_i]
        is_abrupt = abrupt(gone, d)
        # -- the reclaim ----------------------------------------------------------------------
        if policy == "requeue":
            res.rollback_node_s += max(0.0, d - last_durable) * S
            t1 = d + p.requeue_delay_s
            res.add_down("requeue_delay", p.requeue_delay_s)
            t2, nodes = acquire(pool, t1, S, set(), order)
            if not nodes:  # never S free nodes again: down until the end of the run
                res.add_down("wait_capacity", max(0.0, end - t1))
                t = max(t1, end)
                break
            res.add_down("wait_capacity", t2 - t1)
            res.add_down("restart", p.restart_s)
            t2 += p.restart_s
            t, last_durable = t2, t2
        elif policy == "redundancy":
            neighbours_lost = degraded > 0  # a second loss before the pipeline is whole again
            if not neighbours_lost:
                # failover: the neighbour holds the stage's layers; no rollback, re-plan the pipeline
                res.add_down("reconfig", p.reconfig_s)
                rest = [n for n in nodes if n is not gone]
                t2, extra = acquire(pool, d + p.reconfig_s, 1, {n.name for n in rest}, order)
                if t2 <= d + p.reconfig_s + 1e-6:
                    nodes, degraded = rest + extra, 0
                else:
                    nodes, degraded = rest, 1
                t = d + p.reconfig_s
            else:
                res.rollback_node_s += max(0.0, d - last_durable) * (S - degraded)
                t1 = d + p.requeue_delay_s
                res.add_down("requeue_delay", p.requeue_delay_s)
                t2, nodes = acquire(pool, t1, S, set(), order)
                if not nodes:  # never S free nodes again: down until the end of the run
                    res.add_down("wait_capacity", max(0.0, end - t1))
                    t = max(t1, end)
                    break
                res.add_down("wait_capacity", t2 - t1)
                res.add_down("restart", p.restart_s)
                t2 += p.restart_s
                t, last_durable, degraded = t2, t2, 0
        else:  # laminar
            assert hz is not None
            # the job keeps training until the timetable's signal, then checkpoints and moves
            notice_at = max(d - p.notice_s + step.signal_at_s, t)
            rest = [n for n in nodes if n is not gone]
            busy = {n.name for n in rest} | {gone.name}
            by_name = {n.name: n for n in pool}
            dest: Node | None = None
            dest_lost: Node | None = None  # the move's destination, left while restarting the job
            move_failed = False  # the move's destination left before the checkpoint arrived
            if not is_abrupt and step.final:
                # rank the free nodes up and not under a notice when the move is planned (the
                # agent's candidates: what it knows then, no look-ahead). The move: write, send
                # (the hand-over at t_sent: the source stops the job, the destination keeps it
                # and restarts it), restart; the job runs there from t_go
                models = hz.at(notice_at)
                t_sent = notice_at + write_s + size / link
                t_go = t_sent + p.restart_s
                cands = [Candidate(n.name, n.zone, "r0", Resources(1, 0, 0), link,
                                   survival=models[n.zone].survival(notice_at, p.remaining_s))
                         for n in pool if n.name not in busy and n.up_at(notice_at) and not under_notice(n, notice_at)]
                req = MoveRequest("j", Resources(1, 0, 0), size, p.remaining_s, p.notice_s, gone.name, gone.zone, "r0")
                ranked = [r for r in rank(req, cands) if r.feasible]
                cand = by_name[ranked[0].candidate.node] if ranked else None
                c_end = (cand.up_at(notice_at) or (notice_at, notice_at))[1] if cand else math.inf
                if cand is not None and c_end < t_sent:
                    # the destination left (without notice, or with one that came after the move
                    # was planned) before the checkpoint arrived: the send stalls until the plan's
                    # transfer deadline (t_sent) and fails; the agent's other candidates and a
                    # keeper get that same, passed deadline (_move: one deadline for every try),
                    # so the move fails: the job is thawed, trains on to the window's end and its
                    # keeper resumes it from its replica (the fallback below)
                    res.moves_failed += 1
                    move_failed = True
                elif cand is not None and c_end < t_go:
                    # handed over, then the destination left while restarting the job: it was
                    # the job's only keeper (the old keeper was released at the hand-over, the
                    # source stopped the job), so the final checkpoint is gone with it
                    dest_lost = cand
                elif cand is not None:
                    dest = cand
                    res.migrations += 1
                    res.add_down("final_ckpt_write", write_s)
                    res.add_down("final_transfer", size / link)
                    res.add_down("restart", p.restart_s)
                    res.useful_node_s -= max(0.0, d - notice_at) * S  # paused from the signal on
                    nodes, t = rest + [dest], t_go
                    last_durable = t
                    arch_durable = t if arch_rule() else None
            if dest_lost is not None:
                # the move was made (write, send, hand-over) and the job was restarting on
                # dest_lost when it left; nothing keeps the job now
                res.migrations += 1
                res.moves_lost += 1
                res.reclaims += 1  # the destination's departure is one of the job's too
                res.add_down("final_ckpt_write", write_s)
                res.add_down("final_transfer", size / link)
                res.add_down("restart", c_end - t_sent)  # the restart it did not finish
                res.useful_node_s -= max(0.0, d - notice_at) * S  # paused from the signal on
                t1 = c_end + p.orphan_after_s  # the zone takes the destination for gone
                res.add_down("detect", p.orphan_after_s)
                if arch_durable is not None:
                    # the job's live record is in the archive with its newest archived periodic
                    # checkpoint (the destination archives the one it restarted from only once
                    # the job runs): an agent with room claims it at its next round (poll_s) and
                    # resumes from there; the work since is lost with the final checkpoint
                    t_c = t1 + p.poll_s
                    t_up, up = acquire(pool, t_c, 1, busy, order)
                    if not up:
                        break
                    res.archive_claims += 1
                    res.rollback_node_s += max(0.0, notice_at - arch_durable) * S
                    res.add_down("detect", p.poll_s)
                    res.add_down("wait_capacity", t_up - t_c)
                    res.add_down("resume_transfer", size / link)
                    res.add_down("restart", p.restart_s)
                    nodes, t = rest + up[:1], t_up + size / link + p.restart_s
                else:
                    # no copy of the job is left: it starts over (as any job whose every copy is
                    # gone, above), placed when a node is free
                    res.dest_lost += 1
                    t_look, wait, lag = keeper_look(pool, order, sched, t1, busy)
                    if not math.isfinite(t_look):
                        break
                    nodes, t = resume_at_look(t_look, wait, lag, False, rest, busy)
                last_durable = t
                arch_durable = t if arch_rule() else None
                odds.observe(announced=True)  # the source's departure
                odds.observe(announced=not abrupt(dest_lost, c_end))
                continue
            held_by: Node | None = None
            if dest is None and p.shrink and degraded == 0 and S > 1:
                # NOT BUILT (--shrink): the job restarts on the nodes it has, from the final
                # checkpoint (or, without notice, the keeper's replica), and runs with one fewer
                res.fallbacks += 1
                if not is_abrupt and step.final:
                    res.add_down("final_ckpt_write", write_s)
                    res.add_down("final_transfer", size / link)
                    res.useful_node_s -= max(0.0, d - notice_at) * S
                    t1 = notice_at + write_s + size / link
                else:
                    res.rollback_node_s += max(0.0, d - last_durable) * S
                    t1 = d + (p.orphan_after_s if is_abrupt else 0.0)
                    res.add_down("detect", t1 - d)
                    res.add_down("resume_transfer", size / link)
                    t1 += size / link
                res.add_down("restart", p.restart_s)
                nodes, degraded = rest, 1
                t = last_durable = t1 + p.restart_s
                arch_durable = t if arch_rule() else None
                odds.observe(announced=not is_abrupt)
                continue
            if dest is None and not is_abrupt and step.final and p.keeper and not move_failed:
                # nowhere to run it: the final checkpoint goes to the live peer with the best
                # survival odds (Keepers.hold; disk space assumed on every peer) and
                # the job stops there; the keeper places it when room frees
                models = hz.at(notice_at)
                t_h = notice_at + write_s + size / link
                live = [n for n in rest if live_peer(n, notice_at, t_h)] + [
                    n for n in pool if n.name not in busy and live_peer(n, notice_at, t_h)]
                hc = [KeeperCandidate(n.name, n.zone, math.inf, link, models[n.zone].survival(notice_at, p.remaining_s))
                      for n in live]
                ranked_h = [r for r in choose_keeper(hc, size, p.notice_s, src_zone=gone.zone) if r.feasible]
                archived = not ranked_h and p.archive  # no live peer: the source archives it (_hold)
                if ranked_h or archived:
                    held_by = by_name[ranked_h[0].candidate.node] if ranked_h else gone
                    res.held += 1
                    res.add_down("final_ckpt_write", write_s)
                    res.add_down("final_transfer", size / link)
                    res.useful_node_s -= max(0.0, d - notice_at) * S  # paused from the signal on
                    # with the archive the source also archives it (_hold): it never hangs on one node
                    t_look, wait, lag, kept = keeper_wait(None if p.archive else held_by, t_h,
                                                         {n.name for n in rest} | {gone.name})
                    if not math.isfinite(t_look):
                        break
                    nodes, t = resume_at_look(t_look, wait, lag, kept, rest, {n.name for n in rest} | {gone.name})
                    # not kept: its copy and the job's keeper are gone (the keeper was released)
                    res.stopped_keeper_lost += not kept
                    last_durable = t
                    arch_durable = t if arch_rule() else None
            if dest is None and held_by is None:
                # no usable notice, or nowhere to go and no keeper: the job's replica on its keeper
                # is what is left (work since it rolls back); the keeper, its keeper, looks for room
                # from the silence (no notice) or the window's end on, on its retry schedule, and
                # sends the replica to the free node it finds
                res.fallbacks += 1
                if not is_abrupt and step.final:
                    res.add_down("final_ckpt_write", write_s)  # the agent checkpointed, then found no room
                    res.useful_node_s -= write_s * S
                    if move_failed:  # ... or sent it to a destination that left: frozen until the send failed
                        res.add_down("final_transfer", size / link)
                        res.useful_node_s -= size / link * S
                res.rollback_node_s += max(0.0, d - last_durable) * S
                t1 = d + (p.orphan_after_s if is_abrupt else 0.0)
                res.add_down("detect", t1 - d)
                # the keeper: the live peer with the best odds when the node left (the agent ranks
                # its keeper the same way; none: the replica was never off the node)
                models = hz.at(d)
                live = [n for n in pool if n is not gone and live_peer(n, d, d)]
                hb = [r for r in choose_keeper([KeeperCandidate(n.name, n.zone, math.inf, link,
                                                                models[n.zone].survival(d, p.remaining_s))
                                                for n in live], size, None) if r.feasible]
                keeper = by_name[hb[0].candidate.node] if hb else None
                keeper_lost_at.clear()
                if keeper is None:
                    t_look, wait, lag = keeper_look(pool, order, sched, t1, busy)
                    kept = False
                else:
                    # it takes over from t1 on; before that it must not leave
                    t_look, wait, lag, kept = keeper_wait(keeper, t1, busy)
                    kept = kept and keep_keeper(keeper, d, t1)
                if not kept and arch_durable is not None:
                    # the node and its keeper are both gone, the job's live record is in the
                    # archive: any agent with room claims it once both are silent for
                    # orphan_after_s (its next archive round, poll_s), and resumes the job from
                    # the archived periodic checkpoint (the keeper's newer replica is lost)
                    t_c = max([t1] + [g + p.orphan_after_s for g in keeper_lost_at]) + p.poll_s
                    t_up, up = acquire(pool, t_c, 1, busy, order)
                    if not up:
                        break
                    res.archive_claims += 1
                    res.rollback_node_s += max(0.0, last_durable - arch_durable) * S
                    res.add_down("detect", t_c - t1)
                    res.add_down("wait_capacity", t_up - t_c)
                    res.add_down("resume_transfer", size / link)
                    res.add_down("restart", p.restart_s)
                    nodes, t = rest + up[:1], t_up + size / link + p.restart_s
                else:
                    if not math.isfinite(t_look):
                        break
                    nodes, t = resume_at_look(t_look, wait, lag, kept, rest, busy)
                    res.prestage_keeper_lost += not kept  # the replica and the keeper are gone, nothing archived
                last_durable = t
                arch_durable = t if arch_rule() else None
            odds.observe(announced=not is_abrupt)  # what the agent learns from this departure
    if math.isfinite(t):
        res.clip_down(t, end)  # a wait or restart that runs past the end of the traces
    return res


NA_SUFFIX = "_na_reason"
"""Suffix of the key that says why a reduction is null (``<key>_na_reason``)."""


def red(a: float, b: float) -> float | None:
    """Reduction of ``a`` against the baseline's ``b``, in percent (1 decimal): ``100 (1 - a/b)``.

    None when the baseline's ``b`` is 0: a reduction against zero is undefined (nothing to
    reduce, or Laminar infinitely worse), and a number there (it used to be 0.0) would read as
    "no improvement". The JSON says null (with ``<key>_na_reason``), the text "n/a"."""
    if not (math.isfinite(a) and math.isfinite(b)) or a < 0 or b < 0:
        raise ValueError(f"workloss: reduction of {a!r} against {b!r}: both must be finite and >= 0")
    return round(100.0 * (1.0 - a / b), 1) if b > 0 else None


def na_reason(baseline: str, what: str) -> str:
    """Why a reduction against ``baseline``'s ``what`` (work lost, downtime) is undefined."""
    unit = "node-h" if what == "work lost" else "h"
    return f"n/a: {baseline} had no {what} (0 {unit}); a reduction against zero is undefined"


def fmt_red(v: object) -> str:
    """A reduction for text: ``-12.5%`` style change, or ``n/a`` when undefined (None)."""
    return "n/a" if v is None else f"{-float(str(v)):+.1f}%"


def reductions(tot: dict[str, tuple[float, float]]) -> dict[str, object]:
    """The headline reductions from each policy's (work lost, downtime) totals: Laminar against
    each baseline, and ``downtime_reduction_pct`` against the baseline with the least downtime
    (the conservative figure: with both defined, the smaller of the two). An undefined one
    (its baseline at 0) is None with ``<key>_na_reason`` beside it."""
    out: dict[str, object] = {}

    def put(key: str, k: int, base: str) -> None:
        out[key] = red(tot["laminar"][k], tot[base][k])
        if out[key] is None:
            out[f"{key}{NA_SUFFIX}"] = na_reason(base, ("work lost", "downtime")[k])

    put("workloss_reduction_vs_requeue_pct", 0, "requeue")
    put("workloss_reduction_vs_redundancy_pct", 0, "redundancy")
    put("downtime_reduction_vs_requeue_pct", 1, "requeue")
    put("downtime_reduction_vs_redundancy_pct", 1, "redundancy")
    put("downtime_reduction_pct", 1, min(("requeue", "redundancy"), key=lambda pol: tot[pol][1]))
    return out


def run(trace_root: Path, sets: list[str], scenarios: int, p: Params) -> dict[str, object]:
    per: dict[str, list[Result]] = {"laminar": [], "requeue": [], "redundancy": []}
    for s in sets:
        traces = [load_spot_trace(f) for f in spot_trace_files(trace_root / s)]
        traces = [tr for tr in traces if len(tr.departures()) > 0]
        pool, t0, end = build_pool(traces, p.rotations)
        for i in range(scenarios):
            start = t0 + (end - t0) * 0.5 * i / max(scenarios, 1)
            for pol in per:
                per[pol].append(simulate(pol, pool, start, end, p, seed=1000 + i))
    out: dict[str, object] = {}
    tot = {}
    for pol, rs in per.items():
        lost = sum(r.lost_node_s for r in rs)
        down = sum(r.downtime_s for r in rs)
        tot[pol] = (lost, down)
        out[f"{pol}_work_lost_node_h"] = round(lost / 3600, 2)
        out[f"{pol}_rollback_node_h"] = round(sum(r.rollback_node_s for r in rs) / 3600, 2)
        out[f"{pol}_overhead_node_h"] = round(sum(r.overhead_node_s for r in rs) / 3600, 2)
        out[f"{pol}_downtime_h"] = round(down / 3600, 2)
        for part in DOWN_PARTS:  # where the downtime comes from (the parts add up to the total)
            out[f"{pol}_down_{part}_h"] = round(sum(r.down[part] for r in rs) / 3600, 2)
        out[f"{pol}_reclaims"] = sum(r.reclaims for r in rs)
        out[f"{pol}_downtime_per_reclaim_median_s"] = round(
            statistics.median([r.downtime_s / max(r.reclaims, 1) for r in rs]), 1)
        out[f"{pol}_work_lost_per_scenario_median_node_h"] = round(statistics.median([r.lost_node_s for r in rs]) / 3600, 2)
    out["laminar_migrations"] = sum(r.migrations for r in per["laminar"])
    out["laminar_fallbacks"] = sum(r.fallbacks for r in per["laminar"])
    out["laminar_held"] = sum(r.held for r in per["laminar"])
    out["laminar_stopped_keeper_lost"] = sum(r.stopped_keeper_lost for r in per["laminar"])
    out["laminar_keeper_passes"] = sum(r.passes for r in per["laminar"])
    out["laminar_prestage_keeper_lost"] = sum(r.prestage_keeper_lost for r in per["laminar"])
    out["laminar_keeper_lost_abrupt"] = sum(r.keeper_lost_abrupt for r in per["laminar"])
    out["laminar_keeper_lost_no_peer"] = sum(r.keeper_lost_no_peer for r in per["laminar"])
    out["laminar_archive_claims"] = sum(r.archive_claims for r in per["laminar"])
    out["laminar_moves_failed"] = sum(r.moves_failed for r in per["laminar"])
    out["laminar_moves_lost"] = sum(r.moves_lost for r in per["laminar"])
    out["laminar_jobs_lost"] = sum(r.stopped_keeper_lost + r.prestage_keeper_lost + r.dest_lost for r in per["laminar"])

    out.update(reductions(tot))
    out["scenarios"] = len(per["laminar"])
    out["trace_sets"] = ",".join(Path(s).name for s in sets)
    for k, v in vars(p).items():
        out[f"param_{k}"] = v
    out["_per"] = per  # removed before writing JSON
    return out


HEADLINE = ("workloss_reduction_vs_requeue_pct", "workloss_reduction_vs_redundancy_pct", "downtime_reduction_pct",
            "downtime_reduction_vs_requeue_pct", "downtime_reduction_vs_redundancy_pct")


def both_configs(arch: dict[str, object], no_arch: dict[str, object]) -> dict[str, object]:
    """The headline keys from the run with the archive (``migrate.archive_dir``: Laminar's
    copies of last resort on storage outside the pool, the storage the baselines checkpoint to;
    see docs/baselines.md); the run without it under ``<key>_no_archive`` (the headline keys and
    every ``laminar_*`` key). The baselines do not depend on the archive: their figures must be
    the same in both runs (checked)."""
    arch.pop("_per", None)
    no_arch.pop("_per", None)
    for k, v in arch.items():
        if k.startswith(("requeue_", "redundancy_")) and no_arch[k] != v:
            raise AssertionError(f"baseline figure {k} differs with and without the archive: {v} vs {no_arch[k]}")
    out = dict(arch)
    out["headline_config"] = "archive"
    for k, v in no_arch.items():
        if k in HEADLINE or k.startswith("laminar_") or k.removesuffix(NA_SUFFIX) in HEADLINE:
            out[f"{k.removesuffix(NA_SUFFIX)}_no_archive{NA_SUFFIX if k.endswith(NA_SUFFIX) else ''}"] = v
    return out


def plot(out: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = ["requeue", "redundancy", "laminar", "laminar_no_archive"]
    labels = ["Slurm requeue", "pipeline\nredundancy", "Laminar\n(archive)", "Laminar\n(no archive)"]

    def val(pol: str, what: str) -> float:
        if pol == "laminar_no_archive":
            return float(str(out[f"laminar_{what}_no_archive"]))
        return float(str(out[f"{pol}_{what}"]))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rb = [val(p, "rollback_node_h") for p in pols]
    ov = [val(p, "overhead_node_h") for p in pols]
    axes[0].bar(labels, rb, label="rolled back (recomputed)", color="#c44")
    axes[0].bar(labels, ov, bottom=rb, label="tolerance overhead (checkpoints, redundancy)", color="#e9a")
    axes[0].set_ylabel("node-hours lost")
    def change(key: str) -> str:  # a reduction of r % is a change of -r %; undefined: n/a
        return fmt_red(out[key])

    axes[0].set_title(f"work lost, archive ({change('workloss_reduction_vs_requeue_pct')} vs requeue, "
                      f"{change('workloss_reduction_vs_redundancy_pct')} vs redundancy; no archive: "
                      f"{change('workloss_reduction_vs_requeue_pct_no_archive')}, "
                      f"{change('workloss_reduction_vs_redundancy_pct_no_archive')})", fontsize=8)
    axes[0].legend(fontsize=7)
    axes[1].bar(labels, [val(p, "downtime_h") for p in pols], color=["#888", "#888", "#2a7", "#9cb"])
    axes[1].set_ylabel("hours without progress")
    axes[1].set_title(f"downtime vs the better baseline: {change('downtime_reduction_pct')} (archive), "
                      f"{change('downtime_reduction_pct_no_archive')} (no archive)", fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{out['scenarios']} scenarios on spot traces {out['trace_sets']}, notice {out['param_notice_s']:.0f}s, "
                 f"{out['param_abrupt_frac']:.0%} abrupt", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="spot-traces directory")
    ap.add_argument("--quick", action="store_true", help="one trace set, 4 scenarios (< 60 s)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--scenarios", type=int, default=12)
    ap.add_argument("--notice", type=float, default=Params.notice_s)
    ap.add_argument("--abrupt-frac", type=float, default=Params.abrupt_frac)
    ap.add_argument("--redundancy-overhead", type=float, default=Params.redundancy_overhead)
    ap.add_argument("--ckpt-gb", type=float, default=Params.ckpt_gb_per_node)
    ap.add_argument("--no-keeper", action="store_true", help="Laminar without storage keepers (migrate.keeper = false)")
    ap.add_argument("--no-holder", action="store_true", help=argparse.SUPPRESS)  # old spelling of --no-keeper
    ap.add_argument("--shrink", action="store_true",
                    help="NOT BUILT, a sensitivity: a job with no free node restarts on the nodes it has (one fewer)")
    ap.add_argument("--retry-max", type=float, default=Params.retry_max_s, help="the keeper's longest wait (s)")
    a = ap.parse_args(argv)
    if a.no_holder:  # old spelling, read for one release
        print("workloss: `--no-holder` is now `--no-keeper`; the old name goes in the next release", file=sys.stderr)  # old spelling
        a.no_keeper = True
    if not a.trace.is_dir():
        ap.error(f"--trace {a.trace}: not a directory (expected ../shared/data/spot-traces)")
    p = Params(notice_s=a.notice, abrupt_frac=a.abrupt_frac, redundancy_overhead=a.redundancy_overhead,
               ckpt_gb_per_node=a.ckpt_gb, keeper=not a.no_keeper, retry_max_s=a.retry_max,
               archive=True, shrink=a.shrink)
    sets = [SETS[0]] if a.quick else list(SETS)
    scen = 4 if a.quick else a.scenarios
    t0 = time.monotonic()
    out = both_configs(run(a.trace, sets, scen, p), run(a.trace, sets, scen, replace(p, archive=False)))
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["quick"] = int(a.quick)
    print(json.dumps(out, indent=1))
    for k, v in out.items():
        if k.endswith(NA_SUFFIX):
            print(f"workloss: {k.removesuffix(NA_SUFFIX)} {v}", file=sys.stderr)
    if a.json:
        a.json.write_text(json.dumps(out))
    if a.plot:
        plot(out, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
