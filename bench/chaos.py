"""A soak under random reclaims, withdrawals and agent kills: do jobs finish once, with the
right result, and how much work is redone?

Real laminard agents, one zone, each in its own network namespace (``tests/cluster/harness.py``),
sharing an archive directory (``migrate.archive_dir``; none with ``--no-archive``: the jobs then
live on their keepers' replicas alone) with prestaging on. The jobs are this
script's ``--role job``: a hash chain of ``--steps`` steps (``h = sha256(h || step)``), saved
through jobkit every second and when the agent asks, resumed from ``LAMINAR_RESUME_FROM``; every
step, start and end is appended to a ledger file shared by all nodes (one ``write`` per line,
``O_APPEND``: lines never interleave within themselves). Meanwhile a seeded schedule hits random
nodes, one at a time (``--concurrent N``: up to N at once, each on its own node), with one of:

- ``reclaim``: a notice of 4 to 10 s; once its window ended and 3 to 15 s more passed, the owner
  gives the node back (``reclaim cancel``, or an agent restart, which clears the stored reclaim);
- ``withdraw``: a notice of 10 s, cancelled 1 to 5 s into it;
- ``kill``: SIGKILL of the agent (its jobs run on), started again 1 to 6 s later;
- ``restart``: SIGTERM, started again at once;
- ``partition`` (with ``--partitions``): the node's link to the bridge down for 2 s to
  min(12 s, ``orphan_after_s`` / 2), then up (shorter than ``orphan_after_s``: no take-over);
- ``long-partition`` (with ``--long-partitions``): the link down for ``orphan_after_s`` + 3 to
  + 15 s: the zone takes the node for gone and resumes its jobs elsewhere while they run on
  there. Two copies of a job may run from the take-over until LONG_CUT_GRACE_S after the link
  is back (the keeper then tells the node, which stops its copy: control op ``superseded``);
- ``partial-partition`` (with ``--partial-partitions``): only the link between the node and one
  other node down (blackhole routes, both ways) for ``orphan_after_s`` + 3 to + 15 s; both still
  hear the rest of the zone, so neither is gone (the silent one is vouched for by the others,
  control op ``heard``): no copy may run twice, and none is counted as a split run;
- ``crash`` (with ``--crashes``): the node fails abruptly, as a power cut or a kernel panic: its
  agent and every job are SIGKILLed, its cgroups removed and its link cut for
  ``orphan_after_s`` + 5 to + 25 s (the zone counts it gone: its jobs are taken over elsewhere,
  from their replicas or the archive); then it comes back, its state directory and pins kept
  as on a disk, and its agent starts (a reboot);
- ``reboot`` (with ``--reboots``): the same for 3 s to ``orphan_after_s`` / 2, so nobody took its
  jobs over: they are ``lost`` there, and their keepers must resume them.

Checked, from the ledger (the run exits 1 when any fails; these are the contract, not timings):

- ``double_runs``: two processes of the same job stepping at the same time (their step lines
  interleave), or a job stepping after its end; inside a long partition's window (above) these
  are counted as ``split_runs`` instead, and are no failure;
- ``wrong_results``: an end whose hash is not the chain's over all the steps;
- ``unfinished``: a job with no end when the run's time is up (lost, or never resumed).

Measured: ``redone_steps_pct`` (steps run more than once, over the jobs' steps), ``wall_s``,
events by kind, and the agents' own counts of moves and archive claims.

    python bench/chaos.py [--quick] [--seed N] [--json PATH] [--nodes N] [--jobs N]
                          [--steps N] [--limit-s S] [--partitions] [--long-partitions] [--crashes]
                          [--partial-partitions] [--reboots]
                          [--concurrent N] [--fence-after-s S] [--no-archive] [--keep-logs DIR]

``--quick``: 3 nodes, 2 jobs of 600 steps; else 4 nodes, 3 jobs of 3,000 steps. A step is 50 ms.
Needs root (namespaces, cgroups).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEP_S = 0.05
# After a long partition's link is back, two copies of a job may run this long more: the keeper
# hears the node (summaries), tells it (``superseded``) and it stops its copy.
LONG_CUT_GRACE_S = 20.0


def chain(steps: int) -> str:
    h = b""
    for s in range(1, steps + 1):
        h = hashlib.sha256(h + s.to_bytes(8, "big")).digest()
    return h.hex()


def _role_job(name: str, steps: int, ledger: str) -> int:
    sys.path.insert(0, str(REPO / "agent"))
    from laminar import jobkit

    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(**kw: Any) -> None:
        os.write(fd, (json.dumps({"n": name, "pid": os.getpid(), "t": round(time.time(), 3), **kw}) + "\n").encode())

    ck = jobkit.Checkpointer()
    state = ck.resume()
    step, h = (0, b"") if state is None else (int.from_bytes(state[:8], "big"), state[8:])
    cg = Path("/proc/self/cgroup").read_text().strip().rsplit(":", 1)[-1]  # names the agent (its cgroup root)
    note(ev="start", s=step, job=os.environ.get("LAMINAR_JOB_ID", ""), cgroup=cg)
    last = time.monotonic()
    while step < steps:
        time.sleep(STEP_S)
        step += 1
        h = hashlib.sha256(h + step.to_bytes(8, "big")).digest()
        note(ev="step", s=step)
        if ck.requested() or time.monotonic() - last >= 1.0:
            ck.save(step.to_bytes(8, "big") + h, step=step)
            last = time.monotonic()
    note(ev="done", s=step, h=h.hex())
    return 0


# --------------------------------------------------------------------------- the checks


def check(ledger: Path, names: list[str], steps: int,
          windows: list[tuple[float, float]] | None = None) -> dict[str, Any]:
    """The contract's checks over the ledger (see the module's doc). ``windows``: (from, to)
    wall-clock spans of long partitions (grace included) in which two copies may run: what
    happens in one is a ``split_runs`` entry, not a ``double_runs`` one."""
    want = chain(steps)
    rows = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()] if ledger.exists() else []
    double: list[str] = []
    split: list[str] = []
    wrong: list[str] = []
    ran = dict.fromkeys(names, 0)
    done: dict[str, int] = {}
    stepping: dict[str, int] = {}  # job -> the pid that stepped last
    last_t: dict[int, float] = {}  # pid -> when it stepped last

    def bad(what: str, t: float) -> None:
        (split if any(lo <= t <= hi for lo, hi in windows or []) else double).append(what)

    for r in rows:
        n, pid, t = r["n"], r["pid"], float(r.get("t", 0.0))
        if r["ev"] == "start":
            stepping.pop(n, None)
            if n in done:
                bad(f"{n}: started again (pid {pid}) after its end", t)
        elif r["ev"] == "step":
            ran[n] += 1
            if n in done:
                bad(f"{n}: step {r['s']} by pid {pid} after its end", t)
            prev = stepping.get(n)
            if prev is not None and prev != pid:
                # the two ran at once until the other's last step: that is when it happened
                bad(f"{n}: pids {prev} and {pid} step at once (step {r['s']})", last_t.get(prev, t))
            stepping[n] = pid
            last_t[pid] = t
        elif r["ev"] == "done":
            if n in done:
                bad(f"{n}: ended twice", t)
            done[n] = pid
            if r["h"] != want:
                wrong.append(f"{n}: hash {r['h'][:12]}... is not the chain's {want[:12]}...")
    # a job restarted from a checkpoint starts with a "start" line: any later step by the older
    # pid is a second process stepping at once (caught above when lines interleave)
    return {"double_runs": double, "split_runs": len(split), "wrong_results": wrong,
            "unfinished": sorted(set(names) - set(done)),
            "redone_steps_pct": round(100.0 * (sum(ran.values()) - steps * len(done)) / max(1, steps * len(names)), 2),
            "steps_run": sum(ran.values())}


# --------------------------------------------------------------------------- the driver


def run(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "cluster")]
    from agentproc import remove_cgroup_tree
    from harness import Cluster, wait_until

    rng = random.Random(a.seed)
    ledger = tmp / "ledger.jsonl"
    extra = ("\n[migrate]\nprestage = \"always\"\npoll_s = 0.2\nretry_base_s = 0.5\nretry_max_s = 2.0\n"
             f"orphan_after_s = {a.orphan_after_s}\nfence_after_s = {a.fence_after_s}\n")
    if not a.no_archive:
        archive = tmp / "archive"
        archive.mkdir()
        extra += f"archive_dir = \"{archive}\"\narchive_gc_s = 2.0\n"
    names = [f"chaos{i}" for i in range(a.jobs)]
    counts: dict[str, int] = {}
    log: list[str] = []
    windows: list[tuple[float, float]] = []  # long partitions: (cut, back + LONG_CUT_GRACE_S), wall clock
    t0 = time.monotonic()

    def say(msg: str) -> None:
        line = f"[{time.monotonic() - t0:7.1f}s] {msg}"
        log.append(line)
        print(line, file=sys.stderr, flush=True)

    with Cluster.create(tmp, zones=1, per_zone=a.nodes, gpus=1, cpus=4, memory_mb=8000, zone_extra=extra) as c:
        def up(nd: Any) -> bool:
            return nd.agent.proc is not None and nd.agent.proc.poll() is None

        for i, n in enumerate(names):
            nd = c.nodes[i % len(c.nodes)]
            nd.ctl("-o", "json", "submit", "--gpus", "1", "--name", n, "--", sys.executable,
                   str(Path(__file__).resolve()), "--role", "job", "--name", n, "--steps", str(a.steps),
                   "--ledger", str(ledger))
        say(f"{a.jobs} jobs submitted on {a.nodes} nodes")
        time.sleep(3)

        def all_done() -> bool:
            return len(check(ledger, names, a.steps, windows)["unfinished"]) == 0

        def draw(kind: str) -> dict[str, Any]:
            """The event's parameters, drawn here (in the schedule's order: a seed's schedule is
            the same whatever the timing)."""
            if kind == "reclaim":
                notice = rng.uniform(4, 10)
                return {"notice": notice, "back": notice + rng.uniform(3, 15), "how": rng.choice(["cancel", "restart"])}
            if kind == "withdraw":
                return {"into": rng.uniform(1, 5)}
            if kind == "partition":
                return {"cut": rng.uniform(2, min(12.0, a.orphan_after_s / 2))}
            if kind == "kill":
                return {"down": rng.uniform(1, 6)}
            if kind == "crash":
                return {"down": a.orphan_after_s + rng.uniform(5, 25)}
            if kind == "reboot":
                return {"down": rng.uniform(3, a.orphan_after_s / 2)}
            if kind == "long-partition":
                return {"cut": a.orphan_after_s + rng.uniform(3, 15)}
            if kind == "partial-partition":
                return {"cut": a.orphan_after_s + rng.uniform(3, 15), "peer": rng.random()}
            return {}

        def act(nd: Any, kind: str, p: dict[str, Any]) -> None:
            try:
                if kind == "reclaim":
                    nd.ctl("reclaim", "--notice", f"{p['notice']:.1f}s", "--reason", "bench/chaos.py")
                    say(f"node {nd.node_id}: reclaim, notice {p['notice']:.1f} s; given back by {p['how']} "
                        f"after {p['back']:.1f} s")
                    time.sleep(p["back"])
                    if p["how"] == "cancel":
                        nd.ctl("reclaim", "cancel", "--reason", "bench/chaos.py: back", check=False)
                    else:
                        nd.agent.stop()
                        nd.agent.start(timeout=90)
                elif kind == "withdraw":
                    say(f"node {nd.node_id}: reclaim, notice 10 s, withdrawn after {p['into']:.1f} s")
                    nd.ctl("reclaim", "--notice", "10s", "--reason", "bench/chaos.py")
                    time.sleep(p["into"])
                    nd.ctl("reclaim", "cancel", "--reason", "bench/chaos.py: withdrawn", check=False)
                elif kind == "partition":
                    say(f"node {nd.node_id}: partitioned (its link down) for {p['cut']:.1f} s")
                    subprocess.run(["ip", "link", "set", nd.host_if, "down"], check=True)
                    try:
                        time.sleep(p["cut"])
                    finally:
                        subprocess.run(["ip", "link", "set", nd.host_if, "up"], check=True)
                elif kind == "long-partition":
                    say(f"node {nd.node_id}: partitioned for {p['cut']:.1f} s, past orphan_after_s (its jobs are "
                        "resumed elsewhere; its copies must stop once it is back)")
                    cut_at = time.time()
                    subprocess.run(["ip", "link", "set", nd.host_if, "down"], check=True)
                    try:
                        time.sleep(p["cut"])
                    finally:
                        subprocess.run(["ip", "link", "set", nd.host_if, "up"], check=True)
                        windows.append((cut_at, time.time() + LONG_CUT_GRACE_S))
                elif kind == "partial-partition":
                    peers = [o for o in c.nodes if o is not nd]
                    o = peers[int(p["peer"] * len(peers))]
                    say(f"node {nd.node_id}: cut from node {o.node_id} alone for {p['cut']:.1f} s, past "
                        "orphan_after_s (both still hear the others: neither is gone)")
                    routes = [(nd, o), (o, nd)]
                    for x, y in routes:
                        x.netns.run("ip", "route", "add", "blackhole", f"{y.addr}/32")
                    try:
                        time.sleep(p["cut"])
                    finally:
                        for x, y in routes:
                            x.netns.run("ip", "route", "del", "blackhole", f"{y.addr}/32", check=False)
                elif kind in ("crash", "reboot"):
                    say(f"node {nd.node_id}: {kind} (agent and jobs killed, cgroups gone, link down) for "
                        f"{p['down']:.1f} s, then a reboot")
                    subprocess.run(["ip", "link", "set", nd.host_if, "down"], check=True)
                    try:
                        nd.agent.kill9()
                        remove_cgroup_tree(nd.agent.cgroup_root)  # every job process with it
                        time.sleep(p["down"])
                    finally:
                        subprocess.run(["ip", "link", "set", nd.host_if, "up"], check=True)
                    nd.agent.start(timeout=90)
                elif kind == "kill":
                    say(f"node {nd.node_id}: SIGKILL, down {p['down']:.1f} s")
                    nd.agent.kill9()
                    time.sleep(p["down"])
                    nd.agent.start(timeout=90)
                else:
                    say(f"node {nd.node_id}: SIGTERM and start")
                    nd.agent.stop()
                    nd.agent.start(timeout=90)
            except Exception as e:  # an agent that fails to answer or start is a finding too
                say(f"node {nd.node_id}: {kind} failed: {e}")
                counts["failed_actions"] = counts.get("failed_actions", 0) + 1
                if not up(nd):
                    nd.agent.start(timeout=90)
            finally:
                busy.discard(nd.node_id)

        busy: set[int] = set()
        threads: list[threading.Thread] = []
        deadline = t0 + a.limit_s
        while time.monotonic() < deadline and not all_done():
            free = [nd for nd in c.nodes if nd.node_id not in busy]
            if len(busy) >= a.concurrent or not free:
                time.sleep(0.2)
                continue
            nd = rng.choice(free)
            kinds, weights = ["reclaim", "withdraw", "kill", "restart"], [4, 2, 3, 1]
            if a.partitions:
                kinds, weights = kinds + ["partition"], weights + [3]
            if a.crashes:
                kinds, weights = kinds + ["crash"], weights + [1]
            if a.reboots:
                kinds, weights = kinds + ["reboot"], weights + [3]
            if a.long_partitions:
                kinds, weights = kinds + ["long-partition"], weights + [2]
            if a.partial_partitions:
                kinds, weights = kinds + ["partial-partition"], weights + [2]
            kind = rng.choices(kinds, weights=weights)[0]
            counts[kind] = counts.get(kind, 0) + 1
            busy.add(nd.node_id)
            params = draw(kind)
            if a.concurrent == 1:
                act(nd, kind, params)
            else:  # up to --concurrent events at once, each on its own node
                t = threading.Thread(target=act, args=(nd, kind, params), daemon=True)
                t.start()
                threads.append(t)
            time.sleep(rng.uniform(2, 8))
        for t in threads:
            t.join()
        say("chaos over; waiting for the jobs to end")
        try:
            wait_until(all_done, max(60.0, deadline + 120 - time.monotonic()), "every job to end", every=1.0)
        except AssertionError as e:
            say(str(e))
        res = check(ledger, names, a.steps, windows)
        agents: dict[str, int] = {}
        for nd in c.nodes:
            if not up(nd):
                continue
            moves = nd.json("migrations")
            for m in moves:
                k = f"moves_{m.get('phase')}"
                agents[k] = agents.get(k, 0) + 1
            events = nd.json("events", "--kind", "migrate", "--limit", "5000")
            for ev in events:
                k = f"migrate_events_{ev.get('phase')}"
                agents[k] = agents.get(k, 0) + 1
            if a.keep_logs:
                Path(a.keep_logs).mkdir(parents=True, exist_ok=True)
                Path(a.keep_logs, f"migrate-node{nd.node_id}.json").write_text(
                    json.dumps({"migrations": moves, "events": events}, indent=1))
        if a.keep_logs:
            out = Path(a.keep_logs)
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(ledger, out / "ledger.jsonl")
            for nd in c.nodes:
                shutil.copy(nd.agent.log_path, out / f"laminard-node{nd.node_id}.log")
                logs = nd.agent.state_dir / "logs"
                if logs.is_dir():
                    shutil.copytree(logs, out / f"jobs-node{nd.node_id}", dirs_exist_ok=True)
            (out / "schedule.txt").write_text("\n".join(log) + "\n")
    return {"seed": a.seed, "nodes": a.nodes, "jobs": a.jobs, "steps": a.steps, "step_s": STEP_S,
            "fence_after_s": a.fence_after_s, "archive": not a.no_archive,
            "wall_s": round(time.monotonic() - t0, 1), "events": counts, **agents, **res}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--jobs", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--limit-s", type=float, default=600.0, help="how long the schedule runs at most")
    ap.add_argument("--orphan-after-s", type=float, default=30.0,
                    help="migrate.orphan_after_s (above the longest kill: a kill is not a departure)")
    ap.add_argument("--fence-after-s", type=float, default=0.0,
                    help="migrate.fence_after_s (0: off): a node cut off from the zone freezes its jobs before "
                         "they are resumed elsewhere, so a long partition should leave no split runs")
    ap.add_argument("--partitions", action="store_true",
                    help="also cut a node's link for 2 s to min(12, orphan_after_s / 2) s (a partition shorter "
                         "than orphan_after_s: no take-over may follow)")
    ap.add_argument("--long-partitions", action="store_true",
                    help="also cut a node's link for orphan_after_s + 3 to + 15 s: its jobs are taken over elsewhere "
                         "and its copies must stop once it is back (two copies allowed until LONG_CUT_GRACE_S after)")
    ap.add_argument("--partial-partitions", action="store_true",
                    help="also cut the link between a node and one other node alone for orphan_after_s + 3 to + 15 s "
                         "(both still hear the rest of the zone: no take-over may follow, no copy may run twice)")
    ap.add_argument("--crashes", action="store_true",
                    help="also crash a node: agent and jobs killed, cgroups gone, link down for orphan_after_s "
                         "+ 5 to + 25 s, then a reboot (its jobs are taken over elsewhere meanwhile)")
    ap.add_argument("--reboots", action="store_true",
                    help="also reboot a node faster than orphan_after_s: agent and jobs killed, cgroups gone, link "
                         "down for 3 s to orphan_after_s / 2, then its agent starts (nobody took its jobs over: "
                         "their keepers must resume them, found lost there)")
    ap.add_argument("--concurrent", type=int, default=1,
                    help="events under way at once, each on its own node (1: one after another)")
    ap.add_argument("--no-archive", action="store_true",
                    help="no migrate.archive_dir: jobs survive on their keepers' replicas alone (a crash while "
                         "a job's node and its keeper are both down loses it: use --concurrent 1)")
    ap.add_argument("--keep-logs", help="copy the ledger, the agents' and the jobs' logs here")
    ap.add_argument("--role", choices=["job"], help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--ledger", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.nodes = a.nodes or (3 if a.quick else 4)
    a.jobs = a.jobs or (2 if a.quick else 3)
    a.steps = a.steps or (600 if a.quick else 3000)
    if a.role == "job":
        return _role_job(str(a.name), a.steps, str(a.ledger))
    if a.nodes < 2 or a.jobs < 1 or a.jobs > a.nodes or a.steps < 1 or a.limit_s <= 0 or not 1 <= a.concurrent < a.nodes:
        raise SystemExit(f"chaos: need 2+ nodes, 1 to nodes jobs, 1+ steps, a positive limit and 1 to nodes-1 "
                         f"concurrent events (got --nodes {a.nodes} --jobs {a.jobs} --steps {a.steps} "
                         f"--limit-s {a.limit_s} --concurrent {a.concurrent})")
    if os.geteuid() != 0:
        raise SystemExit("chaos: needs root (network namespaces, cgroups)")

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # the cluster's cleanup runs (agents, namespaces, bridge, cgroups)

    signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="lm-bench-chaos-") as tmp:
        res = run(a, Path(tmp))
    out = json.dumps(res, indent=1)
    print(out)
    if a.json:
        Path(a.json).write_text(out + "\n")
    return 1 if res["double_runs"] or res["wrong_results"] or res["unfinished"] else 0


if __name__ == "__main__":
    sys.exit(main())
