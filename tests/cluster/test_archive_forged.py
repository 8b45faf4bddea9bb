"""Shared storage is not trusted, between real agents (issue 31, item 5): the archive
(``migrate.archive_dir``, a directory every agent's namespace sees, as an NFS mount would be
seen) is written by someone who is not one of the zone's agents.

Three agents of zone 1 share the archive; node 1's training job is archived at its reclaim (no
peer has room or disk: node 2's and node 3's only GPU each run a filler) and node 1 leaves. Then:

* an unprivileged local user tries to plant a record: the archive's root (root's, 0755, as
  docs/operations.md requires) refuses it;
* a plain process running as root without the zone's key file (another host's root on the
  export) plants a root-uid record whose command would create a marker file, a record under the
  key of node 3's running filler (a live job), a record in the envelope's shape with a made-up
  MAC, a link in place of node 2's next job's key directory (to a directory outside with a
  checkpoint and a file of its own), a FIFO record and a deep-JSON running record;
* a second real agent, of another zone with a key of its own (a one-node zone sharing the
  path), publishes a genuine record of its own (its running job's periodic record: that agent
  is gone as far as the zone can tell, so it would be claimable).

Over many archive rounds: no marker appears, nothing of those records runs anywhere, node 3's
filler still runs, the link's target is byte- and mode-identical, both agents count the
refusals by reason and root's ``status``/``killswitch`` answer on node 2 within the liveness
bound. Then room frees on node 2: it claims node 1's genuinely archived job and finishes it with
the weights of an uninterrupted run (its periodic copies, which would go through the planted
link, are refused instead), and still nothing planted ran.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from archiverig import snapshot
from conftest import delete_netns, make_veth_pair
from harness import ZoneAgent, wait_until
from liveness import RootLiveness
from test_migrate_archive import archived, finish
from test_migration import (  # noqa: F401  (fixtures: make_cluster, reference_sha)
    fill,
    find_migrated,
    gone,
    job_state,
    make_cluster,
    migrate_config,
    reference_sha,
    submit,
    train_cmd,
)
from userrig import local_user

pytestmark = pytest.mark.cluster

# What a process without the zone's key plants, as root (argv: archive, marker prefix, the live
# job's key, node 2's next key, the link's target). It may use the agents' own code for
# checkpoints: those are no secret.
PLANT = r'''
import json, os, sys
from pathlib import Path
from laminar.jobkit import Checkpointer
arch, marker, live_key, next_key, outside = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5])

def plant(key, rec, name="guard.json"):
    d = arch / key
    d.mkdir(mode=0o700, exist_ok=True)
    ck = Checkpointer(job_id=key, ckpt_dir=d, install_signal=False).save(b"an attacker's state", step=1)
    (rec["body"] if "body" in rec else rec)["ckpt"] = ck.name
    (d / name).write_text(json.dumps(rec))

def root_job(tag):
    return {"spec": {"command": ["/bin/sh", "-c", f"touch {marker}-{tag}"]}, "owner_uid": 0, "owner_gid": 0, "gpus": 0}

plant("pwn", {"src_node": 1, "src_job": "x", "request": root_job("pwn")})
node, job = live_key[1:].split("-", 1)
plant(live_key, {"key": live_key, "src_node": int(node), "src_job": job, "request": root_job("live")})
plant("n1-job-99", {"v": 1, "zmac": "00" * 32, "body": {"kind": "guard", "key": "n1-job-99", "zone": 1, "writer": 1,
      "src_node": 1, "src_job": "job-99", "request": root_job("envelope")}})
os.symlink(outside, arch / next_key)
(arch / "n4-job-1").mkdir(mode=0o700)
os.mkfifo(arch / "n4-job-1" / "guard.json")
(arch / "n4-job-2").mkdir(mode=0o700)
(arch / "n4-job-2" / "running-9.json").write_text("[" * 200000)
'''

REASONS = ("no_envelope", "bad_mac", "unknown_key", "link", "not_regular", "bad_json")


def counts_of(nd: Any) -> dict[str, int]:
    return {k.removeprefix("archive_unverified_"): int(v) for k, v in nd.json("status")["migrate"]["counts"].items()
            if k.startswith("archive_unverified_")}


def rounds_of(nd: Any) -> int:
    return int(nd.json("status")["migrate"]["archive"]["rounds"])


def test_what_someone_without_the_key_plants_in_the_archive_never_runs_and_a_real_archived_job_still_does(
        make_cluster, reference_sha, tmp_path):  # noqa: F811
    arch = Path(f"/tmp/lmt-archive-{secrets.token_hex(4)}")  # under /tmp (1777): an unprivileged user reaches it
    arch.mkdir(mode=0o755)
    marker = tmp_path / "pwned"
    outside = tmp_path / "outside"
    outside.mkdir()
    os.chmod(outside, 0o755)
    (outside / "ckpt-1").mkdir()
    (outside / "ckpt-1" / "state.bin").write_bytes(b"not the agent's")
    (outside / "keep.conf").write_text("an operator's file")
    go = tmp_path / "go"
    created: list[Any] = []
    lone: ZoneAgent | None = None
    try:
        c = make_cluster(zones=1, per_zone=3, gpus=1, zone_extra=migrate_config(
            retry_base_s=0.5, retry_max_s=2.0, keeper_reserve_mb=1 << 29, archive_dir=f'"{arch}"',
            archive_gc_s=1.0, prestage_unannounced=0.0))
        a, b, x = c.nodes
        fillers = fill(c, [b, x])
        live_key = f"n{x.node_id}-{fillers[x.node_id]}"

        # a second real agent, of another zone (a one-node zone: a key of its own), on the same path
        pair = make_veth_pair(created, tag="lone")
        lone = ZoneAgent(tmp_path, pair.ifname_a, pair.a, node="lm-t-lone", extra_toml=(
            f'[gpus]\ndeclared = 1\n\n[zone]\nnode_id = 7\n\n[migrate]\narchive_dir = "{arch}"\npoll_s = 0.2\n'))
        lone.start()
        ljid = str(json.loads(lone.ctl("-o", "json", "submit", "--gpus", "1", "--", *train_cmd(0.1)).stdout)["id"])
        lone_key = f"n7-{ljid}"

        jid = submit(a, "--name", "train", "--", *train_cmd(0.1, sleep_until=go))
        key = f"n{a.node_id}-{jid}"
        for ag, j in ((lone, ljid), (a.agent, jid)):
            wait_until(lambda ag=ag, j=j: any(e["event"] == "checkpoint" for e in job_log_of(ag, j)), 60,
                       "a first checkpoint")
        a.ctl("reclaim", "--notice", "5s")
        wait_until(lambda: archived(arch, key)["files"] == ["guard.json"], 60, "node 1's job in the archive")
        # (its running job's periodic record: departures without notice are plausible there too)
        wait_until(lambda: archived(arch, lone_key)["files"] == ["live.json"], 60, "the other zone's record")
        held = int(a.json("migrations")[0]["ckpt"].removeprefix("ckpt-"))
        gone(a)

        # an unprivileged user cannot plant anything: the root is root's, 0755; a key dir 0700
        with local_user("arch") as u:
            for argv in (["/bin/mkdir", str(arch / "pwn-user")],
                         ["/bin/sh", "-c", f"echo {{}} > {arch / key / 'claimed-5.json'}"]):
                r = subprocess.run(["setpriv", f"--reuid={u.uid}", f"--regid={u.gid}", "--clear-groups", *argv],
                                   capture_output=True, text=True)
                assert r.returncode != 0 and "Permission denied" in r.stderr, (argv, r)

        next_key = f"n{b.node_id}-job-{max(int(j['id'].removeprefix('job-')) for j in b.json('jobs')) + 1}"
        subprocess.run([sys.executable, "-c", PLANT, str(arch), str(marker), live_key, next_key, str(outside)],
                       check=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        before = snapshot(outside)
        with RootLiveness(b.agent.sock, fillers[b.node_id]) as live:
            start = {nd.node_id: rounds_of(nd) for nd in (b, x)}
            wait_until(lambda: all(rounds_of(nd) >= start[nd.node_id] + 20 for nd in (b, x)), 60,
                       "20 more archive rounds on nodes 2 and 3")
            for nd in (b, x):  # each counted what it refused, by reason
                wait_until(lambda nd=nd: all(counts_of(nd).get(r, 0) >= 1 for r in REASONS), 30,
                           f"node {nd.node_id} to count every kind of refusal (has {counts_of(nd)})")
        live.check(bound_s=2.0)
        planted = ("pwn", live_key, "n1-job-99", lone_key)
        assert not list(tmp_path.glob("pwned*"))
        assert not [j for nd in (b, x) for j in nd.json("jobs")
                    if (j.get("origin") or {}).get("migrated_from") in planted]
        assert job_state(x, fillers[x.node_id])["state"] == "running"  # the live job the forgery named
        assert snapshot(outside) == before
        assert find_migrated(c, key) is None  # nobody has room yet: node 1's job waits in the archive

        # room frees on node 2: it claims node 1's job and finishes it, once, with the right weights
        b.ctl("job", "stop", fillers[b.node_id])
        found = wait_until(lambda: find_migrated(c, key), 60, "node 2 to claim the archived job", every=0.3)
        assert found[0] is b and f"n{b.node_id}-{found[1]['id']}" == next_key, (found[1]["id"], next_key)
        go.touch()
        finish(c, key, b, held, reference_sha)
        # its periodic copies were refused at the planted link, never written through it
        assert f"{next_key} is a symbolic link; nothing written there" in b.agent.log_path.read_text()
        assert not list(tmp_path.glob("pwned*"))
        assert job_state(x, fillers[x.node_id])["state"] == "running"
        assert snapshot(outside) == before
        assert not [j for nd in (b, x) for j in nd.json("jobs")
                    if (j.get("origin") or {}).get("migrated_from") in planted]
    finally:
        if lone is not None:
            lone.cleanup()
        for ns in created:
            delete_netns(ns)
        shutil.rmtree(arch, ignore_errors=True)


def job_log_of(agent: ZoneAgent, job_id: str) -> list[dict[str, Any]]:
    from harness import parse_events

    p = agent.state_dir / "logs" / f"{job_id}.log"
    return parse_events(p.read_text()) if p.exists() else []

