"""Kill-switch latency under a UDP flood across a veth pair (BENCHMARKS.md: killswitch).

Two namespaces joined by a veth; the real agent (laminard, at the unit's ``Nice=``) runs in the
node's namespace with netguard attached to the veth; a flood of UDP packets goes from the node
to its peer, each packet carrying the CLOCK_MONOTONIC time it was handed to the kernel (the
clock is the same in every namespace). The receiver keeps the stamp of every packet that got
through. Per trial:

* data plane: the bench writes the flow's kill bit into the pinned ``lm_flows`` map itself;
  ``dataplane_us`` = stamp of the last packet that passed - start of the map write (0 when no
  packet sent after the write began got through); ``leaked`` = packets stamped after the map
  write *returned* that still got through (must be 0).
* end to end: ``POST /v1/killswitch/flow {"action": "on"}`` on the agent's control socket by a
  minimal HTTP/1.1 client (one connection per request, as laminarctl; the request is built after
  the clock starts); ``e2e_us`` = stamp of the last packet that passed - the moment the client
  started the request. Enforcement begins at the agent's map write, so the answer and the event
  the agent records after it do not count; ``e2e_api_roundtrip_*`` is the whole round trip.

CPU placement, two rounds in the same run on the same rig:

* ``pinned`` (the headline keys): the flood's sender and receiver are confined to CPU 0, the
  agent and the requesting client to CPU 1. This is a node where jobs run under cgroup CPU limits
  (cpuset/quota) and the node agent has a CPU of its own, as a GPU node reserves system CPUs.
* ``shared`` (``*_shared_*`` keys): no placement at all; the flood's two busy processes, the
  agent and the client share both CPUs of this 2-core VM, plus whatever else the machine runs
  (``loadavg_1m_at_start`` says how busy it was).

``flood_pps`` is the packets per second that reached the receiver while nothing was cut.
Compared with ReclaimNet's claim of a sub-millisecond kill-switch (1000 us).

    python bench/killswitch.py [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import array
import bisect
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "agent"))

from laminar.bpf.libbpf import BpfMap  # noqa: E402
from laminar.net import killswitch as ks  # noqa: E402

PY = sys.executable
RECLAIMNET_US = 1000.0

# Keeps the stamp of every packet it hands to the kernel (passed or dropped), so a trial can
# tell when the flood was not flowing across the cut (the sender itself descheduled).
SENDER = r"""
import array, signal, socket, struct, sys, time
dst, dport, sport, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", sport))
pack, now, addr = struct.Struct("=q").pack, time.monotonic_ns, (dst, dport)
sent = array.array("q"); keep = sent.append
def done(*_):
    with open(out, "wb") as f:
        sent.tofile(f)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
print("ready", flush=True)
while True:
    t = now()
    try:
        s.sendto(pack(t), addr)
    except OSError:
        pass
    keep(t)
"""

RECEIVER = r"""
import array, signal, socket, struct, sys
port, out = int(sys.argv[1]), sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", port))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
import time
stamps = array.array("q"); recvd = array.array("q"); unpack = struct.Struct("=q").unpack_from
now = time.monotonic_ns
def done(*_):
    with open(out, "wb") as f:
        stamps.tofile(f)
    with open(out + ".recv", "wb") as f:
        recvd.tofile(f)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
print("ready", flush=True)
while True:
    stamps.append(unpack(s.recv(64))[0]); recvd.append(now())
