"""The Kubernetes backend: pods adopted by their cgroups, an owner's reclaim through the API server.

Enabled by ``[kubernetes] enabled = true`` (deploy/kubernetes/laminard.yaml runs the agent as a
DaemonSet with it; docs/kubernetes.md). Every ``[kubernetes] tick_s`` its round
(:meth:`KubernetesBackend.tick`):

1. walks the kubelet's cgroup tree under ``[kubernetes] cgroup_root`` (:mod:`laminar.sched.kubepods`:
   both cgroup drivers, the three QoS classes; bounded: ``max_pods`` pods, never a symlink), off
   the event loop;
2. lists this node's pods with their annotations (``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>``,
   :mod:`laminar.sched.kubeapi`: the service account's token and CA, bounded in bytes and time,
   off the loop);
3. adopts each pod that opted in (``laminar.io/class``; :mod:`laminar.policy.kubernetes`) and whose
   cgroup it found, *in place*: ``JobManager.adopt`` with ``cgroup=`` the pod's cgroup, scheduler
   ``kubernetes``, ref ``<namespace>/<pod>``, the GPUs the device plugin gave its containers
   (``NVIDIA_VISIBLE_DEVICES`` of each container's first process: :func:`kubepods.pod_gpus`). The agent never creates, limits or removes a pod's
   cgroup; Airlock freezes it (and with it every container), the kill-switch cuts its traffic.
   A bad annotation is refused with one event (kind ``sched``) naming the pod and the value;
4. forgets a pod that is gone (from the API server's list, or its cgroup from the tree). Its
   job ends when its cgroup is empty (the job manager watches ``populated``: the kubelet kills
   a deleted pod's containers), ``ended by kubernetes``. The agent does not kill a pod's
   processes on the API server's word: a stale list, or an API server that lost the pod while
   the kubelet still runs it, must not cost a running job; and it never removes the cgroup.

The reclaim's calls (:class:`laminar.sched.backend.Backend`): ``drain`` cordons the node (a
strategic-merge PATCH of ``spec.unschedulable`` with the mark ``laminar.io/cordoned``; a node an
operator had cordoned already is left as it is and never uncordoned by ``undrain``);
``give_back`` evicts the pod through the Eviction API (policy/v1), so PodDisruptionBudgets hold:
a 429 (a budget allows no disruption now) is asked again with a growing wait until the deadline,
then reported (BackendError); ``publish`` sets the pod's annotation
``laminar.io/last-checkpoint`` (a merge PATCH).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

from ..config import Field, register_section
from ..offloop import Lane, LaneBusy
from ..policy import kubernetes as pk
from ..policy import sched_reclaim as sr
from ..policy.sched import Scheduler, check_ref
from . import kubepods
from .backend import BackendError
from .kubeapi import CA_FILE, LIST_BYTES_MAX, TIMEOUT_S, TOKEN_FILE, KubeApi, KubeApiError, check_url

if TYPE_CHECKING:
    from ..runtime.gpus import GpuInventory
    from ..runtime.record import Job

log = logging.getLogger("laminar.sched.kubernetes")

# How long an eviction a PodDisruptionBudget refuses is asked again when the caller gives no
# deadline: within the 12 s the reclaim keeps for the give-back at the window's end
# (laminar.sched.component.GIVE_BACK_RESERVE_S), so the retries end before the window does.
EVICT_RETRY_S = 10.0
# Refusals remembered (one event each): at most this many pods' (bounded by max_pods anyway).
NOTED_MAX = 1024
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


def _abs_or_empty(v: str) -> str | None:
    return None if v == "" or v.startswith("/") else "expected an absolute path"


def _rel_cgroup(v: str) -> str | None:
    if v.startswith("/") or ".." in v.split("/") or "\0" in v:
        return "expected a path relative to the cgroup2 mount, without '..' (\"\" = the mount itself)"
    return None


CONFIG_FIELDS = {
    "enabled": Field(bool, False, "adopt this node's pods that ask for it (annotation laminar.io/class) and carry out "
                     "an owner's reclaim as cordon, checkpoint, eviction (docs/kubernetes.md)"),
    "api_url": Field(str, "", "the API server, https://HOST[:PORT] (\"\": the in-cluster address from "
                     "KUBERNETES_SERVICE_HOST/PORT)", check_url),
    "token_file": Field(str, TOKEN_FILE, "the service account's bearer token (read again for every request)",
                        _abs_or_empty),
    "ca_file": Field(str, CA_FILE, "the CA the API server's certificate is checked against", _abs_or_empty),
    "node_name": Field(str, "", "this node's name in Kubernetes (\"\": $NODE_NAME, which the manifest sets from "
                       "spec.nodeName, else [agent] node)"),
    "cgroup_root": Field(str, "", "where the kubelet's cgroup tree (kubepods.slice or kubepods) starts, relative "
                         "to the cgroup2 mount (\"\": the mount itself)", _rel_cgroup),
    "tick_s": Field((int, float), 5.0, "how often the pods are looked for (the cgroup tree, then the API server)",
                    lambda v: None if 0.05 <= v <= 3600 else "out of range 0.05..3600"),
    "max_pods": Field(int, 250, "at most this many pods are read from the cgroup tree in one round (the kubelet "
                      "runs 110 by default)", lambda v: None if 1 <= v <= 10_000 else "out of range 1..10000"),
    "evict_retry_s": Field((int, float), EVICT_RETRY_S, "how long an eviction a PodDisruptionBudget refuses (429) "
                           "is asked again when the reclaim gives no deadline",
                           lambda v: None if 0 <= v <= 3600 else "out of range 0..3600"),
}
register_section("kubernetes", CONFIG_FIELDS)


class JobsForKubernetes(Protocol):
    """What the backend calls on the job manager (laminar.runtime.adopt, design-34 §1)."""

    async def adopt(self, req: Any) -> tuple[Job, dict[str, str]]: ...

    def find_adopted(self, scheduler: str, ref: str) -> list[Job]: ...

    @property
    def inventory(self) -> GpuInventory | None: ...


class Events(Protocol):
    def emit(self, kind: str, message: str, **fields: Any) -> Any: ...


def split_ref(job: Job) -> tuple[str, str]:
    """(namespace, pod) of an adopted job's ref; BackendError when it is not a Kubernetes one."""
    ref = getattr(job.origin, "scheduler_ref", None)
    sched = getattr(job.origin, "scheduler", None)
    if sched != Scheduler.KUBERNETES or not ref:
        raise BackendError(f"job {job.id} was not adopted from kubernetes (scheduler {sched}, ref {ref})")
    try:
        check_ref(Scheduler.KUBERNETES, ref)
    except ValueError as e:
        raise BackendError(f"job {job.id}: {e}") from None
    ns, name = ref.split("/")
    return ns, name


