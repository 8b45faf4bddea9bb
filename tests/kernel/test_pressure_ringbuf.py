"""pressure.bpf.o on the real kernel: a process that allocates past its memory limit shows up
in the lm_events ring buffer as memcg reclaim and then as the OOM victim, with its cgroup2 id
and pid.

The process runs in a cgroup2 directory of the test's own (whose id the events carry) and, on a
hybrid host (this VM: the memory controller is v1), in a v1 memory cgroup of its own with the
limit (32 MiB); on a pure-v2 host the one cgroup2 directory carries the limit (memory.max). All
are removed afterwards, as are the pins (/sys/fs/bpf/laminar-t-<hex>).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from laminar.airlock.cgroups import detect
from laminar.bpf import abi
from laminar.bpf.libbpf import BpfLink, BpfMap, BpfObject, RingBuffer, object_path

# serial: its memory pressure is felt machine-wide (node PSI, MemAvailable); run alone (Makefile)
pytestmark = [pytest.mark.kernel, pytest.mark.serial]

HIER = detect()
LIMIT = 32 << 20
WAIT_S = 30.0

# Touch 4 MiB at a time up to 256 MiB: the 32 MiB limit is crossed within the first few steps.
HOG = """
chunks = []
for _ in range(64):
    b = bytearray(4 << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    chunks.append(b)
"""


@pytest.fixture
def pressure() -> Iterator[dict[str, Any]]:
    tag = secrets.token_hex(3)
    pin_root = f"/sys/fs/bpf/laminar-t-{tag}"
    obj = BpfObject.open(object_path("pressure"), pin_root=pin_root)
    links: list[BpfLink] = []
    ring: RingBuffer | None = None
    events: list[dict[str, Any]] = []
    v2 = HIER.unified / f"laminar-t-{tag}"
    v1 = None if HIER.memory_in_v2 else HIER.v1["memory"] / f"laminar-t-{tag}"
    try:
        obj.load()
        links = [p.attach() for p in obj.programs().values()]
        ring = RingBuffer(obj.map("lm_events"), lambda data: events.append(abi.decode_event(data)))
        v2.mkdir()
        if v1 is None:
            (v2 / "memory.max").write_text(str(LIMIT))
            if (v2 / "memory.swap.max").exists():
                (v2 / "memory.swap.max").write_text("0")  # swap would put the OOM kill off
        else:
            v1.mkdir()
            (v1 / "memory.limit_in_bytes").write_text(str(LIMIT))
        yield {"ring": ring, "events": events, "v1": v1, "v2": v2, "pin_root": pin_root}
    finally:
        if ring is not None:
            ring.close()
        for link in links:
            link.destroy()
        obj.close()
        for d in (v1, v2):
            if d is not None and d.exists():
                end = time.monotonic() + WAIT_S
                while (d / "cgroup.procs").read_text().strip() and time.monotonic() < end:
                    time.sleep(0.05)
                d.rmdir()
        shutil.rmtree(pin_root, ignore_errors=True)


def test_programs_attach_and_share_lm_stats(pressure: dict[str, Any]) -> None:
    """Every program is attached; lm_stats is the pinned per-CPU array netguard shares."""
    with BpfMap.from_pin(Path(pressure["pin_root"]) / "lm_stats") as stats:
        assert stats.type_name == "percpu_array" and stats.max_entries == abi.LM_STAT_MAX
        assert stats.lookup_percpu_sum(abi.LM_STAT_EV_LOST) == 0


def test_memcg_reclaim_and_oom_victim_events(pressure: dict[str, Any]) -> None:
    v1, v2 = pressure["v1"], pressure["v2"]
    cg2_id = os.stat(v2).st_ino  # what bpf_get_current_cgroup_id() returns for its tasks

    def enter() -> None:
        pid = str(os.getpid())
        if v1 is not None:
            (v1 / "cgroup.procs").write_text(pid)
        (v2 / "cgroup.procs").write_text(pid)

    hog = subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=enter)
    ring: RingBuffer = pressure["ring"]
    events: list[dict[str, Any]] = pressure["events"]

    def mine(kind: str) -> list[dict[str, Any]]:
        return [e for e in events if e["type"] == kind and e["pid"] == hog.pid]

    try:
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end and not (mine("oom_victim") and hog.poll() is not None):
            ring.poll(100)
        ring.consume()
    finally:
        if hog.poll() is None:
            hog.kill()
        hog.wait()

    assert hog.returncode == -9, f"the hog should be OOM-killed, exit {hog.returncode}"
    reclaim = mine("memcg_reclaim_begin")
    assert reclaim, f"no memcg reclaim event for pid {hog.pid} among {len(events)} events"
    assert all(e["cgroup_id"] == cg2_id for e in reclaim)
    assert mine("memcg_reclaim_end"), "reclaim began but never ended"
    victims = mine("oom_victim")
    assert len(victims) == 1
    v = victims[0]
    assert v["cgroup_id"] == cg2_id and v["comm"].startswith("python")
    assert v["ts_ns"] >= reclaim[0]["ts_ns"]
    if v1 is not None:
        assert int((v1 / "memory.failcnt").read_text()) > 0
    else:
        events_v2 = dict(line.split() for line in (v2 / "memory.events").read_text().splitlines())
        assert int(events_v2["max"]) > 0 and int(events_v2["oom_kill"]) == 1, events_v2
