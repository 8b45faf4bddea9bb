"""The pruning of ended jobs' records (:meth:`Pruner.prune_ended`: config ``[jobs]``
``keep_ended_s``, ``keep_ended``, ``keep_ended_per_user``; never a job that has not ended, nor
one another component's table still names), with their logs and checkpoint directories,
removed in one thread of their own (:func:`remove_job_files`: never following a link)."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .jobs import JobManager


log = logging.getLogger("laminar.jobs")


# The most ended jobs' records one prune deletes (the rest at the next): a limit lowered by a
# million rows must not hold the event loop in one statement.
PRUNE_BATCH = 5000
# Config [jobs] (laminar.runtime.jobs.CONFIG_FIELDS): how long and how many ended jobs' records
# the store keeps, and how many of one user's.
KEEP_ENDED_S = 7 * 86400.0
KEEP_ENDED = 10_000
KEEP_ENDED_PER_USER = 1000
# Pruned jobs whose files (log, checkpoint directory) may wait for the removal thread at once.
REMOVE_QUEUE_MAX = 100_000
# The meta key holding the highest job number pruned: numbers (and ids, log and checkpoint
# paths, replica keys) are never given twice, also when the newest rows are pruned.
NUM_FLOOR_KEY = "jobs.num_floor"
# The meta key holding the highest job number reserved for a multi-node job's id on its origin
# (JobManager.reserve_multinode_id): no job-N of this node takes it.
NUM_RESERVED_KEY = "jobs.num_reserved"
# Tables of other components whose rows name a job (column): a job they name is not pruned
# (a keeper keeping its replica asks about it, a replica resumed here finds it by its key).
KEEP_REFERENCED = (("migrate_keepers", "job_id"), ("migrate_replicas", "job_id"), ("net_transfers", "job"),
                   ("zone_placed", "job_id"), ("jobs_leaked_cgroups", "job_id"),
                   ("migrate_buddies", "job_id"))  # old spelling: an older agent's, until migrate starts and renames it


def remove_job_files(state_dir: Path, job_id: str) -> None:
    """Removes a pruned job's log (``logs/<id>.log``) and checkpoint directory (``ckpt/<id>``),
    never following a link: ``logs`` and ``ckpt`` are root's (0711), so the names are the agent's;
    what lies below is the job owner's, and shutil.rmtree (file-descriptor based on Linux) removes
    a link in it as a link. Errors are logged, never raised (the next agent leaves the rest)."""
    if not job_id.startswith("job-") or "/" in job_id:
        return
    try:
        os.unlink(state_dir / "logs" / f"{job_id}.log")
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("jobs: cannot remove the log of pruned %s: %s", job_id, e)
    ckpt = state_dir / "ckpt" / job_id
    try:
        st = os.lstat(ckpt)
    except OSError:
        return
    try:
        if stat.S_ISDIR(st.st_mode):
            import shutil

            shutil.rmtree(ckpt)
        else:
            os.unlink(ckpt)
    except OSError as e:
        log.warning("jobs: cannot remove the checkpoint directory of pruned %s: %s", job_id, e)


class Pruner:
    """The retention of ended jobs' records and files, for a :class:`~laminar.runtime.jobs.JobManager`
    (``jobs.pruner``), whose store, settings (config ``[jobs]`` keep_ended*) and jobs it reads."""

    def __init__(self, jm: JobManager) -> None:
        self.jm = jm
        self._remover: Any = None  # the queue of the thread that removes pruned jobs' files (_remove_files)
        self._removing = 0  # pruned jobs whose files wait for it
        self._removing_lock = threading.Lock()

    def prune_ended(self, now: float | None = None) -> int:
        """Delete the records of ended jobs beyond config ``jobs.keep_ended_per_user`` (a user's
        oldest ended first: one user's submissions in a loop must not push out everyone else's
        history), ``jobs.keep_ended_s`` (ended longer ago) and ``jobs.keep_ended`` (the oldest
        ended first); returns how many. Never a job that has not ended (no ``ended`` recorded:
        queued, running, suspended, being stopped, or a stop the previous agent left
        unfinished), nor one another component's table still names (`KEEP_REFERENCED`). At most
        PRUNE_BATCH per call (the rest at the next one), so a lowered limit never holds the event
        loop. The highest number pruned is kept (`NUM_FLOOR_KEY`): no job number is ever given
        twice. A pruned job's log and checkpoint directory are removed with its record, in a
        thread (`_remove_files`). Called when a job ends, at start and every ``leak_sweep_s``;
        a store error is logged, never raised."""
        if self.jm.store is None:
            return 0
        now = time.time() if now is None else now
        keep_s = KEEP_ENDED_S if self.jm.keep_ended_s is None else float(self.jm.keep_ended_s)
        keep_n = KEEP_ENDED if self.jm.keep_ended is None else int(self.jm.keep_ended)
        keep_u = KEEP_ENDED_PER_USER if self.jm.keep_ended_per_user is None else int(self.jm.keep_ended_per_user)
        picked: dict[str, int] = {}  # id -> num, in the order picked

        def add(rows: Any, most: int | None = None) -> None:
            added = 0
            for i, n in rows:
                if len(picked) >= PRUNE_BATCH or (most is not None and added >= most):
                    return
                if i not in picked:
                    picked[i] = int(n)
                    added += 1

        try:
            db = self.jm.store.db
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            where = "ended IS NOT NULL" + "".join(
                f" AND id NOT IN (SELECT {col} FROM {table} WHERE {col} IS NOT NULL)"
                for table, col in KEEP_REFERENCED if table in tables)
            if keep_u > 0:
                over = db.execute(f"SELECT owner_uid, COUNT(*) FROM jobs WHERE {where} AND owner_uid != 0 "
                                  "GROUP BY owner_uid HAVING COUNT(*) > ?", (keep_u,)).fetchall()
                for uid, n in over:
                    add(db.execute(f"SELECT id, num FROM jobs WHERE {where} AND owner_uid = ? ORDER BY ended, num "
                                   "LIMIT ?", (uid, min(int(n) - keep_u, PRUNE_BATCH))).fetchall())
            add(db.execute(f"SELECT id, num FROM jobs WHERE {where} AND ended < ? ORDER BY ended, num LIMIT ?",
                           (now - keep_s, PRUNE_BATCH)).fetchall())
            excess = int(db.execute(f"SELECT COUNT(*) FROM jobs WHERE {where}").fetchone()[0]) - len(picked) - keep_n
            if excess > 0 and len(picked) < PRUNE_BATCH:
                add(db.execute(f"SELECT id, num FROM jobs WHERE {where} ORDER BY ended, num LIMIT ?",
                               (min(excess + len(picked), 2 * PRUNE_BATCH),)).fetchall(), most=excess)
            if not picked:
                return 0
            old = list(picked.items())
            floor = max(int(self.jm.store.get_meta(NUM_FLOOR_KEY, 0) or 0), max(n for _, n in old))
            with self.jm.store.tx() as tx:
                tx.executemany("DELETE FROM jobs WHERE id = ? AND ended IS NOT NULL", [(i,) for i, _ in old])
                tx.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET "
                           "value=excluded.value", (NUM_FLOOR_KEY, json.dumps(floor)))
        except Exception as e:  # sqlite3.Error, a store closing under us: the next call retries
            log.warning("jobs: pruning ended jobs' records failed: %s", e)
            return 0
        log.info("jobs: pruned the records of %d ended job(s) (oldest %s; keep_ended %d, keep_ended_s %g, "
                 "keep_ended_per_user %d)", len(old), old[0][0], keep_n, keep_s, keep_u)
        self._remove_files([i for i, _ in old])
        return len(old)

    def _remove_files(self, job_ids: list[str]) -> None:
        """Removes the logs and checkpoint directories of pruned jobs, in the job manager's one
        file-removal thread (the directories are their owners': an rmtree of 100,000 files must
        not hold the loop). A directory a job that has not ended resumes from is kept. Never
        follows a link (`remove_job_files`); at most REMOVE_QUEUE_MAX jobs wait, the rest keep
        their files (logged)."""
        if self.jm.state_dir is None or not job_ids:
            return
        root = str(self.jm.state_dir / "ckpt") + "/"
        keep = {os.path.normpath(r)[len(root):].split("/", 1)[0] for r in (j.spec.resume_from for j in self.jm.jobs.values())
                if isinstance(r, str) and os.path.normpath(r).startswith(root)}
        ids = [i for i in job_ids if i not in keep]
        with self._removing_lock:
            room = REMOVE_QUEUE_MAX - self._removing
            if len(ids) > room:
                log.warning("jobs: %d pruned jobs' files left in place (%d removals already waiting)",
                            len(ids) - max(room, 0), self._removing)
                ids = ids[:max(room, 0)]
            self._removing += len(ids)
        if not ids:
            return
        if self._remover is None:
            # a daemon thread of its own (not an executor's, which the interpreter joins at exit:
            # an rmtree stuck on its owner's hung mount would hold the agent's stop)
            import queue

            self._remover = queue.SimpleQueue()
            threading.Thread(target=self._removal_thread, args=(self._remover, self.jm.state_dir),
                             name="lm-jobs-remove", daemon=True).start()
        self._remover.put(ids)

    def _removal_thread(self, todo: Any, state_dir: Path) -> None:
        while True:
            ids = todo.get()
            for i in ids:
                try:
                    remove_job_files(state_dir, i)
                except Exception:  # never let one job's files end the thread
                    log.exception("jobs: removing the files of pruned %s failed", i)
                finally:
                    with self._removing_lock:
                        self._removing -= 1
