"""Storage keepers and the retrying keeper between real agents: node A is reclaimed while no
peer has room for its job (each peer's only GPU is taken by a job of its own). The job's final
checkpoint still leaves A: it goes to a peer with the disk space (the keeper), which keeps the
job, finds no room, and keeps looking (backoff, state kept in its store across a restart of
its agent). Then the keeper is reclaimed itself: it passes the checkpoint and the keeper on to
another peer (also full). When room frees on a third node, that keeper reserves it through
the zone, sends the checkpoint there and hands the job over; the job resumes from exactly
its final checkpoint and ends with the weights of an uninterrupted run.

Four agents in one zone (tests/cluster/harness.py), one declared (fake) GPU each; the job is
the real PyTorch job examples/train_mnistlike.py on CPU.
"""

from __future__ import annotations

import json
import time

import pytest
from agentproc import remove_cgroup_tree
from conftest import delete_netns
from harness import wait_until
from test_migration import (  # noqa: F401  (fixtures: make_cluster, reference_sha)
    CKPT_EVERY,
    alive,
    assert_continuous,
    fill,
    find_migrated,
    job_log,
    job_state,
    make_cluster,
    migrate_config,
    reference_sha,
    steps_of,
    submit,
    train_cmd,
    verified_steps,
)

pytestmark = pytest.mark.cluster


def replica(nd, key: str) -> dict | None:  # type: ignore[no-untyped-def]
    return next((r for r in nd.json("replicas") if r["key"] == key), None)


