"""What one local user may hold of the agent at once, and the count of what was refused.

The agent serves every local user from one event loop, a few worker threads and one store. A
user who asks for slow work in parallel (a checkpoint hashed in a thread, a policy parsed in a
child, a path probed on their own hung mount) must not take all of it, and one who makes the
agent record things in a loop must not push everyone else's records out. This module holds the
three pure, in-memory bounds the components share:

- :class:`UidSlots`: at most ``per_uid`` pieces of some work in flight per uid, and ``total``
  for all uids together; the next one is refused at once (:class:`Busy`, a 429 in the API),
  never queued on the user's behalf. Root (uid 0) is never counted; the API also exempts the
  control group (the callers it trusts with privileged routes).
- :class:`EventBudget`: a token bucket per uid for the events a user's actions make the agent
  store (job queued, started, stopped, ...): past it the events still reach the live streams but
  are not stored, and one event says how many were not.
- :class:`Refusals`: every refusal counted by a short stable reason, shown as
  ``api.refused_by_reason`` in ``laminarctl status -o json`` (a benchmark counts attacks there).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


class Busy(Exception):
    """Work refused because the caller already has as much in flight as it may (HTTP 429).
    `reason`: the stable word counted in ``api.refused_by_reason``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class Refusals:
    """Refusals by reason (a short stable word: ``spec_too_large``, ``uid_connections``, ...)."""

    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()

    def count(self, reason: str, n: int = 1) -> None:
        self.by_reason[reason] += n

    def total(self) -> int:
        return sum(self.by_reason.values())

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.by_reason.items()))


@dataclass
class UidSlots:
    """At most `per_uid` pieces of `what` in flight per uid, `total` for all counted uids."""

    what: str
    per_uid: int
    total: int
    reason: str  # counted under it in api.refused_by_reason where the refusal is answered
    held: dict[int, int] = field(default_factory=dict)

    def in_flight(self, uid: int | None = None) -> int:
        return sum(self.held.values()) if uid is None else self.held.get(uid, 0)

    def take(self, uid: int) -> None:
        """Counts one piece for `uid` (uid 0: never counted); raises Busy past a bound."""
        if uid == 0:
            return
        mine = self.held.get(uid, 0)
        if mine >= self.per_uid or self.in_flight() >= self.total:
            raise Busy(f"busy: uid {uid} already has {mine} {self.what} in flight (at most {self.per_uid} per user, "
                       f"{self.total} for all users together); retry when one has finished", self.reason)
        self.held[uid] = mine + 1

    def release(self, uid: int) -> None:
        if uid == 0:
            return
        n = self.held.get(uid, 0) - 1
        if n > 0:
            self.held[uid] = n
        else:
            self.held.pop(uid, None)

    @contextmanager
    def hold(self, uid: int, exempt: bool = False) -> Iterator[None]:
        """One piece for `uid` while the block runs (none when `exempt`: a privileged caller)."""
        if exempt:
            yield
            return
        self.take(uid)
        try:
            yield
        finally:
            self.release(uid)


@dataclass
class _Bucket:
    tokens: float
    at: float
    suppressed: int = 0


class EventBudget:
    """A token bucket per uid: `burst` stored events at once, refilled at `per_s` a second.

    ``admit(uid)`` says whether an event charged to `uid` is stored. When a uid's bucket runs
    dry, `on_spent(uid, text)` is called once (the caller stores one event saying so); when it
    has tokens again, the next admitted event is preceded by `on_spent(uid, text)` saying how
    many were not stored. uid 0 and None are never limited. Buckets of uids that are full again
    are forgotten, so the table holds only the uids that spent recently."""

    def __init__(self, burst: float, per_s: float, on_spent: Callable[[int, str, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = float(burst)
        self.per_s = float(per_s)
        self.on_spent = on_spent
        self.clock = clock
        self.buckets: dict[int, _Bucket] = {}
        self.suppressed_total = 0

    def admit(self, uid: int | None) -> bool:
        if not uid or self.burst <= 0:
            return True
        now = self.clock()
        b = self.buckets.get(uid)
        if b is None:
            b = self.buckets[uid] = _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + (now - b.at) * self.per_s)
        b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            if b.suppressed:
                n, b.suppressed = b.suppressed, 0
                if self.on_spent is not None:
                    self.on_spent(uid, f"{n} event(s) caused by uid {uid} were not stored (its budget of "
                                       f"{self.burst:g} events, refilled at {self.per_s:g}/s, was spent); they "
                                       "reached live event streams only", n)
            self._forget_full(now)
            return True
        if b.suppressed == 0 and self.on_spent is not None:
            self.on_spent(uid, f"uid {uid} spent its budget of {self.burst:g} stored events (refilled at "
                               f"{self.per_s:g}/s); further events it causes are not stored until it has tokens "
                               "again (one event will say how many)", 0)
        b.suppressed += 1
        self.suppressed_total += 1
        return False

    def _forget_full(self, now: float) -> None:
        if len(self.buckets) < 1024:
            return
        for uid, b in list(self.buckets.items()):
            if not b.suppressed and b.tokens + (now - b.at) * self.per_s >= self.burst:
                del self.buckets[uid]
