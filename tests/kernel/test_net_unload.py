"""``laminarctl bpf unload`` leaves the uplink as it was: the shaping tree goes too (real laminard).

``bpf unload`` promises the interface as it was before the agent: it removed the tc filters,
the clsact qdisc and the pins, but not the HTB tree the transfer registry puts at the uplink's
root (``4c4d:``, root class at ``shaping.link_mbit``, background held to its class). After an
unload the node's whole egress stayed shaped by an agent that no longer ran, with the
migration leaves still there; the stored transfers came back at the next start. The tree is
now deleted (only ours: an HTB root with the 4c4d handle), and the stored transfers with it,
both by the agent's unload and by ``bpf unload --force`` with no agent running.

Nor may an unload touch the jobs, which keep running: the removal of the classes' empty v1
memory cgroups signalled Airlock's eventfds on them, read as critical pressure (jobs suspended,
reclaimed, and left frozen as the agent stopped).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until
from jobrig import airlock_rig, running, until

from laminar.airlock.cgroups import Hierarchy, read_memory_limit
from laminar.policy import ladder
from laminar.runtime.spec import JobSpec

pytestmark = pytest.mark.kernel

HTB_HANDLE = "4c4d:"



def root_qdisc(veth_pair: Any) -> dict[str, Any] | None:
    out = veth_pair.a.run("tc", "-j", "qdisc", "show", "dev", veth_pair.ifname_a).stdout
    return next((q for q in json.loads(out or "[]") if q.get("root")), None)


def test_unload_removes_the_shaping_tree(shaping_agent: AgentProc, veth_pair: Any) -> None:
    st = shaping_agent.json("net", "transfers")
    assert st["status"]["shaping"] == "on", st
    q = root_qdisc(veth_pair)
    assert q is not None and q["kind"] == "htb" and q["handle"] == HTB_HANDLE, q
    shaping_agent.ctl("bpf", "unload")
    shaping_agent.proc.wait(30)  # type: ignore[union-attr]
    q = root_qdisc(veth_pair)
    assert q is None or q["handle"] != HTB_HANDLE, f"the HTB tree outlived bpf unload: {q}"


def test_offline_unload_removes_the_shaping_tree(shaping_agent: AgentProc, veth_pair: Any) -> None:
    assert (root_qdisc(veth_pair) or {}).get("handle") == HTB_HANDLE
    shaping_agent.kill9()
    r = shaping_agent.ctl("bpf", "unload", "--force", "--config", str(shaping_agent.config_path))
    assert r.returncode == 0, r.stderr
    q = root_qdisc(veth_pair)
    assert q is None or q["handle"] != HTB_HANDLE, f"the HTB tree outlived bpf unload --force: {q}"


def test_unload_with_running_jobs_neither_freezes_nor_kills_them(agent: AgentProc) -> None:
    """``bpf unload`` removes the classes' empty cgroups; on cgroup v1 the kernel signals each
    removed memory cgroup's registered eventfds (oom_control, pressure_level) as it goes. Airlock
    read that as "pressure critical" and suspended or reclaimed the jobs the docs say keep
    running. Now a source whose cgroup is gone is dropped, not read as pressure, and the jobs
    still run, not frozen, after the agent stopped. A job's cgroup removed at its normal end is
    no pressure either (no level change in the log)."""
    agent.json("submit", "--name", "short", "--class", "standard", "--", "true")
    jobs = [agent.json("submit", "--name", f"u{i}", "--class", "transient", "--", "sleep", "600") for i in range(2)]
    wait_until(lambda: all(j["state"] == "running" for j in agent.json("jobs", "--active")), 30,
               "both jobs running", agent.log)
    wait_until(lambda: all(j["state"] == "exited" for j in agent.json("jobs") if j["name"] == "short"),
               30, "the short job ended", agent.log)
    time.sleep(1.0)  # what a removed job cgroup's sources would signal comes in ms; the ticker syncs each 1 s
    assert "pressure none ->" not in agent.log(), f"a job's normal end was taken for pressure:\n{agent.log()}"
    pids = [int(p) for j in agent.json("jobs", "--active") for p in j.get("pids") or []]
    assert len(pids) >= 2, agent.json("jobs")
    agent.ctl("bpf", "unload")
    agent.proc.wait(30)  # type: ignore[union-attr]
    log = agent.log()
    for word in ("suspend", "airlock killed", "airlock: kill", "level=critical"):
        assert word not in log, f"{word!r} after bpf unload with {len(jobs)} running jobs:\n{log}"
    for pid in pids:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state != "D" and state != "Z", f"job pid {pid} in state {state} after bpf unload"
        freezer = [line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if ":freezer:" in line]
        for line in freezer:
            d = Path("/sys/fs/cgroup/freezer") / line.split(":", 2)[2].lstrip("/")
            if (d / "freezer.state").exists():
                assert (d / "freezer.state").read_text().strip() == "THAWED", f"{d} frozen after bpf unload"


def test_unload_thaws_the_jobs_airlock_holds_suspended(tmp_path: Path) -> None:
    """A job Airlock suspended before ``bpf unload`` would stay frozen with no agent left to
    recover it: the unload thaws it (real cgroups and processes; the suspension is set as the
    ladder's SUSPEND action sets it)."""
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, _):
            job = await running(jobs, "lm-t-unload-frozen")
            other = await running(jobs, "lm-t-unload-free")
            # the kernel sets `frozen 1` once every task has stopped, a moment after the request
            assert job.cgroup.freeze(timeout=10), "the job's cgroup did not freeze within 10 s"
            al._set_rung(job.id, ladder.SUSPEND, time.monotonic(), 0, "test: pressure critical")
            jobs.set_state(job, "suspended", "airlock: test")
            assert al.release_for_unload() == [job.id]
            assert not job.cgroup.freeze_requested() and job.state == "running" and job.id not in al.rungs
            assert await until(lambda: not job.cgroup.frozen(), 10), "the job stayed frozen 10 s after the unload"
            assert other.state == "running"
            al.schedule()  # released: no evaluation is armed any more
            assert al._timer is None or al._timer.cancelled()
            assert al._task is not None and not al._closers
            await asyncio.sleep(0)
            assert al._task.cancelled()
            # an unload that failed: Airlock watches and acts again
            al.resume_after_failed_unload()
            assert al._closers and al._task is not None and not al._task.done() and not al._pending

    asyncio.run(main())


