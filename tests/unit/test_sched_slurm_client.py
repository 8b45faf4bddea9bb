"""The Slurm client (:class:`laminar.sched.slurm.Slurm`) and backend, against a stand-in
``scontrol``: a real program written by the test (``standin-scontrol``) that records its argv and
answers as scontrol does (a ``show`` line, an error on stderr with a non-zero status, no answer,
too much output). Real: the child processes, their pipes, their timeouts and kills. What a real
slurmctld says is tests/cluster/test_slurm_reclaim_cluster.py.

Checked: each call's exact command line; every value checked before it reaches scontrol (a bad
node name, job id, a newline in a reason); errors name the command line and scontrol's stderr;
a hung scontrol is killed at ``timeout_s``; one that prints without end is killed past
``output_max``; the backend resumes only a node whose drain reason is Laminar's; the published
comment keeps the user's words."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from laminar.config import Config, validate
from laminar.policy.sched import Scheduler
from laminar.sched import slurm
from laminar.sched.slurm import Slurm, SlurmBackend, SlurmError

STANDIN = r'''#!{python}
# standin-scontrol: a stand-in for Slurm's scontrol (the test's, named so), for
# tests/unit/test_sched_slurm_client.py. Records argv, answers per the files beside it (the
# client gives scontrol only PATH, LC_ALL and SLURM_CONF of its environment).
import json, os, sys, time
here = os.path.dirname(os.path.abspath(sys.argv[0]))
def said(name, default):
    p = os.path.join(here, name)
    return open(p).read().strip() if os.path.exists(p) else default
with open(os.path.join(here, "argv.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
mode = said("mode", "ok")
if mode == "fail":
    sys.stderr.write("slurm_update error: Invalid node name specified\n")
    sys.exit(1)
if mode == "hang":
    time.sleep(60)
if mode == "flood":
    while True:
        sys.stdout.write("x" * 65536)
        sys.stdout.flush()
if sys.argv[1:4] == ["show", "job", "-d"]:
    sys.stdout.write(said("jobd", ""))
elif sys.argv[1:3] == ["show", "job"]:
    print("JobId=%s JobName=train UserId=u(1000) JobState=RUNNING Reason=None Comment=%s NodeList=lmt1" % (
        sys.argv[3], said("comment", "(null)")))
elif sys.argv[1:3] == ["show", "node"]:
    print("NodeName=%s Arch=x86_64 State=IDLE+DRAIN Reason=%s [root@2026-12-06T23:30:00]" % (
        sys.argv[3], said("reason", "laminar: reclaim of node lmt1: owner")))
'''


@pytest.fixture()
def standin(tmp_path: Path) -> SimpleNamespace:
    exe = tmp_path / "standin-scontrol"
    exe.write_text(STANDIN.replace("{python}", sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "argv.jsonl"
    mode = tmp_path / "mode"
    mode.write_text("ok")

    def argv() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return SimpleNamespace(exe=str(exe), argv=argv, mode=mode, dir=tmp_path)


def test_command_lines(standin: SimpleNamespace) -> None:
    async def go() -> None:
        c = Slurm(standin.exe, timeout_s=10)
        await c.drain("lmt1", "laminar: reclaim of node lmt1: owner")
        await c.undrain("lmt1")
        await c.requeue("1234")
        await c.set_comment("1234", "mine; laminar-ckpt=5 /s/ckpt-1")
        job = await c.job("1234")
        node = await c.node("lmt1")
        assert job["JobState"] == "RUNNING" and job["NodeList"] == "lmt1" and job["Comment"] == "(null)"
        assert node["State"] == "IDLE+DRAIN"
        assert node["Reason"].startswith("laminar: reclaim of node lmt1: owner")
        assert c.calls == 6 and c.failures == 0

    asyncio.run(go())
    assert standin.argv() == [
        ["update", "NodeName=lmt1", "State=DRAIN", "Reason=laminar: reclaim of node lmt1: owner"],
        ["update", "NodeName=lmt1", "State=UNDRAIN"],
        ["requeue", "1234"],
        ["update", "JobId=1234", "Comment=mine; laminar-ckpt=5 /s/ckpt-1"],
        ["show", "job", "1234", "--oneliner"],
        ["show", "node", "lmt1", "--oneliner"],
    ]


@pytest.mark.parametrize("call,match", [
    (lambda c: c.drain("lmt1;rm", "r"), "node name 'lmt1;rm'"),
    (lambda c: c.drain("-x", "r"), "node name '-x'"),
    (lambda c: c.drain("lmt1", "two\nlines"), "reason 'two\\\\nlines'"),
    (lambda c: c.requeue("1234.0"), "job '1234.0': expected a Slurm job id"),
    (lambda c: c.requeue("12345678901"), "expected a Slurm job id"),
    (lambda c: c.set_comment("12", "x" * 5000), "comment 'xxx"),
])
def test_bad_values_never_reach_scontrol(standin: SimpleNamespace, call, match: str) -> None:
    with pytest.raises(SlurmError, match=match):
        asyncio.run(call(Slurm(standin.exe)))
    assert standin.argv() == []


def test_failure_names_the_command_and_stderr(standin: SimpleNamespace) -> None:
    standin.mode.write_text("fail")
    c = Slurm(standin.exe)
    with pytest.raises(SlurmError) as e:
        asyncio.run(c.drain("lmt9", "laminar: x"))
    msg = str(e.value)
    assert "scontrol update NodeName=lmt9 State=DRAIN Reason=laminar: x" in msg
    assert "exit status 1" in msg and "Invalid node name specified" in msg
    assert c.failures == 1


def test_missing_binary_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SlurmError, match="not found on PATH.*slurm-client"):
        asyncio.run(Slurm("lm-no-such-scontrol").requeue("1"))
    with pytest.raises(SlurmError, match="could not run"):
        asyncio.run(Slurm(str(tmp_path / "nothing")).requeue("1"))


def test_hung_scontrol_is_killed_at_the_timeout(standin: SimpleNamespace) -> None:
    standin.mode.write_text("hang")
    t0 = time.monotonic()
    with pytest.raises(SlurmError, match=r"scontrol requeue 7: no answer within 0.5 s .*killed"):
        asyncio.run(Slurm(standin.exe, timeout_s=0.5).requeue("7"))
    assert time.monotonic() - t0 < 5


def test_endless_output_is_cut(standin: SimpleNamespace) -> None:
    standin.mode.write_text("flood")
    t0 = time.monotonic()
    with pytest.raises(SlurmError, match=r"printed more than 262144 bytes; killed"):
        asyncio.run(Slurm(standin.exe, timeout_s=20, output_max=256 << 10).job("7"))
    assert time.monotonic() - t0 < 10


def test_parse_oneliner_values_with_spaces() -> None:
    f = slurm.parse_oneliner("JobId=5 JobName=a b Comment=mine; laminar-ckpt=9 /s/x y Restarts=1 NodeList=lmt[1-2]\n")
    assert f == {"JobId": "5", "JobName": "a b", "Comment": "mine; laminar-ckpt=9 /s/x y", "Restarts": "1",
                 "NodeList": "lmt[1-2]"}
    assert slurm.parse_oneliner("") == {}


def _job(ref: str | None = "1234", active: bool = False) -> SimpleNamespace:
    """A stand-in adopted job (``active``: its processes here still run)."""
    return SimpleNamespace(id="job-3", active=active,
                           origin=SimpleNamespace(scheduler=Scheduler.SLURM if ref else None, scheduler_ref=ref))


def test_backend_undrain_only_its_own_drain(standin: SimpleNamespace) -> None:
    b = SlurmBackend(Slurm(standin.exe), "lmt1")
    assert b.scheduler == Scheduler.SLURM

    async def go() -> None:
        await b.drain("owner needs it")
        assert b.drained_reason == "laminar: reclaim of node lmt1: owner needs it"
        await b.undrain("withdrawn")  # the node's reason is ours: resumed
        (standin.dir / "reason").write_text("disk swap by ops")
        await b.undrain("withdrawn")  # an operator's drain: left

    asyncio.run(go())
    assert standin.argv() == [
        ["update", "NodeName=lmt1", "State=DRAIN", "Reason=laminar: reclaim of node lmt1: owner needs it"],
        ["show", "node", "lmt1", "--oneliner"],
        ["update", "NodeName=lmt1", "State=UNDRAIN"],
        ["show", "node", "lmt1", "--oneliner"],
    ]


def test_backend_give_back_and_publish(standin: SimpleNamespace) -> None:
    b = SlurmBackend(Slurm(standin.exe), "lmt1", newest=lambda job: "/shared/slurm-1234/ckpt-40")
    (standin.dir / "comment").write_text("my sweep 3")

    async def go() -> None:
        assert await b.give_back(_job(), "/shared/slurm-1234/ckpt-40") == \
            "slurm job 1234 requeued, to resume from /shared/slurm-1234/ckpt-40; its processes here are gone and " \
            "Slurm's hold on its restart released"
        await b.publish(_job(), 1765000000.5)
        with pytest.raises(SlurmError, match="job job-3 has no Slurm job id"):
            await b.give_back(_job(None), None)

    asyncio.run(go())
    assert standin.argv() == [
        ["requeue", "1234"],
        ["update", "JobId=1234", "StartTime=now"],  # its processes here are gone: Slurm's hold released
        ["show", "job", "1234", "--oneliner"],
        ["update", "JobId=1234", "Comment=my sweep 3; laminar-ckpt=1765000000 /shared/slurm-1234/ckpt-40"],
    ]
    off = SlurmBackend(Slurm(standin.exe), "lmt1", publish_comment=False)
    asyncio.run(off.publish(_job(), 1.0))
    assert len(standin.argv()) == 4  # nothing run


def test_a_requeued_job_whose_processes_here_outlive_the_wait_keeps_slurms_hold(standin: SimpleNamespace,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Two copies must never run: while its processes here live, its restart elsewhere waits."""
    import laminar.sched.slurm as slurm_mod

    monkeypatch.setattr(slurm_mod, "RELEASE_WAIT_S", 0.3)
    b = SlurmBackend(Slurm(standin.exe), "lmt1")
    said = asyncio.run(b.give_back(_job(active=True), None))
    assert said.endswith("its processes here outlived the wait, so Slurm's hold stays"), said
    assert standin.argv() == [["requeue", "1234"]]


