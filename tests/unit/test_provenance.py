"""The agent trusts only what it wrote (laminar.runtime.provenance): names it sets in a job's
environment are refused in every spec, with the name and what to use instead; what it knows of a
job's origin comes from its own code and store, never from the job's env; ids a peer must not
guess come from the CSPRNG; ids and keys are checked by full match, ASCII only.

The hand-over and take-over cases run the real zone and migration components (stand-in job
managers, named as such: the job manager's own store queries are tested for real in
tests/kernel/test_provenance_store.py)."""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from standin_agent import standin_agent
from test_loan_component import StandInJob, make_comp
from test_zone_handover import SubmittingJobs

from laminar.components import MigrateAgent
from laminar.migrate import constants
from laminar.migrate.transfer import Manifest, TransferError
from laminar.policy import placement as pl
from laminar.runtime import gpus as gpumod
from laminar.runtime import provenance as pv
from laminar.runtime.provenance import NO_ORIGIN, JobOrigin
from laminar.runtime.spec import JobError, JobSpec, ReservedEnvError
from laminar.zone import wire
from laminar.zone.authority import Policy
from laminar.zone.component import HANDOVER_OK, HANDOVER_REJECTED, demand_to_probe
from laminar.zone.loan import job_row

# every name a job's env may not set, and a word its refusal must carry besides the name
RESERVED = {
    "LM_MIGRATED_FROM": "drop it", "LM_PLACEMENT_ID": "drop it", "LM_GPU_SHARE": "gpus",
    "LM_REQUEUED_FROM": "drop it", "LM_REMAINING_S": "remaining_s", "LM_CKPT_PERIODIC": "periodic_checkpoints",
    "LM_ANYTHING_ELSE": "reserved", "LAMINAR_JOB_ID": "reserved", "LAMINAR_RESUME_FROM": "reserved",
    "CUDA_VISIBLE_DEVICES": "--gpus", "CUDA_DEVICE_ORDER": "drop it",
}


@pytest.mark.parametrize("name", sorted(RESERVED))
def test_each_reserved_name_is_refused_naming_it_and_what_to_use(name: str) -> None:
    with pytest.raises(ReservedEnvError) as e:
        JobSpec.from_dict({"command": ["true"], "env": {"HOME": "/tmp", name: "n1-job-1"}})
    assert repr(name) in str(e.value) and RESERVED[name] in str(e.value), str(e.value)
    assert "HOME" not in str(e.value)


def test_the_defaults_the_agent_gives_a_job_stay_the_users_to_override() -> None:
    spec = JobSpec.from_dict({"command": ["true"], "env": {k: "x" for k in ("PATH", "LANG", "HOME", "USER", "LOGNAME",
                                                                              "CUDA_LAUNCH_BLOCKING", "lm_lower")}})
    assert len(spec.env) == 7


