"""Shared storage is not trusted (issue 31, item 5; /tmp/audit/archive.md A1-A9): whoever can
write ``migrate.archive_dir`` without the zone key (another host on the export, an agent of
another zone on the same path, a user on a bad export) cannot make an agent run, stop, stand
down, copy or remove anything, and a planted file stops no round.

Real files in a temporary archive, real jobkit checkpoints, real components (each its own
store and the archive's lane thread) holding the zone's key as agents do (tests/archiverig.py).
The attacker is this test writing into the archive by hand; where a zone member is the
attacker it is said. One stand-in, named: the job manager (:class:`Submitted`, which records
the jobs the agent would start and starts nothing).

Each forgery is planted beside a good record (node 1's stopped job ``n1-job-1``) and one real
archive round of node 3 runs (:meth:`Archive.run_round`: the look, the claims, the
start through the real ``Takeover.resume_here``, the sweep). Each asserts: refused and counted by reason
(``counts["archive_unverified_<reason>"]``), the planted files byte- and mode-identical, no job
submitted for it, and the good record claimed and started in that same round.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from archiverig import (
    OTHER_KEY,
    ZONE_KEY,
    agent_of,
    claimed_by,
    mark_done,
    node_keys,
    pairs_of,
    record,
    reseal,
    snapshot,
    zone_keys,
    zone_of,
)
from standin_agent import standin_agent
from standin_origin import OriginQueries

from laminar.components import MigrateAgent
from laminar.jobkit import Checkpointer
from laminar.migrate import archive_fs
from laminar.migrate.archive_auth import ArchiveAuth, Refused, owner_body
from laminar.migrate.archive_claims import ARCHIVE_CLAIM_STALE_S, ARCHIVE_CLAIMS_MAX
from laminar.migrate.archive_view import ARCHIVE_SCAN_MAX, LIVE_RECORD
from laminar.migrate.mover import _manifest_facts
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.schema import REPLICAS_SCHEMA
from laminar.store import Store

GOOD = "n1-job-1"


class Submitted(OriginQueries):
    """Stand-in job manager: records each job the agent would start (spec, owner, origin), starts nothing."""

    def __init__(self) -> None:
        self.jobs: list[Any] = []

    async def submit(self, spec: Any, owner_uid: int = 0, owner_gid: int = 0, *, origin: Any = None) -> Any:
        j = SimpleNamespace(id=f"job-{70 + len(self.jobs)}", spec=spec, owner_uid=owner_uid, owner_gid=owner_gid,
                            state="queued", active=True, started=None, origin=origin)
        self.jobs.append(j)
        return j

    def list(self) -> list[Any]:
        return list(self.jobs)

    def active(self) -> list[Any]:
        return []

    def get(self, jid: str) -> Any:
        return next((j for j in self.jobs if j.id == jid), None)

    def keys(self) -> list[str]:
        return [j.origin.migrated_from for j in self.jobs]


def ckpt_of(tmp: Path, name: str, step: int = 7, data: bytes = b"weights") -> Path:
    return Checkpointer(job_id=name, ckpt_dir=tmp / "ck" / name, install_signal=False, keep=5).save(data, step=step)


def claimer(tmp: Path, arch: Path, node: int = 3, keys: Any = None, pairs: Any = None) -> ReclaimComponent:
    """Node ``node``'s migrate component with room: its own store and state directory, the
    stand-in job manager."""
    state = tmp / f"state-{node}"
    state.mkdir(exist_ok=True)
    store = Store(state / "state.db")
    with store.tx() as db:
        for stmt in REPLICAS_SCHEMA:
            db.execute(stmt)
    c = ReclaimComponent()
    c.agent = standin_agent(MigrateAgent, zone=zone_of(node, keys, pairs), jobs=Submitted(), store=store,
                              config=SimpleNamespace(state_dir=str(state)),
                              events=SimpleNamespace(emit=lambda *a, **kw: None))
    c.s = {"archive_dir": str(arch), "prestage_unannounced": 1.0, "archive_gc_s": 3600.0, "retry_max_s": 30.0,
           "retry_base_s": 30.0, "orphan_after_s": 0.0, "dead_after_s": 3.0}
    return c


def run_round(c: ReclaimComponent, limit_s: float = 20.0) -> None:
    """One real archive round of ``c`` and everything it started (claims, the sweep), in a thread
    of its own: fails when it has not ended within ``limit_s`` (a round a planted file stops)."""
    err: list[BaseException] = []

    async def main() -> None:
        await c.archive.run_round()
        while c._tasks:
            await asyncio.gather(*list(c._tasks))
        await c.archive.lane.call("flush", lambda: None)  # what the round handed the lane (a claim's end) is done

    def go() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported below
            err.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"an archive round did not end within {limit_s} s"
    if err:
        raise err[0]


@pytest.fixture
def world(tmp_path: Path) -> Any:
    """The archive with the good record (node 1's stopped job, its checkpoint), node 1 (the
    writer) and node 3 (the claimer); the claimer's lane and store are closed at the end."""
    arch = tmp_path / "arch"
    writer = agent_of(1, arch)
    writer.archive.stopped.publish(GOOD, ckpt_of(tmp_path, GOOD), record(GOOD))
    c = claimer(tmp_path, arch)
    w = SimpleNamespace(arch=arch, tmp=tmp_path, writer=writer, c=c)
    yield w
    c.archive.lane.close()
    c.agent.store.close()


