"""Capacity summaries (:class:`Summaries`, a part of :class:`laminar.zone.component.ZoneComponent`:
its ``summaries``).

Every ``summary_interval_s`` (:meth:`Summaries.tick`) a node sends its residual capacity to a
few peers of its zone (``summary_fanout``), and the zone's *speaker* (its lowest node id heard
from lately) sends the zone's summary to a few nodes of each other zone (:meth:`Summaries.speak`);
both carry the shape mix the node learned (packing mode: ``docs/allocation.md``). What comes in
(:meth:`Summaries.on_summary`, :meth:`Summaries.on_zone_summary`) gives the submitter its fit
per zone (:meth:`Summaries.zone_fits`) and its hints (:meth:`Summaries.zone_summary`), and the
arbiter the mixes its zone peers and the other zones shared (:meth:`Summaries.refresh_peer_mixes`).

State: the other zones' summaries, the fits and this zone's own summary cached until the next
round or summary, the mixes shared by zone peers and by other zones. A peer's own summary is
kept in its membership state (``Membership.state[n].last_summary``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any, Protocol

from laminar.policy import mixlearn
from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.arbiter import (
    Arbiter,
    msg_to_zone_summary,
    summary_to_capacity,
    wire_to_shares,
    zone_summary_to_msg,
)
from laminar.zone.membership import Membership

log = logging.getLogger("laminar.zone")


class SummariesHost(Protocol):
    """What :class:`Summaries` uses of the component that holds it (ZoneComponent)."""

    arbiter: Arbiter
    clock: Callable[[], float]
    counts: dict[str, int]
    endpoint: Any
    membership: Membership
    node_id: int
    rng: random.Random
    s: dict[str, Any]
    zone: int


class Summaries:
    """This node's and this zone's capacity summaries, and the ones heard (see the module's
    doc): a part of :class:`laminar.zone.component.ZoneComponent` (its ``summaries``).
    ``host``: the component."""

    def __init__(self, host: SummariesHost) -> None:
        self.host = host
        self.zone_summaries: dict[int, pl.ZoneSummary] = {}  # the other zones', by zone
        self._fits_cache: dict[tuple[Any, ...], dict[int, float]] = {}
        self._own_summary: pl.ZoneSummary | None = None
        # shared shape mixes (frag nodes): per zone peer and per other zone, (received at, mix)
        self.peer_mixes: dict[int, tuple[float, mixlearn.Shares]] = {}
        self.zone_mixes: dict[int, tuple[float, mixlearn.Shares]] = {}

    # -- a round ---------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """The start of a summary round (the component's summary loop, every
        ``summary_interval_s``, after the inventory is read again): forget the cached fits, hand
        the arbiter the fresh shared mixes and send this node's summary to up to
        ``summary_fanout`` peers of its zone."""
        self.changed()
        self.refresh_peer_mixes(now)
        h = self.host
        assert h.endpoint is not None
        mine = h.arbiter.summary(now)
        for n in pl.probe_targets(h.membership.zone_list(h.zone), int(h.s["summary_fanout"]), h.rng,
                                  exclude={h.node_id}):
            h.endpoint.send(n, mine)
            h.counts["summaries_sent"] += 1

    def speak(self, now: float) -> None:
        """The end of a summary round: when this node is its zone's speaker (the lowest node id
        heard from within ``peer_timeout_s``, this one included; in a zone larger than the
        fan-out a few may speak, still a bounded rate), send the zone's summary to up to
        ``summary_fanout`` nodes of each other zone."""
        h = self.host
        fanout = int(h.s["summary_fanout"])
        peers = h.membership.zone_list(h.zone)
        fresh = float(h.s["peer_timeout_s"])
        heard = [n for n in peers if n == h.node_id
                 or (h.membership.state[n].heard_at >= 0 and now - h.membership.state[n].heard_at <= fresh)]
        if heard and min(heard) == h.node_id:
            zmsg = zone_summary_to_msg(self.own_zone_summary(now), self.own_zone_mix(now))
            for z in h.membership.zones():
                if z == h.zone:
                    continue
                for n in pl.probe_targets(h.membership.zone_list(z), fanout, h.rng):
                    h.endpoint.send(n, zmsg)

    # -- what comes in ---------------------------------------------------------------------------

    def on_summary(self, sender: int, body: wire.Summary) -> None:
        """A zone peer's summary: its capacity (kept in its membership state) and its mix."""
        h = self.host
        h.counts["summaries_received"] += 1
        st = h.membership.state[sender]
        m = h.membership.by_node[sender]
        st.last_summary = summary_to_capacity(sender, m.zone, body)
        st.summary_at = h.clock()
        shared = wire_to_shares(body.mix, body.mix_weight)
        if shared is not None and m.zone == h.zone:
            self.peer_mixes[sender] = (st.summary_at, shared)

    def on_zone_summary(self, sender: int, body: wire.ZoneSummaryMsg) -> None:
        """Another zone's summary, from its speaker."""
        h = self.host
        h.counts["zone_summaries_received"] += 1
        # a zone's summary comes from a member of that zone (its speaker); one a node sends
        # for another zone is not believed (nor kept: zone ids are the sender's choice)
        if body.zone != h.zone and body.zone == h.membership.by_node[sender].zone:
            z = msg_to_zone_summary(body, h.clock())
            if z is not None:
                self.zone_summaries[body.zone] = z
                self.changed()
            shared = wire_to_shares(body.mix, body.mix_weight)
            if shared is not None:
                self.zone_mixes[body.zone] = (h.clock(), shared)

    # -- what the submitter and the arbiter read -------------------------------------------------

    def own_zone_summary(self, now: float) -> pl.ZoneSummary:
        """This zone's summary from the peers' fresh summaries and this node's own view."""
        fresh = float(self.host.s["peer_timeout_s"])
        caps = [self.host.arbiter.view(now)]
        for n in self.host.membership.zone_list(self.host.zone):
            if n == self.host.node_id:
                continue
            st = self.host.membership.state[n]
            if st.last_summary is not None and now - st.summary_at <= fresh:
                caps.append(st.last_summary)
        return pl.summarize_zone(self.host.zone, caps, now, rng=self.host.rng, hints=pl.HINTS_PER_SHAPE)

    def _fresh_peer_mixes(self, now: float) -> list[mixlearn.Shares]:
        """The mixes this zone's peers shared in summaries received within ``peer_timeout_s``
        (older ones are forgotten)."""
        fresh = float(self.host.s["peer_timeout_s"])
        for n in [n for n, (at, _) in self.peer_mixes.items() if now - at > fresh]:
            del self.peer_mixes[n]
        return [m for _, m in self.peer_mixes.values()]

    def own_zone_mix(self, now: float) -> mixlearn.Shares | None:
        """This zone's merged mix, for the zone summary: this node's own counts and its fresh
        zone peers' (each weighted by its total), the heaviest shapes; None when none is known."""
        parts = self._fresh_peer_mixes(now)
        mine = self.host.arbiter.mix_share()
        if mine is not None:
            parts.append(mine)
        return mixlearn.top_shares(mixlearn.merge_shares(parts)) if parts else None

    def refresh_peer_mixes(self, now: float) -> None:
        """Hand the arbiter the fresh shared mixes: its zone peers' (``peer_timeout_s``) and the
        other zones' (3 x ``peer_timeout_s``, as their summaries); once a summary round."""
        parts = self._fresh_peer_mixes(now)
        stale = 3 * float(self.host.s["peer_timeout_s"])
        for z in [z for z, (at, _) in self.zone_mixes.items() if now - at > stale]:
            del self.zone_mixes[z]
        parts += [m for _, m in self.zone_mixes.values()]
        self.host.arbiter.set_peer_mixes(parts)

    def _own_summary_cached(self) -> pl.ZoneSummary:
        """:meth:`own_zone_summary`, kept until the next summary round (as the fits are)."""
        if self._own_summary is None:
            self._own_summary = self.own_zone_summary(self.host.clock())
        return self._own_summary

    def changed(self) -> None:
        """Forget the fits and this zone's own summary: a summary came in, or a round begins."""
        self._fits_cache.clear()
        self._own_summary = None

    def zone_summary(self, zone: int) -> pl.ZoneSummary | None:
        """The summary this node holds for ``zone`` (its own zone's from its peers), or None
        when it has none fresh enough; the submitter takes its hints from it."""
        if zone == self.host.zone:
            return self._own_summary_cached()
        s = self.zone_summaries.get(zone)
        if s is None or self.host.clock() - s.issued_at > 3 * float(self.host.s["peer_timeout_s"]):
            return None
        return s

    def zone_fits(self, demand: pl.Demand) -> dict[int, float]:
        """Fit per zone for ``demand``; cached until a summary changes."""
        key = (demand.gpus, demand.cpus, demand.memory_mb, demand.gpu_model)
        f = self._fits_cache.get(key)
        if f is None:
            now = self.host.clock()
            stale = 3 * float(self.host.s["peer_timeout_s"])
            sums = {z: s for z, s in self.zone_summaries.items() if now - s.issued_at <= stale}
            sums[self.host.zone] = self._own_summary_cached()
            f = {z: pl.zone_fit(s, demand) for z, s in sums.items()}
            self._fits_cache[key] = f
        return f