GROW = ("import os, sys, time\n"
        "go, done = sys.argv[1], sys.argv[2]\n"
        "while not os.path.exists(go): time.sleep(0.02)\n"
        "b = b'x' * (160 << 20)\n"
        "open(done, 'w').close()\n"
        "time.sleep(600)\n")


def holds(h: Hierarchy, d: Path) -> bool:
    """A task at ``d``'s limit waits instead of being killed (Airlock's hold): v1
    oom_kill_disable; v2 a memory.high below memory.max (or with no memory.max)."""
    if not h.memory_in_v2:
        return "oom_kill_disable 1" in (d / "memory.oom_control").read_text()
    return held_at(h, d) is not None


def held_at(h: Hierarchy, d: Path) -> int | None:
    """Where a task of ``d`` is held or capped by Airlock: v1 its limit (with oom_kill_disable,
    or a class cap), v2 its memory.high; None when nothing holds it there."""
    if not h.memory_in_v2:
        return read_memory_limit(h, d)
    high = (d / "memory.high").read_text().strip()
    return None if high == "max" else int(high)


def test_unload_lifts_the_memory_holds_no_agent_would_release(tmp_path: Path) -> None:
    """With a node budget, Airlock has the kernel hold a task that reaches the budget or its
    class's cap (v1 oom_kill_disable; v2 memory.high below the limit) until Airlock decides, and caps each
    unprotected class at what its last tick saw. After ``bpf unload`` no agent decides again:
    a job growing past its class's old cap waited there for good (under_oom), though the
    unload promises that jobs keep running. The unload lifts the hold and the caps (the budget
    stays, the kernel's OOM killer enforcing it); an unload that fails puts them back. Real
    cgroups, a real job growing by 160 MiB (its class capped near 128 MiB under a 256 MiB
    budget whose reserve is half of it)."""
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, _):
            h = al.tree.hierarchy  # type: ignore[union-attr]
            root = al._root_memory_dir()
            al.budget_mb = 256
            al.set_policy({"thresholds": {"usage.high": 0.45, "usage.critical": 0.5},
                           "hysteresis": {"recover_below": 0.4}})
            go, done = tmp_path / "go", tmp_path / "done"
            job = await jobs.submit(JobSpec([sys.executable, "-I", "-S", "-c", GROW, str(go), str(done)],
                                            name="lm-t-unload-grow", job_class="transient").validate())
            await until(lambda: job.pid in job.cgroup.pids(), 10)
            al.cap_unprotected()
            cap = held_at(h, root / "transient")
            assert cap is not None and cap < 160 << 20, f"the transient class is not capped below what the job will take: {cap}"
            assert holds(h, root)
            al.release_for_unload()
            for d in (root, *(root / c for c in al.tree.classes)):  # type: ignore[union-attr]
                assert not holds(h, d), f"{d} still holds at its limit"
            assert read_memory_limit(h, root) == 256 << 20  # the budget stays
            go.touch()
            await until(lambda: done.exists() or job.cgroup.under_oom(), 20)
            assert done.exists() and job.active, (
                f"the job waits at its class's old cap after the unload: under_oom {job.cgroup.under_oom()}, "
                f"held at {held_at(h, root / 'transient')}")
            al.resume_after_failed_unload()  # an unload that failed: the holds are back
            assert holds(h, root)

    asyncio.run(main())