def sealed(auth_node: int, body: dict[str, Any], key: str = ZONE_KEY, zone: int = 1) -> bytes:
    """``body`` signed as node ``auth_node`` of ``zone`` under ``key`` (hex)."""
    return ArchiveAuth(auth_node, zone, zone_keys(key, zone=zone)).seal(body)


def a_body(key: str, ckpt: Path, kind: str = "guard", **req: Any) -> dict[str, Any]:
    """A well-formed body of ``key``'s record naming the checkpoint ``ckpt`` (its facts)."""
    rec = record(key)
    rec["request"].update(req)
    return owner_body(kind, rec, ckpt.name, *_manifest_facts(ckpt), time.time())


def plant_dir(w: Any, key: str, ckpt: Path | None = None) -> Path:
    """``<archive>/<key>/`` made by the attacker (root's, 0755: as an agent's would look from
    the owner and mode), with a copy of ``ckpt`` in it."""
    d = w.arch / key
    d.mkdir()
    if ckpt is not None:
        shutil.copytree(ckpt, d / ckpt.name)
    return d


# -- the forgeries: each plants what it plants and returns (what to keep unchanged, the reason) ---

def no_envelope(w: Any) -> tuple[list[Path], str]:
    """A1: the record of before, as a user plants it: root's uid (0 by default before), any command."""
    ck = ckpt_of(w.tmp, "pwn")
    d = plant_dir(w, "pwn", ck)
    (d / "guard.json").write_text(json.dumps({"src_node": 1, "src_job": "x", "ckpt": ck.name, "request": {
        "spec": {"command": ["/bin/sh", "-c", f"touch {w.tmp}/pwned"]}}}))
    return [d], "no_envelope"


def wrong_key(w: Any) -> tuple[list[Path], str]:
    """A1: a well-formed record signed with another key (another zone's agent, a guessed key)."""
    ck = ckpt_of(w.tmp, "n1-job-2")
    d = plant_dir(w, "n1-job-2", ck)
    (d / "guard.json").write_bytes(sealed(1, a_body("n1-job-2", ck, owner_uid=0), key=OTHER_KEY))
    return [d], "bad_mac"


def altered(field: str, value: Any) -> Callable[[Any], tuple[list[Path], str]]:
    """A1/A2: a genuine record (node 1's) with one field changed after it was signed."""
    def plant(w: Any) -> tuple[list[Path], str]:
        key = "n1-job-3"
        w.writer.archive.stopped.publish(key, ckpt_of(w.tmp, key), record(key))
        p = w.arch / key / "guard.json"
        env = json.loads(p.read_bytes())
        b = env["body"]
        if field in ("owner_uid", "gpus"):
            b["request"][field] = value
        elif field in ("command", "env", "cwd"):
            b["request"]["spec"][field] = value
        else:
            b[field] = value
        p.write_text(json.dumps(env))
        return [w.arch / key], "bad_mac"
    plant.__name__ = f"altered_{field}"
    return plant


