"""laminar.tasks.cancel_until_done: a component's stop ends its tasks also when one of them
loses a cancellation (Python 3.11's wait_for drops one that arrives as its future completes;
here a task drops it itself, the same for its caller), and reads what they raised."""

from __future__ import annotations

import asyncio
import time

from laminar.tasks import cancel_until_done


def test_a_task_that_loses_a_cancellation_is_cancelled_again_until_it_ends() -> None:
    async def loses_one() -> None:
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            pass  # lost, as wait_for loses it: the task goes on to its next wait
        await asyncio.sleep(600)  # (a placement's retry backoff, an interval loop)

    async def fails() -> None:
        raise RuntimeError("read, not logged as never retrieved")

    async def main() -> tuple[float, list[bool]]:
        tasks = [asyncio.ensure_future(loses_one()), asyncio.ensure_future(asyncio.sleep(600)),
                 asyncio.ensure_future(fails())]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await asyncio.wait_for(cancel_until_done(tasks, every_s=0.2), 30)
        return time.monotonic() - t0, [t.done() for t in tasks]

    took, done = asyncio.run(main())
    assert done == [True, True, True]
    assert took < 10, took  # the second cancel ends it, not its 600 s wait
