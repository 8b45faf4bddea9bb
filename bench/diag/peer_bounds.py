"""What attacks on the checkpoint-transfer port cost the agent: a real
:class:`laminar.migrate.transfer.Receiver` in this process (node 1 at 127.0.0.1, as the agent
builds it: its roster 127.0.0.1 and node 2 at 127.0.0.2), the attacker in another process
(``tests/cluster/peerattack.py``), so the figures are the receiver's alone.

1. ``flood``: an off-roster host (40 addresses 127.0.1.1-40) opens as many connections as it
   can, dripping a byte every 2 s, for ``--seconds``: the receiver's open file descriptors
   (``fds_base``, ``fds_most``) and what the flooder held (``flood``).
2. ``member``: node 2 (the zone key, from 127.0.0.2) holds 64 authenticated connections idle,
   then sends four 15 MiB control headers, a 15 MiB offer and a chunk before an offer: the
   receiver's resident memory (``rss_base_mib``, ``rss_most_mib``), the longest lateness of a
   1 ms sleep on its event loop (``loop_late_max_s``: a stall of everything the agent does),
   and the answers.

``--tree PATH`` (an ``agent/`` directory of another revision) measures that revision's code:
``python bench/diag/peer_bounds.py --tree /tmp/old/agent`` after
``git archive <rev> agent | tar -x -C /tmp/old``. Prints one JSON object (``--json PATH``: also
written there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ATTACK = REPO / "tests" / "cluster" / "peerattack.py"


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _run(cmd: list[str], env: dict[str, str]) -> tuple[dict[str, Any], float, float, float]:
    """Runs the attacker; meanwhile samples this process: (its JSON, most fds, most RSS MiB,
    longest loop lateness s)."""
    most_fd, most_rss, late = 0, 0.0, 0.0
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out = asyncio.ensure_future(proc.communicate())
    while not out.done():
        t0 = time.monotonic()
        await asyncio.sleep(0.001)
        late = max(late, time.monotonic() - t0 - 0.001)
        most_fd, most_rss = max(most_fd, _fds()), max(most_rss, _rss_mib())
    stdout, stderr = out.result()
    try:
        res = json.loads(stdout.decode().strip().splitlines()[-1])
    except (IndexError, ValueError):
        res = {"error": stderr.decode()[-2000:]}
    return res, most_fd, most_rss, late


async def main(a: argparse.Namespace) -> dict[str, Any]:
    import laminar
    from laminar.migrate import transfer as T

    key = secrets.token_bytes(32)
    tmp = Path(tempfile.mkdtemp(prefix="lm-peer-bounds-"))
    keys = tmp / "zone.keys"
    keys.write_text(f"1 {key.hex()}\n")
    os.chmod(keys, 0o600)
    roster = {1: "127.0.0.1", 2: "127.0.0.2"}

    def on_control(node: str, op: str, body: Any) -> Any:
        if not isinstance(body, dict):
            raise ValueError(f"body of {op!r} must be an object")
        return {"ok": op}

    kw: dict[str, Any] = {"on_control": on_control, "sources": roster.get}
    try:
        from laminar.zone.gate import Gate

        rcv = T.Receiver(tmp / "root", lambda z: key, gate=Gate(lambda: set(roster.values())), **kw)
    except (ImportError, TypeError):  # a revision before the gate
        rcv = T.Receiver(tmp / "root", lambda z: key, **kw)
    port = await rcv.start("127.0.0.1", 0)
    env = {**os.environ, "PYTHONPATH": str(Path(laminar.__file__).resolve().parents[1])}
    out: dict[str, Any] = {"tree": str(Path(laminar.__file__).resolve().parents[1])}
    try:
        fds0 = _fds()
        res, fd_most, _, _ = await _run(
            [sys.executable, str(ATTACK), "flood", "--target", "127.0.0.1", "--transfer", str(port), "--sources",
             ",".join(f"127.0.1.{k}" for k in range(1, 41)), "--seconds", str(a.seconds), "--max", "4000",
             "--rate", "400", "--drip", "2"], env)
        out["flood"] = {"fds_base": fds0, "fds_most": fd_most, "flooder": res}
        await asyncio.sleep(1)
        rss0 = _rss_mib()
        res, _, rss_most, late = await _run(
            [sys.executable, str(ATTACK), "member", "--target", "127.0.0.1", "--port", str(port), "--local",
             "127.0.0.2", "--key-file", str(keys), "--zone", "1", "--node", "2", "--idle", "64", "--big",
             str(15 << 20)], env)
        out["member"] = {"rss_base_mib": round(rss0, 1), "rss_most_mib": round(rss_most, 1),
                         "loop_late_max_s": round(late, 3),
                         "idle": res.get("idle"), "answers": [(b["what"], b["answer"][:120], b["s"])
                                                             for b in res.get("big", [])]}
    finally:
        await rcv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=None, help="an agent/ directory of another revision to measure")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.tree).resolve()) if args.tree else str(REPO / "agent"))
    result = asyncio.run(main(args))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
