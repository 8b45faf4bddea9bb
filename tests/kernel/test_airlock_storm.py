"""Airlock on the real kernel: real processes in real cgroups under a real memory budget.

Each test builds its own cgroup root (``laminar-t-<hex>``), a JobManager and an Airlock over a
fresh SQLite store, runs memory hogs as jobs, and removes every cgroup and process afterwards.
The jobs are Python processes that allocate and touch memory (`HOG`), so the pressure is real.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from jobrig import until

from laminar.airlock.cgroups import (
    CgroupError,
    CgroupTree,
    detect,
    read_memory_limit,
    read_memory_usage,
    read_memory_waits,
    v2_hold_bytes,
)
from laminar.airlock.manager import Airlock
from laminar.airlock.policy import PolicyError
from laminar.airlock.signals import read_psi
from laminar.events import EventBus
from laminar.policy import ladder
from laminar.runtime.jobs import JobManager
from laminar.runtime.spec import JobSpec
from laminar.store import Store

# serial: its memory pressure is felt machine-wide (node PSI, MemAvailable); run alone (Makefile)
pytestmark = [pytest.mark.kernel, pytest.mark.serial]

# A job that writes a checkpoint on SIGUSR1 (the contract), grows to TOTAL MiB in STEP MiB steps every DELAY s, holds HOLD s (forever when
# < 0), frees, then sleeps forever. Pages are written so they are really charged.
HOG = r"""
import os, signal, sys, time
def checkpoint(signum, frame):
    d = os.environ["LAMINAR_CKPT_DIR"]
    with open(os.path.join(d, "ckpt.tmp"), "w") as f:
        f.write(str(time.time()))
    os.replace(os.path.join(d, "ckpt.tmp"), os.path.join(d, "ckpt"))
signal.signal(signal.SIGUSR1, checkpoint)
total, step, delay, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
base = int(sys.argv[5]) if len(sys.argv) > 5 else 0
def block(mib):
    b = bytearray(mib << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    return b
keep = [block(base)]
got = 0
while got < total:
    keep.append(block(step))
    got += step
    time.sleep(delay)
if hold >= 0:
    time.sleep(hold)
    del keep[1:]
while True:
    time.sleep(1)
"""


def hog(total: int, step: int = 20, delay: float = 0.02, hold: float = -1, base: int = 0) -> list[str]:
    return [sys.executable, "-c", HOG, str(total), str(step), str(delay), str(hold), str(base)]


class Rig:
    def __init__(self, tmp: Path, root: str) -> None:
        self.tmp = tmp
        self.root = root
        self.store = Store(tmp / "laminar.db")
        self.events = EventBus(self.store)
        self.seen: list[dict[str, Any]] = []
        self.events.subscribe(self.seen.append)
        self.jobs: JobManager | None = None
        self.airlock: Airlock | None = None

    async def start(self, budget_mb: int | None, policy: dict[str, Any] | None = None, **airlock: Any) -> None:
        """JobManager and Airlock; `airlock` are more Airlock arguments (class_budget_mb, hold_allocator)."""
        self.jobs = JobManager(store=self.store, state_dir=self.tmp, cgroup_root=self.root, events=self.events,
                               gpus_declared=[])
        await self.jobs.start(None)
        self.airlock = Airlock(jobs=self.jobs, store=self.store, events=self.events, budget_mb=budget_mb,
                               policy=policy, **airlock)
        await self.airlock.start(None)

    async def restart(self, budget_mb: int | None, **airlock: Any) -> None:
        """A new JobManager and Airlock over the same store and cgroups (an agent restart),
        with the config's `budget_mb` and `airlock` arguments of the new process."""
        assert self.jobs is not None and self.airlock is not None
        await self.airlock.stop()
        await self.jobs.stop()
        await self.start(budget_mb, **airlock)

    async def close(self) -> None:
        """Stops the components, kills and removes the test's cgroup tree, closes the store."""
        if self.airlock:
            await self.airlock.stop()
        if self.jobs:
            await self.jobs.stop()
        CgroupTree(detect(), self.root).purge()
        self.store.close()

    def actions(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.seen if e["kind"] == "airlock" and "action" in e and (kind is None or e["action"] == kind)]


@contextlib.asynccontextmanager
async def storm_rig(tmp: Path, budget_mb: int | None, policy: dict[str, Any] | None = None,
                    **airlock: Any) -> AsyncIterator[Rig]:
    """A started `Rig` with its own cgroup root (``laminar-t-<hex>``); closed on leaving (its
    cgroups and processes removed), also when the test fails."""
    r = Rig(tmp, f"laminar-t-{secrets.token_hex(3)}")
    try:
        await r.start(budget_mb, policy, **airlock)
        yield r
    finally:
        await r.close()


def cache_reader(tmp: Path, mib: int) -> tuple[list[str], Path]:
    """A job's command that writes a `mib` MiB file past the page cache (O_DIRECT), reads it
    back (so the reading job is charged that much clean page cache), touches the returned
    path, then sleeps."""
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp)], capture_output=True, text=True).stdout.strip()
    if fs in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp} is on {fs}: a file there is shared memory, charged to the reader and never "
                    "dropped, so no clean page cache to test with (put the test's tmp on a disk: --basetemp)")
    data, done = tmp / "data", tmp / "done"
    return ["sh", "-c", f"dd if=/dev/zero of={data} bs=1M count={mib} oflag=direct status=none && "
                        f"cat {data} > /dev/null && touch {done} && exec sleep 600"], done


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_storm_from_transients_leaves_long_resident_untouched(tmp_path: Path) -> None:
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=512,
                             policy={"rungs": {"suspend": {"budget_s": 1.0}}, "readdress": False}) as r:
            assert r.jobs is not None
            lr = await r.jobs.submit(JobSpec(command=hog(150, step=50, delay=0.05), job_class="long-resident",
                                             priority=90, name="lr"))
            await asyncio.sleep(1.0)
            ts = [await r.jobs.submit(JobSpec(command=hog(300, step=20, delay=0.02), job_class="transient",
                                              priority=10 + i, name=f"t{i}")) for i in range(3)]
            # The storm (150 + 3 x 300 MiB against 512 MiB) must end: transients suspended or killed.
            assert await until(lambda: all(r.jobs.get(t.id).state in ("suspended", "killed") for t in ts), 20)
            await asyncio.sleep(2.0)
            lr_now = r.jobs.get(lr.id)
            assert lr_now is not None and lr_now.state == "running" and alive(lr.pid)
            assert not lr_now.cgroup.frozen()
            touched = [a for a in r.actions() if a["job"] == lr.id]
            assert touched == [], f"Airlock acted on the long-resident job: {touched}"
            assert r.actions("suspend"), "no suspension recorded"
            for a in r.actions():
                assert a["reason"], a
            killed = [r.jobs.get(t.id) for t in ts if r.jobs.get(t.id).state == "killed"]
            for j in killed:
                assert j.work_lost_s is not None and j.work_lost_s >= 0

    run(main())


