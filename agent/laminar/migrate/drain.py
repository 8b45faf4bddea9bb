"""What a reclaimed node does with the jobs queued on it.

A reclaim moves the node's running jobs (:mod:`laminar.migrate.reclaim`). A job still *queued*
here has no process and no checkpoint to move; left alone it would start on the capacity the
moves free, on a node about to go, and be killed at the window's end (state ``reclaimed``), or
stay queued on a node that is gone. So at the notice the node holds its queue
(``JobManager.hold_queue``: no queued job starts here any more) and :func:`place_queued_elsewhere`
places every queued job again through the zone, from its spec as submitted (GPU indices of this
node become their count; the request names the job it came from, ``requeued_from``
``n<node>-<job>``, which the node that takes it stores: laminar.runtime.provenance):

* one the zone places leaves this node's queue (state ``requeued``, the reason naming the node
  and the job it became there) and a ``migrate`` event says so;
* one that finds no place (``queued-out``) stays queued here, held, and is tried again every
  :data:`RETRY_S` until the window ends;
* one whose placement is ``unconfirmed`` (the destination may have started it) or ``rejected``
  (no node may take such a job) is not tried again: it stays queued here, held, so it never runs
  twice, and the event says why;
* a job that becomes queued during the window (a hand-over bound before the notice) is placed
  the same way.

Without a zone (a single node) the queued jobs stay queued here, held. Counted in the
migration status as ``queued_placed``.

**An agent restart during the window.** The reclaim is stored (``migrate_reclaim``, with the
window's end in wall-clock time): the restarted job manager holds its queue from its start
(:func:`held_at_start`, before Airlock's word would start a queued job), and the reclaim
component places the queued jobs again. A job whose placement was asked for before the restart
and not settled (the zone may have placed it: a ``placing`` record in ``migrate_moves``) is
not placed a second time: it stays queued here, held, as an ``unconfirmed`` one does. An agent
restarted during a cancel (store meta :data:`CANCEL_META`, kept from the cancel's first step to
its last) holds its queue (:data:`SETTLING_HOLD`) while a queued job's placement elsewhere was
unsettled, until the reclaim component has settled what the cancel left as it would have. What is
left of the window is measured by the boot's own clock (``CLOCK_BOOTTIME``, which steps of the
wall clock do not move; store meta ``migrate.reclaim_clock``) when the agent restarts on the boot
that stored the reclaim (:func:`window_left`); after a reboot by the wall clock, never more than
the notice.

**A reclaim withdrawn** (``laminarctl reclaim cancel``): the placement loop stops after the
placement it is asking for (never cut in the middle: the zone may place the job); a queued job
whose placement elsewhere is still unsettled then (``unconfirmed``, or asked for before a
restart) is stopped here (state ``stopped``, the reason saying where it may run) so it never runs
twice; the queue hold is released and the others start here (:func:`release_hold`). The node
takes placements again (:func:`undrain`); the kill-switch deadlines the reclaim armed are cleared
(:func:`disarm`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from laminar.policy import moves
from laminar.policy.endcause import EndCause

log = logging.getLogger("laminar.migrate")

RETRY_S = 1.0  # a queued job that found no place is tried again this often during the window


def hold_reason(node: int) -> str:
    """The queue-hold reason of a reclaim of ``node`` (what each held queued job shows)."""
    return f"node {node} is reclaimed: no queued job starts here; each is placed again elsewhere"


# The queue hold of an agent restarted during a reclaim's cancel, while a queued job's placement
# elsewhere was unsettled: released once the reclaim component has stopped that job (it may run
# there), as the cancel would have.
SETTLING_HOLD = "a withdrawn reclaim's placements of queued jobs elsewhere are being settled"
CANCEL_META = "migrate.reclaim_cancelling"  # store meta: a cancel under way ({"node", "window_end"})


def release_hold(jobs: Any, node: int) -> bool:
    """Releases the job manager's queue hold when it is ``node``'s reclaim's (another keeper's
    hold stays); queued jobs that fit start. Returns whether it was released."""
    if jobs is None or getattr(jobs, "held", None) != hold_reason(node):
        return False
    jobs.hold_queue(None)
    return True


def undrain(zone: Any) -> bool:
    """The node takes placements again: the zone arbiter's inventory loses its ``draining`` mark
    (the one ``ZoneComponent.reclaim_notice`` set); peers see it in this node's next summary.
    Returns whether the node was draining."""
    arb: Any = getattr(zone, "arbiter", None)
    inv = getattr(arb, "inventory", None)
    if inv is None or not getattr(inv, "draining", False):
        return False
    arb.inventory = dataclasses.replace(inv, draining=False)
    return True


def disarm(netguard: Any, cgroup_id: int) -> bool:
    """Clears the armed deadline of the job in cgroup ``cgroup_id`` (the one a reclaim armed for
    its window's end) and nothing else: a cut the job has (``LM_JOB_KILL``, an operator's
    ``killswitch job on``) stays. Returns whether a deadline was armed; False for a job the data
    plane does not know."""
    from laminar.bpf import abi

    entry = netguard.job_entry(cgroup_id)
    if entry is None or not entry.flags & abi.LM_JOB_ARMED:
        return False
    netguard.disarm_job(cgroup_id)
    return True


CLOCK_META = "migrate.reclaim_clock"  # store meta: the stored reclaim's window's end by the boot's clock


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def note_window(store: Any, announced: float, left_s: float) -> None:
    """Records the end of the reclaim announced at ``announced`` (wall clock), ``left_s`` from
    now, by the boot's own clock (``CLOCK_BOOTTIME``: not moved by steps of the wall clock, nor
    stopped by a suspend), for :func:`window_left` after an agent restart on this boot."""
    store.set_meta(CLOCK_META, {"announced": announced, "boot_id": _boot_id(),
                                "end_boot": time.clock_gettime(time.CLOCK_BOOTTIME) + left_s})


def window_left(store: Any, notice_s: float, announced: float, deadline: float) -> float:
    """Seconds left of the stored reclaim (``migrate_reclaim``: its notice, when it was announced
    and its window's end, wall clock), negative once it ended: by the boot's clock when this is the
    boot that stored it (:func:`note_window`), else (a reboot) by the wall clock, never more than
    the notice (a wall clock stepped back must not lengthen the window)."""
    clk = store.get_meta(CLOCK_META)
    boot = _boot_id()
    if isinstance(clk, dict) and clk.get("announced") == announced and boot is not None and clk.get("boot_id") == boot:
        return float(clk["end_boot"]) - time.clock_gettime(time.CLOCK_BOOTTIME)
    return min(deadline - time.time(), notice_s)


def held_at_start(store: Any) -> str | None:
    """The queue-hold reason a starting job manager takes on before it admits anything: that of
    this node's stored reclaim (table ``migrate_reclaim`` of :mod:`laminar.migrate.reclaim`)
    whose window is still open (:func:`window_left`); None when there is none, its window
    ended, or the table does not exist yet (a first start)."""
    try:
        row = store.db.execute("SELECT node, notice_s, announced, deadline FROM migrate_reclaim").fetchone()
    except sqlite3.OperationalError:  # no such table: this agent never stored a reclaim
        return None
    placing = _unsettled_placing(store.db)
    if row is None or store.get_meta(CANCEL_META) is not None:  # a cancel the agent's restart interrupted
        return SETTLING_HOLD if placing is not None else None
    if window_left(store, float(row[1]), float(row[2]), float(row[3])) <= 0:
        return None
    return hold_reason(int(row[0]))


def _unsettled_placing(db: sqlite3.Connection) -> object | None:
    """A reclaim's record of a queued job's placement elsewhere not settled (``migrate_moves``
    phase ``placing``; in an older agent's store, which the migrate component's start has not
    upgraded yet when the job manager starts, ``migrate_reclaim_jobs``), or None."""
    for q in ("SELECT 1 FROM migrate_moves WHERE cause='reclaim' AND phase='placing' LIMIT 1",
              "SELECT 1 FROM migrate_reclaim_jobs WHERE phase='placing' LIMIT 1"):
        try:
            got = db.execute(q).fetchone()
        except sqlite3.OperationalError:  # no such table or column: not this store's shape
            continue
        if got is not None:
            return got
    return None


def requeue_spec(spec: dict[str, Any], key: str) -> dict[str, Any]:
    """The spec a queued job is placed again with: as submitted, without what was this node's
    (GPU indices become their count); not lent (the destination decides). Where it came from
    (``key``) is no part of it: the placement's request says so (:func:`requeue_origin`), and the
    node that takes it records it (its env is its user's: laminar.runtime.provenance)."""
    out = dict(spec)
    out.update(lent=False)
    if isinstance(out.get("gpus"), list):
        out["gpus"] = len(out["gpus"])  # indices on this node mean nothing elsewhere: their count does
    return out


async def place_queued_elsewhere(mig: Any, deadline: Callable[[], float], skip: Collection[str] = ()) -> None:
    """Until ``deadline()`` (monotonic; read each round: a shorter window replaces it): place each job queued on this node through the zone
    and take it out of this node's queue once placed (see the module's doc). ``mig`` is the
    migration component (``agent``, ``node_id``, ``job_key``, ``_need``, ``_emit``, ``counts``,
    ``evacuation.note_move``, ``evacuation.forget_move``). ``skip``: jobs never placed (their placement before a
    restart was not settled). Never raises."""
    jobs = mig.agent.jobs
    zone = mig.agent.zone
    if jobs is None or zone is None or not hasattr(zone, "place"):
        return
    done: set[str] = set(skip)  # placed, or not to be tried again
    while time.monotonic() < deadline():
        for job in list(jobs.queued()):
            if job.id in done or time.monotonic() >= deadline():
                continue
            try:
                await _place_one(mig, jobs, zone, job, done)
            except Exception:  # one job's trouble never stops the others
                log.exception("migrate: placing queued job %s elsewhere", job.id)
                done.add(job.id)
        await asyncio.sleep(max(0.0, min(RETRY_S, deadline() - time.monotonic())))


def requeue_origin(job: Any, key: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The request's origin of a requeue of ``job`` as ``key``: that key, and whether the agent
    gave the ``resume_from`` its spec carries (it did when it gave the job its own: the job's
    recorded origin says)."""
    from laminar.runtime.provenance import request_origin

    given = bool(spec.get("resume_from")) and bool(getattr(getattr(job, "origin", None), "resume_given", None))
    return request_origin(requeued_from=key, resume_given=given)


async def _place_one(mig: Any, jobs: Any, zone: Any, job: Any, done: set[str]) -> None:
    demand, _ = mig._need(job)
    key = mig.job_key(job)
    spec = requeue_spec(job.spec.as_dict(), key)
    mig.evacuation.note_move(job.id, moves.Event.PLACE)  # a restart before this settles must not place it twice
    res = await zone.place(spec, demand, job.owner_uid, job.owner_gid, origin=requeue_origin(job, key, spec))
    if res.outcome == "queued-out":
        mig.evacuation.forget_move(job.id)
        return  # no room anywhere now: tried again at the next round
    done.add(job.id)
    if res.outcome != "placed":
        if res.outcome != "unconfirmed":  # unconfirmed: it may run there; never placed again
            mig.evacuation.forget_move(job.id)
        mig._emit(f"queued job {job.id} stays queued on reclaimed node {mig.node_id}, held: its placement "
                  f"elsewhere was {res.outcome} ({res.reason or 'no reason given'})", job=job.id,
                  outcome=res.outcome, reason=res.reason)
        return
    if job.state == "queued":
        await jobs.stop(job.id, f"node {mig.node_id} reclaimed: placed again on node {res.node} as {res.job_id}",
                        state="requeued", cause=EndCause.REQUEUED)
    mig.evacuation.forget_move(job.id)
    mig.counts["queued_placed"] = mig.counts.get("queued_placed", 0) + 1
    mig._emit(f"queued job {job.id} of reclaimed node {mig.node_id} placed again on node {res.node} as "
              f"{res.job_id}", job=job.id, outcome="placed", node=res.node, new_job=res.job_id)
