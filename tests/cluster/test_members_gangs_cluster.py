"""Concurrent gang submissions never over-commit a node and never deadlock (issue 33), between
real agents: 6 laminard processes in one zone with 2 GPUs each, each in a network namespace of
its own on a bridge of the test's own.

Four 3-worker jobs of 2 GPUs per worker are submitted at once from four different origins
(threads, each calling its origin's API): each needs 3 whole nodes and the zone has room for
two. Every submission answers within a bounded time, placed or queued-out (ended, with the
placer's reason); at no moment does a node run more GPUs than it has (the members of every job,
as every agent lists them); one or two gangs are placed (no two gangs wait on each other; a
gang is queued out only after all its rounds), and no node is left with a reservation. Once the placed jobs are stopped, the ones that did not fit
are submitted again and now are placed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_until

pytestmark = pytest.mark.cluster

GPUS = 2  # per node
GANGS = 4
BOUND_S = 60.0  # every submission answers within this


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(Cluster.create(tmp_path, **kw))




def gpus_in_use(c: Cluster) -> dict[int, int]:
    """node id -> the GPUs its live jobs (members of every job) hold, as its agent lists them."""
    out = {}
    for nd in c.nodes:
        live = [j for j in nd.json("jobs") if j["state"] in ("starting", "running", "suspended", "queued")]
        out[nd.node_id] = sum(len(j.get("gpus") or []) if isinstance(j.get("gpus"), list) else int(j.get("gpus") or 0)
                              for j in live)
    return out


def story(c: Cluster, results: dict[int, dict[str, Any]]) -> str:
    """The submissions' answers and every node's jobs and members events, for failure messages."""
    import json

    out = [json.dumps(results[i]) for i in sorted(results)]
    for nd in c.nodes:
        out += [f"node {nd.node_id} job {j['id']} {j['state']} gpus={j.get('gpus')} {j.get('reason')}"
                for j in nd.json("jobs")]
        out += [f"node {nd.node_id} {e['ts']:.3f} {e['message']}" for e in nd.json("events", "--kind", "members")]
    return "\n".join(out)


def spec(i: int) -> dict[str, Any]:
    return {"name": f"gang{i}", "command": ["sleep", "300"], "workers": 3, "launcher": "plain"}


def test_concurrent_gangs_never_overcommit_a_node_never_deadlock_and_the_rest_fit_later(make_cluster) -> None:
    c = make_cluster(zones=1, per_zone=6, gpus=GPUS)
    results: dict[int, dict[str, Any]] = {}
    took: dict[int, float] = {}
    errors: list[BaseException] = []
    watch_over = threading.Event()
    peaks: dict[int, int] = {}
    watch_errors: list[BaseException] = []

    def watch() -> None:  # node GPU use, sampled all through the placements
        while not watch_over.is_set():
            try:
                for n, g in gpus_in_use(c).items():
                    peaks[n] = max(peaks.get(n, 0), g)
            except BaseException as e:  # noqa: BLE001 (reported below)
                watch_errors.append(e)
                return
            time.sleep(0.05)

    def submit(i: int) -> None:
        t0 = time.monotonic()
        try:
            results[i] = c.place(i, spec(i), gpus=GPUS)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
        took[i] = time.monotonic() - t0

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    go = [threading.Thread(target=submit, args=(i,), daemon=True) for i in range(GANGS)]
    for t in go:
        t.start()
    for t in go:
        t.join(BOUND_S + 30)
    assert not any(t.is_alive() for t in go), f"a submission did not answer within {BOUND_S + 30} s: {took}"
    assert not errors, errors
    assert all(s <= BOUND_S for s in took.values()), took

    placed = {i: r for i, r in results.items() if r["placement"].get("outcome") == "placed"}
    out = {i: r for i, r in results.items() if i not in placed}
    # room for two: usually both are used (the gangs that split the free nodes in a round probe
    # them again later: test_gangplace_simnet pins that down); here at least one, and a gang
    # queued out only after all its rounds (three losers may split the nodes in each of them)
    assert 1 <= len(placed) <= 2, story(c, results)
    assert all(r["placement"]["rounds"] == 3 for i, r in results.items() if i not in placed), story(c, results)
    for i, r in placed.items():
        assert r["state"] in ("starting", "running") and len({m["node"] for m in r["members"]}) == 3, r
        wait_until(lambda i=i, r=r: c.multinode_view(i, r["id"]).get("state") == "running", 30, f"gang {i} running")
    for r in out.values():  # queued-out: ended with the placer's reason, nothing of it runs
        assert r["placement"]["outcome"] == "queued-out" and r["state"] == "ended", r
        assert r["end_reason"].startswith("not placed: ") and len(r["end_reason"]) > len("not placed: "), r
    # the placed gangs run on distinct nodes: two of them use all six
    used = [m["node"] for r in placed.values() for m in r["members"]]
    assert len(used) == len(set(used)), used
    time.sleep(1.0)
    watch_over.set()
    watcher.join(5)
    assert not watch_errors, watch_errors
    assert set(peaks) == {nd.node_id for nd in c.nodes}
    assert all(g <= GPUS for g in peaks.values()), f"a node ran more than {GPUS} GPUs: {peaks}"
    now = gpus_in_use(c)
    assert now == {n: (GPUS if n in used else 0) for n in now}, now
    # no node holds a reservation for a gang that is gone
    for nd in c.nodes:
        held = nd.json("zone", "stats")["arbiter"]["held"]
        assert held == 0, (nd.node_id, held)

    # the ones that did not fit fit once the others end
    for i, r in placed.items():
        c.nodes[i].ctl("job", "stop", r["id"])
        wait_until(lambda i=i, r=r: c.multinode_view(i, r["id"]).get("state") == "ended", 30, f"gang {i} stopped")
    wait_until(lambda: not any(gpus_in_use(c).values()), 30, "every GPU free")
    c.wait_converged()
    again = {}
    for i in sorted(out)[:2]:
        again[i] = c.place(i, spec(i), gpus=GPUS)
        assert again[i]["placement"]["outcome"] == "placed", again[i]
    used = [m["node"] for r in again.values() for m in r["members"]]
    assert len(used) == len(set(used)) == 3 * len(again), used
    wait_until(lambda: all(g <= GPUS for g in gpus_in_use(c).values()), 5, "no node over-committed")
    for i, r in again.items():
        c.nodes[i].ctl("job", "stop", r["id"])
