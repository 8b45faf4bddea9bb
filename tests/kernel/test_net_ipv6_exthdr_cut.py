"""A cut flow stays cut for IPv6 packets with extension headers and for fragments (real netguard).

netguard matched an IPv6 packet to its flow only when the first header after the IPv6 header was
TCP or UDP. A packet with a hop-by-hop or destination options header, or a fragmented datagram
(its fragments carry a fragment header), matched no flow and no job: a sender could reach a job
whose flow was cut by adding an extension header, and a cut flow's own large UDP datagrams (the
kernel fragments them) still left the node. netguard now walks the extension header chain to the
TCP/UDP header (a first fragment holds it); a chain longer than it walks is dropped.

Later fragments (offset > 0, IPv4 or IPv6) carry no ports: netguard passed them, so although the
datagram could not be reassembled without its dropped first fragment, the rest of a cut flow's
fragmented datagrams still took the link and the peer's reassembly memory. netguard now remembers
the datagram of a first fragment it drops (lm_frags) and drops its later fragments; the tests
count what reached the receiving namespace's reassembly (``ReasmReqds`` of /proc/net/snmp{,6}).

The node is namespace ``a`` of a veth pair running netguard (the stand-in of
test_killswitch_dataplane, maps driven directly; for a job's switch, the ``env`` of
test_netguard_dataplane: receivers in job cgroups of the test's own); packets come from namespace
``b``, built with scapy (ingress) or sent by a real socket whose datagrams the kernel fragments
(egress). Each kind of packet is sent on a cut flow (job) and on an open one: the open one's must
still arrive.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_killswitch_dataplane import DataPlane, start_dataplane, stop_dataplane
from test_net_ipv6_flows import ADDR_A, ADDR_B, RECV, add_ipv6, counts
from test_netguard_dataplane import Env, env  # noqa: F401 (env: netguard with job cgroups of the test's own)

from laminar.bpf import abi
from laminar.net import killswitch as ks

pytestmark = pytest.mark.kernel
PY = sys.executable
WAIT_S = 10.0

# The kinds of packet sent, by name: scapy layers between IPv6 and UDP ("frag": the datagram is
# fragmented into 2 of at most 1280 bytes). "plain" was cut before too: the control.
KINDS = ("plain", "destopt", "hopbyhop", "hopbyhop+destopt", "frag", "destopt+frag")
LONG_CHAIN = 9  # destination options headers: more than netguard walks (LM_IPV6_MAX_EXT 8)
CUT_SPORT, OPEN_SPORT, DPORT = 41700, 41720, 9701

# argv: IFACE DST_MAC SRC DST DPORT SPEC; SPEC is JSON [[kind, sport, count], ...]: sends each
# datagram of `kind` from [SRC]:sport to [DST]:DPORT as raw Ethernet frames (fragment ids differ by
# port and datagram: datagrams of one pair of hosts sharing an id would be one to the receiver).
SCAPY_SEND = r"""
import json, sys
from scapy.all import Ether, IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrFragment, IPv6ExtHdrHopByHop, UDP, Raw, fragment6, sendp
iface, mac, src, dst, dport, spec = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), json.loads(sys.argv[6])
frames = []
for kind, sport, n in spec:
    for i in range(n):
        hdrs = IPv6(src=src, dst=dst)
        parts = kind.split("+")
        for p in parts:
            if p == "destopt":
                hdrs = hdrs / IPv6ExtHdrDestOpt()
            elif p == "hopbyhop":
                hdrs = hdrs / IPv6ExtHdrHopByHop()
            elif p == "longchain":
                for _ in range(int(sys.argv[7])):
                    hdrs = hdrs / IPv6ExtHdrDestOpt()
        if "frag" in parts:
            pkt = hdrs / IPv6ExtHdrFragment(id=(dport % 256) << 24 | sport << 8 | i) / UDP(sport=sport, dport=dport) / Raw(b"f" * 2000)
            frames += [Ether(dst=mac) / f for f in fragment6(pkt, 1280)]
        else:
            frames.append(Ether(dst=mac) / hdrs / UDP(sport=sport, dport=dport) / Raw(b"x" * 64))
sendp(frames, iface=iface, verbose=False)
print(len(frames), flush=True)
"""

# argv: SRC SPORT DST DPORT COUNT SIZE; COUNT datagrams of SIZE bytes (the kernel fragments them).
SEND_BIG = r"""
import socket, sys, time
src, sport, dst, dport, n, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.bind((src, sport))
for _ in range(n):
    try:
        s.sendto(b"b" * size, (dst, dport))
    except OSError:
        pass
    time.sleep(0.001)
