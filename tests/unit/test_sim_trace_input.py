"""Bad trace files reach `laminarctl sim` as a clear error (file, line,
problem; exit 2), never a traceback, a hang or a silently wrong run.

Every case writes a real file to tmp_path and runs the real reader or the real CLI in a
subprocess (the CLI is what users run).
"""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.sim.trace import (
    TraceError,
    read_openb_nodes,
    read_openb_pods,
    read_pollux_workload,
    read_spot_trace,
)

HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
NODES = "sn,cpu_milli,memory_mib,gpu,model\nn1,64000,262144,8,G2\nn2,64000,262144,8,G2\n"
POLLUX = "name,time,application,num_replicas,batch_size\n"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "laminar.sim.cli", *args, "-o", "json"], capture_output=True, text=True, timeout=60
    )


def openb_dir(tmp_path: Path, pods: bytes | str) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "openb_node_list_gpu_node.csv").write_text(NODES)
    p = d / "openb_pod_list_default.csv"
    if isinstance(pods, str):
        p.write_text(pods)
    else:
        p.write_bytes(pods)
    return d


def assert_clear_error(r: subprocess.CompletedProcess[str], needle: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert needle in r.stderr, r.stderr


def test_duplicate_job_ids_name_the_line_of_the_second(tmp_path: Path) -> None:
    """Was: a ValueError traceback from the engine, naming neither the file nor the job."""
    d = openb_dir(tmp_path, HEADER + "a,1000,100,1,1000,,BE,Running,0,100,0\n"
                  "b,1000,100,1,1000,,BE,Running,0,100,0\na,1000,100,1,500,,BE,Running,5,300,6\n")
    with pytest.raises(TraceError, match=r"openb_pod_list_default.csv:4: duplicate job id 'a' \(first on line 2\)"):
        read_openb_pods(d / "openb_pod_list_default.csv")
    assert_clear_error(cli("--trace", str(d)), "openb_pod_list_default.csv:4: duplicate job id 'a'")
    p = tmp_path / "workload-1.csv"
    p.write_text(POLLUX + "j,0,app,1,32\nj,5,app,1,32\n")
    with pytest.raises(TraceError, match=r"workload-1.csv:3: duplicate job id 'j'"):
        read_pollux_workload(p, {"app": 100.0})


def test_bom_and_crlf_file_reads_like_a_plain_one(tmp_path: Path) -> None:
    """Was: `missing column name` for a file saved by a spreadsheet (UTF-8 BOM, CRLF)."""
    plain = HEADER + "a,1000,100,1,1000,,BE,Running,0,100,0\n"
    (tmp_path / "plain.csv").write_text(plain)
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + plain.replace("\n", "\r\n").encode())
    assert read_openb_pods(tmp_path / "bom.csv") == read_openb_pods(tmp_path / "plain.csv")
    (tmp_path / "nodes.csv").write_bytes(b"\xef\xbb\xbf" + NODES.replace("\n", "\r\n").encode())
    assert [n.name for n in read_openb_nodes(tmp_path / "nodes.csv")] == ["n1", "n2"]


