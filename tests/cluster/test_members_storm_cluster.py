"""A memory storm on one member's node freezes every member of a multi-node job, and they thaw
together (issue 33), between real agents: 3 laminard processes in one zone, each in a network
namespace of its own on a bridge of the test's own.

Only the storm node runs Airlock (``Cluster.create(airlock=...)``: the other agents leave it out,
see ``ZoneAgent``), with a node budget of this test's own (``BUDGET_MB``). A 3-worker job of a
plain program (class transient, low priority: the lowest survival value on the storm node) runs
one member per node, each appending a tick to a file of its own every 50 ms. A long-resident
(protected) local job on the storm node grows to ~0.9 of the budget, holds, then frees: Airlock
suspends the member there, its origin orders the others frozen, so every member's cgroup on
every node is frozen (``cgroup.events`` frozen 1) and no member ticks; once the spike is gone
Airlock recovers its member, the origin thaws the others, all tick again, and the job ends ok.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_until

# serial: its memory pressure is felt machine-wide (node PSI, MemAvailable); run alone (Makefile)
pytestmark = [pytest.mark.cluster, pytest.mark.serial]

BUDGET_MB = 512
STORM = 2  # the storm node's index (not the origin's: the freeze crosses the zone both ways)

# A member: one tick line per 50 ms to TICKS.<rank> until DONE exists, then exit 0.
MEMBER = 'while [ ! -e "$DONE" ]; do echo t >> "$TICKS.$RANK"; sleep 0.05; done'

# The spike: grows to TOTAL MiB in 30 MiB steps (pages written, so really charged), holds HOLD
# s, frees it, then sleeps.
SPIKE = r"""
import sys, time
total, hold = int(sys.argv[1]), float(sys.argv[2])
keep = []
while sum(map(len, keep)) < total << 20:
    b = bytearray(30 << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    keep.append(b)
    time.sleep(0.03)
time.sleep(hold)
del keep[:]
while True:
    time.sleep(1)
"""


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(Cluster.create(tmp_path, **kw))




def member_jobs(c: Cluster, job: str) -> dict[int, dict[str, Any]]:
    """node id -> that node's local job of the multi-node ``job``."""
    return {nd.node_id: j for nd in c.nodes for j in nd.json("jobs") if j["id"] == job}


def frozen(cgroup: str) -> bool:
    """The cgroup's own word (cgroup v2 ``cgroup.events``: frozen 1 once every task is stopped)."""
    events = dict(line.split() for line in (Path(cgroup) / "cgroup.events").read_text().splitlines())
    return events.get("frozen") == "1"


def story(c: Cluster, job: str) -> str:
    out = [json.dumps(c.multinode_view(0, job))]
    for nd in c.nodes:
        for kind in ("airlock", "job", "members"):
            for e in nd.json("events", "--kind", kind, "--limit", "100"):
                out.append(f"node {nd.node_id} {e['ts']:.3f} {kind:<7} {e['message']}")
    return "\n".join(out)


def test_a_storm_on_one_members_node_freezes_every_member_and_they_thaw_together(make_cluster, tmp_path) -> None:
    c = make_cluster(zones=1, per_zone=3, gpus=0, airlock=(STORM,),
                     node_extra={STORM: f"[airlock]\nbudget_mb = {BUDGET_MB}\n"})
    storm = c.nodes[STORM]
    assert storm.json("status")["airlock"]["budget_mb"] == BUDGET_MB
    # quick recovery once calm; a suspend rung that only recovery ends (a member's next rung is a kill)
    pol = tmp_path / "policy.json"
    # and a spike that is HIGH, never CRITICAL (which would kill the suspended member at once):
    # usage.critical above the spike's peak, no critical level from PSI full
    pol.write_text(json.dumps({"hysteresis": {"hold_s": 0.5, "step_s": 0.2},
                               "thresholds": {"usage.critical": 0.99, "memory.full": 0.0},
                               "rungs": {"suspend": {"budget_s": 60.0}}, "readdress": False}))
    storm.json("policy", "set", str(pol))

    ticks, done = tmp_path / "ticks", tmp_path / "done"
    spec = {"name": "gang", "command": ["sh", "-c", MEMBER], "workers": 3, "launcher": "plain",
            "class": "transient", "priority": 5, "memory_mb": 64,
            "env": {"TICKS": str(ticks), "DONE": str(done)}}
    view = c.place(0, spec)
    job = view["id"]
    assert sorted(m["node"] for m in view["members"]) == [1, 2, 3], view
    wait_until(lambda: c.multinode_view(0, job).get("state") == "running", 30, "the job running")

    def counts() -> list[int]:
        return [len(p.read_text()) if (p := Path(f"{ticks}.{i}")).exists() else 0 for i in range(3)]

    wait_until(lambda: all(counts()), 20, "every member ticking")
    cgroups = {nd.node_id: nd.json("job", "show", job)["cgroup"] for nd in c.nodes}
    assert sorted(cgroups) == [1, 2, 3] and not any(map(frozen, cgroups.values()))

    try:
        storm_passes(c, job, cgroups, counts)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{story(c, job)}") from None
    # the job finishes correctly: every member exits 0, the job ends ok at its origin
    done.touch()
    v = wait_until(lambda: (lambda x: x if x.get("state") == "ended" else None)(c.multinode_view(0, job)), 30,
                   "the job's end")
    assert v["end_reason"] == "ok" and [m["state"] for m in v["members"]] == ["exited"] * 3, v


def storm_passes(c: Cluster, job: str, cgroups: dict[int, str], counts: Callable[[], list[int]]) -> None:
    """The spike on the storm node: every member frozen, nothing ticks; then every member thawed
    and ticking again, nothing killed, the job as it was."""
    storm = c.nodes[STORM]
    # the spike: a protected local job on the storm node, to ~0.9 of the budget for 6 s
    spiky = storm.json("submit", "--name", "spiky", "--class", "long-resident", "--priority", "90",
                       "--memory", "480M", "--", sys.executable, "-c", SPIKE, "450", "6")
    wait_until(lambda: all(map(frozen, cgroups.values())), 30, "every member's cgroup frozen")
    # nothing ticks while they are frozen
    held = counts()
    time.sleep(0.5)
    assert counts() == held
    locals_ = member_jobs(c, job)
    assert all(j["state"] == "suspended" for j in locals_.values()), locals_
    acts = [e for e in storm.json("events", "--kind", "airlock", "--limit", "200") if "action" in e]
    assert [a["job"] for a in acts if a["action"] == "suspend"] == [job], acts  # the member, nothing else
    # the spike passes: Airlock recovers its member, the origin thaws the others
    wait_until(lambda: not any(map(frozen, cgroups.values())), 40, "every member thawed")
    wait_until(lambda: all(a > b for a, b in zip(counts(), held, strict=True)), 10, "every member ticking again")
    wait_until(lambda: all(j["state"] == "running" for j in member_jobs(c, job).values()), 10,
               "every member running")
    assert not [a for a in storm.json("events", "--kind", "airlock", "--limit", "200")
                if a.get("action") == "kill"], "Airlock killed something"
    assert storm.json("job", "show", spiky["id"])["state"] == "running"
    v = c.multinode_view(0, job)
    assert v["generation"] == 0 and v["restarts"] == 0, v