"""


@pytest.fixture
def node6(veth_pair: Any) -> Iterator[tuple[Any, DataPlane]]:
    """netguard on ``a`` of a veth pair with IPv6 addresses on both ends."""
    add_ipv6(veth_pair)
    dp = start_dataplane(veth_pair.a.argv(), veth_pair.ifname_a, "v6x")
    try:
        yield veth_pair, dp
    finally:
        stop_dataplane(dp)


def receiver(ns: Any, out: Path, *ports: int) -> subprocess.Popen[str]:
    p = ns.popen(PY, "-c", RECV, str(out), *map(str, ports))
    wait_for(out.exists, "the receiver to start")
    return p


def wait_for(pred: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def mac_of(ns: Any, ifname: str) -> str:
    return str(json.loads(ns.run("ip", "-j", "link", "show", ifname).stdout)[0]["address"])


def scapy_send(vp: Any, spec: list[tuple[str, int, int]]) -> None:
    vp.b.run(PY, "-c", SCAPY_SEND, vp.ifname_b, mac_of(vp.a, vp.ifname_a), ADDR_B, ADDR_A, str(DPORT),
             json.dumps(spec), str(LONG_CHAIN))


def test_ipv6_with_extension_headers_to_a_cut_flow_is_dropped_on_ingress(node6: Any, tmp_path: Path) -> None:
    vp, dp = node6
    flows = dp.map("lm_flows")
    for i in range(len(KINDS) + 1):  # keyed in egress orientation: the node's side first
        ks.apply_flow_switch(flows, ks.FlowKey("udp", ADDR_A, DPORT, ADDR_B, CUT_SPORT + i), "on", None)
    out = tmp_path / "lm-t-v6x-at-a.json"
    rx = receiver(vp.a, out, DPORT)
    try:
        n = 5
        # The cut flows' packets go first, the open flows' after them on the same veth: once the
        # open flows' are all in, the cut flows' would be in too had they passed.
        scapy_send(vp, [(k, CUT_SPORT + i, n) for i, k in enumerate(KINDS)])
        scapy_send(vp, [(k, OPEN_SPORT + i, n) for i, k in enumerate(KINDS)])
        wait_for(lambda: all(counts(out).get(f"{DPORT}:{OPEN_SPORT + i}") == n for i in range(len(KINDS))),
                 f"every open flow's datagrams ({counts(out)})")
        got = counts(out)
        escaped = {k: got[f"{DPORT}:{CUT_SPORT + i}"] for i, k in enumerate(KINDS) if f"{DPORT}:{CUT_SPORT + i}" in got}
        assert escaped == {}, f"datagrams reached the cut flows' receiver, by kind: {escaped}"

        # A chain longer than netguard walks is dropped, cut flow or not, and counted.
        stats = dp.map("lm_stats")
        before = stats.lookup_percpu_sum(abi.u32(abi.LM_STAT_DROP_EXTHDR))
        scapy_send(vp, [("longchain", CUT_SPORT + len(KINDS), n), ("plain", OPEN_SPORT + len(KINDS), 1)])
        wait_for(lambda: counts(out).get(f"{DPORT}:{OPEN_SPORT + len(KINDS)}") == 1, "the marker after the long chains")
        assert f"{DPORT}:{CUT_SPORT + len(KINDS)}" not in counts(out), counts(out)
        assert stats.lookup_percpu_sum(abi.u32(abi.LM_STAT_DROP_EXTHDR)) - before == n
    finally:
        rx.kill()
        rx.wait()


def test_a_cut_flows_fragmented_ipv6_datagrams_do_not_leave(node6: Any, tmp_path: Path) -> None:
    vp, dp = node6
    cut_port, open_port, dport = 9711, 9712, 41711
    ks.apply_flow_switch(dp.map("lm_flows"), ks.FlowKey("udp", ADDR_A, cut_port, ADDR_B, dport), "on", None)
    out = tmp_path / "lm-t-v6x-at-b.json"
    rx = receiver(vp.b, out, dport)
    try:
        n, size = 10, 3000  # over the veth's 1500-byte MTU: the kernel sends 3 fragments each
        vp.a.run(PY, "-c", SEND_BIG, ADDR_A, str(cut_port), ADDR_B, str(dport), str(n), str(size))
        vp.a.run(PY, "-c", SEND_BIG, ADDR_A, str(open_port), ADDR_B, str(dport), str(n), str(size))
        wait_for(lambda: counts(out).get(f"{dport}:{open_port}") == n, f"the open flow's datagrams ({counts(out)})")
        assert f"{dport}:{cut_port}" not in counts(out), f"the cut flow's fragmented datagrams arrived: {counts(out)}"
    finally:
        rx.kill()
        rx.wait()


# argv: IFACE DST_MAC SRC DST SPORT DPORT N; N UDP datagrams of 3000 bytes, fragmented (IPv4 or IPv6
# by the addresses), as raw Ethernet frames; prints the number of fragments sent. Fragment ids
# differ by datagram and by ID_BASE (argv 8; default: SPORT), so datagrams are not merged.
SCAPY_FRAGS = r"""
import sys
from scapy.all import IP, UDP, Ether, IPv6, IPv6ExtHdrFragment, Raw, fragment, fragment6, sendp
iface, mac, src, dst, sport, dport, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
base = int(sys.argv[8]) if len(sys.argv) > 8 else sport
frames = []
for i in range(n):
    data = UDP(sport=sport, dport=dport) / Raw(b"f" * 3000)
    if ":" in dst:
        frags = fragment6(IPv6(src=src, dst=dst) / IPv6ExtHdrFragment(id=base * 256 + i) / data, 1280)
    else:
        frags = fragment(IP(src=src, dst=dst, id=(base % 1000) * 64 + i) / data, fragsize=1200)
    frames += [Ether(dst=mac) / f for f in frags]
