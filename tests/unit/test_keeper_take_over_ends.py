"""A take-over that asks the job's source first (:meth:`Takeover.take_over_unless_alive`,
:meth:`Takeover.take_over_unless_back`) ends the same way however it ends
(:meth:`Takeover.taking_over`): an error in it is logged, never raised into the watch loop,
and the key's take-over ends (``Takeover.taking``: the next round may try it again); a cancel (the agent
stopping) still propagates, and ends it too.

A real component, not started: no zone, so the source cannot be asked (the take-over goes on),
and the keeper's row (a dict, as the store's rows are read) has no ``request``: the take-over
itself fails.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from laminar.migrate.reclaim import ReclaimComponent

KEY = "lmt-take-over-key"


@pytest.mark.parametrize("ask", ["unless_alive", "unless_back"])
def test_a_take_over_that_fails_is_logged_and_ends(ask: str, caplog: pytest.LogCaptureFixture) -> None:
    rc = ReclaimComponent()
    rc.s = {"dead_after_s": 0.1}
    rc.takeover.taking.add(KEY)
    take_over = getattr(rc.takeover, f"take_over_{ask}")
    with caplog.at_level(logging.INFO, logger="laminar.migrate"):
        asyncio.run(take_over({"key": KEY, "src_node": 2}, "lm-t why"))  # does not raise
    assert KEY not in rc.takeover.taking
    assert "node 2 is not a member of this zone" in caplog.text  # asked first: no answer
    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in failed] == [f"migrate: take-over of {KEY}"]
    assert failed[0].exc_info is not None and failed[0].exc_info[0] is KeyError  # the row's missing request


@pytest.mark.parametrize("ask", ["unless_alive", "unless_back"])
def test_a_cancelled_take_over_propagates_and_ends(ask: str) -> None:
    rc = ReclaimComponent()
    rc.s = {"dead_after_s": 0.1}
    rc.takeover.taking.add(KEY)

    async def cancelled(*args: Any, **kwargs: Any) -> None:
        raise asyncio.CancelledError

    rc.takeover.take_over_once = cancelled  # type: ignore[method-assign]  # the agent stops during the take-over
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(getattr(rc.takeover, f"take_over_{ask}")({"key": KEY, "src_node": 2}, "lm-t why"))
    assert KEY not in rc.takeover.taking
