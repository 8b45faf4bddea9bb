"""A pruned job is told from one never given (``JobManager.pruned``), over real cgroups and a
real store.

Once an ended job's record is pruned (``[jobs] keep_ended``, ``keep_ended_s``), ``get`` says
None for it exactly as for an id this node never gave. Whoever answers for an ended job long
after (a keeper still keeping the replica of a job whose release never reached it asks its
source whether the keeper is needed: with no record the source answers "needed", and the keeper
keeps it and resumes the finished job when the source leaves) needs to know that it ended:
``pruned`` says so from the job number floor the store keeps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from jobrig import job_manager
from standin_agent import standin_agent

from laminar.components import MigrateAgent
from laminar.runtime.spec import JobSpec

pytestmark = pytest.mark.kernel


def test_a_pruned_job_is_known_as_pruned_an_unknown_or_kept_one_is_not(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            first = await jobs.submit(JobSpec(["true"], name="lm-t-pr1").validate())
            await jobs.wait(first.id, 30)
            # an ended job still recorded is not pruned; nor is a number never given
            assert jobs.get(first.id) is not None and not jobs.table.pruned(first.id)
            assert not jobs.table.pruned(f"job-{first.num + 1}") and not jobs.table.pruned("job-0")
            assert not jobs.table.pruned("nonsense") and not jobs.table.pruned("job-²") and not jobs.table.pruned("9" * 40)

            jobs.keep_ended = 0
            assert jobs.pruner.prune_ended() == 1 and jobs.get(first.id) is None
            assert jobs.table.pruned(first.id) and jobs.table.pruned(str(first.num))

            running = await jobs.submit(JobSpec(["sleep", "600"], name="lm-t-pr2").validate())
            assert not jobs.table.pruned(running.id)  # has a record (never pruned while it runs)
            await jobs.stop(running.id, "test", grace_s=0)
            assert jobs.get(running.id) is None and jobs.table.pruned(running.id)  # pruned as it ended
            assert not jobs.table.pruned(f"job-{running.num + 1}")

    asyncio.run(main())


def test_a_keeper_asking_about_a_pruned_job_is_told_the_keeper_is_not_needed(tmp_path: Path) -> None:
    """The source's answer to a keeper's ``needs`` question (``Replicas.answer_needs``,
    run over a real job manager; the component's other state is a stand-in with no keeper and
    nothing moving): a job whose record was pruned ended, so its keeper is not needed. Before, no
    record read as "cannot tell": needed, and the keeper kept the replica for good and resumed the
    finished job when this node left."""
    import types

    from laminar.migrate.replicas import Replicas
    from laminar.migrate.takeover import Takeover

    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            done = await jobs.submit(JobSpec(["true"], name="lm-t-pr3").validate())
            await jobs.wait(done.id, 30)
            src = types.SimpleNamespace(node_id=1, agent=standin_agent(MigrateAgent, jobs=jobs), evacuating=set(),
                                        prestage=types.SimpleNamespace(keeper={}, prestaging=set()))
            src.takeover = Takeover(src)  # type: ignore[arg-type]  # (its runs_here: this node runs none again)

            def ask(jid: str) -> dict[str, object]:
                return Replicas(src).answer_needs("2", f"n1-{jid}")  # type: ignore[arg-type]

            assert ask(done.id)["state"] == "exited"  # recorded: keeper_needed decides, as before
            jobs.keep_ended = 0
            assert jobs.pruner.prune_ended() == 1 and jobs.get(done.id) is None
            out = ask(done.id)
            assert out["needed"] is False and out["state"] == "pruned" and "pruned" in str(out["why"]), out
            unknown = ask(f"job-{done.num + 5}")  # a number never given: still "cannot tell"
            assert unknown["needed"] is True and unknown["state"] is None, unknown

    asyncio.run(main())
