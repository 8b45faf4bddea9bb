"""What a pod's annotations ask of Laminar, and what the agent sends the API server (pure).

A pod opts in with annotations (the pod's, set by whoever creates it)::

    metadata:
      annotations:
        laminar.io/class: long-resident      # required to be adopted: an Airlock class
        laminar.io/priority: "60"            # optional, 0..100 (default 50)
        laminar.io/checkpoint: USR1          # optional: the signal it catches for a checkpoint, or none

A pod without ``laminar.io/class`` is left alone. A bad value is refused (:class:`PodNoteError`
naming the pod, the annotation, the value and what is right); the agent emits it as an event once
and does not adopt the pod. Values are short strings: each is refused past ``VALUE_MAX``
characters before anything else is done with it.

The request bodies (the reclaim's cordon, eviction and the last-checkpoint annotation) are built
here too, so a unit test pins what goes on the wire.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PREFIX = "laminar.io/"
CLASS = PREFIX + "class"
PRIORITY = PREFIX + "priority"
CHECKPOINT = PREFIX + "checkpoint"
LAST_CHECKPOINT = PREFIX + "last-checkpoint"
# On the node while Laminar holds it cordoned for a reclaim: undrain uncordons only a node that
# carries it, never one an operator cordoned.
CORDONED = PREFIX + "cordoned"

CLASSES = ("long-resident", "standard", "transient")  # laminar.airlock.cgroups.LIFECYCLE_CLASSES
PRIORITY_MAX = 100  # laminar.runtime.spec.PRIORITY_MAX
PRIORITY_DEFAULT = 50
CHECKPOINT_DEFAULT = "USR1"
VALUE_MAX = 64
# Linux's signals a process may catch (KILL and STOP it cannot), by name without SIG: what the
# checkpoint annotation may name (policy is pure: no import of the signal module here).
CATCHABLE = frozenset("HUP INT QUIT ILL TRAP ABRT BUS FPE USR1 SEGV USR2 PIPE ALRM TERM STKFLT CHLD CONT TSTP "
                      "TTIN TTOU URG XCPU XFSZ VTALRM PROF WINCH IO PWR SYS".split())
# An eviction a PodDisruptionBudget refuses (429) is asked again after these waits (seconds),
# the last one repeated, until the caller's deadline: the disruption controller updates a PDB's
# allowance within seconds of a pod becoming ready elsewhere.
EVICT_BACKOFF_S = (1.0, 2.0, 4.0, 8.0)


class PodNoteError(ValueError):
    """A pod's laminar.io annotation holds a value Laminar refuses; the message names the pod,
    the annotation, the value and what is right."""


@dataclass(frozen=True)
class PodAsk:
    """What an opted-in pod asks for."""

    job_class: str
    priority: int
    checkpoint: str  # a signal name without SIG ("USR1"), or "none"


def _shown(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= VALUE_MAX + 2 else s[:VALUE_MAX] + "...'"


def parse_annotations(pod: str, notes: Any) -> PodAsk | None:
    """None when the pod did not opt in (no ``laminar.io/class``); else what it asks. Raises
    :class:`PodNoteError` on a bad value (``pod``: ``namespace/name``, for the message)."""
    if not isinstance(notes, dict) or CLASS not in notes:
        return None
    for key in (CLASS, PRIORITY, CHECKPOINT):
        v = notes.get(key)
        if v is not None and (not isinstance(v, str) or len(v) > VALUE_MAX):
            raise PodNoteError(f"pod {pod}: annotation {key} = {_shown(v)}: expected a string of at most "
                               f"{VALUE_MAX} characters")
    cls = notes[CLASS].strip()
    if cls not in CLASSES:
        raise PodNoteError(f"pod {pod}: annotation {CLASS} = {_shown(notes[CLASS])}: unknown class; "
                           f"classes are {', '.join(CLASSES)}")
    raw = notes.get(PRIORITY)
    prio = PRIORITY_DEFAULT
    if raw is not None:
        s = raw.strip()
        if not re.fullmatch(r"[0-9]{1,3}", s) or int(s) > PRIORITY_MAX:
            raise PodNoteError(f"pod {pod}: annotation {PRIORITY} = {_shown(raw)}: expected an integer "
                               f"0..{PRIORITY_MAX} (default {PRIORITY_DEFAULT})")
        prio = int(s)
    return PodAsk(cls, prio, parse_checkpoint(pod, notes.get(CHECKPOINT)))


def parse_checkpoint(pod: str, raw: str | None) -> str:
    """The checkpoint annotation as a signal name without ``SIG`` (``USR1``) or ``none``."""
    if raw is None:
        return CHECKPOINT_DEFAULT
    s = raw.strip().upper()
    if s == "NONE":
        return "none"
    name = s.removeprefix("SIG")
    if name not in CATCHABLE:
        raise PodNoteError(f"pod {pod}: annotation {CHECKPOINT} = {_shown(raw)}: expected the name of a signal "
                           f"the job catches (USR1, the default; USR2; TERM...) or none; KILL and STOP cannot "
                           f"be caught")
    return name


def cordon_patch(on: bool, reason: str) -> dict[str, Any]:
    """Strategic-merge patch of the node: ``spec.unschedulable`` and the :data:`CORDONED` mark
    (removed on uncordon)."""
    return {"metadata": {"annotations": {CORDONED: reason[:VALUE_MAX * 4] if on else None}},
            "spec": {"unschedulable": on}}


def eviction_body(namespace: str, name: str) -> dict[str, Any]:
    """The policy/v1 Eviction POSTed to ``/api/v1/namespaces/<ns>/pods/<name>/eviction``. No
    grace period of its own: the pod's terminationGracePeriodSeconds holds (the checkpoint was
    taken before)."""
    return {"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace}}


def annotation_patch(key: str, value: str | None) -> dict[str, Any]:
    """Merge patch of a pod's one annotation (None removes it)."""
    return {"metadata": {"annotations": {key: value}}}


def evict_wait(tries: int) -> float:
    """The wait before the next eviction after ``tries`` refusals (429) so far."""
    return EVICT_BACKOFF_S[min(max(tries, 1), len(EVICT_BACKOFF_S)) - 1]
