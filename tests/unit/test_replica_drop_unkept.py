"""A drop of a key whose keeper has not arrived yet: the source's prestage has committed its
checkpoint on the keeper (so the key is held there, with no row: "unclaimed", which a drop
without ``--force`` may remove, and a forced one tells nobody about) and sends the keeper a
moment later. Before, the keeper then took the keeper of a checkpoint it no longer held: it
kept the job with nothing to resume it from, and the source, never told, counted on it (the
job was lost with its node). Now the keeper refuses a keeper naming a checkpoint it does not hold:
the source's prestage fails, it does not count on that node, and its next prestage goes to
another peer.

Real pieces (the rig of test_gc_keepers): migrate components (node 1: the keeper whose operator
drops, node 2: the source, node 3: another peer) on their own SQLite stores, endpoints on
127.0.0.<node>; the source's own prestage, real transfers, real authenticated ``keeper``
control messages. The interleaving is made deterministic by running node 1's drop from inside
the source's ``_make_keeper`` (a wrapper around the real one), right before the keeper is sent.
"""

from __future__ import annotations

from typing import Any

import pytest
from jobrig import until
from test_gc_keepers import Jobs, K, free_port, held, job_of, node, prestage_round, run, state

from laminar.jobkit import Checkpointer


@pytest.mark.parametrize("force", [False, True])
def test_a_keeper_naming_a_checkpoint_dropped_before_it_came_is_refused(tmp_path: Any, force: bool) -> None:
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2, 3], port) as b, node(tmp_path, 3, [1, 2, 3], port) as c:
            async with node(tmp_path, 2, [1, 2, 3], port, Jobs([job])) as src:
                src.agent.zone.membership.state[3].last_summary = type("S", (), {"draining": True})()  # node 1 first
                real_keeper = src.mover.send_keeper
                dropped: list[Any] = []

                async def keeper_after_a_drop(j: Any, n: int, ckpt: str, take_over: bool = False) -> None:
                    if n == 1 and not dropped:  # the checkpoint is on node 1, its keeper not yet
                        assert state(b) is None and held(b) == ["ckpt-5"]
                        dropped.append(await b.replicas.operator.drop_and_tell(K, force=force, by="uid 0"))
                    await real_keeper(j, n, ckpt, take_over)

                src.mover.send_keeper = keeper_after_a_drop  # type: ignore[method-assign]
                Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False, keep=10).save(
                    b"weights-5", step=5)
                await prestage_round(src)
                assert await until(lambda: bool(dropped) and not src.prestage.prestaging, timeout=20)
                assert isinstance(dropped[0], dict) and dropped[0]["dropped"] == ["ckpt-5"], dropped
                # node 1 keeps nothing it cannot resume, and the source does not count on it
                assert state(b) is None and held(b) == [], (state(b), held(b))
                assert src.prestage.keeper.get("job-1") != 1 and src.prestage.shipped.get("job-1") is None, (src.prestage.keeper, src.prestage.shipped)
                # the next prestage goes to the other peer
                src.agent.zone.membership.state[3].last_summary = None
                await prestage_round(src)
                assert await until(lambda: src.prestage.keeper.get("job-1") == 3 and src.prestage.shipped.get("job-1") == "ckpt-5",
                                   timeout=20), (src.prestage.keeper, src.prestage.shipped)
                assert state(c) == "keeping" and held(c) == ["ckpt-5"]

    run(main())
