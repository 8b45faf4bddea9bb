"""UDP sender and counting receiver used by the agent tests (run as separate processes).

    python udp_tools.py send ADDR PORT COUNT PAYLOAD GO_FILE
        sends COUNT packets of PAYLOAD bytes (paced), then waits for GO_FILE to exist and
        floods until killed.
    python udp_tools.py recv PORT[,PORT...] OUT_JSON
        counts datagrams per port and rewrites OUT_JSON with the counts every 20 ms.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time


def send(addr: str, port: int, count: int, payload: int, go_file: str) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    data = b"x" * payload
    for _ in range(count):
        s.sendto(data, (addr, port))
        time.sleep(0.0005)
    while not os.path.exists(go_file):
        time.sleep(0.01)
    while True:
        try:
            s.sendto(data, (addr, port))
        except OSError:
            pass
        time.sleep(0.0002)


def recv(ports: list[int], out: str) -> None:
    socks = {}
    for p in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("0.0.0.0", p))
        s.setblocking(False)
        socks[s] = p
    counts = {str(p): 0 for p in ports}
    last = 0.0
    while True:
        ready, _, _ = select.select(list(socks), [], [], 0.02)
        for s in ready:
            while True:
                try:
                    s.recv(65535)
                except BlockingIOError:
                    break
                counts[str(socks[s])] += 1
        if time.monotonic() - last >= 0.02:
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(counts, f)
            os.replace(tmp, out)
            last = time.monotonic()


if __name__ == "__main__":
    if sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        recv([int(p) for p in sys.argv[2].split(",")], sys.argv[3])
