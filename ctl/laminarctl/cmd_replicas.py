"""Replicas: the checkpoints this node holds for jobs of other nodes, and what becomes of them.

    laminarctl replicas                      # per key: state, source, checkpoints, bytes, age, GC plan; totals
    laminarctl replicas -o json              # the same, one object per key (a list)
    laminarctl replicas --totals -o json     # {"replicas": [...], "totals": {...}}: bytes held, free space
    laminarctl replicas drop KEY             # remove a key's replicas and row (root or the control group)
    laminarctl replicas drop KEY --force     # ... even one this node keeps (the job may have no other copy)

A node keeps under ``<state_dir>/xfer/checkpoints/<key>/`` the checkpoints a keeper prestaged
and the copies it holds as a storage keeper, with a row per key (state ``keeping``,
``waiting``, ``released``, ``handed-over``, ``placed``, ``passed``, ``resumed``, ``failed``,
``archived``; ``unclaimed``: a directory no keeper named). The GC removes what the job no longer
needs; ``GC`` says what it will remove and when, or why it keeps the key. ``keeping
(unconfirmed)``: the job's source, alive in the zone, did not answer when last asked whether it
still needs the keeper (``WHY`` says since when it was last heard from); kept, never removed for it. ``failed`` and
``archived`` keys are left to an operator: drop them once nobody needs them.

A drop goes through the GC's safe path (the key's directory is renamed into the replica trash,
then removed in the background) and is refused while a checkpoint of the key is being received,
while a take-over of it runs, or while a local job resumes from it (``--force`` or not); a
``keeping`` or ``waiting`` key needs ``--force``; the job's source is then told (control
message ``dropped``): a live source forgets this node as the job's keeper and prestages the job's
newest checkpoint to another peer at once. A source that cannot be reached is not told (the drop
stands; the answer says so): a stopped job held here, or a gone source's job, is lost unless the
archive holds it. Callers other than root, the control group and the job's owner see sizes and states
but not which job a replica is (docs/operations.md, *Checkpoint replicas on a node*).
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

from .output import emit, error, info, table

# A replica key as the agent accepts it (a transfer's job id): checked here too, so a key with
# path characters is bad input (exit 2) before anything is sent.
KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # ASCII, full match

COLUMNS = [("key", "KEY"), ("state", "STATE"), ("from", "FROM"), ("held", "CHECKPOINTS"), ("size", "BYTES"),
           ("age", "AGE"), ("used_by", "USED BY"), ("gc_plan", "GC"), ("gc_why", "WHY")]


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; None -> '-'."""
    if n is None:
        return "-"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TiB"  # pragma: no cover (the loop returns)


def human_age(s: float | None) -> str:
    """Seconds -> '45s', '12m', '3h', '2d'; None -> '-'."""
    if s is None:
        return "-"
    s = max(0.0, float(s))
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("replicas", parents=[common], help="checkpoint replicas this node holds for other nodes' jobs")
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("action", nargs="?", choices=["drop"], help="drop: remove KEY's replicas and row")
    p.add_argument("key", nargs="?", help="with drop: the replica key (the KEY column)")
    p.add_argument("--force", action="store_true", help="with drop: also a key this node keeps or waits to resume")
    p.add_argument("--totals", action="store_true", help="with -o json: an object with the totals, not a list")
    p.set_defaults(func=cmd_replicas)


def _row(r: dict[str, Any], now: float) -> dict[str, Any]:
    src = "-" if r.get("src_node") is None else f"node {r['src_node']}" + (f"/{r['src_job']}" if r.get("src_job") else "")
    held = ", ".join(c["name"] for c in r.get("checkpoints", [])) or "-"
    if r.get("receiving"):
        held += " (receiving)"
    if r.get("gc") == "removes":
        at = r.get("gc_at")
        when = "next round" if at is None or at <= now + 60 else f"in {human_age(at - now)}"
        plan = f"removes {', '.join(r.get('gc_removes') or [])} {when}"
    elif r.get("row_gc_at") is not None:
        plan = f"row goes in {human_age(max(0.0, r['row_gc_at'] - now))}"
    else:
        plan = "keeps"
    why = r.get("gc_why") or ""
    if r.get("attempts"):  # a waiting keeper: how often it looked, and why it found no room
        n = int(r["attempts"])
        why += f"; looked {n} time{'' if n == 1 else 's'}" + (f", last: {r['last_error']}" if r.get("last_error") else "")
    state = str(r.get("state")) + (" (unconfirmed)" if r.get("unconfirmed") else "")
    return {**r, "key": r.get("key") or "(another user's)", "state": state, "from": src, "held": held, "gc_why": why,
            "size": human_bytes(r.get("bytes")), "age": human_age(r.get("age_s")),
            "used_by": ", ".join(r.get("used_by") or []) or "-", "gc_plan": plan}


def cmd_replicas(args: argparse.Namespace) -> int:
    if args.action == "drop":
        return cmd_drop(args)
    if args.key is not None or args.force:
        raise ValueError("replicas: KEY and --force go with drop: laminarctl replicas drop KEY [--force]")
    if args.output == "json" and not args.totals:
        emit(args.client.get("/v1/migrate/replicas"), "json")
        return 0
    view = args.client.get("/v1/migrate/replicas?totals=1")

    def human(v: dict[str, Any]) -> None:
        now = float(v.get("now") or time.time())
        table([_row(r, now) for r in v.get("replicas", [])], COLUMNS)
        t = v.get("totals") or {}
        if t:
            info(f"{t.get('keys', 0)} keys, {human_bytes(t.get('bytes_held'))} held in {t.get('checkpoints', 0)} "
                 f"checkpoints under {t.get('root')}; {human_bytes(t.get('free_bytes'))} free there "
                 f"({human_bytes(t.get('free_for_offers'))} for new transfers)"
                 + (f"; {human_bytes(t['trash_bytes'])} being removed" if t.get("trash_bytes") else ""))

    emit(view, args.output, human)
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    key = args.key
    if key is None:
        raise ValueError("replicas drop: give the KEY to drop (the KEY column of `laminarctl replicas`)")
    if not KEY_RE.fullmatch(key):
        raise ValueError(f"replicas drop: {key!r} is not a replica key: expected letters, digits, '_', '.' or '-', "
                         "starting with a letter or digit (the KEY column of `laminarctl replicas`)")
    res = args.client.post(f"/v1/migrate/replicas/{key}/drop", {"force": bool(args.force)})

    def human(r: dict[str, Any]) -> None:
        info(f"dropped {r['key']} ({r['state']}): {', '.join(r.get('dropped') or []) or 'no checkpoint held'}, "
             f"{human_bytes(r.get('bytes'))}")
        if r.get("forced") and r.get("source_told"):
            info(f"its source node {r.get('src_node')} was told and no longer counts on this node: "
                 f"{r.get('source_says') or 'no reason given'}")
        elif r.get("forced"):
            error(f"warning: {r['key']} was {r['state']}; its source node was not told "
                  f"({r.get('source_says') or 'no source to tell'}) and this node no longer keeps the job")

    emit(res, args.output, human)
    return 0
