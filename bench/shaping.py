"""A checkpoint transfer with a deadline while iperf3 runs background traffic (BENCHMARKS.md: shaping).

One veth pair between two namespaces stands for the node's uplink. The agent's HTB tree is on
it: the root class caps the link at 200 Mbit/s (checked at the start of every run by a bulk TCP
iperf3 stream: ``link_measured_mbps``), the background class has a floor of 140 Mbit/s, the
migration class the remaining 60. iperf3 (Debian) sends background UDP from the node to its peer
at a fixed offered rate of 140 Mbit/s (what the floor guarantees). Three phases, same run, same
link, same shaping tree, repeated ``repetitions`` times:

1. background alone (the reference);
2. background + an *unshaped* transfer (no lm_flows entry: it lands in the background class,
   so background and transfer together ask for 140 + whatever TCP takes of a 200 Mbit/s link);
3. background + the same transfer *shaped*: registered with the transfer registry (real code),
   steered by netguard into its own HTB leaf, its rate set by the shaper every 100 ms.

How the background is measured: what the peer's UDP stack *delivered* to iperf3's socket
(``Udp: InDatagrams`` of the peer's namespace, sampled every 5 ms from ``/proc/PID/net/snmp``),
over exactly the interval the transfer ran (from the sink's accept to its EOF, CLOCK_MONOTONIC).
The reference is the same-length window of phase 1 at the same offset from the start of the
background. Averages over the whole phase would hide the harm: a UDP sender on the node is
back-pressured by the local qdisc (its socket blocks, nothing is "lost") and iperf3 ``-b`` then
sends in bursts to catch up its average once the transfer is over.

``background_degradation_pct`` = (reference - with shaped transfer) / reference over that
window, in percent, signed (a negative figure is noise: the background got more than in the
reference); ``unshaped_background_degradation_pct`` the same with the unshaped transfer;
``deadline_met_ratio`` = shaped transfers done by their deadline / transfers (each transfer
needs 40 Mbit/s, inside the 60 Mbit/s budget: feasible); ``transfer_goodput_mbps`` = the shaped
transfer's bytes over its time. Compared with ReclaimNet's "<3% background degradation".

netguard is loaded and attached by a small process that does what NetGuard.start does (the
kernel side is the same; the agent's other components are not needed here).

    python bench/shaping.py [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "agent"))

from laminar.bpf.libbpf import BpfMap  # noqa: E402
from laminar.net import killswitch as ks  # noqa: E402
from laminar.net.htb import HtbTree  # noqa: E402
from laminar.net.transfers import TransferRegistry  # noqa: E402

PY = sys.executable
MBIT = 1_000_000
LINK, FLOOR, BG_RATE = 200 * MBIT, 140 * MBIT, 140 * MBIT
RECLAIMNET_PCT = 3.0

STANDIN = r"""
import signal, sys
from laminar.bpf.libbpf import BpfObject, object_path
from laminar.net import tc
obj = BpfObject.open(object_path("netguard"), pin_root=sys.argv[1]); obj.load()
idx = tc.ifindex_of(sys.argv[2]); tc.ensure_clsact(idx)
for d, n in (("egress", "lm_egress"), ("ingress", "lm_ingress")):
    tc.attach_bpf(idx, d, obj.program(n).fd, n)