def test_transient_spike_survived_by_suspension_and_recovery(tmp_path: Path) -> None:
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=512, policy={"hysteresis": {"hold_s": 0.5, "step_s": 0.2}}) as r:
            assert r.jobs is not None
            t = await r.jobs.submit(JobSpec(command=hog(80, step=40, delay=0.05), job_class="transient", name="t"))
            await asyncio.sleep(1.0)
            # The long-resident job spikes to ~0.88 of the budget for 1.5 s, then frees.
            lr = await r.jobs.submit(JobSpec(command=hog(360, step=30, delay=0.03, hold=1.5), job_class="long-resident",
                                             priority=80, name="spiky"))
            assert await until(lambda: bool(r.actions("suspend")), 10), "the spike was not met by a suspension"
            assert await until(lambda: bool(r.actions("recover")), 15), "the suspended job was not recovered"
            assert not r.actions("kill") and not r.actions("readdress")
            tj = r.jobs.get(t.id)
            assert tj is not None and tj.state == "running" and not tj.cgroup.frozen() and alive(t.pid)
            assert alive(lr.pid)
            assert [a["job"] for a in r.actions("suspend")] == [t.id]

    run(main())


def test_frozen_job_that_never_recovers_is_escalated_within_budget(tmp_path: Path) -> None:
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=512,
                             policy={"rungs": {"suspend": {"budget_s": 1.0}, "readdress": {"budget_s": 1.0}}}) as r:
            assert r.jobs is not None
            t = await r.jobs.submit(JobSpec(command=hog(100, step=50, delay=0.05), job_class="transient", name="t"))
            await asyncio.sleep(1.0)
            # The long-resident job grows to ~0.88 of the budget and stays there: no recovery.
            await r.jobs.submit(JobSpec(command=hog(340, step=30, delay=0.03), job_class="long-resident", name="big"))
            assert await until(lambda: r.jobs.get(t.id).state == "killed", 20), "\n".join(f"{e['ts']:.3f} {e['message']}" for e in r.seen if e["kind"] in ("airlock", "job"))
            kinds = [a["action"] for a in r.actions() if a["job"] == t.id]
            assert kinds[0] == "suspend" and "kill" in kinds and "readdress" in kinds, r.actions()
            esc = [a for a in r.actions() if a["job"] == t.id and a["action"] != "suspend"]
            assert all("budget" in a["reason"] for a in esc), esc
            final = r.jobs.get(t.id)
            assert final is not None and final.work_lost_s is not None and final.work_lost_s > 0
            # the stop records 'killed' first, then kills and removes the cgroup
            assert await until(lambda: not final.cgroup.exists(), 10)

    run(main())


