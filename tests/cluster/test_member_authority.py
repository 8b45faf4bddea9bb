"""A compromised zone member can harm its own jobs and no others' (docs/protocol.md, *Authority*).

Four real agents in one zone (tests/cluster/harness.py), each in its own network namespace, with
node keys (``node_keys = "require"``, every node keyed) and ``[zone] root_from = [1, 2, 4]``:
node 3 is the compromised member. Its agent is stopped and a script (tests/cluster/rogue_member.py)
takes its place in its namespace with its real zone key, node key, address and ports, and the
agents' own wire, transport and transfer code: it speaks as node 3, as root on node 3 can.

Node 1 runs a job of another user (``agentproc.NOBODY``: jobkit checkpoints, prestaged to its
keeper B, node 2 or 4). Node 3 then sends each forged-authority message to the real agents:

- hand-overs to node 1 with ``owner_uid`` absent, 0, -1 and 4294967295, as uid 65534 with gid 0,
  and as uid 65534 at a class and priority node 1's ``[grants]`` do not give it;
- a checkpoint under node 1's job key to B, a ``keeper`` overwriting B's keeper of it (naming that
  checkpoint), a ``release`` of it;
- a ``keeper`` with ``take_over`` of a root job under a key of node 1's that C (the other node)
  does not keeper, and one under a key of node 3's own (it owns that key: the take-over's uid
  policy refuses it);
- a hand-over under node 2's placement id (seen in node 2's probe of node 3) to node 1;
- a ``reclaim`` of node 1 (a 0.5 s notice), a loan ``return`` of node 1 (in the inference pool).

Each is refused with the reason named (and counted in ``authority`` of ``zone stats``), no job
ran with uid or gid 0 (a marker file the jobs would write never appears), node 1's jobs and B's
replica are unchanged. The legitimate flows still work beside them: node 2's placement (the
one node 3 tried to hijack), a reclaim of C forwarded from node 1 (``migrate.reclaim_from =
[1]``) moving C's root job while node 3's ``reclaim-cancel`` of it is refused, and, once node 1
is gone, B's take-over of node 1's job from the real checkpoint, as its real owner.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from agentproc import NOBODY, REPO, VENV_BIN, jobkit_base
from harness import Cluster, Node, wait_until
from liveness import RootLiveness
from test_migration import gone, job_log, job_state, migrate_config

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent

# the victim's job (jobkit: a checkpoint at start, one more each time it is asked; says from
# which step it resumed)
JOB = """
import json, os, sys, time
sys.path.insert(0, os.environ.get("LMT_LIB", REPO_AGENT))
from laminar.jobkit import Checkpointer
ck = Checkpointer()
ck.resume()
step = ck.resumed_step or 0
print(json.dumps({"event": "start", "resumed": ck.resumed_step, "uid": os.getuid()}), flush=True)
if step == 0:
    step = 7
    ck.save(b"weights-%d" % step, step=step)
while True:
    if ck.requested():
        step += 1
        ck.save(b"weights-%d" % step, step=step)
    time.sleep(0.05)
""".replace("REPO_AGENT", repr(str(REPO / "agent")))

# what node 3's jobs run: it says who it runs as, and leaves a marker when that is root's uid or gid
EVIL = 'id -u; id -g; if [ "$(id -u)" = 0 ] || [ "$(id -g)" = 0 ]; then touch {}; fi; sleep 120'


def evil(markers: Path, name: str, **spec: Any) -> dict[str, Any]:
    return {"name": name, "command": ["/bin/sh", "-c", EVIL.format(markers / name)], **spec}


def stats(nd: Node) -> dict[str, int]:
    return dict(nd.json("zone", "stats")["authority"]["refused"])


def rogue(nd: Node, plan: list[dict[str, Any]]) -> subprocess.Popen[str]:
    """Node ``nd``'s identity, from its namespace, running ``plan`` (rogue_member.py)."""
    return nd.netns.popen(str(VENV_BIN / "python"), str(HERE / "rogue_member.py"), str(nd.agent.config_path),
                          json.dumps(plan), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def lines(p: subprocess.Popen[str], n: int, timeout: float = 120.0) -> list[dict[str, Any]]:
    """The next ``n`` JSON lines the rogue prints (the first: ready)."""
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    assert p.stdout is not None
    while len(out) < n:
        if time.monotonic() > deadline or p.poll() is not None and not p.stdout.readable():
            raise AssertionError(f"the rogue printed {out}, then stopped: {p.stderr.read() if p.stderr else ''}")
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"the rogue ended after {out}: {p.stderr.read() if p.stderr else ''}")
        out.append(json.loads(line))
    return out


