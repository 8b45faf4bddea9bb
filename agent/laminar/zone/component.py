"""The zone component of laminard: wires node-local arbitration and the submitter into the agent.

The two halves of placement live in their own socket-free modules, so the agent, the simulated
transport and the simulator run the same code:

- :class:`laminar.zone.arbiter.Arbiter` is the node answering probes. It holds the reservations
  (tentative under a lease, committed for the hand-over, then *placed* while the job runs) and
  decides each probe with :func:`laminar.policy.placement.arbitrate`.
- :class:`laminar.zone.submitter.Submitter` places one job: choose a zone by fit, probe ``d``
  nodes, bind the first good offer by handing the job over (the others lapse with their lease);
  bounded retries. It talks through a :class:`laminar.zone.submitter.Transport` (real UDP/TCP in
  the agent, :mod:`laminar.zone.transport`; :class:`laminar.zone.simnet.SimNet` in the benchmark).

Their names stay importable from this module (the old path) until a later stage of issue 32.

Packing mode (``docs/allocation.md``): with ``[zone] packing = "frag"`` a node's arbiter offers
the least-fragmenting GPUs (:func:`laminar.policy.packing.least_frag_alloc`) and scores its
offers; a placement with ``packing`` (``POST /v1/placements {"packing": true}``,
``laminarctl zone submit --packing``) probes every member of the first ``packing_spread``
zones that can take the job, awaits every answer and binds the least-fragmenting offer
(:func:`laminar.policy.packing.pick_frag_offer`): the simulator's ``laminar-frag-wide``
placement, on the same policy functions. The defaults (``bestfit``, no ``packing``) are the
hot path, unchanged.

:class:`ZoneComponent` wires them into the agent: the UDP endpoint, the TCP hand-over server,
summaries and heartbeats at a bounded rate, and the API routes ``GET /v1/zone/peers``,
``GET /v1/zone/stats``, ``GET /v1/zone/keys``, ``POST /v1/zone/keys/reload`` (privileged) and
``POST /v1/placements``.

Keys: the agent re-reads its key file (``[zone] keys_file``) on SIGHUP and on
``POST /v1/zone/keys/reload`` (``laminarctl zone keys reload``), without a restart
(:meth:`ZoneComponent.reload_keys`): a file that fails any check is refused whole and the keys
in use stay. ``GET /v1/zone/keys`` shows each key's zone, role, fingerprint and how many
datagrams it verified, so an operator rotating a key sees when the old one is no longer used
(``docs/operations.md``, "Rotating a zone key").

Node keys: a node whose ``[[zone.nodes]]`` entry lists a ``pubkey`` reads its private key from
``[zone] node_key_file`` at start (a missing or unsafe file, or one whose public key is not the
roster's, stops the start naming both), and signs what it sends to every node with a pubkey
with their pair key (:class:`laminar.zone.keys.PairKeys`); its decoders take only pair MACs
from those nodes. A reload (SIGHUP, ``POST /v1/zone/keys/reload``) re-reads ``node_keys``,
``node_key_file`` and the roster's pubkeys from the config file, checked whole before any is
used (:meth:`ZoneComponent.reload_keys`); the rest of the roster is read at start only.

Sequence floor: the wire sequence starts at the wall clock in microseconds; the agent persists
a floor above every number it used (``zone.seq_floor.<node>`` in the store's meta table, one
write per :data:`laminar.zone.wire.SEQ_BLOCK` datagrams) and starts above it, so a restart
right after the wall clock stepped back is not dropped by its peers as replays.

A placement's outcomes (:class:`PlacementResult`) are laminar.zone.submitter's to describe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any, NamedTuple

from laminar.policy import mixlearn
from laminar.policy import placement as pl
from laminar.userbounds import Busy
from laminar.zone import authority, wire

# The arbiter and the submitter moved to their own socket-free modules (issue 32): the star
# imports keep their names importable from here until a later stage moves the callers.
from laminar.zone.arbiter import *  # noqa: F403
from laminar.zone.arbiter import (
    HANDOVER_ERROR,
    HANDOVER_NO_RESERVATION,
    HANDOVER_OK,
    HANDOVER_REJECTED,
    LEASE_S,
    PACKING_MODES,
    PACKING_SPREAD,
    Arbiter,
    Placed,
    capacity_to_summary,
    msg_to_zone_summary,
    summary_to_capacity,
    wire_to_shares,
    zone_summary_to_msg,
)
from laminar.zone.keys import DEFAULT_NODE_KEY_FILE, NODE_KEY_MODES, PairKeys
from laminar.zone.loan import LoanManager
from laminar.zone.membership import WILDCARDS, Membership, bind_host, canonical_ip, host_port, listen_check
from laminar.zone.submitter import *  # noqa: F403
from laminar.zone.submitter import PlacementResult, Submitter
from laminar.zone.transport import (
    Router,
    Transport,
    address_is_local,
    error_text,
    wait_while_tentative,
)

log = logging.getLogger("laminar.zone")

ROSTER_WAIT_S = 5.0  # an IPv6 roster address still tentative at start (DAD) is waited for this long
REBIND_INTERVAL_S = 2.0  # then, listening on ::, how often the zone looks whether it is usable


# zone_submitted keeps a record of each placement this node submitted (POST /v1/placements, any
# user's): the newest SUBMITTED_KEEP, none older than SUBMITTED_KEEP_S (it was never pruned).
SUBMITTED_KEEP = 10_000
SUBMITTED_KEEP_S = 7 * 86400.0


def _demand_number(value: Any, what: str, lo: float, hi: float) -> float:
    """A number of a placement's demand: JSON's, or text float() reads (laminar.inputs bounds it
    first: ASCII, at most NUMBER_TEXT_MAX characters); PlacementError naming it otherwise."""
    from laminar.inputs import NUMBER_TEXT_MAX, InputError, brief, read_number

    if isinstance(value, str):
        if not value.isascii() or len(value) > NUMBER_TEXT_MAX:
            raise pl.PlacementError(f"{what} {brief(value)}: expected a number {lo:g}..{hi:g}")
        try:
            value = float(value)
        except ValueError:
            raise pl.PlacementError(f"{what} {brief(value)}: expected a number {lo:g}..{hi:g}") from None
    try:
        return read_number(value, what, lo, hi)
    except InputError as e:
        raise pl.PlacementError(str(e)) from None


def placement_demand(body: dict[str, Any], spec: dict[str, Any], checked: Any) -> pl.Demand:
    """The Demand of a POST /v1/placements body (its spec `checked` by JobSpec.from_dict, or
    None). Each field is checked for its type and range before it is converted: JSON's 1e400
    is inf, and int(inf), ``[].encode()`` or float("²") answered 500. PlacementError naming the
    field otherwise."""
    from laminar.inputs import InputError, brief, read_text

    gpus = _demand_number(body.get("gpus", spec.get("gpus", 0)), "demand: gpus", 0, pl.MAX_GPUS_PER_NODE)
    cpus = _demand_number(body.get("cpus", getattr(checked, "cpus", None) or 1.0), "demand: cpus", 0, 65535)
    memory = _demand_number(body.get("memory_mb", getattr(checked, "memory_mb", None) or 256), "demand: memory_mb",
                            0, 2 ** 32 - 1)
    if memory != int(memory):
        raise pl.PlacementError(f"demand: memory_mb {brief(body.get('memory_mb'))}: expected a whole number of MiB")
    names: dict[str, str | None] = {}
    for key in ("gpu_model", "pool"):
        v = body.get(key)
        try:
            names[key] = None if v is None or v == "" else read_text(v, f"demand: {key}", 32)
        except InputError as e:
            raise pl.PlacementError(str(e)) from None
    return pl.Demand(gpus=gpus, cpus=cpus, memory_mb=int(memory), gpu_model=names["gpu_model"], pool=names["pool"])


# --------------------------------------------------------------------------- the agent component

DEFAULT_PORT = 7440
DEFAULT_HANDOVER_PORT = 7441


def _nodes_check(v: Any) -> str | None:
    from laminar.zone.membership import MembershipError, members_from_config

    try:
        members_from_config(v, DEFAULT_PORT, DEFAULT_HANDOVER_PORT)
    except MembershipError as e:
        return str(e)
    return None


def zone_config_fields() -> dict[str, Any]:
    """The ``[zone]`` config section (registered with laminar.config on import)."""
    from laminar.config import Field, _one_of, _range

    def rng(lo: float, hi: float) -> Any:
        return _range(lo, hi)

    return {
        "node_id": Field(int, 0, "this node's id in zone.nodes (0: the one-node zone, no network)", rng(0, 2**32 - 1)),
        "listen": Field(str, "0.0.0.0", "address the UDP probe endpoint and the TCP hand-over server bind "
                        "(0.0.0.0: this node's zone.nodes address when this host holds it, else 0.0.0.0, :: for "
                        "an IPv6 one)", listen_check),
        "port": Field(int, DEFAULT_PORT, "UDP port of the probe endpoint", rng(1, 65535)),
        "handover_port": Field(int, DEFAULT_HANDOVER_PORT, "TCP port for job hand-overs", rng(1, 65535)),
        "keys_file": Field(str, "/etc/laminar/zone.keys", "per-zone keys (root-only file; see docs/protocol.md)"),
        "node_key_file": Field(str, DEFAULT_NODE_KEY_FILE, "this node's private X25519 key (root-only file, "
                               "laminarctl zone keys node-gen); read only when this node's zone.nodes entry lists a "
                               "pubkey (docs/protocol.md, Node keys)"),
        "node_keys": Field(str, "require", "with a node key, what goes to and is taken from peers the roster gives "
                           "a pubkey: accept (sign with the zone key, take pair or zone MACs), send (sign with the "
                           "pair key, take either), require (pair MACs only); a zone rolls node keys out through "
                           "the three in turn (docs/operations.md, Node keys)", _one_of(*NODE_KEY_MODES)),
        "gpu_model": Field(str, "", "GPU model this node advertises (e.g. H100; empty: from NVML or none)"),
        "cpus": Field((int, float), 0.0, "CPUs this node offers to placed jobs (0: all online CPUs)", rng(0, 65535)),
        "memory_mb": Field(int, 0, "memory (MiB) this node offers to placed jobs (0: physical memory)", rng(0, 2**32 - 1)),
        "probe_d": Field(int, 2, "nodes probed per placement attempt", rng(1, 64)),
        "probe_d_max": Field(int, 8, "most nodes probed in one attempt after widening", rng(1, 255)),
        "zones_max": Field(int, 3, "zones tried before a placement is queued", rng(1, 1000)),
        "queue_rounds": Field(int, 3, "queue cycles (with back-off) before a placement gives up", rng(1, 100)),
        "lease_s": Field((int, float), LEASE_S, "lease of a tentative reservation (an offer); unused offers lapse "
                         "after it (they are not released)", rng(0.05, 60)),
        "hold_s": Field((int, float), 30.0, "hold of a committed reservation awaiting its hand-over", rng(1, 600)),
        "probe_timeout_s": Field((int, float), 0.2, "how long a submitter waits for answers to one probe round", rng(0.005, 10)),
        "handover_timeout_s": Field((int, float), 10.0, "how long a hand-over may take (job start included)", rng(0.1, 120)),
        "unconfirmed_wait_s": Field((int, float), 60.0, "how long a submitter keeps asking a node that received a "
                                    "hand-over and went silent, before reporting the placement unconfirmed", rng(0, 3600)),
        "summary_interval_s": Field((int, float), 1.0, "period of this node's capacity summaries", rng(0.05, 600)),
        "summary_fanout": Field(int, 8, "peers each summary goes to (bounds the rate in any zone size)", rng(1, 1000)),
        "peer_timeout_s": Field((int, float), 10.0, "a summary older than this no longer counts", rng(0.5, 3600)),
        "replay_window_s": Field((int, float), 30.0, "accepted clock difference between nodes", rng(1, 3600)),
        "check_source": Field(bool, True, "drop a datagram or hand-over frame that comes from another address than "
                              "its sender's zone.nodes entry (wrong_source): the key is per zone, so without it "
                              "any member can speak as any node; off only for NAT'd or multi-homed nodes whose "
                              "traffic leaves from another address (docs/protocol.md, Security)"),
        "max_tentative": Field(int, 64, "most tentative reservations a node holds at once", rng(1, 100000)),
        "max_held_per_node": Field(int, 32, "most reservations (offers, commits) one peer may hold here at once, "
                                   "so that one member cannot take every slot of max_tentative (0: no cap of its own)",
                                   rng(0, 100000)),
        "root_from": Field(list, [], "nodes trusted to hand this node jobs that run as root (uid 0): a root job "
                           "runs here only when both its origin and the node handing it here are listed (or are "
                           "this node); default none (docs/protocol.md, Authority)", authority.check_node_list),
        "peer_unknown_uids": Field(str, "refuse", "a job from a peer whose uid has no account here: refuse (the "
                                   "default) or allow (run with no supplementary group, never with gid 0)",
                                   _one_of(*authority.UNKNOWN_UIDS)),
        "packing": Field(str, "bestfit", "which GPUs this node offers: bestfit (the tightest GPU, the hot path) or "
                         "frag (the least-fragmenting GPUs, with a score for packing placements; docs/allocation.md)",
                         _one_of(*PACKING_MODES)),
        "packing_spread": Field(int, PACKING_SPREAD, "zones whose every member a packing placement "
                                "(POST /v1/placements {\"packing\": true}) probes in one round", rng(1, 1000)),
        "nodes": Field(list, [], "the cluster: [[zone.nodes]] id, zone, addr ('IP' or 'IP:PORT'), handover_port, pool, "
                       "owner, pubkey (64 hex digits)",
                       _nodes_check),
    }


try:  # the zone section joins the agent's config schema wherever this module is imported
    from laminar.config import register_section

    register_section("zone", zone_config_fields())
except ImportError:  # pragma: no cover - the simulator runs without the agent package parts
    pass


def _send_local(comp: ZoneComponent, body: wire.Body) -> None:
    """Deliver ``body`` to this node's own arbiter and route its answer to the waiting submitter."""
    reply = comp.handle_request(comp.node_id, body)
    if isinstance(reply, wire.Offer | wire.Refuse | wire.CommitAck):
        if not comp.router.route(comp.node_id, reply) and isinstance(reply, wire.Offer):
            comp.arbiter.on_release(wire.Release(reply.placement_id), comp.clock())


