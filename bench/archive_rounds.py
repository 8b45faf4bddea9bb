"""What the archive's periodic rounds cost a node in the steady state: the CPU the agent spends,
round after round, on one running job whose newest checkpoint (S MiB) is already in the archive.

With ``migrate.archive_dir`` set and departures without notice plausible (the learned share at
least ``prestage_unannounced``: the rule that prestages), the agent's watch runs an archive round
every ``poll_s`` (0.5 s) that copies each running job's newest checkpoint into the archive when
it is new. Until 2026-11-24 each round found that checkpoint with ``jobkit.latest_checkpoint``,
a whole read and hash of it, copied or not; it now takes the checkpoint driver's answer for the
job's listing.

Measured in-process, in a child process per tree and size: the real ReclaimComponent, its
archive lane and its CkptDriver, a real jobkit checkpoint of S MiB of random bytes and a real
archive directory, both under a temporary directory on this machine's disk (the page cache
holds them: the CPU is the hashes'; a checkpoint larger than the page cache would also be read
from the disk every round). Stand-ins, named as such: the agent (a namespace holding the job
list, the store and the zone id) and its watch loop (a plain loop: one round, then ``poll_s``).
The first copy into the archive is made before the measured span and not counted.

    python bench/archive_rounds.py [--quick] [--json PATH] [--plot PATH] [--sizes-mib 64,512]
                                   [--seconds N] [--baseline-tree PATH]

``--quick``: 64 and 256 MiB, 8 s each; else 64, 512 and 1024 MiB, 30 s each.
``--baseline-tree``: an ``agent/`` directory of another revision, measured the same way
(``base_`` keys). Keys per size S: ``cpu_pct_<S>`` (CPU seconds / wall seconds, % of one core),
``rounds_<S>``, ``reads_<S>`` (whole-checkpoint hashes of the job's checkpoint in the span);
``cpu_pct`` (the largest size) and, with a baseline, ``cpu_ratio_base_vs_this``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def measure(size_mib: int, seconds: float) -> dict[str, Any]:
    """One measurement in this process (``--role measure``): the tree on ``sys.path`` first."""
    import asyncio
    import resource
    import secrets
    import shutil
    import time
    from types import SimpleNamespace

    from laminar import jobkit
    from laminar.migrate.ckpt_driver import CkptDriver
    from laminar.migrate.reclaim import ReclaimComponent
    from laminar.migrate.schema import REPLICAS_SCHEMA
    from laminar.runtime.spec import JobSpec
    from laminar.store import Store
    from laminar.zone.keys import parse_keys

    tmp = Path(tempfile.mkdtemp(prefix="lm-bench-archive-"))
    try:
        ck = jobkit.Checkpointer(job_id="bench", ckpt_dir=tmp / "ck", install_signal=False).save(
            os.urandom(size_mib << 20), step=1)
        job = SimpleNamespace(id="job-1", ckpt_dir=ck.parent, active=True, state="running",
                              spec=JobSpec(["train"]), owner_uid=0, owner_gid=0, gpus=[])
        (tmp / "state").mkdir()
        store = Store(tmp / "state" / "state.db")
        with store.tx() as db:
            for stmt in REPLICAS_SCHEMA:
                db.execute(stmt)
        c = ReclaimComponent()
        # the zone's key signs the archive's records (archive_auth): a key of this run's own
        keys = parse_keys(f"1 {secrets.token_hex(32)}\n", "bench keys")
        c.agent = SimpleNamespace(  # stand-in for the agent
            zone=SimpleNamespace(node_id=2, zone=1, keys=keys, pairs=None, networked=False), store=store,
            jobs=SimpleNamespace(active=lambda: [job], get=lambda jid: job if jid == job.id else None,
                                 list=lambda: [job]),
            config=SimpleNamespace(state_dir=str(tmp / "state")))
        c.s = {"archive_dir": str(tmp / "archive"), "prestage_unannounced": 0.0, "prestage": "off",
               "archive_gc_s": 3600.0, "retry_max_s": 1.0, "poll_s": 0.5}
        c.reclaim = None
        c._emit = lambda message, **fields: None  # type: ignore[method-assign]
        c.ckpt = CkptDriver(c)
        c.ckpt.threaded = True  # as its loop runs it: the rounds wait for its check
        reads = [0]
        verify = jobkit.verify_checkpoint

        def counted(p: Any, **kw: Any) -> Any:
            if Path(p) == ck and not kw.get("hashed"):
                reads[0] += 1
            return verify(p, **kw)

        jobkit.verify_checkpoint = counted  # type: ignore[assignment]

        def cpu() -> float:
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime

        async def main() -> dict[str, Any]:
            await c.ckpt.verify_new()  # the driver's check (the old tree's: jobkit's)
            while c.archive.periodic.live.get(job.id) != ck.name:  # the first copy: not counted
                c.archive.round_running = True
                await c.archive.run_round()
                await asyncio.sleep(0.05)
            t0, w0, rounds, reads[0] = cpu(), time.monotonic(), 0, 0
            while time.monotonic() - w0 < seconds:
                c.archive.round_running = True
                await c.archive.run_round()
                rounds += 1
                await asyncio.sleep(float(c.s["poll_s"]))
            wall = time.monotonic() - w0
            return {"cpu_pct": round(100 * (cpu() - t0) / wall, 2), "rounds": rounds, "reads": reads[0]}

        try:
            return asyncio.run(main())
        finally:
            c.archive.lane.close()
            store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_child(tree: Path, size: int, seconds: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, __file__, "--role", "measure", "--size", str(size),
                          "--seconds", str(seconds)], env=env, capture_output=True, text=True, timeout=seconds + 600)
    if out.returncode != 0:
        raise SystemExit(f"measurement of {size} MiB under {tree} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--sizes-mib")
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--baseline-tree")
    ap.add_argument("--role", default="main", choices=["main", "measure"])
    ap.add_argument("--size", type=int)
    a = ap.parse_args()
    if a.role == "measure":
        print(json.dumps(measure(int(a.size), float(a.seconds))))
        return 0
    sizes = [int(x) for x in a.sizes_mib.split(",")] if a.sizes_mib else ([64, 256] if a.quick else [64, 512, 1024])
    seconds = a.seconds or (8.0 if a.quick else 30.0)
    trees = [("", REPO / "agent")] + ([("base_", Path(a.baseline_tree).resolve())] if a.baseline_tree else [])
    res: dict[str, Any] = {"seconds": seconds}
    for s in sizes:
        for prefix, tree in trees:
            r = run_child(tree, s, seconds)
            for k, v in r.items():
                res[f"{prefix}{k}_{s}"] = v
            print(f"{prefix or 'this '}{s} MiB: {r['cpu_pct']} % of a core, {r['rounds']} rounds, "
                  f"{r['reads']} whole reads of the checkpoint", flush=True)
    top = sizes[-1]
    res["cpu_pct"] = res[f"cpu_pct_{top}"]
    if a.baseline_tree:
        res["base_cpu_pct"] = res[f"base_cpu_pct_{top}"]
        res["cpu_ratio_base_vs_this"] = round(res["base_cpu_pct"] / max(res["cpu_pct"], 0.01), 1)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        w = 0.38
        xs = range(len(sizes))
        ax.bar([x - w / 2 for x in xs], [res[f"cpu_pct_{s}"] for s in sizes], w, label="this tree")
        if a.baseline_tree:
            ax.bar([x + w / 2 for x in xs], [res[f"base_cpu_pct_{s}"] for s in sizes], w, label="baseline tree")
        ax.set_xticks(list(xs), [f"{s} MiB" for s in sizes])
        ax.set_ylabel("agent CPU, % of one core")
        ax.set_title("Archive rounds, one running job, checkpoint already archived")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
