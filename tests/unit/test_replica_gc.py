"""Checkpoint replicas a node holds for other nodes' jobs do not pile up (ReclaimComponent's
replica GC): ``<root>/checkpoints/<key>/ckpt-<n>`` committed by the real transfer endpoint.

A real component is started on a real SQLite store; its real Receiver listens on loopback; the
checkpoints are real jobkit checkpoints sent with the real ``send_checkpoint`` and the keeper and
release are real authenticated control messages. Stand-ins, named as such: the zone (``FakeZone``
from the evidence test: membership and keys only, no sockets) and the job manager (``Jobs``: the
jobs the GC asks about, each with a spec whose ``resume_from`` may point at a replica).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jobrig import until
from standin_origin import OriginQueries
from test_migrate_evidence import FakeZone, make_agent

from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.transfer import send_checkpoint, send_control
from laminar.policy import custody
from laminar.runtime.provenance import JobOrigin
from laminar.runtime.spec import JobSpec

KEY = b"k" * 32
K = "n2-job-1"  # node 2's job-1, kept here (node 1)
OTHER = "n3-job-7"


class Jobs(OriginQueries):
    """Stand-in job manager: the jobs this node runs (``list``), none active for the watch loop."""

    def __init__(self) -> None:
        self.jobs: list[Any] = []

    def active(self) -> list[Any]:
        return []

    def list(self) -> list[Any]:
        return list(self.jobs)

    def get(self, job_id: str) -> Any:
        return next((j for j in self.jobs if j.id == job_id), None)


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# the owner a keeper names: root's job (a take-over of it needs the source in zone.root_from)
ROOT_IDS = {"owner_uid": 0, "owner_gid": 0}


class Source:
    """Node ``node`` sending its job's checkpoints and control messages to the component."""

    def __init__(self, tmp: Path, comp: ReclaimComponent, node: int, key: str) -> None:
        self.comp, self.node, self.key = comp, node, key
        self.ck = Checkpointer(job_id=key, ckpt_dir=tmp / f"src-{key}", install_signal=False, keep=10)

    async def send(self, step: int) -> Path:
        c = self.ck.save(f"weights-{step}".encode(), step=step)
        res = await send_checkpoint("127.0.0.1", self.comp.port, c, self.key, KEY, zone=1, node=str(self.node),
                                    retries=1)
        return Path(res.remote_path)

    async def ctl(self, op: str, ckpt: str = "") -> Any:
        body: dict[str, Any] = {"key": self.key}
        if op == "keeper":
            body.update(src_node=self.node, src_job="job-1", ckpt=ckpt, request={"spec": {"command": ["train"]},
                                                                                      **ROOT_IDS})
        return await send_control("127.0.0.1", self.comp.port, KEY, op, body, zone=1, node=str(self.node))


def start(tmp: Path) -> tuple[SimpleNamespace, ReclaimComponent]:
    agent = make_agent(tmp)
    agent.jobs = Jobs()
    comp = ReclaimComponent()
    return agent, comp


async def started(tmp: Path) -> tuple[SimpleNamespace, ReclaimComponent]:
    agent, comp = start(tmp)
    await comp.start(agent)  # zone None at start: the endpoint binds a free port on loopback
    zone = FakeZone([2, 3])
    zone.keys = {1: KEY}
    agent.zone = zone
    return agent, comp


def test_older_replicas_go_the_kept_and_resumed_from_stay_a_released_key_goes(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data").write_bytes(b"not the agent's")

    async def main() -> None:
        agent, comp = await started(tmp_path)
        try:
            d = comp.root / "checkpoints" / K  # type: ignore[operator]
            src, other = Source(tmp_path, comp, 2, K), Source(tmp_path, comp, 3, OTHER)
            # another key, a partial transfer in incoming/ and a commit's temporary are not this GC's
            await other.send(1)
            await other.ctl("keeper", "ckpt-1")
            await other.send(2)
            await other.ctl("keeper", "ckpt-2")
            od = comp.root / "checkpoints" / OTHER  # type: ignore[operator]
            assert await until(lambda: names(od) == ["ckpt-2"])  # its own older one went
            partial = comp.root / "incoming" / K / "ckpt-99"  # type: ignore[operator]
            partial.mkdir(parents=True)
            (partial / "data.partial").write_bytes(b"half")

            await src.send(5)
            await src.ctl("keeper", "ckpt-5")
            await src.send(10)  # the keeper still names ckpt-5 (it follows the transfer)
            assert await until(lambda: names(d) == ["ckpt-10", "ckpt-5"]), names(d)
            await src.ctl("keeper", "ckpt-10")
            await src.send(15)
            assert await until(lambda: names(d) == ["ckpt-10", "ckpt-15"]), names(d)  # ckpt-5 went
            await src.ctl("keeper", "ckpt-15")  # the keeper names the newest: the older one goes too
            assert await until(lambda: names(d) == ["ckpt-15"]), names(d)

            # a job runs here resumed from ckpt-15 (a move handed it over); the source goes on
            agent.jobs.jobs.append(SimpleNamespace(id="job-4", state="running", ended=None,
                                                   spec=JobSpec(["train"], resume_from=str(d / "ckpt-15")),
                                                   origin=JobOrigin(resume_given=str(d / "ckpt-15"))))
            (d / ".tmp-ckpt-30").mkdir()  # a commit in progress (transfer/receive.py's, not this GC's)
            (d / "ckpt-3").symlink_to(outside, target_is_directory=True)
            await src.send(20)
            await src.ctl("keeper", "ckpt-20")
            await src.send(25)
            assert await until(lambda: names(d) == [".tmp-ckpt-30", "ckpt-15", "ckpt-20", "ckpt-25"]), names(d)
            assert names(outside) == ["data"]  # the link went as a link, its target stayed

            # the job ended; the source released the keeper: the key's checkpoints go
            agent.jobs.jobs[0].state = "exited"
            (d / ".tmp-ckpt-30").rmdir()
            assert await src.ctl("release") == {"released": K}
            assert await until(lambda: not d.exists()), names(d)
            assert await until(lambda: names(comp.root / "replica-gc") == []), "removed in a thread"  # type: ignore[operator]
            assert (partial / "data.partial").read_bytes() == b"half"  # incoming/ untouched
            assert names(od) == ["ckpt-2"]  # the other key untouched
            assert (outside / "data").read_bytes() == b"not the agent's"
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())


