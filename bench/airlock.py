"""Benchmark: a memory storm against long-resident and transient jobs under a node budget.

Three defenders face the same storm, side by side, in one run:

- ``kernel``: the jobs' parent cgroup has the budget as its memory limit; the kernel's memcg
  OOM killer acts alone (it picks by size: the long-resident job is the largest);
- ``earlyoom``: the same limit as a backstop, plus Debian's earlyoom 1.7 with its threshold
  matched to Airlock's ``usage.high``: ``-M`` = MemAvailable at the start minus
  usage.high x budget, so it crosses when the storm fills the budget to the same point.
  earlyoom watches the whole machine, so it runs with ``--dryrun`` and this script carries out
  the kill it announces (SIGTERM, as earlyoom's first step) only when the victim is one of this
  benchmark's jobs; picks of other processes are counted (``earlyoom_foreign_picks``);
- ``airlock``: laminar's JobManager + Airlock with the default policy (allocator held at the
  budget, ladder: suspend, re-address, kill).

Storm: one long-resident job grows to LR_MB and keeps working (checkpoint every 60 s), then
N transients grow by STEP_MB every 40 ms to T_MB each (checkpoint every 2 s); their sum exceeds
the budget. Work lost for a killed job = time since its last checkpoint. The storm meets each
job at a random phase of its checkpoint interval (seeded per storm, the same for the three
defenders): a long-resident job has on average 30 s of work at risk, a transient 1 s.

reaction_p99_ms is measured from outside Airlock: from the first 5 ms sample in which the
budget's usage reached usage.high (or from Airlock's first stall signal, whichever came first)
to Airlock's first action of that storm.

Keys: protected_killed (Airlock), kernel_protected_killed, earlyoom_protected_killed,
reaction_p99_ms (first stall signal -> first Airlock action), work_lost_ratio_vs_earlyoom,
work_lost_ratio_vs_kernel, ...

    python bench/airlock.py [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "agent"), str(REPO / "ctl")]

from laminar.airlock.cgroups import CgroupTree, detect  # noqa: E402
from laminar.airlock.manager import Airlock  # noqa: E402
from laminar.airlock.policy import validate  # noqa: E402
from laminar.events import EventBus  # noqa: E402
from laminar.runtime.jobs import JobManager  # noqa: E402
from laminar.runtime.spec import JobSpec  # noqa: E402
from laminar.store import Store  # noqa: E402

BUDGET_MB = 768
LR_MB = 300
T_MB, STEP_MB, N_T = 160, 20, 4
LR_CKPT_S, T_CKPT_S = 60.0, 2.0

HOG = r"""
import sys, time
total, step, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
keep = []
def block(mib):
    b = bytearray(mib << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    return b
got = 0
while got < total:
    keep.append(block(step)); got += step
    time.sleep(delay)
while True:
    x = sum(range(10000)); time.sleep(0.01)
"""


def hog(total: int, step: int, delay: float) -> list[str]:
    return [sys.executable, "-c", HOG, str(total), str(step), str(delay)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


class Storm:
    """One run: spawn jobs, sample memory, record deaths."""

    def __init__(self, mode: str, duration: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.mode = mode
        self.duration = duration
        self.root = f"laminar-b-{secrets.token_hex(3)}"
        self.h = detect()
        self.tree = CgroupTree(self.h, self.root)
        self.jobs: list[dict[str, Any]] = []  # pid, class, start, ckpt_s, died
        self.samples: list[tuple[float, float]] = []
        self.actions: list[tuple[float, str]] = []
        self.t0 = 0.0
        self.reactions: list[float] = []
        self.foreign = 0
        self.inner: list[float] = []

    def mem_dir(self) -> Path:
        return (self.h.unified if self.h.memory_in_v2 else self.h.v1["memory"]) / self.root

    def usage_mb(self) -> float:
        name = "memory.current" if self.h.memory_in_v2 else "memory.usage_in_bytes"
        try:
            return int((self.mem_dir() / name).read_text()) / (1 << 20)
        except OSError:
            return 0.0

    def spawn_plain(self, cls: str, prio: int, argv: list[str], idx: int) -> int:
        cg = self.tree.job(cls, f"j{idx}")
        cg.create()
        files = [str(f) for f in cg.procs_files()]
        sh = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1"; shift; n=$((n-1)); done; exec "$@"'
        p = subprocess.Popen(["/bin/sh", "-c", sh, "x", str(len(files)), *files, *argv],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        return p.pid

    async def run(self) -> dict[str, Any]:
        tmp = Path(tempfile.mkdtemp(prefix="lm-bench-airlock-"))
        store = Store(tmp / "db.sqlite")
        bus = EventBus(store)
        jm: JobManager | None = None
        al: Airlock | None = None
        eo: subprocess.Popen[str] | None = None
        try:
            self.tree.ensure()
            if self.mode == "airlock":
                jm = JobManager(store=store, state_dir=tmp, cgroup_root=self.root, events=bus, gpus_declared=[])
                await jm.start(None)
                al = Airlock(jobs=jm, store=store, events=bus, budget_mb=BUDGET_MB, policy={})
                await al.start(None)
                bus.subscribe(lambda e: self.actions.append((time.monotonic(), e["action"]))
                              if e["kind"] == "airlock" and "action" in e else None)
            else:
                self.tree.set_root_memory(BUDGET_MB << 20, oom_kill_disable=False)
            if self.mode == "earlyoom":
                avail = int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))  # type: ignore[union-attr]
                high = validate({})["thresholds"]["usage.high"]
                threshold_kib = int(avail - high * BUDGET_MB * 1024)
                eo = subprocess.Popen(["earlyoom", "--dryrun", "-r", "0", "-M", f"{threshold_kib},{threshold_kib}",
                                       "-S", "100,100"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                os.set_blocking(eo.stdout.fileno(), False)  # type: ignore[union-attr]
            self.t0 = time.monotonic()
            specs = [("long-resident", 90, hog(LR_MB, 50, 0.02), LR_CKPT_S)]
            specs += [("transient", 10 + i, hog(T_MB, STEP_MB, 0.04), T_CKPT_S) for i in range(N_T)]
            for i, (cls, prio, argv, ck) in enumerate(specs):
                if i == 1:
                    await asyncio.sleep(0.8)  # the long-resident job is up before the storm
                if jm is not None:
                    job = await jm.submit(JobSpec(command=argv, job_class=cls, priority=prio))
                    pid = job.pid or 0
                else:
                    pid = self.spawn_plain(cls, prio, argv, i)
                phase = self.rng.uniform(0, ck)  # work since the last checkpoint when the storm begins
                self.jobs.append({"pid": pid, "class": cls, "start": time.monotonic() - phase, "ckpt": ck,
                                  "died": None})
            end = time.monotonic() + self.duration
            while time.monotonic() < end:
                now = time.monotonic()
                self.samples.append((now - self.t0, self.usage_mb()))
                for j in self.jobs:
                    if j["died"] is None and not alive(j["pid"]):
                        j["died"] = now
                if eo is not None:
                    self.earlyoom_picks(eo)
                await asyncio.sleep(0.005)
            if al is not None:
                high_mb = validate({})["thresholds"]["usage.high"] * BUDGET_MB
                crossed = next((self.t0 + t for t, m in self.samples if m >= high_mb), None)
                first_act = next((t for t, a in self.actions if a in ("suspend", "kill")), None)
                inner = list(al.reactions_ms)
                if first_act is not None and crossed is not None:
                    self.reactions = [max(0.0, (first_act - crossed) * 1000)]
                self.inner = inner
        finally:
            if eo is not None:
                eo.terminate()
                eo.wait()
            if al is not None:
                await al.stop()
            if jm is not None:
                await jm.stop()
            self.tree.purge()
            store.close()
            shutil.rmtree(tmp, ignore_errors=True)  # the run's store, job logs and checkpoints
        return self.result()

    def earlyoom_picks(self, eo: subprocess.Popen[str]) -> None:
        try:
            out = eo.stdout.read() if eo.stdout else None
        except (BlockingIOError, TypeError):
            out = None
        for m in re.finditer(r"sending SIG\w+ to process (\d+)", out or ""):
            pid = int(m.group(1))
            ours = [j for j in self.jobs if j["pid"] == pid]
            if not ours:
                self.foreign += 1
                continue
            try:
                os.kill(pid, signal.SIGTERM)
                self.actions.append((time.monotonic(), "earlyoom kill"))
            except ProcessLookupError:
                pass

    def result(self) -> dict[str, Any]:
        lost = 0.0
        protected_killed = 0
        killed = 0
        for j in self.jobs:
            if j["died"] is None:
                continue
            killed += 1
            ran = j["died"] - j["start"]
            lost += ran - (ran // j["ckpt"]) * j["ckpt"]
            if j["class"] == "long-resident":
                protected_killed += 1
        return {"mode": self.mode, "protected_killed": protected_killed, "killed": killed, "work_lost_s": lost,
                "reactions_ms": self.reactions, "inner_ms": self.inner, "foreign": self.foreign, "samples": self.samples,
                "actions": [(t - self.t0, a) for t, a in self.actions]}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 storms per defender, 5 s each (< 60 s)")
    ap.add_argument("--json", help="write the flat result object here")
    ap.add_argument("--plot", help="write a PNG of memory and actions over time")
    ap.add_argument("--runs", type=int, help="storms per defender (default 2 quick, 5 full)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/airlock.py: needs root (cgroups)", file=sys.stderr)
        return 1
    runs = args.runs or (2 if args.quick else 5)
    duration = 5.0 if args.quick else 10.0
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in ("kernel", "earlyoom", "airlock")}
    for i in range(runs):
        for mode in results:
            results[mode].append(asyncio.run(Storm(mode, duration, seed=1000 + i).run()))
    out: dict[str, Any] = {"budget_mb": BUDGET_MB, "storms_per_defender": runs, "storm_s": duration,
                           "earlyoom_threshold": "MemAvailable at start - usage.high x budget (dry run, kill applied to bench jobs)"}
    for mode, rs in results.items():
        prefix = "" if mode == "airlock" else f"{mode}_"
        out[f"{prefix}protected_killed"] = sum(r["protected_killed"] for r in rs)
        out[f"{mode}_jobs_killed"] = sum(r["killed"] for r in rs)
        out[f"{mode}_work_lost_s"] = round(sum(r["work_lost_s"] for r in rs), 3)
    out["earlyoom_foreign_picks"] = sum(r["foreign"] for r in results["earlyoom"])
    reactions = [x for r in results["airlock"] for x in r["reactions_ms"]]
    out["reaction_p50_ms"] = pct(reactions, 0.5)
    out["reaction_p99_ms"] = pct(reactions, 0.99)
    inner = [x for r in results["airlock"] for x in r["inner_ms"]]
    out["reaction_from_signal_p99_ms"] = pct(inner, 0.99)
    a = out["airlock_work_lost_s"]
    out["work_lost_ratio_vs_earlyoom"] = round(a / out["earlyoom_work_lost_s"], 4) if out["earlyoom_work_lost_s"] else None
    out["work_lost_ratio_vs_kernel"] = round(a / out["kernel_work_lost_s"], 4) if out["kernel_work_lost_s"] else None
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


def plot(results: dict[str, list[dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for ax, (mode, rs) in zip(axes, results.items(), strict=True):
        r = rs[0]
        if r["samples"]:
            t, m = zip(*r["samples"], strict=True)
            ax.plot(t, m, label="jobs' memory (MiB)")
        ax.axhline(BUDGET_MB, color="red", linestyle="--", label="budget")
        ax.axhline(BUDGET_MB * 0.85, color="orange", linestyle=":", label="usage.high")
        colors = {"suspend": "tab:blue", "recover": "tab:green", "kill": "black", "readdress": "tab:purple",
                  "earlyoom kill": "black"}
        for t_, act in r["actions"]:
            ax.axvline(t_, color=colors.get(act, "gray"), alpha=0.5)
        ax.set_title(f"{mode}: killed {r['killed']} (protected {r['protected_killed']}), work lost {r['work_lost_s']:.1f} s")
        ax.set_ylabel("MiB")
        ax.legend(loc="lower right", fontsize=7)
    axes[-1].set_xlabel("seconds since the storm began (vertical lines: actions)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
