"""Adopted jobs (laminar.runtime.adopt) on real cgroups and real processes: a Slurm-like task
moved into a cgroup of the agent's, and a pod-like cgroup tree (a named fake of the kubelet's:
a cgroup the test makes beside the agent's root, a real process in a child "container" cgroup)
taken in place. Each shows as adopted, is frozen and thawed by Airlock's hold, gets its
checkpoint signal, and ends when its processes end; the agent removes the cgroup it made and
never the one it took in place."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from jobrig import airlock_rig, until

from laminar.airlock.cgroups import detect
from laminar.jobkit import Checkpointer
from laminar.migrate.ckpt_driver import CkptDriver
from laminar.policy import ladder
from laminar.policy.sched import Scheduler
from laminar.runtime.adopt import AdoptRequest, FixedCgroup
from laminar.runtime.spec import JobError

pytestmark = pytest.mark.kernel

# a task that catches SIGUSR1 (writes the file named by argv[1]) and sleeps
CATCHER = ("import signal, sys, time\n"
           "signal.signal(signal.SIGUSR1, lambda *_: open(sys.argv[1], 'a').write('ckpt\\n'))\n"
           "open(sys.argv[1] + '.ready', 'w').close()\n"
           "while True: time.sleep(0.1)\n")


def start_catcher(out: Path) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", CATCHER, str(out)], start_new_session=True)
    end = time.monotonic() + 20
    while not Path(f"{out}.ready").exists() and time.monotonic() < end:
        time.sleep(0.02)
    return p


def request(ref: str, **kw: Any) -> AdoptRequest:
    base: dict[str, Any] = {"scheduler": Scheduler.SLURM, "ref": ref, "uid": 0, "gid": 0, "job_class": "transient",
                            "priority": 50, "checkpoint": "SIGUSR1", "gpus": (), "pid": None, "cgroup": None,
                            "name": None}
    return AdoptRequest(**{**base, **kw})


def calm(al: Any, t0: float) -> None:
    al.memo.last_pressure = t0
    now = t0 + al.policy["hysteresis"]["hold_s"] + 0.1
    for a in ladder.decide(now, ladder.NONE, al.views(now), al.policy.doc, al.memo, 0.1):
        al._apply(a, now, ladder.NONE, al.signals(now))


async def held_and_released(job: Any, al: Any) -> None:
    t0 = time.monotonic()
    al._apply(ladder.Action(ladder.SUSPEND, job.id, "test: high"), t0, ladder.HIGH, al.signals(t0))
    assert await until(job.cgroup.frozen, 10), "Airlock's hold did not freeze the adopted job"
    calm(al, time.monotonic())
    assert await until(lambda: not job.cgroup.frozen(), 10), "Airlock's release did not thaw it"


@contextmanager
def pod_tree() -> Iterator[tuple[str, Path]]:
    """A fake of a kubelet's pod cgroup (named as such): ``laminar-t-<hex>-kubepods/pod/ctr``
    made by the test beside the agent's root, removed after (its processes killed)."""
    h = detect()
    top = f"laminar-t-{secrets.token_hex(3)}-kubepods"
    ctr = h.unified / top / "pod" / "ctr"
    ctr.mkdir(parents=True)
    # on a hybrid host the kubelet makes the same path in the v1 memory hierarchy
    mem = h.v1["memory"] / top / "pod" / "ctr" if "memory" in h.v1 else None
    if mem is not None:
        mem.mkdir(parents=True)
    try:
        yield top, ctr
    finally:
        if mem is not None:
            for d in (mem, mem.parent, mem.parent.parent):
                for _ in range(100):
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)
        for d in (ctr, ctr.parent, ctr.parent.parent):
            try:
                (d / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for d in (ctr, ctr.parent, ctr.parent.parent):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def test_a_slurm_task_is_moved_in_held_signalled_and_ends_with_its_processes(tmp_path: Path) -> None:
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, _store):
            jobs.adoption.ckpt_root = tmp_path / "adopted"
            # a checkpoint the job's earlier run left: the answer names it to resume from
            ckdir = tmp_path / "adopted" / "slurm-4242"
            ckdir.mkdir(parents=True, mode=0o700)
            Checkpointer(job_id="x", ckpt_dir=ckdir, install_signal=False).save(b"weights", step=3)
            out = tmp_path / "ckpt-signals"
            p = start_catcher(out)
            p2 = start_catcher(tmp_path / "second")
            try:
                job, env = await jobs.adopt(request("4242", pid=p.pid))
                assert job.state == "running" and job.origin.scheduler is Scheduler.SLURM
                assert job.origin.scheduler_ref == "4242" and job.cgroup_id != 0
                assert not isinstance(job.cgroup, FixedCgroup) and p.pid in job.cgroup.pids()
                assert env["LAMINAR_JOB_ID"] == job.id and env["LAMINAR_CKPT_DIR"] == str(ckdir)
                assert env["LAMINAR_CKPT_SIGNAL"] == "SIGUSR1" and "LAMINAR_CHECKPOINT_SIGNAL" not in env
                assert env.get("LAMINAR_RESUME_FROM", "").startswith(str(ckdir) + "/ckpt-"), env
                rec = job.as_dict()
                assert rec["origin"]["scheduler"] == "slurm" and rec["limits"]["set_by"] == "slurm"
                assert [j.id for j in jobs.find_adopted("slurm", "4242")] == [job.id]
                # a second task of the same Slurm job: the same job, moved into its cgroup
                again, _ = await jobs.adopt(request("4242", pid=p2.pid))
                assert again is job and p2.pid in job.cgroup.pids()
                await held_and_released(job, al)
                assert jobs.request_checkpoint(job)
                assert await until(lambda: out.exists() and "ckpt" in out.read_text(), 10)
                made = job.cgroup.unified
                p.kill()
                p.wait()
                await asyncio.sleep(1.2)
                assert jobs.get(job.id).state == "running", "the job ended while its second task ran"
                p2.kill()
                p2.wait()
                final = await jobs.wait(job.id, 15)
                assert final is not None and final.state == "exited" and final.reason == "ended by slurm", final
                assert not made.exists(), "the cgroup the agent made for the adopted job was left"
                assert jobs.find_adopted("slurm", "4242") == []
                # read back from the store as adopted
                assert jobs.get(job.id).origin.scheduler_ref == "4242"
            finally:
                for q in (p, p2):
                    q.kill()
                    q.wait()

    asyncio.run(main())