def test_config_section_and_build(tmp_path: Path) -> None:
    cfg = Config(validate({"slurm": {"enabled": True, "node_name": "lmt2", "scontrol": "/usr/bin/scontrol",
                                     "timeout_s": 3}}))
    b = slurm.build(SimpleNamespace(config=cfg))
    assert b.node == "lmt2" and b.client.scontrol == "/usr/bin/scontrol" and b.client.timeout_s == 3.0
    assert slurm.build(SimpleNamespace(config=Config(validate({})))).node == os.uname().nodename.split(".")[0]
    from laminar.config import ConfigError

    with pytest.raises(ConfigError, match="slurm.node_name = 'a b'"):
        validate({"slurm": {"node_name": "a b"}})
    with pytest.raises(ConfigError, match="slurm.scontrol = 'bin/scontrol'"):
        validate({"slurm": {"scontrol": "bin/scontrol"}})


# What Slurm 22.05.8's `scontrol show job -d 7` printed in the test rig (tests/slurmrig.py, gres
# on fake GPUs), trimmed; a detail line per group of nodes that hold the same.
SHOW_JOB_D = """JobId=7 JobName=wrap
   UserId=u(1000) GroupId=u(1000) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   NodeList=lmt-n[0-3],gpu07
   NumNodes=5 NumCPUs=5 NumTasks=5 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   JOB_GRES=gpu:9
     Nodes=lmt-n[0-1] CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1)
     Nodes=lmt-n2 CPU_IDs=0 Mem=0 GRES=gpu:a100:3(IDX:0-1,3),mps:100(0/100,0/100)
     Nodes=lmt-n3 CPU_IDs=1 Mem=0 GRES=
     Nodes=gpu07 CPU_IDs=0-1 Mem=0 GRES=gpu:a100:1(IDX:2),gpu:v100:1(IDX:5)
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   TresPerNode=gres:gpu:2
"""


