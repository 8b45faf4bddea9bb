"""The sending agent builds its offer off its event loop: a real transfer over loopback, the
destination on its own loop in another thread, with the manifest's serialization (its digest
for the MAC, the offer's JSON) watched for the thread it runs on. For a 100 GiB checkpoint in
1 MiB chunks that is ~7 MB of JSON twice, ~80 ms, and it ran on the source agent's loop at
every attempt."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar.migrate.transfer import Manifest, Receiver, send_checkpoint


def test_an_offer_is_built_off_the_senders_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_ckpt(tmp_path, 300_000)
    on_loop: list[bool] = []
    sender_thread = threading.main_thread()
    real = Manifest.body

    def spy(self: Manifest) -> Any:
        on_loop.append(threading.current_thread() is sender_thread)
        return real(self)

    monkeypatch.setattr(Manifest, "body", spy)
    started, stop = threading.Event(), threading.Event()
    port: list[int] = []

    def destination() -> None:  # the destination agent: its own loop, its own thread
        async def body(rcv: Receiver, p: int) -> None:
            port.append(p)
            started.set()
            await asyncio.to_thread(stop.wait, 60)
        asyncio.run(with_receiver(tmp_path / "dst", body))

    t = threading.Thread(target=destination)
    t.start()
    try:
        assert started.wait(30)
        for _ in range(2):  # the second time: the destination answers "committed"
            res = asyncio.run(send_checkpoint("127.0.0.1", port[0], ckpt, "j1", KEY, chunk_size=4096, retries=0))
            assert res.remote_path
    finally:
        stop.set()
        t.join(30)
    assert on_loop and not any(on_loop), f"{on_loop.count(True)} manifest serializations on the sender's loop"
