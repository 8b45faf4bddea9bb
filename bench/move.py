"""Move downtime on real agents: how long a job with S MiB of state makes no progress when its
node is reclaimed and it moves to another node of the zone.

Two real laminard processes in one zone, each in its own network namespace on a bridge of the
benchmark's own (``tests/cluster/harness.py``, the cluster tests' rig), their state directories
on this machine's disk. The job is this script's ``--role job``: it holds S MiB of random state
(bytes, as a model's weights would be), takes a step every STEP_S and logs it with the wall
clock, and saves its state through jobkit when the agent asks (the reclaim's final
checkpoint); resumed elsewhere, it logs when its process started and when its state was
loaded. The benchmark reclaims node A with a notice window of NOTICE_S plus 10 s per GiB
(more than the move needs) and reads the job's logs on both nodes (the nodes share this machine's clock):

- ``downtime_s``: the final checkpoint saved on A to the job's first step on B (the time it
  makes no progress it keeps: steps on A after that checkpoint are lost, ``lost_steps``, as
  the agent freezes the job once it saw the checkpoint);
- ``ckpt_s``: the reclaim's request to the final checkpoint saved on A (signal, save, fsync;
  not downtime: the job trains on meanwhile);
- ``move_s``: that checkpoint saved to the job's process started on B (the agent's check,
  transfer, commit, keeper and hand-over);
- ``start_s``: the process started to its state loaded (``import torch``, as a training
  job's, where it is installed, and jobkit's check of what it loads included); split into
  ``start_cpu_s``, the job's main thread on a CPU, and ``start_runq_s``, the same thread
  runnable but waiting for a CPU (Linux schedstat; what is left of ``start_s`` it was blocked),
  beside ``start_agents_cpu_s``, the CPU both agents used meanwhile (sampled every 50 ms): on
  this 2-core machine ``start_runq_s`` is other processes' load, and it swings by seconds;
- the rest is the first step.

Compared in the same run, interleaved, with ``--baseline-tree PATH`` (an ``agent/`` directory
of another revision: the agents import it first, through PYTHONPATH): the same keys prefixed
``base_`` and ``speedup_vs_base`` (baseline downtime / this tree's, at the largest size).

    python bench/move.py [--quick] [--json PATH] [--plot PATH] [--sizes-mib 64,256] [--runs N]
                         [--baseline-tree PATH]

``--quick``: 64 and 256 MiB, one run each; else 64, 256 and 1024 MiB, 3 runs each (medians).
Needs root (namespaces, cgroups). Keys per size S: ``downtime_s_<S>``, ``ckpt_s_<S>``,
``move_s_<S>``, ``start_s_<S>`` (and its ``start_cpu_s_<S>``, ``start_runq_s_<S>``,
``start_agents_cpu_s_<S>``), ``lost_steps_<S>``; and ``downtime_s`` (the largest size).
"""

from __future__ import annotations

import time

T_EXEC = time.time()  # the job's process started (--role job): before its imports


