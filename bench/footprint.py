"""Footprint benchmark: one real laminard idle, then answering 10,000 probes/s.

The agent runs in a network namespace of the benchmark's own, joined by a veth to a second
namespace where a load generator (this script, ``--generator``) plays another zone member:
it sends signed probes at a fixed rate, each naming the previous probe's placement as released
(as a submitter that bound elsewhere does: the release rides on its next probe to the node,
``wire.Probe.releases``, with the agents' 0.1 s lease), and times each answer from the wire:
from the kernel's TX timestamp of the probe (SO_TIMESTAMPING, software) to the kernel's RX
timestamp of its answer (SO_TIMESTAMPNS), so that neither generator process's own scheduling
is timed as the agent's (``probe_reply_wire_*``; ``probe_reply_p99_ms`` times from the sender's
clock read before it encoded the probe, the earlier method, reported beside it);
``--release-datagrams`` releases every offer by a datagram of its own instead (the earlier
protocol: twice the datagrams). Measured on the agent process: resident memory, CPU
while idle, CPU under load, memory growth over the load; on the generator: the reply latency.
There is no baseline (absolute figures); the goals are in the issue (rss under 60 MB, idle
CPU under 0.5 %, p99 reply under 2 ms at 10,000 probes/s, growth under 5 MB).

    python bench/footprint.py [--quick] [--json PATH] [--plot PATH]

``--quick``: 10 s idle and 10 s of load (else 60 s each). Needs root. Everything it creates
(namespaces, veth, agent, its pins and cgroups) is removed, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "agent"), str(REPO / "tests"), str(REPO / "tests" / "cluster")]

PORT = 7440
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux: SO_TIMESTAMPNS_OLD = SCM_TIMESTAMPNS
SO_TIMESTAMPING = 37  # SO_TIMESTAMPING_OLD = SCM_TIMESTAMPING (linux/net_tstamp.h)
# SOF_TIMESTAMPING_TX_SOFTWARE | _SOFTWARE | _OPT_ID | _OPT_TSONLY
TS_FLAGS = (1 << 1) | (1 << 4) | (1 << 7) | (1 << 11)
IP_RECVERR = 11
SO_EE_ORIGIN_TIMESTAMPING = 4


def drain_tx_stamps(sock: socket.socket, tx: dict[int, int]) -> None:
    """Read every TX timestamp waiting on ``sock``'s error queue into ``tx`` (tskey -> ns)."""
    while True:
        try:
            _data, anc, _flags, _addr = sock.recvmsg(0, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        ts = key = None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPING and len(payload) >= 16:
                sec, nsec = struct.unpack_from("qq", payload)  # ts[0]: the software stamp
                ts = sec * 1_000_000_000 + nsec
            elif level == socket.IPPROTO_IP and kind == IP_RECVERR and len(payload) >= 16:
                _errno, origin, _t, _c, _p, _info, data = struct.unpack_from("IBBBBII", payload)
                if origin == SO_EE_ORIGIN_TIMESTAMPING:
                    key = data
        if ts and key is not None:
            tx[key] = ts


# --------------------------------------------------------------------------- the load generator


def generator(args: argparse.Namespace) -> int:
    """The load generator, two processes sharing one UDP socket, so that neither's backlog is
    timed as the agent's. ``--role recv`` binds the socket, starts ``--role send`` with it
    (inherited fd), then reads the answers, times each against the CLOCK_MONOTONIC send time
    its placement id carries, and releases every offer (as member node 3). The sender sends
    probes at ``rate``/s as member node 2."""
    from laminar.zone import wire
    from laminar.zone.keys import load_keys

    keys = load_keys(args.keys)
    dst = (args.dst, PORT)
    sock = socket.socket(fileno=int(args.fd)) if args.fd else socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if args.role == "send":
        enc = wire.Encoder(2, keys)
        # each probe is also stamped by the kernel as it leaves (software TX timestamps on the
        # error queue, numbered per send by SOF_TIMESTAMPING_OPT_ID), so that the reply can be
        # timed from the wire, not from this sender's clock read before it encoded and sent
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, TS_FLAGS)
        t0 = time.perf_counter()
        end = t0 + args.duration
        k = 0
        blocked = 0
        interval = 1.0 / args.rate
        prev: tuple[int, ...] = ()
        sent_pids: list[int] = []  # in the order the kernel numbers them (tskey 0, 1, ...)
        tx: dict[int, int] = {}  # tskey -> CLOCK_REALTIME ns the probe left
        while True:
            now = time.perf_counter()
            if now >= end:
                break
            due = int((now - t0) / interval) + 1
            while k < due:
                pid = ((time.monotonic_ns() << 8) | (k & 0xFF)) & (2**64 - 1)
                probe = wire.Probe(pid, 0, 10, 1, args.lease_ms, "", "", () if args.release_datagrams else prev)
                try:
                    sock.sendto(enc.encode(probe, 1, time.time()), dst)
                    sent_pids.append(pid)
                except BlockingIOError:
                    blocked += 1
                prev = (pid,)
                k += 1
            drain_tx_stamps(sock, tx)
            time.sleep(max(0.0, t0 + k * interval - time.perf_counter()))
        time.sleep(0.05)
        drain_tx_stamps(sock, tx)
        tx_by_pid = {str(pid): tx.get(i) for i, pid in enumerate(sent_pids)}
        Path(args.out).write_text(json.dumps({"sent": k, "send_blocked": blocked,
                                              "elapsed_s": time.perf_counter() - t0, "tx_ns": tx_by_pid}))
        return 0
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind(("0.0.0.0", 0))
    sender = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--generator", "--role", "send",
                               "--keys", args.keys, "--dst", args.dst, "--rate", str(args.rate), "--duration",
                               str(args.duration), "--fd", str(sock.fileno()), "--out", args.out + ".send",
                               "--lease-ms", str(args.lease_ms)] + (["--release-datagrams"] if args.release_datagrams else []),
                              pass_fds=[sock.fileno()])
    enc = wire.Encoder(3, keys)
    dec = wire.Decoder(keys, {1: 1, 2: 1, 3: 1})
    sock.settimeout(0.2)
    # each answer is timed at its arrival in this host's kernel (SO_TIMESTAMPNS, CLOCK_REALTIME,
    # mapped onto CLOCK_MONOTONIC by their offset at start), so that this receiver's own
    # scheduling on the shared CPUs is not timed as the agent's; the user-space clock is the
    # fallback where the kernel gives no stamp
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    offset_ns = time.time_ns() - time.monotonic_ns()
    lat: list[float] = []
    at: list[float] = []
    start_ns = time.monotonic_ns()
    offers = refusals = 0
    kernel_stamped = 0
    rx_by_pid: dict[int, int] = {}
    end = time.monotonic() + args.duration + 1.5
    while time.monotonic() < end:
        try:
            data, anc, _flags, _addr = sock.recvmsg(2048, 256)
        except TimeoutError:
            continue
        t = time.monotonic_ns()
        rx_real = 0
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= 16:
                sec, nsec = struct.unpack_from("qq", payload)
                rx_real = sec * 1_000_000_000 + nsec
                t = rx_real - offset_ns
                kernel_stamped += 1
        try:
            msg = dec.decode(data, time.time())
        except wire.Dropped:
            continue
        b = msg.body
        if isinstance(b, wire.Offer | wire.Refuse):
            lat.append((t - (b.placement_id >> 8)) / 1e6)
            if rx_real:
                rx_by_pid[b.placement_id] = rx_real
            at.append(round(((b.placement_id >> 8) - start_ns) / 1e9, 4))
            if isinstance(b, wire.Offer):
                offers += 1
                if args.release_datagrams:
                    sock.sendto(enc.encode(wire.Release(b.placement_id), 1, time.time()), dst)
            else:
                refusals += 1
    sender.wait(30)
    sent = json.loads(Path(args.out + ".send").read_text())
    # the wire's view: from the probe's kernel TX stamp to its answer's kernel RX stamp (same
    # host, same CLOCK_REALTIME). A stamp whose number does not match its probe (the kernel
    # numbered a send that failed) shows as one before its probe was stamped by the sender, or
    # long after: those are counted and the wire figure is not reported if there are any.
    tx_ns = sent.pop("tx_ns", {})
    wire_lat: list[float] = []
    tx_mismatch = 0
    for pid, rx in rx_by_pid.items():
        txn = tx_ns.get(str(pid))
        if txn is None:
            continue
        if not 0 <= txn - offset_ns - (pid >> 8) < 1_000_000_000 or rx < txn:
            tx_mismatch += 1
            continue
        wire_lat.append((rx - txn) / 1e6)
    Path(args.out).write_text(json.dumps({**sent, "answered": len(lat), "offers": offers, "refusals": refusals,
                                          "kernel_stamped": kernel_stamped, "tx_stamped": len(wire_lat),
                                          "tx_mismatch": tx_mismatch, "lat_ms": lat, "t_s": at,
                                          "wire_lat_ms": wire_lat}))
    return sender.returncode


