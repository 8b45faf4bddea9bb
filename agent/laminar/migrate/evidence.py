"""What the agent has seen of departures, kept across restarts: hazard evidence and notice odds.

The hazard model (:mod:`laminar.migrate.hazard`) starts from a prior (the configuration, or a
calibration on spot traces) and learns from the departures this agent lives through. That
learning must survive a restart of the agent (crash, upgrade), or every restart would forget
a week of evidence and plan checkpoints as if the provider had never taken a node back.

Two pieces:

* :class:`NoticeOdds` (policy, pure): how many departures came with a usable notice and how
  many without (a peer that fell silent with no reclaim notice, a replica's source that died
  unannounced), and the posterior mean share of *unannounced* departures under a Beta prior.
  The checkpoint scheduler uses it
  as ``unannounced_frac`` (how often a job whose final checkpoint fits the window still rolls
  back) and prestaging uses it (``prestage = "auto"`` keeps an off-node replica while
  departures without notice are plausible). The default prior is one unannounced departure
  and no announced one: with no evidence every departure is assumed to come without notice
  (the scheduler's cautious default), and each announced departure seen lowers the share
  (after 9 announced and none silent it is 0.1). ``bench/workloss.py`` uses the same class.
* :class:`EvidenceStore` (mechanism): the agent's own evidence in its SQLite store
  (``agent.store``; tables ``migrate_hazard`` and ``migrate_notice``, owned by the migrate
  component): per provider, the 168 hour-of-week departure counts and node-hours of exposure,
  and the notice counts. Only what the agent *observed* is stored, never the prior or a trace
  calibration (those come from the configuration at every start, so a changed prior takes
  effect and trace evidence is never counted twice).

Example::

    ev = EvidenceStore(agent.store)              # creates the tables once
    seen, odds = ev.load()                       # {provider: HazardModel (evidence only)}, {provider: NoticeOdds}
    model = prior_model.merged(seen["default"])  # the model the agent plans with
    ev.save("default", seen["default"], odds["default"])
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from laminar.migrate.hazard import HOURS_PER_WEEK, HazardError, HazardModel

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS migrate_hazard (
        provider TEXT PRIMARY KEY,
        events TEXT NOT NULL,
        exposure_h TEXT NOT NULL,
        updated REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS migrate_notice (
        provider TEXT PRIMARY KEY,
        announced REAL NOT NULL,
        unannounced REAL NOT NULL,
        updated REAL NOT NULL)""",
]

# Without evidence, assume departures come unannounced (share 1: the cautious side); each
# announced departure seen then lowers the share.
DEFAULT_PRIOR_ANNOUNCED = 0.0
DEFAULT_PRIOR_UNANNOUNCED = 1.0


@dataclass
class NoticeOdds:
    """Departures seen with and without a usable notice, and the posterior share of the
    unannounced ones (``Beta(prior_unannounced, prior_announced)`` prior)."""

    announced: float = 0.0
    unannounced: float = 0.0
    prior_announced: float = DEFAULT_PRIOR_ANNOUNCED
    prior_unannounced: float = DEFAULT_PRIOR_UNANNOUNCED

    def __post_init__(self) -> None:
        for name in ("announced", "unannounced", "prior_announced", "prior_unannounced"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise HazardError(f"notice odds: {name} must be a finite number >= 0, got {v!r}")
        if self.prior_announced + self.prior_unannounced <= 0:
            raise HazardError("notice odds: the prior needs some weight (prior_announced + prior_unannounced > 0)")

    def observe(self, announced: bool, count: float = 1.0) -> None:
        """Records ``count`` departures, with (``announced``) or without a usable notice."""
        if count < 0:
            raise HazardError(f"notice odds: count must be >= 0, got {count!r}")
        if announced:
            self.announced += count
        else:
            self.unannounced += count

    @property
    def unannounced_frac(self) -> float:
        """Posterior mean share of departures that come without a usable notice, in (0, 1]
        (never 0: the scheduler divides by it)."""
        a = self.unannounced + self.prior_unannounced
        b = self.announced + self.prior_announced
        return max(1e-6, min(1.0, a / (a + b)))


class EvidenceStore:
    """The migrate component's evidence tables in ``store`` (a :class:`laminar.store.Store`)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        store.ensure_schema("migrate-evidence", SCHEMA)

    def load(self) -> tuple[dict[str, HazardModel], dict[str, NoticeOdds]]:
        """Every provider's stored evidence: hazard models holding only evidence (their prior is
        a placeholder: merge them into the configured model with ``HazardModel.merged``) and
        notice counts. A row that does not parse is left out (it is not evidence; the next
        :meth:`save` of that provider overwrites it)."""
        seen: dict[str, HazardModel] = {}
        odds: dict[str, NoticeOdds] = {}
        db = self.store.db
        for row in db.execute("SELECT provider, events, exposure_h FROM migrate_hazard").fetchall():
            try:
                ev = [float(x) for x in json.loads(row["events"])]
                ex = [float(x) for x in json.loads(row["exposure_h"])]
                seen[str(row["provider"])] = HazardModel(str(row["provider"]), events=ev, exposure_h=ex)
            except (ValueError, TypeError, HazardError):
                continue
        for row in db.execute("SELECT provider, announced, unannounced FROM migrate_notice").fetchall():
            try:
                odds[str(row["provider"])] = NoticeOdds(float(row["announced"]), float(row["unannounced"]))
            except (ValueError, TypeError, HazardError):
                continue
        return seen, odds

    def save(self, provider: str, seen: HazardModel, odds: NoticeOdds | None = None) -> None:
        """Writes ``provider``'s evidence (and notice counts) in one transaction."""
        if len(seen.events) != HOURS_PER_WEEK or len(seen.exposure_h) != HOURS_PER_WEEK:
            raise HazardError(f"evidence: model of {provider!r} does not have {HOURS_PER_WEEK} hour bins")
        now = time.time()
        with self.store.tx() as db:
            db.execute("INSERT INTO migrate_hazard VALUES (?, ?, ?, ?) ON CONFLICT(provider) DO UPDATE SET "
                       "events=excluded.events, exposure_h=excluded.exposure_h, updated=excluded.updated",
                       (provider, json.dumps(seen.events), json.dumps(seen.exposure_h), now))
            if odds is not None:
                db.execute("INSERT INTO migrate_notice VALUES (?, ?, ?, ?) ON CONFLICT(provider) DO UPDATE SET "
                           "announced=excluded.announced, unannounced=excluded.unannounced, updated=excluded.updated",
                           (provider, odds.announced, odds.unannounced, now))
