"""Job specs, sizes, signals, GPU choice, cgroup hierarchy detection and admission by class
capacity (no privileges)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from laminar.airlock import policy
from laminar.airlock.cgroups import CgroupError, detect
from laminar.policy import admission
from laminar.runtime import gpus
from laminar.runtime.spec import JobError, JobSpec, parse_gpus, parse_memory_mb, parse_signal


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
                     ({"command": ["x"], "env": {"LAMINAR_JOB_ID": "x"}}, "LAMINAR_JOB_ID.*reserved"),
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


# -- admission by class capacity (airlock.admission: pure) ------------------------------------------

def _q(jid: str, num: int, cls: str = "transient", prio: int = 50, mb: int | None = 100) -> admission.Queued:
    return admission.Queued(jid, num, cls, prio, mb)


def test_admission_room_is_cap_minus_member_limits_and_the_queue_is_fifo_by_priority() -> None:
    lim = admission.Limits({"transient": 512})
    # 400 MiB of members: room 112. FIFO within a class, priority first; the head blocks.
    start, waits = admission.plan([_q("a", 1, mb=100), _q("b", 2, mb=200), _q("c", 3, prio=90, mb=300)],
                                  {"transient": 400}, lim)
    assert start == [] and list(admission.queue_order([_q("a", 1), _q("c", 3, prio=90)]))[0].id == "c"
    assert (waits["c"].position, waits["a"].position, waits["b"].position) == (1, 2, 3)
    assert waits["c"].reason("transient") == ("waiting for class transient: needs 300 MiB, 112 MiB free under "
                                              "its cap of 512 MiB")
    assert "1 job(s) ahead" in waits["a"].reason("transient")
    # Room 312: c (300) starts; a (100) does not fit the 12 left and blocks b.
    start, waits = admission.plan([_q("a", 1), _q("b", 2, mb=200), _q("c", 3, prio=90, mb=300)], {"transient": 200}, lim)
    assert start == ["c"] and set(waits) == {"a", "b"}
    # Room for all: they start in queue order.
    start, _ = admission.plan([_q("b", 2, mb=200), _q("a", 1), _q("c", 3, prio=90)], {}, lim)
    assert start == ["c", "a", "b"]


def test_admission_without_a_cap_starts_everything_and_classes_are_independent() -> None:
    lim = admission.Limits({"standard": 100})
    start, waits = admission.plan([_q("t", 1, "transient", mb=10_000), _q("s", 2, "standard", mb=60)],
                                  {"standard": 50}, lim)
    assert start == ["t"] and waits["s"].free_mb == 50
    assert admission.plan([_q("t", 1, mb=None)], {}, admission.NO_LIMITS)[0] == ["t"]


def test_admission_charges_and_never_fits() -> None:
    assert admission.charge_mb(200, 512) == 200
    assert admission.charge_mb(None, 512) == 512  # no limit: may use the whole cap
    assert admission.charge_mb(None, None) == 0
    assert admission.never_fits(600, 512) and not admission.never_fits(512, 512) and not admission.never_fits(None, 512)
    assert not admission.never_fits(10 ** 6, None)
    # A job queued before the cap was lowered under it waits without blocking the others.
    start, waits = admission.plan([_q("big", 1, mb=600), _q("small", 2, mb=100)], {}, admission.Limits({"transient": 512}))
    assert start == ["small"] and waits["big"].never and "raise the cap" in waits["big"].reason("transient")
    assert admission.class_caps({"transient": 1024, "standard": 300}, {"transient": 512, "long-resident": 64}) == \
        {"transient": 512, "standard": 300, "long-resident": 64}


def test_policy_admission_keys_are_validated_by_name() -> None:
    p = policy.validate({"class_caps_mb": {"transient": 512}, "job_default_mb": {"transient": 128}})
    assert p["class_caps_mb"] == {"transient": 512} and p["job_default_mb"] == {"transient": 128}
    assert policy.validate({})["class_caps_mb"] == {}
    for doc, needle in [({"class_caps_mb": {"gold": 1}}, "unknown class 'gold' in class_caps_mb"),
                        ({"class_caps_mb": {"transient": 0}}, "class_caps_mb.transient 0"),
                        ({"class_caps_mb": {"transient": "1G"}}, "expected MiB as an integer"),
                        ({"job_default_mb": {"standard": True}}, "job_default_mb.standard True"),
                        ({"class_caps_mb": 5}, "class_caps_mb must be a table"),
                        ({"class_caps_mb": {"transient": 100}, "job_default_mb": {"transient": 200}},
                         "job_default_mb.transient 200 exceeds class_caps_mb.transient 100")]:
        with pytest.raises(policy.PolicyError, match=re.escape(needle)):
            policy.validate(doc)


def test_a_gpu_list_longer_than_any_node_is_refused_at_once_and_named_briefly() -> None:
    """gpus = [0, 1, ..., 149999] (fits the API's 1 MiB body) used to pass validation and reach
    gpus.allocate, whose duplicate check was quadratic: minutes of the agent's event loop for one
    local user's request (root's kill-switch unanswered meanwhile), then a 1 MB error message."""
    many = list(range(150_000))
    with pytest.raises(JobError) as e:
        JobSpec.from_dict({"command": ["true"], "gpus": many})
    msg = str(e.value)
    assert "gpus" in msg and str(gpus.GPUS_MAX) in msg and len(msg) < 300, msg[:400]
    with pytest.raises(JobError, match=f"at most {gpus.GPUS_MAX}"):
        parse_gpus(gpus.GPUS_MAX + 1)
    with pytest.raises(JobError, match="0..1023"):
        parse_gpus([0, gpus.GPUS_MAX])
    assert parse_gpus(list(range(gpus.GPUS_MAX))) == list(range(gpus.GPUS_MAX))
    # the pure choice stays linear for what is let through, and names a repeat
    inv = gpus.discover(list(range(gpus.GPUS_MAX)))
    assert gpus.allocate(inv, [], list(range(gpus.GPUS_MAX))) == list(range(gpus.GPUS_MAX))
    with pytest.raises(ValueError, match=r"indices \[3\] listed more than once"):
        gpus.allocate(inv, [], [3, 1, 3])


@pytest.mark.parametrize("spec, names", [
    ({"class": "transient", "job_class": "long-resident"}, ["'class' = 'transient'", "'job_class' = 'long-resident'"]),
    ({"memory": "1G", "memory_mb": 64}, ["'memory' = '1G'", "'memory_mb' = 64"]),
])
def test_a_spec_giving_one_thing_twice_is_refused_whole(spec: dict[str, object], names: list[str]) -> None:
    """'class' and 'job_class' (or 'memory' and 'memory_mb') in one spec: one silently won, so a
    job asked for as long-resident ran as transient (or with another memory limit)."""
    with pytest.raises(JobError) as e:
        JobSpec.from_dict({"command": ["true"], **spec})
    for n in names:
        assert n in str(e.value), str(e.value)
    assert JobSpec.from_dict({"command": ["true"], "job_class": "transient", "memory_mb": 64}).memory_mb == 64
