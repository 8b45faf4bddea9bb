"""The agent's event bus: every decision and observation, recorded and streamed.

``emit`` stores the event in SQLite (so ``laminarctl events`` shows history across restarts)
and hands it to subscribers: the control API's ``/v1/events?follow=1`` streams and the
components that react to events (Airlock reacts to pressure events). High-rate kinds (raw BPF
pressure events) can be marked transient: streamed and counted, but only sampled into the store.

An event a local user's action caused (``emit(..., by_uid=uid)``: their job queued, started,
stopped) is charged to that user's budget (`laminar.userbounds.EventBudget`, config ``[agent]
user_events_burst`` and ``user_events_per_s``): one user who submits and stops jobs in a loop
must not push everyone else's history out of the store's bounded log (``store.EVENTS_KEEP``).
Past the budget such events still reach the streams but are not stored; one stored ``agent``
event says when a user's budget ran out, and one how many were not stored once it refilled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .store import Store
from .userbounds import EventBudget

log = logging.getLogger("laminar.events")

Subscriber = Callable[[dict[str, Any]], None]


class EventBus:
    def __init__(self, store: Store | None, user_burst: float = 0, user_per_s: float = 1.0) -> None:
        self.store = store
        self._subs: list[Subscriber] = []
        self._seq = 0
        self.budget = EventBudget(user_burst, user_per_s, self._budget_spent) if user_burst > 0 else None

    def _budget_spent(self, uid: int, text: str, not_stored: int) -> None:
        self.emit("agent", text, uid=uid, events_not_stored=not_stored)

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Calls fn(event) for every event from now on; returns the function that unsubscribes."""
        self._subs.append(fn)

        def unsubscribe() -> None:
            if fn in self._subs:
                self._subs.remove(fn)

        return unsubscribe

    def emit(self, kind: str, message: str, *, persist: bool = True, by_uid: int | None = None,
             **fields: Any) -> dict[str, Any]:
        """Records an event and delivers it to subscribers. A failing subscriber is logged, not
        fatal. `by_uid`: the local user whose action caused it (charged to their budget; past it
        the event is delivered but not stored)."""
        if persist and by_uid and self.budget is not None and not self.budget.admit(by_uid):
            persist = False
        ts = time.time()
        event_id = 0
        if persist and self.store is not None:
            event_id = self.store.add_event(kind, message, fields, ts)
        self._seq += 1
        event = {"id": event_id, "seq": self._seq, "ts": ts, "kind": kind, "message": message, **fields}
        log.info("%s: %s", kind, message, extra={"fields": fields})
        for fn in list(self._subs):
            try:
                fn(event)
            except Exception:  # a broken subscriber must not stop the others
                log.exception("event subscriber %r failed", fn)
        return event
