"""Placement policy: pure functions shared by the agent and the simulator.

Nothing in this module does I/O, reads a clock or draws randomness of its own: every function
takes ``now`` and ``rng`` as arguments, so the agent (``laminar.zone.component``), the simulated
transport (``laminar.zone.simnet``) and the trace-driven simulator (``laminar.sim``) run the
same decisions on the same inputs.

The placement of one job goes like this (probe-first, execute-later):

1. The submitter holds a :class:`ZoneSummary` per zone (residual capacity by shape, spread by
   the agents at a bounded rate). :func:`zone_fit` turns a summary and a :class:`Demand` into a
   number; :func:`choose_zone` picks a zone with probability proportional to it.
2. :func:`probe_targets` samples ``d`` members of that zone (O(d), whatever the zone's size).
3. Each probed node runs :func:`arbitrate` against its own :class:`NodeCapacity` and the
   reservations it already holds: it answers an :class:`Offer` (a tentative reservation with a
   lease) or a :class:`Refusal` with a :class:`RefuseReason`.
4. The submitter binds the first good offer (:func:`pick_offer`, late binding) by handing the
   job over to that node; the other offers are not released (a datagram each): their short
   lease runs out. Zone summaries name a few nodes with room for each shape that not every
   node can take (:func:`hinted_nodes`); one of the ``d`` probes goes to such a node, so a
   scarce shape is rarely refused by every node probed.
5. When no offer comes, :func:`retry_schedule` says what to do next: widen ``d``, then try the
   next zone, then queue the job and try again later.

Example::

    >>> import random
    >>> node = NodeCapacity(node=7, zone=1, gpu_free=(1.0, 1.0, 0.5), cpus=32, memory_mb=128_000)
    >>> d = Demand(gpus=0.5, cpus=4, memory_mb=16_000)
    >>> offer = arbitrate(node, [], d, now=100.0, placement_id=42, lease_s=2.0)
    >>> offer.gpu_alloc          # best fit: the half-used GPU 2, not a whole one
    ((2, 0.5),)
"""

from __future__ import annotations

import bisect
import enum
import functools
import heapq
import math
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

# GPU fractions are compared with this slack so that 0.25 + 0.25 + 0.5 == 1.0 holds.
EPS = 1e-6

# GPU shapes a zone summary counts slots for: the CPU-only shape (0), fractional shares, and
# whole-GPU gangs. A demand is counted against the smallest shape at least as large as it.
SHAPES: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)

# Most GPUs one node may declare (the wire format carries one byte per GPU).
MAX_GPUS_PER_NODE = 64

# Nodes a zone summary names per shape as having room for it (ZoneSummary.hints), for the
# shapes not every node can take (HINT_BELOW): 4 bytes a node id, so at most 7 x 16 x 4 = 448
# bytes of a zone-summary datagram. Sixteen spread the hinted probes of a busy summary interval
# over several nodes; the wire allows up to MAX_HINTS.
HINTS_PER_SHAPE = 16
MAX_HINTS = 32
# Shapes that at least this share of a zone's nodes have room for get no hints: two uniform
# probes both miss such a shape at most (1 - 0.75)^2 = 6 % of the time, and hinting them would
# only crowd probes onto a few nodes.
HINT_BELOW = 1.0

# Host buckets of a zone summary (ZoneSummary.hosts): per shape, the nodes that might host a
# demand of its class (host_classes: e.g. a 0.3-GPU demand on a GPU with 0.4 free) grouped by free CPUs, largest first, in groups of HOST_BUCKET_SIZES nodes (the last group
# takes the rest); each group is sent as (nodes, their largest free CPUs, their largest free
# memory). Eight groups: on the wire 6 bytes a group, at most 7 x (1 + 8 x 6) = 343 bytes.
HOST_BUCKET_SIZES: tuple[int, ...] = (1, 1, 2, 4, 8, 16, 32)
MAX_HOST_BUCKETS = len(HOST_BUCKET_SIZES) + 1

HostBucket = tuple[int, float, float]
"""``(nodes, cpus, memory_mb)``: a group of nodes with room for a shape, with the largest free
CPUs and the largest free memory (MB) among them (``math.inf``: more than the wire can say)."""


class PlacementError(ValueError):
    """A demand, capacity or policy value is out of range; the message names it."""