@pytest.mark.parametrize("node,want", [
    ("lmt-n0", (0, 1)), ("lmt-n1", (0, 1)),  # one line for two nodes (a hostlist)
    ("lmt-n2", (0, 1, 3)),  # a typed gres, IDX ranges and a list; mps (no IDX) is not a GPU
    ("lmt-n3", ()),  # a node of the job without GPUs
    ("gpu07", (2, 5)),  # two typed gpu gres on one node
])
def test_parse_job_gpus_reads_this_nodes_line_only(node: str, want: tuple[int, ...]) -> None:
    assert slurm.parse_job_gpus(SHOW_JOB_D, "7", node) == want


def test_parse_job_gpus_refuses_what_it_cannot_read() -> None:
    # no line of this node: the job holds nothing here per slurmctld, or node_name is wrong
    with pytest.raises(SlurmError, match=r"job 7 on node lmt-n9: slurmctld lists no allocation .*node_name"):
        slurm.parse_job_gpus(SHOW_JOB_D, "7", "lmt-n9")
    with pytest.raises(SlurmError, match="printed no record JobId=8"):
        slurm.parse_job_gpus(SHOW_JOB_D, "8", "lmt-n0")
    with pytest.raises(SlurmError, match="printed no record"):
        slurm.parse_job_gpus("", "7", "lmt-n0")
    for idx in ("N/A", "0-", "3-1", "a", "1,1", "0-99999", "1024", "-1", ""):
        bad = f"JobId=7 JobName=x\n     Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:{idx})\n"
        with pytest.raises(SlurmError, match=r"job 7 on node n1: IDX"):
            slurm.parse_job_gpus(bad, "7", "n1")


