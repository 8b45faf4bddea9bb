"""The API of multi-node jobs (laminar.members.routes, docs/jobs.md "CLI and API"): a gang's
placement through POST /v1/placements refused before anything changes when the cluster can
never hold it, the jobs API listing and showing multi-node jobs with their members and stopping
them, the kill-switch reaching every member. The members component is a stand-in
(tests/standin_members.py) while the real one is built beside this; the zone, the job manager
(real jobs in real cgroups, as root) and netguard's route are the real ones."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from jobrig import job_manager
from standin_agent import standin_agent
from standin_members import StandinMembers, view

from laminar import config as cfg
from laminar.api import ApiError, Peer, Request
from laminar.components import JobsAgent, NetGuardAgent, ZoneAgent
from laminar.members.routes import ClusterRoom, gang_refusal, member_block, reserved_num
from laminar.net.netguard import NetGuard
from laminar.policy import placement as pl
from laminar.runtime.spec import JobSpec
from laminar.zone.component import ZoneComponent
from laminar.zone.membership import Member, Membership

ROOT = Peer(0, 0, 1)


def room(zones: dict[int, list[int]], gpus: dict[int, int | None] | None = None) -> ClusterRoom:
    nodes = [n for ns in zones.values() for n in ns]
    return ClusterRoom(zones=zones, own_zone=1, gpus_of=gpus or dict.fromkeys(nodes))


def test_gang_refusals_name_the_value_and_what_is_allowed() -> None:
    two_zones = {1: [1, 2, 3], 2: [4, 5, 6, 7]}
    assert gang_refusal(3, 0, False, room(two_zones)) is None
    assert gang_refusal(4, 0, False, room(two_zones)) is None  # zone 2 holds it
    why = gang_refusal(5, 0, False, room(two_zones))
    assert why is not None and "workers 5" in why and "largest zone has 4 nodes" in why and "at most 4" in why
    assert "--spread-zones" in why and "(7 nodes)" in why
    assert gang_refusal(7, 0, True, room(two_zones)) is None
    why = gang_refusal(8, 0, True, room(two_zones))
    assert why is not None and "workers 8" in why and "7 nodes in 2 zone(s)" in why and "at most 7" in why
    one = gang_refusal(4, 0, False, room({1: [1, 2, 3]}))
    assert one is not None and "the zone has 3 nodes" in one and "spread" not in one
    # GPUs per worker: from the summaries known; a node not heard of might have them
    g = {1: 1, 2: 1, 3: 1}
    why = gang_refusal(2, 2, False, room({1: [1, 2, 3]}, g))
    assert why is not None and "gpus 2 per worker" in why and "no node has 2 GPUs" in why and "at most 1" in why
    assert gang_refusal(2, 1, False, room({1: [1, 2, 3]}, g)) is None
    why = gang_refusal(3, 4, False, room({1: [1, 2, 3]}, {1: 8, 2: 8, 3: 1}))
    assert why is not None and "only 2 node(s)" in why and "at most 2 workers" in why
    assert gang_refusal(3, 4, False, room({1: [1, 2, 3]}, {1: 8, 2: 8, 3: None})) is None  # node 3 unknown
    # a zone too small for the gang does not count its big nodes
    why = gang_refusal(3, 4, False, room({1: [1, 2], 2: [3, 4, 5]}, {1: 8, 2: 8, 3: 1, 4: 1, 5: 1}))
    assert why is not None and "no node has 4 GPUs" in why


def test_views_helpers() -> None:
    assert reserved_num("job-7-n3") == 7 and reserved_num("job-7") is None
    v = view("job-7-n3", 3, [(5, "10.9.0.5"), (8, "10.9.0.8")])
    assert member_block(v, 8) == {"job": "job-7-n3", "index": 1, "count": 2, "origin": 3}
    assert member_block(v, 9)["index"] is None


# ------------------------------------------------------------------- POST /v1/placements (the zone's)


def zone_with(members: StandinMembers | None, nodes: int = 3,
              gpus: dict[int, int] | None = None) -> ZoneComponent:
    """A started one-node zone given a roster of ``nodes`` nodes (one zone) and the GPU counts
    of the peers' summaries in ``gpus``; the agent a stand-in with ``members``."""
    comp = ZoneComponent(settings={"cpus": 4, "memory_mb": 4000}, gpus=1)

    async def go() -> None:
        await comp.start(None)
        await comp.stop()

    asyncio.run(go())
    comp.membership = Membership(1, [Member(n, 1, f"10.9.0.{n}", 7000) for n in range(1, nodes + 1)])
    for n, k in (gpus or {}).items():
        comp.membership.state[n].last_summary = pl.NodeCapacity(n, 1, (1.0,) * k, 8.0, 8000)
    comp.agent = standin_agent(ZoneAgent, members=members)  # type: ignore[assignment]
    return comp


