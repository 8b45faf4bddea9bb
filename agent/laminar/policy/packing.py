"""Fragmentation-aware packing: pure policy shared by node arbitration and the simulator.

A GPU node's *fragmentation* is how much of its free GPU capacity the jobs that usually
arrive could not use. This module measures it the way "Beware of Fragmentation: Scheduling
GPU-Sharing Workloads with Fragmentation Gradient Descent" (Weng et al., USENIX ATC'23) does,
and turns it into the decisions Laminar makes on a node and at the submitter:

- :func:`shape_mix` turns the worker shapes seen (CPU milli-cores, GPU milli per GPU, number
  of GPUs) into a :data:`ShapeMix`: the most popular shapes covering ``coverage`` of the
  workers, each with its probability. A zone summary can carry this mix (a few dozen
  entries), so that every node in the zone scores with the same one.
- :func:`node_frag` is the expected fragmentation of one node for that mix, in milli-GPUs.
  For each shape ``m`` with probability ``p``: when the node cannot host ``m`` at all (too
  few GPUs with ``m``'s share free, too few CPUs, or ``m`` needs no GPU), all its free GPU
  milli count as fragment; when it can, the free milli of the GPUs too small for ``m``'s
  share count. The measure is ``sum(p * fragment)``. Memory is not part of it (as in FGD).
- :func:`alloc_options` lists where on a node one worker could go (each GPU with room for a
  shared worker; the lowest-index idle GPUs for whole-GPU workers), and :func:`frag_delta`
  says how much fragmentation each would add.
- :func:`least_frag_alloc` is Laminar's node-side choice: the option that adds the least
  fragmentation (exact delta; ties to the tighter GPU, then the lower index).
  :func:`fgd_alloc` is FGD's: the first option with the highest *quantized* score
  (:func:`fgd_score`, the Kubernetes score ``int(100 * sigmoid(-delta / 1000))``).
- :func:`pick_frag_offer` is the submitter's choice among the offers of the ``d`` probed
  nodes: the least fragmentation added, then the tightest fit.
- :func:`eviction_order` says which one resident worker a node would move away to make room
  for a worker that does not fit (the bounded re-addressing hop FGD cannot take).
- :func:`move_frees` is what a node puts in its zone summary's *move hints*: whether the
  move of one of its residents alone would let a worker of a given typical shape fit where it
  does not now; :func:`hint_shape` maps any worker to the typical (or gang) shape whose hints
  it may use, and :func:`pick_evictions` orders the candidate moves the probed hinted nodes
  name, across nodes.

Units are integers: GPU capacity in milli-GPUs per GPU (1000 = one idle GPU) and CPUs in
milli-cores, so that equal states compare equal and measures can be cached. :func:`to_milli`
converts the free fractions the placement code uses (``NodeCapacity.gpu_free``).

Example (a 2-GPU node, one GPU half used, and a mix of half-GPU and whole-GPU workers)::

    >>> mix = ((Shape(4000, 500, 1), 0.5), (Shape(8000, 1000, 1), 0.5))
    >>> node_frag((1000, 500), 32000, mix)   # the 500 GPU is too small for a whole-GPU worker
    250.0
    >>> [(a, frag_delta((1000, 500), 32000, a, 4000, mix)) for a in alloc_options((1000, 500), Shape(4000, 500, 1))]
    [(((0, 500),), 250.0), (((1, 500),), -250.0)]
    >>> least_frag_alloc((1000, 500), 32000, Shape(4000, 500, 1), mix)
    (((1, 500),), -250.0)
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MILLI = 1000
"""Milli-GPUs in one whole GPU."""


class PackingError(ValueError):
    """A shape, mix or node state is out of range; the message names the value."""


@dataclass(frozen=True, order=True)
class Shape:
    """What one worker asks for: ``cpu_milli`` milli-cores, ``num_gpus`` GPUs with
    ``gpu_milli`` milli-GPUs of each.

    A shared-GPU worker is ``num_gpus=1, gpu_milli<1000``; a gang of whole GPUs is
    ``gpu_milli=1000``; a CPU-only worker is ``num_gpus=0, gpu_milli=0``.
    """

    cpu_milli: int
    gpu_milli: int
    num_gpus: int

    def __post_init__(self) -> None:
        if not (isinstance(self.cpu_milli, int) and self.cpu_milli >= 0):
            raise PackingError(f"shape: cpu_milli {self.cpu_milli!r} must be an integer >= 0")
        if not (isinstance(self.num_gpus, int) and self.num_gpus >= 0):
            raise PackingError(f"shape: num_gpus {self.num_gpus!r} must be an integer >= 0")
        if not (isinstance(self.gpu_milli, int) and 0 <= self.gpu_milli <= MILLI):
            raise PackingError(f"shape: gpu_milli {self.gpu_milli!r} must be an integer in 0..{MILLI}")
        if (self.num_gpus == 0) != (self.gpu_milli == 0):
            raise PackingError(f"shape: num_gpus {self.num_gpus} with gpu_milli {self.gpu_milli}: both 0 or both > 0")
        if self.num_gpus > 1 and self.gpu_milli != MILLI:
            raise PackingError(f"shape: {self.num_gpus} GPUs of {self.gpu_milli} milli: a share is only for one GPU")

    @property
    def total_gpu_milli(self) -> int:
        return self.gpu_milli * self.num_gpus


ShapeMix = tuple[tuple[Shape, float], ...]
"""Typical worker shapes with their probabilities (summing to 1), most popular first."""

GpuAlloc = tuple[tuple[int, int], ...]
"""Where a worker goes on a node: ``((gpu index, milli-GPUs), ...)``."""


def shape_of(gpus: float, cpus: float) -> Shape:
    """The :class:`Shape` of a worker asking ``gpus`` GPUs (``0.46`` shares one; ``2`` is two
    whole GPUs) and ``cpus`` cores. A fraction above one GPU is refused (no shape has it)."""
    if not (math.isfinite(gpus) and gpus >= 0):
        raise PackingError(f"shape_of: gpus {gpus!r} must be a finite number >= 0")
    if not (math.isfinite(cpus) and cpus >= 0):
        raise PackingError(f"shape_of: cpus {cpus!r} must be a finite number >= 0")
    cpu = int(round(cpus * MILLI))
    milli = int(round(gpus * MILLI))
    if milli == 0:
        return Shape(cpu, 0, 0)
    if milli < MILLI:
        return Shape(cpu, milli, 1)
    if milli % MILLI:
        raise PackingError(f"shape_of: gpus {gpus!r} above one GPU must be whole")
    return Shape(cpu, MILLI, milli // MILLI)


def to_milli(gpu_free: Sequence[float]) -> tuple[int, ...]:
    """Free fractions per GPU (``NodeCapacity.gpu_free``) as milli-GPUs per GPU."""
    return tuple(max(0, min(MILLI, int(round(f * MILLI)))) for f in gpu_free)


def shape_mix(shapes: Iterable[Shape], coverage: float = 0.95) -> ShapeMix:
    """The typical shapes of ``shapes`` (one entry per worker) and their probabilities.

    Shapes are ranked by how many workers have them (ties: the larger shape first, FGD's
    order); the most popular are kept until they cover at least ``coverage`` of the workers,
    then their probabilities are renormalized to sum to 1. FGD's artifact uses 0.95.
    """
    if not (0 < coverage <= 1):
        raise PackingError(f"shape_mix: coverage {coverage!r} must be in (0, 1]")
    counts = Counter(shapes)
    total = sum(counts.values())
    if total == 0:
        raise PackingError("shape_mix: no shapes given")
    ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].num_gpus), reverse=True)
    kept: list[tuple[Shape, int]] = []
    cum = 0
    for s, c in ranked:
        if cum >= coverage * total:
            break
        kept.append((s, c))
        cum += c
    return tuple((s, c / cum) for s, c in kept)


def check_mix(mix: ShapeMix) -> None:
    """Raise :class:`PackingError` unless ``mix`` is non-empty with probabilities summing to 1."""
    if not mix:
        raise PackingError("shape mix is empty")
    for s, p in mix:
        if not isinstance(s, Shape) or not (0 <= p <= 1):
            raise PackingError(f"shape mix entry ({s!r}, {p!r}): want (Shape, probability in 0..1)")
    total = sum(p for _, p in mix)
    if abs(total - 1) > 1e-6:
        raise PackingError(f"shape mix probabilities sum to {total:.6f}, not 1")


def node_frag(gpu_left: Sequence[int], cpu_left: int, mix: ShapeMix) -> float:
    """Expected fragmentation of a node in milli-GPUs for ``mix`` (see the module docs).

    ``gpu_left``: free milli-GPUs per GPU; ``cpu_left``: free milli-cores. The order of the
    GPUs does not matter. 0 for a node with no free GPU capacity.
    """
    return _frag(tuple(sorted(gpu_left, reverse=True)), cpu_left, mix)


@functools.lru_cache(maxsize=1 << 18)
def _frag(gpu_desc: tuple[int, ...], cpu_left: int, mix: ShapeMix) -> float:
    total = sum(gpu_desc)
    if total == 0:
        return 0.0
    frag = 0.0
    for s, p in mix:
        if s.num_gpus == 0 or cpu_left < s.cpu_milli:
            frag += p * total
            continue
        # GPUs are sorted largest first: the first num_gpus decide whether the shape fits
        if len(gpu_desc) < s.num_gpus or gpu_desc[s.num_gpus - 1] < s.gpu_milli:
            frag += p * total
            continue
        frag += p * sum(g for g in gpu_desc if g < s.gpu_milli)
    return frag


def alloc_options(gpu_left: Sequence[int], shape: Shape) -> list[GpuAlloc]:
    """Every place on a node a worker of ``shape`` could take GPUs (CPUs are not checked).

    A shared-GPU worker: one option per GPU with at least ``gpu_milli`` free, in index order.
    Whole GPUs: one option, the lowest-index idle GPUs. A CPU-only worker: ``[()]``.
    Empty list: the GPUs do not fit.
    """
    if shape.num_gpus == 0:
        return [()]
    if shape.gpu_milli < MILLI:
        return [((i, shape.gpu_milli),) for i, g in enumerate(gpu_left) if g >= shape.gpu_milli]
    idle = [i for i, g in enumerate(gpu_left) if g >= MILLI]
    if len(idle) < shape.num_gpus:
        return []
    return [tuple((i, MILLI) for i in idle[: shape.num_gpus])]


def apply_alloc(gpu_left: Sequence[int], alloc: GpuAlloc) -> tuple[int, ...]:
    """``gpu_left`` less ``alloc``; raises :class:`PackingError` if a GPU would go below 0."""
    out = list(gpu_left)
    for i, m in alloc:
        if not (0 <= i < len(out)) or out[i] < m:
            raise PackingError(f"alloc {alloc!r} does not fit GPUs {tuple(gpu_left)!r} (GPU {i})")
        out[i] -= m
    return tuple(out)


def frag_delta(gpu_left: Sequence[int], cpu_left: int, alloc: GpuAlloc, cpu_milli: int, mix: ShapeMix) -> float:
    """How much :func:`node_frag` grows (milli-GPUs, may be negative) when a worker taking
    ``alloc`` and ``cpu_milli`` is placed on the node."""
    after = node_frag(apply_alloc(gpu_left, alloc), cpu_left - cpu_milli, mix)
    return after - node_frag(gpu_left, cpu_left, mix)


def fgd_score(delta: float) -> int:
    """FGD's node score for a fragmentation growth of ``delta`` milli-GPUs: the Kubernetes
    score ``int(100 * sigmoid(-delta / 1000))`` in 0..100 (50 for no change), truncated as
    the artifact truncates it, so close deltas tie."""
    x = -delta / MILLI
    sig = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return int(sig * 100)


def fgd_alloc(gpu_left: Sequence[int], cpu_left: int, shape: Shape, mix: ShapeMix) -> tuple[GpuAlloc, int] | None:
    """FGD's choice on one node: ``(alloc, score)`` for the first option with the highest
    :func:`fgd_score`, or None when the worker does not fit (GPUs or CPUs)."""
    if cpu_left < shape.cpu_milli:
        return None
    best: tuple[GpuAlloc, int] | None = None
    for a in alloc_options(gpu_left, shape):
        s = fgd_score(frag_delta(gpu_left, cpu_left, a, shape.cpu_milli, mix))
        if best is None or s > best[1]:
            best = (a, s)
    return best


def least_frag_alloc(gpu_left: Sequence[int], cpu_left: int, shape: Shape, mix: ShapeMix) -> tuple[GpuAlloc, float] | None:
    """Laminar's choice on one node: ``(alloc, delta)`` adding the least fragmentation
    (exact, unquantized; ties to the GPU left with less free, then the lower index), or
    None when the worker does not fit (GPUs or CPUs)."""
    if cpu_left < shape.cpu_milli:
        return None
    best: tuple[float, int, GpuAlloc] | None = None
    for a in alloc_options(gpu_left, shape):
        d = frag_delta(gpu_left, cpu_left, a, shape.cpu_milli, mix)
        key = (round(d, 6), sum(gpu_left[i] for i, _ in a), a)
        if best is None or key < best:
            best = key
    return None if best is None else (best[2], best[0])


@dataclass(frozen=True)
class FragOffer:
    """A probed node's offer as the submitter compares it: which node, where on it, how
    much fragmentation it adds, and the free GPU milli the node would have left."""

    node: int
    alloc: GpuAlloc
    delta: float
    gpu_left_after: int


def pick_frag_offer(offers: Iterable[FragOffer], quantized: bool = False) -> FragOffer | None:
    """The offer adding the least fragmentation; ties to the tighter fit (less free GPU
    left), then the lower node id (so that submitters sharing a node order fill the same
    nodes first). None when there is no offer.

    ``quantized``: compare :func:`fgd_score` of the deltas instead of the exact deltas, so
    that nearly equal deltas tie and the tighter fit decides (FGD's integer scores).

    This needs every answer of a round, where :func:`laminar.policy.placement.pick_offer`
    binds the first: the submitter waits for the ``d`` answers (or their timeout)."""
    best: FragOffer | None = None
    best_key: tuple[float, int, int] | None = None
    for o in offers:
        key = (-fgd_score(o.delta) if quantized else round(o.delta, 6), o.gpu_left_after, o.node)
        if best_key is None or key < best_key:
            best, best_key = o, key
    return best


@dataclass(frozen=True)
class Resident:
    """A worker running on a node, as the node's eviction choice sees it."""

    worker: int
    alloc: GpuAlloc
    cpu_milli: int
    memory_mb: int = 0


def eviction_order(
    gpu_left: Sequence[int], cpu_left: int, mem_left: int, residents: Sequence[Resident], shape: Shape, memory_mb: int,
    mix: ShapeMix, limit: int = 4,
) -> list[tuple[Resident, GpuAlloc, float]]:
    """Residents whose move alone would let a worker of ``shape`` (and ``memory_mb``) fit.

    Returns up to ``limit`` entries ``(resident, alloc for the new worker, fragmentation
    delta of the node after both the move and the placement)``, best first: the smallest
    GPU share moved (less to move), then the least fragmentation. Empty when the worker fits
    already (no move is needed) or when no single move makes room.
    """
    if limit < 1:
        raise PackingError(f"eviction_order: limit {limit!r} must be >= 1")
    if cpu_left >= shape.cpu_milli and mem_left >= memory_mb and alloc_options(gpu_left, shape):
        return []
    before = node_frag(gpu_left, cpu_left, mix)
    out: list[tuple[tuple[int, float, int], tuple[Resident, GpuAlloc, float]]] = []
    for r in residents:
        freed = list(gpu_left)
        for i, m in r.alloc:
            freed[i] = min(MILLI, freed[i] + m)
        cpu = cpu_left + r.cpu_milli
        if mem_left + r.memory_mb < memory_mb:
            continue
        got = least_frag_alloc(freed, cpu, shape, mix)
        if got is None:
            continue
        a, _ = got
        after = node_frag(apply_alloc(freed, a), cpu - shape.cpu_milli, mix)
        moved = sum(m for _, m in r.alloc)
        out.append(((moved, round(after - before, 6), r.worker), (r, a, after - before)))
    out.sort(key=lambda e: e[0])
    return [e[1] for e in out[:limit]]



def move_frees(gpu_left: Sequence[int], cpu_left: int, residents: Sequence[Resident], shape: Shape) -> bool:
    """True when a worker of ``shape`` does not fit the node now (GPUs or CPUs) and would
    after one resident alone leaves: the node's entry in its zone summary's move hints for
    ``shape``. Memory is left to the probe (:func:`eviction_order` checks it)."""
    if cpu_left >= shape.cpu_milli and alloc_options(gpu_left, shape):
        return False
    for r in residents:
        if cpu_left + r.cpu_milli < shape.cpu_milli:
            continue
        freed = list(gpu_left)
        for i, m in r.alloc:
            freed[i] = min(MILLI, freed[i] + m)
        if alloc_options(freed, shape):
            return True
    return False


def hint_shape(shape: Shape, hinted: Iterable[Shape]) -> Shape:
    """The shape of ``hinted`` whose move hints a worker of ``shape`` may use: ``shape``
    itself when hinted, else the smallest hinted shape that covers it (as many GPUs, at least
    its share, at least its CPUs; smallest share, then fewest CPUs), else its GPU-only gang
    shape ``Shape(0, gpu_milli, num_gpus)`` (a node that frees room for that frees the GPUs at
    least). A node hinted for a covering shape can host ``shape`` after the move."""
    pool = list(hinted)
    if shape in pool:
        return shape
    cover = [h for h in pool if h.num_gpus == shape.num_gpus and h.gpu_milli >= shape.gpu_milli
             and h.cpu_milli >= shape.cpu_milli]
    if cover:
        return min(cover, key=lambda h: (h.gpu_milli, h.cpu_milli))
    return Shape(0, shape.gpu_milli, shape.num_gpus)


@dataclass(frozen=True)
class MoveCandidate:
    """One move a probed node names for a worker that does not fit: move ``resident`` away
    (``moved_milli`` GPU milli), then the worker takes ``alloc`` and the node's fragmentation
    changes by ``delta``."""

    node: int
    resident: Resident
    alloc: GpuAlloc
    delta: float

    @property
    def moved_milli(self) -> int:
        return sum(m for _, m in self.resident.alloc)


def pick_evictions(cands: Iterable[MoveCandidate], limit: int) -> list[MoveCandidate]:
    """Up to ``limit`` candidate moves in the order the submitter tries them: the least GPU
    moved (the resident easiest to re-home, the least state to move), then the least
    fragmentation left on the node, then the lower node id and worker id."""
    if limit < 1:
        raise PackingError(f"pick_evictions: limit {limit!r} must be >= 1")
    return sorted(cands, key=lambda c: (c.moved_milli, round(c.delta, 6), c.node, c.resident.worker))[:limit]
