"""What this node's kernel can do, found at start-up and shown by ``laminarctl status``.

Each probe reads the kernel's own interfaces (BTF, cgroup mounts, PSI files, capability
masks, the qdisc kinds the kernel accepts) instead of trusting a version number.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CAP_SYS_RESOURCE = 24
CAP_BPF = 39


@dataclass
class Features:
    kernel: str
    btf: bool
    bpffs: bool
    cgroup_mode: str  # "v2", "hybrid" or "v1"
    cgroup2_path: str | None
    memory_controller: str | None  # "v2" or "v1"
    psi: bool
    cap_sys_resource: bool
    cap_bpf: bool
    psi_window_us: int  # the shortest PSI trigger window this process may use

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mounts() -> list[tuple[str, str]]:
    out = []
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            f = line.split()
            if len(f) >= 3:
                out.append((f[1], f[2]))
    except OSError:
        pass
    return out


def has_capability(cap: int) -> bool:
    """Whether this process's effective capability set holds `cap` (read from /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> cap & 1)
    except OSError:
        pass
    return False


def detect() -> Features:
    mounts = _mounts()
    cg2 = next((m for m, t in mounts if t == "cgroup2"), None)
    v1 = [m for m, t in mounts if t == "cgroup"]
    mem_v2 = False
    if cg2:
        try:
            mem_v2 = "memory" in Path(cg2, "cgroup.controllers").read_text().split()
        except OSError:
            pass
    mem_v1 = any(m.rstrip("/").endswith("/memory") for m in v1)
    mode = "v2" if cg2 and not v1 else ("hybrid" if cg2 else "v1")
    cap_res = has_capability(CAP_SYS_RESOURCE)
    return Features(
        kernel=os.uname().release,
        btf=Path("/sys/kernel/btf/vmlinux").exists(),
        bpffs=any(t == "bpf" for _, t in mounts),
        cgroup_mode=mode,
        cgroup2_path=cg2,
        memory_controller="v2" if mem_v2 else ("v1" if mem_v1 else None),
        psi=Path("/proc/pressure/memory").exists(),
        cap_sys_resource=cap_res,
        cap_bpf=has_capability(CAP_BPF),
        # Without CAP_SYS_RESOURCE the kernel only accepts trigger windows that are multiples of 2 s.
        psi_window_us=1_000_000 if cap_res else 2_000_000,
    )


def pressure_now() -> dict[str, Any]:
    """Node memory pressure right now: PSI averages and available memory."""
    out: dict[str, Any] = {}
    try:
        for line in Path("/proc/pressure/memory").read_text().splitlines():
            kind, *fields = line.split()
            out[f"memory_{kind}"] = {k: float(v) for k, v in (f.split("=") for f in fields) if k != "total"}
    except OSError:
        out["memory_psi"] = None
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0])
        out["mem_total_mb"] = info["MemTotal"] // 1024
        out["mem_available_mb"] = info["MemAvailable"] // 1024
    except (OSError, KeyError, ValueError):
        pass
    return out


def ensure_bpffs(path: str = "/sys/fs/bpf") -> None:
    """Mounts bpffs at `path` if nothing is mounted there (pins need it)."""
    if any(m == path and t == "bpf" for m, t in _mounts()):
        return
    import subprocess

    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "bpf", "bpf", path], check=True)