def test_restart_during_storm_loses_no_job(tmp_path: Path) -> None:
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=512, policy={"rungs": {"suspend": {"budget_s": 30.0}}}) as r:
            assert r.jobs is not None
            lr = await r.jobs.submit(JobSpec(command=hog(150, step=50, delay=0.05), job_class="long-resident", name="lr"))
            ts = [await r.jobs.submit(JobSpec(command=hog(200, step=20, delay=0.05), job_class="transient", name=f"t{i}"))
                  for i in range(2)]
            assert await until(lambda: bool(r.actions("suspend")), 15)
            before = {j.id: j.state for j in r.jobs.active()}
            await r.restart(budget_mb=512)
            after = {j.id: j.state for j in r.jobs.active()}
            assert set(after) == set(before), (before, after)
            for jid, state in before.items():
                assert after[jid] == state, (jid, before, after)
                assert all(j.reattached for j in r.jobs.active())
            assert alive(lr.pid) and r.jobs.get(lr.id).state == "running"
            # The reattached jobs are still managed: a stop works and records the end.
            final = await r.jobs.stop(ts[0].id, "test over", grace_s=0.5)
            assert final is not None and final.state == "stopped" and not final.cgroup.exists()

    run(main())


def charged(job: Any) -> int:
    """The job's memory charge now, 0 once its cgroup is gone."""
    try:
        return int(job.cgroup.memory_usage())
    except CgroupError:
        return 0


def memory_settings(r: Rig) -> dict[str, tuple[int | None, str]]:
    """{"root" or class: (limit in bytes or None, hold)} of the rig's memory cgroups. hold is "1"
    where a task at the limit waits instead of being killed: v1 oom_kill_disable; v2 a
    memory.high at the hold below memory.max (cgroups.v2_hold_bytes), or a memory.high with no
    memory.max (a protected class: throttled at its budget, its limit); else "0"."""
    assert r.airlock is not None and r.airlock.tree is not None
    tree = r.airlock.tree
    h = tree.hierarchy
    dirs = {"root": r.airlock._root_memory_dir(), **{c: tree.class_memory_dir(c) for c in tree.classes}}
    out = {}
    for k, d in dirs.items():
        limit = read_memory_limit(h, d)
        if h.memory_in_v2:
            high = (d / "memory.high").read_text().strip()
            if limit is None and high != "max":
                limit, hold = int(high), "1"
            else:
                hold = "1" if limit is not None and high != "max" and int(high) == v2_hold_bytes(limit) else "0"
        else:
            hold = (d / "memory.oom_control").read_text().split()[1]
        out[k] = (limit, hold)
    return out


