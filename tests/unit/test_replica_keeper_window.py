"""A keeper does not take over a job whose source is silent in the zone during its reclaim window
but still answers: that source is evacuating the job (a move to another node is under way), and
a take-over here would run it twice. A source that does not answer is taken over as before.
After the window's end, only a keeper that may have missed the source's news (restarted since the
keeper came, or silent) asks first; one that was up and heard from the source takes over at once.

Two real components on loopback (the keeper, node 1, and the source, node 2: each a real store,
real transfer endpoint, real authenticated control messages); stand-ins, named as such: the
zones (``FakeZone``: membership and keys, no sockets) and the job managers (``Jobs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jobrig import until
from standin_agent import standin_agent
from test_migrate_evidence import FakeZone, make_agent
from test_replica_gc import KEY, Jobs, K, Source, started

from laminar.components import MigrateAgent
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.replicas import Replicas
from laminar.migrate.transfer import send_control


def state_of(comp: ReclaimComponent, key: str) -> str:
    row = comp.agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
    return str(row["state"]) if row else ""


async def source_node(d: Path, before_start: Callable[[Any], None] | None = None
                      ) -> tuple[Any, ReclaimComponent, FakeZone]:
    """Node 2, a job's source: a started component over a stand-in agent (no jobs yet) and zone
    (nodes 1 and 3, zone key KEY). ``before_start(agent)`` runs before the component starts
    (what a restarted agent finds in its store)."""
    agent = make_agent(d)
    agent.jobs = Jobs()
    if before_start is not None:
        before_start(agent)
    source = ReclaimComponent()
    await source.start(agent)
    zone = FakeZone([1, 3])
    zone.node_id = 2
    zone.keys = {1: KEY}
    agent.zone = zone
    return agent, source, zone


def test_a_source_silent_in_its_window_that_answers_keeps_its_job(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        agent_b, keeper = await started(tmp_path / "b")
        agent_a, source, zone_a = await source_node(tmp_path / "a")
        agent_a.jobs.jobs.append(SimpleNamespace(id="job-1", state="running", ended=None, spec=None))
        try:
            keeper.s["port"] = source.port  # the keeper's control messages to node 2 reach the source
            seen: list[str] = []
            agent_b.events.subscribe(lambda e: seen.append(str(e.get("message", ""))))
            src = Source(tmp_path, keeper, 2, K)
            await src.send(5)
            await src.ctl("keeper", "ckpt-5")
            assert state_of(keeper, K) == "keeping"
            now = time.time()
            keeper.notices[2] = (now + 60, now - 10)  # its reclaim was announced 10 s ago, 60 s left
            agent_b.zone.membership.state[2].last_seen = now - 10  # and nothing heard since
            # (nor from node 3: nobody else to ask when it last heard node 2, vouch.py)
            agent_b.zone.membership.state[3].last_seen = now - 10
            keeper._started = now - 60  # (up a minute: it was there to hear that silence)
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking)
            assert state_of(keeper, K) == "keeping"  # asked, answered "running there": not taken over
            assert any("answers: its job lives there" in m for m in seen), seen

            await source.stop()  # the source is gone for good: no answer now
            keeper.takeover._alive_asked[K] = -math.inf
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert state_of(keeper, K) != "keeping"  # taken over (resumed, or waiting for room)
        finally:
            await keeper.stop()
            agent_b.store.db.close()
            agent_a.store.db.close()

    asyncio.run(main())


async def stop_both(keeper: ReclaimComponent, source: ReclaimComponent, *agents: Any) -> None:
    """A test's teardown: both components stopped (the source may be already), the agents'
    stores closed."""
    await keeper.stop()
    with contextlib.suppress(Exception):
        await source.stop()
    for agent in agents:
        agent.store.db.close()


async def source_asked_by(d: Path, keeper: ReclaimComponent, source: ReclaimComponent,
                          job_ids: tuple[str, ...]) -> tuple[Any, ReclaimComponent, list[str]]:
    """Node 2, the source: ``source`` started on an agent in ``d`` whose jobs ``job_ids`` run,
    in a zone that knows node 1 (the keeper). Returns (its agent, the source, the list of
    control messages the keeper sends from now on, ``"<op> <key>"`` each, which still go out)."""
    agent_a = make_agent(d)
    agent_a.jobs = Jobs()
    for jid in job_ids:
        agent_a.jobs.jobs.append(SimpleNamespace(id=jid, state="running", ended=None, spec=None))
    await source.start(agent_a)
    zone_a = FakeZone([1, 3])
    zone_a.node_id = 2
    zone_a.keys = {1: KEY}
    agent_a.zone = zone_a
    asked: list[str] = []
    control = keeper._control

    async def spy(node: int, op: str, body: dict[str, Any], **kw: Any) -> Any:  # records, then sends
        asked.append(f"{op} {body.get('key')}")
        return await control(node, op, body, **kw)

    keeper._control = spy  # type: ignore[method-assign]
    return agent_a, source, asked


def test_after_the_window_only_a_keeper_that_may_have_missed_news_asks_first(tmp_path: Path) -> None:
    """The window's end as the keeper message carried it has passed. A keeper up since that
    message that heard from the source takes over at once (no question: a real reclaim is not
    delayed); so does one restarted before the reclaim that knows the window from the zone's
    notice it heard since. One started after that message (a restart: it may have missed the withdrawal)
    asks: a source that runs the job and has no reclaim keeps the keeper keeping and its window
    is forgotten. One silent for peer_timeout_s before the end asks too; no answer (the source
    gone) goes on with the take-over."""
    async def main() -> None:
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        agent_b, keeper = await started(tmp_path / "b")
        agent_b.zone.s["peer_timeout_s"] = 10.0
        agent_a, source, asked = await source_asked_by(tmp_path / "a", keeper, ReclaimComponent(),
                                                      ("job-1", "job-2", "job-3", "job-4"))
        try:
            keeper.s["port"] = source.port
            ended = time.time() - 1.0  # the window's end the keeper messages carry: passed

            async def kept(key: str) -> None:
                src = Source(tmp_path, keeper, 2, key)
                await src.send(5)
                await send_control("127.0.0.1", keeper.port, KEY, "keeper", {
                    "key": key, "src_node": 2, "src_job": key[3:], "ckpt": "ckpt-5",
                    "request": {"spec": {"command": ["train"]}, "window_end": ended}}, zone=1, node="2")

            # up since the keeper came, heard from the source just now: taken over at once
            await kept("n2-job-1")
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert state_of(keeper, "n2-job-1") != "keeping" and asked == [], asked

            # restarted before the reclaim (an older keeper without the window's end), the window
            # known from the zone's notice heard since: up the whole window, taken over at once
            src4 = Source(tmp_path, keeper, 2, "n2-job-4")
            await src4.send(5)
            await src4.ctl("keeper", "ckpt-5")
            with agent_b.store.tx() as db:  # the keeper came before the window's end (the notice's)
                db.execute("UPDATE migrate_replicas SET updated=? WHERE key='n2-job-4'", (ended - 20.0,))
            keeper._started = time.time()
            keeper.notices[2] = (ended, ended - 10.0)
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert state_of(keeper, "n2-job-4") != "keeping" and asked == [], asked
            keeper.notices.pop(2)
            keeper._started = 0.0

            # the agent started after the keeper came: it asks, the source runs the job with no reclaim
            await kept("n2-job-2")
            keeper._started = time.time()
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert asked == ["needs n2-job-2"] and state_of(keeper, "n2-job-2") == "keeping", asked
            row = agent_b.store.db.execute("SELECT request FROM migrate_replicas WHERE key='n2-job-2'").fetchone()
            assert "window_end" not in json.loads(row["request"])  # the withdrawn window ends nothing
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert asked == ["needs n2-job-2"] and state_of(keeper, "n2-job-2") == "keeping"

            # up the whole window but nothing heard for peer_timeout_s before its end, the source gone
            keeper._started = 0.0
            await kept("n2-job-3")
            agent_b.zone.membership.state[2].last_seen = ended - 20.0
            await source.stop()
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert asked == ["needs n2-job-2", "needs n2-job-3"] and state_of(keeper, "n2-job-3") != "keeping", asked
        finally:
            await stop_both(keeper, source, agent_b, agent_a)

    asyncio.run(main())


class OlderReplicas(Replicas):
    """The replicas part of :class:`OlderSource`: its answer to ``needs`` lacks the ``reclaim``
    field (as agents before that field answered)."""

    def answer_needs(self, node: str, key: str) -> dict[str, Any]:
        ans = super().answer_needs(node, key)
        ans.pop("reclaim", None)
        return ans


class OlderSource(ReclaimComponent):
    """Stand-in for a source running an older agent: the real component, whose answer to
    ``needs`` lacks the ``reclaim`` field (:class:`OlderReplicas`)."""

    def __init__(self) -> None:
        super().__init__()
        self.replicas = OlderReplicas(self)


def test_an_older_source_that_says_its_job_lives_is_not_asked_every_dead_after_s(tmp_path: Path) -> None:
    """A keeper that may have missed its source's news (started after the keeper came) asks the
    source after the window's end; the source is an older agent whose answer says the job runs
    there but not whether it still has a reclaim. The job is not taken over and the window is
    kept (a withdrawal is not known), once, with one ``source-alive`` event (``withdrawn``
    None); it is not asked again while the zone hears from the source, however many rounds pass
    (before: every dead_after_s for as long as the source lives, with a log line each time).
    Once the source falls silent it is asked again: still answering, still kept (no second
    event); gone (no answer), the job is taken over."""
    async def main() -> None:
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        agent_b, keeper = await started(tmp_path / "b")
        keeper.s["dead_after_s"] = 0.2
        agent_a, source, asked = await source_asked_by(tmp_path / "a", keeper, OlderSource(), ("job-1",))
        events: list[dict[str, Any]] = []
        agent_b.events.subscribe(events.append)
        heard = agent_b.zone.membership.state[2]
        try:
            keeper.s["port"] = source.port
            ended = time.time() - 1.0
            src = Source(tmp_path, keeper, 2, K)
            await src.send(5)
            await send_control("127.0.0.1", keeper.port, KEY, "keeper", {
                "key": K, "src_node": 2, "src_job": "job-1", "ckpt": "ckpt-5",
                "request": {"spec": {"command": ["train"]}, "window_end": ended}}, zone=1, node="2")
            keeper._started = time.time()  # this agent started after the keeper came: it may have missed news

            async def round_after_dead_after_s() -> None:
                await asyncio.sleep(0.3)  # past dead_after_s since the last question
                heard.last_seen = time.time()  # the zone hears from node 2 meanwhile
                await keeper.takeover.tick(time.time())
                assert await until(lambda: not keeper.takeover.taking, timeout=30)

            await round_after_dead_after_s()
            assert asked == [f"needs {K}"] and state_of(keeper, K) == "keeping", asked
            alive = [e for e in events if e.get("phase") == "source-alive"]
            assert [(e["key"], e["src_state"], e["withdrawn"]) for e in alive] == [(K, "running", None)], alive
            row = agent_b.store.db.execute("SELECT request FROM migrate_replicas WHERE key=?", (K,)).fetchone()
            assert json.loads(row["request"])["window_end"] == ended  # not known withdrawn: kept
            for _ in range(4):
                await round_after_dead_after_s()
            assert asked == [f"needs {K}"], f"asked again while node 2 is heard from: {asked}"
            assert state_of(keeper, K) == "keeping"

            heard.last_seen = time.time() - 10.0  # node 2 falls silent in the zone: asked again
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert asked == [f"needs {K}"] * 2 and state_of(keeper, K) == "keeping", asked
            assert len([e for e in events if e.get("phase") == "source-alive"]) == 1, events

            await source.stop()  # gone: no answer, taken over
            await asyncio.sleep(0.3)
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert asked == [f"needs {K}"] * 3 and state_of(keeper, K) != "keeping", asked
        finally:
            await stop_both(keeper, source, agent_b, agent_a)

    asyncio.run(main())


def test_a_keeper_reads_the_sources_window_in_its_own_clock(tmp_path: Path) -> None:
    """The source's clock runs 300 s behind the keeper's. Its keeper message says its window ends
    30 s from now by its clock: the keeper keeps keeping (before, it read that instant in its
    own clock, 270 s in the past, and took the job over at once while the source was still
    moving it: the job ran twice). A keeper's ``not_before`` is moved the same way; a message
    with an unreadable clock is refused whole."""
    async def main() -> None:
        (tmp_path / "b").mkdir()
        agent_b, keeper = await started(tmp_path / "b")
        try:
            src = Source(tmp_path, keeper, 2, K)
            await src.send(5)
            skew = -300.0
            theirs = time.time() + skew
            body = {"key": K, "src_node": 2, "src_job": "job-1", "ckpt": "ckpt-5", "clock": theirs,
                    "request": {"spec": {"command": ["train"]}, "window_end": theirs + 30,
                                "not_before": theirs + 20}}
            await send_control("127.0.0.1", keeper.port, KEY, "keeper", body, zone=1, node="2")
            row = keeper.agent.store.db.execute("SELECT request FROM migrate_replicas WHERE key=?", (K,)).fetchone()
            req = json.loads(row["request"])
            now = time.time()
            assert now + 29 < req["window_end"] <= now + 31  # 30 s from now, in the keeper's clock
            assert now + 19 < req["not_before"] <= now + 21
            agent_b.zone.membership.state[2].last_seen = now
            assert keeper.takeover.source_dead(2, now, req["window_end"]) is None
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking)
            assert state_of(keeper, K) == "keeping"  # not taken over: the window is open

            bad = {**body, "clock": "soon", "request": {**body["request"], "window_end": 1.0}}
            try:
                await send_control("127.0.0.1", keeper.port, KEY, "keeper", bad, zone=1, node="2")
            except Exception as e:
                assert "clock" in str(e), e
            else:
                raise AssertionError("a keeper with an unreadable clock was taken")
            row = keeper.agent.store.db.execute("SELECT request FROM migrate_replicas WHERE key=?", (K,)).fetchone()
            assert json.loads(row["request"])["window_end"] == req["window_end"]  # unchanged
        finally:
            await keeper.stop()
            agent_b.store.db.close()

    asyncio.run(main())


def test_a_sources_keeper_message_carries_its_clock(tmp_path: Path) -> None:
    """What the source's component sends (``_control``): the keeper's request with the sender's
    wall clock beside it, so the keeper can move the instants into its own."""
    async def main() -> None:
        (tmp_path / "b").mkdir()
        agent_b, keeper = await started(tmp_path / "b")
        (tmp_path / "a").mkdir()
        agent_a, source, zone_a = await source_node(tmp_path / "a")
        try:
            zone_a.membership.by_node[1].handover_port = 0
            source.s["port"] = keeper.port  # node 1's transfer endpoint is the keeper's
            await Source(tmp_path, keeper, 2, K).send(5)
            bodies: list[Any] = []
            real = keeper.control.answer

            def on_control(node: str, op: str, body: Any) -> Any:
                bodies.append(body)
                return real(node, op, body)

            keeper.control.answer = on_control  # type: ignore[method-assign]
            assert keeper.receiver is not None
            keeper.receiver.on_control = on_control
            t0 = time.time()
            await source._control(1, "keeper", {"key": K, "src_node": 2, "src_job": "job-1", "ckpt": "ckpt-5",
                                               "request": {"spec": {"command": ["train"]}, "window_end": t0 + 40}})
            row = keeper.agent.store.db.execute("SELECT request FROM migrate_replicas WHERE key=?", (K,)).fetchone()
            end = json.loads(row["request"])["window_end"]
            assert t0 + 40 <= end <= time.time() + 40  # moved by the transit only (same clock here)
            assert [t0 <= b["clock"] <= time.time() for b in bodies] == [True]  # the sender's clock, as it sent
        finally:
            await source.stop()
            await keeper.stop()
            agent_b.store.db.close()
            agent_a.store.db.close()

    asyncio.run(main())


def test_a_job_a_source_keeps_after_coming_back_from_its_reclaim_is_not_taken_over(tmp_path: Path) -> None:
    """Node 2's reclaim window ended (the zone's notice) and its agent came back: restarted after
    the window's end, it cleared the reclaim (the owner gave the node back) and takes jobs again.
    A job it runs since, and keeps here (a keeper message without a window, after the window's
    end), is not taken over: it runs there (before, it was taken over at once, the notice's old
    window declaring its source dead, and ran twice). A keeper that came before the window's end
    is taken over at once, as before; and so is the new job once node 2 is reclaimed again and
    that window ends."""
    async def main() -> None:
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        agent_b, keeper = await started(tmp_path / "b")
        agent_a, source, asked = await source_asked_by(tmp_path / "a", keeper, ReclaimComponent(), ("job-5", "job-6"))
        try:
            keeper.s["port"] = source.port
            now = time.time()
            keeper.notices[2] = (now - 30.0, now - 90.0)  # its 60 s window ended 30 s ago
            agent_b.zone.membership.state[2].last_seen = time.time()  # heard from since

            old = Source(tmp_path, keeper, 2, "n2-job-5")  # kept before the window's end
            await old.send(5)
            await old.ctl("keeper", "ckpt-5")
            with agent_b.store.tx() as db:
                db.execute("UPDATE migrate_replicas SET updated=? WHERE key='n2-job-5'", (now - 100.0,))
            new = Source(tmp_path, keeper, 2, "n2-job-6")  # kept now, back from the reclaim
            await new.send(5)
            await new.ctl("keeper", "ckpt-5")
            for _ in range(3):
                await keeper.takeover.tick(time.time())
                assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert state_of(keeper, "n2-job-5") != "keeping"  # its source's window ended: taken over
            assert state_of(keeper, "n2-job-6") == "keeping", "the job of a node back from its reclaim was taken over"
            assert keeper.takeover.source_dead(2, time.time()) is not None  # node 2 counts as dead for anything else
            assert keeper.takeover.source_dead(2, time.time(), None, time.time() - 1.0) is None
            assert asked == [], asked

            # reclaimed again, after that keeper came: that window's end declares it dead for the job
            await asyncio.sleep(0.2)
            now = time.time()
            keeper.notices[2] = (now - 0.05, now - 5.0)
            await keeper.takeover.tick(time.time())
            assert await until(lambda: not keeper.takeover.taking, timeout=30)
            assert state_of(keeper, "n2-job-6") != "keeping"
        finally:
            await stop_both(keeper, source, agent_b, agent_a)

    asyncio.run(main())


def test_a_reclaimed_source_says_its_window_in_every_keeper_message() -> None:
    """A keeper message without the window's end tells the keeper that its source has no reclaim
    (one that came after the notice's window ended is of a node back from its reclaim, whose job
    is not taken over). So a source that is still reclaimed says it in every message: also one
    sent once the reclaim's own task ended (a prestage in flight at the window's end), which left
    it out before, and whose job, stopped at the window's end, would then never be taken over."""
    from laminar.runtime.spec import JobSpec

    async def main() -> None:
        c = ReclaimComponent()
        c.agent = standin_agent(MigrateAgent, zone=SimpleNamespace(node_id=2))
        sent: list[dict[str, Any]] = []

        async def control(node: int, op: str, body: Any, timeout: float = 5.0) -> Any:  # recorded, not sent
            sent.append(dict(body["request"]))

        c._control = control  # type: ignore[method-assign]
        c._need = lambda job: (None, SimpleNamespace(gpus=0))  # type: ignore[method-assign]
        job = SimpleNamespace(id="job-1", spec=JobSpec(["train"]), owner_uid=0, owner_gid=0)
        await c.mover.send_keeper(job, 1, "ckpt-5")  # no reclaim
        loop = asyncio.get_running_loop()
        running, done = loop.create_future(), loop.create_future()
        done.set_result(None)
        c.reclaim = {"deadline": 1000.0, "task": running}  # in its window
        await c.mover.send_keeper(job, 1, "ckpt-6")
        c.reclaim = {"deadline": 1000.0, "task": done}  # reclaimed: the window ended, the reclaim's task too
        await c.mover.send_keeper(job, 1, "ckpt-7")
        running.cancel()
        assert ["window_end" in r for r in sent] == [False, True, True], sent
        assert sent[2]["window_end"] == 1000.0

    asyncio.run(main())