class LocalTransport:
    """The one-node zone's transport: the submitter talks to this node's own arbiter in process."""

    def __init__(self, comp: ZoneComponent) -> None:
        self.comp = comp

    def send(self, node: int, body: wire.Body) -> None:
        _send_local(self.comp, body)

    def expect(self, placement_id: int) -> asyncio.Queue[tuple[int, wire.Body]]:
        return self.comp.router.expect(placement_id)

    def forget(self, placement_id: int) -> None:
        self.comp.router.forget(placement_id)

    async def handover(self, node: int, port: int, body: wire.Handover, timeout_s: float) -> wire.HandoverAck:
        return await self.comp.on_handover(self.comp.node_id, body)


class NetTransport:
    """The agent's transport over its UDP endpoint and TCP hand-overs (itself: in process)."""

    def __init__(self, comp: ZoneComponent) -> None:
        self.comp = comp

    def send(self, node: int, body: wire.Body) -> None:
        if node == self.comp.node_id:
            _send_local(self.comp, body)
            return
        assert self.comp.endpoint is not None
        self.comp.endpoint.send(node, body)

    def expect(self, placement_id: int) -> asyncio.Queue[tuple[int, wire.Body]]:
        return self.comp.router.expect(placement_id)

    def forget(self, placement_id: int) -> None:
        self.comp.router.forget(placement_id)

    async def handover(self, node: int, port: int, body: wire.Handover, timeout_s: float) -> wire.HandoverAck:
        if node == self.comp.node_id:
            return await self.comp.on_handover(node, body)
        from laminar.zone.transport import handover

        m = self.comp.membership.by_node[node]
        assert self.comp.encoder is not None and self.comp.tcp_decoder is not None
        # from the address the agent listens on, when it names one: its roster address, which
        # the receiver checks the connection against (zone.check_source)
        listen = self.comp.listen_host
        local = None if listen in WILDCARDS else listen
        return await handover(self.comp.encoder, self.comp.tcp_decoder, m.zone, m.addr, port or m.handover_port,
                              body, timeout_s, self.comp.wall, to=node, local_host=local)


class NodeKeyConfig(NamedTuple):
    """What a reload reads from the agent's config file (:meth:`ZoneComponent.reload_keys`)."""

    pairs: PairKeys | None  # this node's pair keys; None when its roster entry lists no pubkey
    pubkeys: dict[int, bytes]  # the roster's pubkeys by node id
    restart_needed: list[str]  # other [zone] settings the file changes, which only a restart applies
    keys_file: str  # the zone key file it names
    added: list[Any]  # Members the roster lists and the running one does not (nodes added)
    moved: list[Any]  # other nodes the roster lists at another address or ports than the running one