def test_memory_settings_follow_the_config_of_a_restarted_agent(tmp_path: Path) -> None:
    """A restarted agent whose config no longer has a budget, a class budget or hold_allocator
    left the old process's limits and oom_kill_disable in the kernel: jobs were held at a
    budget the operator had removed (and, the usage read against that limit, suspended and
    killed for it)."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=96, class_budget_mb={"long-resident": 64}, hold_allocator=True) as r:
            before = memory_settings(r)
            assert before["root"][0] == 96 << 20 and before["long-resident"] == (64 << 20, "1"), before
            await r.restart(budget_mb=None, class_budget_mb={}, hold_allocator=False)
            after = memory_settings(r)
            assert all(v[0] is None for v in after.values()), after
            assert all(v[1] == "0" for v in after.values()), after
            # a long-resident job takes more than both old limits, and is left alone
            assert r.jobs is not None
            lr = await r.jobs.submit(JobSpec(command=hog(120, step=20, delay=0.02), job_class="long-resident",
                                             name="lr"))
            assert await until(lambda: lr.cgroup.memory_usage() >= 120 << 20, 20), lr.cgroup.memory_usage()
            assert r.jobs.get(lr.id).state == "running" and alive(lr.pid)  # type: ignore[union-attr]

    run(main())


def test_a_job_starting_in_an_unprotected_class_meets_a_cap_that_leaves_the_protected_jobs_what_they_use_now(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unprotected classes' caps follow usage every tick (50 ms). A long-resident job grew by
    120 MiB and transients started at once, before a tick (the agent's loop busy with their
    submissions): their class cap still left the long-resident job its usage from before, so the
    storm could fill the budget itself, where v1's oom_kill_disable fails kernel-side charges
    with ENOMEM and a protected job dies of a failed write (seen in CI). The job runtime asks
    Airlock for the caps before it starts a job, and Airlock brings them up to date then. Here
    no tick refreshes them (both tick intervals an hour): the cap the transient meets is the one
    its own admission wrote."""
    from laminar.airlock import manager

    monkeypatch.setattr(manager, "IDLE_TICK_S", 3600.0)

    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=256, tick_s=3600.0) as r:
            assert r.jobs is not None
            before = memory_settings(r)["transient"][0]
            lr = await r.jobs.submit(JobSpec(command=hog(120, step=40, delay=0.01), job_class="long-resident",
                                             priority=90, name="lr"))
            assert await until(lambda: lr.cgroup.memory_usage() >= 120 << 20, 20), lr.cgroup.memory_usage()
            assert memory_settings(r)["transient"][0] == before  # no tick: the cap from before lr grew
            await r.jobs.submit(JobSpec(command=["sleep", "600"], job_class="transient", name="t"))
            # the budget less the long-resident job's usage (>= 120 MiB) and the reserve (16 MiB)
            cap = memory_settings(r)["transient"][0]
            assert before is not None and before > (200 << 20), before
            assert cap is not None and cap <= (256 - 120 - 16) << 20, (cap >> 20, before >> 20)

    run(main())


@pytest.mark.parametrize("protected", [["long-resident", "standard"], []])
def test_a_policy_change_lifts_the_caps_of_classes_no_longer_capped(tmp_path: Path, protected: list[str]) -> None:
    """The unprotected classes' caps follow usage every tick, but a class that a new policy
    protects (or every class, when the policy protects none) kept the cap last written, from
    the moment of the last storm: its jobs were held there for good (a protected one never
    acted on, the rest suspended and killed with the budget mostly free)."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=256) as r:
            assert r.jobs is not None and r.airlock is not None
            t = await r.jobs.submit(JobSpec(command=hog(150, step=30, delay=0.02), job_class="transient", name="t"))
            # the standard class is capped at its usage (0) plus the free room left by the transient
            assert await until(lambda: r.airlock.status()["class_caps_mb"].get("standard", 999) <= 100, 20), \
                r.airlock.status()
            r.airlock.set_policy({"protected": protected})
            assert memory_settings(r)["standard"][0] is None, memory_settings(r)
            await r.jobs.stop(t.id, "storm over", grace_s=0)
            s = await r.jobs.submit(JobSpec(command=hog(150, step=30, delay=0.02), job_class="standard", name="s"))
            assert await until(lambda: s.cgroup.memory_usage() >= 150 << 20, 20), s.cgroup.memory_usage()
            assert r.jobs.get(s.id).state == "running" and not r.actions("kill")  # type: ignore[union-attr]

    run(main())


def test_a_policy_whose_job_default_exceeds_the_configs_class_cap_is_refused_whole(tmp_path: Path) -> None:
    """Such a policy was accepted, and from then on every job of the class submitted without
    --memory was refused at submit as one that could never start on this node."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=256, class_budget_mb={"transient": 128}) as r:
            assert r.jobs is not None and r.airlock is not None and r.airlock.policy is not None
            version = r.airlock.policy.version
            with pytest.raises(PolicyError, match=r"job_default_mb.transient 200 exceeds the transient class's cap "
                                                  r"of 128 MiB \(\[airlock\] class_budget_mb"):
                r.airlock.set_policy({"job_default_mb": {"transient": 200}, "hysteresis": {"hold_s": 1.0}})
            assert r.airlock.policy.version == version and r.airlock.policy["job_default_mb"] == {}
            assert r.airlock.policies is not None and r.airlock.policies.current().version == version
            t = await r.jobs.submit(JobSpec(command=["sleep", "60"], job_class="transient", name="t"))
            assert t.state == "running" and t.spec.memory_mb is None

    run(main())