def test_gzip_trace_is_read_and_binary_junk_is_named(tmp_path: Path) -> None:
    """Was: `'utf-8' codec can't decode byte 0x8b`, naming no file."""
    text = HEADER + "a,1000,100,1,1000,,BE,Running,0,100,0\n"
    (tmp_path / "pods.csv.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "pods.csv").write_text(text)
    assert read_openb_pods(tmp_path / "pods.csv.gz") == read_openb_pods(tmp_path / "pods.csv")
    (tmp_path / "junk.csv").write_bytes(b"\x00\xff\xfe\x80junk")
    with pytest.raises(TraceError, match=r"junk.csv: not UTF-8 text"):
        read_openb_pods(tmp_path / "junk.csv")
    bad_gz = openb_dir(tmp_path, b"\x1f\x8b\x08\x00truncated")
    assert_clear_error(cli("--trace", str(bad_gz)), "openb_pod_list_default.csv: not a readable gzip file")


def _pollux(tmp_path: Path, summary: str) -> Path:
    (tmp_path / "results-jobload" / "tiresias-0.5").mkdir(parents=True)
    (tmp_path / "results-jobload" / "tiresias-0.5" / "summary.json").write_text(summary)
    (tmp_path / "workloads").mkdir()
    w = tmp_path / "workloads" / "workload-1.csv"
    w.write_text(POLLUX + "j1,0,app,2,32\nj2,5,app,1,32\n")
    return w


@pytest.mark.parametrize(
    ("summary", "needle"),
    [
        # Was: the simulator never returned (NaN run times: every finish event at NaN).
        ('{"jcts": {"x": {"app-1": NaN}}}', "JCT of app-1 is nan"),
        # Was: a run with negative run times, reported as a result.
        ('{"jcts": {"x": {"app-1": -5}}}', "JCT of app-1 is -5"),
        # Was: `could not convert string to float: 'abc'` naming no file.
        ('{"jcts": {"x": {"app-1": "abc"}}}', "JCT of app-1 is 'abc'"),
        # Was: AttributeError traceback.
        ('{"jcts": {"x": ["a"]}}', "not a Pollux summary"),
    ],
)
def test_bad_pollux_run_times(tmp_path: Path, summary: str, needle: str) -> None:
    w = _pollux(tmp_path, summary)
    r = cli("--trace", str(w))
    assert_clear_error(r, "summary.json")
    assert needle in r.stderr


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ('{"metadata": {"gap_seconds": NaN}, "data": [0, 1]}', "gap_seconds nan must be a finite number > 0"),
        ('{"metadata": {"gap_seconds": Infinity}, "data": [0, 1]}', "gap_seconds inf must be a finite number > 0"),
        ('{"metadata": {"gap_seconds": 60}, "data": "0110"}', "data must be a list"),
        ('{"metadata": {"gap_seconds": 60}, "data": [0, 1.5]}', "data[1] 1.5 is not a whole instance count"),
        ('{"metadata": {"gap_seconds": 60}, "data": [0, true]}', "data[1] True is not a whole instance count"),
        ('{"metadata": {"gap_seconds": 60}, "data": []}', "no data"),
    ],
)
def test_bad_spot_traces(tmp_path: Path, doc: str, needle: str) -> None:
    """Was: NaN/inf gaps, a string of digits, fractions and booleans accepted silently (a NaN
    gap gives NaN departure times)."""
    p = tmp_path / "spot.json"
    p.write_text(doc)
    with pytest.raises(TraceError) as e:
        read_spot_trace(p)
    assert "spot.json" in str(e.value) and needle in str(e.value)


def test_engine_refuses_a_nan_run_time_instead_of_spinning() -> None:
    """Was: a job with a NaN duration (from a library caller, e.g. a bench building its own
    JobSpecs) put a FINISH event at NaN and the run never returned."""
    from laminar.sim.engine import simulate
    from laminar.sim.trace import JobSpec, NodeSpec

    nodes = [NodeSpec("n", 8, 64.0, 262_144)]
    with pytest.raises(ValueError, match=r"job j: arrival 0 and duration nan must be finite"):
        simulate([JobSpec("j", 0.0, float("nan"))], nodes, "noloan")
    with pytest.raises(ValueError, match=r"duplicate job id 'a'"):
        simulate([JobSpec("a", 0.0, 1.0), JobSpec("b", 0.0, 1.0), JobSpec("a", 1.0, 1.0)], nodes, "noloan")


def test_engine_names_an_unknown_policy() -> None:
    """Was: KeyError: 'lamnar' (the friendly check came after the lookup)."""
    from laminar.sim.engine import simulate
    from laminar.sim.trace import JobSpec, NodeSpec

    with pytest.raises(ValueError, match=r"unknown policy 'lamnar'; choose one of laminar, bestfit, noloan, requeue"):
        simulate([JobSpec("a", 0.0, 1.0)], [NodeSpec("n", 1, 4.0, 1000)], "lamnar")


def test_pollux_workload_named_relative_to_its_own_directory(tmp_path: Path) -> None:
    """Was: `--trace workload-1.csv` run inside workloads/ looked for ./results-jobload (the
    parent of "." is "."), so the run failed with `no such file`."""
    (tmp_path / "results-jobload" / "tiresias-0.5").mkdir(parents=True)
    (tmp_path / "results-jobload" / "tiresias-0.5" / "summary.json").write_text('{"jcts": {"x": {"app-1": 100}}}')
    (tmp_path / "workloads").mkdir()
    (tmp_path / "workloads" / "workload-1.csv").write_text(POLLUX + "j1,0,app,2,32\n")
    r = subprocess.run([sys.executable, "-m", "laminar.sim.cli", "--trace", "workload-1.csv", "-o", "json"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path / "workloads")
    assert r.returncode == 0, r.stderr
    assert '"completed": 1' in r.stdout


def test_duplicate_node_sn_names_both_lines(tmp_path: Path) -> None:
    """Was: accepted; the node list then held two nodes of one name."""
    p = tmp_path / "nodes.csv"
    p.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,1000,100,1,T4\nn2,1000,100,1,T4\nn1,1000,100,2,T4\n")
    with pytest.raises(TraceError, match=r"nodes.csv:4: duplicate node sn 'n1' \(first on line 2\)"):
        read_openb_nodes(p)
