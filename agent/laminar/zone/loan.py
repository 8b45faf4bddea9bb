"""Capacity loaning and elastic scaling between real agents (``agent.zone.loan``).

The policy lives in :mod:`laminar.policy.loaning` (which servers to return, at what cost) and
:mod:`laminar.policy.elastic` (who gets free GPUs); this module is the mechanism that runs it in
laminard. See ``docs/loaning.md`` for the whole story; in short:

**Loaning.** A node whose pool is ``[loan] pool`` (default ``inference``) serves its own load,
a number 0..1 the inference scheduler or the operator sets::

    laminarctl pool load 0.2                 POST /v1/pool/load {"load": 0.2}      (privileged)

While the load is below ``[loan] idle_below`` (and the node has not been returned since), the
node is *loanable*: a placement for another pool (a demand with ``pool = "training"``) that
probes it gets an offer, and the job it hands over runs with ``lent = true`` (netguard's
``LM_JOB_LENT``, under the node-wide lent kill-switch). A busy node refuses such probes with
the reason ``pool_busy``. Demands for the node's own pool, and demands naming no pool, are not
loans and are decided as before.

**Return.** A member of the pool (or a node the servers' ``[loan] return_from`` lists) takes k
servers of the pool back::

    laminarctl pool return --pool inference --count 1      POST /v1/pool/return {"pool": ..., "count": k}

(``pool reclaim`` and ``/v1/pool/reclaim``, the names before 2026-12-06, still work for one release.)

The node asks every member of the pool in its zone for its loan state and lent jobs (a signed
``LOAN_REQUEST``/``LOAN_ANSWER`` exchange over the zone's UDP endpoint, see
``docs/protocol.md``), turns the answers into :class:`laminar.policy.loaning.LoanedJob` rows
(weight: GPUs x seconds of work since the job's last checkpoint, plus a restart), chooses the
k servers of least preemption cost with :func:`laminar.policy.loaning.plan_return` and tells each
to return. A returned server marks itself returned (it refuses loans until its load is set
below the threshold again), revokes elastic grants, and does the plan's action for each lent
job. ``migrate`` (free GPUs were reported elsewhere): the migration layer moves it with its
checkpoint (``Mover.move_now``: checkpoint, reserve, transfer, verify, resume there
from the copy; state ``migrated`` here). ``requeue`` (and a failed move): checkpoint signal,
wait for the checkpoint (``ckpt_wait_s``), stop with state ``requeued``, and place the job
again through the zone with ``LAMINAR_RESUME_FROM`` naming the checkpoint (the path must be
reachable where the job lands: shared storage). The plan (servers, cost, per-job action) is
the API's answer and a ``zone`` event.

**Elastic scaling.** Every ``elastic_interval_s`` the node gives its idle whole GPUs to its
elastic jobs (``elastic_min``/``elastic_max`` in the job spec; one worker per GPU) with
:func:`laminar.policy.elastic.allocate_elastic`. A job learns its worker count from the JSON file
``LAMINAR_WORKERS_FILE`` names (``{"workers": n, "gpus": [...]}``), rewritten atomically, and a
``SIGUSR2`` once the job has a handler for it (never before: its default action kills);
:func:`laminar.jobkit.workers` reads it. A grant is on loan to the elastic job,
not taken: the node still offers granted GPUs to placements, and a job handed over onto them
**sheds** them (the elastic jobs holding them are told their smaller worker count before the
new job starts), as a queued job takes an elastic job's extra workers in Aryl's design. Grants
take idle GPUs from the highest index down and placements take GPUs from the lowest up, so a
placement sheds only when no other idle GPU is left. A GPU a local job took is shed at the
next round. A node that stops being free for it (busy inference, returned) revokes the grants.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar.migrate.ckpt_driver import wait_new_checkpoint
from laminar.migrate.drain import requeue_spec
from laminar.policy import elastic as el
from laminar.policy import loaning as ln
from laminar.policy import placement as pl
from laminar.policy.endcause import EndCause
from laminar.runtime.provenance import request_origin
from laminar.runtime.signals import signal_if_caught
from laminar.tasks import cancel_until_done
from laminar.zone import authority as au
from laminar.zone import wire
from laminar.zone.wire import new_id

if TYPE_CHECKING:
    from laminar.zone.component import ZoneComponent

log = logging.getLogger("laminar.zone.loan")

OP_QUERY = 1
OP_RETURN = 2
STATUS_OK = 0
STATUS_ERROR = 1
WORKERS_ENV = "LAMINAR_WORKERS_FILE"  # set by the job manager for elastic jobs
ANSWER_CACHE = 256  # answers kept for repeated requests (retransmissions)
ANSWER_LIMIT = wire.MAX_DATAGRAM - wire.HEADER_SIZE - wire.MAC_SIZE - 16  # a loan answer's JSON, at most
# phases of a returned job's move or requeue while it is under way (GET /v1/pool requeues)
BUSY_PHASES = frozenset({"checkpointing", "migrating", "stopping", "placing"})
# At start, how long a returned server's redo of its return waits for the migration layer to start.
REDO_WAIT_S = 30.0


def config_fields() -> dict[str, Any]:
    """The ``[loan]`` config section."""
    from laminar.config import Field, _range

    return {
        "pool": Field(str, "inference", "the pool whose idle nodes are loaned to other pools (training)"),
        "idle_below": Field((int, float), 0.3, "a node of that pool is loanable while its load is below this",
                            _range(0.0, 1.0)),
        "load": Field((int, float), 0.0, "this node's serving load at start (0..1; POST /v1/pool/load changes it)",
                      _range(0.0, 1.0)),
        "query_timeout_s": Field((int, float), 1.0, "how long a return waits for each server's answer", _range(0.05, 60)),
        "ckpt_wait_s": Field((int, float), 10.0, "how long a returned job gets to write its checkpoint", _range(0, 3600)),
        "stop_grace_s": Field((int, float), 2.0, "SIGTERM grace of a requeued job", _range(0, 600)),
        "requeue_for_s": Field((int, float), 600.0, "how long a requeued job keeps trying to be placed again",
                               _range(1, 86400)),
        "restart_s": Field((int, float), 60.0, "a stopped job's restart cost in a server's preemption cost",
                           _range(0, 86400)),
        "elastic_interval_s": Field((int, float), 1.0, "how often idle GPUs are given to elastic jobs (0: never)",
                                    _range(0, 3600)),
        "return_from": Field(list, [], "nodes that may return this server to its pool (LOAN_REQUEST op 2, laminarctl "
                             "pool return there) besides the members of its own pool in its zone, which always may",
                             au.check_node_list),
        "elastic_remaining_s": Field((int, float), 3600.0, "an elastic job's remaining single-worker seconds when it "
                                     "does not say (its spec's remaining_s, laminarctl submit --remaining)", _range(1, 1e9)),
    }


try:
    from laminar.config import register_section

    register_section("loan", config_fields())
except ImportError:  # pragma: no cover - the simulator runs without the agent package parts
    pass


class LoanError(ValueError):
    """A loan request that cannot be done; the message says why and what would be right."""


class LoanRefused(LoanError):
    """A node answered a loan request with an error: it did nothing (as opposed to a node
    that did not answer, which may have)."""


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def fit_payload(state: dict[str, Any], limit: int) -> bytes:
    """``state`` as JSON of at most ``limit`` bytes: when its job list does not fit, the jobs are
    folded into one rigid entry carrying their summed weight and GPUs (every job on a returned
    server stops in this agent, so the cost is the same)."""
    data = _dumps(state)
    if len(data) <= limit:
        return data
    jobs = state.get("jobs", [])
    folded = {"id": f"{len(jobs)}-jobs", "workers": 1, "min": 1,
              "gpw": round(sum(j["workers"] * j["gpw"] for j in jobs), 2),
              "weight": round(sum(j["weight"] for j in jobs), 1), "folded": [j["id"] for j in jobs][:8]}
    data = _dumps({**state, "jobs": [folded], "jobs_folded": len(jobs)})
    if len(data) > limit:
        data = _dumps({**state, "jobs": [{**folded, "folded": []}], "jobs_folded": len(jobs)})
    return data


def fit_return(done: dict[str, Any], limit: int) -> bytes:
    """A return's answer (:meth:`LoanManager.do_return`) as JSON of at most ``limit`` bytes:
    when the per-job actions do not fit, they are counted by action instead
    (``jobs_folded``: how many; ``actions``: count per action; ``jobs``: the first few)."""
    data = _dumps(done)
    if len(data) <= limit:
        return data
    jobs: dict[str, str] = done.get("jobs", {})
    counts: dict[str, int] = {}
    for a in jobs.values():
        counts[a] = counts.get(a, 0) + 1
    for keep in (16, 4, 0):
        data = _dumps({**done, "jobs": dict(list(jobs.items())[:keep]), "jobs_folded": len(jobs), "actions": counts})
        if len(data) <= limit:
            break
    return data


def job_row(job: Any, now: float, restart_s: float) -> dict[str, Any]:
    """What a server reports about one lent job (one worker per GPU; a CPU-only job is one
    worker): id, workers, min workers, GPUs per worker, weight (loaning.job_weight)."""
    gpus = float(len(job.gpus or []))
    # fractional GPUs, as the hand-over that placed it recorded them (laminar.runtime.provenance;
    # before, its env's LM_GPU_SHARE, which its user could set: "0:x" failed every loan query)
    gpus += sum(f for _, f in getattr(getattr(job, "origin", None), "gpu_share", ()) or ())
    workers = max(1, len(job.gpus or []))
    at_risk = job.work_at_risk_s(now) if hasattr(job, "work_at_risk_s") else 0.0
    return {"id": str(job.id), "workers": workers, "min": workers, "gpw": round(gpus / workers, 2) if gpus else 0.0,
            "weight": round(ln.job_weight(max(gpus, 0.01), at_risk, restart_s), 1), "name": job.spec.name}


def on_loan(state: dict[str, Any]) -> bool:
    """A server's answer says it is on loan (:func:`laminar.policy.loaning.on_loan`)."""
    return ln.on_loan(state)


