"""A real DDP job (gloo, CPU, examples/ddp_train.py) started the way a multi-node job's members
start it (laminar.members.launch: three torchruns, c10d rendezvous, on 127.0.0.1/2/3), against
the same job run by `torchrun --standalone` by hand; and an elastic job (--nnodes=2:3) that
loses a member after a checkpoint: TorchElastic restarts the two left, they resume from the
checkpoint and end with the weights of the unresized run. No root: everything on loopback."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from laminar.members.launch import MemberBlock, launch

REPO = Path(__file__).resolve().parents[2]
EX = str(REPO / "examples/ddp_train.py")
ADDRS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
JOB = "job-7-n3"
ARGS = ["--steps", "40", "--samples", "256", "--global-batch", "30"]  # 30: uneven slices on 2 and 3... (15/15, 10/10/10) and 4 below
# short rendezvous timeouts: a dead member is noticed in 2 s, the round closes 1 s after min joined
RDZV = {"join_timeout": 60, "last_call_timeout": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 2}

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def reaped() -> Iterator[dict[str, str]]:
    """The environment of this module's processes, marked: every process still carrying the
    mark at the end is killed (torchrun starts each worker in a session of its own, so a worker
    outlives a torchrun killed or timed out)."""
    mark = secrets.token_hex(8)
    yield {**os.environ, "LM_DDP_TEST": mark}
    for q in psutil.process_iter():
        try:
            if q.pid != os.getpid() and q.environ().get("LM_DDP_TEST") == mark:
                q.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _block(i: int, lo: int, hi: int, port: int) -> MemberBlock:
    return MemberBlock.from_dict({"job": JOB, "origin": 3, "index": i, "count": 3, "min": lo, "max": hi,
                                  "nodes": [[n + 1, a] for n, a in enumerate(ADDRS)],
                                  "endpoint": f"127.0.0.1:{port}", "launcher": "torchrun", "generation": 0})


class Member:
    """One member's torchrun, its output lines gathered by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.lines: list[dict[str, object]] = []
        self.log = open(log, "w")
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  start_new_session=True, cwd=REPO)
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def kill_all(self) -> None:
        """SIGKILL to torchrun and every process under it (a node gone)."""
        try:
            procs = [psutil.Process(self.p.pid), *psutil.Process(self.p.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for q in procs:
            try:
                q.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass

    def close(self) -> None:
        self.kill_all()
        self.p.wait(timeout=10)
        self.log.close()


def _members(base: dict[str, str], tmp: Path, lo: int, hi: int, extra: list[str], out: Path) -> list[Member]:
    port = _free_port()
    ms = []
    for i in range(3):
        b = _block(i, lo, hi, port)
        ln = launch(b, [sys.executable, EX, *ARGS, *extra, "--out", str(out)], ifname="lo", rdzv_conf=RDZV)
        env = {**base, **ln.env, "LAMINAR_CKPT_DIR": str(tmp / "ckpt"), "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"}
        ms.append(Member(ln.argv, env, tmp / f"member{i}.log"))
    return ms


def _weights(p: Path) -> dict[str, object]:
    return torch.load(p, weights_only=True)


def _close(ws: dict[str, object], ref: dict[str, object]) -> None:
    assert ws.keys() == ref.keys()
    for k in ws:
        torch.testing.assert_close(ws[k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory: pytest.TempPathFactory, reaped: dict[str, str]) -> Path:
    """The job run by torchrun by hand, three workers on one node."""
    d = tmp_path_factory.mktemp("byhand")
    out = d / "w.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                    EX, *ARGS, "--out", str(out)], check=True, capture_output=True, timeout=120, cwd=d,
                   env=reaped)
    return out


def _wait(ms: list[Member], timeout: float) -> None:
    end = time.monotonic() + timeout
    for m in ms:
        m.p.wait(timeout=max(1.0, end - time.monotonic()))
        m.t.join(timeout=5)


def test_three_members_launched_as_laminar_does_end_as_torchrun_by_hand(tmp_path: Path, by_hand: Path,
                                                                      reaped: dict[str, str]) -> None:
    out = tmp_path / "w.pt"
    ms = _members(reaped, tmp_path, 3, 3, [], out)
    try:
        _wait(ms, 120)
    finally:
        for m in ms:
            m.close()
    assert [m.p.returncode for m in ms] == [0, 0, 0], [(tmp_path / f"member{i}.log").read_text()[-2000:] for i in range(3)]
    starts = [e for m in ms for e in m.lines if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts) == [0, 1, 2] and {e["world"] for e in starts} == {3}
    _close(_weights(out), _weights(by_hand))


def test_an_elastic_job_that_loses_a_member_goes_on_with_two_and_ends_as_unresized(tmp_path: Path, by_hand: Path,
                                                                                  reaped: dict[str, str]) -> None:
    out = tmp_path / "w.pt"
    ms = _members(reaped, tmp_path, 2, 3, ["--ckpt-every", "10", "--step-sleep", "0.1"], out)
    try:
        # wait for the first checkpoint (rank 0's line, on whichever member holds rank 0)
        end = time.monotonic() + 90
        while not any(e["event"] == "checkpoint" for m in ms for e in m.lines):
            assert time.monotonic() < end, "no checkpoint"
            assert all(m.p.poll() is None for m in ms)
            time.sleep(0.05)
        ck = next(e for m in ms for e in m.lines if e["event"] == "checkpoint")
        killed_at = time.monotonic()
        ms[2].kill_all()  # not member 0: its torchrun hosts the c10d store
        _wait(ms[:2], 120)
        took = time.monotonic() - killed_at
    finally:
        for m in ms:
            m.close()
    assert [m.p.returncode for m in ms[:2]] == [0, 0], [(tmp_path / f"member{i}.log").read_text()[-3000:] for i in range(3)]
    restarted = [e for m in ms[:2] for e in m.lines if e["event"] == "start" and e["restarts"] > 0]
    assert len(restarted) == 2 and {e["world"] for e in restarted} == {2}, restarted
    assert all(e["resumed"] and e["step"] >= ck["step"] for e in restarted), (restarted, ck)
    done = [e for m in ms[:2] for e in m.lines if e["event"] == "done"]
    assert len(done) == 1 and done[0]["world"] == 2
    _close(_weights(out), _weights(by_hand))
    print(f"elastic: checkpoint at step {ck['step']}, member 2 killed, the two left ended {took:.1f} s later")
