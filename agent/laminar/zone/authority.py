"""A zone member's authority, not only its identity: what a peer may make this node do.

The wire proves *who* speaks (the MAC, the roster address, with node keys the pair key). This
module decides whether that node may ask for *what* it asks: a peer speaks only for what it
owns. Every decision is a pure function of its arguments (the caller passes what it read from
its store and config), tested in memory (tests/unit/test_zone_authority.py); the components act
on the answer and count each refusal by its reason (:class:`Refusals`: ``authority`` in
``laminarctl zone stats`` and in ``laminarctl -o json status``).

**Running a peer's job** (:func:`peer_run_as`; the one chokepoint before ``jobs.submit`` for a
job that came from another node: a hand-over, a keeper's take-over, a claim from the archive):

1. ``owner_uid`` and ``owner_gid`` are integers in ``0..2**32-2`` (:data:`MAX_ID`), and both
   are given: ``-1`` and ``4294967295`` mean "unchanged" to ``setresuid``, so ``setpriv`` would
   leave the job root; a missing uid is never taken for 0.
2. uid 0 runs only when both the node the job belongs to (its *origin*: the submitter of a
   placement, the ``n<N>-`` of a migrated job's key) and the node that hands it here (the
   *sender*: the hand-over's peer, the node that handed the keeper over) are this node itself or
   listed in ``[zone] root_from`` (default: none). A relay cannot launder a root job: a keeper
   that resumes a job of node N elsewhere carries N as the origin, and the destination asks
   about both.
3. Another uid must have an account here (``[zone] peer_unknown_uids = "refuse"``, the
   default; ``"allow"`` runs an unknown uid with no supplementary group and never with gid 0),
   and the gid must be one of that account's groups (its primary group or a supplementary one).
4. The destination's ``[grants]`` apply to that uid and its groups (class and priority), as
   they do to a local user's submission.
5. A hand-over's ``cpus`` and ``memory_mb`` are clamped to what the reservation it binds holds
   (a job reserved as 1 CPU does not run with 64).

**Job keys.** A migration key ``n<N>-<job>`` belongs to node N (:func:`key_owner`). A ``keeper``
of it is taken from N, or from the node that handed the keeper here last (``keeper_from``), or,
when this node holds no live keeper of the key, from any member with ``take_over`` (a keeper
passed on by a reclaimed keeper, or a keeper's placement of the job it took over: neither is N,
and N may be gone); its ``src_node`` must be N (:func:`keeper_refusal`). ``release`` of a keeper
held here comes only from N or ``keeper_from`` (:func:`release_refusal`). A checkpoint offer under
a key kept here comes only from N or ``keeper_from`` (:func:`offer_refusal`), and a take-over
resumes only from checkpoints those nodes sent (:func:`checkpoint_senders`).

**Node operations.** A ``reclaim`` or ``reclaim-cancel`` of this node from another node is
taken only from nodes listed in ``[migrate] reclaim_from`` (default: none; the node's own API
always may). A loan ``return`` comes from the loaning pool's own members in this zone or a node
listed in ``[loan] return_from`` (:func:`node_op_refusal`). A reservation (an offer) answers
only the node that probed for it: commit, release, the releases a probe carries and the
hand-over that binds it (:class:`laminar.zone.component.Arbiter`).

What this buys, and what it does not: a compromised member can harm its own jobs and no others'.
It can still run a job as any uid that has an account on the destination (the zone takes a
member's word about its own users, as it takes its placements), bounded by the destination's
``[grants]`` and the reservation. The guarantee needs identity first: ``[zone] node_keys =
"require"`` with every member keyed (docs/protocol.md, *Node keys*); with zone keys alone a
member can speak as another by its address (:func:`identity_warnings`).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

# The highest uid or gid a peer may name: (uid_t)-1 = 2**32-1 means "leave unchanged" to
# setresuid/setresgid (and setpriv), so a job "as 4294967295" would keep the agent's root.
MAX_ID = 2**32 - 2
UNKNOWN_UIDS = ("refuse", "allow")
# States of a keeper row (migrate_replicas.state) whose key this node still keeps or ran for
# its source: while one is there, only the key's node or the node that handed the keeper here
# speaks for the key. ("released" and "failed" are history: a new keeper may come from anyone
# that passes a stopped job on.)
BINDING_STATES = frozenset({"keeping", "waiting", "resumed", "placed", "handed-over", "passed", "archived"})
RECENT_MAX = 32  # refusals kept with their text for operators (bounded)
_KEY = re.compile(r"n([0-9]{1,10})-[A-Za-z0-9_.-]+")


class Refused(ValueError):
    """A peer asked for what it has no authority over. ``reason`` is the counter's name (one of
    :data:`REASONS`), the message says what was asked, by whom, and the rule or config key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# Every reason a refusal is counted under (Refusals.counts), one word each.