sendp(frames, iface=iface, verbose=False)
print(len(frames), flush=True)
"""


def reasm_reqds(ns: Any, family: int) -> int:
    """Fragments the namespace's IPv4 or IPv6 reassembly has been given (ReasmReqds)."""
    if family == 6:
        for line in ns.run("cat", "/proc/net/snmp6").stdout.splitlines():
            if line.split()[0] == "Ip6ReasmReqds":
                return int(line.split()[1])
        raise AssertionError("no Ip6ReasmReqds in /proc/net/snmp6")
    ip = [line.split() for line in ns.run("cat", "/proc/net/snmp").stdout.splitlines() if line.startswith("Ip:")]
    return int(ip[1][ip[0].index("ReasmReqds")])


@pytest.mark.parametrize("family", [4, 6])
def test_later_fragments_of_a_cut_flow_do_not_leave(node6: Any, tmp_path: Path, family: int) -> None:
    vp, dp = node6
    src, dst = (ADDR_A, ADDR_B) if family == 6 else (vp.addr_a, vp.addr_b)
    sock_src, sock_dst = (src, dst) if family == 6 else (f"::ffff:{src}", f"::ffff:{dst}")
    cut_port, open_port, dport = 9721, 9722, 41721
    ks.apply_flow_switch(dp.map("lm_flows"), ks.FlowKey("udp", src, cut_port, dst, dport), "on", None)
    out = tmp_path / "lm-t-v6x-frags.json"
    rx = receiver(vp.b, out, dport)  # a dual-stack socket: IPv4 too
    try:
        n, size = 10, 3000  # over the veth's 1500-byte MTU: the kernel sends 3 fragments each
        before = reasm_reqds(vp.b, family)
        vp.a.run(PY, "-c", SEND_BIG, sock_src, str(cut_port), sock_dst, str(dport), str(n), str(size))
        vp.a.run(PY, "-c", SEND_BIG, sock_src, str(open_port), sock_dst, str(dport), "1", "64")  # the marker
        wait_for(lambda: counts(out).get(f"{dport}:{open_port}") == 1, f"the marker ({counts(out)})")
        leaked = reasm_reqds(vp.b, family) - before
        assert leaked == 0, f"{leaked} fragments of the cut flow's {n} datagrams reached the peer"
        assert f"{dport}:{cut_port}" not in counts(out)
        # The open flow's fragmented datagrams are whole: nothing of theirs is dropped.
        vp.a.run(PY, "-c", SEND_BIG, sock_src, str(open_port), sock_dst, str(dport), str(n), str(size))
        wait_for(lambda: counts(out).get(f"{dport}:{open_port}") == 1 + n, f"the open flow's datagrams ({counts(out)})")
        assert reasm_reqds(vp.b, family) - before == 3 * n
    finally:
        rx.kill()
        rx.wait()


