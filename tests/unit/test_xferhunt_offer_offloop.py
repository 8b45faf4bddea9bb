"""The receiving agent takes an offer in off its event loop: a real transfer over loopback,
the sender on its own loop in another thread, with the manifest's serialization (its digest,
the copy kept beside the partial file) watched for the thread it runs on. A 100 GiB
checkpoint in 1 MiB chunks has a manifest of ~7 MB of JSON; its digest and the partial's
manifest copy cost ~80 ms each offer, and ran on the destination's loop (probes,
heartbeats, kill-switches waited behind them)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar.migrate.transfer import Manifest, Receiver, send_checkpoint, verified_checkpoint


def test_an_offer_is_parsed_and_recorded_off_the_receivers_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_ckpt(tmp_path, 300_000)
    on_loop: list[bool] = []
    receiver_loop_thread = threading.main_thread()
    real = Manifest.body

    def spy(self: Manifest) -> Any:
        on_loop.append(threading.current_thread() is receiver_loop_thread)
        return real(self)

    monkeypatch.setattr(Manifest, "body", spy)

    async def body(rcv: Receiver, port: int) -> None:
        res: dict[str, Any] = {}

        def sender() -> None:  # the source agent: its own loop, its own thread
            res["r"] = asyncio.run(send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=4096, retries=0))

        t = threading.Thread(target=sender)
        t.start()
        await asyncio.to_thread(t.join)
        assert await asyncio.to_thread(verified_checkpoint, res["r"].remote_path)
        # and the offer of a checkpoint it already holds
        t = threading.Thread(target=sender)
        t.start()
        await asyncio.to_thread(t.join)
        assert res["r"].sent_bytes == 0

    asyncio.run(with_receiver(tmp_path / "dst", body))
    assert on_loop and not any(on_loop), f"{on_loop.count(True)} manifest serializations on the receiver's loop"
