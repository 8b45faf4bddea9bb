"""Multi-node jobs on the agent (:class:`MembersComponent`, the agent's ``members``).

A multi-node job (``workers`` > 1) has one id, ``job-<num>-n<origin>``, and one member per node:
a local job of that node's agent with the job's id. The node it was submitted on, its *origin*,
places the gang (``placer``: laminar.zone.gangplace), keeps the job's record and decides what
happens when a member ends (:func:`laminar.policy.members.on_member_end`). Every node that hosts
a member keeps the job's record too (:class:`laminar.members.table.MemberTable`, the only writer
of the store's two tables), re-read at start.

Two sides, one component (a node may be both, for one job):

- *member side*: :meth:`MembersComponent.start_member` (from the zone's hand-over: the member
  block the origin put beside the spec) starts the local job with the launch argv and env
  (laminar.members.launch); each tick compares the local job with the member's stored state
  and REPORTs a change to the origin, retried every tick until the origin answers; ORDERs from
  the record's origin (stop, freeze, thaw, checkpoint, killswitch_on/off, relaunch) are acted
  on; an order of an older generation is ignored.
- *origin side*: :meth:`submit` records the job and places it; a REPORT (only from the node
  the record names for that index, only of the current generation) is stored and decided: a
  restart stops the live members and relaunches every member with the next generation (a lost
  member's node re-placed with k=1), an elastic job goes on resizing, or the job ends and its
  members are stopped. A member's node that the zone's liveness declares dead makes that member
  ``lost``. :meth:`stop` and :meth:`killswitch` order every member.

Messages are the zone's MEMBER_REQUEST / MEMBER_ANSWER (op 1 report, 2 order, 3 view), sent like
the loan layer's: retransmitted with the same id, answers cached by (sender, id). Everything
a message says was stored before it is sent, and a report or order repeated (after a restart of
either side) changes nothing the second time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from laminar.policy import members as pm
from laminar.policy.endcause import EndCause
from laminar.policy.members import Action, MemberState, MultiState
from laminar.runtime.spec import JobError, JobSpec, is_multinode_id
from laminar.zone import wire

from .table import MemberRow, MemberTable, MultiRecord, TableFull

if TYPE_CHECKING:
    from laminar.components import MembersAgent

log = logging.getLogger("laminar.members")

OP_REPORT = 1
OP_ORDER = 2
OP_VIEW = 3
STATUS_OK = 0
STATUS_ERROR = 1
ORDERS = ("stop", "freeze", "thaw", "checkpoint", "killswitch_on", "killswitch_off", "relaunch")
ANSWER_CACHE = 512  # answers kept for retransmitted requests, by (sender, request id)
PAYLOAD_MAX = wire.MAX_DATAGRAM - wire.HEADER_SIZE - wire.MAC_SIZE - 9  # a member message's JSON, at most
REPORTS_IN_FLIGHT = 16  # reports awaiting the origin at once (the rest wait for the next tick)
RESIZE_SETTLE_S = 10.0  # an elastic job resizing whose live members all run this long is running again
PATH_MAX = 512  # a checkpoint path in a report or an order, at most
STOP_WAIT_S = 60.0  # a relaunch waits this long, at most, for the member's earlier job to be gone
VIEW_EVERY_S = 10.0  # the origin sends each member's node the job's view this often (unanswered: a miss)
CKPT_LOOK_S = 10.0  # member 0's node looks for a newer verified checkpoint of its job this often
CKPT_VERIFY_S = 5.0  # one look's verification, at most (off the loop; the newest two are tried)


def config_fields() -> dict[str, Any]:
    """The ``[members]`` config section."""
    from laminar.config import Field, _range

    return {
        "max_jobs": Field(int, 256, "multi-node jobs this node keeps a record of (as origin or member); the oldest "
                          "ended go first", _range(1, 100_000)),
        "ckpt_root": Field(str, "", "storage every member of a job reaches (a shared filesystem): a member's "
                           "LAMINAR_CKPT_DIR is <ckpt_root>/<job id>, the same path on every node (empty: the "
                           "job's own checkpoint directory on each node)"),
        "max_restarts": Field(int, pm.MAX_RESTARTS, "restarts of a whole multi-node job before it ends failed",
                              _range(0, 100)),
        "tick_s": Field((int, float), 1.0, "how often local members are looked at and unanswered reports resent",
                        _range(0.05, 60)),
        "request_timeout_s": Field((int, float), 3.0, "how long a report or order waits for its answer (three sends)",
                                   _range(0.05, 60)),
    }


def _register() -> None:
    from laminar.config import register_section

    register_section("members", config_fields())


_register()


class MemberError(ValueError):
    """A member message refused: the answer's error."""


def endpoint_port(job: str, generation: int) -> int:
    """The rendezvous port member 0's node serves for ``job``'s ``generation``
    (laminar.members.launch's)."""
    from laminar.members import launch

    return launch.endpoint_port(job, generation)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MemberError(f"{what} {str(v)[:40]!r}: expected an integer {lo}..{hi}")
    return v


def _job_id(v: Any) -> str:
    if not isinstance(v, str) or not is_multinode_id(v):
        raise MemberError(f"job {str(v)[:40]!r}: expected a multi-node job id (job-<num>-n<node>)")
    return v


def check_block(block: Any) -> dict[str, Any]:
    """A member block (design: index, count, nodes, endpoint, ...) checked for its types and
    bounds (at most WORKERS_MAX members); the dict. MemberError otherwise."""
    if hasattr(block, "as_dict"):
        block = block.as_dict()
    if not isinstance(block, dict):
        raise MemberError("member block: expected an object")
    b = dict(block)
    _job_id(b.get("job"))
    _int(b.get("origin"), "member block: origin", 1, 2**32 - 1)
    count = _int(b.get("count"), "member block: count", 1, pm.WORKERS_MAX)
    _int(b.get("index"), "member block: index", 0, count - 1)
    lo = _int(b.get("min", count), "member block: min", 1, count)
    _int(b.get("max", count), "member block: max", lo, pm.WORKERS_MAX)
    _int(b.get("generation", 0), "member block: generation", 0, 2**31)
    nodes = b.get("nodes")
    if not isinstance(nodes, list) or len(nodes) != count:
        raise MemberError(f"member block: nodes: expected {count} [node, address] pairs")
    seen = set()
    for n in nodes:
        if not (isinstance(n, list | tuple) and len(n) == 2 and isinstance(n[1], str) and len(n[1]) <= 64):
            raise MemberError("member block: nodes: expected [node, address] pairs")
        seen.add(_int(n[0], "member block: node", 1, 2**32 - 1))
    if len(seen) != count:
        raise MemberError("member block: nodes: one member per node")
    if not isinstance(b.get("endpoint", ""), str) or len(b.get("endpoint", "")) > 80:
        raise MemberError("member block: endpoint: expected host:port")
    b.setdefault("min", count)
    b.setdefault("max", count)
    b.setdefault("generation", 0)
    return b


