"""Zone: the peers this agent knows, its protocol counters, and placing jobs through the zone.

    laminarctl zone peers                     # members, liveness, last seen, summary age
    laminarctl zone stats                     # drops by reason, arbiter and submitter counters
    laminarctl zone submit --gpus 0.5 --memory 4G --name train -- python train.py
    laminarctl zone submit --workers 3 --gpus 1 [--elastic 2:4] -- python train.py   # a multi-node job
    laminarctl zone placements                # where this node's placements went, and why
    laminarctl zone keys                      # each zone key: role, fingerprint, datagrams it verified
    laminarctl zone keys reload               # re-read the key file and node keys now (root; same as SIGHUP)
    laminarctl zone keys node-gen --out /etc/laminar/node.key   # a node key; prints its roster line

``zone submit`` places the job on whichever node of the cluster offers first (probe-first,
late binding; see docs/protocol.md): it may run here or on another node. Exit code 0 when the
job was placed, 1 otherwise (the reason is printed).

``zone submit --workers N`` places a multi-node job (docs/jobs.md): N members, one per node,
each with the ``--gpus``, ``--cpus`` and ``--memory`` given (per worker), all or none, in one
zone unless ``--spread-zones``; run through ``torchrun`` when the command is a Python script
(``--launcher`` says which: ``torchrun`` or ``plain``). With ``--workers``, ``--elastic A:B``
gives the member bounds (the job goes on with at least A members, up to B); without it,
``--elastic`` keeps its meaning of ``submit``: GPU workers on one node. It prints the job's id
and members; exit 1, with the agent's message, when refused (0 workers, min > max, more
workers than the zone has nodes, per-worker GPUs no node has).

``zone submit --packing`` is the packing placement (docs/allocation.md): every node of the
first few zones that can take the job is probed, every answer awaited, and the offer adding
the least GPU fragmentation binds (nodes configured with ``[zone] packing = "frag"`` score
their offers). It costs a probe and an answer per node of those zones: for a saturated
cluster or a batch of arrivals, not for every job.

``zone keys node-gen --out PATH`` makes this node's key (an X25519 private key, written 0600;
an existing file is never replaced) and prints the ``pubkey = "..."`` line for the node's
``[[zone.nodes]]`` entry on every node (docs/operations.md, "Node keys"). It runs here, without
the agent.
"""

from __future__ import annotations

import argparse
from typing import Any

from .output import emit, info, kv, table

PEER_COLUMNS = [("node", "NODE"), ("zone", "ZONE"), ("addr", "ADDRESS"), ("pool", "POOL"), ("owner", "OWNER"),
                ("alive", "ALIVE"), ("last_seen_s", "SEEN s"), ("summary_age_s", "SUMMARY s"),
                ("misses", "MISSES"), ("rx", "RX"), ("tx", "TX")]
KEY_COLUMNS = [("zone", "ZONE"), ("role", "ROLE"), ("fingerprint", "FINGERPRINT"), ("verified", "VERIFIED"),
               ("last_verified_s", "LAST USED s AGO")]
