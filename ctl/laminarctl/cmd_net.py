"""Network commands: migration transfers and their shaping, and the per-flow kill-switch.

    laminarctl net transfers                          rates, statuses and reasons
    laminarctl net transfers add --job J --flow tcp:10.0.0.1:40000->10.0.0.2:7000 \\
                                 --bytes 4G --deadline +90s [--id ckpt-7] [--max-rate 2G]
    laminarctl net transfers progress ckpt-7 --sent 1G
    laminarctl net transfers rm ckpt-7
    laminarctl net kill-flow ckpt-7 on|off|arm [--at +30s]   (a transfer id or a 5-tuple)
    laminarctl net flows                              every lm_flows entry and its switch, with who
                                                      cut it (origin: transfer or operator) and when
                                                      a transfer's cut expires (expires_in_s)

Job-wide switches are ``laminarctl killswitch on|off|arm --job J|--all|--lent`` (cmd_core).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from .cmd_core import add_deadline, parse_duration
from .output import emit, info, kv, table

# Exit status when some transfer will miss its deadline (scripts re-plan on it); after the
# client's own codes (0 ok, 1 failed, 2 usage, 3 no agent, 4 denied).
EXIT_INFEASIBLE = 5

_SIZE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'4G' -> 4_000_000_000, '512Mi' -> 536870912, '1000' -> 1000. Raises ValueError naming the text."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?", text.strip())
    if not m:
        raise ValueError(f"size {text!r} not understood: use e.g. 4G, 512Mi, 1000000")
    return int(float(m.group(1)) * _SIZE[(m.group(2) or "").lower()])


def parse_rate(text: str) -> int:
    """'2G' (bit/s) -> 2_000_000_000; also '500M', '100mbit'. Raises ValueError."""
    return parse_size(re.sub(r"(?i)bit(/s)?$", "", text.strip()))


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    net = sub.add_parser("net", parents=[common], help="migration transfers, shaping and flow kill-switches")
    nsub = net.add_subparsers(dest="net_cmd", metavar="SUBCOMMAND")
    nsub.required = True

    tr = nsub.add_parser("transfers", parents=[common], help="migration transfers: rates, statuses, reasons")
    tr.set_defaults(func=cmd_transfers)
    tsub = tr.add_subparsers(dest="tr_cmd", metavar="ACTION")
    p = tsub.add_parser("add", parents=[common], help="register a transfer (gets an HTB leaf and a flow entry)")
    p.add_argument("--job", required=True, help="the job the transfer belongs to")
    p.add_argument("--flow", required=True, help="5-tuple, local -> remote: tcp:SADDR:SPORT->DADDR:DPORT (IPv6 in brackets: tcp:[fd00::1]:40000->[fd00::2]:7000)")
    p.add_argument("--bytes", required=True, help="total size, e.g. 4G, 512Mi")
    p.add_argument("--deadline", required=True, help="when it must be done, from now: +90s, 2m")
    p.add_argument("--id", help="transfer id (default: generated)")
    p.add_argument("--max-rate", help="cap in bit/s, e.g. 2G")
    p.set_defaults(func=cmd_transfer_add)
    p = tsub.add_parser("progress", parents=[common], help="report bytes sent (the sender knows best)")
    p.add_argument("id")
    p.add_argument("--sent", required=True, help="bytes sent so far, e.g. 1G")
    p.set_defaults(func=cmd_transfer_progress)
    p = tsub.add_parser("rm", parents=[common], help="remove a transfer: its class and flow entry")
    p.add_argument("id")
    p.set_defaults(func=cmd_transfer_rm)

    p = nsub.add_parser("kill-flow", parents=[common], help="cut one flow (both directions) now or at a deadline")
    p.add_argument("flow", help="a transfer id or a 5-tuple tcp:SADDR:SPORT->DADDR:DPORT (IPv6 addresses in brackets)")
    p.add_argument("action", choices=["on", "off", "arm"], help="on: cut now; off: restore; arm: cut at --at")
    p.add_argument("--at", help="with arm: when, e.g. +30s (the data plane enforces it even if the agent dies)")
    p.set_defaults(func=cmd_kill_flow)

    p = nsub.add_parser("flows", parents=[common], help="every lm_flows entry and its switch")
    p.set_defaults(func=cmd_flows)


# BY: how SENT is known (acked: the destination's TCP acknowledged it; reported; estimated)
TRANSFER_COLUMNS = [("id", "ID"), ("job", "JOB"), ("flow", "FLOW"), ("class", "CLASS"), ("sent_bytes", "SENT"),
                    ("progress", "BY"), ("total_bytes", "TOTAL"), ("deadline_in_s", "DUE IN S"), ("rate", "RATE"),
                    ("status", "STATUS"), ("reason", "REASON")]


def cmd_transfers(args: argparse.Namespace) -> int:
    res = args.client.get("/v1/net/transfers")

    def human(r: dict[str, Any]) -> None:
        kv(r["status"], "shaping")
        table(r["transfers"], TRANSFER_COLUMNS, title="transfers")

    emit(res, args.output, human)
    return EXIT_INFEASIBLE if any(t["status"] in ("infeasible", "late") for t in res["transfers"]) else 0


def cmd_transfer_add(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"job": args.job, "flow": args.flow, "total_bytes": parse_size(args.bytes),
                            "deadline_s": parse_duration(args.deadline)}
    if args.id:
        body["id"] = args.id
    if args.max_rate:
        body["max_rate_bps"] = parse_rate(args.max_rate)
    res = args.client.post("/v1/net/transfers", body)
    emit(res, args.output, lambda r: info(f"transfer {r['id']} -> class {r['class']} at {r['rate']}: "
                                          f"{r['status']} ({r['reason']})"))
    return EXIT_INFEASIBLE if res.get("status") in ("infeasible", "late") else 0


def cmd_transfer_progress(args: argparse.Namespace) -> int:
    res = args.client.post(f"/v1/net/transfers/{args.id}/progress", {"sent_bytes": parse_size(args.sent)})
    emit(res, args.output, lambda r: info(f"transfer {r['id']}: {r['sent_bytes']}/{r['total_bytes']} bytes"))
    return 0


def cmd_transfer_rm(args: argparse.Namespace) -> int:
    res = args.client.delete(f"/v1/net/transfers/{args.id}")
    emit(res, args.output, lambda r: info(f"transfer {r['removed']} removed (class {r['class_removed']})"))
    return 0


def cmd_kill_flow(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"flow": args.flow, "action": args.action}
    res = args.client.post("/v1/killswitch/flow", add_deadline(body, args.action, args.at))
    emit(res, args.output, lambda r: info(r["message"]))
    return 0


def cmd_flows(args: argparse.Namespace) -> int:
    res = args.client.get("/v1/killswitch/flow")
    emit(res, args.output, lambda r: table(r, ["flow", "transfer", "job_num", "priority", "kill", "armed",
                                               "armed_in_s", "cut", "origin", "expires_in_s", "packets", "bytes"]))
    return 0
