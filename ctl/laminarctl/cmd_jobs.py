"""Jobs: submit a command as a job on this node, list, show and stop jobs.

    laminarctl submit --memory 2G --cpus 4 --gpus 2 --class long-resident --priority 80 \\
        --name train -- python train.py --epochs 10
    laminarctl jobs                 # active and finished jobs (SCHEDULER: slurm:1234 for an adopted one)
    laminarctl adopt --slurm 1234 --pid 4321 --class long-resident   # a scheduler's task as a job
    laminarctl job show job-3       # or: laminarctl job show 3
    laminarctl job show 3 --follow  # until it ends; a move off this node as a progress bar
    laminarctl job stop job-3 [--grace 10] [--reason "..."]
    laminarctl job show job-7-n3    # a multi-node job (laminarctl zone submit --workers 3): its members
    laminarctl job settle job-3 --run-here   # its node never answered the hand-over and is gone
    laminarctl job settle job-3 --gone       # ... and runs the job: stop it here (migrated)

Any local user may submit (the job runs with the caller's uid and gid) and stop their own
jobs; stopping another user's job needs root or the agent's control group.

A multi-node job (``job-<num>-n<node>``, docs/jobs.md) is listed by ``jobs`` on the node it was
submitted on, and ``job show`` there gives its members: index, node, address, state; on a
member's node the local job shows which member it is (``member``). ``job stop`` stops every
member. ``-o json`` gives everything the agent answered.

``job show`` says what the job started with (``limits``: its owner's profile on this node, not
the agent's; docs/operations.md, "What a job gets: the site's limits"): every rlimit as
SOFT:HARD, its ``pids.max``, umask and nice value, where they came from (``[job_limits]``, the
limits.conf lines that applied) and what the agent could not give (``limits clamped``); and,
while it runs, its tasks against its ``pids.max`` with the forks refused there (``pids``).

A job whose class has no room under its memory cap is accepted in state ``queued`` and starts
by itself once room frees (docs/airlock.md, "Admission"): ``submit`` says so and exits 0,
``jobs`` and ``job show`` give the reason (``waiting for class transient: needs 400 MiB,
112 MiB free under its cap of 512 MiB``), and ``job stop`` takes it out of the queue. A job
whose limit exceeds its class's cap could never start: ``submit`` refuses it (exit 1), naming
the limit and the cap.

``job settle`` (root or the control group) ends the wait of a move whose hand-over its
destination may have received and never answered (``job show`` and ``migrations --pending``
show it ``unconfirmed``, with the node and since when; the job stays frozen here meanwhile, as
two copies must never run). Only an operator who knows that node is gone for good decides:
``--run-here`` (it does not run the job: the job is thawed and runs here; the node is told to
release the placement if it comes back) or ``--gone`` (it runs the job: the job is stopped
here, state ``migrated``). The key of a keeper's placement (``migrations --pending``, kind
placement) is settled the same way. The decision is stored: a restart never asks that node
again. Refused (exit 1) for a job with no pending hand-over (docs/migration.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from .cmd_zone import members_table
from .output import emit, info, kv, table

# The agent's limit on a stop's grace (laminar.runtime.spec.STOP_GRACE_MAX_S).
GRACE_MAX_S = 3600.0
# The longest stop reason the agent keeps (laminar.runtime.jobs_api.REASON_MAX).
REASON_MAX = 1000
# Ended jobs `jobs` lists by default, and at most (read in pages of the agent's GET /v1/jobs).
LAST_DEFAULT = 200
LAST_MAX = 100_000
# Jobs asked per page (the agent's most: laminar.runtime.jobtable.LIST_PAGE_MAX).
PAGE = 1000
LIVE_STATES = ("queued", "running", "suspended", "starting")
# How long `job stop` waits for the agent beyond the grace (the kill and the cgroups' removal).
STOP_ANSWER_S = 120.0

JOB_COLUMNS = [("id", "ID"), ("name", "NAME"), ("state", "STATE"), ("class", "CLASS"), ("priority", "PRIO"),
               ("pid", "PID"), ("used_mb", "USED MiB"), ("memory_mb", "LIMIT MiB"), ("rung", "AIRLOCK"),
               ("gpus", "GPUS"), ("sched", "SCHEDULER"), ("reason", "REASON")]


def _gpus_arg(text: str) -> int | list[int]:
    """'2' -> 2 (count), '0,1' -> [0, 1] (indices)."""
    t = text.strip()
    try:
        if "," not in t:
            n = int(t)
            if n < 0:
                raise ValueError
            return n
        return [int(x) for x in t.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: expected a count (2) or indices (0,1)") from None


def _env_arg(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"--env {text!r}: expected NAME=value")
    return k, v


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("submit", parents=[common], help="run a command as a job on this node",
                       description="Run a command as a job in cgroups of its own. Put the command after --.")
    p.add_argument("--name", default="", help="a name for the job")
    p.add_argument("--memory", help="memory limit, e.g. 512M, 2G (default: none)")
    p.add_argument("--cpus", type=float, help="CPU limit in CPUs, fractions allowed (default: none)")
    p.add_argument("--gpus", type=_gpus_arg, default=0, help="GPU count (2) or indices (0,1)")
    p.add_argument("--class", dest="job_class", default="standard", choices=["long-resident", "standard", "transient"],
                   help="lifecycle class (default: standard); transient yields first under memory pressure")
    p.add_argument("--priority", type=int, default=50, help="0..100, higher survives longer (default 50)")
    p.add_argument("--ckpt-signal", default="SIGUSR1", help="signal that asks the job for a checkpoint (default SIGUSR1)")
    p.add_argument("--env", type=_env_arg, action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment (not LM_*, LAMINAR_* nor CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER: the agent "
                        "sets those itself)")
    p.add_argument("--cwd", help="working directory (absolute, one you may enter; default: the agent's)")
    p.add_argument("--lent", action="store_true", help="the job runs on lent capacity (covered by the lent kill-switch)")
    p.add_argument("--elastic", metavar="MIN:MAX", help="elastic workers, e.g. 1:4")
    p.add_argument("--resume-from", help="checkpoint to resume from (sets LAMINAR_RESUME_FROM)")
    p.add_argument("--remaining", type=float, metavar="SECONDS",
                   help="an elastic job's remaining single-worker seconds, 1..1e9 (how it is given idle GPUs; "
                        "default: [loan] elastic_remaining_s)")
    p.add_argument("--no-periodic-checkpoints", dest="periodic_checkpoints", action="store_false",
                   help="never ask this job for periodic checkpoints (the migration layer's checkpoint driver)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("adopt", parents=[common], help="take a scheduler's task or pod as a job (root, or the task's user)",
                       description="Adopt a Slurm task (by its pid) or a Kubernetes pod (by its cgroup, root only) as a "
                                   "job without launching it (docs/operations.md, 'Adopted jobs'). Prints the job and "
                                   "the environment the task must get.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--slurm", metavar="JOBID", help="the Slurm job id")
    which.add_argument("--kubernetes", metavar="NS/POD", help="the pod, as namespace/name")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--pid", type=int, help="the task's pid (Slurm)")
    where.add_argument("--cgroup", help="the pod's cgroup, relative to the cgroup2 mount (Kubernetes)")
    p.add_argument("--class", dest="job_class", default="standard", help="Airlock class (default: standard)")
    p.add_argument("--priority", type=int, default=50, help="0..100 (default 50)")
    p.add_argument("--checkpoint", default="USR1", help="the signal the job catches for a checkpoint, or none")
    p.add_argument("--gpus", default="", help="the GPU indices the scheduler assigned, e.g. 0,1")
    p.add_argument("--uid", type=int, help="the job's user (root only; default: yours)")
    p.add_argument("--gid", type=int, help="the job's group (default: the user's)")
    p.add_argument("--name", help="a name for the job")
    p.set_defaults(func=cmd_adopt)

    p = sub.add_parser("jobs", parents=[common], help="list jobs on this node")
    p.add_argument("--active", action="store_true", help="only jobs that have not ended (queued, running, suspended)")
    p.add_argument("--last", type=int, default=LAST_DEFAULT, metavar="N",
                   help=f"with the jobs that have not ended, the N that ended last (default {LAST_DEFAULT}, "
                        f"at most {LAST_MAX}; -o json too)")
    p.set_defaults(func=cmd_jobs)

    job = sub.add_parser("job", parents=[common], help="one job: show, stop")
    jsub = job.add_subparsers(dest="job_cmd", metavar="SUBCOMMAND")
    jsub.required = True
    p = jsub.add_parser("show", parents=[common], help="everything about one job")
    p.add_argument("id", help="job id (job-3) or number (3)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="follow the job until it ends, with its move to another node as a progress bar "
                        "(-o json: one line per change)")
    p.set_defaults(func=cmd_job_show)
    p = jsub.add_parser("stop", parents=[common], help="stop a job: SIGTERM, grace, then kill")
    p.add_argument("id", help="job id (job-3) or number (3)")
    p.add_argument("--grace", type=float, help=f"seconds between SIGTERM and the kill, 0..{GRACE_MAX_S:g} "
                                               "(default: the agent's, 5)")
    p.add_argument("--reason", help="recorded with the job and in its event")
    p.set_defaults(func=cmd_job_stop)
    p = jsub.add_parser("settle", parents=[common],
                        help="end a move's wait for a destination that never answered its hand-over (root)")
    p.add_argument("id", help="job id (job-3) or number (3), or a keeper placement's key (migrations --pending)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--run-here", dest="decision", action="store_const", const="run-here",
                     help="the destination does not run the job (gone, known not to): thaw and run it here")
    how.add_argument("--gone", dest="decision", action="store_const", const="gone",
                     help="the destination runs the job: stop it here as migrated")
    p.set_defaults(func=cmd_job_settle)


def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /v1/jobs body from the command line. Raises ValueError for bad input."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("submit: no command given; put it after --, e.g. laminarctl submit -- sleep 60")
    if not 0 <= args.priority <= 100:
        raise ValueError(f"--priority {args.priority}: expected an integer 0..100 (higher survives longer)")
    spec: dict[str, Any] = {"command": cmd, "name": args.name, "class": args.job_class, "priority": args.priority,
                            "gpus": args.gpus, "checkpoint_signal": args.ckpt_signal, "env": dict(args.env),
                            "lent": args.lent}
    if args.memory:
        spec["memory"] = args.memory
    if args.cpus is not None:
        spec["cpus"] = args.cpus
    if args.cwd:
        spec["cwd"] = args.cwd
    if args.resume_from:
        spec["resume_from"] = args.resume_from
    if getattr(args, "remaining", None) is not None:
        if not 1 <= args.remaining <= 1e9:  # (NaN and inf fail it too)
            raise ValueError(f"--remaining {args.remaining:g}: expected the job's remaining single-worker seconds, "
                             "1 to 1e9")
        spec["remaining_s"] = args.remaining
    if getattr(args, "periodic_checkpoints", True) is False:
        spec["periodic_checkpoints"] = False
    if args.elastic:
        lo, sep, hi = args.elastic.partition(":")
        if not sep or not lo.isdigit() or not hi.isdigit():
            raise ValueError(f"--elastic {args.elastic!r}: expected MIN:MAX, e.g. 1:4")
        spec["elastic_min"], spec["elastic_max"] = int(lo), int(hi)
    return spec


def multinode_view(j: dict[str, Any]) -> dict[str, Any] | None:
    """The multi-node job's view in a GET /v1/jobs entry: the entry itself (a job originated
    on this node with no member here) or a member's ``multinode``; None for a one-node job."""
    if j.get("kind") == "multinode":
        return j
    v = j.get("multinode")
    return v if isinstance(v, dict) else None