@dataclass(frozen=True)
class Demand:
    """What one job asks for.

    ``gpus`` may be fractional: ``0.5`` is half of one GPU; ``2`` is two whole GPUs; ``1.5``
    is one whole GPU plus half of another. ``gpu_model`` (e.g. ``"H100"``), when set, is a hard
    requirement. ``pool``, when set, is a preference: probes go to that pool's members first.
    """

    gpus: float = 0.0
    cpus: float = 1.0
    memory_mb: int = 1024
    gpu_model: str | None = None
    pool: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.gpus, (int, float)) and math.isfinite(self.gpus) and 0 <= self.gpus <= MAX_GPUS_PER_NODE):
            raise PlacementError(f"demand: gpus {self.gpus!r} must be a number in 0..{MAX_GPUS_PER_NODE}")
        if abs(self.gpus * 100 - round(self.gpus * 100)) > EPS * 100:
            raise PlacementError(f"demand: gpus {self.gpus!r} must be a multiple of 0.01")
        if not (isinstance(self.cpus, (int, float)) and math.isfinite(self.cpus) and 0 <= self.cpus <= 65535):
            raise PlacementError(f"demand: cpus {self.cpus!r} must be a number in 0..65535")
        if not (isinstance(self.memory_mb, int) and 0 <= self.memory_mb < 2**32):
            raise PlacementError(f"demand: memory_mb {self.memory_mb!r} must be an integer in 0..2^32-1")
        if self.gpu_model is not None and not (0 < len(self.gpu_model.encode()) <= 32):
            raise PlacementError(f"demand: gpu_model {self.gpu_model!r} must be 1..32 bytes")
        if self.pool is not None and not (0 < len(self.pool.encode()) <= 32):
            raise PlacementError(f"demand: pool {self.pool!r} must be 1..32 bytes")


@dataclass(frozen=True)
class NodeCapacity:
    """What a node has free for new jobs, before counting the reservations it holds.

    ``gpu_free`` holds one entry per GPU: the free fraction of it (1.0 idle, 0.0 taken).
    The agent builds this from its declared or discovered inventory minus its running jobs;
    the simulator builds it from its model of the node. ``draining`` nodes (being reclaimed
    by their owner) refuse everything.
    """

    node: int
    zone: int
    gpu_free: tuple[float, ...] = ()
    cpus: float = 0.0
    memory_mb: int = 0
    gpu_model: str | None = None
    pool: str | None = None
    draining: bool = False

    def __post_init__(self) -> None:
        if len(self.gpu_free) > MAX_GPUS_PER_NODE:
            raise PlacementError(f"node {self.node}: {len(self.gpu_free)} GPUs, at most {MAX_GPUS_PER_NODE}")
        for i, f in enumerate(self.gpu_free):
            if not (-EPS <= f <= 1 + EPS):
                raise PlacementError(f"node {self.node}: gpu {i} free fraction {f!r} must be in 0..1")
        if self.cpus < -EPS or self.memory_mb < 0:
            raise PlacementError(f"node {self.node}: cpus {self.cpus!r} and memory_mb {self.memory_mb!r} must be >= 0")


GpuAlloc = tuple[tuple[int, float], ...]
"""Which GPUs a reservation takes: ``((gpu index, fraction), ...)``."""


@dataclass(frozen=True)
class Reservation:
    """Capacity a node has promised: tentative (an offer under lease) or committed.

    A reservation counts against the node until ``expires_at`` (same clock as ``now``); a
    committed one is given a longer lease by the agent, covering the job hand-over.
    """

    placement_id: int
    demand: Demand
    gpu_alloc: GpuAlloc
    expires_at: float
    committed: bool = False

    def live(self, now: float) -> bool:
        """True while this reservation still counts against the node."""
        return now < self.expires_at


@dataclass(frozen=True)
class Offer:
    """A node's yes: it holds ``reservation`` for the submitter until the lease ends."""

    node: int
    zone: int
    pool: str | None
    reservation: Reservation

    @property
    def placement_id(self) -> int:
        return self.reservation.placement_id

    @property
    def expires_at(self) -> float:
        return self.reservation.expires_at

    @property
    def gpu_alloc(self) -> GpuAlloc:
        return self.reservation.gpu_alloc