def test_a_pod_cgroup_is_taken_in_place_and_never_removed(tmp_path: Path) -> None:
    async def main() -> None:
        with pod_tree() as (top, ctr):
            async with airlock_rig(tmp_path) as (jobs, al, _store):
                jobs.adoption.ckpt_root = tmp_path / "adopted"
                jobs.adoption.inplace_roots = (top,)
                out = tmp_path / "pod-signals"
                p = start_catcher(out)
                try:
                    (ctr / "cgroup.procs").write_text(str(p.pid))
                    h = detect()
                    if "memory" in h.v1:  # as the kubelet's runtime does on a hybrid host
                        (h.v1["memory"] / top / "pod" / "ctr" / "cgroup.procs").write_text(str(p.pid))
                    rel = f"{top}/pod"
                    job, env = await jobs.adopt(request("team-a/train-0", scheduler=Scheduler.KUBERNETES,
                                                        cgroup=rel))
                    assert isinstance(job.cgroup, FixedCgroup) and job.cgroup.unified == ctr.parent
                    assert job.origin.scheduler_cgroup == rel and job.cgroup_id == os.stat(ctr.parent).st_ino
                    assert p.pid in job.cgroup.pids() and "LAMINAR_RESUME_FROM" not in env
                    assert env["LAMINAR_CKPT_DIR"].endswith("/kubernetes-team-a_train-0")
                    await held_and_released(job, al)
                    assert jobs.request_checkpoint(job)
                    assert await until(lambda: out.exists() and "ckpt" in out.read_text(), 10)
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
                    final = await jobs.wait(job.id, 15)
                    assert final is not None and final.state == "exited" and final.reason == "ended by kubernetes"
                    assert ctr.is_dir() and ctr.parent.is_dir(), "the agent removed a cgroup it did not create"
                finally:
                    p.kill()
                    p.wait()

    asyncio.run(main())


def test_a_cgroup_outside_the_inplace_roots_or_inside_the_agents_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        with pod_tree() as (top, _ctr):
            async with airlock_rig(tmp_path) as (jobs, _al, _store):
                jobs.adoption.ckpt_root = tmp_path / "adopted"
                k8s = {"scheduler": Scheduler.KUBERNETES}
                with pytest.raises(JobError, match="not under \\[adopt\\] inplace_roots"):
                    await jobs.adopt(request("ns/p", cgroup=f"{top}/pod", **k8s))
                jobs.adoption.inplace_roots = (top, jobs.cgroup_root or "")
                with pytest.raises(JobError, match="agent's \\[cgroups\\] root"):
                    await jobs.adopt(request("ns/p", cgroup=f"{jobs.cgroup_root}/transient", **k8s))
                with pytest.raises(JobError, match="no such cgroup"):
                    await jobs.adopt(request("ns/p", cgroup=f"{top}/nope", **k8s))
                with pytest.raises(JobError, match="no such process"):
                    await jobs.adopt(request("1", pid=(1 << 22) - 1))
                with pytest.raises(JobError, match="no such Airlock class"):
                    await jobs.adopt(request("ns/p", cgroup=f"{top}/pod", job_class="huge", **k8s))
                with pytest.raises(JobError, match="not on this node"):
                    await jobs.adopt(request("ns/p", cgroup=f"{top}/pod", gpus=(3,), **k8s))
                assert jobs.list() == [] and not (tmp_path / "adopted" / "kubernetes-ns_p").exists()

    asyncio.run(main())


