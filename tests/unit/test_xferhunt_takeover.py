"""Transfer receive path, the StreamReader take-over, over a real loopback connection with a
real Receiver and real files: a source that sends its records right behind its ``auth``
(without waiting for ``ok``) while the destination's loop is busy leaves more than
StreamReader's high-water mark buffered at the take-over, so asyncio has paused reading the
socket. The record buffer took the bytes over but not the paused state: it never resumed
reading, and the transfer stalled until IO_TIMEOUT_S ended the connection. (laminar's own
sender waits for ``ok``, so it never pipelines; a peer that does must still be served.)

The source here is a plain blocking socket in a thread speaking the protocol byte for byte
(HMAC handshake, AES-GCM records), so nothing of the module's sender is involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from xferrig import KEY, make_ckpt, with_receiver

from laminar.migrate import transfer as T
from laminar.migrate.transfer import Receiver, verified_checkpoint
from laminar.migrate.transfer.channel import RECORD_MAX


def _frame(h: dict[str, object]) -> bytes:
    raw = json.dumps(h).encode()
    return struct.pack(">I", len(raw)) + raw


class _Sealer:
    def __init__(self, key: bytes) -> None:
        self.a, self.n = AESGCM(key), 0

    def __call__(self, data: bytes) -> bytes:
        out = []
        for off in range(0, max(1, len(data)), RECORD_MAX):
            pt = data[off:off + RECORD_MAX]
            ln = struct.pack(">I", len(pt) + 16)
            out.append(ln + self.a.encrypt(self.n.to_bytes(12, "big"), pt, ln))
            self.n += 1
        return b"".join(out)


def _read_msg(s: socket.socket) -> dict[str, object]:
    def exactly(n: int) -> bytes:
        b = b""
        while len(b) < n:
            got = s.recv(n - len(b))
            assert got, "connection closed"
            b += got
        return b
    n = struct.unpack(">I", exactly(4))[0]
    return json.loads(exactly(n))  # type: ignore[no-any-return]


def test_records_pipelined_behind_auth_beyond_the_readers_limit(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 3 << 20)
    chunk = 64 << 10
    m = T.build_manifest(ckpt, "j1", chunk)
    data = b"".join((ckpt / n).read_bytes() for n, _, _ in m.files)

    def source(port: int, loop: asyncio.AbstractEventLoop) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            nc = secrets.token_bytes(32)
            s.sendall(_frame({"t": "hello", "v": T.PROTOCOL_VERSION, "zone": 0, "node": "src", "nonce": nc.hex()}))
            ns = bytes.fromhex(str(_read_msg(s)["nonce"]))
            seal = _Sealer(T.derive_keys(KEY, nc, ns)[0])
            ident = T.hello_identity(T.PROTOCOL_VERSION, 0, "src")  # the hello's claims, under the MAC
            blob = [_frame({"t": "auth", "mac": T.mac(KEY, b"laminar-xfer-client", ns, nc, ident)}),
                    seal(_frame({"t": "offer", "manifest": m.body(),
                                 "mac": T.mac(KEY, b"laminar-manifest", m.digest.encode())}))]
            for i in range(len(m.chunks)):
                p = data[i * chunk:(i + 1) * chunk]
                blob += [seal(_frame({"t": "chunk", "i": i, "len": len(p)})), seal(p)]
            blob.append(seal(_frame({"t": "done"})))
            busy = threading.Event()

            def block() -> None:  # the destination's loop is busy elsewhere (another commit, a probe)
                busy.set()
                time.sleep(0.5)

            loop.call_soon_threadsafe(block)
            busy.wait()
            s.sendall(b"".join(blob))  # all of it behind auth, without waiting for ok
            s.settimeout(20)  # far more than the transfer takes; a stall is cut here
            with contextlib.suppress(TimeoutError):
                while s.recv(1 << 16):  # the destination's answers, until it closes
                    pass

    async def body(rcv: Receiver, port: int) -> None:
        assert rcv.server is not None
        # socket buffers sized for a fast link (as a tcp_rmem tuned for 100 Gb/s gives every
        # connection): the first read after the busy stretch takes far more than the reader's limit
        rcv.server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        loop = asyncio.get_running_loop()
        t = threading.Thread(target=source, args=(port, loop), daemon=True)
        t.start()
        await asyncio.to_thread(t.join, 30)
        assert [(c.job_id, c.ckpt_id) for c in rcv.committed] == [("j1", ckpt.name)]
        assert verified_checkpoint(rcv.committed[0].path)

    asyncio.run(with_receiver(tmp_path / "dst", body))
