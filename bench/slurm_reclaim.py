"""Reclaim with notice on a real Slurm: Laminar's reclaim against Slurm's own preempt-and-requeue
(``GraceTime`` and ``--signal``), work lost and downtime of the same job (issue 34).

Everything here is real: Debian's Slurm (slurmctld, two slurmd, munge; ``tests/slurmrig.py``)
over two real laminard agents of one zone (``tests/cluster/harness.py``: each agent and its
slurmd in a network namespace of their own), the laminar SPANK plugin, and one batch job, a
python program that sums ``i * i`` over ``STEPS`` steps of ``STEP_S`` seconds with
``laminar.jobkit.Checkpointer``: it saves its state when asked (SIGUSR1), resumes from a
checkpoint, and logs every step with its wall time and node. The node the job runs on is
taken back with ``NOTICE_S`` seconds of notice, ``RECLAIM_AT_S`` seconds after the job
started, in three ways:

* ``laminar``: the job is adopted (``--laminar-class standard --laminar-checkpoint USR1``) and
  the owner runs ``laminarctl reclaim --notice NOTICE_S`` on its node. The agent drains the node
  in Slurm, asks for the checkpoint as late in the window as is safe, requeues the job once the
  checkpoint is committed (``scontrol requeue``), and the job resumes on the other node from
  ``LAMINAR_RESUME_FROM``.
* ``slurm-run``: Slurm's own preemption. The job runs in partition ``work`` (``PriorityTier=1``,
  ``PreemptMode=REQUEUE``, ``GraceTime=NOTICE_S``, ``SchedulerParameters=preempt_send_user_signal``:
  Slurm 22.05's spelling) with ``--signal=USR1@NOTICE_S``, its work one ``srun`` step (Slurm
  signals a preempted job's steps, not its batch shell); the owner submits an exclusive job to
  partition ``owner`` (``PriorityTier=10``) on that node. Slurm signals the job at once (SIGUSR1,
  or SIGTERM: the job takes either as its checkpoint request), the job checkpoints and computes on
  until it is killed at the grace time's end, and is requeued; it resumes from its newest
  verified checkpoint.
* ``slurm-idle``: the same, but the job stops computing once its checkpoint is saved and waits
  to be killed (it must not exit: a preempted job that ends by itself is not requeued).

Per way: ``work_lost_s`` (wall time of the steps computed and then computed again),
``gap_s`` (from the last step on the first node to the first on the second), ``delay_s``
(how much later the job ended than an uninterrupted run: work lost + gap + idle time), and
``owner_wait_s`` (from the owner's request until the node was free of the job: its end as the
node's agent recorded it, or the owner's preempting job's start as Slurm recorded it, to the
second). ``--runs`` repeats each way (the median is reported).

    python bench/slurm_reclaim.py --quick --json out.json --plot out.png

Root, Slurm and munge installed, the plugin built (``make setup``). ``--quick``: one run per way
with a 10 s notice (about 3 minutes: the job must really run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "agent"), str(REPO / "tests"), str(REPO / "tests" / "cluster")]

STEP_S = 0.1

JOB = '''#!{python}
# lm-b-sumsq: the Slurm batch job of bench/slurm_reclaim.py
import json, os, sys, time
sys.path.insert(0, {agent!r})
from laminar import jobkit

out, mode, steps, step_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if mode == "laminar":  # adopted: the agent gave LAMINAR_CKPT_DIR and, on a resume, LAMINAR_RESUME_FROM
    ck = jobkit.Checkpointer()
else:  # Slurm alone: the job finds its own newest checkpoint in a directory of its own
    d = os.path.join({shared!r}, "native-" + os.environ["SLURM_JOB_ID"])
    os.makedirs(d, exist_ok=True)
    newest, _ = jobkit.newest_verified(d)
    ck = jobkit.Checkpointer(ckpt_dir=d, resume_from=str(newest) if newest else "")
    import signal
    signal.signal(signal.SIGTERM, lambda *_: ck.request())  # what Slurm sends when --signal's was sent
state = ck.resume()
i, acc = (0, 0) if state is None else tuple(json.loads(state))
node = os.uname().nodename
log = open(out + ".steps", "a", buffering=1)
log.write(json.dumps({{"start": time.time(), "node": node, "began": i}}) + "\\n")
while i < steps:
    acc += i * i
    i += 1
    time.sleep(step_s)
    log.write(json.dumps({{"t": time.time(), "step": i, "node": node}}) + "\\n")
    if ck.requested():
        ck.save(json.dumps([i, acc]).encode(), step=i)
        log.write(json.dumps({{"ckpt": time.time(), "step": i, "node": node}}) + "\\n")
        if mode == "slurm-idle":
            while True:  # wait to be killed: a preempted job that ends by itself is not requeued
                time.sleep(1)
with open(out, "w") as f:
    json.dump({{"result": acc, "node": node, "t": time.time()}}, f)
'''


def one_run(c: Any, s: Any, tmp: Path, shared: Path, way: str, steps: int, notice_s: float,
            reclaim_at_s: float) -> dict[str, Any]:
    from harness import wait_until  # type: ignore[import-not-found]

    run_dir = tmp / f"{way}-{time.monotonic_ns()}"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    out = run_dir / "result.json"
    script = s.public / "lm-b-sumsq.py"
    wrapper = s.public / "lm-b-sumsq.sh"  # Slurm signals a preempted job's steps: the work runs as one
    if not script.exists():
        script.write_text(JOB.format(python=sys.executable, agent=str(REPO / "agent"), shared=str(shared)))
        wrapper.write_text(f'#!/bin/sh\nexec srun "{script}" "$@"\n')
        for f in (script, wrapper):
            f.chmod(0o755)
    common = ["-p", "work", "--requeue", "-o", str(run_dir / "slurm-%j.out")]
    if way == "laminar":
        job = s.sbatch(*common, "--laminar-class", "standard", "--laminar-checkpoint", "USR1",
                       str(script), str(out), way, str(steps), str(STEP_S))
    else:
        job = s.sbatch(*common, f"--signal=USR1@{int(notice_s)}", str(wrapper), str(out), way, str(steps), str(STEP_S))
    first = s.wait_state(job, "RUNNING", 60)
    x_name = first["NodeList"]
    xi = next(n.index for n in s.nodes if n.name == x_name)
    steps_file = Path(str(out) + ".steps")
    wait_until(lambda: steps_file.exists() and steps_file.stat().st_size > 0, 60, f"job {job} to start")
    time.sleep(reclaim_at_s)
    t_req = time.time()
    owner = None
    if way == "laminar":
        c.nodes[xi].ctl("reclaim", "--notice", f"{notice_s:g}s", "--reason", "bench owner")
    else:  # the owner keeps its node until the measured job is done
        owner = s.sbatch("-p", "owner", "-w", x_name, "--exclusive", "-o", "/dev/null", "--wrap", "sleep 3600")
    s.wait_state(job, "COMPLETED", steps * STEP_S * 3 + notice_s + 240)
    result = json.loads(out.read_text())
    lines = [json.loads(x) for x in steps_file.read_text().splitlines()]
    runs: list[list[dict[str, Any]]] = []
    for x in lines:
        if "start" in x:
            runs.append([])
        elif "t" in x:
            runs[-1].append(x)
    if len(runs) != 2:
        raise RuntimeError(f"{way}: expected one requeue (2 runs), saw {len(runs)}")
    first_run, second_run = runs
    began2 = second_run[0]["step"] - 1
    redone = [x for x in first_run if x["step"] > began2]
    ticks = first_run + second_run
    step_mean = statistics.median(b["t"] - a["t"] for run_ in runs for a, b in zip(run_, run_[1:], strict=False))
    lost = (first_run[-1]["t"] - redone[0]["t"] + step_mean) if redone else 0.0
    start0 = next(x["start"] for x in lines if "start" in x)
    total = ticks[-1]["t"] - start0
    second_node = second_run[0]["node"]
    if way == "laminar":  # when the node was free of the job: its end as X's agent recorded it
        rec = next(j for j in c.nodes[xi].json("jobs") if j.get("scheduler_ref") == job)
        node_free = float(rec["ended"])
    else:  # when the owner's job started there (Slurm's StartTime, to the second)
        node_free = time.mktime(time.strptime(s.job(str(owner))["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    if way == "laminar":  # the node given back: the reclaim ended, Slurm's drain cleared
        c.nodes[xi].ctl("reclaim", "cancel", check=False)
        s.run("scontrol", "update", f"nodename={x_name}", "state=undrain", check=False)
    else:
        s.run("scancel", str(owner), check=False)
    s.wait_idle(60)
    return {
        "ok": result["result"] == sum(i * i for i in range(steps)),
        "requeued_to_other_node": second_node != x_name,
        "work_lost_s": round(lost, 3),
        "steps_redone": len(redone),
        "gap_s": round(second_run[0]["t"] - step_mean - first_run[-1]["t"], 3),
        "delay_s": round(total - steps * step_mean, 3),
        "owner_wait_s": round(node_free - t_req, 3),
        "checkpoint_after_request_s": round(next((x["ckpt"] for x in lines if "ckpt" in x), float("nan")) - t_req, 3),
        "began_again_at_step": began2,
    }


def run(quick: bool, runs: int) -> dict[str, Any]:
    import tempfile

    from harness import Cluster  # type: ignore[import-not-found]
    from slurmrig import SlurmRig, slurm_ready  # type: ignore[import-not-found]

    why = slurm_ready()
    if why:
        raise SystemExit(f"slurm_reclaim: {why}")
    notice_s = 10.0 if quick else 30.0
    steps = 500 if quick else 1200  # past the grace time plus slurmctld's 30 s time-limit sweep
    reclaim_at_s = 6.0 if quick else 15.0
    tmp = Path(tempfile.mkdtemp(prefix="lm-b-slurm-"))
    os.chmod(tmp, 0o755)
    shared = tmp / "shared-ckpt"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    adopt = f'\n[adopt]\nckpt_root = "{shared}"\n'
    parts = (f"PartitionName=work Nodes={{nodes}} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
             f"PreemptMode=REQUEUE GraceTime={int(notice_s)}\n"
             "PartitionName=owner Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF\n")
    extra = "PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE\nSchedulerParameters=preempt_send_user_signal\n"
    out: dict[str, Any] = {"notice_s": notice_s, "steps": steps, "step_s": STEP_S, "reclaim_at_s": reclaim_at_s}
    with Cluster.create(tmp, zones=1, per_zone=2, gpus=0, node_extra={0: adopt, 1: adopt}) as c, \
            SlurmRig.create(tmp, c, partitions=parts, conf_extra=extra) as s:
        os.environ["SLURM_CONF"] = str(s.conf)
        s.agents_act_through_slurm(c)
        for way in ("laminar", "slurm-run", "slurm-idle"):
            rs = []
            for r in range(runs):
                print(f"{way} run {r + 1}/{runs} ...", flush=True)
                rs.append(one_run(c, s, tmp, shared, way, steps, notice_s, reclaim_at_s))
                print(f"  {rs[-1]}", flush=True)
            out[f"{way}_runs"] = rs
            for k in ("work_lost_s", "gap_s", "delay_s", "owner_wait_s"):
                out[f"{way}_{k}"] = round(statistics.median(r[k] for r in rs), 3)
            out[f"{way}_ok"] = all(r["ok"] and r["requeued_to_other_node"] for r in rs)
    for k in ("work_lost_s", "delay_s"):
        base = min(out[f"slurm-run_{k}"], out[f"slurm-idle_{k}"])
        out[f"laminar_{k}_vs_best_slurm"] = round(out[f"laminar_{k}"] - base, 3)
    return out


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = ("laminar", "slurm-run", "slurm-idle")
    keys = ("work_lost_s", "gap_s", "delay_s", "owner_wait_s")
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.25
    for i, way in enumerate(ways):
        ax.bar([j + i * w for j in range(len(keys))], [res[f"{way}_{k}"] for k in keys], w, label=way)
    ax.set_xticks([j + w for j in range(len(keys))], [k[:-2].replace("_", " ") for k in keys])
    ax.set_ylabel("seconds")
    ax.set_title(f"reclaim with {res['notice_s']:g} s notice on a real Slurm (median of runs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one run per way, 10 s of notice")
    ap.add_argument("--runs", type=int, default=None, help="runs per way (default 1 quick, 3 otherwise)")
    ap.add_argument("--json", help="write the result object here")
    ap.add_argument("--plot", help="write a PNG here")
    a = ap.parse_args()
    t0 = time.time()
    res = run(a.quick, a.runs or (1 if a.quick else 3))
    res["wall_s"] = round(time.time() - t0, 1)
    res["date"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    res["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    if a.plot:
        plot(res, a.plot)
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_runs")}, indent=2))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
