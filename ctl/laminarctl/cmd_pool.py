"""Pools: capacity loaning between the inference and training pools (laminar.zone.loan).

    laminarctl pool                                    # this node's pool, load, lent jobs, requeues
    laminarctl pool load 0.2                           # serving load 0..1 (below idle_below: loanable)
    laminarctl pool return --pool inference --count 1  # take the 1 loaned server of least preemption cost back

``pool return`` (``pool reclaim`` before 2026-12-06, still accepted for one release) asks
every server of the pool in this zone for its lent jobs, returns the ``count`` servers whose return stops the least work (GPU-seconds since each job's checkpoint),
and prints the plan: servers, cost, and what happens to each job. Servers that refused (another
return took them at the same time) are replaced by the next cheapest. Exit code 0 when the
plan was carried out for ``count`` servers, 1 when it could not be made (too few loaned servers
answered) or fell short (fewer servers were left than asked: the answer's ``short``), 2 for bad
input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .client import EXIT_FAILED, EXIT_USAGE, CtlError
from .output import emit, info, kv, table

ACTION_COLUMNS = [("node", "NODE"), ("job", "JOB"), ("action", "ACTION"), ("workers_removed", "WORKERS")]
JOB_COLUMNS = [("id", "JOB"), ("name", "NAME"), ("workers", "WORKERS"), ("gpw", "GPU/WORKER"), ("weight", "WEIGHT")]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    pool = sub.add_parser("pool", parents=[common], help="capacity loaning: serving load, pool return")
    pool.set_defaults(func=cmd_show)
    psub = pool.add_subparsers(dest="pool_cmd", metavar="SUBCOMMAND")
    p = psub.add_parser("show", parents=[common], help="this node's pool, load and lent jobs")
    p.set_defaults(func=cmd_show)
    p = psub.add_parser("load", parents=[common], help="set this node's serving load (0..1)")
    p.add_argument("load", type=float, help="share of serving capacity in use, 0..1")
    p.set_defaults(func=cmd_load)
    p = psub.add_parser("return", aliases=["reclaim"], parents=[common],
                        help="take loaned servers of a pool back, least preemption first (old name: reclaim)")
    p.add_argument("--pool", default="inference", help="the pool (default: inference)")
    p.add_argument("--count", type=int, default=1, help="how many servers (default 1)")
    p.set_defaults(func=cmd_return)


def cmd_show(args: argparse.Namespace) -> int:
    st = args.client.get("/v1/pool")

    def human(s: dict[str, Any]) -> None:
        kv({k: s[k] for k in ("node", "pool", "load", "idle_below", "loanable", "returned", "free_gpus")}, title="pool")
        table(s["jobs"], JOB_COLUMNS, title="lent jobs")
        if s["requeues"]:
            table(s["requeues"], ["job", "phase", "planned", "node", "new_job", "reason"], title="requeues")

    emit(st, args.output, human)
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    if not 0.0 <= args.load <= 1.0:
        raise CtlError(f"pool load {args.load}: expected a number in 0..1", EXIT_USAGE)
    st = args.client.post("/v1/pool/load", {"load": args.load})
    emit(st, args.output, lambda s: info(f"node {s['node']} load {s['load']:g}: "
                                         f"{'loanable' if s['loanable'] else 'not loanable'}"))
    return 0


def old_name(old: str) -> None:
    """Says on stderr that ``old`` is the name of ``pool return`` before 2026-12-06."""
    print(f"laminarctl: `{old}` is now `pool return`; the old name goes in the next release", file=sys.stderr)


def cmd_return(args: argparse.Namespace) -> int:
    if getattr(args, "pool_cmd", None) == "reclaim":
        old_name("pool reclaim")
    if args.count < 1:
        raise CtlError(f"--count {args.count}: expected a number of servers >= 1", EXIT_USAGE)
    res = args.client.post("/v1/pool/return", {"pool": args.pool, "count": args.count}, timeout=60.0)

    def human(r: dict[str, Any]) -> None:
        info(f"plan {r['plan']}: returning node(s) {', '.join(map(str, r['servers']))} of pool {r['pool']}, "
             f"preemption cost {r['cost']:g}")
        table(r["actions"], ACTION_COLUMNS, title="jobs")
        if r["unanswered"]:
            kv(r["unanswered"], title="servers that did not answer")
        if r.get("refused"):
            kv(r["refused"], title="servers that refused (taken by another return), replaced")
        if r.get("short"):
            info(f"short: {r['short']}")

    emit(res, args.output, human)
    return EXIT_FAILED if res.get("short") else 0
