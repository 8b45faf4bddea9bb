"""A buddy does not take over a job whose source is silent in the zone during its reclaim window
but still answers: that source is evacuating the job (a move to another node is under way), and
a take-over here would run it twice. A source that does not answer is taken over as before.

Two real components on loopback (the buddy, node 1, and the source, node 2: each a real store,
real transfer endpoint, real authenticated control messages); stand-ins, named as such: the
zones (``FakeZone``: membership and keys, no sockets) and the job managers (``Jobs``).
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from types import SimpleNamespace

from jobrig import until
from test_migrate_evidence import FakeZone, make_agent
from test_replica_gc import KEY, Jobs, K, Source, started

from laminar.migrate.reclaim import ReclaimComponent


def state_of(comp: ReclaimComponent, key: str) -> str:
    row = comp.agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
    return str(row["state"]) if row else ""


def test_a_source_silent_in_its_window_that_answers_keeps_its_job(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        agent_b, buddy = await started(tmp_path / "b")
        agent_a = make_agent(tmp_path / "a")
        agent_a.jobs = Jobs()
        agent_a.jobs.jobs.append(SimpleNamespace(id="job-1", state="running", ended=None, spec=None))
        source = ReclaimComponent()
        await source.start(agent_a)
        zone_a = FakeZone([1, 3])
        zone_a.node_id = 2
        zone_a.keys = {1: KEY}
        agent_a.zone = zone_a
        try:
            buddy.s["port"] = source.port  # the buddy's control messages to node 2 reach the source
            seen: list[str] = []
            agent_b.events.subscribe(lambda e: seen.append(str(e.get("message", ""))))
            src = Source(tmp_path, buddy, 2, K)
            await src.send(5)
            await src.ctl("guard", "ckpt-5")
            assert state_of(buddy, K) == "guarding"
            now = time.time()
            buddy.notices[2] = (now + 60, now - 10)  # its reclaim was announced 10 s ago, 60 s left
            agent_b.zone.membership.state[2].last_seen = now - 10  # and nothing heard since
            await buddy._guard_round()
            assert await until(lambda: not buddy._taking)
            assert state_of(buddy, K) == "guarding"  # asked, answered "running there": not taken over
            assert any("answers: its job lives there" in m for m in seen), seen

            await source.stop()  # the source is gone for good: no answer now
            buddy._alive_asked[K] = -math.inf
            await buddy._guard_round()
            assert await until(lambda: not buddy._taking, timeout=30)
            assert state_of(buddy, K) != "guarding"  # taken over (resumed, or waiting for room)
        finally:
            await buddy.stop()
            agent_b.store.db.close()
            agent_a.store.db.close()

    asyncio.run(main())