REASONS = ("bad_id", "root", "unknown_uid", "gid", "grants", "key", "keeper", "release", "offer",
           "reclaim", "loan_return", "placement", "held")


@dataclass(frozen=True)
class Account:
    """What this node knows of a uid: its name, primary gid and every group it is in."""

    name: str
    gid: int
    groups: frozenset[int]


@dataclass(frozen=True)
class Policy:
    """This node's rules for jobs from peers (``[zone] root_from``, ``peer_unknown_uids``)."""

    node: int
    root_from: frozenset[int] = frozenset()
    unknown_uids: str = "refuse"


@dataclass(frozen=True)
class RunAs:
    """What a peer's job runs as here: the checked ids, and its resources after the clamp."""

    uid: int
    gid: int
    cpus: float | None = None
    memory_mb: int | None = None
    clamped: tuple[str, ...] = ()


def system_account(uid: int) -> Account | None:
    """The account of ``uid`` on this host (passwd, then every group it is in), None when it has
    none. Reads NSS (local files here; a directory service answers as for a login)."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return None
    try:
        groups = frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
    except OSError:
        groups = frozenset()
    return Account(pw.pw_name, pw.pw_gid, groups | {pw.pw_gid})


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def owner_id(what: str, v: Any, sender: int | None = None) -> int:
    """``v`` as a uid or gid a peer may name (an int in 0..MAX_ID, not a bool); else Refused
    (``bad_id``) naming the value and what is allowed."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_ID:
        who = f" from node {sender}" if sender is not None else ""
        raise Refused("bad_id", f"{what} {v!r}{who} is not a user or group id: expected an integer 0..{MAX_ID} "
                      "(-1 and 4294967295 mean 'unchanged' to setresuid, which would leave the job root)")
    return v


def _who_speaks(owner: int | None, keeper_from: int) -> str:
    """'node N' or 'node N or node H': who may speak for a key (its node, the keeper's sender)."""
    if owner is None or owner == keeper_from:
        return f"node {keeper_from}"
    return f"node {owner} or node {keeper_from}"


def _trusted(node: int, policy: Policy) -> bool:
    return node == policy.node or node in policy.root_from


def root_refusal(policy: Policy, origin: int, sender: int) -> Refused | None:
    """Why a root job whose origin is ``origin``, handed here by ``sender``, may not run here
    (``[zone] root_from``); None when both are this node or listed."""
    roles = [f"node {origin} (the job's origin)"] if not _trusted(origin, policy) else []
    if sender != origin and not _trusted(sender, policy):
        roles.append(f"node {sender} (which hands it here)")
    if not roles:
        return None
    listed = ", ".join(map(str, sorted(policy.root_from))) or "none"
    return Refused("root", f"a job as root (uid 0) from {' and '.join(roles)} is not run on node {policy.node}: "
                   f"only nodes listed in zone.root_from may hand root jobs here (listed: {listed})")


