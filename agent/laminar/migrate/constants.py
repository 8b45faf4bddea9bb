"""Tunables and names more than one part of the migrate component uses (:mod:`laminar.migrate.reclaim`
and the parts :class:`~laminar.migrate.reclaim.ReclaimComponent` inherits); a part's own are at the top
of its module."""

from __future__ import annotations

import re

DEFAULT_REMAINING_S = 3600.0  # a job's expected remaining run time when nobody says
MIGRATED_ENV = "LM_MIGRATED_FROM"  # LAMINAR_* names are reserved by the job manager
HOLD_MIN_S = 30.0

# A source's job in these states lives there (runs, or will): a guard must not revive it elsewhere,
# nor a node claim it from the archive.
SOURCE_LIVE_STATES = ("queued", "starting", "running", "suspended")

# A source's job in these states needs no guard anywhere: it ended here (by itself, by its user, or
# failed: the source releases its buddy then too) or it moved (the destination runs it, under its
# own key, with its own buddy).
GUARD_ENDED_STATES = ("exited", "stopped", "failed", "migrated")

# The reason of a job its node's reclaim stopped at the window's end, before it moved (also when
# the agent was down then): its guard resumes it (``needs`` answers ``stopped_for_good``).
WINDOW_ENDED = "the notice window ended"

# A checkpoint committed after its key's row last changed (released, say) may be followed by a
# guard naming it (the guard is sent after the transfer): kept this long.
REPLICA_LATE_S = 3600.0

_CKPT_NAME = re.compile(r"^ckpt-\d+$")
_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # a transfer's job id (transfer._SAFE)
