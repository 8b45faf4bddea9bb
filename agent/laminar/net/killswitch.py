"""The kill-switch for migration flows, and the request rules every kill-switch shares.

netguard (``laminar.net.netguard``) owns the per-job, all-jobs and lent-jobs switches
(``POST /v1/killswitch``, ``laminarctl killswitch on|off|arm``). This module adds the fourth
scope, the **flow**: one migration transfer's TCP/UDP 5-tuple in ``lm_flows``, cut in both
directions (egress by its key, ingress by the swapped key), now or at a deadline that the data
plane enforces by itself (``LM_FLOW_ARMED`` with ``kill_at_ns`` on CLOCK_MONOTONIC, compared with
``bpf_ktime_get_ns()`` on every packet), so it cuts at the window's end even when the agent is
stopped, busy or dead.

A flow is named by a transfer id (``laminarctl net transfers``) or by a 5-tuple written
``tcp:10.0.0.1:40000->10.0.0.2:7000`` or, IPv6, ``tcp:[fd00::1]:40000->[fd00::2]:7000``
(egress orientation: local -> remote). A 5-tuple that has
no ``lm_flows`` entry yet gets one (no HTB class: priority 0), so any flow on the uplink can be
cut, not only registered transfers; ``off`` deletes such an entry again (the registry's
``flow_switch``), so ad-hoc cuts do not fill the map. A cut made through a transfer id expires
``shaping.flow_cut_linger_s`` after its transfer ends; a cut by 5-tuple stays until ``off``
(``laminar.net.transfers``, docs/shaping.md).

API (privileged)::

    POST /v1/killswitch/flow {"flow": "ckpt-7", "action": "arm", "at_s": 30}
    POST /v1/killswitch/flow {"flow": "tcp:10.0.0.1:40000->10.0.0.2:7000", "action": "on"}
    GET  /v1/killswitch/flow            every lm_flows entry with its switch

CLI: ``laminarctl net kill-flow ckpt-7 arm --at +30s`` (see ``laminarctl.cmd_net``).

Bad input changes nothing: an unknown transfer, a malformed 5-tuple, a deadline not in the
future (``at_s`` <= 0: use ``on`` to cut now) are refused with the value and what is allowed.

The flow entries are read-modify-written: netguard adds to ``packets``/``bytes`` in the same
value, so the few packets counted between our read and our write (microseconds) are lost from
the counters. The switch bits themselves are never lost.
"""

from __future__ import annotations

import ctypes
import functools
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

from ..bpf import abi
from ..bpf.abi import LM_FLOW_ARMED, LM_FLOW_KILL, PROTOS

MAX_ARM_S = 7 * 86400  # an arm further out than a week is a typo, not a plan

# An address is a dotted quad or a bracketed IPv6 address (``[fd00::1]``), as in a URL.
_ADDR = r"([0-9.]+|\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?\])"
_TUPLE_RE = re.compile(rf"(tcp|udp):{_ADDR}:([0-9]{{1,5}})->{_ADDR}:([0-9]{{1,5}})")


