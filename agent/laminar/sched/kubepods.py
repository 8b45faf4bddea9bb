"""The kubelet's pod cgroups on this node, found by their names (no kubelet is asked).

The kubelet lays each pod out under the cgroup2 mount by its QoS class, with one child cgroup per
container (the sandbox's "pause" container too). With the **systemd** cgroup driver (the default of
kubeadm and most distributions)::

    kubepods.slice/kubepods-pod<uid_>.slice/cri-containerd-<id>.scope                     Guaranteed
    kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/<ctr>.scope  Burstable
    kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice/<ctr>.scope BestEffort

where ``<uid_>`` is the pod's UID with ``_`` for ``-`` (systemd's unit names) and a container's
scope is ``cri-containerd-<id>.scope``, ``crio-<id>.scope`` or ``docker-<id>.scope``. With the
**cgroupfs** driver::

    kubepods/pod<uid>/<id>                 Guaranteed
    kubepods/burstable/pod<uid>/<id>       Burstable
    kubepods/besteffort/pod<uid>/<id>      BestEffort

:func:`parse_pod_dir` reads one directory name (pure); :func:`discover` walks the tree, bounded:
at most ``max_pods`` pods and ``max_entries`` directory entries in all, never following a
symlink (cgroupfs has none, a test tree might), and nothing but names is read. It blocks (a few
hundred ``readdir`` calls on a full node): the agent runs it off the event loop.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

QOS_CLASSES = ("guaranteed", "burstable", "besteffort")
# A pod's UID as the API server gives it (metadata.uid): a UUID, lower-case hex.
_UID = "{0}{{8}}-{0}{{4}}-{0}{{4}}-{0}{{4}}-{0}{{12}}".format("[0-9a-f]")
_UID_ = _UID.replace("}-", "}_")  # systemd's unit name: "_" for "-"
_SYSTEMD_POD = re.compile(rf"kubepods-(?:(burstable|besteffort)-)?pod({_UID_})\.slice")
_CGROUPFS_POD = re.compile(rf"pod({_UID})")
# Container cgroups: systemd scopes of the runtimes the kubelet drives, or the bare id (cgroupfs).
# cri-o's conmon scope (crio-conmon-<id>.scope) is the runtime's monitor, not a container.
_SYSTEMD_CTR = re.compile(r"(?:cri-containerd|crio|docker)-([0-9a-f]{12,64})\.scope")
_CGROUPFS_CTR = re.compile(r"([0-9a-f]{12,64})")

# Bounds of one walk. A node runs at most 110 pods by the kubelet's default (--max-pods); the
# config's max_pods caps what one walk keeps. Entries: every directory the walk lists, summed.
MAX_ENTRIES = 20_000


@dataclass(frozen=True)
class PodCgroup:
    """One pod's cgroup: its UID, QoS class, path relative to the cgroup2 mount, driver and the
    container cgroups below it (paths relative to the mount too)."""

    uid: str
    qos: str
    path: str
    driver: str
    containers: tuple[str, ...]


@dataclass(frozen=True)
class Walk:
    """What one walk found: the pods, and whether a bound cut it short (``truncated`` names it)."""

    pods: tuple[PodCgroup, ...]
    entries: int
    truncated: str | None = None


def parse_pod_dir(name: str, parent_qos: str | None, driver: str) -> tuple[str, str] | None:
    """(uid, qos) when ``name`` is a pod's cgroup directory under a QoS parent (``parent_qos``:
    ``guaranteed`` for the kubepods directory itself, else the QoS the parent stands for), else
    None. A systemd pod slice must name the QoS of the slice it is in."""
    if driver == "systemd":
        m = _SYSTEMD_POD.fullmatch(name)
        if not m:
            return None
        qos = m.group(1) or "guaranteed"
        if qos != parent_qos:
            return None
        return m.group(2).replace("_", "-"), qos
    m = _CGROUPFS_POD.fullmatch(name)
    return (m.group(1), parent_qos) if m and parent_qos else None


def container_id(name: str, driver: str) -> str | None:
    """The container id a container cgroup's name carries, else None."""
    m = (_SYSTEMD_CTR if driver == "systemd" else _CGROUPFS_CTR).fullmatch(name)
    return m.group(1) if m else None


def qos_dirs(driver: str) -> dict[str, str]:
    """QoS class -> the directory (relative to the kubepods directory) its pods are in."""
    if driver == "systemd":
        return {"guaranteed": "", "burstable": "kubepods-burstable.slice", "besteffort": "kubepods-besteffort.slice"}
    return {"guaranteed": "", "burstable": "burstable", "besteffort": "besteffort"}


def _subdirs(d: Path, budget: list[int]) -> list[str] | None:
    """Names of the real (not symlinked) directories in ``d``, charging every entry listed to
    ``budget[0]``; None when the budget ran out first. A directory that cannot be read (gone
    meanwhile) has none."""
    out: list[str] = []
    try:
        with os.scandir(d) as it:
            for e in it:
                budget[0] -= 1
                if budget[0] < 0:
                    return None
                try:
                    if e.is_dir(follow_symlinks=False):
                        out.append(e.name)
                except OSError:
                    continue
    except OSError:
        return out
    return sorted(out)