def test_a_compromised_member_speaks_only_for_what_it_owns() -> None:
    extra = "peer_timeout_s = 2.0\n" + migrate_config(orphan_after_s=4, reclaim_from="[1]")
    with jobkit_base("lm-t-auth-") as base, \
            Cluster.create(base, zones=1, per_zone=4, gpus=1, node_keys=True, root_from=[1, 2, 4],
                           pools={0: "inference"}, probe_timeout_s=1.0, zone_extra=extra) as c:
        markers = base / "markers"
        markers.mkdir()
        os.chmod(markers, 0o777)  # a job of any uid could leave its marker: none may
        attacked(c, markers, base / "lib")


def attacked(c: Cluster, markers: Path, lib: Path) -> None:
    n1, n2, n3, n4 = c.nodes
    n3.agent.stop()  # node 3's ports are the rogue's now
    wait_until(lambda: all((p.get("summary_age_s") or 99) > 2.0 for nd in (n1, n2, n4)
                           for p in nd.json("zone", "peers") if p["node"] == 3), 30, "node 3 to go stale")
    # the victim: a job of another user on node 1, its checkpoint kept by its keeper B
    jid = json.loads(n1.agent.ctl("-o", "json", "submit", "--name", "theirs", "--env", f"LMT_LIB={lib}", "--",
                            "/usr/bin/python3", "-c", JOB, user=NOBODY).stdout)["id"]
    key = f"n1-{jid}"
    b_id = wait_until(lambda: n1.json("status")["migrate"]["keepers"].get(jid), 60, "the job's keeper")
    b = c.nodes[int(b_id) - 1]
    cn = n4 if b is n2 else n2  # the other legitimate node
    kept = wait_until(lambda: next((r for r in b.json("replicas") if r["key"] == key and r["state"] == "keeping"),
                                      None), 60, "the keeper to keep the job's checkpoint")
    root_job = json.loads(n1.ctl("-o", "json", "submit", "--name", "roots", "--", "sleep", "600").stdout)["id"]
    n1_jobs = {j["id"] for j in n1.json("jobs")}

    req = {"spec": {"command": ["true"]}}  # a keeper's request naming node 1's job
    plan: list[dict[str, Any]] = [
        {"do": "handover", "to": 1, "req": {"spec": evil(markers, "no-owner")}},
        {"do": "handover", "to": 1, "req": {"spec": evil(markers, "uid-0"), "owner_uid": 0, "owner_gid": 0}},
        {"do": "handover", "to": 1, "req": {"spec": evil(markers, "uid-minus-1"), "owner_uid": -1, "owner_gid": -1}},
        {"do": "handover", "to": 1, "req": {"spec": evil(markers, "uid-max"), "owner_uid": 4294967295,
                                            "owner_gid": 4294967295}},
        {"do": "handover", "to": 1, "req": {"spec": evil(markers, "gid-0"), "owner_uid": NOBODY, "owner_gid": 0}},
        {"do": "handover", "to": 1, "req": {"spec": evil(markers, "grants", **{"class": "long-resident"}, priority=90),
                                            "owner_uid": NOBODY, "owner_gid": NOBODY}},
        {"do": "ckpt", "to": b.node_id, "key": key, "step": 999999},
        {"do": "ctl", "to": b.node_id, "op": "keeper",
         "body": {"key": key, "src_node": 1, "src_job": jid, "ckpt": kept["ckpt"],
                  "request": {**req, "owner_uid": 0, "owner_gid": 0, "spec": evil(markers, "overwrite")}}},
        {"do": "ctl", "to": b.node_id, "op": "release", "body": {"key": key}},
        {"do": "ckpt", "to": cn.node_id, "key": "n1-lmt-evil", "step": 1},
        {"do": "ctl", "to": cn.node_id, "op": "keeper",
         "body": {"key": "n1-lmt-evil", "src_node": 1, "src_job": "lmt-evil", "ckpt": "ckpt-1",
                  "request": {"spec": evil(markers, "take-over"), "owner_uid": 0, "owner_gid": 0, "take_over": True}}},
        {"do": "ckpt", "to": cn.node_id, "key": "n3-lmt-own", "step": 1},
        {"do": "ctl", "to": cn.node_id, "op": "keeper",
         "body": {"key": "n3-lmt-own", "src_node": 3, "src_job": "lmt-own", "ckpt": "ckpt-1",
                  "request": {"spec": evil(markers, "own-key"), "owner_uid": 0, "owner_gid": 0, "take_over": True}}},
        {"do": "hijack", "victim": 2, "to": 1, "wait_s": 60,
         "req": {"spec": evil(markers, "hijack", env={"MARK": "evil"}), "owner_uid": NOBODY, "owner_gid": NOBODY}},
        {"do": "ctl", "to": 1, "op": "reclaim", "body": {"notice_s": 0.5, "reason": "rogue", "ts": time.time()}},
        {"do": "loan", "to": 1, "op": 2},
    ]
    with RootLiveness(n1.agent.sock, root_job) as live:
        p = rogue(n3, plan)
        try:
            got = lines(p, len(plan) - 2)  # ready, and every action before the hijack
            # node 2 places a job with every member probed (node 3 too): node 3 hands its own spec
            # over to node 1 under that placement's id
            placed = c.place(1, {"name": "victim", "command": ["sleep", "600"]}, gpus=1, packing=True)
            got += lines(p, 3)
            p.wait(30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    live.check(bound_s=2.0)
    res = {f"{i}:{a['do']}:{a.get('op', '')}": r for i, (a, r) in enumerate(zip(plan, got[1:], strict=True))}
    print(json.dumps(res, indent=1))  # what each attack got (the notes cite the run before the fix)
    time.sleep(3.0)  # keeper rounds (poll_s 0.2) for a take-over to act, were it accepted
    r = list(res.values())
    print(json.dumps({"markers": sorted(os.listdir(markers)),  # (the run before the fix: what ran as root)
                      "jobs": {nd.node_id: [(j["name"], j.get("owner_uid"), j["state"]) for j in nd.json("jobs")]
                               for nd in (n1, n2, n4)},
                      "replicas_at_keeper": [x for x in b.json("replicas") if x["key"] == key]}, indent=1))

    # hand-overs: refused, naming the rule
    for i, why in enumerate(("names no owner_uid", "zone.root_from", "is not a user or group id",
                             "is not a user or group id", "is not a group of uid 65534", "[grants]")):
        assert r[i].get("status") == 2 and why in r[i]["text"], (i, r[i])
    # node 1's job key at its keeper: no checkpoint, no keeper overwrite, no release from node 3
    assert "error" in r[6] and f"keeps {key} for node 1; only node 1 may send" in r[6]["error"], r[6]
    assert "error" in r[7] and "handed this node that keeper" in r[7]["error"], r[7]
    assert "error" in r[8] and "only node 1" in r[8]["error"], r[8]
    # a root job's keeper on a key of node 1's: refused at once; on its own key: taken, never run
    assert "ok" in r[9] and "error" in r[10] and "zone.root_from" in r[10]["error"], (r[9], r[10])
    assert "ok" in r[11] and r[12].get("ok") == {"keeping": "n3-lmt-own"}, (r[11], r[12])
    own = wait_until(lambda: next((x for x in cn.json("replicas") if x["key"] == "n3-lmt-own"
                                   and x["state"] == "failed"), None), 30, "node 3's own-key take-over to be refused")
    assert own["src_node"] == 3
    ev = [e for e in cn.json("events", "--kind", "migrate", "--limit", "500") if e.get("key") == "n3-lmt-own" and e.get("phase") == "failed"]
    assert ev and ev[-1].get("reason") == "root" and "zone.root_from" in ev[-1]["message"], ev
    # the hijack: node 3's hand-over under node 2's placement id is refused; node 2's job is placed
    assert r[13].get("status") == 1 and "is node 2's" in r[13]["text"], r[13]
    assert placed["outcome"] == "placed", placed
    dest = c.nodes[int(placed["node"]) - 1]
    job = job_state(dest, placed["job_id"])
    assert job["name"] == "victim" and "MARK" not in (job["spec"].get("env") or {}), job
    # node operations
    assert "error" in r[14] and "migrate.reclaim_from" in r[14]["error"], r[14]
    assert n1.json("reclaim", "status")["reclaim"] is None
    assert "error" in r[15] and "loan.return_from" in r[15]["error"], r[15]
    assert n1.json("pool")["returned"] is False

    # nothing ran as root's uid or gid, nothing of node 3's runs anywhere
    assert sorted(os.listdir(markers)) == []
    for nd in (n1, n2, n4):
        assert not [j for j in nd.json("jobs") if j["name"] in ("no-owner", "uid-0", "uid-minus-1", "uid-max",
                                                                         "gid-0", "grants", "overwrite", "take-over",
                                                                         "own-key", "hijack")], nd.node_id
    assert {j["id"] for j in n1.json("jobs")} - n1_jobs <= {placed["job_id"]}
    assert job_state(n1, jid)["state"] == "running"
    row = next(x for x in b.json("replicas") if x["key"] == key)
    assert (row["state"], row["src_node"], row["ckpt"], row["owner_uid"]) == ("keeping", 1, kept["ckpt"], NOBODY), row
    assert not (b.agent.state_dir / "xfer" / "checkpoints" / key / "ckpt-999999").exists()
    # every refusal counted by its reason where it was refused
    s1, sb, sc = stats(n1), stats(b), stats(cn)
    assert s1["bad_id"] >= 3 and s1["root"] >= 1 and s1["gid"] >= 1 and s1["grants"] >= 1, s1
    assert s1["reclaim"] >= 1 and s1["loan_return"] >= 1 and s1["placement"] >= 1, s1
    assert sb["offer"] >= 1 and sb["keeper"] >= 1 and sb["release"] >= 1, sb
    assert sc["root"] >= 2, sc

    # a legitimate reclaim, forwarded from node 1 (migrate.reclaim_from = [1]), moves C's root job;
    # node 3's cancel of it is refused
    kid = json.loads(cn.ctl("-o", "json", "submit", "--name", "k", "--", str(VENV_BIN / "python"), "-c", JOB).stdout)["id"]
    wait_until(lambda: any(e.get("event") == "start" for e in job_log(cn, kid)), 30, "C's job to start")
    n1.ctl("reclaim", "--node", str(cn.node_id), "--notice", "60s", "--reason", "lm-t legit")
    assert cn.json("reclaim", "status")["reclaim"] is not None
    p = rogue(n3, [{"do": "ctl", "to": cn.node_id, "op": "reclaim-cancel", "body": {"reason": "rogue", "ts": time.time()}}])
    try:
        cancel = lines(p, 2)[1]
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert "error" in cancel and "migrate.reclaim_from" in cancel["error"], cancel
    assert cn.json("reclaim", "status")["reclaim"] is not None
    move = wait_until(lambda: next((m for m in cn.json("migrations") if m["job"] == kid and m["phase"] in
                                    ("done", "failed", "held")), None), 90, "C's job to move")
    assert move["phase"] == "done", move
    assert job_state(c.nodes[int(move["dest"]) - 1], move["dest_job"])["state"] == "running"
    assert stats(cn)["reclaim"] >= 1

    # node 1 leaves without notice: its keeper takes its job over from the real checkpoint, as its owner
    keeper = c.nodes[int(n1.json("status")["migrate"]["keepers"][jid]) - 1]
    gone(n1)
    ev = wait_until(lambda: next((e for e in keeper.json("events", "--kind", "migrate", "--limit", "500")
                                  if e.get("key") == key and e.get("phase") == "resumed"), None), 90,
                    "the keeper to take node 1's job over")
    st = job_state(keeper, ev["job"])
    assert st["owner_uid"] == NOBODY and st["state"] == "running", st
    start = wait_until(lambda: next((e for e in job_log(keeper, ev["job"]) if e.get("event") == "start"), None), 30,
                       "the resumed job to start")
    assert start == {"event": "start", "resumed": 7, "uid": NOBODY}, start
