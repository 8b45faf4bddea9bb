"""Liveness beyond probes (:class:`Liveness`, a part of :class:`laminar.zone.component.ZoneComponent`:
its ``liveness``).

Who is live is :class:`laminar.zone.membership.Membership`'s to say, from the traffic the zone
sees (any authenticated datagram clears a suspect: ``Membership.seen``; a request left
unanswered counts: ``Membership.missed``). This part makes sure a suspect can be heard from
again: once a summary round (:meth:`Liveness.tick`) it asks a bounded number of suspects for a
heartbeat (:meth:`Liveness.ask_suspects`), and it answers the heartbeats that ask for a reply
(:meth:`Liveness.on_heartbeat`). It holds no state of its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

from laminar.zone import wire
from laminar.zone.membership import Membership


class LivenessHost(Protocol):
    """What :class:`Liveness` uses of the component that holds it (ZoneComponent)."""

    clock: Callable[[], float]
    counts: dict[str, int]
    endpoint: Any
    membership: Membership
    node_id: int
    rng: random.Random
    s: dict[str, Any]
    started: float


class Liveness:
    """Heartbeats asked of suspects and answered (see the module's doc): a part of
    :class:`laminar.zone.component.ZoneComponent` (its ``liveness``). ``host``: the component."""

    def __init__(self, host: LivenessHost) -> None:
        self.host = host

    def tick(self, now: float) -> None:
        """Once a summary round (the component's summary loop): ask up to ``summary_fanout``
        suspects for a heartbeat."""
        self.ask_suspects(int(self.host.s["summary_fanout"]))

    def ask_suspects(self, most: int) -> int:
        """Ask up to ``most`` suspects (drawn at random) for a heartbeat; returns how many.

        A suspect is not probed, so nothing this node sends it would show that it is back; and
        a node of another zone sends this one nothing by itself (its summaries stay in its zone,
        its zone speaks through its lowest live node). Without this, a node that missed three
        requests (a restart, a link down for a few seconds) stayed a suspect of every node
        outside its zone for good. Its answer (any authenticated datagram) clears it
        (``Membership.seen``). Bounded: ``most`` datagrams a summary round, whatever the
        number of suspects."""
        sus = [n for n in self.host.membership.suspects if n != self.host.node_id]
        if not sus or self.host.endpoint is None:
            return 0
        pick = sus if len(sus) <= most else self.host.rng.sample(sorted(sus), most)
        hb = wire.Heartbeat(int(self.host.clock() - self.host.started))
        for n in pick:
            self.host.endpoint.send(n, hb, flags=wire.FLAG_REPLY_WANTED)
        self.host.counts["heartbeats_sent"] += len(pick)
        return len(pick)

    def on_heartbeat(self, sender: int, flags: int) -> None:
        """A heartbeat from ``sender`` (its arrival already cleared it of suspicion): answered
        with one of this node's when it asks for a reply (``wire.FLAG_REPLY_WANTED``)."""
        if flags & wire.FLAG_REPLY_WANTED and self.host.endpoint is not None:
            self.host.endpoint.send(sender, wire.Heartbeat(int(self.host.clock() - self.host.started)))
