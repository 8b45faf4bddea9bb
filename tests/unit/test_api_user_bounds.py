"""The control API's per-user bounds in memory: the control group's gid looked up off the loop
after the first time (L4), an event stream whose reader falls behind ends with a ``lagged`` line
(M2), and an event page is bounded (M2)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from laminar import api as A


def test_the_group_is_looked_up_in_a_thread_after_the_first_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """getgrnam may wait on LDAP or sssd; every connection of a user other than root asks."""
    calls: list[str] = []

    class G:
        gr_gid = 4242

    def slow(name: str) -> G:
        calls.append(threading.current_thread().name)
        time.sleep(0.5)
        return G()

    monkeypatch.setattr(A.grp, "getgrnam", slow)
    auth = A.Authorizer("lm-t-group")
    assert auth.group_gid() == 4242  # the first time (the API's start), where it is asked
    auth._gid = (time.monotonic() - auth.GID_TTL_S - 1, 4242)  # stale
    t0 = time.monotonic()
    assert auth.group_gid() == 4242  # the known gid, at once ...
    assert time.monotonic() - t0 < 0.25
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls[1] == "lm-group-lookup", calls  # ... and looked up again in a thread of its own


def _agent(tmp_path: Path):  # type: ignore[no-untyped-def]
    from laminar.agent import Agent, import_components
    from laminar.config import load

    import_components()
    conf = tmp_path / "a.toml"
    conf.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\nsocket = "{tmp_path}/s.sock"\n[metrics]\nlisten = ""\n')
    return Agent(load(str(conf)))


def test_a_stream_that_falls_behind_ends_with_a_lagged_line(tmp_path: Path) -> None:
    from laminar.agent import FOLLOW_QUEUE

    async def main() -> list[dict]:
        agent = _agent(tmp_path)
        gen = agent._follow(None, 0, 100)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # subscribed, waiting
        for i in range(FOLLOW_QUEUE + 50):
            agent.events.emit("test", f"event {i}")
        got = [await first]
        async for e in gen:
            got.append(e)
        agent.store.close()
        return got

    got = asyncio.run(main())
    assert [e["message"] for e in got[:-1]] == [f"event {i}" for i in range(FOLLOW_QUEUE)]
    assert got[-1]["kind"] == "lagged" and "--since" in got[-1]["message"]


def test_an_event_page_is_bounded(tmp_path: Path) -> None:
    from laminar.agent import MAX_EVENTS

    async def main() -> tuple[list[dict], int]:
        agent = _agent(tmp_path)
        for i in range(MAX_EVENTS + 10):
            agent.events.emit("test", f"event {i}")
        page = await agent._past_events(0, "test", MAX_EVENTS)
        try:
            await agent._events(A.Request("GET", "/v1/events", {"limit": str(MAX_EVENTS + 1)}, {}, None,
                                          A.Peer(1000, 1000, 1)))
        except A.ApiError as e:
            code = e.status
        agent.store.close()
        return page, code

    page, code = asyncio.run(main())
    assert len(page) == MAX_EVENTS and page[-1]["message"] == f"event {MAX_EVENTS + 9}" and code == 400
