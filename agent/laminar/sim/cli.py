"""``laminarctl sim``: run the simulator locally (no agent needed).

    laminarctl sim --trace PATH --policy NAME [--seed N] [--nodes PATH] [-o json]

``--trace`` is one of: an ``openb_pod_list_*.csv`` (nodes from ``--nodes``, by default the
``openb_node_list_gpu_node.csv`` beside it), a Pollux ``workload-N.csv`` (a 16 x 4-GPU
training pool), or a directory holding ``openb_pod_list_default.csv``. The openb pod list is a
snapshot, not a load, so its jobs are re-timed to ``--load`` of the training pool
(:func:`laminar.sim.trace.rescale_arrivals`). An inference pool of the same size as the
training pool, with a diurnal load, is added unless ``--inference-nodes 0``. Exit codes: 0 ok,
2 bad input (the message names the file, line and problem).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from laminar.sim.engine import POLICIES, SimConfig, SimResult, simulate
from laminar.sim.trace import (
    JobSpec,
    NodeSpec,
    TraceError,
    check_fit,
    default_data_dir,
    read_openb_nodes,
    read_openb_pods,
    read_pollux_workload,
    rescale_arrivals,
    with_elasticity,
)


def build_scenario(
    trace: Path,
    nodes_path: Path | None = None,
    load: float = 0.9,
    inference_nodes: int | None = None,
    elastic_fraction: float = 0.5,
    seed: int = 0,
    max_jobs: int | None = None,
    span_s: float = 7 * 86_400.0,
    max_duration_s: float = 172_800.0,
) -> tuple[list[JobSpec], list[NodeSpec]]:
    """Jobs and nodes (training pool + inference pool) for a trace path; see the module docs.

    openb: the jobs' arrivals are re-timed to a Poisson process over ``span_s`` (their trace
    order kept), and the training pool is every k-th GPU node of the node list, k chosen so
    the jobs offer ``load`` of the pool's GPUs over the span (from the first node, or the
    first offset whose sample can host every job); the inference pool is 8-GPU
    servers with as many GPUs.
    Pods still running at the snapshot's end carry the snapshot's end as their deletion time,
    so their durations are censored, not measured: durations are capped at ``max_duration_s``.
    """
    if not (math.isfinite(load) and load > 0):
        raise ValueError(f"--load {load:g} must be a finite number > 0 (1.0 offers the pool's capacity)")
    if max_jobs is not None and max_jobs < 1:
        raise ValueError(f"--max-jobs {max_jobs} must be >= 1")
    if inference_nodes is not None and inference_nodes < 0:
        raise ValueError(f"--inference-nodes {inference_nodes} must be >= 0")
    if not 0 <= elastic_fraction <= 1:  # also false for NaN
        raise ValueError(f"--elastic-fraction {elastic_fraction:g} must be in 0..1")
    if trace.is_dir():
        trace = trace / "openb_pod_list_default.csv"
    if trace.name.startswith("workload-"):
        jobs = read_pollux_workload(trace)
        training = [NodeSpec(f"train-{i:02d}", 4, 64.0, 262_144, "V100", "training") for i in range(16)]
        n_inf = 16 if inference_nodes is None else inference_nodes
        inference = [NodeSpec(f"infer-{i:02d}", 4, 64.0, 262_144, "V100", "inference") for i in range(n_inf)]
    else:
        pods = read_openb_pods(trace)
        npath = nodes_path or trace.parent / "openb_node_list_gpu_node.csv"
        all_nodes = read_openb_nodes(npath)
        jobs = [replace(p, duration=min(p.duration, max_duration_s)) for p in pods if p.scheduled and p.duration > 0]
        if not jobs:
            raise TraceError(trace, None, "no scheduled job with a run time above 0 (scheduled_time set, "
                             "deletion_time after it); a timed run needs one")
        check_fit(jobs, all_nodes, npath)
        if max_jobs is not None:
            jobs = jobs[:max_jobs]
        # Size the training pool so the jobs, spread over span_s, offer `load` of it.
        work = sum(max(j.gpus, 0.01) * j.duration for j in jobs)
        target = work / (span_s * load)
        step = max(1, round(sum(n.gpus for n in all_nodes) / target))
        # every step-th node, from the first offset whose sample can host every job (a small
        # pool may miss the few nodes the largest pods need)
        # (offsets past the list's end give empty samples: only the first len(all_nodes) count)
        first: TraceError | None = None
        for offset in range(min(step, len(all_nodes))):
            training = all_nodes[offset::step]
            try:
                check_fit(jobs, training, f"{npath.name} (1 node in {step})")
                first = None
                break
            except TraceError as e:
                first = first or e
        if first is not None:
            raise TraceError(npath, None, f"training pool (1 node in {step}): {first.problem}; no sample of that "
                             f"size (for --load {load:g}) hosts every job: lower --load or give a larger node list")
        gpus = sum(n.gpus for n in training)
        jobs = rescale_arrivals(jobs, work / span_s, 1.0, seed)
        n_inf = max(1, gpus // 8) if inference_nodes is None else inference_nodes
        inference = [NodeSpec(f"infer-{i:04d}", 8, 96.0, 786_432, "G2", "inference") for i in range(n_inf)]
    if max_jobs is not None:
        jobs = sorted(jobs, key=lambda j: j.arrival)[:max_jobs]
    jobs = with_elasticity(jobs, elastic_fraction, 2, seed)
    if nodes_path is not None and trace.name.startswith("workload-"):
        training = read_openb_nodes(nodes_path)
    # The training pool is what every policy may use (noloan never borrows the inference
    # servers): a job it cannot hold would never run there, and the policies' means would
    # cover different jobs.
    check_fit(jobs, training, nodes_path if nodes_path is not None else "training pool")
    check_fit(jobs, training + inference, "cluster")
    return jobs, training + inference


def add_parser(subparsers: Any, parents: list[argparse.ArgumentParser] | None = None) -> argparse.ArgumentParser:
    """Add the ``sim`` subcommand to an argparse ``subparsers``; returns its parser.

    ``parents`` (laminarctl's common options) must provide ``-o/--output`` when given.
    """
    p = subparsers.add_parser("sim", help="run the trace-driven simulator locally", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter, parents=parents or [])
    p.add_argument("--trace", type=Path, default=default_data_dir(), help="trace file or data directory")
    p.add_argument("--nodes", type=Path, default=None, help="node list (openb_node_list_*.csv)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="laminar")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", type=float, default=0.9, help="offered load on the training pool (openb)")
    p.add_argument("--inference-nodes", type=int, default=None, help="inference servers (default: as training)")
    p.add_argument("--elastic-fraction", type=float, default=0.5)
    p.add_argument("--max-jobs", type=int, default=None)
    p.add_argument("--ckpt-gb-per-gpu", type=float, default=SimConfig.ckpt_gb_per_gpu,
                   help="checkpoint size per GPU a worker holds, GB (an assumption; 0 with --ckpt-pause-s 0: free checkpoints)")
    p.add_argument("--ckpt-pause-s", type=float, default=SimConfig.ckpt_pause_s,
                   help="fixed cost of one checkpoint, seconds (the agent's migrate.ckpt_pause_s)")
    p.add_argument("--progress", action="store_true", help="progress lines on stderr")
    if not parents:
        p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the ``sim`` subcommand; returns the exit code."""
    try:
        jobs, nodes = build_scenario(
            args.trace, args.nodes, args.load, args.inference_nodes, args.elastic_fraction, args.seed, args.max_jobs
        )
        for opt, v in (("--ckpt-gb-per-gpu", args.ckpt_gb_per_gpu), ("--ckpt-pause-s", args.ckpt_pause_s)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{opt} {v:g} must be a finite number >= 0 (0 for both: checkpoints cost nothing)")
        cfg = replace(SimConfig(), seed=args.seed, progress=args.progress, ckpt_gb_per_gpu=args.ckpt_gb_per_gpu,
                      ckpt_pause_s=args.ckpt_pause_s)
    except (TraceError, ValueError) as e:
        print(f"laminarctl sim: {e}", file=sys.stderr)
        return 2
    res = simulate(jobs, nodes, args.policy, cfg)
    emit(res, getattr(args, "output", "table"))
    if res.completed < res.jobs:
        print(f"laminarctl sim: warning: {res.jobs - res.completed} of {res.jobs} jobs never finished "
              "(nothing could run them); the means cover the finished jobs only", file=sys.stderr)
    return 0


def emit(res: SimResult, fmt: str) -> None:
    s = res.summary()
    if fmt == "json":
        print(json.dumps(s, indent=2))
        return
    width = max(len(k) for k in s)
    for k, v in s.items():
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m laminar.sim.cli --trace ...``."""
    ap = argparse.ArgumentParser(prog="laminar-sim")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = ap.parse_args(["sim", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