def peer_run_as(req: dict[str, Any], *, policy: Policy, origin: int, sender: int,
                account: Callable[[int], Account | None] = system_account, grants: Any = None,
                job_class: str = "standard", priority: int = 0, cpus: float | None = None,
                memory_mb: int | None = None, reserved: tuple[float, int] | None = None) -> RunAs:
    """Whether, and as whom, a job a peer asks this node to run (its request ``req``:
    ``owner_uid``, ``owner_gid``) runs here; the rules are the module's (1-5). ``origin``: the
    node the job belongs to; ``sender``: the node that hands it here. ``grants``: this node's
    :class:`laminar.runtime.grants.Grants` (None: not checked); ``job_class``, ``priority``,
    ``cpus``, ``memory_mb``: the job's spec; ``reserved``: (cpus, memory_mb) of the reservation
    it binds (None: a take-over, which this node's own admission decides). Raises Refused."""
    if "owner_uid" not in req:
        raise Refused("bad_id", f"the job from node {sender} names no owner_uid: a peer's job never runs as a "
                      "default owner (before, a missing one meant root)")
    if "owner_gid" not in req:
        raise Refused("bad_id", f"the job from node {sender} names no owner_gid")
    uid = owner_id("owner_uid", req["owner_uid"], sender)
    gid = owner_id("owner_gid", req["owner_gid"], sender)
    groups: frozenset[int] = frozenset({gid})
    if uid == 0:
        why = root_refusal(policy, origin, sender)
        if why is not None:
            raise why
    else:
        acct = account(uid)
        if acct is None:
            if policy.unknown_uids != "allow":
                raise Refused("unknown_uid", f"uid {uid} (a job from node {sender}) has no account on node "
                              f"{policy.node}: not run (zone.peer_unknown_uids = \"refuse\"; create the user here, "
                              "or set it to \"allow\")")
            if gid == 0:
                raise Refused("gid", f"gid 0 (root's group) for uid {uid}, which has no account on node "
                              f"{policy.node}: not run")
        else:
            if gid not in acct.groups:
                have = ", ".join(f"{g} ({group_name(g)})" for g in sorted(acct.groups))
                raise Refused("gid", f"gid {gid} ({group_name(gid)}) is not a group of uid {uid} ({acct.name}) on "
                              f"node {policy.node}: the job from node {sender} may run with one of {have}")
            groups = acct.groups
    if grants is not None:
        why = grants.refusal(uid, set(groups), job_class, priority)
        if why is not None:
            raise Refused("grants", f"node {policy.node}'s [grants] refuse the job from node {sender}: {why}")
    clamped: list[str] = []
    if reserved is not None:
        r_cpus, r_mem = reserved
        if cpus is not None and cpus > r_cpus + 1e-9:
            clamped.append(f"cpus {cpus:g} -> {r_cpus:g}")
            cpus = r_cpus
        if memory_mb is not None and memory_mb > r_mem:
            clamped.append(f"memory_mb {memory_mb} -> {r_mem}")
            memory_mb = r_mem
    return RunAs(uid, gid, cpus, memory_mb, tuple(clamped))


def chain_refusal(req: dict[str, Any], *, policy: Policy, origin: int, sender: int) -> Refused | None:
    """The part of :func:`peer_run_as` that no other node can decide differently: the ids'
    range, and a root job's origin and sender (``root_from``). A keeper that this refuses for
    neither runs the job here nor places it elsewhere (a relay must not launder it)."""
    try:
        uid = owner_id("owner_uid", req["owner_uid"], sender) if "owner_uid" in req else None
        if uid is None:
            return Refused("bad_id", f"the job from node {sender} names no owner_uid")
        owner_id("owner_gid", req.get("owner_gid"), sender)
    except Refused as e:
        return e
    return root_refusal(policy, origin, sender) if uid == 0 else None


# -- job keys ---------------------------------------------------------------------------------------


def key_owner(key: str) -> int | None:
    """The node a migration key ``n<N>-<job>`` belongs to; None for a key of no node."""
    m = _KEY.fullmatch(key) if isinstance(key, str) else None
    return int(m.group(1)) if m else None


def keeper_refusal(asker: int, key: str, src_node: Any, take_over: bool, keeper_from: int | None,
                  state: str | None = None, root_request: bool = False,
                  policy: Policy | None = None) -> Refused | None:
    """Why ``asker`` may not hand this node the keeper of ``key`` naming ``src_node`` (None: it
    may). ``keeper_from``: the node that handed the live keeper held here (``keeper_from``; None: no
    live keeper, BINDING_STATES) and ``state`` its row's state. A keeper from another node than
    the key's (a pass-on, a placement by the keeper that took the job over) of a root job
    (``root_request``) comes only from a node ``policy`` trusts with root (``root_from``): else
    an untrusted member's word would reach a trusted relay."""
    owner = key_owner(key)
    if owner is None:
        return Refused("key", f"keeper of {key!r} from node {asker}: not a job key (n<node>-<job>)")
    if isinstance(src_node, bool) or not isinstance(src_node, int) or src_node != owner:
        return Refused("key", f"keeper of {key} from node {asker}: src_node {src_node!r} is not the key's node "
                       f"{owner} (a key n<N>-... belongs to node N)")
    if asker == owner:
        if keeper_from is not None and keeper_from != owner and state in ("resumed", "placed"):
            # a take-over of the key ran here on another node's word: the key's node, alive, hands
            # its job (a move, a prestage) to a node where that copy would answer for it: elsewhere
            return Refused("keeper", f"keeper of {key} from node {asker}: a take-over of it handed here by node {keeper_from} "
                           f"is {state} on this node; node {asker}'s job goes to another node")
        return None
    if asker == keeper_from:
        return None
    if keeper_from is None:
        if not take_over:
            return Refused("keeper", f"keeper of {key} from node {asker}: only node {owner} (the job's own node) hands "
                           "a job's keeper to a node that holds none (another node only with a stopped job: "
                           "take_over)")
        if root_request and policy is not None and asker != policy.node and asker not in policy.root_from:
            listed = ", ".join(map(str, sorted(policy.root_from))) or "none"
            return Refused("root", f"keeper of {key} (a job as root) from node {asker}, which is not node {owner}: only "
                           f"nodes listed in zone.root_from may pass a root job's keeper on (listed: {listed})")
        return None  # passed on, or placed by the keeper that took the job over: node N may be gone
    return Refused("keeper", f"keeper of {key} from node {asker}: node {keeper_from} handed this node that keeper; only "
                   f"{_who_speaks(owner, keeper_from)} may change it")