class KillSwitchError(ValueError):
    """A request that cannot be carried out; the message names the value and what is allowed."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def canonical_addr(addr: str) -> str:
    """An address as a flow key holds it: IPv4 dotted, IPv6 compressed (``fd00::1``), an
    IPv4-mapped IPv6 address (``::ffff:10.0.0.1``, what a dual-stack socket reports) as its IPv4
    address (the packet on the wire is IPv4), a zone (``%eth0``) dropped. Raises KillSwitchError."""
    from laminar.zone.membership import canonical_ip

    try:
        return canonical_ip(addr)
    except ValueError:
        raise KillSwitchError(f"address {addr!r} is not an IPv4 or IPv6 address (e.g. 10.0.0.1, fd00::1)") from None


@dataclass(frozen=True)
class FlowKey:
    """A TCP/UDP 5-tuple in egress orientation (local -> remote), IPv4 or IPv6 (both addresses of
    one family). Addresses are kept canonical (``canonical_addr``), so one flow is one key."""

    proto: str
    saddr: str
    sport: int
    daddr: str
    dport: int

    def __post_init__(self) -> None:
        if self.proto not in PROTOS:
            raise KillSwitchError(f"protocol {self.proto!r}: expected tcp or udp")
        for name in ("saddr", "daddr"):
            object.__setattr__(self, name, canonical_addr(getattr(self, name)))
        if (":" in self.saddr) != (":" in self.daddr):
            raise KillSwitchError(f"addresses {self.saddr!r} and {self.daddr!r} are of different families: "
                                  "a flow is IPv4 to IPv4 or IPv6 to IPv6")
        for p in (self.sport, self.dport):
            if not 1 <= p <= 65535:
                raise KillSwitchError(f"port {p} out of range 1..65535")

    @property
    def ipv6(self) -> bool:
        return ":" in self.saddr

    @classmethod
    def parse(cls, text: str) -> FlowKey:
        """``tcp:10.0.0.1:40000->10.0.0.2:7000`` or ``tcp:[fd00::1]:40000->[fd00::2]:7000`` ->
        FlowKey. Raises KillSwitchError.
        Keys are immutable, so parses are remembered (a kill-switch names the same flow again)."""
        key = _parse_cached(text)
        if not isinstance(key, cls):  # a subclass asked: build its own instance
            return cls(key.proto, key.saddr, key.sport, key.daddr, key.dport)
        return key

    def __str__(self) -> str:
        if self.ipv6:
            return f"{self.proto}:[{self.saddr}]:{self.sport}->[{self.daddr}]:{self.dport}"
        return f"{self.proto}:{self.saddr}:{self.sport}->{self.daddr}:{self.dport}"

    def pack(self) -> bytes:
        """The lm_flow_key bytes: addresses (IPv6, IPv4 v4-mapped) and ports in network byte
        order, as in the headers."""
        return self._packed

    @functools.cached_property
    def _packed(self) -> bytes:
        # Computed once per key (the dataclass is frozen; cached_property writes __dict__ directly).
        return bytes(abi.flow_key(self.saddr, self.daddr, self.sport, self.dport, self.proto))

    @classmethod
    def unpack(cls, raw: bytes) -> FlowKey:
        k = abi.LmFlowKey.from_buffer_copy(raw[:ctypes.sizeof(abi.LmFlowKey)])
        proto = {v: k for k, v in PROTOS.items()}.get(k.proto, str(k.proto))
        return cls(proto, abi.addr_str(bytes(k.saddr)), socket.ntohs(k.sport), abi.addr_str(bytes(k.daddr)),
                   socket.ntohs(k.dport))

    def as_dict(self) -> dict[str, Any]:
        return {"proto": self.proto, "saddr": self.saddr, "sport": self.sport, "daddr": self.daddr, "dport": self.dport}


@functools.lru_cache(maxsize=1024)
def _parse_cached(text: str) -> FlowKey:
    m = _TUPLE_RE.fullmatch(text.strip())
    if not m:
        raise KillSwitchError(f"flow {text!r} not understood: expected PROTO:SADDR:SPORT->DADDR:DPORT, "
                              "e.g. tcp:10.0.0.1:40000->10.0.0.2:7000 or tcp:[fd00::1]:40000->[fd00::2]:7000 "
                              "(local -> remote)")
    return FlowKey(m[1], m[2].strip("[]"), int(m[3]), m[4].strip("[]"), int(m[5]))


@dataclass
class FlowEntry:
    """An lm_flows value."""

    job_id: int = 0
    flags: int = 0
    priority: int = 0
    kill_at_ns: int = 0
    packets: int = 0
    nbytes: int = 0

    def pack(self) -> bytes:
        return bytes(abi.LmFlow(job_id=self.job_id, flags=self.flags, priority=self.priority,
                                kill_at_ns=self.kill_at_ns, packets=self.packets, bytes=self.nbytes))

    @classmethod
    def unpack(cls, raw: bytes) -> FlowEntry:
        v = abi.LmFlow.from_buffer_copy(raw[:ctypes.sizeof(abi.LmFlow)])
        return cls(v.job_id, v.flags, v.priority, v.kill_at_ns, v.packets, v.bytes)

    def describe(self, now_ns: int | None = None) -> dict[str, Any]:
        now = time.monotonic_ns() if now_ns is None else now_ns
        armed = bool(self.flags & LM_FLOW_ARMED)
        return {"job_num": self.job_id, "kill": bool(self.flags & LM_FLOW_KILL), "armed": armed,
                "armed_in_s": round((self.kill_at_ns - now) / 1e9, 3) if armed else None,
                "cut": bool(self.flags & LM_FLOW_KILL) or (armed and now >= self.kill_at_ns),
                "priority": f"{self.priority >> 16:x}:{self.priority & 0xFFFF:x}" if self.priority else None,
                "packets": self.packets, "bytes": self.nbytes}


def deadline_ns(at_s: Any, now_ns: int | None = None) -> int:
    """CLOCK_MONOTONIC ns ``at_s`` seconds from now. Raises KillSwitchError unless 0 < at_s <= a week
    (a deadline in the past would cut at once, which is ``on``)."""
    if isinstance(at_s, bool) or not isinstance(at_s, int | float):
        raise KillSwitchError(f"at_s = {at_s!r}: expected seconds from now (a number > 0)")
    if not 0 < at_s <= MAX_ARM_S:
        raise KillSwitchError(f"at_s = {at_s!r}: the deadline must be in the future and within {MAX_ARM_S} s "
                              "(a deadline in the past would cut at once: use action 'on' for that)")
    return (time.monotonic_ns() if now_ns is None else now_ns) + int(at_s * 1e9)


def parse_action(body: Any) -> tuple[str, int | None]:
    """Reads ``action`` (on/off/arm) and, for arm, ``at_s`` from a request body. Returns the action
    and the deadline (monotonic ns) or None. Raises KillSwitchError; nothing is changed."""
    if not isinstance(body, dict):
        raise KillSwitchError("request body must be a JSON object with 'action' (on, off, arm)")
    action = body.get("action")
    if action not in ("on", "off", "arm"):
        raise KillSwitchError(f"action {action!r}: expected one of on, off, arm")
    if action == "arm":
        if "at_s" not in body:
            raise KillSwitchError("arm needs 'at_s': seconds from now when the cut happens (> 0)")
        return action, deadline_ns(body["at_s"])
    if body.get("at_s") is not None:
        raise KillSwitchError(f"at_s goes with action 'arm' only (got action {action!r})")
    return action, None


def apply_flow_switch(flows_map: Any, key: FlowKey, action: str, deadline: int | None, *,
                      create: bool = True, job_num: int = 0) -> FlowEntry:
    """Sets a flow's switch in ``lm_flows`` (a laminar.bpf.libbpf.BpfMap): ``on`` cuts now, ``off``
    clears both the cut and an armed deadline, ``arm`` cuts at ``deadline`` (monotonic ns); arming a
    flow its passed deadline has cut keeps it cut (``on`` is set with the new deadline).
    A flow with no entry gets one when ``create`` (priority 0: no class), else KillSwitchError 404.
    Returns the entry as written."""
    kb = key.pack()
    raw = flows_map.lookup(kb)
    if raw is None and not create:
        raise KillSwitchError(f"flow {key} has no lm_flows entry", 404)
    entry = FlowEntry.unpack(raw) if raw is not None else FlowEntry(job_id=job_num)
    if action == "on":
        entry.flags |= LM_FLOW_KILL
    elif action == "off":
        entry.flags &= ~(LM_FLOW_KILL | LM_FLOW_ARMED)
        entry.kill_at_ns = 0
    elif action == "arm":
        if deadline is None:
            raise KillSwitchError("arm needs a deadline")
        if cut_by_deadline(entry.flags, entry.kill_at_ns):
            # Cut already, by its passed deadline: a new deadline must not reopen it ("arm" cuts
            # at T, only "off" restores), so the cut becomes a plain one.
            entry.flags |= LM_FLOW_KILL
        # Deadline first in the same value write: the program never sees ARMED with a stale time.
        entry.kill_at_ns = deadline
        entry.flags |= LM_FLOW_ARMED
    else:
        raise KillSwitchError(f"action {action!r}: expected one of on, off, arm")
    flows_map.update(kb, entry.pack())
    return entry


def cut_by_deadline(flags: int, kill_at_ns: int, armed_bit: int = LM_FLOW_ARMED, now_ns: int | None = None) -> bool:
    """Whether an armed switch (``armed_bit`` in ``flags``) has cut already: its deadline passed.
    Arming such a switch again keeps the cut (the caller sets its kill bit): only ``off`` restores."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    return bool(flags & armed_bit) and kill_at_ns <= now


def read_flows(flows_map: Any) -> list[tuple[FlowKey, FlowEntry]]:
    """Every lm_flows entry, decoded."""
    return [(FlowKey.unpack(k), FlowEntry.unpack(v)) for k, v in flows_map.items()]
