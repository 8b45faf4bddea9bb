"""Trace readers for the simulator: jobs and nodes from public cluster data, checked line by line.

Every reader takes a path and returns plain dataclasses (:class:`JobSpec`, :class:`NodeSpec`);
bad input raises :class:`TraceError`, whose message names the file, the line and the problem::

    openb_pod_list_x.csv:3: negative time: creation_time -5

Readers:

- :func:`read_openb_pods`, :func:`read_openb_nodes`: the Alibaba GPU cluster trace 2023
  (``openb_pod_list_*.csv``, ``openb_node_list_gpu_node.csv``). ``gpu_milli`` < 1000 with
  ``num_gpu == 1`` is a fractional GPU (one worker on a share of one GPU); ``num_gpu`` n >= 1
  with ``gpu_milli == 1000`` is one worker on n whole GPUs of one node; ``num_gpu == 0`` is a
  CPU-only job. A pod's duration is ``deletion_time - scheduled_time``; pods never scheduled
  (``scheduled_time`` empty) have no duration and are kept only for placement-only experiments
  (their ``duration`` is 0 and ``scheduled`` False).
- :func:`read_pollux_workload`: ``pollux/simulator/workloads/workload-N.csv`` (``name, time,
  application, num_replicas, batch_size``). The workload files carry no run times, so each
  job's run time at its requested replicas is taken from the same artifact's Tiresias results
  at load 0.5 (``results-jobload/tiresias-0.5/summary.json``): the shortest JCT seen for that
  application, i.e. a run with no queuing at that scale. One replica is one worker on one GPU.
- :func:`read_spot_trace`: a skypilot spot trace (``{"metadata": {"gap_seconds": N}, "data":
  [...]}``) as (gap, series); :func:`departures_from_spot` turns a 1-node preemption or
  availability series into departure times (a 0 -> 1 step in a preemption series, 1 -> 0 in
  an availability series).
- :func:`synthetic_openb`: a synthetic trace of any size drawn from the openb job mix (shapes,
  durations) with Poisson arrivals at a target load; a fake made for speed tests, named so.

:func:`default_data_dir` is ``<repo>/../shared/data`` (the project's rule: read data by path,
never copy it into the repository).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import random
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path


class TraceError(ValueError):
    """Bad trace input; the message names the file, the line and the problem."""

    def __init__(self, path: str | Path, line: int | None, problem: str) -> None:
        where = f"{Path(path).name}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {problem}")
        self.path = str(path)
        self.line = line
        self.problem = problem


@dataclass(frozen=True)
class JobSpec:
    """One job of a trace.

    A job runs ``workers`` workers, each on one node, each taking ``worker_gpus`` GPUs (a
    fraction < 1 shares one GPU; >= 1 must be whole), ``worker_cpus`` cores and
    ``worker_memory_mb``. ``duration`` is its run time in seconds on ``workers`` workers.
    An elastic job (``max_workers > workers``) may run up to ``max_workers``; it never drops
    below ``workers`` by choice, so ``workers`` is also its minimum.
    """

    job_id: str
    arrival: float
    duration: float
    workers: int = 1
    worker_gpus: float = 1.0
    worker_cpus: float = 1.0
    worker_memory_mb: int = 1024
    max_workers: int = 1
    kind: str = "training"
    scheduled: bool = True

    @property
    def gpus(self) -> float:
        return self.workers * self.worker_gpus

    @property
    def elastic(self) -> bool:
        return self.max_workers > self.workers


@dataclass(frozen=True)
class NodeSpec:
    """One node: ``gpus`` whole GPUs of ``model``, ``cpus`` cores, ``memory_mb``, a pool."""

    name: str
    gpus: int
    cpus: float
    memory_mb: int
    model: str = ""
    pool: str = "training"


def default_data_dir() -> Path:
    """``<repo>/../shared/data``, the repository being the checkout this module lives in."""
    return Path(__file__).resolve().parents[3].parent / "shared" / "data"


def _read_text(path: Path) -> str:
    """The text of ``path``: gzip-compressed or not, UTF-8 with or without a BOM; CRLF kept
    for the csv module. Unreadable or non-text files raise :class:`TraceError`."""
    if not path.is_file():
        raise TraceError(path, None, "no such file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(path, None, f"cannot read: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(path, None, f"not a readable gzip file: {e}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceError(path, None, f"not UTF-8 text (byte {e.start}: {e.reason}); a CSV or JSON trace is") from None


def _rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    try:
        header = reader.fieldnames or []
    except csv.Error as e:
        raise TraceError(path, 1, f"not a CSV header: {e}") from None
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceError(path, 1, f"missing column {', '.join(missing)} (header: {','.join(header)})")
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise TraceError(path, reader.line_num, f"not CSV: {e}") from None
        if None in row or any(v is None for v in row.values()):
            raise TraceError(path, reader.line_num, "wrong number of fields")
        yield reader.line_num, row


def _unique_id(path: Path, line: int, value: str, seen: dict[str, int], what: str = "job id") -> str:
    """``value`` stripped, checked non-empty and not seen before in this file (``seen`` maps
    each id to its line)."""
    v = value.strip()
    if not v:
        raise TraceError(path, line, f"empty {what}")
    if v in seen:
        raise TraceError(path, line, f"duplicate {what} {v!r} (first on line {seen[v]})")
    seen[v] = line
    return v


def _num(path: Path, line: int, row: dict[str, str], col: str, *, allow_empty: bool = False) -> float | None:
    v = row[col].strip()
    if v == "":
        if allow_empty:
            return None
        raise TraceError(path, line, f"empty {col}")
    try:
        x = float(v)
    except ValueError:
        raise TraceError(path, line, f"{col} {v!r} is not a number") from None
    if not math.isfinite(x):
        raise TraceError(path, line, f"{col} {v!r} is not finite")
    if x < 0:
        what = "negative time" if col.endswith("time") else "negative value"
        raise TraceError(path, line, f"{what}: {col} {v}")
    return x


POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "creation_time", "deletion_time", "scheduled_time")
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")


def read_openb_pods(path: str | Path) -> list[JobSpec]:
    """Jobs of an ``openb_pod_list_*.csv`` in file order (see the module docs)."""
    p = Path(path)
    jobs: list[JobSpec] = []
    seen: dict[str, int] = {}
    for line, row in _rows(p, POD_COLUMNS):
        name = _unique_id(p, line, row["name"], seen)
        cpu = _num(p, line, row, "cpu_milli")
        mem = _num(p, line, row, "memory_mib")
        ngpu = _num(p, line, row, "num_gpu")
        milli = _num(p, line, row, "gpu_milli")
        created = _num(p, line, row, "creation_time")
        deleted = _num(p, line, row, "deletion_time")
        sched = _num(p, line, row, "scheduled_time", allow_empty=True)
        assert cpu is not None and mem is not None and ngpu is not None and milli is not None
        assert created is not None and deleted is not None
        if ngpu != int(ngpu):
            raise TraceError(p, line, f"num_gpu {row['num_gpu']} is not a whole number")
        if milli > 1000:
            raise TraceError(p, line, f"gpu_milli {row['gpu_milli']} above 1000")
        if ngpu > 1 and milli != 1000:
            raise TraceError(p, line, f"num_gpu {int(ngpu)} with gpu_milli {int(milli)}: shares only for one GPU")
        if ngpu >= 1 and milli == 0:
            raise TraceError(p, line, f"num_gpu {int(ngpu)} with gpu_milli 0")
        start = sched if sched is not None else created
        if deleted < start:
            raise TraceError(p, line, f"deletion_time {deleted:g} before start {start:g}")
        if sched is not None and sched < created:
            raise TraceError(p, line, f"scheduled_time {sched:g} before creation_time {created:g}")
        worker_gpus = 0.0 if ngpu == 0 else (milli / 1000.0 if ngpu == 1 else float(ngpu))
        jobs.append(
            JobSpec(
                job_id=name,
                arrival=created,
                duration=(deleted - start) if sched is not None else 0.0,
                workers=1,
                worker_gpus=worker_gpus,
                worker_cpus=cpu / 1000.0,
                worker_memory_mb=int(mem),
                max_workers=1,
                kind="inference" if row.get("qos", "") == "LS" else "training",
                scheduled=sched is not None,
            )
        )
    if not jobs:
        raise TraceError(p, None, "no jobs")
    return jobs


def read_openb_nodes(path: str | Path, pool: str = "training") -> list[NodeSpec]:
    """Nodes of an ``openb_node_list_*.csv``; nodes with no GPU are skipped."""
    p = Path(path)
    nodes: list[NodeSpec] = []
    seen: dict[str, int] = {}
    for line, row in _rows(p, NODE_COLUMNS):
        sn = _unique_id(p, line, row["sn"], seen, "node sn")
        cpu = _num(p, line, row, "cpu_milli")
        mem = _num(p, line, row, "memory_mib")
        gpu = _num(p, line, row, "gpu")
        assert cpu is not None and mem is not None and gpu is not None
        if gpu != int(gpu):
            raise TraceError(p, line, f"gpu {row['gpu']} is not a whole number")
        if gpu == 0:
            continue
        nodes.append(NodeSpec(sn, int(gpu), cpu / 1000.0, int(mem), row["model"], pool))
    if not nodes:
        raise TraceError(p, None, "no GPU nodes")
    return nodes


def _slots(j: JobSpec, n: NodeSpec) -> int:
    """How many workers of ``j`` an empty ``n`` holds at once."""
    g = j.worker_gpus
    if g <= 0:
        by_gpu = math.inf
    elif g < 1:
        by_gpu = n.gpus * math.floor(1.0 / g + 1e-9)
    else:
        by_gpu = n.gpus // math.ceil(g - 1e-9)
    by_cpu = math.floor(n.cpus / j.worker_cpus + 1e-9) if j.worker_cpus > 0 else math.inf
    by_mem = n.memory_mb // j.worker_memory_mb if j.worker_memory_mb > 0 else math.inf
    m = min(by_gpu, by_cpu, by_mem)
    return j.workers if m == math.inf else int(m)


def check_fit(jobs: Sequence[JobSpec], nodes: Sequence[NodeSpec], path: str | Path = "node list") -> None:
    """Raise TraceError when no node could ever hold some job's worker, or the empty nodes
    together cannot hold all of a job's ``workers`` at once (its gang), naming that job."""
    if not nodes:
        raise TraceError(path, None, "empty node list")
    max_gpu = max(n.gpus for n in nodes)
    for j in jobs:
        g = j.worker_gpus
        ok = any(
            n.gpus >= math.ceil(g - 1e-9) and n.cpus >= j.worker_cpus - 1e-9 and n.memory_mb >= j.worker_memory_mb
            for n in nodes
        )
        if not ok:
            raise TraceError(
                path,
                None,
                f"no node can fit job {j.job_id} (worker: {g:g} GPUs, {j.worker_cpus:g} CPUs, "
                f"{j.worker_memory_mb} MiB; largest node has {max_gpu} GPUs)",
            )
        if j.workers > 1:
            room = sum(min(_slots(j, n), j.workers) for n in nodes)
            if room < j.workers:
                raise TraceError(
                    path,
                    None,
                    f"job {j.job_id} runs {j.workers} workers at once ({j.worker_gpus:g} GPUs, "
                    f"{j.worker_cpus:g} CPUs, {j.worker_memory_mb} MiB each); the {len(nodes)} nodes hold at most {room}",
                )


