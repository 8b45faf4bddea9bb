"""A silence is a departure only if the zone agrees: before a node takes a peer for gone after a
silence (``orphan_after_s``, or ``dead_after_s`` after the peer's reclaim notice) and resumes its
jobs (a keeper's take-over, a claim in the archive), it asks a few other members when they last
heard that peer (control op ``heard``).

A partial partition (the link between a job's node and its keeper down, both still hearing the
rest of the zone) looks, from the keeper, like the node's departure: before, the keeper resumed
the job after ``orphan_after_s`` while the node ran its copy on, and both ran until the link came
back. Self-fencing does not help there (fence.py): the node hears the others, so it never takes
itself for cut off. Nor did fencing's own rule (:meth:`laminar.migrate.fence.Fence.cannot_tell`:
others heard ``dead_after_s`` past the peer's last word) hold for a link that flapped: a node cut
off 4 s, back for a tenth of a second (it heard one other member, not the reclaimed peer) and
cut off again resumed the peer's job in its window (bench/chaos.py --partial-partitions, seed 32).

So when a peer's silence here reaches that length and a verdict is asked for
(:meth:`Takeover.source_dead`: a keeper's take-over, a claim from the archive, the fence's
settling), this node asks up to :data:`VOUCH_ASK` other members it heard lately
(:meth:`_lately_s`) how long ago they heard the peer (``{node, age}``; ``age`` None: not since
that agent started), and the verdict waits for the answers (milliseconds;
:data:`VOUCH_TIMEOUT_S` at most). The silence that counts is the shortest: this node's own, or
an answer's age plus the time since it came. A peer another member heard within that length is
not gone (:meth:`Vouch.heard_elsewhere`; an event of phase ``heard-elsewhere`` says so once per
silence); once that answer is too old to tell, the peer is asked about again. An answer that
confirms the silence (its own age that long) holds for as long. Members reached that cannot say
(not heard since their start, or an older agent that refuses the op) leave this node's silence
to count, as before; members not reached at all hold the verdict back for ``dead_after_s`` (this
node may be the one cut off) and are asked again. With nobody to ask (a zone of two, every other
member silent here for longer than :meth:`_lately_s`), this node's own silence counts. Only
peers a verdict is asked about are asked about, at most :data:`VOUCH_MAX_ASKING` at once: the
questions grow with the departures, not the zone.

A member's word is bounded (a member that lies, answering ``age`` 0 for every node, would hold
every take-over back for good; docs/protocol.md, *Authority*): where two or more members answer
with an age, the second shortest counts (two must agree that they heard the peer lately), and
the word of one member alone holds a take-over back at most :data:`VOUCH_LONE_HOLDS` times the
silence asked about, once per silence (then an event of phase ``heard-elsewhere-ignored`` says
so and this node's own silence counts). Each hold is counted per member (``heard_vouchers`` in
the component's status), so an operator sees one member holding take-overs back.

What it costs: a take-over by silence waits one question's round trip; a dead node behind a
partial partition is declared gone once the members that heard it last have not heard it for
that long either; a node cut off from everyone waits up to :meth:`_lately_s` longer before its
own silence counts (with fencing it takes nothing over meanwhile anyway). The answer is
authenticated as every control message; it only ever holds a take-over back.

:class:`Vouch` is a part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``vouch``),
built with the component (what it uses of it: :class:`VouchHost`) and the fence's
:meth:`~laminar.migrate.fence.Fence.isolated`. The keeper asks :meth:`Vouch.heard_elsewhere`; the
control op ``heard`` is answered by :meth:`Vouch.answer_heard`; the component's watch loop calls
:meth:`Vouch.tick` each round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

from laminar.migrate.transfer import TransferError

log = logging.getLogger("laminar.migrate")

VOUCH_ASK = 3
"""Members asked, per question, when they last heard a silent peer."""

VOUCH_TIMEOUT_S = 2.0
"""How long one question waits for each answer."""

VOUCH_MAX_ASKING = 8
"""Most silent peers asked about at once (a verdict on another waits a round)."""

VOUCH_LONE_HOLDS = 10.0
"""One member's word alone holds a take-over back at most this many times the silence asked
about (a partial partition seen by one member only lasts that long at most before the take-over
goes on; a member that lies about every peer holds none back for longer)."""


class VouchHost(Protocol):
    """What :class:`Vouch` uses of the component that holds it (ReclaimComponent)."""

    _started: float
    counts: dict[str, int]
    s: dict[str, Any]

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _last_seen(self, node: int) -> float: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Vouch:
    """Other members' word on a silent peer (see the module's doc): a part of
    :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``vouch``). ``host``: the component;
    ``isolated``: whether this node is cut off from its zone at an instant (:meth:`Fence.isolated`)."""

    def __init__(self, host: VouchHost, isolated: Callable[[float], bool]) -> None:
        self.host = host
        self._isolated = isolated
        # node -> (when the answers came (wall), the shortest age they gave (None: nobody could say),
        # whether any member asked was reached: it answered, or refused the op)
        self._vouched: dict[int, tuple[float, float | None, bool]] = {}
        self._vouching: set[int] = set()  # nodes asked about now
        # nodes whose take-over another member's word held back (said once a silence; status: heard_elsewhere)
        self.held_back: set[int] = set()
        # node -> (the member whose word the verdict goes by, alone: no second member agreed)
        self._vouch_who: dict[int, tuple[int, bool]] = {}
        self._vouch_since: dict[int, float] = {}  # node -> when a lone member's word first held its take-over back
        self.vouchers: dict[int, int] = {}  # member -> how many verdicts its word held back (status: heard_vouchers)
        self._vouch_ignored: set[int] = set()  # nodes whose lone voucher's word no longer counts (said once a silence)

    def _silent_here(self, node: int, now: float) -> float:
        return now - max(self.host._last_seen(node), self.host._started)

    def _lately_s(self) -> float:
        """A member heard here within this long can be asked (half of ``orphan_after_s``, at least
        twice ``dead_after_s``)."""
        return max(float(self.host.s.get("orphan_after_s") or 0.0) / 2, 2 * float(self.host.s["dead_after_s"]))

    def tick(self, now: float) -> None:
        """Forgets what was said of peers heard here again (their silence ended)."""
        for node in set(self._vouched) | self.held_back | set(self._vouch_since):
            if self._silent_here(node, now) < float(self.host.s["dead_after_s"]):
                self._vouched.pop(node, None)
                self.held_back.discard(node)
                self._vouch_since.pop(node, None)
                self._vouch_who.pop(node, None)
                self._vouch_ignored.discard(node)

    def _ask_about(self, node: int, now: float) -> bool:
        """Starts a question about ``node`` (unless one is out) to up to :data:`VOUCH_ASK` other
        members heard here lately (:meth:`_lately_s`); at most :data:`VOUCH_MAX_ASKING` nodes are
        asked about at once. False when there is nobody to ask: this node heard nobody else
        lately (a zone of two, or it is the one cut off, for a while now)."""
        if node in self._vouching:
            return True
        z = self.host.zone
        if z is None or node == self.host.node_id:
            return False  # (this node itself: it is no peer's to vouch for)
        lately = self._lately_s()
        heard = [n for n in z.membership.state
                 if n not in (self.host.node_id, node) and self._silent_here(n, now) < lately]
        if not heard or self._isolated(now):
            return False
        if len(self._vouching) >= VOUCH_MAX_ASKING:
            return True  # asked once the questions out are answered (a round later)
        self._vouching.add(node)
        self.host._spawn(self._ask_heard(node, random.sample(heard, min(VOUCH_ASK, len(heard)))))
        return True

    async def _ask_heard(self, node: int, ask: list[int]) -> None:
        try:
            answers = await asyncio.gather(*(self.host._control(n, "heard", {"node": node}, timeout=VOUCH_TIMEOUT_S)
                                             for n in ask), return_exceptions=True)
            ages: list[tuple[float, int]] = []
            reached = False
            for n, a in zip(ask, answers, strict=True):
                if isinstance(a, TransferError):  # it answered with a refusal (an older agent)
                    reached = True
                if isinstance(a, BaseException):
                    log.info("migrate: node %d did not say when it last heard node %d: %s", n, node, a)
                    continue
                if not isinstance(a, dict) or a.get("node") != node:
                    continue
                reached = True
                age = a.get("age")
                if isinstance(age, (int, float)) and not isinstance(age, bool) and math.isfinite(age) and age >= 0:
                    ages.append((float(age), n))
            self.host.counts["vouch_asks"] = self.host.counts.get("vouch_asks", 0) + 1
            ages.sort()
            # two members must agree: with two ages or more the second shortest counts (one member
            # answering 0 for every node holds nothing back by itself)
            got = ages[1] if len(ages) >= 2 else ages[0] if ages else None
            if got is not None:
                self._vouch_who[node] = (got[1], len(ages) < 2)
            self._vouched[node] = (time.time(), None if got is None else got[0], reached)
        finally:
            self._vouching.discard(node)

    def heard_elsewhere(self, node: int, now: float, within: float | None = None) -> bool:
        """Whether other members' word holds back the verdict that ``node``, silent here for
        ``within`` (``orphan_after_s`` by default), is gone. The answers in hand hold it back
        while one says a member heard ``node`` within ``within`` (its age plus the time since it
        came); they confirm the silence when one said so itself (its age at least ``within``;
        good for ``within``), or when the members reached could not say (not heard since their
        start, or an older agent's refusal). When none was reached (this node may be the one cut
        off) it is held back for ``dead_after_s``, then asked again. Anything else (no answer in
        hand, or one too old to tell) asks, and holds the verdict back until the answers come;
        with nobody to ask, this node's silence counts."""
        within = float(self.host.s.get("orphan_after_s") or 0.0) if within is None else within
        got = self._vouched.get(node)
        if got is not None:
            at, age, reached = got
            fresh = now - at < within
            if age is not None and age + max(0.0, now - at) < within:
                who, lone = self._vouch_who.get(node, (None, False))
                if lone:  # one member's word alone: bounded (module docs)
                    since = self._vouch_since.setdefault(node, now)
                    if now - since > VOUCH_LONE_HOLDS * within:
                        if node not in self._vouch_ignored:  # (said once per silence)
                            self._vouch_ignored.add(node)
                            self.host._emit(
                                f"node {node}'s silence has been held back by node {who}'s word alone for "
                                f"{now - since:.1f} s (at most {VOUCH_LONE_HOLDS:g} x {within:g} s): its "
                                "silence here counts now", node=node, voucher=who, phase="heard-elsewhere-ignored")
                        return False
                if who is not None and node not in self.held_back:
                    self.vouchers[who] = self.vouchers.get(who, 0) + 1
                if node not in self.held_back:
                    self.held_back.add(node)
                    self.host._emit(
                        f"node {node} is silent here for {self._silent_here(node, now):.1f} s, but another "
                        f"member heard it {age + max(0.0, now - at):.1f} s ago: not taken for gone (a partial "
                        "partition, or this node's own: its jobs are not resumed here)", node=node,
                        heard_s=round(age + max(0.0, now - at), 3), phase="heard-elsewhere")
                return True
            if fresh and (age is not None and age >= within or age is None and reached):
                return False
            if not reached and now - at < float(self.host.s["dead_after_s"]):
                return True
        return self._ask_about(node, now)

    def answer_heard(self, asker: str, body: dict[str, Any]) -> dict[str, Any]:
        """Control op ``heard``: how long ago this node last heard ``node`` (``{node, age}``; age
        None when not since this agent started). Raises ValueError for a node id that is not one."""
        try:
            node = int(body["node"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"heard: node {body.get('node')!r} is not a node id") from None
        seen = self.host._last_seen(node)
        if node == self.host.node_id:
            return {"node": node, "age": 0.0}
        return {"node": node, "age": None if seen < 0 else max(0.0, time.time() - seen)}
