"""Tunables and names more than one part of the migrate component uses (:mod:`laminar.migrate.reclaim`
and the parts :class:`~laminar.migrate.reclaim.ReclaimComponent` inherits); a part's own are at the top
of its module."""

from __future__ import annotations

import re

from laminar.policy.endcause import WINDOW_ENDED_TEXT

DEFAULT_REMAINING_S = 3600.0  # a job's expected remaining run time when nobody says
# The name the agent gives a moved or taken-over job its origin by, for the job to read (and an
# agent of an older release, which read it back): the agent reads the jobs table's origin_key
# (laminar.runtime.provenance), never this.
MIGRATED_ENV = "LM_MIGRATED_FROM"
HOLD_MIN_S = 30.0

# A source's job in these states lives there (runs, or will): a keeper must not revive it elsewhere,
# nor a node claim it from the archive.
SOURCE_LIVE_STATES = ("queued", "starting", "running", "suspended")

# A source's job in these states needs no keeper anywhere: it ended here (by itself, by its user, or
# failed: the source releases its keeper then too) or it moved (the destination runs it, under its
# own key, with its own keeper).
KEEPER_ENDED_STATES = ("exited", "stopped", "failed", "migrated")

# The words in the reason of a job its node's reclaim stopped at the window's end, before it
# moved (also when the agent was down then), for people: code reads its end cause,
# EndCause.WINDOW_ENDED (its keeper resumes it: ``needs`` answers ``stopped_for_good``).
WINDOW_ENDED = WINDOW_ENDED_TEXT

# A checkpoint committed after its key's row last changed (released, say) may be followed by a
# keeper naming it (the keeper is sent after the transfer): kept this long.
REPLICA_LATE_S = 3600.0

# ASCII only and anchored at the very end (\Z): ``$`` lets one trailing newline through, and
# ``\d`` matches every Unicode digit, which int() then reads (``ckpt-5\n`` and ``ckpt-٥`` aliased
# ckpt-5). Use valid_ckpt_name / valid_key (full matches); ``.match`` on these is safe too.
_CKPT_NAME = re.compile(r"^ckpt-[0-9]{1,18}\Z")
_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")  # a transfer's job id (transfer.manifest._SAFE)


def valid_key(value: object) -> bool:
    """A migration key or transfer job id (``n<node>-<job id>``): ASCII letters, digits, ``_.-``
    (not first), at most 128 characters, the whole string."""
    return isinstance(value, str) and _SAFE_KEY.fullmatch(value) is not None


def valid_ckpt_name(value: object) -> bool:
    """A checkpoint's name, ``ckpt-<n>`` with ASCII digits, the whole string."""
    return isinstance(value, str) and _CKPT_NAME.fullmatch(value) is not None

DEFAULT_CKPT_BYTES = 64 << 20  # planning size of a job that has not checkpointed yet

# Replicas this node holds for other nodes' jobs (``<root>/checkpoints/<key>/``) that are no longer
# needed are renamed into ``<root>/REPLICA_TRASH/`` on the event loop, then removed in a thread.
REPLICA_TRASH = "replica-gc"


# A job of a user other than root resumes from a replica here through ``<state_dir>/RESUME_DIR/<key>/
# ckpt-<n>/``: ``<key>/`` its owner's (0500; the state directory and RESUME_DIR are 0711), the
# checkpoint directory root's (0755) with hard links to the replica's files (root's, 0644), or
# copies of those only root may read. ``xfer/`` itself stays root's alone (0700).
RESUME_DIR = "resume"
# A resume copy no local job names goes once this old (the hand-over that made it may still be
# starting its job).
RESUME_KEEP_S = 600.0


# The replica root is walked off the event loop, one walk at a time (a lane of one thread), each
# of at most REPLICA_WALK_MAX entries (what a tree holds past it is not counted; a key not walked
# whole never looks old) and REPLICA_SCAN_TIMEOUT_S; GET /v1/migrate/replicas answers from a scan
# at most REPLICA_VIEW_MAX_AGE_S old (any number of requests: one walk).
REPLICA_WALK_MAX = 200_000
REPLICA_SCAN_TIMEOUT_S = 30.0
REPLICA_VIEW_MAX_AGE_S = 2.0
REPLICA_DROP_WALK_MAX = 10_000  # a drop's count of the bytes it removes, on the loop