def _rung(j: dict[str, Any]) -> str | None:
    """'suspend 3.2s' while Airlock holds the job at a rung, else None."""
    r = j.get("airlock")
    return f"{r['rung']} {r['for_s']:g}s" if isinstance(r, dict) else None


def _row(j: dict[str, Any]) -> dict[str, Any]:
    spec = j.get("spec") or {}
    used = j.get("memory_bytes")
    v = multinode_view(j)
    if v is not None and j.get("kind") == "multinode":  # the job, on its origin
        j = {**j, "reason": j.get("end_reason") or f"{len(v.get('members') or [])} members"}
    elif v is not None:  # a member's local job
        mb = j.get("member") or {}
        j = {**j, "reason": j.get("reason") or f"member {mb.get('index')} of {mb.get('job')}"}
    sched = f"{j['scheduler']}:{j.get('scheduler_ref')}" if j.get("scheduler") else None
    return {**j, "memory_mb": spec.get("memory_mb"), "used_mb": used >> 20 if isinstance(used, int) else None,
            "rung": _rung(j), "sched": sched}


def _submitted(j: dict[str, Any]) -> None:
    if j.get("state") == "queued":
        info(f"{j['id']} queued: {j.get('reason') or 'waiting for room in its class'}")
    else:
        info(f"{j['id']} started (pid {j['pid']}, cgroup {j['cgroup']}, log {j['log']})")


