"""The zone's API routes (:func:`zone_routes`; the component's ``routes`` adds the loan layer's).

- ``GET /v1/zone/peers``: the roster with each peer's liveness and the age of its summary;
- ``GET /v1/zone/stats``: the component's counters (``ZoneComponent.stats``);
- ``GET /v1/zone/keys``, ``POST /v1/zone/keys/reload`` (privileged): the keys in use and a
  reload (:class:`laminar.zone.keyring.Keyring`);
- ``GET /v1/placements``: the placements this node submitted lately;
- ``POST /v1/placements`` (any user): a placement of a job through the zone, its spec checked
  here (``JobSpec``, the caller's grant) and its demand read by :func:`placement_demand`; a
  spec (or body) with ``workers`` is a multi-node job, placed as a gang by the agent's members
  component (``laminar.members.routes.submit``; docs/jobs.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from laminar.policy import placement as pl
from laminar.zone.membership import Membership

if TYPE_CHECKING:
    from laminar.components import ZoneAgent
    from laminar.zone.keyring import Keyring
    from laminar.zone.keys import ZoneKeys
    from laminar.zone.submitter import PlacementResult


def _demand_number(value: Any, what: str, lo: float, hi: float) -> float:
    """A number of a placement's demand: JSON's, or text float() reads (laminar.inputs bounds it
    first: ASCII, at most NUMBER_TEXT_MAX characters); PlacementError naming it otherwise."""
    from laminar.inputs import NUMBER_TEXT_MAX, InputError, brief, read_number

    if isinstance(value, str):
        if not value.isascii() or len(value) > NUMBER_TEXT_MAX:
            raise pl.PlacementError(f"{what} {brief(value)}: expected a number {lo:g}..{hi:g}")
        try:
            value = float(value)
        except ValueError:
            raise pl.PlacementError(f"{what} {brief(value)}: expected a number {lo:g}..{hi:g}") from None
    try:
        return read_number(value, what, lo, hi)
    except InputError as e:
        raise pl.PlacementError(str(e)) from None


def placement_demand(body: dict[str, Any], spec: dict[str, Any], checked: Any) -> pl.Demand:
    """The Demand of a POST /v1/placements body (its spec `checked` by JobSpec.from_dict, or
    None). Each field is checked for its type and range before it is converted: JSON's 1e400
    is inf, and int(inf), ``[].encode()`` or float("²") answered 500. PlacementError naming the
    field otherwise."""
    from laminar.inputs import InputError, brief, read_text

    gpus = _demand_number(body.get("gpus", spec.get("gpus", 0)), "demand: gpus", 0, pl.MAX_GPUS_PER_NODE)
    cpus = _demand_number(body.get("cpus", getattr(checked, "cpus", None) or 1.0), "demand: cpus", 0, 65535)
    memory = _demand_number(body.get("memory_mb", getattr(checked, "memory_mb", None) or 256), "demand: memory_mb",
                            0, 2 ** 32 - 1)
    if memory != int(memory):
        raise pl.PlacementError(f"demand: memory_mb {brief(body.get('memory_mb'))}: expected a whole number of MiB")
    names: dict[str, str | None] = {}
    for key in ("gpu_model", "pool"):
        v = body.get(key)
        try:
            names[key] = None if v is None or v == "" else read_text(v, f"demand: {key}", 32)
        except InputError as e:
            raise pl.PlacementError(str(e)) from None
    return pl.Demand(gpus=gpus, cpus=cpus, memory_mb=int(memory), gpu_model=names["gpu_model"], pool=names["pool"])


class RoutesHost(Protocol):
    """What the routes use of the component (ZoneComponent)."""

    _jobs: Any
    agent: ZoneAgent | None
    clock: Callable[[], float]
    history: list[dict[str, Any]]
    keyring: Keyring
    keys: ZoneKeys
    membership: Membership
    networked: bool

    async def place(self, spec: dict[str, Any], demand: pl.Demand, owner_uid: int = 0, owner_gid: int = 0,
                    packing: bool = False, quota: bool = False,
                    origin: dict[str, Any] | None = None) -> PlacementResult: ...
    def stats(self) -> dict[str, Any]: ...
    def own_gpus(self) -> int | None: ...


def cluster_room(host: RoutesHost) -> Any:
    """What a gang may be placed on as this node knows it (laminar.members.routes.ClusterRoom):
    the roster's nodes by zone, and the GPUs of each node whose summary it holds (this node's
    own from its arbiter's inventory) ."""
    from laminar.members.routes import ClusterRoom

    ms = host.membership
    gpus: dict[int, int | None] = {}
    for n in ms.by_node:
        st = ms.state.get(n)
        cap = st.last_summary if st is not None else None
        gpus[n] = len(cap.gpu_free) if cap is not None else None
    own = host.own_gpus()
    if own is not None:
        gpus[ms.self_node] = own
    return ClusterRoom(zones={z: list(nodes) for z, nodes in ms.by_zone.items()}, own_zone=ms.zone, gpus_of=gpus)