def test_with_gpus_owned_by_the_scheduler_laminar_hands_out_none_and_adopted_jobs_hold_theirs(tmp_path: Path) -> None:
    from test_provenance_store import zone_of

    from laminar.runtime.jobs import JobManager
    from laminar.runtime.spec import JobSpec
    from laminar.store import Store

    async def main() -> None:
        root = f"laminar-t-{secrets.token_hex(3)}"
        store = Store(tmp_path / "laminar.db")
        jobs = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, gpus_declared=[0, 1])
        p = start_catcher(tmp_path / "gpu-task")
        try:
            await jobs.start(None)
            jobs.adoption.ckpt_root = tmp_path / "adopted"
            jobs.adoption.configure(None, {"owner": "scheduler"})
            with pytest.raises(JobError, match='\\[gpus\\] owner = "scheduler"'):
                await jobs.submit(JobSpec(["sleep", "1"], gpus=1).validate())
            assert jobs.list() == []
            job, env = await jobs.adopt(request("9", pid=p.pid, gpus=(1,)))
            assert job.gpus == [1] and job.as_dict()["gpus"] == [1]
            q = start_catcher(tmp_path / "gpu-task-2")
            try:
                with pytest.raises(JobError, match=f"\\[1\\] held by job {job.id}"):
                    await jobs.adopt(request("10", pid=q.pid, gpus=(1,)))
            finally:
                q.kill()
                q.wait()
            with pytest.raises(JobError, match="already in a job's cgroup"):
                await jobs.adopt(request("10", pid=p.pid))
            zone = zone_of(tmp_path, jobs)
            await zone.start(None)
            try:
                zone.refresh_inventory()
                assert zone.arbiter.inventory.gpu_free == (0.0, 0.0), "the zone was told of a free GPU"
            finally:
                await zone.stop()
        finally:
            p.kill()
            p.wait()
            await jobs.stop()
            from laminar.airlock.cgroups import CgroupTree

            CgroupTree(detect(), root).purge()
            store.close()

    asyncio.run(main())


def test_the_last_checkpoint_is_in_the_record_and_the_metrics(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, _al, _store):
            jobs.adoption.ckpt_root = tmp_path / "adopted"
            p = start_catcher(tmp_path / "m")
            try:
                job, _ = await jobs.adopt(request("31", pid=p.pid))
                assert job.as_dict()["last_ckpt"] is None
                assert b'scheduler_ref="31"' not in generate_latest(jobs.metrics)
                assert job.ckpt_dir is not None
                # the checkpoint driver checks what the scanner lists (migrate's, here on its own)
                driver = CkptDriver(SimpleNamespace(agent=SimpleNamespace(jobs=jobs), s={}))
                # an entry named like a checkpoint (a user's mkdir, one half written) is not one
                (Path(job.ckpt_dir) / "ckpt-9").mkdir()
                assert await until(lambda: job.last_checkpoint() is not None, 10)
                await driver.verify_new()
                assert job.as_dict()["last_ckpt"] is None and job.verified_checkpoint() is None
                assert b'scheduler_ref="31"' not in generate_latest(jobs.metrics)
                (Path(job.ckpt_dir) / "ckpt-9").rmdir()
                Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False).save(b"w", step=1)
                await driver.verify_new()  # (lists the directory again, then checks)
                verified = job.verified_checkpoint()
                assert verified is not None and verified[0] == str(Path(job.ckpt_dir) / "ckpt-1")
                rec = job.as_dict()
                assert rec["last_ckpt"] == verified[1]
                assert abs(rec["last_ckpt"] - time.time()) < 30 and 0 <= rec["last_ckpt_age_s"] < 30
                text = generate_latest(jobs.metrics).decode()
                line = [ln for ln in text.splitlines() if ln.startswith("laminar_job_last_checkpoint_age_seconds{")
                        and 'scheduler_ref="31"' in ln]
                assert line and f'job="{job.id}"' in line[0] and 'scheduler="slurm"' in line[0], text[-2000:]
                assert "laminar_job_last_checkpoint_timestamp_seconds{" in text
            finally:
                p.kill()
                p.wait()

    asyncio.run(main())


