"""Checkpoint transfer between two namespaces over a real veth pair: delivery, resume after a
killed sender or a restarted receiver, corruption in transit and at rest, authentication.

The receiver runs in namespace b (``python -m laminar.migrate.transfer serve``), the sender in
namespace a, both as real processes entered with nsenter --net.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from xferrig import make_ckpt

from laminar import jobkit
from laminar.migrate.transfer import TransferError, latest_verified, verified_checkpoint

pytestmark = pytest.mark.kernel

PY = sys.executable
MB = 1 << 20


def keyfile(tmp: Path, name: str = "zone.keys") -> Path:
    p = tmp / name
    p.write_text(f"* {secrets.token_hex(32)}\n")
    p.chmod(0o600)
    return p



class Proc:
    """A process in a namespace whose JSON lines we read as they come."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.err = open(log, "w")
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.err, text=True)

    def next_event(self, want: str, timeout: float = 60) -> dict[str, object]:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                raise AssertionError(f"process ended (rc={self.p.poll()}) before {want!r}: {self.log.read_text()[-2000:]}")
            ev = json.loads(line)
            if ev.get("event") == want:
                return ev
        raise AssertionError(f"no {want!r} within {timeout}s")

    def wait(self, timeout: float = 120) -> int:
        return self.p.wait(timeout=timeout)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.err.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in started:
            p.kill()


def serve(veth, procs: list[Proc], root: Path, key: Path, port: int, tmp: Path) -> Proc:  # type: ignore[no-untyped-def]
    p = Proc(veth.b.argv(PY, "-m", "laminar.migrate.transfer", "serve", "--root", str(root),
                         "--listen", f"{veth.addr_b}:{port}", "--key-file", str(key)), tmp / f"serve-{len(procs)}.log")
    procs.append(p)
    p.next_event("listening")
    return p


def send(veth, procs: list[Proc], ckpt: Path, key: Path, tmp: Path, port: int, *extra: str, to: str | None = None) -> Proc:  # type: ignore[no-untyped-def]
    p = Proc(veth.a.argv(PY, "-m", "laminar.migrate.transfer", "send", "--to", f"{to or veth.addr_b}:{port}",
                         "--job", "j1", "--ckpt", str(ckpt), "--key-file", str(key), *extra), tmp / f"send-{len(procs)}.log")
    procs.append(p)
    return p


def port() -> int:
    return 20000 + secrets.randbelow(20000)


