"""The archive's sweep (:class:`Sweep`, the ``gc`` of :class:`laminar.migrate.archive.Archive`).

**What the archive keeps, and what goes** (:meth:`Sweep.sweep`, every ``archive_gc_s``, 10 s,
by each agent). A claim that started its job leaves ``<archive>/<key>/`` behind
with ``running-<node>.json`` (the record, now naming where the job was resumed: its node and job
id) and the checkpoint it resumed from. That directory is removed once the job no longer needs
it: when the job it resumed **ended** where it runs (exited, or stopped by its user; the agent
running it removes it), or when the job's **newer state is safe** in the archive under its new
key (``n<node>-<job>``: a record whose checkpoint the job wrote itself after it resumed, verified
against its manifest; any agent removes it). Never removed: a directory with ``guard.json``,
``live.json`` or a ``claimed-*`` record (claimable, being claimed, or a claim whose node died,
which another agent takes over after ``ARCHIVE_CLAIM_STALE_S``); a running record whose job
failed to start, was lost, moved on or is still queued without a newer archived checkpoint; a
directory with a checkpoint and no record at all (a publish in progress, or a crash's only
copy: an operator's call). Temporary names (``.tmp-*`` partial copies, ``.guard-*``/
``.live-*``/``.running-*`` partial records and renamed-away ``.live-*.old`` ones) whose newest
file is older than ``ARCHIVE_TMP_STALE_S``, and directories with nothing in them for as long,
are a crashed writer's: whichever agent sees them removes them. Every removal is a rename into
``<archive>/.gc/`` first (one agent wins; a half-removed tree is never mistaken for a job), then
the tombstone's removal; symbolic links are never followed (one is removed as a link), and
nothing outside ``archive_dir`` is touched. The counts are in the component's status
(``counts``: ``archive_gc_dirs``, by why ``archive_gc_ended``/``_superseded``/``_empty``, and
``archive_gc_temporaries``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar.migrate import archive_fs
from laminar.migrate.archive_auth import Refused
from laminar.migrate.archive_view import _NODE_FILE, ARCHIVE_SCAN_MAX, DONE_DIR, LIVE_RECORD, View
from laminar.migrate.constants import _SAFE_KEY
from laminar.migrate.errors import MigrateError

if TYPE_CHECKING:
    from laminar.migrate.archive import Archive

log = logging.getLogger("laminar.migrate")

# A temporary name in the archive (a partial copy or record) whose newest file is this old is a
# crashed writer's: any agent removes it. A copy in progress writes its files as it goes, so only
# a writer stalled this long loses its temporary (its rename then fails: nothing is published).
ARCHIVE_TMP_STALE_S = 3600.0
# How often each agent sweeps the archive (listing it on shared storage is not free): the default
# of ``[migrate] archive_gc_s``.
ARCHIVE_GC_S = 10.0
# Removals are renamed here first (one agent wins the rename), then removed.
ARCHIVE_TRASH = ".gc"
# A key whose claimed job ended or was superseded (the sweep removed its directory) leaves a marker
# here, ``<archive>/.done/<key>``, naming who ran it (signed): without it a keeper of that key
# that missed the claim (down, cut off) found nothing archived, published its older checkpoint
# again and another agent resumed the job a second time (bench/chaos.py). Kept
# ARCHIVE_DONE_KEEP_S by the time it signed.
ARCHIVE_DONE = DONE_DIR
# Kept at least as long as a claimable record is (archive_auth.RECORD_MAX_AGE_S, a day less): a
# copy of a claimed record planted again after its marker went is refused as expired.
ARCHIVE_DONE_KEEP_S = 30 * 86400.0
ARCHIVE_DONE_EXPIRE_EVERY_S = 3600.0  # the markers are looked over for expiry this often, not at every sweep


class Sweep:
    """The archive's sweep (see the module's doc).
    A piece of the part :class:`laminar.migrate.archive.Archive` (its ``gc``), built with it. ``archive``: the part."""

    def __init__(self, archive: Archive) -> None:
        self.archive = archive
        self.host = archive.host
        self._gc_next = 0.0  # when this agent sweeps the archive next (monotonic)
        self._gc_running = False
        self._done_expired: float | None = None  # when the sweep last expired <archive>/.done markers (wall)
        self.gc_unverified: set[tuple[str, str]] = set()  # (key, ckpt) that failed verification: not re-hashed

    def start_sweep(self) -> None:
        """Every ``archive_gc_s``: the archive sweep (:meth:`sweep`) in a thread, one at a time."""
        if self._gc_running or time.monotonic() < self._gc_next:
            return
        self._gc_next = time.monotonic() + float(self.host.s["archive_gc_s"])
        self._gc_running = True
        self.host._spawn(self._gc_task(self._gc_ended()))

    def _gc_ended(self) -> dict[str, set[str]]:
        """Archive key -> ids of this node's jobs resumed from it (their origin, as the job
        manager stored it: laminar.runtime.provenance; never a job's env, which its user writes)
        that ended by themselves (exited) or were stopped by their user: they need nothing from
        it any more. A job that failed to start, was lost, moved or reclaimed is not here: its
        state may still be needed from the archive. One indexed query, no spec decoded."""
        jobs = self.host.agent.jobs
        return jobs.table.ended_origins(("exited", "stopped")) if jobs is not None else {}

    async def _gc_task(self, ended: dict[str, set[str]]) -> None:
        try:
            res = await self.archive.lane.call("archive sweep", self.sweep, ended)
            for key, why in res["removed"].items():
                self.host._emit(f"archive: {key} removed ({why})", persist=False, key=key, phase="archive-removed", why=why)
        except Exception:  # a bug or the storage: the next sweep tries again
            log.exception("migrate: archive sweep")
        finally:
            self._gc_running = False

    def sweep(self, ended: dict[str, set[str]] | None = None, now: float | None = None,
                   tmp_stale_s: float = ARCHIVE_TMP_STALE_S) -> dict[str, Any]:
        """One sweep of the archive (the rule is in the module's docs, *What the archive keeps, and
        what goes*) over the next ARCHIVE_SCAN_MAX entries of its root (:meth:`Archive.scan_keys`: a
        larger archive takes several sweeps). Per ``<archive>/<key>/`` (a real directory of the
        archive's owner: links and files at the top are not this agent's and are left alone):

        * temporary names (``.``-prefixed) whose newest file is older than ``tmp_stale_s`` go;
        * a directory whose only record is a verified ``running-<node>.json`` goes when the job
          resumed from it ended here (``ended``: key -> this node's job ids that exited or were
          stopped by their user, and the record names one of them, or, a record without
          ``resumed``, this node ran it) or when the record's ``resumed`` job holds a newer
          checkpoint it wrote itself under its own key, verified against the manifest its record
          signed (:meth:`_holds_safe_copy_in`);
        * a directory with nothing left in it for ``tmp_stale_s`` goes;
        * tombstones in ``<archive>/.gc`` older than ``tmp_stale_s`` (a crash mid-removal) go.

        Everything else stays (a directory holding a record that does not verify is an
        operator's call). Each removal is a rename into ``.gc`` (the agent whose rename wins
        removes it; a loser skips it) and then the tombstone's removal without following links.
        Blocking file I/O (the lane). Never raises for the storage (what cannot be read is
        kept). Returns ``{"removed": {key: why}, "temporaries": n, "tombstones": n}`` and adds
        them to ``counts`` (``archive_gc_dirs`` and one count per why, ``archive_gc_temporaries``)."""
        out: dict[str, Any] = {"removed": {}, "temporaries": 0, "tombstones": 0}
        now = time.time() if now is None else now
        try:
            v = self.archive.view_or_none()
        except (OSError, MigrateError):
            return out
        if v is None:
            return out
        with v:
            for key in self.archive.scan_keys(v, "_gc_scan"):
                d = v.dir(key)
                if d is None:
                    continue
                names = v.names(key)
                for n in names:
                    if n.startswith(".") and now - archive_fs.newest_mtime(d, n) > tmp_stale_s \
                            and self.tombstone_in(v, key, n):
                        out["temporaries"] += 1
                why, runner = self._gc_verdict_in(v, key, names, (ended or {}).get(key, set()), now, tmp_stale_s)
                if why in ("ended", "superseded") and runner is not None:
                    self.mark_done_in(v, key, runner, why, now)  # before the directory goes
                if why is not None and self.tombstone_in(v, None, key):
                    out["removed"][key] = why
            if self._done_expired is None or now - self._done_expired >= ARCHIVE_DONE_EXPIRE_EVERY_S:
                self._done_expired = now  # (listing them at every sweep grows with the claims on shared storage)
                self._expire_done(v, now, tmp_stale_s)
            trash = v.dir(ARCHIVE_TRASH)
            if trash is not None:
                with contextlib.suppress(OSError):
                    for t in archive_fs.names(trash, ARCHIVE_SCAN_MAX)[0]:
                        try:
                            born = int(t.rsplit(".", 1)[-1]) / 1e9
                        except ValueError:
                            born = archive_fs.newest_mtime(trash, t)
                        if now - born > tmp_stale_s:
                            archive_fs.remove_tree(trash, t)
                            out["tombstones"] += 1
        self.host.counts["archive_gc_dirs"] = self.host.counts.get("archive_gc_dirs", 0) + len(out["removed"])
        for why in out["removed"].values():  # archive_gc_ended, archive_gc_superseded, archive_gc_empty
            self.host.counts[f"archive_gc_{why}"] = self.host.counts.get(f"archive_gc_{why}", 0) + 1
        self.host.counts["archive_gc_temporaries"] = (self.host.counts.get("archive_gc_temporaries", 0) + out["temporaries"]
                                                      + out["tombstones"])
        return out

    def _expire_done(self, v: View, now: float, tmp_stale_s: float) -> None:
        """The next ARCHIVE_SCAN_MAX entries of ``<archive>/.done``: a verified marker whose signed
        time is older than ARCHIVE_DONE_KEEP_S goes, as does a crashed write's temporary;
        anything else stays (a marker that does not verify is never removed: an operator's call)."""
        d = v.dir(ARCHIVE_DONE)
        if d is None:
            return
        with contextlib.suppress(OSError):
            for e in self.archive.scan_page("_done_scan", str(v.root / ARCHIVE_DONE), d):
                t = e.name
                if t.startswith("."):
                    if now - archive_fs.newest_mtime(d, t) > tmp_stale_s:
                        with contextlib.suppress(OSError):
                            os.unlink(t, dir_fd=d)
                    continue
                s = v.done(t)
                if s is not None and now - float(s.body["at"]) > ARCHIVE_DONE_KEEP_S:
                    with contextlib.suppress(OSError):
                        os.unlink(t, dir_fd=d)

    def mark_done_in(self, v: View, key: str, runner: int, why: str, now: float) -> None:
        """``<archive>/.done/<key>``, signed by this node: the claimed job of ``key`` ran on node
        ``runner`` and ended (``why``: "ended there" on its own node, "ended", "superseded").
        Written whole under a temporary name of this write's own, then renamed (two sweepers
        marking one key at once each rename a whole record); never raises."""
        if not _SAFE_KEY.match(key):
            return
        try:
            d = v.dir(ARCHIVE_DONE, create=True)
            assert d is not None
            archive_fs.replace(d, key, v.auth.seal({"kind": "done", "key": key, "runner": int(runner), "why": why,
                                                    "at": now}),
                               f".{key}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        except (OSError, Refused) as e:
            log.warning("migrate: archive: cannot mark %s done: %s", key, e)

    def _gc_verdict_in(self, v: View, key: str, names: list[str], ended: set[str], now: float,
                       tmp_stale_s: float) -> tuple[str | None, int | None]:
        """Why the key's directory may go now ("ended", "superseded", "empty") and the node that
        ran its job (named by its marker), or (None, None): it stays. ``names``: its entries;
        ``ended``: this node's job ids resumed from it that ended. Only a verified running record
        decides; a directory with any other record (verified or not) stays."""
        recs = [n for n in names if n.endswith(".json") and not n.startswith(".")]
        if any(n in ("guard.json", LIVE_RECORD) or n.startswith("claimed-") for n in recs):
            return None, None  # claimable, being claimed, or a claim whose node died (taken over when stale)
        if not any(n.startswith("running-") for n in recs):
            v.forget(key)
            if v.names(key) or now - archive_fs.newest_mtime(v.rootfd, key) <= tmp_stale_s:
                return None, None  # a checkpoint without a record: a publish in progress or a crash's only copy
            return "empty", None
        runs = sorted(v.runs(key), key=lambda s: s.name)
        if not runs:
            return None, None
        runner, res = int(runs[0].body["writer"]), runs[0].body.get("resumed")
        if res is not None:
            node, job = int(res["node"]), str(res["job"])
            if node == self.host.node_id and job in ended:
                return "ended", runner
            succ = f"n{node}-{job}"
            if succ != key and not job.startswith(".") and self._holds_safe_copy_in(v, succ):
                return "superseded", runner
            return None, None
        if runner == self.host.node_id and ended:
            return "ended", runner  # a record without ``resumed``: this node claimed it and ran it here
        return None, None

    def _holds_safe_copy_in(self, v: View, key: str) -> bool:
        """``<archive>/<key>/`` has a verified record (live, keeper, claimed or running) naming a
        checkpoint the job wrote itself (not the copy of what it resumed from,
        ``resumed_copy``) whose manifest is the one the record signed and whose files match it
        (hashed in place). A checkpoint that failed is not hashed again."""
        if v.dir(key) is None:
            return False
        for n in v.names(key):
            if not (n in (LIVE_RECORD, "guard.json") or _NODE_FILE.fullmatch(n)):
                continue
            s = v.read(key, n)
            if s is None or s.owner.get("resumed_copy"):
                continue
            b = s.owner
            if (key, str(b["ckpt"])) in self.gc_unverified:
                continue
            try:
                self.archive.claims.check_payload(v, key, b)
            except (OSError, Refused) as e:
                log.info("migrate: archived %s/%s is no safe copy: %s", key, b["ckpt"], e)
                self.gc_unverified.add((key, str(b["ckpt"])))
                continue
            return True
        return False

    def tombstone(self, root: Path, path: Path) -> bool:
        """Removes ``path`` (an entry of the archive ``root`` or of one of its job directories)
        (:meth:`tombstone_in`). Raises ValueError for a path outside the archive."""
        if path.parent != root and path.parent.parent != root:
            raise ValueError(f"{path} is not an entry of the archive {root} or of one of its job directories")
        with self.archive.view(root, create=False) as v:
            return self.tombstone_in(v, None if path.parent == root else path.parent.name, path.name)

    def tombstone_in(self, v: View, key: str | None, name: str) -> bool:
        """Removes the entry ``name`` of the archive's root (``key`` None) or of the key's
        directory: renamed into ``<root>/.gc`` first (atomic: of two agents one wins; through
        directory fds, never a path a link could redirect), then removed without following
        links. True when this agent's rename won. A ``.gc`` that is not a real directory of the
        archive's owner (a link: counted) stops every removal."""
        try:
            trash = v.dir(ARCHIVE_TRASH, create=True)
        except (OSError, Refused):
            return False
        src = v.rootfd if key is None else v.dir(key)
        if trash is None or src is None:
            return False
        t = f"{name}.{self.host.node_id}.{time.time_ns()}"
        try:
            os.rename(name, t, src_dir_fd=src, dst_dir_fd=trash)
        except OSError:
            return False  # gone meanwhile (another agent won), or not ours to move
        v.forget(name if key is None else key)
        archive_fs.remove_tree(trash, t)
        return True