def place(comp: ZoneComponent, body: dict[str, Any], peer: Peer = ROOT) -> Any:
    submit = next(r for r in comp.routes() if r.method == "POST" and r.path == "/v1/placements")
    return asyncio.run(submit.handler(Request("POST", "/v1/placements", {}, {}, body, peer)))


def test_a_gang_goes_to_the_members_component() -> None:
    m = StandinMembers(origin=1)
    comp = zone_with(m)
    v = place(comp, {"spec": {"command": ["python", "train.py"], "workers": 3, "cpus": 2}, "gpus": 1},
              Peer(1000, 1000, 1))
    assert v["id"] == "job-7-n1" and len(v["members"]) == 3
    (_, spec, uid, gid, spread), = m.calls
    assert isinstance(spec, JobSpec) and spec.workers == 3 and spec.gpus == 1 and spec.cpus == 2.0
    assert (uid, gid, spread) == (1000, 1000, False)
    # the multi-node keys beside the spec, and the zones spread
    place(comp, {"spec": {"command": ["python", "t.py"]}, "workers": 3, "workers_min": 2, "workers_max": 3,
                 "launcher": "plain", "spread_zones": True})
    spec, spread = m.calls[-1][1], m.calls[-1][4]
    assert (spec.workers_min, spec.workers, spec.workers_max, spec.launcher, spread) == (2, 3, 3, "plain", True)
    # one worker is a one-node placement, as before: not the members component's
    n = len(m.calls)
    res = place(comp, {"spec": {"command": ["true"], "workers": 1}})
    assert "outcome" in res and len(m.calls) == n


@pytest.mark.parametrize("body, status, words", [
    ({"spec": {"command": ["x"], "workers": 0}}, 400, ["workers 0", "1 to 64"]),
    ({"spec": {"command": ["x"], "workers": 2, "workers_min": 3, "workers_max": 2}}, 400, ["3:2", "min 3"]),
    ({"spec": {"command": ["x"], "workers": 4}}, 400, ["workers 4", "the zone has 3 nodes", "at most 3"]),
    ({"spec": {"command": ["x"], "workers": 2}, "gpus": 2}, 400, ["gpus 2 per worker", "no node has 2 GPUs"]),
    ({"spec": {"command": ["x"], "workers": 2}, "gpus": 0.5}, 400, ["gpus 0.5", "whole GPUs"]),
    ({"spec": {"command": ["x"], "workers": 2}, "packing": True}, 400, ["packing True", "not for a multi-node"]),
    ({"spec": {"command": ["x"], "workers": 2}, "pool": "a"}, 400, ["pool 'a'"]),
    ({"spec": {"command": ["x"], "workers": 2}, "workers": 3}, 400, ["workers 3 in the body and 2 in the spec"]),
    ({"spec": {"command": ["x"], "workers": 2, "gpus": 1}, "gpus": 0}, 400, ["gpus 0 beside the spec and 1 in it"]),
    ({"spec": {"command": ["x"], "workers": 2}, "spread_zones": "yes"}, 400, ["spread_zones 'yes'"]),
    ({"spec": {"command": ["x"], "workers": 2, "launcher": "mpi"}}, 400, ["launcher 'mpi'"]),
])
def test_refused_before_anything_changes(body: dict[str, Any], status: int, words: list[str]) -> None:
    m = StandinMembers()
    comp = zone_with(m, nodes=3, gpus={1: 1, 2: 1, 3: 1})
    with pytest.raises(ApiError) as e:
        place(comp, body)
    assert e.value.status == status
    for w in words:
        assert w in e.value.message, (w, e.value.message)
    assert m.calls == [] and m.jobs == {}


def test_without_a_members_component_and_the_components_refusal() -> None:
    comp = zone_with(None)
    with pytest.raises(ApiError) as e:
        place(comp, {"spec": {"command": ["x"], "workers": 2}})
    assert e.value.status == 501 and "workers 2" in e.value.message and "no members component" in e.value.message
    m = StandinMembers()
    m.refuse = "too many jobs: uid 0 has 256"
    comp = zone_with(m)
    with pytest.raises(ApiError) as e:
        place(comp, {"spec": {"command": ["x"], "workers": 2}})
    assert e.value.status == 400 and "too many jobs" in e.value.message


# ------------------------------------------------------------------- the jobs API and the kill-switch


def jobs_routes(jm: Any) -> dict[tuple[str, str], Any]:
    return {(r.method, r.path): r.handler for r in jm.routes()}


def req(method: str, path: str, params: dict[str, str] | None = None, body: Any = None,
        peer: Peer = ROOT, query: dict[str, str] | None = None) -> Request:
    return Request(method, path, query or {}, {}, body, peer, params or {})


