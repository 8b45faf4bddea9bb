"""Capacity loaning in the zone component (laminar.zone.loan): loan admission, the loan
messages, return plans and elastic grants. No privileges: a real ZoneComponent on loopback
sockets; jobs come from a stand-in job table (``StandInJobs``: the real JobManager needs root
and cgroups, which the cluster test uses)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ports import free_port
from standin_origin import OriginQueries

from laminar import jobkit
from laminar.policy import placement as pl
from laminar.runtime.provenance import NO_ORIGIN, JobOrigin
from laminar.runtime.spec import JobSpec
from laminar.zone import wire
from laminar.zone.component import ZoneComponent, demand_to_probe
from laminar.zone.loan import OP_QUERY, OP_RETURN, LoanError, fit_payload, plan_from_answers, workers_file


@dataclass
class StandInJob:
    id: str
    spec: JobSpec
    gpus: list[int]
    pid: int | None = None
    state: str = "running"
    owner_uid: int = 0
    owner_gid: int = 0
    ckpt_dir: Path | None = None
    created: float = 0.0
    origin: JobOrigin = NO_ORIGIN  # what the job manager recorded of where it came from

    @property
    def active(self) -> bool:
        return self.state == "running"

    def work_at_risk_s(self, now: float) -> float:
        return max(0.0, now - self.created)


@dataclass
class StandInJobs(OriginQueries):
    state_dir: Path
    jobs: dict[str, StandInJob] = field(default_factory=dict)

    def active(self) -> list[StandInJob]:
        return [j for j in self.jobs.values() if j.active]

    def list(self, all_jobs: bool = True) -> list[StandInJob]:
        return list(self.jobs.values())

    def get(self, job_id: str) -> StandInJob | None:
        return self.jobs.get(job_id)


def make_comp(tmp_path: Path, pool: str = "inference", jobs: Any = None, gpus: int = 4, **loan: Any) -> ZoneComponent:
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    nodes = [{"id": 1, "zone": 1, "addr": f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}", "pool": pool},
             {"id": 2, "zone": 1, "addr": f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}", "pool": "training"}]
    settings = {"node_id": 1, "nodes": nodes, "keys_file": str(keys), "listen": "127.0.0.1",
                "port": int(nodes[0]["addr"].split(":")[1]), "handover_port": free_port(socket.SOCK_STREAM),
                "cpus": 8, "memory_mb": 8000}
    return ZoneComponent(settings=settings, jobs=jobs, gpus=gpus, loan={"elastic_interval_s": 0, **loan})


def run(comp: ZoneComponent, fn: Any) -> Any:
    async def go() -> Any:
        await comp.start(None)
        try:
            r = fn()
            return await r if asyncio.iscoroutine(r) else r
        finally:
            await comp.stop()

    return asyncio.run(go())


def probe(comp: ZoneComponent, pool: str | None, pid: int) -> wire.Body | None:
    return comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1, pool=pool), pid, 2.0))


def test_idle_inference_node_offers_to_training_and_busy_one_refuses(tmp_path):
    comp = make_comp(tmp_path)

    def check() -> None:
        assert comp.loan.lends and comp.loan.loanable
        assert isinstance(probe(comp, "training", 11), wire.Offer)
        comp.loan.set_load(0.9)
        r = probe(comp, "training", 12)
        assert isinstance(r, wire.Refuse) and r.reason == pl.RefuseReason.POOL_BUSY
        # its own pool and demands naming no pool are not loans: decided as before
        assert isinstance(probe(comp, "inference", 13), wire.Offer)
        assert isinstance(probe(comp, None, 14), wire.Offer)
        assert comp.loan.counts["loan_refusals"] == 1
        comp.loan.set_load(0.1)
        assert isinstance(probe(comp, "training", 15), wire.Offer)
        assert comp.loan.is_loan(pl.Demand(gpus=1, pool="training"))
        assert not comp.loan.is_loan(pl.Demand(gpus=1, pool="inference"))

    run(comp, check)


def test_training_node_is_never_a_lender(tmp_path):
    comp = make_comp(tmp_path, pool="training")

    def check() -> None:
        comp.loan.set_load(1.0)
        assert not comp.loan.lends and not comp.loan.loanable
        assert isinstance(probe(comp, "batch", 21), wire.Offer)
        with pytest.raises(LoanError, match="not in the loaning pool"):
            comp.loan.do_return({}, 2)

    run(comp, check)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "high", True, None])
def test_bad_load_is_refused_with_the_value(tmp_path, bad):
    comp = make_comp(tmp_path)
    with pytest.raises(LoanError, match=r"pool load .*expected a number in 0\.\.1"):
        run(comp, lambda: comp.loan.set_load(bad))


def test_loan_messages_round_trip_and_repeats_are_answered_from_cache(tmp_path):
    from laminar.zone.keys import ZoneKeys

    keys = ZoneKeys({1: bytes(32)}, "test")
    enc, dec = wire.Encoder(3, keys, seq0=1), wire.Decoder(keys, {3: 1})
    for body in (wire.LoanRequest(5, OP_QUERY, b"{}"), wire.LoanAnswer(5, 1, b'{"error":"x"}'), wire.LoanRequest(6, 2)):
        assert dec.decode(enc.encode(body, 1, 100.0), 100.0).body == body
    comp = make_comp(tmp_path)

    def check() -> None:
        ans = comp.handle_request(2, wire.LoanRequest(77, OP_QUERY, b"{}"))
        assert isinstance(ans, wire.LoanAnswer) and ans.status == 0
        st = json.loads(ans.payload)
        assert st["node"] == 1 and st["pool"] == "inference" and st["loanable"] and st["jobs"] == []
        bad = comp.handle_request(2, wire.LoanRequest(78, 9, b"{}"))
        assert isinstance(bad, wire.LoanAnswer) and bad.status == 1 and b"unknown loan operation 9" in bad.payload
        # node 2 is of the training pool: it may not return this inference server (loan.return_from)
        refused = comp.handle_request(2, wire.LoanRequest(80, OP_RETURN, b'{"plan":"p0"}'))
        assert isinstance(refused, wire.LoanAnswer) and refused.status == 1, refused
        assert b"loan.return_from" in refused.payload and not comp.loan.returned
        assert comp.authority.counts["loan_return"] == 1
        comp.loan.s["return_from"] = [2]
        first = comp.handle_request(2, wire.LoanRequest(79, OP_RETURN, b'{"plan":"p1"}'))
        assert isinstance(first, wire.LoanAnswer) and json.loads(first.payload)["returned"] is True
        assert comp.loan.returned and not comp.loan.loanable and comp.loan.counts["returns"] == 1
        again = comp.handle_request(2, wire.LoanRequest(79, OP_RETURN, b'{"plan":"p1"}'))
        assert again == first and comp.loan.counts["returns"] == 1  # a retransmission is not a second return
        r = probe(comp, "training", 31)
        assert isinstance(r, wire.Refuse) and r.reason == pl.RefuseReason.POOL_BUSY
        comp.loan.set_load(0.0)  # the inference scheduler says it is idle again: loanable
        assert comp.loan.loanable and not comp.loan.returned

    run(comp, check)


def test_return_plan_picks_the_server_whose_jobs_preempt_least():
    answers = {
        3: {"loanable": True, "jobs": [{"id": "a", "workers": 1, "min": 1, "gpw": 1, "weight": 600.0}]},
        4: {"jobs": [{"id": "b", "workers": 1, "min": 1, "gpw": 1, "weight": 90.0},
                     {"id": "c", "workers": 1, "min": 1, "gpw": 1, "weight": 70.0}]},
        5: {"jobs": [{"id": "d", "workers": 2, "min": 2, "gpw": 1, "weight": 120.0}]},
        6: {"returned": True, "jobs": []},  # already returned: not a candidate
    }
    plan, where = plan_from_answers(answers, 1)
    assert plan.servers == ["5"] and plan.cost == 120.0
    assert [(a.job_id, a.action) for a in plan.actions] == [("n5-d", "requeue")]
    assert where["n5-d"] == (5, "d")
    plan2, _ = plan_from_answers(answers, 2)
    assert plan2.servers == ["5", "4"] and plan2.cost == 280.0
    answers[8] = {"loanable": False, "jobs": []}  # busy serving, nothing lent: not on loan, not a candidate
    assert plan_from_answers(answers, 3)[0].servers == ["5", "4", "3"]
    answers[7] = {"loanable": True, "jobs": []}  # an idle loaned server costs nothing: it goes first
    assert plan_from_answers(answers, 1)[0].servers == ["7"]
    with pytest.raises(LoanError, match="cannot return 5 server"):
        plan_from_answers(answers, 5)


def test_a_long_job_list_is_folded_to_fit_one_datagram():
    jobs = [{"id": f"job-{i:04d}", "workers": 1, "min": 1, "gpw": 0.25, "weight": 10.0, "name": "x" * 20}
            for i in range(60)]
    data = fit_payload({"node": 1, "jobs": jobs}, 1000)
    assert len(data) <= 1000
    st = json.loads(data)
    assert st["jobs_folded"] == 60 and len(st["jobs"]) == 1
    assert st["jobs"][0]["weight"] == 600.0 and st["jobs"][0]["gpw"] == 15.0
    plan, _ = plan_from_answers({1: st, 2: {"jobs": [{"id": "y", "workers": 1, "min": 1, "gpw": 1, "weight": 5}]}}, 1)
    assert plan.servers == ["2"]  # the folded cost still counts in full


def test_idle_gpus_go_to_elastic_jobs_by_the_knapsack_and_are_revoked_when_busy(tmp_path, monkeypatch):
    jobs = StandInJobs(tmp_path / "state")
    for jid, gpu, mx in (("e1", 0, 3), ("e2", 1, 2)):
        jobs.jobs[jid] = StandInJob(jid, JobSpec(["sleep", "1"], elastic_min=1, elastic_max=mx).validate(), [gpu])
    comp = make_comp(tmp_path, jobs=jobs, gpus=4)

    def check() -> None:
        # GPUs 0 and 1 are the two jobs' own (local jobs count against the node), 2 and 3 idle
        comp.refresh_inventory()
        plan = comp.loan.elastic_round()
        assert sum(o.gpus for o in plan.values()) == 2
        granted = comp.loan.granted_gpus()
        assert granted == {2, 3}
        # granted GPUs stay free for placements (a hand-over sheds them), but are not idle
        assert comp.arbiter.view(comp.clock()).gpu_free == (0.0, 0.0, 1.0, 1.0)
        for jid in ("e1", "e2"):
            f = workers_file(jobs.state_dir, jid)
            w = json.loads(f.read_text())
            assert w["workers"] == 1 + len(comp.loan.grants.get(jid, []))
            monkeypatch.setenv("LAMINAR_WORKERS_FILE", str(f))
            assert jobkit.workers() == w["workers"]
        assert comp.loan.elastic_round() == {}  # nothing idle any more
        comp.loan.set_load(0.8)  # the inference node serves again: grants go back
        assert comp.loan.granted_gpus() == set()
        assert all(json.loads(workers_file(jobs.state_dir, j).read_text())["workers"] == 1 for j in ("e1", "e2"))
        assert comp.arbiter.view(comp.clock()).gpu_free == (0.0, 0.0, 1.0, 1.0)
        assert comp.loan.elastic_round() == {}  # busy: no grants

    run(comp, check)
    monkeypatch.delenv("LAMINAR_WORKERS_FILE")
    assert jobkit.workers(default=4) == 4


def test_grants_come_from_the_top_and_give_way_to_placements_and_local_jobs(tmp_path, monkeypatch):
    jobs = StandInJobs(tmp_path / "state")
    jobs.jobs["e"] = StandInJob("e", JobSpec(["sleep", "1"], elastic_min=1, elastic_max=2).validate(), [0])
    comp = make_comp(tmp_path, jobs=jobs, gpus=4)

    def workers() -> dict[str, Any]:
        return dict(json.loads(workers_file(jobs.state_dir, "e").read_text()))

    def check() -> None:
        comp.refresh_inventory()
        plan = comp.loan.elastic_round()
        assert plan["e"].gpus == 1 and comp.loan.granted_gpus() == {3}  # the highest idle GPU
        assert workers()["workers"] == 2 and workers()["gpus"] == [0, 3]
        # a placement takes the lowest free GPUs: an idle one first, no grant shed
        offer = probe(comp, "training", 21)
        assert isinstance(offer, wire.Offer) and [i for i, _ in offer.gpu_alloc] == [1]
        # shedding gives the GPU back: the job is told one worker again, and it is free
        assert comp.loan.shed({3, 2}, "test") == {"e": [3]}
        assert comp.loan.granted_gpus() == set() and comp.loan.counts["sheds"] == 1
        assert workers()["workers"] == 1 and workers()["gpus"] == [0] and "test" in workers()["reason"]
        assert comp.loan.shed({3}, "again") == {}  # nothing granted: nothing to shed, no file change
        # granted again (GPU 3, the offer holds GPU 1); then a local job starts on GPU 3 without the
        # zone: the next round sheds it and grants nothing else (GPU 2 goes, the job is at its max)
        assert comp.loan.elastic_round()["e"].gpus == 1 and comp.loan.granted_gpus() == {3}
        jobs.jobs["local"] = StandInJob("local", JobSpec(["sleep", "1"]).validate(), [3])
        comp.refresh_inventory()
        comp.loan.elastic_round()
        assert comp.loan.granted_gpus() == {2} and workers()["gpus"] == [0, 2]
        assert comp.loan.counts["sheds"] == 2

    run(comp, check)


def test_a_job_is_signalled_only_once_it_catches_sigusr2(tmp_path):
    """SIGUSR2's default action kills: a job still starting (no handler yet) is told by its
    file only, and signalled at a later round once it catches SIGUSR2 (real processes)."""
    import subprocess
    import sys

    starting = subprocess.Popen(["sleep", "30"])
    catching = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                 "signal.signal(signal.SIGUSR2, lambda *a: print('usr2', flush=True))\n"
                                 "print('ready', flush=True)\ntime.sleep(30)\n"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert catching.stdout is not None and catching.stdout.readline().strip() == "ready"
        jobs = StandInJobs(tmp_path / "state")
        jobs.jobs["e"] = StandInJob("e", JobSpec(["sleep", "1"], elastic_min=1, elastic_max=2).validate(), [0],
                                    pid=starting.pid)
        comp = make_comp(tmp_path, jobs=jobs, gpus=2)

        def check() -> None:
            comp.refresh_inventory()
            assert comp.loan.elastic_round()["e"].gpus == 1
            assert json.loads(workers_file(jobs.state_dir, "e").read_text())["workers"] == 2
            assert starting.poll() is None  # not killed by a SIGUSR2 it does not catch
            assert comp.loan.elastic_round() == {}
            with pytest.raises(subprocess.TimeoutExpired):  # still alive: a SIGUSR2 would have killed it
                starting.wait(timeout=0.3)
            # the job's process now catches SIGUSR2 (here: another real process stands in for it)
            jobs.jobs["e"].pid = catching.pid
            comp.loan.elastic_round()
            assert catching.stdout is not None and catching.stdout.readline().strip() == "usr2"
            comp.loan.shed({1}, "test")  # a later change is signalled at once
            assert catching.stdout.readline().strip() == "usr2"

        run(comp, check)
    finally:
        for p in (starting, catching):
            p.kill()
            p.wait()


def test_the_workers_file_is_the_jobs_owners_alone(tmp_path):
    """The count and GPU ids an elastic job is told are readable by its owner (the job runs as
    it) and root only; the directory is reachable, not listable."""
    jobs = StandInJobs(tmp_path / "state")
    jobs.jobs["e1"] = StandInJob("e1", JobSpec(["sleep", "1"], elastic_min=1, elastic_max=3).validate(), [0],
                                 owner_uid=4242, owner_gid=4243)
    comp = make_comp(tmp_path, jobs=jobs, gpus=2)

    def check() -> None:
        comp.refresh_inventory()
        assert comp.loan.elastic_round()
        st = workers_file(jobs.state_dir, "e1").stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (4242, 4243, 0o600)
        assert workers_file(jobs.state_dir, "e1").parent.stat().st_mode & 0o777 == 0o711

    run(comp, check)
