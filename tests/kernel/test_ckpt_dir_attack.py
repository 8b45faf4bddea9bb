"""A job's checkpoint directory is the job's: whatever it puts there costs the agent nothing.

The agent looks at every job's ``LAMINAR_CKPT_DIR`` (Airlock's work at risk on every 50 ms tick,
the checkpoint driver every ``poll_s``, the prestage rule, moves). The job's owner writes that
directory. Before, all of that ran on the agent's event loop and followed what it found: a job
of 200,000 ``ckpt-N`` directories held the loop about 1.4 s per listing, several listings per
round (root's ``status`` and kill-switch waited seconds); a link in a checkpoint to
``/etc/shadow`` put the size of that root-only file into GET /v1/checkpoints (readable by
everyone); a manifest declaring a 512 GiB sparse file was hashed for minutes in a thread the
driver awaited before any other job's check, so every other user's periodic checkpoints went
unverified; a hung FUSE mount under a job's checkpoint directory stopped the loop for good (and
the agent's stop with it); a move froze a job with a task in uninterruptible sleep by waiting 2 s
on the loop.

Real: laminard (tests/agentproc.py), two unprivileged users (tests/userrig.py) whose jobs run
as them, a hung FUSE mount (tests/fuserig.py, ``allow_other``: what a user gets with
``user_allow_other``, or an NFS mount gone dead), root's liveness probe (tests/liveness.py). The
last test drives one move of a real job in a real cgroup through the migrate component over the
stand-in zone of tests/kernel/test_replica_gc_move_freeze.py (no peer: the move fails after its
freeze, as intended).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, api_json, jobkit_base, wait_until
from fuserig import eio_mount, fuse_waiters
from jobrig import job_manager, until
from liveness import RootLiveness
from test_move_freeze_on_checkpoint import saves_when_asked
from test_replica_gc_move_freeze import component
from userrig import User, call_as, local_user

from laminar.jobkit import Checkpointer
from laminar.runtime.spec import JobSpec

pytestmark = pytest.mark.kernel

SHADOW = Path("/etc/shadow")
ATTACK_S = 30.0  # how long the probe watches the agent under the attack ("tens of seconds")
MS_BIND, MNT_DETACH = 4096, 2

# A job of the attacker's: its checkpoint directory filled with 200,000 ckpt-N directories, a
# link of a checkpoint's name into the hung mount, and a FIFO of one.
FLOOD = r'''
import os, sys, time
d = os.environ["LAMINAR_CKPT_DIR"]
for n in range(200_000):
    os.mkdir(f"{d}/ckpt-{n}")
os.symlink(sys.argv[1], f"{d}/ckpt-900000001")
os.mkfifo(f"{d}/ckpt-900000002")
print("ready", flush=True)
time.sleep(600)
'''

# A job of the attacker's with a valid checkpoint whose sidecar name is a link to /etc/shadow.
LEAK = r'''
import os, sys, time
sys.path.insert(0, sys.argv[1])
from laminar import jobkit
ck = jobkit.Checkpointer(install_signal=False)
p = ck.save(b"s" * 1000, step=5)
os.symlink("/etc/shadow", p / "VERIFIED")
print("ready", flush=True)
time.sleep(600)
'''

# A job of the attacker's: ckpt-1 valid, then two whose manifests declare huge files (a sparse
# file of 512 GiB, under the default verify_max_bytes; a file of 4 TiB, over it).
SPARSE = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from laminar import jobkit
ck = jobkit.Checkpointer(install_signal=False)
good = ck.save(b"g" * 1000, step=1)
for step, size in ((2, 512 << 30), (3, 4 << 40)):
    p = ck.ckpt_dir / f"ckpt-{step}"
    p.mkdir()
    with open(p / "state.bin", "wb") as f:
        f.truncate(size)
    m = json.loads((good / jobkit.MANIFEST).read_text())
    m["step"], m["files"] = step, [{"name": "state.bin", "size": size, "sha256": "0" * 64}]
    (p / jobkit.MANIFEST).write_text(json.dumps(m))
print("ready", flush=True)
time.sleep(600)
'''

# Another user's job honouring the checkpoint contract: the driver asks it for checkpoints.
HONEST = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
from laminar import jobkit
ck = jobkit.Checkpointer()
print("ready", flush=True)
step = 0
while True:
    time.sleep(0.05)
    step += 1
    if ck.requested():
        ck.save(b"w" * 4096, step=step)
'''

PERIODIC = ("[migrate]\nhazard_prior_rate_per_h = 100.0\nmin_interval_s = 1.0\nmax_interval_s = 30.0\n"
            "ckpt_pause_s = 0.2\nstagger_gap_s = 0.5\npoll_s = 0.2\n")


@contextlib.contextmanager
def agent_at(base: Path, veth: Any, extra_toml: str = PERIODIC) -> Iterator[AgentProc]:
    """A laminard whose state directory other users may pass through (their jobs reach their
    checkpoint directories there)."""
    a = AgentProc(base, veth.ifname_a, veth.a, extra_toml=extra_toml)
    try:
        a.start()
        yield a
    finally:
        a.cleanup()


def run_as(agent: AgentProc, user: User, name: str, code: str, *args: str) -> dict[str, Any]:
    status, job, raw = call_as(user, agent.sock, "POST", "/v1/jobs",
                               {"name": name, "command": ["/usr/bin/python3", "-c", code, *args]})
    assert status == 201, raw
    return job  # type: ignore[no-any-return]


def fuse_waits(pid: int) -> list[int]:
    """The threads of ``pid`` waiting on a FUSE server now (for its answer, or for a connection
    whose server never answered its start: ``fuse_get_req``)."""
    out = fuse_waiters(pid)
    with contextlib.suppress(OSError):
        for t in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                if (t / "wchan").read_text() == "fuse_get_req":
                    out.append(int(t.name))
    return out


def ready(job: dict[str, Any]) -> bool:
    try:
        return "ready" in Path(job["log"]).read_text()
    except OSError:
        return False


def checkpoints(agent: AgentProc) -> dict[str, dict[str, Any]]:
    code, out = api_json(agent.sock, "GET", "/v1/checkpoints", timeout=30)
    assert code == 200, out
    return {r["job"]: r for r in out["jobs"]}


def attack(agent: AgentProc, attacker: User, victim: User, hostile: dict[str, tuple[str, tuple[str, ...]]],
           lib: str) -> tuple[RootLiveness, dict[str, dict[str, Any]], dict[str, dict[str, Any]], int]:
    """Another user's honest job runs; then the attacker's ``hostile`` jobs (name -> (code, argv))
    do their worst while root's liveness probe watches for ATTACK_S: (the probe, GET
    /v1/checkpoints at the end by job id, the jobs by name with ``honest``, the honest job's
    commits when the attack was ready)."""
    root_job = agent.json("submit", "--name", "lm-t-root", "--", "sleep", "600")["id"]
    jobs = {"honest": run_as(agent, victim, "lm-t-honest", HONEST, lib)}
    wait_until(lambda: ready(jobs["honest"]), 60, "the other user's job to start", agent.log)
    with RootLiveness(agent.sock, root_job) as live:
        for name, (code, argv) in hostile.items():
            jobs[name] = run_as(agent, attacker, f"lm-t-{name}", code, *argv)
        wait_until(lambda: all(ready(j) for j in jobs.values()), 120, "the attacker's jobs to be ready", agent.log)
        before = checkpoints(agent).get(jobs["honest"]["id"], {}).get("commits", 0)
        time.sleep(ATTACK_S)
        rows = checkpoints(agent)
    return live, rows, jobs, before


def test_a_flooded_checkpoint_directory_with_links_costs_nothing_and_leaks_nothing(
        veth_pair: Any, tmp_path: Path) -> None:
    """200,000 ``ckpt-N`` directories, a link of a checkpoint's name into a hung mount, a FIFO,
    and, in another job, a checkpoint whose sidecar is a link to /etc/shadow."""
    backing = tmp_path / "backing"
    (backing / "ckpt-1").mkdir(parents=True)
    with jobkit_base("lm-t-ckatk-") as base, agent_at(base, veth_pair) as agent, \
            local_user("ckatk") as attacker, local_user("ckvic") as victim, eio_mount(backing) as fs:
        fs.hang()  # storage that never answers: a link into it must never be followed
        lib = str(base / "lib")
        live, rows, jobs, before = attack(agent, attacker, victim, {
            "flood": (FLOOD, (str(fs.path / "ckpt-1"),)), "leak": (LEAK, (lib,))}, lib)
        live.check(bound_s=2.0)
        print(f"root's slowest status / kill-switch during the attack: {live.worst()}")
        # the other user's periodic checkpoints were asked for, committed and verified meanwhile
        assert rows[jobs["honest"]["id"]]["commits"] >= before + 2, rows[jobs["honest"]["id"]]
        # the leaking checkpoint's size is its manifest's (the state and the manifest), never
        # with the size of a root-only file a link in it points to
        ck5 = Path(jobs["leak"]["ckpt_dir"]) / "ckpt-5"
        manifest = json.loads((ck5 / "MANIFEST.json").read_text())
        expected = sum(f["size"] for f in manifest["files"]) + (ck5 / "MANIFEST.json").stat().st_size
        row = rows[jobs["leak"]["id"]]
        assert row["newest"] == "ckpt-5", row
        assert row["size_bytes"] == expected, (
            f"GET /v1/checkpoints shows {row['size_bytes']} bytes for {jobs['leak']['id']}: its checkpoint holds "
            f"{expected}, {SHADOW} {SHADOW.stat().st_size}")
        # the flood is listed, bounded: the scans say they cut it
        scan = agent.json("status")["jobs"]["ckpt_scan"]
        assert scan["truncated"] >= 1, scan


def test_checkpoints_declaring_huge_or_sparse_files_are_refused_unread_and_others_are_verified(
        veth_pair: Any, tmp_path: Path) -> None:
    """A manifest declaring a 512 GiB sparse file (hashed for minutes before, in a thread the
    checkpoint driver awaited before any other job's check) and one declaring 4 TiB: refused
    unread; the other user's periodic checkpoints are verified meanwhile; the agent stops at once."""
    with jobkit_base("lm-t-ckbig-") as base, agent_at(base, veth_pair) as agent, \
            local_user("ckbig") as attacker, local_user("ckvic") as victim:
        lib = str(base / "lib")
        live, rows, jobs, before = attack(agent, attacker, victim, {"sparse": (SPARSE, (lib,))}, lib)
        live.check(bound_s=2.0)
        assert rows[jobs["honest"]["id"]]["commits"] >= before + 2, rows[jobs["honest"]["id"]]
        # the checkpoints that declare 512 GiB (sparse) and 4 TiB were refused unread: ckpt-1 is its newest
        assert rows[jobs["sparse"]["id"]]["newest"] == "ckpt-1", rows[jobs["sparse"]["id"]]
        refused = agent.json("status")["migrate"]["ckpt"]["refused"]  # counted by reason
        assert refused["sparse"] >= 1 and refused["too_large"] >= 1, refused
        t0 = time.monotonic()
        rc = agent.stop()
        took = time.monotonic() - t0
        assert rc == 0 and took < 25.0, f"the agent's stop took {took:.1f} s (exit {rc})"


def test_a_resume_froms_sparse_manifest_is_refused_unread_by_the_owners_check(tmp_path: Path) -> None:
    """A placement's ``resume_from`` (any local user's) is checked as its owner
    (``verify_as_owner``, a child process): a hand-made manifest naming a 512 GiB sparse file was
    hashed whole, minutes to hours of a worker thread (stopped only when the read made no
    progress at all). Refused unread now."""
    from laminar import jobkit
    from laminar.migrate.owner_check import verify_as_owner

    p = jobkit.Checkpointer("j", tmp_path / "ck", install_signal=False).save(b"x", step=1)
    size = 512 << 30
    with open(p / "state.bin", "r+b") as f:
        f.truncate(size)
    m = json.loads((p / jobkit.MANIFEST).read_text())
    m["files"] = [{"name": "state.bin", "size": size, "sha256": "0" * 64}]
    (p / jobkit.MANIFEST).write_text(json.dumps(m))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="sparse"):
        verify_as_owner(str(p), 0, 0)
    assert time.monotonic() - t0 < 30.0


