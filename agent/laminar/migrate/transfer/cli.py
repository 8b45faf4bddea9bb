"""The command line of the checkpoint transfer (tests, operators debugging a path)::

    python -m laminar.migrate.transfer serve --root /var/lib/laminar/xfer --listen 10.0.0.2:7480 --key-file zone.keys
    python -m laminar.migrate.transfer send --to 10.0.0.2:7480 --job j1 --ckpt /ck/j1/ckpt-40 --key-file zone.keys
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from laminar.migrate.transfer.committed import Committed
from laminar.migrate.transfer.errors import TransferError
from laminar.migrate.transfer.manifest import DEFAULT_CHUNK
from laminar.migrate.transfer.progress import Progress
from laminar.migrate.transfer.receive import Receiver
from laminar.migrate.transfer.send import send_checkpoint


def _load_key(path: str, zone: int) -> bytes:
    from laminar.zone.keys import load_keys

    k = load_keys(path).get(zone)
    if k is None:
        raise SystemExit(f"transfer: {path} holds no key for zone {zone}")
    return k


def _hostport(v: str) -> tuple[str, int]:
    host, _, port = v.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [fd00::2]:7480: an IPv6 address with a port
        host = host[1:-1]
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{v!r}: expected HOST:PORT ([IPv6]:PORT for an IPv6 address)")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laminar.migrate.transfer", description="checkpoint transfer endpoint")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--root", required=True)
    s.add_argument("--listen", type=_hostport, required=True)
    s.add_argument("--key-file", required=True)
    s.add_argument("--once", action="store_true", help="exit after the first commit")
    c = sub.add_parser("send")
    c.add_argument("--to", type=_hostport, required=True)
    c.add_argument("--ckpt", required=True)
    c.add_argument("--job", required=True)
    c.add_argument("--key-file", required=True)
    c.add_argument("--rate-bps", type=float)
    c.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    c.add_argument("--retries", type=int, default=5)
    for p in (s, c):
        p.add_argument("--zone", type=int, default=0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    key = _load_key(a.key_file, a.zone)

    if a.cmd == "serve":
        async def serve() -> None:
            done = asyncio.Event()

            def commit(cm: Committed) -> None:
                print(json.dumps({"event": "committed", "job": cm.job_id, "ckpt": cm.ckpt_id, "path": str(cm.path),
                                  "digest": cm.digest}), flush=True)
                if a.once:
                    done.set()

            def prog(p: Progress) -> None:
                print(json.dumps({"event": "progress", "bytes": p.done_bytes, "total": p.total_bytes}), flush=True)

            rcv = Receiver(a.root, key, on_commit=commit, on_progress=prog)
            port = await rcv.start(*a.listen)
            print(json.dumps({"event": "listening", "port": port}), flush=True)
            await done.wait()
            await rcv.stop()

        asyncio.run(serve())
        return 0

    def prog(p: Progress) -> None:
        print(json.dumps({"event": "progress", "bytes": p.done_bytes, "total": p.total_bytes}), flush=True)

    try:
        res = asyncio.run(send_checkpoint(a.to[0], a.to[1], a.ckpt, a.job, key, zone=a.zone, rate_bps=a.rate_bps,
                                          chunk_size=a.chunk_size, retries=a.retries, progress=prog))
    except TransferError as e:
        print(json.dumps({"event": "failed", "error": str(e)}), flush=True)
        return 2
    print(json.dumps({"event": "sent", **{k: v for k, v in vars(res).items()}}), flush=True)
    return 0
