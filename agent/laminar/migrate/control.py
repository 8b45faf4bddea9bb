"""The control ops other nodes send this one (:class:`Control`, a part of
:class:`laminar.migrate.reclaim.ReclaimComponent`: its ``control``), and who may send them.

The transfer endpoint hands each authenticated control message to :meth:`Control.answer`: the
body must be an object and the asker a node id; the op is looked up in one table
(:attr:`Control.OPS`: op to handler, in the order an unknown op's answer lists them); a
``reclaim`` or ``reclaim-cancel`` comes only from a node in ``migrate.reclaim_from``
(:func:`laminar.zone.authority.node_op_refusal`), and a reclaim's notice, cancel or withdrawal
only when dated within CONTROL_DATED_S of this node's clock (:meth:`Control.check_dated`).
The handlers ask :mod:`laminar.zone.authority` who may speak for a job key (a keeper, a
release, an offer of a checkpoint: :meth:`Control.may_offer`), count the refusals
(:meth:`Control.refusals`: the zone's, else its own) and answer with the other parts' answers
(``superseded``, ``needs``, ``dropped``, ``taken``, ``heard``). A keeper message's instants are
read in this node's clock (:func:`_in_own_clock`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from laminar.migrate import ledger
from laminar.migrate.constants import valid_ckpt_name, valid_key
from laminar.migrate.errors import MigrateError
from laminar.migrate.evacuation import parse_duration
from laminar.policy import custody
from laminar.zone import authority as au

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.archive import Archive
    from laminar.migrate.evacuation import Evacuation
    from laminar.migrate.fence import Fence
    from laminar.migrate.prestage import Prestage
    from laminar.migrate.replicas import Replicas
    from laminar.migrate.takeover import Takeover
    from laminar.migrate.transfer import Receiver
    from laminar.migrate.vouch import Vouch
    from laminar.migrate.withdraw import Withdraw

log = logging.getLogger("laminar.migrate")

# A reclaim's notice, cancel or withdrawal from another node dated further than this from this
# node's clock is refused: a replayed or badly delayed message must not reclaim the node.
CONTROL_DATED_S = 60

# The control ops that only a node of ``migrate.reclaim_from`` may send.
RECLAIM_FROM_OPS = ("reclaim", "reclaim-cancel")

KEEPER_INSTANTS = ("window_end", "not_before")  # wall-clock instants a keeper message's request carries


def _in_own_clock(body: dict[str, Any]) -> dict[str, Any]:
    """A keeper message's request with its instants (KEEPER_INSTANTS: the end of the source's
    reclaim window, the moment before which the keeper must not act) moved from the sender's
    wall clock to this node's: shifted by this node's time less the sender's ``clock`` when it
    sent the message. The shift holds the skew between the two clocks and the message's
    transit, so an instant lands at most a transit later than it was meant, never earlier: a
    keeper whose clock runs ahead no longer takes over before the window ends. A message
    without ``clock`` (an agent of before 2026-11-24) is taken as it is. Raises ValueError for
    a ``clock`` or an instant that is not a finite number."""
    def instant(name: str, v: Any) -> float:
        try:
            t = float(v)
        except (TypeError, ValueError):
            t = math.nan
        if isinstance(v, bool) or not math.isfinite(t):
            raise ValueError(f"keeper: {name} {v!r} is not a finite number (seconds since the epoch)")
        return t

    req = dict(body["request"])
    if body.get("clock") is None:
        return req
    shift = time.time() - instant("clock", body["clock"])
    for f in KEEPER_INSTANTS:
        if req.get(f) is not None:
            req[f] = instant(f, req[f]) + shift
    return req


# Control ops' names before 2026-12-06, answered for one release as the new ones (an older peer
# sends them); this agent sends only the new names.
OLD_CONTROL_OPS = {"guard": "keeper"}  # old spelling

class ControlHost(Protocol):
    """What :class:`Control` uses of the component that holds it (ReclaimComponent and its parts)."""

    agent: MigrateAgent
    archive: Archive
    counts: dict[str, int]
    evacuation: Evacuation
    fence: Fence
    takeover: Takeover
    prestage: Prestage
    receiver: Receiver | None
    replicas: Replicas
    root: Path | None
    s: dict[str, Any]
    vouch: Vouch
    withdraw: Withdraw

    def _heard_over_tcp(self, node: str) -> None: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Control:
    """The control ops table and its handlers, and who may speak for a job key (see the module's doc): a
    part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``control``). ``host``: the component."""

    def __init__(self, host: ControlHost) -> None:
        self.host = host
        self._own_refusals: au.Refusals | None = None  # where refusals are counted without a zone's (refusals)

    def refusals(self) -> au.Refusals:
        """Where peers' refusals are counted: the zone's (``authority`` in zone stats and status)."""
        got = getattr(self.host.zone, "authority", None)
        if isinstance(got, au.Refusals):
            return got
        if self._own_refusals is None:
            self._own_refusals = au.Refusals()
        return self._own_refusals

    def refuse(self, e: au.Refused, node: int | None) -> ValueError:
        """Counts ``e`` and returns it as the ValueError a control op is refused with (its text
        goes back to the sender)."""
        self.refusals().note(e, node)
        log.warning("migrate: refused %s", e)
        return ValueError(str(e))

    def keeping_from(self, key: str) -> int | None:
        """The node that made this node the live keeper of ``key`` (the key's node, or the node
        that passed it on or placed the job here: ``migrate_keeper_from``; else the row's source);
        None when this node is no live keeper of it (au.BINDING_STATES)."""
        return self.keeper_held(key)[0]

    def keeper_held(self, key: str) -> tuple[int | None, str | None]:
        """(:meth:`keeping_from`, the row's state; None when there is no row)."""
        db = self.host.agent.store.db
        row = db.execute("SELECT src_node, state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        if row is None or str(row["state"]) not in au.BINDING_STATES:
            return None, None if row is None else str(row["state"])
        got = db.execute("SELECT node FROM migrate_keeper_from WHERE key=?", (key,)).fetchone()
        return (int(got["node"]) if got is not None else int(row["src_node"])), str(row["state"])

    def may_offer(self, node: str, key: str) -> str | None:
        """The transfer endpoint's question before it takes a checkpoint of ``key`` from ``node``:
        None, or why not (counted; au.offer_refusal)."""
        try:
            asker = int(node)
        except ValueError:
            return f"node {node!r} is not a node id"
        e = au.offer_refusal(asker, key, self.keeping_from(key))
        if e is None:
            return None
        self.refusals().note(e, asker)
        return str(e)

    def answer(self, node: str, op: str, body: Any) -> Any:
        """A control operation from another node (``node``: its id, as the transfer endpoint's
        hello gave it): answered by its handler in :attr:`OPS`. Raises ValueError for a
        body that is not an object, an asker that is not a node id, or an unknown op; a
        ``reclaim`` or ``reclaim-cancel`` from a node not in ``migrate.reclaim_from`` is refused."""
        # an authenticated message from a roster member (its hello's node, checked against its
        # roster address): it is alive, as an authenticated datagram says (Membership.seen).
        # Before, only datagrams counted: a keeper that had the source's message in hand could still
        # take it for silent (its datagrams not yet heard after a partition) and take its job over
        self.host._heard_over_tcp(node)
        if not isinstance(body, dict):
            raise ValueError(f"body of {op!r} must be an object")
        try:
            asker = int(node)
        except ValueError:
            raise ValueError(f"{op}: the asking node {node!r} is not a node id") from None
        if op in OLD_CONTROL_OPS:  # an older peer's name for it (sent: the new one)
            op = OLD_CONTROL_OPS[op]
        handler = self.OPS.get(op)
        if handler is None:
            raise ValueError(f"unknown control operation {op!r} ({', '.join(self.OPS)})")
        if op in RECLAIM_FROM_OPS:  # another node reclaims this one: migrate.reclaim_from only
            e = au.node_op_refusal(op, asker, [int(n) for n in self.host.s.get("reclaim_from") or []],
                                   "migrate.reclaim_from", self.host.node_id)
            if e is not None:
                raise self.refuse(e, asker)
        return handler(self, node, asker, body)

    @staticmethod
    def check_dated(body: dict[str, Any], what: str) -> None:
        """A reclaim's notice, cancel or withdrawal is answered only within CONTROL_DATED_S of
        this node's clock (its ``ts``): ValueError otherwise."""
        ts = float(body.get("ts", 0))
        if abs(time.time() - ts) > CONTROL_DATED_S:
            raise ValueError(f"{what} dated {ts} is more than {CONTROL_DATED_S:g} s from this node's clock")

    def _op_keeper(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        key = str(body["key"])
        src = body.get("src_node")
        if isinstance(src, str) and src.isascii() and src.isdigit():
            src = int(src)
        got = body.get("request")
        req_in: dict[str, Any] = got if isinstance(got, dict) else {}
        policy = getattr(self.host.zone, "policy", None)
        e = au.keeper_refusal(asker, key, src, req_in.get("take_over") is True, *self.keeper_held(key),
                             root_request=req_in.get("owner_uid", 0) == 0,
                             policy=policy if isinstance(policy, au.Policy) else au.Policy(self.host.node_id))
        if e is not None:
            raise self.refuse(e, asker)
        self._check_kept_ckpt(key, str(body["ckpt"]))
        req = _in_own_clock(body)
        with self.host.agent.store.tx() as db:
            # keeping, but a copy its take-over acted on (resumed, handed-over, placed) stays so
            ledger.move(db, key, custody.Event.KEEPER, counts=self.host.counts, ckpt=str(body["ckpt"]), request=json.dumps(req),
                        insert={"src_node": int(body["src_node"]), "src_job": str(body["src_job"]),
                                "request": json.dumps(req), "ckpt": str(body["ckpt"])})
            # the source just spoke about this keeper: its earlier silence no longer counts
            ledger.keeper_heard(db, key)
            # who handed it: with the key's node, the only one who may change or release it
            ledger.keeper_from(db, key, asker)
        self.host.replicas.resumes.note_owner(key, req)
        try:  # the keeper names a newer checkpoint: the older ones go (when it is held here)
            self.host.replicas.gc(key, newest=str(body["ckpt"]))
        except Exception:
            log.exception("migrate: replica GC of %s", key)
        return {"keeping": key}

    def _op_space(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """May this node hold a checkpoint? (storage keepers: Keepers.hold)"""
        assert self.host.root is not None
        assert self.host.receiver is not None
        # what an offer may take now (the free space less what transfers in progress still
        # lack and the receiver's margin), less what this node keeps for itself as a keeper
        free = self.host.receiver.free_for_offers() - float(self.host.s["keeper_reserve_mb"]) * (1 << 20)
        return {"free_bytes": max(0.0, free)}

    def _op_release(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        key = str(body["key"])
        e = au.release_refusal(asker, key, self.keeping_from(key))
        if e is not None:
            raise self.refuse(e, asker)
        row = self.host.agent.store.db.execute("SELECT state, updated FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        # taken over here and run here: the source still runs its copy, or it would not release
        # this keeper; the answer says so (as ``superseded`` would: a release may come first)
        runs = self.host.takeover.runs_here(key) if row is not None and row["state"] == "resumed" else None
        # taken over and placed on another node (no room here): the same, naming that node, as
        # ``taken`` does. Before, the answer said only "released", and a source whose keeper had
        # changed (this keeper was the old one) refused this node's ``superseded`` after it: a
        # fenced copy was thawed beside the placed one (bench/chaos.py --no-archive, seed 43)
        placed = self.host.archive.placed_as(key) if row is not None and row["state"] == "placed" else None
        with self.host.agent.store.tx() as db:
            ledger.move(db, key, custody.Event.RELEASE, counts=self.host.counts)  # a live keeper only (the table)
        try:  # nothing here needs the key's checkpoints any more (but a local job resumed from one)
            self.host.replicas.gc(key)
        except Exception:
            log.exception("migrate: replica GC of %s", key)
        if runs is not None or placed is not None:
            assert row is not None
            node_job = (self.host.node_id, runs) if runs is not None else placed
            assert node_job is not None
            return {"released": key, "superseded": {"node": node_job[0], "job": node_job[1],
                                                    "at": float(row["updated"]), "clock": time.time()}}
        return {"released": key}

    def _op_reclaim(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """Another node reclaims this one (``laminarctl reclaim --node``)."""
        self.check_dated(body, "reclaim notice")
        return self.host.evacuation.start(parse_duration(body["notice_s"]), f"{body.get('reason', '')} (from node {node})")

    def _op_reclaim_cancel(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        self.check_dated(body, "reclaim-cancel")
        return self._cancel_for(node, str(body.get("reason") or ""))

    def _op_reclaim_withdrawn(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """The sender's own reclaim is withdrawn: its notice is forgotten."""
        self.check_dated(body, "reclaim-withdrawn")
        return {"withdrawn": int(node), "keepers": self.host.withdraw.withdrawn_notice(int(node))}

    def _op_superseded(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """A keeper took one of this node's jobs over and runs it."""
        return self.host.replicas.answer_superseded(node, body)

    def _op_needs(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """A node holding a keeper of one of this node's jobs asks whether it still must."""
        return self.host.replicas.answer_needs(node, str(body["key"]))

    def _op_dropped(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """An operator dropped the keeper of one of this node's jobs there, by force."""
        return self.host.prestage.answer_dropped(node, str(body["key"]))

    def _op_taken(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """A job's node, fenced while cut off and heard again: did this node take it over?"""
        return self.host.fence.answer_taken(node, str(body["key"]))

    def _op_heard(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """A node that hears nothing from a peer: when did this node last hear it?"""
        return self.host.vouch.answer_heard(node, body)

    # op -> its handler (self, the asking node as the endpoint gave it, its id, the body), in the
    # order the answer to an unknown op lists them
    OPS: ClassVar[dict[str, Callable[[Control, str, int, dict[str, Any]], Any]]] = {
        "keeper": _op_keeper, "release": _op_release, "reclaim": _op_reclaim, "reclaim-cancel": _op_reclaim_cancel,
        "reclaim-withdrawn": _op_reclaim_withdrawn, "space": _op_space, "superseded": _op_superseded,
        "needs": _op_needs, "dropped": _op_dropped, "taken": _op_taken, "heard": _op_heard,
    }

    async def _cancel_for(self, node: str, reason: str) -> dict[str, Any]:
        """Control op ``reclaim-cancel``: another node cancels this node's reclaim (``laminarctl
        reclaim cancel --node``). Nothing to cancel is answered ``{"refused": why}``."""
        try:
            return await self.host.withdraw.cancel_reclaim(f"{reason or 'reclaim cancelled'} (from node {node})")
        except (LookupError, MigrateError) as e:
            return {"refused": str(e), "not_found": isinstance(e, LookupError)}

    def _check_kept_ckpt(self, key: str, ckpt: str) -> None:
        """A keeper is taken only for a checkpoint held here (``<root>/checkpoints/<key>/<ckpt>/``,
        a directory, not a link): every keeper follows the transfer of the checkpoint it names, and
        one that is not here was dropped in between (an operator's drop of a key no keeper had named
        yet, with or without force) or never came. Taking it would leave this node keeping a job
        with nothing to resume it from while its source counts on it; refused (ValueError), the
        source's prestage or move fails and it tries another node (a keeper it had stays)."""
        if not valid_key(key) or not valid_ckpt_name(ckpt):
            raise ValueError(f"keeper of {key!r}: {ckpt!r} is not a checkpoint name (ckpt-<n>) of a replica key")
        assert self.host.root is not None
        try:
            held = stat.S_ISDIR(os.lstat(self.host.root / "checkpoints" / key / ckpt).st_mode)
        except OSError:
            held = False
        if not held:
            raise ValueError(f"keeper of {key}: {ckpt} is not held on node {self.host.node_id} (dropped by its operator, "
                             "or never received): not keeping it")
