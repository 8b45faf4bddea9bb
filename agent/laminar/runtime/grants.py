"""Who may submit what (config ``[grants]``): the Airlock classes and priorities a local
user may ask for, decided from the caller's uid and gids alone (:meth:`Grants.refusal`; pure,
root may submit anything), and :class:`GrantError`, the refusal (403 in the API)."""

from __future__ import annotations

import grp
import pwd
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class GrantError(Exception):
    """A submission beyond the caller's grant (config ``[grants]``); the message names the class
    and priority asked and what the caller may use."""


@dataclass(frozen=True)
class GrantRule:
    """One rule of who may submit what: the classes it allows up to `priority_max`, for the
    uids and gids it names (`everyone`: the default rule)."""

    classes: tuple[str, ...]
    priority_max: int
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    everyone: bool = False
    label: str = "the default for every user"

    def applies(self, uid: int, gids: set[int]) -> bool:
        return self.everyone or uid in self.uids or bool(self.gids & gids)

    def allows(self, job_class: str, priority: int) -> bool:
        return job_class in self.classes and priority <= self.priority_max

    def describe(self) -> str:
        return f"{', '.join(self.classes)} up to priority {self.priority_max} ({self.label})"


@dataclass(frozen=True)
class Grants:
    """Which Airlock classes and priorities a caller may submit (config ``[grants]``). Pure:
    `refusal` decides from the caller's uid and gids alone. Root may submit anything."""

    rules: tuple[GrantRule, ...]

    @classmethod
    def from_config(cls, section: dict[str, Any] | None) -> Grants:
        """From a validated ``[grants]`` section (laminar.config); None: the defaults. User
        and group names are resolved to ids here."""
        from ..config import SCHEMA

        sec = {k: f.default for k, f in SCHEMA["grants"].items()} | dict(section or {})
        rules = [GrantRule(tuple(sec["default_classes"]), int(sec["default_priority_max"]), everyone=True)]
        for g in sec["grant"]:
            uids = frozenset(x if isinstance(x, int) else pwd.getpwnam(x).pw_uid for x in g.get("users", []))
            gids = frozenset(x if isinstance(x, int) else grp.getgrnam(x).gr_gid for x in g.get("groups", []))
            who = [f"user {x}" for x in g.get("users", [])] + [f"group {x}" for x in g.get("groups", [])]
            rules.append(GrantRule(tuple(g["classes"]), int(g["priority_max"]), uids, gids,
                                   label=f"granted to {', '.join(who)}"))
        return cls(tuple(rules))

    def allowed(self, uid: int, gids: set[int]) -> list[GrantRule]:
        """The rules that apply to the caller."""
        return [r for r in self.rules if r.applies(uid, gids)]

    def refusal(self, uid: int, gids: set[int], job_class: str, priority: int) -> str | None:
        """None when the caller (uid, primary and supplementary gids) may submit a job of
        `job_class` at `priority`; else the refusal, naming what was asked and what it may use."""
        if uid == 0:
            return None
        mine = self.allowed(uid, gids)
        if any(r.allows(job_class, priority) for r in mine):
            return None
        may = "; ".join(r.describe() for r in mine) or "nothing"
        return (f"permission denied: class {job_class} at priority {priority} is beyond what uid {uid} may submit; "
                f"it may submit {may}. Ask the node's operator for a grant ([grants] in laminard's config, "
                "docs/operations.md)")

    def as_dict(self) -> list[dict[str, Any]]:
        return [{"classes": list(r.classes), "priority_max": r.priority_max, "who": r.label} for r in self.rules]


def caller_gids(gid: int, pid: int) -> set[int]:
    """The caller's primary gid and its supplementary groups (``/proc/<pid>/status``; only the
    primary one when the process is gone)."""
    out = {gid}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                out.update(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return out
