"""Periodic checkpoints: the agent asks each job for a checkpoint at the interval the hazard sets.

:mod:`laminar.policy.ckpt_schedule` says *how often* a job should checkpoint (Young/Daly with
the node's time-varying hazard, the checkpoint's cost at the uplink share left when
co-resident jobs checkpoint too) and how to *stagger* checkpoints that fall due together.
This module is the part of ``agent.migrate`` that acts on it: every ``poll_s`` it

1. looks at each active job's checkpoint directory (jobkit's layout): a new verified
   checkpoint is a *commit*; its size is the planning size of the next one, and the time from
   the signal to the commit (the manifest's mtime) is what a checkpoint costs the job;
2. records the exposure of this node (until its reclaim is announced) and its live zone peers in the hazard model (the
   departures it sees, announced or not, are recorded by the reclaim component; both are kept
   in the agent's store, :mod:`laminar.migrate.evidence`), so the rate learns from what the
   zone lives through and a restart does not forget it;
3. re-plans every job with :func:`ckpt_schedule.plan` (hazard of the ``default`` provider, the
   uplink of ``migrate.uplink_mbit``, else ``shaping.link_mbit``, else ``migrate.path_mbit``;
   the rate is the slower of that uplink and ``path_mbit`` (a transfer crosses both);
   the notice window ``expected_notice_s``, 0 with ``prestage = "always"``, judged with
   ``notice_margin`` as the reclaim does; with ``prestage = "off"`` no transfer is planned; the share of
   departures without notice learned from what the agent saw, ``NoticeOdds.unannounced_frac``);
4. a job is *due* one interval after its newest checkpoint (whoever asked for it) or, before
   its first, after it was first seen; due jobs are ordered by :func:`ckpt_schedule.stagger`
   so that no two checkpoint at once (each occupies ``max(cost, stagger_gap_s)``, the transfer
   too when prestaged; in-flight checkpoints count; at most one job starts per round), and the
   job whose start has come gets its
   checkpoint signal (``agent.jobs.request_checkpoint``) and a ``migrate`` event with
   ``phase = "periodic"``, the interval and why (MTBF from the hazard, cost, bandwidth share).

**Who is skipped.** A job is only signalled when its main process *catches* its checkpoint
signal (``SigCgt`` in ``/proc/<pid>/status``): a process that does not would be killed by
SIGUSR1, so a job without the checkpoint contract is never driven. A job opts out with
``periodic_checkpoints = false`` in its spec (``laminarctl submit --no-periodic-checkpoints``;
once the env name ``LM_CKPT_PERIODIC=off``, which the agent no longer reads); the whole driver with
``migrate.periodic = false``. Jobs being moved, and every job during a reclaim of this node,
are left to the reclaim.

Config (``[migrate]``, besides the reclaim's keys)::

    periodic = true            # drive periodic checkpoints
    min_interval_s = 30        # bounds on an interval
    max_interval_s = 21600
    ckpt_pause_s = 2.0         # planned cost of a job's checkpoint until one has been measured
    write_mbit = 8000          # local checkpoint write rate assumed for planning
    uplink_mbit = 0            # uplink for the bandwidth share (0: shaping.link_mbit, else path_mbit)
    stagger_gap_s = 1.0        # least time between two jobs' checkpoint signals
    stagger_max_delay_s = 60   # a checkpoint is never delayed more than this to stagger it

The plan is shown by ``GET /v1/checkpoints`` and ``laminarctl checkpoints``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar import jobkit
from laminar.config import Field, _range
from laminar.offloop import Lane, LaneBusy
from laminar.policy import ckpt_schedule as cs
from laminar.runtime.ckpt_scan import CkptScanner, Listing

log = logging.getLogger("laminar.migrate")

OPT_OUT_FIELD = "periodic_checkpoints"  # false in a job's spec: never signalled periodically
# Checks of jobs' checkpoints run side by side (one per owner at a time: laminar.offloop.Lane), so
# a user whose checkpoint takes long to check (many GB, slow storage) holds one of these and
# never delays another user's.
VERIFY_WORKERS = 8
VERIFY_MAX_BYTES = 1 << 40
VERIFY_TIMEOUT_S = 1800.0
VERIFY_TRIES = 3
# Checkpoints of jobs refused by a check's limits, by reason (jobkit.LimitError: too_large, sparse,
# out_of_time), since the agent started: `laminarctl status -o json`, migrate.ckpt.refused.
REFUSED: dict[str, int] = {"too_large": 0, "sparse": 0, "out_of_time": 0}


def _count_refusal(e: BaseException) -> None:
    if isinstance(e, jobkit.LimitError):
        REFUSED[e.reason] = REFUSED.get(e.reason, 0) + 1
DEFAULT_PLAN_BYTES = 64 << 20  # planning size before a job's first checkpoint
CLOCK_STEP_S = 1.0  # wall and monotonic clocks parting by more than this between rounds: a step

CONFIG_FIELDS = {
    "periodic": Field(bool, True, "drive periodic checkpoints at the hazard's interval"),
    "min_interval_s": Field((int, float), cs.MIN_INTERVAL_S, "shortest periodic checkpoint interval (s)",
                            _range(0.1, 86400)),
    "max_interval_s": Field((int, float), cs.MAX_INTERVAL_S, "longest periodic checkpoint interval (s)",
                            _range(0.1, 7 * 86400)),
    "ckpt_pause_s": Field((int, float), 2.0, "planned cost of a checkpoint until one has been measured (s)",
                          _range(0, 3600)),
    "write_mbit": Field((int, float), 8000.0, "local checkpoint write rate assumed for planning (Mbit/s)",
                        _range(0.001, 10_000_000)),
    "uplink_mbit": Field((int, float), 0.0, "uplink shared by checkpoint transfers (Mbit/s; 0: shaping.link_mbit, "
                         "else path_mbit)", _range(0, 10_000_000)),
    "stagger_gap_s": Field((int, float), 1.0, "least time between two jobs' periodic checkpoint signals (s)",
                           _range(0, 3600)),
    "stagger_max_delay_s": Field((int, float), 60.0, "most a periodic checkpoint is delayed to stagger it (s)",
                                 _range(0, 86400)),
    "verify_max_bytes": Field(int, VERIFY_MAX_BYTES, "most bytes a job's checkpoint may declare in its manifest to "
                              "be checked (a larger one, or one with a sparse file, is refused unread)",
                              _range(1, 1 << 60)),
    "verify_timeout_s": Field((int, float), VERIFY_TIMEOUT_S, "longest check of one job's checkpoints (s); past it "
                              "the check stops and the checkpoint counts as unverified", _range(1, 86400)),
    "verify_tries": Field(int, VERIFY_TRIES, "newest checkpoints of a job checked, newest first, to find one that "
                          "verifies", _range(1, 64)),
}


def check_settings(s: dict[str, Any]) -> None:
    """Raises ValueError naming the keys when the ``[migrate]`` settings of this driver
    contradict each other (each key's own range is checked by the config schema):
    ``min_interval_s`` above ``max_interval_s`` would otherwise plan every job at the minimum."""
    lo, hi = float(s["min_interval_s"]), float(s["max_interval_s"])
    if lo > hi:
        raise ValueError(f"migrate.min_interval_s = {lo:g} is above migrate.max_interval_s = {hi:g}: "
                         "the shortest periodic checkpoint interval must not exceed the longest")


# -- pure parts -----------------------------------------------------------------------------


@dataclass
class Track:
    """What the driver knows of one job's checkpoints (wall-clock times)."""

    job_id: str
    first_seen: float
    newest: str = ""  # name of the newest verified checkpoint seen
    newest_at: float | None = None  # its commit time (manifest mtime)
    newest_id: tuple[int, int] | None = None  # its directory (a save at the same step is a new one)
    size_bytes: float | None = None
    latency_s: float | None = None  # signal -> commit, last measured
    signal_at: float | None = None  # last periodic signal
    pending: bool = False  # a signal was sent and its checkpoint has not committed yet
    signals: int = 0
    commits: int = 0
    misses: int = 0
    plan: cs.CkptPlan | None = None
    start_at: float | None = None  # when the stagger lets its next checkpoint start
    skip: str = ""  # why it is not driven (empty: driven)
    history: list[float] = field(default_factory=list)  # recent signal times

    def shift(self, d: float) -> None:
        """Moves every time of the track by ``d`` seconds (the wall clock stepped by ``d``)."""
        self.first_seen += d
        if self.newest_at is not None:
            self.newest_at += d
        if self.signal_at is not None:
            self.signal_at += d
        if self.start_at is not None:
            self.start_at += d
        self.history = [h + d for h in self.history]

    def base(self) -> float:
        """The time the next interval counts from: the newest checkpoint or signal, else first seen."""
        return max(t for t in (self.first_seen, self.newest_at, self.signal_at) if t is not None)

    def occupancy(self, gap_s: float) -> float:
        """How long one of this job's checkpoints keeps the node's checkpoint path busy."""
        p = self.plan
        if p is None:
            return gap_s
        return max(gap_s, p.cost_s)


def due_at(t: Track) -> float:
    """When ``t``'s next checkpoint is due (inf without a plan)."""
    if t.plan is None or math.isinf(t.plan.interval_s):
        return math.inf
    return t.base() + t.plan.interval_s


def starts(tracks: Sequence[Track], now: float, gap_s: float, max_delay_s: float) -> dict[str, float]:
    """Start times of the driven jobs' next checkpoints, staggered with :func:`ckpt_schedule.stagger`.

    Checkpoints in flight (signalled, not committed; or signalled less than their occupancy
    ago) hold the path first: the others queue behind the last of them ends (a leading busy
    entry). Jobs in flight and jobs without a plan are left out of the answer."""
    entries: list[tuple[str, float, float]] = []
    inflight: set[str] = set()
    busy_from, busy_to = math.inf, -math.inf
    for t in tracks:
        if t.skip or t.plan is None:
            continue
        occ = t.occupancy(gap_s)
        if t.signal_at is not None and (t.pending or now - t.signal_at < occ):
            busy = max(occ, now - t.signal_at + gap_s) if t.pending else occ
            busy_from, busy_to = min(busy_from, t.signal_at), max(busy_to, t.signal_at + busy)
            inflight.add(t.job_id)
            continue
        d = due_at(t)
        if math.isfinite(d):
            entries.append((t.job_id, d, occ))
    if inflight:
        first = min([busy_from, *(d for _, d, _ in entries)])
        entries.append(("", first, busy_to - first))  # "" sorts first: it starts at `first`, ends at busy_to
    out = cs.stagger(entries, max_delay_s)
    return {k: v for k, v in out.items() if k and k not in inflight}


def due_now(tracks: Sequence[Track], now: float, gap_s: float, max_delay_s: float) -> list[str]:
    """The job whose staggered start has come (at most one: when a round comes late, two
    starts a gap apart may both have passed; the second then waits for the next round, behind
    the first in flight), as a list. Sets each track's ``start_at``."""
    st = starts(tracks, now, gap_s, max_delay_s)
    for t in tracks:
        t.start_at = st.get(t.job_id)
    return [j for j, s in sorted(st.items(), key=lambda kv: (kv[1], kv[0])) if s <= now][:1]


Ident = tuple[tuple[str, tuple[int, int]], ...]  # a listing's checkpoints: Listing.ident()


@dataclass(frozen=True)
class Checked:
    """What the check of a checkpoint found besides its path: the bytes its verified manifest
    declares (the planning size; never a stat of the job's files, which may be links anywhere),
    the manifest's modification time (the commit time), and which directory it is."""

    size_bytes: int
    committed_at: float
    ident: tuple[int, int]


def limits_of(s: dict[str, Any]) -> jobkit.Limits:
    """A check's limits from the ``[migrate]`` settings ``s``, its deadline from now."""
    return jobkit.Limits(int(s.get("verify_max_bytes", VERIFY_MAX_BYTES)),
                         time.monotonic() + float(s.get("verify_timeout_s", VERIFY_TIMEOUT_S)), refuse_sparse=True)


def checked_info(p: Path, manifest: dict[str, Any]) -> Checked:
    """:class:`Checked` of the checkpoint ``p`` whose ``manifest`` verified (blocking: one lstat)."""
    st = os.lstat(p / jobkit.MANIFEST)  # (the manifest itself: what a transfer sends besides the files)
    d = os.lstat(p)
    return Checked(sum(int(f["size"]) for f in manifest["files"]) + st.st_size, st.st_mtime, (d.st_dev, d.st_ino))


def note_verified(job: Any, newest: Path | None, info: Checked | None) -> None:
    """Sets ``job.ckpt_verified`` (runtime.record.Job) from a check: its newest verified
    checkpoint and commit time (the manifest's, never later than now: a job may date it ahead)."""
    if hasattr(job, "ckpt_verified"):
        job.ckpt_verified = None if newest is None or info is None else (str(newest), min(info.committed_at, time.time()))


def check_newest(names: Sequence[Path], s: dict[str, Any],
                 check: Callable[[Path], object] | None = None) -> tuple[Path | None, Any, Checked | None]:
    """The newest of ``names`` (oldest first) that passes its check, within the settings'
    limits (at most ``verify_tries`` tried, each refused unread past ``verify_max_bytes`` or
    with a sparse file, all of them within ``verify_timeout_s``): (its path, what ``check``
    returned (None: jobkit's check), :class:`Checked`), or (None, None, None). Blocking: a
    verify lane runs it."""
    limits = limits_of(s)
    for p in list(reversed(names))[:int(s.get("verify_tries", VERIFY_TRIES))]:
        try:
            built = None
            if check is None:
                m = jobkit.verify_checkpoint(p, limits=limits)
            else:
                m = jobkit.precheck(p, limits)  # nothing read before the directory is as its manifest says
                built = check(p)
            return p, built, checked_info(p, m)
        except (jobkit.CheckpointError, OSError) as e:
            log.info("migrate: checkpoint %s not taken: %s", p, e)
            _count_refusal(e)
            if limits.deadline is not None and time.monotonic() > limits.deadline:
                break
    return None, None, None


async def wait_new_checkpoint(ckpt_dir: str | Path | None, after: Path | None, timeout: float,
                              alive: Callable[[], bool], poll_s: float = 0.05,
                              check: Callable[[Path], object] | None = None,
                              found: Callable[[Path], object] | None = None, *,
                              job: Any = None, scanner: CkptScanner | None = None, lane: Lane | None = None,
                              settings: dict[str, Any] | None = None) -> Path | None:
    """The first checkpoint under ``ckpt_dir`` newer than ``after`` (a higher step, or ``after``'s
    step saved again: jobkit replaces it) that passes ``check`` (None:
    :func:`laminar.jobkit.verify_checkpoint`; a check raises CheckpointError or OSError), or
    None after ``timeout`` or once ``alive()`` is false with none (every checkpoint listed is
    checked first). ``found`` is called (on the loop) with each checkpoint before its check; it
    may return an awaitable (awaited before the check).

    The directory is the job's: it is listed by ``scanner`` (bounded, off the loop, never
    through a link: :mod:`laminar.runtime.ckpt_scan`), and each checkpoint is checked once, in
    ``lane`` (one check per owner at a time, with the settings' limits: at most
    ``verify_max_bytes``, no sparse file, ``verify_timeout_s``), never on the event loop
    (probes, heartbeats, kill-switches). ``job`` (its ``id`` and ``owner_uid``), ``scanner``,
    ``lane`` and ``settings`` default to a listing of ``ckpt_dir`` of its own and the defaults."""
    import asyncio
    from types import SimpleNamespace

    if not ckpt_dir:
        return None
    s = settings or {}
    who = job if job is not None else SimpleNamespace(id=f"path:{ckpt_dir}", ckpt_dir=ckpt_dir, owner_uid=0)
    if getattr(who, "ckpt_dir", None) != ckpt_dir:
        who = SimpleNamespace(id=f"path:{ckpt_dir}", ckpt_dir=ckpt_dir, owner_uid=getattr(job, "owner_uid", 0))
    scan = scanner or CkptScanner()
    lane = lane or Lane("ckpt-verify", workers=1, timeout_s=float(s.get("verify_timeout_s", VERIFY_TIMEOUT_S)))
    owner = getattr(who, "owner_uid", 0)
    end = time.monotonic() + timeout
    floor = int(after.name[5:]) if after is not None else -1
    known = scan.cached(who.id)  # taken before the checkpoint was asked for: ``after`` as it was
    after_id = known.ident_of(after.name) if known is not None and after is not None else None
    first = True
    failed: set[tuple[str, tuple[int, int]]] = set()

    def verify(p: Path) -> object:
        limits = limits_of(s)
        if check is None:
            return jobkit.verify_checkpoint(p, limits=limits)
        jobkit.precheck(p, limits)  # nothing read before the directory is as its manifest says
        return check(p)

    while True:
        listing = await scan.refresh(who)
        if listing is not None and first and after is not None and after_id is None:
            after_id = listing.ident_of(after.name)
        first = False
        for name, ino in reversed(listing.ckpts if listing is not None else ()):
            n = int(name[5:])
            if n < floor:
                break
            pid = (listing.key[0], ino) if listing is not None else (0, 0)
            if n == floor and pid == after_id:
                continue  # ``after`` itself (a save at the same step replaces it: new)
            if (name, pid) in failed:
                continue
            p = Path(ckpt_dir) / name
            if found is not None:
                res = found(p)
                if asyncio.iscoroutine(res) or isinstance(res, asyncio.Future):
                    await res
            try:
                await lane.run(owner, verify, p, timeout_s=max(1.0, float(s.get("verify_timeout_s", VERIFY_TIMEOUT_S))))
                return p
            except (jobkit.CheckpointError, OSError, TimeoutError, LaneBusy) as e:
                log.info("migrate: checkpoint %s not taken: %s", p, e)
                _count_refusal(e)
                failed.add((name, pid))
        if time.monotonic() >= end or not alive():
            return None
        await asyncio.sleep(poll_s)


# -- the driver -----------------------------------------------------------------------------


class CkptDriver:
    """Drives periodic checkpoints for the jobs of ``comp.agent`` (``comp``: the reclaim
    component, for its settings, hazard models and the jobs it is moving)."""

    def __init__(self, comp: Any) -> None:
        self.comp = comp
        self.tracks: dict[str, Track] = {}
        self.last_round: float | None = None
        self._last_mono: float | None = None
        self.link_bps = 0.0
        self.counts = {"signals": 0, "commits": 0, "misses": 0, "verify_failed": 0, "verify_unknown": 0}
        # job id -> (the checkpoints listed, the newest that verified, that check's transfer
        # manifest or None, what its check found): filled off the event loop by run() (a
        # checkpoint of many GB takes seconds to hash); a direct round() hashes inline. Keyed by
        # the whole listing, not its highest name: a commit below a damaged checkpoint of a
        # higher step changes the listing but not its top. What the prestage, a move's start and
        # the archive's periodic copy take as the newest verified checkpoint while the listing
        # stays (:meth:`checked`).
        self._verified: dict[str, tuple[Ident, Path | None, Any, Checked | None]] = {}
        self.threaded = False
        # job id -> (the listing, whether with the manifest, the check in flight): :meth:`check`
        self._checking: dict[str, tuple[Any, bool, Any]] = {}
        # jobs' checkpoint listings: the job manager's scanner (Airlock reads the same), else one
        # of the driver's own (a stand-in job manager)
        self.scan: CkptScanner = getattr(comp.agent.jobs, "ckpt_scan", None) or CkptScanner()
        # checks of jobs' checkpoints: one per owner at a time, each within verify_timeout_s
        self.lane = Lane("ckpt-verify", workers=VERIFY_WORKERS,
                         timeout_s=float(dict(comp.s).get("verify_timeout_s", VERIFY_TIMEOUT_S)))

    def stats(self) -> dict[str, Any]:
        """Counts for the status: signals, commits, misses, checks that failed or did not
        finish, and the scan and check lanes'."""
        return {**self.counts, "refused": dict(REFUSED), "scan": self.scan.stats(), "verify": self.lane.stats()}

    def _listed(self, job: Any) -> Listing | None:
        """``job``'s checkpoint listing: the scanner's last (run() refreshes it off the loop), or
        scanned here for a direct round() (no event loop: tests, tools)."""
        if self.threaded:
            return self.scan.cached(job.id)
        return self.scan.scan_now(job)

    def verified_bytes(self, job: Any) -> int | None:
        """The size of ``job``'s newest verified checkpoint by its manifest, as last checked
        (whatever its listing became since), or None when none verified. O(1), no file read."""
        hit = self._verified.get(job.id)
        return None if hit is None or hit[3] is None else hit[3].size_bytes

    def listed(self, job: Any) -> list[Path] | None:
        """``job``'s checkpoints (the highest-numbered, oldest first) by the scanner's last
        listing, no scan; None when it has not been listed (or its listing is unknown)."""
        got = self.scan.cached(job.id)
        return None if got is None else got.paths()

    @property
    def s(self) -> dict[str, Any]:
        return dict(self.comp.s)

    def uplink_bps(self) -> float:
        """Bytes/s of the uplink checkpoint transfers share (see the module docstring)."""
        mbit = float(self.s["uplink_mbit"])
        if mbit <= 0:
            try:
                mbit = float(self.comp.agent.config.section("shaping").get("link_mbit") or 0)
            except (KeyError, AttributeError):
                mbit = 0.0
        if mbit <= 0:
            mbit = float(self.s["path_mbit"])
        return mbit * 1e6 / 8

    def _skip_reason(self, job: Any) -> str:
        if getattr(job.spec, OPT_OUT_FIELD, True) is False:
            return f"opted out ({OPT_OUT_FIELD} = false)"
        if not job.ckpt_dir:
            return "no checkpoint directory"
        if job.id in self.comp.evacuating:
            return "being moved"
        fence = getattr(self.comp, "fence", None)  # (a stand-in component may have none)
        if fence is not None and job.id in fence.fenced_jobs:
            return "fenced (the node hears none of its zone: migrate.fence_after_s)"
        # (its main process; a member of a multi-node job: any process of its cgroup, torchrun's
        # workers, as request_checkpoint signals them)
        if not self.comp.agent.jobs.catches_checkpoint(job):
            return f"does not catch {job.spec.checkpoint_signal} (no checkpoint contract)"
        return ""

    def _observe(self, t: Track, job: Any, now: float) -> None:
        """Notices a new verified checkpoint of ``job``; measures its size and latency. A signal
        not answered by a new *verified* checkpoint within ``ckpt_wait_s`` is a miss (a
        checkpoint directory that does not verify is no answer), and the job is asked again at
        its next due time."""
        listing = self._listed(job)
        if listing is None and self.threaded and job.ckpt_dir:
            return  # not listed yet, or its scan did not finish: unknown this round
        names = listing.paths() if listing is not None else []
        key = listing.ident() if listing is not None else ()
        newest: Path | None = None
        info: Checked | None = None
        cached = self._verified.get(job.id)
        if not names:
            pass
        elif cached is not None and cached[0] == key:
            newest, info = cached[1], cached[3]
        elif self.threaded:
            return  # run() verifies it in a thread before the next round
        else:
            newest, _, info = check_newest(names, self.s)
            self._verified[job.id] = (key, newest, None, info)
            note_verified(job, newest, info)
        if (newest is not None and info is not None and (newest.name, info.ident) != (t.newest, t.newest_id)
                and self._commit(t, newest, info, now)):
            return
        if t.pending and t.signal_at is not None and now - t.signal_at > float(self.s["ckpt_wait_s"]):
            t.pending = False
            t.misses += 1
            self.counts["misses"] += 1

    def _commit(self, t: Track, newest: Path, info: Checked, now: float) -> bool:
        """Records ``newest``, a verified checkpoint not seen before, by what its check found
        (``info``: its size by its manifest, its commit time; nothing of the job's is read here)."""
        at = info.committed_at
        first = not t.newest
        t.newest, t.newest_at, t.size_bytes = newest.name, min(at, now), float(info.size_bytes)
        t.newest_id = info.ident
        if first and t.signal_at is None:
            return True  # there before the driver looked: not a commit it saw
        t.commits += 1
        self.counts["commits"] += 1
        if t.pending and t.signal_at is not None and at >= t.signal_at - 0.5:
            t.latency_s = max(0.0, min(at, now) - t.signal_at)
            t.pending = False
        return True

    def _plan(self, tracks: list[Track], now: float) -> None:
        s = self.s
        write_bps = float(s["write_mbit"]) * 1e6 / 8
        jobs = []
        for t in tracks:
            size = t.size_bytes if t.size_bytes is not None else float(DEFAULT_PLAN_BYTES)
            pause = float(s["ckpt_pause_s"]) if t.latency_s is None else max(0.0, t.latency_s - size / write_bps)
            jobs.append(cs.CkptJob(t.job_id, size, write_bps, pause))
        # a checkpoint leaves over the uplink *and* the path to a peer: the slower one bounds
        # every transfer, the final one of a notice window (what the reclaim plans with) too
        self.link_bps = min(self.uplink_bps(), float(s["path_mbit"]) * 1e6 / 8)
        window = 0.0 if s["prestage"] == "always" else float(s["expected_notice_s"])
        lo = float(s["min_interval_s"])
        hi = max(lo, float(s["max_interval_s"]))
        plans = cs.plan(jobs, self.comp.evidence.hazards["default"], now, self.link_bps, window, lo, hi,
                        unannounced_frac=self.comp.evidence.notice_odds.unannounced_frac,
                        margin=float(s["notice_margin"]), prestage=s["prestage"] != "off")
        for t in tracks:
            t.plan = plans.get(t.job_id)

    def round(self, now: float | None = None) -> list[str]:
        """One look at every active job; signals the due ones. Returns the ids signalled."""
        mono = time.monotonic()
        if now is None:
            now = time.time()
            # exposure is the time that passed, measured on the monotonic clock: a wall-clock
            # step (NTP, an RTC fixed at boot) or a suspend would otherwise count as hours or
            # years of up time without a departure and pull the learned rate towards 0 (saved)
            if self.last_round is not None and self._last_mono is not None:
                elapsed = min(max(0.0, now - self.last_round), max(0.0, mono - self._last_mono))
                if elapsed > 0:
                    self._expose(now - elapsed, now)
                # the tracks' times are wall clock: a step (or a suspend, which the monotonic
                # clock does not count) moves them with it, so each job keeps its place in its
                # interval (a day's step back stalled every job for a day; one forward made all
                # of them due at once)
                step = (now - self.last_round) - (mono - self._last_mono)
                if abs(step) > CLOCK_STEP_S:
                    for t in self.tracks.values():
                        t.shift(step)
        elif self.last_round is not None and now > self.last_round:  # a caller's clock (tests, replay)
            self._expose(self.last_round, now)
        self.last_round = now
        self._last_mono = mono
        jobs = {j.id: j for j in self.comp.agent.jobs.active()}
        for jid in list(self.tracks):
            if jid not in jobs:
                del self.tracks[jid]
        for jid in list(self._verified):
            if jid not in jobs:
                del self._verified[jid]
        if self.scan is not getattr(self.comp.agent.jobs, "ckpt_scan", None):
            self.scan.keep_only(jobs)  # (the job manager's scanner is the job manager's to prune)
        for jid, job in jobs.items():
            t = self.tracks.setdefault(jid, Track(jid, now))
            if job.ckpt_dir:
                self._observe(t, job, now)
            t.skip = self._skip_reason(job)
        if not self.s["periodic"]:
            for t in self.tracks.values():
                t.skip = t.skip or "periodic checkpoints are off (migrate.periodic = false)"
        reclaim = self.comp.reclaim
        if reclaim is not None and not reclaim["task"].done():
            for t in self.tracks.values():
                t.skip = "this node is being reclaimed"
        driven = [t for t in self.tracks.values() if not t.skip]
        if driven:
            self._plan(driven, now)
        for t in self.tracks.values():
            if t.skip:
                t.plan, t.start_at = None, None
        fired = []
        for jid in due_now(driven, now, float(self.s["stagger_gap_s"]), float(self.s["stagger_max_delay_s"])):
            t = self.tracks[jid]
            if self._signal(jobs[jid], t, now):
                fired.append(jid)
        return fired

    def _expose(self, t0: float, t1: float) -> None:
        """Records ``t0 .. t1`` as exposure of the nodes whose departures are counted here: this
        node stops counting once its reclaim is announced (its departure was counted then, and
        a node that has departed cannot depart again), its live peers go on."""
        nodes = float(self.comp.evidence.exposed_nodes())
        if self.comp.reclaim is not None:
            nodes = max(0.0, nodes - 1.0)
        if nodes > 0:
            self.comp.evidence.observe_exposure(t0, t1, nodes)

    def _signal(self, job: Any, t: Track, now: float) -> bool:
        p = t.plan
        assert p is not None
        if not self.comp.agent.jobs.request_checkpoint(job):
            return False
        due = due_at(t)
        t.signal_at, t.pending = now, True
        t.signals += 1
        t.history = (t.history + [now])[-20:]
        self.counts["signals"] += 1
        late = now - due
        why = (f"{job.id}: periodic checkpoint requested: interval {p.interval_s:.1f} s (Daly with MTBF "
               f"{p.mtbf_s:.0f} s from the hazard, cost C {p.cost_s:.2f} s, uplink share "
               f"{p.share_bps * 8 / 1e6:.1f} Mbit/s); {p.reason}")
        if late > 0.5:
            why += f"; staggered {late:.1f} s behind co-resident checkpoints"
        self.comp._emit(why, job=job.id, phase="periodic", interval_s=round(p.interval_s, 3),
                        cost_s=round(p.cost_s, 3), mtbf_s=round(p.mtbf_s, 1), share_bps=round(p.share_bps),
                        prestage=p.prestage, delay_s=round(max(0.0, late), 3), signal_at=now)
        return True

    async def run(self) -> None:
        """The loop the reclaim component starts; never raises (a failed round is logged)."""
        import asyncio

        self.threaded = True
        while True:
            try:
                await self.verify_new(wait=False)
                self.round()
            except Exception:
                log.exception("migrate: checkpoint round failed")
            await asyncio.sleep(float(self.s["poll_s"]))

    async def verify_new(self, wait: bool = True) -> None:
        """Lists every active job's checkpoints (the scanner, off the loop) and, for each job
        whose listing changed, starts the check that finds its newest verified checkpoint (what
        the next round reads). The checks run side by side, one per owner (:attr:`lane`): a
        user's checkpoint that takes an hour to check delays no other user's. ``wait``: until
        the checks started here end (run() does not: its rounds go on meanwhile)."""
        import asyncio

        jobs = [j for j in self.comp.agent.jobs.active() if j.ckpt_dir]
        await self.scan.refresh_all(jobs)
        started = []
        for job in jobs:
            listing = self.scan.cached(job.id)
            if listing is None or not listing.ckpts:
                continue
            cached = self._verified.get(job.id)
            if cached is not None and cached[0] == listing.ident():
                continue
            flying = self._checking.get(job.id)
            if flying is not None and flying[0] == listing.ident():
                continue
            started.append(asyncio.ensure_future(self.check(job)))
        if wait and started:
            await asyncio.gather(*started, return_exceptions=True)

    async def check(self, job: Any, manifest: bool | None = None) -> tuple[Path | None, Any]:
        """(``job``'s newest verified checkpoint or None, the transfer manifest its check built
        or None) for the job's checkpoint listing now: the check in a worker thread, done once
        per listing whoever asks (this driver's round, a prestage), a second asker of the same
        listing awaiting the first one's. ``manifest``: the check is the transfer manifest's
        build (jobkit's check of each file beside the chunks' hashes, in the same read; the
        reclaim component's ``_newest_checked``) so that the prestage sends with it; None: when
        the component prestages the job (``Checkpoints.prestage_manifest``). Before, the driver's check and
        the prestage's build each read every checkpoint whole."""
        import asyncio

        listing = await self.scan.refresh(job) if job.ckpt_dir else None
        cached = self._verified.get(job.id)
        if listing is None:  # no directory, or its scan did not finish: what the last check found
            return (cached[1], cached[2]) if cached is not None and job.ckpt_dir else (None, None)
        key = listing.ident()
        if cached is not None and cached[0] == key and (cached[2] is not None or not manifest or cached[1] is None):
            return cached[1], cached[2]
        flying = self._checking.get(job.id)
        if flying is not None and flying[0] == key and (flying[1] or not manifest):
            try:  # the lane's answer is check_newest's (newest, manifest, info)
                newest, built, _ = await asyncio.shield(flying[2])
            except (TimeoutError, LaneBusy):  # the first asker counts it and keeps what was there
                keep = cached is not None and cached[1] is not None and cached[1] in listing.paths()
                return (cached[1], None) if keep and cached is not None else (None, None)
            return newest, built
        if manifest is None:
            wants = getattr(getattr(self.comp, "checkpoints", None), "prestage_manifest", None)
            manifest = bool(wants is not None and wants(job))
        names = listing.paths()
        settings = self.s
        build = (lambda p: self.comp.checkpoints.checked_manifest(job, p)) if manifest else None
        fut = asyncio.ensure_future(self.lane.run(getattr(job, "owner_uid", 0), check_newest, names, settings, build,
                                                  timeout_s=float(settings.get("verify_timeout_s", VERIFY_TIMEOUT_S)) + 5.0))
        self._checking[job.id] = (key, manifest, fut)
        try:
            newest, built, info = await asyncio.shield(fut)
            if newest is None:
                self.counts["verify_failed"] += 1
        except (TimeoutError, LaneBusy) as e:
            # its check did not finish (storage that does not answer, a checkpoint too slow to
            # read): the checkpoint it had, if still listed, stays its newest verified one
            log.info("migrate: %s: checking its checkpoints: %s", job.id, e)
            self.counts["verify_unknown"] += 1
            keep = cached is not None and cached[1] is not None and cached[1] in names
            newest, built, info = (cached[1], None, cached[3]) if keep and cached is not None else (None, None, None)
        finally:
            if self._checking.get(job.id, (None, None, None))[2] is fut:
                del self._checking[job.id]
        prev = self._verified.get(job.id)
        if prev is None or prev[0] != key or prev[2] is None or built is not None:
            self._verified[job.id] = (key, newest, built, info)  # (a check with the manifest that ended first is kept)
            note_verified(job, newest, info)
        return newest, built

    def checked(self, job: Any) -> tuple[Path | None, Any] | None:
        """(``job``'s newest verified checkpoint, the transfer manifest its check built or
        None) as the last check found them, while the job's checkpoint listing (names and
        directories) is still the one checked; None when it was not checked or changed since.
        A checkpoint rewritten in place since its check is not noticed here: whoever sends or
        copies it checks what it reads (the send against the manifest, the archive's copy
        against the job's manifest)."""
        hit = self._verified.get(job.id) if job.ckpt_dir else None
        listing = self.scan.cached(job.id) if self.threaded else self.scan.scan_now(job)
        if hit is None or listing is None or listing.ident() != hit[0]:
            return None
        return hit[1], hit[2]

    def view(self) -> list[dict[str, Any]]:
        """The current plan per job (GET /v1/checkpoints)."""
        return [row(t) for t in sorted(self.tracks.values(), key=lambda t: t.job_id)]


def row(t: Track) -> dict[str, Any]:
    p = t.plan
    return {
        "job": t.job_id,
        "driven": not t.skip,
        "skip": t.skip,
        "interval_s": None if p is None else round(p.interval_s, 3),
        "cost_s": None if p is None else round(p.cost_s, 3),
        "mtbf_s": None if p is None else round(p.mtbf_s, 1),
        "share_mbit": None if p is None else round(p.share_bps * 8 / 1e6, 3),
        "prestage": None if p is None else p.prestage,
        "reason": "" if p is None else p.reason,
        "next_at": t.start_at,
        "due_at": None if p is None else due_at(t),
        "size_bytes": t.size_bytes,
        "latency_s": None if t.latency_s is None else round(t.latency_s, 3),
        "newest": t.newest,
        "signals": t.signals,
        "commits": t.commits,
        "misses": t.misses,
        "last_signal": t.signal_at,
    }