def moved(w: Any) -> tuple[list[Path], str]:
    """A1: a genuine record copied under another key's directory."""
    d = plant_dir(w, "n1-job-4", w.arch / GOOD / "ckpt-7")
    shutil.copy(w.arch / GOOD / "guard.json", d / "guard.json")
    return [d], "key_mismatch"


def not_owner(w: Any) -> tuple[list[Path], str]:
    """A1 (a zone member, node 2, no node keys): a record of node 1's job signed by node 2."""
    ck = ckpt_of(w.tmp, "n1-job-5")
    d = plant_dir(w, "n1-job-5", ck)
    (d / "guard.json").write_bytes(sealed(2, a_body("n1-job-5", ck)))
    return [d], "not_owner"


def no_uid(w: Any) -> tuple[list[Path], str]:
    """A1 (a zone member): a signed record whose request names no owner: never read as root."""
    ck = ckpt_of(w.tmp, "n1-job-6")
    d = plant_dir(w, "n1-job-6", ck)
    b = a_body("n1-job-6", ck)
    del b["request"]["owner_uid"]
    (d / "guard.json").write_bytes(sealed(1, b))
    return [d], "bad_schema"


def ckpt_path(value: str) -> Callable[[Any], tuple[list[Path], str]]:
    """A2 (a zone member): a signed record whose ``ckpt`` is a path, not a name of its directory."""
    def plant(w: Any) -> tuple[list[Path], str]:
        outside = w.tmp / "outside" / "n2-job-7"
        if not outside.exists():
            outside.parent.mkdir(exist_ok=True)
            shutil.copytree(ckpt_of(w.tmp, "theirs").parent, outside)  # another user's checkpoint
        ck = ckpt_of(w.tmp, "n1-job-8")
        d = plant_dir(w, "n1-job-8", ck)
        b = a_body("n1-job-8", ck)
        b["ckpt"] = value
        (d / "guard.json").write_bytes(sealed(1, b))
        return [d, w.tmp / "outside"], "bad_ckpt"
    plant.__name__ = f"ckpt_{value}"
    return plant


def other_zone(w: Any) -> tuple[list[Path], str]:
    """A1: a record of a zone this node holds no key for."""
    ck = ckpt_of(w.tmp, "n1-job-9")
    d = plant_dir(w, "n1-job-9", ck)
    (d / "guard.json").write_bytes(sealed(1, a_body("n1-job-9", ck), key=OTHER_KEY, zone=7))
    return [d], "unknown_key"


def fifo(w: Any) -> tuple[list[Path], str]:
    """A6: a FIFO where a record is read: its open waited for a writer, and the lane with it."""
    d = plant_dir(w, "n1-job-10")
    os.mkfifo(d / "guard.json")
    return [d], "not_regular"


def dev_zero(w: Any) -> tuple[list[Path], str]:
    """A6: a live record that is a link to /dev/zero (read whole before: memory without end)."""
    d = plant_dir(w, "n2-job-11")
    os.symlink("/dev/zero", d / LIVE_RECORD)
    return [d], "not_regular"


def huge(w: Any) -> tuple[list[Path], str]:
    """A6: a 50 MB record (sparse: nothing written)."""
    d = plant_dir(w, "n1-job-12")
    with open(d / "guard.json", "wb") as f:
        f.truncate(50 << 20)
    return [d], "too_large"


def deep(w: Any) -> tuple[list[Path], str]:
    """A6: JSON nested past the parser's recursion limit (before: every round and sweep failed)."""
    d = plant_dir(w, "n1-job-13")
    (d / "guard.json").write_text("[" * 200_000)
    return [d], "bad_json"


def bad_keeper(w: Any) -> tuple[list[Path], str]:
    """A6 (a zone member): a signed live record whose keeper is not a node (before: a ValueError
    on the event loop aborted every round)."""
    ck = ckpt_of(w.tmp, "n2-job-14")
    d = plant_dir(w, "n2-job-14", ck)
    b = a_body("n2-job-14", ck, kind="live")
    b["buddy"] = "x"
    (d / LIVE_RECORD).write_bytes(sealed(2, b))
    return [d], "bad_schema"


