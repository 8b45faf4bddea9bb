"""Self-fencing (``migrate.fence_after_s``): a node cut off from its whole zone freezes the jobs the
zone would resume elsewhere, before the zone does, so a job never runs twice at once.

Without it (tests/cluster/test_partition_heal_superseded.py) the job's node runs its copy on
through the partition, beside the copy its keeper resumed, until the heal. With it, the cut-off
node hears no member for ``fence_after_s`` (less than ``orphan_after_s``) and freezes the job;
the keeper resumes it; once healed, the node asks the keeper (control op ``taken``) and stops its
frozen copy without running another step. A partition that ends before ``orphan_after_s``
thaws the job: nobody took it over.

Three real agents in one zone (tests/cluster/harness.py), one declared (fake) GPU each; the job
is a real process that writes one jobkit checkpoint and then appends its pid to a file every
50 ms (its steps). The partition is blackhole routes between the job's node and the two others,
both ways (it hears nobody; they hear each other), removed to heal it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from agentproc import VENV_BIN
from harness import Node, wait_until
from test_migration import (  # noqa: F401  (fixture)
    fill,
    find_migrated,
    job_state,
    make_cluster,
    migrate_config,
    submit,
    verified_steps,
)
from test_replica_keeper_change import replica

pytestmark = pytest.mark.cluster

STEPS = """
import os, sys, time
from laminar.jobkit import Checkpointer
Checkpointer(install_signal=False).save(b"weights-7", step=7)
while True:
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.05)
"""


def steps_by(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text().split() if path.exists() else []:
        out[line] = out.get(line, 0) + 1
    return out


def phases(nd: Node, phase: str) -> list[dict[str, object]]:
    return [e for e in nd.json("events", "--kind", "migrate") if e.get("phase") == phase]


def cut(a: Node, others: list[Node]) -> None:
    """Both ways: a blackhole route stops only what its namespace sends."""
    for o in others:
        a.netns.run("ip", "route", "add", "blackhole", f"{o.addr}/32")
        o.netns.run("ip", "route", "add", "blackhole", f"{a.addr}/32")


def heal(a: Node, others: list[Node]) -> None:
    for o in others:
        a.netns.run("ip", "route", "del", "blackhole", f"{o.addr}/32", check=False)
        o.netns.run("ip", "route", "del", "blackhole", f"{a.addr}/32", check=False)


def kept(make: Any, path: Path, orphan_after_s: float) -> tuple[Any, Node, list[Node], str, str, Node, str]:
    """Three agents with fencing; node A's job stepping, its checkpoint kept by a peer.
    Returns (cluster, A, the other two, job id, key, keeper, the job's pid)."""
    c = make(zones=1, per_zone=3, gpus=1, zone_extra=migrate_config(
        orphan_after_s=orphan_after_s, fence_after_s=1.5, retry_base_s=0.3, retry_max_s=0.6))
    a, *others = c.nodes
    jid = submit(a, "--name", "fenced", "--", str(VENV_BIN / "python"), "-c", STEPS, str(path))
    key = f"n{a.node_id}-{jid}"
    keeper = wait_until(lambda: next((nd for nd in c.nodes if nd is not a and (r := replica(nd, key)) is not None
                                     and r["state"] == "keeping" and 7 in verified_steps(nd, key)), None),
                       60, "a peer to hold and keeper the job's checkpoint")
    wait_until(lambda: steps_by(path), 30, "the job to step")
    return c, a, others, jid, key, keeper, str(job_state(a, jid)["pid"])


def test_a_node_cut_off_freezes_its_job_before_the_zone_resumes_it_and_stops_it_when_healed(
        make_cluster, tmp_path: Path) -> None:  # noqa: F811
    steps = tmp_path / "steps"
    c, a, others, jid, key, keeper, pid_a = kept(make_cluster, steps, orphan_after_s=4)

    cut(a, others)
    try:
        wait_until(lambda: phases(a, "fenced"), 30, "A to fence its job")
        assert [e["jobs"] for e in phases(a, "fenced")] == [[jid]]
        assert list(a.json("status")["migrate"]["fenced"]) == [jid]
        _, resumed = wait_until(lambda: find_migrated(c, key), 30, "the keeper to resume the job")
        assert find_migrated(c, key)[0] is keeper  # type: ignore[index]
        wait_until(lambda: job_state(keeper, resumed["id"])["state"] == "running", 30, "the resumed copy to run")
        frozen_at = steps_by(steps).get(pid_a, 0)
        wait_until(lambda: steps_by(steps).get(str(job_state(keeper, resumed["id"])["pid"]), 0) >= 20, 30,
                   "the resumed copy to step")
        # A's copy took no step while the resumed one ran: one copy at a time
        assert steps_by(steps).get(pid_a, 0) == frozen_at
        shown = job_state(a, jid)  # frozen, not stopped: A cannot know yet
        assert shown["state"] == "suspended" and shown["reason"].startswith("fenced: "), shown
    finally:
        heal(a, others)

    wait_until(lambda: job_state(a, jid)["state"] == "migrated", 30, "A to stop its fenced copy once healed")
    assert f"node {keeper.node_id}" in job_state(a, jid)["reason"]
    assert steps_by(steps).get(pid_a, 0) == frozen_at, "A's copy stepped again after the heal"
    assert job_state(keeper, resumed["id"])["state"] == "running"
    assert phases(a, "unfenced") == []
    wait_until(lambda: a.json("status")["migrate"]["fenced"] == {}, 10, "A's status to show nothing fenced")
    assert [e["job"] for e in phases(a, "superseded")] == [jid]


def test_a_partition_shorter_than_orphan_after_s_thaws_the_fenced_job(make_cluster, tmp_path: Path) -> None:  # noqa: F811
    steps = tmp_path / "steps"
    c, a, others, jid, key, keeper, pid_a = kept(make_cluster, steps, orphan_after_s=30)

    cut(a, others)
    try:
        wait_until(lambda: phases(a, "fenced"), 30, "A to fence its job")
        held = steps_by(steps).get(pid_a, 0)
        time.sleep(1.0)  # (no assertion on a timing: only that a frozen job takes no step)
        assert steps_by(steps).get(pid_a, 0) == held
    finally:
        heal(a, others)

    wait_until(lambda: phases(a, "unfenced"), 30, "A to thaw its job once it hears its zone")
    wait_until(lambda: steps_by(steps).get(pid_a, 0) > held + 5, 30, "the thawed job to step again")
    assert job_state(a, jid)["state"] == "running"
    assert job_state(a, jid)["reason"].startswith("unfenced: ")
    assert find_migrated(c, key) is None  # nobody took it over
    assert replica(keeper, key)["state"] == "keeping"  # type: ignore[index]
    ev = phases(a, "unfenced")
    assert [(e["job"], e["airlock_held"]) for e in ev] == [(jid, False)], ev


def test_an_agent_restarted_while_fenced_keeps_the_job_frozen_and_settles_it_once_healed(
        make_cluster, tmp_path: Path) -> None:  # noqa: F811
    """The agent of the cut-off node is killed (SIGKILL) and started again while the node is
    still cut off: the job stays frozen (the fence is kept in the store, and a restarted agent
    has heard nobody yet, so it settles nothing), and once healed it is settled as before:
    nobody took it over, so it is thawed."""
    steps = tmp_path / "steps"
    c, a, others, jid, key, keeper, pid_a = kept(make_cluster, steps, orphan_after_s=30)
    cut(a, others)
    try:
        wait_until(lambda: phases(a, "fenced"), 30, "A to fence its job")
        a.agent.kill9()
        a.agent.start()
        assert job_state(a, jid)["state"] == "suspended"  # reattached, still frozen
        assert list(a.json("status")["migrate"]["fenced"]) == [jid]
        held = steps_by(steps).get(pid_a, 0)
        time.sleep(1.0)  # (no assertion on a timing: only that a frozen job takes no step)
        assert steps_by(steps).get(pid_a, 0) == held
        assert phases(a, "unfenced") == []
    finally:
        heal(a, others)
    wait_until(lambda: phases(a, "unfenced"), 30, "A to thaw its job once it hears its zone")
    wait_until(lambda: steps_by(steps).get(pid_a, 0) > held + 5, 30, "the thawed job to step again")
    assert find_migrated(c, key) is None
    assert job_state(a, jid)["state"] == "running"  # (not left "suspended" as reattached)
    # the restarted Airlock did not take the frozen job for one it suspended: the fence thawed it
    assert [e["airlock_held"] for e in phases(a, "unfenced")] == [False]
    assert a.json("status")["migrate"]["fenced"] == {}


def test_a_keeper_cut_off_when_the_reclaim_is_withdrawn_does_not_resume_the_job_at_the_old_windows_end(
        make_cluster, tmp_path: Path) -> None:  # noqa: F811
    """A's reclaim is announced, and its keeper B hears the notice; B is then cut off, and the
    owner withdraws the reclaim, which B misses. At the old window's end B has room (its own
    job stopped meanwhile) and a keeper whose source's window ended. Before, B resumed the job
    there and then, beside the copy that ran on at A (the soak, seed 29). Now the end declares
    nothing while B hears no other member after it; healed, B learns of the withdrawal (asks A,
    or hears it told again) and keeps on: the job ran once, on A, all along."""
    steps = tmp_path / "steps"
    c, a, others, jid, key, keeper, pid_a = kept(make_cluster, steps, orphan_after_s=30)
    third = next(nd for nd in others if nd is not keeper)
    fillers = fill(c, [keeper, third])  # no room for a move: the job stays on A through the window
    a.json("reclaim", "--notice", "8s", "--reason", "lm-t owner")
    notices = wait_until(lambda: keeper.json("reclaim", "status")["notices"].get(str(a.node_id)), 10,
                         "B to hear A's notice")
    end = float(notices["window_end"])

    cut(keeper, [a, third])
    try:
        out = a.json("reclaim", "cancel", "--reason", "lm-t plans changed")
        assert out["in_window"] and keeper.node_id in out["peers_missed"], out
        keeper.ctl("job", "stop", fillers[keeper.node_id])  # room on B for a take-over at the old end
        wait_until(lambda: job_state(keeper, fillers[keeper.node_id])["state"] not in ("running", "suspended"), 30,
                   "B's own job to stop")
        while time.time() < end + 4.0:  # past the old window's end, B still cut off
            time.sleep(0.2)
        assert find_migrated(c, key) is None, "B resumed the job while cut off, beside A's copy"
        assert set(steps_by(steps)) == {pid_a}
    finally:
        heal(keeper, [a, third])

    wait_until(lambda: str(a.node_id) not in keeper.json("reclaim", "status")["notices"], 30,
               "B to learn, once healed, that A's reclaim was withdrawn")
    time.sleep(2.0)  # ten keeper rounds (poll_s 0.2): the forgotten window brings no take-over
    assert find_migrated(c, key) is None
    assert job_state(a, jid)["state"] == "running"
    assert set(steps_by(steps)) == {pid_a}, "another copy of the job stepped"
