"""A job's keeper that went silent (its host gone, its agent hung: nothing answers) costs the
job's next prestage one timeout, not the transfer's whole retry ladder: the keeper is then
suspect for prestages (every job's: another job of this node whose keeper it was does not try
it again) and the checkpoint goes to another live peer at the next round. A move (a reclaim's,
a loan return's, Airlock's) never waits on that silent keeper: its ``release`` is sent beside
the hand-over, not before it (the job is frozen then).

Real pieces (the rig of test_gc_keepers): migrate components of node 2 (the source) and node 3
(a live peer) on their own SQLite stores, endpoints on 127.0.0.<node>; the source's own
prestage, real transfers, real authenticated ``keeper`` and ``release`` control messages.
Stand-ins, named as such: node 1, the silent keeper, is a TCP listener on 127.0.0.1 that accepts
connections and never answers (a hung agent; a host whose packets vanish is the connect-phase
case of the same rule, measured in bench/prestage_silent_keeper.py); the handshake timeout is
shortened for the test (``HANDSHAKE_TIMEOUT_S``, where the sender and the receiver read it); in the move tests, the zone's
reservation and the hand-over (``_reserve``, ``_handover``) are stand-ins, the transfer and
keeper before them are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from jobrig import until
from test_gc_keepers import Job, Jobs, K, free_port, held, job_of, node, prestage_round, run, state

from laminar.jobkit import Checkpointer, latest_checkpoint
from laminar.migrate.errors import MigrateError
from laminar.migrate.mover import Move
from laminar.migrate.transfer import receive as xfer_receive
from laminar.migrate.transfer import send as xfer_send
from laminar.runtime.spec import JobSpec


class Silent:
    """Stand-in for a keeper that went silent: accepts connections, never says a word."""

    def __init__(self) -> None:
        self.connections = 0
        self._open: list[asyncio.StreamWriter] = []

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._open.append(w)
        await r.read()  # until the sender gives up and closes

    @asynccontextmanager
    async def listening(self, port: int, host: str = "127.0.0.1") -> AsyncIterator[Silent]:
        srv = await asyncio.start_server(self._handle, host, port)
        try:
            yield self
        finally:
            for w in self._open:
                w.close()
            srv.close()
            await srv.wait_closed()


def save(job: Any, step: int) -> None:
    Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False, keep=10).save(
        f"weights-{step}".encode(), step=step)


@pytest.fixture(autouse=True)
def short_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xfer_send, "HANDSHAKE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(xfer_receive, "HANDSHAKE_TIMEOUT_S", 0.5)


def test_a_silent_keeper_costs_one_timeout_and_the_checkpoint_goes_to_another_peer(tmp_path: Path) -> None:
    port = free_port()
    job = job_of(tmp_path)
    job2 = Job(id="job-2", num=2, state="running", gpus=[], owner_uid=0, owner_gid=0, ended=None, pid=None,
               exit_code=None, spec=JobSpec(["train"]), ckpt_dir=tmp_path / "job-2-ckpt")

    async def main() -> None:
        async with Silent().listening(port) as silent, node(tmp_path, 3, [1, 2, 3], port) as c:
            async with node(tmp_path, 2, [1, 2, 3], port, Jobs([job, job2])) as src:
                src.prestage.set_keeper("job-1", 1)  # node 1 kept both jobs' older checkpoints, then went silent
                src.prestage.set_keeper("job-2", 1)
                sends: list[tuple[str, int]] = []
                real_send = src.mover.send

                async def send(j: Any, ck: Path, n: int, *a: Any, **kw: Any) -> str:
                    sends.append((j.id, n))
                    return await real_send(j, ck, n, *a, **kw)

                src.mover.send = send  # type: ignore[method-assign]
                save(job, 10)
                await prestage_round(src)
                assert await until(lambda: not src.prestage.prestaging, timeout=30)
                # one attempt at the silent keeper, not the transfer's retry ladder (6 of them)
                assert silent.connections == 1, silent.connections
                assert src.prestage.keeper["job-1"] == 1  # a failed prestage keeps the keeper (it keeps the older one)
                await prestage_round(src)  # the next round: another live peer
                assert await until(lambda: src.prestage.shipped.get("job-1") == "ckpt-10", timeout=20), src.prestage.shipped
                assert src.prestage.keeper["job-1"] == 3 and held(c) == ["ckpt-10"] and state(c) == "keeping"
                # done without waiting on the release of node 1's keeper (its outcome not known yet):
                # the job's next prestage is not held up by the silent old keeper either
                assert (1, "n2-job-1") in src.prestage._releasing  # (owed from the first try on: _releases)
                assert (1, "n2-job-1") in src.prestage.releases
                # its first try failed: still owed, sent again later
                assert await until(lambda: (1, "n2-job-1") not in src.prestage._releasing, timeout=20)
                assert (1, "n2-job-1") in src.prestage.releases
                # the other job whose keeper node 1 was does not try it again: it is suspect now
                save(job2, 7)
                await prestage_round(src)
                assert await until(lambda: src.prestage.shipped.get("job-2") == "ckpt-7", timeout=20), src.prestage.shipped
                assert src.prestage.keeper["job-2"] == 3 and held(c, "n2-job-2") == ["ckpt-7"]
                assert sends == [("job-1", 1), ("job-1", 3), ("job-2", 3)], sends

    run(main())



def test_a_keeper_whose_syns_go_unanswered_costs_one_connect_timeout(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The connect phase of the same rule: node 1's host vanished (its SYNs go unanswered, no
    RST). Stand-in: a listener on 127.0.0.1 with a full accept queue (backlog 0, one connection
    never accepted), so the kernel drops every further SYN to it."""
    monkeypatch.setattr(xfer_send, "CONNECT_TIMEOUT_S", 0.5)
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        with socket.socket() as full:
            full.bind(("127.0.0.1", port))
            full.listen(0)
            with socket.create_connection(("127.0.0.1", port)):  # fills the accept queue
                async with node(tmp_path, 3, [1, 2, 3], port) as c, node(tmp_path, 2, [1, 2, 3], port, Jobs([job])) as src:
                    src.prestage.set_keeper("job-1", 1)
                    save(job, 10)
                    await prestage_round(src)
                    assert await until(lambda: not src.prestage.prestaging, timeout=30)
                    assert src.prestage.silent_peers() == {1} and src.prestage.shipped.get("job-1") is None
                    await prestage_round(src)
                    assert await until(lambda: src.prestage.shipped.get("job-1") == "ckpt-10", timeout=20), src.prestage.shipped
                    assert src.prestage.keeper["job-1"] == 3 and held(c) == ["ckpt-10"]

    run(main())

