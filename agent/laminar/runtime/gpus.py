"""This node's GPUs: from NVML where a GPU and its driver exist, else the config's declared list.

`discover(declared)` returns a `GpuInventory` whose `source` says where the list came from:

- ``"nvml"``: NVML found the GPUs (index, name, total memory);
- ``"declared"``: NVML found none (the reason is in `note`, e.g. "NVML: Driver Not Loaded"),
  and the config's ``gpus.declared`` lists them. Declared GPUs are a stand-in for machines
  without a GPU (development, CI): they are allocated to jobs like real ones, but nothing on
  the node checks that they exist;
- ``"none"``: neither (``"no GPUs found"``).

`allocate(inventory, used, want)` is the pure choice of indices for a job, and
`cuda_env(inventory, indices)` the environment that shows a job exactly those GPUs:
``CUDA_VISIBLE_DEVICES`` names NVML GPUs by UUID (CUDA's own order, fastest first, need not be
NVML's PCI order, so an index could name another GPU on a node of mixed GPUs) and declared ones
by index, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that indices, where used, count as NVML does;
a job given no GPUs gets ``CUDA_VISIBLE_DEVICES=""`` and sees none.

`nvml_process_memory()` is the GPU memory NVML attributes to each pid (compute processes).
Verified on a real H100 (docs/gpus.md; tests/gpu).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# The most GPUs a node has, and one past the highest index: a job asking for more, or a longer
# list of indices, is a mistake (and a list of 100,000 indices must not cost the agent time).
GPUS_MAX = 1024


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_total: int | None = None  # bytes; None for declared GPUs
    uuid: str | None = None  # NVML's "GPU-…"; None for declared GPUs


@dataclass
class GpuInventory:
    source: str  # "nvml" | "declared" | "none"
    gpus: list[Gpu] = field(default_factory=list)
    note: str = ""

    @property
    def indices(self) -> list[int]:
        return [g.index for g in self.gpus]

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "note": self.note,
                "gpus": [{"index": g.index, "name": g.name, "memory_total": g.memory_total, "uuid": g.uuid}
                         for g in self.gpus]}


def nvml_library() -> bool:
    """Whether NVML's library (libnvidia-ml.so.1, the driver's) can be loaded here: where it
    cannot, pynvml (about 2 MB of an agent's memory for its whole life) is never imported."""
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def nvml_gpus() -> tuple[list[Gpu], str]:
    """GPUs NVML reports (index, name, total memory in bytes, UUID), and a note ("" when NVML
    found at least one). Never raises: a missing library or driver, or a GPU NVML cannot
    read, is the note (the GPUs read before it are not returned: a half-read node is none)."""
    if not nvml_library():
        return [], "NVML: NVML Shared Library Not Found"  # pynvml's own words for it
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py (pynvml) not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [], f"NVML: {e}"
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append(Gpu(i, _text(pynvml.nvmlDeviceGetName(h)), int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                           _text(pynvml.nvmlDeviceGetUUID(h))))
        return out, "" if out else "NVML: the driver reports 0 GPUs"
    except pynvml.NVMLError as e:
        return [], f"NVML: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(v: str | bytes) -> str:
    """NVML strings: bytes in older nvidia-ml-py, str in newer."""
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_process_memory() -> dict[int, int]:
    """GPU memory used per pid (bytes) summed over all GPUs, from NVML's compute processes;
    {} where NVML has no GPU. A GPU NVML cannot read is left out, the others still count.
    Pids are as the driver sees them (this host's; in a container with its own pid namespace
    they are not the container's). A process whose memory NVML cannot tell counts 0."""
    if not nvml_library():
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    out: dict[int, int] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            except pynvml.NVMLError:
                continue
            for p in procs:
                out[p.pid] = out.get(p.pid, 0) + int(p.usedGpuMemory or 0)
    except pynvml.NVMLError:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def discover(declared: Iterable[int] | None) -> GpuInventory:
    """NVML first; else the declared indices (None: the config has no such key)."""
    found, why = nvml_gpus()
    if found:
        return GpuInventory("nvml", found)
    if declared is None:
        return GpuInventory("none", [], f"no GPUs found ({why}); config has no gpus.declared, treated as 0")
    idx = sorted(set(declared))
    if not idx:
        return GpuInventory("none", [], f"no GPUs found ({why}); gpus.declared = 0")
    return GpuInventory("declared", [Gpu(i, "declared (no NVML device)") for i in idx],
                        f"no GPUs found ({why}); using {len(idx)} GPUs declared in the config")


def allocate(inventory: GpuInventory, used: Iterable[int], want: int | list[int]) -> list[int]:
    """Pick GPU indices for a job: `want` is a count (lowest free indices first) or explicit
    indices (each at most once). Raises ValueError naming what is missing, busy or malformed
    (a count below 0 or not a whole number, an index listed twice)."""
    busy = set(used)
    have = inventory.indices
    if isinstance(want, bool) or (not isinstance(want, int) and not isinstance(want, list)):
        raise ValueError(f"gpus: a count must be a whole number >= 0, got {want!r}")
    if isinstance(want, int):
        if want < 0:
            raise ValueError(f"gpus: a count must be a whole number >= 0, got {want!r}")
        if want == 0:
            return []
        free = [i for i in have if i not in busy]
        if len(free) < want:
            where = f"{inventory.source}: {len(have)} GPUs" if have else inventory.note or "no GPUs found"
            raise ValueError(f"gpus: asked for {want}, only {len(free)} free ({where}; busy: {sorted(busy) or 'none'})")
        return free[:want]
    twice = sorted(i for i, n in Counter(want).items() if n > 1)
    if twice:
        raise ValueError(f"gpus: indices {twice} listed more than once (a GPU goes to a job once)")
    missing = [i for i in want if i not in have]
    if missing:
        raise ValueError(f"gpus: indices {missing} do not exist on this node (have {have or 'none'}; "
                         f"{inventory.note or inventory.source})")
    taken = [i for i in want if i in busy]
    if taken:
        raise ValueError(f"gpus: indices {taken} are in use by other jobs")
    return list(want)


def cuda_env(inventory: GpuInventory, indices: Iterable[int]) -> dict[str, str]:
    """The environment that shows a job exactly the GPUs `indices` (from `allocate`).

    ``CUDA_VISIBLE_DEVICES`` lists NVML GPUs by UUID and declared ones by index; an empty
    list gives ``""`` (CUDA then sees no GPU). ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA
    number GPUs in NVML's order. Raises ValueError for an index the inventory does not have."""
    by_index = {g.index: g for g in inventory.gpus}
    names = []
    for i in indices:
        g = by_index.get(i)
        if g is None:
            raise ValueError(f"gpus: index {i} is not in this node's inventory (have {inventory.indices or 'none'})")
        names.append(g.uuid or str(g.index))
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(names)}