def plan_from_answers(answers: dict[int, dict[str, Any]], k: int) -> tuple[ln.ReturnPlan, dict[str, tuple[int, str]]]:
    """The return plan for ``k`` of the servers that answered (node -> state), by the policy
    the simulator runs too (:func:`laminar.policy.loaning.plan_from_reports`). Job ids are local
    to a node, so each row is keyed ``n<node>-<id>``; the free GPUs the servers report decide
    migrate vs requeue. Returns the plan (server names are node ids as strings) and {plan job
    id: (node, job id on that node)}. Raises LoanError when k is out of range."""
    reports: dict[str, dict[str, Any]] = {}
    where: dict[str, tuple[int, str]] = {}
    for n, a in answers.items():
        rows = []
        for j in a.get("jobs", []) or []:
            key = f"n{n}-{j['id']}"
            where[key] = (n, str(j["id"]))
            rows.append({**j, "id": key})
        reports[str(n)] = {**a, "jobs": rows}
    try:
        plan = ln.plan_from_reports(reports, k)
    except ValueError as e:
        raise LoanError(str(e).removeprefix("loaning: ")) from None
    return plan, where


class LoanManager:
    """Loaning, returns and elastic grants on one node; owned by the zone component."""

    def __init__(self, zone: ZoneComponent, settings: dict[str, Any] | None = None) -> None:
        self.zone = zone
        self.s = {**{k: f.default for k, f in config_fields().items()}, **(settings or {})}
        self.load = float(self.s["load"])
        self.returned = False
        self.grants: dict[str, list[int]] = {}  # job id -> extra GPU indices granted
        self.workers: dict[str, int] = {}  # job id -> worker count last told
        self._unsignalled: set[str] = set()  # told a new count before catching SIGUSR2
        self.requeues: dict[str, dict[str, Any]] = {}  # job id -> its requeue's progress
        self.last_plan: dict[str, Any] | None = None
        self.last_return: dict[str, Any] = {}  # this server's return: plan, by, job id -> action (stored)
        # request id -> (the node asked, its answer): an answer counts only from the node asked
        self._pending: dict[int, tuple[int, asyncio.Future[tuple[int, bytes]]]] = {}
        self._answered: OrderedDict[tuple[int, int], wire.LoanAnswer] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.counts: dict[str, int] = {"loans": 0, "loan_refusals": 0, "queries": 0, "returns": 0, "requeued": 0,
                                       "grants": 0, "revokes": 0, "sheds": 0,
                                       "migrated": 0}

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        store = self._store
        if store is not None:
            store.ensure_schema("loan", [
                "CREATE TABLE IF NOT EXISTS loan_state (key TEXT PRIMARY KEY, value TEXT NOT NULL)"])
            for key, value in store.db.execute("SELECT key, value FROM loan_state").fetchall():
                v = json.loads(value)
                if key == "load":
                    self.load = float(v)
                elif key == "returned":
                    self.returned = bool(v)
                elif key == "grants":
                    self.grants = {str(k): [int(g) for g in gs] for k, gs in v.items()}
                elif key == "return":
                    self.last_return = v if isinstance(v, dict) else {}
        if float(self.s["elastic_interval_s"]) > 0:
            self._spawn(self._elastic_loop())
        if self.returned and self.lends:  # its return's moves and requeues ran in memory: a stop cut them
            self._spawn(self._redo_return(self.last_return))

    async def stop(self) -> None:
        await cancel_until_done(self._tasks)  # (a cancel lost in a wait_for: the placement retried 577 s)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def _store(self) -> Any:
        return self.zone.agent.store if self.zone.agent is not None else None

    @property
    def _jobs(self) -> Any:
        return self.zone._jobs

    def _save(self, key: str, value: Any) -> None:
        store = self._store
        if store is not None:
            with store.tx() as db:
                db.execute("INSERT OR REPLACE INTO loan_state VALUES (?, ?)", (key, json.dumps(value)))

    # -- loan state ----------------------------------------------------------------------------

    @property
    def pool(self) -> str:
        """This node's pool (from zone.nodes; empty when none is configured)."""
        return self.zone.membership.by_node[self.zone.node_id].pool

    @property
    def lends(self) -> bool:
        """True when this node belongs to the loaning pool."""
        return bool(self.pool) and self.pool == self.s["pool"]

    @property
    def loanable(self) -> bool:
        return self.lends and not self.returned and self.load < float(self.s["idle_below"])

    def is_loan(self, demand: pl.Demand) -> bool:
        """A demand that would run here on loan: for another pool, on a node of the loaning pool."""
        return self.lends and demand.pool is not None and demand.pool != self.pool

    def admit(self, demand: pl.Demand) -> pl.RefuseReason | None:
        """None when this node may take ``demand`` as far as loaning goes, else the refusal."""
        if self.is_loan(demand) and not self.loanable:
            self.counts["loan_refusals"] += 1
            return pl.RefuseReason.POOL_BUSY
        return None

    def set_load(self, load: Any) -> dict[str, Any]:
        """Set the serving load (0..1). Below ``idle_below`` a returned node is loanable again.
        Raises LoanError for a value out of range."""
        from laminar.inputs import InputError, brief, read_number

        try:
            read_number(load, "pool load", 0.0, 1.0)  # 10**400: an OverflowError in float() before
        except InputError:
            raise LoanError(f"pool load {brief(load)}: expected a number in 0..1 (share of serving capacity in "
                            "use)") from None
        was = self.loanable
        self.load = float(load)
        self._save("load", self.load)
        if self.load < float(self.s["idle_below"]) and self.returned:
            self.returned = False
            self._save("returned", False)
        if was != self.loanable:
            self.zone._emit(f"pool {self.pool or '-'}: node {self.zone.node_id} "
                            f"{'loanable' if self.loanable else 'busy: no more loans'} at load {self.load:g}",
                            load=self.load, loanable=self.loanable)
        if not self.loanable and self.lends:
            self.revoke_grants("the node serves its own load")
        return self.state()

    def lent_jobs(self) -> list[Any]:
        jobs = self._jobs
        if jobs is None:
            return []
        return [j for j in jobs.active() if getattr(j.spec, "lent", False)]

    def state(self) -> dict[str, Any]:
        """This node's loan state and lent jobs (the answer to a query)."""
        now = time.time()  # a job's times are wall-clock times; the arbiter's are the zone's clock
        free = sum(1 for f in self.zone.arbiter.view(self.zone.clock()).gpu_free if f >= 1.0 - pl.EPS)
        return {"node": self.zone.node_id, "pool": self.pool, "load": self.load, "loanable": self.loanable,
                "returned": self.returned, "lends": self.lends, "free_gpus": free,
                "jobs": [job_row(j, now, float(self.s["restart_s"])) for j in self.lent_jobs()],
                "grants": {k: len(v) for k, v in self.grants.items()}}

    # -- messages --------------------------------------------------------------------------------

    def on_message(self, sender: int, body: wire.LoanRequest | wire.LoanAnswer) -> wire.LoanAnswer | None:
        """A LOAN_REQUEST from ``sender``: the answer (cached by request id, so a repeat is not
        acted on twice). A LOAN_ANSWER: delivered to the waiting request; None."""
        if isinstance(body, wire.LoanAnswer):
            got = self._pending.get(body.request_id)
            if got is not None and got[0] == sender and not got[1].done():
                got[1].set_result((body.status, body.payload))
            return None
        key = (sender, body.request_id)
        ans = self._answered.get(key)
        if ans is not None:
            return ans
        try:
            req = json.loads(body.payload or b"{}")
            if body.op == OP_QUERY:
                self.counts["queries"] += 1
                out = fit_payload(self.state(), ANSWER_LIMIT)
            elif body.op == OP_RETURN:
                refused = self.return_refusal(sender)
                if refused is not None:
                    raise LoanError(str(refused))
                out = fit_return(self.do_return(req if isinstance(req, dict) else {}, sender), ANSWER_LIMIT)
            else:
                raise LoanError(f"unknown loan operation {body.op} (1 query, 2 return)")
            ans = wire.LoanAnswer(body.request_id, STATUS_OK, out)
        except (LoanError, ValueError, TypeError, KeyError) as e:
            ans = wire.LoanAnswer(body.request_id, STATUS_ERROR, _dumps({"error": str(e)[:400]}))
        self._answered[key] = ans
        while len(self._answered) > ANSWER_CACHE:
            self._answered.popitem(last=False)
        return ans

    def return_refusal(self, sender: int) -> au.Refused | None:
        """Why ``sender`` may not return this server (counted): only this server's own pool's
        members in its zone (the pool's scheduler takes its servers back) and the nodes listed
        in ``[loan] return_from`` may (laminar.zone.authority)."""
        allowed = {int(n) for n in self.s.get("return_from") or []}
        try:
            allowed.update(self.zone.membership.pool_list(self.zone.zone, self.pool))
        except (AttributeError, KeyError):
            pass
        e = au.node_op_refusal(f"return (pool {self.pool})", sender, allowed,
                               f"loan.return_from (or pool {self.pool!r} of zone {getattr(self.zone, 'zone', '?')})",
                               self.zone.node_id)
        if e is not None:
            refusals = getattr(self.zone, "authority", None)
            if isinstance(refusals, au.Refusals):
                refusals.note(e, sender)
            self.counts["return_refusals"] = self.counts.get("return_refusals", 0) + 1
        return e

    async def request(self, node: int, op: int, payload: dict[str, Any]) -> dict[str, Any]:
        """Send a loan request to ``node`` (this node: handled in process) and wait for the
        answer, retransmitting (same request id) within ``query_timeout_s``. Raises LoanError
        when the node does not answer or answers with an error."""
        rid = new_id()  # answers are matched by it: a CSPRNG's, not the zone's rng
        body = wire.LoanRequest(rid, op, _dumps(payload))
        if node == self.zone.node_id or self.zone.endpoint is None:
            ans = self.on_message(self.zone.node_id, body)
            assert ans is not None
            status, data = ans.status, ans.payload
        else:
            fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
            self._pending[rid] = (node, fut)
            timeout = float(self.s["query_timeout_s"])
            try:
                for _ in range(3):
                    self.zone.endpoint.send(node, body)
                    try:
                        status, data = await asyncio.wait_for(asyncio.shield(fut), timeout / 3)
                        break
                    except TimeoutError:
                        continue
                else:
                    self.zone.membership.missed(node, self.zone.clock())
                    raise LoanError(f"node {node} did not answer the loan request within {timeout:g} s")
            finally:
                self._pending.pop(rid, None)
        try:
            out = json.loads(data or b"{}")
        except ValueError:
            raise LoanError(f"node {node} answered with something that is not JSON") from None
        if status != STATUS_OK:
            raise LoanRefused(f"node {node}: {out.get('error', 'error') if isinstance(out, dict) else out}")
        if not isinstance(out, dict):
            raise LoanError(f"node {node} answered {out!r}, expected an object")
        return out

    # -- return (the coordinating node) -----------------------------------------------------------

    async def return_servers(self, pool: str, count: int) -> dict[str, Any]:
        """Take ``count`` loaned servers of ``pool`` in this zone back (see the module docs).
        Returns the plan as carried out. Raises LoanError for bad input or too few answers."""
        from laminar.inputs import brief

        if not isinstance(pool, str) or not pool or len(pool.encode()) > 32:
            raise LoanError(f"pool {brief(pool)}: expected a pool name such as \"inference\" (1..32 bytes)")
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1 << 20:
            raise LoanError(f"count {brief(count)}: expected a number of servers, 1..{1 << 20}")
        members = self.zone.membership.pool_list(self.zone.zone, pool)
        if not members:
            pools = sorted({p for (z, p) in self.zone.membership.by_pool if z == self.zone.zone})
            raise LoanError(f"pool {pool!r} has no members in zone {self.zone.zone} (pools here: {', '.join(pools) or 'none'})")
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self.request(n, OP_QUERY, {}) for n in members), return_exceptions=True)
        answers: dict[int, dict[str, Any]] = {}
        unanswered: dict[int, str] = {}
        for n, r in zip(members, results, strict=True):
            if isinstance(r, BaseException):
                unanswered[n] = str(r)
            else:
                answers[n] = r
        plan, where = plan_from_answers(answers, count)  # too few candidates: LoanError, nothing done
        cand_cost = {n: ln.preemption_cost(
            [ln.LoanedJob(f"n{n}-{j['id']}", int(j["workers"]), int(j["workers"]), float(j["gpw"]), float(j["weight"]),
                          {str(n): int(j["workers"])}) for j in a.get("jobs", [])], [str(n)])
            for n, a in answers.items() if on_loan(a)}
        plan_id = f"{new_id() & 0xFFFFFFFF:08x}"
        told: dict[int, Any] = {}
        refused: dict[int, str] = {}
        servers: list[int] = []
        actions: list[dict[str, Any]] = []
        cost = 0.0
        short = ""
        while True:
            by_server: dict[int, dict[str, str]] = {int(s): {} for s in plan.servers}
            acts: list[dict[str, Any]] = []
            for a in plan.actions:
                node, job_id = where[a.job_id]
                by_server[node][job_id] = a.action
                acts.append({"node": node, "job": job_id, "action": a.action, "workers_removed": a.workers_removed})
            rets = await asyncio.gather(*(self.request(n, OP_RETURN, {"plan": plan_id, "actions": acts_n})
                                          for n, acts_n in by_server.items()), return_exceptions=True)
            again = 0
            for n, r in zip(by_server, rets, strict=True):
                told[n] = {"error": str(r)} if isinstance(r, BaseException) else r
                if isinstance(r, LoanRefused):
                    # it answered no and did nothing (returned already by another return at the
                    # same time, or not a lender): not a candidate any more, another server goes
                    refused[n] = str(r)
                    answers[n] = {**answers[n], "returned": True}
                    again += 1
                else:  # returned, or silent (it may have returned: it is not replaced)
                    servers.append(n)
                    actions += [x for x in acts if x["node"] == n]
                    cost += ln.preemption_cost(
                        [ln.LoanedJob(f"n{n}-{j['id']}", int(j["workers"]), int(j["workers"]), float(j["gpw"]),
                                      float(j["weight"]), {str(n): int(j["workers"])}) for j in answers[n].get("jobs", [])],
                        [str(n)])
            if not again:
                break
            try:
                plan, where = plan_from_answers({n: a for n, a in answers.items() if n not in servers}, again)
            except LoanError as e:
                short = f"{again} server(s) short: {e}"
                break
        out = {"plan": plan_id, "pool": pool, "count": count, "servers": servers,
               "cost": cost, "actions": actions, "candidates": cand_cost,
               "unanswered": unanswered, "told": told, "refused": refused, "short": short,
               "elapsed_ms": round((time.perf_counter() - t0) * 1000, 1)}
        self.last_plan = out
        self.zone._emit(f"pool {pool}: returning node(s) {', '.join(map(str, servers)) or 'none'} "
                        f"(preemption cost {cost:g}, {len(actions)} job(s): "
                        f"{', '.join(str(a['job']) + '@' + str(a['node']) + ' ' + str(a['action']) for a in actions) or 'none'})"
                        + (f"; {short}" if short else ""),
                        plan=plan_id, pool=pool, servers=servers, cost=cost, actions=actions)
        return out

    # -- return (the returned server) ----------------------------------------------------------------

    def do_return(self, req: dict[str, Any], sender: int) -> dict[str, Any]:
        """This server is returned to its pool: no more loans, grants revoked, lent jobs
        requeued (in the background). Returns what will happen to each lent job."""
        if not self.lends:
            raise LoanError(f"node {self.zone.node_id} is not in the loaning pool {self.s['pool']!r}")
        if self.returned:  # another return took it first (a repeat of the same request is answered from the cache)
            raise LoanError(f"node {self.zone.node_id} was returned already; choose another server")
        self.counts["returns"] += 1
        self.returned = True
        self._save("returned", True)
        # A lent server taken back is a departure with notice of this node: the hazard the
        # checkpoint driver times lent jobs' checkpoints by learns the hours its pool takes
        # servers back (docs/loaning.md).
        mig = self.zone.agent.migrate if self.zone.agent is not None else None
        if mig is not None:
            mig.evidence.observe_departure(time.time(), announced=True)
        self.revoke_grants("the node was returned to its pool")
        asked = req.get("actions", {}) if isinstance(req.get("actions"), dict) else {}
        done: dict[str, str] = {}
        for job in self.lent_jobs():
            if self.requeues.get(job.id, {}).get("phase") in BUSY_PHASES:
                continue  # a move or requeue of it runs already (an earlier return): never two
            action = str(asked.get(job.id, "requeue"))
            if action not in ("requeue", "scale_in", "migrate"):
                action = "requeue"
            # One job runs on one node here: shedding this server's workers leaves none, so a
            # planned scale-in is carried out as a requeue. "migrate" (free GPUs elsewhere) moves
            # the job with the migration layer (its checkpoint is sent to the destination and
            # verified there); if that fails, or there is no migration layer, it is requeued:
            # checkpoint, stop, place again through the zone (resume_from must then be readable
            # where it lands).
            done[job.id] = "migrate" if action == "migrate" else "requeue"
            self.requeues[job.id] = {"job": job.id, "phase": "checkpointing", "planned": action,
                                     "plan": req.get("plan", ""), "by": sender, "since": time.time()}
            if action == "migrate":
                self._spawn(self._migrate(job, str(req.get("plan", ""))))
            else:
                self._spawn(self._requeue(job, str(req.get("plan", ""))))
        self.last_return = {"plan": str(req.get("plan", "")), "by": sender, "jobs": done}
        self._save("return", self.last_return)  # a restart carries out what a stop cuts (_redo_return)
        self.zone._emit(f"pool {self.pool}: node {self.zone.node_id} returned by node {sender}; "
                        f"{len(done)} lent job(s) requeued", plan=req.get("plan", ""), jobs=done, by=sender)
        return {"node": self.zone.node_id, "returned": True, "jobs": done}

    async def _redo_return(self, ret: dict[str, Any]) -> None:
        """At start, on a server returned before the agent stopped (``returned`` is stored, its
        return's moves and requeues ran in memory, so a stop or crash cut them): every lent job
        still active here is returned again with the action the return gave it (``ret``, stored
        by :meth:`do_return`: ``migrate`` or ``requeue``; ``requeue`` for a job it did not name),
        with a ``zone`` event (``restarted`` true). A job whose cut move the migration layer is
        settling at its start (``ReclaimComponent.evacuating``: its destination is asked whether
        it took the job) is waited for first: it may run there now, and a second move would
        hand it over twice. Never raises."""
        try:
            agent = self.zone.agent
            if agent is not None:  # the agent starts migrate after the zone
                end = time.monotonic() + REDO_WAIT_S
                while agent.migrate is None and not agent.components_started.is_set() and time.monotonic() < end:
                    await asyncio.sleep(0.1)
            mig = agent.migrate if agent is not None else None
            plan = str(ret.get("plan", ""))
            asked = ret.get("jobs") if isinstance(ret.get("jobs"), dict) else {}
            assert isinstance(asked, dict)
            todo = {j.id: ("migrate" if asked.get(j.id) == "migrate" else "requeue") for j in self.lent_jobs()
                    if self.requeues.get(j.id, {}).get("phase") not in BUSY_PHASES}
            # requeues the stop cut after the job's stop, while they looked for room (_requeue)
            placing = {jid: p for jid, p in (ret.get("placing") or {}).items() if isinstance(p, dict)
                       and jid not in todo and self._jobs is not None
                       and getattr(self._jobs.get(jid), "state", None) == "requeued"}
            for jid, p in placing.items():
                self.requeues[jid] = {"job": jid, "phase": "placing", "planned": "requeue", "plan": plan,
                                      "by": ret.get("by"), "since": time.time(), "restarted": True}
                origin = p.get("origin") if isinstance(p.get("origin"), dict) else None
                self._spawn(self._place_requeued(jid, p["spec"], pl.Demand(**p["demand"]), int(p["owner_uid"]),
                                                 int(p["owner_gid"]), plan, origin))
            if placing:
                self.zone._emit(f"pool {self.pool}: node {self.zone.node_id} was returned before the agent stopped, "
                                f"which cut the placement elsewhere of {len(placing)} requeued job(s): placed again: "
                                + ", ".join(placing), plan=plan, placing=sorted(placing), restarted=True)
            if not todo:
                return
            self.zone._emit(f"pool {self.pool}: node {self.zone.node_id} was returned (plan {plan or '-'}) before the "
                            f"agent stopped, which cut its return; {len(todo)} lent job(s) still here returned again: "
                            + ", ".join(f"{j} {a}" for j, a in todo.items()), plan=plan, jobs=todo,
                            by=ret.get("by"), restarted=True)
            for jid, action in todo.items():
                self.requeues[jid] = {"job": jid, "phase": "checkpointing", "planned": action, "plan": plan,
                                      "by": ret.get("by"), "since": time.time(), "restarted": True}
                self._spawn(self._redo_one(jid, action, plan, mig))
        except Exception:
            log.exception("loan: carrying out the return again at start")

    async def _redo_one(self, job_id: str, action: str, plan: str, mig: Any) -> None:
        """One lent job of :meth:`_redo_return`: once no move of it is being settled, moved or
        requeued as its return planned, unless it ended or left meanwhile. Never raises."""
        try:
            while mig is not None and job_id in getattr(mig, "evacuating", ()):
                await asyncio.sleep(0.2)
            job = self._jobs.get(job_id) if self._jobs is not None else None
            if job is None or not job.active:  # its settled move stopped it here (it runs there), or it ended
                self.requeues[job_id]["phase"] = "ended"
                return
            await (self._migrate(job, plan) if action == "migrate" else self._requeue(job, plan))
        except Exception:
            log.exception("loan: returning %s again at start", job_id)

    async def _wait_checkpoint(self, job: Any, after: Path | None, timeout: float) -> Path | None:
        """The job's first verified checkpoint newer than ``after`` within ``timeout``, else
        ``after``; hashed off the event loop (:func:`ckpt_driver.wait_new_checkpoint`)."""
        driver = self._ckpt_driver()
        new = await wait_new_checkpoint(job.ckpt_dir, after, timeout, lambda: bool(job.active), poll_s=0.1, job=job,
                                        scanner=driver.scan if driver is not None else None,
                                        lane=driver.lane if driver is not None else None,
                                        settings=driver.s if driver is not None else None)
        return new or after

    def _ckpt_driver(self) -> Any:
        """The migration layer's checkpoint driver (its scanner and check lane), or None."""
        mig = self.zone.agent.migrate if self.zone.agent is not None else None
        return mig.ckpt if mig is not None else None

    def _demand_of(self, job: Any) -> pl.Demand:
        for p in self.zone.arbiter.placed.values():
            if p.job_id == job.id:
                return p.reservation.demand
        return pl.Demand(float(len(job.gpus or [])), float(job.spec.cpus or 1.0), int(job.spec.memory_mb or 256))

    async def _migrate(self, job: Any, plan: str) -> None:
        """The plan's ``migrate``: move the job with the migration layer (checkpoint, reserve a
        node, send the checkpoint, hand over with ``resume_from`` on the destination, stop
        here); requeue it when that fails. Never raises."""
        rq = self.requeues[job.id]
        mig = self.zone.agent.migrate if self.zone.agent is not None else None
        if mig is not None:
            rq["phase"] = "migrating"
            try:
                mv = await mig.mover.move_now(job, f"node {self.zone.node_id} returned to pool {self.pool} (plan {plan})")
            except Exception as e:  # move_now never raises; a bug must not strand the job
                log.exception("loan: migration of %s", job.id)
                mv = None
                rq["migrate_error"] = repr(e)
            if mv is not None and mv.phase == "done":
                self.counts["migrated"] += 1
                rq.update(phase="placed", node=mv.dest, new_job=mv.dest_job, via="migration", checkpoint=mv.ckpt)
                self.zone._emit(f"migrated job {job.id} to node {mv.dest} as {mv.dest_job} (checkpoint {mv.ckpt} sent "
                                f"and verified there)", job=job.id, outcome="placed", node=mv.dest, new_job=mv.dest_job,
                                plan=plan, via="migration")
                return
            if mv is not None:
                rq["migrate_error"] = mv.error
            self.zone._emit(f"migration of job {job.id} failed ({rq.get('migrate_error', '')}); requeuing it",
                            job=job.id, plan=plan)
            if not job.active:  # it ended meanwhile (or was stopped): nothing to requeue
                rq["phase"] = "ended"
                return
        await self._requeue(job, plan)

    async def _requeue(self, job: Any, plan: str) -> None:
        """Checkpoint, stop (state ``requeued``), place again through the zone. Never raises."""

        rq = self.requeues[job.id]
        try:
            # the newest verified checkpoint: the migration layer's checkpoint driver's check of
            # the job's listing while it holds (nothing read before the final checkpoint is
            # asked for: a whole read of many GB took seconds of the return), else checked now
            driver = self._ckpt_driver()
            if driver is not None and job.ckpt_dir:
                before = (await driver.check(job, manifest=False))[0]
            else:  # (no migration layer: listed and checked off the loop, bounded, by a scan of its own)
                before = await wait_new_checkpoint(job.ckpt_dir, None, 0.0, lambda: False, job=job)
            ckpt = before
            if self._jobs.request_checkpoint(job):
                ckpt = await self._wait_checkpoint(job, before, float(self.s["ckpt_wait_s"]))
            demand = self._demand_of(job)
            key = f"n{self.zone.node_id}-{job.id}"
            spec = requeue_spec(job.spec.as_dict(), key)
            # Unlike a queued job's (drain.py: its indices become their count), a started job's GPUs
            # go: the demand it is placed with again is its placement's here (a GPU share, say), and
            # the destination gives it GPUs for that demand.
            spec.pop("gpus", None)
            if ckpt is not None:
                spec["resume_from"] = str(ckpt)
            # the agent gave its resume_from when it is this checkpoint, or when the job's own was
            # the agent's (laminar.runtime.provenance): the destination records it so
            given = ckpt is not None or bool(getattr(getattr(job, "origin", None), "resume_given", None))
            origin = request_origin(requeued_from=key, resume_given=given and bool(spec.get("resume_from")))
            rq.update(phase="stopping", checkpoint=str(ckpt) if ckpt else None)
            if job.active:
                await self._jobs.stop(job.id, f"node {self.zone.node_id} returned to pool {self.pool} (plan {plan}): "
                                      "requeued" + (f" from {ckpt.name}" if ckpt else " without a checkpoint"),
                                      grace_s=float(self.s["stop_grace_s"]), state="requeued",
                                      cause=EndCause.REQUEUED)
            self.counts["requeued"] += 1
            rq["phase"] = "placing"
            await self._place_requeued(job.id, spec, demand, job.owner_uid, job.owner_gid, plan, origin)
        except Exception as e:
            log.exception("requeue of %s failed", job.id)
            rq.update(phase="failed", reason=str(e))
            self.zone._emit(f"requeue of job {job.id} failed: {e}", job=job.id, plan=plan)

    async def _place_requeued(self, job_id: str, spec: dict[str, Any], demand: pl.Demand, owner_uid: int,
                              owner_gid: int, plan: str, origin: dict[str, Any] | None = None) -> None:
        """Places a requeued job (stopped here) through the zone, trying again for up to
        ``requeue_for_s``. Stored while it runs (the return's ``placing``), so a restart of a
        returned server places it again (:meth:`_redo_return`): a stop or crash here would
        otherwise leave the job stopped here and placed nowhere. A crash between a placement
        and that record's removal places it twice. Never raises."""
        rq = self.requeues[job_id]
        placing = self.last_return.setdefault("placing", {})
        placing[job_id] = {"spec": spec, "demand": dataclasses.asdict(demand), "owner_uid": owner_uid,
                           "owner_gid": owner_gid, "origin": origin}
        try:
            self._save("return", self.last_return)
            end = time.monotonic() + float(self.s["requeue_for_s"])
            delay = 1.0
            while True:
                res = await self.zone.place(spec, demand, owner_uid, owner_gid, origin=origin)
                rq["attempts"] = rq.get("attempts", 0) + 1
                if res.outcome in ("placed", "unconfirmed", "rejected") or time.monotonic() + delay > end:
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
            placing.pop(job_id, None)
            self._save("return", self.last_return)
            rq.update(phase=res.outcome, node=res.node, new_job=res.job_id, reason=res.reason)
            self.zone._emit(f"requeued job {job_id}: {res.outcome}"
                            + (f" on node {res.node} as {res.job_id}" if res.outcome == "placed" else f" ({res.reason})"),
                            job=job_id, outcome=res.outcome, node=res.node, new_job=res.job_id,
                            resume_from=spec.get("resume_from"), plan=plan)
        except Exception as e:
            log.exception("requeue of %s failed", job_id)
            rq.update(phase="failed", reason=str(e))
            self.zone._emit(f"requeue of job {job_id} failed: {e}", job=job_id, plan=plan)

    # -- elastic scaling ------------------------------------------------------------------------------

    def granted_gpus(self) -> set[int]:
        """GPU indices granted to elastic jobs (free for placements, which shed them)."""
        return {g for gs in self.grants.values() for g in gs}

    def frozen_grants(self) -> set[int]:
        """GPU indices granted to elastic jobs that are frozen now (Airlock's suspend, a move's
        freeze): not free for placements. A frozen job cannot scale in (its ``SIGUSR2`` waits
        for the thaw), so a job handed over onto its granted GPU would share it with the
        frozen extra worker; they are offered again once it thaws."""
        if not self.grants or self._jobs is None:
            return set()
        out: set[int] = set()
        for job_id, extra in self.grants.items():
            job = self._jobs.get(job_id)
            if job is not None and job_frozen(job):
                out.update(extra)
        return out

    def shed(self, gpus: set[int] | list[int], why: str) -> dict[str, list[int]]:
        """Take ``gpus`` back from the elastic jobs granted them, for a job that starts on them:
        each such job is told its smaller worker count (file + ``SIGUSR2``) before this returns.
        Returns job id -> the GPUs taken from it (empty when none was granted)."""
        want = set(gpus)
        taken: dict[str, list[int]] = {}
        for job_id, extra in list(self.grants.items()):
            hit = [g for g in extra if g in want]
            if not hit:
                continue
            keep = [g for g in extra if g not in want]
            if keep:
                self.grants[job_id] = keep
            else:
                del self.grants[job_id]
            job = self._jobs.get(job_id) if self._jobs is not None else None
            if job is not None and job.active:
                workers = max(job.spec.elastic_min or 1, len(job.gpus or [])) + len(keep)
                try:
                    self.tell_workers(job, workers, f"scale in: {why}")
                except OSError:  # not told: its extra workers still run there, the grant stands
                    self.grants[job_id] = extra
                    if taken:
                        self._save("grants", self.grants)
                    raise
            taken[job_id] = hit
            self.counts["sheds"] += 1
            if job is not None and job.active:
                self.zone._emit(f"elastic: job {job_id} scaled in to {workers} worker(s), GPU(s) {hit} shed ({why})",
                                job=job_id, workers=workers, gpus=hit)
        if taken:
            self._save("grants", self.grants)
        return taken

    def _elastic_jobs(self) -> list[Any]:
        jobs = self._jobs
        if jobs is None:
            return []
        return [j for j in jobs.active() if j.spec.elastic_min is not None and j.gpus]

    @property
    def may_grant(self) -> bool:
        """Idle GPUs may go to elastic jobs: anywhere but on a loaning-pool node that is busy."""
        return not self.lends or self.loanable

    def tell_workers(self, job: Any, workers: int, reason: str) -> None:
        """Write the job's worker count (atomically) and send it SIGUSR2 if it has a handler
        for it (``SigCgt``): SIGUSR2's default action would kill a job still starting (importing
        its framework) or one without the contract. A job not signalled is signalled by a later
        round once it catches SIGUSR2 (:meth:`_signal_late`); the file holds the count anyway."""
        path = workers_file(self._state_dir(), job.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o711)  # reachable by each job, listed by none
        tmp = path.with_suffix(".tmp")
        gpus = list(job.gpus or []) + self.grants.get(job.id, [])
        tmp.write_text(json.dumps({"workers": workers, "gpus": gpus, "updated": time.time(), "reason": reason}))
        # the job's own (its user reads it): other local users learn nothing of its GPUs
        os.chown(tmp, int(getattr(job, "owner_uid", 0) or 0), int(getattr(job, "owner_gid", 0) or 0))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        self.workers[job.id] = workers
        self._signal(job)

    def _signal(self, job: Any) -> None:
        # through the job manager: by the pidfd it watches the job by, never a bare pid (an
        # reattached job's main process is not the agent's child; its pid may be another's by now)
        send = getattr(self._jobs, "signal_main", None)
        if send(job, "SIGUSR2") if send is not None else signal_if_caught(job.pid, "SIGUSR2"):
            self._unsignalled.discard(job.id)
        else:
            self._unsignalled.add(job.id)

    def _signal_late(self) -> None:
        """Signal the jobs told a new worker count before they caught SIGUSR2, now that they do."""
        for job_id in list(self._unsignalled):
            job = self._jobs.get(job_id) if self._jobs is not None else None
            if job is None or not job.active:
                self._unsignalled.discard(job_id)
            else:
                self._signal(job)  # stays in the set while it does not catch SIGUSR2

    def _state_dir(self) -> Path:
        jobs = self._jobs
        sd = getattr(jobs, "state_dir", None)
        return Path(sd) if sd else Path("/var/lib/laminar")

    def revoke_grants(self, why: str) -> None:
        if not self.grants or self._jobs is None:
            return
        for job_id in list(self.grants):
            job = self._jobs.get(job_id)
            extra = self.grants.pop(job_id)
            self.counts["revokes"] += 1
            if job is not None and job.active:
                base = max(job.spec.elastic_min or 1, len(job.gpus or []))
                self.tell_workers(job, base, f"scale in: {why}")
                self.zone._emit(f"elastic: job {job_id} scaled in to {base} worker(s), {len(extra)} GPU(s) back ({why})",
                                job=job_id, workers=base, gpus=extra)
        self._save("grants", self.grants)
        self.zone.refresh_inventory()

    def elastic_round(self) -> dict[str, el.ElasticOption]:
        """One round: forget grants of ended jobs, give idle whole GPUs to elastic jobs by the
        knapsack. Returns the grants made."""
        jobs = self._jobs
        if jobs is None:
            return {}
        self._signal_late()
        changed = False
        for job_id in list(self.grants):
            j = jobs.get(job_id)
            if j is None or not j.active:
                del self.grants[job_id]
                self.workers.pop(job_id, None)
                changed = True
        # a job started on a granted GPU without the zone (a local submit): its GPUs are shed now
        held = {g for j in jobs.active() for g in (getattr(j, "gpus", None) or [])}
        if self.shed(held & self.granted_gpus(), "a local job took the GPU"):
            changed = True
        if not self.may_grant:
            if changed:
                self._save("grants", self.grants)
            return {}
        self.zone.refresh_inventory()
        view = self.zone.arbiter.view(self.zone.clock())
        granted = self.granted_gpus()  # free in the view (placements may shed them), not idle
        idle = [self.zone.gpu_index[i] for i, f in enumerate(view.gpu_free)
                if f >= 1.0 - pl.EPS and i < len(self.zone.gpu_index) and self.zone.gpu_index[i] not in granted]
        cands = [j for j in self._elastic_jobs() if not job_frozen(j)]  # a frozen job cannot scale out
        if not idle or not cands:
            if changed:
                self._save("grants", self.grants)
            return {}
        options = []
        for j in cands:
            now_w = max(j.spec.elastic_min or 1, len(j.gpus)) + len(self.grants.get(j.id, []))
            remaining = float(getattr(j.spec, "remaining_s", None) or self.s["elastic_remaining_s"])
            options.append(el.elastic_job(j.id, remaining, now_w, int(j.spec.elastic_max or now_w), 1,
                                          most=len(idle)))
        plan = el.allocate_elastic(options, len(idle))
        for j in cands:
            opt = plan.get(j.id)
            if opt is None:
                continue
            # from the highest index down: placements take the lowest first (allocate_gpus), so
            # they shed a grant only when no other idle GPU is left
            take, idle = sorted(idle[len(idle) - opt.gpus:]), idle[:len(idle) - opt.gpus]
            self.grants.setdefault(j.id, []).extend(take)
            workers = max(j.spec.elastic_min or 1, len(j.gpus)) + len(self.grants[j.id])
            self.tell_workers(j, workers, "scale out: idle GPUs granted")
            self.counts["grants"] += 1
            self.zone._emit(f"elastic: job {j.id} scaled out to {workers} worker(s) on GPU(s) {take} "
                            f"(JCT -{opt.jct_reduction:.0f} s by the model)", job=j.id, workers=workers, gpus=take,
                            jct_reduction_s=round(opt.jct_reduction, 1))
            changed = True
        if changed:
            self._save("grants", self.grants)
            self.zone.refresh_inventory()
        return plan

    async def _elastic_loop(self) -> None:
        interval = float(self.s["elastic_interval_s"])
        while True:
            await asyncio.sleep(interval)
            try:
                self.elastic_round()
            except Exception:
                log.exception("elastic round failed")

    # -- API -----------------------------------------------------------------------------------------

    def routes(self) -> list[Any]:
        from laminar.api import ApiError, Request, Route

        async def get_pool(req: Request) -> dict[str, Any]:
            return {**self.state(), "idle_below": float(self.s["idle_below"]), "loan_pool": self.s["pool"],
                    "counts": dict(self.counts), "requeues": list(self.requeues.values()), "last_plan": self.last_plan}

        async def post_load(req: Request) -> dict[str, Any]:
            b = req.body if isinstance(req.body, dict) else {}
            if "load" not in b:
                raise ApiError(400, "pool load: body must be {\"load\": 0..1}")
            try:
                return self.set_load(b["load"])
            except LoanError as e:
                raise ApiError(400, str(e)) from None

        async def post_return(req: Request) -> dict[str, Any]:
            b = req.body if isinstance(req.body, dict) else {}
            try:
                return await self.return_servers(b.get("pool", self.s["pool"]), b.get("count", 1))
            except LoanError as e:
                raise ApiError(400, f"pool return: {e}") from None

        return [
            Route("GET", "/v1/pool", get_pool),
            Route("POST", "/v1/pool/load", post_load, privileged=True),
            Route("POST", "/v1/pool/return", post_return, privileged=True),
            Route("POST", "/v1/pool/reclaim", post_return, privileged=True),  # its name before 2026-12-06, for one release
        ]


def job_frozen(job: Any) -> bool:
    """True when ``job``'s processes are frozen: its state is ``suspended`` (Airlock) or its
    cgroup's kernel flag says frozen (any freeze, a move's included); False when that cannot
    be read (a cgroup going away)."""
    if getattr(job, "state", "") == "suspended":
        return True
    frozen = getattr(getattr(job, "cgroup", None), "frozen", None)
    if frozen is None:
        return False
    try:
        return bool(frozen())
    except (OSError, RuntimeError):  # CgroupError: the cgroup is gone or unreadable
        return False


def workers_file(state_dir: Path, job_id: str) -> Path:
    """Where an elastic job's worker count is written (``LAMINAR_WORKERS_FILE``)."""
    return Path(state_dir) / "elastic" / f"{job_id}.json"
