"""A keeper whose source is alive in the zone but does not answer ``needs`` (a one-way partition)
is kept and shown: ``laminarctl replicas`` marks it unconfirmed with how long since the source
last spoke, one ``keeper-unconfirmed`` event is recorded however many questions go unanswered,
and once the source answers again the keeper is confirmed.

Two real agents in one zone (tests/cluster/harness.py), each in its own network namespace. The
job on node A is a real process that writes one jobkit checkpoint (prestaged to B, which
keeps it) and runs on. The one-way partition is a blackhole route to A in B's namespace: A's
datagrams still reach B (A is alive there, not a suspect) but B cannot open a connection to A's
transfer endpoint. B checks keepers unchanged for 1 s (``replica_keeper_check_s``) at each of its
replica GC rounds: one when its agent starts, then every ``replica_gc_s`` (2 s here; 30 s by
default). B's agent is restarted (as an operator's ``systemctl restart``) to ask its first
question at once, and again to ask the last one; the second question is the running agent's own
next round. The count of questions unanswered and the one event are B's store's, so they hold
across its restarts too.
"""

from __future__ import annotations

import pytest
from agentproc import VENV_BIN
from harness import Node, wait_until
from test_migration import make_cluster, migrate_config, submit, verified_steps  # noqa: F401  (fixture)
from test_replica_keeper_change import JOB, replica

pytestmark = pytest.mark.cluster


def restart(nd: Node) -> None:
    """Stops ``nd``'s agent (SIGTERM) and starts it again, until it answers."""
    nd.agent.stop()
    nd.agent.start(wait=True, timeout=90)


def test_a_keeper_whose_source_does_not_answer_is_kept_and_shown_unconfirmed(make_cluster):  # noqa: F811
    c = make_cluster(zones=1, per_zone=2, gpus=0, zone_extra=migrate_config(replica_keeper_check_s=1, replica_gc_s=2))
    a, b = c.nodes
    jid = submit(a, "--name", "one-ckpt", "--", str(VENV_BIN / "python"), "-c", JOB, gpus=0)
    key = f"n{a.node_id}-{jid}"
    wait_until(lambda: (r := replica(b, key)) is not None and r["state"] == "keeping" and 7 in verified_steps(b, key),
               60, "B to keep the job")
    # nothing unanswered (the source's keeper message is what B last heard): confirmed, the keeper stays
    r = wait_until(lambda: (r := replica(b, key)) is not None and r["needs_unanswered"] == 0 and r, 75,
                   "B to show the keeper confirmed")
    assert r["unconfirmed"] is False and r["state"] == "keeping"

    # B asks only about a keeper unchanged for replica_keeper_check_s: its round at the restart must see one
    wait_until(lambda: (r := replica(b, key)) is not None and (r["source_silent_s"] or 0) >= 1.5, 30,
               "B's keeper to be unchanged for longer than replica_keeper_check_s")
    b.netns.run("ip", "route", "add", "blackhole", f"{a.addr}/32")
    restart(b)  # B asks at once
    r = wait_until(lambda: (r := replica(b, key)) is not None and r["unconfirmed"] and r, 75,
                   "the keeper to be shown unconfirmed")
    assert r["state"] == "keeping" and r["needs_unanswered"] >= 1 and r["needs_error"], r
    assert r["source_silent_s"] is not None and r["source_silent_s"] > 0 and "UNCONFIRMED" in r["gc_why"], r
    assert next(p for p in b.json("zone", "peers") if p["node"] == a.node_id)["alive"]  # A is alive for B
    table = b.ctl("replicas").stdout
    assert "(unconfirmed)" in " ".join(table.split()), table
    # asked again at B's next round, still no answer: still kept, and still one event
    r = wait_until(lambda: (r := replica(b, key)) is not None and r["needs_unanswered"] >= 2 and r, 75,
                   "B to ask A a second time")
    assert r["unconfirmed"] and r["state"] == "keeping" and 7 in verified_steps(b, key)
    ev = [e for e in b.json("events", "--kind", "migrate") if e.get("phase") == "keeper-unconfirmed"]
    assert [(e["key"], e["src_node"]) for e in ev] == [(key, a.node_id)], ev
    assert b.json("replicas", "--totals")["totals"]["unconfirmed"] == 1

    # the partition heals: the next question is answered, the keeper is confirmed again
    b.netns.run("ip", "route", "del", "blackhole", f"{a.addr}/32")
    restart(b)  # B asks at once
    r = wait_until(lambda: (r := replica(b, key)) is not None and not r["unconfirmed"] and r, 75,
                   "the keeper to be confirmed again")
    assert r["needs_unanswered"] == 0 and r["state"] == "keeping" and 7 in verified_steps(b, key)
    assert [e["key"] for e in b.json("events", "--kind", "migrate") if e.get("phase") == "keeper-confirmed"] == [key]
