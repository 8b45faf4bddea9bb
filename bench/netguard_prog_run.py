"""netguard's cost per packet, by kind of packet, measured with BPF_PROG_TEST_RUN (no network).

Loads netguard.bpf.o objects (this build's, and any others given, e.g. one compiled from an older
revision) with empty maps pinned under a root of their own (/sys/fs/bpf/laminar-t-bench-<pid>),
pins lm_egress and lm_ingress there, and runs each program over prepared frames with
``bpftool prog run ... repeat N``: the kernel's average ns per run. Rounds alternate the objects
so that load on a shared machine hits them alike; the median of the rounds is printed. The
figures are the program alone (no stack, no qdisc) and indicative on a loaded machine.

    .venv/bin/python bench/netguard_prog_run.py [--repeat 1000000] [--rounds 5] [OLD.bpf.o ...]

Frames (64 bytes of UDP payload): IPv4 UDP; IPv6 UDP; IPv6 with hop-by-hop and destination
options headers before UDP; the first fragment of an IPv6 UDP datagram; a later fragment (offset
72 bytes) of an IPv6 and of an IPv4 UDP datagram.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "agent"))

from laminar.bpf.libbpf import _L, BpfObject, object_path  # noqa: E402


def frames() -> dict[str, bytes]:
    from scapy.all import IP, UDP, Ether, IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrFragment, IPv6ExtHdrHopByHop, Raw

    eth = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    udp, data = UDP(sport=40000, dport=7000), Raw(b"x" * 64)
    v6 = IPv6(src="fd00::1", dst="fd00::2")
    return {
        "ipv4_udp": bytes(eth / IP(src="10.0.0.1", dst="10.0.0.2") / udp / data),
        "ipv6_udp": bytes(eth / v6 / udp / data),
        "ipv6_hbh_dst_udp": bytes(eth / v6 / IPv6ExtHdrHopByHop() / IPv6ExtHdrDestOpt() / udp / data),
        "ipv6_frag0_udp": bytes(eth / v6 / IPv6ExtHdrFragment(m=1, id=7) / udp / data),
        "ipv6_frag_later": bytes(eth / v6 / IPv6ExtHdrFragment(nh=17, offset=9, id=7) / data),
        "ipv4_frag_later": bytes(eth / IP(src="10.0.0.1", dst="10.0.0.2", proto=17, frag=9, id=7) / data),
    }


def run_ns(pin: Path, data: Path, repeat: int) -> float:
    out = subprocess.run(["bpftool", "prog", "run", "pinned", str(pin), "data_in", str(data), "repeat", str(repeat)],
                         check=True, capture_output=True, text=True).stdout
    m = re.search(r"duration \(average\): (\d+)ns", out)
    if m is None:
        raise RuntimeError(f"bpftool prog run printed no duration: {out!r}")
    return float(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("objects", nargs="*", help="other netguard.bpf.o files to compare (this build's is 'current')")
    args = ap.parse_args()
    root = Path(f"/sys/fs/bpf/laminar-t-bench-{os.getpid()}")
    tmp = Path(tempfile.mkdtemp(prefix="lm-bench-"))
    objs = {"current": str(object_path("netguard")), **{Path(o).name: o for o in args.objects}}
    loaded = []
    try:
        progs: dict[tuple[str, str], Path] = {}
        for label, path in objs.items():
            obj = BpfObject.open(path, pin_root=str(root / re.sub(r"\W", "_", label)))
            obj.load()
            loaded.append(obj)
            for prog in ("lm_egress", "lm_ingress"):
                pin = root / f"{re.sub(r'[^A-Za-z0-9_]', '_', label)}_{prog}"
                lib = _L()  # the library handle: BpfProgram has no pin of its own
                lib.call(f"pin of {prog}", lib.lib.bpf_obj_pin, obj.program(prog).fd, os.fsencode(str(pin)))
                progs[(label, prog)] = pin
        files = {}
        for name, raw in frames().items():
            files[name] = tmp / name
            files[name].write_bytes(raw)
        res: dict[str, dict[str, list[float]]] = {}
        for _ in range(args.rounds):
            for name, f in files.items():
                for (label, prog), pin in progs.items():
                    res.setdefault(f"{name} {prog}", {}).setdefault(label, []).append(run_ns(pin, f, args.repeat))
        table = {k: {label: statistics.median(v) for label, v in by.items()} for k, by in res.items()}
        print(json.dumps({"repeat": args.repeat, "rounds": args.rounds, "median_ns": table}, indent=1))
    finally:
        for obj in loaded:
            obj.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
