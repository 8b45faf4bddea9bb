"""Job specs, sizes, signals, GPU choice and cgroup hierarchy detection (no privileges)."""

from __future__ import annotations

from pathlib import Path

import pytest

from laminar.airlock.cgroups import CgroupError, detect
from laminar.runtime import gpus
from laminar.runtime.jobs import JobError, JobSpec, parse_gpus, parse_memory_mb, parse_signal


def test_memory_sizes() -> None:
    assert parse_memory_mb("512M") == 512
    assert parse_memory_mb("2G") == 2048
    assert parse_memory_mb("1.5GiB") == 1536
    assert parse_memory_mb(300) == 300
    assert parse_memory_mb(None) is None
    with pytest.raises(JobError, match="memory 'lots'"):
        parse_memory_mb("lots")
    with pytest.raises(JobError, match="between 1 MiB"):
        parse_memory_mb("0M")


def test_signals_and_gpus() -> None:
    assert parse_signal("usr1") == "SIGUSR1"
    assert parse_signal(12) == "SIGUSR2"
    with pytest.raises(JobError, match="checkpoint signal 'SIGNOPE'"):
        parse_signal("SIGNOPE")
    assert parse_gpus("2") == 2
    assert parse_gpus("0,1") == [0, 1]
    with pytest.raises(JobError, match="unique"):
        parse_gpus([1, 1])


def test_spec_from_dict_validates_with_clear_errors() -> None:
    s = JobSpec.from_dict({"command": ["sleep", "1"], "memory": "1G", "class": "transient", "priority": 7})
    assert (s.memory_mb, s.job_class, s.priority, s.checkpoint_signal) == (1024, "transient", 7, "SIGUSR1")
    for bad, msg in [({"command": []}, "non-empty list"), ({"command": ["x"], "class": "batch"}, "class 'batch'"),
                     ({"command": ["x"], "priority": 101}, "priority 101"), ({"command": ["x"], "bogus": 1}, "unknown keys"),
                     ({"command": ["x"], "env": {"LAMINAR_JOB_ID": "x"}}, "set by the agent"),
                     ({"command": ["x"], "elastic_min": 3, "elastic_max": 2}, "1 <= min <= max"),
                     ({"command": ["x"], "cwd": "rel"}, "absolute path"), ({"command": ["x"], "cpus": 0}, "cpus 0")]:
        with pytest.raises(JobError, match=msg):
            JobSpec.from_dict(bad)
    assert JobSpec.from_dict(s.as_dict()) == s


def test_gpu_choice_declared_and_none() -> None:
    inv = gpus.discover([0, 1, 2])
    if inv.source == "nvml":
        pytest.skip("a real GPU is present; declared inventory not used")
    assert inv.source == "declared" and "no GPUs found" in inv.note
    assert gpus.allocate(inv, used=[0], want=2) == [1, 2]
    with pytest.raises(ValueError, match="only 2 free"):
        gpus.allocate(inv, used=[0], want=3)
    with pytest.raises(ValueError, match="in use"):
        gpus.allocate(inv, used=[1], want=[1])
    none = gpus.discover(None)
    assert none.source == "none" and "treated as 0" in none.note
    with pytest.raises(ValueError, match="asked for 1"):
        gpus.allocate(none, used=[], want=1)


HYBRID = """cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,memory 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,nosuid,cpu 0 0
"""


def test_detect_hybrid_and_v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # detect() reads cgroup.controllers under the cgroup2 mount: point it at a directory we own.
    u = tmp_path / "unified"
    u.mkdir()
    (u / "cgroup.controllers").write_text("hugetlb\n")
    h = detect(HYBRID.replace("/sys/fs/cgroup/unified", str(u)))
    assert h.mode == "hybrid" and set(h.v1) == {"memory", "cpu"} and "v1 cpu" in h.describe()
    (u / "cgroup.controllers").write_text("cpu memory pids\n")
    h2 = detect(f"cgroup2 {u} cgroup2 rw 0 0\n")
    assert h2.mode == "v2" and h2.memory_in_v2 and h2.v1 == {}
    (u / "cgroup.controllers").write_text("cpu\n")
    with pytest.raises(CgroupError, match="no memory controller"):
        detect(f"cgroup2 {u} cgroup2 rw 0 0\n")
    with pytest.raises(CgroupError, match="no cgroup2 mount"):
        detect("proc /proc proc rw 0 0\n")
