"""A node under reclaim, or reclaimed (its window ended, the reclaim not withdrawn), claims
nothing from the archive (Archive.run_round): the job it would claim would sit queued
on a node its owner has taken back, while the claim told every other node (the job's keeper's
keeper included) that a node runs it. A withdrawn reclaim (``reclaim`` None again) claims as before.

A real component, not started, and a real archive in a temporary directory; the claim's own work
(:meth:`Claims.claim_and_resume`, which resumes the job) is replaced by a recorder: what is asserted is
which records the round hands to it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from archiverig import record, zone_of
from standin_agent import standin_agent

from laminar.components import MigrateAgent
from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.schema import REPLICAS_SCHEMA
from laminar.store import Store


def component(node: int, archive: Path, state: Path) -> ReclaimComponent:
    c = ReclaimComponent()
    state.mkdir(parents=True, exist_ok=True)
    store = Store(state / "state.db")
    with store.tx() as db:
        for stmt in REPLICAS_SCHEMA:
            db.execute(stmt)
    jobs = SimpleNamespace(get=lambda jid: None, active=lambda: [], list=lambda: [])
    c.agent = standin_agent(MigrateAgent, zone=zone_of(node), jobs=jobs, store=store, config=SimpleNamespace(state_dir=str(state)))
    c.s = {"archive_dir": str(archive), "prestage_unannounced": 1.0, "archive_gc_s": 3600.0,
           "retry_max_s": 1.0}
    return c


def round_claims(c: ReclaimComponent, reclaim: str | None) -> list[tuple[str, bool]]:
    tried: list[tuple[str, bool]] = []

    async def recorder(key: str, live: bool = False, dead_runner: int | None = None) -> None:
        tried.append((key, live))

    c.archive.claims.claim_and_resume = recorder  # type: ignore[method-assign]
    c.archive.gc.start_sweep = lambda: None  # type: ignore[method-assign]

    async def main() -> None:
        if reclaim is not None:
            task = asyncio.get_running_loop().create_future()
            if reclaim == "ended":
                task.set_result(None)
            c.reclaim = {"task": task, "deadline": 0.0, "cancel": asyncio.Event()}
        try:
            await c.archive.run_round()
            await asyncio.sleep(0)  # the claims it spawned run
        finally:
            c.archive.lane.close()
            c.agent.store.close()

    asyncio.run(main())
    return tried


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    """An archive holding one stopped job's keeper record (node 1's, as its reclaim archived it)."""
    root = tmp_path / "arch"
    job = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2)
    src = component(1, root, tmp_path / "s1")
    src.archive.stopped.publish("n1-job-1", job.save(b"w", step=3), record("n1-job-1", None))
    src.archive.lane.close()
    src.agent.store.close()
    assert (root / "n1-job-1" / "guard.json").exists()
    return root


@pytest.mark.parametrize("reclaim", ["in-window", "ended"])
def test_a_node_under_reclaim_or_reclaimed_claims_nothing(archive: Path, tmp_path: Path, reclaim: str) -> None:
    c = component(2, archive, tmp_path / "s2")
    assert round_claims(c, reclaim) == []
    assert (archive / "n1-job-1" / "guard.json").exists()  # still claimable by a node that stays


def test_a_node_with_no_reclaim_claims_a_stopped_jobs_record(archive: Path, tmp_path: Path) -> None:
    c = component(2, archive, tmp_path / "s2")
    assert round_claims(c, None) == [("n1-job-1", False)]


def test_a_withdrawn_reclaim_claims_again(archive: Path, tmp_path: Path) -> None:
    # Withdraw.cancel_reclaim sets ``reclaim`` to None (withdraw.py): the node stays, and claims again
    c = component(2, archive, tmp_path / "s2")
    assert round_claims(c, "ended") == []
    c2 = component(2, archive, tmp_path / "s2")
    assert round_claims(c2, None) == [("n1-job-1", False)]