def test_parse_job_gpus_takes_the_jobs_own_record_of_several() -> None:
    # an array's or a heterogeneous job's records: only JobId=7's detail lines count
    text = ("JobId=6 ArrayJobId=6 ArrayTaskId=0\n     Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0)\n"
            "JobId=7 ArrayJobId=6 ArrayTaskId=1\n     Nodes=n1 CPU_IDs=1 Mem=0 GRES=gpu:1(IDX:1)\n"
            "JobId=70 ArrayJobId=6 ArrayTaskId=2\n     Nodes=n1 CPU_IDs=1 Mem=0 GRES=gpu:1(IDX:2)\n")
    assert slurm.parse_job_gpus(text, "7", "n1") == (1,)
    # a gres whose name only begins with gpu is another gres
    assert slurm.parse_job_gpus("JobId=7\n  Nodes=n1 CPU_IDs=0 GRES=gpux:1(IDX:0),xgpu:1(IDX:1)\n", "7", "n1") == ()


def test_parse_job_gpus_is_bounded() -> None:
    # a million lines (past the 10,000 read) and a huge hostlist cost their text, no more
    many = "JobId=7\n" + "   Foo=bar\n" * 1_000_000 + "     Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0)\n"
    t0 = time.monotonic()
    with pytest.raises(SlurmError, match="no allocation"):
        slurm.parse_job_gpus(many, "7", "n1")
    huge = "JobId=7\n     Nodes=n[0-99999999] CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0)\n"
    assert slurm.parse_job_gpus(huge, "7", "n12345678") == (0,)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("node,hostlist,want", [
    ("n3", "n[1-5]", True), ("n03", "n[01-05]", True), ("n3", "n[01-05]", False), ("n6", "n[1-5,7]", False),
    ("n10", "n[1-9,10]", True), ("r2-g07", "r[1-2]-g[01-08]", True), ("r3-g07", "r[1-2]-g[01-08]", False),
    ("x", "a,x", True), ("x", "a,[x", False), ("lmt-n0", "lmt-n0", True), ("lmt-n0", "lmt-n00", False),
])
def test_in_hostlist(node: str, hostlist: str, want: bool) -> None:
    assert slurm.in_hostlist(node, hostlist) is want


def test_job_gpus_asks_scontrol_show_job_d(standin: SimpleNamespace) -> None:
    (standin.dir / "jobd").write_text(SHOW_JOB_D.replace("JobId=7 ", "JobId=1234 "))
    c = Slurm(standin.exe)
    assert asyncio.run(c.job_gpus("1234", "lmt-n2")) == (0, 1, 3)
    with pytest.raises(SlurmError, match="job '1234.0'"):
        asyncio.run(c.job_gpus("1234.0", "lmt-n2"))
    with pytest.raises(SlurmError, match="node name 'a b'"):
        asyncio.run(c.job_gpus("1234", "a b"))
    assert standin.argv() == [["show", "job", "-d", "1234"]]
