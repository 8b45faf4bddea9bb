"""The copy of a stopped job's checkpoint and its keeper record in the archive
(:class:`StoppedCopies`, the ``stopped`` of :class:`laminar.migrate.archive.Archive`; the records
and their claim: that module's doc): written when no live peer can hold the job (a reclaim with
no keeper, a reclaimed keeper with no peer to pass to) and by a keeper as soon as it finds no room.

A reclaim waits for the archive only until ``ARCHIVE_WAIT_MARGIN_S`` before its window ends
(:meth:`StoppedCopies.publish_until`): its move then fails as with no archive (the job's keeper
still keeps it) and the copy it waited for is given up (:class:`laminar.migrate.archive_lane.ArchiveWait`): when the storage
answers, it publishes nothing; a reclaimed keeper's copy of a job it passes on is the exception,
published late (it is the job's only way back, and every taker claims it through the archive).
So is the copy of a job with no keeper and no keeper, and it survives an agent stop or crash
(``migrate_late_copies``; :meth:`StoppedCopies.restore_late_copies`): its "about to publish" is
committed before its record's rename, so a restart publishes it at most once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar import jobkit
from laminar.airlock.cgroups import set_frozen_async
from laminar.components import jobs_of
from laminar.migrate import archive_fs
from laminar.migrate.archive_auth import PRESIGNED, Refused, canonical, manifest_digest, owner_body
from laminar.migrate.archive_lane import ArchiveGivenUp, ArchiveWait
from laminar.migrate.archive_view import LIVE_RECORD, View
from laminar.migrate.constants import _SAFE_KEY
from laminar.migrate.errors import MigrateError
from laminar.policy.endcause import LATE_COPY_TAKEN_UP, EndCause

if TYPE_CHECKING:
    from laminar.migrate.archive import Archive

log = logging.getLogger("laminar.migrate")

# A reclaim waits for the archive's answer (the copy of a job no live peer can keep, a keeper passed
# on) until this long before its window ends, and no longer: a hung archive then fails the move
# (its job thawed, its keeper still keeping it) and says so before the window's end stops what
# still runs, rather than the move being cut there in the middle, with nothing said.
ARCHIVE_WAIT_MARGIN_S = 1.0


class StoppedCopies:
    """The copy of a stopped job's checkpoint and its records (see the module's doc).
    A piece of the part :class:`laminar.migrate.archive.Archive` (its ``stopped``), built with it. ``archive``: the part."""

    def __init__(self, archive: Archive) -> None:
        self.archive = archive
        self.host = archive.host
        self.late_stopping: set[str] = set()  # jobs a restart stops: their record was being archived

    def publish(self, key: str, ckpt: Path, record: dict[str, Any], wait: ArchiveWait | None = None,
                 mark: Callable[[], None] | None = None) -> Path:
        """Copies the verified checkpoint ``ckpt`` of ``key`` into the archive and (unless a node
        claimed or runs it) writes its keeper record ``guard.json``, both atomically (a temporary
        name, fsync, rename): the archived checkpoint's path. The record is signed by this node
        for its own job; for another node's (a keeper's publish) it is the one that node signed
        and handed the keeper with (``record["request"][PRESIGNED]``), for this very checkpoint,
        or nothing is published (OSError). Raises OSError/CheckpointError. ``wait``: its
        waiter's deadline (:class:`ArchiveWait`); once given up, nothing more is published (its
        temporaries are removed) and ArchiveGivenUp is raised. ``mark``: called (here, on the
        lane) right before the record is put in place, once it will be: a late copy's durable
        "about to publish" (:meth:`late_mark`)."""
        root = self.archive.root()
        assert root is not None
        with self.archive.view(root) as v:
            d = self.key_dir_made(v, key)
            signed = self._presigned(v, key, record)
            if signed is not None and signed["body"]["ckpt"] != ckpt.name:
                raise OSError(f"{key}: the record node {record['src_node']} signed names {signed['body']['ckpt']}, "
                              f"this keeper holds {ckpt.name}: not archived")
            digest, nbytes, files = self.publish_copy(ckpt, d, wait, None if signed is None else
                                                      str(signed["body"]["manifest_sha256"]),
                                                      int(record["request"]["owner_uid"]))
            v.forget(key)
            taken = bool(v.claims(key))
            tmpj = f".guard-{self.host.node_id}-{time.monotonic_ns()}.tmp"
            if not taken:
                data = canonical(signed) if signed is not None else v.auth.seal(
                    owner_body("guard", record, ckpt.name, digest, nbytes, files, time.time()))
                archive_fs.write_new(d, tmpj, data)
            if wait is not None and not wait.publish():
                # the move that wanted it went on without it (a copy already renamed into place stays: a
                # record of another node may name it; with no record of its own it is an operator's call)
                with contextlib.suppress(OSError):
                    os.unlink(tmpj, dir_fd=d)
                log.info("migrate: archive %s answered after the wait for %s's copy ended: no record published", root,
                         key)
                raise ArchiveGivenUp(f"archive of {key} given up by its waiter")
            if not taken and mark is not None:
                mark()
            old_live = f".live-{self.host.node_id}-{time.monotonic_ns()}.old"
            if not taken and LIVE_RECORD in v.names(key):
                # the job's periodic record becomes its keeper record: taken by rename (atomic), so a
                # node that claimed it meanwhile keeps it and no second claimable record appears
                try:
                    os.rename(LIVE_RECORD, old_live, src_dir_fd=d, dst_dir_fd=d)
                except OSError:
                    taken = True
            if not taken:
                os.rename(tmpj, "guard.json", src_dir_fd=d, dst_dir_fd=d)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(tmpj, dir_fd=d)
            with contextlib.suppress(OSError):
                os.unlink(old_live, dir_fd=d)
        return root / key / ckpt.name

    def key_dir_made(self, v: View, key: str) -> int:
        """The fd of ``<archive>/<key>``, made 0700 when missing (root's alone: its records carry
        the job's request, env values included, and its checkpoints are a user's); OSError when
        it is a link, not a directory or another owner's (counted: never written through)."""
        if not _SAFE_KEY.match(key):
            raise OSError(f"archive: {key!r} is not a job key")
        try:
            d = v.dir(key, create=True)
        except Refused as e:
            raise OSError(f"archive {v.root}: {key}: {e}; nothing written there") from None
        assert d is not None
        return d

    def _presigned(self, v: View, key: str, record: dict[str, Any]) -> dict[str, Any] | None:
        """The envelope this node publishes for another node's job (as its keeper): the keeper
        record that job's node signed and handed the keeper with (:data:`PRESIGNED` in the
        request), once it verifies here; None for this node's own job (it signs it itself).
        OSError when there is none or it does not verify: only a job's node speaks for its job."""
        src = int(record["src_node"])
        if src == self.host.node_id:
            return None
        env = (record.get("request") or {}).get(PRESIGNED)
        if not isinstance(env, dict):
            raise OSError(f"{key}: node {src} handed its keeper no signed record to publish (an agent from before "
                          "archive authentication): not archived; this keeper keeps the job")
        try:
            v.auth.open_obj(env, name="guard.json", dir_key=key)
        except Refused as e:
            raise OSError(f"{key}: the record node {src} signed for its keeper is refused here ({e}): not archived") \
                from None
        return env

    async def publish_until(self, what: str, key: str, ckpt: Path, record: dict[str, Any], until: float,
                             late_ok: bool = False,
                             settled: Callable[[BaseException | None], None] | None = None,
                             mark: Callable[[], None] | None = None, wait: ArchiveWait | None = None) -> Path:
        """:meth:`publish` on the lane, waited for until ``until`` (monotonic) and no longer: a
        reclaim's copy, which must be made within its window while the archive may hang. The
        archived path; OSError/CheckpointError as :meth:`publish`. Raises MigrateError naming
        the archive and the time waited when it has not answered by then (or the wait's task is
        cancelled: the window's end). The work may still be in hand on the lane then, waiting on
        the storage, or queued behind what is: it is given up (:class:`ArchiveWait`; dropped
        from the queue, and a late answer publishes nothing), so what the caller does instead
        stays true; except with ``late_ok`` (a late copy is still wanted, and whoever resumes the
        job claims it there first), when it goes on and says so once it is done (and calls
        ``settled`` on the event loop: with None once the copy is there, with the error when the
        storage refused it). A copy whose record the lane was putting in place when the time ran
        out counts as archived. ``mark``: as :meth:`publish`'s. ``wait``: with ``late_ok``, the
        caller's :class:`ArchiveWait`, given up only if this wait is cancelled (the caller's job
        is thawed and runs on: a copy published later would be a second one); its state says
        whether it was."""
        root = self.archive.root()
        assert root is not None
        if not late_ok:
            wait = ArchiveWait()
        t0 = time.monotonic()
        fut = self.archive.lane.call(what, self.publish, key, ckpt, record, wait, mark)
        try:
            done, _ = await asyncio.wait({fut}, timeout=max(0.0, until - t0))
        except asyncio.CancelledError:
            if wait is not None and wait.give_up():
                fut.cancel()  # dropped while queued; in hand, it publishes nothing
            fut.add_done_callback(self._late(what, late_ok, settled))
            raise
        if done:
            return Path(fut.result())
        waited = time.monotonic() - t0
        if late_ok:  # it goes on
            fut.add_done_callback(self._late(what, late_ok, settled))
        elif wait is not None and not wait.give_up():
            log.info("migrate: %s: the record was being put in place in archive %s when %.1f s were up: counted as "
                     "archived", what, root, waited)
            fut.add_done_callback(self._late(what, late_ok, settled))
            return root / key / ckpt.name
        else:
            fut.cancel()
        raise MigrateError(f"archive {root} did not answer in {waited:.1f} s ({what})")

    def _late(self, what: str, late_ok: bool, settled: Callable[[BaseException | None], None] | None = None
                      ) -> Callable[[asyncio.Future[Any]], None]:
        """The end of a publish :meth:`publish_until` stopped waiting for: said (with ``late_ok``,
        its late copy, with an event, after ``settled(None)``; its failure after
        ``settled(error)``), its error taken."""
        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled():
                return
            e = fut.exception()
            if late_ok and settled is not None and not isinstance(e, ArchiveGivenUp):
                settled(e)
            if e is None and late_ok:
                self.host._emit(f"{what}: the archive answered late; the copy is there now", phase="archived-late")
            elif e is not None and not isinstance(e, ArchiveGivenUp):
                log.info("migrate: %s, after its wait ended: %s", what, e)
        return done

    def late_row_add(self, key: str, job_id: str, ckpt: Path, record: dict[str, Any]) -> None:
        """Before a copy that may go on past its window's wait starts: what a restart needs to
        take it up (:meth:`restore_late_copies`)."""
        with self.host.agent.store.tx() as db:
            db.execute("INSERT OR REPLACE INTO migrate_late_copies VALUES (?, ?, ?, ?, 0, 0, ?)",
                       (key, job_id, str(ckpt), json.dumps(record), time.time()))

    def late_row_late(self, key: str) -> None:
        """The copy goes on past its window's wait, and its job is stopped for it."""
        with self.host.agent.store.tx() as db:
            db.execute("UPDATE migrate_late_copies SET late=1 WHERE key=?", (key,))

    def late_row_drop(self, key: str) -> None:
        with self.host.agent.store.tx() as db:
            db.execute("DELETE FROM migrate_late_copies WHERE key=?", (key,))

    def late_mark(self, key: str) -> None:
        """On the lane, right before the copy's record is put in place: ``publishing``, committed
        (synchronous=FULL) before the rename, so a restart that reads 0 knows the record never
        was (at most once: it may publish it). Through a connection of its own, not the loop's:
        its transaction is this one write's alone."""
        db = sqlite3.connect(str(self.host.agent.store.path), isolation_level=None, timeout=30.0)
        try:
            db.execute("PRAGMA synchronous=FULL")
            db.execute("UPDATE migrate_late_copies SET publishing=1 WHERE key=?", (key,))
        finally:
            db.close()

    def restore_late_copies(self) -> None:
        """At start: a late copy the agent's stop or crash cut (``migrate_late_copies``) is taken
        up again when its job is still ``reclaimed`` here and stopped for good by the reclaim
        (its end cause in :data:`~laminar.policy.endcause.LATE_COPY_TAKEN_UP`; its checkpoint is
        only in its ckpt directory): published if its record never was; a record ``publishing`` when
        the agent stopped is looked for in the archive and never written twice
        (:meth:`_late_again`). A job still running here whose record was ``publishing`` (the
        agent stopped between the publish and the job's stop) is stopped now, as it would have
        been, and left out of the restored reclaim's moves (:attr:`late_stopping`): the archive is
        its way back, so it runs once. Any other row (a job the agent stopped before it stopped:
        the restored reclaim moves it again) is dropped, with an event when its record may be in
        the archive (another agent may resume the job too)."""
        jobs_mgr = self.host.agent.jobs
        rows = self.host.agent.store.db.execute("SELECT * FROM migrate_late_copies").fetchall()
        for r in rows:
            key, job_id, publishing = str(r["key"]), str(r["job_id"]), bool(r["publishing"])
            job = jobs_mgr.get(job_id) if jobs_mgr is not None else None
            state = getattr(job, "state", None)
            active = state in ("running", "suspended")
            for_copy = state == "reclaimed" and getattr(job, "end_cause", None) in LATE_COPY_TAKEN_UP
            try:
                record = json.loads(r["record"])
            except ValueError:
                record = None
            if (self.archive.root() is None or not isinstance(record, dict)
                    or not ((for_copy and (r["late"] or publishing)) or (active and publishing))):
                self.late_row_drop(key)
                if publishing and not for_copy:
                    # its record may be in the archive, claimable, while the job is here too
                    self.host._emit(f"{job_id}: its copy to the archive (key {key}) was being published when the agent "
                               f"stopped, and the job is {state or 'gone'} here: if the archive holds its record, "
                               "another agent may resume it as well; check `laminarctl migrations`", job=job_id,
                               key=key, phase="archive-uncertain")
                else:
                    log.info("migrate: a copy of %s to the archive cut by the agent's stop is not taken up: the job "
                             "is %s here%s", job_id, state or "gone",
                             "" if isinstance(record, dict) else " (its stored record is not a JSON object)")
                continue
            if active:
                self.late_stopping.add(job_id)
                self.host._spawn(self._late_stop_then_copy(job, key, Path(r["ckpt"]), record))
            else:
                self.host._spawn(self._late_copy_again(key, job_id, Path(r["ckpt"]), record, publishing))

    async def _late_stop_then_copy(self, job: Any, key: str, ckpt: Path, record: dict[str, Any]) -> None:
        """A job whose archived record was being published when the agent stopped, before the
        job did: stopped here (``reclaimed``) as it would have been, then its copy is seen to."""
        try:
            with contextlib.suppress(Exception):
                await set_frozen_async(job.cgroup, False, 2.0)  # a frozen job is not killed by a signal until it thaws
            try:
                await jobs_of(self.host.agent).stop(job.id, f"node {self.host.node_id} reclaimed: {ckpt.name} was being published "
                                                "in the archive when the agent stopped; the first agent with room resumes "
                                                "the job from there", grace_s=0, state="reclaimed",
                                                cause=EndCause.ARCHIVED)
            except Exception as e:
                log.warning("migrate: stopping %s, archived before the restart: %s", job.id, e)
            await self._late_copy_again(key, job.id, ckpt, record, True)
        finally:
            self.late_stopping.discard(job.id)

    async def _late_copy_again(self, key: str, job_id: str, ckpt: Path, record: dict[str, Any],
                               publishing: bool) -> None:
        """A late copy taken up after a restart: on the lane (waited for as long as the archive
        takes: it is the job's only way back), its move shown (``archiving``, then ``archived``
        or ``failed``) and said with events."""
        from laminar.migrate.reclaim import Move

        mv = Move(job_id, key, "a late archive copy taken up after the agent's restart", phase="archiving",
                  ckpt=ckpt.name, ended=time.time())
        self.host.moves[job_id] = mv
        self.host.counts["archive_late_resumed"] = self.host.counts.get("archive_late_resumed", 0) + 1
        self.host._emit(f"{job_id}: its copy of {ckpt.name} to the archive was cut by the agent's stop; taken up again",
                        job=job_id, ckpt=ckpt.name, phase="archiving")
        try:
            res = await self.archive.lane.call(f"archiving {job_id} again", self._late_again, key, ckpt, record, publishing)
        except (OSError, jobkit.CheckpointError, MigrateError) as e:
            self.late_row_drop(key)
            self.host.keepers.late_copy_settled(mv, e)
            return
        self.late_row_drop(key)
        self.host.keepers.late_copy_settled(mv, None)
        if res == "gone":
            self.host._emit(f"{job_id}: its record was being put in the archive when the agent stopped, and nothing "
                            f"of it is there now (claimed and run to its end elsewhere, or removed): not published "
                            f"again (the job would run twice); {ckpt.name} stays in its ckpt directory here",
                            job=job_id, key=key, phase="archived")
        else:
            self.host._emit(f"{job_id}: {ckpt.name} is in the archive ({res} after the agent's restart); the first "
                            "agent with room resumes it", job=job_id, ckpt=ckpt.name, phase="archived-late")

    def _late_again(self, key: str, ckpt: Path, record: dict[str, Any], publishing: bool) -> str:
        """On the lane: a late copy after a restart. With ``publishing`` its record may already be
        in place: a verified record of the key there (``guard.json``, a claim, a runner) is it
        ("published"); a temporary record of this node's (``.guard-<node>-*.tmp``, removed by
        the rename only) says the rename never happened (published now); neither says it was
        published and has since gone (claimed, run to its end elsewhere and removed, or the
        temporary removed as stale): "gone", nothing published. Otherwise the copy is made
        ("published now"). Raises OSError/CheckpointError/MigrateError."""
        root = self.archive.root()
        if root is None:
            raise MigrateError("migrate.archive_dir is not set any more")
        if publishing:
            with self.archive.view(root) as v:
                if v.read(key, "guard.json") is not None or v.claims(key):
                    return "published"
                if not any(n.startswith(f".guard-{self.host.node_id}-") and n.endswith(".tmp") for n in v.names(key)):
                    return "gone"
        jobkit.verify_checkpoint(ckpt)
        self.publish(key, ckpt, record, None, mark=lambda: self.late_mark(key))
        return "published now"

    def publish_copy(self, ckpt: Path, d: int, wait: ArchiveWait | None = None, expect: str | None = None,
                      owner_uid: int | None = None) -> tuple[str, int, int]:
        """Copies the checkpoint ``ckpt`` (a local directory) into the key directory ``d`` as
        ``ckpt.name``: (its manifest's SHA-256, bytes, files). Only the files its manifest lists
        are read, through an fd of ``ckpt`` opened without following a link, each opened without
        following a link or waiting, hashed as it is copied and compared with the manifest;
        under a temporary name, fsync'd, renamed into place (a complete copy of this very
        manifest already there is kept; an incomplete leftover of the name is replaced). A job's
        own checkpoint (outside the agent's state directory) must be owned by ``owner_uid``: a
        job cannot make root copy another user's files into its record. ``expect``: the manifest
        digest a presigned record names (another is refused). Raises OSError/CheckpointError (a
        failed copy is removed, never published); ArchiveGivenUp once its ``wait`` was given up."""
        try:
            src = os.open(ckpt, archive_fs.O_DIR)
        except OSError as e:
            raise jobkit.CheckpointError(f"checkpoint {ckpt}: not a directory ({e.strerror or e})") from None
        try:
            if owner_uid and not self._in_state_dir(ckpt) and os.fstat(src).st_uid != owner_uid:
                raise jobkit.CheckpointError(f"checkpoint {ckpt} is owned by uid {os.fstat(src).st_uid}, not by the "
                                             f"job's owner (uid {owner_uid}): not archived")
            try:
                raw = archive_fs.read_small(src, jobkit.MANIFEST, jobkit.MAX_MANIFEST_BYTES)
                m = archive_fs.parse_manifest(raw, str(ckpt))
            except FileNotFoundError:
                raise jobkit.CheckpointError(f"checkpoint {ckpt}: no {jobkit.MANIFEST}") from None
            except Refused as e:
                raise jobkit.CheckpointError(f"checkpoint {ckpt}: {e}") from None
            digest = manifest_digest(raw)
            if expect is not None and digest != expect:
                raise jobkit.CheckpointError(f"checkpoint {ckpt}: its manifest is not the one its job's node signed")
            facts = (digest, sum(int(f["size"]) for f in m["files"]), len(m["files"]))
            try:
                have = archive_fs.open_dir(d, ckpt.name)
            except (OSError, Refused):
                have = None
            if have is not None:
                try:
                    same = manifest_digest(archive_fs.read_small(have, jobkit.MANIFEST, jobkit.MAX_MANIFEST_BYTES)) \
                        == digest
                except (OSError, Refused):
                    same = False
                finally:
                    os.close(have)
                if same:
                    return facts
            tmp = f".tmp-{ckpt.name}-{self.host.node_id}-{time.monotonic_ns()}"
            os.mkdir(tmp, 0o700, dir_fd=d)
            try:
                tfd = archive_fs.open_dir(d, tmp)
                try:
                    archive_fs.copy_checkpoint(src, tfd, raw, str(ckpt))
                finally:
                    os.close(tfd)
                if wait is not None and wait.given_up:
                    raise ArchiveGivenUp(f"copy of {ckpt.name} given up by its waiter")
                archive_fs.remove_tree(d, ckpt.name)  # an incomplete leftover of that name
                os.rename(tmp, ckpt.name, src_dir_fd=d, dst_dir_fd=d)
            except Refused as e:
                archive_fs.remove_tree(d, tmp)
                raise jobkit.CheckpointError(f"checkpoint {ckpt}: {e}") from None
            except BaseException:
                archive_fs.remove_tree(d, tmp)
                raise
            return facts
        finally:
            os.close(src)

    def _in_state_dir(self, p: Path) -> bool:
        state = self.host.agent.config.state_dir
        return state is not None and Path(os.path.normpath(str(state))) in Path(os.path.normpath(str(p))).parents

    def publish_unless_archived(self, key: str, ckpt: Path, record: dict[str, Any]) -> Path | None:
        """:meth:`publish` unless the archive holds a record of ``key`` already (blocking)."""
        return None if self.archive.archived(key) else self.publish(key, ckpt, record)
