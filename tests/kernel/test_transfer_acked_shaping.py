"""A shaped checkpoint transfer's progress in the shaper's registry is what the destination's TCP
acknowledged, not the leaf's estimate.

Node a runs netguard (the stand-in of test_killswitch_dataplane) and the HTB tree; the transfer
registry (real code) ticks the shaper on its own thread. The receiver is a real endpoint in
namespace b (``python -m laminar.migrate.transfer serve``). The sender is the real
``send_checkpoint`` with the agent's real flow hook adapter (``mover._ShaperHook``), run on an
event loop in a thread of this process that entered namespace a (setns), so its socket is node
a's and its packets go through the transfer's leaf. While it runs, the registry's progress is
sampled and compared with ``bytes_received`` of the receiver's socket (``ss -ti`` in namespace b):
never ahead of it. At the transfer's end (when the adapter removes it) the registry holds the
total, reported as acknowledged, and the shaper calls it done. Before the sender reported
acknowledged bytes, progress was the leaf's count x 0.94 (never the total, status never done).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_killswitch_dataplane import start_dataplane, stop_dataplane
from test_transfer import keyfile, port, procs, serve  # noqa: F401  (procs: the fixture)
from xferrig import make_ckpt

from laminar.migrate.mover import _ShaperHook
from laminar.migrate.transfer import send_checkpoint
from laminar.net.htb import HtbTree
from laminar.net.transfers import TransferRegistry
from laminar.zone.keys import load_keys

pytestmark = pytest.mark.kernel
MBIT = 1_000_000
MB = 1 << 20
CLONE_NEWNET = 0x40000000


def received_by(ns: Any, lport: int) -> int:
    """``bytes_received`` of the connection to ``lport`` in ``ns`` (0 before it exists)."""
    out = ns.run("ss", "-tinH", "state", "established", f"( sport = :{lport} )").stdout
    m = re.search(r"bytes_received:(\d+)", out)
    return int(m.group(1)) if m else 0


def in_netns(path: str, fn: Any) -> Any:
    """Runs ``fn()`` in a new thread that entered the network namespace at ``path``; returns its
    result or raises its exception. Sockets it creates belong to that namespace."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(path, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {path}")
            finally:
                os.close(fd)
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=run, name="lm-t-sender")
    th.start()
    th.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_registry_progress_is_the_bytes_the_destination_acknowledged(veth_pair, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    vp = veth_pair
    link, floor = 200 * MBIT, 80 * MBIT
    key_path, pt = keyfile(tmp_path), port()
    key = load_keys(str(key_path)).get(0)
    assert key is not None
    ckpt = make_ckpt(tmp_path, 4 * MB + 4321)
    serve(vp, procs, tmp_path / "dst", key_path, pt, tmp_path)
    dp = start_dataplane(vp.a.argv(), vp.ifname_a, "ack")
    tree = HtbTree(vp.ifname_a, link, floor, netns=vp.a.name)
    try:
        tree.setup()
        reg = TransferRegistry(tree=tree, flows_map=dp.map("lm_flows"))
        reg.configure(link, floor, margin=0.1)
        samples: list[tuple[int, str, int]] = []  # (registry progress, its source, bytes the receiver got)
        at_remove: list[dict[str, Any]] = []
        remove = reg.remove

        def recording_remove(tid: str) -> Any:  # on the registry's thread, as every change
            reg.tick()  # the shaper's decision on what the registry holds now
            t = reg.transfers[tid]
            at_remove.append({**t.as_dict(time.monotonic_ns(), tree.major), "leaf_bytes": tree.leaf_stats()[t.minor].bytes})
            return remove(tid)

        reg.remove = recording_remove  # type: ignore[method-assign]
        stop = threading.Event()

        def sampler() -> None:
            while not stop.wait(0.05):
                for t in list(reg.transfers.values()):
                    sent, source = t.sent_bytes, getattr(t, "progress", "estimated")
                    samples.append((sent, source, received_by(vp.b, pt)))

        async def main() -> Any:
            ticker = asyncio.create_task(reg._ticker())
            try:
                hook = _ShaperHook(reg, SimpleNamespace(id="job-ack", num=1))
                # 4 MiB in 3 s: about 12 Mbit/s with the margin, so the transfer lasts long enough to sample
                return await send_checkpoint(vp.addr_b, pt, ckpt, "job-ack", key, flow_hook=hook,
                                             deadline_monotonic=time.monotonic() + 3.0)
            finally:
                ticker.cancel()

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        try:
            res = in_netns(vp.a.path, lambda: asyncio.run(main()))
        finally:
            stop.set()
            th.join()
        assert res.remote_path and res.sent_bytes == res.total_bytes
        assert len(at_remove) == 1, "the transfer was never registered with the shaper (or removed twice)"
        end = at_remove[0]
        assert end["total_bytes"] == res.total_bytes
        # At its end the registry holds every byte, so the shaper calls it done ...
        assert (end["sent_bytes"], end["status"]) == (end["total_bytes"], "done"), end
        # ... confirmed by the destination, and says so.
        assert end.get("progress") == "acked" and end.get("estimated") is False, end
        # It went through its leaf (the shaper really carried it).
        assert end["leaf_bytes"] >= res.total_bytes, end
        assert any(src == "acked" for _, src, _ in samples), "no acknowledged progress while it ran"
        # While it ran: never ahead of what the receiver's socket had received (which also counts
        # the handshake and the records' framing: payload acknowledged is less still).
        ahead = [(s, got) for s, src, got in samples if src == "acked" and got and s > got]
        assert not ahead, f"registry progress ahead of the bytes received: {ahead[:5]}"
        acked = [s for s, src, _ in samples if src == "acked"]
        assert acked == sorted(acked), "acknowledged progress went back"
    finally:
        tree.teardown()
        stop_dataplane(dp)