"""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, text=True, capture_output=True)


def ns_argv(ns: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{ns}", "--"]


class Rig:
    """Namespaces, veth, the agent, sender and receiver; close() removes everything."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.tag = tag
        self.ns_a, self.ns_b = f"lm-t-ksb-a-{tag}", f"lm-t-ksb-b-{tag}"
        self.if_a, self.if_b = f"lmt{tag}a", f"lmt{tag}b"
        self.addr_a, self.addr_b = "10.79.1.1", "10.79.1.2"
        self.tmp = Path(tempfile.mkdtemp(prefix="lm-t-ksb-"))
        self.pin_root = Path(f"/sys/fs/bpf/laminar-t-ksb-{tag}")
        self.cg_root = f"laminar-t-ksb-{tag}"
        self.procs: list[subprocess.Popen[str]] = []
        self.agent: subprocess.Popen[str] | None = None

    def up(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.if_a, "netns", self.ns_a, "type", "veth", "peer", "name", self.if_b,
           "netns", self.ns_b)
        for ns, ifn, addr in ((self.ns_a, self.if_a, self.addr_a), (self.ns_b, self.if_b, self.addr_b)):
            sh(*ns_argv(ns), "ip", "addr", "add", f"{addr}/24", "dev", ifn)
            sh(*ns_argv(ns), "ip", "link", "set", ifn, "up")
            sh(*ns_argv(ns), "ip", "link", "set", "lo", "up")
        cfg = self.tmp / "laminard.toml"
        cfg.write_text(f"""[agent]
state_dir = "{self.tmp}/state"
socket = "{self.tmp}/laminard.sock"
[bpf]
pin_root = "{self.pin_root}"
pressure = false
[net]
uplink = "{self.if_a}"
[metrics]
listen = ""
[cgroups]
root = "{self.cg_root}"
""")
        # The agent runs at the niceness systemd/laminard.service gives it (Nice=), as on a node.
        self.agent = subprocess.Popen([*ns_argv(self.ns_a), "nice", "-n", str(unit_nice()),
                                       str(REPO / ".venv/bin/laminard"), "--config", str(cfg)],
                                      stdout=subprocess.DEVNULL, stderr=open(self.tmp / "agent.log", "w"), text=True)
        for _ in range(200):
            if (self.tmp / "laminard.sock").exists() and (self.pin_root / "lm_flows").exists():
                break
            if self.agent.poll() is not None:
                raise RuntimeError(f"laminard exited: {(self.tmp / 'agent.log').read_text()[-2000:]}")
            time.sleep(0.05)
        else:
            raise RuntimeError("laminard did not come up in 10 s")

    def start(self, ns: str, code: str, *args: str) -> subprocess.Popen[str]:
        p = subprocess.Popen([*ns_argv(ns), PY, "-c", code, *args], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"helper in {ns} failed to start")
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGCONT)
            self.agent.terminate()
            try:
                self.agent.wait(10)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()
        for ns in (self.ns_a, self.ns_b):
            sh("ip", "netns", "delete", ns, check=False)
        shutil.rmtree(self.pin_root, ignore_errors=True)
        for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/freezer"):
            root = Path(base, self.cg_root)
            if root.is_dir():
                for d in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
                    if d.is_dir():
                        d.rmdir()
                root.rmdir()
        shutil.rmtree(self.tmp, ignore_errors=True)


def unit_nice() -> int:
    """The Nice= of systemd/laminard.service (0 when it sets none)."""
    for line in (REPO / "systemd/laminard.service").read_text().splitlines():
        if line.startswith("Nice="):
            return int(line.split("=", 1)[1])
    return 0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


FLOOD_CPU, AGENT_CPU = 0, 1
# A trial counts only when the flood kept flowing across the cut: the last packet that passed and
# the first one the switch dropped were sent at most this far apart (the flood sends one every
# few us; a wider gap is the sender being descheduled, which would hide when the cut happened).
MAX_GAP_NS = 50_000


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Pins every thread of process `pid` to `cpus`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass


