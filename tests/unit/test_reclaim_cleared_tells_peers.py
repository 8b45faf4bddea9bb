"""A node given back by an agent restart (its stored reclaim cleared at the start: the window
ended while no agent ran) tells its peers, as ``reclaim cancel`` does (``reclaim-withdrawn``),
and they forget its notice. Before, they kept it and counted the node dead by its ended window:
a peer that could not reach it when it asked before claiming its running job's archived copy (a
partition) claimed it and ran the job a second time (bench/chaos.py --concurrent 2).

Two real components on loopback (node 2, restarted with its stored reclaim; node 1, its peer
holding the notice: each a real store, transfer endpoint and authenticated control messages);
stand-ins, named as such: the zones (``FakeZone``) and the job managers (``Jobs``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from jobrig import until
from test_replica_gc import started
from test_replica_keeper_window import source_node, stop_both

from laminar.migrate.schema import RECLAIM_SCHEMA


def test_a_reclaim_cleared_at_the_start_is_withdrawn_at_the_peers(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        agent_b, peer = await started(tmp_path / "b")  # node 1
        now = time.time()
        peer.notices[2] = (now - 10.0, now - 70.0)  # node 2's 60 s window ended 10 s ago
        assert peer.takeover.source_dead(2, now) == "node 2's reclaim window ended"

        events: list[dict[str, Any]] = []

        def stored_reclaim(agent: Any) -> None:  # node 2, restarted: its reclaim is stored
            agent.store.ensure_schema("migrate-reclaim", RECLAIM_SCHEMA)
            with agent.store.tx() as db:
                db.execute("INSERT INTO migrate_reclaim VALUES (?, ?, ?, ?, ?)", (2, 60.0, "owner", now - 70.0, now - 10.0))
            agent.events.subscribe(events.append)

        agent_a, source, _ = await source_node(tmp_path / "a", stored_reclaim)
        source.s["port"] = peer.port  # node 2's control messages reach node 1
        try:
            assert [e["phase"] for e in events if e.get("phase") == "reclaim-cleared"] == ["reclaim-cleared"]
            assert await until(lambda: 2 not in peer.notices, timeout=20), "node 1 still holds node 2's notice"
            assert peer.takeover.source_dead(2, time.time()) is None
        finally:
            await stop_both(peer, source, agent_b, agent_a)

    asyncio.run(main())
