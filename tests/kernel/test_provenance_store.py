"""A job's origin lives in the store, written by the agent only (laminar.runtime.provenance): a
real JobManager over real cgroups and SQLite (tests/jobrig.py).

- submit records the origin the agent's own code gives it; every look-up is one indexed query,
  never a job's env;
- an upgrade adds the columns to an old table and fills them from the agent's own tables
  (``zone_placed``, ``migrate_replicas``), never from a job's env; the stored specs of jobs not
  ended lose the reserved names, the old user hints become their fields;
- F7: a job reattached after a restart whose main process is gone keeps no stale pid, so a
  checkpoint request never reaches a process that took that pid since (before: root sent the
  job's checkpoint signal to it).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from agentproc import NOBODY
from jobrig import job_manager, until
from ports import free_port
from standin_agent import standin_agent

from laminar.airlock.cgroups import CgroupTree, detect
from laminar.components import MigrateAgent, ZoneAgent
from laminar.events import EventBus
from laminar.migrate.reclaim import ReclaimComponent
from laminar.runtime.jobs import JobManager
from laminar.runtime.provenance import JobOrigin
from laminar.runtime.spec import JobSpec
from laminar.store import Store
from laminar.zone.component import ZoneComponent

pytestmark = pytest.mark.kernel


def test_submit_records_the_origin_and_the_look_ups_use_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            plain = await jobs.submit(JobSpec(["/bin/sleep", "60"]).validate())
            moved = await jobs.submit(JobSpec(["/bin/sleep", "60"], resume_from="/x/ckpt-3").validate(),
                                      origin=JobOrigin(migrated_from="n2-job-7", placement_id=0x1234,
                                                       gpu_share=((0, 0.5),), resume_given="/x/ckpt-3"))
            assert jobs.table.find_origin("n2-job-7") == moved.id and jobs.table.find_placement(0x1234) == moved.id
            assert jobs.table.find_origin("n2-job-8") is None and jobs.table.find_placement(0x1235) is None
            assert jobs.table.resume_users(("running",), 0.0) == [(moved.id, "/x/ckpt-3")]
            row = jobs.store.db.execute("SELECT origin_key, placement_id, gpu_share, resume_given FROM jobs "
                                        "WHERE id=?", (moved.id,)).fetchone()
            assert tuple(row) == ("n2-job-7", 0x1234, "0:0.5", "/x/ckpt-3")
            assert jobs.get(moved.id).origin == moved.origin and jobs.get(plain.id).origin == JobOrigin()
            # the plans are index look-ups, not scans of the table
            for sql, args in (("SELECT id FROM jobs WHERE origin_key=? AND state != 'failed' ORDER BY num LIMIT 1",
                               ("k",)),
                              ("SELECT id FROM jobs WHERE placement_id=? ORDER BY num LIMIT 1", (1,)),
                              ("SELECT id, resume_given, num FROM jobs WHERE resume_given IS NOT NULL AND (state IN "
                               "(?, ?) OR (state = 'requeued' AND (ended IS NULL OR ended > ?)))", ("running", "lost", 0)),
                              ("SELECT origin_key, id FROM jobs WHERE origin_key IS NOT NULL AND state IN (?)",
                               ("exited",))):
                plan = " ".join(str(r[-1]) for r in jobs.store.db.execute(f"EXPLAIN QUERY PLAN {sql}", args))
                assert "USING INDEX" in plan, plan
            await jobs.stop(moved.id, grace_s=0)
            assert jobs.table.ended_origins(("stopped",)) == {"n2-job-7": {moved.id}}
            assert jobs.table.find_origin("n2-job-7") == moved.id  # it ran here: a keeper never resumes it again

    asyncio.run(main())


def zone_of(tmp: Path, jobs: JobManager) -> ZoneComponent:
    """A zone component of a two-node zone on loopback (node 1), with ``jobs``."""
    keys = tmp / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    nodes = [{"id": 1, "zone": 1, "addr": f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"},
             {"id": 2, "zone": 1, "addr": f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"}]
    settings = {"node_id": 1, "nodes": nodes, "keys_file": str(keys), "listen": "127.0.0.1",
                "port": int(nodes[0]["addr"].split(":")[1]), "handover_port": free_port(socket.SOCK_STREAM),
                "cpus": 8, "memory_mb": 8000}
    return ZoneComponent(settings=settings, jobs=jobs, gpus=1, loan={"elastic_interval_s": 0})


OLD_SCHEMA = """CREATE TABLE jobs (id TEXT PRIMARY KEY, num INTEGER UNIQUE NOT NULL, spec TEXT NOT NULL,
    state TEXT NOT NULL, pid INTEGER, cgroup_id INTEGER, owner_uid INTEGER NOT NULL, owner_gid INTEGER NOT NULL,
    gpus TEXT NOT NULL, created REAL NOT NULL, ended REAL, exit_code INTEGER, reason TEXT, work_lost_s REAL,
    started REAL)"""


def old_row(db: sqlite3.Connection, num: int, env: dict[str, str], state: str = "queued", **spec: object) -> str:
    jid = f"job-{num}"
    body = {"command": ["/bin/sleep", "60"], "name": "", "memory_mb": None, "cpus": None, "gpus": 0, "priority": 50,
            "checkpoint_signal": "SIGUSR1", "env": env, "cwd": None, "lent": False, "elastic_min": None,
            "elastic_max": None, "resume_from": None, "class": "standard", **spec}
    db.execute("INSERT INTO jobs(id, num, spec, state, owner_uid, owner_gid, gpus, created, ended) "
               "VALUES (?, ?, ?, ?, 0, 0, '[]', ?, ?)",
               (jid, num, json.dumps(body), state, time.time(), None if state == "queued" else time.time()))
    return jid


def test_an_upgrade_fills_the_origin_from_the_agents_tables_never_from_env(tmp_path: Path) -> None:
    """A store of the previous release: job-1 a user's queued job forging another job's key and a
    placement in its env, with the two old hints; job-2 ended, resumed here by a keeper (its
    migrate_replicas row); job-3 queued, placed here by the zone (its zone_placed row, a GPU
    share). After the upgrade: job-1 has no origin and a clean env, its hints as fields; job-2
    the key its keeper row names; job-3 its placement and share."""
    db = sqlite3.connect(tmp_path / "laminar.db")
    db.execute(OLD_SCHEMA)
    forger = old_row(db, 1, {"A": "1", "LM_MIGRATED_FROM": "n2-job-9", "LM_PLACEMENT_ID": f"{0x77:016x}",
                             "LM_REMAINING_S": "120", "LM_CKPT_PERIODIC": "off", "CUDA_VISIBLE_DEVICES": "3"})
    resumed = old_row(db, 2, {"LM_MIGRATED_FROM": "n2-job-5"}, state="exited",
                      resume_from=str(tmp_path / "xfer/checkpoints/n2-job-5/ckpt-4"))
    placed = old_row(db, 3, {"LM_PLACEMENT_ID": f"{0x99:016x}", "LM_GPU_SHARE": "0:0.5"})
    db.execute("CREATE TABLE zone_placed (placement_id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, demand TEXT NOT NULL,"
               " gpu_alloc TEXT NOT NULL, submitter INTEGER NOT NULL, since REAL NOT NULL)")
    db.execute("INSERT INTO zone_placed VALUES (?, ?, ?, ?, 2, ?)",
               (0x99, placed, json.dumps({"gpus": 0.5, "cpus": 1.0, "memory_mb": 256, "gpu_model": None, "pool": None}),
                json.dumps([[0, 0.5]]), time.time()))
    db.commit()
    db.close()

    async def main() -> None:
        root = f"laminar-t-{secrets.token_hex(3)}"
        store = Store(tmp_path / "laminar.db")
        jobs = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, events=EventBus(store), gpus_declared=[0])
        jobs.held = "held by the test (nothing starts)"
        try:
            await jobs.start(None)
            one = jobs.get(forger)
            assert one.origin == JobOrigin() and one.spec.env == {"A": "1"}, (one.origin, one.spec.env)
            assert one.spec.remaining_s == 120.0 and one.spec.periodic_checkpoints is False
            assert jobs.table.find_origin("n2-job-9") is None and jobs.table.find_placement(0x77) is None
            # the zone's own record of what it placed here (its start restores zone_placed)
            comp = zone_of(tmp_path, jobs)
            await comp.start(standin_agent(ZoneAgent, store=store))
            await comp.stop()
            assert jobs.get(placed).origin == JobOrigin(placement_id=0x99, gpu_share=((0, 0.5),))
            # the migration layer's own record of what its keepers resumed here
            store.ensure_schema("migrate", __import__("laminar.migrate.schema", fromlist=["x"]).REPLICAS_SCHEMA)
            with store.tx() as tx:
                tx.execute("INSERT INTO migrate_replicas VALUES ('n2-job-5', 2, 'job-5', '{}', 'ckpt-4', 'resumed', ?, ?)",
                           (resumed, time.time()))
            ReclaimComponent._backfill_origins(SimpleNamespace(  # type: ignore[arg-type]
                agent=standin_agent(MigrateAgent, jobs=jobs, store=store, config=SimpleNamespace(state_dir=tmp_path))))
            two = jobs.get(resumed)
            assert two.origin.migrated_from == "n2-job-5" and two.origin.resume_given == two.spec.resume_from
            assert jobs.table.ended_origins(("exited",)) == {"n2-job-5": {resumed}}
        finally:
            await jobs.stop()
            CgroupTree(detect(), root).purge()
            store.close()

    asyncio.run(main())


VICTIM = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *a: open(sys.argv[1], "w").write("signalled"))
print("ready", flush=True)
time.sleep(60)
"""


