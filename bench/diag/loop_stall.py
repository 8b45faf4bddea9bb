"""How long can a local user hold the agent's event loop? Seconds of stall per attack.

One real laminard (tests/agentproc.py, in a network namespace of its own, metrics on its
loopback, two declared GPUs) and one real local user (tests/userrig.py). For each attack of
tests/loopattacks.py the user makes it on the public socket (or the metrics port), while root
asks ``GET /v1/status`` on the admin socket every 50 ms (tests/liveness.py): the figure is the
slowest answer root got during the attack (the loop's longest stall, give or take 50 ms),
with root's p99, the attacker's status codes and, for the connection floods, the agent's
thread and descriptor counts. Run it on the code before and after a fix and compare.

    python bench/diag/loop_stall.py [--json PATH] [--only NAME[,NAME...]] [--quick] [--keep-log PATH]

Needs root (namespaces, cgroups, users). The attacks are sized to stall the old code for
seconds, not hours (the stall grows with the size: see each attack's docstring).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "agent")]

METRICS_PORT = 19478


def p99(xs: list[float]) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def measure(agent: Any, job: str, name: str, how: tuple[Any, ...], *args: Any, timeout: float = 300.0,
            after_s: float = 0.5) -> dict[str, Any]:
    """Runs one attack (``how``: user, netns, function) with root's liveness probe beside it."""
    import threading

    import loopattacks as la
    from liveness import RootLiveness

    pid = la.laminard_pid(agent)
    t0 = time.monotonic()
    peak = {"threads": 0, "fds": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak["threads"] = max(peak["threads"], la.agent_threads(pid))
                peak["fds"] = max(peak["fds"], la.agent_fds(pid))
            except OSError:
                pass
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with RootLiveness(agent.sock, job, period_s=0.05, call_timeout_s=timeout) as live:
        time.sleep(0.3)
        try:
            res = la.start_as(*how, *args).result(timeout)
        except Exception as e:  # noqa: BLE001 - reported in the figures
            res = {"error": repr(e)}
        time.sleep(after_s)
    done.set()
    sampler.join()
    st = live.status_s
    return {"attack": name, "stall_s": round(max(st, default=0.0), 3), "root_status_p99_s": round(p99(st), 4),
            "root_status_median_s": round(statistics.median(st), 4) if st else None, "root_calls": len(st),
            "root_failures": live.failures[:3], "wall_s": round(time.monotonic() - t0, 2),
            "agent_threads_max": peak["threads"], "agent_fds_max": peak["fds"], "attacker": res}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--only", help="comma-separated attack names")
    ap.add_argument("--quick", action="store_true", help="smaller attacks")
    ap.add_argument("--keep-log", help="copy the agent's log here at the end")
    args = ap.parse_args()

    import loopattacks as la
    from agentproc import AgentProc, api_json
    from conftest import delete_netns, make_veth_pair
    from userrig import local_user

    only = set(args.only.split(",")) if args.only else None
    q = 0.5 if args.quick else 1.0
    created: list[Any] = []
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lm-t-stall-") as tmp:
        veth = make_veth_pair(created, tag="ls")
        agent = AgentProc(Path(tmp), veth.ifname_a, veth.a, extra_toml="[gpus]\ndeclared = 2\n")
        agent.config_path.write_text(agent.config_path.read_text().replace(
            'listen = ""', f'listen = "127.0.0.1:{METRICS_PORT}"'))
        try:
            agent.start()
            code, job = api_json(agent.sock, "POST", "/v1/jobs", json.dumps({"command": ["sleep", "3600"]}))
            assert code == 201, job
            # 10,000 events in the log, as a busy node has (the store keeps 50,000)
            db = sqlite3.connect(str(agent.state_dir / "laminar.db"), timeout=30)
            with db:
                db.executemany("INSERT INTO events(ts, kind, message, fields) VALUES(?, 'job', ?, ?)",
                               [(time.time(), f"job job-{i} exited: exit code 0",
                                 json.dumps({"job": f"job-{i}", "state": "exited", "exit_code": 0}))
                                for i in range(10_000)])
            db.close()
            ns = veth.a.path
            with local_user("stall") as user:
                who = (user, None)
                attacks: list[tuple[str, tuple[Any, ...], tuple[Any, ...]]] = [
                    ("memory_regex_16k", (*who, la.memory_regex), (str(agent.sock), int(16_000 * q))),
                    ("huge_numbers", (*who, la.huge_numbers), (str(agent.sock),)),
                    ("policy_dotted_32k", (*who, la.policy_dotted), (str(agent.sock), int(32_000 * q))),
                    ("policy_nested", (*who, la.policy_nested), (str(agent.sock),)),
                    ("policy_parallel_8x16k", (*who, la.policy_parallel), (str(agent.sock), 8, 16_000)),
                    ("events_32x10000", (*who, la.get_many), (str(agent.sock), "/v1/events?limit=10000", 32)),
                    ("events_32x1000", (*who, la.get_many), (str(agent.sock), "/v1/events?limit=1000", 32)),
                    ("status_hammer_32x5s", (*who, la.hammer), (str(agent.sock), "/v1/status", 32, 5.0 * q)),
                    ("metrics_idle_500", (user, ns, la.idle_connections), (("127.0.0.1", METRICS_PORT), 500, 5.0)),
                    ("big_env_jobs_16x1MiB", (*who, la.big_env_jobs), (str(agent.sock), 16, 1000 << 10)),
                    ("big_env_jobs_64x60KiB", (*who, la.big_env_jobs), (str(agent.sock), 64, 60 << 10)),
                    ("jobs_list_8", (*who, la.get_many), (str(agent.sock), "/v1/jobs?limit=1000", 8)),
                    ("elastic_1e6", (*who, la.submit), (str(agent.sock), {
                        "command": ["/bin/sleep", "600"], "gpus": 1, "elastic_min": 1, "elastic_max": 1_000_000})),
                ]
                for name, fn, fargs in attacks:
                    if only and name not in only:
                        continue
                    after = 5.0 if name.startswith("elastic") else 0.5
                    r = measure(agent, job["id"], name, fn, *fargs, after_s=after)
                    print(json.dumps(r), flush=True)
                    out.append(r)
                    # each attack from a clean slate: the user's jobs stopped
                    for j in api_json(agent.sock, "GET", "/v1/jobs?all=0")[1]:
                        if j.get("owner_uid") == user.uid:
                            api_json(agent.sock, "POST", f"/v1/jobs/{j['id']}/stop", '{"grace_s": 0}', timeout=60)
        finally:
            if args.keep_log:
                import shutil

                shutil.copy(agent.log_path, args.keep_log)
            agent.cleanup()
            for n in created:
                delete_netns(n)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
