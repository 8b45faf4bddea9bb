"""Hand-overs on the node side (laminar.zone.handovers.Handovers.on_handover) with a real
component on loopback sockets and real files: a hand-over that fails gives its GPU back, and a resumed job's
checkpoint is verified off the event loop. Jobs come from the stand-in job table of
test_loan_component (the real JobManager needs root and cgroups)."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from standin_agent import standin_agent
from test_loan_component import StandInJob, StandInJobs, make_comp, run
from xferrig import make_ckpt

from laminar.components import ZoneAgent
from laminar.migrate import reclaim
from laminar.migrate.reclaim import ReclaimComponent
from laminar.policy import placement as pl
from laminar.runtime.provenance import NO_ORIGIN, JobOrigin
from laminar.runtime.spec import JobSpec
from laminar.zone import wire
from laminar.zone.component import HANDOVER_NO_RESERVATION, HANDOVER_OK, demand_to_probe
from laminar.zone.loan import workers_file

# a hand-over names its job's owner (a missing one is refused: laminar.zone.authority); nobody
# has an account on every Debian host and needs no zone.root_from
NOBODY_IDS = {"owner_uid": 65534, "owner_gid": 65534}


class ActiveWhenSuspended(StandInJob):
    """A stand-in job that is active while suspended, as the real Job (runtime.record.ACTIVE_STATES)."""

    @property
    def active(self) -> bool:
        return self.state in ("running", "suspended")


class SubmittingJobs(StandInJobs):
    """The stand-in job table with a submit that records the spec (a job 'runs' at once)."""

    async def submit(self, spec: JobSpec, owner_uid: int = 0, owner_gid: int = 0,
                     origin: JobOrigin = NO_ORIGIN) -> StandInJob:
        jid = f"j{len(self.jobs) + 1}"
        self.jobs[jid] = StandInJob(jid, spec, list(spec.gpus or []), origin=origin)
        return self.jobs[jid]


def test_a_hand_over_that_fails_before_its_job_starts_gives_the_gpu_back(tmp_path: Path) -> None:
    """The elastic shed before the job starts fails (its workers file cannot be written: here
    the state directory's 'elastic' entry is a file, as a full or broken disk would fail it):
    the hand-over answers an error and the submitter places the job elsewhere, so the GPU
    must be free again here. It stayed taken by a placed entry with no job, for good (the
    job watcher skips entries without a job id), until the agent restarted."""
    jobs = SubmittingJobs(tmp_path / "state")
    jobs.jobs["e"] = StandInJob("e", JobSpec(["sleep", "1"], elastic_min=1, elastic_max=2).validate(), [0])
    comp = make_comp(tmp_path, pool="training", jobs=jobs, gpus=2)

    async def check() -> None:
        comp.refresh_inventory()
        assert comp.loan.elastic_round()["e"].gpus == 1 and comp.loan.granted_gpus() == {1}
        elastic = jobs.state_dir / "elastic"
        shutil.rmtree(elastic)
        elastic.write_text("not a directory")  # tell_workers' mkdir/write now fail
        pid = 0x5151
        offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 5.0))
        assert isinstance(offer, wire.Offer) and [i for i, _ in offer.gpu_alloc] == [1]
        ack = await comp.handovers.on_handover(2, wire.Handover(pid, json.dumps({"spec": {"command": ["sleep", "1"]}, **NOBODY_IDS}).encode()))
        assert ack.status != HANDOVER_OK
        assert pid not in comp.arbiter.placed  # nothing runs for it here
        assert comp.arbiter.view(comp.clock()).gpu_free == (0.0, 1.0)  # GPU 1 is free again
        # the elastic job was not told to scale in: its grant of GPU 1 stands (a later
        # placement on it sheds it again)
        assert comp.loan.grants == {"e": [1]} and comp.loan.counts["sheds"] == 0
        again = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), 0x5153, 5.0))
        assert isinstance(again, wire.Offer) and [i for i, _ in again.gpu_alloc] == [1]

    run(comp, check)


def test_a_resumed_job_s_checkpoint_is_verified_off_the_event_loop(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A hand-over with ``resume_from`` (a migrated or requeued job) has the migration layer
    verify the checkpoint right before the job starts: every file hashed, 0.8 s per GiB here.
    That ran on the agent's event loop, which then answered no probe, heartbeat or API call
    for seconds on a large checkpoint. The real ReclaimComponent.check_resume runs here, on a
    real jobkit checkpoint; its check (jobkit's, in a child process bounded against storage
    that hangs: ``verify_as_owner``) is watched for the thread that runs it."""
    jobs = SubmittingJobs(tmp_path / "state")
    comp = make_comp(tmp_path, pool="training", jobs=jobs, gpus=1)
    assert comp._settings is not None
    comp._settings["root_from"] = [2]  # root's job (its checkpoint is root's): node 2 may hand those here
    ckpt = make_ckpt(tmp_path, 200_000)
    migrate = SimpleNamespace(root=None)
    migrate.check_resume = functools.partial(ReclaimComponent.check_resume, migrate)
    calls: list[tuple[Path, bool]] = []
    real = reclaim.verify_as_owner

    def spy(p: str, uid: int, gid: int, stall_s: float | None = None) -> None:
        calls.append((Path(p), threading.current_thread() is threading.main_thread()))
        real(p, uid, gid, stall_s)

    monkeypatch.setattr(reclaim, "verify_as_owner", spy)

    async def check() -> None:
        comp.agent = standin_agent(ZoneAgent, migrate=migrate)
        pid = 0x6161
        offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 5.0))
        assert isinstance(offer, wire.Offer)
        spec = {"command": ["sleep", "1"], "resume_from": str(ckpt)}
        ack = await comp.handovers.on_handover(2, wire.Handover(pid, json.dumps({"spec": spec, "owner_uid": 0,
                                                                       "owner_gid": 0}).encode()))
        assert ack.status == HANDOVER_OK, ack.text
        assert jobs.jobs[ack.text].spec.resume_from == str(ckpt)
        hashed = [on_loop for p, on_loop in calls if p.is_relative_to(ckpt)]
        assert hashed and not any(hashed)  # verified, in a worker thread

    run(comp, check)


