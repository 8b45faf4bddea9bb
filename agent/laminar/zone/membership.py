"""Zone membership: who the peers are (from the config) and who is alive (from traffic).

The config lists every node of the cluster the agent may talk to (``[[zone.nodes]]``): node
id, zone id, UDP address, TCP hand-over port, pool and owner. Nothing is discovered: a node
that is not listed is dropped at the door (``unknown_node``). A node's listed address is also
its identity: the zone key is shared by the zone, so a receiver takes a node's datagrams only
from its address and port (:meth:`Membership.udp_sources`) and its hand-overs only from its IP
(:meth:`Membership.tcp_sources`), compared in one spelling (:func:`canonical_ip`); anything
else is ``wrong_source`` (``zone.check_source``, docs/protocol.md, Security). A node may also
list a ``pubkey`` (its node key's public key): then its traffic with other nodes that list one
is signed with their pair key, which binds the node id whatever the address
(:class:`laminar.zone.keys.PairKeys`).

Liveness is learnt from traffic. Any authenticated datagram from a node marks it seen; each
probe or commit it fails to answer counts a miss. A node with :data:`MAX_MISSES` misses and no
traffic since is *suspect* and is not probed until it is heard from again (summaries keep
zone peers heard; the agent asks a few suspects for a heartbeat each summary round,
``laminar.zone.liveness.Liveness.ask_suspects``, so one that is back is heard from whatever
its zone). Nodes never heard from are probed optimistically: at start
the whole zone is unknown, and a probe is how one finds out.

Example::

    >>> m = Membership(self_node=1, members=[Member(1, 1, "10.0.0.1", 7440), Member(2, 1, "10.0.0.2", 7440)])
    >>> m.zone_members(1, alive_only=True, now=0.0)
    [2]
    >>> for _ in range(MAX_MISSES): m.missed(2, now=1.0)
    >>> m.zone_members(1, alive_only=True, now=1.0)
    []
    >>> m.seen(2, now=2.0); m.zone_members(1, alive_only=True, now=2.0)
    [2]
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

MAX_MISSES = 3


def canonical_ip(host: str) -> str:
    """``host`` (an IP address as the config or a socket gives it) in one spelling, so that two
    spellings of one address compare equal: IPv6 compressed and lower case, an IPv4-mapped
    IPv6 address (``::ffff:10.0.0.1``, what a dual-stack socket reports for an IPv4 peer) as
    its IPv4 address, a scope (``fe80::1%eth0``) left out. Raises ValueError for a string that
    is not an IP address."""
    ip = ipaddress.ip_address(host.partition("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def host_port(host: str, port: int) -> str:
    """``host:port`` as a config or a user writes it: ``[fd00::1]:7440`` for an IPv6 address
    (its colons would run into the port's), ``10.0.0.1:7440`` for an IPv4 one."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_addr(addr: str) -> tuple[str, int | None]:
    """``(IP, port)`` of a ``[[zone.nodes]]`` ``addr``: ``"10.0.0.1"``, ``"10.0.0.1:7440"``,
    ``"fd00::1"``, ``"[fd00::1]"`` or ``"[fd00::1]:7440"`` (an IPv6 address with a port is
    written in brackets; a bare one never has a port); port None when none is written. Raises
    ValueError saying which part is wrong."""
    host, port = addr, ""
    if addr.startswith("["):
        inner, sep, rest = addr[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{addr!r}: expected '[IPv6]' or '[IPv6]:PORT'")
        host, port = inner, rest[1:] if rest else ""
        if rest and not port:
            raise ValueError(f"{addr!r}: the port after ']:' is missing")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"{addr!r}: {host!r} is not an IPv6 address") from None
        if ip.version != 6:
            raise ValueError(f"{addr!r}: brackets are for IPv6 addresses; write an IPv4 address as 'IP:PORT'")
    elif addr.count(":") == 1:
        host, _, port = addr.partition(":")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{addr!r}: {host!r} is not an IP address") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_link_local:
        # unscoped, TCP to it fails (EINVAL); scoped, the agent's sockets lose the scope (a 2-tuple
        # address carries none), so it could not bind it and spoke from another address
        raise ValueError(f"{addr!r}: a link-local address (fe80::/10) reaches one link only and needs an "
                         "interface; list the node's global or ULA (fd00::/8) address")
    if not port:
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{addr!r}: port must be 1..65535")
    return host, int(port)


WILDCARDS = ("", "0.0.0.0", "::")  # listen addresses that name no one address


def listen_check(v: str) -> str | None:
    """Config check of ``zone.listen`` / ``migrate.listen``: one IP address to bind (empty: the
    key's default), written bare; None when it is one, else what is wrong."""
    if v == "":
        return None
    try:
        ipaddress.ip_address(v)
    except ValueError:
        return ("must be one IP address to bind, written bare (e.g. 0.0.0.0, ::, 10.0.0.5 or fd00::5: "
                "no brackets, no port: the ports are keys of their own)")
    return None


def bind_host(listen: str, own_addr: str) -> str:
    """The address to bind for ``zone.listen`` = ``listen`` on a node whose roster address is
    ``own_addr``. The default ``0.0.0.0`` (or empty) is the roster address itself, of either
    family: a host often holds several addresses (IPv4: a secondary address, a service or
    keepalived VIP on the uplink; IPv6: SLAAC beside a static one, privacy addresses) and the
    kernel sends from the one its route picks, which peers would drop as ``wrong_source``; and
    an IPv4 socket can neither reach nor be reached by an IPv6 peer. (The agent binds ``0.0.0.0``
    or ``::`` instead when the address is not on this host, e.g. behind NAT:
    ``ZoneComponent.start``.) Any other value is kept."""
    if listen in ("", "0.0.0.0"):
        return own_addr
    return listen


class MembershipError(ValueError):
    """A node list from the config that cannot be used; the message names the entry."""


@dataclass(frozen=True)
class Member:
    """One node of the cluster, as configured."""

    node: int
    zone: int
    addr: str
    port: int
    handover_port: int = 0
    pool: str = ""
    owner: str = ""
    pubkey: bytes = b""  # its node key's X25519 public key (32 bytes); empty: none (zone-key MACs)


@dataclass
class PeerState:
    last_seen: float = -1.0  # wall clock of the last authenticated datagram; -1: never
    heard_at: float = -1.0  # the same on the receiver's local (stepless) clock, for ages; -1: never
    misses: int = 0
    rx: int = 0
    tx: int = 0
    last_summary: Any = None  # laminar.policy.placement.NodeCapacity (its residual)
    summary_at: float = -1.0


@dataclass
class Membership:
    """The configured members and their liveness. ``self_node`` is this agent's node id."""

    self_node: int
    members: Iterable[Member]
    by_node: dict[int, Member] = field(init=False)
    by_zone: dict[int, list[int]] = field(init=False)
    state: dict[int, PeerState] = field(init=False)
    by_addr: dict[tuple[str, int], int] = field(init=False)
    by_pool: dict[tuple[int, str], list[int]] = field(init=False)
    suspects: set[int] = field(init=False)
    _ips: frozenset[str] = field(init=False, default=frozenset(), repr=False, compare=False)
    _ips_of: object = field(init=False, default=None, repr=False, compare=False)  # the members list _ips is of

    def __post_init__(self) -> None:
        self.by_node = {}
        self.by_zone = {}
        self.by_addr = {}
        self.by_pool = {}
        self.suspects = set()
        for m in self.members:
            if m.node in self.by_node:
                raise MembershipError(f"zone.nodes: node id {m.node} listed twice")
            self.by_node[m.node] = m
            self.by_zone.setdefault(m.zone, []).append(m.node)
            self.by_addr[(m.addr, m.port)] = m.node
            if m.pool:
                self.by_pool.setdefault((m.zone, m.pool), []).append(m.node)
        for z in (*self.by_zone.values(), *self.by_pool.values()):
            z.sort()
        self.members = list(self.by_node.values())
        self.state = {n: PeerState() for n in self.by_node}

    def add(self, members: Iterable[Member]) -> list[int]:
        """Adds ``members``, nodes the roster lists now and did not before (a reload:
        ``Keyring.reload_keys``); their liveness starts unknown, as every node's at start
        (probed optimistically). The indexes are updated in place (``zone_list`` and
        ``pool_list`` hand out the same lists). Raises :class:`MembershipError` (nothing added)
        for a node id listed already or twice, or an address and port another node has. The
        node ids added."""
        new = list(members)
        ids = [m.node for m in new]
        addrs = [(m.addr, m.port) for m in new]
        for m in new:
            if m.node in self.by_node or ids.count(m.node) > 1:
                raise MembershipError(f"zone.nodes: node id {m.node} listed twice")
            if (m.addr, m.port) in self.by_addr or addrs.count((m.addr, m.port)) > 1:
                raise MembershipError(f"zone.nodes: node {m.node}'s address {host_port(m.addr, m.port)} is another "
                                      "node's too")
        for m in new:
            self.by_node[m.node] = m
            self.by_zone.setdefault(m.zone, []).append(m.node)
            self.by_zone[m.zone].sort()
            self.by_addr[(m.addr, m.port)] = m.node
            if m.pool:
                self.by_pool.setdefault((m.zone, m.pool), []).append(m.node)
                self.by_pool[(m.zone, m.pool)].sort()
            self.state[m.node] = PeerState()
        self.members = list(self.by_node.values())
        return ids

    def readdress(self, members: Iterable[Member]) -> list[int]:
        """Moves ``members``, nodes the roster lists already, to the address and ports listed
        now (a reload: a node given another address, its agent restarted there). Their zone,
        pool and owner stay as they are (a change of those takes a restart), their liveness
        too: a node is heard from its new address from now on, and its old one is nobody's.
        Raises :class:`MembershipError` (nothing changed) for a node not in the roster, one whose
        zone, pool or owner differ, or an address and port that another node would have after
        the move. The node ids moved."""
        new = list(members)
        for m in new:
            cur = self.by_node.get(m.node)
            if cur is None:
                raise MembershipError(f"zone.nodes: node {m.node} is not in the roster: it cannot be readdressed")
            if (cur.zone, cur.pool, cur.owner) != (m.zone, m.pool, m.owner):
                raise MembershipError(f"zone.nodes: node {m.node}'s zone, pool or owner changed: only its address and "
                                      "ports change without a restart")
        after = {n: (x.addr, x.port) for n, x in self.by_node.items()} | {m.node: (m.addr, m.port) for m in new}
        owner: dict[tuple[str, int], int] = {}
        for n, a in sorted(after.items()):
            if a in owner:
                raise MembershipError(f"zone.nodes: node {n}'s address {host_port(*a)} is node {owner[a]}'s too")
            owner[a] = n
        for m in new:
            cur = self.by_node[m.node]
            self.by_addr.pop((cur.addr, cur.port), None)
        for m in new:
            self.by_node[m.node] = replace(m, pubkey=self.by_node[m.node].pubkey)  # (pubkeys: set_pubkeys)
            self.by_addr[(m.addr, m.port)] = m.node
        self.members = list(self.by_node.values())
        return [m.node for m in new]

    @property
    def zone(self) -> int:
        """This node's zone."""
        return self.by_node[self.self_node].zone

    def zone_of(self) -> dict[int, int]:
        """node id -> zone id for every member (what the wire decoder needs)."""
        return {n: m.zone for n, m in self.by_node.items()}

    def udp_sources(self) -> dict[int, tuple[str, int]]:
        """node id -> (canonical IP, UDP port): where that node's datagrams come from (it sends
        from the socket its roster entry names). What ``wire.Decoder(sources=...)`` checks
        :class:`laminar.zone.transport.UdpEndpoint`'s sources against."""
        return {n: (canonical_ip(m.addr), m.port) for n, m in self.by_node.items()}

    def pubkeys(self) -> dict[int, bytes]:
        """node id -> its node public key, for the members the roster gives one
        (:class:`laminar.zone.keys.PairKeys`)."""
        return {n: m.pubkey for n, m in self.by_node.items() if m.pubkey}

    def set_pubkeys(self, pubkeys: dict[int, bytes]) -> None:
        """The roster's node public keys are ``pubkeys`` now (a reload of the node keys: every
        other field of every member stays); a member not in it has none."""
        for n, m in list(self.by_node.items()):
            if m.pubkey != pubkeys.get(n, b""):
                self.by_node[n] = replace(m, pubkey=pubkeys.get(n, b""))
        self.members = list(self.by_node.values())

    def roster_ips(self) -> frozenset[str]:
        """Every member's canonical IP: the addresses that may open this node's TCP ports with
        ``zone.check_source`` (:class:`laminar.zone.gate.Gate`). Built again only when the roster
        changed (``members`` is a new list after each change), so a check per connection is a
        set lookup."""
        if self._ips_of is not self.members:
            self._ips = frozenset(canonical_ip(m.addr) for m in self.members)
            self._ips_of = self.members
        return self._ips

    def tcp_sources(self) -> dict[int, str]:
        """node id -> canonical IP: where that node's hand-over connections come from (any
        port)."""
        return {n: canonical_ip(m.addr) for n, m in self.by_node.items()}

    def zones(self) -> list[int]:
        return sorted(self.by_zone)

    def seen(self, node: int, now: float, local: float | None = None) -> None:
        """An authenticated datagram came from ``node`` at wall-clock time ``now``; ``local``:
        the same moment on the clock that ages are measured with (default ``now``), which a
        step of the wall clock does not move (ZoneComponent.clock)."""
        st = self.state.get(node)
        if st is not None:
            st.last_seen = now
            st.heard_at = now if local is None else local
            st.misses = 0
            st.rx += 1
            self.suspects.discard(node)

    def missed(self, node: int, now: float) -> None:
        """``node`` did not answer a request in time."""
        st = self.state.get(node)
        if st is not None:
            st.misses += 1
            if st.misses >= MAX_MISSES:
                self.suspects.add(node)

    def alive(self, node: int, now: float) -> bool:
        """False only for a suspect node: :data:`MAX_MISSES` misses and no traffic since."""
        st = self.state.get(node)
        return st is not None and st.misses < MAX_MISSES

    def zone_list(self, zone: int) -> list[int]:
        """Every node id of ``zone``, sorted (shared: do not modify). O(1)."""
        return self.by_zone.get(zone, [])

    def pool_list(self, zone: int, pool: str) -> list[int]:
        """Node ids of ``zone`` in ``pool``, sorted (shared: do not modify). O(1)."""
        return self.by_pool.get((zone, pool), [])

    def zone_members(self, zone: int, *, alive_only: bool, now: float, include_self: bool = False) -> list[int]:
        """Node ids of ``zone`` (sorted), without this node unless ``include_self``."""
        out = []
        for n in self.by_zone.get(zone, ()):
            if n == self.self_node and not include_self:
                continue
            if alive_only and not self.alive(n, now):
                continue
            out.append(n)
        return out

    def peers(self, now: float) -> list[dict[str, Any]]:
        """One row per member for ``laminarctl zone peers`` (``now`` on the clock of ``seen``'s
        ``local``)."""
        rows = []
        for n, m in sorted(self.by_node.items()):
            st = self.state[n]
            rows.append(
                {
                    "node": n,
                    "zone": m.zone,
                    "addr": host_port(m.addr, m.port),
                    "pool": m.pool,
                    "owner": m.owner,
                    "self": n == self.self_node,
                    "alive": n == self.self_node or self.alive(n, now),
                    "last_seen_s": round(now - st.heard_at, 3) if st.heard_at >= 0 else None,
                    "misses": st.misses,
                    "rx": st.rx,
                    "tx": st.tx,
                }
            )
        return rows


def members_from_config(rows: Iterable[Mapping[str, Any]], default_port: int, default_handover_port: int) -> list[Member]:
    """Parse ``[[zone.nodes]]`` tables: ``id`` (int), ``zone`` (int), ``addr`` ("IP", "IP:PORT", or
    for IPv6 "[IP]:PORT": :func:`split_addr`),
    optional ``handover_port``, ``pool``, ``owner``, ``pubkey`` (the node key's public key, 64 hex
    digits: :func:`laminar.zone.keys.parse_pubkey`). Raises :class:`MembershipError` naming the
    entry and the field that is wrong."""
    from laminar.zone.keys import parse_pubkey

    out: list[Member] = []
    for i, row in enumerate(rows):
        where = f"zone.nodes[{i}]"
        if not isinstance(row, Mapping):
            raise MembershipError(f"{where}: must be a table with id, zone, addr; got {row!r}")
        unknown = set(row) - {"id", "zone", "addr", "handover_port", "pool", "owner", "pubkey"}
        if unknown:
            raise MembershipError(f"{where}: unknown keys {sorted(unknown)}; allowed: id, zone, addr, handover_port, pool, "
                                  "owner, pubkey")
        node, zone, addr = row.get("id"), row.get("zone"), row.get("addr")
        if not isinstance(node, int) or isinstance(node, bool) or not 0 < node < 2**32:
            raise MembershipError(f"{where}: id {node!r} must be an integer in 1..2^32-1")
        if not isinstance(zone, int) or isinstance(zone, bool) or not 0 <= zone < 2**16:
            raise MembershipError(f"{where}: zone {zone!r} must be an integer in 0..65535")
        if not isinstance(addr, str):
            raise MembershipError(f"{where}: addr {addr!r} must be a string 'IP', 'IP:PORT' or '[IPv6]:PORT'")
        try:
            host, written = split_addr(addr)
        except ValueError as e:
            raise MembershipError(f"{where}: addr {e}") from None
        port = default_port if written is None else written
        hp = row.get("handover_port", default_handover_port)
        if not isinstance(hp, int) or not 0 < hp < 65536:
            raise MembershipError(f"{where}: handover_port {hp!r} must be 1..65535")
        pool, owner = row.get("pool", ""), row.get("owner", "")
        if not isinstance(pool, str) or not isinstance(owner, str) or len(pool.encode()) > 32:
            raise MembershipError(f"{where}: pool and owner must be strings (pool at most 32 bytes)")
        pubkey = b""
        if "pubkey" in row:
            try:
                pubkey = parse_pubkey(row["pubkey"], f"{where} (node {node})")
            except ValueError as e:
                raise MembershipError(str(e)) from None
            twin = next((m.node for m in out if m.pubkey == pubkey), None)
            if twin is not None:
                raise MembershipError(f"{where} (node {node}): pubkey {row['pubkey']!r} is node {twin}'s too; every node "
                                      "needs a key of its own (laminarctl zone keys node-gen on each)")
        out.append(Member(node, zone, host, port, hp, pool, owner, pubkey))
    return out
