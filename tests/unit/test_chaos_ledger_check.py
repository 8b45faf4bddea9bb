"""bench/chaos.py's verdict over its ledger (``check``): what it calls a double run, a wrong
result and an unfinished job, on ledgers written by hand (the soak itself needs root and
minutes: docs/migration.md, *Soak*)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lm_bench_chaos", REPO / "bench" / "chaos.py")
assert _spec is not None and _spec.loader is not None
chaos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos)

STEPS = 4


def ledger(tmp: Path, rows: list[dict[str, Any]]) -> Path:
    p = tmp / "ledger.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def run(name: str, pid: int, start: int, end: int, done: bool = True, h: str | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"n": name, "pid": pid, "ev": "start", "s": start}]
    rows += [{"n": name, "pid": pid, "ev": "step", "s": s} for s in range(start + 1, end + 1)]
    if done:
        rows.append({"n": name, "pid": pid, "ev": "done", "s": end, "h": h or chaos.chain(STEPS)})
    return rows


def test_a_job_moved_once_and_rolled_back_is_clean_and_counts_its_redone_steps(tmp_path: Path) -> None:
    # pid 1 steps to 3 and stops; pid 2 resumes from the checkpoint at 2 and ends
    rows = run("a", 1, 0, 3, done=False) + run("a", 2, 2, STEPS) + run("b", 3, 0, STEPS)
    r = chaos.check(ledger(tmp_path, rows), ["a", "b"], STEPS)
    assert r["double_runs"] == [] and r["wrong_results"] == [] and r["unfinished"] == []
    assert r["steps_run"] == 9 and r["redone_steps_pct"] == 12.5  # step 3 of "a" twice: 1 of 8


def test_two_processes_stepping_at_once_a_step_after_the_end_and_a_bad_hash_are_caught(tmp_path: Path) -> None:
    a1, a2 = run("a", 1, 0, 2, done=False), run("a", 2, 0, STEPS)
    interleaved = a1[:2] + a2[:2] + a1[2:] + a2[2:]  # pid 1 steps while pid 2 runs
    late = [{"n": "a", "pid": 1, "ev": "step", "s": 3}]
    bad = run("b", 3, 0, STEPS, h="00" * 32)
    r = chaos.check(ledger(tmp_path, interleaved + late + bad), ["a", "b", "c"], STEPS)
    assert any("pids 2 and 1 step at once" in d for d in r["double_runs"]), r["double_runs"]
    assert any("after its end" in d for d in r["double_runs"]), r["double_runs"]
    assert len(r["wrong_results"]) == 1 and r["wrong_results"][0].startswith("b: hash 000000")
    assert r["unfinished"] == ["c"]


def timed(rows: list[dict[str, Any]], t0: float, dt: float = 1.0) -> list[dict[str, Any]]:
    return [{**r, "t": t0 + i * dt} for i, r in enumerate(rows)]


def test_two_copies_inside_a_long_partitions_window_are_split_runs_and_outside_it_double_runs(tmp_path: Path) -> None:
    """A long partition (``--long-partitions``): the node's copy (pid 1) runs on while the keeper's
    (pid 2) resumes; pid 1 stops after the heal. Inside the window that is a split run, not a
    failure; the same overlap outside it, or a copy that steps on after it, is a double run."""
    a1, a2 = run("a", 1, 0, 2, done=False), run("a", 2, 0, STEPS)
    rows = timed(a1[:2] + a2[:2] + a1[2:] + a2[2:], 100.0)  # pid 1 steps at 100..102 beside pid 2
    r = chaos.check(ledger(tmp_path, rows), ["a"], STEPS, windows=[(99.0, 110.0)])
    assert r["double_runs"] == [] and r["split_runs"] >= 1, r
    r = chaos.check(ledger(tmp_path, rows), ["a"], STEPS, windows=[(50.0, 60.0)])
    assert any("step at once" in d for d in r["double_runs"]) and r["split_runs"] == 0, r
    # pid 2 resumed inside the window, pid 1 still steps long after it ended: a double run
    late = [{"n": "a", "pid": 1, "ev": "step", "s": 3, "t": 200.0}, {"n": "a", "pid": 2, "ev": "step", "s": 4, "t": 201.0}]
    r = chaos.check(ledger(tmp_path, timed(a1[:2] + a2[:2], 100.0) + late), ["a"], STEPS, windows=[(99.0, 110.0)])
    assert any("step at once" in d for d in r["double_runs"]), r
