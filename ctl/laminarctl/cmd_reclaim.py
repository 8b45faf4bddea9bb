"""Reclaim: announce that a node is taken back, with a notice window.

    laminarctl reclaim --notice 60s              # this node: move its jobs off within 60 s
    laminarctl reclaim --notice 2m --node 4      # node 4 of the zone (its agent is told)
    laminarctl reclaim status                    # the reclaim in progress, notices heard from peers
    laminarctl reclaim cancel [--node 4]         # the owner withdraws it, or gives the node back
    laminarctl migrations                        # moves of jobs off this node
    laminarctl migrations --pending              # hand-overs not answered (laminarctl job settle)
    laminarctl checkpoints                       # periodic checkpoint plan: interval, cost, next signal

The agent checkpoints each job, moves it to another node of the zone and arms the kill-switch
for the window's end (docs/migration.md). Announcing a reclaim needs root or the control group.

``reclaim cancel`` ends a reclaim (root or the control group): inside the window nothing more
moves, the kill-switch deadlines are cleared, the queued jobs start here and the node takes
placements again (jobs already moved stay where they went; a move already begun finishes);
after the window the node takes jobs again. Refused (exit 1, "no reclaim") when there is none.
Follow one job's move with ``laminarctl job show ID --follow``.
"""

from __future__ import annotations

import argparse
from typing import Any

from .output import emit, info, kv, table

MOVE_COLUMNS = [("job", "JOB"), ("phase", "PHASE"), ("ckpt", "CHECKPOINT"), ("dest", "TO NODE"),
                ("dest_job", "AS"), ("done_bytes", "BYTES"), ("total_bytes", "OF"), ("error", "ERROR")]
PENDING_COLUMNS = [("job", "JOB/KEY"), ("kind", "KIND"), ("node", "TO NODE"), ("state", "STATE"), ("since", "SINCE"),
                   ("error", "ERROR")]
CKPT_COLUMNS = [("job", "JOB"), ("interval_s", "EVERY s"), ("cost_s", "COST s"), ("share_mbit", "Mbit/s"),
                ("next_in_s", "NEXT IN s"), ("signals", "SIGNALS"), ("commits", "COMMITS"), ("skip", "SKIPPED")]


