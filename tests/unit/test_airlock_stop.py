"""``Airlock.stop`` is idempotent: a second stop is a no-op, and a stop after a start that failed
(or never ran) is safe. A real start needs cgroups: ``tests/kernel/test_airlock_kill_restart.py``
stops a started Airlock twice (once itself, once through ``jobrig.airlock_rig``)."""

from __future__ import annotations

import asyncio
import os

import pytest

from laminar.airlock.manager import Airlock
from laminar.airlock.signals import PriPoller
from laminar.events import EventBus


def test_a_stop_of_an_airlock_never_started_is_safe_twice() -> None:
    async def main() -> None:
        al = Airlock()
        await al.stop()
        await al.stop()
        assert al.loop is None

    asyncio.run(main())


def test_a_stop_after_a_refused_start_is_safe_twice() -> None:
    async def main() -> None:
        al = Airlock()  # no jobs component: start refuses
        with pytest.raises(RuntimeError, match="needs the jobs component"):
            await al.start(None)
        await al.stop()
        await al.stop()
        assert al.loop is None

    asyncio.run(main())


def test_a_second_stop_lets_go_of_nothing_twice() -> None:
    """What a start leaves (its subscription, its poller read by the loop with a source in it,
    its ticker, an evaluation armed) is let go of once: the second stop neither closes the
    poller again (its fd may be another file's by then) nor raises."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        bus = EventBus(None)
        al = Airlock(events=bus)
        al.loop = loop
        unsubscribed = []
        unsub = bus.subscribe(lambda ev: None)
        al._unsub = lambda: (unsubscribed.append(1), unsub())
        r, w = os.pipe()
        try:
            poller = PriPoller()
            poller.add(r, "test", pri=False)
            loop.add_reader(poller.fileno(), lambda: None)
            al._poller = poller
            al._task = loop.create_task(asyncio.sleep(600))
            al._timer = loop.call_later(600, lambda: None)
            task, timer = al._task, al._timer
            await al.stop()
            assert unsubscribed == [1] and bus._subs == []
            assert poller.ep.closed and task.cancelling() and timer.cancelled()
            await al.stop()  # no second unsubscribe, no close of a closed poller
            assert unsubscribed == [1]
            assert al.loop is None and al._poller is None and al._task is None and al._timer is None
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            os.close(r)
            os.close(w)

    asyncio.run(main())
