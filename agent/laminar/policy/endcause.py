"""Why a job ended, as data (pure): :class:`EndCause`, one member for each way a job ends.

A job's ``state`` says where it is (``exited``, ``stopped``, ``reclaimed``, ``killed``, ...),
its ``reason`` says why in words for a person, and its ``end_cause`` says why for code: the
protocols and policies that depend on why a job ended read the cause, never the reason's text
(a reason may be a user's own words, and its wording changes). A state can have several causes
(``reclaimed``: the notice window ended, a checkpoint left with a keeper or the archive) and a
cause belongs to exactly one state (:data:`STATE_OF`).

The job manager records the cause with the state, at the moment the end is decided (a stop
records it before its grace, so a stop the agent's death cut short keeps it); a live job has
none (``None``). The records of jobs that ended before the column existed are given a cause by
:func:`derive` from their state and the words the agent wrote then, or :attr:`EndCause.UNKNOWN`
where those do not say.

    >>> from laminar.policy.endcause import RESUMED_BY_ITS_KEEPER, EndCause, exited
    >>> [str(exited(c)) for c in (0, 3, None)]
    ['exited_zero', 'exited_nonzero', 'exited_code_unknown']
    >>> EndCause.WINDOW_ENDED in RESUMED_BY_ITS_KEEPER, EndCause.AIRLOCK_KILL in RESUMED_BY_ITS_KEEPER
    (True, False)
"""

from __future__ import annotations

from enum import StrEnum


class EndCause(StrEnum):
    """Each way a job ends today, with the place that ends it that way."""

    # by itself (runtime.jobs: its main process exited)
    EXITED_ZERO = "exited_zero"  # exit code 0
    EXITED_NONZERO = "exited_nonzero"  # a non-zero code, or a signal the agent did not send
    EXITED_CODE_UNKNOWN = "exited_code_unknown"  # reattached after a restart: not the agent's child
    # by a person (POST /v1/jobs/ID/stop)
    STOPPED_BY_USER = "stopped_by_user"  # the job's owner
    STOPPED_BY_OPERATOR = "stopped_by_operator"  # root or the control group, for another user's job
    # never ran (runtime.jobs: the start raised, or the agent died while starting it)
    START_FAILED = "start_failed"
    # the agent was down when it ended (runtime.jobs, at the next start)
    LOST_WITH_CGROUP = "lost_with_cgroup"  # its cgroup was gone: the node rebooted, or it was removed
    ENDED_WHILE_DOWN = "ended_while_down"  # its cgroup empty: it may have finished by itself
    # Airlock's last rung (airlock.manager)
    AIRLOCK_KILL = "airlock_kill"
    # the owner's reclaim of the node (migrate)
    WINDOW_ENDED = "window_ended"  # killed at the notice window's end, before it moved
    HANDED_OVER = "handed_over"  # its hand-over was sent before a restart: that node runs or keeps it
    HELD_ELSEWHERE = "held_elsewhere"  # no room in the zone: a keeper keeps its checkpoint and resumes it
    ARCHIVED = "archived"  # its checkpoint is in the archive (or on its way): the first agent with room resumes it
    MIGRATED = "migrated"  # moved: another node runs it from its checkpoint
    PLACEMENT_UNSETTLED = "placement_unsettled"  # queued; a cancelled reclaim's placement elsewhere may run it
    # another node's copy (migrate, after a partition)
    SUPERSEDED = "superseded"  # a node that took the job over runs it
    FINISHED_ELSEWHERE = "finished_elsewhere"  # its source finished it: this copy was a rerun
    # placed again elsewhere (a reclaim's drain of the queue; a loaned node returned to its pool)
    REQUEUED = "requeued"
    # a multi-node job's member stopped by the job's origin (laminar.members: the job's stop,
    # its end, or its restart, which starts the member again with the next generation)
    STOPPED_BY_ORIGIN = "stopped_by_origin"
    # a record from before the cause was kept, whose words do not say
    UNKNOWN = "unknown"


# The one state each cause ends a job in (runtime.record.STATES).
STATE_OF: dict[EndCause, str] = {
    EndCause.EXITED_ZERO: "exited", EndCause.EXITED_NONZERO: "exited", EndCause.EXITED_CODE_UNKNOWN: "exited",
    EndCause.STOPPED_BY_USER: "stopped", EndCause.STOPPED_BY_OPERATOR: "stopped",
    EndCause.PLACEMENT_UNSETTLED: "stopped", EndCause.FINISHED_ELSEWHERE: "stopped",
    EndCause.STOPPED_BY_ORIGIN: "stopped",
    EndCause.START_FAILED: "failed",
    EndCause.LOST_WITH_CGROUP: "lost", EndCause.ENDED_WHILE_DOWN: "lost",
    EndCause.AIRLOCK_KILL: "killed", EndCause.WINDOW_ENDED: "reclaimed", EndCause.HANDED_OVER: "reclaimed",
    EndCause.HELD_ELSEWHERE: "reclaimed", EndCause.ARCHIVED: "reclaimed",
    EndCause.MIGRATED: "migrated", EndCause.SUPERSEDED: "migrated",
    EndCause.REQUEUED: "requeued",
}

