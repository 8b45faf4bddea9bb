"""Prestage to a silent keeper: how long a job has no new replica off its node once its keeper
went silent, i.e. the time from a new checkpoint (its keeper silent already) to that checkpoint
committed and kept on another peer.

Real pieces (the rig of tests/unit/test_gc_keepers.py): migrate components of node 2 (the source)
and node 3 (a live peer), real jobkit checkpoints, real transfers and ``keeper`` messages; the
source's prestage rounds are run every 0.5 s (``poll_s``'s default). Node 1, the job's keeper, is
silent in one of two ways:

- ``blackhole``: as if its host vanished: its SYNs go unanswered, no RST comes (the connect
  phase times out). Stand-in: a listener on 127.0.0.1 whose accept queue is full (listen
  backlog 0, one connection never accepted): the kernel drops every further SYN to it.
- ``hung``: its agent hangs: a listener on 127.0.0.1 accepts connections and never answers (the
  handshake times out).

    python bench/prestage_silent_keeper.py [--baseline-tree PATH] [--json PATH]

``--baseline-tree``: an ``agent/`` directory of another revision, run the same way for the
before figures (e.g. ``git archive 3a2072c agent | tar -x -C /tmp/base``). Keys per case:
``s_to_replica`` (seconds from the new checkpoint to its replica committed and kept on node
3) and ``silent_connections`` (hung only: connections made to node 1 meanwhile, the prestage's
attempts and the release of its keeper once the job has a new keeper). Takes about 20 s, 2
minutes with a baseline of before 2026-11-23.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


async def _case(tmp: Path, how: str) -> dict[str, Any]:
    """One measurement inside the benchmark's namespace (``how``: blackhole or hung)."""
    sys.path[:0] = [str(REPO / "tests" / "unit"), str(REPO / "tests")]
    from test_gc_keepers import Jobs, free_port, held, job_of, node, state  # the tests' rig

    from laminar.jobkit import Checkpointer

    port = free_port()
    job = job_of(tmp)
    conns = [0]

    async def mute(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns[0] += 1
        with contextlib.suppress(Exception):
            await r.read()
        w.close()

    srv = await asyncio.start_server(mute, "127.0.0.1", port) if how == "hung" else None
    full = None
    if how == "blackhole":  # a full accept queue: every further SYN to it is dropped
        full = socket.socket()
        full.bind(("127.0.0.1", port))
        full.listen(0)
        filler = socket.create_connection(("127.0.0.1", port))
    try:
        async with node(tmp, 3, [1, 2, 3], port) as c, node(tmp, 2, [1, 2, 3], port, Jobs([job])) as src:
            if hasattr(src, "prestage"):  # the component's part (issue 32)
                set_keeper, prestage_round = src.prestage.set_keeper, lambda: src.prestage.tick(time.time())
            else:  # a baseline tree from before it: the component's own methods
                set_keeper, prestage_round = src._set_keeper, src._prestage_round
            set_keeper("job-1", 1)  # node 1 keeps the job's older checkpoint, and is silent now
            Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False).save(os.urandom(1 << 20), step=10)
            t0 = time.monotonic()
            nxt = t0
            while not (state(c) == "keeping" and held(c) == ["ckpt-10"]):  # committed there, and kept
                if time.monotonic() >= nxt:
                    prestage_round()
                    nxt += 0.5
                await asyncio.sleep(0.05)
                if time.monotonic() - t0 > 300:
                    raise SystemExit("no replica on node 3 after 300 s")
            took = time.monotonic() - t0
            return {"s_to_replica": round(took, 2), "silent_connections": conns[0]}
    finally:
        if srv is not None:
            srv.close()
        if full is not None:
            filler.close()
            full.close()


def _inner(how: str) -> None:
    import logging
    import tempfile

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="lm-psb-") as d:
        print(json.dumps(asyncio.new_event_loop().run_until_complete(_case(Path(d), how))))


def _measure(tree: Path, how: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--inner", how], env=env, timeout=400, check=True, text=True,
                         capture_output=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inner", choices=("blackhole", "hung"), help=argparse.SUPPRESS)
    p.add_argument("--baseline-tree", type=Path, help="an agent/ directory of another revision")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.inner:
        _inner(a.inner)
        return 0
    res: dict[str, Any] = {}
    trees = [("", REPO / "agent")] + ([("base_", a.baseline_tree)] if a.baseline_tree else [])
    for prefix, tree in trees:
        for how in ("blackhole", "hung"):
            r = _measure(tree.resolve(), how)
            res[f"{prefix}{how}"] = r
            conns = "" if how == "blackhole" else f", {r['silent_connections']} connections to the silent keeper"
            print(f"{prefix or 'this '}{how}: replica on another node {r['s_to_replica']} s after the new checkpoint"
                  f"{conns}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
