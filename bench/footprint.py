"""Footprint benchmark: one real laminard idle, then answering 10,000 probes/s.

The agent runs in a network namespace of the benchmark's own, joined by a veth to a second
namespace where a load generator plays another zone member: it sends signed probes at a fixed
rate, each naming the previous probe's placement as released (as a submitter that bound
elsewhere does: the release rides on its next probe to the node, ``wire.Probe.releases``, with
the agents' 0.1 s lease), and times each answer two ways: from the sender's clock read just
before it sent the probe to the kernel's RX timestamp of the answer (``probe_reply_*``), and
from the wire: from the kernel's TX timestamp of the probe (SO_TIMESTAMPING, software) to the
kernel's RX timestamp of its answer (SO_TIMESTAMPNS) (``probe_reply_wire_*``).

The load generator is ``bench/lmgen.c``, built here with the machine's C compiler: on a node
the probes come from other machines, and on a small machine a Python generator took more CPU
than the agent it loaded (about 60 % of a core against the agent's 50 %, on a 2-core VM), so
its scheduling showed up in the agent's reply times. The generator does no cryptography: this
script signs every probe beforehand with the agent's wire codec (each stamped with the time it
is due to leave, well inside the replay window) and checks and decodes every answer after the
load. Measured on the agent process: resident memory, CPU while idle, CPU under load (while
the probes are due), memory growth over the load; from the generator's records: the reply
latency. The idle RSS is also given as the agent's own memory (``rss_anon_mb``) and mapped files
(``rss_file_mb``), with the share of the agent's modules whose bytecode was cached when it started
(``agent_bytecode_cached_pct``; the rest it compiles at start, e.g. under
PYTHONDONTWRITEBYTECODE, which costs about 1.3 MB of idle RSS more). There is no baseline (absolute figures); the goals are in the issue (rss under 60 MB, idle
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
import shutil
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


# --------------------------------------------------------------------------- the load generator


def build_generator(out: Path) -> Path:
    """Compile bench/lmgen.c (the load generator, in C: see its header) to ``out``."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("footprint: no C compiler (cc, gcc or clang) to build the load generator bench/lmgen.c")
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-o", str(out), str(REPO / "bench" / "lmgen.c")], check=True)
    return out


def sign_probes(keys_file: Path, n: int, rate: int, lease_ms: int, base: int, path: Path) -> float:
    """Sign ``n`` probes (member node 2, placement ids ``base`` + k) into ``path`` for lmgen and
    return the wall-clock time (s) the first is due to leave: each probe carries the time it is
    due (they leave at ``rate``/s from then on; a late one is still well inside the replay
    window), and each names the previous one's placement as released, as a submitter that bound
    elsewhere does (``wire.Probe.releases``: the release rides on its next probe to the node)."""
    from laminar.zone import wire
    from laminar.zone.keys import load_keys

    enc = wire.Encoder(2, load_keys(str(keys_file)))
    t = time.perf_counter()
    for _ in range(200):  # time a few, then plan the start past the signing of the rest
        enc.encode(wire.Probe(base, 0, 10, 1, lease_ms, "", "", ()), 1, time.time(), to=1)
    per_probe = (time.perf_counter() - t) / 200
    start = time.time() + 1.0 + 2.0 * per_probe * n
    out = bytearray()
    for k in range(n):
        probe = wire.Probe(base + k, 0, 10, 1, lease_ms, "", "", (base + k - 1,) if k else ())
        d = enc.encode(probe, 1, start + k / rate, to=1)  # the MAC covers the receiver (wire v2)
        out += struct.pack("<H", len(d)) + d
    path.write_bytes(bytes(out))
    if time.time() > start - 0.3:
        raise RuntimeError("footprint: signing the probes took longer than planned; run again")
    return start


