"""gpus.allocate (the pure choice of a job's GPU indices) keeps its contract
for every input: a GPU goes to a job at most once, and a count is a whole number >= 0.

Declared GPUs (the config's stand-in where NVML finds none: this machine has no GPU)."""

from __future__ import annotations

import pytest

from laminar.runtime.gpus import Gpu, GpuInventory, allocate, cuda_env

INV = GpuInventory("declared", [Gpu(i, "declared (no NVML device)") for i in range(4)])


def test_negative_count_is_refused_not_all_but_one_gpu() -> None:
    """Was: allocate(inv, [], -1) returned free[:-1], three of the four GPUs, to a job that
    asked for -1."""
    with pytest.raises(ValueError, match=r"gpus: a count must be a whole number >= 0, got -1"):
        allocate(INV, [], -1)


def test_bool_is_not_a_count() -> None:
    """Was: True counted as 1 GPU."""
    with pytest.raises(ValueError, match=r"gpus: a count must be a whole number >= 0, got True"):
        allocate(INV, [], True)


def test_one_gpu_listed_twice_is_refused() -> None:
    """Was: [0, 0] returned [0, 0]: one GPU counted as two, listed twice in
    CUDA_VISIBLE_DEVICES."""
    with pytest.raises(ValueError, match=r"gpus: indices \[0\] listed more than once"):
        allocate(INV, [], [0, 0])
    assert allocate(INV, [1], [0, 2]) == [0, 2]
    assert cuda_env(INV, allocate(INV, [0], 2))["CUDA_VISIBLE_DEVICES"] == "1,2"