def key_dir_link(w: Any) -> tuple[list[Path], str]:
    """A3: a key directory that is a link out of the archive, holding a genuine-looking record."""
    outside = w.tmp / "linked"
    outside.mkdir()
    shutil.copytree(w.arch / GOOD / "ckpt-7", outside / "ckpt-7")
    shutil.copy(w.arch / GOOD / "guard.json", outside / "guard.json")
    os.chmod(outside, 0o755)
    os.symlink(outside, w.arch / "n1-job-15")
    return [outside], "link"


def foreign_dir(w: Any) -> tuple[list[Path], str]:
    """A8: a key directory owned by a user (as a user makes one on a bad export)."""
    d = plant_dir(w, "n1-job-16", ckpt_of(w.tmp, "n1-job-16"))
    (d / "guard.json").write_bytes(sealed(1, a_body("n1-job-16", d / "ckpt-7")))
    os.chown(d, 65534, 65534)
    return [d], "foreign_owner"


def replayed(w: Any) -> tuple[list[Path], str]:
    """A4: a claimed record planted again beside the claim that runs it (before: claimed again)."""
    key = "n1-job-17"
    d = claimed_by(w.arch, w.tmp, key, 2, (2, "job-40"))
    run = json.loads((d / "running-2.json").read_bytes())
    (d / "guard.json").write_text(json.dumps(run["body"]["record"]))
    return [d], "replayed"


def replayed_done(w: Any) -> tuple[list[Path], str]:
    """A4: a genuine record of a key whose claimed job ended (its .done marker) planted again."""
    key = "n1-job-18"
    w.writer.archive.stopped.publish(key, ckpt_of(w.tmp, key), record(key))
    mark_done(agent_of(2, w.arch), key, 2, "ended")
    return [w.arch / key, w.arch / ".done" / key], "replayed"


def expired(w: Any) -> tuple[list[Path], str]:
    """A4: a genuine record older than any marker that refuses its replay."""
    key = "n1-job-19"
    w.writer.archive.stopped.publish(key, ckpt_of(w.tmp, key), record(key))
    reseal(w.writer, w.arch / key / "guard.json", ts=time.time() - 40 * 86400)
    return [w.arch / key], "expired"


FORGERIES = [no_envelope, wrong_key, altered("owner_uid", 4321), altered("command", ["/bin/sh", "-c", "id"]),
             altered("env", {"LD_PRELOAD": "/tmp/x.so"}), altered("cwd", "/root"), altered("ckpt", "ckpt-8"),
             altered("src_node", 2), altered("gpus", 8), moved, not_owner, no_uid, ckpt_path("/abs/ckpt-1"),
             ckpt_path("../outside/n2-job-7/ckpt-7"), ckpt_path("ckpt-1/../../y"), other_zone, fifo, dev_zero, huge,
             deep, bad_keeper, key_dir_link, foreign_dir, replayed, replayed_done, expired]


@pytest.mark.parametrize("forge", FORGERIES, ids=[f.__name__ for f in FORGERIES])
def test_a_forged_record_is_refused_counted_untouched_and_the_good_one_is_claimed(
        world: Any, forge: Callable[[Any], tuple[list[Path], str]]) -> None:
    planted, reason = forge(world)
    before = {p: snapshot(p) for p in planted}
    run_round(world.c)
    assert [(j.origin.migrated_from, j.owner_uid) for j in world.c.agent.jobs.jobs] == \
        [(GOOD, os.getuid())]  # the good one only
    assert {p: snapshot(p) for p in planted} == before  # byte and mode for mode
    assert sorted(n.name for n in (world.arch / GOOD).glob("*.json")) == ["running-3.json"]
    assert world.c.counts.get(f"archive_unverified_{reason}", 0) >= 1, world.c.counts
    assert any(s["reason"] == reason for s in world.c.archive.status()["refused"])  # shown in the status
    assert not (world.tmp / "pwned").exists()
    run_round(world.c)  # and again: counted once per file, nothing started
    assert world.c.agent.jobs.keys() == [GOOD]


def test_a_missing_owner_uid_is_never_read_as_root(world: Any) -> None:
    """A job's request without its owner, even from the job's keeper row (the wire), is refused."""
    async def main() -> str | None:
        return await world.c.takeover.resume_here({"key": "n1-job-1", "src_node": 1, "src_job": "job-1"},
                                          {"spec": {"command": ["true"]}, "gpus": 0}, world.arch, "test")
    err = asyncio.run(main())
    assert err is not None and "names no owner_uid" in err and world.c.agent.jobs.jobs == []