# --------------------------------------------------------------------------- the benchmark


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def measure(quick: bool, rate: int, without_airlock: bool = False, release_datagrams: bool = False,
            lease_ms: int = 100) -> dict[str, Any]:
    import psutil
    from conftest import delete_netns, kernel_ready, make_veth_pair
    from harness import ZoneAgent
    from killswitch import unit_nice

    why = kernel_ready()
    if why:
        raise SystemExit(f"footprint: cannot run here: {why}")
    idle_s = 10.0 if quick else 60.0
    load_s = 10.0 if quick else 60.0
    created = []
    agent = None
    with tempfile.TemporaryDirectory(prefix="lm-fp-") as tmpd:
        tmp = Path(tmpd)
        try:
            pair = make_veth_pair(created, subnet="10.78", tag="fp")
            a, b, ia, addr_a, addr_b = pair.a, pair.b, pair.ifname_a, pair.addr_a, pair.addr_b
            keys = tmp / "zone.keys"
            keys.write_text(f"1 {secrets.token_hex(32)}\n")
            os.chmod(keys, 0o600)
            zone = (f'[gpus]\ndeclared = 8\n\n[zone]\nnode_id = 1\nport = {PORT}\nkeys_file = "{keys}"\n'
                    f'cpus = 64\nmemory_mb = 64000\n\n'
                    f'[[zone.nodes]]\nid = 1\nzone = 1\naddr = "{addr_a}"\n\n'
                    f'[[zone.nodes]]\nid = 2\nzone = 1\naddr = "{addr_b}"\n\n'
                    f'[[zone.nodes]]\nid = 3\nzone = 1\naddr = "{addr_b}:7441"\n')
            agent = ZoneAgent(tmp, ia, a, extra_toml=zone, node="fp-agent")
            agent.airlock = not without_airlock  # default: the whole agent, every component
            agent.start(wait=True, timeout=90)
            assert agent.proc is not None
            proc = psutil.Process(agent.proc.pid)
            # the niceness systemd/laminard.service gives the agent (Nice=), as on a node (and
            # as bench/killswitch.py runs it); every thread, since Linux keeps one per thread
            for task in Path(f"/proc/{proc.pid}/task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(task.name), unit_nice())
            time.sleep(3.0)  # let start-up settle
            c0, w0 = sum(proc.cpu_times()[:2]), time.monotonic()
            time.sleep(idle_s)
            c1, w1 = sum(proc.cpu_times()[:2]), time.monotonic()
            idle_pct = (c1 - c0) / (w1 - w0) * 100
            rss0 = proc.memory_info().rss / 2**20
            t2 = proc.cpu_times()
            c2, w2 = t2.user + t2.system, time.monotonic()
            gen = b.popen(sys.executable, str(Path(__file__).resolve()), "--generator", "--role", "recv",
                          "--keys", str(keys), "--dst", addr_a, "--rate", str(rate), "--duration", str(load_s),
                          "--out", str(tmp / "gen.json"), "--lease-ms", str(lease_ms),
                          *(["--release-datagrams"] if release_datagrams else []))
            rss_samples = []
            while gen.poll() is None:
                rss_samples.append(proc.memory_info().rss / 2**20)
                time.sleep(0.5)
            t3 = proc.cpu_times()
            c3, w3 = t3.user + t3.system, time.monotonic()
            time.sleep(0.5)
            rss1 = proc.memory_info().rss / 2**20
            if gen.returncode != 0:
                raise RuntimeError(f"load generator failed ({gen.returncode})")
            g = json.loads((tmp / "gen.json").read_text())
            g["unanswered"] = g["sent"] - g["answered"]
            stats = agent.json("zone", "stats")
        finally:
            if agent is not None:
                agent.cleanup()
            for ns in created:
                delete_netns(ns)
    lat = g["lat_ms"]
    wl = g.get("wire_lat_ms", [])
    wire_ok = bool(wl) and g.get("tx_mismatch", 0) == 0
    return {
        "rss_mb": round(rss0, 1),
        "rss_after_load_mb": round(rss1, 1),
        "rss_growth_mb": round(rss1 - rss0, 2),
        "idle_cpu_pct": round(idle_pct, 3),
        "load_cpu_pct": round((c3 - c2) / (w3 - w2) * 100, 1),
        "load_cpu_user_pct": round((t3.user - t2.user) / (w3 - w2) * 100, 1),  # Python
        "load_cpu_sys_pct": round((t3.system - t2.system) / (w3 - w2) * 100, 1),  # the kernel's share
        "probe_rate_target": rate,
        "probe_rate_sent": round(g["sent"] / g["elapsed_s"]),
        "probes_answered": g["answered"],
        "probes_unanswered": g["unanswered"],
        "probe_reply_kernel_stamped": g.get("kernel_stamped", 0),
        "probe_reply_p50_ms": round(pct(lat, 0.5), 3),
        "probe_reply_p90_ms": round(pct(lat, 0.90), 3),
        "probe_reply_p99_ms": round(pct(lat, 0.99), 3),
        "probe_reply_over_2ms_pct": round(100 * sum(1 for x in lat if x > 2.0) / max(1, len(lat)), 2),
        "probe_reply_max_ms": round(max(lat), 3) if lat else None,
        "probe_reply_wire_p50_ms": round(pct(wl, 0.5), 3) if wire_ok else None,
        "probe_reply_wire_p99_ms": round(pct(wl, 0.99), 3) if wire_ok else None,
        "probe_reply_wire_over_2ms_pct": round(100 * sum(1 for x in wl if x > 2.0) / max(1, len(wl)), 2) if wire_ok else None,
        "probe_tx_stamped": g.get("tx_stamped", 0),
        "probe_tx_mismatch": g.get("tx_mismatch", 0),
        "offers": g["offers"],
        "refusals": g["refusals"],
        "agent_drops": sum(v for k, v in stats["drops"].items() if k != "accepted"),
        "agent_udp_received": stats["udp"]["received"],
        "agent_udp_sent": stats["udp"]["sent"],
        "agent_probes": stats["counts"]["probes"],
        "idle_s": idle_s,
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "components": "all" if not without_airlock else "all but airlock",
        "releases": "datagrams" if release_datagrams else "on the next probe",
        "probe_lease_ms": lease_ms,
        "agent_nice": unit_nice(),
        "load_s": load_s,
        "_lat": lat,
        "_lat_t": g.get("t_s", []),
        "_rss": rss_samples,
    }


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.scatter(res["_lat_t"], res["_lat"], s=1, alpha=0.3)
    a.axhline(2.0, ls=":", c="gray", label="goal: p99 < 2 ms")
    a.set_yscale("log")
    a.set_xlabel("seconds into the load")
    a.set_ylabel("probe reply latency (ms)")
    a.set_title(f"Reply latency at {res['probe_rate_sent']} probes/s (p99 {res['probe_reply_p99_ms']} ms)")
    a.legend(fontsize=8)
    rss = res["_rss"]
    b.plot([i * 0.5 for i in range(len(rss))], rss, label="agent RSS under load")
    b.axhline(60, ls=":", c="gray", label="goal: < 60 MB")
    b.set_ylim(0, max(80, max(rss or [0]) * 1.2))
    b.set_xlabel("seconds")
    b.set_ylabel("MB")
    b.set_title(f"RSS {res['rss_mb']} MB, growth {res['rss_growth_mb']} MB; idle CPU {res['idle_cpu_pct']} %")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 s idle, 10 s load (else 60 s each)")
    ap.add_argument("--json", help="write the flat result object here")
    ap.add_argument("--plot", help="write a PNG here")
    ap.add_argument("--rate", type=int, default=10_000, help="probes per second (default 10000)")
    ap.add_argument("--without-airlock", action="store_true",
                    help="diagnosis: run the agent without its Airlock component (to see what the rest costs)")
    ap.add_argument("--release-datagrams", action="store_true",
                    help="release every offer by a datagram (the earlier protocol) instead of on the next probe")
    ap.add_argument("--lease-ms", type=int, default=100, help="the probes' lease (default 100, the agents' lease_s)")
    ap.add_argument("--generator", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--keys", help=argparse.SUPPRESS)
    ap.add_argument("--role", choices=["send", "recv"], help=argparse.SUPPRESS)
    ap.add_argument("--fd", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--duration", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generator:
        return generator(args)
    res = measure(args.quick, args.rate, args.without_airlock, args.release_datagrams, args.lease_ms)
    if args.plot:
        plot(res, args.plot)
    flat = {k: v for k, v in res.items() if not k.startswith("_")}
    print(json.dumps(flat, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(flat, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
