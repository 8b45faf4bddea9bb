"""Core commands: status, bpf, killswitch, events."""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

from .client import EXIT_NO_AGENT, EXIT_USAGE, Client, CtlError
from .output import emit, fmt, info, kv, print_json, table

# Events one GET /v1/events answers (the agent's most: laminar.agent.MAX_EVENTS); `events --limit`
# reads more in pages, up to EVENTS_MAX.
EVENTS_PAGE = 1000
EVENTS_MAX = 100_000


def parse_duration(text: str) -> float:
    """'+30s', '90', '2m', '1.5h' -> seconds (float > 0). Raises ValueError naming the text."""
    m = re.fullmatch(r"\+?(\d+(?:\.\d+)?)(ms|s|m|h)?", text.strip())
    if not m:
        raise ValueError(f"duration {text!r} not understood: use e.g. +30s, 90s, 2m, 500ms")
    value = float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]
    if value <= 0:
        raise ValueError(f"duration {text!r} must be greater than zero")
    return value


def add_deadline(body: dict[str, Any], action: str, at: str | None) -> dict[str, Any]:
    """Puts `at_s` in a kill-switch request body: required with arm, refused without it."""
    if action == "arm":
        if not at:
            raise CtlError("arm needs --at, e.g. --at +30s", EXIT_USAGE)
        body["at_s"] = parse_duration(at)
    elif at:
        raise CtlError("--at goes with arm only", EXIT_USAGE)
    return body


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[common], help="agent, kernel features, maps, programs, pressure now")
    p.set_defaults(func=cmd_status)

    bpf = sub.add_parser("bpf", parents=[common], help="the BPF data plane")
    bsub = bpf.add_subparsers(dest="bpf_cmd", metavar="SUBCOMMAND")
    bsub.required = True
    p = bsub.add_parser("maps", parents=[common], help="pinned maps and their sizes")
    p.set_defaults(func=cmd_bpf_maps)
    p = bsub.add_parser("dump", parents=[common], help="a map's entries, decoded")
    p.add_argument("map", help="map name, e.g. lm_jobs")
    p.set_defaults(func=cmd_bpf_dump)
    p = bsub.add_parser("unload", parents=[common],
                        help="detach netguard, unpin maps, restore the interface (stops the agent's data plane)")
    p.add_argument("--force", action="store_true",
                   help="when the agent is not running, remove the pins and filters directly (root)")
    p.add_argument("--config", help="agent config to read pin root, uplink and state dir from (with --force)")
    p.set_defaults(func=cmd_bpf_unload)

    ks = sub.add_parser("killswitch", parents=[common], help="cut a job's (or all jobs') traffic at once, or at a deadline")
    ks.add_argument("action", choices=["on", "off", "arm", "status"],
                    help="on: cut now; off: restore; arm: cut at --at; status: show switches")
    who = ks.add_mutually_exclusive_group()
    who.add_argument("--job", help="job id")
    who.add_argument("--all", action="store_true", help="every job on this node")
    who.add_argument("--lent", action="store_true", help="every job on lent capacity")
    ks.add_argument("--at", help="with arm: when to cut, e.g. +30s (data plane enforces it even if the agent dies)")
    ks.set_defaults(func=cmd_killswitch)

    ev = sub.add_parser("events", parents=[common], help="pressure, Airlock, kill-switch and job events")
    ev.add_argument("--follow", "-f", action="store_true", help="stream events as they come")
    ev.add_argument("--kind", help="only this kind (pressure, airlock, killswitch, job, zone, agent, ...)")
    ev.add_argument("--since", type=int, default=0, help="only events after this id")
    ev.add_argument("--limit", type=int, default=50,
                    help=f"how many past events (default 50, at most {EVENTS_MAX}; read in pages of {EVENTS_PAGE})")
    ev.set_defaults(func=cmd_events)


def cmd_status(args: argparse.Namespace) -> int:
    st = args.client.get("/v1/status")

    def human(s: dict[str, Any]) -> None:
        kv(s["agent"], "agent")
        kv(s["kernel"], "kernel")
        ng = s.get("netguard")
        if ng:
            kv({k: v for k, v in ng.items() if k not in ("maps", "programs")}, "netguard")
            table(ng.get("programs", []), ["ifname", "direction", "name", "prog_id"], title="attached programs")
            table(ng.get("maps", []), ["name", "type", "entries", "max_entries", "pin"], title="maps")
        pw = s.get("pressurewatch")
        if pw:
            kv(pw, "pressure watch")
        kv(s["pressure"], "pressure now")
        for key, value in s.items():
            if key not in ("agent", "kernel", "netguard", "pressurewatch", "pressure") and isinstance(value, dict):
                kv(value, key)

    emit(st, args.output, human)
    return 0