def test_a_protected_class_held_at_its_own_class_budget_costs_no_other_job(tmp_path: Path) -> None:
    """A protected class at its own class budget (config class_budget_mb, held by
    hold_allocator) read as node pressure 'critical': Airlock suspended every unprotected job
    and killed them one by one, none of which could free a byte for the held class (its
    limit is its own, and Airlock never acts on protected jobs)."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=512, class_budget_mb={"long-resident": 64}, hold_allocator=True) as r:
            assert r.jobs is not None and r.airlock is not None
            t = await r.jobs.submit(JobSpec(command=hog(20, step=20, delay=0.02), job_class="transient", name="t"))
            lr = await r.jobs.submit(JobSpec(command=hog(100, step=10, delay=0.02), job_class="long-resident",
                                             name="lr"))
            cls_dir = r.airlock.tree.class_memory_dir("long-resident")  # type: ignore[union-attr]
            h = r.airlock.tree.hierarchy  # type: ignore[union-attr]
            assert await until(lambda: read_memory_waits(h, cls_dir), 20)
            await asyncio.sleep(2.0)  # many evaluations (ticks, the class's oom_control eventfd)
            assert [a for a in r.actions() if a["job"] == t.id] == [], r.actions()
            tj = r.jobs.get(t.id)
            assert tj is not None and tj.state == "running" and not tj.cgroup.frozen() and alive(t.pid)
            held = [e for e in r.seen if e["kind"] == "airlock" and e.get("held_class") == "long-resident"]
            assert held and "class_budget_mb" in held[0]["message"], [e["message"] for e in r.seen]
            assert alive(lr.pid)

    run(main())


def test_a_protected_job_at_the_full_node_budget_is_not_said_to_wait_at_its_own_class_limit(tmp_path: Path) -> None:
    """On v1 a full budget marks every class under it as waiting (``under_oom``), the protected
    ones too: Airlock said "protected class long-resident waits at its own memory limit
    (class_budget_mb ? MiB) ... raise [airlock] class_budget_mb" while the class had no limit of
    its own and the node budget was what was full (seen in CI). A class is held at its own limit
    only when the budget is not full."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=128, hold_allocator=True) as r:
            assert r.jobs is not None and r.airlock is not None
            lr = await r.jobs.submit(JobSpec(command=hog(200, step=10, delay=0.02), job_class="long-resident",
                                             name="lr"))
            root = r.airlock._root_memory_dir()
            h = r.airlock.tree.hierarchy  # type: ignore[union-attr]
            assert await until(lambda: read_memory_waits(h, root), 20)
            await asyncio.sleep(1.0)  # many evaluations (ticks, the root's oom_control eventfd)
            assert read_memory_waits(h, root)
            held = [e["message"] for e in r.seen if e["kind"] == "airlock" and e.get("held_class")]
            assert held == [], held
            assert [a for a in r.actions() if a["job"] == lr.id] == []  # protected: never acted on

    run(main())


def test_a_protected_class_with_no_budget_of_its_own_seen_waiting_after_the_root_is_node_pressure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """signals() reads the root's wait, then each class's. On v1 the kernel marks a budget's OOM
    down its subtree one cgroup at a time, so an OOM that begins (or ends) between the two reads
    shows a class waiting and the root not: Airlock then said the protected class "waits at its
    own memory limit (class_budget_mb ? MiB)" while it had none (fresh-clone CI, 2026-12-07). The
    two reads are made to straddle the change here."""
    from laminar.airlock import manager as manager_mod

    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=128) as r:
            assert r.airlock is not None and r.airlock.tree is not None
            cls_dir = r.airlock.tree.class_memory_dir("long-resident")
            monkeypatch.setattr(manager_mod, "read_memory_waits", lambda h, d: d == cls_dir)
            sig = r.airlock.signals(time.monotonic())
            assert sig.under_oom  # the class waits at the budget's limit, which acting on others lifts
            held = [e["message"] for e in r.seen if e["kind"] == "airlock" and e.get("held_class")]
            assert held == [], held

    run(main())