def test_the_cuda_names_are_those_the_agent_sets_for_the_gpus() -> None:
    inv = gpumod.GpuInventory("declared", [gpumod.Gpu(0, "declared")])
    assert set(pv.CUDA_NAMES) == set(gpumod.cuda_env(inv, [0])) == {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"}


def test_many_reserved_names_are_named_within_a_bounded_message() -> None:
    with pytest.raises(JobError) as e:
        JobSpec.from_dict({"command": ["true"], "env": {f"LM_{i:05d}": "" for i in range(1000)}})
    assert "and 992 more" in str(e.value) and len(str(e.value)) < 2000


@pytest.mark.parametrize("value", [0, 0.5, -1, 1e10, math.nan, math.inf, "60", True, None])
def test_remaining_s_is_a_finite_number_of_seconds(value: Any) -> None:
    if value is None:
        assert JobSpec.from_dict({"command": ["x"]}).remaining_s is None
        return
    with pytest.raises(JobError, match=r"remaining_s .*1 to 1e\+09"):
        JobSpec.from_dict({"command": ["x"], "remaining_s": value})


def test_the_new_fields_are_left_out_of_a_spec_at_their_defaults() -> None:
    """An agent of an older release refuses keys it does not know: a job using neither still moves to it."""
    plain = JobSpec.from_dict({"command": ["x"]}).as_dict()
    assert "remaining_s" not in plain and "periodic_checkpoints" not in plain
    given = JobSpec.from_dict({"command": ["x"], "remaining_s": 60, "periodic_checkpoints": False}).as_dict()
    assert given["remaining_s"] == 60.0 and given["periodic_checkpoints"] is False
    assert JobSpec.from_dict(given).as_dict() == given
    with pytest.raises(JobError, match="periodic_checkpoints 'no': expected true or false"):
        JobSpec.from_dict({"command": ["x"], "periodic_checkpoints": "no"})


def test_laminarctl_submit_takes_the_hints_as_flags() -> None:
    from laminarctl.cmd_jobs import build_spec

    base = dict(cmd=["--", "true"], priority=50, name="", job_class="standard", gpus=0, ckpt_signal="SIGUSR1",
                env=[], lent=False, memory=None, cpus=None, cwd=None, resume_from=None, elastic=None)
    spec = build_spec(SimpleNamespace(**base, remaining=120.0, periodic_checkpoints=False))
    assert spec["remaining_s"] == 120.0 and spec["periodic_checkpoints"] is False
    assert JobSpec.from_dict(spec).remaining_s == 120.0
    for bad in (0.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="--remaining"):
            build_spec(SimpleNamespace(**base, remaining=bad, periodic_checkpoints=True))


def test_a_peers_spec_loses_the_agents_own_names_and_keeps_the_users_hints_as_fields() -> None:
    counts: dict[str, int] = {}
    spec = {"command": ["x"], "env": {"A": "1", "LM_MIGRATED_FROM": "n1-job-1", "LM_PLACEMENT_ID": "00ff",
                                      "LM_GPU_SHARE": "0:x", "LM_REQUEUED_FROM": "n2-job-2",
                                      "LM_REMAINING_S": "120", "LM_CKPT_PERIODIC": "off"}}
    out = pv.from_peer(spec, counts, "node 2")
    assert out["env"] == {"A": "1"} and out["remaining_s"] == 120.0 and out["periodic_checkpoints"] is False
    assert counts == {f"env_dropped.{k}": 1 for k in pv.AGENT_ENV}
    assert JobSpec.from_dict(out).env == {"A": "1"}
    assert spec["env"]["LM_MIGRATED_FROM"] == "n1-job-1"  # the caller's dict untouched
    # a hint that does not parse is dropped (counted), never a field; one the spec gives wins
    out = pv.from_peer({"command": ["x"], "env": {"LM_REMAINING_S": "inf"}}, counts)
    assert "remaining_s" not in out and counts["env_dropped.LM_REMAINING_S"] == 1
    out = pv.from_peer({"command": ["x"], "remaining_s": 5.0, "env": {"LM_REMAINING_S": "9"}})
    assert out["remaining_s"] == 5.0
    # the sender's own copy of the origin its request names is no user's: dropped, not counted
    counts.clear()
    pv.from_peer({"command": ["x"], "env": {"LM_MIGRATED_FROM": "n1-job-1"}}, counts, ours={"LM_MIGRATED_FROM": "n1-job-1"})
    assert counts == {}
    # anything else reserved is left for the spec's check to refuse
    with pytest.raises(ReservedEnvError, match="CUDA_VISIBLE_DEVICES"):
        JobSpec.from_dict(pv.from_peer({"command": ["x"], "env": {"CUDA_VISIBLE_DEVICES": "0"}}))


@pytest.mark.parametrize("key", ["n1-job-3\n", "n1-job-3\r", "/etc/passwd", "../n1-job-3", "n١-job-3", ".hidden", "",
                                 "n1-job-3/..", "x" * 129])
def test_an_origin_names_keys_only_in_full_and_ascii(key: str) -> None:
    assert not pv.valid_key(key) and not constants.valid_key(key)
    with pytest.raises(ValueError, match="expected a key"):
        JobOrigin(migrated_from=key).checked()
    with pytest.raises(ValueError, match="expected a key"):
        pv.origin_of_request({"origin": {"requeued_from": key}})
    # a store row holding one (a hand-edited store) reads as no origin
    assert JobOrigin.from_row({"origin_key": key}).migrated_from is None


@pytest.mark.parametrize("share", ["0:x", "0:1e308", "0:inf", "0:nan", "0:1", "0:0", "0:0.5,0:0.25", "5000:0.5",
                                   "0:0.5\n", "٠:0.5", ""])
def test_a_gpu_share_is_checked_in_full(share: str) -> None:
    with pytest.raises(ValueError, match="gpu share"):
        pv.parse_share(share)


def test_a_gpu_share_round_trips() -> None:
    assert pv.parse_share("0:0.5,3:0.25") == ((0, 0.5), (3, 0.25))
    o = JobOrigin(migrated_from="n1-job-2", placement_id=0xABC, gpu_share=((0, 0.5),), requeued_from="n3-job-4",
                  resume_given="/var/lib/laminar/xfer/checkpoints/n1-job-2/ckpt-5").checked()
    row = dict(zip(pv.COLUMNS, o.row(), strict=True))
    assert JobOrigin.from_row(row) == o
    assert o.env() == {"LM_MIGRATED_FROM": "n1-job-2", "LM_PLACEMENT_ID": f"{0xABC:016x}", "LM_GPU_SHARE": "0:0.5",
                       "LM_REQUEUED_FROM": "n3-job-4"}


@pytest.mark.parametrize("name", ["ckpt-5\n", "ckpt-5\r", "ckpt-٥", "ckpt-", "ckpt-5 ", "ckpt-" + "9" * 19])
def test_checkpoint_names_are_full_ascii_matches(name: str) -> None:
    from laminar import jobkit
    from laminar.migrate.replica_policy import _ckpt_step

    assert not constants.valid_ckpt_name(name) and not constants._CKPT_NAME.match(name)
    assert not jobkit._NAME.fullmatch(name) and _ckpt_step(name) == -1
    assert constants.valid_ckpt_name("ckpt-5") and _ckpt_step("ckpt-5") == 5


def test_a_manifest_naming_a_sidecar_with_a_newline_is_refused() -> None:
    from laminar.migrate.transfer import MANIFEST_VERSION

    good = {"v": MANIFEST_VERSION, "job_id": "n1-job-1", "ckpt_id": "ckpt-1", "chunk_size": 1 << 20,
            "files": [["data", 1, "00"]], "chunks": ["00"]}
    Manifest.from_body(good)
    for bad in ("VERIFIED\n", "data\n", "dat\u0430"):  # a newline; a Cyrillic a
        with pytest.raises(TransferError, match="unsafe name"):
            Manifest.from_body({**good, "files": [[bad, 1, "00"]]})
    with pytest.raises(TransferError, match="unsafe name"):
        Manifest.from_body({**good, "ckpt_id": "ckpt-1\n"})


def test_placement_loan_and_notice_ids_come_from_the_csprng(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeding Python's random, or breaking its generator, changes nothing of the ids a peer or
    a local user must not guess (before: the zone's random.Random, Mersenne Twister)."""
    comp = make_comp(tmp_path)

    def broken(*a: Any) -> int:
        raise AssertionError("an id drawn from random.Random")

    async def go() -> tuple[list[int], int]:
        await comp.start(None)
        try:
            monkeypatch.setattr(random.Random, "getrandbits", broken)
            comp.rng.seed(0)
            ids = [comp.submitter.new_placement_id() for _ in range(3)]
            sent: list[Any] = []
            comp.endpoint = SimpleNamespace(send=lambda n, body, **kw: sent.append(body))  # type: ignore[assignment]
            comp.membership.zone_list = lambda z: [1, 2]  # type: ignore[method-assign]
            comp.reclaim_notice(10.0, "test")
            comp.endpoint = None
            return ids, sent[0].notice_id
        finally:
            await comp.stop()

    ids, notice = asyncio.run(go())
    assert len(set(ids)) == 3 and all(i & 1 and 0 < i < 1 << 63 for i in ids)
    assert notice > 0


def test_a_loan_answer_reports_the_recorded_share_never_the_env() -> None:
    """Before, job_row parsed the job's env LM_GPU_SHARE: "0:x" made every loan query to the node
    fail, "0:1e308" reported an infinite weight."""
    spec = JobSpec(["train"], env={"X": "1"}).validate()
    spec.env["LM_GPU_SHARE"] = "0:x"  # an older agent's stored spec (never accepted now)
    job = StandInJob("j1", spec, [], origin=JobOrigin(gpu_share=((0, 0.5),)))
    row = job_row(job, 0.0, 60.0)
    assert row["gpw"] == 0.5 and math.isfinite(row["weight"])
    assert job_row(StandInJob("j2", spec, [1]), 0.0, 60.0)["gpw"] == 1.0


class CountingJobs(SubmittingJobs):
    """The stand-in job table, with the real job manager's refusal counter."""

    provenance_counts: dict[str, int]

    def count_refusal(self, path: str, error: BaseException) -> None:
        k = f"refused.{path}.{'reserved_env' if isinstance(error, ReservedEnvError) else type(error).__name__}"
        self.provenance_counts[k] = self.provenance_counts.get(k, 0) + 1


def handed(tmp_path: Path, req: dict[str, Any], gpus: float = 1.0) -> tuple[wire.HandoverAck, CountingJobs, int]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    jobs = CountingJobs(tmp_path / "state")
    jobs.provenance_counts = {}
    comp = make_comp(tmp_path, pool="training", jobs=jobs, gpus=1)

    async def go() -> tuple[wire.HandoverAck, int]:
        await comp.start(None)
        try:
            pid = 0x5151
            assert isinstance(comp.handle_request(2, demand_to_probe(pl.Demand(gpus=gpus), pid, 30.0)), wire.Offer)
            # a peer's job runs as its owner (nobody, an account of this host: laminar.zone.authority)
            whole = {"owner_uid": 65534, "owner_gid": 65534, **req}
            return await comp.handovers.on_handover(2, wire.Handover(pid, json.dumps(whole).encode())), pid
        finally:
            await comp.stop()

    ack, pid = asyncio.run(go())
    return ack, jobs, pid


def test_a_handover_from_an_older_peer_loses_the_agents_names_and_gets_its_own_origin(tmp_path: Path) -> None:
    """A user of an older node set LM_PLACEMENT_ID / LM_MIGRATED_FROM / LM_GPU_SHARE (accepted
    there): dropped here, counted, and the job is stored with this node's own record of its
    placement and share; the migration key its env claimed is not its origin."""
    ack, jobs, pid = handed(tmp_path, {"spec": {"command": ["sleep", "1"], "env": {
        "A": "1", "LM_PLACEMENT_ID": f"{0x9999:016x}", "LM_MIGRATED_FROM": "n3-job-42", "LM_GPU_SHARE": "0:x"}}},
        gpus=0.5)
    assert ack.status == HANDOVER_OK, ack
    job = jobs.jobs[ack.text]
    assert job.spec.env == {"A": "1"}
    assert job.origin == JobOrigin(placement_id=pid, gpu_share=((0, 0.5),)), job.origin
    assert jobs.provenance_counts == {"env_dropped.LM_PLACEMENT_ID": 1, "env_dropped.LM_MIGRATED_FROM": 1,
                                      "env_dropped.LM_GPU_SHARE": 1}


def test_a_handover_whose_spec_sets_another_reserved_name_is_rejected_naming_it(tmp_path: Path) -> None:
    ack, jobs, _ = handed(tmp_path, {"spec": {"command": ["sleep", "1"], "env": {"CUDA_VISIBLE_DEVICES": "0,1"}}})
    assert ack.status == HANDOVER_REJECTED and "CUDA_VISIBLE_DEVICES" in ack.text, ack
    assert jobs.jobs == {} and jobs.provenance_counts == {"refused.handover.reserved_env": 1}


def test_a_handover_request_names_its_origin_in_its_own_field(tmp_path: Path) -> None:
    ack, jobs, pid = handed(tmp_path, {"spec": {"command": ["sleep", "1"], "env": {"LM_MIGRATED_FROM": "n2-job-7"}},
                                       "origin": {"migrated_from": "n2-job-7", "requeued_from": "n2-job-6"}})
    assert ack.status == HANDOVER_OK, ack
    assert jobs.jobs[ack.text].origin == JobOrigin(migrated_from="n2-job-7", placement_id=pid, requeued_from="n2-job-6")
    assert jobs.provenance_counts == {}  # the sender's copy for older receivers: not a user's
    bad, jobs, _ = handed(tmp_path / "b", {"spec": {"command": ["x"]}, "origin": {"migrated_from": "n2-job-7\n"}})
    assert bad.status == HANDOVER_REJECTED and "expected a key" in bad.text and jobs.jobs == {}


def test_a_forged_placement_env_does_not_answer_a_late_handover(tmp_path: Path) -> None:
    """A local user's job carrying another placement's id in its env (accepted before) answered
    a late repeat of that placement's hand-over as placed: the placer stopped retrying and the
    job never ran. The zone asks the job manager's record of the placement now."""
    jobs = SubmittingJobs(tmp_path / "state")
    spec = JobSpec(["true"]).validate()
    spec.env["LM_PLACEMENT_ID"] = f"{0x7777:016x}"  # (an older agent's stored spec)
    jobs.jobs["job-9"] = StandInJob("job-9", spec, [])
    jobs.jobs["job-3"] = StandInJob("job-3", JobSpec(["true"]).validate(), [], origin=JobOrigin(placement_id=0x7778))
    comp = make_comp(tmp_path, jobs=jobs)
    comp._jobs = jobs
    assert comp.handovers.job_for_placement(0x7777) is None
    assert comp.handovers.job_for_placement(0x7778) == "job-3"


def test_a_stand_in_without_origin_is_no_origin() -> None:
    assert NO_ORIGIN.env() == {} and NO_ORIGIN.row() == (None,) * len(pv.COLUMNS) and len(pv.COLUMNS) == 8


def test_a_take_over_drops_the_agents_names_refuses_the_rest_and_records_its_own_key(tmp_path: Path) -> None:
    """A keeper's stored request (from a source of an older release, or from the archive) whose
    spec env claims another job's key and placement: the job this take-over starts has its own
    key as origin, and what the agent gave it to resume from; a spec with another reserved name is
    refused by the take-over (counted), nothing started."""
    from test_replica_gc import Jobs, K, Source, started

    class SubmittingKeeperJobs(Jobs):
        provenance_counts: dict[str, int] = {}

        async def submit(self, spec: JobSpec, owner_uid: int = 0, owner_gid: int = 0, *,
                         origin: JobOrigin = NO_ORIGIN) -> Any:
            job = SimpleNamespace(id=f"job-{len(self.jobs) + 1}", state="running", ended=None, spec=spec,
                                  origin=origin)
            self.jobs.append(job)
            return job

        def count_refusal(self, path: str, error: BaseException) -> None:
            k = f"refused.{path}.{'reserved_env' if isinstance(error, ReservedEnvError) else 'other'}"
            self.provenance_counts[k] = self.provenance_counts.get(k, 0) + 1

    async def main() -> None:
        agent, comp = await started(tmp_path)
        # the stored requests are root's jobs of node 2, which this node trusts with them (root_from)
        agent.zone.policy = Policy(comp.node_id, root_from=frozenset({2}))
        jobs = SubmittingKeeperJobs()
        jobs.provenance_counts = {}
        agent.jobs = jobs
        try:
            path = await Source(tmp_path, comp, 2, K).send(5)
            row = {"key": K, "src_node": 2, "src_job": "job-1"}
            bad = {"spec": {"command": ["train"], "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "owner_uid": 0, "owner_gid": 0}
            err = await comp.takeover.resume_here(row, bad, path, "test")
            assert err is not None and "CUDA_VISIBLE_DEVICES" in err and jobs.jobs == []
            assert jobs.provenance_counts == {"refused.takeover.reserved_env": 1}
            forged = {"spec": {"command": ["train"], "env": {"A": "1", "LM_MIGRATED_FROM": "n9-job-9",
                                                             "LM_PLACEMENT_ID": f"{0x42:016x}"}},
                      "owner_uid": 0, "owner_gid": 0}
            assert await comp.takeover.resume_here(row, forged, path, "test") is None
            (job,) = jobs.jobs
            assert job.spec.env == {"A": "1"}
            assert job.origin == JobOrigin(migrated_from=K, resume_given=str(path)), job.origin
            assert jobs.provenance_counts["env_dropped.LM_MIGRATED_FROM"] == 1
            assert comp.takeover.runs_here(K) == job.id and comp.takeover.runs_here("n9-job-9") is None
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.run(main())


def test_the_archive_copies_only_a_resume_from_the_agent_gave(tmp_path: Path) -> None:
    """F4: the archive's periodic round copied (as root) a running job's resume_from when it lay
    in the state directory, whoever set it: a user naming another user's checkpoint there had it
    archived as their own job's state. Now only what the agent recorded it gave counts."""
    from laminar.migrate.archive_periodic import PeriodicCopies

    me = SimpleNamespace(host=SimpleNamespace(agent=standin_agent(MigrateAgent, config=SimpleNamespace(state_dir=tmp_path))))
    theirs = str(tmp_path / "ckpt" / "job-5" / "ckpt-100")
    users = SimpleNamespace(spec=JobSpec(["x"], resume_from=theirs), origin=NO_ORIGIN)
    assert PeriodicCopies.given_resume_from(me, users, tmp_path / "arch") is None  # type: ignore[arg-type]
    given = str(tmp_path / "resume" / "n2-job-1" / "ckpt-3")
    agents = SimpleNamespace(spec=JobSpec(["x"], resume_from=given), origin=JobOrigin(resume_given=given))
    assert PeriodicCopies.given_resume_from(me, agents, tmp_path / "arch") == given  # type: ignore[arg-type]
