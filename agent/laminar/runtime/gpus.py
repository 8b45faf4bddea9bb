"""This node's GPUs: from NVML where a GPU and its driver exist, else the config's declared list.

`discover(declared)` returns a `GpuInventory` whose `source` says where the list came from:

- ``"nvml"``: NVML found the GPUs (index, name, total memory);
- ``"declared"``: NVML found none (the reason is in `note`, e.g. "NVML: Driver Not Loaded"),
  and the config's ``gpus.declared`` lists them. Declared GPUs are a stand-in for machines
  without a GPU (development, CI): they are allocated to jobs like real ones, but nothing on
  the node checks that they exist;
- ``"none"``: neither (``"no GPUs found"``).

`allocate(inventory, used, want)` is the pure choice of indices for a job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_total: int | None = None  # bytes; None for declared GPUs


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
                "gpus": [{"index": g.index, "name": g.name, "memory_total": g.memory_total} for g in self.gpus]}


def nvml_gpus() -> tuple[list[Gpu], str]:
    """GPUs NVML reports, and a note ("" when NVML worked). Never raises."""
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
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode()
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            out.append(Gpu(i, str(name), int(mem)))
        return out, ""
    except pynvml.NVMLError as e:
        return [], f"NVML: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def nvml_process_memory() -> dict[int, int]:
    """GPU memory used per pid (bytes) across all GPUs, from NVML; {} where NVML has no GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    out: dict[int, int] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                out[p.pid] = out.get(p.pid, 0) + int(p.usedGpuMemory or 0)
    except Exception:
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
    indices. Raises ValueError naming what is missing or busy."""
    busy = set(used)
    have = inventory.indices
    if isinstance(want, int):
        if want == 0:
            return []
        free = [i for i in have if i not in busy]
        if len(free) < want:
            where = f"{inventory.source}: {len(have)} GPUs" if have else inventory.note or "no GPUs found"
            raise ValueError(f"gpus: asked for {want}, only {len(free)} free ({where}; busy: {sorted(busy) or 'none'})")
        return free[:want]
    missing = [i for i in want if i not in have]
    if missing:
        raise ValueError(f"gpus: indices {missing} do not exist on this node (have {have or 'none'}; "
                         f"{inventory.note or inventory.source})")
    taken = [i for i in want if i in busy]
    if taken:
        raise ValueError(f"gpus: indices {taken} are in use by other jobs")
    return list(want)
