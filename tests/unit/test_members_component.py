"""laminar.members: the members component's logic with stand-in agents (three nodes in one
process, messages delivered in process through each component's ``send``): the member side
(start, reports retried until answered, orders from the origin only), the origin side (submit,
reports from members only, restart / continue / end, stop, a lost node), and reattach from the
store after a restart, Airlock's word, the kill-switch. The local jobs are a stand-in job
manager (``StandInJobs``: it starts no process); a member as a real local job is
tests/kernel/test_members_local_job.py, and tests/cluster/test_members_cluster.py runs real
agents (and a real DDP job)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from standin_agent import standin_agent

from laminar.components import MembersAgent
from laminar.config import load
from laminar.events import EventBus
from laminar.members.component import MembersComponent
from laminar.members.messages import OP_ORDER, OP_REPORT
from laminar.members.origin import VIEW_EVERY_S, endpoint_port
from laminar.members.table import MemberTable
from laminar.policy.members import MemberState, MultiState
from laminar.runtime.spec import JobError, JobSpec
from laminar.store import Store
from laminar.zone import wire


@dataclass
class StandInJob:
    """A stand-in local job: its state is what the test sets (no process)."""

    id: str
    spec: JobSpec
    env: dict[str, str]
    state: str = "running"
    exit_code: int | None = None
    cgroup_id: int = 0
    pids: list[int] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return self.state in ("queued", "running", "suspended")


class StandInJobs:
    """A stand-in job manager: submit records the job, stop marks it stopped; no process runs.
    As the real one, ``jobs`` holds the jobs that have not ended (``get`` finds any)."""

    def __init__(self) -> None:
        self.all: dict[str, StandInJob] = {}
        self.num = 0
        self.submits: list[str] = []

    @property
    def jobs(self) -> dict[str, StandInJob]:
        return {k: j for k, j in self.all.items() if j.live}

    def reserve_multinode_id(self, node: int) -> str:
        self.num += 1
        return f"job-{self.num}-n{node}"

    def get(self, job_id: str) -> StandInJob | None:
        return self.all.get(job_id)

    async def submit(self, spec: JobSpec, owner_uid: int = 0, owner_gid: int = 0, *, job_id: str | None = None,
                     relaunch: bool = False, agent_env: dict[str, str] | None = None) -> StandInJob:
        assert job_id is not None
        old = self.all.get(job_id)
        if old is not None and (old.live or not relaunch):
            raise JobError(f"job id {job_id!r}: a job here has it already")
        self.all[job_id] = StandInJob(job_id, spec, dict(agent_env or {}))
        self.submits.append(job_id)
        return self.all[job_id]

    def freeze_member(self, job_id: str) -> bool:
        self.all[job_id].state = "suspended"
        return True

    def thaw_member(self, job_id: str) -> bool:
        self.all[job_id].state = "running"
        return True

    def signal_catchers(self, job: StandInJob, signame: str) -> list[int]:
        return []

    async def stop(self, job_id: str, reason: str = "", **_: Any) -> StandInJob:
        job = self.all[job_id]
        job.state = "stopped"
        return job


class StandInNetGuard:
    """netguard's per-job switch as the component calls it (the real one needs BPF maps)."""

    def __init__(self) -> None:
        self.cut: dict[str, bool] = {}

    def set_job_switch(self, job_id: str, on: bool) -> bool:
        self.cut[job_id] = on
        return True


class StandInMembership:
    """The zone's liveness as the component reads it: a node is dead once set so, or after
    three requests it left unanswered (laminar.zone.membership.MAX_MISSES)."""

    def __init__(self) -> None:
        self.dead: set[int] = set()
        self.misses: dict[int, int] = {}

    def alive(self, node: int, now: float) -> bool:
        return node not in self.dead and self.misses.get(node, 0) < 3

    def missed(self, node: int, now: float) -> None:
        self.misses[node] = self.misses.get(node, 0) + 1


class StandInZone:
    """What the members component reads of the zone: its node id, liveness and clock."""

    def __init__(self, node: int, membership: StandInMembership) -> None:
        self.node_id = node
        self.membership = membership
        self.endpoint = None

    def clock(self) -> float:
        return 0.0