# A job whose working set (a 160 MiB file it reads through mmap, like a data loader) is larger
# than its own --memory: it stalls on refaults all the time, and only itself.
THRASH = r"""
import mmap, os, sys
size = 160 << 20
with open(sys.argv[1], "wb") as f:
    for _ in range(size >> 20):
        f.write(b"\1" * (1 << 20))
m = mmap.mmap(os.open(sys.argv[1], os.O_RDONLY), size, prot=mmap.PROT_READ)
s = 0
while True:
    for i in range(0, size, 4096):
        s += m[i]
"""


def test_a_job_thrashing_at_its_own_memory_limit_costs_no_other_job(tmp_path: Path) -> None:
    """A job stalling at its own --memory (PSI of its cgroup, hence of the jobs' subtree and the
    node) read as node pressure, 'critical' by the subtree's PSI full: with the budget 94 %
    free, Airlock suspended and killed the other jobs ("killed to free 0 MiB") and then
    the thrashing job itself. Suspending or killing other jobs lifts no job's own limit."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=1024) as r:
            assert r.jobs is not None and r.airlock is not None
            b = await r.jobs.submit(JobSpec(command=["sleep", "600"], job_class="transient", priority=1, name="b"))
            a = await r.jobs.submit(JobSpec(command=[sys.executable, "-c", THRASH, str(tmp_path / "data")],
                                            job_class="transient", priority=90, memory_mb=64, name="a"))
            assert await until(lambda: read_psi(a.cgroup.memory_pressure_path)[0] >= 0.05, 30), \
                a.cgroup.memory_pressure_path.read_text()
            await asyncio.sleep(3.0)  # PSI triggers of the job, the subtree and the node; many evaluations
            assert r.actions() == [], [e["message"] for e in r.actions()]
            assert r.jobs.get(b.id).state == "running" and r.jobs.get(a.id).state == "running"  # type: ignore[union-attr]

    run(main())


def test_a_class_held_at_its_own_class_budget_is_relieved_by_its_own_jobs(tmp_path: Path) -> None:
    """An unprotected class at its own class budget (config class_budget_mb) made the whole
    node 'critical', and the ladder took the lowest-value jobs anywhere: the transients were
    suspended and killed first, although their memory is not under that class's limit and
    freeing it could not let the held job go on."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=512, class_budget_mb={"standard": 64}, hold_allocator=True,
                             policy={"readdress": False}) as r:
            assert r.jobs is not None and r.airlock is not None
            t = await r.jobs.submit(JobSpec(command=hog(20, step=20, delay=0.02), job_class="transient", name="t"))
            s = await r.jobs.submit(JobSpec(command=hog(100, step=10, delay=0.02), job_class="standard", name="s"))
            assert await until(lambda: r.jobs.get(s.id).state == "killed", 20), [e["message"] for e in r.actions()]  # type: ignore[union-attr]
            assert [a for a in r.actions() if a["job"] == t.id] == [], [e["message"] for e in r.actions()]
            tj = r.jobs.get(t.id)
            assert tj is not None and tj.state == "running" and not tj.cgroup.frozen() and alive(t.pid)

    run(main())


def test_a_suspension_pending_at_a_restart_is_taken_over_and_thawed_once_calm(tmp_path: Path) -> None:
    """A task waiting at the held budget only freezes once its wait ends: Airlock's freeze is
    requested (cgroup.freeze 1) while cgroup.events still says frozen 0. A restart in that
    window dropped the job's suspend rung as 'found thawed' and called it running; when memory
    freed, the job froze as requested, and nothing ever thawed it."""
    async def main() -> None:
        everything = {"protected": ["long-resident", "standard", "transient"]}  # the ladder acts on nothing
        async with storm_rig(tmp_path, budget_mb=64, policy=everything, hold_allocator=True) as r:
            assert r.jobs is not None and r.airlock is not None
            b = await r.jobs.submit(JobSpec(command=hog(40, step=20, delay=0.02), job_class="transient", name="b"))
            assert await until(lambda: b.cgroup.memory_usage() >= 40 << 20, 20)
            a = await r.jobs.submit(JobSpec(command=hog(40, step=10, delay=0.02), job_class="transient", name="a"))
            root_dir = r.airlock._root_memory_dir()
            h = r.airlock.tree.hierarchy  # type: ignore[union-attr]
            assert await until(lambda: read_memory_waits(h, root_dir), 20)
            now = time.monotonic()
            r.airlock._apply(ladder.Action(ladder.SUSPEND, a.id, "test: high"), now, ladder.HIGH, r.airlock.signals(now))
            assert (a.cgroup.unified / "cgroup.freeze").read_text().strip() == "1" and not a.cgroup.frozen()
            await r.restart(budget_mb=64, hold_allocator=True)
            assert r.airlock.rungs.get(a.id, (None,))[0] == ladder.SUSPEND, r.airlock.rungs
            assert r.jobs.get(a.id).state == "suspended"  # type: ignore[union-attr]
            await r.jobs.stop(b.id, "frees the budget", grace_s=0)
            assert await until(a.cgroup.frozen, 20)  # the wait ended: the requested freeze took hold
            assert r.airlock.policy is not None
            later = time.monotonic() + 60
            r.airlock.memo.last_recover = float("-inf")
            for act in ladder.decide(later, ladder.NONE, r.airlock.views(later), r.airlock.policy.doc,
                                     r.airlock.memo, 0.1):
                r.airlock._apply(act, later, ladder.NONE, r.airlock.signals(later))
            aj = r.jobs.get(a.id)
            assert aj is not None and not aj.cgroup.frozen() and aj.state == "running" and alive(a.pid)

    run(main())


