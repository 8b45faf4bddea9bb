"""NVML on a real GPU (laminar.runtime.gpus): the inventory, per-process GPU memory, and the
environment that shows a job its GPUs. Each test skips with NVML's reason where no GPU exists
(this VM, CI); on a GPU node it compares with nvidia-smi and with what CUDA shows a child.

Run on a GPU node: ``python3 -m pytest -m gpu tests/gpu`` (docs/gpus.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from gpucheck import child_env, cuda_child, nvml_or_skip, smi_gpus

from laminar.runtime import gpus

pytestmark = pytest.mark.gpu

GIB = 1 << 30

# A CUDA child that takes 1 GiB on the GPU, says "ready", and holds it until stdin closes.
HOLD_GIB = r"""
import sys, torch
x = torch.ones(1 << 30, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("ready", int(x.sum().item()), flush=True)
sys.stdin.read()
"""


def test_discover_reports_the_gpus_nvidia_smi_sees() -> None:
    found = nvml_or_skip()
    smi = smi_gpus()
    for declared in (None, [0, 1, 2, 3, 4, 5, 6, 7, 8]):  # NVML wins over any declared list
        inv = gpus.discover(declared)
        assert inv.source == "nvml" and inv.note == ""
        assert inv.indices == [s.index for s in smi]
        for g, s in zip(inv.gpus, smi, strict=True):
            assert g.name == s.name
            assert g.uuid == s.uuid
            assert g.memory_total is not None and abs(g.memory_total / (1 << 20) - s.memory_mib) <= 1
    d = gpus.discover(None).as_dict()
    assert d["source"] == "nvml"
    assert [(x["index"], x["name"], x["uuid"]) for x in d["gpus"]] == [(g.index, g.name, g.uuid) for g in found]


def test_allocate_on_the_real_inventory() -> None:
    nvml_or_skip()
    inv = gpus.discover(None)
    n = len(inv.gpus)
    assert gpus.allocate(inv, [], n) == inv.indices
    with pytest.raises(ValueError, match=rf"asked for 1, only 0 free \(nvml: {n} GPUs"):
        gpus.allocate(inv, inv.indices, 1)
    with pytest.raises(ValueError, match=r"in use by other jobs"):
        gpus.allocate(inv, [inv.indices[0]], [inv.indices[0]])
    with pytest.raises(ValueError, match=rf"indices \[{n}\] do not exist"):
        gpus.allocate(inv, [], [n])


def _wait_for(pred, timeout: float, step: float = 0.2):  # type: ignore[no-untyped-def]
    """Polls `pred()` until it returns a truthy value or `timeout` passes; returns the last value."""
    end = time.monotonic() + timeout
    v = pred()
    while not v and time.monotonic() < end:
        time.sleep(step)
        v = pred()
    return v


def test_process_memory_follows_a_cuda_child() -> None:
    nvml_or_skip()
    cuda_child(child_env())  # skips where torch has no CUDA
    bystander = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_GIB], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        assert holder.stdout is not None and holder.stdin is not None and holder.stderr is not None
        line = holder.stdout.readline()
        if line.split() != ["ready", str(GIB)]:
            holder.kill()
            pytest.fail(f"the CUDA holder said {line!r}; its stderr:\n{holder.stderr.read()[-4000:]}")
        def holder_seen() -> dict[int, int]:
            m = gpus.nvml_process_memory()
            return m if m.get(holder.pid, 0) >= GIB else {}

        per_pid = _wait_for(holder_seen, 30)
        assert per_pid, f"NVML never attributed >= 1 GiB to the holder pid {holder.pid}: {gpus.nvml_process_memory()}"
        # only processes that use the GPU: not this test (it never touched CUDA), not the bystander
        assert bystander.pid not in per_pid and os.getpid() not in per_pid
        holder.stdin.close()
        assert holder.wait(60) == 0
        gone = _wait_for(lambda: holder.pid not in gpus.nvml_process_memory(), 30)
        assert gone, f"NVML still lists the exited holder {holder.pid}: {gpus.nvml_process_memory()}"
    finally:
        for p in (holder, bystander):
            if p.poll() is None:
                p.kill()
                p.wait(30)


def test_cuda_env_shows_a_child_exactly_its_gpu() -> None:
    nvml_or_skip()
    inv = gpus.discover(None)
    everything = cuda_child(child_env())
    assert everything["count"] == len(inv.gpus)
    assert sorted(everything["uuids"]) == sorted(str(g.uuid) for g in inv.gpus)
    for g in inv.gpus:
        env = gpus.cuda_env(inv, [g.index])
        assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": g.uuid}
        view = cuda_child(child_env(**env))
        assert view["count"] == 1 and view["uuids"] == [g.uuid] and view["alloc_ok"] is True
    none = gpus.cuda_env(inv, [])
    assert none["CUDA_VISIBLE_DEVICES"] == ""
    assert cuda_child(child_env(**none))["count"] == 0
    with pytest.raises(ValueError, match=rf"index {len(inv.gpus)} is not in this node's inventory"):
        gpus.cuda_env(inv, [len(inv.gpus)])


def test_index_form_with_pci_order_names_the_same_gpu() -> None:
    """What the runtime sets today (CUDA_VISIBLE_DEVICES=<NVML index>) names the GPU NVML calls
    that index once CUDA_DEVICE_ORDER=PCI_BUS_ID is set (CUDA's default order may differ on a
    node of mixed GPUs)."""
    nvml_or_skip()
    inv = gpus.discover(None)
    for g in inv.gpus:
        view = cuda_child(child_env(CUDA_VISIBLE_DEVICES=str(g.index), CUDA_DEVICE_ORDER="PCI_BUS_ID"))
        assert view["count"] == 1 and view["uuids"] == [g.uuid]