def _port_taken(addr: str, endpoint: str) -> str | None:
    """Why member 0's rendezvous endpoint (``host:port``) cannot be served here (a process of
    this node holds the port), or None: bound for a moment on ``addr``, the node's own address.
    An address this node does not hold (a test's) or an endpoint that is not one: None."""
    import errno
    import socket

    _, _, port = endpoint.rpartition(":")
    if not port.isdigit() or not addr:
        return None
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sk:
        try:
            sk.bind((addr, int(port)))
        except OSError as e:
            return os.strerror(e.errno or 0) if e.errno == errno.EADDRINUSE else None
    return None


@dataclass(frozen=True)
class Member:
    """A member of a multi-node job hosted here, as the job manager, Airlock and netguard read it
    (laminar.components.MemberInfo)."""

    job: str
    index: int
    count: int
    origin: int
    rigid: bool


LaunchPlan = Callable[[dict[str, Any], JobSpec], tuple[list[str], dict[str, str]]]


def default_launch(block: dict[str, Any], spec: JobSpec) -> tuple[list[str], dict[str, str]]:
    """The member's argv and env (laminar.members.launch): its block checked in full, the
    interface that holds its own address read here. LaunchError (a ValueError) when refused."""
    from laminar.members import launch

    b = launch.MemberBlock.from_dict(block)
    plan = launch.launch(b, spec.command, launch.interface_of(b.own_addr))
    return list(plan.argv), dict(plan.env)