print("ready", flush=True); signal.pause()
"""

# TCP sink: argv port; accepts one connection, reads to EOF; prints bytes, accept and EOF times
# (CLOCK_MONOTONIC ns, the same clock in every namespace).
SINK = r"""
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1]))); srv.listen(1); print("ready", flush=True)
c, _ = srv.accept(); t0 = time.monotonic_ns(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(n, t0, time.monotonic_ns(), flush=True)
"""

SOURCE = r"""
import socket, sys
dst, port, sport, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", sport)); s.connect((dst, port)); buf = b"\0" * (1 << 16); left = total
while left > 0:
    left -= s.send(buf[: min(left, len(buf))])
s.close()
"""

BG_PAYLOAD = 1400  # UDP payload bytes per background datagram (iperf3 -l)
SAMPLE_S = 0.005   # how often the peer's UDP counters are read


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, text=True, capture_output=True)


def nsx(ns: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{ns}", "--"]


def wait_ready(p: subprocess.Popen[str], what: str) -> None:
    assert p.stdout is not None
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{what} did not start")


def udp_in_datagrams(pid: int) -> int:
    """``Udp: InDatagrams`` of the network namespace process `pid` is in (datagrams delivered to sockets)."""
    lines = [x for x in Path(f"/proc/{pid}/net/snmp").read_text().splitlines() if x.startswith("Udp:")]
    names, values = lines[0].split()[1:], lines[1].split()[1:]
    return int(values[names.index("InDatagrams")])


class Sampler(threading.Thread):
    """Reads the peer namespace's UDP delivery counter every SAMPLE_S: (monotonic ns, datagrams)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[int, int]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                n = udp_in_datagrams(self.pid)
            except (OSError, IndexError, ValueError):
                break  # the process is gone
            self.samples.append((time.monotonic_ns(), n))
            time.sleep(SAMPLE_S)

    def at(self, t_ns: int) -> float:
        """Datagrams delivered by time t_ns (linear between the two samples around it)."""
        s = self.samples
        lo = bisect.bisect_left(s, (t_ns, -1))
        if lo == 0 or lo >= len(s):
            raise ValueError(f"time {t_ns} outside the samples ({s[0][0]}..{s[-1][0]})")
        (t0, n0), (t1, n1) = s[lo - 1], s[lo]
        return n0 + (n1 - n0) * (t_ns - t0) / max(1, t1 - t0)

    def mbps(self, t0_ns: int, t1_ns: int) -> float:
        """Background Mbit/s (UDP payload) delivered over [t0, t1]."""
        return (self.at(t1_ns) - self.at(t0_ns)) * BG_PAYLOAD * 8 / ((t1_ns - t0_ns) / 1e9) / 1e6

    def first_arrival(self) -> int:
        """When the first background datagram was delivered (the background's start)."""
        base = self.samples[0][1]
        return next(t for t, n in self.samples if n > base)


def link_check(a: str, b: str, addr_b: str, secs: float) -> float:
    """Bulk TCP alone through the tree (background class, ceil = link): Mbit/s the peer received.
    Shows that the link cap exists, so background + unshaped transfer really oversubscribe it."""
    port = 5300 + secrets.randbelow(600)
    srv = subprocess.Popen([*nsx(b), "iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = sh(*nsx(a), "iperf3", "-c", addr_b, "-p", str(port), "-t", str(secs), "-J").stdout
        return float(json.loads(out)["end"]["sum_received"]["bits_per_second"]) / 1e6
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()


def phase(a: str, b: str, addr_b: str, secs: float, transfer: tuple[int, float, int] | None,
          reg: TransferRegistry | None, tag: str) -> dict[str, Any]:
    """One phase: background UDP for `secs`; optionally a transfer (bytes, deadline s, sport)
    started 1 s in, shaped when `reg` is given. Returns the background's counter samples, its
    start, and the transfer's bytes and interval."""
    port = 5300 + secrets.randbelow(600)
    srv = subprocess.Popen([*nsx(b), "iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    sampler = Sampler(srv.pid)  # nsenter execs iperf3: this pid is the server, in the peer's namespace
    sampler.start()
    cli = subprocess.Popen([*nsx(a), "iperf3", "-u", "-c", addr_b, "-p", str(port), "-t", str(secs), "-b",
                            str(BG_RATE), "-l", str(BG_PAYLOAD), "-J"], stdout=subprocess.PIPE, text=True)
    res: dict[str, Any] = {"sampler": sampler}
    stop = threading.Event()
    try:
        if transfer is not None:
            total, deadline_s, sport = transfer
            time.sleep(1.0)
            sink = subprocess.Popen([*nsx(b), PY, "-c", SINK, "7300"], stdout=subprocess.PIPE, text=True)
            wait_ready(sink, "sink")
            t = None
            if reg is not None:
                key = ks.FlowKey("tcp", addr_b.rsplit(".", 1)[0] + ".1", sport, addr_b, 7300)
                t = reg.add("bench", 1, key, total, deadline_s, transfer_id=f"bench-{tag}")

                def ticker() -> None:
                    while not stop.wait(0.1):
                        reg.tick()

                threading.Thread(target=ticker, daemon=True).start()
            src = subprocess.Popen([*nsx(a), PY, "-c", SOURCE, addr_b, "7300", str(sport), str(total)])
            out, _ = sink.communicate(timeout=secs + 60)
            src.wait(10)
            stop.set()
            n, t0, t1 = (int(x) for x in out.split())
            res.update(transfer_bytes=n, t0=t0, t1=t1, transfer_s=(t1 - t0) / 1e9, deadline_s=deadline_s,
                       met=(t1 - t0) / 1e9 <= deadline_s)
            if reg is not None and t is not None:
                reg.remove(t.id)
        out, _ = cli.communicate(timeout=secs + 30)
        end = json.loads(out)["end"]
        res["iperf3_sender_mbps"] = end["sum"]["bits_per_second"] / 1e6
    finally:
        stop.set()
        for p in (cli, srv):
            if p.poll() is None:
                p.kill()
            p.wait()
        sampler.halt.set()
        sampler.join(5)
    res["bg_start"] = sampler.first_arrival()
    return res


def run(quick: bool) -> dict[str, Any]:
    tag = secrets.token_hex(3)
    a, b = f"lm-t-shb-a-{tag}", f"lm-t-shb-b-{tag}"
    ia, ib = f"lmt{tag}a", f"lmt{tag}b"
    addr_a, addr_b = "10.79.2.1", "10.79.2.2"
    pin_root = Path(f"/sys/fs/bpf/laminar-t-shb-{tag}")
    standin = None
    tree = None
    load = os.getloadavg()[0]
    try:
        for ns in (a, b):
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", ia, "netns", a, "type", "veth", "peer", "name", ib, "netns", b)
        for ns, ifn, addr in ((a, ia, addr_a), (b, ib, addr_b)):
            sh(*nsx(ns), "ip", "addr", "add", f"{addr}/24", "dev", ifn)
            sh(*nsx(ns), "ip", "link", "set", ifn, "up")
        standin = subprocess.Popen([*nsx(a), PY, "-c", STANDIN, str(pin_root), ia], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": str(REPO / "agent")})
        wait_ready(standin, "netguard stand-in")
        tree = HtbTree(ia, LINK, FLOOR, netns=a)
        tree.setup()
        reg = TransferRegistry(tree=tree, flows_map=BpfMap.from_pin(pin_root / "lm_flows"))
        reg.configure(LINK, FLOOR, margin=0.1)
        link_mbps = link_check(a, b, addr_b, 2.0 if quick else 5.0)
        secs = 8.0 if quick else 16.0
        deadline = 5.0 if quick else 10.0
        total = int(40 * MBIT / 8 * deadline)  # needs 40 Mbit/s (44 with the margin): inside the 60 Mbit/s budget
        reps = 1 if quick else 3
        rows: list[dict[str, Any]] = []
        for r in range(reps):
            alone = phase(a, b, addr_b, secs, None, None, f"a{r}")
            unshaped = phase(a, b, addr_b, secs, (total, deadline, 40300 + 2 * r), None, f"u{r}")
            shaped = phase(a, b, addr_b, secs, (total, deadline, 40301 + 2 * r), reg, f"s{r}")
            row: dict[str, Any] = {"shaped": shaped, "unshaped": unshaped}
            for kind, ph in (("shaped", shaped), ("unshaped", unshaped)):
                # The same window of phase 1: same offset from the background's start, same length.
                off0, off1 = ph["t0"] - ph["bg_start"], ph["t1"] - ph["bg_start"]
                ref = alone["sampler"].mbps(alone["bg_start"] + off0, alone["bg_start"] + off1)
                got = ph["sampler"].mbps(ph["t0"], ph["t1"])
                row[f"{kind}_ref_mbps"], row[f"{kind}_bg_mbps"] = ref, got
                row[f"{kind}_deg_pct"] = (ref - got) / ref * 100
            rows.append(row)

        def mean(key: str) -> float:
            return sum(x[key] for x in rows) / reps

        deg, deg_u = mean("shaped_deg_pct"), mean("unshaped_deg_pct")
        shaped_goodput = [x["shaped"]["transfer_bytes"] * 8 / x["shaped"]["transfer_s"] / 1e6 for x in rows]
        unshaped_goodput = [x["unshaped"]["transfer_bytes"] * 8 / x["unshaped"]["transfer_s"] / 1e6 for x in rows]
        return {
            "background_degradation_pct": round(deg, 2),
            "background_degradation_max_pct": round(max(x["shaped_deg_pct"] for x in rows), 2),
            "unshaped_background_degradation_pct": round(deg_u, 2),
            "deadline_met_ratio": sum(1 for x in rows if x["shaped"]["met"]) / reps,
            "unshaped_deadline_met_ratio": sum(1 for x in rows if x["unshaped"]["met"]) / reps,
            "transfer_goodput_mbps": round(sum(shaped_goodput) / reps, 1),
            "unshaped_transfer_goodput_mbps": round(sum(unshaped_goodput) / reps, 1),
            "transfer_seconds_max": round(max(x["shaped"]["transfer_s"] for x in rows), 2),
            "unshaped_transfer_seconds_max": round(max(x["unshaped"]["transfer_s"] for x in rows), 2),
            "deadline_s": deadline, "transfer_bytes": total, "repetitions": reps,
            "background_ref_mbps": round(mean("shaped_ref_mbps"), 1),
            "background_shaped_mbps": round(mean("shaped_bg_mbps"), 1),
            "background_unshaped_ref_mbps": round(mean("unshaped_ref_mbps"), 1),
            "background_unshaped_mbps": round(mean("unshaped_bg_mbps"), 1),
            "link_mbps": LINK / 1e6, "link_measured_mbps": round(link_mbps, 1),
            "background_floor_mbps": FLOOR / 1e6, "background_offered_mbps": BG_RATE / 1e6,
            "reclaimnet_pct": RECLAIMNET_PCT,
            "ratio_vs_reclaimnet": round(RECLAIMNET_PCT / max(deg, 0.01), 1),
            "loadavg_1m_at_start": round(load, 2),
        }
    finally:
        if tree is not None:
            try:
                tree.teardown()
            except Exception:
                pass
        if standin is not None:
            standin.kill()
            standin.wait()
        for ns in (a, b):
            sh("ip", "netns", "delete", ns, check=False)
        shutil.rmtree(pin_root, ignore_errors=True)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax1.bar(["alone\n(reference)", "+ unshaped\ntransfer", "+ shaped\ntransfer"],
            [res["background_ref_mbps"], res["background_unshaped_mbps"], res["background_shaped_mbps"]],
            color=["grey", "tab:red", "tab:green"])
    ax1.set_ylabel("background during the transfer (Mbit/s)")
    ax1.set_title(f"background degradation: {res['background_degradation_pct']}% shaped, "
                  f"{res['unshaped_background_degradation_pct']}% unshaped", fontsize=9)
    ax2.bar(["unshaped", "shaped"], [res["unshaped_transfer_goodput_mbps"], res["transfer_goodput_mbps"]],
            color=["tab:red", "tab:green"])
    ax2.axhline(res["transfer_bytes"] * 8 / res["deadline_s"] / 1e6, color="black", linestyle="--",
                label="rate needed for the deadline")
    ax2.set_ylabel("transfer goodput (Mbit/s)")
    ax2.set_title(f"deadline met: {res['deadline_met_ratio']:.0%} shaped", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repetition of 8 s phases (< 60 s); default: three of 16 s")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a PNG here")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("iperf3") is None:
        print("bench/shaping.py needs root and iperf3 (make setup)", file=sys.stderr)
        return 1
    res = run(args.quick)
    res.update(date=time.strftime("%Y-%m-%d"), machine=f"{os.uname().nodename} {os.uname().release} "
                                                       f"{os.cpu_count()} cpus")
    if args.plot:
        plot(res, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