def discover(mount: Path, root: str = "", max_pods: int = 250, max_entries: int = MAX_ENTRIES) -> Walk:
    """The pods under ``mount``/``root`` in either driver's layout (both are looked for: a node
    has one). Bounded as the module docstring says; a bound reached ends the walk with what was
    found so far and says which (``truncated``). Never follows a symlink: the kubepods directory
    itself, a QoS parent or a pod directory that is a symlink is skipped."""
    base = mount / root if root else mount
    budget = [max_entries]
    pods: list[PodCgroup] = []
    for driver, top in (("systemd", "kubepods.slice"), ("cgroupfs", "kubepods")):
        kube = base / top
        if kube.is_symlink() or not kube.is_dir():
            continue
        for qos, sub in qos_dirs(driver).items():
            parent = kube / sub if sub else kube
            if sub and (parent.is_symlink() or not parent.is_dir()):
                continue
            names = _subdirs(parent, budget)
            if names is None:
                return Walk(tuple(pods), max_entries, f"more than {max_entries} cgroup entries")
            for name in names:
                hit = parse_pod_dir(name, qos, driver)
                if hit is None:
                    continue
                if len(pods) >= max_pods:
                    return Walk(tuple(pods), max_entries - budget[0], f"more than {max_pods} pods")
                pod_dir = parent / name
                kids = _subdirs(pod_dir, budget)
                if kids is None:
                    return Walk(tuple(pods), max_entries, f"more than {max_entries} cgroup entries")
                ctrs = tuple(str((pod_dir / k).relative_to(mount)) for k in kids if container_id(k, driver))
                pods.append(PodCgroup(hit[0], hit[1], str(pod_dir.relative_to(mount)), driver, ctrs))
    return Walk(tuple(pods), max_entries - budget[0])


def systemd_pod_path(root: str, uid: str, qos: str) -> str:
    """Where the systemd driver puts pod ``uid`` of ``qos`` (relative to the mount): what the
    kubelet would create, for tests and the docs."""
    slice_ = f"kubepods-pod{uid.replace('-', '_')}.slice" if qos == "guaranteed" else \
        f"kubepods-{qos}-pod{uid.replace('-', '_')}.slice"
    parts = [p for p in (root, "kubepods.slice", qos_dirs("systemd")[qos], slice_) if p]
    return "/".join(parts)


def cgroupfs_pod_path(root: str, uid: str, qos: str) -> str:
    """Where the cgroupfs driver puts pod ``uid`` of ``qos`` (relative to the mount)."""
    parts = [p for p in (root, "kubepods", qos_dirs("cgroupfs")[qos], f"pod{uid}") if p]
    return "/".join(parts)


# A pod's GPUs: the device plugin (NVIDIA's) tells the container runtime which GPUs a container
# gets through NVIDIA_VISIBLE_DEVICES in the container's environment (UUIDs by default, indices
# with deviceIDStrategy=index). The first process of each container cgroup shows it.
GPU_ENV = "NVIDIA_VISIBLE_DEVICES"
ENVIRON_MAX = 256 * 1024  # a process's environment read, at most (the kernel allows more; 128 KiB is usual)
CONTAINERS_MAX = 16  # containers of one pod looked at


def gpus_of(value: str, uuids: dict[str, int]) -> set[int] | None:
    """The GPU indices ``NVIDIA_VISIBLE_DEVICES`` names (indices, or UUIDs mapped through
    ``uuids``: the inventory's ``uuid -> index``); None when it names no definite set (``all``:
    an image's default, not an assignment; an unknown UUID)."""
    v = value.strip()
    if v in ("", "none", "void"):
        return set()
    if v == "all":
        return None
    out: set[int] = set()
    for item in v.split(","):
        item = item.strip()
        if item.isdigit() and len(item) <= 4:
            out.add(int(item))
        elif item in uuids:
            out.add(uuids[item])
        else:
            return None
    return out


def _env_value(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(ENVIRON_MAX)
    except OSError:
        return None
    key = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode("ascii", "replace")
    return None


def pod_gpus(mount: Path, containers: tuple[str, ...], uuids: dict[str, int]) -> tuple[int, ...]:
    """The GPUs the device plugin gave the pod's containers (the union; their first process's
    ``NVIDIA_VISIBLE_DEVICES``), bounded (``CONTAINERS_MAX`` containers, one process each,
    ``ENVIRON_MAX`` bytes). Empty when none says a definite set. Blocks: run off the loop."""
    out: set[int] = set()
    for rel in containers[:CONTAINERS_MAX]:
        try:
            with open(mount / rel / "cgroup.procs") as f:
                first = f.readline().strip()
        except OSError:
            continue
        if not first.isdigit():
            continue
        value = _env_value(int(first), GPU_ENV)
        got = gpus_of(value, uuids) if value is not None else set()
        if got:
            out |= got
    return tuple(sorted(out))