def test_a_hand_over_onto_the_grant_of_an_elastic_job_frozen_since_the_offer_goes_elsewhere(tmp_path: Path) -> None:
    """The offer took the elastic job's granted GPU while the job ran; Airlock suspended it
    before the hand-over came (the stand-in's state 'suspended'; the cluster test freezes a
    real cgroup). A frozen job cannot scale in, so the hand-over answers 'no reservation'
    (the submitter places the job elsewhere), no job starts, and the grant stands."""
    jobs = SubmittingJobs(tmp_path / "state")
    jobs.jobs["e"] = ActiveWhenSuspended("e", JobSpec(["sleep", "1"], elastic_min=1, elastic_max=2).validate(), [0])
    comp = make_comp(tmp_path, pool="training", jobs=jobs, gpus=2)

    async def check() -> None:
        comp.refresh_inventory()
        assert comp.loan.elastic_round()["e"].gpus == 1 and comp.loan.granted_gpus() == {1}
        pid = 0x7171
        offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 5.0))
        assert isinstance(offer, wire.Offer) and [i for i, _ in offer.gpu_alloc] == [1]
        jobs.jobs["e"].state = "suspended"
        ack = await comp.handovers.on_handover(2, wire.Handover(pid, json.dumps({"spec": {"command": ["sleep", "1"]}, **NOBODY_IDS}).encode()))
        assert ack.status == HANDOVER_NO_RESERVATION and "frozen elastic job" in ack.text, ack
        assert set(jobs.jobs) == {"e"} and pid not in comp.arbiter.placed
        assert comp.loan.grants == {"e": [1]}
        assert json.loads(workers_file(jobs.state_dir, "e").read_text())["workers"] == 2  # not told to scale in
        refused = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), 0x7173, 5.0))
        assert isinstance(refused, wire.Refuse)  # not offered while frozen
        assert comp.loan.elastic_round() == {}  # and a frozen job gets no new grant
        jobs.jobs["e"].state = "running"
        comp.refresh_inventory()
        again = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), 0x7175, 5.0))
        assert isinstance(again, wire.Offer) and [i for i, _ in again.gpu_alloc] == [1]

    run(comp, check)


