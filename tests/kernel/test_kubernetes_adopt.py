"""Pods adopted in place from a FAKE KUBELET TREE, the reclaim's requests to a FAKE API SERVER.

No kubelet and no API server run on these machines. What is real here:

- the FAKE KUBELET TREE: real cgroup2 directories the test makes under its own root
  (``lm-kube-t-<hex>`` below the cgroup2 mount), laid out exactly as the kubelet's systemd cgroup
  driver lays out its pods (``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/
  cri-containerd-<id>.scope``; a Guaranteed pod directly under ``kubepods.slice``), with real
  processes (``sleep``) in the container cgroups, as containerd puts them there;
- the real JobManager (its adoption, laminar.runtime.adopt), the real Airlock freezing a job,
  and the real Kubernetes backend (laminar.sched.kubernetes): its walk, its HTTPS client;
- the FAKE API SERVER (tests/fakekubeapi.py): an http.server over real TLS on 127.0.0.1 that
  serves the pod list and records the PATCH and POST requests; one pod's eviction answers 429
  twice (a PodDisruptionBudget holds) and then 201.

What it shows: pods with ``laminar.io/class`` are adopted in place (scheduler kubernetes, ref
ns/pod, class and priority from the annotations, the job's cgroup the pod's own), a pod without
it is not; Airlock's freeze of the pod's cgroup freezes its containers; the eviction and cordon
requests carry the right bodies; a pod gone from the list ends its job once its containers are
gone (not before: the agent kills nothing on the API server's word); and the agent never removes a
pod's cgroup (the kubelet's to remove).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakekubeapi import fake_api_server, pod
from jobrig import airlock_rig, until

from laminar.airlock.cgroups import detect
from laminar.policy import kubernetes as pk
from laminar.policy import ladder
from laminar.policy.sched import Scheduler
from laminar.sched import kubepods
from laminar.sched.kubernetes import KubernetesBackend

pytestmark = pytest.mark.kernel

NODE = "lm-kube-node-1"
TRAIN_UID = "0b6f2a94-3c1d-4e8e-9b7a-1f2e3d4c5b6a"  # burstable, annotated
GUARD_UID = "11111111-2222-4333-8444-555555555555"  # guaranteed, annotated, a PDB holds it
PLAIN_UID = "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"  # besteffort, no annotation


class FakeKubeletTree:
    """A FAKE KUBELET TREE: real cgroups under ``<mount>/<root>``, laid out as the kubelet's
    systemd driver lays out pods, with real processes in the container cgroups. ``remove()``
    kills them and removes every directory it made (the kubelet's job, never the agent's)."""

    def __init__(self, mount: Path, root: str) -> None:
        self.mount = mount
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        (mount / root).mkdir()

    def add_pod(self, uid: str, qos: str, containers: int = 2) -> tuple[Path, list[Path]]:
        pod_dir = self.mount / kubepods.systemd_pod_path(self.root, uid, qos)
        pod_dir.mkdir(parents=True)
        ctrs = []
        for _ in range(containers):
            ctr = pod_dir / f"cri-containerd-{secrets.token_hex(32)}.scope"
            ctr.mkdir()
            # the process enters its container cgroup before it execs, as runc puts it there
            p = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > "{ctr}/cgroup.procs" && exec sleep 600'],
                                 start_new_session=True)
            self.procs.append(p)
            ctrs.append(ctr)
        return pod_dir, ctrs

    def remove(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(Exception):
                p.wait(5)
        top = self.mount / self.root
        if not top.exists():
            return
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                (d / "cgroup.kill").write_text("1")
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


@contextlib.contextmanager
def fake_kubelet_tree() -> Iterator[FakeKubeletTree]:
    tree = FakeKubeletTree(detect().unified, f"lm-kube-t-{secrets.token_hex(3)}")
    try:
        yield tree
    finally:
        tree.remove()


def pids_in(d: Path) -> list[int]:
    return [int(x) for x in (d / "cgroup.procs").read_text().split()]


def task_state(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return "?"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups under the cgroup2 mount")
def test_pods_adopted_in_place_frozen_evicted_and_their_cgroups_left(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pk, "EVICT_BACKOFF_S", (0.1, 0.2))

    async def main() -> None:
        with fake_kubelet_tree() as tree, fake_api_server(tmp_path, NODE) as srv:
            train_dir, train_ctrs = tree.add_pod(TRAIN_UID, "burstable")
            guard_dir, guard_ctrs = tree.add_pod(GUARD_UID, "guaranteed")
            plain_dir, plain_ctrs = tree.add_pod(PLAIN_UID, "besteffort")
            srv.pods = [
                pod("team-a", "train-0", TRAIN_UID, NODE, {pk.CLASS: "long-resident", pk.PRIORITY: "70",
                                                           pk.CHECKPOINT: "USR2"}),
                pod("team-a", "guarded", GUARD_UID, NODE, {pk.CLASS: "standard"}),
                pod("team-b", "plain", PLAIN_UID, NODE),
                pod("team-c", "elsewhere", PLAIN_UID.replace("a", "b"), "lm-kube-node-2", {pk.CLASS: "standard"}),
            ]
            srv.evictions["team-a/guarded"] = [429, 429, 201]
            for ctr in train_ctrs:
                assert await until(lambda c=ctr: len(pids_in(c)) == 1, 5)
            async with airlock_rig(tmp_path) as (jobs, al, _store):
                # [adopt]: the fake kubelet tree's root is where pods are taken in place
                jobs.adoption.configure({"inplace_roots": [f"{tree.root}/kubepods.slice"],
                                         "ckpt_root": str(tmp_path / "adopted")}, None)
                b = KubernetesBackend({"api_url": srv.url, "token_file": str(srv.token_file),
                                       "ca_file": str(srv.ca_file), "node_name": NODE, "cgroup_root": tree.root,
                                       "tick_s": 0.05}, jobs, jobs.events, tree.mount)
                await b.tick()
                assert set(b.adopted) == {"team-a/train-0", "team-a/guarded"}, (b.status(), srv.requests)
                (train,) = jobs.find_adopted(Scheduler.KUBERNETES, "team-a/train-0")
                assert train.origin.scheduler == "kubernetes" and train.origin.scheduler_ref == "team-a/train-0"
                assert train.spec.job_class == "long-resident" and train.spec.priority == 70
                assert train.spec.checkpoint_signal == "SIGUSR2"  # laminar.io/checkpoint: USR2
                rec = train.as_dict()  # what GET /v1/jobs and `laminarctl jobs` show
                assert (rec["scheduler"], rec["scheduler_ref"], rec["class"], rec["priority"], rec["cgroup"]) == \
                    ("kubernetes", "team-a/train-0", "long-resident", 70, str(train_dir))
                assert sorted(rec["pids"]) == sorted(p for c in train_ctrs for p in pids_in(c))
                # in place: the job's cgroup is the pod's own, its containers' processes are the job's
                assert train.cgroup.unified == train_dir
                assert jobs.find_adopted(Scheduler.KUBERNETES, "team-b/plain") == []
                assert not any(j.cgroup.unified == plain_dir for j in jobs.active())
                (guarded,) = jobs.find_adopted(Scheduler.KUBERNETES, "team-a/guarded")
                assert guarded.cgroup.unified == guard_dir and guarded.spec.job_class == "standard"
                # Airlock's freeze of the pod's cgroup freezes every container in it, its recovery
                # thaws them
                t0 = time.monotonic()
                al._apply(ladder.Action(ladder.SUSPEND, guarded.id, "test: high"), t0, ladder.HIGH, al.signals(t0))
                assert await until(guarded.cgroup.frozen, 10)
                for ctr in guard_ctrs:
                    assert "frozen 1" in (ctr / "cgroup.events").read_text()
                    assert all(task_state(p) in ("S", "D", "T") for p in pids_in(ctr))
                al._apply(ladder.Action(ladder.RECOVER, guarded.id, "test: calm"), t0, ladder.NONE, al.signals(t0))
                assert await until(lambda: not guarded.cgroup.frozen(), 10)
                for ctr in guard_ctrs:
                    assert "frozen 0" in (ctr / "cgroup.events").read_text()
                # the reclaim: cordon, then the evictions (one held twice by a PodDisruptionBudget)
                await b.drain("laminar: reclaimed by its owner, notice 60s")
                (cordon,) = srv.seen("PATCH", f"/api/v1/nodes/{NODE}")
                assert cordon.content_type == "application/strategic-merge-patch+json"
                assert cordon.body == {"spec": {"unschedulable": True}, "metadata": {"annotations": {
                    pk.CORDONED: "laminar: reclaimed by its owner, notice 60s"}}}
                said = await b.give_back(train, None)
                assert said == "pod team-a/train-0 evicted"
                said = await b.give_back(guarded, None, deadline_mono=time.monotonic() + 10)
                assert "after 2 refusals by a PodDisruptionBudget" in said
                evictions = srv.seen("POST", "/eviction")
                assert [e.path for e in evictions] == ["/api/v1/namespaces/team-a/pods/train-0/eviction"] + \
                    ["/api/v1/namespaces/team-a/pods/guarded/eviction"] * 3
                assert evictions[0].body == {"apiVersion": "policy/v1", "kind": "Eviction",
                                             "metadata": {"name": "train-0", "namespace": "team-a"}}
                # the eviction went through: the pod is gone from the API server and the kubelet
                # kills its containers; it has not removed the pod's cgroup yet. The job ends
                # when its cgroup is empty; the agent removes no cgroup of the pod
                srv.pods = [p for p in srv.pods if p["metadata"]["name"] != "train-0"]
                await asyncio.sleep(0.06)
                await b.tick()
                assert "team-a/train-0" not in b.adopted and "team-a/guarded" in b.adopted
                assert train.live  # not ended on the API server's word while its processes run
                for ctr in train_ctrs:
                    (ctr / "cgroup.kill").write_text("1")  # what the kubelet does (through the runtime)
                assert await until(lambda: not train.live, 10), train.state
                assert train.state == "exited" and train.reason == "ended by kubernetes"
                assert train_dir.is_dir() and all(c.is_dir() for c in train_ctrs)
            # the job manager stopped: no pod cgroup was removed, the other pods' processes run on
            assert train_dir.is_dir() and guard_dir.is_dir() and plain_dir.is_dir()
            assert all(len(pids_in(c)) == 1 for c in guard_ctrs + plain_ctrs)

    asyncio.run(main())
