"""The FGD allocation experiment run by the agents' packing mode (real Arbiter and Submitter).

:func:`laminar.sim.allocation.run_allocation` with ``laminar-frag-wide`` models the packing
placement in the simulator's own node model. This module runs the *agent's* code for it
instead: one :class:`laminar.zone.arbiter.Arbiter` per openb node (``packing="frag"``,
its real inventory: GPUs, CPUs, memory, GPU model) and one
:class:`laminar.zone.submitter.Submitter` placing every pod with ``packing=True``
(:meth:`~laminar.zone.submitter.Submitter._place_packing`: whole zones probed,
``packing_spread`` = :data:`~laminar.sim.allocation.FRAG_SPREAD` at a time, every answer
awaited, :func:`laminar.policy.packing.pick_frag_offer` bound), over
:class:`laminar.zone.simnet.SimNet` (a FAKE network: instant, lossless, every message
counted, encoded and decoded by the real wire codec unless ``use_wire=False``).

Same input as the simulator, by the same functions: the node list in file order, node ``i``
(0-based) is SimNet node ``i + 1`` in zone ``i // 64 + 1`` (the simulator's zones ``i // 64``,
shifted by one since SimNet numbers from 1; order and ties to the lowest id are unchanged);
the pods tuned to ``ratio`` x capacity and shuffled by :func:`~laminar.sim.allocation.inflate`
with ``random.Random(seed)``, exactly as ``run_allocation`` does. Pods are placed one by one
and never leave; a pod that fails is dropped.

What may differ from ``laminar-frag-wide`` (the point of running it):

- the mix: ``mix="workload"`` gives every arbiter the workload's mix
  (:func:`~laminar.sim.allocation.workload_mix`, as the simulator does); ``mix="learned"``
  is the agent's default, the mix each node learns from the shapes probed at it
  (:class:`laminar.policy.mixlearn.MixLearner`;
  :data:`laminar.zone.arbiter.DEFAULT_FRAG_MIX` until 16 were seen) merged with the mixes
  its zone peers and the other zones share in their summaries (:class:`MixExchange`, a
  summary round every :data:`MIX_EVERY` pods); ``mix="pooled"`` and ``mix="local"`` are
  diagnostics (one learner shared by every node; each node its own probes only, the agent
  before the shared mix: :data:`DIAGNOSTIC_MIXES`);
- the zones: the submitter takes the zones whose summaries' ``zone_fit`` is positive, where
  the simulator counts the nodes of each zone that can host the pod. ``zone_fit`` reads the
  summaries' host buckets (:func:`laminar.policy.placement.host_buckets`: per shape, the nodes
  that might host a demand of its class grouped by free CPUs, with their largest free CPUs and memory), so a zone where no
  node has GPU, CPU and memory room together says 0; a group's CPUs and memory may come from
  two of its nodes, so it can still say a zone fits when none of its nodes can;
- the arbiter's rounding: CPUs floored to milli-cores, the score's delta carried in
  micro-GPUs on the wire.

Between two pods the fake clock moves :data:`ARRIVAL_GAP_S` (longer than an offer's lease),
so offers left unused by the previous pod have lapsed, as in the simulator where nothing is
held; the zone summaries are refreshed (``only_changed``) after every placement, so the
submitter reads exact summaries (their traffic is background, not counted per pod).

Run it (from the repository root)::

    .venv/bin/python -m laminar.sim.agent_packing --seed 42        # with PYTHONPATH=agent

``--mix-trace N`` prints, every N pods, how far the arbiters' mixes are from the workload's
(:class:`MixTrace`: total variation distances, per zone group, of the probe stream and of
the placed pods).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from laminar.policy import mixlearn
from laminar.policy import packing as K
from laminar.policy import placement as pl
from laminar.policy.mixlearn import mix_distance
from laminar.sim import allocation as A
from laminar.sim.cluster import demand_of
from laminar.sim.trace import JobSpec, NodeSpec, default_data_dir, read_openb_nodes, read_openb_pods
from laminar.zone import wire
from laminar.zone.arbiter import DEFAULT_FRAG_MIX, LEASE_S, Arbiter, wire_to_shares, zone_summary_to_msg
from laminar.zone.membership import Member, Membership
from laminar.zone.simnet import SIM_KEY, SimNet, _AnyNode
from laminar.zone.submitter import PlacementResult

ZONE_SIZE = 64
"""Nodes per zone, as ``run_allocation`` sets them (node ``i`` in zone ``i // 64``)."""

ARRIVAL_GAP_S = 10.0
"""Fake seconds between two pods: past any offer's lease (``LEASE_S`` + the probe timeout)."""

PROBE_TIMEOUT_S = 5.0
"""The submitter's wait for all answers. SimNet has delivered every answer before the wait
starts, but the wait is measured in real time while the answers are read: a short one
(SimNet's 0.05 s) could run out on a loaded machine and mark nodes as missed."""

MIXES = ("workload", "learned")
DIAGNOSTIC_MIXES = ("pooled", "local")
"""``pooled``: a diagnostic, not the agent: every arbiter counts its probes into one shared
:class:`laminar.policy.mixlearn.MixLearner` (each placement once), so all score with the mix of
the whole probe stream. ``local``: the agent before the shared mix (each node its own
probes only, no :class:`MixExchange`). ``learned`` is the agent: each node learns from its
probes and scores with the mixes its zone peers and the other zones share in their summaries."""

MIX_EVERY = 4
"""Pods between two summary rounds of the shared mix (:class:`MixExchange`). The agents send
summaries every second and pods here arrive 10 fake seconds apart, so the agent's mixes are
fresher than these: a round every few pods keeps the run's cost down (each round encodes the
summaries of the nodes probed since the last)."""

ZONE_CHOICES = ("summary", "exact")
"""How the submitter learns which zones can take a pod: ``summary`` (the agent: the zone
summaries' ``zone_fit``, host buckets included; SimNet hands the submitter the summaries
as computed, not their wire form, whose corners are rounded up to a tenth of a core and 64 MB),
``exact`` (a diagnostic, not the agent: the count of the zone's nodes
whose arbiter would accept the pod, what the simulator's ``laminar-frag-wide`` reads)."""

assert ARRIVAL_GAP_S > LEASE_S + PROBE_TIMEOUT_S


@dataclass
class AgentPackingResult:
    """One run: the allocation (the metric of :class:`laminar.sim.allocation.AllocationResult`)
    and the messages (probes, answers, hand-overs and their acknowledgements; releases carried
    in probes cost nothing extra; zone summaries excluded)."""

    mix: str
    zones: str
    seed: int
    pods: int
    placed: int
    failed: int
    allocation_ratio_pct: float
    messages: int
    messages_per_pod: float
    messages_per_placed_pod: float
    wall_s: float
    probes_refused: int  # probes answered with a refusal (nodes of a probed zone without room)
    no_zone: int  # pods no zone summary said could be hosted (no probe sent)
    probe_timeouts: int  # rounds whose wait ran out (0 expected: SimNet loses nothing)
    mix_rounds: int = 0  # summary rounds of the shared mix (MixExchange), 0 without it
    summary_bytes: dict[str, float] | None = None  # summary datagram sizes (mean, max), with and without the mix


def build_net(nodes: Sequence[NodeSpec], mix: K.ShapeMix | None, seed: int = 42, use_wire: bool = True) -> SimNet:
    """A SimNet of ``nodes`` (node ``i`` is SimNet node ``i + 1``, zone ``i // 64 + 1``), each
    with a ``packing="frag"`` :class:`Arbiter` holding the node's real inventory; ``mix``
    given to every arbiter, or None for the agent's learned mix. Summaries computed."""
    if not nodes:
        raise ValueError("agent packing: the node list is empty; give at least one node with GPUs")
    members = [Member(i + 1, i // ZONE_SIZE + 1, f"10.{(i + 1) >> 16}.{((i + 1) >> 8) & 255}.{(i + 1) & 255}",
                      7440, 7441) for i in range(len(nodes))]
    arbiters = {}
    for m, n in zip(members, nodes, strict=True):
        inv = pl.NodeCapacity(m.node, m.zone, (1.0,) * n.gpus, float(n.cpus), int(n.memory_mb), n.model or None)
        arbiters[m.node] = Arbiter(inv, hold_s=30.0, packing="frag", mix=mix)
    net = SimNet(arbiters, Membership(self_node=1, members=members), random.Random(seed + 1), submitter_node=1,
                 use_wire=use_wire)
    net.refresh_summaries()
    return net


def allocated_gpus(net: SimNet) -> float:
    """GPUs held by placed jobs, over every arbiter; checks that no GPU, CPU or memory of any
    node is over-allocated (raises AssertionError naming the node otherwise)."""
    total = 0.0
    for node, a in net.arbiters.items():
        inv = a.inventory
        used = [0.0] * len(inv.gpu_free)
        cpus = 0.0
        mem = 0
        for p in a.placed.values():
            r = p.reservation
            for i, f in r.gpu_alloc:
                used[i] += f
            cpus += r.demand.cpus
            mem += r.demand.memory_mb
        for i, u in enumerate(used):
            if u > inv.gpu_free[i] + 1e-6:
                raise AssertionError(f"node {node}: GPU {i} allocated {u:.3f} of {inv.gpu_free[i]}")
        if cpus > inv.cpus + 1e-6 or mem > inv.memory_mb:
            raise AssertionError(f"node {node}: {cpus} CPUs / {mem} MB placed of {inv.cpus} / {inv.memory_mb}")
        total += sum(used)
    return total


class ExactZoneFits:
    """``zone_fits`` for the submitter from the arbiters themselves (the ``exact`` zone choice,
    a diagnostic): for each zone in id order, how many of its nodes' arbiters would accept
    ``demand`` now (their residual, :func:`laminar.policy.placement.fits`), until ``wanted``
    zones with a host were found (the packing placement never probes more); later zones are
    left out. Cached per zone until :meth:`changed` names one of its nodes."""

    def __init__(self, net: SimNet, wanted: int) -> None:
        self.net = net
        self.wanted = wanted
        self._zones = {z: net.membership.zone_list(z) for z in net.membership.zones()}
        self._cache: dict[int, dict[tuple[float, float, int], int]] = {z: {} for z in self._zones}

    def changed(self, node: int | None) -> None:
        m = self.net.membership.by_node.get(node) if node is not None else None
        if m is not None:
            self._cache[m.zone].clear()

    def __call__(self, demand: pl.Demand) -> dict[int, float]:
        key = (demand.gpus, demand.cpus, demand.memory_mb)
        now = self.net.clock_s
        out: dict[int, float] = {}
        found = 0
        for z in sorted(self._zones):
            c = self._cache[z]
            if key not in c:
                c[key] = sum(1 for n in self._zones[z]
                             if pl.fits(self.net.arbiters[n].view(now), demand) is None)
            out[z] = float(c[key])
            found += c[key] > 0
            if found >= self.wanted:
                break
        return out


class MixExchange:
    """The shared shape mix of the ``frag`` agents over the fake network, by the agent's code:
    each node's summary (:meth:`Arbiter.summary`, its learned mix as the optional trailer) to
    its zone peers, each zone's merged mix in its zone summary
    (:func:`laminar.zone.arbiter.zone_summary_to_msg`) to the other zones, through the wire
    codec (one datagram each, :data:`wire.MAX_DATAGRAM` enforced) unless ``use_wire`` is False
    (then the same quantized values without the envelope); each arbiter then scores with its
    own counts plus its zone peers' and the other zones' mixes
    (:meth:`Arbiter.set_peer_weights`, the weights :func:`laminar.policy.mixlearn.merge_shares`
    gives for those parts). As in an agent that holds every peer's fresh summary: every node
    hears every zone peer and every zone (summaries are not counted as placement messages).

    Cost: a node's summary is encoded again only when it counted probes since the last round;
    the merge per node is its zone's and the other zones' merged weights less its own part
    (O(nodes x shapes) a round). ``sizes`` records the summary datagrams' sizes in bytes, with
    and without the mix (``node``, ``node_before``, ``zone``, ``zone_before``)."""

    def __init__(self, net: SimNet, use_wire: bool = True) -> None:
        self.net = net
        self.use_wire = use_wire
        self.zones = {z: net.membership.zone_list(z) for z in net.membership.zones()}
        self._part: dict[int, mixlearn.Shares] = {}  # node -> its mix as its peers decoded it
        self._seen: dict[int, int] = {}  # node -> learner.seen at its last summary
        self._enc: dict[int, wire.Encoder] = {}
        self._dec = wire.Decoder(SIM_KEY, _AnyNode())
        self.sizes: dict[str, list[int]] = {"node": [], "node_before": [], "zone": [], "zone_before": []}
        self.rounds = 0

    def _carry(self, src: int, zone: int, body: wire.Body, kind: str, before: wire.Body) -> wire.Body:
        if not self.use_wire:
            return body
        enc = self._enc.get(src)
        if enc is None:
            enc = self._enc[src] = wire.Encoder(src, SIM_KEY, seq0=1)
        data = enc.encode(body, zone, self.net.clock_s)  # raises past one datagram
        self.sizes[kind].append(len(data))
        self.sizes[kind + "_before"].append(wire.HEADER_SIZE + len(wire.encode_body(before)) + wire.MAC_SIZE)
        return self._dec.decode(data, self.net.clock_s).body

    def round(self) -> None:
        """One summary round: every node's mix to its peers, every zone's to the others."""
        self.rounds += 1
        net, now = self.net, self.net.clock_s
        for node, a in net.arbiters.items():
            seen = a.mix_learner.seen
            if self._seen.get(node) == seen:
                continue
            self._seen[node] = seen
            body = a.summary(now)
            got = self._carry(node, net.membership.by_node[node].zone, body, "node", replace(body, mix=(), mix_weight=0))
            assert isinstance(got, wire.Summary)
            part = wire_to_shares(got.mix, got.mix_weight)
            if part is None:
                self._part.pop(node, None)
            else:
                self._part[node] = part
        inside: dict[int, dict[K.Shape, float]] = {}  # zone -> its nodes' merged weights
        shared: dict[int, dict[K.Shape, float]] = {}  # zone -> its zone summary's mix, as received
        for z, members in self.zones.items():
            parts = [self._part[n] for n in members if n in self._part]
            inside[z] = mixlearn.merge_shares(parts)
            zmix = mixlearn.top_shares(inside[z]) if parts else None
            zs = net.zone_summaries.get(z)
            if zs is None or zmix is None:
                continue
            zbody = zone_summary_to_msg(zs, zmix)
            zgot = self._carry(members[0], z, zbody, "zone", replace(zbody, mix=(), mix_weight=0))
            assert isinstance(zgot, wire.ZoneSummaryMsg)
            part = wire_to_shares(zgot.mix, zgot.mix_weight)
            if part is not None:
                shared[z] = mixlearn.merge_shares([part])
        everyone = mixlearn.merge_shares([])
        for w in shared.values():
            for s_, v in w.items():
                everyone[s_] = everyone.get(s_, 0.0) + v
        for z, members in self.zones.items():
            base = dict(inside[z])
            for s_, v in everyone.items():
                base[s_] = base.get(s_, 0.0) + v
            for s_, v in shared.get(z, {}).items():  # the other zones only
                base[s_] -= v
            for n in members:
                own = self._part.get(n)
                w = dict(base)
                if own is not None:  # its zone peers only
                    total, items = own
                    for s_, p in items:
                        w[s_] -= total * p
                net.arbiters[n].set_peer_weights({s_: v for s_, v in w.items() if v > 1e-9 * (1 + abs(v))})


def mix_classes(mix: K.ShapeMix) -> dict[str, float]:
    """A mix's probability by class: CPU-only, a share of one GPU, one whole GPU, several GPUs."""
    out = {"cpu": 0.0, "share": 0.0, "gpu1": 0.0, "gpus": 0.0}
    for s, p in mix:
        out["cpu" if s.num_gpus == 0 else "share" if s.gpu_milli < K.MILLI else "gpu1" if s.num_gpus == 1
            else "gpus"] += p
    return out


class MixTrace:
    """Instrumentation for :func:`run_agent_packing` (``observe``): every ``every`` pods, how far
    the mixes the arbiters score with are from ``reference`` (the workload's mix) and from the
    mix of the pods that arrived so far; the probe stream's own mix (each pod's shape counted
    once per probe sent for it) and the placed pods' mix. Rows go to ``rows`` (and ``out``)."""

    def __init__(self, reference: K.ShapeMix, every: int, out: Callable[[str], None] | None = None) -> None:
        if every <= 0:
            raise ValueError(f"mix trace: every {every!r} must be > 0")
        self.reference = reference
        self.every = every
        self.out = out
        self.rows: list[dict[str, object]] = []
        self._arrived: Counter[K.Shape] = Counter()
        self._placed: Counter[K.Shape] = Counter()
        self._probes: Counter[K.Shape] = Counter()
        self._probes_of = {"placed": 0, "failed": 0}
        self._pods_of = {"placed": 0, "failed": 0}
        self._repeat = 0  # probes that went to a node already probed for the same pod

    @staticmethod
    def _mix(c: Counter[K.Shape]) -> K.ShapeMix:
        return K.shape_mix(c.elements(), A.MIX_COVERAGE)

    def __call__(self, i: int, pod: JobSpec, r: PlacementResult, net: SimNet) -> None:
        shape = K.shape_of(pod.worker_gpus, pod.worker_cpus)
        self._arrived[shape] += 1
        kind = "placed" if r.outcome == "placed" else "failed"
        if kind == "placed":
            self._placed[shape] += 1
        self._probes[shape] += len(r.probed)
        self._probes_of[kind] += len(r.probed)
        self._pods_of[kind] += 1
        self._repeat += len(r.probed) - len(set(r.probed))
        if (i + 1) % self.every:
            return
        arrived = self._mix(self._arrived)
        mixes = {n: a.shape_mix() for n, a in net.arbiters.items()}
        learned = [m for m in mixes.values() if m is not self._default]
        zone = {n: net.membership.by_node[n].zone for n in mixes}
        d_ref = [mix_distance(m, self.reference) for m in learned]
        d_arr = [mix_distance(m, arrived) for m in learned]
        pooled: dict[K.Shape, float] = {}
        for m in learned:
            for s, p in m:
                pooled[s] = pooled.get(s, 0.0) + p / len(learned)
        pooled_mix = tuple(sorted(pooled.items(), key=lambda kv: -kv[1]))
        early = [mix_distance(m, self.reference) for n, m in mixes.items() if m is not self._default and zone[n] <= 4]
        late = [mix_distance(m, self.reference) for n, m in mixes.items() if m is not self._default and zone[n] > 4]
        def mean(x: list[float]) -> float | None:
            return round(sum(x) / len(x), 3) if x else None
        row: dict[str, object] = {
            "pods": i + 1, "nodes_learned": len(learned),
            "node_tv_workload": mean(d_ref), "node_tv_arrived": mean(d_arr),
            "node_tv_workload_zones1_4": mean(early), "node_tv_workload_zones5_": mean(late),
            "pooled_tv_workload": round(mix_distance(pooled_mix, self.reference), 3),
            "probe_stream_tv_workload": round(mix_distance(self._mix(self._probes), self.reference), 3)
            if self._probes else None,
            "placed_tv_workload": round(mix_distance(self._mix(self._placed), self.reference), 3)
            if self._placed else None,
            "arrived_tv_workload": round(mix_distance(arrived, self.reference), 3),
            "probes_per_placed": round(self._probes_of["placed"] / max(1, self._pods_of["placed"]), 1),
            "probes_per_failed": round(self._probes_of["failed"] / max(1, self._pods_of["failed"]), 1),
            "repeat_probes": self._repeat,
            "classes_workload": {k: round(v, 3) for k, v in mix_classes(self.reference).items()},
            "classes_pooled": {k: round(v, 3) for k, v in mix_classes(pooled_mix).items()},
            "classes_probes": {k: round(v, 3) for k, v in mix_classes(self._mix(self._probes)).items()}
            if self._probes else None,
        }
        self.rows.append(row)
        if self.out is not None:
            self.out(json.dumps(row))

    _default: K.ShapeMix = DEFAULT_FRAG_MIX


def run_agent_packing(
    nodes: Sequence[NodeSpec], pods: Sequence[JobSpec], seed: int = 42, ratio: float = 1.3, *, mix: str = "workload",
    spread: int = A.FRAG_SPREAD, use_wire: bool = True, limit: int | None = None, zones: str = "summary",
    observe: Callable[[int, JobSpec, PlacementResult, SimNet], None] | None = None, mix_every: int = MIX_EVERY,
) -> AgentPackingResult:
    """One run of the experiment by the agents (see the module docs); deterministic for ``seed``.

    ``mix``: ``"workload"`` (every arbiter scores with the workload's mix, as the simulator),
    ``"learned"`` (the agent's default) or ``"pooled"`` (:data:`DIAGNOSTIC_MIXES`). ``zones``: one of :data:`ZONE_CHOICES`. ``limit``: place only the first ``limit`` pods of
    the shuffled list (a prefix, for timing); the ratio is still over the whole cluster.
    ``observe(i, pod, result, net)``: called after the ``i``-th pod's placement (instrumentation,
    e.g. :class:`MixTrace`); it must not change the arbiters. ``mix_every``: pods between two
    summary rounds of the shared mix (``mix="learned"``, :class:`MixExchange`)."""
    if mix not in MIXES + DIAGNOSTIC_MIXES:
        raise ValueError(f"agent packing: mix {mix!r}; choose one of {', '.join(MIXES + DIAGNOSTIC_MIXES)}")
    if zones not in ZONE_CHOICES:
        raise ValueError(f"agent packing: zones {zones!r}; choose one of {', '.join(ZONE_CHOICES)}")
    if mix_every < 1:
        raise ValueError(f"agent packing: mix_every {mix_every!r} must be >= 1 pod")
    if limit is not None and limit < 0:
        raise ValueError(f"agent packing: limit {limit!r} must be >= 0 (or None for every pod)")
    capacity = float(sum(n.gpus for n in nodes))
    if capacity <= 0:
        raise ValueError("agent packing: the node list has no GPU")
    t0 = time.monotonic()
    full = A.inflate(pods, capacity, ratio, random.Random(seed))  # the same list as run_allocation's
    work = full if limit is None else full[:limit]
    net = build_net(nodes, A.workload_mix(full) if mix == "workload" else None, seed, use_wire)
    if mix == "pooled":
        shared = next(iter(net.arbiters.values())).mix_learner
        for a in net.arbiters.values():
            a.mix_learner = shared
    exchange = MixExchange(net, use_wire) if mix == "learned" else None
    sub = net.submitter(A.FRAG_RETRY)
    exact = ExactZoneFits(net, A.FRAG_RETRY.zones * spread)
    if zones == "exact":
        sub.zone_fits = exact
    sub.packing_spread = spread
    sub.probe_timeout_s = PROBE_TIMEOUT_S
    placed = failed = no_zone = 0

    async def go() -> None:
        nonlocal placed, failed, no_zone
        for i, p in enumerate(work):
            r = await sub.place(demand_of(p.worker_gpus, p.worker_cpus, p.worker_memory_mb), {"name": p.job_id},
                                packing=True)
            if r.outcome == "placed":
                placed += 1
                exact.changed(r.node)
            else:
                failed += 1
                no_zone += not r.probed
            if observe is not None:
                observe(i, p, r, net)
            net.clock_s += ARRIVAL_GAP_S
            net.refresh_summaries(only_changed=True)
            if exchange is not None and (i + 1) % mix_every == 0:
                exchange.round()

    asyncio.run(go())
    used = allocated_gpus(net)
    refused = sum(a.counts["refusals"] for a in net.arbiters.values())
    n = len(work)
    sizes = None
    if exchange is not None and exchange.sizes["node"]:
        sizes = {f"{k}_{f}": round(g(v), 1) for k, v in exchange.sizes.items() if v
                 for f, g in (("mean", lambda x: sum(x) / len(x)), ("max", max))}
    return AgentPackingResult(mix, zones, seed, n, placed, failed, 100 * used / capacity, net.messages,
                              net.messages / n if n else 0.0, net.messages / placed if placed else 0.0,
                              time.monotonic() - t0, refused, no_zone,
                              sub.counts["probe_timeouts"], exchange.rounds if exchange is not None else 0, sizes)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the FGD allocation experiment run by the agents' packing mode "
                                 "(real Arbiter/Submitter over SimNet, a fake network), beside laminar-frag-wide")
    ap.add_argument("--seed", type=int, action="append", help="seed (repeatable; default 42)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="directory of the openb CSVs")
    ap.add_argument("--mix", choices=(*MIXES, *DIAGNOSTIC_MIXES, "both"), default="both",
                    help="both: workload and learned (the agent: mixes shared in the summaries); pooled: a diagnostic "
                    "(one learner shared by every node); local: each node its own probes only (before the shared mix)")
    ap.add_argument("--mix-every", type=int, default=MIX_EVERY, metavar="N",
                    help="pods between two summary rounds of the shared mix (learned)")
    ap.add_argument("--zones", choices=(*ZONE_CHOICES, "both"), default="summary",
                    help="zone choice: the summaries (the agent), exact host counts (a diagnostic), or both")
    ap.add_argument("--limit", type=int, default=None, help="place only the first N pods (timing)")
    ap.add_argument("--no-wire", action="store_true", help="skip the wire codec (faster; same decisions)")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator's laminar-frag-wide run")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--mix-trace", type=int, default=0, metavar="N",
                    help="every N pods, print how far the arbiters' mixes are from the workload's (MixTrace)")
    args = ap.parse_args(argv)
    nodes = read_openb_nodes(args.data / "openb_node_list_gpu_node.csv")
    pods = read_openb_pods(args.data / "openb_pod_list_default.csv")
    out: list[dict[str, object]] = []
    for seed in args.seed or [42]:
        if not args.no_sim and args.limit is None:
            t = time.monotonic()
            s = A.run_allocation(nodes, pods, "laminar-frag-wide", seed=seed)
            row = {"run": "sim laminar-frag-wide", "seed": seed, "pods": s.pods, "failed": s.failed,
                   "allocation_ratio_pct": round(s.allocation_ratio_pct, 2), "messages": s.messages,
                   "messages_per_placed_pod": round(s.messages / max(1, s.pods - s.failed), 1),
                   "wall_s": round(time.monotonic() - t, 1)}
            print(json.dumps(row), flush=True)
            out.append(row)
        for mix, zones in [(m, z) for m in (MIXES if args.mix == "both" else (args.mix,))
                           for z in (ZONE_CHOICES if args.zones == "both" else (args.zones,))]:
            trace = None
            if args.mix_trace:
                ref = A.workload_mix(A.inflate(pods, float(sum(n.gpus for n in nodes)), 1.3, random.Random(seed)))
                trace = MixTrace(ref, args.mix_trace, out=lambda line: print(line, flush=True))
            r = run_agent_packing(nodes, pods, seed, mix=mix, use_wire=not args.no_wire, limit=args.limit, zones=zones,
                                  observe=trace, mix_every=args.mix_every)
            row = {"run": f"agent mix={mix} zones={zones}"} | {k: round(v, 2) if isinstance(v, float) else v
                                                 for k, v in asdict(r).items()}
            print(json.dumps(row), flush=True)
            out.append(row)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
