"""A job's keeper (the peer that keeps its prestaged checkpoint) changes, and exactly one node
keeps the job afterwards:

- an operator's forced drop of a keeper (``laminarctl replicas drop KEY --force`` on the keeper) is
  told to the job's source, which forgets that keeper and prestages the job to another peer at
  once; a source that cannot be reached is not told, the drop stands and the answer says so.
  Before, the source went on believing the dropped keeper kept the job: no node held a copy.
- when the checkpoints go to a new keeper, the old keeper is released also when it cannot
  be reached at that moment (the release is sent again until it arrives) and also when the
  source restarted in between (the keeper is kept in the source's store). Before, the release
  was sent once, and the keeper map was in memory only (after a restart the source prestaged to
  a freshly chosen node and released nobody): two nodes kept the job, and both would have
  resumed it had the source died.

Three real agents in one zone (tests/cluster/harness.py), each in its own network namespace,
shared by this module's tests; each test has a job of its own on node A and stops it at its
end. The jobs are real processes that write a jobkit checkpoint (step 7) at start and run on;
the release tests' job writes another each time it is asked (SIGUSR1), and runs on across a
restart of A's agent, which adopts it. Cuts are routes: a ``blackhole`` route to A in the
keeper's namespace for the untold drop (the keeper's connections to A fail at once), and an
``unreachable`` route to the old keeper X in A's namespace for the release tests: A's
connections to X fail at once (as when a router answers "no route"), while X's datagrams still
reach A, so X stays alive for A and only the failed prestage makes A try the other peer Y (a
failed node is avoided for a while). Each route goes when its step ends, also when it fails.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from agentproc import VENV_BIN
from harness import Cluster, Node, wait_until
from test_migration import job_state, migrate_config, submit, verified_steps
from test_replica_resume_owner import JOB as CKPT_ON_ASK

pytestmark = pytest.mark.cluster

# The job: one checkpoint (step 7), then it runs on without another.
JOB = """
import time
from laminar.jobkit import Checkpointer
Checkpointer(install_signal=False).save(b"weights-7", step=7)
time.sleep(3600)
"""


def replica(nd: Node, key: str) -> dict[str, Any] | None:
    return next((r for r in nd.json("replicas") if r["key"] == key), None)


def keeper_of(nodes: list[Node], key: str) -> Node | None:
    """The node whose replica of ``key`` is keeping with checkpoint 7 held, verified."""
    for nd in nodes:
        r = replica(nd, key)
        if r is not None and r["state"] == "keeping" and 7 in verified_steps(nd, key):
            return nd
    return None


def keepers(nd: Node) -> dict[str, int]:
    return dict(nd.json("status")["migrate"]["keepers"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster.create(tmp_path_factory.mktemp("keeper"), zones=1, per_zone=3, gpus=0,
                        zone_extra=migrate_config()) as c:
        yield c


@contextmanager
def route(nd: Node, kind: str, to: Node) -> Iterator[None]:
    """A ``kind`` route (blackhole, unreachable) to ``to`` in ``nd``'s namespace for the block."""
    nd.netns.run("ip", "route", "add", kind, f"{to.addr}/32")
    try:
        yield
    finally:
        nd.netns.run("ip", "route", "del", kind, f"{to.addr}/32", check=False)


def test_a_forced_drop_of_a_keeper_makes_the_source_prestage_to_another_keeper(cluster: Cluster) -> None:
    c = cluster
    a = c.nodes[0]
    jid = submit(a, "--name", "one-ckpt", "--", str(VENV_BIN / "python"), "-c", JOB, gpus=0)
    key = f"n{a.node_id}-{jid}"
    first = wait_until(lambda: keeper_of(c.nodes[1:], key), 60, "the job's checkpoint to be prestaged to a keeper")
    assert isinstance(first, Node)
    wait_until(lambda: keepers(a).get(jid) == first.node_id, 30, "A to record its keeper")
    other = next(nd for nd in c.nodes[1:] if nd is not first)
    assert replica(other, key) is None

    r = first.ctl("-o", "json", "replicas", "drop", key, "--force")
    res = json.loads(r.stdout)
    assert res["forced"] and res["dropped"] == ["ckpt-7"] and res["src_node"] == a.node_id, res
    assert res["source_told"] is True and "another keeper" in res["source_says"], res
    assert replica(first, key) is None and verified_steps(first, key) == []

    # A forgets that keeper and prestages the job's checkpoint to the other peer, which keeps it
    second = wait_until(lambda: keeper_of([other], key), 60, "the job to be prestaged to another keeper")
    assert second is other
    wait_until(lambda: keepers(a).get(jid) == other.node_id, 30, "A to record its new keeper")
    ev = [e for e in a.json("events", "--kind", "migrate") if e.get("phase") == "keeper-dropped"]
    assert [(e["key"], e["node"]) for e in ev] == [(key, first.node_id)], ev
    assert replica(first, key) is None  # the node whose operator dropped it is not chosen again

    # the source cannot be reached from the new keeper: the drop still happens, and says so
    with route(other, "blackhole", a):
        r = other.ctl("replicas", "drop", key, "--force")
        err = " ".join(r.stderr.split())
        assert f"dropped {key} (keeping): ckpt-7" in r.stdout and "was not told" in err, (r.stdout, r.stderr)
        assert replica(other, key) is None and verified_steps(other, key) == []
        untold = [e for e in other.json("events", "--kind", "migrate") if e.get("phase") == "replica-drop-untold"]
        assert [e["key"] for e in untold] == [key], untold
        assert keepers(a).get(jid) == other.node_id  # A was not told: it still counts on that keeper
    a.ctl("job", "stop", jid)  # the next test's job is alone on A


