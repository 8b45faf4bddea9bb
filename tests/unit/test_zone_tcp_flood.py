"""The hand-over port under a flood of unauthenticated frames, with a real ZoneComponent on
loopback: anyone who reaches the TCP port can announce a frame of up to 1 MiB, and the agent
buffers the whole frame before it checks the MAC. Many such connections held open made the
agent hold a MiB each (before the fix: 300 connections, 300 MiB more resident memory in the
privileged agent on a GPU node). The agent's resident memory is measured (psutil). Now a frame's
header is read and checked first: these frames are dropped there, their MiB never read."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import psutil
from test_loan_component import make_comp, run

from laminar.zone import wire

CONNECTIONS = 300
FRAME = wire.MAX_FRAME  # the largest frame a hand-over may announce


def test_unauthenticated_frames_held_open_do_not_grow_the_agent_s_memory(tmp_path: Path) -> None:
    comp = make_comp(tmp_path, pool="training", gpus=1)
    me = psutil.Process()

    async def check() -> None:
        port = int(comp.s["handover_port"])
        before = me.memory_info().rss
        writers: list[asyncio.StreamWriter] = []
        try:
            for _ in range(CONNECTIONS):
                try:
                    _, w = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    continue
                writers.append(w)
                w.write(struct.pack("!I", FRAME) + b"\0" * (FRAME - 1))  # all but the last byte
            for w in writers:
                try:
                    await asyncio.wait_for(w.drain(), 10)
                except (OSError, TimeoutError):
                    pass  # the agent closed it
            peak = 0
            for _ in range(20):  # let the agent read what it will
                await asyncio.sleep(0.05)
                peak = max(peak, me.memory_info().rss - before)
            assert peak < 64 << 20, f"{peak >> 20} MiB more resident memory for {CONNECTIONS} unauthenticated frames"
            # each refused at accept (past its address's share) or dropped at its header (not a
            # frame of ours: bad_magic) before its MiB was read
            st = comp.stats()
            assert st["handover_tcp"]["refused"] + st["handover_drops"]["bad_magic"] > 0, st
        finally:
            for w in writers:
                w.close()
        # a real hand-over still gets through once the flood is gone
        body = wire.Handover(0x4242, b'{"spec": {"command": ["true"]}}')
        from laminar.zone.transport import handover

        assert comp.encoder is not None and comp.tcp_decoder is not None
        ack = await handover(comp.encoder, comp.tcp_decoder, 1, "127.0.0.1", port, body, 5.0, to=1)
        assert ack.placement_id == 0x4242  # answered ("no reservation": nothing was offered)

    run(comp, check)