def test_clean_page_cache_is_not_memory_in_use(tmp_path: Path) -> None:
    """v1 usage_in_bytes counts the page cache: a job reading a file larger than the budget's
    free room (a data set, a checkpoint) fills the budget with clean cache, which the kernel
    frees on demand, and Airlock read that as pressure 'high': every job was suspended, then
    re-addressed and killed as its budgets ran out, with 1 MiB of memory really in use."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=256) as r:
            assert r.jobs is not None and r.airlock is not None
            b = await r.jobs.submit(JobSpec(command=["sleep", "600"], job_class="transient", priority=1, name="b"))
            reader, done = cache_reader(tmp_path, 400)
            a = await r.jobs.submit(JobSpec(command=reader, job_class="standard", name="a"))
            root = r.airlock._root_memory_dir()
            h = r.airlock.tree.hierarchy  # type: ignore[union-attr]
            peak = [0]

            def read_done() -> bool:
                peak[0] = max(peak[0], read_memory_usage(h, root))
                return done.exists()

            assert await until(read_done, 60, step=0.02)
            assert peak[0] >= 0.85 * (256 << 20), f"the cache reached only {peak[0] >> 20} MiB of the budget"
            await asyncio.sleep(2.0)
            assert r.actions() == [], [e["message"] for e in r.actions()]
            assert r.jobs.get(a.id).state == "running" and r.jobs.get(b.id).state == "running"  # type: ignore[union-attr]

    run(main())


def test_victims_are_ranked_by_the_memory_they_would_free_not_their_page_cache(tmp_path: Path) -> None:
    """Survival value falls with the memory a job would free, and that was its charge with the
    page cache: a job that had read a large file ranked lowest and was suspended (and killed,
    'to free 300 MiB') ahead of the job actually holding the memory."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=512) as r:
            assert r.jobs is not None and r.airlock is not None and r.airlock.policy is not None
            reader, done = cache_reader(tmp_path, 300)
            a = await r.jobs.submit(JobSpec(command=reader, job_class="transient", name="reader"))
            b = await r.jobs.submit(JobSpec(command=hog(60, step=20, delay=0.02), job_class="transient", name="keeper"))
            assert await until(lambda: done.exists() and b.cgroup.memory_usage() >= 60 << 20, 60)
            assert a.cgroup.memory_usage() > 2 * b.cgroup.memory_usage()  # the reader's charge: its cache
            now = time.monotonic()
            acts = ladder.decide(now, ladder.HIGH, r.airlock.views(now), r.airlock.policy.doc, ladder.Memo(), 0.9)
            assert [(x.kind, x.job_id) for x in acts] == [(ladder.SUSPEND, b.id)], acts

    run(main())