async def reaped(pid: int) -> None:
    """Until ``pid`` (a child of this process: the first job manager's) has exited and is reaped."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # reaped already (subprocess reaps children it forgot)
            if not os.path.exists(f"/proc/{pid}"):
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"process {pid} did not exit")


def spawn_at(pid: int, out: Path) -> subprocess.Popen[str] | None:
    """A root process catching SIGUSR1 (it writes ``out`` when it gets one) at pid ``pid``; None
    when another process took that pid first."""
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    p = subprocess.Popen([sys.executable, "-c", VICTIM, str(out)], stdout=subprocess.PIPE, text=True)
    if p.pid != pid:
        p.kill()
        p.wait()
        return None
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.serial  # it steers pids (ns_last_pid)
def test_a_reattached_job_whose_main_process_is_gone_signals_no_process_that_took_its_pid(tmp_path: Path) -> None:
    """A user's job whose main process exits while the agent is down (here: the first job
    manager stops watching, as the agent's stop does; its main process, the agent's child, is
    reaped as init would) leaves a child in its cgroup. A root process takes the freed pid and
    catches SIGUSR1. The next job manager reattaches the job: its checkpoint request must not
    reach that process. Before: it kept the stale pid and root signalled the new process."""
    os.chmod(tmp_path, 0o755)  # the job's user reaches its checkpoint directory

    async def main() -> None:
        root = f"laminar-t-{secrets.token_hex(3)}"
        store = Store(tmp_path / "laminar.db")
        victim: subprocess.Popen[str] | None = None
        out = tmp_path / "victim-signalled"
        try:
            for _ in range(10):  # another process on the machine may take the pid first: again
                first = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, events=EventBus(store),
                                   gpus_declared=[])
                await first.start(None)
                # its other process leaves the job's session (setsid: the user's to do), so nothing
                # holds the main process's pid as a session or group id once it exits
                job = await first.submit(JobSpec(["/bin/sh", "-c", "/usr/bin/setsid /bin/sleep 600 & exec /bin/sleep 1"]
                                                 ).validate(),
                                         owner_uid=NOBODY, owner_gid=NOBODY)
                main_pid = job.pid
                assert main_pid is not None
                assert await until(lambda j=job, p=main_pid: p in j.cgroup.pids(), 10)
                await first.shutdown()  # the agent goes; its jobs run on
                await reaped(main_pid)  # the main process exits; reaped, as init would
                victim = spawn_at(main_pid, out)
                if victim is not None:
                    break
            assert victim is not None, "no process could be started at the freed pid"
            second = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, events=EventBus(store),
                                gpus_declared=[])
            await second.start(None)
            adopted = second.get(job.id)
            assert adopted is not None and adopted.reattached and adopted.state == "running"
            assert adopted.pid is None, f"the reattached job kept the pid {adopted.pid} of its gone main process"
            assert second.request_checkpoint(adopted) is False
            assert second.signal_main(adopted, "SIGUSR1") is False
            await asyncio.sleep(0.5)
            assert not out.exists(), "root signalled the process that took the job's old pid"
            stored = store.db.execute("SELECT pid FROM jobs WHERE id=?", (job.id,)).fetchone()[0]
            assert stored is None
            await second.stop(job.id, grace_s=0)
            await second.stop()
        finally:
            if victim is not None:
                victim.kill()
                victim.wait()
            CgroupTree(detect(), root).purge()
            store.close()

    asyncio.run(main())
