"""An operator's settle of an unanswered hand-over (``laminarctl job settle JOB --run-here|--gone``)
that crosses the node's own answer: the node refuses the hand-over while the settle is being
handed to the wait. The move then tries its next node; the operator's decision was about the
first node and must not be applied to the second one's hand-over.

The real ReclaimComponent over a real store; the zone is a stand-in, named as such
(``TwoNodeZone``: its transport's hand-over to node 2 goes unanswered once, then answers with a
refusal when the test opens its gate; to node 3 it never answers, the frame delivered). The
real-zone settle tests are tests/kernel/test_handover_settle.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jobrig import until
from test_migrate_evidence import make_agent

from laminar.migrate.errors import MigrateError
from laminar.migrate.mover import Move
from laminar.migrate.reclaim import ReclaimComponent
from laminar.policy import moves
from laminar.zone import wire
from laminar.zone.transport import HandoverError


class TwoNodeTransport:
    """Stand-in transport: node 2's first hand-over is not answered, its second waits on
    ``gate`` and is refused; node 3's are never answered (delivered)."""

    def __init__(self) -> None:
        self.asked: dict[int, int] = {2: 0, 3: 0}
        self.gate = asyncio.Event()
        self.sent: list[Any] = []

    async def handover(self, node: int, port: int, msg: Any, timeout: float) -> Any:
        self.asked[node] += 1
        if node == 2 and self.asked[node] >= 2:
            await self.gate.wait()
            return wire.HandoverAck(msg.placement_id, 1, "no live reservation for this placement")
        raise HandoverError("no answer", delivered=True)

    def send(self, node: int, msg: Any) -> None:
        self.sent.append((node, msg))


class TwoNodeZone:
    networked = True

    def __init__(self) -> None:
        self.membership = SimpleNamespace(by_node={n: SimpleNamespace(handover_port=1) for n in (1, 2, 3)},
                                          suspects=set())
        self.submitter = SimpleNamespace(t=TwoNodeTransport())
        self.s = {"handover_timeout_s": 0.1}


def test_a_settle_crossed_by_the_nodes_refusal_is_not_applied_to_the_next_nodes_hand_over(tmp_path: Path) -> None:
    """Node 2 refuses just as the operator settles its unanswered hand-over ``--run-here``; the
    move goes on to node 3 (as ``_move`` does after a refusal), whose frame arrives and is not
    answered. Before, the decision left behind was taken by node 3's wait: it ended at once as
    if the operator had said node 3 does not run the job (the job thawed here while node 3 may
    start it: two copies); with ``--gone``, taken as run by node 3 unasked."""
    async def main() -> None:
        agent = make_agent(tmp_path)
        comp = ReclaimComponent()
        await comp.start(agent)
        agent.zone = zone = TwoNodeZone()
        t = zone.submitter.t
        req = {"spec": {"argv": ["sleep", "1"]}, "owner_uid": 0, "owner_gid": 0}
        try:
            comp.mover.record("job-1", moves.Event.HAND_OVER, reason="lm-t loan return", thaw=True, node=2, pid=11, request=req)
            to2 = asyncio.ensure_future(comp.takeover.handover(2, 11, req, confirm=True, job_id="job-1"))
            assert await until(lambda: t.asked[2] == 2)  # asked again, that answer held at the gate
            settle = asyncio.ensure_future(comp.settle.settle_handover("job-1", "run-here", by="lm-t"))
            assert await until(lambda: comp.takeover.asking["job-1"]["wake"].is_set())  # handed to node 2's wait ...
            t.gate.set()  # ... while node 2's answer comes: a refusal
            try:
                await to2
                raise AssertionError("node 2 refused: the hand-over must fail")
            except MigrateError as e:
                assert "did not start" in str(e) or "operator" in str(e), e
            # the move tries its next node (_move_to: recorded, then handed over)
            comp.mover.record("job-1", moves.Event.HAND_OVER, node=3, pid=12, request=req)
            comp.moves["job-1"] = mv = Move("job-1", "n1-job-1", "lm-t loan return", phase="handover", dest=3)
            to3 = asyncio.ensure_future(comp.takeover.handover(3, 12, req, confirm=True, job_id="job-1"))
            assert await until(lambda: t.asked[3] >= 2 or to3.done())
            assert not to3.done(), f"node 3's hand-over ended on node 2's settle: {to3.exception() or to3.result()}"
            assert await until(settle.done, 10)  # the settle does not hang on node 3's wait
            assert mv.phase == "handover" and not mv.error, mv  # the move to node 3 goes on
            to3.cancel()
            await asyncio.gather(to3, return_exceptions=True)
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.run(main())