def adopt_body(args: argparse.Namespace) -> dict[str, Any]:
    """The body of POST /v1/jobs/adopt from ``laminarctl adopt``'s arguments (the agent checks every field)."""
    body: dict[str, Any] = {"scheduler": "slurm" if args.slurm else "kubernetes", "ref": args.slurm or args.kubernetes,
                            "class": args.job_class, "priority": args.priority, "checkpoint": args.checkpoint}
    if args.pid is not None:
        body["pid"] = args.pid
    else:
        body["cgroup"] = args.cgroup
    try:
        body["gpus"] = [int(x) for x in args.gpus.split(",")] if args.gpus.strip() else []
    except ValueError:
        raise ValueError(f"--gpus {args.gpus!r}: expected GPU indices, e.g. 0,1") from None
    for k in ("uid", "gid", "name"):
        if getattr(args, k) is not None:
            body[k] = getattr(args, k)
    return body


def cmd_adopt(args: argparse.Namespace) -> int:
    out = args.client.post("/v1/jobs/adopt", adopt_body(args))

    def human(r: dict[str, Any]) -> None:
        j = r["job"]
        info(f"{j['id']} adopted from {j['scheduler']}:{j['scheduler_ref']} (cgroup {j['cgroup']})")
        for k, v in sorted(r.get("env", {}).items()):
            info(f"{k}={v}")

    emit(out, args.output, human)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    job = args.client.post("/v1/jobs", build_spec(args))
    emit(job, args.output, _submitted)
    return 0