# A job stopped here for good without moving, whose keeper (the node holding its checkpoint for
# this one) is to resume it: its window ended first, or it was lost with its cgroup (a reboot).
# Not one that may have ended by itself while the agent was down, nor one Airlock killed.
# (migrate: the ``needs`` answer's ``stopped_for_good``.)
RESUMED_BY_ITS_KEEPER = frozenset({EndCause.WINDOW_ENDED, EndCause.LOST_WITH_CGROUP})

# A job stopped here for good by its node's reclaim, its checkpoint in no other node's keeping:
# the copy to the archive a restart cut is taken up for it (migrate: ``StoppedCopies.restore_late_copies``).
# Not one handed over or held elsewhere (another node runs or resumes it: a published copy would
# run it twice).
LATE_COPY_TAKEN_UP = frozenset({EndCause.ARCHIVED, EndCause.WINDOW_ENDED})

# The words older agents wrote (and this one still writes) in the reasons of some ends: read only
# by :func:`derive`, for records that have no cause yet.
WINDOW_ENDED_TEXT = "the notice window ended"
LOST_WITH_CGROUP_TEXT = "its cgroup was gone when the agent started (the node rebooted, or it was removed)"
ENDED_WHILE_DOWN_TEXT = "ended while the agent was down (exit code unknown)"


def exited(code: int | None) -> EndCause:
    """The cause of a job whose main process exited by itself with ``code`` (None: unknown)."""
    if code is None:
        return EndCause.EXITED_CODE_UNKNOWN
    return EndCause.EXITED_ZERO if code == 0 else EndCause.EXITED_NONZERO


def stopped_by(caller_uid: int, owner_uid: int) -> EndCause:
    """The cause of a stop asked for by ``caller_uid``: its owner's own (root's job stopped by
    root too), else an operator's (root or the control group)."""
    return EndCause.STOPPED_BY_USER if caller_uid == owner_uid else EndCause.STOPPED_BY_OPERATOR


def parse(value: object) -> EndCause | None:
    """A stored or received cause: None for none, :attr:`EndCause.UNKNOWN` for a word this
    version does not know (a newer agent's)."""
    if value is None or value == "":
        return None
    try:
        return EndCause(str(value))
    except ValueError:
        return EndCause.UNKNOWN


def derive(state: str, reason: str | None, exit_code: int | None, owner_uid: int) -> EndCause | None:
    """The cause of a record kept before causes were (the store's upgrade), from its state and
    the words the agent wrote: None for a live job, :attr:`EndCause.UNKNOWN` where they do not
    say. A ``stopped`` job's reason may be its stopper's own words: only the agent's default
    (``stopped by uid N``) says who stopped it."""
    text = reason or ""
    if state in ("queued", "running", "suspended", "starting"):
        return None
    if state == "exited":
        return exited(exit_code)
    if state == "failed":
        return EndCause.START_FAILED
    if state == "lost":
        return {LOST_WITH_CGROUP_TEXT: EndCause.LOST_WITH_CGROUP,
                ENDED_WHILE_DOWN_TEXT: EndCause.ENDED_WHILE_DOWN}.get(text, EndCause.UNKNOWN)
    if state == "requeued":
        return EndCause.REQUEUED
    if state == "killed":
        return EndCause.AIRLOCK_KILL
    if state == "reclaimed":
        if text.startswith("airlock reclaimed: "):  # an Airlock kill of an agent older than the state ``killed``
            return EndCause.AIRLOCK_KILL
        if not text.startswith("node "):
            return EndCause.UNKNOWN
        if WINDOW_ENDED_TEXT in text:
            return EndCause.WINDOW_ENDED
        if " reclaimed with no room in the zone: " in text:
            return EndCause.HELD_ELSEWHERE
        if " reclaimed with no room, no keeper " in text:
            return EndCause.ARCHIVED
        if " handed over to node " in text:
            return EndCause.HANDED_OVER
        if " archive" in text:
            return EndCause.ARCHIVED
        return EndCause.UNKNOWN
    if state == "migrated":
        if text.startswith("migrated to node "):
            return EndCause.MIGRATED
        if text.startswith("node ") and " runs it as " in text:
            return EndCause.SUPERSEDED
        return EndCause.UNKNOWN
    if state == "stopped":
        if text == f"stopped by uid {owner_uid}":
            return EndCause.STOPPED_BY_USER
        prefix = "stopped by uid "
        if text.startswith(prefix) and text[len(prefix):].isdigit():
            return EndCause.STOPPED_BY_OPERATOR
        return EndCause.UNKNOWN
    return EndCause.UNKNOWN