def bind(src: Path, dst: Path) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.mount(str(src).encode(), str(dst).encode(), None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bind {src} on {dst}: {os.strerror(err)}")


def unbind(dst: Path) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).umount2(str(dst).encode(), MNT_DETACH)


def test_a_hung_fuse_mount_under_a_jobs_checkpoint_directory_stops_neither_the_agent_nor_its_stop(
        veth_pair: Any, tmp_path: Path) -> None:
    """The issue's case: a hung FUSE mount at ``<ckpt dir>/ckpt-7`` of a user's job (the user's own
    FUSE with ``allow_other``, or a dead NFS automount). Every ``stat`` of it waits for good."""
    backing = tmp_path / "backing"
    backing.mkdir()
    (backing / "state.bin").write_bytes(b"x")
    extra = PERIODIC + "verify_timeout_s = 5.0\n"
    with jobkit_base("lm-t-ckhung-") as base, agent_at(base, veth_pair, extra) as agent, \
            local_user("ckhung") as user, eio_mount(backing) as fs:
        lib = str(base / "lib")
        agent_pid = agent.json("status")["agent"]["pid"]
        root_job = agent.json("submit", "--name", "lm-t-root", "--", "sleep", "600")["id"]
        job = run_as(agent, user, "lm-t-hungdir", "import os, sys, time\nsys.path.insert(0, sys.argv[1])\n"
                     "from laminar import jobkit\nck = jobkit.Checkpointer(install_signal=False)\n"
                     "ck.save(b'x', step=3)\nd = os.environ['LAMINAR_CKPT_DIR']\n"
                     "os.mkdir(d + '/ckpt-7')\nprint('ready', flush=True)\n"
                     "while not os.path.exists(d + '/go'):\n    time.sleep(0.05)\n"
                     "ck.save(b'y', step=4)\ntime.sleep(600)\n", lib)
        wait_until(lambda: ready(job), 60, "the job to make its checkpoint directory", agent.log)
        target = Path(job["ckpt_dir"]) / "ckpt-7"
        bind(fs.path, target)
        try:
            fs.hang()
            # a new checkpoint after the mount: the agent's next check of the job's listing
            # starts from its newest name, ckpt-7 (a check before the mount may already have
            # refused the empty directory, and the mount alone changes nothing it lists)
            (Path(job["ckpt_dir"]) / "go").touch()
            with RootLiveness(agent.sock, root_job) as live:
                # the agent reached the mount (its check of ckpt-7 waits there, in a thread of its own)
                wait_until(lambda: fuse_waits(agent_pid), 60, "the agent to reach the hung mount", agent.log)
                time.sleep(15.0)
                code, status = api_json(agent.sock, "GET", "/v1/status", timeout=10)
            live.check(bound_s=2.0)
            print(f"root's slowest status / kill-switch with the hung mount: {live.worst()}")
            assert code == 200
            ckpt = status["migrate"]["ckpt"]
            assert ckpt["verify"]["timeouts"] >= 1 and ckpt["verify_unknown"] >= 1, ckpt
            # and the agent stops, the mount still hung: no thread of its holds the exit
            t0 = time.monotonic()
            rc = agent.stop()
            took = time.monotonic() - t0
            assert rc == 0 and took < 25.0, f"the agent's stop took {took:.1f} s (exit {rc}) with the mount hung"
        finally:
            unbind(target)
            fs.heal()


