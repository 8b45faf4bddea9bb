"""laminar.offloop.Lane: blocking work on paths a job controls, in threads of its own, bounded in
threads per owner and in time. Real threads blocked on a real ``threading.Event`` stand for a
thread held by storage that does not answer (the kernel tests use a real hung FUSE mount)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from laminar.offloop import Lane, LaneBusy


def test_work_runs_in_a_thread_of_the_lane_and_its_result_or_error_comes_back() -> None:
    lane = Lane("t", workers=2, timeout_s=5.0)

    def where() -> str:
        return threading.current_thread().name

    def fails() -> None:
        raise OSError("no such file")

    async def main() -> None:
        assert await lane.run(1, where) == "laminar-t"
        with pytest.raises(OSError, match="no such file"):
            await lane.run(1, fails)

    asyncio.run(main())
    assert lane.stats()["done"] == 1 and lane.stats()["failed"] == 1 and lane.stats()["running"] == 0


def test_a_stuck_owner_holds_one_thread_and_is_refused_at_once_while_others_go_on() -> None:
    """Owner 1's work waits on storage that does not answer: its caller gets TimeoutError after
    the lane's limit, its worker is freed for owner 2, and owner 1's next work is refused at once
    (LaneBusy) instead of starting a second stuck thread. Once the storage answers, owner 1 is
    served again."""
    lane = Lane("t", workers=1, timeout_s=0.3)
    hung = threading.Event()

    async def main() -> None:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await lane.run(1, hung.wait)
        assert time.monotonic() - t0 < 2.0
        assert lane.stuck(1) and lane.stats()["stuck"] == 1
        assert await lane.run(2, lambda: "other owner") == "other owner"  # the only worker was freed
        with pytest.raises(LaneBusy):
            await lane.run(1, lambda: "again")
        hung.set()  # the storage answers: the stuck thread returns
        for _ in range(100):
            if not lane.stuck(1):
                break
            await asyncio.sleep(0.01)
        assert await lane.run(1, lambda: "served") == "served"

    try:
        asyncio.run(main())
    finally:
        hung.set()
    st = lane.stats()
    assert st["timeouts"] == 1 and st["busy"] == 1 and st["stuck"] == 0


def test_one_owners_work_queues_behind_its_own_never_ahead_of_anothers() -> None:
    lane = Lane("t", workers=4, timeout_s=5.0)
    order: list[str] = []
    gate = threading.Event()

    def step(name: str, wait: bool) -> str:
        if wait:
            gate.wait(5)
        order.append(name)
        return name

    async def main() -> None:
        a1 = asyncio.ensure_future(lane.run("a", step, "a1", True))
        await asyncio.sleep(0.05)
        a2 = asyncio.ensure_future(lane.run("a", step, "a2", False))  # waits for a1 (one per owner)
        b1 = await lane.run("b", step, "b1", False)  # another owner: not behind a
        assert b1 == "b1" and order == ["b1"]
        gate.set()
        assert await a1 == "a1" and await a2 == "a2"

    asyncio.run(main())
    assert order == ["b1", "a1", "a2"]


def test_the_wait_for_a_worker_counts_against_the_callers_limit() -> None:
    lane = Lane("t", workers=1, timeout_s=5.0)
    gate = threading.Event()

    async def main() -> None:
        first = asyncio.ensure_future(lane.run(1, gate.wait, 5))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await lane.run(2, lambda: None, timeout_s=0.2)
        gate.set()
        await first

    try:
        asyncio.run(main())
    finally:
        gate.set()


def test_a_lane_refuses_settings_that_make_no_sense() -> None:
    with pytest.raises(ValueError, match="workers 0"):
        Lane("t", workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        Lane("t", timeout_s=0)