class RefuseReason(enum.IntEnum):
    """Why a node refused a probe (values travel on the wire: append only)."""

    NO_GPU = 1  # not enough free GPU (whole or fractional) for the demand
    GPU_MODEL = 2  # the node's GPUs are not the model the demand requires
    NO_CPU = 3
    NO_MEMORY = 4
    DRAINING = 5  # the node is being reclaimed by its owner
    BUSY = 6  # the node holds its most tentative reservations already
    UNKNOWN_PLACEMENT = 7  # commit/release for a placement this node does not hold
    POOL_BUSY = 8  # a node of the loaning pool (inference) is serving its own load: no loans now


@dataclass(frozen=True)
class Refusal:
    node: int
    reason: RefuseReason


# --------------------------------------------------------------------------- node-local policy


def allocate_gpus(gpu_free: Sequence[float], gpus: float) -> GpuAlloc | None:
    """Pick GPUs for ``gpus`` from the free fractions ``gpu_free``, or None if they do not fit.

    Whole GPUs come from fully free GPUs (lowest indices first). A fractional remainder goes
    best-fit: to the GPU whose free fraction is the smallest that still holds it, so partly
    used GPUs fill up before idle ones are broken. ``gpus == 0`` returns ``()``.
    """
    whole = int(gpus + EPS)
    frac = round(gpus - whole, 6)
    if frac < EPS:
        frac = 0.0
    alloc: list[tuple[int, float]] = []
    taken: set[int] = set()
    if whole:
        idle = [i for i, f in enumerate(gpu_free) if f >= 1.0 - EPS]
        if len(idle) < whole:
            return None
        for i in idle[:whole]:
            alloc.append((i, 1.0))
            taken.add(i)
    if frac:
        best: int | None = None
        for i, f in enumerate(gpu_free):
            if i in taken or f < frac - EPS:
                continue
            if best is None or f < gpu_free[best] - EPS:
                best = i
        if best is None:
            return None
        alloc.append((best, frac))
    return tuple(alloc)


_MODEL_WORDS = re.compile(r"[\s_-]+")


@functools.lru_cache(maxsize=256)
def model_matches(want: str, have: str | None) -> bool:
    """True when a demand's ``gpu_model`` names a node's: the same name, or a run of its words
    (case-insensitive; words split at spaces, ``-`` and ``_``). A node advertises NVML's name
    (``"NVIDIA H100 80GB HBM3"``), which ``"H100"``, ``"h100 80gb"`` and the full name all
    match; ``"A10"`` does not match ``"NVIDIA A100-SXM4-40GB"`` (a different word), and nothing
    matches a node with no model."""
    if not have:
        return False
    if want == have:
        return True
    w = [x for x in _MODEL_WORDS.split(want.lower()) if x]
    h = [x for x in _MODEL_WORDS.split(have.lower()) if x]
    return bool(w) and any(h[i:i + len(w)] == w for i in range(len(h) - len(w) + 1))


def residual(node: NodeCapacity, held: Iterable[Reservation], now: float) -> NodeCapacity:
    """``node`` less every reservation in ``held`` that is live at ``now``.

    Expired reservations count for nothing: that is how a lost release or a dead submitter
    gives capacity back.
    """
    gpu: list[float] | None = None
    cpus, mem = node.cpus, node.memory_mb
    for r in held:
        if not r.expires_at > now:
            continue
        if r.gpu_alloc:
            if gpu is None:
                gpu = list(node.gpu_free)
            for i, f in r.gpu_alloc:
                if 0 <= i < len(gpu):
                    gpu[i] = max(0.0, round(gpu[i] - f, 6))
        cpus -= r.demand.cpus
        mem -= r.demand.memory_mb
    # on the probe path (thousands a second): the values are in range by construction, so the
    # checks of NodeCapacity.__post_init__ are skipped (the fields are filled in directly)
    out = object.__new__(NodeCapacity)
    out.__dict__.update(node=node.node, zone=node.zone, gpu_free=node.gpu_free if gpu is None else tuple(gpu),
                        cpus=max(0.0, cpus), memory_mb=max(0, mem), gpu_model=node.gpu_model, pool=node.pool,
                        draining=node.draining)
    return out


