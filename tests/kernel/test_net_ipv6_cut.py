"""A job's kill-switch also stops IPv6 traffic coming in to it (real laminard, real netguard).

netguard found the job an ingress packet is for only for IPv4 (it parses the 5-tuple to look the
local socket up); an IPv6 packet belonged to no job and passed. A job whose switch was on (or
whose armed deadline had passed, or a lent job at the end of its window) still received every
IPv6 datagram sent to it, while its own packets were dropped. netguard now looks up the local
socket of IPv6 TCP/UDP packets too (no extension headers: the first header must be TCP or UDP).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until

pytestmark = pytest.mark.kernel

ADDR_A, ADDR_B = "fd00:4c4d:7::1", "fd00:4c4d:7::2"
PORT = 47117

RECV = f"""
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.bind(("::", {PORT}))
out = sys.argv[1]
n = 0
open(out, "w").write("0")
while True:
    s.recv(2048)
    n += 1
    open(out + ".tmp", "w").write(str(n))
    __import__("os").replace(out + ".tmp", out)
"""

SEND = f"""
import socket, sys, time
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[1])):
    s.sendto(b"x" * 64, ("{ADDR_A}", {PORT}))
    time.sleep(0.001)
"""


def count(f: Path) -> int:
    try:
        return int(f.read_text() or "0")
    except (OSError, ValueError):
        return -1


def test_a_cut_job_receives_no_ipv6(agent: AgentProc, veth_pair: Any, tmp_path: Path) -> None:
    vp = veth_pair
    vp.a.run("ip", "-6", "addr", "add", f"{ADDR_A}/64", "dev", vp.ifname_a, "nodad")
    vp.b.run("ip", "-6", "addr", "add", f"{ADDR_B}/64", "dev", vp.ifname_b, "nodad")
    out = tmp_path / "lm-t-v6-count"
    job = agent.json("submit", "--name", "lm-t-v6", "--", "python3", "-c", RECV, str(out))
    wait_until(lambda: count(out) == 0, 30, "the job's receiver to start", agent.log)

    def send(n: int) -> None:
        vp.b.run("python3", "-c", SEND, str(n))

    send(20)
    wait_until(lambda: count(out) == 20, 10, "the 20 datagrams before the cut")
    agent.json("killswitch", "on", "--job", job["id"])
    send(20)
    agent.json("killswitch", "off", "--job", job["id"])
    # a datagram after the switch went off: once it is in, any sent during the cut would be too
    deadline = time.monotonic() + 10
    while count(out) < 21 and time.monotonic() < deadline:
        send(1)
        time.sleep(0.1)
    got = count(out)
    assert got >= 21, f"nothing arrived after the switch went off ({got})"
    assert got < 40, f"{got} datagrams counted: the 20 IPv6 datagrams sent while the job was cut reached it"
