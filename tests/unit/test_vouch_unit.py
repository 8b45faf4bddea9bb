"""Other members' word on a silent peer (laminar/migrate/vouch.py): a node silent here is taken
for gone after ``orphan_after_s`` only when the members asked (control op ``heard``) did not hear
it within that time either (a partial partition: the link between this node and it is down, the
rest of the zone still hears it).

A real component started on a real SQLite store with its real transfer endpoint on loopback:
the ``heard`` question it answers is a real authenticated control message from node 2.
Stand-ins, named as such: the zone (``FakeZone``: membership only), and, for the questions this
node asks, its ``_control`` (``Peers``: answers as the members would; the whole path over real
agents and a real partial partition is tests/cluster/test_partial_partition.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from test_replica_gc import KEY, started

from laminar.migrate.transfer import TransferError, send_control


class Peers:  # stand-in for the control messages this node sends: each member's answer to ``heard``
    def __init__(self, ages: dict[int, Any]) -> None:
        self.ages, self.asked = ages, []  # node -> age it answers (an exception: no answer)

    async def __call__(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any:
        self.asked.append((node, op, body["node"]))
        age = self.ages[node]
        if isinstance(age, BaseException):
            raise age
        return {"node": body["node"], "age": age}


async def settle(c: Any) -> None:
    for _ in range(50):
        if not c.vouch._vouching:
            return
        await asyncio.sleep(0.01)


def test_a_silent_node_another_member_heard_lately_is_not_gone(tmp_path: Path) -> None:
    async def main() -> None:
        agent, c = await started(tmp_path)  # this node is 1; members 2 and 3
        events: list[dict[str, Any]] = []
        agent.events.subscribe(events.append)
        try:
            c.s.update(orphan_after_s=10.0, dead_after_s=3.0)
            now = time.time()
            c._started = now - 100.0
            state = agent.zone.membership.state
            state[2].last_seen, state[3].last_seen = now - 12.0, now - 0.5  # 2 silent here, 3 heard
            c._control = peers = Peers({3: 1.0})  # node 3 heard node 2 a second ago
            assert c.takeover.source_dead(2, now) is None  # the verdict asks node 3 first, and waits
            assert 2 in c.vouch._vouching
            await settle(c)
            assert peers.asked == [(3, "heard", 2)]
            assert c.takeover.source_dead(2, now) is None  # heard by node 3 a second ago: a partial partition
            ev = [e for e in events if e.get("phase") == "heard-elsewhere"]
            assert [(e["node"], e["heard_s"] < 2.0) for e in ev] == [(2, True)]
            assert c.status()["heard_elsewhere"] == [2]
            assert c.takeover.source_dead(2, now + 5.0) is None
            assert len(peers.asked) == 1  # the answer holds while its word is under 10 s old: not asked again
            # its word too old to tell (10.5 s): asked again; node 3 has not heard node 2 for 11 s either: gone
            peers.ages[3] = 11.0
            state[3].last_seen = now + 9.0  # (node 3 still heard here)
            assert c.takeover.source_dead(2, now + 9.5) is None
            await settle(c)
            assert len(peers.asked) == 2
            assert c.takeover.source_dead(2, now + 9.5) == "node 2 silent for 21.5 s"
            assert c.takeover.source_dead(2, now + 9.9) == "node 2 silent for 21.9 s"
            assert len(peers.asked) == 2  # a confirmed silence holds for orphan_after_s
            assert len([e for e in events if e.get("phase") == "heard-elsewhere"]) == 1  # said once

            # node 2 heard here again: what was said of it is forgotten
            state[2].last_seen = now
            c.vouch.tick(now)
            assert 2 not in c.vouch._vouched and c.status()["heard_elsewhere"] == []
            # silent again; an older agent refuses the op: the verdict waits for the question,
            # then this node's silence counts (as before the op)
            state[2].last_seen, state[3].last_seen = now - 12.0, now - 0.5
            peers.ages[3] = TransferError("unknown control operation 'heard'")
            assert c.takeover.source_dead(2, now) is None
            await settle(c)
            assert c.takeover.source_dead(2, now) == "node 2 silent for 12.0 s"
            # node 3 not reached (this node may be the one cut off): held back, asked again after dead_after_s
            c.vouch._vouched.clear()
            peers.ages[3] = OSError(113, "No route to host")
            assert c.takeover.source_dead(2, now) is None
            await settle(c)
            assert c.takeover.source_dead(2, now + 1.0) is None and 2 not in c.vouch._vouching  # (held, not asked again yet)
            assert c.takeover.source_dead(2, now + 3.5) is None and 2 in c.vouch._vouching  # asked again
            await settle(c)
            assert len(peers.asked) == 5
            # node 3 silent here as well, for longer than 6 s (twice dead_after_s): nobody to ask,
            # this node's silence counts at once
            state[3].last_seen = now - 12.0
            assert c.takeover.source_dead(2, now + 3.5) == "node 2 silent for 15.5 s"
            assert not c.vouch._vouching and len(peers.asked) == 5

            # a silence after a reclaim notice (dead_after_s) is asked about the same way
            c.vouch._vouched.clear()
            state[2].last_seen, state[3].last_seen = now - 4.0, now - 0.2
            c.notices[2] = (now + 60.0, now - 20.0)
            peers.ages[3] = 0.5  # node 3 heard node 2 half a second ago
            assert c.takeover.source_dead(2, now) is None
            await settle(c)
            assert c.takeover.source_dead(2, now) is None and len(peers.asked) == 6
            peers.ages[3] = 4.0
            assert c.takeover.source_dead(2, now + 3.0) is None  # its word too old: asked again
            await settle(c)
            assert c.takeover.source_dead(2, now + 3.0) == "node 2 went silent 7.0 s after announcing its reclaim"
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_the_node_answers_when_it_last_heard_a_member(tmp_path: Path) -> None:
    async def main() -> None:
        agent, c = await started(tmp_path)
        try:
            now = time.time()
            agent.zone.membership.state[3].last_seen = now - 4.0

            async def ask(body: Any) -> Any:
                return await send_control("127.0.0.1", c.port, KEY, "heard", body, zone=1, node="2")

            got = await ask({"node": 3})
            assert got["node"] == 3 and 4.0 <= got["age"] < 6.0, got
            agent.zone.membership.state[3].last_seen = -1.0  # not heard since this agent started
            assert await ask({"node": 3}) == {"node": 3, "age": None}
            assert (await ask({"node": 9}))["age"] is None  # not a member: never heard
            with pytest.raises(TransferError, match=r"heard: node 'x' is not a node id"):
                await ask({"node": "x"})
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_a_lying_member_alone_holds_a_take_over_back_only_so_long_and_two_must_agree(tmp_path: Path) -> None:
    """A compromised member answers ``heard`` with age 0 for every node: before, no silent
    node's job was ever taken over while it answered. Now, where two members answer, the second
    shortest age counts (node 4, honest, has not heard node 2 either: the silence counts at
    once); a lone member's word holds a take-over back at most VOUCH_LONE_HOLDS times the
    silence asked about, once per silence (an event says so), and each hold is counted per
    member (status ``heard_vouchers``)."""
    from test_migrate_evidence import FakeZone

    from laminar.migrate.vouch import VOUCH_LONE_HOLDS

    async def main() -> None:
        agent, c = await started(tmp_path)  # this node is 1
        agent.zone = FakeZone([2, 3, 4])
        events: list[dict[str, Any]] = []
        agent.events.subscribe(events.append)
        try:
            c.s.update(orphan_after_s=10.0, dead_after_s=3.0)
            now = time.time()
            c._started = now - 100.0
            state = agent.zone.membership.state
            state[2].last_seen = now - 12.0  # node 2 silent here
            state[3].last_seen = state[4].last_seen = now - 0.5
            c._control = peers = Peers({3: 0.0, 4: 12.0})  # node 3 lies; node 4 has not heard node 2 either
            assert c.takeover.source_dead(2, now) is None
            await settle(c)
            assert sorted(n for n, _, _ in peers.asked) == [3, 4]
            assert c.takeover.source_dead(2, now) == "node 2 silent for 12.0 s"  # the second shortest: 12 s
            assert c.status()["heard_vouchers"] == {}

            # node 3 the only one to ask (node 4 not heard lately): its word alone holds the verdict back...
            c.vouch._vouched.clear()
            state[4].last_seen = now - 100.0
            peers.ages = {3: 0.0}
            assert c.takeover.source_dead(2, now) is None
            await settle(c)
            assert c.takeover.source_dead(2, now) is None and c.status()["heard_vouchers"] == {"3": 1}
            bound = VOUCH_LONE_HOLDS * 10.0

            async def asked_at(t: float) -> None:  # node 3 asked again at ``t`` (its answer dated then)
                state[3].last_seen = t - 0.5
                c.vouch._vouched.clear()
                assert c.takeover.source_dead(2, t) is None
                await settle(c)
                at, age, reached = c.vouch._vouched[2]
                c.vouch._vouched[2] = (t, age, reached)

            await asked_at(now + bound - 1.0)
            assert c.takeover.source_dead(2, now + bound - 1.0) is None  # ... for up to the bound,
            await asked_at(now + bound + 1.0)
            assert c.takeover.source_dead(2, now + bound + 1.0) == f"node 2 silent for {12.0 + bound + 1.0:.1f} s"  # no more
            ignored = [e for e in events if e.get("phase") == "heard-elsewhere-ignored"]
            assert len(ignored) == 1 and ignored[0]["voucher"] == 3, ignored
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())
