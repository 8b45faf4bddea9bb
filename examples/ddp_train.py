"""A small, deterministic PyTorch DDP training job (gloo, CPU) that honours Laminar's
checkpoint contract in a job of several processes (a multi-node job's members, or torchrun).

A two-layer MLP learns a fixed random regression on synthetic data (``--samples`` rows drawn
from ``--seed``), with plain SGD. Every step's global batch (``--global-batch``) is
``jobkit.global_batch``'s: the same samples in the same order whatever the world size, each
rank's loss scaled so that DDP's gradient average is the gradient of the mean loss over the
global batch. A run resized from 3 workers to 2 (or resumed from a checkpoint) ends with the
final weights of an unresized run, within float tolerance (the sum of the ranks' gradients is
added in another order).

It runs under torchrun unchanged, and under Laminar's plain launcher (``MASTER_ADDR``,
``RANK``, ``WORLD_SIZE`` from the environment)::

    torchrun --standalone --nproc-per-node 3 examples/ddp_train.py --steps 60 --out /tmp/w.pt
    LAMINAR_CKPT_DIR=/tmp/ck torchrun ... examples/ddp_train.py --step-sleep 0.05 &
    kill -USR1 <a worker's pid>   # every rank checkpoints at the same step; rank 0 commits

It resumes from ``LAMINAR_RESUME_FROM`` (and, after TorchElastic restarted its workers, from
the newest checkpoint in ``LAMINAR_CKPT_DIR``). Prints one JSON line per event: ``start``
(rank, world size, the step it resumed from, TorchElastic's restart count), ``checkpoint``
(rank 0), ``done`` (rank 0: the sum and SHA-256 of the final weights, and rank 0's step times:
``step_ms_median``, ``step_ms_mean``, ``step_ms_p90`` over ``steps_timed`` steps, each step from
its batch to its checkpoint agreement inclusive, checkpoint writes and ``--step-sleep`` excluded,
the first ``--warmup-steps`` of this run left out; ``loop_s``, the whole loop's wall time). With
``--out`` rank 0 writes the final weights there (``torch.save`` of the state dict).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))  # run from a checkout
from laminar import jobkit  # noqa: E402

IN, HIDDEN = 8, 16


def dataset(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples: inputs and a noisy fixed nonlinear target, a function of ``seed`` alone."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    w = torch.randn(IN, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def model_of(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def weights_digest(model: nn.Module) -> tuple[float, str]:
    h = hashlib.sha256()
    total = 0.0
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
        total += float(t.double().sum())
    return total, h.hexdigest()


def step_summary(step_s: list[float]) -> dict[str, float | int]:
    """Median, mean and 90th percentile of the step times (ms), and how many there were."""
    if not step_s:
        return {"steps_timed": 0}
    ms = sorted(t * 1000 for t in step_s)
    return {"steps_timed": len(ms), "step_ms_median": round(statistics.median(ms), 4),
            "step_ms_mean": round(statistics.fmean(ms), 4), "step_ms_p90": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 4)}


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> NoReturn:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--ckpt-every", type=int, default=0, help="also checkpoint every N steps (0: only on request)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (to watch it)")
    ap.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the step-time summary")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a collective waits for a peer")
    ap.add_argument("--out", type=Path, default=None, help="rank 0 writes the final weights here")
    a = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # outside Laminar (no LAMINAR_CKPT_DIR), checkpoints go to a directory of this run's own
    ckpt = jobkit.Checkpointer(ckpt_dir=os.environ.get("LAMINAR_CKPT_DIR") or tempfile.mkdtemp(prefix="ddp-ckpt-"), keep=3)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = dataset(a.seed, a.samples)
    model = model_of(a.seed)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    start = 0
    state = ckpt.resume()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
    say(event="start", rank=rank, world=world, step=start, resumed=state is not None,
        restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), pid=os.getpid())
    step_s: list[float] = []
    loop0 = time.perf_counter()
    for step in range(start, a.steps):
        t0 = time.perf_counter()
        s = jobkit.global_batch(step, rank, world, a.global_batch, a.samples, a.seed)
        idx = torch.tensor(s.indices, dtype=torch.long)
        loss = ((ddp(x[idx]) - y[idx]) ** 2).sum() * s.loss_scale
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        asked = ckpt.requested_all()  # every rank, every step: they agree on the step
        if step - start >= a.warmup_steps:
            step_s.append(time.perf_counter() - t0)
        if asked or (a.ckpt_every and (step + 1) % a.ckpt_every == 0):
            path = ckpt.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, step=step + 1)
            if rank == 0:
                say(event="checkpoint", step=step + 1, path=str(path), requested=asked, world=world)
        if a.step_sleep:
            time.sleep(a.step_sleep)
    loop_s = time.perf_counter() - loop0
    total, sha = weights_digest(model)
    if rank == 0:
        if a.out is not None:
            torch.save(model.state_dict(), a.out)
        say(event="done", rank=rank, world=world, steps=a.steps, weights_sum=total, weights_sha256=sha,
            **step_summary(step_s), loop_s=round(loop_s, 4))
    dist.barrier()
    # Ends here, without the interpreter's teardown: freeing DDP's reducer joins gloo's thread
    # while holding the GIL that thread waits for (torch 2.13, gloo): one run in a few hung at
    # exit after its last line, its work done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
