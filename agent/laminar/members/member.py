"""The member side of multi-node jobs (:class:`MemberSide`, a part of
:class:`laminar.members.component.MembersComponent`: its ``member``).

:meth:`MemberSide.start_member` (the component's ``start_member``, from the zone's hand-over: the
member block the origin put beside the spec) starts the local job with the launch argv and env
(laminar.members.launch); each tick (:meth:`MemberSide.tick`) compares the local job with the
member's stored state and REPORTs a change to the origin, retried every tick until the origin
answers; member 0's node looks for a newer verified checkpoint in the job's shared directory
(``ckpt_root``) and reports it. ORDERs from the record's origin (:meth:`MemberSide.on_order`:
stop, freeze, thaw, checkpoint, killswitch_on/off, relaunch) are acted on on this node; an order
of an older generation is ignored. The origin's view of the job (:meth:`MemberSide.on_view`)
brings the last verified checkpoint. What Airlock did to the local member
(:meth:`MemberSide.on_airlock`, the component's ``on_airlock``) is told to the origin.

:class:`MemberSide` is built with the component (what it uses of it: :class:`MemberHost`) and
holds the member side's state: the jobs whose member's state the origin has not acknowledged
(:attr:`MemberSide.unreported`), the relaunches under way, the generation last started here, the
checkpoint looks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from laminar.policy import members as pm
from laminar.policy.endcause import EndCause
from laminar.policy.members import MemberState, MultiState
from laminar.runtime.spec import JobError, JobSpec

from .messages import OP_REPORT, PATH_MAX, MemberError, _int, _job_id
from .table import MemberRow, MemberTable, MultiRecord, TableFull

if TYPE_CHECKING:
    from laminar.components import MembersAgent

    from .messages import Messages
    from .origin import OriginSide

log = logging.getLogger("laminar.members")

ORDERS = ("stop", "freeze", "thaw", "checkpoint", "killswitch_on", "killswitch_off", "relaunch")
REPORTS_IN_FLIGHT = 16  # reports awaiting the origin at once (the rest wait for the next tick)
STOP_WAIT_S = 60.0  # a relaunch waits this long, at most, for the member's earlier job to be gone
CKPT_LOOK_S = 10.0  # member 0's node looks for a newer verified checkpoint of its job this often
CKPT_VERIFY_S = 5.0  # one look's verification, at most (off the loop; the newest two are tried)


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


class MemberHost(Protocol):
    """What :class:`MemberSide` uses of the component that holds it (MembersComponent and its parts)."""

    agent: MembersAgent | None
    counts: dict[str, int]
    launch_plan: Callable[[dict[str, Any], JobSpec], tuple[list[str], dict[str, str]]]
    messages: Messages
    node: int
    origin: OriginSide
    s: dict[str, Any]
    table: MemberTable

    def _emit(self, message: str, **fields: Any) -> None: ...
    @staticmethod
    def _launcher(rec: MultiRecord) -> str: ...
    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...


class MemberSide:
    """This node's members of multi-node jobs (see the module's doc): a part of
    :class:`laminar.members.component.MembersComponent` (its ``member``). ``host``: the component."""

    def __init__(self, host: MemberHost) -> None:
        self.host = host
        self.unreported: set[str] = set()  # jobs whose member here has a state the origin has not acknowledged
        self._reporting: set[str] = set()
        self._relaunching: set[str] = set()  # member: jobs whose relaunch here is under way
        # member: jobs whose record is stored and whose local job is being submitted (the submit
        # checks paths as the owner, off the loop): no local job yet is not a failed member
        self._launching: set[str] = set()
        self._started_gen: dict[str, int] = {}  # member: the generation this node last started of a job
        self._ckpt_looked: dict[str, float] = {}  # member 0: job -> when its shared directory was last looked at
        self._ckpt_looking: set[str] = set()
        self._airlock_killed: dict[str, int] = {}  # member: job -> the generation Airlock killed here

    def tick(self, now: float) -> None:
        """Each local member's job compared with its stored state (a change is stored and
        reported; the origin's own member is decided there), member 0's node's look for a newer
        checkpoint, unanswered reports resent."""
        for rec in list(self.host.table.jobs.values()):
            idx = rec.index_of(self.host.node)
            if idx is not None and rec.state is not MultiState.ENDED and rec.job not in self._relaunching \
                    and rec.job not in self._launching:
                self._look_at_local(rec, idx)  # (a relaunch's stop is not the member's end)
                if idx == 0:
                    self._look_for_ckpt(rec, now)
        for job in sorted(self.unreported - self._reporting):
            if len(self._reporting) >= REPORTS_IN_FLIGHT:
                break
            self._reporting.add(job)
            self.host._spawn(self._report(job))

    def _local_state(self, rec: MultiRecord) -> tuple[MemberState, int | None] | None:
        """The state of this node's member of ``rec`` as its local job shows it; None while the
        job manager has no word (no job manager)."""
        jobs = self.host.agent.jobs if self.host.agent is not None else None
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
        if self.host.table.set_member(rec, idx, state, code):
            if rec.origin == self.host.node:  # the origin's own member: one record, decided here
                self.host.origin.decide(rec, idx, state)
            else:
                self.unreported.add(rec.job)

    def ckpt_dir(self, job: str) -> str | None:
        root = str(self.host.s["ckpt_root"] or "")
        return f"{root.rstrip('/')}/{job}" if root else None

    def _look_for_ckpt(self, rec: MultiRecord, now: float) -> None:
        """Member 0's node: every CKPT_LOOK_S, the newest verified checkpoint in the job's shared
        directory (rank 0 commits there), off the loop and bounded; a newer one than the record's
        is stored and reported to the origin (which relaunches from it)."""
        d = self.ckpt_dir(rec.job)
        if d is None or rec.job in self._ckpt_looking or now - self._ckpt_looked.get(rec.job, -1e18) < CKPT_LOOK_S:
            return
        self._ckpt_looked[rec.job] = now
        self._ckpt_looking.add(rec.job)
        self.host._spawn(self._find_ckpt(rec, d))

    async def _find_ckpt(self, rec: MultiRecord, d: str) -> None:
        from laminar import jobkit

        try:
            limits = jobkit.Limits(deadline=time.monotonic() + CKPT_VERIFY_S, refuse_sparse=True)
            path = await asyncio.to_thread(jobkit.latest_checkpoint, d, tries=2, limits=limits)
            if path is not None and str(path) != rec.last_ckpt and len(str(path)) <= PATH_MAX:
                self.host.table.set_job(rec, last_ckpt=str(path), last_ckpt_at=time.time())
                if rec.origin != self.host.node:
                    self.unreported.add(rec.job)
        finally:
            self._ckpt_looking.discard(rec.job)

    def on_order(self, sender: int, req: dict[str, Any]) -> dict[str, Any]:
        job = _job_id(req.get("job"))
        rec = self.host.table.get(job)
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
        idx = rec.index_of(self.host.node)
        if idx is None:
            raise MemberError(f"job {job}: no member of it on node {self.host.node}")
        self.host.counts["orders_taken"] += 1
        jobs = self.host.agent.jobs if self.host.agent is not None else None
        local = jobs.get(job) if jobs is not None else None
        if do == "relaunch":
            return self._order_relaunch(rec, idx, gen, req)
        if local is None or not local.live:
            return {"done": "not running"}
        if do == "stop":
            assert jobs is not None
            self.host._spawn(jobs.stop(job, f"stopped by its origin, node {rec.origin}", cause=EndCause.STOPPED_BY_ORIGIN))
            return {"done": "stopping"}
        assert jobs is not None
        if do == "freeze":  # the job's ``members`` hold, which this node's Airlock never releases
            return {"done": "frozen" if jobs.freeze_member(job) else "not frozen"}
        if do == "thaw":
            return {"done": "thawed" if jobs.thaw_member(job) else "still held"}
        if do == "checkpoint":  # every process of the member's cgroup that catches the signal
            return {"done": "signalled", "processes": len(jobs.signal_catchers(local, local.spec.checkpoint_signal))}
        netguard = self.host.agent.netguard if self.host.agent is not None else None
        if netguard is None:
            raise MemberError(f"node {self.host.node} runs no netguard: no kill-switch")
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

            root = str(self.host.s["ckpt_root"] or "")
            mine = os.path.normpath(f"{root.rstrip('/')}/{rec.job}") if root else ""
            if not mine or not os.path.normpath(resume).startswith(mine + "/"):
                raise MemberError(f"resume_from {resume[:80]!r}: not a checkpoint of {rec.job} under members.ckpt_root")
        block = check_block({"job": rec.job, "origin": rec.origin, "index": idx, "count": rec.workers,
                             "min": rec.workers_min, "max": rec.workers_max, "nodes": nodes, "endpoint": endpoint,
                             "launcher": self.host._launcher(rec), "generation": gen})
        if [int(n) for n, _ in block["nodes"]][idx] != self.host.node:
            raise MemberError(f"job {rec.job}: the relaunch names node {block['nodes'][idx][0]} for member {idx}")
        if rec.job in self._relaunching:
            return {"done": "relaunching"}
        for i, (n, a) in enumerate(block["nodes"]):  # the job's nodes as they are now, stored
            self.host.table.set_member(rec, i, rec.members[i].state, rec.members[i].code, node=int(n), addr=str(a))
        self._relaunching.add(rec.job)
        self.host._spawn(self._relaunch_here(rec, block, resume))
        return {"done": "relaunching"}

    async def _relaunch_here(self, rec: MultiRecord, block: dict[str, Any], resume: str | None) -> None:
        """The member here stopped (if it still runs) and started with the block's generation;
        nothing when that generation was started here already (a repeated relaunch)."""
        try:
            jobs = self.host.agent.jobs if self.host.agent is not None else None
            if jobs is None:
                raise JobError("this node runs no job manager")
            gen = int(block["generation"])
            # the generation last started here: on a member node its record's, on the origin
            # (whose record moved to the next generation first) what this process started
            started = self._started_gen.get(rec.job, rec.generation if rec.origin != self.host.node else -1)
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
            self.host._emit(f"job {rec.job}: relaunch failed here: {e}", job=rec.job)
            self.unreported.add(rec.job)
        finally:
            self._relaunching.discard(rec.job)

    def on_view(self, sender: int, req: dict[str, Any]) -> dict[str, Any]:
        job = _job_id(req.get("job"))
        rec = self.host.table.get(job)
        if rec is None:
            raise MemberError(f"job {job}: unknown here")
        if sender != rec.origin:
            raise MemberError(f"job {job}: only its origin, node {rec.origin}, sends its view (not node {sender})")
        ckpt = req.get("last_ckpt")
        mine = self.ckpt_dir(job)
        if (isinstance(ckpt, str) and len(ckpt) <= PATH_MAX and mine is not None and ckpt.startswith(mine + "/")
                and ckpt != rec.last_ckpt):
            self.host.table.set_job(rec, last_ckpt=ckpt, last_ckpt_at=time.time())
        if _int(req.get("generation"), "generation", 0, 1 << 31) == rec.generation:
            # the origin's word on the job's state and on the other members' (this node's own
            # member is what its local job says, reported by this node)
            said = req.get("state")
            if isinstance(said, str) and said in MultiState.__members__.values():
                why = req.get("end_reason")
                self.host.table.follow(rec, MultiState(said), why[:200] if isinstance(why, str) else "ended at its origin")
            states = pm.states_of(req.get("members"), len(rec.members))
            own = rec.index_of(self.host.node)
            for i, st in enumerate(states or ()):
                if i != own:
                    self.host.table.set_member(rec, i, st, rec.members[i].code)
        return {"job": job, "generation": rec.generation}

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
        if int(b["nodes"][idx][0]) != self.host.node:
            raise JobError(f"member block: member {idx} is node {b['nodes'][idx][0]}'s, not this node's ({self.host.node})")
        jobs = self.host.agent.jobs if self.host.agent is not None else None
        if jobs is None:
            raise JobError("this node runs no job manager")
        job_id = str(b["job"])
        old = self.host.table.get(job_id)
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
            argv, env = self.host.launch_plan(b, spec)
        except ValueError as e:  # (launch.LaunchError)
            raise JobError(f"member {idx} of {job_id}: {e}") from None
        root = str(self.host.s["ckpt_root"] or "")
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
        if old is not None and old.origin == self.host.node:
            # this node is the job's origin too: its record (the job's state, the other members
            # as reported) stays; only this member's row starts again
            rec = old
            self.host.table.set_member(rec, idx, MemberState.STARTING, None)
        else:
            try:
                self.host.table.add(rec)
            except TableFull as e:
                raise JobError(str(e)) from None
        self._launching.add(job_id)
        try:
            job = await jobs.submit(run, owner_uid, owner_gid, job_id=job_id, relaunch=old is not None, agent_env=env)
        finally:
            self._launching.discard(job_id)  # (a submit that failed: the next tick finds no job, failed)
        self._started_gen[job_id] = int(b["generation"])
        self.host._emit(f"member {idx} of job {job_id} started (generation {b['generation']}, origin node {b['origin']})",
                   job=job_id, member=idx, generation=int(b["generation"]), origin=int(b["origin"]))
        return job.id

    async def _report(self, job: str) -> None:
        try:
            rec = self.host.table.get(job)
            idx = rec.index_of(self.host.node) if rec is not None else None
            if rec is None or idx is None:
                self.unreported.discard(job)
                return
            m = rec.members[idx]
            told = (m.state, m.code, rec.last_ckpt, rec.generation)
            payload: dict[str, Any] = {"job": job, "index": idx, "generation": rec.generation, "state": str(m.state)}
            if m.code is not None:
                payload["code"] = m.code
            if idx == 0 and rec.last_ckpt:
                payload["ckpt"] = rec.last_ckpt
            self.host.counts["reports_sent"] += 1
            try:
                got = await self.host.messages.request(rec.origin, OP_REPORT, payload)
            except MemberError as e:
                if "did not answer" in str(e):
                    return  # retried on the next tick
                log.warning("members: the report of job %s was refused by its origin: %s", job, e)
                got = {}
            if (m.state, m.code, rec.last_ckpt, rec.generation) == told:  # (else: told again next tick)
                self.unreported.discard(job)
            said = got.get("state")
            if rec.origin != self.host.node and said in set(MultiState) and got.get("generation") == rec.generation:
                self.host.table.follow(rec, MultiState(said), str(got.get("end_reason") or "ended at its origin"))
        finally:
            self._reporting.discard(job)

    def on_airlock(self, job_id: str, action: str, work_lost_s: float | None) -> None:
        """Airlock acted on the local member ``job_id`` (``suspend``, ``recover``, ``kill``): its
        origin is told in a REPORT (``airlock``), from a task (never blocks, never raises); the
        origin freezes or thaws the other members, or decides the kill (policy.members)."""
        rec = self.host.table.get(job_id)
        idx = rec.index_of(self.host.node) if rec is not None else None
        if rec is None or idx is None or action not in ("suspend", "recover", "kill"):
            return
        if action == "kill":
            self._airlock_killed[job_id] = rec.generation
            self.host.table.set_member(rec, idx, MemberState.FAILED, None)
        payload: dict[str, Any] = {"job": job_id, "index": idx, "generation": rec.generation,
                                   "state": str(rec.members[idx].state), "airlock": action}
        if work_lost_s is not None:
            payload["work_lost_s"] = round(float(work_lost_s), 1)
        self.host._spawn(self._tell_origin(rec, payload))

    async def _tell_origin(self, rec: MultiRecord, payload: dict[str, Any]) -> None:
        try:
            await self.host.messages.request(rec.origin, OP_REPORT, payload)
        except MemberError as e:
            log.warning("members: job %s: telling its origin of %s failed: %s", rec.job, payload.get("airlock"), e)
            self.unreported.add(rec.job)  # (the member's state, at least, is reported again)
