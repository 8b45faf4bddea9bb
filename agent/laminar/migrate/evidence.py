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

* :class:`Evidence`, a part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its
  ``evidence``): the hazard models the agent plans with (``hazards``: the prior, or the trace
  calibration, merged with what was seen) and what it saw (``seen``, ``notice_odds``), loaded
  from the store at start (:meth:`Evidence.load`) and fed by the agent: exposure of this node
  and its live peers (:meth:`Evidence.observe_exposure`, from the checkpoint driver's rounds;
  written at most every EVIDENCE_SAVE_S), departures (:meth:`Evidence.observe_departure`: this
  node's reclaim, the zone's reclaim notices of peers, a loan's return; written at once), and a
  peer that fell silent with no reclaim notice (its :meth:`Evidence.tick`, counted once per
  silence). :meth:`Evidence.status` is ``migrate.evidence`` in the agent's status.

Example::

    ev = EvidenceStore(agent.store)              # creates the tables once
    seen, odds = ev.load()                       # {provider: HazardModel (evidence only)}, {provider: NoticeOdds}
    model = prior_model.merged(seen["default"])  # the model the agent plans with
    ev.save("default", seen["default"], odds["default"])
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Protocol

from laminar.policy.hazard import HOURS_PER_WEEK, HazardError, HazardModel
from laminar.policy.notice import (  # noqa: F401  (re-exported at the old path, issue 32)
    DEFAULT_PRIOR_ANNOUNCED,
    DEFAULT_PRIOR_UNANNOUNCED,
    NoticeOdds,
)

log = logging.getLogger("laminar.migrate")

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


# Exposure accrues every poll; the store is written at most this often for it (a departure is
# written at once). A crash loses at most this much exposure, which only makes the rate a
# little higher (the cautious side).
EVIDENCE_SAVE_S = 60.0


class EvidenceHost(Protocol):
    """What :class:`Evidence` uses of the component that holds it (ReclaimComponent)."""

    notices: dict[int, tuple[float, float]]

    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Evidence:
    """The hazard and notice odds the agent plans with and what it saw (see the module's doc): a
    part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``evidence``). ``host``: the
    component."""

    def __init__(self, host: EvidenceHost) -> None:
        self.host = host
        self.hazards: dict[str, HazardModel] = {}  # what the agent plans with: prior (+ traces) + seen
        self.seen: dict[str, HazardModel] = {}  # only what this agent observed (persisted)
        self.notice_odds = NoticeOdds()  # departures with and without notice (persisted)
        self.store: EvidenceStore | None = None
        self._saved = 0.0
        self._suspected: set[int] = set()  # peers already counted as departed without notice

    def load(self, store: Any, base: HazardModel) -> None:
        """What this agent saw before a restart is evidence too: reloaded from ``store`` (the
        agent's) on top of ``base`` (the prior, or the trace calibration)."""
        self.store = EvidenceStore(store)
        seen, odds = self.store.load()
        self.seen = {"default": seen.get("default") or HazardModel("default")}
        self.notice_odds = odds.get("default") or NoticeOdds()
        self.hazards["default"] = base.merged(self.seen["default"])
        self._saved = time.monotonic()

    def observe_exposure(self, t0: float, t1: float, nodes: float = 1.0) -> None:
        """``nodes`` nodes were up from ``t0`` to ``t1``: exposure for the hazard. Written to the
        store at most every EVIDENCE_SAVE_S."""
        for m in (self.hazards["default"], self.seen.setdefault("default", HazardModel("default"))):
            m.observe_exposure(t0, t1, nodes)
        if time.monotonic() - self._saved >= EVIDENCE_SAVE_S:
            self.save()

    def observe_departure(self, ts: float, announced: bool) -> None:
        """A node of the zone departed at ``ts`` (this one or a peer), with or without a usable
        notice: hazard evidence and notice odds, written to the store at once."""
        for m in (self.hazards["default"], self.seen.setdefault("default", HazardModel("default"))):
            m.observe_reclaim(ts)
        self.notice_odds.observe(announced)
        self.save()

    def status(self) -> dict[str, Any]:
        """The evidence this agent gathered (its store's, not the configured prior): departures
        with and without notice, exposure, and the ``default`` hazard's rate now."""
        seen = self.seen.get("default") or HazardModel("default")
        return {"announced": self.notice_odds.announced, "unannounced": self.notice_odds.unannounced,
                "departures": seen.total_events, "exposure_node_h": round(seen.total_exposure_h, 3),
                "rate_per_h_now": round(self.hazards["default"].rate_per_h(time.time()), 6),
                "unannounced_frac": round(self.notice_odds.unannounced_frac, 4)}

    def save(self) -> None:
        if self.store is None:
            return
        try:
            self.store.save("default", self.seen.setdefault("default", HazardModel("default")), self.notice_odds)
            self._saved = time.monotonic()
        except Exception as e:  # the store is the agent's; a failed write must not stop the watch
            log.warning("migrate: saving hazard evidence failed: %s", e)

    def exposed_nodes(self) -> float:
        """Nodes whose departures this agent counts: itself and its live zone peers (their
        reclaim notices and silences are observed here too)."""
        z = self.host.zone
        if z is None:
            return 1.0
        now = time.time()
        return float(1 + sum(1 for n in z.membership.by_node if n != self.host.node_id and n not in z.membership.suspects
                             and not self.announced(n, now)))

    def announced(self, node: int, now: float) -> bool:
        """Whether ``node``'s departure was counted from its reclaim notice: the notice came and
        its window is open or ended less than an hour ago (a notice window may be hours long)."""
        notice = self.host.notices.get(node)
        return notice is not None and now < max(notice) + 3600

    def tick(self, now: float) -> None:
        """A peer that turned suspect (silent) with no reclaim notice departed without notice;
        counted once per silence (it counts again only after it was heard from)."""
        z = self.host.zone
        if z is None:
            return
        sus = set(z.membership.suspects)
        self._suspected &= sus
        for n in sorted(sus - self._suspected):
            self._suspected.add(n)
            if self.announced(n, now):
                continue  # announced: counted when its notice came
            self.observe_departure(now, announced=False)
            log.info("migrate: node %d fell silent without a reclaim notice (unannounced departure)", n)
