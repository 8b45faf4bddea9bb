"""A storage keeper of a stopped job (``take_over``) stands down when the job's own node runs it
again. The node, reclaimed with no room in the zone, stopped the job and left its final
checkpoint with a keeper (waiting for room) and in the archive; given back, it claimed the job
from the archive and resumed it itself. Before, the keeper learned that only from the archive's
running record, which goes once the resumed job's own copy is archived; a keeper that found room
after that resumed the job a second time (bench/chaos.py: two processes of one job for 23 s).
Now a waiting ``take_over`` keeper whose source is heard from after the keeper came asks it
(control op ``needs``), and the source answers ``runs_as`` when it runs the key again: the keeper
is released. Any other answer (the job stopped there) goes on with the take-over as before.

Two real components on loopback (the keeper, node 1, and the source, node 2: each a real store,
transfer endpoint and authenticated control messages; the checkpoint is a real jobkit one sent
with the real transfer); stand-ins, named as such: the zones (``FakeZone``) and the job
managers (``Jobs``); the job's start on the keeper is recorded, not run (``Takeover.resume_here``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jobrig import until
from test_replica_gc import KEY, K, Source, started
from test_replica_keeper_window import source_asked_by, state_of, stop_both

from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.transfer import send_control
from laminar.runtime.provenance import JobOrigin


def test_a_waiting_keeper_stands_down_when_the_source_runs_the_job_again(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        agent_b, keeper = await started(tmp_path / "b")  # node 1
        agent_a, source, asked = await source_asked_by(tmp_path / "a", keeper, ReclaimComponent(), ())
        stopped = SimpleNamespace(id="job-1", state="reclaimed", ended=None, spec=SimpleNamespace(env={}))
        agent_a.jobs.jobs.append(stopped)
        keeper.s["port"] = source.port  # the keeper's control messages to node 2 reach the source
        events: list[dict[str, Any]] = []
        agent_b.events.subscribe(events.append)
        resumed: list[str] = []

        async def resume_here(row: Any, req: dict[str, Any], path: Path, why: str) -> str | None:
            resumed.append(f"{row['key']} {path.name}")  # (the job's start: not what is tested)
            return None

        keeper.takeover.resume_here = resume_here  # type: ignore[method-assign]

        async def held_and_waiting(ckpt: str) -> None:
            """Node 2 stopped job-1 and handed its checkpoint and keeper to the keeper, which found
            no room and waits; node 2 is heard from since."""
            await send_control("127.0.0.1", keeper.port, KEY, "keeper",
                               {"key": K, "src_node": 2, "src_job": "job-1", "ckpt": ckpt,
                                "request": {"spec": {"command": ["train"]}, "gpus": 0, "take_over": True,
                                            "owner_uid": 65534, "owner_gid": 65534}},
                               zone=1, node="2")
            keeper.takeover.wait_for_room(K, "node 2 stopped the job and left its checkpoint here", "no room", None)
            keeper.agent.store.db.execute("UPDATE migrate_retry SET next_at=0 WHERE key=?", (K,))
            keeper.agent.store.db.commit()
            assert state_of(keeper, K) == "waiting"
            agent_b.zone.membership.state[2].last_seen = time.time() + 0.01  # heard from after the keeper

        try:
            await Source(tmp_path, keeper, 2, K).send(5)
            # node 2 claimed the job back from the archive and runs it as job-2
            agent_a.jobs.jobs.append(SimpleNamespace(id="job-2", state="running", ended=None,
                                                     spec=SimpleNamespace(env={}),
                                                     origin=JobOrigin(migrated_from=K)))
            await held_and_waiting("ckpt-5")
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking)
            assert resumed == [], "the job its source runs again was resumed here too"
            assert state_of(keeper, K) == "released"
            assert asked == [f"needs {K}"], asked
            ended = [e for e in events if e.get("phase") == "keeper-ended"]
            assert ended and "runs n2-job-1 again, as job-2" in ended[0]["message"], ended

            # the job stopped there and nothing runs it: the keeper resumes it, as before (asked)
            agent_a.jobs.jobs.remove(agent_a.jobs.get("job-2"))
            await Source(tmp_path / "again", keeper, 2, K).send(6)
            await held_and_waiting("ckpt-6")
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking)
            assert resumed == [f"{K} ckpt-6"], resumed
            assert asked[-1] == f"needs {K}"
        finally:
            await stop_both(keeper, source, agent_b, agent_a)

    asyncio.run(main())
