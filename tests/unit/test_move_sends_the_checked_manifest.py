"""A move reads its final checkpoint once before the first byte leaves.

Before, the source read a 1 GiB final checkpoint four times: jobkit's check when the agent found
it, jobkit's check again of the snapshot it sends, the chunks' hashes for the transfer manifest,
and jobkit's check beside the transfer; on 2 cores the first byte left about 1.5 s after the
job's save. Now the agent's check when it finds the checkpoint *is* the manifest's build (jobkit's
check of every file beside the chunks' hashes, one read), the snapshot's check looks at its
shape only (files, types, sizes), and the send uses that manifest as it is when the snapshot
holds the very files it was built from.

What a user relies on and these tests hold: the destination commits exactly the job's
checkpoint; a byte that rots on the source after the check is never committed (the sender
re-hashes each chunk it reads against the manifest); a checkpoint saved again in between is
sent as it is now, not as the manifest described it. A prestage reads its checkpoint once too,
off the event loop. Real jobkit checkpoints, a real Receiver over loopback, the agent's own
``_wait_checkpoint``, ``Prestage.ship`` and ``_send``.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from standin_agent import standin_agent
from xferrig import KEY, make_ckpt, rot, with_receiver

from laminar import jobkit
from laminar.components import MigrateAgent
from laminar.migrate import transfer as T
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.transfer import manifest

KB = 1 << 10


def component(root: Path, port: int) -> ReclaimComponent:
    c = ReclaimComponent()
    c.agent = standin_agent(MigrateAgent, zone=SimpleNamespace(node_id=1))
    c.root = root
    c.s = {"rate_mbit": 0, "chunk_kb": 64}
    c._peer = lambda node: ("127.0.0.1", port, KEY, 0)  # type: ignore[method-assign]
    return c


def job_at(ckpt_dir: Path) -> Any:
    return SimpleNamespace(id="job-1", ckpt_dir=ckpt_dir, active=True)


@pytest.fixture
def read_where(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every whole-checkpoint hash on the sender: jobkit's check without ``hashed`` and the
    manifest's chunk pass, as (what and the checkpoint's name, whether on the event loop's
    thread)."""
    calls: list[tuple[str, bool]] = []
    verify, chunks = jobkit.verify_checkpoint, manifest._hash_checkpoint

    def on_main() -> bool:
        return threading.current_thread() is threading.main_thread()

    def spy_verify(p: Any, **kw: Any) -> Any:
        if not kw.get("hashed"):
            calls.append((f"verify {Path(p).name}", on_main()))
        return verify(p, **kw)

    def spy_chunks(p: Path, *a: Any, **kw: Any) -> Any:
        calls.append((f"chunks {p.name}", on_main()))
        return chunks(p, *a, **kw)

    monkeypatch.setattr(jobkit, "verify_checkpoint", spy_verify)
    monkeypatch.setattr(manifest, "_hash_checkpoint", spy_chunks)
    return calls


def move(tmp: Path, ck: Path, between: Any = None) -> tuple[T.SendResult | BaseException, list[Any], str | None]:
    """The agent finds ``ck`` (its check), ``between()`` runs, then the agent sends it:
    (the committed path or the error, what the destination committed, the manifest's ckpt)."""
    committed: list[Any] = []

    async def body(rcv: T.Receiver, port: int) -> tuple[Any, list[Any], str | None]:
        rcv.on_commit = committed.append
        c = component(tmp / "xfer", port)
        job = job_at(ck.parent)
        found, m = await c.checkpoints.wait_new(job, None, 5.0)
        assert found == ck and m is not None and m.ckpt_id == ck.name and not m.unchecked
        if between is not None:
            between()
        try:
            return await c.mover.send(job, found, 7, None, None, manifest=m), committed, m.ckpt_id
        except T.TransferError as e:
            return e, committed, m.ckpt_id

    return asyncio.run(with_receiver(tmp / "rcv", body))