def pod_ids(pod: dict[str, Any]) -> tuple[int, int]:
    """(uid, gid) the pod's processes run as, from its spec (the pod's securityContext, else its
    first container's; 0 when neither names one: the image's default, root)."""
    spec = pod.get("spec") or {}
    ctxs = [spec.get("securityContext") or {}]
    ctrs = spec.get("containers") or []
    if ctrs and isinstance(ctrs[0], dict):
        ctxs.append(ctrs[0].get("securityContext") or {})
    uid = gid = None
    for c in ctxs:
        if isinstance(c, dict):
            if uid is None and isinstance(c.get("runAsUser"), int):
                uid = c["runAsUser"]
            if gid is None and isinstance(c.get("runAsGroup"), int):
                gid = c["runAsGroup"]
    uid = uid if uid is not None and 0 <= uid < 2**32 - 1 else 0
    return uid, gid if gid is not None and 0 <= gid < 2**32 - 1 else uid


class KubernetesBackend:
    """See the module docstring. ``jobs``/``events``: the agent's job manager and event bus
    (None in a test of the API calls alone); ``mount``: the cgroup2 mount; ``api``: the client
    (default: from the config)."""

    scheduler = Scheduler.KUBERNETES

    def __init__(self, cfg: dict[str, Any], jobs: JobsForKubernetes | None, events: Events | None, mount: Path,
                 api: KubeApi | None = None, node: str = "", newest: Callable[[Job], str | None] | None = None) -> None:
        self.cfg = {**{k: f.default for k, f in CONFIG_FIELDS.items()}, **cfg}
        self.jobs = jobs
        self.events = events
        self.newest = newest
        self.mount = Path(mount)
        self.node = self.cfg["node_name"] or os.environ.get("NODE_NAME", "") or node
        if not self.node:
            raise BackendError("[kubernetes] node_name is empty, NODE_NAME is not set and the agent has no node "
                               "name: give node_name")
        self.api = api or KubeApi(self.cfg["api_url"], self.cfg["token_file"], self.cfg["ca_file"], TIMEOUT_S)
        self.walk_lane = Lane("kube-walk", workers=1, timeout_s=5.0)
        self.adopted: dict[str, tuple[str, str]] = {}  # ref -> (pod uid, job id)
        self.noted: dict[str, str] = {}  # pod uid -> the refusal an event was emitted for
        self.last_walk: kubepods.Walk | None = None
        self.last_error: str | None = None
        self._next = 0.0
        self.counts = {"rounds": 0, "adopted": 0, "gone": 0, "refused": 0, "list_failed": 0,
                       "evictions": 0, "evictions_refused_by_pdb": 0, "cordoned": 0, "uncordoned": 0,
                       "published": 0}

    def status(self) -> dict[str, Any]:
        w = self.last_walk
        return {"node": self.node, "adopted": dict(self.adopted), "counts": dict(self.counts),
                "pods_seen": None if w is None else len(w.pods), "walk_truncated": None if w is None else w.truncated,
                "last_error": self.last_error, "api": self.api.lane.stats()}

    def _emit(self, message: str, **fields: Any) -> None:
        if self.events is not None:
            try:
                self.events.emit("sched", message, scheduler="kubernetes", **fields)
            except Exception:  # an event that cannot be stored must not stop the round
                log.exception("kubernetes: event not emitted")

    # -- the round -------------------------------------------------------------------------------

    async def tick(self) -> None:
        """One round, at most every ``tick_s`` (the component may call it more often)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + float(self.cfg["tick_s"])
        self.counts["rounds"] += 1
        try:
            walk = await self.walk_lane.run("walk", kubepods.discover, self.mount, self.cfg["cgroup_root"],
                                            int(self.cfg["max_pods"]))
        except (TimeoutError, LaneBusy, OSError) as e:
            self.last_error = f"cgroup walk: {e}"
            log.warning("kubernetes: %s", self.last_error)
            return
        if walk.truncated and (self.last_walk is None or self.last_walk.truncated != walk.truncated):
            self._emit(f"kubernetes: the pod cgroup walk stopped at {walk.truncated}: pods past it are not adopted",
                       truncated=walk.truncated)
        self.last_walk = walk
        try:
            pods = await self.list_pods()
        except KubeApiError as e:
            self.counts["list_failed"] += 1
            if self.last_error != str(e):
                self._emit(f"kubernetes: cannot list this node's pods: {e}", error=str(e))
            self.last_error = str(e)
            return  # without the list nothing is adopted or ended this round
        self.last_error = None
        await self.reconcile(walk, pods)

    async def list_pods(self) -> list[dict[str, Any]]:
        """This node's pods (the API server's PodList items). Raises KubeApiError."""
        path = "/api/v1/pods?fieldSelector=" + quote(f"spec.nodeName={self.node}", safe="=")
        ans = await self.api.call("GET", path, max_bytes=LIST_BYTES_MAX, parse=True)
        if ans.status != 200:
            raise KubeApiError(f"GET {path}: {ans.status}: {ans.message()}")
        doc = ans.json()
        items = doc.get("items") if isinstance(doc, dict) else None
        if not isinstance(items, list):
            raise KubeApiError(f"GET {path}: the answer is not a PodList")
        # a node runs at most max_pods pods; more (a server that ignored the field selector) are
        # not looked at, so one round's work stays bounded
        return [p for p in items[: 2 * int(self.cfg["max_pods"])] if isinstance(p, dict)]

    def _refuse(self, uid: str, pod: str, why: str, **fields: Any) -> None:
        """One event per pod and reason (a pod keeps its bad annotation round after round)."""
        if self.noted.get(uid) == why:
            return
        if len(self.noted) >= NOTED_MAX:
            self.noted.pop(next(iter(self.noted)))
        self.noted[uid] = why
        self.counts["refused"] += 1
        self._emit(f"kubernetes: pod {pod} not adopted: {why}", pod=pod, **fields)

    async def reconcile(self, walk: kubepods.Walk, pods: list[dict[str, Any]]) -> None:
        """Adopt what opted in and has a cgroup here; end what is gone. Raises nothing."""
        cgroups = {p.uid: p for p in walk.pods}
        present: dict[str, str] = {}  # ref -> pod uid, of the pods listed
        for pod in pods:
            meta = pod.get("metadata") or {}
            ns, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
            if not (isinstance(ns, str) and isinstance(name, str) and isinstance(uid, str)):
                continue
            ref = f"{ns}/{name}"
            try:
                check_ref(Scheduler.KUBERNETES, ref)
            except ValueError:
                continue
            present[ref] = uid
            if ref in self.adopted or meta.get("deletionTimestamp"):
                continue
            try:
                ask = pk.parse_annotations(ref, meta.get("annotations"))
            except pk.PodNoteError as e:
                self._refuse(uid, ref, str(e).removeprefix(f"pod {ref}: "))
                continue
            if ask is None:
                continue
            cg = cgroups.get(uid)
            if cg is None:  # not started here yet (or past max_pods): next round
                continue
            await self._adopt(ref, uid, pod, ask, cg)
        for ref, (uid, job_id) in list(self.adopted.items()):
            if present.get(ref) == uid and (uid in cgroups or walk.truncated):
                continue  # (a walk a bound cut short says nothing of the pods past it)
            del self.adopted[ref]
            await self._end(ref, job_id, "pod gone from the API server" if present.get(ref) != uid
                            else "pod cgroup gone")

    async def _adopt(self, ref: str, uid: str, pod: dict[str, Any], ask: pk.PodAsk, cg: kubepods.PodCgroup) -> None:
        if self.jobs is None:
            return
        from ..runtime.adopt import AdoptRequest  # the job manager's part (design-34 §1)

        live = self.jobs.find_adopted(Scheduler.KUBERNETES, ref)
        if live:
            if getattr(live[0].origin, "scheduler_cgroup", None) not in (None, cg.path):
                # an earlier pod of the same name (a StatefulSet's) still ends: its job first
                return
            self.adopted[ref] = (uid, live[0].id)  # before an agent restart, or by `laminarctl adopt`
            return
        pod_uid, pod_gid = pod_ids(pod)
        inv = self.jobs.inventory
        uuids = {g.uuid: g.index for g in inv.gpus if g.uuid} if inv is not None else {}
        try:
            gpus = await self.walk_lane.run("walk", kubepods.pod_gpus, self.mount, cg.containers, uuids)
        except (TimeoutError, LaneBusy):
            return  # next round
        req = AdoptRequest(scheduler=Scheduler.KUBERNETES, ref=ref, uid=pod_uid, gid=pod_gid, job_class=ask.job_class,
                           priority=ask.priority, checkpoint=ask.checkpoint, gpus=gpus, pid=None, cgroup=cg.path,
                           name=ref.split("/")[1][:64])
        try:
            job, _env = await self.jobs.adopt(req)
        except Exception as e:  # JobError/AdmissionError: the refusal names the value
            self._refuse(uid, ref, str(e), error=str(e))
            return
        self.adopted[ref] = (uid, job.id)
        self.noted.pop(uid, None)
        self.counts["adopted"] += 1
        self._emit(f"kubernetes: pod {ref} adopted as job {job.id} (class {ask.job_class}, priority {ask.priority}, "
                   f"cgroup {cg.path}, {len(cg.containers)} containers)", job=job.id, pod=ref, qos=cg.qos)

    async def _end(self, ref: str, job_id: str, why: str) -> None:
        """The pod is gone: forgotten here; its job ends when its cgroup is empty (the module
        docstring)."""
        self.counts["gone"] += 1
        self._emit(f"kubernetes: {why} ({ref}): job {job_id} ends when its processes are gone", job=job_id, pod=ref)

    # -- the reclaim's calls -----------------------------------------------------------------------

    def _node_path(self) -> str:
        return f"/api/v1/nodes/{quote(self.node, safe='')}"

    async def _ok(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        try:
            ans = await self.api.call(method, path, body, content_type)
        except KubeApiError as e:
            raise BackendError(str(e)) from None
        if not 200 <= ans.status < 300:
            raise BackendError(f"{method} {path}: {ans.status}: {ans.message()}")
        return ans.json() if ans.body else {}

    async def drain(self, reason: str) -> None:
        """Cordon the node (the module docstring). Raises BackendError."""
        node = await self._ok("GET", self._node_path())
        spec, notes = node.get("spec") or {}, (node.get("metadata") or {}).get("annotations") or {}
        if spec.get("unschedulable") and pk.CORDONED not in notes:
            self._emit(f"kubernetes: node {self.node} was cordoned already (not by Laminar): left as it is",
                       node=self.node)
            return
        await self._ok("PATCH", self._node_path(), pk.cordon_patch(True, reason), STRATEGIC)
        self.counts["cordoned"] += 1
        self._emit(f"kubernetes: node {self.node} cordoned: {reason}", node=self.node)

    async def undrain(self, reason: str) -> None:
        """Uncordon the node if Laminar cordoned it. Raises BackendError."""
        node = await self._ok("GET", self._node_path())
        notes = (node.get("metadata") or {}).get("annotations") or {}
        if pk.CORDONED not in notes:
            return
        await self._ok("PATCH", self._node_path(), pk.cordon_patch(False, reason), STRATEGIC)
        self.counts["uncordoned"] += 1
        self._emit(f"kubernetes: node {self.node} uncordoned: {reason}", node=self.node)

    async def give_back(self, job: Job, ckpt: str | None, deadline_mono: float | None = None) -> str:
        """Evict the job's pod (policy/v1 Eviction). A 429 (a PodDisruptionBudget allows no
        disruption now) is asked again after :func:`laminar.policy.kubernetes.evict_wait` until
        ``deadline_mono`` (default: ``evict_retry_s`` from now), then BackendError; a pod already
        gone (404) is given back. Returns what was done."""
        ns, name = split_ref(job)
        path = f"/api/v1/namespaces/{ns}/pods/{name}/eviction"
        end = deadline_mono if deadline_mono is not None else time.monotonic() + float(self.cfg["evict_retry_s"])
        refusals = 0
        while True:
            try:
                ans = await self.api.call("POST", path, pk.eviction_body(ns, name))
            except KubeApiError as e:
                raise BackendError(str(e)) from None
            if ans.status in (200, 201):
                self.counts["evictions"] += 1
                return f"pod {ns}/{name} evicted" + (f" after {refusals} refusals by a PodDisruptionBudget"
                                                     if refusals else "") + (f" (checkpoint {ckpt})" if ckpt else "")
            if ans.status == 404:
                return f"pod {ns}/{name} already gone"
            if ans.status != 429:
                raise BackendError(f"POST {path}: {ans.status}: {ans.message()}")
            refusals += 1
            self.counts["evictions_refused_by_pdb"] += 1
            wait = pk.evict_wait(refusals)
            if time.monotonic() + wait > end:
                raise BackendError(f"eviction of pod {ns}/{name} refused {refusals} times until the deadline: a "
                                   f"PodDisruptionBudget allows no disruption ({ans.message()})")
            await asyncio.sleep(wait)

    async def publish(self, job: Job, ckpt_time: float) -> None:
        """Set the pod's ``laminar.io/last-checkpoint`` to ``laminar-ckpt=<unix time> <path>``
        (:func:`laminar.policy.sched_reclaim.publish_text`, the same text as a Slurm job's
        comment; the path when ``newest`` knows it). Raises BackendError."""
        ns, name = split_ref(job)
        value = sr.publish_text(ckpt_time, self.newest(job) if self.newest is not None else None)
        await self._ok("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}", pk.annotation_patch(pk.LAST_CHECKPOINT, value),
                       MERGE)
        self.counts["published"] += 1


def build(agent: Any, newest: Callable[[Job], str | None] | None = None) -> KubernetesBackend:
    """The backend as the agent's ``[kubernetes]`` configures it (the scheduler component calls
    this when ``[kubernetes] enabled``; ``agent``: its config, job manager and events;
    ``newest``: a job's newest checkpoint path, named in the published annotation; ``[agent]
    node`` the last fallback of the node's name). Raises BackendError."""
    from ..airlock.cgroups import CgroupError, detect

    try:
        mount = detect().unified
    except CgroupError as e:
        raise BackendError(f"kubernetes: {e}") from None
    return KubernetesBackend(agent.config.section("kubernetes"), agent.jobs, agent.events, mount,
                             node=agent.config.agent.node, newest=newest)


if TYPE_CHECKING:
    from ..events import EventBus
    from ..runtime.jobs import JobManager

    def _conforms(jobs: JobManager, events: EventBus) -> tuple[JobsForKubernetes, Events]:
        """mypy checks that the job manager and the event bus are what the backend calls."""
        return jobs, events
