"""What the agent has seen of departures, kept across restarts: hazard evidence and notice odds.

The hazard model (:mod:`laminar.policy.hazard`) starts from a prior (the configuration, or a
calibration on spot traces) and learns from the departures this agent lives through. That
learning must survive a restart of the agent (crash, upgrade), or every restart would forget
a week of evidence and plan checkpoints as if the provider had never taken a node back.

Two pieces:

* :class:`NoticeOdds` (policy, pure; in :mod:`laminar.policy.notice`, re-exported here): how many departures came with a usable notice and how
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
import time
from typing import Any

from laminar.policy.hazard import HOURS_PER_WEEK, HazardError, HazardModel
from laminar.policy.notice import (  # noqa: F401  (re-exported at the old path, issue 32)
    DEFAULT_PRIOR_ANNOUNCED,
    DEFAULT_PRIOR_UNANNOUNCED,
    NoticeOdds,
)

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