# -- the payload: bound to the record -------------------------------------------------------

def test_a_checkpoint_that_is_a_link_out_is_refused_and_nothing_is_copied(world: Any) -> None:
    """A2: a genuine record whose checkpoint directory was swapped for a link to another
    checkpoint (another user's, root-only): refused, nothing copied, the record given back."""
    key = "n1-job-20"
    world.writer.archive.stopped.publish(key, ckpt_of(world.tmp, key), record(key))
    theirs = world.tmp / "theirs"
    shutil.copytree(world.arch / key / "ckpt-7", theirs)
    shutil.rmtree(world.arch / key / "ckpt-7")
    os.symlink(theirs, world.arch / key / "ckpt-7")
    before = snapshot(theirs), snapshot(world.arch / key)
    run_round(world.c)
    assert world.c.counts["archive_unverified_bad_ckpt"] == 1
    assert (snapshot(theirs), snapshot(world.arch / key)) == before
    assert world.c.agent.jobs.keys() == [GOOD]
    assert sorted(os.listdir(world.tmp / "state-3" / "resume")) == [GOOD]  # nothing of key copied


def test_a_payload_changed_with_a_consistent_manifest_is_refused_and_not_tried_again(world: Any) -> None:
    """A5: the checkpoint's files rewritten with a manifest of their own that matches them
    (what passed every check before): its manifest is not the one the record signed."""
    key = "n1-job-21"
    world.writer.archive.stopped.publish(key, ckpt_of(world.tmp, key), record(key))
    mine = ckpt_of(world.tmp, "mine", 7, b"the attacker's weights")
    for f in mine.iterdir():
        shutil.copy(f, world.arch / key / "ckpt-7" / f.name)
    before = snapshot(world.arch / key)
    run_round(world.c)
    assert world.c.counts["archive_unverified_manifest_mismatch"] == 1
    assert snapshot(world.arch / key) == before and world.c.agent.jobs.keys() == [GOOD]
    world.c.archive.claims.next_try.clear()
    run_round(world.c)  # not claimed, copied or counted again while the record is the same
    assert world.c.counts["archive_unverified_manifest_mismatch"] == 1 and world.c.agent.jobs.keys() == [GOOD]


def test_a_forged_successor_never_gets_a_claimed_directory_removed(world: Any) -> None:
    """A5: node 2 claimed and runs n1-job-22 as its job-5; a forger makes ``n2-job-5`` with a
    self-made checkpoint and record (what the sweep took for the job's newer safe state, and
    removed the claimed directory: the job's only copy outside the pool)."""
    d = claimed_by(world.arch, world.tmp, "n1-job-22", 2, (2, "job-5"))
    succ = plant_dir(world, "n2-job-5", ckpt_of(world.tmp, "self-made", 9))
    (succ / LIVE_RECORD).write_text(json.dumps({"key": "n2-job-5", "src_node": 2, "ckpt": "ckpt-9"}))
    before = snapshot(d), snapshot(succ)
    sweeper = agent_of(4, world.arch)
    assert sweeper.archive.gc.sweep()["removed"] == {}
    assert (snapshot(d), snapshot(succ)) == before
    assert sweeper.counts["archive_unverified_no_envelope"] >= 1
    assert sweeper.archive.done(world.arch, "n1-job-22") is None


# -- links: root never leaves the archive ---------------------------------------------------

