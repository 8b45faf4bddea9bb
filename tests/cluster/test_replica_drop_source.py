"""An operator's forced drop of a guard (``laminarctl replicas drop KEY --force`` on the buddy)
is told to the job's source, which forgets that buddy and prestages the job to another peer at
once; a source that cannot be reached is not told, the drop stands and the answer says so.

Three real agents in one zone (tests/cluster/harness.py), each in its own network namespace.
The job on node A is a real process that writes one jobkit checkpoint and then runs on without
writing another, so nothing but the drop's message can make A prestage it again (before the
fix A went on believing the dropped buddy guarded the job: no node held a copy of it). The
unreachable source is made with a blackhole route to A in the buddy's namespace.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from agentproc import VENV_BIN
from harness import Node, wait_until
from test_migration import make_cluster, migrate_config, submit, verified_steps  # noqa: F401  (fixture)

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


def guard_of(nodes: list[Node], key: str) -> Node | None:
    """The node whose replica of ``key`` is guarding with checkpoint 7 held, verified."""
    for nd in nodes:
        r = replica(nd, key)
        if r is not None and r["state"] == "guarding" and 7 in verified_steps(nd, key):
            return nd
    return None


def buddies(nd: Node) -> dict[str, int]:
    return dict(nd.json("status")["migrate"]["buddies"])


def test_a_forced_drop_of_a_guard_makes_the_source_prestage_to_another_buddy(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=3, gpus=0, zone_extra=migrate_config())
    a = c.nodes[0]
    jid = submit(a, "--name", "one-ckpt", "--", str(VENV_BIN / "python"), "-c", JOB, gpus=0)
    key = f"n{a.node_id}-{jid}"
    first = wait_until(lambda: guard_of(c.nodes[1:], key), 60, "the job's checkpoint to be prestaged to a buddy")
    assert isinstance(first, Node)
    wait_until(lambda: buddies(a).get(jid) == first.node_id, 30, "A to record its buddy")
    other = next(nd for nd in c.nodes[1:] if nd is not first)
    assert replica(other, key) is None

    r = first.ctl("-o", "json", "replicas", "drop", key, "--force")
    res = json.loads(r.stdout)
    assert res["forced"] and res["dropped"] == ["ckpt-7"] and res["src_node"] == a.node_id, res
    assert res["source_told"] is True and "another buddy" in res["source_says"], res
    assert replica(first, key) is None and verified_steps(first, key) == []

    # A forgets that buddy and prestages the job's checkpoint to the other peer, which guards it
    second = wait_until(lambda: guard_of([other], key), 60, "the job to be prestaged to another buddy")
    assert second is other
    wait_until(lambda: buddies(a).get(jid) == other.node_id, 30, "A to record its new buddy")
    ev = [e for e in a.json("events", "--kind", "migrate") if e.get("phase") == "guard-dropped"]
    assert [(e["key"], e["node"]) for e in ev] == [(key, first.node_id)], ev
    assert replica(first, key) is None  # the node whose operator dropped it is not chosen again

    # the source cannot be reached from the new buddy: the drop still happens, and says so
    other.netns.run("ip", "route", "add", "blackhole", f"{a.addr}/32")
    r = other.ctl("replicas", "drop", key, "--force")
    err = " ".join(r.stderr.split())
    assert f"dropped {key} (guarding): ckpt-7" in r.stdout and "was not told" in err, (r.stdout, r.stderr)
    assert replica(other, key) is None and verified_steps(other, key) == []
    untold = [e for e in other.json("events", "--kind", "migrate") if e.get("phase") == "replica-drop-untold"]
    assert [e["key"] for e in untold] == [key], untold
    assert buddies(a).get(jid) == other.node_id  # A was not told: it still counts on that buddy
