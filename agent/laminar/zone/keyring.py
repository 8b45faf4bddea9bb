"""The zone's keys, reloaded without a restart, and the sequence floor (:class:`Keyring`, a part
of :class:`laminar.zone.component.ZoneComponent`: its ``keyring``).

Keys: the agent re-reads its key file (``[zone] keys_file``) on SIGHUP and on
``POST /v1/zone/keys/reload`` (``laminarctl zone keys reload``), without a restart
(:meth:`Keyring.reload_keys`): a file that fails any check is refused whole and the keys in
use stay. ``GET /v1/zone/keys`` shows each key's zone, role, fingerprint and how many
datagrams it verified (:meth:`Keyring.key_stats`), so an operator rotating a key sees when the
old one is no longer used (``docs/operations.md``, "Rotating a zone key").

Node keys: a reload also re-reads ``node_keys``, ``node_key_file`` and the roster's pubkeys
from the config file, checked whole before any is used (:meth:`Keyring.reload_keys`), and takes
nodes added to the roster and other nodes' new addresses (:meth:`Keyring.roster_changes`); the
rest of the roster is read at start only.

Sequence floor: the wire sequence starts at the wall clock in microseconds; the agent persists
a floor above every number it used (``zone.seq_floor.<node>`` in the store's meta table, one
write per :data:`laminar.zone.wire.SEQ_BLOCK` datagrams: :meth:`Keyring.seq_reserve`) and starts
above it (:meth:`Keyring.seq_start`), so a restart right after the wall clock stepped back is
not dropped by its peers as replays.

:class:`Keyring` holds no state of its own: the keys and codecs it replaces are the
component's (``keys``, ``pairs``, ``encoder``, ``decoder``, ``tcp_decoder``), which the
transport and the migration layer read each time; it has no round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from laminar.zone import wire
from laminar.zone.config import zone_config_fields
from laminar.zone.keys import PairKeys, ZoneKeys
from laminar.zone.membership import Membership, canonical_ip, host_port

if TYPE_CHECKING:
    from laminar.components import ZoneAgent
    from laminar.store import Store

log = logging.getLogger("laminar.zone")


class NodeKeyConfig(NamedTuple):
    """What a reload reads from the agent's config file (:meth:`Keyring.reload_keys`)."""

    pairs: PairKeys | None  # this node's pair keys; None when its roster entry lists no pubkey
    pubkeys: dict[int, bytes]  # the roster's pubkeys by node id
    restart_needed: list[str]  # other [zone] settings the file changes, which only a restart applies
    keys_file: str  # the zone key file it names
    added: list[Any]  # Members the roster lists and the running one does not (nodes added)
    moved: list[Any]  # other nodes the roster lists at another address or ports than the running one


class KeyringHost(Protocol):
    """What :class:`Keyring` uses of the component that holds it (ZoneComponent)."""

    _settings: dict[str, Any] | None
    agent: ZoneAgent | None
    decoder: wire.Decoder | None
    encoder: wire.Encoder | None
    keys: ZoneKeys
    membership: Membership
    networked: bool
    node_id: int
    pairs: PairKeys | None
    s: dict[str, Any]
    tcp_decoder: wire.Decoder | None

    wall: Callable[[], float]

    def _emit(self, message: str, **fields: Any) -> None: ...