def test_the_move_sends_the_manifest_its_check_built_and_hashes_nothing_again(tmp_path: Path,
                                                                              read_where: list[tuple[str, bool]]) -> None:
    ck = make_ckpt(tmp_path, 700 * KB)
    seen: list[str] = []
    remote, committed, _ = move(tmp_path, ck, between=lambda: seen.extend(w for w, _ in read_where))
    assert seen == [f"chunks {ck.name}", f"verify {ck.name}"]  # the check: one build, both hashes
    assert [w for w, _ in read_where] == seen  # the send read nothing whole again
    assert not any(main for _, main in read_where)  # and the check read it in worker threads
    assert isinstance(remote, str) and len(committed) == 1
    got = T.verified_checkpoint(remote)
    for f in ck.iterdir():
        assert (got / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_byte_that_rots_after_the_check_is_never_committed(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path, 700 * KB)
    err, committed, _ = move(tmp_path, ck, between=lambda: rot(ck / "state.bin", 300 * KB))
    assert isinstance(err, T.TransferError) and err.fatal, err
    assert "changed on the source" in str(err)
    assert committed == [] and not list((tmp_path / "rcv").glob("checkpoints/*/ckpt-*"))


def test_a_checkpoint_saved_again_after_the_check_is_sent_as_it_is_now(tmp_path: Path,
                                                                       read_where: list[tuple[str, bool]]) -> None:
    ck = make_ckpt(tmp_path, 700 * KB)
    again = b"saved again at the same step" * 1000
    first = (ck / "state.bin").read_bytes()

    def resave() -> None:
        read_where.clear()
        jobkit.Checkpointer(job_id="j1", ckpt_dir=ck.parent, install_signal=False).save(again, step=40)

    remote, committed, _ = move(tmp_path, ck, between=resave)
    assert isinstance(remote, str) and len(committed) == 1, remote
    got = T.verified_checkpoint(remote)
    assert (got / "state.bin").read_bytes() != first  # not what the manifest of the check described
    for f in ck.iterdir():  # the files of the save made after the check
        assert (got / f.name).read_bytes() == f.read_bytes(), f.name
    assert any(w.startswith("chunks") for w, _ in read_where)  # its manifest was built again


def test_a_prestage_reads_the_checkpoint_once_off_the_event_loop(tmp_path: Path,
                                                                  read_where: list[tuple[str, bool]]) -> None:
    """A prestage (the newest checkpoint to the job's keeper, while the job trains) chose its
    checkpoint with ``jobkit.latest_checkpoint`` on the event loop: a whole read of a checkpoint
    of many GB held the agent's loop (probes, the API, kill-switch requests) for seconds; then the
    send read it twice more. Now the choice is the manifest's build in a worker thread, and the
    send uses that manifest."""
    ck = make_ckpt(tmp_path, 700 * KB)
    reads = read_where
    committed: list[Any] = []
    kept: list[tuple[int, str]] = []

    async def body(rcv: T.Receiver, port: int) -> None:
        rcv.on_commit = committed.append
        c = component(tmp_path / "xfer", port)
        c.agent.zone.membership = SimpleNamespace(suspects=set())
        c.agent.zone.networked = True
        job = job_at(ck.parent)
        c.prestage.keeper[job.id] = 7  # its keeper already: no ranking

        async def keeper(job: Any, node: int, ckpt_name: str, take_over: bool = False) -> None:
            kept.append((node, ckpt_name))

        c.mover.send_keeper = keeper  # type: ignore[method-assign]
        c._emit = lambda message, **fields: None  # type: ignore[method-assign]
        c.prestage.set_keeper = lambda job_id, node: None  # type: ignore[method-assign]
        await c.prestage.ship(job)
        assert c.prestage.shipped.get(job.id) == ck.name

    asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert kept == [(7, ck.name)] and len(committed) == 1
    got = T.verified_checkpoint(committed[0].path)
    for f in ck.iterdir():
        assert (got / f.name).read_bytes() == f.read_bytes(), f.name
    assert sorted(w for w, _ in reads) == [f"chunks {ck.name}", f"verify {ck.name}"], reads  # one read by each hash
    assert not any(main for _, main in reads), f"read whole on the event loop: {reads}"