def read_results(keys_file: Path, base: int, send_path: Path, recv_path: Path, window_s: float) -> dict[str, Any]:
    """Check and decode lmgen's answers (the agent's wire codec, member node 1's signature) and
    time each: from its probe's send time on the sender's clock (``lat_ms``), and from the wire
    (``wire_lat_ms``): the probe's kernel TX stamp to its answer's kernel RX stamp (same host,
    same CLOCK_REALTIME). A TX stamp whose number does not match its probe (the kernel numbered
    a send that failed) shows as one before its probe was sent, or long after: those are
    counted, and the wire figure is not reported if there are any."""
    from laminar.zone import wire
    from laminar.zone.keys import load_keys

    raw = send_path.read_bytes()
    sends = [struct.unpack_from("<qqq", raw, i) for i in range(0, len(raw), 24)]
    n = len(sends)
    # CLOCK_REALTIME - CLOCK_MONOTONIC, as lmgen's clocks were (same host, no step in between)
    offset_ns = time.time_ns() - time.monotonic_ns()
    dec = wire.Decoder(load_keys(str(keys_file)), {1: 1, 2: 1, 3: 1}, window_s=window_s, node=2)
    lat: list[float] = []
    at: list[float] = []
    wire_lat: list[float] = []
    offers = refusals = tx_mismatch = kernel_stamped = 0
    start_ns = sends[0][0] if n else 0
    data = recv_path.read_bytes()
    i = 0
    while i + 18 <= len(data):
        rx_real, t_read = struct.unpack_from("<qq", data, i)
        (size,) = struct.unpack_from("<H", data, i + 16)
        dgram = data[i + 18 : i + 18 + size]
        i += 18 + size
        try:
            body = dec.decode(dgram, time.time()).body
        except wire.Dropped:
            continue
        if not isinstance(body, wire.Offer | wire.Refuse):
            continue
        k = body.placement_id - base
        if not 0 <= k < n or not sends[k][2]:
            continue
        send_ns, tx_real, _ok = sends[k]
        offers += isinstance(body, wire.Offer)
        refusals += isinstance(body, wire.Refuse)
        t = rx_real - offset_ns if rx_real else t_read
        kernel_stamped += bool(rx_real)
        lat.append((t - send_ns) / 1e6)
        at.append(round((send_ns - start_ns) / 1e9, 4))
        if rx_real and tx_real:
            if not 0 <= tx_real - offset_ns - send_ns < 1_000_000_000 or rx_real < tx_real:
                tx_mismatch += 1
                continue
            wire_lat.append((rx_real - tx_real) / 1e6)
    sent = sum(1 for x in sends if x[2])
    # the span of n sends is n - 1 intervals: the rate is the sends per interval
    elapsed = (sends[-1][0] - start_ns) / 1e9 * n / (n - 1) if n > 1 else 0.0
    return {"sent": sent, "send_failed": n - sent, "elapsed_s": elapsed, "answered": len(lat), "offers": offers,
            "refusals": refusals, "kernel_stamped": kernel_stamped, "tx_stamped": len(wire_lat),
            "tx_mismatch": tx_mismatch, "lat_ms": lat, "t_s": at, "wire_lat_ms": wire_lat}


# --------------------------------------------------------------------------- the benchmark


def bytecode_cached_pct() -> float:
    """The share (%) of the agent's modules (agent/laminar) whose bytecode is cached and no older
    than the source, as this process's settings find it (PYTHONPYCACHEPREFIX). The agent
    compiles the rest at start (PYTHONDONTWRITEBYTECODE, a read-only checkout: on every start),
    and those compilations' freed memory was a large and variable part of its idle RSS until
    laminar.agent.release_freed_memory (52.1 vs 57.6 MB at two commits whose data differ by 0.9)."""
    import importlib.util

    srcs = [p for p in (REPO / "agent" / "laminar").rglob("*.py") if "__pycache__" not in p.parts]
    fresh = 0
    for src in srcs:
        pyc = Path(importlib.util.cache_from_source(str(src)))
        try:
            fresh += pyc.stat().st_mtime >= src.stat().st_mtime
        except OSError:
            pass
    return round(100 * fresh / max(1, len(srcs)), 1)