class Keyring:
    """The zone's key reloads and sequence floor (see the module's doc): a part of
    :class:`laminar.zone.component.ZoneComponent` (its ``keyring``). ``host``: the component."""

    def __init__(self, host: KeyringHost) -> None:
        self.host = host

    def reload_keys(self) -> dict[str, Any]:
        """Re-read the key file and, from the agent's config file, the node keys (``[zone]
        node_keys``, ``node_key_file`` and the roster's pubkeys: :meth:`_node_keys_from_config`),
        and use them from the next datagram on (sending, receiving, hand-overs and checkpoint
        transfers). Everything is read and checked before anything changes: raises
        :class:`laminar.zone.keys.KeyFileError` (the keys in use stay, node keys too) when the key
        file fails any check or lacks a key for a member's zone, or the config file or node key
        does; RuntimeError for the one-node zone, which has no key file. Returns the keys'
        ``{source, keys: [{zone, role, fingerprint}], node_key, restart_needed}`` (``node_key``
        as ``GET /v1/zone/keys`` shows it; ``restart_needed``: ``[zone]`` settings the config
        file changes that only a restart applies)."""
        from laminar.zone.keys import load_keys

        if not self.host.networked:
            raise RuntimeError("zone: this is the one-node zone (no zone.nodes): it uses an in-memory key, there is "
                               "no key file to reload")
        node = self._node_keys_from_config()
        added = node.added if node is not None else []
        moved = node.moved if node is not None else []
        zones = {m.zone for m in self.host.membership.by_node.values()} | {m.zone for m in added}
        keys = load_keys(self.host.s["keys_file"] if node is None else node.keys_file, need_zones=sorted(zones))
        # everything is checked: from here on it is applied
        self.host.keys = keys
        for coder in (self.host.encoder, self.host.decoder, self.host.tcp_decoder):
            if coder is not None:
                coder.keys = keys
        if added or moved:
            self.roster_changes(added, moved)
        desc = keys.describe()
        restart: list[str] = []
        changed = ""
        if node is not None:
            restart = node.restart_needed
            changed = self._use_pairs(node.pairs, node.pubkeys)
        ids = [m.node for m in added]
        self.host._emit(f"zone keys reloaded from {keys.source}: "
                        + ", ".join(f"{d['zone']}:{d['role']}={d['fingerprint']}" for d in desc)
                        + (f"; nodes added to the roster: {', '.join(f'{m.node} (zone {m.zone}, {host_port(m.addr, m.port)})' for m in added)}"
                           if added else "")
                        + (f"; nodes readdressed: {', '.join(f'{m.node} ({host_port(m.addr, m.port)})' for m in moved)}"
                           if moved else "")
                        + (f"; {changed}" if changed else "")
                        + (f"; {', '.join(restart)} changed in {self.config_source()}: only a restart applies "
                           + ("it" if len(restart) == 1 else "them") if restart else ""),
                        keys=desc, node_key=self.node_key_info(), restart_needed=restart, added_nodes=ids,
                        readdressed_nodes=[m.node for m in moved])
        return {"source": keys.source, "keys": desc, "node_key": self.node_key_info(), "restart_needed": restart,
                "added_nodes": ids, "readdressed_nodes": [m.node for m in moved]}

    def roster_changes(self, added: list[Any], moved: list[Any]) -> None:
        """Nodes added to the roster by a reload, and nodes it moved to another address or
        ports: members from now on (probed, offered, heard from, their hand-overs and transfers
        taken from their listed addresses), and at their new addresses. Every reader of the
        roster reads ``self.host.membership``; the decoders keep their own maps of it."""
        self.host.membership.readdress(moved)  # first: a node added may take the address a moved one left
        self.host.membership.add(added)
        zone_of = self.host.membership.zone_of()
        for dec, sources in ((self.host.decoder, self.host.membership.udp_sources()),
                             (self.host.tcp_decoder, self.host.membership.tcp_sources())):
            if dec is not None:
                dec.known_nodes = zone_of
                if dec.sources is not None:
                    dec.sources = sources
        log.info("zone: roster reloaded: nodes added %s, readdressed %s", [m.node for m in added],
                 [f"{m.node} ({host_port(m.addr, m.port)})" for m in moved])

    # [zone] settings a reload applies (the rest take a restart)
    RELOADED = ("keys_file", "node_keys", "node_key_file", "nodes")

    def _node_keys_from_config(self) -> NodeKeyConfig | None:
        """What the agent's config file says about node keys and the roster now
        (:class:`NodeKeyConfig`). None when the agent was given its settings, not a file. The
        roster (``[[zone.nodes]]``) may differ from the running one in pubkeys, by nodes
        added (``added``) and by other nodes' addresses and ports (``moved``); a node dropped,
        another node's zone, pool or owner changed, or this node's own entry changed, takes a
        restart. Raises KeyFileError naming the file and what is wrong (the file's own
        checks, a roster that differs otherwise, nodes of both address families with
        ``check_source``, a node key file that is missing, unsafe or not the key of this
        node's pubkey)."""
        from laminar.config import ConfigError
        from laminar.config import load as load_config
        from laminar.zone.keys import KeyFileError, load_node_key
        from laminar.zone.membership import MembershipError, members_from_config

        source = self.config_source()
        if self.host._settings is not None or not source or source == "<defaults>":
            return None
        try:
            s = {**{k: f.default for k, f in zone_config_fields().items()}, **load_config(source).section("zone")}
            members = members_from_config(s["nodes"], s["port"], s["handover_port"])
        except (ConfigError, MembershipError) as e:
            raise KeyFileError(f"{e} (re-reading {source} for node keys)") from None
        running = {n: replace(m, pubkey=b"") for n, m in self.host.membership.by_node.items()}
        listed = {m.node: replace(m, pubkey=b"") for m in members}
        dropped = sorted(set(running) - set(listed))
        changed = sorted(n for n in running if n in listed and running[n] != listed[n])
        # another node at another address or ports (its agent restarted there): taken by the reload
        moved = [listed[n] for n in changed if n != self.host.node_id and replace(
            listed[n], addr=running[n].addr, port=running[n].port, handover_port=running[n].handover_port) == running[n]]
        changed = [n for n in changed if n not in {m.node for m in moved}]
        if dropped or changed or int(s["node_id"] or 0) != self.host.node_id:
            if dropped:
                what = f"node{'s' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} dropped"
            elif changed:
                what = f"node{'s' if len(changed) > 1 else ''} {', '.join(map(str, changed))} changed"
            else:
                what = f"node_id {s['node_id']} is not {self.host.node_id}"
            raise KeyFileError(f"{source}: its zone.nodes differ from the roster this agent runs with beyond pubkeys, "
                               f"nodes added and other nodes' addresses ({what}): that roster change takes a restart "
                               "(systemctl restart laminard); a reload applies keys_file, node_keys, node_key_file, "
                               "the roster's pubkeys, nodes added to it and other nodes' new addresses and ports")
        added = [m for m in members if m.node not in running]
        taken: dict[tuple[str, int], int] = {}  # the roster as it will be: one node per address and port
        for m in members:
            other = taken.setdefault((m.addr, m.port), m.node)
            if other != m.node:
                raise KeyFileError(f"{source}: zone.nodes lists node {m.node} at node {other}'s address "
                                   f"{host_port(m.addr, m.port)}")
        if (added or moved) and s["check_source"]:
            fam = {":" in canonical_ip(m.addr) for m in members}
            if len(fam) > 1:
                raise KeyFileError(f"{source}: zone.nodes would list IPv6 and IPv4 addresses with nodes "
                                   f"{', '.join(str(m.node) for m in added + moved)} added or readdressed: with "
                                   "zone.check_source a node is "
                                   "heard only from its listed address, so nodes of the two families can never "
                                   "hear each other (list every node in one family)")
        pubkeys = {m.node: m.pubkey for m in members if m.pubkey}
        pairs = None
        if self.host.node_id in pubkeys:
            path = str(s["node_key_file"])
            try:
                pairs = PairKeys(self.host.node_id, load_node_key(path), pubkeys, path, mode=str(s["node_keys"]))
            except ValueError as e:
                raise KeyFileError(str(e)) from None
        restart = sorted(f"zone.{k}" for k in s if k not in self.RELOADED and s[k] != self.host.s.get(k))
        return NodeKeyConfig(pairs, pubkeys, restart, str(s["keys_file"]), added, moved)

    def _use_pairs(self, pairs: PairKeys | None, pubkeys: dict[int, bytes]) -> str:
        """Sign and verify with ``pairs`` from the next datagram on (the encoder, both decoders;
        the migrate layer reads ``self.host.pairs`` each time), the roster's pubkeys now ``pubkeys``.
        Returns what changed, in words ("" when nothing did: the pair keys in use stay)."""
        old = self.host.pairs
        same = (old is None and pairs is None) or (
            old is not None and pairs is not None and old.mode == pairs.mode and old.source == pairs.source
            and old.public == pairs.public and old.shared == pairs.shared)
        self.host.membership.set_pubkeys(pubkeys)
        if same:
            return ""
        self.host.pairs = pairs
        if self.host.encoder is not None:
            self.host.encoder.pairs = pairs
        for dec in (self.host.decoder, self.host.tcp_decoder):
            if dec is not None:
                dec.use_pairs(pairs)
        if pairs is None:
            return "node keys off (this node's zone.nodes entry lists no pubkey): zone-key MACs"
        return (f"node key {pairs.source}, node_keys = {pairs.mode}: pair MACs with "
                f"{len(pairs.shared) - 1} nodes")

    def on_reload_signal(self) -> None:
        """SIGHUP (the agent owns the signal and calls this): re-read the key file; a file that
        is refused is recorded as a ``zone`` event and the keys in use stay."""
        from laminar.zone.keys import KeyFileError

        try:
            self.reload_keys()
        except (KeyFileError, OSError, RuntimeError) as e:
            self.host._emit(f"zone keys not reloaded (the keys in use stay): {e}", error=str(e))

    def key_stats(self) -> list[dict[str, Any]]:
        """Each key: zone, role, fingerprint, datagrams and hand-over frames it verified here
        (``verified``), and when it last verified one (``last_verified``, keys other than the
        current one)."""
        rows = self.host.decoder.key_stats() if self.host.decoder is not None else []
        tcp = {(r["zone"], r["fingerprint"]): r for r in (self.host.tcp_decoder.key_stats() if self.host.tcp_decoder else [])}
        out = []
        for r in rows:
            t = tcp.get((r["zone"], r["fingerprint"]), {})
            lasts = [x for x in (r["last_verified"], t.get("last_verified")) if isinstance(x, (int, float))]
            out.append({**r, "verified": int(r["verified"]) + int(t.get("verified", 0)),  # type: ignore[call-overload]
                        "last_verified": max(lasts) if lasts else None})
        return out

    def node_key_info(self) -> dict[str, Any] | None:
        """This node's key as ``GET /v1/zone/keys`` shows it: its file, public key and the peers
        whose datagrams take pair MACs (every node the roster gives a pubkey, this one aside);
        None without one (zone-key MACs only)."""
        if self.host.pairs is None:
            return None
        return {"file": self.host.pairs.source, "pubkey": self.host.pairs.public.hex(), "mode": self.host.pairs.mode,
                "pair_peers": sorted(n for n in self.host.pairs.shared if n != self.host.node_id)}

    def config_source(self) -> str | None:
        """The agent's config file (``<defaults>`` without one); None without an agent (tests)."""
        return self.host.agent.config.source if self.host.agent is not None else None

    def seq_store(self) -> Store | None:
        return self.host.agent.store if self.host.agent is not None else None

    def seq_start(self) -> int:
        """This run's first sequence number: the wall clock in µs, or above the persisted
        floor when the clock is behind it."""
        store = self.seq_store()
        floor = store.get_meta(f"zone.seq_floor.{self.host.node_id}") if store is not None else None
        start = wire.seq_start(int(self.host.wall() * 1_000_000), int(floor) if floor is not None else None)
        if floor is not None and start == int(floor) + 1:
            log.warning("zone: the wall clock is behind this node's last sequence numbers (stepped back?): "
                        "starting above the persisted floor %d", floor)
        return start

    def seq_reserve(self, limit: int) -> None:
        store = self.seq_store()
        if store is None:  # not reached: the zone gives the encoder this only with a store
            return
        try:
            store.set_meta(f"zone.seq_floor.{self.host.node_id}", int(limit))
        except Exception as e:  # never fail a send; the next block tries again
            log.warning("zone: cannot persist the sequence floor %d: %s", limit, e)
