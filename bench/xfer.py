"""Checkpoint-transfer benchmark: how fast one agent hands a checkpoint to another, and what
it costs each of them.

Two processes over loopback, as two agents would run: a :class:`laminar.migrate.transfer.Receiver`
and :func:`laminar.migrate.transfer.send_checkpoint` of a jobkit checkpoint of random bytes. The
source checkpoint and the receive root both live on a tmpfs of the benchmark's own (mounted
under a temporary directory, unmounted at the end), so the disk does not bound the figures
and only the agent's own work is measured. Each side runs a ticker coroutine on its event loop
(a 1 ms sleep in a loop) and records the longest lateness: the longest stall of the loop
that answers probes and kill-switches while a transfer runs (``*_stall_max_ms``; on a small
machine running both ends this includes the time the loop's thread waited for a core), and
the most CPU the loop's thread spent between two ticks (``*_busy_max_ms``: the longest stretch
of work that held the loop, which is what the code controls).

Measured per run: wall time from the sender's start (its manifest included: a reclaim builds
it inside the notice window) to the destination's commit, MiB/s over that time; CPU seconds
(user+sys, all threads, process_time) of each side per GiB sent; the sender's manifest time;
the longest loop stall of each side; the receiver's time from its last progress report to
the commit (``commit_s``: its check of everything received and the commit). The figures are medians over the runs. Compared against,
in the same run: a plain TCP copy of the same bytes over loopback (``socket.sendfile`` into
``recv_into``, no hashing, no encryption: the ceiling a transfer over this loopback could
reach) and, with ``--baseline-tree PATH`` (an ``agent/`` directory of another revision), the
same transfer code of that revision.

    python bench/xfer.py [--quick] [--json PATH] [--plot PATH] [--size-mib N] [--runs N]
                         [--baseline-tree PATH]

``--quick``: 256 MiB, 3 runs (about 20 s); else 1024 MiB, 3 runs. Needs root (tmpfs). Keys:
``mib_s``, ``snd_cpu_s_per_gib``, ``rcv_cpu_s_per_gib``, ``snd_stall_max_ms``,
``rcv_stall_max_ms``, ``snd_busy_max_ms``, ``rcv_busy_max_ms``, ``manifest_s``, ``commit_s``, ``tcp_copy_mib_s``, ``ratio_vs_tcp_copy``, and with a
baseline the same keys prefixed ``base_`` and ``speedup_vs_base``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "agent"


# --------------------------------------------------------------------------- the two sides


class _Ticker:
    """The longest lateness of a 1 ms sleep on the running loop (seconds)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.worst = 0.0
        self.busy = 0.0  # the most CPU the loop's thread spent between two ticks: work that held the loop
        self.over_5ms: list[tuple[float, float]] = []  # (seconds since start, lateness)
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        t0 = time.monotonic()
        while True:
            t, c = time.monotonic(), time.thread_time()
            await asyncio.sleep(0.001)
            late = time.monotonic() - t - 0.001
            self.worst = max(self.worst, late)
            self.busy = max(self.busy, time.thread_time() - c)
            if os.environ.get("LM_XFER_STALLS") and time.thread_time() - c > 0.003:
                print(f"{self.role} busy {1e3 * (time.thread_time() - c):.1f} ms at {t - t0:.3f} s", file=sys.stderr)
            if late > 0.005:
                self.over_5ms.append((round(t - t0, 3), round(late * 1e3, 1)))

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass


def _role_serve(root: str, key: bytes) -> None:
    from laminar.migrate.transfer import Receiver

    async def run() -> dict[str, Any]:
        done = asyncio.Event()
        tick = _Ticker("receiver")
        cpu: list[float] = []

        last = [0.0, 0.0]  # the last progress, the commit (monotonic)

        def commit(_c: Any) -> None:
            last[1] = time.monotonic()
            done.set()

        def progress(_p: Any) -> None:
            last[0] = time.monotonic()

        rcv = Receiver(root, key, on_commit=commit, on_progress=progress)
        port = await rcv.start("127.0.0.1", 0)
        print(json.dumps({"port": port}), flush=True)
        tick.start()
        c0 = time.process_time()
        await done.wait()
        cpu.append(time.process_time() - c0)
        await tick.stop()
        await rcv.stop()
        if os.environ.get("LM_XFER_STALLS"):
            print(f"receiver stalls over 5 ms (s, ms): {tick.over_5ms}", file=sys.stderr)
        return {"cpu_s": cpu[0], "stall_max_ms": tick.worst * 1e3, "busy_max_ms": tick.busy * 1e3, "commit_s": last[1] - last[0],
                "stalls_over_5ms": len(tick.over_5ms)}

    print(json.dumps(asyncio.run(run())), flush=True)