@dataclass
class PlacerResult:
    outcome: str
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "reason": self.reason}


class StandInPlacer:
    """A stand-in gang placer (the real one, laminar.zone.gangplace, runs in the cluster tests):
    it takes the first k free nodes in order and hands each member over to that node's component."""

    def __init__(self, cluster: Cluster, origin: int) -> None:
        self.cluster = cluster
        self.origin = origin
        self.calls: list[int] = []

    async def place(self, demand: Any, k: int, build: Any, undo: Any = None, **_: Any) -> PlacerResult:
        """As GangPlacer: a node whose hand-over fails is not chosen again for this placement."""
        self.calls.append(k)
        failed: set[int] = set()
        while True:
            free = [n for n in self.cluster.nodes if n not in self.cluster.membership.dead
                    and n not in self.cluster.busy and n not in failed]
            if len(free) < k:
                return PlacerResult("queued-out", f"{len(free)} nodes free for {k}")
            chosen = free[:k]
            try:
                for data in build([(n, f"10.9.0.{n}") for n in chosen]):
                    req = json.loads(data)
                    block = req["spec"].pop("member")
                    node = block["nodes"][block["index"]][0]
                    try:
                        await self.cluster.comps[node].start_member(block, JobSpec.from_dict(req["spec"]),
                                                                    req["owner_uid"], req["owner_gid"])
                    except JobError:
                        failed.add(node)
                        raise
            except JobError:
                continue
            return PlacerResult("placed")


class Cluster:
    """Nodes 1..n, each a MembersComponent with its own store and stand-in job manager; member
    messages go through ``send`` (dropped while a node is in ``deaf``)."""

    def __init__(self, tmp_path: Any, n: int = 3, ckpt_root: str = "") -> None:
        self.tmp = tmp_path
        self.nodes = list(range(1, n + 1))
        self.membership = StandInMembership()
        self.busy: set[int] = set()
        self.deaf: set[int] = set()
        self.comps: dict[int, MembersComponent] = {}
        self.jobs: dict[int, StandInJobs] = {n: StandInJobs() for n in self.nodes}
        self.stores: dict[int, Store] = {}
        self.netguards: dict[int, StandInNetGuard] = {}
        self.ckpt_root = ckpt_root
        self.now = time.time()

    def agent(self, node: int) -> Any:
        store = self.stores.setdefault(node, Store(self.tmp / f"n{node}" / "laminar.db"))
        conf = self.tmp / f"n{node}.toml"
        conf.write_text(f"[agent]\nstate_dir = {json.dumps(str(self.tmp / f'n{node}'))}\n"
                        f"[members]\ntick_s = 60\nrequest_timeout_s = 0.3\nckpt_root = {json.dumps(self.ckpt_root)}\n")
        config = load(conf)
        return standin_agent(MembersAgent, config=config, store=store, events=EventBus(store),
                             jobs=self.jobs[node], zone=StandInZone(node, self.membership),
                             netguard=self.netguards.setdefault(node, StandInNetGuard()))

    async def start(self, node: int) -> MembersComponent:
        comp = MembersComponent()
        comp.placer = StandInPlacer(self, node)
        comp.send = self._sender(node)
        await comp.start(self.agent(node))
        self.comps[node] = comp
        return comp

    async def start_all(self) -> None:
        for n in self.nodes:
            await self.start(n)

    def _sender(self, src: int) -> Any:
        def send(dst: int, body: wire.MemberRequest) -> None:
            if dst in self.deaf or src in self.deaf or dst not in self.comps:
                return
            ans = self.comps[dst].on_message(src, body)
            if ans is not None:
                asyncio.get_running_loop().call_soon(self.comps[src].on_message, dst, ans)
        return send

    async def tick(self, rounds: int = 1) -> None:
        """Each component's round, ``rounds`` times, each VIEW_EVERY_S later than the last."""
        for _ in range(rounds):
            self.now += VIEW_EVERY_S
            for c in list(self.comps.values()):
                c.tick(self.now)
            for _ in range(20):
                await asyncio.sleep(0)
            await settle(self.comps.values())

    async def stop(self) -> None:
        for c in self.comps.values():
            await c.stop()
        for s in self.stores.values():
            s.close()