def release_refusal(asker: int, key: str, keeper_from: int | None) -> Refused | None:
    """Why ``asker`` may not release this node's live keeper of ``key`` (``keeper_from``: the node
    that handed it here; None: no live keeper, nothing to refuse)."""
    if keeper_from is None:
        return None
    owner = key_owner(key)
    if asker == owner or asker == keeper_from:
        return None
    return Refused("release", f"release of {key} from node {asker}: only {_who_speaks(owner, keeper_from)} (the job's "
                   "node, the node that handed this node the keeper) may release it")


def offer_refusal(asker: int, key: str, keeper_from: int | None) -> Refused | None:
    """Why ``asker`` may not send a checkpoint under ``key`` here: a key this node keeps for
    ``keeper_from`` (None: it keeps none) takes checkpoints from the key's node and ``keeper_from``
    only. A key kept nowhere here takes any member's (a keeper passed on is sent before its
    keeper message); its take-over reads only :func:`checkpoint_senders`' copies."""
    if keeper_from is None:
        return None
    owner = key_owner(key)
    if asker == owner or asker == keeper_from:
        return None
    return Refused("offer", f"checkpoint of {key} from node {asker}: this node keeps {key} for node {keeper_from}; "
                   f"only {_who_speaks(owner, keeper_from)} may send its checkpoints")


def checkpoint_senders(key: str, keeper_from: int | None, src_node: int | None = None) -> frozenset[str]:
    """The nodes (as a transfer's ``from_node`` says them) whose copies of ``key`` a take-over may
    resume from: the key's node, the node that handed the keeper over, and the row's source."""
    out = {str(n) for n in (key_owner(key), keeper_from, src_node) if n is not None}
    return frozenset(out)


def node_op_refusal(op: str, asker: int, allowed: Collection[int], setting: str, node: int) -> Refused | None:
    """Why ``asker`` may not do ``op`` (``reclaim``, ``reclaim-cancel``, ``loan return``) to this
    node ``node``: only the nodes in ``allowed`` (and the node itself) may, per ``setting``."""
    if asker == node or asker in allowed:
        return None
    listed = ", ".join(map(str, sorted(allowed))) or "none"
    reason = "loan_return" if setting.startswith("loan.") else "reclaim"
    return Refused(reason, f"{op} of node {node} from node {asker}: not allowed; only the nodes in {setting} "
                   f"may (listed: {listed})")


def identity_warnings(node_keys: str, check_source: bool, unkeyed: Iterable[int], networked: bool) -> list[str]:
    """What weakens member identity here (and so every rule above): empty when every member
    is keyed and ``node_keys`` is ``require``."""
    if not networked:
        return []
    out = []
    missing = sorted(unkeyed)
    if missing:
        out.append(f"node(s) {', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''} have no pubkey "
                   "in [[zone.nodes]]: their messages are signed with the zone key, which every member holds, so "
                   "another member can speak as them " + ("(by their address: zone.check_source)" if check_source
                                                         else "(zone.check_source is off: by any address)"))
    if node_keys != "require":
        out.append(f"zone.node_keys = \"{node_keys}\": zone-key MACs are still taken, so a member can speak as "
                   "another; the authority rules need \"require\" with every member keyed")
    return out


def check_node_list(v: Any) -> str | None:
    """A config check: a list of node ids (integers 1..2**32-1)."""
    if not isinstance(v, list):
        return "must be a list of node ids"
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= 2**32 - 1:
            return f"node id {x!r} is not an integer 1..{2**32 - 1}"
    return None


# -- counting refusals ------------------------------------------------------------------------------


class Refusals:
    """Refusals of peers' requests, counted by reason (:data:`REASONS`), with the last
    RECENT_MAX texts (who, what, when) for an operator."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_MAX)

    def note(self, e: Refused, node: int | None = None) -> Refused:
        self.counts[e.reason] = self.counts.get(e.reason, 0) + 1
        self.recent.append({"reason": e.reason, "node": node, "error": str(e)[:300], "ts": round(time.time(), 3)})
        return e

    def as_dict(self) -> dict[str, Any]:
        return {"refused": dict(self.counts), "total": sum(self.counts.values()), "recent": list(self.recent)}