def zone_routes(host: RoutesHost) -> list[Any]:
    """The routes above; ``host``: the component."""
    from laminar.api import ApiError, Request, Route

    async def peers(req: Request) -> list[dict[str, Any]]:
        rows = host.membership.peers(host.clock())
        for r in rows:
            st = host.membership.state[r["node"]]
            r["summary_age_s"] = round(host.clock() - st.summary_at, 2) if st.summary_at >= 0 else None
        return rows

    async def stats(req: Request) -> dict[str, Any]:
        return host.stats()

    async def keys(req: Request) -> dict[str, Any]:
        return {"source": host.keys.source if hasattr(host, "keys") else None, "networked": host.networked,
                "keys": host.keyring.key_stats() if host.networked else [], "node_key": host.keyring.node_key_info()}

    async def keys_reload(req: Request) -> dict[str, Any]:
        from laminar.zone.keys import KeyFileError

        try:
            return host.keyring.reload_keys()
        except (KeyFileError, OSError) as e:
            raise ApiError(400, f"{e} (the keys in use stay)") from None
        except RuntimeError as e:
            raise ApiError(409, str(e)) from None

    async def submit(req: Request) -> dict[str, Any]:
        body = req.body
        if not isinstance(body, dict) or not isinstance(body.get("spec"), dict):
            raise ApiError(400, "placement: body must be {\"spec\": {job spec}, \"gpus\": n, \"pool\": ..., "
                                "\"gpu_model\": ..., \"packing\": false}")
        from laminar.members import routes as mroutes

        try:
            spec = mroutes.multinode_spec(body, dict(body["spec"]))
        except mroutes.MembersRefused as e:
            raise ApiError(e.status, e.message, e.reason) from None
        try:
            from laminar.runtime.grants import GrantError
            from laminar.runtime.spec import JobError, JobSpec

            checked = JobSpec.from_dict({**spec, "gpus": 0})  # GPUs are chosen by the node that takes it
        except ImportError:
            checked = None
        except JobError as e:
            if host._jobs is not None and hasattr(host._jobs, "count_refusal"):
                host._jobs.count_refusal("placement", e)
            raise ApiError(400, f"placement: {e}", e.reason or "placement_invalid") from None
        if checked is not None and host._jobs is not None and hasattr(host._jobs, "checks"):
            # the origin checks the caller's grant (config [grants]); the node that takes the
            # job keeps the class admitted here
            try:
                host._jobs.checks.grant(checked, req.peer.uid, req.peer.gid, req.peer.pid, req.peer.groups)
            except GrantError as e:
                raise ApiError(403, f"placement: {e}") from None
        adoption = getattr(host._jobs, "adoption", None)  # [gpus] owner (laminar.runtime.adopt)
        refused = adoption.gpus_refusal(body.get("gpus", spec.get("gpus"))) if adoption is not None else None
        if refused is not None:
            raise ApiError(400, f"placement: {refused}", "gpus_scheduler_owned")
        if checked is not None and checked.is_multinode():  # a gang, placed by the members component
            try:
                checked.gpus = mroutes.per_worker_gpus(mroutes.one_value(body, spec, "gpus", 0) or 0)
                members = host.agent.members if host.agent is not None else None
                return await mroutes.submit(members, checked, body, req.peer.uid, req.peer.gid, cluster_room(host))
            except mroutes.MembersRefused as e:
                raise ApiError(e.status, e.message, e.reason) from None
        if isinstance(spec.get("gpus"), list):
            raise ApiError(400, "placement: give a GPU count (\"gpus\": 2 or 0.5), not indices: the node that "
                                "takes the job chooses its GPUs")
        try:
            demand = placement_demand(body, spec, checked)
        except (pl.PlacementError, TypeError, ValueError) as e:
            raise ApiError(400, f"placement: {e}", "placement_invalid") from None
        packing = body.get("packing", False)
        if not isinstance(packing, bool):
            raise ApiError(400, f"placement: packing {packing!r} must be true or false")
        if checked is not None:  # what was checked goes on, not what was sent (it is checked again there)
            spec = checked.as_dict()
        spec.pop("gpus", None)
        res = await host.place(spec, demand, req.peer.uid, req.peer.gid, packing=packing, quota=True)
        return res.as_dict()

    async def history(req: Request) -> list[dict[str, Any]]:
        return list(reversed(host.history))

    return [
        Route("GET", "/v1/zone/peers", peers),
        Route("GET", "/v1/zone/stats", stats),
        Route("GET", "/v1/zone/keys", keys),
        Route("POST", "/v1/zone/keys/reload", keys_reload, privileged=True),
        Route("GET", "/v1/placements", history),
        Route("POST", "/v1/placements", submit, privileged=False),
    ]