def pages(client: Any, query: str) -> Any:
    """Every page of GET /v1/jobs?<query>, newest first: each page's jobs (oldest first within it),
    until the agent answers an empty page (the next one starts below the lowest number seen)."""
    before = None
    while True:
        page = client.get(f"/v1/jobs?{query}&limit={PAGE}" + (f"&before={before}" if before is not None else ""))
        if not page:
            return
        yield page
        before = min(int(j["num"]) for j in page)


def cmd_jobs(args: argparse.Namespace) -> int:
    if not 0 <= args.last <= LAST_MAX:
        raise ValueError(f"--last {args.last}: expected 0 to {LAST_MAX} ended jobs")
    live = [j for page in pages(args.client, "all=0") for j in page]
    older = False
    if args.active:
        jobs = live
    else:  # the ended ones, newest first, until one more than asked: whether older ones were left out
        ended: list[dict[str, Any]] = []
        for page in pages(args.client, "all=1"):
            ended += [j for j in reversed(page) if j.get("state") not in LIVE_STATES]
            if len(ended) > args.last:
                break
        older = len(ended) > args.last
        seen = {j["id"] for j in live}
        jobs = live + [j for j in ended[:args.last] if j["id"] not in seen]
    jobs.sort(key=lambda j: int(j["num"]))

    def human(js: list[dict[str, Any]]) -> None:
        table([_row(j) for j in js], JOB_COLUMNS)
        for j in js:
            v = multinode_view(j)
            if v is not None:
                members_table(v)
        if older:
            info(f"(older ended jobs not shown: laminarctl jobs --last N, up to {LAST_MAX})")

    emit(jobs, args.output, human)
    return 0


def _move(args: argparse.Namespace) -> dict[str, Any] | None:
    """The job's move off this node (GET /v1/migrations/ID), or None (no move, no migration layer)."""
    from .client import CtlError

    try:
        mv = args.client.get(f"/v1/migrations/{args.id}")
    except CtlError:
        return None
    return mv if isinstance(mv, dict) else None


FOLLOW_EVERY_S = 0.3


def _follow(args: argparse.Namespace) -> int:
    """Polls the job and its move until the job has ended and no move is under way: its move
    has ended (``ended``, set by the agent whatever phase it ended in: done, failed, but also
    held, archived or archiving, where the job's checkpoint left with no destination)."""
    import json
    import time

    def snapshot() -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        job = args.client.get(f"/v1/jobs/{args.id}")
        mv = _move(args)
        moving = mv is not None and mv.get("ended") is None and mv.get("phase") not in ("done", "failed")
        if job.get("kind") == "multinode":  # its states: placing .. ended (docs/jobs.md)
            return job, mv, job.get("state") != "ended"
        return job, mv, job.get("state") in ("queued", "running", "suspended") or moving

    if args.output == "json":
        last = None
        while True:
            job, mv, going = snapshot()
            snap = {"id": job["id"], "state": job["state"], "reason": job.get("reason"), "migration": mv}
            if snap != last:
                print(json.dumps(snap, default=str), flush=True)
                last = snap
            if not going:
                return 0
            time.sleep(FOLLOW_EVERY_S)

    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    cols = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*cols, transient=False) as bar:
        task = bar.add_task("", total=None)
        while True:
            job, mv, going = snapshot()
            desc = f"{job['id']} {job['state']}"
            if mv is not None:
                desc += f" | move {mv['phase']}" + (f" -> node {mv['dest']}" if mv.get("dest") else "")
                if mv.get("total_bytes"):
                    bar.update(task, total=mv["total_bytes"], completed=mv.get("done_bytes", 0))
            bar.update(task, description=desc)
            if not going:
                break
            time.sleep(FOLLOW_EVERY_S)
    info(f"{job['id']} {job['state']}: {job.get('reason') or ''}"
         + (f" ({mv['error']})" if mv and mv.get("error") else ""))
    return 0


