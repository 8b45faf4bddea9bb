"""The API of multi-node jobs (docs/jobs.md, "CLI and API"), served through the routes that own
each path (one route per path): the zone's ``POST /v1/placements`` hands a spec with
``workers`` to :func:`submit`, the jobs API's ``GET /v1/jobs``, ``GET /v1/jobs/{id}`` and
``POST /v1/jobs/{id}/stop`` add the multi-node jobs' views (:func:`list_views`,
:func:`local_job_extra`) and stop one (:func:`stop_members`), netguard's ``POST /v1/killswitch``
cuts every member's traffic (:func:`killswitch`). The members component (the agent's
``members``, ``laminar/members/component.py``) does the work; this module checks the request
first, so that bad input is refused with the value and what is allowed before anything
changes: 0 workers, min > max (:class:`~laminar.runtime.spec.JobSpec`), more workers than the
zones have nodes, per-worker GPUs no node has (:func:`gang_refusal`, from the zone's roster
and the nodes' summaries where known)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from laminar.components import MembersForApi
from laminar.runtime.spec import JobError, JobSpec, _brief, is_multinode_id

# The spec's multi-node keys a POST /v1/placements body may also give beside the spec
BODY_KEYS = ("workers", "workers_min", "workers_max", "launcher")


class MembersRefused(Exception):
    """A request about a multi-node job refused here: ``status`` (the API's) and the message,
    naming the value and what is allowed; ``reason``: the word the API counts it under."""

    def __init__(self, status: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


@dataclass(frozen=True)
class ClusterRoom:
    """What a gang may be placed on, as this node knows it: the roster's nodes by zone, this
    node's zone, and each node's GPU count where its summary is known (None: not known)."""

    zones: Mapping[int, list[int]]
    own_zone: int
    gpus_of: Mapping[int, int | None]


def gang_refusal(workers: int, gpus: int, spread_zones: bool, room: ClusterRoom) -> str | None:
    """Why a gang of ``workers`` members with ``gpus`` GPUs each can never be placed, or None.
    A gang stays in one zone unless ``spread_zones``: the largest zone (or every zone together)
    must have ``workers`` nodes; and at least ``workers`` of those nodes must have ``gpus`` GPUs,
    counting a node whose summary is not known as one that might. Pure: the roster and the
    summaries are given."""
    sizes = {z: len(nodes) for z, nodes in room.zones.items()}
    total = sum(sizes.values())
    if spread_zones:
        if workers > total:
            return (f"workers {workers}: the cluster has {total} nodes in {len(sizes)} zone(s), and a job has one "
                    f"member per node; ask for at most {total}")
        scopes: list[list[int]] = [[n for nodes in room.zones.values() for n in nodes]]
    else:
        biggest = max(sizes.values(), default=0)
        if workers > biggest:
            where = (f"its largest zone has {biggest}" if len(sizes) > 1 else f"the zone has {biggest}")
            more = (f"; --spread-zones lets it span zones ({total} nodes)" if total > biggest else "")
            return (f"workers {workers}: {where} nodes, and a job has one member per node; ask for at most "
                    f"{biggest}{more}")
        scopes = [nodes for nodes in room.zones.values() if len(nodes) >= workers]
    if gpus <= 0:
        return None
    best = 0
    most = 0
    for nodes in scopes:
        might = sum(1 for n in nodes if (room.gpus_of.get(n) is None or (room.gpus_of.get(n) or 0) >= gpus))
        best = max(best, might)
        most = max([most, *((room.gpus_of.get(n) or 0) for n in nodes)])
    if best >= workers:
        return None
    if best == 0:
        return f"gpus {gpus} per worker: no node has {gpus} GPUs (the most any node has is {most}); ask for at most {most}"
    return (f"gpus {gpus} per worker with workers {workers}: only {best} node(s) "
            f"{'of one zone ' if not spread_zones else ''}have {gpus} GPUs; ask for at most {best} workers, "
            "or fewer GPUs each")


def multinode_spec(body: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """The spec of a POST /v1/placements body with the multi-node keys it gives beside the spec
    (``workers``, ``workers_min``, ``workers_max``, ``launcher``) moved in; MembersRefused (400)
    when the body and the spec give one key two values."""
    out = dict(spec)
    for k in BODY_KEYS:
        if k in body:
            if k in out and out[k] != body[k]:
                raise MembersRefused(400, f"placement: {k} {_brief(body[k])} in the body and {_brief(out[k])} in "
                                          "the spec; give one of them", "placement_invalid")
            out[k] = body[k]
    return out


def one_value(body: dict[str, Any], spec: dict[str, Any], key: str, default: Any) -> Any:
    """``key`` as the body or the spec gives it; MembersRefused (400) when both give it with
    different values (a gang's per-worker demand must not be half one and half the other)."""
    if key in body and key in spec and body[key] != spec[key]:
        raise MembersRefused(400, f"placement: {key} {_brief(body[key])} beside the spec and {_brief(spec[key])} in "
                                  "it; give one of them", "placement_invalid")
    return body.get(key, spec.get(key, default))


def per_worker_gpus(value: Any) -> int:
    """A multi-node placement's ``gpus`` (per worker): a whole count; MembersRefused otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < 0 \
            or value != int(value) or value > 1024:
        raise MembersRefused(400, f"placement: gpus {_brief(value)}: a multi-node job's worker takes whole GPUs, "
                                  "0 to 1024 (a count per worker)", "placement_invalid")
    return int(value)


async def submit(members: MembersForApi | None, spec: JobSpec, body: dict[str, Any], uid: int, gid: int,
                 room: ClusterRoom | None) -> dict[str, Any]:
    """A multi-node job's placement (``spec.is_multinode()``, the spec checked): refused with
    MembersRefused before anything changes (no members component, options a gang does not take,
    a gang the cluster can never hold: :func:`gang_refusal` with ``room``, None: not checked),
    else the members component's ``submit`` and the job's view. A JobError of the component is
    a 400 with its message (a QuotaError 429)."""
    from laminar.runtime.spec import QuotaError

    if members is None:
        raise MembersRefused(501, f"placement: workers {spec.workers}: this agent runs no members component, so it "
                                  "cannot place a multi-node job; submit it on an agent that does, or without "
                                  "--workers", "no_members")
    for key in ("packing", "pool", "gpu_model"):
        if body.get(key) not in (None, False, ""):
            raise MembersRefused(400, f"placement: {key} {_brief(body.get(key))}: not for a multi-node job (its "
                                      "members are placed by their GPUs, CPUs and memory per worker); leave it out",
                                 "placement_invalid")
    spread = body.get("spread_zones", False)
    if not isinstance(spread, bool):
        raise MembersRefused(400, f"placement: spread_zones {_brief(spread)}: expected true or false",
                             "placement_invalid")
    gpus = spec.gpus if isinstance(spec.gpus, int) else len(spec.gpus)
    if room is not None:
        assert spec.workers is not None  # a multi-node spec has its count (JobSpec.validate)
        why = gang_refusal(spec.workers, gpus, spread, room)
        if why is not None:
            raise MembersRefused(400, f"placement: {why}", "gang_never_fits")
    try:
        return await members.submit(spec, uid, gid, spread_zones=spread)
    except QuotaError as e:
        raise MembersRefused(429, str(e), e.reason or "max_per_user") from None
    except JobError as e:
        raise MembersRefused(400, f"placement: {e}", e.reason or "placement_invalid") from None


def reserved_num(job_id: str) -> int | None:
    """The origin's job number in a multi-node id (``job-7-n3`` -> 7), None for another id."""
    if not is_multinode_id(job_id):
        return None
    return int(job_id[4:].partition("-")[0])


def origin_views(members: MembersForApi | None, here: int, have: Iterable[str]) -> list[dict[str, Any]]:
    """The views of the multi-node jobs this node originates and hosts no member of (ids not in
    ``have``, the local jobs listed), each with its ``num`` (the number reserved for it here, in
    this node's sequence: a page of GET /v1/jobs places it among the local jobs) and ``kind``
    ``multinode``."""
    if members is None:
        return []
    seen = set(have)
    out = []
    for v in members.views():
        jid = v.get("id")
        if not isinstance(jid, str) or jid in seen or v.get("origin") != here:
            continue
        num = reserved_num(jid)
        if num is not None:
            out.append({**v, "num": num, "kind": "multinode"})
    return out


def member_block(view: dict[str, Any], here: int) -> dict[str, Any]:
    """A local job's ``member`` block (the job's id, this node's member index, the members'
    count, the origin) from its multi-node job's view; index None when the view lists no
    member on this node."""
    ms = view.get("members") or []
    index = next((m.get("index") for m in ms if m.get("node") == here), None)
    return {"job": view.get("id"), "index": index, "count": len(ms), "origin": view.get("origin")}


def local_job_extra(members: MembersForApi | None, job_id: str, here: int) -> dict[str, Any]:
    """What a local job's entry in GET /v1/jobs(/{id}) adds when it is a member of a multi-node
    job this node knows: ``member`` (:func:`member_block`) and ``multinode`` (the job's view);
    nothing otherwise."""
    if members is None or not is_multinode_id(job_id):
        return {}
    v = members.view(job_id)
    if v is None:
        return {}
    return {"member": member_block(v, here), "multinode": v}


def may_manage(view: dict[str, Any], uid: int, in_control_group: bool) -> bool:
    """Whether the caller may stop or cut a multi-node job: root, its owner, the control group."""
    return uid == 0 or uid == view.get("owner_uid") or in_control_group


async def stop_members(members: MembersForApi, job_id: str, uid: int, in_control_group: bool) -> dict[str, Any]:
    """Stops every member of ``job_id`` (a view this node holds: the caller checked). Refused
    (403) unless the caller may manage it; a JobError of the component is a 409."""
    v = members.view(job_id)
    if v is None:
        raise MembersRefused(404, f"no multi-node job {job_id!r} here (see `laminarctl jobs`)")
    if not may_manage(v, uid, in_control_group):
        raise MembersRefused(403, f"permission denied: job {job_id} belongs to uid {v.get('owner_uid')}; stopping "
                                  f"another user's job needs root or the control group (caller uid {uid})")
    try:
        return await members.stop(job_id, by_uid=uid)
    except JobError as e:
        raise MembersRefused(409, str(e), e.reason) from None


def own_node(config: Any) -> int:
    """This node's zone node id (config ``zone.node_id``; 1 for a one-node zone, as the zone
    component takes it)."""
    try:
        return int((config.section("zone") or {}).get("node_id") or 1)
    except (KeyError, AttributeError, TypeError, ValueError):
        return 1