def _role_send(port: int, ckpt: str, key: bytes) -> None:
    from laminar.migrate.transfer import build_manifest, send_checkpoint

    async def run() -> dict[str, Any]:
        tick = _Ticker("sender")
        tick.start()
        c0, t0 = time.process_time(), time.monotonic()
        # as a reclaim does (send_checkpoint builds it so): the manifest off the loop, the
        # files' check beside the transfer where this tree has it (check_files), then the transfer
        try:
            m = await asyncio.to_thread(functools.partial(build_manifest, ckpt, "j1", check_files=False))
        except TypeError:  # a baseline tree from before 2026-11-24: the files checked first
            m = await asyncio.to_thread(build_manifest, ckpt, "j1")
        t1 = time.monotonic()
        await send_checkpoint("127.0.0.1", port, ckpt, "j1", key, manifest=m, retries=0)
        out = {"cpu_s": time.process_time() - c0, "manifest_s": t1 - t0, "wall_s": time.monotonic() - t0,
               "stall_max_ms": tick.worst * 1e3, "busy_max_ms": tick.busy * 1e3, "stalls_over_5ms": len(tick.over_5ms)}
        if os.environ.get("LM_XFER_STALLS"):
            print(f"sender stalls over 5 ms (s, ms): {tick.over_5ms}, manifest until {t1 - t0:.3f}", file=sys.stderr)
        await tick.stop()
        return out

    print(json.dumps(asyncio.run(run())), flush=True)


# --------------------------------------------------------------------------- the driver


def _one(tree: Path, ckpt: Path, root: Path, keyhex: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "LM_XFER_KEY": keyhex}
    me = [sys.executable, str(Path(__file__).resolve())]
    srv = subprocess.Popen([*me, "--role", "serve", "--root", str(root)], env=env, stdout=subprocess.PIPE, text=True)
    snd = None
    try:
        assert srv.stdout is not None
        port = json.loads(srv.stdout.readline())["port"]
        snd = subprocess.Popen([*me, "--role", "send", "--port", str(port), "--ckpt", str(ckpt)], env=env,
                               stdout=subprocess.PIPE, text=True)
        out_s, _ = snd.communicate(timeout=600)
        out_r, _ = srv.communicate(timeout=60)
        if snd.returncode or srv.returncode:
            raise SystemExit(f"xfer: a side failed (sender rc {snd.returncode}, receiver rc {srv.returncode})")
        s, r = json.loads(out_s.splitlines()[-1]), json.loads(out_r.splitlines()[-1])
    finally:
        for p in (snd, srv):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    return {"wall_s": s["wall_s"], "snd_cpu_s": s["cpu_s"], "rcv_cpu_s": r["cpu_s"], "manifest_s": s["manifest_s"],
            "snd_stall_max_ms": s["stall_max_ms"], "rcv_stall_max_ms": r["stall_max_ms"], "commit_s": r["commit_s"],
            "snd_busy_max_ms": s["busy_max_ms"], "rcv_busy_max_ms": r["busy_max_ms"]}


def _tcp_copy(path: Path, size: int) -> float:
    """Seconds to copy ``path`` over loopback TCP: sendfile on one side, recv_into the other."""
    ls = socket.create_server(("127.0.0.1", 0))
    port = ls.getsockname()[1]
    got = [0]

    def rx() -> None:
        c, _ = ls.accept()
        buf = bytearray(1 << 20)
        while (n := c.recv_into(buf)) > 0:
            got[0] += n
        c.close()

    th = threading.Thread(target=rx)
    th.start()
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s, open(path, "rb") as f:
        s.sendfile(f)
    th.join()
    ls.close()
    assert got[0] == size
    return time.monotonic() - t0