def fits(node: NodeCapacity, demand: Demand) -> RefuseReason | None:
    """None when ``demand`` fits in ``node`` as it is, else the first reason it does not.

    ``node`` should already be a :func:`residual` when reservations are held.
    """
    if node.draining:
        return RefuseReason.DRAINING
    if demand.gpus > 0:
        if demand.gpu_model is not None and not model_matches(demand.gpu_model, node.gpu_model):
            return RefuseReason.GPU_MODEL
        if allocate_gpus(node.gpu_free, demand.gpus) is None:
            return RefuseReason.NO_GPU
    if demand.cpus > node.cpus + EPS:
        return RefuseReason.NO_CPU
    if demand.memory_mb > node.memory_mb:
        return RefuseReason.NO_MEMORY
    return None


def arbitrate(
    node: NodeCapacity,
    held: Sequence[Reservation],
    demand: Demand,
    now: float,
    *,
    placement_id: int,
    lease_s: float,
    max_tentative: int = 64,
) -> Offer | Refusal:
    """Decide a probe on the node itself: an :class:`Offer` holding a tentative reservation
    that lasts ``lease_s`` from ``now``, or a :class:`Refusal` with the reason.

    Counts every live reservation in ``held`` against the node first, so two submitters can
    never be promised the same capacity. Idempotent: a probe for a ``placement_id`` the node
    already holds (a retransmission) gets the same offer back, lease unchanged. The caller
    stores ``offer.reservation``; this function changes nothing.
    """
    if lease_s <= 0:
        raise PlacementError(f"arbitrate: lease_s {lease_s!r} must be > 0")
    live = [r for r in held if r.expires_at > now]  # Reservation.live(), inlined: the probe path
    for r in live:
        if r.placement_id == placement_id:
            return Offer(node.node, node.zone, node.pool, r)
    if sum(1 for r in live if not r.committed) >= max_tentative:
        return Refusal(node.node, RefuseReason.BUSY)
    free = residual(node, live, now)
    why = fits(free, demand)
    if why is not None:
        return Refusal(node.node, why)
    alloc = allocate_gpus(free.gpu_free, demand.gpus)
    assert alloc is not None  # fits() said the GPUs fit
    return Offer(node.node, node.zone, node.pool, Reservation(placement_id, demand, alloc, now + lease_s))


def commit(held: Sequence[Reservation], placement_id: int, now: float, hold_s: float) -> Reservation | None:
    """The reservation for ``placement_id`` made committed, its lease extended to
    ``now + hold_s`` (the hand-over window); None when the node holds no live one (its lease
    ran out, or it never offered): the submitter must then try elsewhere.

    Idempotent: committing a committed reservation extends nothing and returns it as it is.
    """
    for r in held:
        if r.placement_id == placement_id and r.live(now):
            if r.committed:
                return r
            return Reservation(r.placement_id, r.demand, r.gpu_alloc, max(r.expires_at, now + hold_s), True)
    return None


# --------------------------------------------------------------------------- zone summaries