_BYTES = ("as", "core", "data", "fsize", "memlock", "msgqueue", "rss", "stack")


def _size(item: str, v: Any) -> str:
    if not isinstance(v, int) or item not in _BYTES:
        return str(v)
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if v >= unit and v % unit == 0:
            return f"{v // unit}{suffix}"
    return str(v)


def limits_pairs(job: dict[str, Any]) -> dict[str, Any]:
    """``job show``'s lines for a job's ``limits`` and ``pids_limit`` (none for a queued job)."""
    lim = job.get("limits")
    out: dict[str, Any] = {}
    if isinstance(lim, dict):
        rl = " ".join(f"{k} {_size(k, s)}:{_size(k, h)}" for k, (s, h) in sorted((lim.get("rlimits") or {}).items()))
        out["limits"] = (f"{rl}; pids.max {lim.get('pids_max')}; umask {lim.get('umask')}; nice {lim.get('nice')}"
                         + ("; no_new_privs" if lim.get("no_new_privs") else ""))
        out["limits from"] = "; ".join(lim.get("from") or [])
        if lim.get("clamped"):
            out["limits clamped"] = "; ".join(f"{k}: {v}" for k, v in sorted(lim["clamped"].items()))
    pl = job.get("pids_limit")
    if isinstance(pl, dict):
        out["pids"] = f"{pl.get('current')} of {pl.get('max')} ({pl.get('refused')} forks refused at pids.max)"
    return out


def cmd_job_show(args: argparse.Namespace) -> int:
    if getattr(args, "follow", False):
        return _follow(args)
    job = args.client.get(f"/v1/jobs/{args.id}")
    mv = _move(args)
    if mv is not None and mv.get("phase") == "unconfirmed":  # the operator's cue for `job settle`
        job = {**job, "migration": {"phase": "unconfirmed", "dest": mv.get("dest"),
                                    "unconfirmed_since": mv.get("unconfirmed_since"), "error": mv.get("error")}}
    def human(j: dict[str, Any]) -> None:
        kv({k: v for k, v in j.items() if k not in ("spec", "limits", "pids_limit", "members", "multinode")}
           | {"command": (j.get("spec") or {}).get("command")} | limits_pairs(j), title=f"job {j['id']}")
        v = multinode_view(j)
        if v is not None:
            members_table(v)

    emit(job, args.output, human)
    return 0


def cmd_job_settle(args: argparse.Namespace) -> int:
    res = args.client.post(f"/v1/migrations/{args.id}/settle", {"decision": args.decision}, timeout=60)
    emit(res, args.output, lambda r: info(
        f"{r['job']}: hand-over to node {r['node']} settled: "
        + ("the job runs here" if r["decision"] == "run-here" and r["kind"] == "move" else
           "the keeper goes on" if r["decision"] == "run-here" else f"node {r['node']} runs it")
        + (f" (state {r['state']})" if r.get("state") else "")))
    return 0


def cmd_job_stop(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    grace = 5.0
    if args.grace is not None:
        if not 0 <= args.grace <= GRACE_MAX_S:  # also refuses inf and nan
            raise ValueError(f"--grace {args.grace:g}: expected seconds from 0 to {GRACE_MAX_S:g}")
        body["grace_s"] = grace = args.grace
    if args.reason:
        if len(args.reason) > REASON_MAX:
            raise ValueError(f"--reason of {len(args.reason)} characters: at most {REASON_MAX}")
        body["reason"] = args.reason
    job = args.client.post(f"/v1/jobs/{args.id}/stop", body, timeout=STOP_ANSWER_S + grace)
    emit(job, args.output, lambda j: info(f"{j['id']} {j['state']}: {j.get('reason') or j.get('end_reason')}"))
    return 0