def test_links_in_the_archive_never_lead_root_outside(world: Any) -> None:
    """A3: a link planted for the next job's key (keys are predictable) and ``.done`` a link:
    the periodic copy, the publish, the claim, the sweep and its marker write nothing there,
    change no mode, remove nothing. Before, root chmodded the target 0700, wrote records and
    checkpoints into it, removed its ckpt-* and wrote ``.done/<key>`` through the link."""
    outside, outside2 = world.tmp / "etc-like", world.tmp / "sudoers-like"
    for o in (outside, outside2):
        o.mkdir()
        os.chmod(o, 0o755)
    shutil.copytree(ckpt_of(world.tmp, "n9-job-1", 3), outside / "ckpt-3")
    (outside / "keep.conf").write_text("a user's file")
    os.symlink(outside, world.arch / "n1-job-30")
    os.symlink(outside2, world.arch / ".done")
    before = snapshot(outside), snapshot(outside2)
    ck = ckpt_of(world.tmp, "n1-job-30", 5)
    with pytest.raises(OSError, match="symbolic link"):
        world.writer.archive.periodic.publish_live("n1-job-30", ck, record("n1-job-30"))
    with pytest.raises(OSError, match="symbolic link"):
        world.writer.archive.stopped.publish("n1-job-30", ck, record("n1-job-30"))
    assert not world.writer.archive.claims.claim("n1-job-30")
    d = claimed_by(world.arch, world.tmp, "n1-job-31", 3, (3, "job-5"))
    res = world.c.archive.gc.sweep({"n1-job-31": {"job-5"}})  # ended: its marker goes to .done (a link)
    assert res["removed"] == {"n1-job-31": "ended"} and not d.exists()
    assert (snapshot(outside), snapshot(outside2)) == before
    assert world.writer.counts["archive_unverified_link"] >= 1 and world.c.counts["archive_unverified_link"] >= 1


# -- presence is no evidence ------------------------------------------------------------------

def test_unsigned_markers_and_stray_json_do_not_stand_a_keeper_down(world: Any) -> None:
    """A4: before, any ``*.json`` in the key's directory or any ``.done/<key>`` made the keeper
    stand down (``handed-over``) or wait for ever: the job lost."""
    key = "n1-job-40"
    d = plant_dir(world, key)
    (d / "x.json").write_text("{}")
    (world.arch / ".done").mkdir()
    (world.arch / ".done" / key).write_text(json.dumps({"key": key, "runner": "node 2"}))
    (d / "running-2.json").write_text(json.dumps({"key": key, "resumed": {"node": 2, "job": "job-1"}}))
    keeper = claimer(world.tmp, world.arch, 2)
    try:
        assert keeper.archive.claims.claim_archived(key) == (False, None, False)  # the keeper takes over from its replica
        assert keeper.archive.runner(key) is None and keeper.fence.archive_claimer(key) is None
        assert keeper.counts["archive_unverified_no_envelope"] >= 2
    finally:
        keeper.archive.lane.close()
        keeper.agent.store.close()


def test_a_filename_alone_never_vouches_a_supersede(world: Any) -> None:
    """A4: node 2 says it runs node 1's job (``superseded``, not the job's keeper); before, an
    unsigned ``running-2.json`` in the key's directory made node 1 stop its real job."""
    key = "n1-job-41"
    d = plant_dir(world, key)
    (d / "running-2.json").write_text(json.dumps({"key": key, "resumed": {"node": 2, "job": "job-9"}}))
    n1 = claimer(world.tmp, world.arch, 1)
    job = SimpleNamespace(id="job-41", active=True, state="running", spec=SimpleNamespace(env={}))
    stopped: list[str] = []

    async def stop(jid: str, reason: str, **kw: Any) -> None:
        stopped.append(jid)

    n1.agent.jobs.stop = stop

    async def main() -> None:
        await n1.replicas.stop_superseded(job, 2, "job-9", key, vouched=False)

    try:
        asyncio.run(main())
        assert stopped == [] and job.active
    finally:
        n1.archive.lane.close()
        n1.agent.store.close()


