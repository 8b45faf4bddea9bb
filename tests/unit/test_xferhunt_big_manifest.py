"""Transfer bug found by the hunt, over a real loopback connection with real files: a message
header longer than one AES-GCM record (RECORD_MAX, 1 MiB) was sealed as one record into the
1 MiB record buffer and failed with ValueError at every attempt. An offer's manifest passes
1 MiB at ~15k chunks (a checkpoint of ~15 GiB in the default 1 MiB chunks), so no large
checkpoint could be sent at all; a ``have`` or ``need`` list of that many chunks failed the
same way. Here: a 1.6 MB checkpoint in 64-byte chunks (25k chunks, a 1.7 MB manifest). (A ``have``
list past 1 MiB, ~180k chunks, takes the same path and is too slow to build here.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from xferrig import KEY, make_ckpt, with_receiver

from laminar.migrate import transfer as T
from laminar.migrate.transfer import Receiver, send_checkpoint, verified_checkpoint
from laminar.migrate.transfer.channel import RECORD_MAX


def test_a_manifest_longer_than_a_record_is_offered_and_delivered(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 1_600_000)
    m = T.build_manifest(ckpt, "j1", 64)
    assert len(json.dumps(m.body())) > RECORD_MAX

    async def body(rcv: Receiver, port: int) -> None:
        res = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64, retries=0, manifest=m)
        dst = await asyncio.to_thread(verified_checkpoint, res.remote_path)
        assert (dst / "state.bin").read_bytes() == (ckpt / "state.bin").read_bytes()

    asyncio.run(with_receiver(tmp_path / "dst", body))

