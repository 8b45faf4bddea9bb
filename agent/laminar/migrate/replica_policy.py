"""The pure rules about the replicas held here for other nodes' jobs (policy: no agent, no I/O;
tested in memory): which checkpoints the GC takes (:func:`replica_victims`) and what it will do
with a key, for operators (:func:`replica_gc_plan`), what a caller who may not see whose job it
is sees (:func:`redact_replica`), a source's answer to a keeper's ``needs`` question
(:func:`keeper_needed`) and whether a keeper held here is unconfirmed (:func:`keeper_confirmation`).
The rules themselves are told in :mod:`laminar.migrate.replicas` (*Replicas held here*, *The
operator's view, and drop*), whose part :class:`laminar.migrate.replicas.Replicas` applies them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable
from typing import Any

from laminar.migrate.constants import _CKPT_NAME, KEEPER_ENDED_STATES, REPLICA_LATE_S

# Replica states after which this node keeps a key's checkpoints only for a local job using them.
REPLICA_DONE_STATES = ("released", "handed-over", "placed", "passed", "resumed")

def _ckpt_step(name: str) -> int:
    return int(name[5:]) if _CKPT_NAME.fullmatch(name) else -1


def replica_victims(names: Iterable[str], *, newest: str | None, keep: Collection[str]) -> list[str]:
    """Which of a key's held checkpoints go (policy; the rule is in :mod:`laminar.migrate.replicas`,
    *Replicas held here*). Only ``ckpt-<n>`` names are ever chosen (``.tmp-*`` commits in progress
    and anything else are not this rule's), never one in ``keep``. ``newest``: a checkpoint of the key just
    committed (or kept) here; those older than it go. None: the key is done here; all go.
    Returned newest first."""
    floor = math.inf if newest is None else _ckpt_step(newest)
    out = [n for n in names if _CKPT_NAME.fullmatch(n) and n not in keep and _ckpt_step(n) < floor]
    return sorted(out, key=_ckpt_step, reverse=True)


# Replica states an operator decides about: the GC never removes these keys' checkpoints.
REPLICA_OPERATOR_STATES = ("failed", "archived")
# States whose key a drop refuses without ``force``: the job may have no other way back.
REPLICA_KEEPER_STATES = ("keeping", "waiting")


def replica_gc_plan(*, state: str | None, held: dict[str, float], in_use: Collection[str], now: float,
                    updated: float | None = None, newest_mtime: float | None = None, taking: bool = False,
                    take_over: bool = False, src_node: int | None = None, next_round: float | None = None,
                    next_look: float | None = None, orphan_s: float = 21600.0, keeper_check_s: float = 600.0,
                    row_keep_s: float = 86400.0) -> dict[str, Any]:
    """What the replica GC will do with one key held here, and when (policy: the same rule
    :meth:`laminar.migrate.replicas.Replicas.gc` and its round apply, :mod:`laminar.migrate.replicas`, *Replicas held here*),
    for operators to read (``laminarctl replicas``).

    ``state``: the key's ``migrate_replicas`` state (None: no row, no keeper named it); ``held``:
    its ``ckpt-<n>`` checkpoints here, name -> modification time; ``in_use``: those a local job
    uses; ``updated``: when the row last changed; ``newest_mtime``: the newest change in the key's
    directory; ``taking``: a take-over (or archive claim) of it runs now; ``take_over``: the keeper
    was handed over with a stopped job; ``next_round``: when the next GC round runs (wall clock);
    ``next_look``: a waiting keeper's next look for room. Returns ``{"removes": [names], "at": wall
    time or None, "keeps": [names], "why": text, "row_at": when the row itself goes or None}``."""
    names = sorted((n for n in held if _CKPT_NAME.fullmatch(n)), key=_ckpt_step, reverse=True)
    used = [n for n in names if n in in_use]
    out: dict[str, Any] = {"removes": [], "at": None, "keeps": names, "why": "", "row_at": None}
    use_note = f"; {', '.join(used)} kept while a local job uses it" if used else ""
    src = f"node {src_node}" if src_node is not None else "its source"
    if taking:
        out["why"] = "a take-over (or archive claim) of it runs now"
        return out
    if state is None:
        victims = [n for n in names if n not in in_use]
        if not victims:
            out["why"] = "no keeper named it; a local job uses it" if used else "no keeper named it; nothing to remove"
            return out
        at = (now if newest_mtime is None or math.isinf(newest_mtime) else newest_mtime) + orphan_s
        out.update(removes=victims, at=at, keeps=used,
                   why=f"no keeper named it: goes once nothing in it changed for replica_orphan_s ({orphan_s:g} s)"
                       + use_note)
        return out
    if state == "keeping":
        if take_over:
            out["why"] = f"keeping: {src} stopped the job and left it here; the take-over places it"
        elif keeper_check_s > 0 and updated is not None:
            out["why"] = (f"keeping the job of {src}: kept while the job may need it; asked whether it still "
                          f"does from {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(updated + keeper_check_s))} UTC")
        else:
            out["why"] = f"keeping the job of {src}: kept while the job may need it"
        return out
    if state == "waiting":
        when = "" if next_look is None else \
            f" (next look {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(next_look))} UTC)"
        out["why"] = f"waiting for room to resume the job of {src} (its source is gone){when}: kept"
        return out
    if state == "failed":
        out["why"] = "the take-over found no verified checkpoint here: kept for an operator (laminarctl replicas drop)"
        return out
    if state == "archived":
        out["why"] = "passed to the archive when this node was reclaimed: kept for an operator (laminarctl replicas drop)"
        return out
    if state not in REPLICA_DONE_STATES:
        out["why"] = f"state {state!r}: not the GC's"
        return out
    late = {n for n in names if updated is not None and held[n] > updated and now - held[n] < REPLICA_LATE_S}
    victims = [n for n in names if n not in in_use and n not in late]
    keeps = [n for n in names if n in in_use or n in late]
    why = f"{state}: the job no longer needs it here"
    if victims:
        out.update(removes=victims, at=now if next_round is None else max(now, next_round))
    elif late:  # nothing goes now: the late ones go once REPLICA_LATE_S passed (the last of them then)
        gone_later = [n for n in names if n in late and n not in in_use]
        if gone_later:
            out.update(removes=gone_later, at=max(held[n] for n in gone_later) + REPLICA_LATE_S)
            keeps = [n for n in names if n in in_use]
    if late:
        why += (f"; {', '.join(sorted(late, key=_ckpt_step, reverse=True))} came after the row changed (a keeper naming"
                f" it may follow): kept until {REPLICA_LATE_S:g} s after it came")
    why += use_note
    if not names and updated is not None:
        out["row_at"] = updated + row_keep_s
        why += "; nothing held: the row goes after replica_row_keep_s"
    out.update(keeps=keeps, why=why)
    return out


# What a caller that is neither root, the control group nor the job's owner does not see of a
# replica (GET /v1/migrate/replicas): which job it is, whose, and what it runs as here.
REPLICA_PRIVATE_FIELDS = ("key", "src_job", "owner_uid", "job_id", "used_by", "last_error", "needs_error")


def redact_replica(item: dict[str, Any]) -> dict[str, Any]:
    """A replica's view for a caller that may not see whose job it is: the fields in
    REPLICA_PRIVATE_FIELDS are None, ``redacted`` is True; state, sizes, ages and the GC's plan
    stay (every local user may see where the node's disk goes)."""
    out = {**item, **{f: None for f in REPLICA_PRIVATE_FIELDS}, "redacted": True}
    if item.get("droppable"):
        out["droppable"] = "refused (details for root or the control group)"
    return out


def keeper_needed(state: str | None, keeper: int | None, asker: int, busy: bool) -> tuple[bool, str]:
    """The source's answer to ``asker`` (a node holding a keeper of one of its jobs, control op
    ``needs``): (still needed, why). Policy; the rule is in :mod:`laminar.migrate.replicas`, *Replicas held here*.
    ``state``: the job's state here (None: no record of it); ``keeper``: the node this agent
    handed the job's keeper to last (None: unknown, e.g. after a restart); ``busy``: a prestage or
    move of the job runs now (it may be handing the keeper to ``asker`` right now). Not needed
    only when the job ended or moved, or another node holds its keeper; anything unknown keeps it."""
    if state is None:
        return True, "this node has no record of the job"
    if busy:
        return True, "a prestage or move of the job is in progress"
    if state in KEEPER_ENDED_STATES:
        return False, f"the job {state} on its source"
    if keeper is not None and keeper != asker:
        return False, f"node {keeper} keeps the job now"
    if keeper is None:
        return True, f"the job is {state} and its source does not know its keeper (it may be this keeper)"
    return True, f"the job is {state} and this node is its keeper"


def keeper_confirmation(*, state: str | None, take_over: bool, updated: float | None, answered: float | None,
                       unanswered: int, now: float) -> dict[str, Any]:
    """Whether a keeper held here is *unconfirmed*: its source, alive in the zone, did not answer
    the last ``needs`` question about it (a one-way partition, an endpoint that does not answer,
    an older agent that does not know the op). Policy; :mod:`laminar.migrate.replicas`, *Replicas held here*.
    Only a ``keeping`` keeper that is not a take-over is ever asked, so only it can be
    unconfirmed; nothing is removed for it (it may be the job's only copy).

    ``updated``: when its row last changed (for a ``keeping`` row: the source's last ``keeper``
    message); ``answered``: when the source last answered ``needs`` (None: never);
    ``unanswered``: the questions in a row it did not answer (an answer, or a new ``keeper``
    message, sets it back to 0). Returns ``{"unconfirmed": bool, "heard_at": when the source last
    spoke about the keeper (its keeper message or an answer) or None, "silent_s": seconds since
    then or None}``; both None for a keeper that is never asked."""
    if state != "keeping" or take_over:
        return {"unconfirmed": False, "heard_at": None, "silent_s": None}
    heard = max((t for t in (updated, answered) if t is not None), default=None)
    return {"unconfirmed": unanswered > 0, "heard_at": heard,
            "silent_s": None if heard is None else max(0.0, now - heard)}
