"""The agent's stop shares one deadline, ``agent.shutdown_timeout_s``, across its components.

Each component used to get its own shutdown_timeout_s (10 s by default, up to 300 s) one after
another, so two hung components took the stop past the unit's TimeoutStopSec=20s and systemd
SIGKILLed the agent mid-stop (Result=timeout), before the components after them saved their
state. Now a component still stopping at the shared deadline is cancelled, each one after it
gets a short grace (its stop still runs and saves), and the agent tells systemd the bound
(EXTEND_TIMEOUT_USEC). Stand-in components (one never returns); a real Agent object, store and
notify socket; nothing is started.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from laminar import agent as agent_mod
from laminar.agent import Agent, stop_bound_s
from laminar.config import load

BUDGET_S = 0.3
GRACE_S = 0.05  # the grace, shortened for the test (agent.STOP_GRACE_S)


class Hangs:
    """A component whose stop never returns (until cancelled)."""

    def __init__(self) -> None:
        self.cancelled = False

    async def stop(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class Saves:
    """A component whose stop returns at once, having saved its state."""

    def __init__(self) -> None:
        self.saved = False

    async def stop(self) -> None:
        await asyncio.sleep(0)
        self.saved = True


def make_agent(tmp: Path) -> Agent:
    cfg = tmp / "laminard.toml"
    cfg.write_text(f'[agent]\nstate_dir = "{tmp / "state"}"\nsocket = "{tmp / "sock" / "laminard.sock"}"\n'
                   f"shutdown_timeout_s = {BUDGET_S}\n\n[metrics]\nlisten = \"\"\n")
    return Agent(load(cfg))


def test_hung_components_share_one_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = make_agent(tmp_path)
    first, second, saves = Hangs(), Hangs(), Saves()
    agent.components = [saves, second, first]  # stopped last started first: first, second, saves
    given: list[float] = []  # the time each stop (the API server's first) was given
    real_wait_for = asyncio.wait_for

    async def recording_wait_for(aw: Any, timeout: float) -> Any:
        given.append(timeout)
        return await real_wait_for(aw, timeout)

    monkeypatch.setattr(agent_mod.asyncio, "wait_for", recording_wait_for)
    monkeypatch.setattr(agent_mod, "STOP_GRACE_S", GRACE_S)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    try:
        asyncio.run(agent.shutdown())
        told = notify.recv(4096).decode()
    finally:
        notify.close()
    assert first.cancelled and second.cancelled
    assert saves.saved, "a component after the hung ones never got to stop"
    assert len(given) == 4, given
    # The first hung component may use what is left of the budget; once it is spent, each later
    # one gets the grace alone, not a fresh shutdown_timeout_s (before: every one got 0.3 s).
    assert given[1] <= BUDGET_S
    assert given[2] == GRACE_S and given[3] == GRACE_S, given
    bound = stop_bound_s(BUDGET_S, 3)
    assert sum(given[1:]) <= bound
    assert told.startswith("EXTEND_TIMEOUT_USEC="), told
    assert int(told.split("=", 1)[1]) >= bound * 1e6, (told, bound)


def test_the_migrate_components_stop_gives_in_to_the_deadline() -> None:
    """The migrate component's stop cancels its tasks and waits for them; a cancel of that stop
    (the shared deadline) is not swallowed with theirs. It awaited each task under
    ``suppress(BaseException)``: the deadline's cancel ended only the wait on the first task, and
    the stop went on waiting for every other one's slow cleanup, past the bound told to systemd.
    The real ReclaimComponent.stop over a bare component (no store, no receiver: nothing started)
    whose two tasks take 5 s each to clean up after their cancel."""
    from laminar.migrate.reclaim import ReclaimComponent

    async def main() -> None:
        comp = ReclaimComponent.__new__(ReclaimComponent)  # stop() needs only what is set here
        comp._unsubscribe = None
        comp.evidence = SimpleNamespace(save=lambda: None)  # type: ignore[assignment]
        comp.receiver = None

        async def slow_cleanup() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                await asyncio.sleep(5)

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(slow_cleanup()), loop.create_task(slow_cleanup())]
        comp._loop_task, comp._tasks = tasks[0], {tasks[1]}
        await asyncio.sleep(0)
        with pytest.raises(TimeoutError):  # before: the stop "returned" once every cleanup ended
            await asyncio.wait_for(comp.stop(), BUDGET_S)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