D_STATE_JOB = "cat {blob} > /dev/null & exec sleep 600"


def test_freezing_a_job_with_a_task_in_d_state_for_a_move_does_not_block_the_loop(tmp_path: Path) -> None:
    """A job's task waits in the kernel on its hung FUSE mount (state D): the cgroup never
    reaches ``frozen 1``. The move's freeze waited for it with a blocking poll of 2 s on the
    loop; now it waits asynchronously, says so, and the move goes on."""
    backing = tmp_path / "backing"
    backing.mkdir()
    (backing / "blob").write_bytes(b"b" * 4096)
    lags: list[float] = []
    events: list[str] = []

    async def ticker(stop: asyncio.Event) -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            lags.append(now - last)
            last = now

    async def main() -> None:
        with eio_mount(backing) as fs:
            fs.hang()
            async with job_manager(tmp_path / "jm") as jobs:
                job = await jobs.submit(JobSpec(["sh", "-c", D_STATE_JOB.format(blob=fs.path / "blob")],
                                                name="lm-t-dstate").validate())
                assert job.ckpt_dir is not None
                Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False).save(b"w", step=5)
                assert await until(lambda: any(fuse_waits(p) for p in job.cgroup.pids()), 30), \
                    "the job's task never waited on the hung mount"
                saves_when_asked(jobs, job, b"final", 9)  # its final checkpoint, when the move asks
                c = component(jobs)
                c._emit = lambda msg, **kw: events.append(msg)  # type: ignore[method-assign]
                stop = asyncio.Event()
                tick = asyncio.ensure_future(ticker(stop))
                t0 = time.monotonic()
                mv = await asyncio.wait_for(c.mover.move_now(job, "test: freeze a job in D state"), 120)
                took = time.monotonic() - t0
                stop.set()
                await tick
                assert mv.phase == "failed" and "no destination fits" in mv.error, mv
                assert mv.ckpt == "ckpt-9", mv
                print(f"move took {took:.2f} s; the loop's longest gap {max(lags):.3f} s")
                assert await until(lambda: not job.cgroup.freeze_requested(), 10), "the failed move left it frozen"
            fs.heal()

    asyncio.run(main())
    assert max(lags) < 1.0, f"the loop stood still {max(lags):.2f} s while the move froze the job"
    assert any("not frozen within" in e for e in events), events


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