async def kept_and_resumed_here(tmp: Path, agent: Any, comp: ReclaimComponent, state: str,
                                   migrated_from: str | None = None) -> tuple[Path, Source, SimpleNamespace]:
    """Node 2 sends ckpt-5 of ``K`` and keeps it here; a local job in ``state`` resumes from it,
    the agent gave it that (its recorded origin; ``migrated_from``: the key it resumed, too).
    (The key's directory, the source, the job.)"""
    d = comp.root / "checkpoints" / K  # type: ignore[operator]
    src = Source(tmp, comp, 2, K)
    await src.send(5)
    await src.ctl("keeper", "ckpt-5")
    job = SimpleNamespace(id="job-4", state=state, ended=None, spec=JobSpec(["train"], resume_from=str(d / "ckpt-5")),
                          origin=JobOrigin(migrated_from=migrated_from, resume_given=str(d / "ckpt-5")))
    agent.jobs.jobs.append(job)
    return d, src, job


def test_a_released_key_keeps_what_a_live_job_resumed_from_and_a_commit_in_progress(tmp_path: Path) -> None:
    async def main() -> None:
        agent, comp = await started(tmp_path)
        try:
            d, src, job = await kept_and_resumed_here(tmp_path, agent, comp, "queued")  # to resume from ckpt-5
            await src.send(10)
            await src.ctl("keeper", "ckpt-10")
            assert await until(lambda: names(d) == ["ckpt-10", "ckpt-5"]), names(d)
            (d / ".tmp-ckpt-15").mkdir()
            await src.ctl("release")
            assert await until(lambda: names(d) == [".tmp-ckpt-15", "ckpt-5"]), names(d)
            # the periodic sweep goes on removing what a released key no longer needs once the job ended
            job.state = "exited"
            comp.replicas.tick(time.time(), force=True)
            assert await until(lambda: names(d) == [".tmp-ckpt-15"]), names(d)
            assert names(comp.root / "incoming") in ([], [K])  # type: ignore[operator]
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())


def test_a_handed_over_key_goes_once_its_local_job_ended_and_stale_trash_goes_at_start(tmp_path: Path) -> None:
    async def main() -> None:
        agent, comp = await started(tmp_path)
        try:
            d, src, job = await kept_and_resumed_here(tmp_path, agent, comp, "running", migrated_from=K)
            comp.takeover.set_replica(K, custody.Event.HAND_OVER, "job-4")
            comp.replicas.tick(time.time(), force=True)
            await asyncio.sleep(0.3)
            assert names(d) == ["ckpt-5"]  # its job runs from it
            job.state = "stopped"
            comp.replicas.tick(time.time(), force=True)
            assert await until(lambda: not d.exists()), names(d)
        finally:
            await comp.stop()
            agent.store.db.close()
        # a crash mid-removal leaves the trash: the next start empties it
        trash = tmp_path / "xfer" / "replica-gc"
        (trash / "n2-job-1.ckpt-1.1").mkdir(parents=True)
        (trash / "n2-job-1.ckpt-1.1" / "f").write_bytes(b"x")
        agent2, comp2 = start(tmp_path)
        agent2.store.db.close()
        agent2 = make_agent(tmp_path)
        agent2.jobs = Jobs()
        await comp2.start(agent2)
        try:
            assert await until(lambda: names(trash) == [])
        finally:
            await comp2.stop()
            agent2.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())


def test_the_policy_picks_only_older_unkept_checkpoints() -> None:
    from laminar.migrate.reclaim import replica_victims

    have = ["ckpt-5", "ckpt-10", "ckpt-15", ".tmp-ckpt-20", "ckpt-x", "notes"]
    assert replica_victims(have, newest="ckpt-15", keep={"ckpt-5"}) == ["ckpt-10"]
    assert replica_victims(have, newest="ckpt-10", keep=set()) == ["ckpt-5"]  # newer ones are not older
    assert replica_victims(have, newest=None, keep={"ckpt-10"}) == ["ckpt-15", "ckpt-5"]
    assert os.sep not in "".join(replica_victims(have, newest=None, keep=set()))