def cmd_bpf_maps(args: argparse.Namespace) -> int:
    maps = args.client.get("/v1/bpf/maps")
    emit(maps, args.output, lambda m: table(m, ["name", "type", "key_size", "value_size", "entries", "max_entries", "pin"]))
    return 0


def cmd_bpf_dump(args: argparse.Namespace) -> int:
    dump = args.client.get(f"/v1/bpf/maps/{args.map}")

    def human(d: dict[str, Any]) -> None:
        rows = [{**{f"key.{k}": v for k, v in e["key"].items()}, **e["value"]} for e in d["entries"]]
        if not rows:
            info(f"{d['name']}: no entries")
            return
        table(rows, list(rows[0].keys()), title=f"{d['name']} ({len(rows)} entries)")

    emit(dump, args.output, human)
    return 0


def cmd_bpf_unload(args: argparse.Namespace) -> int:
    config = None
    client = args.client
    if args.config:
        from laminar.agent import import_components
        from laminar.config import load

        import_components()  # a config may hold every component's section
        config = load(args.config)
        if getattr(args, "socket", None) is None:
            # The agent this config describes, not whichever agent owns the default socket.
            client = Client(config.agent.socket)
    try:
        res = client.post("/v1/bpf/unload", {})
    except CtlError as e:
        if e.code != 3 or not args.force:
            raise
        from laminar.config import load
        from laminar.net.netguard import unload_offline

        res = unload_offline(config if config is not None else load(None))
    emit(res, args.output, lambda r: info(f"unloaded: {fmt(r)}"))
    return 0


def cmd_killswitch(args: argparse.Namespace) -> int:
    if args.action == "status":
        st = args.client.get("/v1/killswitch")
        def human(s: dict[str, Any]) -> None:
            kv(s["global"], "node-wide")
            table(s["jobs"], ["job", "cgroup_id", "kill", "lent", "armed_in_s"], title="jobs")

        emit(st, args.output, human)
        return 0
    scope = "job" if args.job else "all" if args.all else "lent" if args.lent else None
    if scope is None:
        raise CtlError("say whose traffic: --job ID, --all or --lent", EXIT_USAGE)
    body: dict[str, Any] = {"action": args.action, "scope": scope}
    if args.job:
        body["job"] = args.job
    res = args.client.post("/v1/killswitch", add_deadline(body, args.action, args.at))
    emit(res, args.output, lambda r: info(r.get("message", fmt(r))))
    return 0


def _event_line(e: dict[str, Any]) -> str:
    skip = {"id", "seq", "ts", "kind", "message"}
    extra = " ".join(f"{k}={fmt(v)}" for k, v in e.items() if k not in skip)
    stamp = time.strftime("%H:%M:%S", time.localtime(e["ts"])) + f".{int(e['ts'] * 1000) % 1000:03d}"
    return f"{stamp} {e['kind']:<10} {e.get('message', '')} {extra}".rstrip()


def past_events(client: Any, since: int, limit: int, kind: str | None) -> list[dict[str, Any]]:
    """The newest `limit` events after `since` (of `kind`), oldest first, read in pages of at most
    EVENTS_PAGE (the agent's most: laminar.agent.MAX_EVENTS), each before the oldest of the last."""
    out: list[dict[str, Any]] = []
    before = None
    while len(out) < limit:
        n = min(EVENTS_PAGE, limit - len(out))
        page = client.get(f"/v1/events?since={since}&limit={n}" + (f"&kind={kind}" if kind else "")
                          + (f"&before={before}" if before is not None else ""))
        out = page + out
        if len(page) < n:
            break
        before = page[0]["id"]
    return out


def cmd_events(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= EVENTS_MAX:
        raise ValueError(f"--limit {args.limit}: expected 1 to {EVENTS_MAX} events")
    q = f"?since={args.since}&limit={min(args.limit, EVENTS_PAGE)}" + (f"&kind={args.kind}" if args.kind else "")
    if not args.follow:
        events = past_events(args.client, args.since, args.limit, args.kind)
        if args.output == "json":
            print_json(events)
        else:
            for e in events:
                info(_event_line(e))
        return 0
    last = args.since
    for e in args.client.stream("/v1/events" + q + "&follow=1"):
        if e.get("kind") == "keepalive":
            continue
        last = max(last, int(e.get("id") or 0))
        if args.output == "json":
            import json
            import sys

            sys.stdout.write(json.dumps(e, default=str) + "\n")
            sys.stdout.flush()
        else:
            info(_event_line(e))
    # The agent never ends a follow (keepalives every 15 s): the stream closed because it stopped
    # or restarted, which a script watching the exit code must be able to tell from success.
    raise CtlError(f"laminard closed the event stream (it stopped or restarted); to go on where this "
                   f"left off: laminarctl events --follow --since {last}", EXIT_NO_AGENT)