def test_a_job_that_started_is_answered_ok_even_when_its_record_cannot_be_written(tmp_path: Path) -> None:
    """The hand-over started the job, then recording the placement in the agent's database
    failed (here: another connection holds the real SQLite database's write lock past the
    busy timeout, 'database is locked'). The answer was an error, so the submitter placed the
    job on another node as well: two copies. The job runs: the answer is its id."""
    import sqlite3

    from laminar.store import Store

    jobs = SubmittingJobs(tmp_path / "state")
    comp = make_comp(tmp_path, pool="training", jobs=jobs, gpus=1)
    store = Store(tmp_path / "laminar.db")
    blocker = sqlite3.connect(str(tmp_path / "laminar.db"), isolation_level=None)

    async def go() -> None:
        await comp.start(standin_agent(ZoneAgent, store=store))
        try:
            pid = 0x8181
            offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 30.0))
            assert isinstance(offer, wire.Offer)
            blocker.execute("BEGIN IMMEDIATE")  # the write lock, held
            try:
                body = wire.Handover(pid, json.dumps({"spec": {"command": ["sleep", "1"]}, **NOBODY_IDS}).encode())
                ack = await comp.handovers.on_handover(2, body)
            finally:
                blocker.execute("ROLLBACK")
            assert list(jobs.jobs) == ["j1"]  # the job started
            assert ack.status == HANDOVER_OK and ack.text == "j1", ack
            assert comp.arbiter.placed[pid].job_id == "j1"  # its capacity stays taken
        finally:
            await comp.stop()

    try:
        asyncio.run(go())
    finally:
        blocker.close()
        store.close()


def test_a_hand_over_or_commit_after_the_node_announced_its_reclaim_goes_elsewhere(tmp_path: Path) -> None:
    """The node offered capacity (a live tentative reservation), then its owner announced the
    reclaim (ZoneComponent.reclaim_notice: the node drains; the migration layer moves off the
    jobs running at that moment and arms their kill-switch). A hand-over or a commit arriving
    after that bound the offer all the same: a job started on a node being taken back, which
    the evacuation, planned from the jobs of the notice's moment, does not know of (it dies
    with the node). It must be refused so the submitter places it elsewhere."""
    jobs = SubmittingJobs(tmp_path / "state")
    comp = make_comp(tmp_path, pool="training", jobs=jobs, gpus=2)
    spec = json.dumps({"spec": {"command": ["sleep", "1"]}, **NOBODY_IDS}).encode()

    async def check() -> None:
        comp.refresh_inventory()
        pid, pid2 = 0x7171, 0x7173
        for p in (pid, pid2):
            offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), p, 5.0))
            assert isinstance(offer, wire.Offer)
        comp.reclaim_notice(60.0, "owner takes it back")
        ack = await comp.handovers.on_handover(2, wire.Handover(pid, spec))
        assert ack.status == HANDOVER_NO_RESERVATION, ack
        assert pid not in comp.arbiter.placed and not jobs.jobs  # no job started here
        cack = comp.handle_request(2, wire.Commit(pid2, 30_000))
        assert isinstance(cack, wire.CommitAck) and cack.status == int(pl.RefuseReason.DRAINING), cack
        assert not any(r.committed for r in comp.arbiter.held.values())

    run(comp, check)


