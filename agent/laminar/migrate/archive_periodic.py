"""Running jobs' periodic checkpoints in the archive (:class:`PeriodicCopies`, the ``periodic`` of
:class:`laminar.migrate.archive.Archive`), and its share of the archive's round: the jobs to look
at (:meth:`PeriodicCopies.round_jobs`), the look at their checkpoints and at the live records of
the jobs that ended (:meth:`PeriodicCopies.look_in`, on the lane), the copies (:meth:`PeriodicCopies.found`).

**Periodic checkpoints in the archive.** While departures without notice are plausible (the
learned unannounced share is at least ``prestage_unannounced``, the rule that prestages), each
running job's newest committed checkpoint (before it wrote one: the verified checkpoint it was
restarted from, when the agent gave it: :meth:`PeriodicCopies.given_resume_from`) is copied to ``<archive>/<key>/ckpt-N/`` the same way (temporary name, verified
against its manifest, fsync'd, renamed) and the job's *live record* ``live.json`` (its node, its
keeper, its request) is pointed at it; older archived checkpoints of the job are then removed
(the newest complete one is kept), and when the job ends here (exited, stopped, failed, or moved
by a reclaim) the record and its checkpoints go. A live record is claimed like a keeper record
(rename to ``claimed-<node>.json``), but only by the job's keeper once its source is dead, or by
an agent with room that sees the job's node *and* its keeper dead (silent for
``orphan_after_s``, or their reclaim windows ended): a job whose node and keeper both leave
without notice rolls back only to its last archived periodic checkpoint. A stopped job's keeper
record replaces its live record (taken by rename, so only one record is ever claimable), and a
node that finds its job's live record claimed does not publish another. A node whose window ended
counts as dead while its agent may still be copying the job's final checkpoint (late, the
archive hung): while it is heard from and its newer copy's temporary is in the key's directory,
the live record waits, unclaimed, at most as long as the progress that copy holds
(:meth:`Claims._await_newer_copy`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar import jobkit
from laminar.components import jobs_of
from laminar.migrate import archive_fs, ckpt_driver
from laminar.migrate.archive_auth import owner_body
from laminar.migrate.archive_view import _CKPT_STEP, ARCHIVE_SCAN_MAX, LIVE_RECORD, View
from laminar.migrate.errors import MigrateError
from laminar.policy.prestage import unannounced_plausible
from laminar.runtime.ckpt_scan import scan_dir

if TYPE_CHECKING:
    from laminar.migrate.archive import Archive

log = logging.getLogger("laminar.migrate")


class PeriodicCopies:
    """Running jobs' periodic checkpoints and their live records (see the module's doc).
    A piece of the part :class:`laminar.migrate.archive.Archive` (its ``periodic``), built with it. ``archive``: the part."""

    def __init__(self, archive: Archive) -> None:
        self.archive = archive
        self.host = archive.host
        self.live: dict[str, str] = {}  # job id -> newest periodic checkpoint in the archive (live.json)
        self.live_keeper: dict[str, int | None] = {}  # job id -> the keeper its live.json names
        self.archiving: set[str] = set()

    async def round_jobs(self, root: Path, reclaiming: bool
                         ) -> tuple[dict[str, str], list[tuple[str, str, str | None, tuple[Path | None] | None]]]:
        """The archive round's share on the loop before its look (:meth:`Archive.run_round`): the
        jobs whose live records go (ended here: job id -> its state) and the running jobs whose
        newest checkpoint the look finds ((job id, its checkpoint directory, its ``resume_from``,
        the checkpoint driver's answer): :meth:`look_in`), none while ``reclaiming``. At the
        first round since the start, this node's live records in the archive are read back."""
        if not self.archive.rounds:
            # the first round since the start: this node's live records in the archive (what it
            # archived before a restart; live is kept in memory only). Before, a job
            # that ended after a restart left its live record, and a node that took this one
            # for gone later resumed the ended lineage from it (bench/chaos.py
            # --fence-after-s, seed 29)
            mine = await self.archive.lane.call("own live records", self.own_live_records, root)
            for jid, ck in mine.items():
                self.live.setdefault(jid, ck)
        ended: dict[str, str] = {}
        for jid in list(self.live):
            job = jobs_of(self.host.agent).get(jid)
            if job is None or (not job.active and job.state in ("exited", "stopped", "failed", "migrated")):
                if jid not in self.archiving:
                    self.live.pop(jid, None)
                    self.live_keeper.pop(jid, None)
                    ended[jid] = job.state if job else "gone"
        periodic: list[tuple[str, str, str | None, tuple[Path | None] | None]] = []
        if self.periodic_due() and not reclaiming:
            # each job's newest verified checkpoint as the checkpoint driver's check of its
            # listing found it: nothing is read for it here. Before, the look hashed every
            # running job's newest checkpoint whole at every round (poll_s), copied or not.
            # A listing the running driver has not checked yet waits for its check.
            driving = self.host.ckpt is not None and self.host.ckpt.threaded
            for j in list(jobs_of(self.host.agent).active()):
                if j.id in self.host.evacuating or j.id in self.archiving or not j.ckpt_dir:
                    continue
                known = self.host.checkpoints.driver_checked(j)
                if known is None and driving:
                    continue
                periodic.append((j.id, str(j.ckpt_dir), self.given_resume_from(j, root), known))
        return ended, periodic

    def look_in(self, v: View | None, ended: list[str],
                periodic: list[tuple[str, str, str | None, tuple[Path | None] | None]], wall: float,
                out: dict[str, Any]) -> None:
        """The archive round's look (on the lane), its share: drops the live records of the
        ``ended`` jobs (:meth:`drop_live_in`; ``v``: the archive, None when it has none) into
        ``out["dropped"]`` (``out["drop_again"]``: held by a claim, dropped again next round) and
        finds each ``periodic`` job's newest checkpoint into ``out["ckpts"]``."""
        for jid in ended:
            key = f"n{self.host.node_id}-{jid}"
            if v is None:
                break
            if self.drop_live_in(v, key):
                out["dropped"].append(jid)
                # the lineage ended here: a keeper of this key that missed the release (this node
                # was cut off from it when the job ended) finds the marker and stands down
                # (Claims.claim_archived). Before, the keeper took the ended job over after
                # orphan_after_s and ran its last steps, and its end, a second time
                # (bench/chaos.py --fence-after-s, seed 31)
                self.archive.gc.mark_done_in(v, key, self.host.node_id, "ended there", wall)
            elif self.live_held(v, key):
                # claimed by a node that has not run it (yet): it gives the record back if it finds
                # no room, and then the ended job's record would be claimable again (a lineage that
                # ended, resumed: bench/chaos.py --fence-after-s, seed 29). Dropped again next round.
                out["drop_again"].append(jid)
        for jid, ckpt_dir, rf, known in periodic:
            # no driver has checked it: the agent's own bounded check (its tries, bytes and time)
            if known is not None:
                ckpt = known[0]
            else:
                listing = scan_dir(ckpt_dir)
                ckpt = ckpt_driver.check_newest(listing.paths() if listing else [], self.host.s)[0]
            if ckpt is None and rf:
                # restarted from a checkpoint (a move, a keeper, the archive) and none written
                # since: the one it resumed from is its newest, archived at once under its new key
                ckpt = Path(rf) if (Path(rf) / jobkit.MANIFEST).exists() else None
            if ckpt is not None:
                out["ckpts"][jid] = ckpt

    def found(self, look: dict[str, Any], ended: dict[str, str]) -> None:
        """The archive round's share on the loop after its look: says which ended jobs' records
        went, and copies each running job's newer checkpoint (:meth:`copy_periodic`)."""
        for jid in look["dropped"]:
            self.host._emit(f"{jid}: ended ({ended[jid]}); its archived periodic checkpoints removed", persist=False,
                            job=jid, phase="archive-dropped")
        for jid in look.get("drop_again", []):  # (looked at again next round, as long as it is held)
            self.live.setdefault(jid, "")
        for jid, ckpt in look["ckpts"].items():
            job = jobs_of(self.host.agent).get(jid)
            if (job is None or not job.active or jid in self.host.evacuating or jid in self.archiving
                    or (self.live.get(jid) == ckpt.name
                        and self.live_keeper.get(jid) == self.host.prestage.keeper.get(jid))):
                # (published again when its keeper changed: a record naming no keeper, or the old
                # one, let a claimer resume the job while its keeper resumed it too)
                continue
            self.archiving.add(jid)
            self.host._spawn(self.copy_periodic(job, ckpt))

    def periodic_due(self) -> bool:
        """The prestaging rule's unannounced branch: periodic checkpoints go to the archive too
        while departures without notice are plausible (a job whose node and keeper both leave
        without notice then rolls back only to its last periodic checkpoint)."""
        return (self.archive.root() is not None
                and unannounced_plausible(self.host.evidence.notice_odds.unannounced_frac, float(self.host.s["prestage_unannounced"])))

    def publish_live(self, key: str, ckpt: Path, record: dict[str, Any]) -> Path | None:
        """Copies the committed periodic checkpoint ``ckpt`` of the running job ``key`` into the
        archive (the same layout and checks as :meth:`StoppedCopies.publish`), then points the job's live
        record (``live.json``, signed by this node: who runs it, its keeper, its request) at it and
        removes the older archived checkpoints: the newest complete one is kept. A stopped job's
        record (``guard.json``, a claim, a running record, a ``.done`` marker: verified ones) is
        never touched: then nothing is written and None is returned. Blocking file I/O (the
        lane). Raises OSError/CheckpointError (a corrupt copy is removed, never published)."""
        root = self.archive.root()
        assert root is not None
        with self.archive.view(root) as v:
            d = self.archive.stopped.key_dir_made(v, key)

            def stopped() -> bool:
                # (a ``.done`` marker: the key was claimed, run elsewhere and swept; this copy runs on
                # only because a partition kept it from hearing so: a new live record would be
                # claimed a second time. bench/chaos.py --long-partitions)
                v.forget(key)
                return v.read(key, "guard.json") is not None or bool(v.claims(key)) or v.done(key) is not None

            if stopped():
                return None
            digest, nbytes, files = self.archive.stopped.publish_copy(ckpt, d, None, None, int(record["request"]["owner_uid"]))
            tmpj = f".live-{self.host.node_id}-{time.monotonic_ns()}.tmp"
            archive_fs.replace(d, LIVE_RECORD, v.auth.seal(
                owner_body("live", record, ckpt.name, digest, nbytes, files, time.time())), tmpj)
            if stopped():
                # a node claimed the previous live record meanwhile (it thinks this node is dead):
                # that claim is the lock; this record must not be a second one
                with contextlib.suppress(OSError):
                    os.unlink(LIVE_RECORD, dir_fd=d)
                return None
            for old in v.names(key):
                if _CKPT_STEP.fullmatch(old) and old != ckpt.name and not stopped():
                    archive_fs.remove_tree(d, old)
        return root / key / ckpt.name

    def own_live_records(self, root: Path) -> dict[str, str]:
        """{job id: checkpoint} of the verified live records in the archive of this node's jobs
        (at start: at most 16 x ARCHIVE_SCAN_MAX entries of the root are looked at; blocking:
        the lane)."""
        out: dict[str, str] = {}
        prefix = f"n{self.host.node_id}-"
        with contextlib.suppress(OSError, MigrateError), self.archive.view(root, create=False) as v:
            for key in archive_fs.names(v.rootfd, 16 * ARCHIVE_SCAN_MAX)[0]:
                if key.startswith(prefix) and (s := v.read(key, LIVE_RECORD)) is not None:
                    out[key[len(prefix):]] = str(s.body["ckpt"])
        return out

    @staticmethod
    def live_held(v: View, key: str) -> bool:
        """The key's directory holds its live record, or a claim of it that no node runs yet."""
        v.forget(key)
        claims = v.claims(key)
        return (v.read(key, LIVE_RECORD) is not None
                or (any(c.name.startswith("claimed-") for c in claims) and not any(c.name.startswith("running-")
                                                                                 for c in claims)))

    def drop_live(self, key: str) -> bool:
        """The job ended here (by itself, stopped, failed, or moved by a reclaim): its live record
        and archived periodic checkpoints go. The record (this node's own, verified) is taken by
        rename first, so a node that claimed it meanwhile keeps it (and its checkpoint). True
        when removed."""
        v = self.archive.view_or_none()
        if v is None:
            return False
        with v:
            return self.drop_live_in(v, key)

    def drop_live_in(self, v: View, key: str) -> bool:
        d = v.dir(key)
        if d is None or v.read(key, LIVE_RECORD) is None:
            return False
        old = f".live-{self.host.node_id}-{time.monotonic_ns()}.old"
        try:
            os.rename(LIVE_RECORD, old, src_dir_fd=d, dst_dir_fd=d)
        except OSError:
            return False
        v.forget(key)
        if v.read(key, "guard.json") is not None or v.claims(key):
            with contextlib.suppress(OSError):
                os.unlink(old, dir_fd=d)
            return False
        return self.archive.gc.tombstone_in(v, None, key)

    def given_resume_from(self, job: Any, root: Path) -> str | None:
        """The job's ``resume_from`` when the agent gave it (recorded so by the job manager:
        laminar.runtime.provenance; a path in its state directory: a replica, its owner's copy, a
        requeued job's own checkpoint; or in the archive), else None. One its user set is never
        taken for the agent's: root copied such a path (another user's checkpoint) into the
        archive as the job's state. The round's look (on the lane) stats it, and copies it when
        the job has written nothing since: a path of the job's user's own, on storage of theirs
        that may hang, would hold the archive's one thread (and every claim and publish behind
        it) for as long. Never touches the path."""
        rf = getattr(getattr(job, "origin", None), "resume_given", None)
        if not rf:
            return None
        p = Path(os.path.normpath(str(rf)))
        state = Path(os.path.normpath(str(self.host.agent.config.state_dir)))
        return str(rf) if state in p.parents else None

    async def copy_periodic(self, job: Any, ckpt: Path) -> None:
        key = self.host.job_key(job)
        keeper = self.host.prestage.keeper.get(job.id)
        rf = getattr(job.spec, "resume_from", None)
        record = {"key": key, "src_node": self.host.node_id, "src_job": job.id, "buddy": keeper,
                  "request": self.host.mover.request(job, False), "periodic": True,
                  # the checkpoint it resumed from, not one it wrote: what it resumed from stays (Sweep.sweep)
                  "resumed_copy": bool(rf) and Path(str(rf)) == ckpt}
        try:
            path = await self.archive.lane.call(f"periodic copy of {job.id}", self.publish_live, key, ckpt, record)
            if path is not None:
                self.live[job.id] = ckpt.name
                self.live_keeper[job.id] = keeper
                self.host.counts["archived_periodic"] = self.host.counts.get("archived_periodic", 0) + 1
                self.host._emit(f"{job.id}: periodic {ckpt.name} archived (node and keeper leaving without notice would "
                                "roll it back only to here)", persist=False, job=job.id, ckpt=ckpt.name,
                                phase="archived-periodic")
        except (OSError, jobkit.CheckpointError) as e:  # removed by the job's keep meanwhile, a full archive
            log.info("migrate: archiving periodic %s of %s failed: %s", ckpt.name, job.id, e)
        finally:
            self.archiving.discard(job.id)
