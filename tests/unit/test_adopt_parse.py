"""The adoption request (laminar.runtime.adopt.parse_adopt): every bad field refused naming the
value and what is right; only root names another uid; the defaults."""

from __future__ import annotations

import os
import pwd
from typing import Any

import pytest

from laminar.policy.sched import Scheduler
from laminar.runtime.adopt import AdoptRefused, parse_adopt
from laminar.runtime.spec import JobError

OK: dict[str, Any] = {"scheduler": "slurm", "ref": "1234", "pid": 4321, "uid": 1000, "gid": 1000}


def test_a_slurm_task_by_its_pid_with_the_defaults() -> None:
    req = parse_adopt(OK, 0)
    assert req.scheduler is Scheduler.SLURM and req.ref == "1234" and req.pid == 4321 and req.cgroup is None
    assert (req.uid, req.gid, req.job_class, req.priority, req.checkpoint, req.gpus, req.name) == (
        1000, 1000, "standard", 50, "SIGUSR1", (), None)


def test_a_pod_by_its_cgroup_and_the_fields_given() -> None:
    req = parse_adopt({"scheduler": "kubernetes", "ref": "ns/p", "cgroup": "/kubepods.slice/x.slice/", "uid": 0,
                       "gid": 0, "class": "long-resident", "priority": 90, "checkpoint": "USR2", "gpus": [0, 3],
                       "name": "train.0"}, 0)
    assert req.cgroup == "kubepods.slice/x.slice" and req.pid is None and req.checkpoint == "SIGUSR2"
    assert req.gpus == (0, 3) and req.priority == 90 and req.job_class == "long-resident" and req.name == "train.0"
    assert parse_adopt({**OK, "checkpoint": "none"}, 0).checkpoint == "none"


def test_the_caller_is_the_jobs_user_by_default() -> None:
    me = os.getuid()
    body = {k: v for k, v in OK.items() if k not in ("uid", "gid")}
    req = parse_adopt(body, me)
    assert req.uid == me and req.gid == pwd.getpwuid(me).pw_gid


BAD = [
    ({"scheduler": "pbs"}, "'pbs'"),
    ({"ref": "12a"}, "'12a'"),
    ({"ref": None}, "None"),
    ({"pid": 0}, "pid 0"),
    ({"pid": True}, "pid True"),
    ({"pid": "12"}, "pid '12'"),
    ({"pid": None}, "exactly one"),
    ({"cgroup": "kubepods"}, "exactly one"),
    ({"uid": -1}, "uid -1"),
    ({"uid": 1 << 32}, f"uid {1 << 32}"),
    ({"gid": "x"}, "gid 'x'"),
    ({"class": ""}, "class ''"),
    ({"class": 7}, "class 7"),
    ({"priority": 101}, "priority 101"),
    ({"priority": 5.5}, "priority 5.5"),
    ({"checkpoint": "KILL"}, "KILL"),
    ({"checkpoint": "WHAT"}, "WHAT"),
    ({"gpus": [0, 0]}, "[0, 0]"),
    ({"gpus": [-1]}, "[-1]"),
    ({"gpus": "0,1"}, "'0,1'"),
    ({"gpus": [True]}, "[True]"),
    ({"name": "a b"}, "'a b'"),
    ({"name": "x" * 64}, "x" * 20),
    ({"bogus": 1}, "'bogus'"),
]


@pytest.mark.parametrize(("change", "named"), BAD)
def test_a_bad_field_is_refused_naming_it(change: dict[str, Any], named: str) -> None:
    body = {**OK, **change}
    with pytest.raises(JobError) as e:
        parse_adopt(body, 0)
    assert named in str(e.value), str(e.value)
    assert not isinstance(e.value, AdoptRefused)


@pytest.mark.parametrize("cgroup", ["../x", "a/../../b", "", "/", "a\0b", 5])
def test_a_bad_cgroup_path_is_refused_naming_it(cgroup: Any) -> None:
    with pytest.raises(JobError, match="cgroup"):
        parse_adopt({"scheduler": "kubernetes", "ref": "ns/p", "cgroup": cgroup, "uid": 0, "gid": 0}, 0)


def test_a_slurm_task_needs_its_pid_and_a_body_must_be_an_object() -> None:
    with pytest.raises(JobError, match="pid"):
        parse_adopt({"scheduler": "slurm", "ref": "1", "cgroup": "x", "uid": 0, "gid": 0}, 0)
    with pytest.raises(JobError, match="JSON object"):
        parse_adopt([OK], 0)


def test_only_root_names_another_uid() -> None:
    with pytest.raises(AdoptRefused, match="uid 1000.*only root"):
        parse_adopt(OK, 1001)
    assert parse_adopt(OK, 1000).uid == 1000


def test_the_check_needs_no_pid_or_cgroup_and_ignores_them() -> None:
    body = {k: v for k, v in OK.items() if k != "pid"}
    assert parse_adopt(body, 0, target=False).pid is None
    req = parse_adopt({**OK, "cgroup": "../x"}, 0, target=False)
    assert req.pid is None and req.cgroup is None


def test_the_check_needs_no_ref_as_srun_has_no_job_id_yet_but_a_ref_given_is_checked() -> None:
    """What the SPANK plugin asks at srun/sbatch (spank/laminar_spank.c): no ref, no pid."""
    body = {"scheduler": "slurm", "uid": 1000, "gid": 1000, "class": "standard", "priority": 40}
    req = parse_adopt(body, 1000, target=False)
    assert (req.ref, req.job_class, req.priority) == ("", "standard", 40)
    with pytest.raises(JobError, match="slurm ref 'j1'"):
        parse_adopt({**body, "ref": "j1"}, 1000, target=False)
    with pytest.raises(JobError, match="slurm ref"):  # the adoption itself needs it
        parse_adopt({**body, "pid": 4321}, 1000)