def test_a_move_does_not_wait_on_the_release_of_a_silent_old_keeper(tmp_path: Path) -> None:
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        async with Silent().listening(port), node(tmp_path, 3, [1, 2, 3], port) as c:
            async with node(tmp_path, 2, [1, 2, 3], port, Jobs([job])) as src:
                src.s["prestage"] = "off"  # this test is the move's alone
                src.prestage.set_keeper("job-1", 1)  # node 1 kept the job's older checkpoint, then went silent
                save(job, 10)
                ckpt = latest_checkpoint(job.ckpt_dir)
                assert ckpt is not None
                release_pending: list[bool] = []

                async def reserve(n: int, demand: Any, hold_s: float) -> int:  # stand-in: node 3 has room
                    return 77

                async def handover(n: int, pid: int, req: dict[str, Any], **kw: Any) -> str:  # stand-in: node 3 runs it
                    release_pending.append((1, K) not in src.prestage.releases)  # its outcome not known yet
                    return "job-9"

                src.mover.reserve = reserve  # type: ignore[method-assign]
                src.takeover.handover = handover  # type: ignore[method-assign]
                mv = Move(job.id, K, "test", deadline=None)
                await src.mover._move_to(job, mv, ckpt, 3, None)
                assert mv.dest_job == "job-9" and src.prestage.keeper["job-1"] == 3 and state(c) == "keeping"
                # the hand-over went before the release to the silent node 1 had failed (not waited for)
                assert release_pending == [True], release_pending
                # and the release is still sent: it fails, and is queued to be sent again
                assert await until(lambda: (1, K) in src.prestage.releases, timeout=20), src.prestage.releases

    run(main())