def test_a_protected_jobs_page_cache_leaves_the_other_classes_room(tmp_path: Path) -> None:
    """The unprotected classes' caps were computed from charges with the page cache: a
    long-resident job reading its data set fills the budget with clean cache, which left the
    other classes no room at all (their caps at their usage), so any transient that grew was
    held at its cap, 'critical', and killed, with the budget's memory in use nearly nil."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=512) as r:
            assert r.jobs is not None and r.airlock is not None
            reader, done = cache_reader(tmp_path, 700)
            lr = await r.jobs.submit(JobSpec(command=reader, job_class="long-resident", name="lr"))
            assert await until(done.exists, 60)
            assert lr.cgroup.memory_usage() >= 300 << 20, lr.cgroup.memory_usage()  # its cache fills the budget
            await asyncio.sleep(0.5)  # a few ticks of caps
            t = await r.jobs.submit(JobSpec(command=hog(120, step=20, delay=0.02), job_class="transient", name="t"))
            assert await until(lambda: charged(t) >= 120 << 20, 20), (
                r.jobs.get(t.id), [e["message"] for e in r.seen if e["kind"] in ("airlock", "job")])
            await asyncio.sleep(1.0)
            assert r.actions() == [], [e["message"] for e in r.actions()]
            assert r.jobs.get(t.id).state == "running"  # type: ignore[union-attr]

    run(main())


def test_a_job_stopping_through_a_long_grace_is_cut_short_under_pressure_before_a_running_job(tmp_path: Path) -> None:
    """A job being stopped (here: it ignores SIGTERM, its grace is 60 s) was out of Airlock's
    reach: only running and suspended jobs were ranked. Under pressure it kept its memory while
    Airlock suspended and then killed a running job that was not ending at all. Now its grace
    is cut short first (it ends anyway; its end stays the stop's, the reason says so) and the
    running job is left alone."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=512,
                             policy={"readdress": False, "rungs": {"suspend": {"budget_s": 1.0}}}) as r:
            assert r.jobs is not None
            deaf = ["sh", "-c", "trap '' TERM; exec \"$@\"", "sh", *hog(250, step=50, delay=0.05)]
            ending = await r.jobs.submit(JobSpec(command=deaf, job_class="transient", priority=10, name="lm-t-ending"))
            assert await until(lambda: charged(ending) >= 240 << 20, 20), charged(ending)
            stop = asyncio.create_task(r.jobs.stop(ending.id, "test: stopped by its owner", grace_s=60))
            assert await until(lambda: ending.state == "stopped", 10)
            assert ending.ended is None and alive(ending.pid)  # in its grace, SIGTERM ignored
            # 250 MiB held by the ending job + 350 MiB of a running one: more than the 512 MiB budget
            busy = await r.jobs.submit(JobSpec(command=hog(350, step=25, delay=0.03), job_class="standard",
                                               priority=50, name="lm-t-busy"))
            assert await until(lambda: stop.done(), 20), f"the ending job's grace was not cut: {r.actions()}"
            final = await stop
            assert final is not None and final.state == "stopped" and final.ended is not None
            assert "cut short by Airlock" in final.reason, final.reason
            assert [a["job"] for a in r.actions("cut")] == [ending.id], r.actions()
            assert await until(lambda: charged(busy) >= 340 << 20, 20), charged(busy)
            await asyncio.sleep(1.0)  # past the suspend budget: anything acting on it would show
            touched = [a for a in r.actions() if a["job"] == busy.id]
            assert touched == [], f"Airlock acted on the running job instead: {touched}"
            now = r.jobs.get(busy.id)
            assert now is not None and now.state == "running" and not now.cgroup.frozen() and alive(busy.pid)

    run(main())


def test_a_restarted_airlock_leaves_a_job_the_migration_layer_fenced_to_it(tmp_path: Path) -> None:
    """A frozen job with no recorded rung is one Airlock froze and did not record before the
    agent went down: a restarted Airlock suspends it and thaws it once calm. A job the migration
    layer fenced (its node cut off from its zone: store meta ``migrate.fenced``,
    laminar/migrate/fence.py) is frozen too, and not Airlock's: thawed once calm, it would run
    beside the copy the zone resumed elsewhere. A real frozen cgroup each; the other job, frozen
    the same way without the meta, is taken as Airlock's."""
    async def main() -> None:
        async with storm_rig(tmp_path, budget_mb=None) as r:
            assert r.jobs is not None and r.airlock is not None
            fenced = await r.jobs.submit(JobSpec(command=["sleep", "600"], job_class="standard", name="fenced"))
            other = await r.jobs.submit(JobSpec(command=["sleep", "600"], job_class="standard", name="other"))
            for j in (fenced, other):
                assert j.cgroup.freeze(timeout=10)
            r.store.set_meta("migrate.fenced", {fenced.id: time.time()})
            await r.restart(budget_mb=None)
            assert fenced.id not in r.airlock.rungs, r.airlock.rungs
            assert r.airlock.rungs.get(other.id, (None,))[0] == ladder.SUSPEND
            fj = r.jobs.get(fenced.id)
            assert fj is not None and fj.cgroup.frozen()

    run(main())