def test_no_room_anywhere_the_checkpoint_is_held_and_the_job_resumes_when_room_frees(make_cluster, reference_sha):  # noqa: F811
    c = make_cluster(zones=1, per_zone=4, gpus=1,
                     zone_extra=migrate_config(retry_base_s=0.5, retry_max_s=2.0, keeper_reserve_mb=0))
    a, peers = c.nodes[0], c.nodes[1:]
    # every peer's only GPU is taken by a job of its own: no peer can run A's job
    fillers = fill(c, peers)
    # the peers' full GPUs reach A (a stale summary is refused at the probe): a summary of each
    # sent a round (0.3 s) after its filler ran, instead of a fixed wait for a few rounds
    filled = time.monotonic()

    def summaries_after_fill() -> bool:
        since = time.monotonic() - filled - 0.3  # a summary younger than this left after the fill
        ages = [p["summary_age_s"] for p in a.json("zone", "peers") if not p["self"]]
        return len(ages) == len(peers) and all(x is not None and x < since for x in ages)

    wait_until(summaries_after_fill, 30, "A to hear every peer's summary after its GPU was taken")
    jid = submit(a, "--name", "train", "--", *train_cmd(0.1, after_resume=0))
    key = f"n{a.node_id}-{jid}"
    # with no room anywhere, the prestaged replicas go to a peer that only stores them
    wait_until(lambda: any(verified_steps(nd, key) for nd in peers), 60, "a prestaged replica on a storage-only keeper")

    # A short notice: the final checkpoint is asked for late in the window (its planned cost, 2 s,
    # before notice_margin of it) and a small one crosses at once: a longer window is only waited out
    window_end = json.loads(a.ctl("-o", "json", "reclaim", "--notice", "5s", "--reason", "owner needs it").stdout
                            )["reclaim"]["deadline"]
    wait_until(lambda: a.json("migrations") and a.json("migrations")[0]["phase"] in ("held", "failed"), 60,
               "the final checkpoint to leave A")
    move = a.json("migrations")[0]
    assert move["phase"] == "held", move
    assert any("no destination fits" in " ".join(r["reasons"]) or "needs 1 GPUs" in " ".join(r["reasons"])
               for r in move["ranked"] if not r.get("keeper")), move["ranked"]
    held = int(move["ckpt"].removeprefix("ckpt-"))
    h = c.nodes[move["dest"] - 1]
    assert held in verified_steps(h, key)  # the final checkpoint itself, verified on the keeper
    assert job_state(a, jid)["state"] == "reclaimed"
    on_a = job_log(a, jid)
    asked = [e["step"] for e in on_a if e["event"] == "checkpoint" and e["requested"]]
    logged = [e["step"] for e in on_a if e["event"] == "checkpoint"]
    # the one the reclaim asked for (frozen right after committing it, the job may not have logged it)
    assert (asked and asked[0] <= held) or (not asked and held > max(logged, default=-1)), (asked, logged, held)
    assert len([s for s in steps_of(on_a) if s > held]) <= CKPT_EVERY  # lost: only the steps after it

    # the keeper keeps the job, finds no room and keeps looking
    wait_until(lambda: (r := replica(h, key)) is not None and r["state"] == "waiting" and (r["attempts"] or 0) >= 2,
               30, "the keeper to look for room more than once")
    assert find_migrated(c, key) is None
    # A leaves for good: its agent, its jobs, its namespace
    wait_until(lambda: time.time() > window_end + 0.5, 30, "A's window to end")
    a.agent.kill9()
    remove_cgroup_tree(a.agent.cgroup_root)
    delete_netns(a.netns)

    # the keeper's agent restarts: the keeper and its retries survive in its store
    before = replica(h, key)
    assert before is not None
    h.agent.kill9()
    h.agent.start()
    r = wait_until(lambda: (r := replica(h, key)) is not None and r["state"] == "waiting"
                   and r["attempts"] > before["attempts"] and r, 60, "the keeper to look again after its restart")
    assert isinstance(r, dict)
    assert "here:" in r["last_error"] and "elsewhere:" in r["last_error"], r
    assert find_migrated(c, key) is None

    # the keeper is reclaimed in turn: the checkpoint and the keeper go on to another full peer
    h.ctl("reclaim", "--notice", "6s", "--reason", "the keeper's owner needs it too")
    passed = wait_until(lambda: [e for e in h.json("events", "--kind", "migrate") if e.get("phase") == "passed"], 30,
                        "the keeper to pass the keeper on")
    assert passed[0]["key"] == key and passed[0]["ckpt"] == move["ckpt"], passed
    x = c.nodes[passed[0]["node"] - 1]
    assert x is not h and x is not a
    assert held in verified_steps(x, key)
    wait_until(lambda: (r := replica(x, key)) is not None and r["state"] == "waiting", 30, "the new keeper to wait for room")
    assert replica(h, key)["state"] == "passed"  # type: ignore[index]
    y = next(nd for nd in peers if nd is not h and nd is not x)  # where room will free

    # room frees on another node: the keeper places the job there from the held checkpoint
    y.ctl("job", "stop", fillers[y.node_id])
    found = wait_until(lambda: find_migrated(c, key), 60, "the job to resume where room freed", every=0.3)
    nd, job = found
    assert nd is y, (nd.node_id, y.node_id)
    wait_until(lambda: job_state(y, job["id"])["state"] == "exited", 120, "the resumed job to finish")
    assert job_state(y, job["id"])["exit_code"] == 0
    on_y = job_log(y, job["id"])
    assert_continuous(on_y, held)  # from the final checkpoint, every later step once
    assert [e for e in on_y if e["event"] == "done"][0]["weights_sha256"] == reference_sha
    assert held in verified_steps(y, key)  # what it restored was verified there
    placed = [e for e in x.json("events", "--kind", "migrate") if e.get("phase") == "placed"]
    assert placed and placed[0]["node"] == y.node_id and placed[0]["key"] == key, placed
    assert replica(x, key)["state"] == "placed"  # type: ignore[index]
    # exactly one copy ran on the survivors
    copies = [j for n in c.nodes[1:] if alive(n) for j in n.json("jobs")
              if (j.get("origin") or {}).get("migrated_from") == key]
    assert len(copies) == 1, copies
