"""Trace readers: bad input gives an error naming the file, the line and the problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.sim.trace import (
    TraceError,
    check_fit,
    departures_from_spot,
    read_openb_nodes,
    read_openb_pods,
    read_pollux_workload,
    read_spot_trace,
)

HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_reads_fractional_whole_and_cpu_only_pods(tmp_path: Path) -> None:
    p = write(tmp_path, "pods.csv", HEADER + "a,4000,100,1,460,,LS,Running,5,105,7\n"
              "b,8000,100,4,1000,,BE,Failed,0,50,0\nc,1000,10,0,0,,BE,Pending,3,9,\n")
    a, b, c = read_openb_pods(p)
    assert (a.worker_gpus, a.duration, a.arrival, a.worker_cpus, a.kind) == (0.46, 98, 5, 4.0, "inference")
    assert (b.worker_gpus, b.gpus, b.duration) == (4.0, 4.0, 50)
    assert (c.worker_gpus, c.scheduled, c.duration) == (0.0, False, 0.0)


def test_missing_column_names_file_and_line(tmp_path: Path) -> None:
    p = write(tmp_path, "pods_bad.csv", "name,cpu_milli,num_gpu\nx,1,1\n")
    with pytest.raises(TraceError, match=r"pods_bad.csv:1: missing column memory_mib, gpu_milli"):
        read_openb_pods(p)


def test_negative_time_names_line(tmp_path: Path) -> None:
    p = write(tmp_path, "pods_neg.csv", HEADER + "a,1,1,1,1000,,BE,Running,0,10,0\nb,1,1,1,1000,,BE,Running,-5,10,0\n")
    with pytest.raises(TraceError, match=r"pods_neg.csv:3: negative time: creation_time -5"):
        read_openb_pods(p)


def test_other_bad_values(tmp_path: Path) -> None:
    p = write(tmp_path, "p1.csv", HEADER + "a,1,1,2,500,,BE,Running,0,10,0\n")
    with pytest.raises(TraceError, match=r"p1.csv:2: num_gpu 2 with gpu_milli 500"):
        read_openb_pods(p)
    p = write(tmp_path, "p2.csv", HEADER + "a,1,1,1,abc,,BE,Running,0,10,0\n")
    with pytest.raises(TraceError, match=r"p2.csv:2: gpu_milli 'abc' is not a number"):
        read_openb_pods(p)
    p = write(tmp_path, "p3.csv", HEADER + "a,1,1,1,1000,,BE,Running,0,10\n")
    with pytest.raises(TraceError, match=r"p3.csv:2: wrong number of fields"):
        read_openb_pods(p)
    p = write(tmp_path, "p4.csv", HEADER + "a,1,1,1,1000,,BE,Running,20,10,20\n")
    with pytest.raises(TraceError, match=r"p4.csv:2: deletion_time 10 before start 20"):
        read_openb_pods(p)
    with pytest.raises(TraceError, match=r"nope.csv: no such file"):
        read_openb_pods(tmp_path / "nope.csv")


def test_node_list_that_cannot_fit_a_job(tmp_path: Path) -> None:
    pods = read_openb_pods(write(tmp_path, "pods.csv", HEADER + "big,1000,100,8,1000,,BE,Running,0,10,0\n"))
    nodes = read_openb_nodes(write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,1000,4,T4\n"))
    with pytest.raises(TraceError, match=r"nodes.csv: no node can fit job big \(worker: 8 GPUs.*largest node has 4 GPUs"):
        check_fit(pods, nodes, tmp_path / "nodes.csv")
    with pytest.raises(TraceError, match=r"empty.csv: no GPU nodes"):
        read_openb_nodes(write(tmp_path, "empty.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,0,\n"))


def test_pollux_workload_and_bad_application(tmp_path: Path) -> None:
    p = write(tmp_path, "workload-9.csv", "name,time,application,num_replicas,batch_size\n"
              "cifar10-0,107,cifar10,6,2048\nx-1,110,unknown,1,32\n")
    with pytest.raises(TraceError, match=r"workload-9.csv:3: application 'unknown' has no known run time"):
        read_pollux_workload(p, {"cifar10": 513.0})
    p = write(tmp_path, "workload-8.csv", "name,time,application,num_replicas,batch_size\ncifar10-0,107,cifar10,6,2048\n")
    (j,) = read_pollux_workload(p, {"cifar10": 513.0})
    assert (j.workers, j.worker_gpus, j.duration, j.arrival) == (6, 1.0, 513.0, 107)


def test_spot_trace(tmp_path: Path) -> None:
    p = write(tmp_path, "s.json", json.dumps({"metadata": {"gap_seconds": 60}, "data": [0, 1, 1, 0, 1]}))
    gap, data = read_spot_trace(p)
    assert departures_from_spot(gap, data, "preemption") == [60, 240]
    assert departures_from_spot(gap, data, "availability") == [180]
    with pytest.raises(TraceError, match=r"bad.json: not a spot trace"):
        read_spot_trace(write(tmp_path, "bad.json", "{}"))


def test_cli_bad_input_exits_2_with_the_message(tmp_path: Path) -> None:
    p = write(tmp_path, "openb_pod_list_x.csv", "name,cpu_milli\n")
    r = subprocess.run([sys.executable, "-m", "laminar.sim.cli", "--trace", str(p)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "openb_pod_list_x.csv:1: missing column" in r.stderr


def test_scenario_pool_sample_shifts_to_host_the_largest_pod(tmp_path: Path) -> None:
    """A small training pool (every k-th node) that would miss the only node big enough for a
    pod starts its sample at the next offset; with no offset that can host every pod, the error
    names the node list and the step."""
    from laminar.sim.cli import build_scenario

    small = "".join(f"p{i},1000,100,1,1000,,BE,Running,{i * 10},{i * 10 + 3600},{i * 10}\n" for i in range(40))
    pods = write(tmp_path, "openb_pod_list_default.csv", HEADER + small + "big,1000,100,8,1000,,BE,Running,5,3605,5\n")
    head = "sn,cpu_milli,memory_mib,gpu,model\n"
    # 15 GPUs, 48 GPU-hours over one hour at load 10: every 3rd node; the 8-GPU node is n4
    write(tmp_path, "openb_node_list_gpu_node.csv",
          head + "".join(f"n{i},64000,100000,{8 if i == 4 else 1},T4\n" for i in range(8)))
    jobs, nodes = build_scenario(pods, load=10.0, span_s=3600.0)
    training = [n.name for n in nodes if n.pool == "training"]
    assert training == ["n1", "n4", "n7"] and len(jobs) == 41
    # a pod that needs n2 (8 GPUs) and one that needs n3 (the memory): every other node
    # never holds both
    pods = write(tmp_path, "openb_pod_list_default.csv", HEADER + small + "big,1000,100,8,1000,,BE,Running,5,3605,5\n"
                 "fat,1000,800000,1,1000,,BE,Running,6,3606,6\n")
    write(tmp_path, "openb_node_list_gpu_node.csv", head + "".join(
        f"n{i},64000,{900000 if i == 3 else 100000},{8 if i == 2 else 1},T4\n" for i in range(8)))
    with pytest.raises(TraceError, match=r"\(1 node in 2\): no node can fit job (big|fat)"):
        build_scenario(pods, load=6.5, span_s=3600.0)


def _pods() -> list:  # type: ignore[type-arg]
    from laminar.sim.trace import JobSpec

    return [JobSpec("a", 0.0, 100.0), JobSpec("b", 5.0, 300.0, worker_gpus=0.5)]


@pytest.mark.parametrize("span", [0, 0.0, -5.0, float("nan"), float("inf"), 1e300, True, "7d"])
def test_synthetic_refuses_a_bad_span(span: object) -> None:
    """Was: a zero span raised ZeroDivisionError naming nothing, a negative one gave negative
    arrivals (time running backwards: -1.8 s, -1.8 s, -2.5 s), NaN gave every job after the
    first a NaN arrival, and 1e300 s spread four jobs over 1e292 years, all silently."""
    from laminar.sim.trace import synthetic_openb

    with pytest.raises(ValueError, match=r"synthetic: span_s .* must be a finite number of seconds > 0") as e:
        synthetic_openb(_pods(), 10, span, seed=0)  # type: ignore[arg-type]
    assert repr(span) in str(e.value)


@pytest.mark.parametrize("n", [0, -3, 2.5, True])
def test_synthetic_refuses_a_bad_job_count(n: object) -> None:
    from laminar.sim.trace import synthetic_openb

    with pytest.raises(ValueError, match=r"synthetic: n_jobs .* must be a whole number of jobs >= 1"):
        synthetic_openb(_pods(), n, 3600.0, seed=0)  # type: ignore[arg-type]


def test_synthetic_good_span_spreads_arrivals_over_it() -> None:
    from laminar.sim.trace import MAX_SPAN_S, synthetic_openb

    jobs = synthetic_openb(_pods(), 2000, 86_400.0, seed=3, max_duration_s=200.0)
    assert len(jobs) == 2000 and len({j.job_id for j in jobs}) == 2000
    arr = [j.arrival for j in jobs]
    assert arr == sorted(arr) and arr[0] == 0.0
    assert 0.8 * 86_400 < arr[-1] < 1.2 * 86_400  # Poisson: the last arrival near the span
    assert max(j.duration for j in jobs) == 200.0
    assert synthetic_openb(_pods(), 3, MAX_SPAN_S, seed=0)  # the bound itself is accepted
    with pytest.raises(ValueError, match="max_duration_s"):
        synthetic_openb(_pods(), 3, 3600.0, seed=0, max_duration_s=-1.0)