def parse_notice(text: str) -> float:
    """'60s', '2m', '1h', '90' (seconds) -> seconds > 0."""
    t = text.strip().lower()
    mult = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(t[-1:])
    try:
        v = float(t[:-1] if mult else t) * (mult or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--notice {text!r}: expected a duration like 60s, 2m or 90") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"--notice {text!r}: must be > 0")
    return v


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("reclaim", parents=[common], help="announce a node's reclaim (notice window); move its jobs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", choices=["status", "cancel"],
                   help="status: show the reclaim in progress; cancel: withdraw it (or give the node back)")
    p.add_argument("--notice", type=parse_notice, help="the notice window, e.g. 60s, 2m")
    p.add_argument("--node", type=int, help="the node to reclaim, or whose reclaim to cancel (default: this one)")
    p.add_argument("--reason", default="", help="recorded with the notice")
    p.add_argument("--pool", help="old spelling of `pool return --pool P` (goes in the next release)")
    p.add_argument("--count", type=int, default=1, help="with --pool: how many servers to return (default 1)")
    p.set_defaults(func=cmd_reclaim)
    p = sub.add_parser("migrations", parents=[common], help="moves of jobs off this node")
    p.add_argument("--pending", action="store_true",
                   help="hand-overs sent and not answered: node, state (unconfirmed), since (see `job settle`)")
    p.set_defaults(func=cmd_migrations)
    p = sub.add_parser("checkpoints", parents=[common],
                       help="periodic checkpoint plan per job (interval from the hazard, cost, uplink share, stagger)")
    p.set_defaults(func=cmd_checkpoints)


def cmd_reclaim(args: argparse.Namespace) -> int:
    if args.what == "status":
        st = args.client.get("/v1/reclaim")
        emit(st, args.output, lambda s: kv({"node": s["node"], **(s.get("reclaim") or {"reclaim": "none"}),
                                           "notices": s.get("notices")}, title="reclaim"))
        return 0
    if args.what == "cancel":
        return cmd_cancel(args)
    if args.pool:
        if args.notice is not None or args.node is not None:
            raise ValueError("reclaim: --pool returns loaned servers; it does not take --notice or --node")
        from .cmd_pool import cmd_return, old_name

        old_name("reclaim --pool")
        return cmd_return(args)
    if args.notice is None:
        raise ValueError("reclaim: give the notice window, e.g. --notice 60s (loaned servers: `pool return --pool POOL --count K`)")
    body: dict[str, Any] = {"notice_s": args.notice}
    if args.node is not None:
        body["node"] = args.node
    if args.reason:
        body["reason"] = args.reason
    res = args.client.post("/v1/reclaim", body, timeout=30)

    def human(r: dict[str, Any]) -> None:
        if "forwarded_to" in r:
            info(f"node {r['forwarded_to']} took the notice ({args.notice:g} s)")
            return
        rc = r.get("reclaim") or {}
        info(f"node {r['node']} reclaimed in {args.notice:g} s: {len(rc.get('plan', []))} jobs to move, "
             f"kill-switch armed for {len(rc.get('armed', []))}; {rc.get('peers_told', 0)} peers told")
        if rc.get("plan"):
            table(rc["plan"], [("job_id", "JOB"), ("signal_at_s", "SIGNAL AT s"), ("deadline_s", "DEADLINE s"),
                               ("final", "FINAL CKPT")])

    emit(res, args.output, human)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if args.notice is not None or args.pool:
        raise ValueError("reclaim cancel: takes --node and --reason, not --notice or --pool")
    body: dict[str, Any] = {}
    if args.node is not None:
        body["node"] = args.node
    if args.reason:
        body["reason"] = args.reason
    res = args.client.post("/v1/reclaim/cancel", body, timeout=60)

    def human(r: dict[str, Any]) -> None:
        where = f"node {r['forwarded_to']}" if "forwarded_to" in r else f"node {r['node']}"
        if r.get("superseded"):
            info(f"reclaim of {where} cancelled, but a new reclaim was announced meanwhile: the node stays "
                 "reclaimed (see `laminarctl reclaim status`)")
            return
        if not r.get("in_window"):
            info(f"reclaim of {where} cancelled after its window: it takes jobs and placements again")
            return
        info(f"reclaim of {where} cancelled inside its window: kill-switch deadline cleared for "
             f"{len(r.get('disarmed', []))} jobs, queue released, placements taken again"
             + (f"; moves begun, left to finish: {', '.join(r['finishing'])}" if r.get("finishing") else "")
             + (f"; stopped here (placement elsewhere unsettled): {', '.join(r['unsettled'])}"
                if r.get("unsettled") else ""))
        if r.get("peers_missed"):
            info(f"peers not reached yet, told again until the window ends: {r['peers_missed']}")

    emit(res, args.output, human)
    return 0


def cmd_migrations(args: argparse.Namespace) -> int:
    if getattr(args, "pending", False):
        import time

        rows = args.client.get("/v1/migrate/handovers")
        emit(rows, args.output, lambda hs: table(
            [{**h, "since": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"]))} for h in hs],
            PENDING_COLUMNS) if hs else info("no pending hand-over"))
        return 0
    emit(args.client.get("/v1/migrations"), args.output, lambda ms: table(ms, MOVE_COLUMNS))
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    st = args.client.get("/v1/checkpoints")

    def human(d: dict[str, Any]) -> None:
        mtbf = d.get("mtbf_s")
        info(f"periodic checkpoints {'on' if d.get('periodic') else 'off'}; hazard {d.get('hazard_per_h', 0):.4g}/h "
             f"(MTBF {mtbf:.0f} s), uplink {d.get('uplink_mbit') or 0:g} Mbit/s" if mtbf is not None else "")
        rows = []
        for r in d.get("jobs", []):
            nxt = r.get("next_at")
            rows.append({**r, "next_in_s": None if nxt is None else round(max(0.0, nxt - d["now"]), 1)})
        table(rows, CKPT_COLUMNS)

    emit(st, args.output, human)
    return 0