POLLUX_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


def pollux_run_times(results_dir: str | Path) -> dict[str, float]:
    """Run time per application: the shortest Tiresias JCT at load 0.5 (see module docs)."""
    p = Path(results_dir) / "tiresias-0.5" / "summary.json"
    if not p.is_file():
        raise TraceError(p, None, "no such file (Pollux run times come from the Tiresias results)")
    text = _read_text(p)
    try:
        data = json.loads(text)
        jcts = data["jcts"]
        per_jobs = list(jcts.values())
        if not all(isinstance(v, dict) for v in per_jobs):
            raise TypeError("jcts must map each run to {job name: JCT}")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise TraceError(p, None, f"not a Pollux summary: {e}") from None
    out: dict[str, float] = {}
    for per_job in per_jobs:
        for name, jct in per_job.items():
            ok = isinstance(jct, int | float) and not isinstance(jct, bool) and math.isfinite(jct) and jct > 0
            if not ok:
                raise TraceError(p, None, f"JCT of {name} is {jct!r}; a finite number of seconds > 0 is")
            app = name.rsplit("-", 1)[0]
            out[app] = min(out.get(app, math.inf), float(jct))
    return out


def read_pollux_workload(path: str | Path, run_times: dict[str, float] | None = None) -> list[JobSpec]:
    """Jobs of a Pollux ``workload-N.csv``; run times from :func:`pollux_run_times` by default."""
    p = Path(path)
    if run_times is None:
        run_times = pollux_run_times(p.resolve().parent.parent / "results-jobload")
    jobs: list[JobSpec] = []
    seen: dict[str, int] = {}
    for line, row in _rows(p, POLLUX_COLUMNS):
        name = _unique_id(p, line, row["name"], seen)
        t = _num(p, line, row, "time")
        r = _num(p, line, row, "num_replicas")
        assert t is not None and r is not None
        if r < 1 or r != int(r):
            raise TraceError(p, line, f"num_replicas {row['num_replicas']} must be a whole number >= 1")
        app = row["application"]
        if app not in run_times:
            raise TraceError(p, line, f"application {app!r} has no known run time")
        jobs.append(JobSpec(name, t, run_times[app], int(r), 1.0, 4.0, 16_384, int(r)))
    if not jobs:
        raise TraceError(p, None, "no jobs")
    return jobs