def test_a_prestage_a_move_overtook_neither_takes_the_keeper_back_nor_slows_the_move(tmp_path: Path) -> None:
    """A prestage still sending when a move of the job begins (a reclaim's: the keeper is slow, or
    silent) is superseded: its send is cancelled (the move has the uplink to itself), and one that
    got past its send anyway does not hand the job's keeper to its node after the move gave it to
    the destination (before: it did, and released the destination's keeper; the old keeper would
    have resumed the job from an older checkpoint once this node was gone, beside the running
    move)."""
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2, 3], port) as b, node(tmp_path, 3, [1, 2, 3], port) as c:
            async with node(tmp_path, 2, [1, 2, 3], port, Jobs([job])) as src:
                src.prestage.set_keeper("job-1", 1)
                save(job, 10)
                ckpt = latest_checkpoint(job.ckpt_dir)
                assert ckpt is not None
                real_send = src.mover.send
                slow = asyncio.Event()
                prestage_sends: list[str] = []

                async def send(j: Any, ck: Path, n: int, *a: Any, **kw: Any) -> str:
                    if n == 1:  # stand-in for a slow link to the keeper: the prestage's transfer takes a while
                        prestage_sends.append("started")
                        try:
                            await slow.wait()
                            return await real_send(j, ck, n, *a, **kw)
                        except asyncio.CancelledError:
                            prestage_sends.append("cancelled")
                            raise
                    return await real_send(j, ck, n, *a, **kw)

                async def reserve(n: int, demand: Any, hold_s: float) -> int:  # stand-in: node 3 has room
                    if n != 3:
                        raise MigrateError(f"node {n} refused the reservation (stand-in)")
                    return 77

                async def handover(n: int, pid: int, req: dict[str, Any], **kw: Any) -> str:  # stand-in
                    return "job-9"

                src.mover.send = send  # type: ignore[method-assign]
                src.mover.reserve = reserve  # type: ignore[method-assign]
                src.takeover.handover = handover  # type: ignore[method-assign]
                await prestage_round(src)
                assert await until(lambda: prestage_sends == ["started"], timeout=20)
                move = asyncio.ensure_future(src.mover.move(job, "test", None, final=False))
                await asyncio.sleep(0.2)
                slow.set()  # the link to node 1 frees up while the move runs
                mv = await move
                assert mv.phase == "done" and mv.dest == 3, (mv.phase, mv.error)
                assert await until(lambda: not src.prestage.prestaging, timeout=20)
                assert src.prestage.keeper["job-1"] == 3 and state(c) == "keeping"
                await asyncio.sleep(0.3)  # a release or keeper the prestage might still send
                assert src.prestage.keeper["job-1"] == 3 and state(c) == "keeping", (src.prestage.keeper, state(c))
                assert state(b) in (None, "released"), state(b)  # node 1 keeps nothing of the job
                assert prestage_sends == ["started", "cancelled"]  # the move cancelled the prestage's send

    run(main())