def status_kib(pid: int, key: str) -> int:
    """A ``kB`` line of /proc/<pid>/status (RssAnon, RssFile), 0 where absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def measure(quick: bool, rate: int, without_airlock: bool = False, lease_ms: int = 100) -> dict[str, Any]:
    import psutil
    from conftest import delete_netns, kernel_ready, make_veth_pair
    from harness import ZoneAgent
    from killswitch import unit_nice

    why = kernel_ready()
    if why:
        raise SystemExit(f"footprint: cannot run here: {why}")
    idle_s = 10.0 if quick else 60.0
    load_s = 10.0 if quick else 60.0
    created: list[str] = []
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
                    f'[[zone.nodes]]\nid = 2\nzone = 1\naddr = "{addr_b}"\n')
            cached_pct = bytecode_cached_pct()  # before the agent writes any
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
            rss_anon, rss_file = status_kib(proc.pid, "RssAnon") / 1024, status_kib(proc.pid, "RssFile") / 1024
            n = int(load_s * rate)
            base = secrets.randbits(40) << 20  # placement ids base + k: unique to this run
            lmgen = build_generator(tmp / "lmgen")
            start = sign_probes(keys, n, rate, lease_ms, base, tmp / "probes.bin")
            gen = b.popen(str(lmgen), addr_a, str(PORT), str(rate), str(int(start * 1e9)), str(tmp / "probes.bin"),
                          str(tmp / "sends.bin"), str(tmp / "answers.bin"), "1500", str(PORT))  # from node 2's port
            # the agent's CPU is read when the first probe is due and when the last is
            rss_samples = []
            t2 = t3 = None
            w2 = w3 = 0.0
            last_rss = 0.0
            while gen.poll() is None:
                now = time.time()
                if t2 is None and now >= start:
                    t2, w2 = proc.cpu_times(), time.monotonic()
                if t2 is not None and t3 is None and now >= start + n / rate:
                    t3, w3 = proc.cpu_times(), time.monotonic()
                if time.monotonic() - last_rss >= 0.5:
                    rss_samples.append(proc.memory_info().rss / 2**20)
                    last_rss = time.monotonic()
                time.sleep(0.01)
            if gen.returncode != 0:
                raise RuntimeError(f"load generator failed ({gen.returncode})")
            if t2 is None or t3 is None:
                raise RuntimeError("load generator ended before its load did")
            c2, c3 = t2.user + t2.system, t3.user + t3.system
            time.sleep(0.5)
            rss1 = proc.memory_info().rss / 2**20
            g = read_results(keys, base, tmp / "sends.bin", tmp / "answers.bin", time.time() - start + 60)
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
        "rss_anon_mb": round(rss_anon, 1),  # idle, as rss_mb: the agent's own memory
        "rss_file_mb": round(rss_file, 1),  # idle: mapped files (libraries), shared with others
        "agent_bytecode_cached_pct": cached_pct,
        "rss_after_load_mb": round(rss1, 1),
        "rss_growth_mb": round(rss1 - rss0, 2),
        "idle_cpu_pct": round(idle_pct, 3),
        "load_cpu_pct": round((c3 - c2) / (w3 - w2) * 100, 1),
        "load_cpu_user_pct": round((t3.user - t2.user) / (w3 - w2) * 100, 1),  # Python
        "load_cpu_sys_pct": round((t3.system - t2.system) / (w3 - w2) * 100, 1),  # the kernel's share
        "probe_rate_target": rate,
        "probe_rate_sent": round(g["sent"] / g["elapsed_s"]) if g["elapsed_s"] else 0,
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
        "releases": "on the next probe",
        "probe_send_failed": g["send_failed"],
        "generator": "bench/lmgen.c",
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
    ap.add_argument("--lease-ms", type=int, default=100, help="the probes' lease (default 100, the agents' lease_s)")
    args = ap.parse_args()
    res = measure(args.quick, args.rate, args.without_airlock, args.lease_ms)
    if args.plot:
        plot(res, args.plot)
    flat = {k: v for k, v in res.items() if not k.startswith("_")}
    print(json.dumps(flat, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(flat, indent=2) + "\n")
    if not flat["probes_answered"]:  # no latency was measured: say why, never a quiet "nan"
        print(f"footprint: the agent answered none of {flat['probes_unanswered']} probes (it dropped "
              f"{flat['agent_drops']}: see its zone stats' drops by reason)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