@dataclass(frozen=True)
class ZoneSummary:
    """A zone's residual capacity by shape, as spread between agents.

    ``slots[k]`` is how many instances of GPU shape ``SHAPES[k]`` the zone's nodes could take
    (shape 0: how many nodes take a CPU-only job at all). ``cpus`` and ``memory_mb`` are the
    zone's free totals; ``gpu_models`` the GPU models present. ``nodes`` counts live nodes.

    ``hosts[k]`` (empty when the summary has none: an older peer's) holds the nodes that might
    host a demand of shape ``k``'s class (:func:`host_classes`) as :data:`HostBucket` groups, so :func:`zone_fit` can count the nodes that
    could host a demand (GPU, CPU and memory room on the same node) instead of summing the
    zone's resources; see :func:`host_buckets`.
    """

    zone: int
    nodes: int
    slots: tuple[int, ...]
    cpus: float
    memory_mb: int
    gpu_models: tuple[str, ...] = ()
    issued_at: float = 0.0
    hints: tuple[tuple[int, ...], ...] = ()
    hosts: tuple[tuple[HostBucket, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.slots) != len(SHAPES):
            raise PlacementError(f"zone summary {self.zone}: {len(self.slots)} slots, expected {len(SHAPES)}")
        if len(self.hints) > len(SHAPES):
            raise PlacementError(f"zone summary {self.zone}: hints for {len(self.hints)} shapes, at most {len(SHAPES)}")
        if len(self.hosts) > len(SHAPES) or any(len(b) > MAX_HOST_BUCKETS for b in self.hosts):
            raise PlacementError(f"zone summary {self.zone}: host buckets for {len(self.hosts)} shapes, at most "
                                 f"{len(SHAPES)} of {MAX_HOST_BUCKETS} buckets each")


def shape_slots(node: NodeCapacity) -> tuple[int, ...]:
    """How many instances of each shape in :data:`SHAPES` fit on ``node`` (GPU only)."""
    if node.draining:
        return tuple(0 for _ in SHAPES)
    idle = sum(1 for f in node.gpu_free if f >= 1.0 - EPS)
    out: list[int] = []
    for s in SHAPES:
        if s == 0:
            out.append(1)
        elif s < 1:
            out.append(sum(int((f + EPS) // s) for f in node.gpu_free))
        else:
            out.append(idle // int(s))
    return tuple(out)


def host_classes(node: NodeCapacity) -> tuple[bool, ...]:
    """For each shape in :data:`SHAPES`, whether ``node`` might host a demand of that shape's
    class: the GPU demands ``g`` that :func:`shape_index` files under it, ``SHAPES[k-1] < g <=
    SHAPES[k]`` (shape 0: the CPU-only demands). GPU room only, and a necessary condition (an
    upper bound on the hosts), never a sufficient one: a 0.3-GPU demand is filed under the 0.5
    shape, and a node whose best GPU has 0.4 free can host it though it has no 0.5 slot, so it
    is counted; :func:`allocate_gpus` decides. A draining node hosts nothing."""
    if node.draining:
        return tuple(False for _ in SHAPES)
    free = node.gpu_free
    best = max(free, default=0.0)
    idle = sum(1 for f in free if f >= 1.0 - EPS)
    total = sum(free)
    out: list[bool] = []
    lo = 0.0
    for s in SHAPES:
        if s == 0:
            out.append(True)
        elif s <= 1:  # a share of one GPU, more than lo: some GPU with more than lo free
            out.append(best > lo + EPS / 2)
        else:  # more than lo >= 1 GPUs: lo whole ones idle, and more than lo free in all
            out.append(idle >= int(lo + EPS) and total > lo + EPS / 2)
        lo = s
    return tuple(out)


def host_buckets(rooms: Sequence[tuple[float, float]]) -> tuple[HostBucket, ...]:
    """The nodes that might host one shape's class (:func:`host_classes`), given as their
    ``(free cpus, free memory_mb)``, grouped for a zone summary: ordered by free CPUs (then memory), largest first, the first
    groups of :data:`HOST_BUCKET_SIZES` nodes and the rest in one last group, each as
    ``(nodes, largest cpus, largest memory_mb)`` of its members. O(n) (a partial selection of
    the 64 largest, not a sort of all of them); ``()`` for no node.

    A group's corner (its largest CPUs and memory) dominates each of its members, so the nodes
    of the groups whose corner holds a demand include every node that can host it
    (:func:`hosts_fit`, an upper bound); with groups doubling in size from the top, the bound
    is within about twice the true count on the CPU axis."""
    if not rooms:
        return ()
    top = sum(HOST_BUCKET_SIZES)
    head = heapq.nlargest(top, rooms) if len(rooms) > top else sorted(rooms, reverse=True)
    out: list[HostBucket] = []
    i = 0
    for size in HOST_BUCKET_SIZES:
        group = head[i:i + size]
        if not group:
            break
        out.append((len(group), group[0][0], max(m for _, m in group)))
        i += size
    rest = len(rooms) - len(head)
    if rest > 0:  # the nodes below the 64 largest: one group, its corner found in one pass
        cut = head[-1]
        below = [r for r in rooms if r < cut]
        if len(below) < rest:  # nodes equal to the head's last, left out of it
            below.append(cut)
        out.append((rest, max(c for c, _ in below), max(m for _, m in below)))
    return tuple(out)


def hosts_fit(buckets: Sequence[HostBucket], demand: Demand) -> int:
    """How many nodes of ``buckets`` (:func:`host_buckets`) could host ``demand``: the nodes of
    every group whose largest free CPUs and memory both hold it. An upper bound on the true
    count (a group's CPUs and memory may come from two of its nodes); when it says 0, no node
    had both."""
    return sum(n for n, c, m in buckets if c + EPS >= demand.cpus and m >= demand.memory_mb)


def host_copies(buckets: Sequence[HostBucket], demand: Demand) -> float:
    """How many copies of ``demand`` the nodes of ``buckets`` could take, by their CPUs and
    memory: each node of a group that holds one copy (see :func:`hosts_fit`) counts for as
    many as its group's largest free CPUs and memory hold (``math.inf`` for a demand of no
    CPU and no memory). An upper bound; 0 when no node can host one copy."""
    total = 0.0
    for n, c, m in buckets:
        if c + EPS >= demand.cpus and m >= demand.memory_mb:
            per = math.inf  # an infinite corner (beyond the wire's field) bounds nothing
            if demand.cpus > 0 and math.isfinite(c):
                per = min(per, math.floor(c / demand.cpus + EPS))
            if demand.memory_mb > 0 and math.isfinite(m):
                per = min(per, math.floor(m / demand.memory_mb + EPS))
            total += n * per
    return total


def summarize_zone(zone: int, nodes: Iterable[NodeCapacity], issued_at: float = 0.0,
                   rng: random.Random | None = None, hints: int = 0,
                   slots_of: Callable[[NodeCapacity], tuple[int, ...]] = shape_slots,
                   hosts: bool = True) -> ZoneSummary:
    """Aggregate residual node capacities (see :func:`residual`) into a :class:`ZoneSummary`.

    With ``hints`` > 0 (and ``rng``), the summary also names, for each shape that fewer than
    :data:`HINT_BELOW` of the nodes have room for, up to ``hints`` nodes drawn uniformly among
    those that have (:attr:`ZoneSummary.hints`, see :func:`hinted_nodes`): O(nodes) here, once
    per summary, never per placement. ``slots_of`` is :func:`shape_slots` (a caller that keeps
    node capacities unchanged between summaries may pass a memo of it).

    With ``hosts`` (the default) the summary carries, per shape, the nodes that might host a
    demand of its class (:func:`host_classes`) grouped by their free CPUs and memory (:attr:`ZoneSummary.hosts`, :func:`host_buckets`):
    also O(nodes), once per summary; ``hosts=False`` gives the summary of the earlier protocol.
    """
    if hints < 0 or hints > MAX_HINTS:
        raise PlacementError(f"summarize_zone: hints {hints!r} must be in 0..{MAX_HINTS}")
    slots = [0] * len(SHAPES)
    cpus = 0.0
    mem = 0
    models: set[str] = set()
    count = 0
    want = hints if rng is not None else 0
    sample: list[list[int]] = [[] for _ in SHAPES]  # a reservoir per shape
    seen = [0] * len(SHAPES)
    rooms: list[list[tuple[float, float]]] = [[] for _ in SHAPES]  # (cpus, memory) of the nodes in each class
    for n in nodes:
        count += 1
        if hosts:
            room = (n.cpus, float(n.memory_mb))
            for k, ok in enumerate(host_classes(n)):
                if ok:
                    rooms[k].append(room)
        for k, v in enumerate(slots_of(n)):
            slots[k] += v
            if want and v > 0 and n.cpus > EPS and n.memory_mb > 0:
                seen[k] += 1
                if len(sample[k]) < want:
                    sample[k].append(n.node)
                else:
                    j = rng.randrange(seen[k])  # type: ignore[union-attr]
                    if j < want:
                        sample[k][j] = n.node
        if not n.draining:
            cpus += n.cpus
            mem += n.memory_mb
        if n.gpu_model and n.gpu_free:
            models.add(n.gpu_model)
    # only shapes a uniform draw can miss: fewer than HINT_BELOW of the nodes have room
    hint_t = tuple(tuple(h) if seen[k] < HINT_BELOW * count else () for k, h in enumerate(sample)) if want else ()
    host_t = tuple(host_buckets(r) for r in rooms) if hosts else ()
    return ZoneSummary(zone, count, tuple(slots), cpus, mem, tuple(sorted(models)), issued_at, hint_t, host_t)


def hinted_nodes(summary: ZoneSummary, demand: Demand) -> tuple[int, ...]:
    """Nodes ``summary`` names as having had room for ``demand``'s GPU shape when it was issued
    (``()`` when it names none). A hint is a guess, as stale as its summary: the node still
    arbitrates. The submitter probes one hinted node beside the uniform draw, so that a shape
    few nodes can take (e.g. four whole GPUs on a busy zone) is not refused by every node
    probed, which would cost a retry round (more messages than the hint's one probe saves)."""
    k = shape_index(demand.gpus)
    if k is None or k >= len(summary.hints):
        return ()
    return summary.hints[k]


def shape_index(gpus: float) -> int | None:
    """Index in :data:`SHAPES` of the smallest shape holding ``gpus``; None if above the largest."""
    for k, s in enumerate(SHAPES):
        if gpus <= s + EPS:
            return k
    return None


def zone_fit(summary: ZoneSummary, demand: Demand) -> float:
    """How many copies of ``demand`` the zone could take, estimated from its summary (>= 0).

    The GPU slot count of the demand's shape (with host buckets, at least the nodes that might
    host it: a 0.3-GPU demand fits a GPU with 0.4 free, which is no 0.5 slot), bounded by what
    the free CPUs and memory could hold; when the summary carries host buckets
    (:attr:`ZoneSummary.hosts`), bounded also by the copies the nodes that might host the
    demand's class could take each by their own CPUs and memory (:func:`host_copies`): a zone
    where no node has GPU, CPU and memory room together gives 0, and a busy zone counts its
    hosts (near saturation, one copy each), not its summed resources. Never below the number
    of nodes that can host the demand. A summary without them (an older peer's) gives the
    slot estimate alone. A GPU model the zone lacks gives 0. It is an
    estimate (an upper bound, as stale as the summary): arbitration on the node has the last
    word.
    """
    if demand.gpus > 0 and demand.gpu_model is not None and not any(model_matches(demand.gpu_model, m)
                                                                     for m in summary.gpu_models):
        return 0.0
    k = shape_index(demand.gpus)
    if k is None:
        return 0.0
    fit = float(summary.slots[k])
    if k < len(summary.hosts):  # each node that can host the demand takes one copy at least
        fit = max(fit, float(hosts_fit(summary.hosts[k], demand)))
    if demand.cpus > 0:
        fit = min(fit, summary.cpus / demand.cpus)
    if demand.memory_mb > 0:
        fit = min(fit, summary.memory_mb / demand.memory_mb)
    if k < len(summary.hosts):
        fit = min(fit, host_copies(summary.hosts[k], demand))
    return max(0.0, math.floor(fit + EPS))


def choose_zone(fits: Mapping[int, float], rng: random.Random, exclude: Iterable[int] = ()) -> int | None:
    """A zone id drawn with probability proportional to its fit, skipping ``exclude``; None
    when no remaining zone has a positive fit. Zones are visited in sorted order so the draw
    depends only on ``fits`` and ``rng``.
    """
    skip = set(exclude)
    cands = [(z, f) for z, f in sorted(fits.items()) if z not in skip and f > 0 and math.isfinite(f)]
    if not cands:
        return None
    total = sum(f for _, f in cands)
    x = rng.random() * total
    for z, f in cands:
        x -= f
        if x < 0:
            return z
    return cands[-1][0]


@dataclass(frozen=True, eq=False)
class ZoneTable:
    """:func:`choose_zone` prepared for one ``fits`` mapping, for a caller that draws from the
    same fits many times (the submitter, between two summary rounds): the zones with a positive
    fit in sorted order and their cumulative fits, so a draw costs O(log zones), not O(zones).
    It draws the same zone as :func:`choose_zone` for the same ``rng`` state."""

    fits: Mapping[int, float]
    zones: tuple[int, ...]
    cum: tuple[float, ...]

    @classmethod
    def of(cls, fits: Mapping[int, float]) -> ZoneTable:
        zones: list[int] = []
        cum: list[float] = []
        total = 0.0
        for z, f in sorted(fits.items()):
            if f > 0 and math.isfinite(f):
                total += f
                zones.append(z)
                cum.append(total)
        return cls(fits, tuple(zones), tuple(cum))

    def choose(self, rng: random.Random, exclude: Iterable[int] = ()) -> int | None:
        """As :func:`choose_zone` (``exclude`` given: that very function)."""
        if exclude:
            return choose_zone(self.fits, rng, exclude)
        if not self.zones:
            return None
        i = bisect.bisect_right(self.cum, rng.random() * self.cum[-1])
        return self.zones[min(i, len(self.zones) - 1)]


def probe_targets(
    members: Sequence[int],
    d: int,
    rng: random.Random,
    exclude: Iterable[int] = (),
    preferred: Sequence[int] = (),
) -> list[int]:
    """Up to ``d`` distinct nodes to probe, drawn uniformly from ``members`` minus ``exclude``.

    Members of ``preferred`` (e.g. the demand's pool) are drawn first, the rest of ``d`` from
    all members. Costs O(d) draws on average whatever ``len(members)`` is, as long as most
    members are not excluded (it falls back to one O(n) pass when draws keep hitting them).
    Returns fewer than ``d`` only when fewer eligible members exist.
    """
    if d < 0:
        raise PlacementError(f"probe_targets: d {d!r} must be >= 0")
    skip = set(exclude)
    out: list[int] = []
    chosen: set[int] = set()
    for pool in (preferred, members):
        if len(out) >= d or not pool:
            continue
        need = d - len(out)
        tries = 0
        while need and tries < 4 * d + 8:
            tries += 1
            n = pool[rng.randrange(len(pool))]
            if n in skip or n in chosen:
                continue
            out.append(n)
            chosen.add(n)
            need -= 1
        if need:  # crowded by exclusions: one pass over the eligible rest
            rest = [n for n in pool if n not in skip and n not in chosen]
            for n in rng.sample(rest, min(need, len(rest))):
                out.append(n)
                chosen.add(n)
    return out


def pick_offer(answers: Iterable[Offer | Refusal], now: float, margin_s: float = 0.0) -> Offer | None:
    """Late binding: the first offer, in arrival order, whose lease outlives ``now + margin_s``
    (time to send the commit). None when every answer is a refusal or a stale offer."""
    for a in answers:
        if isinstance(a, Offer) and a.expires_at > now + margin_s:
            return a
    return None


# --------------------------------------------------------------------------- retries


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries for one placement.

    Probe ``d`` nodes; on no good offer, probe again ``widen`` times as many (up to
    ``d_max``), ``widen_steps`` times in a zone; then the next zone, up to ``zones`` zones;
    then queue: wait ``queue_backoff_s`` (doubling up to ``queue_backoff_max_s``) and start over.
    """

    d: int = 2
    d_max: int = 8
    widen: int = 2
    widen_steps: int = 1
    zones: int = 3
    queue_backoff_s: float = 1.0
    queue_backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not (1 <= self.d <= self.d_max <= 255):
            raise PlacementError(f"retry: need 1 <= d ({self.d}) <= d_max ({self.d_max}) <= 255")
        if self.widen < 1 or self.widen_steps < 0 or self.zones < 1:
            raise PlacementError(
                f"retry: widen {self.widen} must be >= 1, widen_steps {self.widen_steps} >= 0, zones {self.zones} >= 1"
            )
        if not (0 < self.queue_backoff_s <= self.queue_backoff_max_s):
            raise PlacementError(
                f"retry: need 0 < queue_backoff_s ({self.queue_backoff_s}) <= queue_backoff_max_s ({self.queue_backoff_max_s})"
            )


@dataclass(frozen=True)
class Probe:
    """Probe ``d`` nodes in the ``zone_rank``-th zone chosen (0: the first draw; each new
    rank draws again with the zones already tried excluded)."""

    zone_rank: int
    d: int


@dataclass(frozen=True)
class Queue:
    """Give up for now: put the job in the queue and start over after ``delay_s``."""

    delay_s: float


def retry_schedule(policy: RetryPolicy, round: int = 0) -> list[Probe | Queue]:
    """Every step of one round of retries, ending with a :class:`Queue`.

    With the defaults: ``[Probe(0, 2), Probe(0, 4), Probe(1, 2), Probe(1, 4), Probe(2, 2),
    Probe(2, 4), Queue(1.0)]``; ``round`` k doubles the queue delay k times (capped).
    """
    steps: list[Probe | Queue] = []
    for rank in range(policy.zones):
        d = policy.d
        steps.append(Probe(rank, d))
        for _ in range(policy.widen_steps):
            d = min(policy.d_max, d * policy.widen)
            steps.append(Probe(rank, d))
    delay = min(policy.queue_backoff_max_s, policy.queue_backoff_s * (2 ** min(round, 30)))
    steps.append(Queue(delay))
    return steps


def max_messages_per_attempt(d: int, releases: bool = False) -> int:
    """Messages one successful probe round costs at most: ``d`` probes, ``d`` answers, and the
    binding (the hand-over and its acknowledgement), ``2d + 2``. Unused offers are not
    released, they lapse with their lease; ``releases`` counts the earlier protocol's release
    for each of the other ``d - 1`` offers (``3d + 1``)."""
    return 2 * d + 2 + (d - 1 if releases else 0)
