"""An adopted Slurm job's GPUs are what slurmctld gave it here, never what its task says
(laminar.runtime.adopt.Adoption.scheduler_gpus; issue 35): a user's task naming a GPU its job
does not hold is refused naming both lists; with ``[slurm] enabled = false`` a user's task naming
GPUs is refused naming the setting; root's requests are taken as they are. slurmctld is a
stand-in ``scontrol`` (a real program written by the test, named so) that answers ``show job -d``
from a file and counts its calls: the child process, its bounds and the parser are real."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from laminar.runtime.adopt import Adoption, parse_adopt
from laminar.runtime.spec import JobError

STANDIN = r'''#!{python}
# standin-scontrol: a stand-in for Slurm's scontrol (tests/unit/test_adopt_gpus.py): records argv,
# prints the file "jobd" beside it for `show job -d`, after "delay" seconds
import json, os, sys, time
here = os.path.dirname(os.path.abspath(sys.argv[0]))
with open(os.path.join(here, "argv.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
p = os.path.join(here, "delay")
time.sleep(float(open(p).read()) if os.path.exists(p) else 0)
if sys.argv[1:4] == ["show", "job", "-d"]:
    sys.stdout.write(open(os.path.join(here, "jobd")).read())
'''

# slurmctld's word on job 1234: GPU 1 on this node (lmt-n0), GPUs 0-1 on another
JOBD = """JobId=1234 JobName=train
   JobState=RUNNING Reason=None
     Nodes=lmt-n0 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:1)
     Nodes=lmt-n1 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1)
"""


@pytest.fixture()
def standin(tmp_path: Path) -> SimpleNamespace:
    exe = tmp_path / "standin-scontrol"
    exe.write_text(STANDIN.replace("{python}", sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "jobd").write_text(JOBD)
    log = tmp_path / "argv.jsonl"
    return SimpleNamespace(exe=str(exe), dir=tmp_path,
                           argv=lambda: [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else [])


def adoption(standin: SimpleNamespace | None, owner: str = "laminar") -> Adoption:
    a = Adoption(SimpleNamespace())  # type: ignore[arg-type]  (scheduler_gpus reads no job manager)
    slurm = {"enabled": standin is not None, "scontrol": standin.exe if standin else "scontrol",
             "node_name": "lmt-n0", "timeout_s": 10.0}
    a.configure(None, {"owner": owner}, slurm)
    return a


def req(gpus: list[int], caller: int = 1000, ref: str = "1234", scheduler: str = "slurm"):  # type: ignore[no-untyped-def]
    body = {"scheduler": scheduler, "ref": ref, "uid": caller or 1000, "gid": 1000, "gpus": gpus}
    body.update({"pid": 4321} if scheduler == "slurm" else {"cgroup": "kubepods.slice/p"})
    return parse_adopt(body, caller)


def test_a_users_task_is_adopted_with_the_gpus_slurmctld_gave_its_job_here(standin: SimpleNamespace) -> None:
    a = adoption(standin)
    assert asyncio.run(a.scheduler_gpus(req([1]))).gpus == (1,)
    assert standin.argv() == [["show", "job", "-d", "1234"]]
    # [gpus] owner = "scheduler": asked even when the task names none (SLURM_STEP_GPUS unset)
    assert asyncio.run(adoption(standin, "scheduler").scheduler_gpus(req([]))).gpus == (1,)


def test_a_task_naming_a_gpu_its_job_does_not_hold_here_is_refused_naming_both(standin: SimpleNamespace) -> None:
    a = adoption(standin)
    with pytest.raises(JobError) as e:
        asyncio.run(a.scheduler_gpus(req([0, 1])))
    msg = str(e.value)
    assert "slurm job 1234: gpus [0, 1]" in msg and "SLURM_STEP_GPUS" in msg, msg
    assert "slurmctld gave the job on node lmt-n0: [1] ([0] not among them)" in msg, msg
    assert "refused, nothing changed" in msg and "--gres=gpu:N" in msg and e.value.reason == "adopt_gpus"
    # a job without gres here: slurmctld says none
    (standin.dir / "jobd").write_text("JobId=1234 JobName=x\n     Nodes=lmt-n0 CPU_IDs=0 Mem=0 GRES=\n")
    with pytest.raises(JobError, match=r"gpus \[0\] .* on node lmt-n0: none \(\[0\] not among them\)"):
        asyncio.run(a.scheduler_gpus(req([0])))


def test_slurmctld_not_answering_or_not_listing_this_node_refuses(standin: SimpleNamespace) -> None:
    a = adoption(standin)
    (standin.dir / "jobd").write_text("JobId=1234 JobName=x\n     Nodes=lmt-n1 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0)\n")
    with pytest.raises(JobError, match=r"could not be checked with slurmctld.*no allocation of the job on this node"):
        asyncio.run(a.scheduler_gpus(req([0])))
    (standin.dir / "delay").write_text("30")
    a.slurm.timeout_s = 0.5
    with pytest.raises(JobError, match=r"could not be checked with slurmctld.*no answer within 0.5 s"):
        asyncio.run(a.scheduler_gpus(req([1])))


def test_the_timeout_is_within_what_the_plugin_waits() -> None:
    from laminar.runtime import adopt

    a = Adoption(SimpleNamespace())  # type: ignore[arg-type]
    a.configure(None, None, {"enabled": True, "node_name": "lmt-n0", "timeout_s": 60.0})
    assert a.slurm.timeout_s == adopt.SLURM_GPUS_TIMEOUT_S < 10  # the plugin's TIMEOUT_MS


def test_tasks_of_one_job_asking_at_once_share_one_question(standin: SimpleNamespace) -> None:
    a = adoption(standin)
    (standin.dir / "delay").write_text("0.5")

    async def go() -> list[tuple[int, ...]]:
        return [r.gpus for r in await asyncio.gather(*(a.scheduler_gpus(req([1])) for _ in range(8)))]

    assert asyncio.run(go()) == [(1,)] * 8
    assert len(standin.argv()) == 1 and a._asking == {}


def test_without_slurm_a_users_task_naming_gpus_is_refused_naming_the_setting() -> None:
    a = adoption(None)
    with pytest.raises(JobError) as e:
        asyncio.run(a.scheduler_gpus(req([0])))
    msg = str(e.value)
    assert "slurm job 1234: gpus [0]" in msg and "[slurm] enabled = false" in msg, msg
    assert "[slurm] enabled = true" in msg and "refused, nothing changed" in msg, msg
    # naming none: nothing claimed, adopted holding no GPU, owner scheduler or not
    assert asyncio.run(a.scheduler_gpus(req([]))).gpus == ()
    assert asyncio.run(adoption(None, "scheduler").scheduler_gpus(req([]))).gpus == ()


def test_roots_requests_and_kubernetes_are_taken_as_they_are(standin: SimpleNamespace) -> None:
    a = adoption(standin, "scheduler")
    assert asyncio.run(a.scheduler_gpus(req([0, 3], caller=0))).gpus == (0, 3)
    assert asyncio.run(adoption(None).scheduler_gpus(req([0], caller=0))).gpus == (0,)
    assert asyncio.run(a.scheduler_gpus(req([2], caller=0, ref="ns/p", scheduler="kubernetes"))).gpus == (2,)
    assert standin.argv() == []