class ZoneComponent:
    """laminard's zone layer (``agent.zone``). See the module docstring.

    Usable without an agent (tests, footprint bench): ``ZoneComponent(settings=..., jobs=...)``
    then ``await start(None)``; ``settings`` is the ``[zone]`` section as a dict.
    """

    agent_attr = "zone"
    status_key = "zone"

    def __init__(self, settings: dict[str, Any] | None = None, jobs: Any = None, gpus: int | None = None,
                 clock: Callable[[], float] = time.time, loan: dict[str, Any] | None = None) -> None:
        self._settings = settings
        self._loan_settings = loan
        self.loan: LoanManager
        self._jobs = jobs
        self._gpus = gpus
        # ``clock`` is the wall clock: it stamps datagrams and checks theirs (peers compare
        # wall clocks). Local durations (leases, holds, the age of a summary, when a peer was
        # last heard) run on ``self.clock``: the wall time at start advanced by the monotonic
        # clock, so a step of the wall clock (NTP correcting a clock that ran fast, a VM
        # resumed) neither stretches an offer's lease nor makes an old summary look fresh.
        # (membership.state[n].last_seen stays a wall-clock time: the migration layer compares
        # it with time.time(); heard_at is the same moment on self.clock)
        self.wall = clock
        wall0, mono0 = clock(), time.monotonic()
        self.clock: Callable[[], float] = lambda: wall0 + (time.monotonic() - mono0)
        self.agent: Any = None
        self.node_id = 0
        self.networked = False
        self.membership: Membership
        self.arbiter: Arbiter
        self.submitter: Submitter
        self.encoder: wire.Encoder | None = None
        self.decoder: wire.Decoder | None = None
        self.tcp_decoder: wire.Decoder | None = None
        self.pairs: PairKeys | None = None  # this node's pair keys (node keys), set by start
        self.endpoint: Any = None
        self.server: Any = None
        self.listen_host = "0.0.0.0"  # zone.listen as bound (membership.bind_host), set by start
        # An IPv6 roster address still tentative at start (DAD, at boot) is waited for this long,
        # then the zone listens on :: and looks every rebind_interval_s until it is usable, listens
        # on it and calls each of on_rebind with it (the migration layer's transfer listener).
        self.roster_wait_s = ROSTER_WAIT_S
        self.rebind_interval_s = REBIND_INTERVAL_S
        self.on_rebind: list[Callable[[str], Awaitable[None]]] = []
        self._rebind_to = ""
        self._rebind_what = "roster address"  # or "zone.listen address": which one is waited for
        self.router = Router()
        self.zone_summaries: dict[int, pl.ZoneSummary] = {}
        self._fits_cache: dict[tuple[Any, ...], dict[int, float]] = {}
        self._own_summary: pl.ZoneSummary | None = None
        # shared shape mixes (frag nodes): per zone peer and per other zone, (received at, mix)
        self.peer_mixes: dict[int, tuple[float, mixlearn.Shares]] = {}
        self.zone_mixes: dict[int, tuple[float, mixlearn.Shares]] = {}
        self._inflight: dict[tuple[int, int], asyncio.Future[wire.HandoverAck]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self.history: list[dict[str, Any]] = []
        self.rng = random.Random()
        self.started = self.clock()
        self.gpu_index: list[int] = []
        self.counts: dict[str, int] = {"probes": 0, "handovers": 0, "summaries_sent": 0, "summaries_received": 0,
                                       "zone_summaries_received": 0, "reclaim_notices": 0, "heartbeats_sent": 0}
        # peers' requests refused for want of authority, by reason (laminar.zone.authority); the
        # migration and loan layers count theirs here too
        self.authority = authority.Refusals()
        self.policy = authority.Policy(0)
        self.identity_warnings: list[str] = []

    # -- life cycle -----------------------------------------------------------------------------

    async def start(self, agent: Any) -> None:
        """Read the config, load keys (a clear error when missing or unsafe), open the sockets."""
        from laminar.zone.keys import ephemeral_keys, load_keys, load_node_key
        from laminar.zone.membership import Member, members_from_config

        self.agent = agent
        s = self._settings if self._settings is not None else agent.config.section("zone")
        s = {**{k: f.default for k, f in zone_config_fields().items()}, **s}
        self.s = s
        if self._jobs is None and agent is not None:
            self._jobs = getattr(agent, "jobs", None)
        members = members_from_config(s["nodes"], s["port"], s["handover_port"])
        if members and not s["node_id"]:
            raise RuntimeError(f"zone: zone.nodes lists {len(members)} nodes but zone.node_id is not set; "
                               f"set it to this node's id (one of {sorted(m.node for m in members)})")
        self.node_id = int(s["node_id"]) or 1
        if not members:  # the one-node zone
            members = [Member(self.node_id, 0, "127.0.0.1", s["port"], s["handover_port"])]
            keys = ephemeral_keys()
        else:
            if not any(m.node == self.node_id for m in members):
                raise RuntimeError(f"zone: node_id {s['node_id']} is not in zone.nodes (ids: {sorted(m.node for m in members)})")
            self.networked = True
            v6 = [m for m in members if ":" in canonical_ip(m.addr)]  # (::ffff:a.b.c.d is IPv4)
            v4 = [m for m in members if ":" not in canonical_ip(m.addr)]
            if v6 and v4 and s["check_source"]:
                raise RuntimeError(
                    f"zone: zone.nodes lists IPv6 and IPv4 addresses (node {v6[0].node} ({v6[0].addr}), node "
                    f"{v4[0].node} ({v4[0].addr})): with zone.check_source a node is heard only from its listed "
                    "address, so nodes of the two families can never hear each other; list every node in one "
                    "family (its IPv6 or its IPv4 address), or set check_source = false and listen = \"::\" on every node")
            keys = load_keys(s["keys_file"], need_zones=sorted({m.zone for m in members}))
        self.membership = Membership(self.node_id, members)
        me = self.membership.by_node[self.node_id]
        self.zone = me.zone
        # node keys: only when the roster gives this node a pubkey (else zone-key MACs, as before)
        self.pairs = None
        if self.networked and me.pubkey:
            path = str(s["node_key_file"])
            self.pairs = PairKeys(self.node_id, load_node_key(path), self.membership.pubkeys(), path,
                                  mode=str(s["node_keys"]))
        listen = str(s["listen"])
        explicit = listen not in WILDCARDS  # zone.listen names one address, not the roster's by default
        self.listen_host = bind_host(listen, me.addr)
        state = "usable"
        if self.networked and self.listen_host not in WILDCARDS:
            state = await wait_while_tentative(self.listen_host, self.roster_wait_s)
        if state != "usable":
            if explicit and state == "absent":
                raise RuntimeError(
                    f"zone: zone.listen {listen} is not an address of this host (no interface holds it, nor is it "
                    f"tentative): set zone.listen to an address this host holds, or leave it unset (this node's "
                    f"roster address {me.addr} when the host holds it, else {'::' if ':' in me.addr else '0.0.0.0'})")
            if explicit and state == "duplicate":
                raise RuntimeError(
                    f"zone: zone.listen {listen}: duplicate address detection failed (dadfailed: another host on the "
                    "link holds it), so it cannot be bound until the address is added again; give this host an "
                    "address of its own (ip addr del, then add) or set zone.listen to one it holds")
            anywhere = "::" if ":" in self.listen_host else "0.0.0.0"
            self._rebind_what = "zone.listen address" if explicit else "roster address"
            what = f"{self._rebind_what} {self.listen_host}"
            why = {"tentative": f"is still tentative after {self.roster_wait_s:.0f} s (duplicate address detection "
                                "runs)",
                   "duplicate": "is a duplicate (DAD failed: another host on the link holds it)"}.get(
                       state, "is not on this host")
            message = (f"this node's {what} {why}: listening on {anywhere} until it is usable (checked "
                       f"every {self.rebind_interval_s:.0f} s), so meanwhile its traffic leaves from whatever address "
                       "the kernel picks and peers drop it as wrong_source"
                       + (" (unless a NAT gives it that address); set zone.listen where it never will be"
                          if state == "absent" else ""))
            log.warning("zone: %s", message)
            self._emit(message, addr=self.listen_host, state=state)
            self._rebind_to = self.listen_host
            self.listen_host = anywhere
        self.arbiter = Arbiter(self._inventory(), lease_s=float(s["lease_s"]), hold_s=float(s["hold_s"]),
                               max_tentative=int(s["max_tentative"]), packing=str(s["packing"]),
                               max_held_per_node=int(s["max_held_per_node"]))
        self.policy = authority.Policy(self.node_id, frozenset(int(n) for n in s["root_from"]),
                                       str(s["peer_unknown_uids"]))
        self.identity_warnings = authority.identity_warnings(
            str(s["node_keys"]), bool(s["check_source"]),
            [m.node for m in members if not m.pubkey and m.node != self.node_id], self.networked)
        for w in self.identity_warnings:
            log.warning("zone: member identity is weak: %s (docs/protocol.md, Authority)", w)
        self.loan = LoanManager(self, self._loan_settings if self._loan_settings is not None or agent is None
                                else agent.config.section("loan"))
        self._open_store()
        self.loan.start()
        policy = pl.RetryPolicy(d=int(s["probe_d"]), d_max=max(int(s["probe_d"]), int(s["probe_d_max"])),
                                zones=int(s["zones_max"]))
        transport: Transport = NetTransport(self) if self.networked else LocalTransport(self)  # type: ignore[assignment]
        self.submitter = Submitter(
            transport, self.membership, self.zone_fits, rng=self.rng, policy=policy, lease_s=float(s["lease_s"]),
            hold_s=float(s["hold_s"]), probe_timeout_s=float(s["probe_timeout_s"]),
            handover_timeout_s=float(s["handover_timeout_s"]), max_rounds=int(s["queue_rounds"]), clock=self.clock,
            unconfirmed_wait_s=float(s["unconfirmed_wait_s"]), zone_summary=self.zone_summary,
            packing_spread=int(s["packing_spread"]),
        )
        self.router.on_late_offer = self.submitter.note_late_offer
        self.keys = keys
        self.encoder = wire.Encoder(self.node_id, keys, seq0=self._seq_start(),
                                    reserve=self._seq_reserve if self._seq_store() is not None else None,
                                    pairs=self.pairs)
        zone_of = self.membership.zone_of()
        # both accept only what was sent to this node (the MAC covers the receiver's id)
        # and, with zone.check_source, only from the address its sender's roster entry names (the
        # key is the zone's: any member could sign as any node id)
        check = bool(s["check_source"])
        self.decoder = wire.Decoder(keys, zone_of, window_s=float(s["replay_window_s"]), node=self.node_id,
                                    sources=self.membership.udp_sources() if check else None, pairs=self.pairs)
        # hand-over frames (and their acks) remember every sequence number for the replay window,
        # not 256 behind the highest: a sender's numbers run across its datagrams too, so a slow
        # hand-over frame may come in far behind a later one (wire.Decoder remember_by_time)
        self.tcp_decoder = wire.Decoder(keys, zone_of, window_s=float(s["replay_window_s"]), max_size=wire.MAX_FRAME,
                                        node=self.node_id, remember_by_time=True,
                                        sources=self.membership.tcp_sources() if check else None, pairs=self.pairs)
        if self.networked:
            from laminar.zone.gate import Gate
            from laminar.zone.transport import HandoverServer, UdpEndpoint

            loop = asyncio.get_running_loop()
            self.endpoint = UdpEndpoint(self.membership, self.encoder, self.decoder, self._on_message, self.wall,
                                        local_clock=self.clock)
            try:
                self.endpoint.open(loop, self.listen_host, int(s["port"]))
            except OSError as e:
                raise RuntimeError(f"zone: cannot listen on {host_port(self.listen_host, int(s['port']))} (UDP, "
                                   f"zone.listen and zone.port): {error_text(e)}") from None
            self.server = HandoverServer(self.encoder, self.tcp_decoder,
                                         lambda n: self.membership.by_node[n].zone if n in self.membership.by_node else None,
                                         lambda msg: self.on_handover(msg.node, msg.body),  # type: ignore[arg-type]
                                         self.wall, float(s["handover_timeout_s"]),
                                         gate=Gate(self.membership.roster_ips, check_source=check))
            try:
                await self.server.start(self.listen_host, s["handover_port"])
            except OSError as e:
                self.endpoint.close()
                raise RuntimeError(f"zone: cannot listen on {host_port(self.listen_host, int(s['handover_port']))} "
                                   f"(TCP hand-overs, zone.listen and zone.handover_port): {error_text(e)}") from None
            self._tasks.append(asyncio.create_task(self._summary_loop()))
            if self._rebind_to:
                self._tasks.append(asyncio.create_task(self._listen_once_usable(self._rebind_to)))
        self._tasks.append(asyncio.create_task(self._watch_jobs()))
        self._emit(f"zone ready: node {self.node_id} in zone {self.zone}, {len(members)} members, "
                   f"{'networked' if self.networked else 'one-node zone'}"
                   + (f", node key {self.pairs.source}: pair MACs with {len(self.pairs.shared) - 1} nodes"
                      + (f" (node_keys = {self.pairs.mode}: zone-key MACs taken too)" if self.pairs.mode != "require"
                         else "") if self.pairs is not None else ""))

    async def stop(self) -> None:
        if hasattr(self, "loan"):
            await self.loan.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        if self.server is not None:
            await self.server.stop()
        if self.endpoint is not None:
            self.endpoint.close()

    # -- keys and the sequence floor ---------------------------------------------------------------

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

        if not self.networked:
            raise RuntimeError("zone: this is the one-node zone (no zone.nodes): it uses an in-memory key, there is "
                               "no key file to reload")
        node = self._node_keys_from_config()
        added = node.added if node is not None else []
        moved = node.moved if node is not None else []
        zones = {m.zone for m in self.membership.by_node.values()} | {m.zone for m in added}
        keys = load_keys(self.s["keys_file"] if node is None else node.keys_file, need_zones=sorted(zones))
        # everything is checked: from here on it is applied
        self.keys = keys
        for coder in (self.encoder, self.decoder, self.tcp_decoder):
            if coder is not None:
                coder.keys = keys
        if added or moved:
            self._roster_changes(added, moved)
        desc = keys.describe()
        restart: list[str] = []
        changed = ""
        if node is not None:
            restart = node.restart_needed
            changed = self._use_pairs(node.pairs, node.pubkeys)
        ids = [m.node for m in added]
        self._emit(f"zone keys reloaded from {keys.source}: "
                   + ", ".join(f"{d['zone']}:{d['role']}={d['fingerprint']}" for d in desc)
                   + (f"; nodes added to the roster: {', '.join(f'{m.node} (zone {m.zone}, {host_port(m.addr, m.port)})' for m in added)}"
                      if added else "")
                   + (f"; nodes readdressed: {', '.join(f'{m.node} ({host_port(m.addr, m.port)})' for m in moved)}"
                      if moved else "")
                   + (f"; {changed}" if changed else "")
                   + (f"; {', '.join(restart)} changed in {self.agent.config.source}: only a restart applies "
                      + ("it" if len(restart) == 1 else "them") if restart else ""),
                   keys=desc, node_key=self.node_key_info(), restart_needed=restart, added_nodes=ids,
                   readdressed_nodes=[m.node for m in moved])
        return {"source": keys.source, "keys": desc, "node_key": self.node_key_info(), "restart_needed": restart,
                "added_nodes": ids, "readdressed_nodes": [m.node for m in moved]}

    def _roster_changes(self, added: list[Any], moved: list[Any]) -> None:
        """Nodes added to the roster by a reload, and nodes it moved to another address or
        ports: members from now on (probed, offered, heard from, their hand-overs and transfers
        taken from their listed addresses), and at their new addresses. Every reader of the
        roster reads ``self.membership``; the decoders keep their own maps of it."""
        self.membership.readdress(moved)  # first: a node added may take the address a moved one left
        self.membership.add(added)
        zone_of = self.membership.zone_of()
        for dec, sources in ((self.decoder, self.membership.udp_sources()),
                             (self.tcp_decoder, self.membership.tcp_sources())):
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

        source = getattr(getattr(self.agent, "config", None), "source", None)
        if self._settings is not None or not source or source == "<defaults>":
            return None
        try:
            s = {**{k: f.default for k, f in zone_config_fields().items()}, **load_config(source).section("zone")}
            members = members_from_config(s["nodes"], s["port"], s["handover_port"])
        except (ConfigError, MembershipError) as e:
            raise KeyFileError(f"{e} (re-reading {source} for node keys)") from None
        running = {n: replace(m, pubkey=b"") for n, m in self.membership.by_node.items()}
        listed = {m.node: replace(m, pubkey=b"") for m in members}
        dropped = sorted(set(running) - set(listed))
        changed = sorted(n for n in running if n in listed and running[n] != listed[n])
        # another node at another address or ports (its agent restarted there): taken by the reload
        moved = [listed[n] for n in changed if n != self.node_id and replace(
            listed[n], addr=running[n].addr, port=running[n].port, handover_port=running[n].handover_port) == running[n]]
        changed = [n for n in changed if n not in {m.node for m in moved}]
        if dropped or changed or int(s["node_id"] or 0) != self.node_id:
            if dropped:
                what = f"node{'s' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} dropped"
            elif changed:
                what = f"node{'s' if len(changed) > 1 else ''} {', '.join(map(str, changed))} changed"
            else:
                what = f"node_id {s['node_id']} is not {self.node_id}"
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
        if self.node_id in pubkeys:
            path = str(s["node_key_file"])
            try:
                pairs = PairKeys(self.node_id, load_node_key(path), pubkeys, path, mode=str(s["node_keys"]))
            except ValueError as e:
                raise KeyFileError(str(e)) from None
        restart = sorted(f"zone.{k}" for k in s if k not in self.RELOADED and s[k] != self.s.get(k))
        return NodeKeyConfig(pairs, pubkeys, restart, str(s["keys_file"]), added, moved)

    def _use_pairs(self, pairs: PairKeys | None, pubkeys: dict[int, bytes]) -> str:
        """Sign and verify with ``pairs`` from the next datagram on (the encoder, both decoders;
        the migrate layer reads ``self.pairs`` each time), the roster's pubkeys now ``pubkeys``.
        Returns what changed, in words ("" when nothing did: the pair keys in use stay)."""
        old = self.pairs
        same = (old is None and pairs is None) or (
            old is not None and pairs is not None and old.mode == pairs.mode and old.source == pairs.source
            and old.public == pairs.public and old.shared == pairs.shared)
        self.membership.set_pubkeys(pubkeys)
        if same:
            return ""
        self.pairs = pairs
        if self.encoder is not None:
            self.encoder.pairs = pairs
        for dec in (self.decoder, self.tcp_decoder):
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
            self._emit(f"zone keys not reloaded (the keys in use stay): {e}", error=str(e))

    def key_stats(self) -> list[dict[str, Any]]:
        """Each key: zone, role, fingerprint, datagrams and hand-over frames it verified here
        (``verified``), and when it last verified one (``last_verified``, keys other than the
        current one)."""
        rows = self.decoder.key_stats() if self.decoder is not None else []
        tcp = {(r["zone"], r["fingerprint"]): r for r in (self.tcp_decoder.key_stats() if self.tcp_decoder else [])}
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
        if self.pairs is None:
            return None
        return {"file": self.pairs.source, "pubkey": self.pairs.public.hex(), "mode": self.pairs.mode,
                "pair_peers": sorted(n for n in self.pairs.shared if n != self.node_id)}

    def _seq_store(self) -> Any:
        return getattr(self.agent, "store", None)

    def _seq_start(self) -> int:
        """This run's first sequence number: the wall clock in µs, or above the persisted
        floor when the clock is behind it."""
        store = self._seq_store()
        floor = store.get_meta(f"zone.seq_floor.{self.node_id}") if store is not None else None
        start = wire.seq_start(int(self.wall() * 1_000_000), int(floor) if floor is not None else None)
        if floor is not None and start == int(floor) + 1:
            log.warning("zone: the wall clock is behind this node's last sequence numbers (stepped back?): "
                        "starting above the persisted floor %d", floor)
        return start

    def _seq_reserve(self, limit: int) -> None:
        store = self._seq_store()
        try:
            store.set_meta(f"zone.seq_floor.{self.node_id}", int(limit))
        except Exception as e:  # never fail a send; the next block tries again
            log.warning("zone: cannot persist the sequence floor %d: %s", limit, e)

    async def _listen_once_usable(self, host: str) -> None:
        """While the zone listens on :: (0.0.0.0: an IPv4 address) because the address it should
        bind, ``host`` (its roster address, or zone.listen's), was not usable at start, look every
        ``rebind_interval_s``; once it is, listen on it (datagrams and hand-overs: traffic leaves
        from it again, and peers stop dropping it as wrong_source) and call each of ``on_rebind``
        with it."""
        what = self._rebind_what
        while True:
            await asyncio.sleep(self.rebind_interval_s)
            if not address_is_local(host):
                continue
            try:
                sock = self.endpoint.sock  # None: a rebind found the port taken (tried again here)
                if sock is None or sock.getsockname()[0] != canonical_ip(host):
                    self.endpoint.rebind(host)
                await self.server.relisten(host)
            except OSError as e:
                log.warning("zone: cannot listen on the %s %s yet (%s): still on %s", what, host, e, self.listen_host)
                continue
            self.listen_host = host
            self._rebind_to = ""
            self._emit(f"this node's {what} {host} is usable now: listening on it", addr=host)
            for fn in list(self.on_rebind):
                try:
                    await fn(host)
                except Exception:
                    log.exception("zone: a listener on the %s %s failed to follow it", what, host)
            return

    def _emit(self, message: str, **fields: Any) -> None:
        ev = getattr(self.agent, "events", None)
        if ev is not None:
            ev.emit("zone", message, **fields)
        else:
            log.info("%s %s", message, fields)

    # -- capacity ---------------------------------------------------------------------------------

    def _inventory(self) -> pl.NodeCapacity:
        """This node's capacity for placed jobs: declared/discovered GPUs, CPUs and memory, less
        what jobs not placed through the zone use (they were started locally)."""
        import os

        s = self.s
        jobs = self._jobs
        inv_gpus: list[int] = []
        if jobs is not None and getattr(jobs, "inventory", None) is not None:
            inv_gpus = list(jobs.inventory.indices)
        elif self._gpus is not None:
            inv_gpus = list(range(self._gpus))
        elif self.agent is not None:
            inv_gpus = list(self.agent.config.gpus_declared)
        self.gpu_index = inv_gpus
        gpu = [1.0] * len(inv_gpus)
        cpus = float(s["cpus"]) or float(os.cpu_count() or 1)
        mem = int(s["memory_mb"])
        if not mem:
            try:
                import psutil

                mem = int(psutil.virtual_memory().total >> 20)
            except Exception:
                mem = 1024
        arb: Arbiter | None = getattr(self, "arbiter", None)
        placed_jobs = {p.job_id for p in arb.placed.values()} if arb is not None else set()
        if jobs is not None:
            for j in jobs.active() if hasattr(jobs, "active") else []:
                if j.id in placed_jobs:
                    continue
                for g in getattr(j, "gpus", []) or []:
                    if g in inv_gpus:
                        gpu[inv_gpus.index(g)] = 0.0
                cpus -= float(j.spec.cpus or 0.0)
                mem -= int(j.spec.memory_mb or 0)
        # GPUs granted to elastic jobs stay free here: a placement may take them, and the
        # hand-over sheds them (LoanManager.shed) before its job starts; except those of a
        # frozen elastic job, which cannot scale in until it thaws (LoanManager.frozen_grants)
        loan: LoanManager | None = getattr(self, "loan", None)
        for g in loan.frozen_grants() if loan is not None else ():
            if g in inv_gpus:
                gpu[inv_gpus.index(g)] = 0.0
        model = s["gpu_model"] or None
        if model is None and jobs is not None and getattr(jobs, "inventory", None) is not None and jobs.inventory.gpus:
            model = jobs.inventory.gpus[0].name if jobs.inventory.source == "nvml" else None
        draining = bool(arb is not None and arb.inventory.draining)
        return pl.NodeCapacity(self.node_id, self.zone if hasattr(self, "zone") else 0, tuple(gpu), max(0.0, cpus),
                               max(0, mem), model, None, draining)

    def refresh_inventory(self) -> None:
        inv = self._inventory()
        me = self.membership.by_node[self.node_id]
        self.arbiter.inventory = pl.NodeCapacity(inv.node, me.zone, inv.gpu_free, inv.cpus, inv.memory_mb,
                                                 inv.gpu_model, me.pool or None, inv.draining)

    def _work_slot(self, uid: int) -> Any:
        """One of `uid`'s worker-thread slots (laminar.api ``work``) while the block runs; Busy
        past its share. None held where the agent has no API (tests)."""
        work = getattr(getattr(self.agent, "api", None), "work", None)
        return work.hold(uid) if work is not None else contextlib.nullcontext()

    # -- store ----------------------------------------------------------------------------------

    def _open_store(self) -> None:
        store = getattr(self.agent, "store", None)
        if store is None:
            return
        store.ensure_schema("zone", [
            "CREATE TABLE IF NOT EXISTS zone_placed (placement_id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, "
            "demand TEXT NOT NULL, gpu_alloc TEXT NOT NULL, submitter INTEGER NOT NULL, since REAL NOT NULL)",
            "CREATE TABLE IF NOT EXISTS zone_submitted (placement_id INTEGER PRIMARY KEY, name TEXT, outcome TEXT, "
            "node INTEGER, zone INTEGER, job_id TEXT, reason TEXT, result TEXT, created REAL)",
        ])
        # re-adopt placed jobs that still run: their capacity stays taken, a repeated hand-over
        # answers the same job id
        for pid, job_id, demand, alloc, sub, since in store.db.execute(
                "SELECT placement_id, job_id, demand, gpu_alloc, submitter, since FROM zone_placed").fetchall():
            job = self._jobs.get(job_id) if self._jobs is not None else None
            if job is None or not getattr(job, "live", getattr(job, "active", False)):
                with store.tx() as db:
                    db.execute("DELETE FROM zone_placed WHERE placement_id=?", (pid,))
                continue
            d = pl.Demand(**json.loads(demand))
            r = pl.Reservation(pid, d, tuple((int(i), float(f)) for i, f in json.loads(alloc)), math.inf, True)
            self.arbiter.placed[pid] = Placed(r, job_id, sub, since)
            if hasattr(getattr(self._jobs, "table", None), "backfill_origin"):
                # a job placed by an agent of an older release: its placement and GPU share were
                # only in its env; this table is the agent's own record of them (provenance)
                self._jobs.table.backfill_origin(job_id, placement_id=int(pid), gpu_share=self._share_of(r.gpu_alloc))
        self.refresh_inventory()

    def _store_placed(self, p: Placed) -> None:
        store = getattr(self.agent, "store", None)
        if store is None:
            return
        d = p.reservation.demand
        with store.tx() as db:
            db.execute("INSERT OR REPLACE INTO zone_placed VALUES (?, ?, ?, ?, ?, ?)", (
                p.reservation.placement_id, p.job_id,
                json.dumps({"gpus": d.gpus, "cpus": d.cpus, "memory_mb": d.memory_mb, "gpu_model": d.gpu_model,
                            "pool": d.pool}),
                json.dumps(p.reservation.gpu_alloc), p.submitter, p.since))

    def _unstore_placed(self, pid: int) -> None:
        store = getattr(self.agent, "store", None)
        if store is not None:
            with store.tx() as db:
                db.execute("DELETE FROM zone_placed WHERE placement_id=?", (pid,))

    async def _taken_over_as(self, pid: int, body: wire.Handover) -> str | None:
        """For a hand-over not bound here yet of a migrated job (its request's origin names the
        job's migration key, laminar.runtime.provenance; never its spec's env, which a user
        writes): the job this node's migration layer took that job over as, here, or is starting
        it as (waited for: :meth:`laminar.migrate.guard.Guard.taken_over_as`); else
        None, without suspending (so the bind that follows is in the same step as this look)."""
        from laminar.runtime.provenance import origin_of_request

        guarding = getattr(getattr(self.agent, "migrate", None), "guarding", None)
        if pid in self.arbiter.placed or guarding is None:
            return None
        try:
            key = origin_of_request(json.loads(body.spec_json))[0]
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # refused with its reason by the hand-over's own parse
        if key is None:
            return None
        got = await guarding.taken_over_as(key)
        return None if got is None else str(got)

    def placement_pending(self, pid: int) -> bool:
        """Whether placement ``pid``'s hand-over is bound on this node and not answered yet: its
        capacity taken, the job's start (checkpoint check, job manager) under way. False when it
        never came, was refused, or started its job (:meth:`job_for_placement` finds that one).
        The migration layer's take-over of a job a placement hands here waits while this holds."""
        p = self.arbiter.placed.get(pid)
        return p is not None and not p.job_id

    def forgo_placement(self, pid: int) -> None:
        """Drops the reservation this node holds for placement ``pid`` (an offer, committed or
        lapsed), so that its hand-over, should it still come, binds nothing here. A bound
        placement (:meth:`placement_pending`, or its job started) is left alone."""
        self.arbiter.held.pop(pid, None)
        self.arbiter.lapsed.pop(pid, None)

    def job_for_placement(self, pid: int) -> str | None:
        """The id of the job this node started for placement ``pid`` (in any state), by the
        placement id the job manager stored with it (an indexed column; never the job's env);
        None when there is none."""
        if self._jobs is None:
            return None
        return self._jobs.table.find_placement(pid)

    def _share_of(self, alloc: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
        """The fractional GPUs of a reservation's ``gpu_alloc``, by this node's GPU index."""
        return tuple((self.gpu_index[i], float(f)) for i, f in alloc
                     if f < 1.0 - pl.EPS and 0 <= i < len(self.gpu_index))

    async def _watch_jobs(self) -> None:
        """Give capacity back when placed jobs end."""
        while True:
            await asyncio.sleep(1.0)
            if self._jobs is None:
                continue
            for pid, p in list(self.arbiter.placed.items()):
                if not p.job_id:
                    continue
                job = self._jobs.get(p.job_id)
                if job is None or not getattr(job, "live", getattr(job, "active", False)):
                    self.arbiter.finish(pid)
                    self._unstore_placed(pid)
            self.refresh_inventory()

    # -- the node side: requests from peers --------------------------------------------------------

    def handle_request(self, sender: int, body: wire.Body) -> wire.Body | None:
        """Answer probe, commit and release (and other one-way messages); the reply or None."""
        now = self.clock()
        counts = self.arbiter.counts
        before = counts["not_prober"] + counts["held_per_node"]
        reply: wire.Body | None = None
        if isinstance(body, wire.Probe):
            self.counts["probes"] += 1
            loan = self.loan
            if body.pool and loan.lends and body.pool != loan.pool and not loan.loanable:
                # a loan asked of a node of the loaning pool that serves its own load
                loan.counts["loan_refusals"] += 1
                return wire.Refuse(body.placement_id, int(pl.RefuseReason.POOL_BUSY))
            reply = self.arbiter.on_probe(body, now, sender)
        elif isinstance(body, wire.Commit):
            reply = self.arbiter.on_commit(body, now, int(self.s["handover_port"]), sender)
        elif isinstance(body, wire.Release):
            self.arbiter.on_release(body, now, sender)
        else:
            return self._other_request(sender, body)
        if counts["not_prober"] + counts["held_per_node"] != before:  # (rare: two additions on the hot path)
            self._note_reservation_refusal(sender, body)
        return reply

    def _note_reservation_refusal(self, sender: int, body: wire.Body) -> None:
        """Counts (authority reasons ``placement``, ``held``) what the arbiter just refused ``sender``."""
        pid = getattr(body, "placement_id", None)
        other = self.arbiter.prober_of(pid) if isinstance(pid, int) else None
        if other is not None and other != sender:
            self.authority.note(authority.Refused(
                "placement", f"{type(body).__name__.lower()} of placement {pid:016x} from node {sender}: node "
                f"{other} probed for it; only that node may commit, release or bind it"), sender)
        else:
            self.authority.note(authority.Refused(
                "held", f"probe from node {sender}: it holds zone.max_held_per_node "
                f"({self.arbiter.max_held_per_node}) offers here already"), sender)

    def _other_request(self, sender: int, body: wire.Body) -> wire.Body | None:
        if isinstance(body, wire.LoanRequest | wire.LoanAnswer):
            return self.loan.on_message(sender, body)
        return None

    def _on_message(self, msg: wire.Message, addr: tuple[str, int]) -> None:
        body = msg.body
        if msg.type is wire.MsgType.PROBE or msg.type is wire.MsgType.RELEASE:  # the hot path first
            reply = self.handle_request(msg.node, body)
            if reply is not None and self.endpoint is not None:
                # answer where it came from, signed with the sender's zone key
                self.endpoint.send_to(self.membership.by_node[msg.node].zone, addr, reply, to=msg.node)
            return
        if isinstance(body, wire.Offer | wire.Refuse | wire.CommitAck):
            # an offer nobody waits for any more (it came after the binding) lapses with its lease
            self.router.route(msg.node, body)
            return
        if isinstance(body, wire.Summary):
            self.counts["summaries_received"] += 1
            st = self.membership.state[msg.node]
            m = self.membership.by_node[msg.node]
            st.last_summary = summary_to_capacity(msg.node, m.zone, body)
            st.summary_at = self.clock()
            shared = wire_to_shares(body.mix, body.mix_weight)
            if shared is not None and m.zone == self.zone:
                self.peer_mixes[msg.node] = (st.summary_at, shared)
            return
        if isinstance(body, wire.ZoneSummaryMsg):
            self.counts["zone_summaries_received"] += 1
            # a zone's summary comes from a member of that zone (its speaker); one a node sends
            # for another zone is not believed (nor kept: zone ids are the sender's choice)
            if body.zone != self.zone and body.zone == self.membership.by_node[msg.node].zone:
                z = msg_to_zone_summary(body, self.clock())
                if z is not None:
                    self.zone_summaries[body.zone] = z
                    self._summaries_changed()
                shared = wire_to_shares(body.mix, body.mix_weight)
                if shared is not None:
                    self.zone_mixes[body.zone] = (self.clock(), shared)
            return
        if isinstance(body, wire.ReclaimNotice):
            self.counts["reclaim_notices"] += 1
            self._emit(f"node {msg.node} announced its reclaim in {body.deadline_ms} ms: {body.reason}",
                       node=msg.node, deadline_ms=body.deadline_ms)
            return
        if isinstance(body, wire.Heartbeat):
            if msg.flags & wire.FLAG_REPLY_WANTED and self.endpoint is not None:
                self.endpoint.send(msg.node, wire.Heartbeat(int(self.clock() - self.started)))
            return
        reply = self.handle_request(msg.node, body)
        if reply is not None and self.endpoint is not None:
            # answer where it came from, signed with the sender's zone key
            self.endpoint.send_to(self.membership.by_node[msg.node].zone, addr, reply, to=msg.node)

    async def on_handover(self, sender: int, body: wire.Handover) -> wire.HandoverAck:
        """Start the handed-over job once per placement id; a repeat gets the same answer."""
        pid = body.placement_id
        fut = self._inflight.get((sender, pid))  # (another node's hand-over of that id is not this one's)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[(sender, pid)] = fut
        try:
            ack = await self._handover(sender, body)
        except asyncio.CancelledError:
            self._unbind_unstarted(pid)
            fut.cancel()
            raise
        except Exception as e:
            log.exception("placement %x: hand-over failed", pid)
            ack = wire.HandoverAck(pid, HANDOVER_ERROR, f"hand-over failed: {e}")
        finally:
            self._inflight.pop((sender, pid), None)
        if ack.status != HANDOVER_OK:
            # no job runs for it here (the submitter places it elsewhere): a reservation bound
            # for it must not stay taken (the job watcher only frees entries with a job)
            self._unbind_unstarted(pid)
        fut.set_result(ack)
        return ack

    def _peer_run_as(self, req: Any, sender: int, spec: Any, demand: pl.Demand | None) -> authority.RunAs:
        """:func:`laminar.zone.authority.peer_run_as` for a hand-over's request ``req`` from
        ``sender``: its ``origin`` (a guard placing a job it took over says the job's node;
        else the sender is the origin), this node's policy and ``[grants]``, the reservation's
        CPUs and memory (``spec`` is clamped to them). Counted and raised as Refused."""
        try:
            if not isinstance(req, dict):
                raise authority.Refused("bad_id", f"the hand-over from node {sender} is not an object")
            origin = req.get("origin_node", sender)  # (a node that left the roster may still be a job's origin)
            if isinstance(origin, bool) or not isinstance(origin, int) or not 1 <= origin <= 2**32 - 1:
                raise authority.Refused("key", f"the hand-over from node {sender} names origin_node {origin!r}, "
                                        "not a node id")
            jobs = self._jobs
            grants = getattr(jobs, "grants", None) if jobs is not None else None
            if grants is None and jobs is not None and hasattr(jobs, "checks"):
                from laminar.runtime.grants import Grants

                grants = Grants.from_config(None)
            run_as = authority.peer_run_as(
                req, policy=self.policy, origin=origin, sender=sender, grants=grants,
                job_class=str(getattr(spec, "job_class", "standard")), priority=int(getattr(spec, "priority", 0)),
                cpus=getattr(spec, "cpus", None), memory_mb=getattr(spec, "memory_mb", None),
                reserved=None if demand is None else (demand.cpus, demand.memory_mb))
        except authority.Refused as e:
            raise self.authority.note(e, sender) from None
        if run_as.clamped:
            spec.cpus, spec.memory_mb = run_as.cpus, run_as.memory_mb
            log.info("zone: the job from node %d asked for more than its reservation: %s", sender,
                     ", ".join(run_as.clamped))
        return run_as

    def _unbind_unstarted(self, pid: int) -> None:
        """Free the capacity bound for placement ``pid`` when no job was started for it."""
        p = self.arbiter.placed.get(pid)
        if p is not None and not p.job_id:
            self.arbiter.unbind(pid)

    async def _handover(self, sender: int, body: wire.Handover) -> wire.HandoverAck:
        pid = body.placement_id
        self.counts["handovers"] += 1
        other = self.arbiter.prober_of(pid)
        if other is not None and other != sender:  # another node's placement: its id is no key here
            self.arbiter.counts["not_prober"] += 1
            e = self.authority.note(authority.Refused(
                "placement", f"placement {pid:016x} is node {other}'s (it probed for it), not node {sender}'s: "
                "a hand-over binds only the reservation its own submitter probed for"), sender)
            self._emit(f"refused a hand-over from node {sender}: {e}", placement=f"{pid:016x}", submitter=sender,
                       reason=e.reason)
            return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION, str(e))
        runs = await self._taken_over_as(pid, body)
        if runs is not None:  # this node's own take-over of the job started it: the hand-over gets it
            self.forgo_placement(pid)
            return wire.HandoverAck(pid, HANDOVER_OK, runs)
        p = self.arbiter.bind(pid, self.clock(), sender)
        if p is None:
            # a repeat after this agent restarted: the job may have started before the crash
            done = self.job_for_placement(pid)
            if done is not None:
                return wire.HandoverAck(pid, HANDOVER_OK, done)
            if self.arbiter.inventory.draining:
                return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION,
                                        f"node {self.node_id} is being reclaimed by its owner: it takes no new job")
            return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION, "no live reservation for this placement (lease expired?)")
        if p.job_id:
            return wire.HandoverAck(pid, HANDOVER_OK, p.job_id)
        from laminar.runtime import provenance as pv
        from laminar.runtime.spec import JobError, JobSpec

        try:
            req = json.loads(body.spec_json)
            # the peer's word on its own agent's behalf (a move, a guard's placement, a requeue);
            # a user's placement carries none. The job's env is its user's: names an agent of an
            # older release put there are dropped, never trusted (provenance.from_peer)
            migrated_from, requeued_from, resume_given = pv.origin_of_request(req)
            counts = getattr(self._jobs, "provenance_counts", None)
            ours = pv.JobOrigin(migrated_from=migrated_from, requeued_from=requeued_from).env()
            spec_d = dict(pv.from_peer(req["spec"], counts, f"node {sender}'s hand-over", ours))
            whole = [self.gpu_index[i] for i, f in p.reservation.gpu_alloc if f >= 1.0 - pl.EPS and i < len(self.gpu_index)]
            spec_d["gpus"] = whole
            origin = pv.JobOrigin(migrated_from=migrated_from, placement_id=pid,
                                  gpu_share=self._share_of(p.reservation.gpu_alloc), requeued_from=requeued_from)
            if self.loan.is_loan(p.reservation.demand):
                if not self.loan.loanable:  # it turned busy since its offer: the job goes elsewhere
                    self.arbiter.unbind(pid)
                    return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION,
                                            f"node {self.node_id} serves its own pool now: no loans")
                spec_d["lent"] = True
                self.loan.counts["loans"] += 1
            spec = JobSpec.from_dict(spec_d)
        except (ValueError, KeyError, TypeError) as e:
            if self._jobs is not None and hasattr(self._jobs, "count_refusal"):
                self._jobs.count_refusal("handover", e)
            self.arbiter.unbind(pid)
            return wire.HandoverAck(pid, HANDOVER_REJECTED, f"job spec refused: {e}")
        try:  # the peer speaks only for what it owns: its uid, gid, class and resources (authority.py)
            run_as = self._peer_run_as(req, sender, spec, p.reservation.demand)
        except authority.Refused as e:
            self.arbiter.unbind(pid)
            self._emit(f"refused a hand-over from node {sender}: {e}", placement=f"{pid:016x}", submitter=sender,
                       reason=e.reason)
            return wire.HandoverAck(pid, HANDOVER_REJECTED, str(e))
        if self._jobs is None:
            self.arbiter.unbind(pid)
            return wire.HandoverAck(pid, HANDOVER_ERROR, "this node runs no job manager")
        if req.get("quota") is True:
            # a user's new job whose owner is at jobs.max_per_user here is refused before anything
            # is taken for it (elastic grants shed, a checkpoint hashed); submit checks again
            try:
                self._jobs.checks.quota(run_as.uid)
            except JobError as e:
                self.arbiter.unbind(pid)
                return wire.HandoverAck(pid, HANDOVER_ERROR, f"job could not start on node {self.node_id}: {e}")
        # GPUs granted to elastic jobs are taken back first (their extra workers scale in);
        # one granted to an elastic job frozen since the offer cannot be: the job goes elsewhere
        mine = {self.gpu_index[i] for i, _ in p.reservation.gpu_alloc if i < len(self.gpu_index)}
        frozen = sorted(mine & self.loan.frozen_grants())
        if frozen:
            self.arbiter.unbind(pid)
            self.refresh_inventory()
            return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION, f"GPU(s) {frozen} on node {self.node_id} are granted "
                                    "to a frozen elastic job that cannot scale in until it thaws")
        self.loan.shed(mine, f"placement {pid:016x} from node {sender} takes the GPU")
        migrate = getattr(self.agent, "migrate", None)
        if spec.resume_from and migrate is not None and hasattr(migrate, "check_resume"):
            try:  # a migrated job: its checkpoint is verified here, right before LAMINAR_RESUME_FROM
                # (every file hashed, ~1 s per GiB: in a worker thread, never on the event loop),
                # one of the owner's worker-thread slots held meanwhile (api.work: a user placing
                # jobs whose checkpoints hash for hours must not take every worker thread)
                with self._work_slot(run_as.uid):
                    spec.resume_from = await asyncio.to_thread(migrate.check_resume, spec.resume_from,
                                                               run_as.uid, run_as.gid)
            except Busy as e:
                self.arbiter.unbind(pid)
                refusals = getattr(getattr(self.agent, "api", None), "refusals", None)
                if refusals is not None:
                    refusals.count(e.reason)
                return wire.HandoverAck(pid, HANDOVER_ERROR, f"job could not start on node {self.node_id}: {e}")
            except ValueError as e:
                self.arbiter.unbind(pid)
                return wire.HandoverAck(pid, HANDOVER_ERROR, f"job could not start on node {self.node_id}: {e}")
            if resume_given:  # the sender's agent gave it (a move's, a guard's replica), checked here as its owner
                origin = replace(origin, resume_given=spec.resume_from)
        try:
            job = await self._jobs.submit(spec, owner_uid=run_as.uid, owner_gid=run_as.gid,
                                          **({"quota": True} if req.get("quota") is True else {}), origin=origin)
        except JobError as e:
            # the spec was valid; what failed is this node's (a GPU taken by a local job meanwhile,
            # a command this node lacks): another node may start it
            self.arbiter.unbind(pid)
            return wire.HandoverAck(pid, HANDOVER_ERROR, f"job could not start on node {self.node_id}: {e}")
        except Exception as e:
            self.arbiter.unbind(pid)
            log.exception("placement %x: job start failed", pid)
            return wire.HandoverAck(pid, HANDOVER_ERROR, f"job start failed: {e}")
        p.job_id = job.id
        # the job runs: whatever fails from here on, the answer is its id (an error would have
        # the submitter place it elsewhere as well: two copies)
        try:
            self._store_placed(p)  # lost: after a restart its capacity counts as a local job's
            self._emit(f"placed job {job.id} from node {sender}", job=job.id, placement=f"{pid:016x}",
                       submitter=sender, gpu_alloc=[list(a) for a in p.reservation.gpu_alloc])
        except Exception:
            log.exception("placement %x: job %s started, but recording it failed", pid, job.id)
        return wire.HandoverAck(pid, HANDOVER_OK, job.id)

    # -- summaries ---------------------------------------------------------------------------------

    def own_zone_summary(self, now: float) -> pl.ZoneSummary:
        """This zone's summary from the peers' fresh summaries and this node's own view."""
        fresh = float(self.s["peer_timeout_s"])
        caps = [self.arbiter.view(now)]
        for n in self.membership.zone_list(self.zone):
            if n == self.node_id:
                continue
            st = self.membership.state[n]
            if st.last_summary is not None and now - st.summary_at <= fresh:
                caps.append(st.last_summary)
        return pl.summarize_zone(self.zone, caps, now, rng=self.rng, hints=pl.HINTS_PER_SHAPE)

    def _fresh_peer_mixes(self, now: float) -> list[mixlearn.Shares]:
        """The mixes this zone's peers shared in summaries received within ``peer_timeout_s``
        (older ones are forgotten)."""
        fresh = float(self.s["peer_timeout_s"])
        for n in [n for n, (at, _) in self.peer_mixes.items() if now - at > fresh]:
            del self.peer_mixes[n]
        return [m for _, m in self.peer_mixes.values()]

    def own_zone_mix(self, now: float) -> mixlearn.Shares | None:
        """This zone's merged mix, for the zone summary: this node's own counts and its fresh
        zone peers' (each weighted by its total), the heaviest shapes; None when none is known."""
        parts = self._fresh_peer_mixes(now)
        mine = self.arbiter.mix_share()
        if mine is not None:
            parts.append(mine)
        return mixlearn.top_shares(mixlearn.merge_shares(parts)) if parts else None

    def refresh_peer_mixes(self, now: float) -> None:
        """Hand the arbiter the fresh shared mixes: its zone peers' (``peer_timeout_s``) and the
        other zones' (3 x ``peer_timeout_s``, as their summaries); once a summary round."""
        parts = self._fresh_peer_mixes(now)
        stale = 3 * float(self.s["peer_timeout_s"])
        for z in [z for z, (at, _) in self.zone_mixes.items() if now - at > stale]:
            del self.zone_mixes[z]
        parts += [m for _, m in self.zone_mixes.values()]
        self.arbiter.set_peer_mixes(parts)

    def _own_summary_cached(self) -> pl.ZoneSummary:
        """:meth:`own_zone_summary`, kept until the next summary round (as the fits are)."""
        if self._own_summary is None:
            self._own_summary = self.own_zone_summary(self.clock())
        return self._own_summary

    def _summaries_changed(self) -> None:
        self._fits_cache.clear()
        self._own_summary = None

    def zone_summary(self, zone: int) -> pl.ZoneSummary | None:
        """The summary this node holds for ``zone`` (its own zone's from its peers), or None
        when it has none fresh enough; the submitter takes its hints from it."""
        if zone == self.zone:
            return self._own_summary_cached()
        s = self.zone_summaries.get(zone)
        if s is None or self.clock() - s.issued_at > 3 * float(self.s["peer_timeout_s"]):
            return None
        return s

    def zone_fits(self, demand: pl.Demand) -> dict[int, float]:
        """Fit per zone for ``demand``; cached until a summary changes."""
        key = (demand.gpus, demand.cpus, demand.memory_mb, demand.gpu_model)
        f = self._fits_cache.get(key)
        if f is None:
            now = self.clock()
            stale = 3 * float(self.s["peer_timeout_s"])
            sums = {z: s for z, s in self.zone_summaries.items() if now - s.issued_at <= stale}
            sums[self.zone] = self._own_summary_cached()
            f = {z: pl.zone_fit(s, demand) for z, s in sums.items()}
            self._fits_cache[key] = f
        return f

    async def _summary_loop(self) -> None:
        """Every summary_interval_s: this node's residual capacity to a few zone peers; the
        zone's lowest live node also sends the zone summary to a few nodes of each other zone."""
        interval = float(self.s["summary_interval_s"])
        fanout = int(self.s["summary_fanout"])
        while True:
            try:
                now = self.clock()
                self.refresh_inventory()
                self._summaries_changed()
                self.refresh_peer_mixes(now)
                assert self.endpoint is not None
                mine = self.arbiter.summary(now)
                peers = self.membership.zone_list(self.zone)
                for n in pl.probe_targets(peers, fanout, self.rng, exclude={self.node_id}):
                    self.endpoint.send(n, mine)
                    self.counts["summaries_sent"] += 1
                self._ask_suspects(fanout)
                # the zone's speaker: the lowest node id heard from lately (this one included);
                # in a zone larger than the fan-out a few may speak, still a bounded rate
                fresh = float(self.s["peer_timeout_s"])
                heard = [n for n in peers if n == self.node_id
                         or (self.membership.state[n].heard_at >= 0 and now - self.membership.state[n].heard_at <= fresh)]
                if heard and min(heard) == self.node_id:
                    zmsg = zone_summary_to_msg(self.own_zone_summary(now), self.own_zone_mix(now))
                    for z in self.membership.zones():
                        if z == self.zone:
                            continue
                        for n in pl.probe_targets(self.membership.zone_list(z), fanout, self.rng):
                            self.endpoint.send(n, zmsg)
            except Exception:
                log.exception("zone summary round failed")
            await asyncio.sleep(interval * (0.9 + 0.2 * self.rng.random()))

    def _ask_suspects(self, most: int) -> int:
        """Ask up to ``most`` suspects (drawn at random) for a heartbeat; returns how many.

        A suspect is not probed, so nothing this node sends it would show that it is back; and
        a node of another zone sends this one nothing by itself (its summaries stay in its zone,
        its zone speaks through its lowest live node). Without this, a node that missed three
        requests (a restart, a link down for a few seconds) stayed a suspect of every node
        outside its zone for good. Its answer (any authenticated datagram) clears it
        (``Membership.seen``). Bounded: ``most`` datagrams a summary round, whatever the
        number of suspects."""
        sus = [n for n in self.membership.suspects if n != self.node_id]
        if not sus or self.endpoint is None:
            return 0
        pick = sus if len(sus) <= most else self.rng.sample(sorted(sus), most)
        hb = wire.Heartbeat(int(self.clock() - self.started))
        for n in pick:
            self.endpoint.send(n, hb, flags=wire.FLAG_REPLY_WANTED)
        self.counts["heartbeats_sent"] += len(pick)
        return len(pick)

    # -- the submitter side --------------------------------------------------------------------------

    async def place(self, spec: dict[str, Any], demand: pl.Demand, owner_uid: int = 0, owner_gid: int = 0,
                    packing: bool = False, quota: bool = False, origin: dict[str, Any] | None = None) -> PlacementResult:
        """Place a job through the zone (what ``POST /v1/placements`` and Airlock's re-addressing
        call); ``packing``: the packing placement (:meth:`Submitter._place_packing`); ``quota``:
        a local user's new job (``POST /v1/placements``), which the node that takes it refuses
        when the owner already has ``jobs.max_per_user`` jobs not yet ended there (the
        placement then tries another node). Re-placed, requeued and moved jobs carry no quota:
        they are not new, and refusing them everywhere would lose them. ``origin``: what this
        agent knows of the job's origin (:func:`laminar.runtime.provenance.request_origin`: a
        requeue's key, whether it gave the job's ``resume_from``), for the node that takes it to
        store; never from a user (``POST /v1/placements`` gives none)."""
        req: dict[str, Any] = {"spec": spec, "owner_uid": owner_uid, "owner_gid": owner_gid}
        if quota:
            req["quota"] = True
        if origin:
            req["origin"] = origin
        res = await self.submitter.place(demand, req, packing=packing)
        row = {**res.as_dict(), "name": spec.get("name", ""), "created": time.time()}
        self.history.append(row)
        del self.history[:-200]
        store = getattr(self.agent, "store", None)
        if store is not None:
            with store.tx() as db:
                db.execute("INSERT OR REPLACE INTO zone_submitted VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", (
                    res.placement_id, row["name"], res.outcome, res.node, res.zone, res.job_id, res.reason,
                    json.dumps(row), row["created"]))
                # a record per POST /v1/placements (any user's): the oldest beyond
                # SUBMITTED_KEEP rows or SUBMITTED_KEEP_S seconds go in the same transaction
                db.execute("DELETE FROM zone_submitted WHERE created < ? OR placement_id IN (SELECT placement_id "
                           "FROM zone_submitted ORDER BY created DESC LIMIT -1 OFFSET ?)",
                           (row["created"] - SUBMITTED_KEEP_S, SUBMITTED_KEEP))
        fields = {k: row[k] for k in ("placement_id", "outcome", "node", "zone", "job_id")}
        if quota and owner_uid:  # a local user's placement: charged to their event budget (laminar.events)
            fields["by_uid"] = owner_uid
        self._emit(f"placement {res.outcome}: {row['name'] or 'job'} -> node {res.node} zone {res.zone}"
                   + (f" ({res.reason})" if res.reason else ""), **fields)
        return res

    def reclaim_notice(self, deadline_s: float, reason: str) -> int:
        """This node is being taken back: refuse new placements and tell the zone. Returns
        the number of peers told."""
        self.arbiter.inventory = pl.NodeCapacity(**{**self.arbiter.inventory.__dict__, "draining": True})
        if self.endpoint is None:
            return 0
        body = wire.ReclaimNotice(wire.new_id(), int(deadline_s * 1000), reason[:200])
        peers = [n for n in self.membership.zone_list(self.zone) if n != self.node_id]
        for n in peers:
            self.endpoint.send(n, body)
        return len(peers)

    # -- status and API --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "node": self.node_id, "zone": self.zone, "networked": self.networked,
            "drops": self.decoder.stats() if self.decoder else {},
            "handover_drops": self.tcp_decoder.stats() if self.tcp_decoder else {},
            "keys": self.key_stats() if self.networked else [],
            # who held the hand-over port, refused by reason (laminar.zone.gate)
            "handover_tcp": self.server.stats() if self.server is not None else {"connections": 0, "refused": 0},
            "udp": {"sent": getattr(self.endpoint, "sent", 0), "received": getattr(self.endpoint, "received", 0),
                    "send_errors": getattr(self.endpoint, "send_errors", 0)},
            "arbiter": {**self.arbiter.counts, "held": len(self.arbiter.held), "placed": len(self.arbiter.placed)},
            "submitter": dict(self.submitter.counts),
            "counts": dict(self.counts), "late_offers": self.router.late_offers,
            "authority": {**self.authority.as_dict(), "root_from": sorted(self.policy.root_from),
                          "peer_unknown_uids": self.policy.unknown_uids,
                          "identity_warnings": list(self.identity_warnings)},
            "residual": capacity_to_summary(self.arbiter.view(now)).__dict__,
            "loan": {"pool": self.loan.pool, "load": self.loan.load, "loanable": self.loan.loanable,
                     "returned": self.loan.returned, **self.loan.counts},
            "zone_summaries": {z: {"nodes": s.nodes, "slots": dict(zip(map(str, pl.SHAPES), s.slots, strict=True)),
                                   "gpu_models": list(s.gpu_models), "age_s": round(now - s.issued_at, 2),
                                   "hints": {str(pl.SHAPES[k]): list(h) for k, h in enumerate(s.hints) if h}}
                               for z, s in self.zone_summaries.items()},
        }

    def status(self) -> dict[str, Any]:
        return {"node": self.node_id, "zone": self.zone, "networked": self.networked,
                "members": len(self.membership.by_node), "held": len(self.arbiter.held),
                "placed": len(self.arbiter.placed), "drops": sum((self.decoder.drops if self.decoder else {}).values()),
                "handover_gate": self.server.gate.stats() if self.server is not None else {},
                # peers' requests refused for want of authority, by reason; what weakens identity
                "authority": dict(self.authority.counts), "warnings": list(self.identity_warnings)}

    def routes(self) -> list[Any]:
        from laminar.api import ApiError, Request, Route

        async def peers(req: Request) -> list[dict[str, Any]]:
            rows = self.membership.peers(self.clock())
            for r in rows:
                st = self.membership.state[r["node"]]
                r["summary_age_s"] = round(self.clock() - st.summary_at, 2) if st.summary_at >= 0 else None
            return rows

        async def stats(req: Request) -> dict[str, Any]:
            return self.stats()

        async def keys(req: Request) -> dict[str, Any]:
            return {"source": self.keys.source if hasattr(self, "keys") else None, "networked": self.networked,
                    "keys": self.key_stats() if self.networked else [], "node_key": self.node_key_info()}

        async def keys_reload(req: Request) -> dict[str, Any]:
            from laminar.zone.keys import KeyFileError

            try:
                return self.reload_keys()
            except (KeyFileError, OSError) as e:
                raise ApiError(400, f"{e} (the keys in use stay)") from None
            except RuntimeError as e:
                raise ApiError(409, str(e)) from None

        async def submit(req: Request) -> dict[str, Any]:
            body = req.body
            if not isinstance(body, dict) or not isinstance(body.get("spec"), dict):
                raise ApiError(400, "placement: body must be {\"spec\": {job spec}, \"gpus\": n, \"pool\": ..., "
                                    "\"gpu_model\": ..., \"packing\": false}")
            spec = dict(body["spec"])
            try:
                from laminar.runtime.grants import GrantError
                from laminar.runtime.spec import JobError, JobSpec

                checked = JobSpec.from_dict({**spec, "gpus": 0})  # GPUs are chosen by the node that takes it
            except ImportError:
                checked = None
            except JobError as e:
                if self._jobs is not None and hasattr(self._jobs, "count_refusal"):
                    self._jobs.count_refusal("placement", e)
                raise ApiError(400, f"placement: {e}", e.reason or "placement_invalid") from None
            if checked is not None and self._jobs is not None and hasattr(self._jobs, "checks"):
                # the origin checks the caller's grant (config [grants]); the node that takes the
                # job keeps the class admitted here
                try:
                    self._jobs.checks.grant(checked, req.peer.uid, req.peer.gid, req.peer.pid, req.peer.groups)
                except GrantError as e:
                    raise ApiError(403, f"placement: {e}") from None
            if isinstance(spec.get("gpus"), list):
                raise ApiError(400, "placement: give a GPU count (\"gpus\": 2 or 0.5), not indices: the node that "
                                    "takes the job chooses its GPUs")
            try:
                demand = placement_demand(body, spec, checked)
            except (pl.PlacementError, TypeError, ValueError) as e:
                raise ApiError(400, f"placement: {e}", "placement_invalid") from None
            packing = body.get("packing", False)
            if not isinstance(packing, bool):
                raise ApiError(400, f"placement: packing {packing!r} must be true or false")
            if checked is not None:  # what was checked goes on, not what was sent (it is checked again there)
                spec = checked.as_dict()
            spec.pop("gpus", None)
            res = await self.place(spec, demand, req.peer.uid, req.peer.gid, packing=packing, quota=True)
            return res.as_dict()

        async def history(req: Request) -> list[dict[str, Any]]:
            return list(reversed(self.history))

        return [
            *self.loan.routes(),
            Route("GET", "/v1/zone/peers", peers),
            Route("GET", "/v1/zone/stats", stats),
            Route("GET", "/v1/zone/keys", keys),
            Route("POST", "/v1/zone/keys/reload", keys_reload, privileged=True),
            Route("GET", "/v1/placements", history),
            Route("POST", "/v1/placements", submit, privileged=False),
        ]