class MembersComponent:
    """The agent's ``members`` (see the module's doc)."""

    agent_attr = "members"
    status_key = "members"

    def __init__(self, launch_plan: LaunchPlan | None = None, clock: Callable[[], float] = time.time) -> None:
        self.agent: MembersAgent | None = None
        self.s: dict[str, Any] = {k: f.default for k, f in config_fields().items()}
        self.table = MemberTable(None)
        self.placer: Any = None  # laminar.zone.gangplace.GangPlacer, built at start from the zone
        self.launch_plan: LaunchPlan = launch_plan or default_launch
        self.clock = clock
        self.node = 0
        # request id -> (the node asked, its answer's future): an answer counts only from the node asked
        self._pending: dict[int, tuple[int, asyncio.Future[tuple[int, bytes]]]] = {}
        self._answered: OrderedDict[tuple[int, int], wire.MemberAnswer] = OrderedDict()
        self._unreported: set[str] = set()  # jobs whose member here has a state the origin has not acknowledged
        self._reporting: set[str] = set()
        self._acting: set[str] = set()  # origin: jobs whose restart or end is under way
        self._relaunching: set[str] = set()  # member: jobs whose relaunch here is under way
        self._started_gen: dict[str, int] = {}  # member: the generation this node last started of a job
        self._ckpt_looked: dict[str, float] = {}  # member 0: job -> when its shared directory was last looked at
        self._ckpt_looking: set[str] = set()
        self._suspended: dict[str, set[int]] = {}  # origin: job -> members whose node's Airlock suspended them
        self._airlock_killed: dict[str, int] = {}  # member: job -> the generation Airlock killed here
        self._viewed: dict[str, float] = {}  # origin: job -> when its members' nodes were last sent its view
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[Any] | None = None
        self.counts: dict[str, int] = {"reports_sent": 0, "reports_taken": 0, "orders_sent": 0, "orders_taken": 0,
                                       "refused": 0, "restarts": 0, "lost": 0}
        # a request's sender: the node id itself when it speaks over the zone, this node's in process
        self.send: Callable[[int, wire.MemberRequest], None] | None = None

    # -- life cycle ----------------------------------------------------------------------------------

    async def start(self, agent: MembersAgent | None) -> None:
        self.agent = agent
        if agent is not None:
            self.s.update(agent.config.section("members") or {})
            zone = agent.zone
            self.node = zone.node_id if zone is not None else 1
            self.table = MemberTable(agent.store, int(self.s["max_jobs"]))
            if zone is not None and self.placer is None:
                self.placer = self._make_placer(zone)
        self.table.max_jobs = int(self.s["max_jobs"])
        for rec in self.table.load():
            idx = rec.index_of(self.node)
            if idx is not None and rec.state is not MultiState.ENDED and rec.origin != self.node:
                self._unreported.add(rec.job)  # told again: the origin ignores a repeat
            if rec.origin == self.node and rec.state is MultiState.RESTARTING:
                self._spawn(self._relaunch(rec))  # the restart in flight when the agent stopped goes on
            elif rec.origin == self.node and rec.state is MultiState.PLACING:
                # the placement died with the agent: its members, if any started, are stopped
                self._spawn(self._end(rec, "failed: the origin's agent restarted while placing the job"))
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    @staticmethod
    def _make_placer(zone: Any) -> Any:
        """The gang placer over the zone's own transport, membership and summaries, with the
        zone's placement settings (``[zone]``); the zone's late offers reach it too."""
        try:
            from laminar.zone import gangplace
        except ImportError:  # pragma: no cover - an installation without the gang placement
            return None
        s = zone.s
        placer = gangplace.GangPlacer(
            zone.submitter.t, zone.membership, zone.summaries.zone_fits, rng=zone.rng, lease_s=float(s["lease_s"]),
            hold_s=float(s["hold_s"]), probe_timeout_s=float(s["probe_timeout_s"]),
            handover_timeout_s=float(s["handover_timeout_s"]), max_rounds=int(s["queue_rounds"]), clock=zone.clock,
            unconfirmed_wait_s=float(s["unconfirmed_wait_s"]), zone_summary=zone.summaries.zone_summary)
        single = zone.router.on_late_offer

        def late(node: int, offer: Any) -> None:
            if single is not None:
                single(node, offer)
            placer.note_late_offer(node, offer)
        zone.router.on_late_offer = late
        return placer

    def _addr_of(self, node: Any) -> tuple[int, str]:
        """A placed member's (node, address): the placer names nodes (ids, or (id, address)
        pairs); the address is the zone membership's."""
        if isinstance(node, list | tuple):
            return int(node[0]), str(node[1])
        zone = self.agent.zone if self.agent is not None else None
        m = zone.membership.by_node.get(int(node)) if zone is not None else None
        return int(node), (m.addr if m is not None else "")

    async def _shutdown(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._loop_task = None

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("members: a task failed: %s", task.exception(), exc_info=task.exception())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(float(self.s["tick_s"]))
            try:
                self.tick(self.clock())
            except Exception:
                log.exception("members: tick failed")

    def _emit(self, message: str, **fields: Any) -> None:
        log.info("%s", message)
        if self.agent is not None:
            self.agent.events.emit("members", message, **fields)

    # -- the tick --------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Member side: each local member's job compared with its stored state (a change is
        stored and reported), unanswered reports resent. Origin side: members on nodes the
        zone's liveness declares dead are lost; a job resizing settles."""
        for rec in list(self.table.jobs.values()):
            idx = rec.index_of(self.node)
            if idx is not None and rec.state is not MultiState.ENDED and rec.job not in self._relaunching:
                self._look_at_local(rec, idx)  # (a relaunch's stop is not the member's end)
                if idx == 0:
                    self._look_for_ckpt(rec, now)
            if rec.origin == self.node and rec.state not in (MultiState.ENDED, MultiState.PLACING):
                self._look_at_nodes(rec, now)
        for job in sorted(self._unreported - self._reporting):
            if len(self._reporting) >= REPORTS_IN_FLIGHT:
                break
            self._reporting.add(job)
            self._spawn(self._report(job))

    def _local_state(self, rec: MultiRecord) -> tuple[MemberState, int | None] | None:
        """The state of this node's member of ``rec`` as its local job shows it; None while the
        job manager has no word (no job manager)."""
        jobs = self.agent.jobs if self.agent is not None else None
        if jobs is None:
            return None
        job = jobs.get(rec.job)
        if job is None:
            return MemberState.FAILED, None
        if job.state in ("queued", "starting"):
            return MemberState.STARTING, None
        if job.live:
            return MemberState.RUNNING, None
        if job.state == "exited" and job.exit_code == 0:
            return MemberState.EXITED, 0
        if job.state == "stopped":
            return MemberState.STOPPED, job.exit_code
        return MemberState.FAILED, job.exit_code

    def _look_at_local(self, rec: MultiRecord, idx: int) -> None:
        got = self._local_state(rec)
        if got is None:
            return
        state, code = got
        if self.table.set_member(rec, idx, state, code):
            if rec.origin == self.node:  # the origin's own member: one record, decided here
                self._decide(rec, idx, state)
            else:
                self._unreported.add(rec.job)

    def _ckpt_dir(self, job: str) -> str | None:
        root = str(self.s["ckpt_root"] or "")
        return f"{root.rstrip('/')}/{job}" if root else None

    def _look_for_ckpt(self, rec: MultiRecord, now: float) -> None:
        """Member 0's node: every CKPT_LOOK_S, the newest verified checkpoint in the job's shared
        directory (rank 0 commits there), off the loop and bounded; a newer one than the record's
        is stored and reported to the origin (which relaunches from it)."""
        d = self._ckpt_dir(rec.job)
        if d is None or rec.job in self._ckpt_looking or now - self._ckpt_looked.get(rec.job, -1e18) < CKPT_LOOK_S:
            return
        self._ckpt_looked[rec.job] = now
        self._ckpt_looking.add(rec.job)
        self._spawn(self._find_ckpt(rec, d))

    async def _find_ckpt(self, rec: MultiRecord, d: str) -> None:
        from laminar import jobkit

        try:
            limits = jobkit.Limits(deadline=time.monotonic() + CKPT_VERIFY_S, refuse_sparse=True)
            path = await asyncio.to_thread(jobkit.latest_checkpoint, d, tries=2, limits=limits)
            if path is not None and str(path) != rec.last_ckpt and len(str(path)) <= PATH_MAX:
                self.table.set_job(rec, last_ckpt=str(path), last_ckpt_at=time.time())
                if rec.origin != self.node:
                    self._unreported.add(rec.job)
        finally:
            self._ckpt_looking.discard(rec.job)

    def _look_at_nodes(self, rec: MultiRecord, now: float) -> None:
        zone = self.agent.zone if self.agent is not None else None
        if zone is None or rec.job in self._acting:
            return
        for m in rec.members:
            if m.state in pm.LIVE and m.node != self.node and not zone.membership.alive(m.node, zone.clock()):
                self.counts["lost"] += 1
                self._emit(f"job {rec.job}: member {m.index}'s node {m.node} is dead (zone liveness): lost",
                           job=rec.job, member=m.index, node=m.node)
                self.table.set_member(rec, m.index, MemberState.LOST)
                self._decide(rec, m.index, MemberState.LOST)
                if rec.job in self._acting:
                    return
        if now - self._viewed.get(rec.job, -1e18) >= VIEW_EVERY_S:
            # the job's view to each member's node: it carries the last verified checkpoint, and
            # an unanswered one counts as a miss (zone liveness), so a node that left without
            # notice is found dead though nothing else is sent to it
            self._viewed[rec.job] = now
            for m in rec.members:
                if m.state in pm.LIVE and m.node != self.node:
                    self._spawn(self._send_view(rec, m.node))
        if (rec.state is MultiState.RESIZING and now - rec.updated >= RESIZE_SETTLE_S
                and all(m.state is MemberState.RUNNING for m in rec.members if m.state in pm.LIVE)):
            self.table.move(rec, pm.Event.ALL_RUNNING)

    async def _send_view(self, rec: MultiRecord, node: int) -> None:
        payload: dict[str, Any] = {"job": rec.job, "generation": rec.generation}
        if rec.last_ckpt:
            payload["last_ckpt"] = rec.last_ckpt
        try:
            await self.request(node, OP_VIEW, payload)
        except MemberError as e:
            log.info("members: job %s: the view to node %d: %s", rec.job, node, e)

    # -- messages ------------------------------------------------------------------------------------

    def on_message(self, sender: int, body: wire.MemberRequest | wire.MemberAnswer) -> wire.MemberAnswer | None:
        """A MEMBER_REQUEST from ``sender``: the answer (cached by request id, so a repeat is
        not acted on twice). A MEMBER_ANSWER: delivered to the waiting request; None."""
        if isinstance(body, wire.MemberAnswer):
            got = self._pending.get(body.request_id)
            if got is not None and got[0] == sender and not got[1].done():
                got[1].set_result((body.status, body.payload))
            return None
        key = (sender, body.request_id)
        ans = self._answered.get(key)
        if ans is not None:
            return ans
        try:
            if len(body.payload) > PAYLOAD_MAX:
                raise MemberError(f"a member message of {len(body.payload)} bytes: at most {PAYLOAD_MAX}")
            req = json.loads(body.payload or b"{}")
            if not isinstance(req, dict):
                raise MemberError("a member message is a JSON object")
            if body.op == OP_REPORT:
                out = self._on_report(sender, req)
            elif body.op == OP_ORDER:
                out = self._on_order(sender, req)
            elif body.op == OP_VIEW:
                out = self._on_view(sender, req)
            else:
                raise MemberError(f"unknown member operation {body.op} (1 report, 2 order, 3 view)")
            ans = wire.MemberAnswer(body.request_id, STATUS_OK, _dumps(out))
        except (MemberError, ValueError, TypeError, KeyError) as e:
            self.counts["refused"] += 1
            ans = wire.MemberAnswer(body.request_id, STATUS_ERROR, _dumps({"error": str(e)[:400]}))
        self._answered[key] = ans
        while len(self._answered) > ANSWER_CACHE:
            self._answered.popitem(last=False)
        return ans

    async def request(self, node: int, op: int, payload: dict[str, Any]) -> dict[str, Any]:
        """Sends a member request to ``node`` (this node: handled in process) and waits for the
        answer, retransmitting (same id) within ``request_timeout_s``. Raises MemberError when
        the node does not answer or answers with an error."""
        rid = wire.new_id()
        data = _dumps(payload)
        if len(data) > PAYLOAD_MAX:
            raise MemberError(f"a member message of {len(data)} bytes: at most {PAYLOAD_MAX}")
        body = wire.MemberRequest(rid, op, data)
        zone = self.agent.zone if self.agent is not None else None
        send = self.send
        if send is None and zone is not None and zone.endpoint is not None and node != self.node:
            endpoint = zone.endpoint

            def send(n: int, b: wire.MemberRequest) -> None:
                endpoint.send(n, b)
        if node == self.node or send is None:
            ans = self.on_message(self.node, body)
            assert ans is not None
            status, raw = ans.status, ans.payload
        else:
            fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
            self._pending[rid] = (node, fut)
            timeout = float(self.s["request_timeout_s"])
            try:
                for _ in range(3):
                    send(node, body)
                    try:
                        status, raw = await asyncio.wait_for(asyncio.shield(fut), timeout / 3)
                        break
                    except TimeoutError:
                        continue
                else:
                    if zone is not None:
                        zone.membership.missed(node, zone.clock())
                    raise MemberError(f"node {node} did not answer within {timeout:g} s")
            finally:
                self._pending.pop(rid, None)
        out = json.loads(raw or b"{}")
        if status != STATUS_OK:
            raise MemberError(f"node {node}: {out.get('error', 'error') if isinstance(out, dict) else out}")
        return out if isinstance(out, dict) else {}

    # -- the origin's side of messages -------------------------------------------------------------------

    def _on_report(self, sender: int, req: dict[str, Any]) -> dict[str, Any]:
        job = _job_id(req.get("job"))
        rec = self.table.get(job)
        if rec is None or rec.origin != self.node:
            raise MemberError(f"job {job}: unknown here (this node is not its origin)")
        index = _int(req.get("index"), "index", 0, rec.workers - 1)
        if rec.members[index].node != sender:
            raise MemberError(f"job {job}: member {index} is node {rec.members[index].node}'s, not node {sender}'s")
        gen = _int(req.get("generation"), "generation", 0, 2**31)
        if gen < rec.generation:
            return {"ignored": f"generation {gen} is over (the job is at {rec.generation})", "state": str(rec.state)}
        if gen > rec.generation:
            raise MemberError(f"job {job}: generation {gen} is not the job's ({rec.generation})")
        state = MemberState(str(req.get("state")))
        code = req.get("code")
        code = None if code is None else _int(code, "code", -(2**31), 2**31)
        ckpt = req.get("ckpt")
        if ckpt is not None and index == 0:
            if not isinstance(ckpt, str) or not ckpt.startswith("/") or len(ckpt) > PATH_MAX:
                raise MemberError(f"ckpt {str(ckpt)[:40]!r}: expected an absolute path")
            mine = self._ckpt_dir(job)
            if mine is None or not ckpt.startswith(mine + "/"):
                raise MemberError(f"ckpt {ckpt[:80]!r}: not under the job's shared directory (members.ckpt_root)")
            if ckpt != rec.last_ckpt:
                self.table.set_job(rec, last_ckpt=ckpt, last_ckpt_at=time.time())
        self.counts["reports_taken"] += 1
        airlock = req.get("airlock")
        if airlock is not None and airlock not in ("suspend", "recover", "kill"):
            raise MemberError(f"airlock {str(airlock)[:20]!r}: expected suspend, recover or kill")
        lost = req.get("work_lost_s")
        work_lost = float(lost) if isinstance(lost, int | float) and not isinstance(lost, bool) and 0 <= lost < 1e9 else None
        if airlock == "kill":
            state = MemberState.FAILED
        changed = rec.state is not MultiState.ENDED and self.table.set_member(rec, index, state, code)
        if airlock is not None:
            self._on_airlock(rec, index, str(airlock), work_lost)
        elif changed:
            self._decide(rec, index, state)
        return {"state": str(rec.state), "generation": rec.generation, "end_reason": rec.end_reason}

    def _recheck(self, rec: MultiRecord) -> None:
        """The members' states as they stand, decided again (reports that came while the gang
        was being placed were stored, not decided)."""
        for m in rec.members:
            if m.state in pm.ENDED:
                self._decide(rec, m.index, m.state)
                return
        if rec.members:
            self._decide(rec, 0, rec.members[0].state)

    def _decide(self, rec: MultiRecord, index: int, state: MemberState, airlock_kill: bool = False) -> None:
        """Member ``index`` of ``rec`` is in ``state`` now (stored): what the job does."""
        if rec.state in (MultiState.ENDED, MultiState.RESTARTING, MultiState.PLACING) or rec.job in self._acting:
            return  # (the ends a restart, a stop or an unplaced gang make are its own)
        if state in pm.LIVE:
            if all(m.state is MemberState.RUNNING for m in rec.members if m.state in pm.LIVE) \
                    and rec.state is MultiState.STARTING:
                self.table.move(rec, pm.Event.ALL_RUNNING)
            return
        d = pm.on_member_end(rec.policy_view(int(self.s["max_restarts"])), index, state, airlock_kill)
        self._emit(f"job {rec.job}: member {index} {state.value}: {d.action.value} ({d.reason})", job=rec.job,
                   member=index, state=str(state), action=str(d.action), reason=d.reason)
        if d.action is Action.CONTINUE:
            if d.shrink:
                self.table.move(rec, pm.Event.SHRINK)
        elif d.action is Action.RESTART:
            self.counts["restarts"] += 1
            self._acting.add(rec.job)
            # the next generation is stored before any order goes: a restart after a crash
            # relaunches this same generation (_relaunch at start)
            gen = rec.generation + 1
            self.table.set_job(rec, generation=gen, restarts=rec.restarts + 1,
                               endpoint=self._endpoint(rec, gen))
            self.table.move(rec, pm.Event.RESTART, d.reason)
            self._spawn(self._restart(rec))
        else:
            self._acting.add(rec.job)
            self._spawn(self._end(rec, d.reason))

    def _endpoint(self, rec: MultiRecord, gen: int) -> str:
        host = rec.members[0].addr if rec.members else ""
        return f"{host}:{endpoint_port(rec.job, gen)}"

    async def _order_all(self, rec: MultiRecord, do: str, only_live: bool = True, skip: int | None = None,
                         **extra: Any) -> dict[int, str]:
        """ORDER ``do`` to every member (only the live ones by default; not member ``skip``);
        what each answered (its error, when one)."""
        targets = [m for m in rec.members if (not only_live or m.state in pm.LIVE) and m.index != skip]

        async def one(m: MemberRow) -> tuple[int, str]:
            try:
                self.counts["orders_sent"] += 1
                got = await self.request(m.node, OP_ORDER, {"job": rec.job, "generation": rec.generation, "do": do,
                                                            **extra})
                return m.index, str(got.get("done", "ok"))
            except MemberError as e:
                return m.index, f"error: {e}"
        return dict(await asyncio.gather(*(one(m) for m in targets)))

    async def _end(self, rec: MultiRecord, reason: str) -> None:
        self._acting.add(rec.job)
        try:
            self.table.move(rec, pm.Event.END, reason)
            self._emit(f"job {rec.job} ended: {reason}", job=rec.job, reason=reason)
            await self._order_all(rec, "stop")
        finally:
            self._acting.discard(rec.job)

    async def _restart(self, rec: MultiRecord) -> None:
        try:
            await self._order_all(rec, "stop")
            await self._relaunch(rec)
        finally:
            self._acting.discard(rec.job)

    async def _relaunch(self, rec: MultiRecord) -> None:
        """Every member relaunched with the job's (stored) generation: ORDER relaunch to the ones
        on live nodes, a lost member's node re-placed through the placer (k=1). Idempotent: a
        member already at that generation answers without acting."""
        self._acting.add(rec.job)
        try:
            zone = self.agent.zone if self.agent is not None else None
            moved: list[list[Any]] = []  # [index, node, address] of the members re-placed
            for m in rec.members:
                gone = m.state is MemberState.LOST or (
                    zone is not None and m.node != self.node and not zone.membership.alive(m.node, zone.clock()))
                if gone:
                    if await self._replace(rec, m.index):
                        moved.append([m.index, rec.members[m.index].node, rec.members[m.index].addr])
                    else:
                        await self._end(rec, f"failed: member {m.index}'s node {m.node} is gone and no node took "
                                        "its place")
                        return
            rec.endpoint = self._endpoint(rec, rec.generation)
            self.table.set_job(rec, endpoint=rec.endpoint)
            for m in rec.members:
                self.table.set_member(rec, m.index, MemberState.STARTING, None)
            # the members know the job's nodes: only those re-placed are named (a datagram holds
            # a few, not 64)
            answers = await self._order_all(rec, "relaunch", only_live=False, resume_from=rec.last_ckpt,
                                            endpoint=rec.endpoint, moved=moved)
            failed = {i: a for i, a in answers.items() if a.startswith("error")}
            if failed:
                await self._end(rec, f"failed: relaunch refused by member(s) {sorted(failed)}: "
                                f"{next(iter(failed.values()))}")
                return
            self.table.move(rec, pm.Event.RELAUNCHED)
            self._emit(f"job {rec.job} relaunched, generation {rec.generation}", job=rec.job, generation=rec.generation,
                       resume_from=rec.last_ckpt)
        finally:
            self._acting.discard(rec.job)

    async def _replace(self, rec: MultiRecord, index: int) -> bool:
        """A lost member's node re-placed (k=1) through the placer: the member's row names the
        new node. False when there is no placer or it placed nothing."""
        if self.placer is None:
            return False
        spec = JobSpec.from_dict(rec.spec)

        def build(nodes: list[Any]) -> list[bytes]:
            # a node that hosts another member of the job refuses the hand-over (start_member):
            # the placer goes on without it
            node, addr = self._addr_of(nodes[0])
            self.table.set_member(rec, index, MemberState.STARTING, None, node=int(node), addr=str(addr))
            rec.endpoint = self._endpoint(rec, rec.generation)
            return [self._handover_json(rec, spec, index)]

        try:
            res = await self.placer.place(self._demand(spec), 1, build, undo=self._undo(rec))
        except (MemberError, JobError, ValueError) as e:
            log.warning("members: job %s: member %d not re-placed: %s", rec.job, index, e)
            return False
        return getattr(res, "outcome", "") == "placed"

    # -- the member's side of messages -------------------------------------------------------------

    def _on_order(self, sender: int, req: dict[str, Any]) -> dict[str, Any]:
        job = _job_id(req.get("job"))
        rec = self.table.get(job)
        if rec is None:
            raise MemberError(f"job {job}: unknown here")
        if sender != rec.origin:
            raise MemberError(f"job {job}: only its origin, node {rec.origin}, gives it orders (not node {sender})")
        gen = _int(req.get("generation"), "generation", 0, 2**31)
        if gen < rec.generation:
            return {"done": "ignored", "why": f"generation {gen} is over (this member is at {rec.generation})"}
        do = req.get("do")
        if do not in ORDERS:
            raise MemberError(f"order {str(do)[:40]!r}: expected one of {', '.join(ORDERS)}")
        idx = rec.index_of(self.node)
        if idx is None:
            raise MemberError(f"job {job}: no member of it on node {self.node}")
        self.counts["orders_taken"] += 1
        jobs = self.agent.jobs if self.agent is not None else None
        local = jobs.get(job) if jobs is not None else None
        if do == "relaunch":
            return self._order_relaunch(rec, idx, gen, req)
        if local is None or not local.live:
            return {"done": "not running"}
        if do == "stop":
            assert jobs is not None
            self._spawn(jobs.stop(job, f"stopped by its origin, node {rec.origin}", cause=EndCause.STOPPED_BY_ORIGIN))
            return {"done": "stopping"}
        assert jobs is not None
        if do == "freeze":  # the job's ``members`` hold, which this node's Airlock never releases
            return {"done": "frozen" if jobs.freeze_member(job) else "not frozen"}
        if do == "thaw":
            return {"done": "thawed" if jobs.thaw_member(job) else "still held"}
        if do == "checkpoint":  # every process of the member's cgroup that catches the signal
            return {"done": "signalled", "processes": len(jobs.signal_catchers(local, local.spec.checkpoint_signal))}
        netguard = self.agent.netguard if self.agent is not None else None
        if netguard is None:
            raise MemberError(f"node {self.node} runs no netguard: no kill-switch")
        return {"done": do if netguard.set_job_switch(job, do == "killswitch_on") else "not registered"}

    def _order_relaunch(self, rec: MultiRecord, idx: int, gen: int, req: dict[str, Any]) -> dict[str, Any]:
        nodes = [[m.node, m.addr] for m in rec.members]
        moved = req.get("moved") or []
        if not isinstance(moved, list) or len(moved) > rec.workers:
            raise MemberError("moved: expected [index, node, address] triples")
        for mv in moved:
            if not (isinstance(mv, list) and len(mv) == 3):
                raise MemberError("moved: expected [index, node, address] triples")
            nodes[_int(mv[0], "moved: index", 0, rec.workers - 1)] = [mv[1], mv[2]]
        endpoint = req.get("endpoint")
        resume = req.get("resume_from")
        if resume is not None and (not isinstance(resume, str) or not resume.startswith("/") or len(resume) > PATH_MAX):
            raise MemberError("resume_from: expected an absolute path")
        if resume is not None:
            # the origin names a checkpoint of this job only: under <ckpt_root>/<job id>, the
            # directory every member shares; anywhere else (or with no ckpt_root) it is refused
            import os.path

            root = str(self.s["ckpt_root"] or "")
            mine = os.path.normpath(f"{root.rstrip('/')}/{rec.job}") if root else ""
            if not mine or not os.path.normpath(resume).startswith(mine + "/"):
                raise MemberError(f"resume_from {resume[:80]!r}: not a checkpoint of {rec.job} under members.ckpt_root")
        block = check_block({"job": rec.job, "origin": rec.origin, "index": idx, "count": rec.workers,
                             "min": rec.workers_min, "max": rec.workers_max, "nodes": nodes, "endpoint": endpoint,
                             "launcher": self._launcher(rec), "generation": gen})
        if [int(n) for n, _ in block["nodes"]][idx] != self.node:
            raise MemberError(f"job {rec.job}: the relaunch names node {block['nodes'][idx][0]} for member {idx}")
        if rec.job in self._relaunching:
            return {"done": "relaunching"}
        for i, (n, a) in enumerate(block["nodes"]):  # the job's nodes as they are now, stored
            self.table.set_member(rec, i, rec.members[i].state, rec.members[i].code, node=int(n), addr=str(a))
        self._relaunching.add(rec.job)
        self._spawn(self._relaunch_here(rec, block, resume))
        return {"done": "relaunching"}

    async def _relaunch_here(self, rec: MultiRecord, block: dict[str, Any], resume: str | None) -> None:
        """The member here stopped (if it still runs) and started with the block's generation;
        nothing when that generation was started here already (a repeated relaunch)."""
        try:
            jobs = self.agent.jobs if self.agent is not None else None
            if jobs is None:
                raise JobError("this node runs no job manager")
            gen = int(block["generation"])
            # the generation last started here: on a member node its record's, on the origin
            # (whose record moved to the next generation first) what this process started
            started = self._started_gen.get(rec.job, rec.generation if rec.origin != self.node else -1)
            local = jobs.get(rec.job)
            if local is not None and local.live and started >= gen:
                return
            if local is not None and local.live:
                try:
                    await jobs.stop(rec.job, f"relaunched by its origin (generation {gen})",
                                    cause=EndCause.STOPPED_BY_ORIGIN)
                except JobError:
                    pass
            # an earlier stop (the origin's ORDER stop) may still be in its grace: the job
            # manager lets the id go once the job is gone
            deadline = time.monotonic() + STOP_WAIT_S
            while rec.job in jobs.jobs and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            spec = JobSpec.from_dict({**rec.spec, "resume_from": resume})
            await self.start_member(block, spec, rec.owner_uid, rec.owner_gid)
        except (JobError, MemberError) as e:
            self._emit(f"job {rec.job}: relaunch failed here: {e}", job=rec.job)
            self._unreported.add(rec.job)
        finally:
            self._relaunching.discard(rec.job)

    def _on_view(self, sender: int, req: dict[str, Any]) -> dict[str, Any]:
        job = _job_id(req.get("job"))
        rec = self.table.get(job)
        if rec is None:
            raise MemberError(f"job {job}: unknown here")
        if sender != rec.origin:
            raise MemberError(f"job {job}: only its origin, node {rec.origin}, sends its view (not node {sender})")
        ckpt = req.get("last_ckpt")
        mine = self._ckpt_dir(job)
        if (isinstance(ckpt, str) and len(ckpt) <= PATH_MAX and mine is not None and ckpt.startswith(mine + "/")
                and ckpt != rec.last_ckpt):
            self.table.set_job(rec, last_ckpt=ckpt, last_ckpt_at=time.time())
        return {"job": job, "generation": rec.generation}

    # -- the member side: starting a member -----------------------------------------------------------

    async def start_member(self, block: Any, spec: JobSpec, owner_uid: int, owner_gid: int) -> str:
        """Starts this node's member of a multi-node job (from the zone's hand-over, which
        checked that the sender is the block's origin and that this node is ``nodes[index]``;
        checked again here): records the job, starts the local job (id = the job's) with the
        launch argv and env. Returns the job id; JobError when it cannot start."""
        try:
            b = check_block(block)
        except MemberError as e:
            raise JobError(str(e)) from None
        idx = int(b["index"])
        if int(b["nodes"][idx][0]) != self.node:
            raise JobError(f"member block: member {idx} is node {b['nodes'][idx][0]}'s, not this node's ({self.node})")
        jobs = self.agent.jobs if self.agent is not None else None
        if jobs is None:
            raise JobError("this node runs no job manager")
        job_id = str(b["job"])
        old = self.table.get(job_id)
        local = jobs.get(job_id)
        if local is not None and local.live:
            raise JobError(f"job {job_id}: a member of it runs on this node already (one member per node)")
        if old is not None and old.generation > int(b["generation"]):
            raise JobError(f"job {job_id}: generation {b['generation']} is over (this node knows {old.generation})")
        if idx == 0:
            taken = _port_taken(str(b["nodes"][0][1]), str(b.get("endpoint", "")))
            if taken:
                raise JobError(f"job {job_id}: the rendezvous endpoint {b['endpoint']} is taken on this node ({taken}); "
                               "the origin tries another port or node")
        try:
            argv, env = self.launch_plan(b, spec)
        except ValueError as e:  # (launch.LaunchError)
            raise JobError(f"member {idx} of {job_id}: {e}") from None
        root = str(self.s["ckpt_root"] or "")
        if root:
            env["LAMINAR_CKPT_DIR"] = f"{root.rstrip('/')}/{job_id}"
        # the member's own job is a one-node job (the members are this component's)
        run = JobSpec.from_dict({**spec.as_dict(), "command": argv, "workers": None, "workers_min": None,
                                 "workers_max": None, "launcher": None})
        rec = MultiRecord(job=job_id, origin=int(b["origin"]), spec=spec.as_dict(), owner_uid=owner_uid,
                          owner_gid=owner_gid, state=MultiState.STARTING if old is None else old.state,
                          workers_min=int(b["min"]), workers_max=int(b["max"]),
                          members=[MemberRow(i, int(n), str(a)) for i, (n, a) in enumerate(b["nodes"])],
                          generation=int(b["generation"]), endpoint=str(b.get("endpoint", "")),
                          last_ckpt=spec.resume_from if old is None else old.last_ckpt,
                          restarts=0 if old is None else old.restarts, created=0.0 if old is None else old.created)
        if old is not None and old.origin == self.node:
            # this node is the job's origin too: its record (the job's state, the other members
            # as reported) stays; only this member's row starts again
            rec = old
            self.table.set_member(rec, idx, MemberState.STARTING, None)
        else:
            try:
                self.table.add(rec)
            except TableFull as e:
                raise JobError(str(e)) from None
        job = await jobs.submit(run, owner_uid, owner_gid, job_id=job_id, relaunch=old is not None, agent_env=env)
        self._started_gen[job_id] = int(b["generation"])
        self._emit(f"member {idx} of job {job_id} started (generation {b['generation']}, origin node {b['origin']})",
                   job=job_id, member=idx, generation=int(b["generation"]), origin=int(b["origin"]))
        return job.id

    async def _report(self, job: str) -> None:
        try:
            rec = self.table.get(job)
            idx = rec.index_of(self.node) if rec is not None else None
            if rec is None or idx is None:
                self._unreported.discard(job)
                return
            m = rec.members[idx]
            told = (m.state, m.code, rec.last_ckpt, rec.generation)
            payload: dict[str, Any] = {"job": job, "index": idx, "generation": rec.generation, "state": str(m.state)}
            if m.code is not None:
                payload["code"] = m.code
            if idx == 0 and rec.last_ckpt:
                payload["ckpt"] = rec.last_ckpt
            self.counts["reports_sent"] += 1
            try:
                got = await self.request(rec.origin, OP_REPORT, payload)
            except MemberError as e:
                if "did not answer" in str(e):
                    return  # retried on the next tick
                log.warning("members: the report of job %s was refused by its origin: %s", job, e)
                got = {}
            if (m.state, m.code, rec.last_ckpt, rec.generation) == told:  # (else: told again next tick)
                self._unreported.discard(job)
            said = got.get("state")
            if rec.origin != self.node and said in set(MultiState) and got.get("generation") == rec.generation:
                self.table.follow(rec, MultiState(said), str(got.get("end_reason") or "ended at its origin"))
        finally:
            self._reporting.discard(job)

    # -- the origin side: the public API ---------------------------------------------------------------

    def _demand(self, spec: JobSpec) -> Any:
        from laminar.policy import placement as pl

        gpus = spec.gpus if isinstance(spec.gpus, int) else len(spec.gpus)
        return pl.Demand(gpus=float(gpus), cpus=float(spec.cpus or 1.0), memory_mb=int(spec.memory_mb or 256))

    @staticmethod
    def _launcher(rec: MultiRecord) -> str:
        from laminar.members import launch

        return str(rec.spec.get("launcher") or launch.launcher_for(rec.spec.get("command") or []))

    def _handover_json(self, rec: MultiRecord, spec: JobSpec, index: int) -> bytes:
        block = {"job": rec.job, "origin": rec.origin, "index": index, "count": rec.workers, "min": rec.workers_min,
                 "max": rec.workers_max, "nodes": [[m.node, m.addr] for m in rec.members], "endpoint": rec.endpoint,
                 "launcher": self._launcher(rec), "generation": rec.generation}
        spec_d = {**spec.as_dict(), "member": block}
        return _dumps({"spec": spec_d, "owner_uid": rec.owner_uid, "owner_gid": rec.owner_gid})

    def _undo(self, rec: MultiRecord) -> Callable[..., Awaitable[None]]:
        """What the placer calls when a gang's hand-over failed after some members started: they
        are stopped (ORDER stop), so that no partial gang runs."""
        async def undo(*_: Any) -> None:
            await self._order_all(rec, "stop")
        return undo

    async def submit(self, spec: JobSpec, owner_uid: int, owner_gid: int, *, spread_zones: bool = False) -> dict[str, Any]:
        """Submits a multi-node job (``spec.workers`` members, elastic bounds when given) from this
        node, its origin: records it, places the gang through the zone and answers its view.
        JobError when refused (bad bounds, no room for the record, no zone)."""
        workers, lo, hi = spec.workers, spec.workers_min, spec.workers_max
        if not isinstance(workers, int) or isinstance(workers, bool) or not 2 <= workers <= pm.WORKERS_MAX:
            raise JobError(f"workers {workers!r}: a multi-node job has 2..{pm.WORKERS_MAX} workers")
        lo, hi = (workers, workers) if lo is None and hi is None else (lo, hi)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= workers <= hi <= pm.WORKERS_MAX):
            raise JobError(f"workers {workers} with bounds {lo}:{hi}: expected 1 <= min <= workers <= max <= "
                           f"{pm.WORKERS_MAX}")
        spec.validate()
        if self.placer is None:
            raise JobError("this node places no multi-node job: it has no zone (or no gang placement)")
        jobs = self.agent.jobs if self.agent is not None else None
        if jobs is None:
            raise JobError("this node runs no job manager")
        job_id = jobs.reserve_multinode_id(self.node)
        spec_d = spec.as_dict()
        rec = MultiRecord(job=job_id, origin=self.node, spec=spec_d, owner_uid=owner_uid, owner_gid=owner_gid,
                          state=MultiState.PLACING, workers_min=lo, workers_max=hi,
                          members=[MemberRow(i, 0, "") for i in range(workers)])
        try:
            self.table.add(rec)
        except TableFull as e:
            raise JobError(str(e)) from None
        self._acting.add(job_id)

        def build(nodes: list[Any]) -> list[bytes]:
            if len(nodes) != workers:
                raise MemberError(f"the placement gave {len(nodes)} nodes for {workers} members")
            for i, (node, addr) in enumerate(map(self._addr_of, nodes)):
                self.table.set_member(rec, i, MemberState.STARTING, None, node=int(node), addr=str(addr))
            self.table.set_job(rec, endpoint=self._endpoint(rec, rec.generation))
            return [self._handover_json(rec, spec, i) for i in range(workers)]

        try:
            res = await self.placer.place(self._demand(spec), workers, build, undo=self._undo(rec),
                                          **({"spread_zones": True} if spread_zones else {}))
        except BaseException as e:
            await self._end(rec, f"not placed: {e}")
            raise
        finally:
            self._acting.discard(job_id)
        as_dict = getattr(res, "as_dict", None)
        rec.extra["placement"] = as_dict() if callable(as_dict) else {}
        if getattr(res, "outcome", "") == "placed":
            self.table.move(rec, pm.Event.PLACED)
            self._emit(f"job {job_id} placed on nodes {[m.node for m in rec.members]}", job=job_id,
                       nodes=[m.node for m in rec.members], by_uid=owner_uid)
            self._recheck(rec)
        else:
            await self._end(rec, f"not placed: {getattr(res, 'reason', '') or getattr(res, 'outcome', '?')}")
        return self._view(rec)

    def _owned(self, job_id: str, by_uid: int | None) -> MultiRecord:
        """The record of ``job_id``, which this node originates; ``by_uid`` (None: the caller
        authorized already) must be its owner or root."""
        rec = self.table.get(job_id)
        if rec is None:
            raise JobError(f"no multi-node job {job_id!r} here")
        if rec.origin != self.node:
            raise JobError(f"job {job_id}: its origin is node {rec.origin}; ask there")
        if by_uid is not None and by_uid not in (0, rec.owner_uid):
            raise JobError(f"job {job_id} is uid {rec.owner_uid}'s: only its owner or root may do that")
        return rec

    async def stop(self, job_id: str | None = None, by_uid: int = 0) -> dict[str, Any]:
        """Stops every member of ``job_id`` (this node its origin); the job's view. The caller
        authorized ``by_uid`` (the API route: the owner, root or the control group, as for a
        one-node job). With no ``job_id`` this is the component's stop (the agent's): its
        rounds end, the members run on (as JobManager.stop); answers {}."""
        if job_id is None:
            await self._shutdown()
            return {}
        rec = self._owned(job_id, None)
        if rec.state is not MultiState.ENDED:
            await self._end(rec, f"stopped by uid {by_uid}")
        else:
            await self._order_all(rec, "stop")
        return self._view(rec)

    async def killswitch(self, job_id: str, on: bool, by_uid: int) -> dict[str, Any]:
        """Cuts (``on``) or restores every member's traffic on its node."""
        rec = self._owned(job_id, by_uid)
        answers = await self._order_all(rec, "killswitch_on" if on else "killswitch_off")
        return {**self._view(rec), "killswitch": {str(i): a for i, a in sorted(answers.items())}}

    # -- what Airlock, netguard and the job manager ask ----------------------------------------------

    def member_of(self, job_id: str) -> Member | None:
        """The member of a multi-node job that the local job ``job_id`` is, or None (a job of this
        node alone, or one whose record is gone or ended). O(members)."""
        rec = self.table.get(job_id)
        if rec is None or rec.state is MultiState.ENDED:
            return None
        idx = rec.index_of(self.node)
        if idx is None:
            return None
        return Member(rec.job, idx, rec.workers, rec.origin, rec.workers_min == rec.workers_max)

    def on_airlock(self, job_id: str, action: str, work_lost_s: float | None) -> None:
        """Airlock acted on the local member ``job_id`` (``suspend``, ``recover``, ``kill``): its
        origin is told in a REPORT (``airlock``), from a task (never blocks, never raises); the
        origin freezes or thaws the other members, or decides the kill (policy.members)."""
        rec = self.table.get(job_id)
        idx = rec.index_of(self.node) if rec is not None else None
        if rec is None or idx is None or action not in ("suspend", "recover", "kill"):
            return
        if action == "kill":
            self._airlock_killed[job_id] = rec.generation
            self.table.set_member(rec, idx, MemberState.FAILED, None)
        payload: dict[str, Any] = {"job": job_id, "index": idx, "generation": rec.generation,
                                   "state": str(rec.members[idx].state), "airlock": action}
        if work_lost_s is not None:
            payload["work_lost_s"] = round(float(work_lost_s), 1)
        self._spawn(self._tell_origin(rec, payload))

    async def _tell_origin(self, rec: MultiRecord, payload: dict[str, Any]) -> None:
        try:
            await self.request(rec.origin, OP_REPORT, payload)
        except MemberError as e:
            log.warning("members: job %s: telling its origin of %s failed: %s", rec.job, payload.get("airlock"), e)
            self._unreported.add(rec.job)  # (the member's state, at least, is reported again)

    def _on_airlock(self, rec: MultiRecord, index: int, action: str, work_lost: float | None) -> None:
        """The origin: member ``index``'s node's Airlock suspended, recovered or killed it."""
        suspended = self._suspended.setdefault(rec.job, set())
        self._emit(f"job {rec.job}: member {index}'s node {action}ed it (Airlock)"
                   + (f", {work_lost:g} s of work lost" if work_lost is not None else ""),
                   job=rec.job, member=index, airlock=action, work_lost_s=work_lost)
        if action == "suspend":
            suspended.add(index)
            self._spawn(self._order_others(rec, index, "freeze"))
        elif action == "recover":
            suspended.discard(index)
            if not suspended:
                self._spawn(self._order_others(rec, index, "thaw"))
        else:  # kill: decided as the member's end (its state, failed, came with it)
            suspended.discard(index)
            if work_lost is not None:
                rec.extra["work_lost_s"] = rec.extra.get("work_lost_s", 0.0) + work_lost
            if rec.state is not MultiState.ENDED and rec.job not in self._acting:
                self._decide(rec, index, MemberState.FAILED, airlock_kill=True)
            if not suspended:
                self._spawn(self._order_others(rec, index, "thaw"))

    async def _order_others(self, rec: MultiRecord, but: int, do: str) -> None:
        for i, answer in (await self._order_all(rec, do, skip=but)).items():
            if answer.startswith("error"):
                log.warning("members: job %s: %s of member %d: %s", rec.job, do, i, answer)

    # -- views ---------------------------------------------------------------------------------------

    def _view(self, rec: MultiRecord) -> dict[str, Any]:
        return {"id": rec.job, "state": str(rec.state), "end_reason": rec.end_reason, "origin": rec.origin,
                "workers": rec.workers, "workers_min": rec.workers_min, "workers_max": rec.workers_max,
                "launcher": self._launcher(rec), "generation": rec.generation, "restarts": rec.restarts,
                "last_ckpt": rec.last_ckpt, "last_ckpt_at": rec.last_ckpt_at, "owner_uid": rec.owner_uid,
                "members": [m.view() for m in rec.members], "placement": rec.extra.get("placement", {})}

    def views(self) -> list[dict[str, Any]]:
        """Every multi-node job this node originates or hosts a member of, oldest first."""
        return [self._view(r) for r in sorted(self.table.jobs.values(), key=lambda r: (r.created, r.job))]

    def view(self, job_id: str) -> dict[str, Any] | None:
        rec = self.table.get(job_id)
        return None if rec is None else self._view(rec)

    def status(self) -> dict[str, Any]:
        live = [r for r in self.table.jobs.values() if r.state is not MultiState.ENDED]
        return {"jobs": len(self.table.jobs), "live": len(live),
                "origin": sum(1 for r in live if r.origin == self.node),
                "unreported": len(self._unreported), **self.counts}
