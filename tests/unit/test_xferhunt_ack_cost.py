"""Transfer receiver bug found by the hunt, over a real loopback connection with real files:
every ``ack`` (one per PERSIST_EVERY chunks) summed the sizes of all chunks held so far on the
agent's event loop, so a transfer's acks cost O(chunks²) in all: about 34 ms of loop per ack
near the end of a 100 GiB checkpoint in 1 MiB chunks, every 8 MiB received. The cost is
counted here as calls of ``Manifest.chunk_len`` (work, not time): it must grow linearly with
the chunks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar.migrate.transfer import Manifest, Receiver, send_checkpoint, verified_checkpoint


def test_acks_cost_linear_work_in_the_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunk = 256
    ckpt = make_ckpt(tmp_path, 600 * chunk)
    calls = 0
    real = Manifest.chunk_len

    def counted(self: Manifest, i: int) -> int:
        nonlocal calls
        calls += 1
        return real(self, i)

    monkeypatch.setattr(Manifest, "chunk_len", counted)
    acked: list[int] = []

    async def body(rcv: Receiver, port: int) -> None:
        res = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=chunk, retries=0,
                                    progress=lambda p: acked.append(p.done_bytes))
        assert verified_checkpoint(res.remote_path)
        n = (res.total_bytes + chunk - 1) // chunk
        assert len(acked) >= n // 8  # the acks did come, and they count what was held
        assert acked == sorted(acked) and acked[-1] == res.total_bytes
        # sender and receiver together: a few calls per chunk, not one per chunk held per ack
        assert calls <= 8 * n, f"{calls} chunk_len calls for {n} chunks"

    asyncio.run(with_receiver(tmp_path / "dst", body))
