"""Pure decisions of an owner's reclaim carried out through a scheduler, and of the last
checkpoint published to it (design-34 §3; the mechanism is :mod:`laminar.sched`).

No I/O here: the scheduler component and its backends call these, and the unit tests check
them in memory.

- :func:`publish_text`: what a scheduler is told of a job's last checkpoint
  (``laminar-ckpt=<unix time> <path>``: a Slurm job's comment, a pod's annotation);
- :func:`merge_comment`: a Slurm comment with that text in place of the one published before,
  the user's own words kept in front;
- :func:`should_publish`: whether a job's checkpoint time is news to its scheduler;
- :func:`drain_reason` / :func:`drained_by_us`: the reason a reclaim drains a node with, and
  whether a node's reason is ours (a withdrawn reclaim resumes only a node it drained itself:
  an operator's own drain stays);
- :func:`ckpt_wait_s`: how long an evacuation waits for the job's new checkpoint before it
  gives the job back anyway (from its previous one), so the give-back lands before the window
  ends and the kill-switch cuts what still runs.
"""

from __future__ import annotations

import math

# The prefix of everything Laminar writes to a scheduler (a comment's part, a drain's reason).
PUBLISH_KEY = "laminar-ckpt="
REASON_PREFIX = "laminar:"
# Bounds on what is written to the scheduler (Slurm keeps comments and reasons in its state and
# in its accounting database; a path or a reason from a user must not grow them).
PATH_MAX = 512
REASON_MAX = 200
COMMENT_MAX = 1024
# What a comment keeps of the user's own words before Laminar's part, at most.
USER_COMMENT_MAX = COMMENT_MAX - PATH_MAX - 40


def _printable(text: str, limit: int) -> str:
    """``text`` with control characters replaced by spaces (a newline in a Slurm comment breaks
    ``scontrol show``'s one line per job), cut to ``limit`` characters."""
    return "".join(c if c.isprintable() else " " for c in text[:limit])


def publish_text(ckpt_time: float, path: str | None = None) -> str:
    """``laminar-ckpt=<unix time, whole seconds>`` plus `` <path>`` when given: a job's last
    verified checkpoint as a scheduler is told it. Raises ValueError naming a time that is not a
    finite number >= 0."""
    if isinstance(ckpt_time, bool) or not isinstance(ckpt_time, int | float) or not math.isfinite(ckpt_time) \
            or ckpt_time < 0:
        raise ValueError(f"checkpoint time {ckpt_time!r}: expected a unix time (a finite number >= 0)")
    out = f"{PUBLISH_KEY}{int(ckpt_time)}"
    if path:
        out += " " + _printable(path, PATH_MAX)
    return out


def parse_published(text: str) -> tuple[int, str | None] | None:
    """(unix time, path or None) of the Laminar part of a comment or annotation, None when it has none."""
    at = _ours_at(text)
    if at < 0:
        return None
    rest = text[at + len(PUBLISH_KEY):]
    num, _, path = rest.partition(" ")
    if not num.isdigit() or len(num) > 12:
        return None
    return int(num), (path or None)


def _ours_at(comment: str) -> int:
    """Where Laminar's part of a comment begins (it is always last: at the start or after
    ``"; "``), -1 when there is none."""
    if comment.startswith(PUBLISH_KEY):
        return 0
    at = comment.rfind("; " + PUBLISH_KEY)
    return at + 2 if at >= 0 else -1


def merge_comment(existing: str | None, text: str) -> str:
    """The comment a Slurm job gets: its own words (what was there before Laminar's part, kept,
    at most USER_COMMENT_MAX characters), then ``"; "`` and ``text`` (Laminar's part, replacing
    the one published before)."""
    own = existing or ""
    at = _ours_at(own)
    if at >= 0:
        own = own[:at]
    own = _printable(own.rstrip().removesuffix(";").rstrip(), USER_COMMENT_MAX)
    return (own + "; " + text if own else text)[:COMMENT_MAX]


def should_publish(published: float | None, ckpt_time: float | None) -> bool:
    """Whether the job's last checkpoint (``ckpt_time``, None: it has none) is news to its
    scheduler, which was last told ``published`` (None: nothing yet). Whole seconds, as published."""
    if ckpt_time is None:
        return False
    return published is None or int(ckpt_time) > int(published)


def drain_reason(node: str, reason: str) -> str:
    """The reason a reclaim drains its node with in the scheduler: ``laminar: reclaim of node
    <node>: <the owner's reason>`` (printable, at most REASON_MAX characters)."""
    text = f"{REASON_PREFIX} reclaim of node {node}" + (f": {reason}" if reason else "")
    return _printable(text, REASON_MAX)


def drained_by_us(reason: str | None) -> bool:
    """Whether a node's drain reason is one Laminar set (a withdrawn reclaim undoes only its own
    drain: a node an operator drained for their own reason stays drained)."""
    return bool(reason) and str(reason).startswith(REASON_PREFIX)


def ckpt_wait_s(now_mono: float, deadline_mono: float, give_back_s: float) -> float:
    """How long an evacuation may still wait for a job's new checkpoint: until ``give_back_s``
    (the give-back's own bound: a scheduler command's timeout) before the window's end, never
    less than 0. At 0 the job is given back at once, from the checkpoint it has."""
    return max(0.0, deadline_mono - now_mono - max(0.0, give_back_s))


__all__ = ["COMMENT_MAX", "PATH_MAX", "PUBLISH_KEY", "REASON_MAX", "REASON_PREFIX", "ckpt_wait_s", "drain_reason",
           "drained_by_us", "merge_comment", "parse_published", "publish_text", "should_publish"]
