"""An IPv6 migration transfer is shaped into its class and cut per flow (real laminard, real netguard).

``lm_flow_key`` held IPv4 addresses only (map ABI 1): an IPv6 checkpoint transfer could not be
registered (``not an IPv4 address``), so it was neither put in its HTB class by its deadline nor
cut by the flow kill-switch, and netguard never looked at IPv6 packets for flows at all. Map ABI 2
keys flows by 16-byte addresses (IPv4 v4-mapped); netguard parses IPv6 TCP/UDP (no extension
headers) on both hooks.

The node is namespace ``a`` of a veth pair with IPv6 addresses on both ends; the agent runs there
with shaping on. The senders and receivers are plain processes in the namespaces (not jobs): a
flow is matched by its 5-tuple alone.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until

pytestmark = pytest.mark.kernel

ADDR_A, ADDR_B = "fd00:4c4d:61::1", "fd00:4c4d:61::2"

# argv: OUT PORT...; counts datagrams by "localport:peerport" and rewrites OUT (JSON) as they come.
RECV = r"""
import json, os, selectors, socket, sys
out, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
sel = selectors.DefaultSelector()
for p in ports:
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); s.setblocking(False)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("::", p))  # the sender binds it too
    sel.register(s, selectors.EVENT_READ, p)
counts = {}
def dump():
    open(out + ".tmp", "w").write(json.dumps(counts)); os.replace(out + ".tmp", out)
dump()
while True:
    for key, _ in sel.select(1.0):
        while True:
            try:
                _, peer = key.fileobj.recvfrom(2048)
            except BlockingIOError:
                break
            k = f"{key.data}:{peer[1]}"
            counts[k] = counts.get(k, 0) + 1
        dump()
"""

# argv: SRC SPORT DST DPORT COUNT; sends COUNT datagrams from [SRC]:SPORT (dropped ones are not retried).
SEND = r"""
import socket, sys, time
src, sport, dst, dport, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((src, sport))
for _ in range(n):
    try:
        s.sendto(b"x" * 64, (dst, dport))
    except OSError:
        pass
    time.sleep(0.001)
"""

# argv: PORT; accepts one TCP connection, reads to EOF, prints the bytes.
SINK = r"""
import socket, sys
srv = socket.socket(socket.AF_INET6); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("::", int(sys.argv[1]))); srv.listen(1)
print("ready", flush=True)
c, _ = srv.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(n, flush=True)
"""

# argv: SRC SPORT DST DPORT BYTES; sends BYTES over TCP from [SRC]:SPORT.
SOURCE = r"""
import socket, sys
src, sport, dst, dport, total = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((src, sport)); s.connect((dst, dport))
s.sendall(b"\0" * total); s.close()
"""


def add_ipv6(vp: Any) -> None:
    vp.a.run("ip", "-6", "addr", "add", f"{ADDR_A}/64", "dev", vp.ifname_a, "nodad")
    vp.b.run("ip", "-6", "addr", "add", f"{ADDR_B}/64", "dev", vp.ifname_b, "nodad")


def counts(f: Path) -> dict[str, int]:
    try:
        return dict(json.loads(f.read_text() or "{}"))
    except (OSError, ValueError):
        return {}


def send(ns: Any, src: str, sport: int, dst: str, dport: int, n: int) -> None:
    ns.run("python3", "-c", SEND, src, str(sport), dst, str(dport), str(n))


def flows(a: AgentProc) -> dict[str, dict[str, Any]]:
    return {f["flow"]: f for f in a.json("net", "flows")}


def test_an_ipv6_transfer_goes_through_its_class(shaping_agent: AgentProc, veth_pair: Any) -> None:
    a, vp = shaping_agent, veth_pair
    add_ipv6(vp)
    total = 400_000
    flow = f"tcp:[{ADDR_A}]:40600->[{ADDR_B}]:7600"
    job = a.json("submit", "--name", "lm-t-v6shape", "--", "sleep", "600")
    t = a.json("net", "transfers", "add", "--job", job["id"], "--flow", flow, "--bytes", str(total),
               "--deadline", "+2s", "--id", "t-v6")
    assert t["flow"] == flow, t
    sink = vp.b.popen("python3", "-c", SINK, "7600", stdout=subprocess.PIPE)
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        vp.a.run("python3", "-c", SOURCE, ADDR_A, "40600", ADDR_B, "7600", str(total))
        out, _ = sink.communicate(timeout=60)
        assert int(out) == total
    finally:
        if sink.poll() is None:
            sink.kill()
        sink.wait()

    def listing() -> dict[str, Any]:  # exits 5 once the transfer is late: its deadline was short
        return dict(json.loads(a.ctl("-o", "json", "net", "transfers", check=False).stdout))

    def row() -> dict[str, Any]:
        return next(r for r in listing()["transfers"] if r["id"] == "t-v6")

    # Counted progress is the bytes the transfer's HTB leaf sent: the flow went through its class.
    wait_until(lambda: row()["sent_bytes"] >= total * 0.9, 10, "the transfer's leaf to count its bytes", a.log)
    f = flows(a)[flow]
    assert f["transfer"] == "t-v6" and f["priority"] == row()["class"] and f["packets"] > 0, f
    assert listing()["status"]["flow_entries"] == 1


def test_an_ipv6_flow_is_cut_both_ways_and_only_that_flow(agent: AgentProc, veth_pair: Any, tmp_path: Path) -> None:
    a, vp = agent, veth_pair
    add_ipv6(vp)
    cut = f"udp:[{ADDR_A}]:40601->[{ADDR_B}]:9601"
    at_b, at_a = tmp_path / "lm-t-v6-at-b.json", tmp_path / "lm-t-v6-at-a.json"
    procs = [vp.b.popen("python3", "-c", RECV, str(at_b), "9601"),
             vp.a.popen("python3", "-c", RECV, str(at_a), "40601", "40602")]
    try:
        wait_until(lambda: at_a.exists() and at_b.exists(), 10, "the receivers to start")
        res = a.json("net", "kill-flow", cut, "on")
        assert res["flow"] == cut and res["kill"], res
        # The cut flow's datagrams go first, the open flow's after them on the same veth: once the
        # open flow's are all in, the cut flow's would be in too had they passed.
        send(vp.a, ADDR_A, 40601, ADDR_B, 9601, 20)  # egress, cut
        send(vp.b, ADDR_B, 9601, ADDR_A, 40601, 20)  # ingress of the cut flow (swapped tuple)
        send(vp.a, ADDR_A, 40602, ADDR_B, 9601, 20)  # another flow of the same hosts and port
        send(vp.b, ADDR_B, 9601, ADDR_A, 40602, 20)
        wait_until(lambda: counts(at_b).get("9601:40602") == 20 and counts(at_a).get("40602:9601") == 20, 10,
                   "the open flow's datagrams, both ways", a.log)
        assert "9601:40601" not in counts(at_b), counts(at_b)
        assert "40601:9601" not in counts(at_a), counts(at_a)
        assert flows(a)[cut]["cut"], flows(a)
        a.json("net", "kill-flow", cut, "off")
        send(vp.a, ADDR_A, 40601, ADDR_B, 9601, 20)
        send(vp.b, ADDR_B, 9601, ADDR_A, 40601, 20)
        wait_until(lambda: counts(at_b).get("9601:40601") == 20 and counts(at_a).get("40601:9601") == 20, 10,
                   "the restored flow's datagrams, both ways", a.log)
        assert cut not in flows(a)  # the operator's ad-hoc entry is freed by off
    finally:
        for p in procs:
            p.kill()
            p.wait()
