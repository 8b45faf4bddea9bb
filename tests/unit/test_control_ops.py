"""The migrate component's control ops (issue 32): one table, op -> handler
(``Control.OPS``), with the checks that come before any handler: the body is an
object, the asker a node id, the op a known one (the answer lists them from the table), a
``reclaim`` or ``reclaim-cancel`` only from ``migrate.reclaim_from``, and a reclaim's notice,
cancel or withdrawal dated within 60 s of this node's clock."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from test_migrate_evidence import make_agent

from laminar.migrate.reclaim import ReclaimComponent


def run(coro: Any) -> Any:
    return asyncio.new_event_loop().run_until_complete(coro)


def test_the_ops_are_a_table_and_the_checks_come_first(tmp_path: Path) -> None:
    async def main() -> None:
        agent = make_agent(tmp_path)
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            assert list(comp.control.OPS) == ["keeper", "release", "reclaim", "reclaim-cancel", "reclaim-withdrawn",
                                               "space", "superseded", "needs", "dropped", "taken", "heard"]
            with pytest.raises(ValueError) as e:
                comp.control.answer("2", "gossip", {})
            assert str(e.value) == ("unknown control operation 'gossip' (keeper, release, reclaim, reclaim-cancel, "
                                    "reclaim-withdrawn, space, superseded, needs, dropped, taken, heard)")
            with pytest.raises(ValueError, match="body of 'needs' must be an object"):
                comp.control.answer("2", "needs", [])
            with pytest.raises(ValueError, match="needs: the asking node 'n2' is not a node id"):
                comp.control.answer("n2", "needs", {})
            # reclaim and reclaim-cancel: migrate.reclaim_from only (empty here), before the clock
            for op in ("reclaim", "reclaim-cancel"):
                with pytest.raises(ValueError, match=f"{op} of node {comp.node_id} from node 2: not allowed; "
                                                     "only the nodes in migrate.reclaim_from may"):
                    comp.control.answer("2", op, {"ts": 0})
            comp.s["reclaim_from"] = [2]
            with pytest.raises(ValueError, match=r"^reclaim notice dated 0.0 is more than 60 s from this node's clock$"):
                comp.control.answer("2", "reclaim", {"ts": 0, "notice_s": 30})
            with pytest.raises(ValueError, match=r"^reclaim-cancel dated 5.0 is more than 60 s"):
                comp.control.answer("2", "reclaim-cancel", {"ts": 5})
            # reclaim-withdrawn: from any node (its own reclaim), dated all the same
            with pytest.raises(ValueError, match=r"^reclaim-withdrawn dated 0.0 is more than 60 s"):
                comp.control.answer("3", "reclaim-withdrawn", {})
            assert comp.control.answer("3", "reclaim-withdrawn", {"ts": time.time()}) == {"withdrawn": 3, "keepers": []}
            got = comp.control.answer("2", "reclaim-cancel", {"ts": time.time(), "reason": "test"})
            assert asyncio.iscoroutine(got)  # answered by the endpoint once awaited
            assert (await got)["refused"].startswith(f"node {comp.node_id} has no reclaim to cancel")
        finally:
            await comp.stop()
    run(main())