def test_an_adopted_job_in_a_capped_class_counts_what_it_uses_not_the_whole_cap(tmp_path: Path) -> None:
    """A class with a cap (policy class_caps_mb): an adopted task has no limit of Laminar's, and
    counted as the whole cap (as a launched job without --memory is) it kept every launched job
    of its class queued for as long as the Slurm job ran. It counts the limit its scheduler set,
    else the memory it uses (tens of MiB here): a launched job that fits beside it starts."""
    from laminar.runtime.spec import JobSpec

    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, _store):
            jobs.adoption.ckpt_root = tmp_path / "adopted"
            al.set_policy({"class_caps_mb": {"transient": 256}})
            p = start_catcher(tmp_path / "c")
            try:
                adopted, _ = await jobs.adopt(request("55", pid=p.pid))
                limits = jobs.limits()
                assert limits is not None and limits.cap("transient") == 256
                charged = jobs.charged_mb(limits)["transient"]
                assert 1 <= charged < 128, charged  # the catcher's memory in use, not the cap
                launched = await jobs.submit(JobSpec(["sleep", "60"], name="t", job_class="transient",
                                                     memory_mb=128).validate())
                assert launched.state == "running", (launched.state, launched.reason)
                assert adopted.state == "running"
                await jobs.stop(launched.id, "test")
            finally:
                p.kill()
                p.wait()

    asyncio.run(main())


def test_adopted_jobs_are_adopted_again_after_a_restart_and_one_that_ended_meanwhile_exited(tmp_path: Path) -> None:
    from laminar.airlock.cgroups import CgroupTree
    from laminar.runtime.jobs import JobManager
    from laminar.store import Store

    async def main() -> None:
        with pod_tree() as (top, ctr):
            root = f"laminar-t-{secrets.token_hex(3)}"
            store = Store(tmp_path / "laminar.db")

            async def manager() -> JobManager:
                jm = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, gpus_declared=[])
                await jm.start(None)
                jm.adoption.ckpt_root = tmp_path / "adopted"
                jm.adoption.inplace_roots = (top,)
                return jm

            moved, pod, gone = (start_catcher(tmp_path / n) for n in ("a", "b", "c"))
            try:
                (ctr / "cgroup.procs").write_text(str(pod.pid))
                jobs = await manager()
                a, _ = await jobs.adopt(request("51", pid=moved.pid))
                b, _ = await jobs.adopt(request("ns/pod-b", scheduler=Scheduler.KUBERNETES, cgroup=f"{top}/pod"))
                c, _ = await jobs.adopt(request("53", pid=gone.pid))
                await jobs.stop()  # the agent goes down: its jobs run on
                gone.kill()
                gone.wait()
                jobs = await manager()
                ra, rb, rc = (jobs.get(j.id) for j in (a, b, c))
                assert ra is not None and ra.state == "running" and ra.origin.scheduler_ref == "51"
                assert rb is not None and rb.state == "running" and isinstance(rb.cgroup, FixedCgroup)
                assert rc is not None and rc.state == "exited" and rc.reason.startswith("ended by slurm"), rc
                assert [j.id for j in jobs.find_adopted("kubernetes", "ns/pod-b")] == [b.id]
                assert jobs.request_checkpoint(rb)
                moved.kill()
                moved.wait()
                pod.kill()
                pod.wait()
                for j in (ra, rb):
                    end = await jobs.wait(j.id, 15)
                    assert end is not None and end.state == "exited", end
                assert ctr.is_dir(), "the agent removed the pod's cgroup"
                await jobs.stop()
            finally:
                for q in (moved, pod, gone):
                    q.kill()
                    q.wait()
                CgroupTree(detect(), root).purge()
                store.close()

    asyncio.run(main())


def test_airlocks_kill_of_an_adopted_job_stops_its_processes(tmp_path: Path) -> None:
    async def main() -> None:
        with pod_tree() as (top, ctr):
            async with airlock_rig(tmp_path) as (jobs, _al, _store):
                jobs.adoption.ckpt_root = tmp_path / "adopted"
                jobs.adoption.inplace_roots = (top,)
                task, pod = start_catcher(tmp_path / "k1"), start_catcher(tmp_path / "k2")
                try:
                    (ctr / "cgroup.procs").write_text(str(pod.pid))
                    a, _ = await jobs.adopt(request("61", pid=task.pid))
                    b, _ = await jobs.adopt(request("ns/k", scheduler=Scheduler.KUBERNETES, cgroup=f"{top}/pod"))
                    made = a.cgroup.unified
                    for j, proc in ((a, task), (b, pod)):
                        await jobs.kill(j, "test: airlock's last rung")
                        end = await jobs.wait(j.id, 15)
                        assert end is not None and end.state == "killed", end
                        assert await until(lambda p=proc: p.poll() is not None, 10), "the adopted task outlived its kill"
                    assert not made.exists() and ctr.is_dir()
                finally:
                    for q in (task, pod):
                        q.kill()
                        q.wait()

    asyncio.run(main())
