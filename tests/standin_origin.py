"""For stand-in job managers in unit tests: the real job manager's look-ups by a job's recorded
origin (``JobManager.table``: ``find_origin``, ``find_placement``, ``ended_origins``, ``resume_users``:
laminar.runtime.provenance), over the stand-in's own ``list()``. The real ones ask the store by
an indexed column; these read each stand-in job's ``origin`` (a ``JobOrigin``; none: no origin),
never its env, as the real ones do not."""

from __future__ import annotations

from typing import Any

from laminar.runtime.provenance import NO_ORIGIN, JobOrigin


def origin_of(job: Any) -> JobOrigin:
    o = getattr(job, "origin", None)
    return o if isinstance(o, JobOrigin) else NO_ORIGIN


class OriginQueries:
    """Mix into a stand-in job manager that has ``list()``. The real manager answers these
    through its table (``jobs.table``: laminar.runtime.jobtable); the stand-in is its own table."""

    @property
    def table(self) -> OriginQueries:
        return self

    def list(self, *a: Any, **kw: Any) -> list[Any]:  # the stand-in's own
        raise NotImplementedError

    def find_origin(self, key: str) -> str | None:
        for j in self.list():
            if origin_of(j).migrated_from == key and getattr(j, "state", "") != "failed":
                return str(j.id)
        return None

    def find_placement(self, placement_id: int) -> str | None:
        for j in self.list():
            if origin_of(j).placement_id == placement_id:
                return str(j.id)
        return None

    def ended_origins(self, states: tuple[str, ...]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for j in self.list():
            key = origin_of(j).migrated_from
            if key and getattr(j, "state", "") in states:
                out.setdefault(key, set()).add(str(j.id))
        return out

    def resume_users(self, states: tuple[str, ...], requeued_since: float) -> list[tuple[str, str]]:
        out = []
        for j in self.list():
            rf, state, ended = origin_of(j).resume_given, getattr(j, "state", ""), getattr(j, "ended", None)
            if rf and (state in states or (state == "requeued" and (ended is None or float(ended) > requeued_since))):
                out.append((str(j.id), rf))
        return out