def test_a_backdated_claim_is_not_stale(world: Any) -> None:
    """A4: a fresh claim whose mtime is set back (``touch -d``): before, a second node took it
    over at once and the job ran twice. A claim's age is its node's signed note; a claim with no
    note (its node crashed right after the rename) ages by the looking agent's own clock."""
    key = "n1-job-42"
    world.writer.archive.stopped.publish(key, ckpt_of(world.tmp, key), record(key))
    two = agent_of(2, world.arch)
    assert two.archive.claims.claim(key)
    claim = world.arch / key / "claimed-2.json"
    os.utime(claim, (1e9, 1e9))
    assert not world.c.archive.claims.claim(key) and world.c.archive.claims.stale_claims(world.arch, time.time()) == []
    reseal(two, claim, ts=time.time() - ARCHIVE_CLAIM_STALE_S - 1)  # node 2 noted it that long ago
    assert world.c.archive.claims.claim(key)
    world.c.archive.claims.unclaim(key)  # (given back: what it took, where it was)
    assert sorted(p.name for p in (world.arch / key).glob("*.json")) == ["guard.json"]
    # a claim never noted: this agent's own wait
    assert two.archive.claims.claim(key)
    taken = json.loads(claim.read_bytes())["body"]["taken"]
    claim.write_bytes(json.dumps(taken).encode())  # the bare record, as the rename left it
    os.utime(claim, (1e9, 1e9))
    assert not world.c.archive.claims.claim(key)
    for ident in world.c.archive.claims.claims_seen:
        world.c.archive.claims.claims_seen[ident] -= ARCHIVE_CLAIM_STALE_S + 1
    assert world.c.archive.claims.claim(key)


# -- bounded work ---------------------------------------------------------------------------------