async def settle(comps: Any) -> None:
    for _ in range(50):
        tasks = [t for c in comps for t in c._tasks]
        if not tasks:
            return
        await asyncio.wait(tasks, timeout=2.0)


def spec3(**kw: Any) -> JobSpec:
    """A multi-node spec (not validated: the refusals of bad counts are the component's to show too)."""
    return JobSpec(command=["sh", "-c", "echo $RANK $WORLD_SIZE; sleep 5"], workers=kw.pop("workers", 3),
                   workers_min=kw.pop("workers_min", None), workers_max=kw.pop("workers_max", None))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- submit and the member side ------------------------------------------------------------------------


def test_submit_places_three_members_with_their_env_and_records_everywhere(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        view = await c.comps[1].submit(spec3(), 1000, 1000)
        job = view["id"]
        assert job == "job-1-n1" and view["state"] == "starting" and view["workers"] == 3
        assert [m["node"] for m in view["members"]] == [1, 2, 3]
        assert view["placement"] == {"outcome": "placed", "reason": ""}
        for i, n in enumerate(c.nodes):
            local = c.jobs[n].get(job)
            assert local is not None and local.env["RANK"] == str(i) and local.env["WORLD_SIZE"] == "3"
            rec = c.comps[n].table.get(job)
            assert rec is not None and rec.origin == 1 and rec.index_of(n) == i
        assert view["members"][0]["addr"] == "10.9.0.1"
        assert c.comps[1].table.get(job).endpoint == f"10.9.0.1:{endpoint_port(job, 0)}"
        await c.tick()  # every member reports running: the job runs
        assert c.comps[1].view(job)["state"] == "running"
        assert [m["state"] for m in c.comps[1].view(job)["members"]] == ["running"] * 3
        assert c.comps[2].counts["reports_sent"] == 1 and not c.comps[2].member.unreported
        await c.stop()
    run(go())


def test_a_member_whose_local_job_is_still_being_submitted_is_starting_not_failed(tmp_path) -> None:
    """The hand-over stores the member's record, then submits its local job, which checks paths
    as the owner off the loop and takes a while under load. A tick meanwhile found no local job,
    reported the member failed, and the gang restarted as soon as it was placed (seen in CI)."""
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        gate = asyncio.Event()
        slow = c.jobs[2]
        real = slow.submit

        async def held(*a: Any, **k: Any) -> StandInJob:
            await gate.wait()
            return await real(*a, **k)

        slow.submit = held  # type: ignore[method-assign]
        placing = asyncio.ensure_future(c.comps[1].submit(spec3(), 1000, 1000))
        for _ in range(200):
            if c.comps[2].table.jobs:
                break
            await asyncio.sleep(0.005)
        (job,) = list(c.comps[2].table.jobs)
        c.comps[2].tick(c.now)  # its local job is not there yet
        for _ in range(20):
            await asyncio.sleep(0)
        assert c.comps[2].table.get(job).members[1].state is MemberState.STARTING
        assert not c.comps[2].member.unreported and c.comps[2].counts["reports_sent"] == 0
        gate.set()
        view = await placing
        assert view["state"] == "starting" and c.comps[1].counts["restarts"] == 0, view
        await c.tick()
        assert c.comps[1].view(job)["state"] == "running"
        await c.stop()
    run(go())


def test_not_placed_ends_the_job_with_the_reason(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        c.busy = {2, 3}
        view = await c.comps[1].submit(spec3(), 0, 0)
        assert view["state"] == "ended" and view["end_reason"].startswith("not placed: 1 nodes free for 3")
        await c.stop()
    run(go())


@pytest.mark.parametrize("workers,lo,hi,match", [(1, None, None, "2..64"), (65, None, None, "2..64"),
                                                  (3, 4, 5, "min <= workers"), (3, 2, None, "bounds 2:None")])
def test_submit_refuses_bad_worker_counts(tmp_path, workers: int, lo: Any, hi: Any, match: str) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        with pytest.raises(JobError, match=match):
            await c.comps[1].submit(spec3(workers=workers, workers_min=lo, workers_max=hi), 0, 0)
        assert not c.comps[1].table.jobs
        await c.stop()
    run(go())


def test_a_report_the_origin_never_got_is_retried_on_the_next_tick(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        c.deaf = {1}
        await c.tick()
        assert job in c.comps[2].member.unreported  # unanswered: kept
        assert c.comps[1].view(job)["members"][2]["state"] == "starting"
        c.deaf = set()
        await c.tick()
        assert not c.comps[2].member.unreported and c.comps[1].view(job)["state"] == "running"
        await c.stop()
    run(go())


def test_member_exits_and_the_job_ends_ok(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        for n in c.nodes:
            c.jobs[n].all[job].state, c.jobs[n].all[job].exit_code = "exited", 0
        await c.tick()
        v = c.comps[1].view(job)
        assert v["state"] == "ended" and v["end_reason"] == "ok"
        assert [m["state"] for m in v["members"]] == ["exited"] * 3 and [m["code"] for m in v["members"]] == [0] * 3
        await c.stop()
    run(go())


# -- authority ---------------------------------------------------------------------------------


def test_orders_from_a_non_origin_and_reports_from_a_non_member_are_refused(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path, n=4)
        await c.start_all()
        c.busy = {4}
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        # node 3 (a member, not the origin) orders node 2 to stop
        order = wire.MemberRequest(11, OP_ORDER, json.dumps({"job": job, "generation": 0, "do": "stop"}).encode())
        ans = c.comps[2].on_message(3, order)
        assert ans is not None and ans.status == 1 and b"only its origin, node 1" in ans.payload
        assert c.jobs[2].all[job].state == "running"
        # node 4 (no member) reports member 1 failed to the origin; node 3 reports for member 1
        for sender in (4, 3):
            rep = wire.MemberRequest(12 + sender, OP_REPORT, json.dumps(
                {"job": job, "index": 1, "generation": 0, "state": "failed", "code": 1}).encode())
            ans = c.comps[1].on_message(sender, rep)
            assert ans is not None and ans.status == 1 and b"member 1 is node 2's" in ans.payload
        assert c.comps[1].view(job)["members"][1]["state"] == "starting"
        # an unknown job, a bad id, an unknown order: refused by name
        for payload, says in (({"job": "job-9-n1", "generation": 0, "do": "stop"}, b"job-9-n1: unknown here"),
                              ({"job": "x; rm", "generation": 0, "do": "stop"}, b"expected a multi-node job id"),
                              ({"job": job, "generation": 0, "do": "explode"}, b"expected one of stop")):
            ans = c.comps[2].on_message(1, wire.MemberRequest(20, OP_ORDER, json.dumps(payload).encode()))
            assert ans is not None and ans.status == 1 and says in ans.payload
            c.comps[2].messages._answered.clear()
        # an order of an older generation is ignored
        c.comps[2].table.set_job(c.comps[2].table.get(job), generation=2)
        ans = c.comps[2].on_message(1, wire.MemberRequest(21, OP_ORDER, json.dumps(
            {"job": job, "generation": 1, "do": "stop"}).encode()))
        assert ans is not None and ans.status == 0 and b"ignored" in ans.payload
        assert c.jobs[2].all[job].state == "running"
        await c.stop()
    run(go())


def test_a_repeated_request_is_answered_from_the_cache_and_acted_on_once(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        rep = wire.MemberRequest(99, OP_REPORT, json.dumps(
            {"job": job, "index": 2, "generation": 0, "state": "failed", "code": 1}).encode())
        a1 = c.comps[1].on_message(3, rep)
        a2 = c.comps[1].on_message(3, rep)
        assert a1 == a2 and c.comps[1].counts["restarts"] == 1
        await settle(c.comps.values())
        await c.stop()
    run(go())


def test_a_message_too_large_is_refused() -> None:
    comp = MembersComponent()
    ans = comp.on_message(2, wire.MemberRequest(1, OP_REPORT, b"{" + b" " * 2000 + b"}"))
    assert ans is not None and ans.status == 1 and b"at most" in ans.payload


# -- restart, continue, end ----------------------------------------------------------------------


def test_rigid_member_failure_restarts_every_member_with_the_next_generation(tmp_path) -> None:
    async def go() -> None:
        root = tmp_path / "shared"
        c = Cluster(tmp_path, ckpt_root=str(root))
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        c.comps[1].table.set_job(c.comps[1].table.get(job), last_ckpt=f"{root}/{job}/ckpt-7")
        c.jobs[3].all[job].state, c.jobs[3].all[job].exit_code = "failed", 1
        await c.tick()
        v = c.comps[1].view(job)
        assert v["generation"] == 1 and v["restarts"] == 1 and v["state"] == "starting", v
        for n in c.nodes:
            local = c.jobs[n].all[job]
            assert local.live and local.spec.resume_from == f"{root}/{job}/ckpt-7"
            assert local.env["LAMINAR_CKPT_DIR"] == f"{root}/{job}"
            assert c.comps[n].table.get(job).generation == 1
        assert c.jobs[2].submits == [job, job]  # stopped, then started again
        await c.tick()
        assert c.comps[1].view(job)["state"] == "running"
        await c.stop()
    run(go())


def test_rigid_job_past_max_restarts_ends_failed_and_stops_the_others(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        c.comps[1].s["max_restarts"] = 0
        await c.tick()
        c.jobs[2].all[job].state, c.jobs[2].all[job].exit_code = "failed", 137
        await c.tick()
        v = c.comps[1].view(job)
        assert v["state"] == "ended" and v["end_reason"].startswith("failed: member 1 failed")
        assert c.jobs[1].all[job].state == "stopped" and c.jobs[3].all[job].state == "stopped"
        await c.stop()
    run(go())


def test_elastic_member_failure_continues_resizing_while_min_live(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(workers_min=2, workers_max=3), 0, 0))["id"]
        await c.tick()
        c.jobs[3].all[job].state, c.jobs[3].all[job].exit_code = "failed", 1
        await c.tick()
        v = c.comps[1].view(job)
        assert v["state"] == "resizing" and v["generation"] == 0 and v["members"][2]["state"] == "failed"
        assert c.jobs[2].all[job].live  # nobody was stopped
        for n in (1, 2):
            c.jobs[n].all[job].state, c.jobs[n].all[job].exit_code = "exited", 0
        await c.tick()
        v = c.comps[1].view(job)
        assert v["state"] == "ended" and v["end_reason"] == "ok with 2 of 3 members"
        await c.stop()
    run(go())


def test_a_dead_node_makes_its_member_lost_and_the_job_re_places_it(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path, n=4)
        await c.start_all()
        c.busy = {4}
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        c.busy = set()
        c.membership.dead = {3}
        c.deaf = {3}
        await c.tick()
        v = c.comps[1].view(job)
        assert v["generation"] == 1 and [m["node"] for m in v["members"]] == [1, 2, 4]
        assert c.comps[1].placer.calls == [3, 1]
        assert c.jobs[4].all[job].env["RANK"] == "2"
        assert c.comps[1].counts["lost"] == 1
        await c.tick()
        assert c.comps[1].view(job)["state"] == "running"
        await c.stop()
    run(go())


def test_stop_orders_every_member_and_only_the_owner_or_root_may(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 1000, 1000))["id"]
        await c.tick()
        with pytest.raises(JobError, match="uid 1000's"):  # (a stop: the API route authorizes)
            await c.comps[1].killswitch(job, True, 1001)
        with pytest.raises(JobError, match="its origin is node 1"):
            await c.comps[2].stop(job, 0)
        v = await c.comps[1].stop(job, 1000)
        assert v["state"] == "ended" and v["end_reason"] == "stopped by uid 1000"
        await settle(c.comps.values())
        assert all(c.jobs[n].all[job].state == "stopped" for n in c.nodes)
        await c.tick()  # the members' stopped reports change nothing more
        assert c.comps[1].view(job)["end_reason"] == "stopped by uid 1000"
        await c.stop()
    run(go())


# -- reattach ----------------------------------------------------------------------------------------


def test_reattach_after_a_restart_of_the_origin_and_of_a_member(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        # the origin's agent and node 2's agent restart (kill -9: no stop): their records come back
        for n in (1, 2):
            c.comps[n]._loop_task.cancel()
            del c.comps[n]
            await c.start(n)
        assert c.comps[1].view(job)["state"] == "running"
        assert [m["state"] for m in c.comps[1].view(job)["members"]] == ["running"] * 3
        assert job in c.comps[2].member.unreported  # told again after its restart: the origin ignores the repeat
        await c.tick()
        assert not c.comps[2].member.unreported and c.comps[1].view(job)["state"] == "running"
        assert c.jobs[2].submits == [job]  # no second copy
        c.jobs[2].all[job].state, c.jobs[2].all[job].exit_code = "failed", 1
        await c.tick()
        assert c.comps[1].view(job)["generation"] == 1
        await c.stop()
    run(go())


def test_reattach_resumes_a_restart_in_flight(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        # the origin stored the restart (generation 1) and died before any relaunch was sent
        origin = c.comps[1]
        rec = origin.table.get(job)
        origin.table.set_job(rec, generation=1, restarts=1)
        from laminar.policy import members as pm

        origin.table.move(rec, pm.Event.RESTART, "test")
        origin._loop_task.cancel()
        del c.comps[1]
        await c.start(1)
        await settle(c.comps.values())
        v = c.comps[1].view(job)
        assert v["state"] == "starting" and v["generation"] == 1
        assert all(c.comps[n].table.get(job).generation == 1 for n in c.nodes)
        await c.stop()
    run(go())


def test_table_keeps_at_most_max_jobs_dropping_the_oldest_ended(tmp_path) -> None:
    from laminar.members.table import MemberRow, MultiRecord, TableFull

    store = Store(tmp_path / "laminar.db")
    t = MemberTable(store, max_jobs=2)

    def rec(i: int) -> MultiRecord:
        return MultiRecord(f"job-{i}-n1", 1, {"command": ["x"]}, 0, 0, MultiState.RUNNING, 2, 2,
                           [MemberRow(0, 1, "a"), MemberRow(1, 2, "b")])
    t.add(rec(1))
    t.add(rec(2))
    with pytest.raises(TableFull, match="members.max_jobs"):
        t.add(rec(3))
    from laminar.policy import members as pm

    t.move(t.get("job-1-n1"), pm.Event.END, "ok")
    t.add(rec(3))
    assert sorted(t.jobs) == ["job-2-n1", "job-3-n1"]
    t.set_member(t.get("job-2-n1"), 1, MemberState.FAILED, 3)
    again = MemberTable(store, max_jobs=2)
    got = {r.job: r for r in again.load()}
    assert sorted(got) == ["job-2-n1", "job-3-n1"]
    assert got["job-2-n1"].members[1].state is MemberState.FAILED and got["job-2-n1"].members[1].code == 3
    store.close()


def test_the_origins_own_member_failing_restarts_the_job(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        c.jobs[1].all[job].state, c.jobs[1].all[job].exit_code = "killed", None
        await c.tick()
        v = c.comps[1].view(job)
        assert v["generation"] == 1 and v["restarts"] == 1 and v["state"] == "starting", v
        assert all(c.jobs[n].all[job].live for n in c.nodes)
        await c.stop()
    run(go())


def test_member_zeros_node_reports_the_newest_verified_checkpoint_and_a_restart_resumes_from_it(tmp_path) -> None:
    """Rank 0 commits into <ckpt_root>/<job> (a real jobkit checkpoint here); member 0's node
    (not the origin) finds it verified, reports it; a corrupt newer one is not taken; the
    restart after a member fails relaunches every member from it."""
    import os

    from laminar import jobkit

    async def go() -> None:
        root = tmp_path / "shared"
        c = Cluster(tmp_path, n=4, ckpt_root=str(root))
        await c.start_all()
        c.busy = {1}
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        c.busy = set()
        assert [m["node"] for m in c.comps[1].view(job)["members"]] == [2, 3, 4]
        ck = jobkit.Checkpointer(job_id=job, ckpt_dir=root / job, install_signal=False)
        good = ck.save(os.urandom(4096), step=10)
        bad = ck.save(os.urandom(4096), step=20)
        victim = next(p for p in bad.iterdir() if p.name != "manifest.json")
        victim.write_bytes(b"rotten")
        await c.tick()
        await c.tick()
        v = c.comps[1].view(job)
        assert v["last_ckpt"] == str(good) and v["last_ckpt_at"] is not None
        c.jobs[3].all[job].state, c.jobs[3].all[job].exit_code = "failed", 1
        await c.tick()
        assert c.comps[1].view(job)["generation"] == 1
        assert all(c.jobs[n].all[job].spec.resume_from == str(good) for n in (2, 3, 4))
        await c.stop()
    run(go())


def test_a_checkpoint_outside_the_jobs_shared_directory_is_refused(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path, ckpt_root=str(tmp_path / "shared"))
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        c.comps[1].messages._answered.clear()
        rep = wire.MemberRequest(5, OP_REPORT, json.dumps({"job": job, "index": 0, "generation": 0, "state": "running",
                                                           "ckpt": "/etc/shadow"}).encode())
        ans = c.comps[1].on_message(1, rep)
        assert ans is not None and ans.status == 1 and b"not under the job's shared directory" in ans.payload
        await c.stop()
    run(go())


def test_member_nodes_follow_the_origins_word_on_the_jobs_state(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        await c.tick()  # the second report round hears "running"
        for n in (2, 3):
            c.jobs[n].all[job].state = "suspended"  # (still running as a member: no report)
        assert c.comps[1].view(job)["state"] == "running"
        assert c.comps[2].view(job)["state"] in ("starting", "running")
        await c.comps[1].stop(job, 0)
        await settle(c.comps.values())
        await c.tick()
        v = c.comps[2].view(job)
        assert v["state"] == "ended" and v["end_reason"] == "stopped by uid 0"
        await c.stop()
    run(go())


def test_reports_that_come_while_placing_are_decided_once_placed(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        placer = c.comps[1].placer
        inner = placer.place

        async def place_then_report(*a: Any, **kw: Any) -> Any:
            res = await inner(*a, **kw)
            await c.tick()  # every member reports running before the placement returns
            return res
        placer.place = place_then_report
        view = await c.comps[1].submit(spec3(), 0, 0)
        assert view["state"] == "running", view
        await c.stop()
    run(go())


def test_a_silent_members_node_is_found_dead_by_the_origins_views_and_replaced(tmp_path) -> None:
    """Nothing else goes to a member's node: the origin's periodic view, unanswered three
    times, makes the zone's liveness call it dead; the member is lost and re-placed."""
    async def go() -> None:
        c = Cluster(tmp_path, n=4)
        await c.start_all()
        c.busy = {4}
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        c.busy = set()
        c.deaf = {3}  # node 3 is gone: nothing it sends or is sent arrives
        await c.tick(3)
        assert c.membership.misses.get(3, 0) >= 3
        await c.tick()
        v = c.comps[1].view(job)
        assert v["generation"] == 1 and [m["node"] for m in v["members"]] == [1, 2, 4], v
        assert c.comps[1].counts["lost"] == 1
        await c.stop()
    run(go())


def test_member_zero_refuses_a_rendezvous_port_a_process_holds() -> None:
    """The endpoint's port bound on this node's address by another process: member 0 refuses
    (the origin tries another node or port); free, or an address not this node's: no refusal."""
    import socket

    from laminar.members.member import _port_taken

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert _port_taken("127.0.0.1", f"127.0.0.1:{port}") == "Address already in use"
    assert _port_taken("127.0.0.1", f"127.0.0.1:{port}") is None
    assert _port_taken("10.255.255.254", "10.255.255.254:29500") is None  # not an address of this host
    assert _port_taken("127.0.0.1", "no port") is None


def test_airlock_suspend_freezes_the_other_members_and_recover_thaws_them(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        m = c.comps[3].member_of(job)
        assert m is not None and (m.index, m.count, m.origin, m.rigid) == (2, 3, 1, True)
        assert c.comps[3].member_of("job-99-n1") is None
        c.jobs[3].all[job].state = "suspended"  # its own Airlock froze it
        c.comps[3].on_airlock(job, "suspend", None)
        await settle(c.comps.values())
        assert [c.jobs[n].all[job].state for n in (1, 2)] == ["suspended", "suspended"]
        c.jobs[3].all[job].state = "running"
        c.comps[3].on_airlock(job, "recover", None)
        await settle(c.comps.values())
        assert [c.jobs[n].all[job].state for n in (1, 2)] == ["running", "running"]
        assert c.comps[1].view(job)["state"] == "running"
        await c.stop()
    run(go())


def test_airlock_kill_of_a_rigid_member_ends_the_job(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 0, 0))["id"]
        await c.tick()
        c.jobs[2].all[job].state = "killed"
        c.comps[2].on_airlock(job, "kill", 42.0)
        await settle(c.comps.values())
        v = c.comps[1].view(job)
        assert v["state"] == "ended" and "killed by Airlock" in v["end_reason"] and v["generation"] == 0, v
        assert c.jobs[1].all[job].state == "stopped" and c.jobs[3].all[job].state == "stopped"
        await c.stop()
    run(go())


def test_killswitch_orders_every_members_switch(tmp_path) -> None:
    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(), 1000, 1000))["id"]
        await c.tick()
        v = await c.comps[1].killswitch(job, True, 1000)
        assert v["killswitch"] == {"0": "killswitch_on", "1": "killswitch_on", "2": "killswitch_on"}
        assert all(c.netguards[n].cut[job] for n in c.nodes)
        await c.comps[1].killswitch(job, False, 0)
        assert not any(c.netguards[n].cut[job] for n in c.nodes)
        await c.stop()
    run(go())


def test_the_origins_view_tells_every_member_node_the_jobs_state_and_the_other_members(tmp_path) -> None:
    """Node 2 hosts member 1: once member 2 failed (elastic: the job resizes, then settles),
    the origin's periodic view tells node 2 the job's state and that member 2 failed; a view with letters
    that are not states, or of the wrong length, changes nothing."""
    from laminar.policy import members as pm

    async def go() -> None:
        c = Cluster(tmp_path)
        await c.start_all()
        job = (await c.comps[1].submit(spec3(workers_min=2, workers_max=3), 0, 0))["id"]
        await c.tick()
        c.jobs[3].all[job].state, c.jobs[3].all[job].exit_code = "failed", 1
        await c.tick()
        assert c.comps[1].view(job)["state"] == "resizing"
        await c.tick()  # (the view of this round may have been sent before the report came)
        v1, v2 = c.comps[1].view(job), c.comps[2].view(job)
        assert v2 is not None and v2["state"] == v1["state"] and v1["state"] in ("resizing", "running")
        assert [m["state"] for m in v2["members"]] == ["running", "running", "failed"]
        rec = c.comps[2].table.get(job)
        assert rec is not None
        for bad in ("rrz", "rr", 7):
            c.comps[2].member.on_view(1, {"job": job, "generation": 0, "members": bad})
            assert [m.state for m in rec.members] == [pm.MemberState.RUNNING, pm.MemberState.RUNNING,
                                                      pm.MemberState.FAILED]
        await c.stop()
    run(go())


def test_member_states_round_trip_as_letters() -> None:
    from laminar.policy import members as pm

    states = tuple(pm.MemberState)
    assert pm.states_of(pm.states_text(states), len(states)) == states
    assert pm.states_of("rq", 2) is None and pm.states_of("r", 2) is None and pm.states_of(None, 0) is None
