"""A forced drop of a keeper that lands while the source is prestaging the job's next checkpoint
to that same keeper (the transfer done, the keeper not yet sent) does not leave the source
believing that keeper keeps the job: the keeper it sends is withdrawn (``release``) and the next
prestage goes to another peer.

Real pieces (the rig of test_gc_keepers): three migrate components (node 1: the keeper whose
operator drops, node 2: the source, node 3: another peer) on their own SQLite stores, endpoints
on 127.0.0.<node>; the source's own prestage, real transfers, real authenticated ``keeper``,
``dropped`` and ``release`` control messages, node 1's real ``ReplicaOperator.drop_and_tell``. The
interleaving is made deterministic by running node 1's drop from inside the source's ``_make_keeper``
(a wrapper around the real one), right before the keeper is sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobrig import until
from test_gc_keepers import Jobs, K, free_port, held, job_of, node, prestage, prestage_round, run, state

from laminar.jobkit import Checkpointer


def test_a_drop_during_a_prestage_to_the_same_keeper_moves_the_keeper_elsewhere(tmp_path: Path) -> None:
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2, 3], port) as b, node(tmp_path, 3, [1, 2, 3], port) as c:
            async with node(tmp_path, 2, [1, 2, 3], port, Jobs([job])) as src:
                src.agent.zone.membership.state[3].last_summary = type("S", (), {"draining": True})()  # node 1 first
                await prestage(src, job, 5)
                assert src.prestage.keeper == {"job-1": 1} and state(b) == "keeping"
                src.agent.zone.membership.state[3].last_summary = None

                real_keeper = src.mover.send_keeper
                dropped: list[Any] = []

                async def keeper_after_a_drop(j: Any, n: int, ckpt: str, take_over: bool = False) -> None:
                    if n == 1 and not dropped:  # node 1's operator drops the key right now
                        dropped.append(await b.replicas.operator.drop_and_tell(K, force=True, by="uid 0"))
                    await real_keeper(j, n, ckpt, take_over)

                src.mover.send_keeper = keeper_after_a_drop  # type: ignore[method-assign]
                Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False, keep=10).save(
                    b"weights-10", step=10)
                await prestage_round(src)
                assert await until(lambda: bool(dropped) and not src.prestage.prestaging, timeout=20)
                assert dropped[0]["source_told"] is True and dropped[0]["dropped"] == ["ckpt-10", "ckpt-5"], dropped
                # the keeper node 1 got after its drop is withdrawn: it holds nothing and keeps nothing
                assert await until(lambda: state(b) in (None, "released") and held(b) == []), (state(b), held(b))
                assert src.prestage.keeper.get("job-1") != 1
                # the next round prestages to the other peer
                await prestage_round(src)
                assert await until(lambda: src.prestage.keeper.get("job-1") == 3 and src.prestage.shipped.get("job-1") == "ckpt-10",
                                   timeout=20), (src.prestage.keeper, src.prestage.shipped)
                assert state(c) == "keeping" and held(c) == ["ckpt-10"]

    run(main())