def test_a_release_the_old_keeper_missed_is_sent_again_until_it_arrives(cluster: Cluster) -> None:
    c = cluster
    a = c.nodes[0]
    jid = submit(a, "--name", "ckpt-on-ask", "--", "/usr/bin/python3", "-c", CKPT_ON_ASK, gpus=0)
    key = f"n{a.node_id}-{jid}"
    x = wait_until(lambda: keeper_of(c.nodes[1:], key), 60, "the job's checkpoint to be prestaged to a keeper")
    y = next(nd for nd in c.nodes[1:] if nd is not x)
    wait_until(lambda: keepers(a).get(jid) == x.node_id, 30, "A to record its keeper")

    with route(a, "unreachable", x):
        os.kill(int(job_state(a, jid)["pid"]), signal.SIGUSR1)  # the job writes ckpt-8
        wait_until(lambda: (r := replica(y, key)) is not None and r["state"] == "keeping"
                   and 8 in verified_steps(y, key), 60, "the new checkpoint to go to Y, which keeps the job")
        wait_until(lambda: keepers(a).get(jid) == y.node_id, 30, "A to record Y as the job's keeper")
        # the release could not arrive: A keeps it to send again
        wait_until(lambda: {"node": x.node_id, "key": key} in a.json("status")["migrate"]["releases_pending"], 30,
                   "the release to X to fail once")
        assert replica(x, key)["state"] == "keeping"  # type: ignore[index]

    wait_until(lambda: (r := replica(x, key)) is None or (r["state"] == "released" and not verified_steps(x, key)),
               60, "X's keeper to be released once it can be reached")
    assert replica(y, key)["state"] == "keeping" and 8 in verified_steps(y, key)  # type: ignore[index]
    assert keepers(a).get(jid) == y.node_id
    # X releases when the release arrives; A drops it from its list when X's answer comes back
    wait_until(lambda: a.json("status")["migrate"]["releases_pending"] == [], 30, "A to hear X's answer")
    a.ctl("job", "stop", jid)


def test_a_restarted_source_releases_the_keeper_it_had_before_the_restart(cluster: Cluster) -> None:
    c = cluster
    a = c.nodes[0]
    jid = submit(a, "--name", "one-ckpt", "--", "/usr/bin/python3", "-c", CKPT_ON_ASK, gpus=0)
    key = f"n{a.node_id}-{jid}"
    x = wait_until(lambda: keeper_of(c.nodes[1:], key), 60, "the job's checkpoint to be prestaged to a keeper")
    y = next(nd for nd in c.nodes[1:] if nd is not x)
    wait_until(lambda: keepers(a).get(jid) == x.node_id, 30, "A to record its keeper")

    with route(a, "unreachable", x):
        a.agent.kill9()
        a.agent.start(wait=False)
        # the restarted agent's first answer: the prestage to X it starts at once fails only after
        # its attempts (seconds), so the keeper it names here is the one it remembered
        first = a.agent.wait_ready(90)
        assert dict(first["migrate"]["keepers"]).get(jid) == x.node_id, first["migrate"]  # remembered
        assert job_state(a, jid)["state"] == "running"  # adopted
        # the prestage after the restart cannot reach X: the checkpoint goes to Y, and X is released
        wait_until(lambda: (r := replica(y, key)) is not None and r["state"] == "keeping"
                   and 7 in verified_steps(y, key), 60, "the checkpoint to go to Y, which keeps the job")
        wait_until(lambda: keepers(a).get(jid) == y.node_id, 30, "A to record Y as the job's keeper")
    wait_until(lambda: (r := replica(x, key)) is None or (r["state"] == "released" and not verified_steps(x, key)),
               60, "X's keeper to be released")
    assert replica(y, key)["state"] == "keeping"  # type: ignore[index]
    a.ctl("job", "stop", jid)