def test_a_round_reads_a_bounded_number_of_entries_and_starts_a_bounded_number_of_claims(
        world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A7: 3,000 planted directories (600 with a record that does not verify) and 10 genuine
    records: a round opens at most ARCHIVE_SCAN_MAX key directories and reads at most as many
    records, starts at most ARCHIVE_CLAIMS_MAX claims; the next rounds go on through the rest."""
    for i in range(3000):
        d = world.arch / f"n5-job-{i}"
        d.mkdir()
        if i % 5 == 0:
            (d / "guard.json").write_text("{}")
    ck = ckpt_of(world.tmp, "many")
    for i in range(10):
        world.writer.archive.stopped.publish(f"n1-job-{100 + i}", ck, record(f"n1-job-{100 + i}"))
    opened, read = [0], [0]
    real_open, real_read = archive_fs.open_dir, archive_fs.read_small

    def count_open(*a: Any) -> Any:
        opened[0] += 1
        return real_open(*a)

    def count_read(*a: Any) -> Any:
        read[0] += 1
        return real_read(*a)

    monkeypatch.setattr(archive_fs, "open_dir", count_open)
    monkeypatch.setattr(archive_fs, "read_small", count_read)
    spawned: list[str] = []
    c = world.c
    c.archive.claims.claim_and_resume = lambda key, **kw: key  # type: ignore[method-assign,assignment]
    c._spawn = spawned.append  # type: ignore[method-assign,assignment]
    seen: set[str] = set()
    for _ in range(3):
        opened[0] = read[0] = 0
        look = c.archive.look(world.arch, [], [], True, frozenset({3}), frozenset(), time.time())
        assert opened[0] <= ARCHIVE_SCAN_MAX + 16 and read[0] <= ARCHIVE_SCAN_MAX + 16, (opened, read)
        before = len(spawned)
        c.archive.claims.start_claims(look, time.time())
        assert len(spawned) - before <= ARCHIVE_CLAIMS_MAX
        seen |= set(look["keepers"])
        c.takeover.taking.clear()
    assert seen == {GOOD} | {f"n1-job-{100 + i}" for i in range(10)}  # the passes went on: all found
    assert c.counts["archive_unverified_no_envelope"] == 600  # each counted once


def test_an_oversized_signed_checkpoint_is_refused_before_copying(world: Any) -> None:
    """A7 (a zone member): a signed record whose checkpoint would not fit the state disk."""
    key = "n1-job-50"
    ck = ckpt_of(world.tmp, key)
    d = plant_dir(world, key, ck)
    b = a_body(key, ck)
    b["bytes"] = 1 << 50
    (d / "guard.json").write_bytes(sealed(1, b))
    run_round(world.c)
    assert world.c.counts["archive_unverified_too_big_ckpt"] == 1 and world.c.agent.jobs.keys() == [GOOD]
    assert not [n for n in os.listdir(world.tmp / "state-3" / "resume") if n.startswith(".tmp")]


# -- the archive's root -----------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["world-writable", "another-owner", "a-link"])
def test_an_archive_root_others_may_write_is_not_used(world: Any, how: str) -> None:
    """A8: an archive any user could write (or a link to one) is not used at all, and the
    status says what was found and the fix."""
    if how == "world-writable":
        os.chmod(world.arch, 0o777)
    elif how == "another-owner":
        os.chown(world.arch, 65534, 65534)
    else:
        os.rename(world.arch, world.tmp / "real")
        os.symlink(world.tmp / "real", world.arch)
    run_round(world.c)
    err = world.c.archive.status()["error"]
    assert world.c.agent.jobs.jobs == [] and err is not None, err
    assert {"world-writable": "chmod go-w", "another-owner": "chown 0", "a-link": "not a directory"}[how] in err


# -- node keys: who wrote it --------------------------------------------------------------------

def test_with_node_keys_a_member_cannot_write_as_another(tmp_path: Path) -> None:
    """With node keys (``node_keys = require``), node 2 holding the zone key and its own node key
    cannot sign as node 1: node 3's node MAC does not verify. Without node keys it can (the
    zone key is the only word: the binding is zone membership), shown last."""
    arch = tmp_path / "arch"
    privs = node_keys([1, 2, 3, 4])
    n1 = agent_of(1, arch, pairs=pairs_of(1, privs))
    key = "n1-job-1"
    ck = ckpt_of(tmp_path, key)
    n1.archive.stopped.publish(key, ck, record(key))
    c = claimer(tmp_path, arch, 3, pairs=pairs_of(3, privs))
    forged = plant_dir(SimpleNamespace(arch=arch), "n1-job-2", ck)
    two = ArchiveAuth(1, 1, zone_keys(), pairs_of(2, privs))  # node 2's pair keys, writing as node 1
    (forged / "guard.json").write_bytes(two.seal(a_body("n1-job-2", ck)))
    zone_only = plant_dir(SimpleNamespace(arch=arch), "n1-job-3", ck)
    (zone_only / "guard.json").write_bytes(sealed(1, a_body("n1-job-3", ck)))  # no node MAC at all
    try:
        run_round(c)
        assert c.agent.jobs.keys() == [key]
        assert c.counts["archive_unverified_bad_nmac"] == 1 and c.counts["archive_unverified_not_for_me"] == 1
        assert c.archive.status()["auth"] == "node"
        # a node the writer's roster did not list when it wrote cannot verify it (until rewritten)
        five = node_keys([5])
        late = claimer(tmp_path, arch, 5, pairs=pairs_of(5, {**privs, **five}))
        try:
            assert late.archive.runner(key) is None and late.counts["archive_unverified_not_for_me"] >= 1
        finally:
            late.archive.lane.close()
            late.agent.store.close()
    finally:
        c.archive.lane.close()
        c.agent.store.close()
    # without node keys, the zone key is the word: node 2 can write as node 1
    arch2 = tmp_path / "arch2"
    arch2.mkdir()
    (arch2 / "n1-job-2").mkdir()
    shutil.copytree(ck, arch2 / "n1-job-2" / ck.name)
    (arch2 / "n1-job-2" / "guard.json").write_bytes(ArchiveAuth(1, 1, zone_keys()).seal(a_body("n1-job-2", ck)))
    assert agent_of(3, arch2).archive.claims.claim("n1-job-2")


def test_a_rotated_key_keeps_records_readable_while_it_is_previous(tmp_path: Path) -> None:
    arch = tmp_path / "arch"
    key = "n1-job-1"
    old, new = ZONE_KEY, "33" * 32
    agent_of(1, arch, zone_keys(old)).archive.stopped.publish(key, ckpt_of(tmp_path, key), record(key))
    assert agent_of(3, arch, zone_keys(new, previous=old)).archive.runner(key) is None  # read, verified
    assert agent_of(3, arch, zone_keys(new, previous=old)).archive.claims.claim(key)
    agent_of(3, arch, zone_keys(new, previous=old)).archive.claims.unclaim(key)
    gone = agent_of(3, arch, zone_keys(new))  # the old key removed: its records are refused
    assert not gone.archive.claims.claim(key) and gone.counts["archive_unverified_bad_mac"] == 1


def test_refusals_name_what_was_found() -> None:
    with pytest.raises(Refused) as e:
        ArchiveAuth(1, 1, zone_keys()).open(b'{"src_node": 1}', name="guard.json", dir_key="n1-job-1")
    assert e.value.reason == "no_envelope" and "body" in e.value.detail
