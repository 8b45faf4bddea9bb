"""A holder's guard of a stopped job (``take_over``) stands down when the job's own node runs it
again. The node, reclaimed with no room in the zone, stopped the job and left its final
checkpoint with a holder (waiting for room) and in the archive; given back, it claimed the job
from the archive and resumed it itself. Before, the holder learned that only from the archive's
running record, which goes once the resumed job's own copy is archived; a holder that found room
after that resumed the job a second time (bench/chaos.py: two processes of one job for 23 s).
Now a waiting ``take_over`` guard whose source is heard from after the guard came asks it
(control op ``needs``), and the source answers ``runs_as`` when it runs the key again: the guard
is released. Any other answer (the job stopped there) goes on with the take-over as before.

Two real components on loopback (the holder, node 1, and the source, node 2: each a real store,
transfer endpoint and authenticated control messages; the checkpoint is a real jobkit one sent
with the real transfer); stand-ins, named as such: the zones (``FakeZone``) and the job
managers (``Jobs``); the job's start on the holder is recorded, not run (``Guard.resume_here``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jobrig import until
from test_replica_gc import KEY, K, Source, started
from test_replica_guard_window import source_asked_by, state_of, stop_both

from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.transfer import send_control
from laminar.runtime.provenance import JobOrigin


def test_a_waiting_holder_stands_down_when_the_source_runs_the_job_again(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        agent_b, holder = await started(tmp_path / "b")  # node 1
        agent_a, source, asked = await source_asked_by(tmp_path / "a", holder, ReclaimComponent(), ())
        stopped = SimpleNamespace(id="job-1", state="reclaimed", ended=None, spec=SimpleNamespace(env={}))
        agent_a.jobs.jobs.append(stopped)
        holder.s["port"] = source.port  # the holder's control messages to node 2 reach the source
        events: list[dict[str, Any]] = []
        agent_b.events.subscribe(events.append)
        resumed: list[str] = []

        async def resume_here(row: Any, req: dict[str, Any], path: Path, why: str) -> str | None:
            resumed.append(f"{row['key']} {path.name}")  # (the job's start: not what is tested)
            return None

        holder.guarding.resume_here = resume_here  # type: ignore[method-assign]

        async def held_and_waiting(ckpt: str) -> None:
            """Node 2 stopped job-1 and handed its checkpoint and guard to the holder, which found
            no room and waits; node 2 is heard from since."""
            await send_control("127.0.0.1", holder.port, KEY, "guard",
                               {"key": K, "src_node": 2, "src_job": "job-1", "ckpt": ckpt,
                                "request": {"spec": {"command": ["train"]}, "gpus": 0, "take_over": True,
                                            "owner_uid": 65534, "owner_gid": 65534}},
                               zone=1, node="2")
            holder.guarding.wait_for_room(K, "node 2 stopped the job and left its checkpoint here", "no room", None)
            holder.agent.store.db.execute("UPDATE migrate_retry SET next_at=0 WHERE key=?", (K,))
            holder.agent.store.db.commit()
            assert state_of(holder, K) == "waiting"
            agent_b.zone.membership.state[2].last_seen = time.time() + 0.01  # heard from after the guard

        try:
            await Source(tmp_path, holder, 2, K).send(5)
            # node 2 claimed the job back from the archive and runs it as job-2
            agent_a.jobs.jobs.append(SimpleNamespace(id="job-2", state="running", ended=None,
                                                     spec=SimpleNamespace(env={}),
                                                     origin=JobOrigin(migrated_from=K)))
            await held_and_waiting("ckpt-5")
            await holder.guarding.tick(time.time())
            assert await until(lambda: not holder.guarding.taking)
            assert resumed == [], "the job its source runs again was resumed here too"
            assert state_of(holder, K) == "released"
            assert asked == [f"needs {K}"], asked
            ended = [e for e in events if e.get("phase") == "guard-ended"]
            assert ended and "runs n2-job-1 again, as job-2" in ended[0]["message"], ended

            # the job stopped there and nothing runs it: the holder resumes it, as before (asked)
            agent_a.jobs.jobs.remove(agent_a.jobs.get("job-2"))
            await Source(tmp_path / "again", holder, 2, K).send(6)
            await held_and_waiting("ckpt-6")
            await holder.guarding.tick(time.time())
            assert await until(lambda: not holder.guarding.taking)
            assert resumed == [f"{K} ckpt-6"], resumed
            assert asked[-1] == f"needs {K}"
        finally:
            await stop_both(holder, source, agent_b, agent_a)

    asyncio.run(main())