def post_raw(sock_path: str, path: str, body: dict[str, Any]) -> tuple[int, int]:
    """One request the way a lean client sends it: connect, one write, read to EOF. Returns the
    status and when the request had been written (monotonic ns)."""
    data = json.dumps(body).encode()
    req = (f"POST {path} HTTP/1.1\r\nHost: laminar\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sock_path)
        s.sendall(req)
        written = time.monotonic_ns()
        resp = b""
        while chunk := s.recv(65536):
            resp += chunk
    return int(resp.split(b" ", 2)[1]), written


def trials_round(rig: Rig, flows: BpfMap, key: ks.FlowKey, trials: int,
                 tag: str) -> list[tuple[str, int, int, int, int]]:
    """`trials` of each kind, alternating; returns (mode, start ns, return ns, restore ns, request
    written ns (e2e; else the return)) per trial."""
    kb = key.pack()
    sock_path = str(rig.tmp / "laminard.sock")
    marks: list[tuple[str, int, int, int, int]] = []
    for i in range(trials * 2):
        mode = f"dataplane{tag}" if i % 2 == 0 else f"e2e{tag}"
        time.sleep(0.02 + secrets.randbelow(20) / 1000)  # a random phase against the flood
        if i % 2 == 0:
            # The value is built first: what is timed is the map write (one bpf syscall).
            entry = ks.FlowEntry.unpack(flows.lookup(kb) or bytes(40))
            entry.flags |= ks.LM_FLOW_KILL
            vb = entry.pack()
            ws = time.monotonic_ns()
            flows.update(kb, vb)
            we = written = time.monotonic_ns()
        else:
            ws = time.monotonic_ns()
            status, written = post_raw(sock_path, "/v1/killswitch/flow", {"flow": str(key), "action": "on"})
            we = time.monotonic_ns()
            if status >= 300:
                raise RuntimeError(f"POST /v1/killswitch/flow answered {status}")
        time.sleep(0.03)
        off = time.monotonic_ns()
        ks.apply_flow_switch(flows, key, "off", None)
        marks.append((mode, ws, we, off, written))
    return marks


def run(trials: int, client_nice: int) -> dict[str, Any]:
    rig = Rig()
    load = os.getloadavg()[0]
    try:
        rig.up()
        assert rig.agent is not None
        flows = BpfMap.from_pin(rig.pin_root / "lm_flows")
        sport, dport = 41500, 9500
        key = ks.FlowKey("udp", rig.addr_a, sport, rig.addr_b, dport)
        ks.apply_flow_switch(flows, key, "off", None)  # creates the entry (no class)
        out = rig.tmp / "stamps.bin"
        rx = rig.start(rig.ns_b, RECEIVER, str(dport), str(out))
        sent_out = rig.tmp / "sent.bin"
        tx = rig.start(rig.ns_a, SENDER, rig.addr_b, str(dport), str(sport), str(sent_out))
        everything = set(range(os.cpu_count() or 1))
        pinned = len(everything) >= 2
        if pinned:
            for pid in (rx.pid, tx.pid):  # nsenter execs python: these are the flood's processes
                set_affinity(pid, {FLOOD_CPU})
            set_affinity(rig.agent.pid, {AGENT_CPU})
            os.sched_setaffinity(0, {AGENT_CPU})
        # Only this process (the client) changes: the agent and the flood were started before.
        os.setpriority(os.PRIO_PROCESS, 0, client_nice)
        time.sleep(0.5)
        flood_from = time.monotonic_ns()
        time.sleep(0.5)
        flood_to = time.monotonic_ns()
        marks = trials_round(rig, flows, key, trials, "")
        if pinned:  # the same trials again with no placement at all
            for pid in (rx.pid, tx.pid, rig.agent.pid):
                set_affinity(pid, everything)
            os.sched_setaffinity(0, everything)
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            time.sleep(0.3)
            marks += trials_round(rig, flows, key, trials, "_shared")
        time.sleep(0.05)
        for p in (tx, rx):
            p.send_signal(signal.SIGTERM)
        for p in (tx, rx):
            p.wait(60)  # they write a few million stamps; slow on a busy machine
        sent = array.array("q")
        sent.frombytes(sent_out.read_bytes())
        stamps, recvd = array.array("q"), array.array("q")
        stamps.frombytes(out.read_bytes())
        recvd.frombytes(Path(f"{out}.recv").read_bytes())
        flood_pps = sum(1 for r in recvd if flood_from <= r < flood_to) / ((flood_to - flood_from) / 1e9)
        # (send stamp, receive time), by send stamp. A packet stamped in a trial's window but
        # received after that trial's restore may have been preempted between its stamp and
        # sendto and gone through after the restore: it tells nothing about the cut, so it is
        # left out (its receive time says so).
        pairs = sorted(zip(stamps, recvd, strict=True))
        passed = [p[0] for p in pairs]

        lat: dict[str, list[float]] = {}
        leaked: list[int] = []
        api_us: dict[str, list[float]] = {}
        client_us: dict[str, list[float]] = {}
        gaps: dict[str, int] = {}
        for mode, ws, we, off, written in marks:
            lo = bisect.bisect_left(passed, ws - 5_000_000)
            hi = bisect.bisect_right(passed, off)
            window = [t for t, r in pairs[lo:hi] if r < off]
            if not window or window[0] > ws:
                continue  # the flood was not flowing at the time: not a measurement
            last = max(window)
            # The first packet sent after the last one that passed (dropped by the switch): the
            # cut lies between the two. A wide gap means the sender was off the cpu across the
            # cut, so the trial cannot say when enforcement began: left out, and counted.
            i = bisect.bisect_right(sent, last)
            if i >= len(sent) or sent[i] - last > MAX_GAP_NS:
                gaps[mode] = gaps.get(mode, 0) + 1
                continue
            lat.setdefault(mode, []).append(max(0.0, (last - ws) / 1000))
            if mode.startswith("dataplane"):
                leaked.append(sum(1 for t in window if t > we))
            else:
                api_us.setdefault(mode, []).append((we - ws) / 1000)
                client_us.setdefault(mode, []).append((written - ws) / 1000)
        dp, e2e = lat.get("dataplane", []), lat.get("e2e", [])
        res: dict[str, Any] = {
            "trials_dataplane": len(dp), "trials_e2e": len(e2e),
            "dataplane_p50_us": round(pct(dp, 50), 1), "dataplane_p99_us": round(pct(dp, 99), 1),
            "dataplane_max_us": round(max(dp), 1) if dp else None,
            "e2e_p50_us": round(pct(e2e, 50), 1), "e2e_p99_us": round(pct(e2e, 99), 1),
            "e2e_max_us": round(max(e2e), 1) if e2e else None,
            "e2e_api_roundtrip_p50_us": round(pct(api_us.get("e2e", []), 50), 1),
            "e2e_api_roundtrip_p99_us": round(pct(api_us.get("e2e", []), 99), 1),
            "e2e_client_write_p50_us": round(pct(client_us.get("e2e", []), 50), 1),
            "e2e_client_write_p99_us": round(pct(client_us.get("e2e", []), 99), 1),
            "leaked_packets_max": max(leaked) if leaked else None,
            "trials_left_out_sender_gap": gaps.get("dataplane", 0) + gaps.get("e2e", 0),
            "cpu_placement": (f"flood (sender, receiver) on cpu {FLOOD_CPU}, agent and client on cpu {AGENT_CPU}"
                              if pinned else "none (one cpu)"),
            "client_nice": client_nice,
        }
        if pinned:
            dps, e2es = lat.get("dataplane_shared", []), lat.get("e2e_shared", [])
            res.update({
                "shared_round": "no cpu placement, client at nice 0",
                "trials_e2e_shared": len(e2es),
                "trials_left_out_sender_gap_shared": gaps.get("dataplane_shared", 0) + gaps.get("e2e_shared", 0),
                "dataplane_shared_p50_us": round(pct(dps, 50), 1), "dataplane_shared_p99_us": round(pct(dps, 99), 1),
                "e2e_shared_p50_us": round(pct(e2es, 50), 1), "e2e_shared_p99_us": round(pct(e2es, 99), 1),
                "e2e_api_roundtrip_shared_p50_us": round(pct(api_us.get("e2e_shared", []), 50), 1),
                "e2e_client_write_shared_p99_us": round(pct(client_us.get("e2e_shared", []), 99), 1),
            })
        res.update({
            "flood_pps": round(flood_pps), "packets_passed": len(passed), "agent_nice": unit_nice(),
            "loadavg_1m_at_start": round(load, 2),
            "reclaimnet_us": RECLAIMNET_US,
            "ratio_vs_reclaimnet_dataplane_p99": round(RECLAIMNET_US / max(pct(dp, 99), 1.0), 3),
            "ratio_vs_reclaimnet_e2e_p99": round(RECLAIMNET_US / max(pct(e2e, 99), 1.0), 3),
            "_dp": dp, "_e2e": e2e, "_e2e_shared": lat.get("e2e_shared", []),
        })
        return res
    finally:
        rig.close()


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bins = [0, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
    data = [res["_dp"], res["_e2e"]]
    labels = ["data plane (map write)", "end to end (control API), agent on its own cpu"]
    if res["_e2e_shared"]:
        data.append(res["_e2e_shared"])
        labels.append("end to end, no cpu placement")
    ax.hist(data, bins=bins + [10000, 20000], label=labels)
    ax.set_xscale("log")
    ax.axvline(RECLAIMNET_US, color="red", linestyle="--", label="ReclaimNet: sub-millisecond")
    ax.set_xlabel("time from request to the last packet that passed (us)")
    ax.set_ylabel("trials")
    ax.set_title(f"kill-switch under a UDP flood: p99 data plane {res['dataplane_p99_us']} us, "
                 f"e2e {res['e2e_p99_us']} us", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="40 trials of each kind (< 60 s)")
    ap.add_argument("--trials", type=int, help="trials of each kind (default 300, quick 40)")
    ap.add_argument("--client-nice", type=int, default=0,
                    help="niceness of the requesting client in the pinned round (default 0: an ordinary root process)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a PNG here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/killswitch.py needs root (namespaces, BPF)", file=sys.stderr)
        return 1
    res = run(args.trials or (40 if args.quick else 300), args.client_nice)
    if args.plot:
        plot(res, args.plot)
    flat = {k: v for k, v in res.items() if not k.startswith("_")}
    flat.update(date=time.strftime("%Y-%m-%d"), machine=f"{os.uname().nodename} {os.uname().release} "
                                                        f"{os.cpu_count()} cpus")
    if args.json:
        Path(args.json).write_text(json.dumps(flat, indent=2) + "\n")
    print(json.dumps(flat, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
