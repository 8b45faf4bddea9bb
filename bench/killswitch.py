"""Kill-switch latency under a UDP flood across a veth pair (BENCHMARKS.md: killswitch).

Two namespaces joined by a veth; the real agent (laminard) runs in the node's namespace with
netguard attached to the veth; a flood of UDP packets goes from the node to its peer, each
packet carrying the CLOCK_MONOTONIC time it was handed to the kernel (the clock is the same in
every namespace). The receiver keeps the stamp of every packet that got through. Per trial:

* data plane: the bench writes the flow's kill bit into the pinned ``lm_flows`` map itself;
  ``dataplane_us`` = stamp of the last packet that passed - start of the map write (0 when no
  packet sent after the write began got through); ``leaked`` = packets stamped after the map
  write *returned* that still got through (must be 0).
* end to end: ``POST /v1/killswitch/flow {"action": "on"}`` on the agent's control socket;
  ``e2e_us`` = stamp of the last packet that passed - the moment the request was sent.

Compared with ReclaimNet's claim of a sub-millisecond kill-switch (1000 us).

    python bench/killswitch.py [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import array
import http.client
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

SENDER = r"""
import socket, struct, sys, time
dst, dport, sport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", sport))
pack, now, addr = struct.Struct("=q").pack, time.monotonic_ns, (dst, dport)
print("ready", flush=True)
while True:
    try:
        s.sendto(pack(now()), addr)
    except OSError:
        pass
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

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = http.client.HTTPConnection("laminar")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(self.tmp / "laminard.sock"))
        conn.sock = sock
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = json.loads(r.read() or b"{}")
        conn.close()
        if r.status >= 300:
            raise RuntimeError(f"{path}: {r.status} {data}")
        return data

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


def run(trials: int) -> dict[str, Any]:
    rig = Rig()
    try:
        rig.up()
        flows = BpfMap.from_pin(rig.pin_root / "lm_flows")
        sport, dport = 41500, 9500
        key = ks.FlowKey("udp", rig.addr_a, sport, rig.addr_b, dport)
        kb = key.pack()
        ks.apply_flow_switch(flows, key, "off", None)  # creates the entry (no class)
        out = rig.tmp / "stamps.bin"
        rx = rig.start(rig.ns_b, RECEIVER, str(dport), str(out))
        rig.start(rig.ns_a, SENDER, rig.addr_b, str(dport), str(sport))
        time.sleep(0.5)
        marks: list[tuple[str, int, int, int]] = []  # (mode, start ns, return ns, restore ns)
        for i in range(trials * 2):
            mode = "dataplane" if i % 2 == 0 else "e2e"
            time.sleep(0.02 + secrets.randbelow(20) / 1000)  # a random phase against the flood
            if mode == "dataplane":
                # The value is built first: what is timed is the map write (one bpf syscall).
                entry = ks.FlowEntry.unpack(flows.lookup(kb) or bytes(40))
                entry.flags |= ks.LM_FLOW_KILL
                vb = entry.pack()
                ws = time.monotonic_ns()
                flows.update(kb, vb)
                we = time.monotonic_ns()
            else:
                ws = time.monotonic_ns()
                rig.post("/v1/killswitch/flow", {"flow": str(key), "action": "on"})
                we = time.monotonic_ns()
            time.sleep(0.03)
            off = time.monotonic_ns()
            ks.apply_flow_switch(flows, key, "off", None)
            marks.append((mode, ws, we, off))
        time.sleep(0.05)
        for p in rig.procs[1:]:
            p.kill()
        rx.send_signal(signal.SIGTERM)
        rx.wait(10)
        stamps, recvd = array.array("q"), array.array("q")
        stamps.frombytes(out.read_bytes())
        recvd.frombytes(Path(f"{out}.recv").read_bytes())
        # (send stamp, receive time), by send stamp. A packet stamped in a trial's window but
        # received after that trial's restore may have been preempted between its stamp and
        # sendto and gone through after the restore: it tells nothing about the cut, so it is
        # left out (its receive time says so).
        pairs = sorted(zip(stamps, recvd, strict=True))
        passed = [p[0] for p in pairs]
        import bisect

        lat: dict[str, list[float]] = {"dataplane": [], "e2e": []}
        leaked: list[int] = []
        e2e_api_us: list[float] = []
        for mode, ws, we, off in marks:
            lo = bisect.bisect_left(passed, ws - 5_000_000)
            hi = bisect.bisect_right(passed, off)
            window = [t for t, r in pairs[lo:hi] if r < off]
            if not window or window[0] > ws:
                continue  # the flood was not flowing at the time: not a measurement
            last = max(window)
            lat[mode].append(max(0.0, (last - ws) / 1000))
            if mode == "dataplane":
                leaked.append(sum(1 for t in window if t > we))
            else:
                e2e_api_us.append((we - ws) / 1000)
        dp, e2e = lat["dataplane"], lat["e2e"]
        return {
            "trials_dataplane": len(dp), "trials_e2e": len(e2e),
            "dataplane_p50_us": round(pct(dp, 50), 1), "dataplane_p99_us": round(pct(dp, 99), 1),
            "dataplane_max_us": round(max(dp), 1) if dp else None,
            "e2e_p50_us": round(pct(e2e, 50), 1), "e2e_p99_us": round(pct(e2e, 99), 1),
            "e2e_api_roundtrip_p50_us": round(pct(e2e_api_us, 50), 1),
            "leaked_packets_max": max(leaked) if leaked else None,
            "packets_passed": len(passed),
            "reclaimnet_us": RECLAIMNET_US,
            "ratio_vs_reclaimnet_dataplane_p99": round(RECLAIMNET_US / max(pct(dp, 99), 1.0), 3),
            "ratio_vs_reclaimnet_e2e_p99": round(RECLAIMNET_US / max(pct(e2e, 99), 1.0), 3),
            "_dp": dp, "_e2e": e2e,
        }
    finally:
        rig.close()


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bins = [0, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
    ax.hist([res["_dp"], res["_e2e"]], bins=bins, label=["data plane (map write)", "end to end (control API)"])
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
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a PNG here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/killswitch.py needs root (namespaces, BPF)", file=sys.stderr)
        return 1
    res = run(args.trials or (40 if args.quick else 300))
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