def _sched() -> tuple[float, float] | None:
    """This thread's seconds on a CPU and runnable waiting for one, since it started (Linux
    ``/proc/thread-self/schedstat``); None where the kernel does not keep them."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, runq = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(runq) / 1e9
    except (OSError, ValueError):
        return None


SCHED_EXEC = _sched()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEP_S = 0.02
NOTICE_S = 20  # and 10 s more per GiB of state: room for the move (the plan asks for the checkpoint late)


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _role_job(mib: int) -> int:
    sys.path.insert(0, str(REPO / "agent"))
    try:  # what a training job imports before it resumes (2-3 s here): part of its start
        import torch  # noqa: F401
    except ImportError:
        pass
    from laminar import jobkit

    ck = jobkit.Checkpointer()
    state = ck.resume()
    loaded = time.time()
    sched = _sched()
    cpu_s, runq_s = ((sched[0] - SCHED_EXEC[0], sched[1] - SCHED_EXEC[1]) if sched and SCHED_EXEC else (None, None))
    resumed = state is not None
    if state is None:
        state = os.urandom(mib << 20)
    say(event="start", resumed=resumed, t_exec=T_EXEC, t_loaded=loaded, bytes=len(state), cpu_s=cpu_s, runq_s=runq_s)
    step = 0
    while True:
        time.sleep(STEP_S)
        step += 1
        say(event="step", step=step, t=time.time())
        if ck.requested():
            ck.save(state, step=step)
            say(event="checkpoint", step=step, t=time.time())


# --------------------------------------------------------------------------- the driver


def _proc_cpu(pid: int) -> float:
    """A process's own CPU seconds, all its threads (``/proc/PID/stat``: not its reaped children's,
    where a job the agent ended would land); 0 once it is gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class _AgentsCpu:
    """The CPU both agents have used, sampled every 50 ms in a thread (two reads of ``/proc``:
    next to nothing on the machine it measures)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples = [(time.time(), sum(_proc_cpu(p) for p in pids))]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), sum(_proc_cpu(p) for p in self.pids)))
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> float:
        """CPU seconds used from about ``t0`` to about ``t1`` (the samples nearest them)."""
        def at(t: float) -> float:
            return min(self.samples, key=lambda s: abs(s[0] - t))[1]

        return at(t1) - at(t0)


def _one(tmp: Path, mib: int, tree: Path | None) -> dict[str, float]:
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "cluster")]
    from harness import Cluster, parse_events, wait_until

    def _events(p: Path) -> list[dict[str, Any]]:
        return parse_events(p.read_text()) if p.exists() else []

    old = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = str(tree)  # the agents import this tree's laminar first
    try:
        extra = '\n[migrate]\nprestage = "off"\npoll_s = 0.2\n'
        with Cluster.create(tmp, zones=1, per_zone=2, gpus=0, cpus=4, memory_mb=8000, zone_extra=extra) as c:
            a, b = c.nodes
            assert a.agent.proc is not None and b.agent.proc is not None
            agents = _AgentsCpu([a.agent.proc.pid, b.agent.proc.pid])
            job = json.loads(a.ctl("-o", "json", "submit", "--name", "mover", "--", sys.executable,
                                   str(Path(__file__).resolve()), "--role", "job", "--mib", str(mib)).stdout)
            jid = job["id"]
            log_a = a.agent.state_dir / "logs" / f"{jid}.log"
            wait_until(lambda: sum(e["event"] == "step" for e in _events(log_a)) >= 5, 120, "the job to step on node A")
            t_req = time.time()
            notice = NOTICE_S + 10 * mib // 1024
            a.ctl("-o", "json", "reclaim", "--notice", f"{notice}s", "--reason", "bench/move.py")

            def moved() -> Any:
                for m in a.json("migrations"):
                    if m.get("job") == jid and m.get("phase") == "done":
                        return m
                return None

            move = wait_until(moved, 300, "the move to finish")
            log_b = b.agent.state_dir / "logs" / f"{move['dest_job']}.log"
            wait_until(lambda: any(e["event"] == "step" for e in _events(log_b)), 120, "the job to step on node B")
            on_a, on_b = _events(log_a), _events(log_b)
            agents.stop()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    saved = [e for e in on_a if e["event"] == "checkpoint"]
    start_b = [e for e in on_b if e["event"] == "start"][0]
    first_b = min(e["t"] for e in on_b if e["event"] == "step")
    if not saved or not start_b["resumed"]:
        raise SystemExit(f"move: the job did not checkpoint and resume ({saved[-1:]}, {start_b})")
    ck = saved[-1]
    return {"downtime_s": first_b - ck["t"], "ckpt_s": ck["t"] - t_req, "move_s": start_b["t_exec"] - ck["t"],
            "start_s": start_b["t_loaded"] - start_b["t_exec"],
            **({"start_cpu_s": start_b["cpu_s"], "start_runq_s": start_b["runq_s"]}
               if start_b.get("cpu_s") is not None else {}),
            "start_agents_cpu_s": agents.between(start_b["t_exec"], start_b["t_loaded"]),
            "lost_steps": sum(e["event"] == "step" and e["step"] > ck["step"] for e in on_a)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--sizes-mib")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--baseline-tree", type=Path)
    ap.add_argument("--role", choices=["job"], help=argparse.SUPPRESS)
    ap.add_argument("--mib", type=int, default=64, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "job":
        return _role_job(a.mib)
    if os.geteuid() != 0:
        raise SystemExit("move: needs root (network namespaces, cgroups)")

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # the cluster's cleanup runs (agents, namespaces, bridge, cgroups)

    signal.signal(signal.SIGTERM, interrupted)
    sizes = [int(x) for x in a.sizes_mib.split(",")] if a.sizes_mib else ([64, 256] if a.quick else [64, 256, 1024])
    runs = a.runs or (1 if a.quick else 3)
    if any(s <= 0 for s in sizes) or runs <= 0:
        raise SystemExit(f"move: sizes {sizes} and runs {runs} must be positive")
    trees: list[tuple[str, Path | None]] = [("", None)]
    if a.baseline_tree:
        if not (a.baseline_tree / "laminar" / "agent.py").is_file():
            raise SystemExit(f"move: --baseline-tree {a.baseline_tree} is not an agent/ directory (no laminar/agent.py)")
        trees.append(("base_", a.baseline_tree.resolve()))
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="lm-bench-move-") as tmp:
        for mib in sizes:
            for i in range(runs):
                for prefix, tree in trees:  # interleaved: drift on a shared machine hits both alike
                    r = _one(Path(tmp) / f"{prefix or 'this'}-{mib}-{i}", mib, tree)
                    rows.setdefault((prefix, mib), []).append(r)
                    print(f"{mib} MiB run {i} {prefix or 'this'}: {json.dumps({k: round(v, 3) for k, v in r.items()})}",
                          file=sys.stderr, flush=True)
    res: dict[str, Any] = {"sizes_mib": ",".join(map(str, sizes)), "runs": runs, "step_s": STEP_S,
                           "load_1m": round(os.getloadavg()[0], 2)}
    for (prefix, mib), rs in rows.items():
        for k in rs[0]:
            if all(k in r for r in rs):
                res[f"{prefix}{k}_{mib}"] = round(statistics.median(r[k] for r in rs), 3)
    for prefix, _ in trees:
        res[f"{prefix}downtime_s"] = res[f"{prefix}downtime_s_{sizes[-1]}"]
    if a.baseline_tree:
        res["speedup_vs_base"] = round(res["base_downtime_s"] / res["downtime_s"], 2)
    out = json.dumps(res, indent=1)
    print(out)
    if a.json:
        Path(a.json).write_text(out + "\n")
    if a.plot:
        _plot(res, sizes, [p for p, _ in trees], a.plot)
    return 0


def _plot(res: dict[str, Any], sizes: list[int], prefixes: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("move_s", "check, transfer, commit, hand-over"), ("start_s", "process start and load")]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, x = [], 0
    for mib in sizes:
        for prefix in prefixes:
            bottom = 0.0
            for i, (k, what) in enumerate(parts):
                v = res[f"{prefix}{k}_{mib}"]
                ax.bar(x, v, bottom=bottom, color=f"C{i}", label=what if x == 0 else None)
                bottom += v
            ax.plot([x - 0.4, x + 0.4], [res[f"{prefix}downtime_s_{mib}"]] * 2, color="k")
            labels.append(f"{mib} MiB\n{'baseline' if prefix else 'this'}")
            x += 1
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("seconds (black line: the job's downtime)")
    ax.set_title("A reclaimed job's move between two real agents")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
