"""A peer this agent has not heard from since it started is silent since that start, not forever.

Before, ``Takeover.source_dead`` took a peer never heard from (zone membership's ``last_seen`` -1, which
every peer has when an agent starts) for silent forever. With ``orphan_after_s`` set (the spot
deployment), an agent's first keeper and archive rounds after a restart, before any summary had
come, took every peer for gone: they claimed live records of jobs that still ran on their nodes
from the archive and resumed them a second time (bench/chaos.py: a node given back by an agent
restart resumed node 2's running job from its periodic copy at once: "node 2 and its keeper are
gone").

A real component started on a real store (its transfer endpoint on loopback) and a real archive
directory with a real jobkit checkpoint and live record; stand-ins, named as such: the zone
(``FakeZone``: membership only, set as a zone that just started: no peer heard yet) and the job
manager; the job's start is recorded, not run (``Takeover.resume_here``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from archiverig import agent_of, record, reseal, zone_keys
from test_migrate_archive_gc import ckpt_of
from test_replica_gc import KEY, started

from laminar.migrate.archive_view import LIVE_RECORD


def test_a_peer_not_heard_since_the_start_counts_as_silent_only_since_then(tmp_path: Path) -> None:
    async def main() -> None:
        agent, c = await started(tmp_path)
        try:
            c.s.update(orphan_after_s=30.0, dead_after_s=10.0)
            for st in agent.zone.membership.state.values():
                st.last_seen = -1.0  # as a zone that just started: nobody heard yet
            now = time.time()
            c._started = now - 5.0  # up 5 s
            assert c.takeover.source_dead(2, now) is None
            c._started = now - 31.0  # up 31 s, and still nothing from node 2
            assert c.takeover.source_dead(2, now) == "node 2 silent for 31.0 s"
            agent.zone.membership.state[2].last_seen = now - 12.0  # heard 12 s ago: silent since then
            assert c.takeover.source_dead(2, now) is None
            agent.zone.membership.state[2].last_seen = now - 40.0  # (before a restart 31 s ago: cannot be)
            assert c.takeover.source_dead(2, now) == "node 2 silent for 31.0 s"
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_an_agent_that_just_started_does_not_claim_a_live_record_of_a_peer_it_has_not_heard_yet(
        tmp_path: Path) -> None:
    async def main() -> None:
        arch = tmp_path / "arch"
        agent, c = await started(tmp_path / "agent")
        resumed: list[str] = []

        async def resume_here(row: Any, req: dict[str, Any], path: Path, why: str) -> str | None:
            resumed.append(f"{row['key']} {path.name}: {why}")  # (the job's start: not what is tested)
            return None

        c.takeover.resume_here = resume_here  # type: ignore[method-assign]
        try:
            c.s.update(archive_dir=str(arch), orphan_after_s=30.0, dead_after_s=10.0)
            # node 2's running job has its periodic copy in the archive, node 3 its keeper
            agent_of(2, arch, zone_keys(KEY.hex())).archive.periodic.publish_live("n2-job-1", ckpt_of(tmp_path, "j1", 40),
                                                                 record("n2-job-1", keeper=3))
            for st in agent.zone.membership.state.values():
                st.last_seen = -1.0  # this agent just (re)started: no peer heard from yet
            c._started = time.time()
            await c.archive.run_round()
            await asyncio.sleep(0.2)
            assert resumed == [], "a job that runs on node 2 was resumed here as well"
            assert (arch / "n2-job-1" / LIVE_RECORD).exists()

            # 31 s on, nothing from node 2 or its keeper: gone, and the job is claimed here
            c._started -= 31.0
            then = time.time() - 31.0  # its live record was written as long ago (a fresh one says its node is alive)
            reseal(agent_of(2, arch, zone_keys(KEY.hex())), arch / "n2-job-1" / LIVE_RECORD, ts=then)
            await c.archive.run_round()
            for _ in range(100):
                if resumed:
                    break
                await asyncio.sleep(0.05)
            assert resumed == ["n2-job-1 ckpt-40: node 2 and its keeper are gone; claimed its periodic "
                               "checkpoint from the archive"], resumed
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_a_restarted_agent_drops_the_live_record_of_a_job_that_ended_after_the_restart(tmp_path: Path) -> None:
    """The agent archived its job's periodic checkpoint (live record), restarted (what it
    archived is kept in memory only), and then the job ended here (stopped: another node runs
    it). Before, its live record stayed, and a node that later took this one for gone resumed
    the ended lineage from it (bench/chaos.py --fence-after-s, seed 29). The first archive round
    after a start finds this node's live records, so the drop happens as without a restart."""
    async def main() -> None:
        arch = tmp_path / "arch"
        keys = zone_keys(KEY.hex())
        agent_of(1, arch, keys).archive.periodic.publish_live("n1-job-3", ckpt_of(tmp_path, "j3", 40), record("n1-job-3", keeper=2))
        agent_of(2, arch, keys).archive.periodic.publish_live("n2-job-1", ckpt_of(tmp_path, "j1", 40), record("n2-job-1", keeper=3))
        agent, c = await started(tmp_path / "agent")  # node 1, just (re)started: nothing in archive.live
        ended = SimpleNamespace(id="job-3", state="migrated", active=False)
        agent.jobs.jobs.append(ended)
        try:
            c.s.update(archive_dir=str(arch), orphan_after_s=30.0)
            assert c.archive.periodic.live == {}
            await c.archive.run_round()
            assert not (arch / "n1-job-3" / LIVE_RECORD).exists()
            assert (arch / "n2-job-1" / LIVE_RECORD).exists()  # another node's: not this one's to drop
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())
