"""Admission by class capacity: which queued jobs may start now (pure; no kernel, no clock).

A lifecycle class may have a memory **cap** (MiB): the operator's ``[airlock] class_budget_mb``
(also the kernel limit on the class's parent cgroup) and the policy's ``class_caps_mb``
(``laminarctl policy set``, applied at once); where both are set the smaller one holds. A class
with neither has no cap: its jobs start at once and may overcommit the node, which is what the
pressure ladder is for.

In a capped class, **room** is the cap minus the *charges* of the class's member jobs, where a
member is every job of the class that has been started and whose cgroup is not yet gone
(running, suspended, or being stopped or reclaimed), and a job's charge is its memory limit:
``--memory``, else the policy's per-class ``job_default_mb`` (which then becomes the job's
limit), else the whole cap (a job without a limit may use all of it); a job adopted from a
scheduler is charged by the job manager (runtime.adopt: its scheduler's limit, else what it uses
now: no limit of Laminar's bounds it). Room is computed from
limits, never from current usage, so whether a job fits is decided by what was asked for and
not by the instant's allocation: the same submissions in the same order give the same
admissions. Since every member's usage is bounded by its limit, the class's usage stays under
its cap and a job started there never meets a full class parent at ``exec``.

Queued jobs of a class start in order of priority (higher first), then submission (the job
number), and the head of the queue blocks the ones behind it (no overtaking by a smaller job:
a big job is never starved by a stream of small ones). A job whose charge exceeds the cap
itself can never start and is refused at submit; one that was queued before the cap was
lowered under it waits (saying so) without blocking the others.

The job runtime (`laminar.runtime.jobs`) is the mechanism; the simulator may call the same
functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

CLASSES = ("long-resident", "standard", "transient")


@dataclass(frozen=True)
class Limits:
    """The caps (MiB, per class; a class that is absent has none) and the per-job defaults
    (MiB, per class) in force."""

    caps_mb: Mapping[str, int] = field(default_factory=dict)
    job_default_mb: Mapping[str, int] = field(default_factory=dict)

    def cap(self, job_class: str) -> int | None:
        return self.caps_mb.get(job_class)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"class_caps_mb": dict(self.caps_mb), "job_default_mb": dict(self.job_default_mb)}


NO_LIMITS = Limits()


def class_caps(class_budget_mb: Mapping[str, int] | None, policy_caps_mb: Mapping[str, int] | None) -> dict[str, int]:
    """The cap of each class that has one: the smaller of the config's and the policy's."""
    out: dict[str, int] = {}
    for src in (class_budget_mb or {}, policy_caps_mb or {}):
        for c, mb in src.items():
            if mb:
                out[c] = min(out.get(c, mb), int(mb))
    return out


def charge_mb(memory_mb: int | None, cap_mb: int | None) -> int:
    """What a job counts against its class's cap: its limit, or the whole cap without one
    (0 in a class without a cap, where nothing is counted)."""
    if cap_mb is None:
        return 0
    return cap_mb if memory_mb is None else memory_mb


def never_fits(memory_mb: int | None, cap_mb: int | None) -> bool:
    """True when a job with this limit could not start even in an empty class."""
    return cap_mb is not None and memory_mb is not None and memory_mb > cap_mb


@dataclass(frozen=True)
class Queued:
    """A queued job as admission sees it."""

    id: str
    num: int
    job_class: str
    priority: int
    memory_mb: int | None


def queue_order(jobs: Iterable[Queued]) -> list[Queued]:
    """Priority first (higher earlier), then submission order (lower job number earlier)."""
    return sorted(jobs, key=lambda q: (-q.priority, q.num))


@dataclass(frozen=True)
class Wait:
    """Why a queued job waits: its charge, the room left, the cap, its place in the queue
    (1 = next), and `never` when it could not start even in an empty class (the cap was
    lowered after it was queued)."""

    need_mb: int
    free_mb: int
    cap_mb: int
    position: int
    never: bool = False

    def reason(self, job_class: str) -> str:
        if self.never:
            return (f"waiting for class {job_class}: needs {self.need_mb} MiB, more than its cap of "
                    f"{self.cap_mb} MiB (lowered after it was queued): raise the cap or stop the job")
        ahead = f", {self.position - 1} job(s) ahead of it" if self.position > 1 else ""
        return (f"waiting for class {job_class}: needs {self.need_mb} MiB, {self.free_mb} MiB free under "
                f"its cap of {self.cap_mb} MiB{ahead}")


def plan(queued: Iterable[Queued], charged_mb: Mapping[str, int], limits: Limits) -> tuple[list[str], dict[str, Wait]]:
    """Which queued jobs start now, in order, and why each other one waits.

    `charged_mb` is the sum of the member jobs' charges per class. A class without a cap
    starts its whole queue. Returns (ids to start, {id: Wait})."""
    by_class: dict[str, list[Queued]] = {}
    for q in queued:
        by_class.setdefault(q.job_class, []).append(q)
    start: list[str] = []
    waits: dict[str, Wait] = {}
    for cls in sorted(by_class):
        cap = limits.cap(cls)
        order = queue_order(by_class[cls])
        if cap is None:
            start.extend(q.id for q in order)
            continue
        used = charged_mb.get(cls, 0)
        blocked = False
        pos = 0
        for q in order:
            need = charge_mb(q.memory_mb, cap)
            if never_fits(q.memory_mb, cap):  # the cap was lowered under it: it must not block the rest
                waits[q.id] = Wait(need, max(0, cap - used), cap, 0, never=True)
                continue
            if not blocked and need <= cap - used:
                start.append(q.id)
                used += need
                continue
            blocked = True
            pos += 1
            waits[q.id] = Wait(need, max(0, cap - used), cap, pos)
    return start, waits
