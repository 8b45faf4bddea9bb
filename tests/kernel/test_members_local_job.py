"""A multi-node job's member as a real local job (laminar.members with a real JobManager over
real cgroups): the member's job has the job's multi-node id and the launch env over the agent's
own contract; the job number it takes stays the origin's (reserve_num); a second live job of the
id is refused; the member's exit is reported (the origin is this node: in process) and ends the
one-member-here job's record; a relaunch replaces the ended local record with the next
generation. The other nodes of the job are named in its block only (stand-in zone: they are
never asked anything here)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from jobrig import job_manager, until
from standin_agent import standin_agent

from laminar.components import MembersAgent
from laminar.config import load
from laminar.events import EventBus
from laminar.members.component import MembersComponent
from laminar.members.table import MemberRow, MultiRecord
from laminar.policy.members import MultiState
from laminar.runtime.spec import JobError, JobSpec

pytestmark = [pytest.mark.kernel, pytest.mark.serial]


class StandInZone:
    """The zone as the members component reads it: node 1, every node alive."""

    node_id = 1
    endpoint = None

    class membership:  # noqa: N801
        @staticmethod
        def alive(node: int, now: float) -> bool:
            return True

    @staticmethod
    def clock() -> float:
        return 0.0


class NoPlacer:
    """A stand-in gang placer: this test places nothing."""

    async def place(self, *args: Any, **kw: Any) -> Any:
        raise AssertionError("nothing is placed here")


def test_a_member_runs_as_a_real_local_job_with_the_jobs_id_and_env(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            conf = tmp_path / "agent.toml"
            conf.write_text(f"[members]\ntick_s = 60\nckpt_root = {json.dumps(str(tmp_path / 'shared'))}\n")
            agent = standin_agent(MembersAgent, config=load(conf), store=jobs.store, events=EventBus(jobs.store),
                                  jobs=jobs, zone=StandInZone())
            comp = MembersComponent()
            comp.placer = NoPlacer()  # (this node only starts a member: it places nothing)
            await comp.start(agent)
            try:
                job_id = jobs.reserve_multinode_id(1)
                num = int(job_id.split("-")[1])
                # the origin's record (this node is origin and member 0)
                comp.table.add(MultiRecord(job_id, 1, {"command": ["true"]}, 0, 0, MultiState.STARTING, 2, 2,
                                           [MemberRow(0, 1, "10.9.0.1"), MemberRow(1, 2, "10.9.0.2")]))
                out = tmp_path / "env.txt"
                spec = JobSpec(command=["sh", "-c", f'echo "$LAMINAR_JOB_ID $RANK $WORLD_SIZE $LAMINAR_MEMBERS '
                                                    f'$LAMINAR_CKPT_DIR" > {out}'])
                block = {"job": job_id, "origin": 1, "index": 0, "count": 2, "nodes": [[1, "10.9.0.1"], [2, "10.9.0.2"]],
                         "endpoint": "10.9.0.1:29500", "launcher": "plain", "generation": 0}
                assert await comp.start_member(block, spec, 0, 0) == job_id
                with pytest.raises(JobError, match="has it already"):
                    await jobs.submit(JobSpec(command=["true"]), job_id=job_id)
                assert await until(lambda: (j := jobs.get(job_id)) is not None and not j.live, 20)
                assert out.read_text().split() == [job_id, "0", "2", "10.9.0.1,10.9.0.2",
                                                   str(tmp_path / "shared" / job_id)]
                # a later local job takes a number past the multi-node job's
                later = await jobs.submit(JobSpec(command=["true"]))
                assert later.id == f"job-{num + 1}" or int(later.id.split("-")[1]) > num
                comp.tick(0.0)
                for _ in range(100):
                    if not comp._tasks and not comp.member.unreported:
                        break
                    await asyncio.sleep(0.02)
                rec = comp.table.get(job_id)
                assert rec is not None and rec.members[0].state == "exited" and rec.members[0].code == 0
                # the next generation replaces the ended local record
                await comp.start_member({**block, "generation": 1}, spec, 0, 0)
                assert await until(lambda: (j := jobs.get(job_id)) is not None and not j.live, 20)
                assert comp.table.get(job_id).members[0].state == "starting"
                with pytest.raises(JobError, match="expected a multi-node job's id"):
                    await jobs.submit(JobSpec(command=["true"]), job_id="job-1; rm")
            finally:
                await comp.stop()
    asyncio.run(main())
