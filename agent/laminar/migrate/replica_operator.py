"""The operator's view of the replicas held here and their drop (``GET /v1/migrate/replicas``,
``laminarctl replicas``, ``replicas drop``): a piece of :class:`laminar.migrate.replicas.Replicas`
(its ``operator``). The view answers from a bounded walk of the replica root, one at a time, in a
lane of its own; a drop refuses a replica a job may still need (module docs of
:mod:`laminar.migrate.replicas`, *Replicas held here*)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar.migrate import ledger
from laminar.migrate.constants import (
    _CKPT_NAME,
    _SAFE_KEY,
    REPLICA_DROP_WALK_MAX,
    REPLICA_TRASH,
    REPLICA_VIEW_MAX_AGE_S,
    REPLICA_WALK_MAX,
)
from laminar.migrate.errors import MigrateError, ReplicaRefused
from laminar.migrate.replica_policy import (
    REPLICA_KEEPER_STATES,
    _ckpt_step,
    keeper_confirmation,
    replica_gc_plan,
)
from laminar.migrate.transfer import TransferError
from laminar.migrate.trees import Budget, _newest_mtime, tree_bytes
from laminar.offloop import LaneBusy
from laminar.policy import custody

if TYPE_CHECKING:
    from laminar.migrate.replicas import Replicas

log = logging.getLogger("laminar.migrate")


class ReplicaOperator:
    """The operator's view and drop of the replicas held here. ``replicas``: the part that holds it."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.host = replicas.host
        # the last walk's answer (in the part's lane: one walk of the replica root at a time)
        self._replica_scan: tuple[float, dict[str, Any]] | None = None
        self._replica_scan_fut: asyncio.Future[dict[str, Any]] | None = None

    def forget_scan(self) -> None:
        """The replica root changed (a commit here): the next view walks it again."""
        self._replica_scan = None


    def receiving(self, key: str) -> bool:
        """Whether the transfer endpoint receives (or commits) a checkpoint of ``key`` now."""
        return self.host.receiver is not None and self.host.receiver.receiving(key)

    async def scan(self, max_age_s: float = REPLICA_VIEW_MAX_AGE_S) -> dict[str, Any]:
        """:meth:`_scan_replicas`'s answer at most ``max_age_s`` old: taken in the replica lane
        (one thread, one walk at a time, REPLICA_SCAN_TIMEOUT_S) and shared by every caller in
        the meantime; a walk that does not finish answers the last one (``stale``) or an empty
        one (``error``). Each GET /v1/migrate/replicas (any local user) walked the whole replica
        root in a thread of the default executor before, with no limit on either."""
        got = self._replica_scan
        if got is not None and time.monotonic() - got[0] < max_age_s:
            return got[1]
        if self._replica_scan_fut is None or self._replica_scan_fut.done():
            self._replica_scan_fut = asyncio.ensure_future(self._replica_scan_once())
        return await asyncio.shield(self._replica_scan_fut)

    async def _replica_scan_once(self) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            scan = await self.replicas.lane.run("replicas", self._scan_replicas)
        except (TimeoutError, LaneBusy) as e:
            if self._replica_scan is not None:
                return {**self._replica_scan[1], "stale": f"the last walk, {time.monotonic() - self._replica_scan[0]:.0f} s "
                        f"old: {e}"}
            return {"keys": {}, "incoming": {}, "free_bytes": None, "fs_bytes": None, "trash_bytes": 0,
                    "truncated": False, "error": str(e)}
        self._replica_scan = (t0, scan)
        return scan

    def _scan_replicas(self) -> dict[str, Any]:
        """What is under the receive root now (blocking: the replica lane runs it): per key
        directory under ``checkpoints/`` its ``ckpt-<n>`` (bytes, modification time), its other
        entries (a commit's ``.tmp-*``), all its bytes and its newest change; the partial
        transfers under ``incoming/``; the filesystem's free space; the replica trash's bytes.
        Links are reported as links, never followed. At most REPLICA_WALK_MAX entries are looked
        at in all (``truncated``: the sizes are then lower bounds, and the keys not walked whole
        never look old)."""
        assert self.host.root is not None
        budget = Budget(REPLICA_WALK_MAX)
        base = self.host.root / "checkpoints"
        keys: dict[str, dict[str, Any]] = {}
        try:
            names = sorted(os.listdir(base))
        except OSError:
            names = []
        for n in names:
            p = base / n
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                keys[n] = {"link": stat.S_ISLNK(st.st_mode), "ckpts": {}, "other": [], "bytes": 0,
                           "newest": st.st_mtime}
                continue
            ckpts: dict[str, tuple[int, float]] = {}
            other: list[str] = []
            total = 0
            try:
                entries = sorted(os.listdir(p))
            except OSError:
                entries = []
            for e in entries:
                try:
                    est = os.lstat(p / e)
                except OSError:
                    continue
                size = tree_bytes(p / e, budget)
                total += size
                if _CKPT_NAME.fullmatch(e) and stat.S_ISDIR(est.st_mode):
                    ckpts[e] = (size, est.st_mtime)
                else:
                    other.append(e)
            keys[n] = {"link": False, "ckpts": ckpts, "other": other, "bytes": total, "newest": _newest_mtime(p, budget)}
        incoming: dict[str, list[str]] = {}
        with contextlib.suppress(OSError):
            for n in sorted(os.listdir(self.host.root / "incoming")):
                with contextlib.suppress(OSError):
                    if stat.S_ISDIR(os.lstat(self.host.root / "incoming" / n).st_mode):
                        incoming[n] = sorted(os.listdir(self.host.root / "incoming" / n))
        free = fs = None
        with contextlib.suppress(OSError):
            sv = os.statvfs(base)
            free, fs = sv.f_bavail * sv.f_frsize, sv.f_blocks * sv.f_frsize
        return {"keys": keys, "incoming": incoming, "free_bytes": free, "fs_bytes": fs,
                "trash_bytes": tree_bytes(self.host.root / REPLICA_TRASH, budget), "truncated": budget.left < 0}

    def view(self, scan: dict[str, Any], now: float | None = None) -> dict[str, Any]:
        """Every key this node holds replicas of or has a ``migrate_replicas`` row for, with what
        the GC will do with it (:func:`replica_gc_plan`), and the totals; ``scan`` is
        :meth:`_scan_replicas`'s (taken in a thread). Runs on the event loop (the store, the jobs).

        Per key: ``key``, ``state`` (the row's, ``unclaimed`` without a row), ``src_node``,
        ``src_job``, ``owner_uid``, ``ckpt`` (the kept checkpoint), ``job_id`` (what it was
        resumed or placed as), ``updated``, ``attempts``/``next_at``/``last_error`` (a waiting
        keeper's), ``checkpoints`` ([{name, bytes, mtime}], newest first), ``bytes``,
        ``temporaries``, ``incoming`` (partial transfers), ``link``, ``age_s`` (since the last
        change of the row or the directory), ``used_by`` (local jobs resumed from it),
        ``receiving``, ``gc`` (``removes``/``keeps``), ``gc_at``, ``gc_removes``, ``gc_why``,
        ``row_gc_at``, ``droppable`` (what ``drop`` without ``force`` would say: None when it
        would drop), ``unconfirmed`` (a keeper whose live source did not answer the last ``needs``
        question: :func:`keeper_confirmation`), ``source_heard_at``/``source_silent_s`` (when the
        source last spoke about a ``keeping`` keeper: its keeper message or an answer),
        ``needs_unanswered`` (questions in a row without an answer) and ``needs_error`` (the
        last one's, while unconfirmed)."""
        assert self.host.root is not None
        now = time.time() if now is None else now
        db = self.host.agent.store.db
        rows = {str(r["key"]): r for r in db.execute(
            "SELECT r.key, r.src_node, r.src_job, r.request, r.ckpt, r.state, r.job_id, r.updated, t.attempts, "
            "t.next_at, t.last_error, g.answered, g.unanswered, g.last_error AS needs_error FROM migrate_replicas r "
            "LEFT JOIN migrate_retry t ON t.key = r.key LEFT JOIN migrate_keeper_checks g ON g.key = r.key").fetchall()}
        held: dict[str, dict[str, Any]] = scan["keys"]
        next_round = now + max(0.0, self.replicas.gc_next - time.monotonic())
        out = []
        for key in sorted(set(rows) | set(held)):
            row, sc = rows.get(key), held.get(key)
            d = self.host.root / "checkpoints" / key
            users = self.replicas.user_jobs(d) if sc is not None and not sc["link"] else {}
            try:
                req = json.loads(row["request"]) if row is not None else {}
            except ValueError:
                req = {}
            req = req if isinstance(req, dict) else {}
            if row is not None:
                src_node: int | None = int(row["src_node"])
                src_job: str | None = str(row["src_job"])
            else:  # no keeper came: what the key's name says (n<node>-<job>)
                m = re.fullmatch(r"n([0-9]{1,10})-(.+)", key)
                src_node, src_job = (int(m.group(1)), m.group(2)) if m else (None, None)
            ckpts = sc["ckpts"] if sc is not None else {}
            updated = float(row["updated"]) if row is not None else None
            newest = sc["newest"] if sc is not None and not math.isinf(sc["newest"]) else None
            state = str(row["state"]) if row is not None else None
            plan = replica_gc_plan(
                state=state, held={n: t for n, (_, t) in ckpts.items()}, in_use=set(users), now=now, updated=updated,
                newest_mtime=newest, taking=key in self.host.takeover.taking, take_over=bool(req.get("take_over")),
                src_node=src_node, next_round=next_round,
                next_look=float(row["next_at"]) if row is not None and row["next_at"] is not None else None,
                orphan_s=float(self.host.s["replica_orphan_s"]), keeper_check_s=float(self.host.s["replica_keeper_check_s"]),
                row_keep_s=float(self.host.s["replica_row_keep_s"]))
            conf = keeper_confirmation(
                state=state, take_over=bool(req.get("take_over")), updated=updated,
                answered=None if row is None or row["answered"] is None else float(row["answered"]),
                unanswered=0 if row is None or row["unanswered"] is None else int(row["unanswered"]), now=now)
            why = plan["why"]
            if conf["unconfirmed"] and row is not None:
                n = int(row["unanswered"])
                why = (f"UNCONFIRMED: node {src_node} has not answered whether the job still needs this keeper "
                       f"({n} question{'' if n == 1 else 's'} in a row; last: {row['needs_error']}); last heard from it "
                       f"{conf['silent_s']:.0f} s ago; kept (it may be the job's only copy). " + why)
            changed = max(t for t in (updated, newest, -math.inf) if t is not None)
            item: dict[str, Any] = {
                "key": key, "state": state or "unclaimed", "src_node": src_node, "src_job": src_job,
                "owner_uid": req.get("owner_uid"), "ckpt": str(row["ckpt"]) if row is not None else None,
                "job_id": row["job_id"] if row is not None else None, "updated": updated,
                "attempts": row["attempts"] if row is not None else None,
                "next_at": row["next_at"] if row is not None else None,
                "last_error": row["last_error"] if row is not None else None,
                "checkpoints": [{"name": n, "bytes": b, "mtime": t}
                                for n, (b, t) in sorted(ckpts.items(), key=lambda kv: _ckpt_step(kv[0]), reverse=True)],
                "bytes": sc["bytes"] if sc is not None else 0,
                "temporaries": sc["other"] if sc is not None else [], "incoming": scan["incoming"].get(key, []),
                "link": bool(sc and sc["link"]), "held": sc is not None,
                "age_s": None if math.isinf(changed) else max(0.0, now - changed),
                "used_by": sorted({j for js in users.values() for j in js}), "receiving": self.receiving(key),
                "gc": "removes" if plan["removes"] else "keeps", "gc_at": plan["at"], "gc_removes": plan["removes"],
                "gc_why": why, "row_gc_at": plan["row_at"], "unconfirmed": conf["unconfirmed"],
                "source_heard_at": conf["heard_at"], "source_silent_s": conf["silent_s"],
                "needs_unanswered": int(row["unanswered"] or 0) if row is not None and conf["heard_at"] is not None
                else None,
                "needs_error": (row["needs_error"] or None) if row is not None and conf["unconfirmed"] else None}
            item["droppable"] = self._drop_refusal(key, state, src_node, src_job, users, force=False)
            out.append(item)
        out.sort(key=lambda r: (r["updated"] if r["updated"] is not None else math.inf, r["key"]))
        totals = {"keys": len(out), "bytes_held": sum(int(r["bytes"]) for r in out),
                  "checkpoints": sum(len(r["checkpoints"]) for r in out),
                  "root": str(self.host.root / "checkpoints"), "free_bytes": scan["free_bytes"], "fs_bytes": scan["fs_bytes"],
                  "free_for_offers": None, "trash_bytes": scan["trash_bytes"],
                  "by_state": {s: sum(1 for r in out if r["state"] == s) for s in sorted({r["state"] for r in out})},
                  "unconfirmed": sum(1 for r in out if r["unconfirmed"]),
                  # the walk of the replica root: cut at REPLICA_WALK_MAX entries, an older one, or none
                  "scan_truncated": bool(scan.get("truncated")), "scan_stale": scan.get("stale"),
                  "scan_error": scan.get("error")}
        if self.host.receiver is not None:
            with contextlib.suppress(OSError):
                totals["free_for_offers"] = self.host.receiver.free_for_offers()
        return {"now": now, "replicas": out, "totals": totals}

    def _drop_refusal(self, key: str, state: str | None, src_node: int | None, src_job: str | None,
                      users: dict[str, list[str]], force: bool) -> str | None:
        """Why :meth:`drop` refuses ``key`` now (None: it would drop it)."""
        if key in self.host.takeover.taking:
            return f"{key}: a take-over (or archive claim) of it runs now; try again once it ended"
        if self.receiving(key):
            return f"{key}: a checkpoint transfer into it is in progress; try again once it ended"
        if users:
            jobs = sorted({j for js in users.values() for j in js})
            return (f"{key}: local job{'s' if len(jobs) > 1 else ''} {', '.join(jobs)} resume{'' if len(jobs) > 1 else 's'}"
                    f" from {', '.join(sorted(users))}; never dropped while a local job uses it, --force or not "
                    "(a job that failed or was lost may need it to be restarted: that is an operator's call)")
        if state in REPLICA_KEEPER_STATES and not force:
            src = f"node {src_node}" if src_node is not None else "its source node"
            what = (f"this node holds the keeper of job {src_job or '?'} of {src}" if state == "keeping" else
                    f"its source {src} is gone and this node waits for room to resume job {src_job or '?'}")
            return (f"{key} is {state}: {what}; these replicas may be the job's only way back. Drop it anyway with "
                    f"--force ({src} is told, if it can be reached, and prestages a running job to another keeper; "
                    "a stopped job held here, or a gone source's job, is then lost unless the archive holds it)")
        return None

    def drop(self, key: str, force: bool = False, by: str = "") -> dict[str, Any]:
        """Removes the replicas of ``key`` held here and its ``migrate_replicas`` (and retry) row,
        as an operator asks (``POST /v1/migrate/replicas/{key}/drop``, ``laminarctl replicas drop``).

        The same safe path as the GC: on the event loop (so no commit of the key interleaves),
        the key's directory is renamed into ``<root>/REPLICA_TRASH/`` (a link is moved as a link,
        never followed) and removed in a worker thread; then the rows go. Refused, with nothing
        changed: a key that is not a transfer key (ValueError), one this node neither holds nor
        has a row for (LookupError), and (ReplicaRefused) one whose take-over runs, one a transfer
        is being received into, one a local job resumes from (``force`` or not), a ``keeping`` or
        ``waiting`` key without ``force``. This tells the source nothing: the API's drop is
        :meth:`drop_and_tell` (see docs/operations.md). ``.tmp-*`` of a commit cannot be there (no transfer runs); partial
        transfers under ``incoming/`` are the endpoint's (:meth:`Receiver.sweep`) and the archive
        is never touched. Returns ``{"key", "state", "dropped": [ckpt names], "bytes", "forced"}``."""
        if not isinstance(key, str) or not _SAFE_KEY.fullmatch(key):
            raise ValueError(f"{key!r} is not a replica key: expected letters, digits, '_', '.' or '-', starting "
                             "with a letter or digit, at most 128 characters (see `laminarctl replicas`)")
        if self.host.root is None:
            raise LookupError(f"no replicas of {key!r} on this node: it has no transfer endpoint")
        row = self.host.agent.store.db.execute("SELECT src_node, src_job, state FROM migrate_replicas WHERE key=?",
                                          (key,)).fetchone()
        d = self.host.root / "checkpoints" / key
        try:
            st: os.stat_result | None = os.lstat(d)
        except FileNotFoundError:
            st = None
        if row is None and st is None:
            raise LookupError(f"no replicas of {key!r} on this node (see `laminarctl replicas`)")
        is_dir = st is not None and stat.S_ISDIR(st.st_mode)
        users = self.replicas.user_jobs(d) if is_dir else {}
        state = str(row["state"]) if row is not None else None
        refusal = self._drop_refusal(key, state, None if row is None else int(row["src_node"]),
                                     None if row is None else str(row["src_job"]), users, force)
        if refusal is not None:
            raise ReplicaRefused(refusal)
        names: list[str] = []
        nbytes = 0
        moved: Path | None = None
        if st is not None:
            if is_dir:
                with contextlib.suppress(OSError):
                    names = sorted((n for n in os.listdir(d) if _CKPT_NAME.fullmatch(n)), key=_ckpt_step, reverse=True)
                nbytes = tree_bytes(d, Budget(REPLICA_DROP_WALK_MAX))  # on the loop: bounded (a lower bound past it)
            trash = self.host.root / REPLICA_TRASH
            try:
                trash.mkdir(exist_ok=True)
                if not stat.S_ISDIR(os.lstat(trash).st_mode):
                    raise OSError(f"{trash} is not a directory")
                moved = trash / f"{key}.drop.{time.monotonic_ns()}"
                os.rename(d, moved)
                self._replica_scan = None  # the replica view walks again
            except OSError as e:
                raise MigrateError(f"{key}: cannot move {d} into {trash}: {e}; nothing was removed") from None
        with self.host.agent.store.tx() as db:
            ledger.move(db, key, custody.Event.DROP, counts=self.host.counts)  # its retry row goes too
            ledger.forget_keeper(db, key)
        self.replicas.keeper_asked.pop(key, None)
        self.host.counts["replica_dropped"] = self.host.counts.get("replica_dropped", 0) + 1
        forced = force and state in REPLICA_KEEPER_STATES
        self.host._emit(f"{key}: replicas dropped by {by or 'an operator'} (state {state or 'unclaimed'}"
                   f"{', forced' if forced else ''}): {', '.join(names) or 'no checkpoint'}, {nbytes} bytes",
                   key=key, phase="replica-dropped", state=state or "unclaimed", forced=forced, by=by)
        if moved is not None:
            self.replicas.remove_later([moved])
        return {"key": key, "state": state or "unclaimed", "dropped": names, "bytes": nbytes, "forced": forced,
                "src_node": None if row is None else int(row["src_node"])}

    async def drop_and_tell(self, key: str, force: bool = False, by: str = "",
                                    timeout: float = 5.0) -> dict[str, Any]:
        """:meth:`drop`, then, for a forced drop of a ``keeping`` or ``waiting`` key, tells
        its source (control op ``dropped``, ``{"key"}``) so that it forgets this node as the job's
        keeper and prestages elsewhere (:meth:`Prestage.answer_dropped` there). The drop stands whatever the
        source says or whether it can be reached. Adds ``source_told`` (True: the source answered;
        False: it was not told; None: nothing to tell) and ``source_says`` (its answer's ``why``, or
        why it was not told) to :meth:`drop`'s answer. Raises what drop raises."""
        res = self.drop(key, force=force, by=by)
        res["source_told"], res["source_says"] = None, ""
        src = res.get("src_node")
        if not res["forced"] or src is None:
            return res
        try:
            if src == self.host.node_id:
                raise MigrateError(f"node {src} is this node")
            ans = await self.host._control(int(src), "dropped", {"key": key}, timeout=timeout)
            if not isinstance(ans, dict) or ans.get("key") != key:
                raise MigrateError(f"node {src} answered {ans!r}")
        except (MigrateError, TransferError, OSError, TimeoutError) as e:
            res["source_told"], res["source_says"] = False, f"node {src} was not told: {e}"
            self.host._emit(f"{key}: the forced drop was not told to node {src} ({e}): it may still count on this node "
                       "as the job's keeper", key=key, src_node=src, phase="replica-drop-untold")
            return res
        res["source_told"], res["source_says"] = True, str(ans.get("why", ""))
        return res

