"""The 130% allocation experiment (run_allocation, and the agents' packing run
through the same inflate) refuses a pod list that can never reach the target instead of
growing its list without end. Real reader on a file in tmp_path."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from laminar.sim.allocation import inflate, run_allocation
from laminar.sim.trace import NodeSpec, read_openb_pods

HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def test_cpu_only_pod_list_is_refused_not_an_endless_loop(tmp_path: Path) -> None:
    """Was: inflate drew CPU-only pods (0 GPUs each) forever, never passing 1.3 x capacity:
    the run never returned and its memory grew until the kernel killed it."""
    p = tmp_path / "cpu_pods.csv"
    p.write_text(HEADER + "a,1000,100,0,0,,BE,Running,0,10,0\nb,2000,100,0,0,,BE,Running,0,10,0\n")
    pods = read_openb_pods(p)
    nodes = [NodeSpec("n", 8, 96.0, 786_432)]
    with pytest.raises(ValueError, match=r"no pod asks for a GPU"):
        run_allocation(nodes, pods, "bestfit", seed=1)


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.nan, math.inf])
def test_bad_ratio_is_refused(tmp_path: Path, ratio: float) -> None:
    """Was: ratio inf drew pods forever; NaN, 0 and -1 silently emptied the list."""
    p = tmp_path / "pods.csv"
    p.write_text(HEADER + "a,1000,100,1,1000,,BE,Running,0,10,0\n")
    with pytest.raises(ValueError, match=r"ratio .* must be a finite number > 0"):
        inflate(read_openb_pods(p), 8.0, ratio, random.Random(0))


def test_empty_pod_list_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no pods"):
        inflate([], 8.0, 1.3, random.Random(0))