@pytest.mark.parametrize("phase", ["connect", "handshake"])
def test_a_move_whose_destination_is_silent_goes_on_to_the_next_candidate_after_two_timeouts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str) -> None:
    """A move (here one without a window: a loan return's, Airlock's; a reclaim's alike) ranked
    node 1 first, and node 1 is silent: its SYNs go unanswered (``connect``: a listener with a
    full accept queue, as above) or its agent hangs (``handshake``: :class:`Silent`). The move
    tries node 1 twice (one more try: a lost SYN or a busy agent), then sends to node 3, not
    after the transfer's whole retry ladder (6 tries: ~26 s connecting, ~63 s handshaking at
    the real timeouts, inside a notice window that may be 60 s). Stand-ins: the ranking (node 1,
    then node 3), the reservation and the hand-over; the transfers are real."""
    monkeypatch.setattr(xfer_send, "CONNECT_TIMEOUT_S", 0.5)
    port = free_port()
    job = job_of(tmp_path)
    tries: list[str] = []
    real_once = xfer_send._send_once

    async def send_once(host: str, *a: Any, **kw: Any) -> None:  # counts each connection a transfer opens
        tries.append(host)
        await real_once(host, *a, **kw)

    monkeypatch.setattr(xfer_send, "_send_once", send_once)

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            if phase == "connect":
                full = stack.enter_context(socket.socket())
                full.bind(("127.0.0.1", port))
                full.listen(0)
                stack.enter_context(socket.create_connection(("127.0.0.1", port)))  # fills the accept queue
            else:
                await stack.enter_async_context(Silent().listening(port))
            c = await stack.enter_async_context(node(tmp_path, 3, [1, 2, 3], port))
            src = await stack.enter_async_context(node(tmp_path, 2, [1, 2, 3], port, Jobs([job])))
            src.s["prestage"] = "off"  # this test is the move's alone
            save(job, 10)

            released = destinations_1_then_3(src)
            mv = await src.mover.move(job, "test", None, final=False)
            assert mv.phase == "done" and mv.dest == 3 and mv.dest_job == "job-93", (mv.phase, mv.error)
            assert tries.count("127.0.0.1") == 2, tries  # node 1 twice, not the ladder's 6
            assert released == [(1, 71)]  # node 1's reservation released
            assert held(c) == ["ckpt-10"]

    run(main())


def destinations_1_then_3(src: Any) -> list[tuple[int, int]]:
    """Stand-ins on the moving node ``src``: the ranking (node 1, then node 3), reservations
    (both have room: placement 70 + node), hand-overs (the job runs there as job-9<node>) and
    the zone's sender. Returns the (node, placement) of every reservation it releases."""
    def rank_for(j: Any, size: float, window: Any, prestaged: bool) -> list[Any]:
        return [SimpleNamespace(candidate=SimpleNamespace(node=n), feasible=True, expected_loss_s=1.0,
                                reasons=[]) for n in (1, 3)]

    async def reserve(n: int, demand: Any, hold_s: float) -> int:
        return 70 + n

    async def handover(n: int, pid: int, req: dict[str, Any], **kw: Any) -> str:
        return f"job-9{n}"

    released: list[tuple[int, int]] = []
    src.zone.submitter = SimpleNamespace(t=SimpleNamespace(send=lambda n, m: released.append((n, m.placement_id))))
    src.mover.rank_for = rank_for
    src.mover.reserve = reserve
    src.takeover.handover = handover
    return released


def test_a_destination_a_move_found_silent_is_not_tried_again_by_the_next_move(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs of one reclaim moved one after the other, node 1 ranked first for both, and node 1
    silent (its agent hangs: :class:`Silent`). The first move pays its two timeouts there and goes
    to node 3; node 1 is then marked silent (as a prestage marks a keeper: ``Prestage.silent_peers``), so
    the second move goes straight to node 3 (before: it connected to node 1 twice more, its job
    frozen meanwhile). Stand-ins: the ranking (node 1, then node 3), the reservation and the
    hand-over; the transfers are real."""
    port = free_port()
    job = job_of(tmp_path)
    job2 = Job(id="job-2", num=2, state="running", gpus=[], owner_uid=0, owner_gid=0, ended=None, pid=None,
               exit_code=None, spec=JobSpec(["train"]), ckpt_dir=tmp_path / "job-2-ckpt")

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            silent = await stack.enter_async_context(Silent().listening(port))
            await stack.enter_async_context(node(tmp_path, 3, [1, 2, 3], port))
            src = await stack.enter_async_context(node(tmp_path, 2, [1, 2, 3], port, Jobs([job, job2])))
            src.s["prestage"] = "off"  # this test is the moves' alone
            save(job, 10)
            save(job2, 20)

            destinations_1_then_3(src)
            mv = await src.mover.move(job, "test", None, final=False)
            assert mv.phase == "done" and mv.dest == 3, (mv.phase, mv.error)
            assert silent.connections == 2, silent.connections  # the first move: two tries at node 1
            mv2 = await src.mover.move(job2, "test", None, final=False)
            assert mv2.phase == "done" and mv2.dest == 3, (mv2.phase, mv2.error)
            assert silent.connections == 2, silent.connections  # the second move: none at node 1

    run(main())