PLACEMENT_COLUMNS = [("placement_id", "PLACEMENT"), ("name", "NAME"), ("outcome", "OUTCOME"), ("node", "NODE"),
                     ("zone", "ZONE"), ("job_id", "JOB"), ("elapsed_ms", "MS"), ("reason", "REASON")]


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    zone = sub.add_parser("zone", parents=[common], help="zone peers, protocol counters, placing through the zone")
    zsub = zone.add_subparsers(dest="zone_cmd", metavar="SUBCOMMAND")
    zsub.required = True
    p = zsub.add_parser("peers", parents=[common], help="the configured members and their liveness")
    p.set_defaults(func=cmd_peers)
    p = zsub.add_parser("stats", parents=[common], help="datagrams dropped by reason; arbiter and submitter counters")
    p.set_defaults(func=cmd_stats)
    p = zsub.add_parser("placements", parents=[common], help="recent placements submitted on this node")
    p.set_defaults(func=cmd_placements)
    p = zsub.add_parser("keys", parents=[common], help="the zone keys in use and which verified how many datagrams",
                        description="Without an action: each key's zone, role, fingerprint and the datagrams and "
                        "hand-overs it verified here since the agent started. 'reload' re-reads the key file and, "
                        "from the config file, node_keys, node_key_file and the roster's pubkeys (refused whole, "
                        "keeping the keys in use, when any is bad). See docs/operations.md, "
                        "'Rotating a zone key'. 'node-gen --out PATH' writes a new node key (mode 0600) and prints "
                        "its roster line (docs/operations.md, 'Node keys').")
    p.add_argument("action", nargs="?", choices=["reload", "node-gen"],
                   help="reload: re-read the key file and node keys now; node-gen: write a node key to --out")
    p.add_argument("--out", help="node-gen: the private key file to create (e.g. /etc/laminar/node.key)")
    p.set_defaults(func=cmd_keys)
    p = zsub.add_parser("submit", parents=[common], help="place a job on any node of the cluster",
                        description="Place a job through the zone. Put the command after --.")
    p.add_argument("--name", default="", help="a name for the job")
    p.add_argument("--gpus", type=float, default=0.0, help="GPUs: a count (2) or a share of one (0.5)")
    p.add_argument("--gpu-model", help="required GPU model: a node's advertised name or a run of its words "
                   "(H100 matches NVML's \"NVIDIA H100 80GB HBM3\"; A10 does not match an A100)")
    p.add_argument("--pool", help="preferred pool: its nodes are probed first")
    p.add_argument("--memory", help="memory limit, e.g. 512M, 2G")
    p.add_argument("--cpus", type=float, help="CPUs, fractions allowed (default 1)")
    p.add_argument("--class", dest="job_class", default="standard", choices=["long-resident", "standard", "transient"],
                   help="lifecycle class (default: standard)")
    p.add_argument("--priority", type=int, default=50, help="0..100, higher survives longer (default 50)")
    p.add_argument("--packing", action="store_true",
                   help="packing placement: probe whole zones, bind the least-fragmenting offer (many more messages)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="a multi-node job: N members, one per node (2 to 64); --gpus, --cpus, --memory are per worker")
    p.add_argument("--elastic", metavar="MIN:MAX",
                   help="with --workers: the members' bounds (goes on with MIN, grows to MAX); without: elastic "
                        "GPU workers on one node, as for submit")
    p.add_argument("--launcher", choices=["torchrun", "plain"],
                   help="with --workers: torchrun (the default for python X.py or python -m M) or plain (the "
                        "environment only: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, ...)")
    p.add_argument("--spread-zones", action="store_true",
                   help="with --workers: the members may span zones when no one zone holds them all")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")
    p.set_defaults(func=cmd_submit)


def cmd_peers(args: argparse.Namespace) -> int:
    rows = args.client.get("/v1/zone/peers")
    emit(rows, args.output, lambda rs: table(rs, PEER_COLUMNS))
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    import time

    if args.action == "node-gen":
        return node_gen(args)
    if args.out:
        raise ValueError("zone keys: --out goes with node-gen only (laminarctl zone keys node-gen --out PATH)")
    if args.action == "reload":
        res = args.client.post("/v1/zone/keys/reload", {})

        def human(r: dict[str, Any]) -> None:
            info(f"keys reloaded from {r['source']}")
            table(r["keys"], KEY_COLUMNS[:3])
            nk = r.get("node_key")
            if nk:
                info(f"node key {nk['file']} (node_keys = {nk.get('mode', 'require')}): pair MACs with nodes "
                     f"{', '.join(map(str, nk['pair_peers'])) or '(none)'}")
            elif "node_key" in r:
                info("node key: none (this node's zone.nodes entry lists no pubkey): zone-key MACs")
            if r.get("added_nodes"):
                info(f"nodes added to the roster: {', '.join(map(str, r['added_nodes']))}")
            if r.get("readdressed_nodes"):
                info(f"nodes at a new address: {', '.join(map(str, r['readdressed_nodes']))}")
            if r.get("restart_needed"):
                info(f"changed in the config file, applied only by a restart: {', '.join(r['restart_needed'])}")

        emit(res, args.output, human)
        return 0
    res = args.client.get("/v1/zone/keys")
    now = time.time()
    for k in res.get("keys", []):
        t = k.get("last_verified")
        k["last_verified_s"] = round(now - t, 1) if isinstance(t, (int, float)) else ("-" if k["role"] == "current"
                                                                                       else "never")

    def listing(r: dict[str, Any]) -> None:
        if r["networked"]:
            table(r["keys"], KEY_COLUMNS, title=f"zone keys ({r['source']})")
            nk = r.get("node_key")
            if nk:
                mode = nk.get("mode", "require")
                info(f"node key {nk['file']}: pubkey {nk['pubkey']}; pair MACs with nodes "
                     f"{', '.join(map(str, nk['pair_peers'])) or '(none)'}"
                     + ("" if mode == "require" else f" (node_keys = {mode}: "
                        + ("signs with the zone key, " if mode == "accept" else "") + "takes zone-key MACs too)"))
            else:
                info("node key: none (this node's zone.nodes entry lists no pubkey): zone-key MACs")
        else:
            info("one-node zone: an in-memory key, no key file")

    emit(res, args.output, listing)
    return 0


def node_gen(args: argparse.Namespace) -> int:
    """Write a node key to ``--out`` and print its roster line (JSON: ``{file, pubkey}``)."""
    from laminar.zone.keys import KeyFileError, generate_node_key

    if not args.out:
        raise ValueError("zone keys node-gen: --out PATH is required (e.g. --out /etc/laminar/node.key)")
    try:
        pub = generate_node_key(args.out)
    except KeyFileError as e:
        raise ValueError(str(e)) from None
    res = {"file": args.out, "pubkey": pub.hex()}

    def human(r: dict[str, Any]) -> None:
        info(f"wrote {r['file']} (mode 0600); add this line to the node's [[zone.nodes]] entry on every node:")
        print(f'pubkey = "{r["pubkey"]}"')

    emit(res, args.output, human)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    st = args.client.get("/v1/zone/stats")

    def human(s: dict[str, Any]) -> None:
        kv({"node": s["node"], "zone": s["zone"], "networked": s["networked"]}, title="zone")
        kv(s["drops"], title="datagrams (accepted, and dropped by reason)")
        if s.get("handover_drops"):
            kv(s["handover_drops"], title="hand-over frames (accepted, and dropped by reason)")
        if s.get("handover_tcp"):
            kv(s["handover_tcp"], title="hand-over port (connections, refused or cut by reason, held now)")
        kv(s["arbiter"], title="arbiter (this node answering probes)")
        kv(s["submitter"], title="submitter (placements from this node)")
        kv({**s["udp"], **s["counts"], "late_offers": s["late_offers"]}, title="traffic")

    emit(st, args.output, human)
    return 0


def cmd_placements(args: argparse.Namespace) -> int:
    rows = args.client.get("/v1/placements")
    emit(rows, args.output, lambda rs: table(rs, PLACEMENT_COLUMNS))
    return 0


def build_placement(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /v1/placements body from the command line. Raises ValueError for bad input."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("zone submit: no command given; put it after --, e.g. laminarctl zone submit -- sleep 60")
    if args.gpus < 0:
        raise ValueError(f"--gpus {args.gpus}: expected a count >= 0 or a share such as 0.5")
    spec: dict[str, Any] = {"command": cmd, "name": args.name, "class": args.job_class, "priority": args.priority}
    if args.memory:
        spec["memory"] = args.memory
    if args.cpus is not None:
        spec["cpus"] = args.cpus
    workers = getattr(args, "workers", None)
    elastic = getattr(args, "elastic", None)
    if elastic:
        lo, sep, hi = elastic.partition(":")
        if not sep or not lo.isdigit() or not hi.isdigit():
            raise ValueError(f"--elastic {elastic!r}: expected MIN:MAX, e.g. 2:4")
        if int(lo) > int(hi):
            raise ValueError(f"--elastic {elastic}: MIN {lo} is more than MAX {hi}")
        keys = ("workers_min", "workers_max") if workers is not None else ("elastic_min", "elastic_max")
        spec[keys[0]], spec[keys[1]] = int(lo), int(hi)
    if workers is not None:
        if workers < 1:
            raise ValueError(f"--workers {workers}: expected a number of nodes, 1 to 64 (one member per node)")
        spec["workers"] = workers
    for opt, value in (("--launcher", getattr(args, "launcher", None)),
                       ("--spread-zones", getattr(args, "spread_zones", False))):
        if value and workers is None:
            raise ValueError(f"{opt}: only with --workers N (a multi-node job)")
    if getattr(args, "launcher", None):
        spec["launcher"] = args.launcher
    body: dict[str, Any] = {"spec": spec, "gpus": args.gpus}
    if getattr(args, "spread_zones", False):
        body["spread_zones"] = True
    if getattr(args, "packing", False):
        body["packing"] = True
    if args.pool:
        body["pool"] = args.pool
    if args.gpu_model:
        body["gpu_model"] = args.gpu_model
    return body


MEMBER_COLUMNS = [("index", "MEMBER"), ("node", "NODE"), ("addr", "ADDRESS"), ("state", "STATE"), ("code", "EXIT")]


def members_table(v: dict[str, Any]) -> None:
    """A multi-node job's members (index, node, address, state, exit code) as a table."""
    table(v.get("members") or [], MEMBER_COLUMNS, title=f"members of {v.get('id')}")


def cmd_submit(args: argparse.Namespace) -> int:
    res = args.client.post("/v1/placements", build_placement(args), timeout=120.0)
    if "members" in res and "outcome" not in res:  # a multi-node job's view
        def gang(v: dict[str, Any]) -> None:
            if v.get("state") == "ended":
                info(f"{v['id']} not placed: {v.get('end_reason') or 'ended'}")
                return
            nodes = ", ".join(str(m.get("node")) for m in v.get("members") or [])
            info(f"{v['id']} {v.get('state')}: {len(v.get('members') or [])} members on nodes {nodes}")
            members_table(v)

        emit(res, args.output, gang)
        return 1 if res.get("state") == "ended" else 0

    def human(r: dict[str, Any]) -> None:
        if r["outcome"] == "placed":
            info(f"{r['job_id']} placed on node {r['node']} (zone {r['zone']}) in {r['elapsed_ms']:.1f} ms, "
                 f"placement {r['placement_id']}")
        else:
            info(f"not placed ({r['outcome']}): {r['reason']}")

    emit(res, args.output, human)
    return 0 if res.get("outcome") == "placed" else 1