class StandInMembers:
    """The members component as the zone's hand-over reaches it: it records each member block
    it is given and starts the member's job in the stand-in job table under the job's id."""

    def __init__(self, jobs: SubmittingJobs) -> None:
        self.jobs = jobs
        self.started: list[dict[str, object]] = []

    def on_message(self, sender: int, body: object) -> None:
        return None

    async def start_member(self, block: dict[str, object], spec: JobSpec, owner_uid: int, owner_gid: int) -> str:
        self.started.append(block)
        jid = str(block["job"])
        self.jobs.jobs[jid] = StandInJob(jid, spec, [])
        return jid


def test_a_member_block_starts_a_member_only_from_its_origin_and_for_this_node(tmp_path: Path) -> None:
    """A hand-over's spec carries a multi-node member block (key ``member``): popped before the
    spec is read, refused unless the sender is the block's origin and this node is its
    ``nodes[index]``, then given to the members component (laminar.members), whose job id the
    ack answers."""
    jobs = SubmittingJobs(tmp_path / "state")
    comp = make_comp(tmp_path, jobs=jobs, gpus=2)
    members = StandInMembers(jobs)

    def block(origin: int, index: int) -> dict[str, object]:
        return {"job": "job-7-n2", "origin": origin, "index": index, "count": 2,
                "nodes": [[2, "127.0.0.2"], [1, "127.0.0.1"]], "endpoint": "127.0.0.2:29517", "generation": 0}

    async def check() -> None:
        comp.agent = standin_agent(ZoneAgent, members=members)
        for pid, (b, says) in enumerate([(block(3, 1), "origin 3, but node 2 sent it"),
                                         (block(2, 0), "member 0 of the block is not node 1")], 0x7171):
            offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 5.0))
            assert isinstance(offer, wire.Offer)
            spec = {"command": ["sleep", "1"], "member": b}
            ack = await comp.handovers.on_handover(2, wire.Handover(pid, json.dumps({"spec": spec, **NOBODY_IDS}).encode()))
            assert ack.status != HANDOVER_OK and says in ack.text, ack
            assert pid not in comp.arbiter.placed
        pid = 0x7173
        offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 5.0))
        assert isinstance(offer, wire.Offer)
        spec = {"command": ["sleep", "1"], "member": block(2, 1)}
        ack = await comp.handovers.on_handover(2, wire.Handover(pid, json.dumps({"spec": spec, **NOBODY_IDS}).encode()))
        assert ack.status == HANDOVER_OK and ack.text == "job-7-n2", ack
        assert members.started == [block(2, 1)] and comp.arbiter.placed[pid].job_id == "job-7-n2"
        assert "member" not in jobs.jobs["job-7-n2"].spec.as_dict()

    run(comp, check)


def test_member_messages_are_routed_to_the_members_component(tmp_path: Path) -> None:
    """MEMBER_REQUEST / MEMBER_ANSWER go to ``agent.members.on_message`` (none: dropped)."""
    comp = make_comp(tmp_path)
    got: list[tuple[int, object]] = []

    class Members(StandInMembers):
        def on_message(self, sender: int, body: object) -> wire.MemberAnswer | None:
            got.append((sender, body))
            return wire.MemberAnswer(5, 0, b"{}") if isinstance(body, wire.MemberRequest) else None

    def check() -> None:
        req, ans = wire.MemberRequest(5, 1, b"{}"), wire.MemberAnswer(6, 0, b"{}")
        assert comp.handle_request(2, req) is None  # no members component: nothing answers
        comp.agent = standin_agent(ZoneAgent, members=Members(SubmittingJobs(tmp_path / "state")))
        assert comp.handle_request(2, req) == wire.MemberAnswer(5, 0, b"{}")
        assert comp.handle_request(2, ans) is None
        assert got == [(2, req), (2, ans)]

    run(comp, check)
