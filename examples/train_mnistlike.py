"""A small, deterministic PyTorch training job (CPU) that honours Laminar's checkpoint contract.

It trains a two-layer MLP on synthetic MNIST-shaped data (28x28 inputs, 10 classes). Every
batch is generated from ``(seed, step)`` alone and the model runs single-threaded, so a run
that is checkpointed, killed and resumed elsewhere (``LAMINAR_RESUME_FROM``) ends with exactly
the same weights as an uninterrupted run with the same seed. The contract is the three
marked lines.

    python examples/train_mnistlike.py --steps 300 --out /tmp/w.pt
    LAMINAR_CKPT_DIR=/tmp/ck python examples/train_mnistlike.py --steps 300 --step-sleep 0.01 &
    kill -USR1 $!          # asks for a checkpoint; it lands in /tmp/ck/ckpt-<step>

``--step-sleep-after-resume S`` sleeps S seconds per step instead once the run resumed from a
checkpoint (the sleep does not touch the weights): a test that watches the job before it moves
but only waits for the resumed run's end sets it to 0, so the move's far side ends at once.
``--step-sleep-until PATH`` ends the per-step sleeps (both) once PATH exists: a test that needs
the run alive until it saw something (a later checkpoint archived, a node gone) creates PATH
then, and the run goes on to its end at full speed (the same weights: the sleeps touch nothing).

Prints one JSON line per event (``start``, ``checkpoint``, ``done`` with the SHA-256 of the
final weights, and with ``--log-steps`` a ``step`` line after each step: the work log) so tests
and the agent's log can follow it.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))  # run from a checkout
from laminar import jobkit  # noqa: E402


def batch(seed: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a function of (seed, step) only, so resuming replays it exactly."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, 1, 28, 28, generator=g)
    # a learnable target: the class is decided by a fixed random projection of the input
    proj = torch.Generator().manual_seed(seed)
    w = torch.randn(28 * 28, 10, generator=proj)
    y = (x.flatten(1) @ w).argmax(dim=1)
    return x, y


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ckpt-every", type=int, default=0, help="also checkpoint every N steps (0: only on request)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (to watch it)")
    ap.add_argument("--step-sleep-after-resume", type=float, default=None, metavar="S",
                    help="seconds to sleep per step once resumed from a checkpoint (default: --step-sleep)")
    ap.add_argument("--step-sleep-until", type=Path, default=None, metavar="PATH",
                    help="no more per-step sleeps once PATH exists (checked after every step)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden units (the checkpoint's size grows with it)")
    ap.add_argument("--log-steps", action="store_true", help="print a step event after every step (the work log)")
    ap.add_argument("--exit-after-checkpoint", action="store_true", help="stop once a requested checkpoint is saved")
    ap.add_argument("--out", type=Path, help="write the final state dict here")
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, a.hidden), nn.ReLU(), nn.Linear(a.hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    ckpt_dir = os.environ.get("LAMINAR_CKPT_DIR")
    if not ckpt_dir:  # run by hand, not by laminard: checkpoints in a directory removed at exit
        ckpt_dir = tempfile.mkdtemp(prefix="laminar-ckpt-")
        atexit.register(shutil.rmtree, ckpt_dir, True)
    ckpt = jobkit.Checkpointer(ckpt_dir=ckpt_dir)  # contract 1/3
    state = ckpt.resume()  # contract 2/3
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    say(event="start", step=start, resumed=state is not None, pid=os.getpid())
    step_sleep = a.step_sleep
    if state is not None and a.step_sleep_after_resume is not None:
        step_sleep = a.step_sleep_after_resume

    loss = torch.tensor(0.0)
    for step in range(start, a.steps):
        x, y = batch(a.seed, step, a.batch)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if a.log_steps:
            say(event="step", step=step + 1)
        if step_sleep and a.step_sleep_until is not None and os.path.exists(a.step_sleep_until):
            step_sleep = 0.0  # released: the rest of the run at full speed
        if step_sleep:
            time.sleep(step_sleep)
        periodic = a.ckpt_every > 0 and (step + 1) % a.ckpt_every == 0
        if ckpt.requested() or periodic:  # contract 3/3
            asked = ckpt.requested()
            path = ckpt.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, step=step + 1)
            say(event="checkpoint", step=step + 1, path=str(path), requested=asked)
            if asked and a.exit_after_checkpoint:
                say(event="exit", step=step + 1)
                return 0
    if a.out:
        torch.save(model.state_dict(), a.out)
    say(event="done", step=a.steps, loss=float(loss.detach()), weights_sha256=weights_sha256(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
