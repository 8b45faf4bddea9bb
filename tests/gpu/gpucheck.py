"""Helpers for the GPU tests (``pytest -m gpu``): the real GPUs or a skip saying why there are none.

- `nvml_or_skip()`: the GPUs NVML finds (`laminar.runtime.gpus.nvml_gpus`), or skip the test
  with NVML's own reason (no driver, no library, no device): machines without a GPU (this VM,
  CI) skip every GPU test cleanly;
- `smi_gpus()`: the same GPUs as ``nvidia-smi`` reports them, the independent reference the
  tests compare NVML's inventory with (never hard-coded names);
- `cuda_child(...)`: a Python child that imports torch and reports what CUDA shows it
  (`CUDA_VIEW`), skipping where torch has no CUDA;
- `JOB`: the GPU job the runtime tests run (reports its CUDA view, holds memory until told).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from laminar.airlock.cgroups import CgroupError, detect
from laminar.runtime import gpus


def nvml_or_skip() -> list[gpus.Gpu]:
    """NVML's GPUs; skips the calling test when there are none (the reason is NVML's)."""
    found, why = gpus.nvml_gpus()
    if not found:
        pytest.skip(f"no GPU here: {why or 'NVML found none'}")
    return found


@dataclass(frozen=True)
class SmiGpu:
    index: int
    name: str
    memory_mib: int
    uuid: str


def smi_gpus() -> list[SmiGpu]:
    """The GPUs as ``nvidia-smi --query-gpu`` lists them; skips where nvidia-smi is missing."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        pytest.skip("nvidia-smi not installed: no independent view to compare NVML's inventory with")
    out = subprocess.run([exe, "--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits"],
                         check=True, text=True, capture_output=True, timeout=60).stdout
    rows = []
    for line in out.strip().splitlines():
        idx, name, mem, uuid = (f.strip() for f in line.split(","))
        rows.append(SmiGpu(int(idx), name, int(mem), uuid))
    return rows


# What CUDA shows a process: device count, each device's UUID (NVML's form, "GPU-…") and name,
# and whether a 64 MiB allocation on device 0 worked. Printed as one JSON line.
CUDA_VIEW = r"""
import json, os, sys
try:
    import torch
except ImportError as e:
    print(json.dumps({"error": f"torch: {e}"})); sys.exit(0)
out = {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "built_with_cuda": torch.version.cuda is not None}
n = torch.cuda.device_count() if out["built_with_cuda"] else 0
out["count"] = n
out["uuids"] = ["GPU-" + str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
out["names"] = [torch.cuda.get_device_name(i) for i in range(n)]
if n:
    x = torch.ones(64 << 20, dtype=torch.uint8, device="cuda:0")
    out["alloc_ok"] = int(x.sum().item()) == 64 << 20
print(json.dumps(out), flush=True)
"""


# The job: reports what CUDA shows it (one JSON line in its log), takes 512 MiB on every GPU it
# sees, writes "ready" in its checkpoint dir, and exits 0 once a "go" file appears there.
JOB = r"""
import json, os, sys, time
import torch
d = os.environ["LAMINAR_CKPT_DIR"]
n = torch.cuda.device_count()
keep = [torch.ones(512 << 20, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
if n:
    torch.cuda.synchronize()
print(json.dumps({"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "order": os.environ.get("CUDA_DEVICE_ORDER"),
                  "count": n, "uuids": ["GPU-" + str(torch.cuda.get_device_properties(i).uuid) for i in range(n)],
                  "alloc_ok": all(int(k.sum().item()) == 512 << 20 for k in keep), "pid": os.getpid()}), flush=True)
open(os.path.join(d, "ready"), "w").close()
end = time.monotonic() + 300
while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < end:
    time.sleep(0.05)
sys.exit(0 if os.path.exists(os.path.join(d, "go")) else 3)
"""


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment without CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER, plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    env.update(overrides)
    return env


def cuda_child(env: dict[str, str]) -> dict[str, Any]:
    """Runs `CUDA_VIEW` in a child with exactly `env`; skips where torch or its CUDA is missing."""
    r = subprocess.run([sys.executable, "-c", CUDA_VIEW], env=env, text=True, capture_output=True, timeout=300)
    assert r.returncode == 0, f"CUDA view child exited {r.returncode}:\n{r.stderr[-4000:]}"
    view: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    if "error" in view:
        pytest.skip(f"no torch for a CUDA child: {view['error']}")
    if not view["built_with_cuda"]:
        pytest.skip("torch here is a CPU build: no CUDA child possible")
    return view


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of `text` that parses as a JSON object, or None."""
    for line in reversed(text.strip().splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict):
            return v
    return None


def runtime_or_skip() -> None:
    """Skips naming why the job runtime (root, cgroups) cannot run here."""
    if os.geteuid() != 0:
        pytest.skip("the job runtime needs root (cgroups)")
    try:
        detect()
    except CgroupError as e:
        pytest.skip(f"the job runtime cannot run here: {e}")