@pytest.mark.parametrize("family", [4, 6])
def test_later_fragments_to_a_cut_flow_are_dropped_on_ingress(node6: Any, tmp_path: Path, family: int) -> None:
    vp, dp = node6
    src, dst = (ADDR_B, ADDR_A) if family == 6 else (vp.addr_b, vp.addr_a)
    cut_sport, open_sport, dport = 41731, 41732, 9731
    ks.apply_flow_switch(dp.map("lm_flows"), ks.FlowKey("udp", dst, dport, src, cut_sport), "on", None)
    out = tmp_path / "lm-t-v6x-frags-in.json"
    rx = receiver(vp.a, out, dport)
    stats = dp.map("lm_stats")
    mac = mac_of(vp.a, vp.ifname_a)

    def send(sport: int, n: int, id_base: int | None = None) -> int:
        return int(vp.b.run(PY, "-c", SCAPY_FRAGS, vp.ifname_b, mac, src, dst, str(sport), str(dport), str(n),
                            *([str(id_base)] if id_base is not None else [])).stdout)

    try:
        n = 5
        before, dropped_before = reasm_reqds(vp.a, family), stats.lookup_percpu_sum(abi.u32(abi.LM_STAT_DROP_FRAG))
        frames = send(cut_sport, n)
        send(open_sport, 1)  # the marker: a whole datagram on an open flow
        wait_for(lambda: counts(out).get(f"{dport}:{open_sport}") == 1, f"the marker ({counts(out)})")
        marker = frames // n
        leaked = reasm_reqds(vp.a, family) - before - marker
        assert leaked == 0, f"{leaked} fragments of {n} datagrams to the cut flow reached reassembly"
        assert f"{dport}:{cut_sport}" not in counts(out)
        assert stats.lookup_percpu_sum(abi.u32(abi.LM_STAT_DROP_FRAG)) - dropped_before == frames - n
        # The dropped datagrams are remembered for LM_FRAG_TTL_NS (1 s) only: after it, datagrams of
        # an open flow between the same hosts that reuse their ids (IPv4's are 16 bits) arrive whole.
        time.sleep(1.2)
        send(open_sport, n, id_base=cut_sport)
        wait_for(lambda: counts(out).get(f"{dport}:{open_sport}") == 1 + n,
                 f"the open flow's datagrams with the cut ones' ids ({counts(out)})")
    finally:
        rx.kill()
        rx.wait()


# An IPv6 UDP receiver on [::]:argv[1] (run in a job's cgroup); each stdin line prints
# {"peer port": datagrams} received so far.
RX6 = """
import json, socket, sys, threading
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.bind(("::", int(sys.argv[1])))
counts, lock = {}, threading.Lock()
def rx():
    while True:
        _, peer = s.recvfrom(4096)
        with lock:
            counts[str(peer[1])] = counts.get(str(peer[1]), 0) + 1
threading.Thread(target=rx, daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    with lock:
        print(json.dumps(counts), flush=True)
"""


def test_a_cut_job_receives_no_ipv6_with_extension_headers(env: Env) -> None:  # noqa: F811
    """The job's own switch on ingress: the job is found by the socket behind the extension headers."""
    vp = env.pair
    add_ipv6(vp)
    cut_dir, cut_id = env.cgroup("job-cut")
    open_dir, open_id = env.cgroup("job-open")
    env.register(cut_id, 1, flags=abi.LM_JOB_KILL)
    env.register(open_id, 2)
    cut_port, open_port = 9741, 9742
    rx_cut = env.spawn(vp.a, RX6, str(cut_port), cgroup=cut_dir)
    rx_open = env.spawn(vp.a, RX6, str(open_port), cgroup=open_dir)
    kinds = ("destopt", "hopbyhop", "frag")
    mac = mac_of(vp.a, vp.ifname_a)
    n = 5
    for dport in (cut_port, open_port):  # the cut job's first, the open job's after them
        vp.b.run(PY, "-c", SCAPY_SEND, vp.ifname_b, mac, ADDR_B, ADDR_A, str(dport),
                 json.dumps([(k, 41740 + i, n) for i, k in enumerate(kinds)]), str(LONG_CHAIN))
    wait_for(lambda: json.loads(rx_open.ask("count")) == {str(41740 + i): n for i in range(len(kinds))},
             "the open job's datagrams of every kind")
    got = json.loads(rx_cut.ask("count"))
    assert got == {}, f"the cut job received, by kind: { {kinds[int(p) - 41740]: c for p, c in got.items()} }"
    assert env.counters(cut_id).drop_packets >= len(kinds) * n
