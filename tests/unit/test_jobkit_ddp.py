"""jobkit in a job of several processes: global_batch's arithmetic (the same global batch and
the same gradient at any world size), rank-0 saves, and the flag and resume agreed across a
real gloo group of two processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from laminar import jobkit
from laminar.jobkit import Checkpointer, CheckpointError, global_batch

REPO = Path(__file__).resolve().parents[2]


def _whole(step: int, world: int, b: int, n: int, seed: int) -> list[int]:
    return [i for r in range(world) for i in global_batch(step, r, world, b, n, seed).indices]


@pytest.mark.parametrize("b", [1, 2, 7, 30, 64])
def test_the_global_batch_is_the_same_at_every_world_size(b: int) -> None:
    for step in (0, 1, 5, 123):
        want = _whole(step, 1, b, 97, 3)
        assert len(want) == b
        for world in range(2, 9):
            parts = [global_batch(step, r, world, b, 97, 3) for r in range(world)]
            assert [i for p in parts for i in p.indices] == want
            sizes = [len(p.indices) for p in parts]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert [p.start for p in parts] == [sum(sizes[:r]) for r in range(world)]
            assert {p.loss_scale for p in parts} == {world / b}


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    n, b = 96, 8
    epochs = [[i for s in range(e * n // b, (e + 1) * n // b) for i in _whole(s, 1, b, n, 9)] for e in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]
    assert _whole(0, 1, b, n, 9) != _whole(0, 1, b, n, 10)  # the seed matters
    assert _whole(0, 1, b, n, 9) == _whole(0, 1, b, n, 9)  # and nothing else
    for n in (1, 2, 3, 5, 1000, 1023, 1024, 1025):
        assert sorted(_whole(0, 1, n, n, 1)) == list(range(n))


def test_the_averaged_gradient_is_the_mean_s_at_any_world_size() -> None:
    """What DDP computes (each rank's gradient of its scaled loss, averaged over the ranks)
    equals the gradient of the mean loss over the global batch, uneven slices included."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 4, generator=g, dtype=torch.float64), torch.randn(50, 1, generator=g, dtype=torch.float64)
    w0 = torch.randn(4, 1, generator=g, dtype=torch.float64)

    def grad(idx: list[int], scale: float) -> torch.Tensor:
        w = w0.clone().requires_grad_(True)
        t = torch.tensor(idx, dtype=torch.long)
        (((x[t] @ w - y[t]) ** 2).sum() * scale).backward()
        assert w.grad is not None
        return w.grad

    for step in range(4):
        whole = global_batch(step, 0, 1, 10, 50, 5).indices
        t = torch.tensor(whole, dtype=torch.long)
        w = w0.clone().requires_grad_(True)
        ((x[t] @ w - y[t]) ** 2).mean().backward()
        for world in (1, 2, 3, 4, 7, 12):
            avg = sum(grad(s.indices, s.loss_scale) for s in
                      (global_batch(step, r, world, 10, 50, 5) for r in range(world))) / world
            torch.testing.assert_close(avg, w.grad)


@pytest.mark.parametrize("args, words", [
    ((-1, 0, 1, 8, 10, 0), "step -1"),
    ((0, 3, 3, 8, 10, 0), "rank 3 is not in 0..2"),
    ((0, 0, 0, 8, 10, 0), "world 0"),
    ((0, 0, 1, 0, 10, 0), "global_batch 0"),
    ((0, 0, 1, 8, 0, 0), "n_samples 0"),
    ((0, 0, 1, 8, 10, -1), "seed -1"),
    ((0, 0, 1, 8.0, 10, 0), "global_batch 8.0"),
    ((0, True, 2, 8, 10, 0), "rank True"),
    ((0, 0, 1, 1 << 30, 10, 0), "global_batch 1073741824"),
])
def test_bad_arguments_are_named(args: tuple[int, ...], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        global_batch(*args)


def test_work_is_the_slice_s_not_the_data_set_s() -> None:
    t = time.monotonic()
    s = global_batch(10**12, 5, 8, 4096, 1 << 62, 7)
    assert len(s.indices) == 512 and all(0 <= i < 1 << 62 for i in s.indices)
    assert time.monotonic() - t < 2.0


def test_only_rank_0_writes(tmp_path: Path) -> None:
    r1 = Checkpointer(ckpt_dir=tmp_path, install_signal=False, rank=1)
    r1.request()
    assert r1.save(b"state", step=4) == tmp_path / "ckpt-4"
    assert not r1.requested() and not (tmp_path / "ckpt-4").exists() and r1.saved == []
    with pytest.raises(CheckpointError, match="rank 1: save needs step="):
        r1.save(b"state")
    r0 = Checkpointer(ckpt_dir=tmp_path, install_signal=False, rank=0)
    assert r0.save(b"state", step=4) == tmp_path / "ckpt-4" and jobkit.verify_checkpoint(tmp_path / "ckpt-4")
    with pytest.raises(CheckpointError, match="rank must be an integer >= 0"):
        Checkpointer(ckpt_dir=tmp_path, install_signal=False, rank=-1)


def test_rank_defaults_to_the_environment_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    assert Checkpointer(ckpt_dir=tmp_path, install_signal=False).rank == 2
    monkeypatch.setenv("RANK", "junk")
    assert Checkpointer(ckpt_dir=tmp_path, install_signal=False).rank == 0
    monkeypatch.delenv("RANK")
    c = Checkpointer(ckpt_dir=tmp_path, install_signal=False)
    assert c.rank == 0
    c.request()
    assert c.requested_all()  # no group: requested()


def test_after_a_torchelastic_restart_it_resumes_from_its_own_newest(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    first = tmp_path / "first"
    Checkpointer(ckpt_dir=first, install_signal=False).save(b"from the agent", step=3)
    own = tmp_path / "own"
    monkeypatch.setenv("LAMINAR_RESUME_FROM", str(first / "ckpt-3"))
    c = Checkpointer(ckpt_dir=own, install_signal=False)
    assert c.resume() == b"from the agent"  # the job's first start
    c.save(b"newer", step=9)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    c2 = Checkpointer(ckpt_dir=own, install_signal=False)
    assert c2.resume() == b"newer" and c2.resumed_step == 9
    c3 = Checkpointer(ckpt_dir=tmp_path / "empty", install_signal=False)
    assert c3.resume() == b"from the agent"  # restarted before its first save


GROUP_JOB = """
import json, os, sys
sys.path.insert(0, {agent!r})
import torch.distributed as dist
from laminar import jobkit
ck = jobkit.Checkpointer(install_signal=False)
dist.init_process_group("gloo")
r = dist.get_rank()
out = {{"rank": r, "ck_rank": ck.rank}}
out["none"] = ck.requested_all()
if r == 1:
    ck.request()
out["one"] = ck.requested_all()
p = ck.save(b"state %d" % r, step=5)
out["cleared"] = not ck.requested() and not ck.requested_all()
if r == 1:
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # rank 1 alone: rank 0's choice counts
out["resumed"] = ck.resume().decode()
out["path"] = str(p)
print(json.dumps(out), flush=True)
dist.barrier()
os._exit(0)
"""


def test_a_real_group_agrees_on_the_flag_and_the_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    older = tmp_path / "older"
    Checkpointer(ckpt_dir=older, install_signal=False).save(b"older", step=2)
    procs = []
    for r in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "2",
               "LAMINAR_CKPT_DIR": str(tmp_path / "ck"), "LAMINAR_RESUME_FROM": str(older / "ckpt-2"),
               "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen([sys.executable, "-c", GROUP_JOB.format(agent=str(REPO / "agent"))], env=env,
                                      stdout=subprocess.PIPE, text=True))
    try:
        outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0]
    for r, o in enumerate(outs):
        assert o["rank"] == o["ck_rank"] == r
        assert o == {**o, "none": False, "one": True, "cleared": True, "path": str(tmp_path / "ck/ckpt-5")}
        # rank 0 (no TorchElastic restart) chose LAMINAR_RESUME_FROM; rank 1 loaded that, not its own newest
        assert o["resumed"] == "older"
    assert jobkit.verify_checkpoint(tmp_path / "ck/ckpt-5") and (tmp_path / "ck/ckpt-5/state.bin").read_bytes() == b"state 0"