def test_offline_unload_lifts_the_memory_holds_of_cgroups_jobs_keep(tmp_path: Path) -> None:
    """``bpf unload --force`` (``make uninstall``, no agent) keeps the cgroups jobs still run in;
    Airlock's holds on them (oom_kill_disable on the budget's root and the class caps) stayed,
    and no agent ever comes back to decide for a task waiting there. The unload lifts them: the
    root keeps the configured budget, a class its class_budget_mb or no limit. Real cgroups, a
    real process kept in a capped class; the settings as a stopped agent leaves them."""
    from laminar.airlock.cgroups import CgroupTree, detect
    from laminar.config import load
    from laminar.net.netguard import unload_offline

    h = detect()
    name = f"laminar-t-{secrets.token_hex(3)}"
    tree = CgroupTree(h, name)
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    try:
        tree.ensure()
        tree.set_root_memory(256 << 20, oom_kill_disable=True)
        tree.set_class_memory("transient", 64 << 20, oom_kill_disable=True)  # a cap of Airlock's
        tree.set_class_memory("standard", 96 << 20, oom_kill_disable=True)  # another, emptied by the unload
        tree.set_class_memory("long-resident", 128 << 20, oom_kill_disable=True)  # class_budget_mb
        mem = (h.unified if h.memory_in_v2 else h.v1["memory"]) / name
        for cls, p in zip(("transient", "long-resident"), procs, strict=True):  # busy: kept
            # v2 keeps processes out of a cgroup whose controllers are enabled for its children
            # (a class parent: EBUSY); they live in a job's directory under it, as jobs do
            d = mem / cls / "lm-t-job" if h.memory_in_v2 else mem / cls
            d.mkdir(exist_ok=True)
            (d / "cgroup.procs").write_text(str(p.pid))
        cfg = tmp_path / "laminar.toml"
        cfg.write_text(f'[agent]\nstate_dir = "{tmp_path / "state"}"\n[bpf]\npin_root = "{tmp_path / "pins"}"\n'
                       f'[cgroups]\nroot = "{name}"\n[airlock]\nbudget_mb = 256\n'
                       'class_budget_mb = {"long-resident" = 128}\n')
        (tmp_path / "state").mkdir()
        res = unload_offline(load(cfg))
        assert str(mem) in res["cgroups_kept_busy"], res
        assert not (mem / "standard").exists(), res
        for d in (mem, mem / "transient", mem / "long-resident"):
            assert not holds(h, d), f"{d} still holds at its limit"
        assert read_memory_limit(h, mem) == 256 << 20  # the budget stays
        assert read_memory_limit(h, mem / "transient") is None and held_at(h, mem / "transient") is None  # lifted
        assert read_memory_limit(h, mem / "long-resident") == 128 << 20
    finally:
        for p in procs:
            p.kill()
            p.wait()
        tree.purge()
