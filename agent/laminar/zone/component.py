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
the message dispatch, this node's inventory, placements it submits (:meth:`ZoneComponent.place`),
its reclaim notice (:meth:`ZoneComponent.reclaim_notice`), and the API routes
``GET /v1/zone/peers``, ``GET /v1/zone/stats``, ``GET /v1/zone/keys``,
``POST /v1/zone/keys/reload`` (privileged) and ``POST /v1/placements``
(:mod:`laminar.zone.routes`). The rest is in its
parts, each built here and given the component (what each uses of it: a ``Protocol`` in its
module), each holding its own state:

- ``keyring`` (:class:`laminar.zone.keyring.Keyring`): key and node-key reloads (SIGHUP,
  ``POST /v1/zone/keys/reload``), roster additions a reload takes, the sequence floor;
- ``handovers`` (:class:`laminar.zone.handovers.Handovers`): jobs handed to this node, the
  placements bound here and their record in the store; ``tick`` gives back ended jobs' capacity;
- ``summaries`` (:class:`laminar.zone.summaries.Summaries`): this node's and this zone's
  capacity summaries, the ones heard, the fits and shared mixes; ``tick``/``speak`` each round;
- ``liveness`` (:class:`laminar.zone.liveness.Liveness`): heartbeats asked of suspects and
  answered (who is live is :class:`laminar.zone.membership.Membership`'s);
- ``rebind`` (:class:`laminar.zone.rebind.Rebind`): the address the zone listens on, waited
  for while tentative and followed once usable (``on_rebind``: the migration layer's listener);
- ``loan`` (:class:`laminar.zone.loan.LoanManager`): capacity loaning and elastic scaling.

The ``[zone]`` settings are :mod:`laminar.zone.config`'s (registered when this module is
imported).

A placement's outcomes (:class:`PlacementResult`) are laminar.zone.submitter's to describe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from laminar.policy import placement as pl
from laminar.tasks import cancel_until_done
from laminar.zone import authority, wire

# The arbiter and the submitter moved to their own socket-free modules (issue 32): the star
# imports keep their names importable from here until a later stage moves the callers.
from laminar.zone.arbiter import *  # noqa: F403
from laminar.zone.arbiter import Arbiter, capacity_to_summary
from laminar.zone.config import zone_config_fields
from laminar.zone.handovers import Handovers
from laminar.zone.keyring import Keyring
from laminar.zone.keys import PairKeys, ZoneKeys
from laminar.zone.liveness import Liveness
from laminar.zone.loan import LoanManager
from laminar.zone.membership import WILDCARDS, Membership, canonical_ip, host_port
from laminar.zone.rebind import Rebind
from laminar.zone.routes import zone_routes
from laminar.zone.submitter import *  # noqa: F403
from laminar.zone.submitter import PlacementResult, Submitter
from laminar.zone.summaries import Summaries
from laminar.zone.transport import (
    Router,
    Transport,
    error_text,
)

if TYPE_CHECKING:
    from laminar.components import ZoneAgent

log = logging.getLogger("laminar.zone")

# zone_submitted keeps a record of each placement this node submitted (POST /v1/placements, any
# user's): the newest SUBMITTED_KEEP, none older than SUBMITTED_KEEP_S (it was never pruned).
SUBMITTED_KEEP = 10_000
SUBMITTED_KEEP_S = 7 * 86400.0


# --------------------------------------------------------------------------- the agent component


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
        return await self.comp.handovers.on_handover(self.comp.node_id, body)


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
            return await self.comp.handovers.on_handover(node, body)
        from laminar.zone.transport import handover

        m = self.comp.membership.by_node[node]
        assert self.comp.encoder is not None and self.comp.tcp_decoder is not None
        # from the address the agent listens on, when it names one: its roster address, which
        # the receiver checks the connection against (zone.check_source)
        listen = self.comp.listen_host
        local = None if listen in WILDCARDS else listen
        return await handover(self.comp.encoder, self.comp.tcp_decoder, m.zone, m.addr, port or m.handover_port,
                              body, timeout_s, self.comp.wall, to=node, local_host=local)


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
        self.agent: ZoneAgent | None = None  # what the zone reads of it: laminar.components
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
        # zone.listen as bound (membership.bind_host), set by start; until the address it should
        # bind is usable, :: or 0.0.0.0 (Rebind)
        self.listen_host = "0.0.0.0"
        self.router = Router()
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
        self.keys: ZoneKeys  # the zone keys, set by start (a reload replaces them: Keyring)
        # the parts (each given this component; what each uses of it: its module's *Host)
        self.keyring = Keyring(self)
        self.handovers = Handovers(self)
        self.summaries = Summaries(self)
        self.liveness = Liveness(self)
        self.rebind = Rebind(self)

    # -- life cycle -----------------------------------------------------------------------------

    async def start(self, agent: ZoneAgent | None) -> None:
        """Read the config, load keys (a clear error when missing or unsafe), open the sockets."""
        from laminar.zone.keys import ephemeral_keys, load_keys, load_node_key
        from laminar.zone.membership import Member, members_from_config

        self.agent = agent
        if self._settings is not None:
            s = self._settings
        elif agent is not None:
            s = agent.config.section("zone")
        else:
            raise RuntimeError("zone: started with neither an agent nor settings")
        s = {**{k: f.default for k, f in zone_config_fields().items()}, **s}
        self.s = s
        if self._jobs is None and agent is not None:
            self._jobs = agent.jobs
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
        await self.rebind.choose(str(s["listen"]), me.addr)
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
            transport, self.membership, self.summaries.zone_fits, rng=self.rng, policy=policy, lease_s=float(s["lease_s"]),
            hold_s=float(s["hold_s"]), probe_timeout_s=float(s["probe_timeout_s"]),
            handover_timeout_s=float(s["handover_timeout_s"]), max_rounds=int(s["queue_rounds"]), clock=self.clock,
            unconfirmed_wait_s=float(s["unconfirmed_wait_s"]), zone_summary=self.summaries.zone_summary,
            packing_spread=int(s["packing_spread"]),
        )
        self.router.on_late_offer = self.submitter.note_late_offer
        self.keys = keys
        self.encoder = wire.Encoder(self.node_id, keys, seq0=self.keyring.seq_start(),
                                    reserve=self.keyring.seq_reserve if self.keyring.seq_store() is not None else None,
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
                                         lambda msg: self.handovers.on_handover(msg.node, msg.body),  # type: ignore[arg-type]
                                         self.wall, float(s["handover_timeout_s"]),
                                         gate=Gate(self.membership.roster_ips, check_source=check))
            try:
                await self.server.start(self.listen_host, s["handover_port"])
            except OSError as e:
                self.endpoint.close()
                raise RuntimeError(f"zone: cannot listen on {host_port(self.listen_host, int(s['handover_port']))} "
                                   f"(TCP hand-overs, zone.listen and zone.handover_port): {error_text(e)}") from None
            self._tasks.append(asyncio.create_task(self._summary_loop()))
            if self.rebind.waiting_for:
                self._tasks.append(asyncio.create_task(self.rebind.follow(self.rebind.waiting_for)))
        self._tasks.append(asyncio.create_task(self._watch_jobs()))
        self._emit(f"zone ready: node {self.node_id} in zone {self.zone}, {len(members)} members, "
                   f"{'networked' if self.networked else 'one-node zone'}"
                   + (f", node key {self.pairs.source}: pair MACs with {len(self.pairs.shared) - 1} nodes"
                      + (f" (node_keys = {self.pairs.mode}: zone-key MACs taken too)" if self.pairs.mode != "require"
                         else "") if self.pairs is not None else ""))

    async def stop(self) -> None:
        if hasattr(self, "loan"):
            await self.loan.stop()
        await cancel_until_done(self._tasks)
        self._tasks.clear()
        if self.server is not None:
            await self.server.stop()
        if self.endpoint is not None:
            self.endpoint.close()

    def _emit(self, message: str, **fields: Any) -> None:
        ev = self.agent.events if self.agent is not None else None
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
        # [gpus] owner = "scheduler" (laminar.runtime.adopt): the scheduler hands out this node's
        # GPUs, so none is free for a placement or a loan here
        if getattr(getattr(jobs, "adoption", None), "gpu_owner", "laminar") == "scheduler":
            gpu = [0.0] * len(gpu)
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

    # -- store ----------------------------------------------------------------------------------

    def _open_store(self) -> None:
        store = self.agent.store if self.agent is not None else None
        if store is None:
            return
        store.ensure_schema("zone", [
            "CREATE TABLE IF NOT EXISTS zone_placed (placement_id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, "
            "demand TEXT NOT NULL, gpu_alloc TEXT NOT NULL, submitter INTEGER NOT NULL, since REAL NOT NULL)",
            "CREATE TABLE IF NOT EXISTS zone_submitted (placement_id INTEGER PRIMARY KEY, name TEXT, outcome TEXT, "
            "node INTEGER, zone INTEGER, job_id TEXT, reason TEXT, result TEXT, created REAL)",
        ])
        self.handovers.reattach(store)
        self.refresh_inventory()

    async def _watch_jobs(self) -> None:
        """Give capacity back when placed jobs end (:meth:`Handovers.tick`), every second."""
        while True:
            await asyncio.sleep(1.0)
            self.handovers.tick(self.clock())

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
        if isinstance(body, wire.MemberRequest | wire.MemberAnswer):
            members = self.agent.members if self.agent is not None else None
            return members.on_message(sender, body) if members is not None else None
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
            self.summaries.on_summary(msg.node, body)
            return
        if isinstance(body, wire.ZoneSummaryMsg):
            self.summaries.on_zone_summary(msg.node, body)
            return
        if isinstance(body, wire.ReclaimNotice):
            self.counts["reclaim_notices"] += 1
            self._emit(f"node {msg.node} announced its reclaim in {body.deadline_ms} ms: {body.reason}",
                       node=msg.node, deadline_ms=body.deadline_ms)
            return
        if isinstance(body, wire.Heartbeat):
            self.liveness.on_heartbeat(msg.node, msg.flags)
            return
        reply = self.handle_request(msg.node, body)
        if reply is not None and self.endpoint is not None:
            # answer where it came from, signed with the sender's zone key
            self.endpoint.send_to(self.membership.by_node[msg.node].zone, addr, reply, to=msg.node)

    async def _summary_loop(self) -> None:
        """Every summary_interval_s: this node's residual capacity to a few zone peers, a few
        suspects asked for a heartbeat, and, from the zone's speaker, the zone summary to a few
        nodes of each other zone (:class:`Summaries`, :class:`Liveness`)."""
        interval = float(self.s["summary_interval_s"])
        while True:
            try:
                now = self.clock()
                self.refresh_inventory()
                self.summaries.tick(now)
                self.liveness.tick(now)
                self.summaries.speak(now)
            except Exception:
                log.exception("zone summary round failed")
            await asyncio.sleep(interval * (0.9 + 0.2 * self.rng.random()))

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
        store = self.agent.store if self.agent is not None else None
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

    def own_gpus(self) -> int | None:
        """How many GPUs this node has for placed jobs (its arbiter's inventory); None before
        the zone has started."""
        arb: Arbiter | None = getattr(self, "arbiter", None)
        return len(arb.inventory.gpu_free) if arb is not None else None

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "node": self.node_id, "zone": self.zone, "networked": self.networked,
            "drops": self.decoder.stats() if self.decoder else {},
            "handover_drops": self.tcp_decoder.stats() if self.tcp_decoder else {},
            "keys": self.keyring.key_stats() if self.networked else [],
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
                               for z, s in self.summaries.zone_summaries.items()},
        }

    def status(self) -> dict[str, Any]:
        return {"node": self.node_id, "zone": self.zone, "networked": self.networked,
                "members": len(self.membership.by_node), "held": len(self.arbiter.held),
                "placed": len(self.arbiter.placed), "drops": sum((self.decoder.drops if self.decoder else {}).values()),
                "handover_gate": self.server.gate.stats() if self.server is not None else {},
                # peers' requests refused for want of authority, by reason; what weakens identity
                "authority": dict(self.authority.counts), "warnings": list(self.identity_warnings)}

    def routes(self) -> list[Any]:
        return [*self.loan.routes(), *zone_routes(self)]
