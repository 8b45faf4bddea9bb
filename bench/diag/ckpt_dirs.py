"""Benchmark: what a job's flooded checkpoint directory costs the agent's event loop, before and after.

A job writes ``--entries`` ``ckpt-N`` directories into its checkpoint directory (what any job's
owner may do). Measured here, on this machine, in this process:

- ``listing_before_s``: one listing as the agent made it on its event loop until 2026-12
  (``jobkit.list_checkpoints`` at 6a85e53: ``iterdir`` + ``is_symlink()`` + ``is_dir()`` of every
  entry, then a sort; copied below as ``old_list``). The checkpoint driver did it several times
  per job every ``poll_s`` (0.5 s), the prestage rule once per job per job (O(n^2));
- ``scan_after_s`` / ``scan_unchanged_after_s``: the scanner's look (laminar.runtime.ckpt_scan,
  in a thread of its own, never on the loop): a first scan (at most 4096 entries read), and one
  of the unchanged directory (one fstat);
- ``airlock_tick_before_s``: Airlock's per-tick cost for ``--jobs`` such jobs as it was
  (``Job.last_checkpoint``: up to 1024 lstat per job per 50 ms tick; copied as ``old_last``);
  after, a tick reads one attribute per job (``airlock_tick_after_s``).

    python bench/diag/ckpt_dirs.py [--entries 200000] [--jobs 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "agent"))

from laminar.runtime import ckpt_scan  # noqa: E402

_NAME = re.compile(r"^ckpt-\d+$")
CKPT_SCAN_MAX_BEFORE = 1024


def old_list(d: Path) -> list[Path]:
    """jobkit.list_checkpoints as of 6a85e53 (on the agent's event loop)."""
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name) and not p.is_symlink() and p.is_dir()),
                  key=lambda p: int(p.name[5:]))


def old_last(d: Path) -> float | None:
    """Job.last_checkpoint as of 6a85e53 (Airlock's tick, per job)."""
    top = os.lstat(d)
    if not stat.S_ISDIR(top.st_mode):
        return None
    newest = None
    with os.scandir(d) as entries:
        for n, entry in enumerate(entries):
            if n >= CKPT_SCAN_MAX_BEFORE:
                newest = max(newest or 0.0, top.st_mtime)
                break
            m = entry.stat(follow_symlinks=False).st_mtime
            newest = m if newest is None else max(newest, m)
    return newest


def best(fn, reps: int = 3) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--jobs", type=int, default=256)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lm-bench-ckdir-"))
    try:
        d = root / "job-1"
        d.mkdir()
        for n in range(a.entries):
            os.mkdir(d / f"ckpt-{n}")
        before = best(lambda: old_list(d))
        first = best(lambda: ckpt_scan.scan_dir(d))
        got = ckpt_scan.scan_dir(d)
        # an unchanged directory: its mtime put an hour back, so the listing is trusted (not racy)
        t = time.time() - 3600
        os.utime(d, (t, t))
        prev = ckpt_scan.scan_dir(d)
        unchanged = best(lambda: ckpt_scan.scan_dir(d, prev))
        tick_before = best(lambda: [old_last(d) for _ in range(a.jobs)], reps=2)

        class J:
            ckpt_seen = 1.0

        jobs = [J() for _ in range(a.jobs)]
        tick_after = best(lambda: [j.ckpt_seen for j in jobs])
        out = {"entries": a.entries, "jobs": a.jobs, "listing_before_s": round(before, 4),
               "scan_after_s": round(first, 4), "scan_entries_read": got.entries if got else None,
               "scan_unchanged_after_s": round(unchanged, 6), "airlock_tick_before_s": round(tick_before, 4),
               "airlock_tick_after_s": round(tick_after, 6), "airlock_tick_s": 0.05}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