def test_checkpoint_crosses_the_veth_and_commits_verified(veth_pair, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    key, pt = keyfile(tmp_path), port()
    ckpt = make_ckpt(tmp_path, 5 * MB + 123)
    srv = serve(veth_pair, procs, tmp_path / "dst", key, pt, tmp_path)
    snd = send(veth_pair, procs, ckpt, key, tmp_path, pt, "--chunk-size", str(256 * 1024))
    sent = snd.next_event("sent")
    assert snd.wait() == 0
    com = srv.next_event("committed")
    dst = Path(str(com["path"]))
    assert dst == tmp_path / "dst/checkpoints/j1/ckpt-40"
    assert verified_checkpoint(dst) == dst
    assert (dst / "state.bin").read_bytes() == (ckpt / "state.bin").read_bytes()
    assert sent["skipped_bytes"] == 0 and sent["attempts"] == 1
    # the job on the destination resumes from it through the contract
    assert jobkit.Checkpointer(ckpt_dir=tmp_path / "j", resume_from=dst, install_signal=False).resume() == (
        ckpt / "state.bin").read_bytes()
    # sending again is a no-op: the destination already holds it
    again = send(veth_pair, procs, ckpt, key, tmp_path, pt)
    assert again.next_event("sent")["sent_bytes"] == 0


def test_resume_after_the_sender_is_killed_mid_transfer(veth_pair, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    key, pt = keyfile(tmp_path), port()
    size = 6 * MB
    ckpt = make_ckpt(tmp_path, size)
    srv = serve(veth_pair, procs, tmp_path / "dst", key, pt, tmp_path)
    slow = send(veth_pair, procs, ckpt, key, tmp_path, pt, "--rate-bps", str(16e6), "--chunk-size", str(128 * 1024))
    while True:  # wait until the destination has persisted a good part of it
        ev = slow.next_event("progress")
        if int(str(ev["bytes"])) >= size // 3:
            break
    slow.kill()
    fast = send(veth_pair, procs, ckpt, key, tmp_path, pt, "--chunk-size", str(128 * 1024))
    res = fast.next_event("sent")
    assert res["skipped_bytes"] >= size // 3
    # only what the destination lacked went again
    assert int(str(res["sent_bytes"])) == int(str(res["total_bytes"])) - int(str(res["skipped_bytes"]))
    dst = Path(str(srv.next_event("committed")["path"]))
    assert (dst / "state.bin").read_bytes() == (ckpt / "state.bin").read_bytes()


def test_resume_after_the_receiver_restarts(veth_pair, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The destination agent dies mid-transfer and comes back on the same root: what it had
    persisted is kept and the sender, retrying, sends only the rest."""
    key, pt = keyfile(tmp_path), port()
    size = 6 * MB
    ckpt = make_ckpt(tmp_path, size)
    root = tmp_path / "dst"
    srv = serve(veth_pair, procs, root, key, pt, tmp_path)
    snd = send(veth_pair, procs, ckpt, key, tmp_path, pt, "--rate-bps", str(24e6), "--chunk-size", str(128 * 1024),
               "--retries", "40")
    while int(str(srv.next_event("progress")["bytes"])) < size // 3:
        pass
    srv.kill()
    held = len((root / "incoming/j1/ckpt-40/have.log").read_text().split())
    assert held > 0
    srv2 = serve(veth_pair, procs, root, key, pt, tmp_path)
    res = snd.next_event("sent", timeout=120)
    assert res["attempts"] >= 2 and int(str(res["skipped_bytes"])) >= held * 128 * 1024
    dst = Path(str(srv2.next_event("committed")["path"]))
    assert (dst / "state.bin").read_bytes() == (ckpt / "state.bin").read_bytes()


RELAY = r"""
import asyncio, sys
listen_port, host, port, flip_at = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
state = {"conn": 0}
async def pipe(r, w, flip):
    seen = 0
    try:
        while data := await r.read(65536):
            if flip is not None and seen <= flip < seen + len(data):
                b = bytearray(data); b[flip - seen] ^= 0xFF; data = bytes(b)
                print("flipped", flush=True)
            seen += len(data)
            w.write(data); await w.drain()
    finally:
        w.close()
async def handle(r, w):
    state["conn"] += 1
    ur, uw = await asyncio.open_connection(host, port)
    flip = flip_at if state["conn"] == 1 else None
    await asyncio.gather(pipe(r, uw, flip), pipe(ur, w, None), return_exceptions=True)
async def main():
    srv = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    print("ready", flush=True)
    await srv.serve_forever()
asyncio.run(main())
"""


def test_corruption_in_transit_is_caught_and_resent(veth_pair, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A relay on the path flips one byte inside the chunk stream: the destination rejects the
    record that carries it (AES-GCM, protocol v2; before, the chunk's SHA-256), the connection
    ends, the sender reconnects, sends that chunk again, and a byte-identical checkpoint commits."""
    key, pt, rp = keyfile(tmp_path), port(), port()
    size = 4 * MB
    ckpt = make_ckpt(tmp_path, size)
    srv = serve(veth_pair, procs, tmp_path / "dst", key, pt, tmp_path)
    relay = subprocess.Popen(veth_pair.a.argv(PY, "-c", RELAY, str(rp), veth_pair.addr_b, str(pt), str(3 * MB)),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
        snd = send(veth_pair, procs, ckpt, key, tmp_path, rp, to="127.0.0.1")
        res = snd.next_event("sent")
        assert relay.stdout.readline().strip() == "flipped"
    finally:
        relay.kill()
        relay.wait()
    assert int(str(res["sent_bytes"])) > size  # one chunk went twice
    dst = Path(str(srv.next_event("committed")["path"]))
    assert (dst / "state.bin").read_bytes() == (ckpt / "state.bin").read_bytes()
    assert "failed authentication" in srv.log.read_text()


def test_corruption_at_rest_on_the_destination_is_caught_before_commit(veth_pair, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    key, pt = keyfile(tmp_path), port()
    size = 4 * MB
    ckpt = make_ckpt(tmp_path, size)
    root = tmp_path / "dst"
    srv = serve(veth_pair, procs, root, key, pt, tmp_path)
    slow = send(veth_pair, procs, ckpt, key, tmp_path, pt, "--rate-bps", str(16e6), "--chunk-size", str(128 * 1024))
    while int(str(slow.next_event("progress")["bytes"])) < size // 2:
        pass
    slow.kill()
    time.sleep(0.5)  # the receiver notices the closed connection and persists what it has
    inc = root / "incoming/j1/ckpt-40"
    held = sorted(int(x) for x in (inc / "have.log").read_text().split())
    assert held
    with open(inc / "data.partial", "r+b") as f:  # rot one byte of a chunk it already holds
        off = held[0] * 128 * 1024 + 77
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x55]))
    fast = send(veth_pair, procs, ckpt, key, tmp_path, pt, "--chunk-size", str(128 * 1024))
    fast.next_event("sent")
    dst = Path(str(srv.next_event("committed")["path"]))
    assert (dst / "state.bin").read_bytes() == (ckpt / "state.bin").read_bytes()


def test_wrong_key_is_refused_and_nothing_is_committed(veth_pair, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pt = port()
    ckpt = make_ckpt(tmp_path, 100_000)
    serve(veth_pair, procs, tmp_path / "dst", keyfile(tmp_path, "a.keys"), pt, tmp_path)
    snd = send(veth_pair, procs, ckpt, keyfile(tmp_path, "b.keys"), tmp_path, pt)
    ev = snd.next_event("failed")
    assert "authentication" in str(ev["error"])
    assert snd.wait() == 2
    assert latest_verified(tmp_path / "dst", "j1") is None
    assert not list((tmp_path / "dst/incoming").iterdir())


def test_a_committed_checkpoint_that_changes_is_no_longer_verified(veth_pair, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    key, pt = keyfile(tmp_path), port()
    older = make_ckpt(tmp_path, 200_000, step=10)
    newer = make_ckpt(tmp_path, 200_000, step=20)
    srv = serve(veth_pair, procs, tmp_path / "dst", key, pt, tmp_path)
    for ck in (older, newer):
        send(veth_pair, procs, ck, key, tmp_path, pt).next_event("sent")
        srv.next_event("committed")
    root = tmp_path / "dst"
    assert latest_verified(root, "j1") == root / "checkpoints/j1/ckpt-20"
    f = root / "checkpoints/j1/ckpt-20/state.bin"
    data = bytearray(f.read_bytes())
    data[5] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(TransferError, match="changed since it was verified"):
        verified_checkpoint(root / "checkpoints/j1/ckpt-20")
    assert latest_verified(root, "j1") == root / "checkpoints/j1/ckpt-10"  # the last verified one
    with pytest.raises(jobkit.CheckpointError):
        jobkit.Checkpointer(ckpt_dir=tmp_path / "x", resume_from=root / "checkpoints/j1/ckpt-20",
                            install_signal=False).resume()