def read_spot_trace(path: str | Path) -> tuple[float, list[int]]:
    """(gap_seconds, series) of a skypilot spot trace JSON file."""
    p = Path(path)
    text = _read_text(p)
    try:
        doc = json.loads(text)
        gap = float(doc["metadata"]["gap_seconds"])
        data = doc["data"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise TraceError(p, None, f"not a spot trace ({{metadata: {{gap_seconds}}, data: [...]}}): {e}") from None
    if not (math.isfinite(gap) and gap > 0):
        raise TraceError(p, None, f"gap_seconds {gap:g} must be a finite number > 0")
    if not isinstance(data, list):
        raise TraceError(p, None, f"data must be a list of instance counts, not {type(data).__name__}")
    if not data:
        raise TraceError(p, None, "no data")
    for i, x in enumerate(data):
        number = isinstance(x, int | float) and not isinstance(x, bool)
        if not number or not math.isfinite(x) or x != int(x):
            raise TraceError(p, None, f"data[{i}] {x!r} is not a whole instance count")
        if x < 0:
            raise TraceError(p, None, f"data[{i}] {x!r}: negative instance count")
    return gap, [int(x) for x in data]


def departures_from_spot(gap: float, series: Sequence[int], kind: str = "preemption") -> list[float]:
    """Times (s from the trace start) at which a 1-node instance departs.

    ``kind="preemption"``: 1 means preempted, so a departure is each 0 -> 1 step;
    ``kind="availability"``: 1 means obtainable, so a departure is each 1 -> 0 step.
    """
    if kind not in ("preemption", "availability"):
        raise ValueError(f"spot: kind {kind!r} must be 'preemption' or 'availability'")
    out: list[float] = []
    for i in range(1, len(series)):
        a, b = series[i - 1] > 0, series[i] > 0
        if (kind == "preemption" and not a and b) or (kind == "availability" and a and not b):
            out.append(i * gap)
    return out


def with_elasticity(jobs: Sequence[JobSpec], fraction: float, scale: int, seed: int) -> list[JobSpec]:
    """Mark a seeded ``fraction`` of whole-GPU jobs elastic with ``max_workers = scale x workers``.

    Fractional-GPU and CPU-only jobs stay rigid. The traces carry no elasticity, so this is an
    assumption of the experiment; it is drawn per job id, the same for every policy.
    """
    if not 0 <= fraction <= 1 or scale < 1:
        raise ValueError(f"elasticity: fraction {fraction} must be in 0..1 and scale {scale} >= 1")
    out = []
    for j in jobs:
        r = random.Random(f"{seed}:{j.job_id}").random()
        if j.worker_gpus >= 1 and r < fraction:
            out.append(replace(j, max_workers=max(j.workers + 1, j.workers * scale)))
        else:
            out.append(replace(j, max_workers=j.workers))
    return out


def rescale_arrivals(jobs: Sequence[JobSpec], capacity_gpus: float, load: float, seed: int) -> list[JobSpec]:
    """The same jobs in arrival order, re-timed as a Poisson process offering ``load`` x capacity.

    The offered load is GPU-seconds per second over ``capacity_gpus``. Used where a trace's own
    timestamps do not describe a load (the openb pod list is a snapshot over 149 days of a
    6,212-GPU cluster that averages 14 busy GPUs).
    """
    if capacity_gpus <= 0 or load <= 0:
        raise ValueError(f"rescale: capacity {capacity_gpus} and load {load} must be > 0")
    ordered = sorted(jobs, key=lambda j: (j.arrival, j.job_id))
    work = sum(max(j.gpus, 0.01) * j.duration for j in ordered)
    if not (work > 0 and math.isfinite(work)):
        raise ValueError(f"rescale: the jobs hold no work to re-time (total {work:g} GPU-seconds)")
    rate = len(ordered) * capacity_gpus * load / work  # jobs per second
    rng = random.Random(seed)
    t = 0.0
    out = []
    for j in ordered:
        out.append(replace(j, arrival=round(t, 3)))
        t += rng.expovariate(rate)
    return out


MAX_SPAN_S = 10 * 365 * 86_400.0
"""Longest span :func:`synthetic_openb` accepts (ten years; a longer one is a unit slip)."""


def _check_seconds(name: str, v: float, most: float) -> None:
    """Raise ValueError unless ``v`` is a finite number of seconds in (0, ``most``]."""
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= most
    if not ok:
        bound = f" and at most {most:g} (ten years; more is a unit slip)" if math.isfinite(most) else ""
        raise ValueError(f"synthetic: {name} {v!r} must be a finite number of seconds > 0{bound}")


def synthetic_openb(
    pods: Sequence[JobSpec], n_jobs: int, span_s: float, seed: int, max_duration_s: float | None = None
) -> list[JobSpec]:
    """A fake trace: ``n_jobs`` jobs drawn (with replacement) from ``pods``, Poisson arrivals over
    ``span_s`` seconds. Durations are the drawn pod's (capped at ``max_duration_s``).

    ``span_s`` must be a finite number of seconds in (0, :data:`MAX_SPAN_S`] (ten years: more is
    a unit slip, e.g. milliseconds given as seconds), ``n_jobs`` a whole number >= 1 and
    ``max_duration_s`` (if given) finite and > 0; otherwise ValueError names the value."""
    _check_seconds("span_s", span_s, MAX_SPAN_S)
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs < 1:
        raise ValueError(f"synthetic: n_jobs {n_jobs!r} must be a whole number of jobs >= 1")
    if max_duration_s is not None:
        _check_seconds("max_duration_s", max_duration_s, math.inf)
    pool = [p for p in pods if p.scheduled and p.duration > 0]
    if not pool:
        raise ValueError("synthetic: no scheduled pods with a duration to draw from")
    rng = random.Random(seed)
    rate = n_jobs / span_s
    t = 0.0
    out = []
    for i in range(n_jobs):
        p = rng.choice(pool)
        d = p.duration if max_duration_s is None else min(p.duration, max_duration_s)
        out.append(replace(p, job_id=f"syn-{i:06d}", arrival=round(t, 3), duration=d))
        t += rng.expovariate(rate)
    return out
