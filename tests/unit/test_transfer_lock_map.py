"""The receiver's per-checkpoint locks: bounded, and still mutually exclusive.

A Receiver serializes the connections that offer the same checkpoint with one asyncio.Lock
per (job, checkpoint). It kept every lock it ever made, one entry per checkpoint ever offered,
so an agent receiving checkpoints for months grew without bound. An entry now lives only while
a connection holds or waits on it. Real Receivers and senders over loopback, real checkpoints.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar.migrate.transfer import Receiver, TransferError, send_checkpoint, verified_checkpoint
from laminar.migrate.transfer.receive import _KeyLocks

KB = 1 << 10


def test_the_lock_map_is_empty_after_many_checkpoints_were_received(tmp_path: Path) -> None:
    ckpts = [make_ckpt(tmp_path / f"c{n}", 64 * KB, step=n) for n in range(6)]
    other = make_ckpt(tmp_path / "other", 64 * KB, step=0)  # ckpt-0 again, other bytes

    async def body(rcv: Receiver, port: int) -> list[str]:
        paths = []
        for n, ck in enumerate(ckpts):
            res = await send_checkpoint("127.0.0.1", port, ck, f"job{n}", KEY, chunk_size=16 * KB, retries=0)
            paths.append(res.remote_path)
        # offered again (already committed): answered without a transfer, no entry left either
        await send_checkpoint("127.0.0.1", port, ckpts[0], "job0", KEY, retries=0)
        # refused (same name, other content): the error path leaves no entry either
        with pytest.raises(TransferError, match="already committed with other content"):
            await send_checkpoint("127.0.0.1", port, other, "job0", KEY, retries=0)
        assert len(rcv._locks) == 0, f"{len(rcv._locks)} lock entries left after 8 offers"
        return paths

    paths = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert all(verified_checkpoint(p) for p in paths)


def test_two_connections_offering_the_same_checkpoint_are_still_served_one_after_the_other(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path, 512 * KB)
    inside: dict[str, int] = {"now": 0, "most": 0, "entries_seen": 0}

    async def body(rcv: Receiver, port: int) -> list[str]:
        real = rcv._receive

        async def counted(*a: Any) -> None:
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])
            inside["entries_seen"] = max(inside["entries_seen"], len(rcv._locks))
            try:
                for _ in range(20):  # gives the other connection every chance to come in
                    await asyncio.sleep(0)
                await real(*a)
            finally:
                inside["now"] -= 1

        rcv._receive = counted  # type: ignore[method-assign,assignment]
        res = await asyncio.gather(*(send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=32 * KB, retries=0)
                                     for _ in range(3)))
        assert len(rcv._locks) == 0
        return [r.remote_path for r in res]

    paths = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert inside["most"] == 1, "two connections received the same checkpoint at once"
    assert inside["entries_seen"] == 1  # the three shared one entry
    assert len(set(paths)) == 1 and verified_checkpoint(paths[0])


def test_a_waiter_keeps_the_entry_so_a_later_connection_still_waits_its_turn() -> None:
    """A holds, B waits; A leaves while B waits (the entry must stay: B is on its lock); C
    comes while B holds and must wait for B, not get a fresh lock of its own."""
    order: list[str] = []

    async def run() -> None:
        locks = _KeyLocks()
        key = ("j", "ckpt-1")
        a_in, a_go, b_in, b_go = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def a() -> None:
            async with locks.hold(key, 5):
                order.append("a in")
                a_in.set()
                await a_go.wait()
                order.append("a out")

        async def b() -> None:
            async with locks.hold(key, 5):
                order.append("b in")
                b_in.set()
                await b_go.wait()
                order.append("b out")

        async def c() -> None:
            async with locks.hold(key, 5):
                order.append("c in")

        ta = asyncio.create_task(a())
        await a_in.wait()
        tb = asyncio.create_task(b())
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(locks) == 1 and locks.held() == {key}
        a_go.set()
        await b_in.wait()
        tc = asyncio.create_task(c())
        for _ in range(10):
            await asyncio.sleep(0)
        assert "c in" not in order, order  # C waits for B
        b_go.set()
        await asyncio.gather(ta, tb, tc)
        assert len(locks) == 0

    asyncio.run(run())
    assert order == ["a in", "a out", "b in", "b out", "c in"]


def test_a_waiter_that_times_out_or_is_cancelled_leaves_no_entry_and_takes_no_lock() -> None:
    async def run() -> None:
        locks = _KeyLocks()
        key = ("j", "ckpt-2")
        held, go = asyncio.Event(), asyncio.Event()

        async def keeper() -> None:
            async with locks.hold(key, 5):
                held.set()
                await go.wait()

        th = asyncio.create_task(keeper())
        await held.wait()
        with pytest.raises(TransferError, match="j/ckpt-2 is busy with another connection"):
            async with locks.hold(key, 0.05):
                raise AssertionError("entered a lock another connection holds")

        async def waiter() -> None:
            async with locks.hold(key, 5):
                raise AssertionError("a cancelled waiter entered")

        tw = asyncio.create_task(waiter())
        for _ in range(5):
            await asyncio.sleep(0)
        tw.cancel()
        with pytest.raises(asyncio.CancelledError):
            await tw
        assert len(locks) == 1  # the keeper's
        go.set()
        await th
        assert len(locks) == 0
        async with locks.hold(key, 0.05):  # free again: nobody holds it
            assert locks.held() == {key}
        assert len(locks) == 0

    asyncio.run(run())
