"""The Kubernetes backend's pure parts and its API calls, without root.

The kubelet's cgroup layout (laminar.sched.kubepods) on plain directories laid out as the
kubelet lays out its cgroups (names only are read, so a tmp tree shows the parser and the walk's
bounds; the real cgroups are tests/kernel/test_kubernetes_adopt.py's); the pod annotations
(laminar.policy.kubernetes); and the backend's requests against the FAKE API server of
tests/fakekubeapi.py (real TLS on 127.0.0.1, a token it checks).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fakekubeapi import fake_api_server, pod

from laminar.policy import kubernetes as pk
from laminar.policy.sched import Scheduler
from laminar.sched import kubepods
from laminar.sched.backend import BackendError
from laminar.sched.kubeapi import KubeApi, KubeApiError, check_url
from laminar.sched.kubernetes import KubernetesBackend, pod_ids

UID1 = "0b6f2a94-3c1d-4e8e-9b7a-1f2e3d4c5b6a"
UID2 = "11111111-2222-4333-8444-555555555555"
UID3 = "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
CTR = "a" * 64


# -- the layout ------------------------------------------------------------------------------------


def test_pod_dir_names_of_both_drivers() -> None:
    u = UID1.replace("-", "_")
    assert kubepods.parse_pod_dir(f"kubepods-pod{u}.slice", "guaranteed", "systemd") == (UID1, "guaranteed")
    assert kubepods.parse_pod_dir(f"kubepods-burstable-pod{u}.slice", "burstable", "systemd") == (UID1, "burstable")
    assert kubepods.parse_pod_dir(f"kubepods-besteffort-pod{u}.slice", "besteffort", "systemd") == (UID1, "besteffort")
    # a slice in the wrong QoS parent, a dashed UID in a systemd name, an upper-case UID: not pods
    assert kubepods.parse_pod_dir(f"kubepods-burstable-pod{u}.slice", "besteffort", "systemd") is None
    assert kubepods.parse_pod_dir(f"kubepods-pod{UID1}.slice", "guaranteed", "systemd") is None
    assert kubepods.parse_pod_dir(f"pod{UID1.upper()}", "burstable", "cgroupfs") is None
    assert kubepods.parse_pod_dir(f"pod{UID1}", "burstable", "cgroupfs") == (UID1, "burstable")
    assert kubepods.parse_pod_dir("kubepods-burstable.slice", "guaranteed", "systemd") is None
    assert kubepods.container_id(f"cri-containerd-{CTR}.scope", "systemd") == CTR
    assert kubepods.container_id(f"crio-{CTR}.scope", "systemd") == CTR
    assert kubepods.container_id(f"crio-conmon-{CTR}.scope", "systemd") is None  # cri-o's monitor
    assert kubepods.container_id(CTR, "cgroupfs") == CTR


def lay_out(mount: Path, rel: str, containers: int = 2) -> None:
    for i in range(containers):
        (mount / rel / f"cri-containerd-{str(i) * 64}.scope").mkdir(parents=True)


def test_discover_finds_the_three_qos_classes_of_the_systemd_driver(tmp_path: Path) -> None:
    for uid, qos in ((UID1, "guaranteed"), (UID2, "burstable"), (UID3, "besteffort")):
        lay_out(tmp_path, kubepods.systemd_pod_path("lm-k", uid, qos))
    (tmp_path / "lm-k/kubepods.slice/kubepods-burstable.slice/not-a-pod.slice").mkdir()
    walk = kubepods.discover(tmp_path, "lm-k")
    assert walk.truncated is None
    got = {p.uid: p for p in walk.pods}
    assert {u: p.qos for u, p in got.items()} == {UID1: "guaranteed", UID2: "burstable", UID3: "besteffort"}
    p = got[UID2]
    assert p.path == f"lm-k/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID2.replace('-', '_')}.slice"
    assert p.driver == "systemd" and len(p.containers) == 2
    assert all(c.startswith(p.path + "/cri-containerd-") for c in p.containers)


def test_discover_reads_the_cgroupfs_driver(tmp_path: Path) -> None:
    for uid, qos in ((UID1, "guaranteed"), (UID2, "burstable")):
        d = tmp_path / kubepods.cgroupfs_pod_path("", uid, qos)
        (d / CTR).mkdir(parents=True)
    got = {p.uid: (p.qos, p.path, p.containers) for p in kubepods.discover(tmp_path).pods}
    assert got == {UID1: ("guaranteed", f"kubepods/pod{UID1}", (f"kubepods/pod{UID1}/{CTR}",)),
                   UID2: ("burstable", f"kubepods/burstable/pod{UID2}", (f"kubepods/burstable/pod{UID2}/{CTR}",))}


def test_discover_never_follows_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    lay_out(outside, kubepods.systemd_pod_path("", UID1, "burstable"))
    (tmp_path / "root").mkdir()
    (tmp_path / "root/kubepods.slice").symlink_to(outside / "kubepods.slice")
    assert kubepods.discover(tmp_path, "root").pods == ()
    # a pod directory that is a symlink, inside a real tree
    lay_out(tmp_path, kubepods.systemd_pod_path("r2", UID2, "burstable"))
    qos = tmp_path / "r2/kubepods.slice/kubepods-burstable.slice"
    (qos / f"kubepods-burstable-pod{UID3.replace('-', '_')}.slice").symlink_to(
        outside / kubepods.systemd_pod_path("", UID1, "burstable"))
    assert [p.uid for p in kubepods.discover(tmp_path, "r2").pods] == [UID2]


def test_discover_is_bounded_in_pods_and_entries(tmp_path: Path) -> None:
    uids = [f"{i:08x}-0000-4000-8000-000000000000" for i in range(6)]
    for u in uids:
        lay_out(tmp_path, kubepods.systemd_pod_path("", u, "besteffort"), containers=3)
    walk = kubepods.discover(tmp_path, max_pods=4)
    assert len(walk.pods) == 4 and walk.truncated == "more than 4 pods"
    walk = kubepods.discover(tmp_path, max_entries=10)
    assert walk.truncated == "more than 10 cgroup entries" and walk.entries == 10
    assert len(walk.pods) < 6


def test_a_pods_gpus_are_what_the_device_plugin_gave_its_containers(tmp_path: Path) -> None:
    uuids = {"GPU-aaaa": 0, "GPU-bbbb": 3}
    assert kubepods.gpus_of("GPU-bbbb,GPU-aaaa", uuids) == {0, 3}
    assert kubepods.gpus_of("1,2", uuids) == {1, 2}
    assert kubepods.gpus_of("void", uuids) == set() and kubepods.gpus_of("none", uuids) == set()
    assert kubepods.gpus_of("all", uuids) is None  # an image's default, not an assignment
    assert kubepods.gpus_of("GPU-cccc", uuids) is None
    # real processes with the environment the runtime gives them; cgroup.procs as the kernel lists it
    rel = kubepods.systemd_pod_path("", UID1, "burstable")
    lay_out(tmp_path, rel, containers=3)
    ctrs = tuple(str(p.relative_to(tmp_path)) for p in sorted((tmp_path / rel).iterdir()))
    procs = [subprocess.Popen(["sleep", "60"], env={"PATH": "/usr/bin:/bin", **env}) for env in
             ({"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb"}, {"NVIDIA_VISIBLE_DEVICES": "all"}, {})]
    try:
        for ctr, p in zip(ctrs, procs, strict=True):
            (tmp_path / ctr / "cgroup.procs").write_text(f"{p.pid}\n")
        assert kubepods.pod_gpus(tmp_path, ctrs, uuids) == (3,)
        (tmp_path / ctrs[2] / "cgroup.procs").write_text(f"{procs[0].pid}\n")
        procs[1].kill()
        procs[1].wait()
        assert kubepods.pod_gpus(tmp_path, ctrs, uuids) == (3,)  # a process gone: nothing from it
    finally:
        for p in procs:
            p.kill()
            p.wait()


# -- the annotations -------------------------------------------------------------------------------


def test_a_pod_without_the_class_annotation_is_not_adopted() -> None:
    assert pk.parse_annotations("a/b", {}) is None
    assert pk.parse_annotations("a/b", None) is None
    assert pk.parse_annotations("a/b", {pk.PRIORITY: "90"}) is None


def test_annotations_give_class_priority_and_checkpoint() -> None:
    assert pk.parse_annotations("a/b", {pk.CLASS: "long-resident"}) == pk.PodAsk("long-resident", 50, "USR1")
    assert pk.parse_annotations("a/b", {pk.CLASS: "transient", pk.PRIORITY: " 7 ", pk.CHECKPOINT: "sigusr2"}) == \
        pk.PodAsk("transient", 7, "USR2")
    assert pk.parse_annotations("a/b", {pk.CLASS: "standard", pk.CHECKPOINT: "None"}).checkpoint == "none"  # type: ignore[union-attr]


@pytest.mark.parametrize(("notes", "words"), [
    ({pk.CLASS: "gold"}, ["pod team-a/train-0", "laminar.io/class", "'gold'", "long-resident, standard, transient"]),
    ({pk.CLASS: "standard", pk.PRIORITY: "101"}, ["laminar.io/priority", "'101'", "0..100"]),
    ({pk.CLASS: "standard", pk.PRIORITY: "-1"}, ["'-1'", "0..100"]),
    ({pk.CLASS: "standard", pk.PRIORITY: "1e2"}, ["'1e2'"]),
    ({pk.CLASS: "standard", pk.CHECKPOINT: "KILL"}, ["laminar.io/checkpoint", "'KILL'", "cannot be caught"]),
    ({pk.CLASS: "standard", pk.CHECKPOINT: "USR9"}, ["'USR9'", "USR1"]),
    ({pk.CLASS: "x" * 10_000}, ["at most 64 characters"]),
    ({pk.CLASS: 3}, ["laminar.io/class", "3", "a string"]),
])
def test_bad_annotations_are_refused_naming_the_pod_and_the_value(notes: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(pk.PodNoteError) as e:
        pk.parse_annotations("team-a/train-0", notes)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert len(str(e.value)) < 400  # a huge value is cut in the message


def test_request_bodies() -> None:
    assert pk.eviction_body("team-a", "train-0") == {"apiVersion": "policy/v1", "kind": "Eviction",
                                                     "metadata": {"name": "train-0", "namespace": "team-a"}}
    assert pk.cordon_patch(True, "reclaim") == {"metadata": {"annotations": {pk.CORDONED: "reclaim"}},
                                                "spec": {"unschedulable": True}}
    assert pk.cordon_patch(False, "withdrawn") == {"metadata": {"annotations": {pk.CORDONED: None}},
                                                   "spec": {"unschedulable": False}}
    assert [pk.evict_wait(n) for n in (1, 2, 3, 4, 9)] == [1.0, 2.0, 4.0, 8.0, 8.0]


def test_pod_ids_come_from_the_spec() -> None:
    assert pod_ids(pod("a", "b", UID1, "n", run_as=1000)) == (1000, 1000)
    assert pod_ids(pod("a", "b", UID1, "n")) == (0, 0)
    p = pod("a", "b", UID1, "n")
    p["spec"]["containers"][0]["securityContext"] = {"runAsUser": 1234}
    assert pod_ids(p) == (1234, 1234)


def test_the_api_url_must_be_https() -> None:
    assert check_url("") is None and check_url("https://10.0.0.1:6443") is None
    assert "https" in (check_url("http://10.0.0.1:8080") or "")
    assert check_url("https://h/api") is not None


# -- the API calls against the FAKE API server ---------------------------------------------------


def backend(srv: Any, node: str = "lm-node-1", **cfg: Any) -> KubernetesBackend:
    events: list[str] = []
    b = KubernetesBackend({"api_url": srv.url, "token_file": str(srv.token_file), "ca_file": str(srv.ca_file),
                           "node_name": node, **cfg}, None, SimpleNamespace(emit=lambda k, m, **f: events.append(m)),
                          Path("/nonexistent"))
    b.seen_events = events  # type: ignore[attr-defined]
    return b


def adopted_job(ref: str) -> Any:
    return SimpleNamespace(id="7", origin=SimpleNamespace(scheduler=Scheduler.KUBERNETES, scheduler_ref=ref))


def test_the_pod_list_is_this_nodes_with_a_checked_token_and_ca(tmp_path: Path) -> None:
    with fake_api_server(tmp_path, "lm-node-1") as srv:
        srv.pods = [pod("team-a", "train-0", UID1, "lm-node-1", {pk.CLASS: "standard"}),
                    pod("team-b", "other", UID2, "lm-node-2")]
        b = backend(srv)
        pods = asyncio.run(b.list_pods())
        assert [p["metadata"]["name"] for p in pods] == ["train-0"]
        (seen,) = srv.seen("GET")
        assert seen.path == "/api/v1/pods?fieldSelector=spec.nodeName=lm-node-1"
        srv.token_file.write_text("a-rotated-token-the-server-does-not-know")
        with pytest.raises(KubeApiError, match="401: Unauthorized"):
            asyncio.run(b.list_pods())
        other_ca = tmp_path / "other"
        other_ca.mkdir()
        from fakekubeapi import make_tls
        ca, _, _ = make_tls(other_ca)
        with pytest.raises(KubeApiError, match="CERTIFICATE_VERIFY_FAILED"):
            KubeApi(srv.url, str(srv.token_file), str(ca)).request("GET", "/api/v1/pods")


def test_an_answer_past_the_bounds_is_refused(tmp_path: Path) -> None:
    with fake_api_server(tmp_path, "lm-node-1") as srv:
        srv.list_pad = 2 * 1024 * 1024
        api = KubeApi(srv.url, str(srv.token_file), str(srv.ca_file), timeout_s=5.0)
        with pytest.raises(KubeApiError, match="more than the 1048576 allowed"):
            api.request("GET", "/api/v1/pods?fieldSelector=spec.nodeName=lm-node-1", max_bytes=1024 * 1024)
        srv.list_pad = 0
        srv.delay_s = 3.0
        api = KubeApi(srv.url, str(srv.token_file), str(srv.ca_file), timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(KubeApiError, match="within 0.5 s"):
            asyncio.run(api.call("GET", "/api/v1/pods"))
        assert time.monotonic() - t0 < 2.5


def test_cordon_and_uncordon_leave_an_operators_cordon_alone(tmp_path: Path) -> None:
    with fake_api_server(tmp_path, "lm-node-1") as srv:
        b = backend(srv)
        asyncio.run(b.drain("laminar: reclaim by the owner"))
        (patch,) = srv.seen("PATCH", "/api/v1/nodes/lm-node-1")
        assert patch.content_type == "application/strategic-merge-patch+json"
        assert patch.body == {"metadata": {"annotations": {pk.CORDONED: "laminar: reclaim by the owner"}},
                              "spec": {"unschedulable": True}}
        assert srv.node["spec"]["unschedulable"] is True
        asyncio.run(b.undrain("withdrawn"))
        assert srv.node["spec"]["unschedulable"] is False and pk.CORDONED not in srv.node["metadata"]["annotations"]
        # cordoned by an operator: neither cordoned again nor ever uncordoned by Laminar
        srv.node["spec"]["unschedulable"] = True
        srv.requests.clear()
        asyncio.run(b.drain("laminar: reclaim"))
        asyncio.run(b.undrain("withdrawn"))
        assert srv.seen("PATCH") == [] and srv.node["spec"]["unschedulable"] is True
        assert any("cordoned already" in m for m in b.seen_events)  # type: ignore[attr-defined]


def test_eviction_retries_while_a_disruption_budget_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pk, "EVICT_BACKOFF_S", (0.05, 0.1))
    with fake_api_server(tmp_path, "lm-node-1") as srv:
        srv.pods = [pod("team-a", "train-0", UID1, "lm-node-1"), pod("team-a", "held", UID2, "lm-node-1")]
        srv.evictions["team-a/train-0"] = [429, 429, 201]
        b = backend(srv)
        said = asyncio.run(b.give_back(adopted_job("team-a/train-0"), "/ckpt/3"))
        assert said == "pod team-a/train-0 evicted after 2 refusals by a PodDisruptionBudget (checkpoint /ckpt/3)"
        posts = srv.seen("POST", "/api/v1/namespaces/team-a/pods/train-0/eviction")
        assert len(posts) == 3
        assert all(p.body == {"apiVersion": "policy/v1", "kind": "Eviction",
                              "metadata": {"name": "train-0", "namespace": "team-a"}} for p in posts)
        srv.evictions["team-a/held"] = [429]  # a budget that never allows it
        t0 = time.monotonic()
        with pytest.raises(BackendError, match="refused .* times until the deadline: a PodDisruptionBudget"):
            asyncio.run(b.give_back(adopted_job("team-a/held"), None, deadline_mono=time.monotonic() + 0.5))
        assert time.monotonic() - t0 < 2.0
        assert asyncio.run(b.give_back(adopted_job("team-a/gone"), None)) == "pod team-a/gone already gone"


def test_publish_sets_the_last_checkpoint_annotation(tmp_path: Path) -> None:
    with fake_api_server(tmp_path, "lm-node-1") as srv:
        srv.pods = [pod("team-a", "train-0", UID1, "lm-node-1", {pk.CLASS: "standard"})]
        asyncio.run(backend(srv).publish(adopted_job("team-a/train-0"), 1765000000.7))
        (p,) = srv.seen("PATCH")
        assert p.content_type == "application/merge-patch+json"
        assert p.body == {"metadata": {"annotations": {"laminar.io/last-checkpoint": "laminar-ckpt=1765000000"}}}
        assert srv.pods[0]["metadata"]["annotations"] == {pk.CLASS: "standard",
                                                         "laminar.io/last-checkpoint": "laminar-ckpt=1765000000"}
        with pytest.raises(BackendError, match="not adopted from kubernetes"):
            asyncio.run(backend(srv).publish(SimpleNamespace(id="8", origin=SimpleNamespace()), 1.0))


def test_a_bad_annotation_is_one_event_naming_the_pod_and_the_value(tmp_path: Path) -> None:
    with fake_api_server(tmp_path, "lm-node-1") as srv:
        srv.pods = [pod("team-a", "bad", UID1, "lm-node-1", {pk.CLASS: "standard", pk.PRIORITY: "999"})]
        b = backend(srv, tick_s=0.05)
        walk = kubepods.Walk((), 0)
        for _ in range(3):
            asyncio.run(b.reconcile(walk, asyncio.run(b.list_pods())))
        assert b.seen_events == ["kubernetes: pod team-a/bad not adopted: annotation laminar.io/priority = '999': "  # type: ignore[attr-defined]
                                 "expected an integer 0..100 (default 50)"]


class StandInJobs:
    """A stand-in job manager (what the backend calls: adopt, find_adopted); the real one adopts
    real cgroups in tests/kernel/test_kubernetes_adopt.py. ``refuse``: refs whose adoption fails."""

    def __init__(self, refuse: dict[str, str] | None = None) -> None:
        self.asked: list[Any] = []
        self.live: dict[str, Any] = {}
        self.inventory = None
        self.refuse = refuse or {}

    async def adopt(self, req: Any) -> tuple[Any, dict[str, str]]:
        self.asked.append(req)
        if req.ref in self.refuse:
            raise ValueError(self.refuse[req.ref])
        job = SimpleNamespace(id=f"j{len(self.asked)}", origin=SimpleNamespace(
            scheduler=Scheduler.KUBERNETES, scheduler_ref=req.ref, scheduler_cgroup=req.cgroup))
        self.live[req.ref] = job
        return job, {}

    def find_adopted(self, scheduler: str, ref: str) -> list[Any]:
        return [self.live[ref]] if ref in self.live else []


def test_the_round_adopts_what_opted_in_and_forgets_what_is_gone(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    for uid, qos in ((UID1, "burstable"), (UID2, "guaranteed"), (UID3, "besteffort")):
        lay_out(mount, kubepods.systemd_pod_path("lm-k", uid, qos))
    with fake_api_server(tmp_path, "lm-node-1") as srv:
        srv.pods = [pod("team-a", "train-0", UID1, "lm-node-1", {pk.CLASS: "long-resident", pk.PRIORITY: "70",
                                                                 pk.CHECKPOINT: "USR2"}, run_as=1000),
                    pod("team-a", "refused", UID2, "lm-node-1", {pk.CLASS: "long-resident"}),
                    pod("team-b", "plain", UID3, "lm-node-1")]
        jobs = StandInJobs({"team-a/refused": "class long-resident: not within uid 0's grant"})
        b = backend(srv, cgroup_root="lm-k", tick_s=0.05)
        b.jobs, b.mount = jobs, mount  # type: ignore[assignment]

        def round_() -> None:
            b._next = 0.0
            asyncio.run(b.tick())

        round_()
        round_()
        assert [r.ref for r in jobs.asked] == ["team-a/train-0", "team-a/refused", "team-a/refused"]
        req = jobs.asked[0]
        assert (req.scheduler, req.uid, req.gid, req.job_class, req.priority, req.checkpoint, req.pid) == \
            (Scheduler.KUBERNETES, 1000, 1000, "long-resident", 70, "USR2", None)
        assert req.cgroup == kubepods.systemd_pod_path("lm-k", UID1, "burstable")
        assert set(b.adopted) == {"team-a/train-0"}
        refusals = [m for m in b.seen_events if "not adopted" in m]  # type: ignore[attr-defined]
        assert refusals == ["kubernetes: pod team-a/refused not adopted: class long-resident: not within uid 0's grant"]
        # a walk a bound cut short forgets nothing; the pod gone from the list is forgotten
        b.cfg["max_pods"] = 1
        srv.pods = srv.pods[:1]
        round_()
        assert set(b.adopted) == {"team-a/train-0"}
        b.cfg["max_pods"] = 250
        srv.pods = []
        round_()
        assert b.adopted == {}
        assert b.seen_events[-1] == ("kubernetes: pod gone from the API server (team-a/train-0): job j1 ends when "  # type: ignore[attr-defined]
                                     "its processes are gone")


def test_the_scheduler_component_builds_the_backend_when_enabled() -> None:
    from laminar.agent import import_components
    from laminar.config import Config, validate
    from laminar.sched.component import build_backends

    import_components()
    cfg = Config(validate({"kubernetes": {"enabled": True, "node_name": "lm-node-1"}}))
    agent = SimpleNamespace(config=cfg, jobs=None, events=None, store=None)
    (b,) = build_backends(agent, lambda job: None)  # type: ignore[arg-type]
    assert isinstance(b, KubernetesBackend) and b.scheduler == "kubernetes" and b.node == "lm-node-1"
    assert build_backends(SimpleNamespace(config=Config(validate({})), jobs=None, events=None, store=None),  # type: ignore[arg-type]
                          lambda job: None) == []


def test_the_catchable_signals_are_the_kernels() -> None:
    import signal

    names = {s.name.removeprefix("SIG") for s in signal.Signals if not s.name.startswith("SIGRT")
             and s.name not in ("SIGKILL", "SIGSTOP", "SIGIOT", "SIGPOLL", "SIGCLD")}
    assert pk.CATCHABLE == names