def _per_gib(rows: list[dict[str, float]], size: int) -> dict[str, float]:
    gib = size / (1 << 30)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"mib_s": size / (1 << 20) / med["wall_s"], "snd_cpu_s_per_gib": med["snd_cpu_s"] / gib,
            "rcv_cpu_s_per_gib": med["rcv_cpu_s"] / gib, "snd_stall_max_ms": med["snd_stall_max_ms"],
            "rcv_stall_max_ms": med["rcv_stall_max_ms"], "manifest_s": med["manifest_s"], "commit_s": med["commit_s"],
            "snd_busy_max_ms": med["snd_busy_max_ms"], "rcv_busy_max_ms": med["rcv_busy_max_ms"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--size-mib", type=int)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline-tree", type=Path, help="an agent/ directory of another revision to compare against")
    ap.add_argument("--role", choices=("serve", "send"), help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        key = bytes.fromhex(os.environ["LM_XFER_KEY"])
        if a.role == "serve":
            _role_serve(a.root, key)
        else:
            _role_send(a.port, a.ckpt, key)
        return 0
    base = a.baseline_tree / "laminar" / "migrate" if a.baseline_tree is not None else None
    if base is not None and not ((base / "transfer.py").is_file() or (base / "transfer" / "__init__.py").is_file()):
        raise SystemExit(f"xfer: --baseline-tree {a.baseline_tree}: no laminar/migrate/transfer.py (or transfer/) "
                         "under it (give an agent/ directory)")
    size = (a.size_mib or (256 if a.quick else 1024)) << 20
    if size <= 0 or a.runs < 1:
        raise SystemExit(f"xfer: --size-mib {a.size_mib} and --runs {a.runs} must be positive")
    sys.path.insert(0, str(TREE))
    from laminar import jobkit

    work = Path(tempfile.mkdtemp(prefix="lm-t-xferbench-"))
    mnt = work / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={3 * size + (256 << 20)},mode=0700", "lm-t-xferbench",
                    str(mnt)], check=True)
    res: dict[str, Any] = {"size_mib": size >> 20, "runs": a.runs}
    try:
        ck = jobkit.Checkpointer(job_id="j1", ckpt_dir=mnt / "src", install_signal=False)
        ck.save(os.urandom(size), step=1)
        ckpt = next((mnt / "src").glob("ckpt-*"))
        blob = max(ckpt.iterdir(), key=lambda p: p.stat().st_size)
        trees = [("", TREE)] + ([("base_", a.baseline_tree.resolve())] if a.baseline_tree else [])
        rows: dict[str, list[dict[str, float]]] = {p: [] for p, _ in trees}
        tcp = []
        keyhex = secrets.token_hex(32)
        for i in range(a.runs):
            for prefix, tree in trees:  # interleaved: drift on a shared machine hits both alike
                root = mnt / "rx"
                subprocess.run(["rm", "-rf", str(root)], check=True)
                rows[prefix].append(_one(tree, ckpt, root, keyhex))
                print(f"run {i} {prefix or 'this'}: {rows[prefix][-1]}", file=sys.stderr, flush=True)
            tcp.append(_tcp_copy(blob, blob.stat().st_size))
        for prefix, _ in trees:
            res.update({prefix + k: round(v, 3) for k, v in _per_gib(rows[prefix], size).items()})
        res["tcp_copy_mib_s"] = round(blob.stat().st_size / (1 << 20) / statistics.median(tcp), 1)
        res["ratio_vs_tcp_copy"] = round(res["mib_s"] / res["tcp_copy_mib_s"], 3)
        if a.baseline_tree:
            res["speedup_vs_base"] = round(res["mib_s"] / res["base_mib_s"], 2)
        res["load_1m"] = round(os.getloadavg()[0], 2)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [p or "this" for p, _ in trees]
        fig, ax = plt.subplots(1, 3, figsize=(11, 3.5))
        ax[0].bar(names + ["tcp copy"], [res[p + "mib_s"] for p, _ in trees] + [res["tcp_copy_mib_s"]])
        ax[0].set_title("MiB/s (loopback)")
        for side in ("snd", "rcv"):
            ax[1].bar([n + f" {side}" for n in names], [res[f"{p}{side}_cpu_s_per_gib"] for p, _ in trees])
            ax[2].bar([n + f" {side}" for n in names], [res[f"{p}{side}_stall_max_ms"] for p, _ in trees])
        ax[1].set_title("CPU s per GiB")
        ax[2].set_title("longest loop stall (ms)")
        fig.tight_layout()
        fig.savefig(a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
