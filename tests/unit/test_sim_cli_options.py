"""`laminarctl sim` options and scenarios that hold no work give exit 2 and a
message naming the option or file, never a traceback or a silent run (the real CLI, in a
subprocess, on files written to tmp_path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from laminar.sim.trace import read_openb_pods, rescale_arrivals

HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
NODES = "sn,cpu_milli,memory_mib,gpu,model\nn1,64000,262144,8,G2\nn2,64000,262144,8,G2\n"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "laminar.sim.cli", *args, "-o", "json"], capture_output=True, text=True, timeout=60
    )


def openb_dir(tmp_path: Path, pods: str) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "openb_node_list_gpu_node.csv").write_text(NODES)
    (d / "openb_pod_list_default.csv").write_text(pods)
    return d


def assert_clear_error(r: subprocess.CompletedProcess[str], needle: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert needle in r.stderr, r.stderr


def test_trace_with_no_timed_job_is_an_error_not_a_division_by_zero(tmp_path: Path) -> None:
    """Was: ZeroDivisionError traceback when no pod has a duration (all unscheduled or
    deleted at their start)."""
    d = openb_dir(tmp_path, HEADER + "a,1000,100,1,1000,,BE,Running,0,0,0\nb,1000,100,1,1000,,BE,Pending,0,9,\n")
    assert_clear_error(cli("--trace", str(d)), "no scheduled job with a run time above 0")
    with pytest.raises(ValueError, match=r"no work"):
        rescale_arrivals(read_openb_pods(d / "openb_pod_list_default.csv"), 8.0, 1.0, 0)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--load", "0"], "--load 0"),
        (["--load", "-1"], "--load -1"),
        (["--load", "inf"], "--load inf"),
        (["--load", "nan"], "--load nan"),
        (["--max-jobs", "0"], "--max-jobs 0"),
        (["--max-jobs", "-1"], "--max-jobs -1"),
        (["--inference-nodes", "-3"], "--inference-nodes -3"),
        (["--elastic-fraction", "nan"], "--elastic-fraction nan"),
        (["--ckpt-gb-per-gpu", "-2"], "--ckpt-gb-per-gpu -2"),
        (["--ckpt-pause-s", "nan"], "--ckpt-pause-s nan"),
    ],
)
def test_bad_options_are_named(tmp_path: Path, args: list[str], needle: str) -> None:
    """Was: ZeroDivisionError tracebacks (--load 0/inf, --max-jobs 0), `cannot convert float
    NaN to integer` (--load nan), or a silent run (--load -1, --max-jobs -1 ran every job
    but the last, --inference-nodes -3 ran with none)."""
    d = openb_dir(tmp_path, HEADER + "a,1000,100,1,1000,,BE,Running,0,100,0\n")
    assert_clear_error(cli("--trace", str(d), *args), needle)


def test_pool_too_small_for_the_jobs_fails_at_once_naming_the_job(tmp_path: Path) -> None:
    """Was: with a high --load the pool step ran past the node list and every later offset
    was tried (empty samples): --load 1e9 never returned, --load 1 ended with `empty node
    list`, naming neither the job nor the fix."""
    d = tmp_path / "split"
    d.mkdir()
    (d / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nn1,8000,262144,8,G2\nn2,96000,262144,1,G2\n")
    (d / "openb_pod_list_default.csv").write_text(
        HEADER + "a,1000,100,8,1000,,BE,Running,0,1000,0\nb,90000,100,1,1000,,BE,Running,0,1000,0\n")
    for load in ("1", "1e9"):
        assert_clear_error(cli("--trace", str(d), "--load", load), "no node can fit job b")
    assert "lower --load" in cli("--trace", str(d), "--load", "1e9").stderr


def test_gang_larger_than_the_training_pool_is_refused(tmp_path: Path) -> None:
    """Was: a Pollux job of 32 workers on a 4 x 4-GPU --nodes list passed the per-worker
    check; under noloan it never started, the run exited 0 with 156 of 160 jobs completed and
    means over those only (laminar, borrowing inference servers, ran all: unlike sets)."""
    from laminar.sim.trace import JobSpec, NodeSpec, TraceError, check_fit

    (tmp_path / "results-jobload" / "tiresias-0.5").mkdir(parents=True)
    (tmp_path / "results-jobload" / "tiresias-0.5" / "summary.json").write_text('{"jcts": {"x": {"app-1": 100}}}')
    (tmp_path / "workloads").mkdir()
    w = tmp_path / "workloads" / "workload-1.csv"
    w.write_text("name,time,application,num_replicas,batch_size\nsmall,0,app,2,32\nbig,5,app,32,32\n")
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"s{i},64000,262144,4,V100\n" for i in range(4)))
    assert_clear_error(cli("--trace", str(w), "--nodes", str(nodes), "--policy", "noloan"),
                       "nodes.csv: job big runs 32 workers at once (1 GPUs, 4 CPUs, 16384 MiB each); the 4 nodes hold at most 16")
    # the gang check counts fractional shares and CPU limits per node
    n = [NodeSpec("a", 2, 4.0, 10_000)]
    check_fit([JobSpec("f", 0.0, 1.0, workers=4, worker_gpus=0.5, worker_cpus=1.0, worker_memory_mb=100)], n)
    with pytest.raises(TraceError, match=r"job c runs 5 workers at once .* hold at most 4"):
        check_fit([JobSpec("c", 0.0, 1.0, workers=5, worker_gpus=0.25, worker_cpus=1.0, worker_memory_mb=100)], n)