@pytest.mark.skipif(os.geteuid() != 0, reason="real jobs in cgroups need root")
def test_jobs_list_show_and_stop_multinode_jobs(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jm:
            m = StandinMembers(origin=1)
            jm.agent = standin_agent(JobsAgent, members=m, config=cfg.load(None), store=jm.store)
            r = jobs_routes(jm)
            with pytest.raises(ApiError) as e:  # one node's POST /v1/jobs takes no gang
                await r[("POST", "/v1/jobs")](req("POST", "/v1/jobs", body={"command": ["x"], "workers": 3}))
            assert e.value.status == 400 and "workers 3" in e.value.message and "--workers 3" in e.value.message
            assert jm.list() == [] and m.calls == []
            a = await jm.submit(JobSpec(command=["sleep", "30"]))  # job-1
            mine = jm.reserve_multinode_id(1)  # job-2-n1: originated here, no member here
            m.jobs[mine] = view(mine, 1, [(2, "10.9.0.2"), (3, "10.9.0.3")], owner_uid=1000)
            b = await jm.submit(JobSpec(command=["sleep", "30"]))  # job-3
            other = "job-9-n4"  # another origin's, a member here (node 1 is member 1)
            m.jobs[other] = view(other, 4, [(4, "10.9.0.4"), (1, "10.9.0.1")])
            member = await jm.submit(JobSpec(command=["sleep", "30"]), job_id=other)
            page = json.loads(bytes(await r[("GET", "/v1/jobs")](req("GET", "/v1/jobs"))))
            assert [j["id"] for j in page] == ["job-1", mine, "job-3", other]
            mv = page[1]
            assert mv["kind"] == "multinode" and mv["num"] == 2 and [x["node"] for x in mv["members"]] == [2, 3]
            assert page[3]["member"] == {"job": other, "index": 1, "count": 2, "origin": 4}
            assert page[3]["multinode"]["members"][0]["addr"] == "10.9.0.4"
            # pages: the view in the page of its number
            p1 = json.loads(bytes(await r[("GET", "/v1/jobs")](req("GET", "/v1/jobs", query={"limit": "2"}))))
            assert [j["id"] for j in p1] == ["job-3", other]
            p2 = json.loads(bytes(await r[("GET", "/v1/jobs")](req("GET", "/v1/jobs",
                                                                   query={"limit": "2", "before": "3"}))))
            assert [j["id"] for j in p2] == ["job-1", mine]
            shown = await r[("GET", "/v1/jobs/{id}")](req("GET", f"/v1/jobs/{mine}", {"id": mine}))
            assert shown["id"] == mine and shown["kind"] == "multinode" and len(shown["members"]) == 2
            local = await r[("GET", "/v1/jobs/{id}")](req("GET", f"/v1/jobs/{other}", {"id": other}))
            assert local["pid"] == member.pid and local["member"]["index"] == 1
            # stop: another user's is refused, nothing asked of the component
            stop = r[("POST", "/v1/jobs/{id}/stop")]
            with pytest.raises(ApiError) as e:
                await stop(req("POST", "/stop", {"id": mine}, {}, Peer(2000, 2000, 1)))
            assert e.value.status == 403 and "belongs to uid 1000" in e.value.message and m.calls == []
            res = await stop(req("POST", "/stop", {"id": mine}, {}, Peer(1000, 1000, 1)))
            assert res["state"] == "ended" and m.calls == [("stop", mine, 1000)]
            m.refuse = "job-9-n4: its origin did not answer"
            with pytest.raises(ApiError) as e:
                await stop(req("POST", "/stop", {"id": other}, {}))
            assert e.value.status == 409 and "did not answer" in e.value.message
            live = json.loads(bytes(await r[("GET", "/v1/jobs")](req("GET", "/v1/jobs", query={"all": "0"}))))
            assert mine not in [j["id"] for j in live]  # ended: not among the live ones
            for j in (a, b, member):
                await jm.stop(j.id, "test")

    asyncio.run(main())


def test_the_killswitch_reaches_every_member() -> None:
    m = StandinMembers(origin=1)
    m.jobs["job-7-n1"] = view("job-7-n1", 1, [(1, "10.9.0.1"), (2, "10.9.0.2")])
    ng = NetGuard()
    ng.agent = standin_agent(NetGuardAgent, members=m)  # type: ignore[assignment]
    handler = next(r.handler for r in ng.routes() if r.method == "POST" and r.path == "/v1/killswitch")

    async def main() -> None:
        ng.agent.loop = asyncio.get_running_loop()  # type: ignore[union-attr]
        res = await handler(req("POST", "/v1/killswitch", body={"action": "on", "scope": "job", "job": "job-7-n1"}))
        assert res["members"]["members"] == [1, 2] and m.calls == [("killswitch", "job-7-n1", True, 0)]
        with pytest.raises(ApiError) as e:  # no member here: a deadline would be no data plane's
            await handler(req("POST", "/v1/killswitch",
                              body={"action": "arm", "scope": "job", "job": "job-7-n1", "at_s": 5}))
        assert e.value.status == 409 and "no member on this node" in e.value.message
        assert len(m.calls) == 1

    asyncio.run(main())
