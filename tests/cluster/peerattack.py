"""Attacks on an agent's peer TCP ports, run as a script in a network namespace (the tests and
bench/ start it there with ``nsenter``). It prints one JSON object with what it saw.

``flood``: an off-roster host. From each of ``--sources`` (addresses on its own interface) it
opens as many connections as it can to ``--target``'s ``--handover`` and ``--transfer`` ports,
at most ``--rate``
new ones a second and ``--max`` open at once, and keeps them: on the hand-over port it sends a
frame's length (1 MiB) and then one byte every ``--drip`` seconds, on the transfer port the
start of a hello and then one byte every ``--drip`` seconds. A connection the target closes or
resets is opened again, so the target's accept path is hammered all along. Counts: ``opened``,
``established``, ``reset`` (closed or reset by the target, refused), ``held`` (open at the end)
and ``held_max``.

``member``: a compromised zone member (``--key-file`` with the zone's key, ``--node`` its id,
run from its roster address). Against the target's transfer port it (1) opens ``--idle``
authenticated connections and leaves them idle (each answered at once with an error is
``refused``, the rest ``held``), then closes them, (2) sends control headers of ``--big`` bytes (a keeper op and
other ops, the body a list of numbers, MAC'd correctly), (3) an offer header of ``--big`` bytes
of numbers, (4) a chunk before any offer; it reports each answer's text and how long it took.

    python peerattack.py flood --target 10.0.0.1 --handover 7441 --transfer 7442 --sources 10.0.0.200,10.0.0.201
    python peerattack.py member --target 10.0.0.1 --port 7442 --key-file zone.keys --zone 1 --node 2 --idle 64
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import resource
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "agent"))


def flood(a: argparse.Namespace) -> dict[str, Any]:
    want = a.max + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(want, soft), max(hard, want)), max(hard, want)))
    sources = a.sources.split(",")
    first: dict[int, bytes] = {}
    if a.handover:
        first[a.handover] = struct.pack("!I", 1 << 20) + b"LZ"  # a hand-over frame: its length, its magic
    if a.transfer:
        first[a.transfer] = struct.pack(">I", 200) + b'{"t":"hello",'  # the transfer handshake's first header
    ports = list(first)
    sel = selectors.DefaultSelector()
    conns: dict[int, tuple[socket.socket, int, bool, float]] = {}  # fd -> (sock, port, established, next drip)
    c = {"opened": 0, "established": 0, "reset": 0, "held_max": 0, "connect_errors": 0}
    end = time.monotonic() + a.seconds

    def stop(*_: object) -> None:  # SIGTERM: end now, and report
        nonlocal end
        end = 0.0

    signal.signal(signal.SIGTERM, stop)
    i = 0
    budget, last = 0.0, time.monotonic()

    def close(fd: int) -> None:
        s = conns.pop(fd)[0]
        try:
            sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()

    while time.monotonic() < end:
        now = time.monotonic()
        budget = min(a.rate, budget + (now - last) * a.rate)
        last = now
        while len(conns) < a.max and budget >= 1:
            budget -= 1
            port = ports[i % len(ports)]
            src = sources[(i // len(ports)) % len(sources)]
            i += 1
            s = socket.socket(socket.AF_INET6 if ":" in a.target else socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.bind((src, 0))
                err = s.connect_ex((a.target, port))
            except OSError:
                s.close()
                c["connect_errors"] += 1
                continue
            if err not in (0, errno.EINPROGRESS):
                s.close()
                c["connect_errors"] += 1
                continue
            c["opened"] += 1
            conns[s.fileno()] = (s, port, False, 0.0)
            sel.register(s, selectors.EVENT_WRITE | selectors.EVENT_READ)
        for key, ev in sel.select(timeout=0.05):
            fd = key.fd
            if fd not in conns:
                continue
            s, port, est, _ = conns[fd]
            if not est and ev & selectors.EVENT_WRITE:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    c["reset"] += 1
                    close(fd)
                    continue
                try:
                    s.send(first[port])
                except OSError:
                    c["reset"] += 1
                    close(fd)
                    continue
                c["established"] += 1
                conns[fd] = (s, port, True, time.monotonic() + a.drip)
                sel.modify(s, selectors.EVENT_READ)
                continue
            if ev & selectors.EVENT_READ:  # an answer (an error) or the end: either way it is over
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    c["reset"] += 1
                    close(fd)
        now = time.monotonic()
        for fd, (s, port, est, nxt) in list(conns.items()):
            if est and now >= nxt:
                try:
                    s.send(b"\0")
                    conns[fd] = (s, port, est, now + a.drip)
                except OSError:
                    c["reset"] += 1
                    close(fd)
        c["held_max"] = max(c["held_max"], sum(1 for x in conns.values() if x[2]))
    c["held"] = sum(1 for x in conns.values() if x[2])
    for fd in list(conns):
        close(fd)
    return c


async def _member(a: argparse.Namespace) -> dict[str, Any]:
    from laminar.migrate import transfer as T
    from laminar.migrate.transfer.channel import _recv
    from laminar.migrate.transfer.send import _client_handshake, _connect
    from laminar.zone.keys import load_keys

    key = load_keys(a.key_file).get(a.zone)
    assert key is not None, f"no key for zone {a.zone} in {a.key_file}"
    out: dict[str, Any] = {}

    async def connect() -> tuple[Any, asyncio.StreamWriter, bytes]:
        r, w = await asyncio.wait_for(_connect(a.target, a.port, a.local), 10)
        ch, ns = await asyncio.wait_for(_client_handshake(r, w, key, a.zone, str(a.node)), 20)
        return ch, w, ns

    async def answer(ch: Any, timeout: float) -> str:
        try:
            hdr, _ = await _recv(ch, timeout)
            return f"answered {hdr.get('t')}"
        except T.TransferError as e:
            return str(e)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as e:
            return f"no answer: {type(e).__name__}"

    # (1) authenticated connections left idle
    idle: list[asyncio.StreamWriter] = []
    refused = []
    for _ in range(a.idle):
        try:
            ch, w, _ns = await connect()
        except (T.TransferError, OSError, TimeoutError) as e:
            refused.append(f"handshake: {e}")
            continue
        idle.append(w)
        got = await answer(ch, 0.3)
        if not got.startswith("no answer"):
            refused.append(got)
    out["idle"] = {"tried": a.idle, "refused": len(refused), "held": a.idle - len(refused),
                   "refusals": sorted(set(refused))[:3]}
    for w in idle:  # let them go: what follows needs a member's share of connections
        w.close()
    await asyncio.sleep(1.0)

    # (2)-(4): headers of --big bytes, each on a connection of its own. The body is a list of
    # numbers (the costliest JSON per byte) and a control message's MAC is right (this member
    # holds the key): before, the agent parsed it and serialized it again (to check the MAC) on
    # its event loop.
    n_items = max(1, (a.big - 64) // 2)
    numbers = b"[" + b"0," * (n_items - 1) + b"0]"
    sent: list[dict[str, Any]] = []

    def ctl(op: str) -> Any:
        return lambda ns: (b'{"t":"ctl","op":"' + op.encode() + b'","body":' + numbers + b',"mac":"'
                           + T.mac(key, b"laminar-ctl", ns, op.encode(), numbers).encode() + b'"}')

    async def send(what: str, make: Any) -> None:
        try:
            ch, w, ns = await connect()
        except (T.TransferError, OSError, TimeoutError) as e:
            sent.append({"what": what, "answer": f"handshake: {e}", "s": 0.0})
            return
        raw = make(ns)
        t0 = time.monotonic()
        try:
            await ch.send_encoded(raw)
            got = await answer(ch, 60)
        except (OSError, T.TransferError) as e:
            got = f"send failed: {e!r}"
        sent.append({"what": what, "bytes": len(raw), "answer": got[:300], "s": round(time.monotonic() - t0, 3)})
        w.close()

    await asyncio.gather(*(send(f"ctl {op}", ctl(op)) for op in ("keeper", "space", "release", "needs")))
    await send("offer", lambda ns: b'{"t":"offer","manifest":' + numbers + b',"mac":"00"}')
    # a chunk before any offer, announcing 64 MiB: refused before its payload is read
    await send("chunk", lambda ns: json.dumps({"t": "chunk", "i": 0, "len": 64 << 20}).encode())
    out["big"] = sent
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("flood")
    f.add_argument("--target", required=True)
    f.add_argument("--handover", type=int, default=0, help="the hand-over port (zone.handover_port)")
    f.add_argument("--transfer", type=int, default=0, help="the transfer port (migrate.port)")
    f.add_argument("--sources", required=True)
    f.add_argument("--seconds", type=float, default=30)
    f.add_argument("--max", type=int, default=4000)
    f.add_argument("--rate", type=float, default=400)
    f.add_argument("--drip", type=float, default=2.0)
    m = sub.add_parser("member")
    m.add_argument("--target", required=True)
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--local", default=None)
    m.add_argument("--key-file", required=True)
    m.add_argument("--zone", type=int, default=1)
    m.add_argument("--node", type=int, required=True)
    m.add_argument("--idle", type=int, default=64)
    m.add_argument("--big", type=int, default=15 << 20)
    a = ap.parse_args()
    res = flood(a) if a.cmd == "flood" else asyncio.run(_member(a))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
