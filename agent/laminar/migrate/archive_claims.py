"""Claims of archived jobs (:class:`Claims`, the ``claims`` of :class:`laminar.migrate.archive.Archive`;
the records and the rules: that module's doc, *The archive, the keeper of last resort*): a keeper record
no node took, the live record of a job whose node and keeper are gone, a claim gone stale, the running
record of a node that died; the claim itself (a rename, then a signed note), the checkpoint fetched
into this node's state directory and checked against its manifest, the resume, the claim given back
or noted done, and the question to a node that may still run the job (:meth:`Claims.still_runs`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar import jobkit
from laminar.migrate import archive_fs
from laminar.migrate.archive_auth import Refused, canonical, manifest_digest, owner_request
from laminar.migrate.archive_gc import ARCHIVE_TMP_STALE_S
from laminar.migrate.archive_view import (
    _CKPT_STEP,
    _NODE_FILE,
    _TMP_COPY,
    ARCHIVE_SCAN_MAX,
    LIVE_RECORD,
    Sealed,
    View,
)
from laminar.migrate.constants import SOURCE_LIVE_STATES
from laminar.migrate.errors import MigrateError

if TYPE_CHECKING:
    from laminar.migrate.archive import Archive

log = logging.getLogger("laminar.migrate")

# A job in these states on the node a claim asks (``still_runs``) ended there by itself, by its
# user, or moved elsewhere (its successor runs under its own key): not resumed again from the
# archive (the node's sweep removes the record: ended, or superseded). A job that failed there is
# (the archive keeps a failed job's state for that: ``Sweep._gc_ended``).
ARCHIVE_ENDED_THERE = ("exited", "stopped", "migrated")
# An archive claim this old whose node never ran the job (it died trying) may be taken by another.
ARCHIVE_CLAIM_STALE_S = 600.0
# Claims started per round; the rest wait for the next round (poll_s later).
ARCHIVE_CLAIMS_MAX = 4
# A checkpoint fetched from the archive leaves this much free on the state directory's disk.
ARCHIVE_FETCH_RESERVE = 256 << 20
# A claim no node runs yet is stale once this agent has seen it, unchanged, this long (its own
# clock: a file's mtime is anyone's to set).
CLAIMS_SEEN_KEEP = 4096
# an archived key: its node
_KEY_NODE = re.compile(r"n(\d{1,10})-.+")


def _newer_copy(dirfd: int, names: list[str], src: int, rec: dict[str, Any],
                wall: float) -> tuple[str, str, float] | None:
    """The copy of a newer checkpoint of the job that node ``src`` is making in its key
    directory (``dirfd``, whose entries are ``names``) while the job's live record ``rec`` (a
    verified body) names an older one: (the record's checkpoint, the newer one's name, the
    progress between them in seconds: when the copy began, its temporary's mtime, less the
    record's time), or None. A temporary older than ARCHIVE_TMP_STALE_S is a crashed writer's
    and does not count (nor does one that is not a directory)."""
    ts, have = float(rec["ts"]), str(rec["ckpt"])
    m_have = _CKPT_STEP.fullmatch(have)
    best: tuple[str, str, float] | None = None
    for n in names:
        m = _TMP_COPY.fullmatch(n)
        if m is None or int(m[2]) != src or m[1] == have:
            continue
        m_new = _CKPT_STEP.fullmatch(m[1])
        if m_have is not None and (m_new is None or int(m_new[1]) <= int(m_have[1])):
            continue  # not newer than the record's
        try:
            st = archive_fs.lstat_at(dirfd, n)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or wall - st.st_mtime > ARCHIVE_TMP_STALE_S:
            continue
        gain = min(max(st.st_mtime - ts, 0.0), ARCHIVE_TMP_STALE_S)
        if best is None or gain < best[2]:
            best = (have, m[1], gain)
    return best


class Claims:
    """Claims of archived jobs, their fetch and their resume (see the module's doc).
    A piece of the part :class:`laminar.migrate.archive.Archive` (its ``claims``), built with it. ``archive``: the part."""

    def __init__(self, archive: Archive) -> None:
        self.archive = archive
        self.host = archive.host
        self.next_try: dict[str, float] = {}  # archived key -> when this node tries it again (monotonic)
        self._tries: dict[str, int] = {}
        # archived key -> the job a node dead by its window answered runs there (said once: still_runs)
        self.runs_told: dict[str, str] = {}
        self._claimed_from: dict[str, str] = {}  # archived key -> the record this node's claim took (unclaim)
        # archived keys whose live record waits, not claimed, for its node's newer copy: since (monotonic)
        self.live_waits: dict[str, float] = {}
        # (key, claim file, inode, ctime) -> when this agent first saw that claim (monotonic): its staleness
        self.claims_seen: collections.OrderedDict[tuple[Any, ...], float] = collections.OrderedDict()

    def look_in(self, v: View, alive: frozenset[int], skip: frozenset[str], wall: float,
                out: dict[str, Any]) -> None:
        """The archive round's look (on the lane), its share: what may be claimed among the next
        ARCHIVE_SCAN_MAX entries of the archive's root (:meth:`Archive.scan_keys`; verified records
        only) into ``out``: keeper records (``keeps``), live records of nodes not in ``alive``
        (``lives``: (key, src, keeper, newer), ``newer`` from :func:`_newer_copy`), stale claims
        (``stale``: :meth:`stale_claim`) and claims whose runner is not in ``alive`` and may be
        dead (``runs``: :meth:`running_records`). Keys in ``skip`` (taken or waiting) are not read."""
        orphan_s = float(self.host.s.get("orphan_after_s") or 0)
        for key in self.archive.scan_keys(v):
            if key in skip:
                continue
            names = v.names(key)
            if "guard.json" in names and v.claimable(key, "guard.json") is not None:
                out["keepers"].append(key)
                continue
            m = _KEY_NODE.fullmatch(key)
            if LIVE_RECORD in names and m is not None and int(m[1]) not in alive:
                # (its node runs it: not claimable, nor its directory looked into for a newer copy)
                s = v.claimable(key, LIVE_RECORD)
                if s is not None:
                    b = s.body
                    # only silent, and written lately (its signed time, not the file's): its node is
                    # alive whatever the zone hears of it (a partition: it still reaches the
                    # archive). bench/chaos.py --long-partitions: a partitioned node's new live
                    # record was claimed a second after it was written. (A node dead by its
                    # window's end is asked first: claim_and_resume's ``ask``.)
                    if self.window_ended(int(b["src_node"]), wall) or wall - float(b["ts"]) >= orphan_s:
                        d = v.dir(key)
                        out["lives"].append((key, int(b["src_node"]), b.get("buddy"),
                                             _newer_copy(d, names, int(b["src_node"]), b, wall)
                                             if d is not None else None))
            if any(n.startswith("claimed-") for n in names):
                stale = self.stale_claim(v, key)
                if stale is not None:
                    out["stale"].append(stale[:2])
            if any(n.startswith("running-") for n in names):
                out["runs"] += self.running_records(v, key, lambda n: n in alive)

    def claim(self, key: str, live: bool = False, dead_runner: int | None = None) -> bool:
        """Takes the archive's claim on ``key`` (rename guard.json -> claimed-<node>.json: one
        node wins). Only a record that verifies is taken (:meth:`_claim_in`). A claim this agent
        has seen unchanged for ARCHIVE_CLAIM_STALE_S whose node never ran the job (it died
        trying) is taken over the same way. ``live``: a running job's periodic record
        (``live.json``) may be claimed too (its node is dead, and its keeper is this node or dead
        as well). ``dead_runner``: the running record of that node, which ran the job from here
        and died before anything newer of it was archived (:meth:`dead_runs`). False when
        another node holds it or there is none."""
        v = self.archive.view_or_none()
        if v is None:
            return False
        with v:
            return self._claim_in(v, key, live, dead_runner)

    def _claim_in(self, v: View, key: str, live: bool = False, dead_runner: int | None = None) -> bool:
        d = v.dir(key)
        if d is None:
            return False
        mine = f"claimed-{self.host.node_id}.json"
        srcs = [n for n in ["guard.json"] + ([LIVE_RECORD] if live else []) if v.claimable(key, n) is not None]
        if dead_runner is not None and dead_runner != self.host.node_id:
            n = f"running-{dead_runner}.json"
            if n in v.names(key) and v.read(key, n) is not None:
                srcs.append(n)
        if (stale := self.stale_claim(v, key)) is not None:
            srcs.append(stale[2])
        for src in srcs:
            s = v.read(key, src)
            if s is None or self.archive.refusals.known(("payload", key, s.owner["nonce"])):
                continue  # (its checkpoint did not match what it signed: not claimed again)
            try:
                os.rename(src, mine, src_dir_fd=d, dst_dir_fd=d)
            except OSError:
                continue
            v.forget(key)
            got = v.read(key, mine)
            if got is None:  # swapped between the look and the rename: given back as it was
                with contextlib.suppress(OSError):
                    os.rename(mine, src, src_dir_fd=d, dst_dir_fd=d)
                v.forget(key)
                continue
            taken, frm = got.taken
            if src.startswith("claimed-"):
                self._claimed_from.pop(key, None)
            else:
                self._claimed_from[key] = src  # what unclaim gives it back as
            # noted, signed: what was taken, from where, when (its staleness; without the note, a
            # crash right after the rename, the claim is stale by this agent's own clock alone)
            with contextlib.suppress(OSError):
                archive_fs.replace(d, mine, v.auth.seal({"kind": "claim", "key": key, "taken": taken, "from": frm,
                                                         "ts": time.time()}),
                                   f".claim-{self.host.node_id}-{time.monotonic_ns()}.tmp")
                v.forget(key)
            return True
        return False

    def unclaim(self, key: str) -> None:
        """Gives this node's claim on ``key`` back (it found no room, or the record's checkpoint
        did not verify) as the record it took (:meth:`claim` notes which): a dead runner's
        ``running-<node>.json``, a running job's live record (claimable again only while its node
        and keeper are gone), a stopped job's ``guard.json``. As a keeper record, a live one would be
        claimed by any agent with room at once, and a node thought dead that was only slow would
        then run the job twice. A stale claim taken over goes back as its signed record says
        (its kind; a claim that does not verify is left as it is). Blocking file I/O (on the lane)."""
        took = self._claimed_from.pop(key, None)
        v = self.archive.view_or_none()
        if v is None:
            return
        with v:
            self._unclaim_in(v, key, took)

    def _unclaim_in(self, v: View, key: str, took: str | None) -> None:
        d = v.dir(key)
        mine = f"claimed-{self.host.node_id}.json"
        if d is None:
            return
        s = v.read(key, mine)
        if s is not None and s.body["kind"] == "claim":  # noted: what it took goes back, as it was, where it was
            taken, frm = s.taken
            with contextlib.suppress(OSError):
                archive_fs.replace(d, frm, canonical(taken), f".unclaim-{self.host.node_id}-{time.monotonic_ns()}.tmp")
                os.unlink(mine, dir_fd=d)
            v.forget(key)
            return
        if took is None:
            if s is None:
                return  # (one that does not verify is left as it is)
            took = s.taken[1]
        with contextlib.suppress(OSError):
            os.rename(mine, took, src_dir_fd=d, dst_dir_fd=d)
        v.forget(key)

    def claim_done(self, key: str, who: str, runs: tuple[int, str] | None = None) -> None:
        """The claimed job runs (here or where this node placed it): this node's claim becomes
        ``running-<node>.json``, a run record it signs holding the record it claimed (no node
        claims it again) and ``resumed``: (node, job id) of the job resumed from it, so any agent
        can tell when the job's newer state is in the archive and this directory may go
        (:meth:`Sweep.sweep`)."""
        self._claimed_from.pop(key, None)
        v = self.archive.view_or_none()
        if v is None:
            return
        with v:
            d = v.dir(key)
            mine = f"claimed-{self.host.node_id}.json"
            s = v.read(key, mine) if d is not None else None
            if d is None or s is None:
                log.warning("migrate: archive: %s/%s is gone or does not verify: no running record written", key, mine)
                return
            body = {"kind": "run", "key": key, "record": s.owner_env, "ts": time.time(),
                    "resumed": {"node": int(runs[0]), "job": str(runs[1])} if runs is not None and runs[1] else None}
            try:
                archive_fs.replace(d, f"running-{self.host.node_id}.json", v.auth.seal(body),
                                   f".running-{self.host.node_id}-{time.monotonic_ns()}.tmp")
            except OSError as e:  # the claim stays as it was: kept, never removed
                log.info("migrate: noting where archived %s runs failed: %s", key, e)
                return
            with contextlib.suppress(OSError):
                os.unlink(mine, dir_fd=d)

    def start_claims(self, look: dict[str, Any], wall: float) -> None:
        """Any agent with room resumes an archived job no node runs: the claimable records the
        round's look found (:meth:`Archive.look`) are tried here (:meth:`claim_and_resume`), at most
        ARCHIVE_CLAIMS_MAX a round (the rest the next round)."""
        now = time.monotonic()
        started = 0

        def free(key: str) -> bool:
            return started < ARCHIVE_CLAIMS_MAX and key not in self.host.takeover.taking and now >= self.next_try.get(key, 0.0)

        for key in look["keepers"]:
            if not free(key) or self.kept_here(key):
                continue  # this node keeps it: its own take-over goes through the claim
            self.host.takeover.taking.add(key)
            started += 1
            self.host._spawn(self.claim_and_resume(key))
        waited = {}
        for key, src, keeper, newer in look["lives"]:
            if not free(key) or self._run_elsewhere(src, keeper, wall):
                continue  # its node runs it, or its keeper lives and resumes it from its replica
            if self.kept_here(key):
                continue  # this node keeps it: its own take-over goes through the claim
            if newer is not None and self._await_newer_copy(key, src, newer, wall, now):
                waited[key] = self.live_waits[key]
                continue
            self.host.takeover.taking.add(key)
            started += 1
            self.host._spawn(self.claim_and_resume(key, live=True, ask=(src, key) if self.window_ended(src, wall) else None))
        self.live_waits = waited  # a wait ends with its record (claimed, replaced by the newer one, gone)
        for key, rec in look["stale"][:ARCHIVE_SCAN_MAX]:
            # its node claimed it and died before the job ran: claimable again (claim takes it over)
            if not free(key):
                continue
            if rec["kind"] == "live":  # claimed from a live record: only while its node and keeper are still gone
                if self._run_elsewhere(int(rec["src_node"]), rec.get("buddy"), wall):
                    continue
            if self.kept_here(key):
                continue  # this node keeps it: its own take-over goes through the claim
            self.host.takeover.taking.add(key)
            started += 1
            self.host._spawn(self.claim_and_resume(key))
        for key, node, (runs_on, job) in look["runs"]:
            if not free(key) or self.host.takeover.source_dead(node, wall) is None or self.kept_here(key):
                continue
            self.host.takeover.taking.add(key)
            started += 1
            # the node it placed the job on (another, alive or not: that one is asked) or itself
            # (asked when its window ended: it may be back), whether the job runs there
            ask = (runs_on, f"n{runs_on}-{job}") if runs_on != node or self.window_ended(node, wall) else None
            self.host._spawn(self.claim_and_resume(key, dead_runner=node, ask=ask))

    def window_ended(self, node: int, wall: float) -> bool:
        """Whether ``node``'s reclaim window (the zone's notice) has ended. Such a node counts as
        dead, yet its agent may have come back after the window (restarted, its reclaim cleared:
        the owner gave the node back) and run what it claimed or started since: its archived
        records are asked about first (:meth:`claim_and_resume`'s ``ask``). A claim of a node
        that is only silent is not (it does not answer)."""
        notice = self.host.notices.get(node)
        return notice is not None and wall >= notice[0]

    def _await_newer_copy(self, key: str, src: int, newer: tuple[str, str, float], wall: float, now: float) -> bool:
        """Whether the live record of ``key`` waits (is not claimed yet) for the newer checkpoint
        its node ``src`` is copying into the archive (``newer``: the record's checkpoint, the newer
        one's name, the progress between them in seconds; :func:`_newer_copy`). A node whose
        reclaim window ended counts as dead, yet its agent may still be there, making the late
        copy of the job's final checkpoint (the archive hung past the window's wait): claiming the
        older record then would resume the job from there and throw away the newer one (its
        record is never published once the live record is claimed). So while ``src`` is heard from
        (within ``dead_after_s``), the claim waits, at most as long as the progress it would save
        (the rent-or-buy break-even: the wait never costs more than that progress); a silent
        ``src`` is not waited for."""
        seen = self.host._last_seen(src)
        if seen < 0 or wall - seen >= float(self.host.s["dead_after_s"]):
            return False
        first = self.live_waits.setdefault(key, now)
        if now - first >= newer[2]:
            self.host._emit(f"{key}: waited {now - first:.1f} s for node {src}'s copy of {newer[1]} into the archive "
                            f"(the progress it holds over {newer[0]}); resumed from {newer[0]}", persist=False,
                            key=key, ckpt=newer[0], phase="archive-live-waited")
            return False
        if now == first:
            self.host._emit(f"{key}: its archived {newer[0]} is not claimed yet: node {src}, heard from past its "
                            f"reclaim window, is copying {newer[1]} into the archive (waits up to {newer[2]:.1f} s, "
                            "the progress it holds)", persist=False, key=key, ckpt=newer[0], phase="archive-live-wait")
        return True

    def kept_here(self, key: str) -> bool:
        """This node keeps (or waits to resume) the job ``key``."""
        row = self.host.agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        return row is not None and row["state"] in ("keeping", "waiting")

    def _run_elsewhere(self, src: int, keeper: Any, wall: float) -> bool:
        """A running job's archived record is not this node's to claim: this node runs it, its
        node ``src`` is alive, or its ``keeper`` (another node) is and resumes it from its replica."""
        if src == self.host.node_id or self.host.takeover.source_dead(src, wall) is None:
            return True
        return keeper is not None and int(keeper) != self.host.node_id and self.host.takeover.source_dead(int(keeper), wall) is None

    def dead_runs(self, root: Path, now: float) -> list[tuple[str, int]]:
        """(key, node) of each job claimed from the archive whose runner ``node`` (another node)
        is dead (:meth:`Takeover.source_dead`) before anything newer of the job reached the archive: its
        successor ``n<node>-<job>`` (the record's ``resumed``) holds no verified record. The
        claimed checkpoint is then the job's newest safe state, and any agent may claim it
        again. With a successor record, the job is recovered through it (its live record), never
        twice; a record without ``resumed`` names no successor and is left. Blocking file I/O
        (the first ARCHIVE_SCAN_MAX entries of the root); the round reads the files on the lane
        (:meth:`running_records`) and asks :meth:`Takeover.source_dead` on the loop."""
        out = []
        with self.archive.view(root, create=False) as v:
            for key in archive_fs.names(v.rootfd, ARCHIVE_SCAN_MAX)[0]:
                if not key.startswith("."):
                    out += [(k, n) for k, n, _ in self.running_records(v, key, lambda n: self.host.takeover.source_dead(n, now) is None)]
        return out

    def running_records(self, v: View, key: str, alive: Callable[[int], bool]
                         ) -> list[tuple[str, int, tuple[int, str]]]:
        """(key, node, (node, job) of the job resumed from it: its successor) of each verified
        running record in the key's directory of another node, not ``alive``, whose successor
        holds no verified record (the file part of :meth:`dead_runs`)."""
        out = []
        for s in v.runs(key):
            node, res = int(s.body["writer"]), s.body.get("resumed")
            if node == self.host.node_id or alive(node) or res is None:
                continue
            succ = f"n{res['node']}-{res['job']}"
            if succ != key and any((n in ("guard.json", LIVE_RECORD) or _NODE_FILE.fullmatch(n))
                                   and v.read(succ, n) is not None for n in v.names(succ)):
                continue
            out.append((key, node, (int(res["node"]), str(res["job"]))))
        return out

    def stale_claims(self, root: Path, now: float) -> list[tuple[str, dict[str, Any]]]:
        """(key, claimed record's body) of each claim in the archive (among the first
        ARCHIVE_SCAN_MAX entries of its root) that this agent has seen unchanged for
        ARCHIVE_CLAIM_STALE_S and whose job no node runs (another node's: this node's own
        claims are its take-overs in flight)."""
        out = []
        with self.archive.view(root, create=False) as v:
            for key in archive_fs.names(v.rootfd, ARCHIVE_SCAN_MAX)[0]:
                st = self.stale_claim(v, key) if not key.startswith(".") else None
                if st is not None:
                    out.append((st[0], st[1]))
        return out

    def stale_claim(self, v: View, key: str) -> tuple[str, dict[str, Any], str] | None:
        """(key, the claimed record's body, the claim's file name) of a verified claim of another
        node in the key's directory that no node runs and that is older than
        ARCHIVE_CLAIM_STALE_S (:meth:`claim_age`), or None."""
        claims = v.claims(key)
        if any(c.name.startswith("running-") for c in claims):
            return None
        for c in claims:
            if c.node == self.host.node_id or not c.name.startswith("claimed-"):
                continue
            if self.claim_age(v, key, c) > ARCHIVE_CLAIM_STALE_S:
                return key, c.owner, c.name
        return None

    def claim_age(self, v: View, key: str, c: Sealed) -> float:
        """How old the claim ``c`` is: by its signed note (``ts``), or, a claim its node never
        noted (it crashed right after the rename), by how long this agent has seen it as it is
        now (:meth:`_claim_seen_for`); so is another node's note under this claim's name (a
        takeover not noted yet). Never the file's mtime, which anyone who can write the share
        sets at will."""
        if c.body["kind"] == "claim" and c.body["writer"] == c.node:
            return time.time() - float(c.body["ts"])
        return self._claim_seen_for(v, key, c)

    def _claim_seen_for(self, v: View, key: str, c: Sealed) -> float:
        """Seconds since this agent first saw the claim ``c`` as it is now (the same file: inode
        and ctime, which a rename or rewrite changes; 0 the first time)."""
        try:
            st = archive_fs.lstat_at(v.dir(key) or v.rootfd, c.name)
        except OSError:
            return 0.0
        ident = (key, c.name, st.st_ino, st.st_ctime_ns)
        now = time.monotonic()
        first = self.claims_seen.setdefault(ident, now)
        self.claims_seen.move_to_end(ident)
        while len(self.claims_seen) > CLAIMS_SEEN_KEEP:
            self.claims_seen.popitem(last=False)
        return now - first

    @staticmethod
    def check_payload(v: View, key: str, b: dict[str, Any], dst_fd: int | None = None) -> None:
        """The checkpoint the verified record body ``b`` names in the key's directory, checked
        against what the record signed (its manifest's SHA-256, then every file against that
        manifest: a payload rewritten with a consistent manifest of its own is refused) and,
        with ``dst_fd``, copied there as it is checked. Raises :class:`Refused` (``bad_ckpt``: not
        a real directory; ``manifest_mismatch``) or OSError."""
        d = v.dir(key)
        if d is None:
            raise FileNotFoundError(f"{v.root}/{key}")
        where = f"{key}/{b['ckpt']}"
        try:
            ck = archive_fs.open_dir(d, str(b["ckpt"]))
        except Refused as e:
            raise Refused("bad_ckpt", f"{where}: {e.detail}") from None
        except FileNotFoundError:
            raise Refused("bad_ckpt", f"{where} is missing") from None
        try:
            try:
                raw = archive_fs.read_small(ck, jobkit.MANIFEST, jobkit.MAX_MANIFEST_BYTES)
            except FileNotFoundError:
                raise Refused("manifest_mismatch", f"{where}: no {jobkit.MANIFEST}") from None
            except Refused as e:
                raise Refused("manifest_mismatch", f"{where}: {jobkit.MANIFEST}: {e.detail}") from None
            if manifest_digest(raw) != b["manifest_sha256"]:
                raise Refused("manifest_mismatch", f"{where}: its {jobkit.MANIFEST} is not the one its record signed")
            archive_fs.copy_checkpoint(ck, dst_fd, raw, where, 0o644)
        finally:
            os.close(ck)

    def fetch(self, v: View, key: str, b: dict[str, Any]) -> Path:
        """The checkpoint the verified record body ``b`` names, copied out of the archive into
        this node's state directory (``<state>/resume/<key>/<ckpt>/``, the owner's view of a
        checkpoint: :meth:`Replicas.resume_install`) and checked against what the record signed as it is
        copied (:meth:`check_payload`): every job resumed from the archive, root's included,
        reads this local copy, never the shared storage (which anyone who can write it could
        change between the check and the job's read). Raises :class:`Refused` (``bad_ckpt``,
        ``manifest_mismatch``, ``too_big_ckpt``: it does not fit, leaving ARCHIVE_FETCH_RESERVE
        free) or OSError."""
        req = b["request"]
        base = self.host.replicas.resumes.base()
        st = os.statvfs(base)
        free = st.f_bavail * st.f_frsize
        if free < int(b["bytes"]) + ARCHIVE_FETCH_RESERVE:
            raise Refused("too_big_ckpt", f"{key}/{b['ckpt']}: {b['bytes']} bytes, {free} free in {base}")
        tmp = base / f".tmp-{key}-{b['ckpt']}-{time.monotonic_ns()}"
        os.mkdir(tmp, 0o700)
        try:
            tfd = os.open(tmp, archive_fs.O_DIR)
            try:
                self.check_payload(v, key, b, tfd)
            finally:
                os.close(tfd)
            return self.host.replicas.resumes.install(tmp, key, str(b["ckpt"]), int(req["owner_uid"]), int(req["owner_gid"]))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def archived_newer(self, key: str, path: Path) -> Path | None:
        """The checkpoint this node's claim on ``key`` names in the archive when its step is above
        ``path``'s and it is what the claimed record signed: copied out into this node's state
        directory for the job's owner (:meth:`fetch`), else None. A keeper's replica may be older
        than what reached the archive since (the job's final checkpoint, sent to a keeper that
        archived it and died): a take-over from the replica would lose the work in between.
        Blocking (copies and hashes)."""
        try:
            v = self.archive.view_or_none()
        except (OSError, MigrateError):
            return None
        if v is None:
            return None
        with v:
            s = v.read(key, f"claimed-{self.host.node_id}.json")
            if s is None:
                return None
            b = s.owner
            try:
                if int(str(b["ckpt"]).removeprefix("ckpt-")) <= int(path.name.removeprefix("ckpt-")):
                    return None
                return self.fetch(v, key, b)
            except Refused as e:
                self._payload_refused(key, b, e)
            except (OSError, ValueError) as e:
                log.info("migrate: archived %s/%s could not be fetched: %s", key, b["ckpt"], e)
        return None

    def _payload_refused(self, key: str, b: dict[str, Any], e: Refused) -> None:
        """Counts a checkpoint that does not match its verified record; one that is not what its
        record signed is not claimed again (until its record changes)."""
        known = e.reason in ("bad_ckpt", "manifest_mismatch")
        self.archive.refusals.note(f"{key}/{b['ckpt']}", e, ("payload", key, b["nonce"]) if known else None)

    def _claim_and_read(self, key: str, live: bool, dead_runner: int | None) -> tuple[dict[str, Any], Path] | None:
        """Takes the archive's claim on ``key`` (:meth:`_claim_in`), reads the claimed record
        (verified) and fetches its checkpoint for the job's owner (:meth:`fetch`): (the job's
        record body, the local checkpoint), or None when another node holds the claim. Raises
        OSError (the claim given back): the checkpoint is not what the record signed (counted),
        does not fit, or the storage failed. Blocking file I/O (on the lane)."""
        v = self.archive.view_or_none()
        if v is None:
            return None
        with v:
            if not self._claim_in(v, key, live=live, dead_runner=dead_runner):
                return None
            try:
                s = v.read(key, f"claimed-{self.host.node_id}.json")
                if s is None:
                    raise OSError(f"archive: {key}: the claimed record is gone or does not verify")
                b = s.owner
                try:
                    path = self.fetch(v, key, b)
                except Refused as e:
                    self._payload_refused(key, b, e)
                    raise OSError(f"archive: {key}: {e}") from None
            except BaseException:
                self._unclaim_in(v, key, self._claimed_from.pop(key, None))
                raise
            return dict(b), path

    def claim_archived(self, key: str) -> tuple[bool, str | None, bool]:
        """A keeper's take-over of ``key`` meets the archive (blocking, on the lane): (whether it
        is archived, who runs it when a node claimed and started it, whether this node took the
        claim, live records included: :meth:`claim`). Only verified records count: a file
        planted there stands no keeper down."""
        v = self.archive.view_or_none()
        if v is None:
            return False, None, False
        with v:
            if not self.archive.archived_in(v, key):
                return False, None, False
            other = self.archive.runner_in(v, key)
            if other is not None:
                return True, other, False
            return True, None, self._claim_in(v, key, live=True)

    async def claim_and_resume(self, key: str, live: bool = False, dead_runner: int | None = None,
                            ask: tuple[int, str] | None = None) -> None:
        """Claims the archived job ``key`` (its keeper record; ``live``: its live record too;
        ``dead_runner``: that node's running record) and resumes it here from the local copy of
        its checkpoint (:meth:`_claim_and_read`); given back when it cannot start here. ``ask``:
        (node, key) of the job that may still run there, asked first (:meth:`still_runs`)."""
        root = self.archive.root()
        assert root is not None
        try:
            if self.host.takeover.runs_here(key) is not None:
                return
            if ask is not None and ask[0] != self.host.node_id and await self.still_runs(key, *ask):
                return
            got = await self.archive.lane.call(f"claim of {key}", self._claim_and_read, key, live, dead_runner)
            if got is None:
                return
            rec, path = got
            done = False
            try:
                row = {"key": key, "src_node": int(rec["src_node"]), "src_job": str(rec["src_job"])}
                why = (f"node {rec['src_node']} and its keeper are gone; claimed its periodic checkpoint from the "
                       "archive" if rec["kind"] == "live" else "claimed from the archive")
                if dead_runner is not None:
                    why = f"node {dead_runner}, which ran it from the archive, is gone; claimed again from the archive"
                # (what its node signed of the request, nothing else: a placement named there would
                # drop this node's reservation of it, an LM_PLACEMENT_ID answer a hand-over with it)
                err = await self.host.takeover.resume_here(row, owner_request(rec["request"]), path, why)
                if err is None:
                    self.archive.lane.submit(f"claim of {key} done", self.claim_done, key, f"node {self.host.node_id}",
                                             (self.host.node_id, self.host.takeover.runs_here(key) or ""))
                    done = True
                else:
                    n = self._tries.get(key, 0)
                    self._tries[key] = n + 1
                    self.next_try[key] = time.monotonic() + self.host.takeover.retry.delay(n)
            finally:
                if not done:  # given back in order on the lane (a hung archive waits for it; nothing waits here)
                    self.archive.lane.submit(f"claim of {key} given back", self.unclaim, key)
        except (OSError, ValueError, KeyError, TypeError, MigrateError, jobkit.CheckpointError) as e:
            log.warning("migrate: archived job %s cannot be resumed here: %s", key, e)
            self.next_try[key] = time.monotonic() + float(self.host.s["retry_max_s"])
        finally:
            self.host.takeover.taking.discard(key)

    async def still_runs(self, key: str, node: int, job_key: str) -> bool:
        """Whether ``node`` answers (control op ``needs``) that its job ``job_key`` lives there
        (SOURCE_LIVE_STATES) or ended there (ARCHIVE_ENDED_THERE: exited, stopped by its user,
        moved elsewhere): the archived job ``key`` is not claimed here then, and is looked at
        again after ``dead_after_s`` (ended: after ARCHIVE_CLAIM_STALE_S; its record goes with
        that node's sweep). A node dead by its reclaim window's end may be back (its agent
        restarted after the window and cleared the reclaim) and run the job it claimed from the
        archive, or its own job whose periodic record this is; before, that job was claimed and
        resumed here too (two copies), or resumed again after it had ended. No answer, a job
        stopped by the window's end (``reclaimed``) or one that failed there goes on with the
        claim."""
        try:
            ans = await self.host._control(node, "needs", {"key": job_key}, timeout=float(self.host.s["dead_after_s"]) + 2.0)
        except Exception as e:  # gone: no answer (a refused connection, a timeout, an error)
            log.info("migrate: node %d did not answer whether %s lives there (before claiming %s): %s",
                     node, job_key, key, e)
            self.runs_told.pop(key, None)
            return False
        state = ans.get("state") if isinstance(ans, dict) and ans.get("key") == job_key else None
        if state not in SOURCE_LIVE_STATES and state not in ARCHIVE_ENDED_THERE:
            self.runs_told.pop(key, None)
            return False
        again = float(self.host.s["dead_after_s"]) if state in SOURCE_LIVE_STATES else ARCHIVE_CLAIM_STALE_S
        self.next_try[key] = time.monotonic() + again
        if self.runs_told.get(key) != job_key:
            self.runs_told[key] = job_key
            what = f"runs there ({state})" if state in SOURCE_LIVE_STATES else f"ended there ({state})"
            self.host._emit(f"{key}: node {node} counts as dead (its reclaim window ended, or it placed the job elsewhere) "
                            f"but answers that {job_key} {what}: not claimed from the archive here", persist=False,
                            key=key, node=node, job_key=job_key, state=state, phase="archive-runs-there")
        return True
