"""The agent's event bus: every decision and observation, recorded and streamed.

``emit`` stores the event in SQLite (so ``laminarctl events`` shows history across restarts)
and hands it to subscribers: the control API's ``/v1/events?follow=1`` streams and the
components that react to events (Airlock reacts to pressure events). High-rate kinds (raw BPF
pressure events) can be marked transient: streamed and counted, but only sampled into the store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .store import Store

log = logging.getLogger("laminar.events")

Subscriber = Callable[[dict[str, Any]], None]


class EventBus:
    def __init__(self, store: Store | None) -> None:
        self.store = store
        self._subs: list[Subscriber] = []
        self._seq = 0

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Calls fn(event) for every event from now on; returns the function that unsubscribes."""
        self._subs.append(fn)

        def unsubscribe() -> None:
            if fn in self._subs:
                self._subs.remove(fn)

        return unsubscribe

    def emit(self, kind: str, message: str, *, persist: bool = True, **fields: Any) -> dict[str, Any]:
        """Records an event and delivers it to subscribers. A failing subscriber is logged, not fatal."""
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
