"""The checkpoint sender's progress is the bytes its peer's TCP acknowledged, not what it wrote.

Real TCP sockets over loopback: the reading of ``tcpi_bytes_acked`` (TCP_INFO) is checked against
what the receiving kernel holds and what the sending kernel still has unacknowledged; a kernel
whose tcp_info lacks the field gives None; and a real transfer to a real Receiver tells its flow
hook acknowledged payload bytes, ending at the registered total, from TCP_INFO and, on a kernel
without it, from SIOCOUTQ.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import socket
import termios
from pathlib import Path
from typing import Any

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar.migrate import transfer as T
from laminar.migrate.transfer import Flow, bytes_acked_of, send_checkpoint, tcp_bytes_acked, tcp_unacked_bytes
from laminar.migrate.transfer import progress as progress_mod

MB = 1 << 20


def _inq(sock: socket.socket) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf, True)
    return int(buf[0])


def _settled(read: Any, tries: int = 200) -> Any:
    """``read()`` once two readings 10 ms apart agree (loopback delivers in a softirq)."""
    import time

    last = read()
    for _ in range(tries):
        time.sleep(0.01)
        now = read()
        if now == last:
            return now
        last = now
    return last


def test_bytes_acked_is_what_the_peer_kernel_holds_not_what_was_written() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    try:
        base = tcp_bytes_acked(cli)
        assert base == 1 and tcp_unacked_bytes(cli) == 0  # the kernel counts the SYN as a byte
        # The peer reads nothing: write until the socket takes no more, so part of what was
        # written sits unsent in the sender's queue, beyond the peer's window.
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        cli.setblocking(False)
        written = 0
        block = b"x" * (64 << 10)
        while True:
            try:
                written += cli.send(block)
            except BlockingIOError:
                break
        acked, unacked, held = _settled(lambda: (tcp_bytes_acked(cli), tcp_unacked_bytes(cli), _inq(peer)))
        assert acked is not None and unacked is not None
        acked -= base
        assert acked + unacked == written  # every byte written is acknowledged or still queued
        assert 0 < acked < written, f"{acked} of {written} acknowledged with the peer's window full"
        # Never more than the peer's kernel holds (it read nothing, so that is all it received;
        # it may hold more than it has acknowledged yet with its window shut).
        assert acked <= held
        # The peer reads it all: all of it is acknowledged.
        cli.setblocking(True)
        cli.shutdown(socket.SHUT_WR)
        got = 0
        while chunk := peer.recv(1 << 20):
            got += len(chunk)
        assert got == written
        assert _settled(lambda: tcp_unacked_bytes(cli)) == 0
        end = tcp_bytes_acked(cli)
        assert end is not None and end - base in (written, written + 1)  # + the FIN, once acknowledged
    finally:
        for s in (cli, peer, srv):
            s.close()


def test_a_kernel_without_the_field_gives_none() -> None:
    """struct tcp_info before Linux 4.1 ends before tcpi_bytes_acked (offset 120): no guess."""
    assert bytes_acked_of(b"\0" * 104) is None
    assert bytes_acked_of(b"\0" * 127) is None
    assert bytes_acked_of(b"\0" * 120 + (12345).to_bytes(8, "little") + b"\0" * 8) == 12345
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        assert tcp_bytes_acked(u) is None  # not TCP: no tcp_info
    finally:
        u.close()


class RecordingHook:
    """A flow hook that keeps what it is told (the real one feeds the shaper's registry)."""

    def __init__(self) -> None:
        self.total = 0
        self.told: list[int] = []
        self.unregistered_after: list[int] | None = None

    def register(self, flow: Flow, job_id: str, total_bytes: int, deadline_monotonic: float | None) -> Any:
        self.total = total_bytes
        return "h1"

    def progress(self, handle: Any, acked_bytes: int) -> None:
        assert handle == "h1"
        self.told.append(acked_bytes)

    def unregister(self, handle: Any) -> None:
        self.unregistered_after = list(self.told)


@pytest.mark.parametrize("kernel", ["tcp_info", "siocoutq"])
def test_a_real_transfer_reports_acknowledged_bytes_up_to_the_total(tmp_path: Path, kernel: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel == "siocoutq":  # a kernel whose tcp_info has no tcpi_bytes_acked
        monkeypatch.setattr(progress_mod, "tcp_bytes_acked", lambda sock: None)
    monkeypatch.setattr(progress_mod, "ACK_POLL_S", 0.02)
    ck = make_ckpt(tmp_path, 3 * MB + 12345)
    hook = RecordingHook()
    positions: list[tuple[int, int]] = []  # (acknowledged payload, chunk payload written) at each reading
    real_read = progress_mod._AckMeter.read

    def read(self: progress_mod._AckMeter) -> int | None:
        n = real_read(self)
        if n is not None:
            positions.append((n, self.payload))
        return n

    monkeypatch.setattr(progress_mod._AckMeter, "read", read)

    async def body(_rcv: Any, port: int) -> T.SendResult:
        loop = asyncio.get_running_loop()
        return await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, flow_hook=hook, rate_bps=64e6,
                                     deadline_monotonic=loop.time() + 600)

    res = asyncio.run(with_receiver(tmp_path / "dst", body))
    assert res.total_bytes == hook.total > 0
    assert hook.told, "the hook was told nothing"
    assert hook.told == sorted(set(hook.told)), f"progress went back or repeated: {hook.told}"
    assert all(0 < n <= hook.total for n in hook.told)
    assert hook.told[-1] == hook.total  # committed: all of it
    assert hook.unregistered_after == hook.told  # told before it was unregistered
    assert positions, "the acknowledged bytes were never read"
    assert all(acked <= written for acked, written in positions)


def test_the_registry_takes_acknowledged_bytes_alone_and_refuses_a_bad_flag() -> None:
    """Reported as acknowledged, progress is the report, not the leaf's count (which runs ahead of
    it by what is in flight) and leaves no unconfirmed bytes; otherwise the larger of the two."""
    from laminar.api import ApiError
    from laminar.net import killswitch as ks
    from laminar.net.transfers import Transfer, TransferRegistry

    reg = TransferRegistry()
    t = Transfer("t-1", "job-1", 1, ks.FlowKey("tcp", "10.0.0.1", 40000, "10.0.0.2", 7000), 10 * MB, 0, 0.0, 0x100)
    reg.transfers[t.id] = t
    t.counted_bytes = 8 * MB  # the leaf has sent this much, headers included
    assert (t.sent_bytes, t.progress) == (int(8 * MB * 0.94), "estimated") and t.unconfirmed_bytes > 0
    reg.report(t.id, 2 * MB)  # a report that is not acknowledged bytes: the estimate still wins
    assert (t.sent_bytes, t.progress) == (int(8 * MB * 0.94), "estimated")
    reg.report(t.id, 5 * MB, acked=True)
    assert (t.sent_bytes, t.progress, t.unconfirmed_bytes) == (5 * MB, "acked", 0)
    assert t.as_dict(0, 0x4c4d)["estimated"] is False
    reg.report(t.id, 4 * MB)  # never back
    assert t.sent_bytes == 5 * MB
    with pytest.raises(ApiError, match="acked = 'yes'"):
        reg.report(t.id, 6 * MB, acked="yes")
    assert t.sent_bytes == 5 * MB
    reg.report(t.id, 10 * MB, acked=True)
    assert t.demand().remaining_bytes == 0
