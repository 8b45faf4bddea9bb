"""The reclaim contract and migration between agents (``agent.migrate``).

An owner (or an inference scheduler) takes a node back with a notice window::

    laminarctl reclaim --notice 60s              # this node
    laminarctl reclaim --notice 60s --node 4     # node 4 of the zone (forwarded to its agent)
    POST /v1/reclaim {"notice_s": 60, "node": 4, "reason": "owner"}     (privileged)

The reclaimed node's agent then

1. tells the zone (the zone's reclaim notice: it stops taking placements, its peers record the
   window) and arms the kill-switch of every job on the node for the window's end
   (``netguard.arm_job``): whatever still runs then loses its network at once;
2. plans the evacuation with :func:`laminar.policy.ckpt_schedule.notice_schedule` (who is
   signalled when, as late as is safe; transfer deadlines);
3. for each job: sends the checkpoint signal, waits for the job's new checkpoint (jobkit's
   layout in ``LAMINAR_CKPT_DIR``), freezes the job as soon as it is there (steps after the
   checkpoint would be lost anyway), checks it against its manifest while it builds the
   transfer manifest (one read), ranks the zone's nodes with
   :func:`laminar.policy.destination.rank` (resource fit from their summaries, whether the
   transfer fits what is left of the window, survival from the hazard model, zone topology),
   reserves the best through the zone (probe, offer, commit), sends the checkpoint to the
   destination's transfer endpoint (:mod:`laminar.migrate.transfer`: authenticated, chunked,
   resumable; registered with the shaper, ``agent.transfers``, with the window's deadline; what
   is sent is a snapshot under ``<root>/outgoing/``: hard links to, or copies of, the job's
   regular files only, never read through a link or opened as a pipe or device, since the job's
   user may swap a file after it was verified; snapshots a crash left there go at start),
   hands the job spec over with ``resume_from`` naming the verified checkpoint *on the
   destination*, and stops its own copy (state ``migrated``). The destination verifies the
   checkpoint again before the job starts there with ``LAMINAR_RESUME_FROM``;
4. at the window's end, stops whatever is still running (state ``reclaimed``).

The component is :class:`ReclaimComponent`: it starts and stops, owns the transfer endpoint and
the watch loop, answers the API and builds its parts (docs/migration.md, *The parts*), each
given the component through its constructor: :mod:`laminar.migrate.control` the control ops
other nodes send (``control``); :mod:`laminar.migrate.evacuation` this node's reclaim
(``evacuation``: its window, its plan, the stop at its end); :mod:`laminar.migrate.mover` one
move of one job (``mover``); :mod:`laminar.migrate.keepers` the storage keepers and the keepers
passed on (``keepers``); :mod:`laminar.migrate.checkpoints` the jobs' checkpoints as a move
sees them (``checkpoints``); :mod:`laminar.migrate.prestage` prestaging, keepers and releases
(``prestage``, *When the source dies*); :mod:`laminar.migrate.fence`, :mod:`laminar.migrate.vouch`,
:mod:`laminar.migrate.replicas`, :mod:`laminar.migrate.withdraw`, :mod:`laminar.migrate.settle`
and :mod:`laminar.migrate.takeover` (``keeping``: a keeper's take-over of a dead source's job). It
builds :mod:`laminar.migrate.archive` the archive, the keeper of last resort (``archive``:
stopped jobs' and periodic checkpoints, claims, the sweep, a hung archive). The tunables more
than one part of the component uses are in :mod:`laminar.migrate.constants`, its errors in
:mod:`laminar.migrate.errors`. The component's tables are in :mod:`laminar.migrate.schema`.

A root job's ``resume_from`` outside ``xfer/`` is checked in a child process like another
user's (:func:`verify_as_owner`), bounded by ``VERIFY_STALL_S``.

Progress: events of kind ``migrate`` and ``GET /v1/migrations/{job}`` (what
``laminarctl job show ID --follow`` draws as a progress bar).

Config (``[migrate]``)::

    [migrate]
    port = 7442              # TCP port of the checkpoint transfer endpoint (the same on every node)
    notice_margin = 0.8      # share of a notice window planned transfers may use
    hazard_prior_rate_per_h = 0.0417   # departures per node-hour before any is seen
    spot_traces = ""         # calibrate the hazard from spot traces (a file or directory)
    path_mbit = 1000         # path bandwidth to peers assumed for planning
    rate_mbit = 0            # pace transfers in user space too (0: the shaper only)
    chunk_kb = 1024          # transfer chunk size
    prestage = "auto"        # auto | always | off
    expected_notice_s = 60   # the window "auto" plans for
    dead_after_s = 3         # silence after a notice that declares the source dead
    orphan_after_s = 0       # silence without a notice that does (0: never; a partition doubles jobs until it heals)
    fence_after_s = 0        # hearing no member this long freezes the jobs the zone would resume (0: off; < orphan_after_s)
    keeper = true            # no room for a job during a reclaim: its final checkpoint goes to a storage keeper
    keeper_reserve_mb = 1024 # disk this node keeps free when it offers to hold checkpoints
    retry_base_s = 2         # a keeper that finds no room looks again after this, doubling each time
    retry_max_s = 30         # ... up to this
    archive_dir = ""         # storage outside the pool for stopped jobs no live peer can keep (empty: off)
    replica_keeper_check_s = 600  # a keeper unchanged this long is checked with its source (0: never)
    replica_orphan_s = 21600 # replicas of a key no keeper named go after this (>= 3600)
    replica_row_keep_s = 86400   # done replica rows whose directory is gone are deleted after this (>= 3600)
    replica_gc_s = 30        # how often every held replica is looked at
    archive_gc_s = 10        # how often this agent sweeps archive_dir

Between reclaims the component also asks each job for periodic checkpoints at the interval the
hazard sets (:mod:`laminar.migrate.ckpt_driver`, its keys in the same section; the plan is
``GET /v1/checkpoints``, ``laminarctl checkpoints``).

The readdress hook Airlock calls for its re-address rung is :meth:`Mover.readdress`
(a move without a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import sqlite3
import time
from pathlib import Path
from typing import Any

from laminar import jobkit
from laminar.airlock.cgroups import freeze_counts as cgroup_freeze_counts
from laminar.components import MigrateAgent
from laminar.config import Field, _one_of, _range, register_old_keys, register_section
from laminar.migrate import ckpt_driver
from laminar.migrate.archive import Archive
from laminar.migrate.archive_gc import ARCHIVE_GC_S
from laminar.migrate.checkpoints import Checkpoints
from laminar.migrate.constants import REPLICA_LATE_S, RESUME_DIR, valid_ckpt_name, valid_key
from laminar.migrate.control import Control
from laminar.migrate.errors import MigrateError
from laminar.migrate.evacuation import Evacuation
from laminar.migrate.evidence import Evidence
from laminar.migrate.fence import Fence, check_fence_settings
from laminar.migrate.hazard import (
    DEFAULT_PRIOR_RATE_PER_H,
    HazardError,
    HazardModel,
    calibrate_from_spot_traces,
)
from laminar.migrate.keepers import Keepers
from laminar.migrate.mover import Move, Mover
from laminar.migrate.owner_check import verify_as_owner
from laminar.migrate.prestage import Prestage
from laminar.migrate.replica_policy import keeper_confirmation as keeper_confirmation
from laminar.migrate.replica_policy import keeper_needed as keeper_needed
from laminar.migrate.replica_policy import redact_replica
from laminar.migrate.replica_policy import replica_gc_plan as replica_gc_plan
from laminar.migrate.replica_policy import replica_victims as replica_victims
from laminar.migrate.replicas import Replicas
from laminar.migrate.schema import (
    MOVES_SCHEMA,
    RECLAIM_SCHEMA,
    REPLICAS_SCHEMA,
    upgrade_keepers,
    upgrade_moves,
)
from laminar.migrate.settle import Settle
from laminar.migrate.takeover import Takeover
from laminar.migrate.transfer import (
    Committed,
    Progress,
    Receiver,
    StatsCollector,
    TransferError,
    send_control,
    verified_checkpoint,
)
from laminar.migrate.trees import _remove_tree
from laminar.migrate.vouch import Vouch
from laminar.migrate.withdraw import Withdraw
from laminar.policy import ckpt_schedule as cs
from laminar.policy import destination as dst
from laminar.policy.keeper import RetrySchedule
from laminar.runtime.holds import Holds, holds_of
from laminar.tasks import cancel_until_done
from laminar.zone import authority as au
from laminar.zone.gate import Gate
from laminar.zone.membership import canonical_ip, listen_check

log = logging.getLogger("laminar.migrate")

DEFAULT_PORT = 7442
# How often every held key is looked at (released, handed over, placed elsewhere, ...): the default
# of ``[migrate] replica_gc_s``.
REPLICA_GC_S = 30.0

CONFIG_FIELDS = {
    "port": Field(int, DEFAULT_PORT, "TCP port of the checkpoint transfer endpoint (the same on every node)",
                  _range(1, 65535)),
    "listen": Field(str, "", "address the transfer endpoint binds and, when it names one address, the one this "
                    "node's transfer connections leave from (peers check it against its zone.nodes entry; "
                    "empty: zone.listen)", listen_check),
    "notice_margin": Field(float, cs.NOTICE_MARGIN, "share of a notice window planned transfers may use",
                           _range(0.1, 1.0)),
    "hazard_prior_rate_per_h": Field(float, DEFAULT_PRIOR_RATE_PER_H, "departures per node-hour before any is seen",
                                     _range(0.0, 100.0)),
    "spot_traces": Field(str, "", "calibrate the hazard model from these spot traces (file or directory)"),
    "path_mbit": Field((int, float), 1000.0, "path bandwidth to peers assumed for planning (Mbit/s)",
                       _range(0.001, 10_000_000)),
    "rate_mbit": Field((int, float), 0.0, "pace checkpoint transfers in user space (Mbit/s; 0: the shaper only)",
                       _range(0, 10_000_000)),
    "chunk_kb": Field(int, 1024, "checkpoint transfer chunk size (KiB)", _range(1, 65536)),
    "prestage": Field(str, "auto", "ship checkpoints to the job's keeper as they are written: auto (when the final "
                      "one would not fit expected_notice_s), always, off", _one_of("auto", "always", "off")),
    "expected_notice_s": Field((int, float), 60.0, "the notice window prestage = auto plans for", _range(0, 86400)),
    "poll_s": Field((int, float), 0.5, "how often checkpoints, replicas and peers are looked at", _range(0.05, 60)),
    "dead_after_s": Field((int, float), 3.0, "zone silence after a reclaim notice that declares the source dead",
                          _range(0.1, 3600)),
    "orphan_after_s": Field((int, float), 0.0, "zone silence without a notice that declares the source dead "
                            "(0: never)", _range(0, 86400)),
    "fence_after_s": Field((int, float), 0.0, "a node that hears no other member of the roster for this long "
                           "freezes the jobs the zone would resume elsewhere (a keeper or an archived copy) until it "
                           "hears one again and finds them not taken over (self-fencing; must be less than "
                           "orphan_after_s; 0: off)", _range(0, 86400)),
    "ckpt_wait_s": Field((int, float), 30.0, "how long a job gets to write its checkpoint after the signal",
                         _range(0.1, 3600)),
    "prestage_unannounced": Field((int, float), 0.02, "prestage = auto also keeps an off-node replica while the "
                                  "learned share of departures without notice is at least this", _range(0.0, 1.0)),
    "keeper": Field(bool, True, "when no peer has room for a job during a reclaim, send its final checkpoint to a live "
                    "peer with the disk space (a storage keeper), which resumes the job when room frees"),
    "keeper_reserve_mb": Field((int, float), 1024.0, "disk space this node keeps free when it offers to hold "
                               "checkpoints (MiB)", _range(0, 1 << 30)),
    "archive_dir": Field(str, "", "storage outside the pool, shared by the zone's agents (an NFS mount): a stopped "
                         "job's checkpoint and keeper go there when no live peer can keep them, and any agent with room "
                         "claims it; running jobs' periodic checkpoints go there too while departures without notice "
                         "are plausible (prestage_unannounced) (empty: off)"),
    "archive_uid": Field(int, 0, "the uid that owns archive_dir and what the agents write there: root (0) unless the "
                         "export squashes root (root_squash or all_squash: then the uid it maps the agents' root to, "
                         "e.g. 65534). The agent uses the archive only while archive_dir is a real directory of this "
                         "uid that neither group nor others may write", _range(0, 2**32 - 2)),
    "retry_base_s": Field((int, float), 2.0, "a keeper that finds no room looks again after this, doubling each time",
                          _range(0.05, 3600)),
    "retry_max_s": Field((int, float), 30.0, "the longest wait between a keeper's looks for room", _range(0.05, 86400)),
    "replica_keeper_check_s": Field((int, float), 600.0, "a keeper held here that has not changed for this long is "
                                   "checked with its live source (control op needs): it ends when the source says the "
                                   "job ended, moved, or has another keeper (0: never)", _range(0, 86400 * 30)),
    "replica_orphan_s": Field((int, float), 21600.0, "a key's directory of replicas with no keeper row here (its keeper "
                              "never came) that no local job uses goes when nothing in it changed for this long",
                              _range(REPLICA_LATE_S, 86400 * 365)),
    "replica_row_keep_s": Field((int, float), 86400.0, "a done replica row (released, handed over, placed, passed, "
                                "resumed) whose directory is gone is deleted after this (a late keeper of it is then "
                                "a new keeper)", _range(REPLICA_LATE_S, 86400 * 365)),
    "replica_gc_s": Field((int, float), REPLICA_GC_S, "how often every replica held here is looked at (released, "
                          "handed over, placed elsewhere: its checkpoints go; keepers due a check with their source)",
                          _range(0.1, 86400)),
    "archive_gc_s": Field((int, float), ARCHIVE_GC_S, "how often this agent sweeps archive_dir for what no job "
                          "needs any more (listing shared storage is not free)", _range(0.1, 86400)),
    "reclaim_from": Field(list, [], "nodes that may reclaim this node, or cancel its reclaim, from their own API "
                          "(laminarctl reclaim --node N there, forwarded as control op reclaim/reclaim-cancel); "
                          "default none: only this node's own API (docs/protocol.md, Authority)", au.check_node_list),
    **ckpt_driver.CONFIG_FIELDS,  # periodic checkpoints (laminar.migrate.ckpt_driver)
}
register_section("migrate", CONFIG_FIELDS)
# The keys' names before 2026-12-06 (issue 32, one word for a keeper), still read for one release
# with a logged note (laminar.config.register_old_keys).
register_old_keys("migrate", {"holder": "keeper",  # old spelling
                              "holder_reserve_mb": "keeper_reserve_mb",  # old spelling
                              "replica_guard_check_s": "replica_keeper_check_s"})  # old spelling

class ReclaimComponent:
    """``laminar.migrate.reclaim:ReclaimComponent`` (agent attribute ``migrate``)."""

    agent_attr = "migrate"
    status_key = "migrate"

    def __init__(self) -> None:
        self._agent: MigrateAgent | None = None  # set by start (:attr:`agent`)
        self.s: dict[str, Any] = {}
        self.receiver: Receiver | None = None
        self._xfer_local: str | None = None  # the address transfer connections leave from (start)
        self.port = 0
        self.root: Path | None = None
        self.evidence = Evidence(self)  # hazard and notice odds: what the agent plans with, what it saw (evidence.py)
        self.notices: dict[int, tuple[float, float]] = {}  # node -> (window end, wall; received, wall)
        self.reclaim: dict[str, Any] | None = None  # this node's reclaim in progress
        self.moves: dict[str, Move] = {}  # job id -> its latest move
        # each job's keeper, the checkpoint last shipped to it, the releases owed to old keepers (prestage.py)
        self.prestage = Prestage(self)
        self.evacuating: set[str] = set()
        self.fence = Fence(self)  # the jobs this node froze while cut off from its zone (fence.py)
        self.ckpt_latency: dict[str, float] = {}  # job id -> seconds its last requested checkpoint took
        self.replicas = Replicas(self)  # the replicas held here for other nodes' jobs (replicas.py)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[Any] | None = None
        self._unsubscribe: Any = None
        self.ckpt: ckpt_driver.CkptDriver | None = None  # periodic checkpoints
        self.counts: dict[str, int] = {"moves": 0, "moved": 0, "failed": 0, "prestaged": 0, "resumed": 0,
                                       "received": 0, "held": 0, "placed": 0, "retries": 0, "archived": 0}
        self._drain_task: asyncio.Task[Any] | None = None  # places this node's queued jobs elsewhere during a reclaim
        self.withdraw = Withdraw(self)  # the cancel of this node's reclaim, a peer's withdrawal (withdraw.py)
        self._superseding: set[str] = set()  # this node's jobs being stopped: a keeper runs them (Replicas.answer_superseded)
        # the archive, the keeper of last resort: its copies, claims, sweep and lane (archive.py)
        self.archive = Archive(self)
        # jobs whose final checkpoint is in the archive (or on its way there, late) while their
        # stop here is under way: never thawed nor moved again (any agent with room claims it)
        self._archive_keeps: set[str] = set()
        self.vouch = Vouch(self, isolated=self.fence.isolated)  # other members' word on a silent peer (vouch.py)
        self._started = 0.0  # when this agent's component started (wall): a keeper older than it may have missed news
        # a keeper's watch of its sources, its take-over of a dead source's job, hand-overs (takeover.py)
        self.takeover = Takeover(self)
        self.settle = Settle(self)  # hand-overs not answered, an operator's settle of one (settle.py)
        self.control = Control(self)  # the control ops other nodes send, who may send them (control.py)
        self.checkpoints = Checkpoints(self)  # the jobs' checkpoints as a move sees them, planning sizes (checkpoints.py)
        self.evacuation = Evacuation(self)  # this node's reclaim: its window, its plan, its records (evacuation.py)
        self.mover = Mover(self)  # one move of one job, the records of a move without a window (mover.py)
        self.keepers = Keepers(self)  # no room anywhere: storage keepers; a reclaimed keeper passing its jobs on (keepers.py)

    @property
    def agent(self) -> MigrateAgent:
        """The agent, as the migration layer reads it (``laminar.components.MigrateAgent``).
        Raises RuntimeError before :meth:`start`."""
        if self._agent is None:
            raise RuntimeError("migrate: not started (no agent yet)")
        return self._agent

    @agent.setter
    def agent(self, agent: MigrateAgent) -> None:
        self._agent = agent

    # -- life cycle ---------------------------------------------------------------------------

    async def start(self, agent: MigrateAgent) -> None:
        """Opens the replicas table, loads the hazard model, starts the transfer endpoint and
        the watch loop. Raises RuntimeError when the endpoint's port cannot be bound."""
        self.agent = agent
        self._started = time.time()
        self.s = {**{k: f.default for k, f in CONFIG_FIELDS.items()}, **agent.config.section("migrate")}
        agent.store.ensure_schema("migrate", REPLICAS_SCHEMA)
        agent.store.ensure_schema("migrate-reclaim", RECLAIM_SCHEMA)
        agent.store.ensure_schema("migrate-moves", MOVES_SCHEMA)
        with agent.store.tx() as db:  # an older agent's move records: all of them into migrate_moves
            upgraded = upgrade_moves(db)
            kept = upgrade_keepers(db)  # and its keeper tables by their old names (same transaction)
        if upgraded:
            log.info("migrate: move records upgraded into migrate_moves: %s", upgraded)
        if kept:
            log.info("migrate: keeper tables and states renamed (rows carried): %s", kept)
        for r in agent.store.db.execute("SELECT key, request FROM migrate_replicas").fetchall():
            self.replicas.resumes.note_owner(str(r["key"]), r["request"])
        self._backfill_origins()
        self.prestage.restore()
        self.fence.restore()
        try:
            self.takeover.retry = RetrySchedule(float(self.s["retry_base_s"]), 2.0, float(self.s["retry_max_s"]))
            ckpt_driver.check_settings(self.s)
            check_fence_settings(self.s)
        except ValueError as e:
            raise RuntimeError(f"migrate: {e}") from None
        prior = float(self.s["hazard_prior_rate_per_h"])
        base = HazardModel("default", prior_rate_per_h=prior)
        if self.s["spot_traces"]:
            try:
                base = calibrate_from_spot_traces(self.s["spot_traces"], provider="default", prior_rate_per_h=prior)
            except (HazardError, OSError) as e:
                raise RuntimeError(f"migrate: spot_traces {self.s['spot_traces']!r}: {e}") from None
        # What this agent saw before a restart is evidence too: reload it on top of the prior.
        self.evidence.load(agent.store, base)
        self.root = agent.config.state_dir / "xfer"
        # Root's alone: replicas, keepers' copies and outgoing snapshots are other users' jobs'
        # checkpoints (the state directory is 0711 so a job can reach its own ckpt/<job>; a
        # version before this one left this directory 0755 and its files 0644).
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        zone = agent.zone
        networked = bool(zone is not None and zone.networked)
        # zone.listen as the zone bound it (0.0.0.0 is the roster address when this host holds it,
        # IPv4 or IPv6, else 0.0.0.0 or ::: membership.bind_host, ZoneComponent.start)
        host = self.s["listen"] or (getattr(zone, "listen_host", zone.s["listen"]) if zone is not None and networked
                                    else "127.0.0.1")
        # A peer's connections leave from this address when it names one (this node's roster
        # address on a host with several), and the node id a peer's hello claims must be the
        # one whose roster address its connection comes from (zone.check_source, as the zone's
        # own messages: the key is the zone's, any member could claim any node id).
        self._xfer_local = None if host in ("", "0.0.0.0", "::") else str(host)
        check = networked and bool(getattr(zone, "s", {}).get("check_source", True))
        # who may hold the port before authenticating (laminar.zone.gate): the roster's addresses,
        # a share each, and with zone.check_source nobody else
        gate = Gate(lambda: zone.membership.roster_ips(), check_source=check) if networked and zone is not None else Gate()
        self.receiver = Receiver(self.root, self._key_lookup, on_commit=self._on_commit, on_progress=self._on_rx_progress,
                                 on_control=self.control.answer, sources=self._roster_ip if check else None,
                                 pair_keys=self._pair_candidates, gate=gate, may_offer=self.control.may_offer)
        metrics = agent.metrics
        if metrics is not None:
            with contextlib.suppress(ValueError):  # the counts are process-wide: registered once per registry
                metrics.register(StatsCollector())
        try:
            self.port = await self.receiver.start(host, int(self.s["port"]) if networked else 0)
        except OSError as e:
            from laminar.zone.membership import host_port

            raise RuntimeError(f"migrate: cannot listen on {host_port(str(host), int(self.s['port']))} for checkpoint transfers: "
                               f"{e.strerror or e}; set migrate.port to a free port") from None
        rebind: Any = getattr(zone, "rebind", None)
        if zone is not None and networked and not self.s["listen"] and hasattr(rebind, "on_rebind"):
            # the zone listens on :: while its roster address is not usable (tentative at boot),
            # then on the address: so do transfers, and they connect from it again
            rebind.on_rebind.append(self._follow_zone_listen)
            if zone.listen_host != host:
                await self._follow_zone_listen(zone.listen_host)
        # Nothing is being sent yet: every snapshot under outgoing/ is a crashed send's, and what
        # is in the replica trash was being removed when the agent stopped.
        await asyncio.to_thread(self._sweep_outgoing)
        await asyncio.to_thread(self.replicas.empty_trash)
        self._unsubscribe = agent.events.subscribe(self._on_event)
        self._loop_task = asyncio.get_running_loop().create_task(self._watch())
        self.ckpt = ckpt_driver.CkptDriver(self)
        self._spawn(self.ckpt.run())
        self.archive.stopped.restore_late_copies()  # before the reclaim's restore: by the job states the stop left
        self.evacuation.restore()
        self.mover.restore()
        self.mover.restore_holds()
        self.takeover.restore_replica_handovers()

    def _backfill_origins(self) -> None:
        """After an upgrade: the job manager records the migration key of the jobs this node's
        keepers resumed (a ``resumed`` row names its job; what it gave the job to resume from is
        the job's ``resume_from``) and of the live jobs a move or a keeper's placement handed here
        (placed through the zone, and resuming from a replica of a key a keeper here names, or
        its owner's copy of one: only ``check_resume`` gives such a path). Before, only their env
        said so, which this reads nothing of (laminar.runtime.provenance). Not recoverable: the
        key of a job handed here that ended already (its placement is forgotten), and a
        requeue's origin (nothing read it)."""
        jobs = self.agent.jobs
        if jobs is None or not hasattr(getattr(jobs, "table", None), "backfill_origin"):
            return
        db = self.agent.store.db
        for r in db.execute("SELECT key, job_id FROM migrate_replicas WHERE state='resumed' AND job_id IS NOT NULL"
                            ).fetchall():
            job = jobs.get(str(r["job_id"]))
            if job is not None and not getattr(job.origin, "migrated_from", None) and valid_key(str(r["key"])):
                rf = job.spec.resume_from if isinstance(job.spec.resume_from, str) else None
                jobs.table.backfill_origin(job.id, migrated_from=str(r["key"]), resume_given=rf)
        keys = {str(r[0]) for r in db.execute("SELECT key FROM migrate_replicas")}
        try:
            placed = {str(r[0]) for r in db.execute("SELECT job_id FROM zone_placed")}
        except sqlite3.OperationalError:  # no zone on this node
            placed = set()
        state = Path(self.agent.config.state_dir)
        for job in list(getattr(jobs, "jobs", {}).values()):
            rf = job.spec.resume_from
            if job.id not in placed or job.origin.migrated_from or not isinstance(rf, str):
                continue
            p = Path(os.path.normpath(rf))
            if p.parent.parent in (state / "xfer" / "checkpoints", state / RESUME_DIR) and p.parent.name in keys \
                    and valid_key(p.parent.name) and valid_ckpt_name(p.name):
                jobs.table.backfill_origin(job.id, migrated_from=p.parent.name, resume_given=str(p))

    async def _follow_zone_listen(self, host: str) -> None:
        """The zone listens on its roster address ``host`` now: transfers listen on it and
        leave from it (zone.check_source at the peers). When the port cannot be bound there
        (taken in the moment the old socket was closed), it is tried again every
        ``interval_s`` of the zone's ``rebind`` until it is, as long as the zone stays on ``host``: meanwhile the
        old address listens, or, when it could not be bound again either, nothing does."""
        if self.receiver is None or self.receiver.port is None:
            return
        try:
            await self._relisten_xfer(host)
        except OSError as e:
            log.warning("migrate: cannot listen for checkpoint transfers on %s yet (%s): tried again", host, e)
            self._spawn(self._relisten_xfer_until(host))

    async def _relisten_xfer(self, host: str) -> None:
        assert self.receiver is not None
        await self.receiver.relisten(host)
        self._xfer_local = host
        log.info("migrate: listening for checkpoint transfers on %s (the zone's roster address) now", host)

    async def _relisten_xfer_until(self, host: str) -> None:
        every = float(getattr(getattr(self.zone, "rebind", None), "interval_s", 0) or 2.0)
        while True:
            await asyncio.sleep(every)
            z = self.zone
            if self.receiver is None or (z is not None and getattr(z, "listen_host", host) != host):
                return  # stopped, or the zone moved on (its next rebind calls _follow_zone_listen again)
            try:
                await self._relisten_xfer(host)
                return
            except OSError as e:
                log.debug("migrate: checkpoint transfers on %s: %s", host, e)

    def _sweep_outgoing(self) -> list[Path]:
        """Removes every snapshot under ``<root>/outgoing/`` (called at start, before any send:
        each one is what a send cut off by a crash left) and returns what went. Links are removed
        as links (:func:`_remove_tree`); nothing outside ``outgoing/`` is touched."""
        assert self.root is not None
        gone = []
        try:
            entries = list((self.root / "outgoing").iterdir())
        except OSError:
            return []
        for e in entries:
            _remove_tree(e)
            gone.append(e)
            log.info("migrate: removed %s (a snapshot left by an interrupted send)", e)
        return gone

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        with contextlib.suppress(Exception):
            self.evidence.save()
        # their ends (cancelled, or an error) are theirs; a cancel of this stop (the agent's stop
        # deadline) is not swallowed with them; one a task lost is sent again (laminar.tasks)
        await cancel_until_done([t for t in (self._loop_task, *self._tasks) if t is not None])
        self.archive.lane.close()
        if self.receiver is not None:
            await self.receiver.stop()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _emit(self, message: str, **fields: Any) -> None:
        self.agent.events.emit("migrate", message, **fields)

    # -- zone helpers -------------------------------------------------------------------------

    @property
    def zone(self) -> Any:
        z = self._agent.zone if self._agent is not None else None
        return z if z is not None and z.networked else None

    def _key_lookup(self, zone: int) -> bytes | None:
        z = self._agent.zone if self._agent is not None else None
        return z.keys.get(zone) if z is not None else None

    @property
    def node_id(self) -> int:
        z = self._agent.zone if self._agent is not None else None
        return int(z.node_id) if z is not None else 0

    def _member(self, node: int) -> Any:
        z = self.zone
        if z is None or node not in z.membership.by_node:
            raise MigrateError(f"node {node} is not a member of this zone (see `laminarctl zone peers`)")
        return z.membership.by_node[node]

    def _peer(self, node: int) -> tuple[str, int, bytes, int]:
        """(address, port, key, zone) of a node's transfer endpoint. The key is the pair key of
        this node and ``node`` under the zone's current key when the zone signs datagrams to it
        with that (node keys: :meth:`laminar.zone.keys.PairKeys.signs`), else the zone key."""
        m = self._member(node)
        key = self._key_lookup(m.zone)
        if key is None:
            raise MigrateError(f"no key for zone {m.zone} of node {node}")
        pairs = getattr(self.zone, "pairs", None)
        return m.addr, int(self.s["port"]), key if pairs is None else pairs.signing_key(key, node), int(m.zone)

    def _pair_candidates(self, node: int, keys: tuple[bytes, ...]) -> tuple[bytes, ...]:
        """The keys a transfer or control connection naming ``node`` may authenticate under
        (the Receiver's ``pair_keys``): with node keys covering it, its pair keys under each of
        the zone's ``keys``, then (unless ``node_keys = require``) those keys too; else ``keys``."""
        pairs = getattr(self.zone, "pairs", None)
        return keys if pairs is None else pairs.accepted(keys, node)

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any:
        if op in ("keeper", "superseded") and isinstance(body, dict):
            # this node's wall clock as it sends: the keeper reads the instants in the request
            # (window_end, not_before) in its own clock, whatever the skew (Control.answer); the
            # source, a take-over's instant (``superseded``: Replicas.answer_superseded)
            body = {**body, "clock": time.time()}
        addr, port, key, zone = self._peer(node)
        return await send_control(addr, port, key, op, body, zone=zone, node=str(self.node_id), timeout=timeout,
                                  local_host=self._xfer_local)

    def _roster_ip(self, node: int) -> str | None:
        """The canonical IP of ``node``'s ``[[zone.nodes]]`` entry, where its transfer connections
        must come from (the Receiver's ``sources``); None for a node the roster does not list."""
        z = self.zone
        m = z.membership.by_node.get(node) if z is not None else None
        if m is None:
            return None
        try:
            return canonical_ip(str(m.addr))
        except ValueError:
            return None

    def _heard_over_tcp(self, node: str) -> None:
        z = self.zone
        if z is None:
            return
        with contextlib.suppress(Exception):  # (not a node id, not in the roster: nothing to note)
            wall = getattr(z, "wall", time.time)
            z.membership.seen(int(node), wall(), z.clock())

    def _last_seen(self, node: int) -> float:
        z = self.zone
        if z is None or node not in z.membership.state:
            return -1.0
        return float(z.membership.state[node].last_seen)

    # -- jobs ---------------------------------------------------------------------------------

    def job_key(self, job: Any) -> str:
        """The job's name across nodes (job ids are per node): ``n<node>-<job id>``."""
        return f"n{self.node_id}-{job.id}"

    def _need(self, job: Any) -> tuple[Any, dst.Resources]:
        """The demand a move of ``job`` places (its pool too, when the zone placed it with one:
        a lent training job asks for the training pool again, so a busy inference node refuses
        it and an idle one takes it on loan) and the resources a destination must have."""
        from laminar.policy.placement import Demand

        spec = job.spec
        gpus = len(job.gpus) if job.gpus else (spec.gpus if isinstance(spec.gpus, int) else len(spec.gpus))
        cpus = float(spec.cpus or 1.0)
        mem = int(spec.memory_mb or 256)
        pool = None
        arb = getattr(self.agent.zone, "arbiter", None)
        for p in getattr(arb, "placed", {}).values():
            if p.job_id == job.id:
                pool = p.reservation.demand.pool
                break
        return Demand(gpus=float(gpus), cpus=cpus, memory_mb=mem, pool=pool), dst.Resources(gpus, mem << 20, cpus)

    def _holds(self) -> Holds:
        """The job manager's holds (runtime/holds.py): a move's freeze is its ``move`` hold, the
        fence's its ``fence`` hold (fence.py)."""
        return holds_of(self.agent.jobs)

    # -- the watch loop: each part's round ----------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                self.evidence.tick(time.time())
                self.fence.tick(time.time())
                self.vouch.tick(time.time())
                self.prestage.tick(time.time())
                self.archive.tick(time.time())
                self.replicas.recheck_keepers(time.time())
                await self.takeover.tick(time.time())
                self.replicas.tick(time.time())
            except Exception:
                log.exception("migrate: watch round failed")
            try:
                await self.checkpoints.tick(time.time())
            except Exception:
                log.exception("migrate: reading GPU memory per process failed")
            await asyncio.sleep(float(self.s["poll_s"]))

    # -- the endpoint's and the events' callbacks ---------------------------------------------

    def _on_commit(self, c: Committed) -> None:
        self.replicas.operator.forget_scan()  # the replica view walks again (a commit changed the root)
        self.counts["received"] += 1
        self._emit(f"received {c.job_id}/{c.ckpt_id} from node {c.peer_node}, verified", key=c.job_id, ckpt=c.ckpt_id,
                   src_node=c.peer_node, path=str(c.path), phase="received")
        keeper = self.control.keeping_from(c.job_id)
        if str(c.peer_node) not in au.checkpoint_senders(c.job_id, keeper) or (
                keeper is None and str(c.peer_node) != str(au.key_owner(c.job_id))):
            # a copy from a node that does not keep the key here (a keeper passed on comes before
            # its keeper message): it replaces nothing, and a take-over reads only its keeper's copies
            return
        try:
            self.replicas.gc(c.job_id, newest=c.ckpt_id)  # the older replicas of the key go
        except Exception:  # the GC must never fail a commit (the sender was told it is delivered)
            log.exception("migrate: replica GC of %s", c.job_id)

    def _on_rx_progress(self, p: Progress) -> None:
        pass

    def _on_event(self, e: dict[str, Any]) -> None:
        """Records the zone's reclaim notices of other nodes (zone events with deadline_ms)."""
        if e.get("kind") == "zone" and "deadline_ms" in e and "node" in e:
            now = time.time()
            node = int(e["node"])
            fresh = node not in self.notices or self.notices[node][1] < now - 3600
            self.notices[node] = (now + int(e["deadline_ms"]) / 1000, now)
            if fresh:  # a repeated notice of the same reclaim is one departure
                self.evidence.observe_departure(now, announced=True)

    def check_resume(self, path: str, owner_uid: int = 0, owner_gid: int | None = None) -> str:
        """What the zone's hand-over calls before a job of ``owner_uid`` starts with
        ``resume_from``; the path the job is given. A path under this node's transfer root must
        be a committed, still-valid checkpoint (verified_checkpoint), any other must pass jobkit's
        own check. A replica (``<root>/checkpoints/<key>/ckpt-<n>``) whose keeper named its job's
        owner is only for a job of that owner (or root's), and that owner gets its own copy of it
        (:meth:`ResumeCopies.copy`: ``xfer/`` is root's alone). A job of a user other than root is
        refused any other path under the transfer root: a replica no keeper here named the owner of
        (every source keeps before it hands over; a hand-over without one would start the job
        with a ``LAMINAR_RESUME_FROM`` it cannot read, and a copy made on the hand-over's word
        would give whoever places a job naming a replica another user's checkpoint). Any other
        path of a non-root job is verified with the owner's own permissions (uid, ``owner_gid``,
        else the uid's passwd group, else 65534, and the uid's groups: :func:`verify_as_owner`),
        never as root: a checkpoint the owner cannot read is refused saying so, alike whether it
        is valid, corrupt or absent (as root, the refusal told a user whether a valid checkpoint
        lay where they cannot look). Raises ValueError."""
        p = Path(os.path.normpath(path))
        under_root = self.root is not None and self.root in p.parents
        replica = self.root is not None and p.parent.parent == self.root / "checkpoints"
        recorded = self.replicas.resumes.owners.get(p.parent.name) if replica else None
        if recorded is not None and owner_uid not in (0, recorded[0]):
            raise ValueError(f"checkpoint {path} is a replica of a job of uid {recorded[0]}: a job of uid "
                             f"{owner_uid} cannot resume from it")
        if under_root and recorded is None and owner_uid != 0:
            what = f"no keeper of {p.parent.name} held here named its job's owner" if replica else \
                "it is not a replica a keeper named"
            raise ValueError(f"checkpoint {path} lies in node {self.node_id}'s transfer directory, which only root "
                             f"may read, and {what}: a job of uid {owner_uid} is not given it")
        if not under_root and owner_uid != 0:
            if owner_gid is None:
                try:
                    owner_gid = pwd.getpwuid(owner_uid).pw_gid
                except KeyError:
                    owner_gid = 65534  # nogroup: no group's permission is assumed
            verify_as_owner(str(p), owner_uid, owner_gid)
            return str(p)
        if not under_root:  # storage that may hang (NFS, FUSE): checked in a child, bounded (root's texts)
            verify_as_owner(str(p), 0, 0)
            return str(p)
        try:
            verified_checkpoint(p)
        except (TransferError, jobkit.CheckpointError) as e:
            raise ValueError(f"checkpoint {path} is not restorable: {e}") from None
        if recorded is not None:  # a replica, and the keeper said whose: the job must be able to read it
            try:
                p = self.replicas.resumes.copy(p, *recorded)
            except OSError as e:
                raise ValueError(f"checkpoint {path}: cannot give the job's owner (uid {recorded[0]}) its copy: "
                                 f"{e}") from None
        return str(p)

    # -- status and API -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        r = self.reclaim
        return {"port": self.port, "counts": dict(self.counts), "keepers": {k: v for k, v in self.prestage.keeper.items()},
                "buddies": {k: v for k, v in self.prestage.keeper.items()},  # old spelling of keepers, one release
                "releases_pending": [{"node": n, "key": k} for n, k in sorted(self.prestage.releases)],
                "reclaim": None if r is None else {"deadline": r["deadline"], "done": r["task"].done()},
                "notices": sorted(self.notices),
                # jobs frozen while this node heard none of its zone (fence.py): job id -> since (wall clock)
                "fenced": dict(self.fence.fenced_jobs),
                # silent peers another member heard lately (vouch.py): not taken for gone
                "heard_elsewhere": sorted(self.vouch.held_back),
                # member -> how many take-over verdicts its word held back (a member holding many: vouch.py)
                "heard_vouchers": {str(n): k for n, k in sorted(self.vouch.vouchers.items())},
                "periodic_ckpt": None if self.ckpt is None else dict(self.ckpt.counts),
                # jobs' checkpoint directories: checks (failed, unfinished) and their lane; freezes
                # and thaws that did not take hold in time (a task in uninterruptible sleep)
                "ckpt": None if self.ckpt is None else {**self.ckpt.stats(), **cgroup_freeze_counts()},
                # what the hazard learned here (departures announced or not, node-hours watched)
                "evidence": self.evidence.status(),
                "archive": self.archive.status(),
                # transfer connections refused: not from the roster address of the node they named
                "transfer_wrong_source": 0 if self.receiver is None else self.receiver.wrong_source,
                # transfer connections refused or cut by reason (off_roster, source_busy, slow, ...)
                "transfer_gate": {} if self.receiver is None else self.receiver.stats()}

    def _sees_all(self, peer: Any) -> bool:
        """Whether ``peer`` sees every replica's job and owner: root or the control group."""
        if peer.uid == 0:
            return True
        auth = getattr(self.agent.api, "auth", None)
        return bool(auth is not None and auth.allowed(peer))

    def routes(self) -> list[Any]:
        from laminar.api import ApiError, Request, Route
        from laminar.inputs import brief

        async def post_reclaim(req: Request) -> dict[str, Any]:
            b = req.body if isinstance(req.body, dict) else {}
            if "notice_s" not in b:
                raise ApiError(400, "reclaim: body must be {\"notice_s\": seconds (or \"60s\"), \"node\"?: id, \"reason\"?}")
            node = b.get("node")
            if node is not None and (isinstance(node, bool) or not isinstance(node, int) or not 0 < node < 1 << 32):
                raise ApiError(400, f"reclaim: node {brief(node)}: expected a node id (see `laminarctl zone peers`)")
            reason = b.get("reason")
            if reason is not None and (not isinstance(reason, str) or len(reason) > 200):
                raise ApiError(400, f"reclaim: reason {brief(reason)}: expected text of at most 200 characters")
            try:
                return await self.evacuation.announce(b["notice_s"], node, reason or f"announced by uid {req.peer.uid}")
            except ValueError as e:
                raise ApiError(400, f"reclaim: {e}") from None
            except MigrateError as e:
                raise ApiError(409 if "not a member" not in str(e) else 404, str(e)) from None

        async def cancel_reclaim(req: Request) -> dict[str, Any]:
            b = {} if req.body is None else req.body
            if not isinstance(b, dict) or set(b) - {"node", "reason"}:
                raise ApiError(400, f"reclaim cancel: body {brief(b)}: expected {{\"node\"?: id, \"reason\"?: text}}")
            node = b.get("node")
            if node is not None and (isinstance(node, bool) or not isinstance(node, int) or not 0 < node < 1 << 32):
                raise ApiError(400, f"reclaim cancel: node {brief(node)}: expected a node id (see `laminarctl zone peers`)")
            reason = b.get("reason")
            if reason is not None and (not isinstance(reason, str) or len(reason) > 200):
                raise ApiError(400, f"reclaim cancel: reason {brief(reason)}: expected text of at most 200 characters")
            try:
                return await self.evacuation.cancel(node, reason or f"cancelled by uid {req.peer.uid}")
            except LookupError as e:
                raise ApiError(404, f"reclaim cancel: {e.args[0]}") from None
            except MigrateError as e:
                raise ApiError(404 if "not a member" in str(e) else 409, f"reclaim cancel: {e}") from None

        async def get_reclaim(req: Request) -> dict[str, Any]:
            return self.evacuation.status()

        async def migrations(req: Request) -> list[dict[str, Any]]:
            return [self.settle.move_view(m) for m in self.moves.values()]

        async def handovers(req: Request) -> list[dict[str, Any]]:
            return self.settle.pending_handovers()

        async def settle(req: Request) -> dict[str, Any]:
            b = req.body
            if not isinstance(b, dict) or set(b) - {"decision"} or b.get("decision") not in ("run-here", "gone"):
                raise ApiError(400, f"settle: body {brief(b)}: expected {{\"decision\": \"run-here\" | \"gone\"}}")
            try:
                return await self.settle.settle_handover(req.params["job"], b["decision"],
                                                         by=f"uid {req.peer.uid}")
            except LookupError as e:
                raise ApiError(409, f"settle: {e.args[0]}") from None

        async def migration(req: Request) -> dict[str, Any]:
            jid = req.params["job"]
            mv = self.moves.get(jid)
            if mv is None and jid.isdigit():
                mv = self.moves.get(f"job-{jid}")
            if mv is None:
                raise ApiError(404, f"no move of job {jid!r} on this node")
            return self.settle.move_view(mv)

        async def replicas(req: Request) -> Any:
            totals = req.query.get("totals", "0")
            if totals not in ("0", "1", "false", "true"):
                raise ApiError(400, f"replicas: totals={totals!r}: expected 1 or 0")
            if self.root is None:
                view: dict[str, Any] = {"now": time.time(), "replicas": [], "totals": {}}
            else:
                api = self.agent.api  # the caller's worker-thread slot while it scans
                with api.work_slot(req.peer) if api is not None else contextlib.nullcontext():
                    scan = await self.replicas.operator.scan()
                view = self.replicas.operator.view(scan)
            rows = view["replicas"] if self._sees_all(req.peer) else \
                [r if r.get("owner_uid") == req.peer.uid else redact_replica(r) for r in view["replicas"]]
            if totals in ("1", "true"):
                return {"now": view["now"], "replicas": rows, "totals": view["totals"]}
            return rows

        async def drop_replica(req: Request) -> dict[str, Any]:
            b = {} if req.body is None else req.body
            if not isinstance(b, dict) or set(b) - {"force"} or not isinstance(b.get("force", False), bool):
                raise ApiError(400, f"replicas drop: body {brief(b)}: expected {{\"force\"?: true|false}}")
            try:
                return await self.replicas.operator.drop_and_tell(req.params["key"], force=bool(b.get("force", False)),
                                                        by=f"uid {req.peer.uid}")
            except ValueError as e:
                raise ApiError(400, f"replicas drop: {e}") from None
            except LookupError as e:
                raise ApiError(404, f"replicas drop: {e.args[0]}") from None
            except MigrateError as e:
                raise ApiError(409, f"replicas drop: {e}") from None

        async def checkpoints(req: Request) -> dict[str, Any]:
            d = self.ckpt
            hz = self.evidence.hazards["default"]
            now = time.time()
            return {"periodic": bool(self.s["periodic"]), "uplink_mbit": None if d is None else d.link_bps * 8 / 1e6,
                    "hazard_per_h": hz.rate_per_h(now), "mtbf_s": hz.mtbf_s(now), "now": now,
                    "counts": None if d is None else dict(d.counts), "jobs": [] if d is None else d.view()}

        return [
            Route("GET", "/v1/checkpoints", checkpoints),
            Route("POST", "/v1/reclaim", post_reclaim, privileged=True),
            Route("POST", "/v1/reclaim/cancel", cancel_reclaim, privileged=True),
            Route("GET", "/v1/reclaim", get_reclaim),
            Route("GET", "/v1/migrations", migrations),
            Route("GET", "/v1/migrations/{job}", migration),
            Route("POST", "/v1/migrations/{job}/settle", settle, privileged=True),
            Route("GET", "/v1/migrate/handovers", handovers),
            Route("GET", "/v1/migrate/replicas", replicas),
            Route("POST", "/v1/migrate/replicas/{key}/drop", drop_replica, privileged=True),
        ]
