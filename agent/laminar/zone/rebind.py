"""The address the zone listens on, and the wait for it (:class:`Rebind`, a part of
:class:`laminar.zone.component.ZoneComponent`: its ``rebind``).

The zone binds its UDP endpoint and TCP hand-over server to ``zone.listen`` or, by default, to
this node's roster address when this host holds it (``membership.bind_host``), so that its
traffic leaves from the address its peers check (``zone.check_source``). An IPv6 address still
tentative at start (duplicate address detection, at boot) is waited for ``roster_wait_s``
(:meth:`Rebind.choose`); still not usable, the zone listens on ``::`` (``0.0.0.0`` for an IPv4
one) and looks every ``interval_s`` until it is (:meth:`Rebind.follow`), then listens on it and
calls each of ``on_rebind`` with it (the migration layer's transfer listener follows it).
A ``zone.listen`` this host does not hold, or one DAD refused, stops the start.

State: the timings, the listeners to call, the address waited for (:attr:`Rebind.waiting_for`,
"" once bound) and which address it is (``roster address`` or ``zone.listen address``); the
address bound is the component's ``listen_host``, which the transports and the migration layer
read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from laminar.zone.membership import WILDCARDS, bind_host, canonical_ip
from laminar.zone.transport import address_is_local, wait_while_tentative

log = logging.getLogger("laminar.zone")

ROSTER_WAIT_S = 5.0  # an IPv6 roster address still tentative at start (DAD) is waited for this long
REBIND_INTERVAL_S = 2.0  # then, listening on ::, how often the zone looks whether it is usable


class RebindHost(Protocol):
    """What :class:`Rebind` uses of the component that holds it (ZoneComponent)."""

    endpoint: Any
    listen_host: str
    networked: bool
    server: Any

    def _emit(self, message: str, **fields: Any) -> None: ...


class Rebind:
    """The zone's listen address and the wait for it (see the module's doc): a part of
    :class:`laminar.zone.component.ZoneComponent` (its ``rebind``). ``host``: the component."""

    def __init__(self, host: RebindHost) -> None:
        self.host = host
        self.roster_wait_s = ROSTER_WAIT_S
        self.interval_s = REBIND_INTERVAL_S
        # called with the address once the zone listens on it (the migration layer's transfer listener)
        self.on_rebind: list[Callable[[str], Awaitable[None]]] = []
        self.waiting_for = ""  # the address to listen on once usable; "" when the zone listens on it
        self.what = "roster address"  # or "zone.listen address": which one is waited for

    async def choose(self, listen: str, roster_addr: str) -> None:
        """At start: the address the zone listens on (``host.listen_host``), from ``zone.listen``
        (``listen``) and this node's roster address. An address still tentative is waited for
        up to ``roster_wait_s``; one still not usable then is looked for again by
        :meth:`follow` (:attr:`waiting_for`), the zone meanwhile on ``::`` (``0.0.0.0``).
        Raises RuntimeError for a ``zone.listen`` this host does not hold or that failed DAD."""
        explicit = listen not in WILDCARDS  # zone.listen names one address, not the roster's by default
        self.host.listen_host = bind_host(listen, roster_addr)
        state = "usable"
        if self.host.networked and self.host.listen_host not in WILDCARDS:
            state = await wait_while_tentative(self.host.listen_host, self.roster_wait_s)
        if state != "usable":
            if explicit and state == "absent":
                raise RuntimeError(
                    f"zone: zone.listen {listen} is not an address of this host (no interface holds it, nor is it "
                    f"tentative): set zone.listen to an address this host holds, or leave it unset (this node's "
                    f"roster address {roster_addr} when the host holds it, else "
                    f"{'::' if ':' in roster_addr else '0.0.0.0'})")
            if explicit and state == "duplicate":
                raise RuntimeError(
                    f"zone: zone.listen {listen}: duplicate address detection failed (dadfailed: another host on the "
                    "link holds it), so it cannot be bound until the address is added again; give this host an "
                    "address of its own (ip addr del, then add) or set zone.listen to one it holds")
            anywhere = "::" if ":" in self.host.listen_host else "0.0.0.0"
            self.what = "zone.listen address" if explicit else "roster address"
            what = f"{self.what} {self.host.listen_host}"
            why = {"tentative": f"is still tentative after {self.roster_wait_s:.0f} s (duplicate address detection "
                                "runs)",
                   "duplicate": "is a duplicate (DAD failed: another host on the link holds it)"}.get(
                       state, "is not on this host")
            message = (f"this node's {what} {why}: listening on {anywhere} until it is usable (checked "
                       f"every {self.interval_s:.0f} s), so meanwhile its traffic leaves from whatever address "
                       "the kernel picks and peers drop it as wrong_source"
                       + (" (unless a NAT gives it that address); set zone.listen where it never will be"
                          if state == "absent" else ""))
            log.warning("zone: %s", message)
            self.host._emit(message, addr=self.host.listen_host, state=state)
            self.waiting_for = self.host.listen_host
            self.host.listen_host = anywhere

    async def follow(self, host: str) -> None:
        """While the zone listens on :: (0.0.0.0: an IPv4 address) because the address it should
        bind, ``host`` (its roster address, or zone.listen's), was not usable at start, look every
        ``interval_s``; once it is, listen on it (datagrams and hand-overs: traffic leaves
        from it again, and peers stop dropping it as wrong_source) and call each of ``on_rebind``
        with it."""
        what = self.what
        while True:
            await asyncio.sleep(self.interval_s)
            if not address_is_local(host):
                continue
            try:
                sock = self.host.endpoint.sock  # None: a rebind found the port taken (tried again here)
                if sock is None or sock.getsockname()[0] != canonical_ip(host):
                    self.host.endpoint.rebind(host)
                await self.host.server.relisten(host)
            except OSError as e:
                log.warning("zone: cannot listen on the %s %s yet (%s): still on %s", what, host, e,
                            self.host.listen_host)
                continue
            self.host.listen_host = host
            self.waiting_for = ""
            self.host._emit(f"this node's {what} {host} is usable now: listening on it", addr=host)
            for fn in list(self.on_rebind):
                try:
                    await fn(host)
                except Exception:
                    log.exception("zone: a listener on the %s %s failed to follow it", what, host)
            return
