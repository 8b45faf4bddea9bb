"""Job cgroups on a hybrid (cgroup v1 + v2) or a pure cgroup2 host.

Every job gets:

- a **cgroup2 directory** (always): `cgroup.freeze` to suspend it, `cgroup.kill` to reclaim
  it, `memory.pressure` for its PSI triggers, `cgroup.events` to see whether it still holds
  processes, and its **cgroup id** (the directory's inode number), which is what
  `bpf_skb_cgroup_id()` returns for its packets and what netguard keys `lm_jobs` by;
- its **memory limit** in whichever hierarchy has the memory controller: v1
  `memory.limit_in_bytes` (plus `memory.oom_control` = 1 so the kernel holds the allocator
  instead of killing) on a hybrid host, v2 `memory.max`/`memory.high` on a pure-v2 host;
- a CPU quota where a cpu controller is available (v1 `cpu.cfs_quota_us` or v2 `cpu.max`);
- a **task limit**, `pids.max`, wherever the pids controller lives: the v1 pids hierarchy on a
  hybrid host (which systemd mounts there), cgroup2 on a pure-v2 host; and one over all jobs on
  the root name's directory (laminar.runtime.joblimits says how many).

Layout, under a configurable root name (default ``laminar``), with one parent per lifecycle
class so that the parents' limits keep the protected class's memory out of the others' reach::

    /sys/fs/cgroup/unified/laminar/<class>/<job_id>     cgroup2 (hybrid host)
    /sys/fs/cgroup/memory/laminar/<class>/<job_id>      v1 memory (hybrid host)
    /sys/fs/cgroup/pids/laminar/<class>/<job_id>        v1 pids (hybrid host)
    /sys/fs/cgroup/laminar/<class>/<job_id>             pure v2: both in one directory

Example::

    h = detect()                       # Hierarchy(mode="hybrid", ...)
    tree = CgroupTree(h, "laminar")
    tree.ensure()                      # root and per-class parents
    cg = tree.job("transient", "job-7")
    cg.create(); cg.set_memory_limit(512 << 20, oom_kill_disable=True)
    cg.attach(pid); cg.freeze(); cg.thaw(); cg.kill(); cg.remove()

This module is mechanism only (files in cgroupfs); the decisions live in `airlock.ladder`.
Nothing here touches a cgroup outside the root name's directories.
"""

from __future__ import annotations

import errno
import os
import select
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CGROUP_MOUNT = Path("/sys/fs/cgroup")
LIFECYCLE_CLASSES = ("long-resident", "standard", "transient")

# How long freeze()/thaw() wait for cgroup.events to report the new state. Freezing a
# cgroup of running tasks takes about 3 ms here; a task in uninterruptible sleep (e.g. held by
# the v1 OOM wait) only freezes once it wakes, so callers treat a timeout as "pending".
FREEZE_WAIT_S = 1.0
# v1 CFS period used to express a CPU count as a quota (the kernel's default period).
CFS_PERIOD_US = 100_000


class CgroupError(RuntimeError):
    """A cgroup operation failed; the message names the path and the cause."""


@dataclass(frozen=True)
class Hierarchy:
    """Which cgroup hierarchies this host has and where they are mounted.

    `mode` is ``"hybrid"`` (cgroup2 without the memory controller, v1 memory) or ``"v2"``
    (memory in cgroup2). `unified` is the cgroup2 mount; `v1` maps each v1 controller that
    Laminar uses (``memory``, ``cpu``, ``pids``) to its mount point (empty on a pure-v2 host).
    `v2_controllers` are the controllers available at the cgroup2 root.
    """

    mode: str
    unified: Path
    v1: dict[str, Path] = field(default_factory=dict)
    v2_controllers: frozenset[str] = frozenset()

    @property
    def memory_in_v2(self) -> bool:
        return self.mode == "v2"

    @property
    def pids_in_v2(self) -> bool:
        """The pids controller is cgroup2's (a pure-v2 host; or a hybrid one that left it there)."""
        return "pids" in self.v2_controllers and "pids" not in self.v1

    @property
    def pids_mount(self) -> Path | None:
        """Where the pids controller is mounted; None when this host has none."""
        return self.unified if self.pids_in_v2 else self.v1.get("pids")

    def describe(self) -> str:
        """One line for `laminarctl status` and the agent's start-up log."""
        if self.mode == "v2":
            return f"cgroup v2 at {self.unified} (controllers: {' '.join(sorted(self.v2_controllers)) or 'none'})"
        v1 = ", ".join(f"{k} at {v}" for k, v in sorted(self.v1.items()))
        return f"hybrid: cgroup2 at {self.unified} (no memory controller), v1 {v1}"

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "unified": str(self.unified),
            "v1": {k: str(v) for k, v in self.v1.items()},
            "v2_controllers": sorted(self.v2_controllers),
            "description": self.describe(),
        }


def _parse_mounts(text: str) -> tuple[list[Path], dict[str, Path]]:
    """cgroup2 mount points and {v1 controller: mount point} from /proc/self/mounts text."""
    v2: list[Path] = []
    v1: dict[str, Path] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        mnt, fstype, opts = parts[1], parts[2], parts[3].split(",")
        if fstype == "cgroup2":
            v2.append(Path(mnt))
        elif fstype == "cgroup":
            for ctrl in ("memory", "cpu", "freezer", "pids"):
                if ctrl in opts and ctrl not in v1:
                    v1[ctrl] = Path(mnt)
    return v2, v1


def detect(mounts: str | None = None) -> Hierarchy:
    """Detect the cgroup layout of this host.

    Returns a `Hierarchy`; raises `CgroupError` when there is no cgroup2 mount (freeze, kill
    and the socket cgroup id need one) or no memory controller in either hierarchy.
    `mounts` is /proc/self/mounts text (read when None), for tests.
    """
    if mounts is None:
        mounts = Path("/proc/self/mounts").read_text()
    v2_mounts, v1 = _parse_mounts(mounts)
    if not v2_mounts:
        raise CgroupError("no cgroup2 mount found in /proc/self/mounts; Laminar needs cgroup2 "
                          "(mount -t cgroup2 none /sys/fs/cgroup/unified)")
    # Prefer /sys/fs/cgroup itself (pure v2), then /sys/fs/cgroup/unified (hybrid).
    v2_mounts.sort(key=lambda p: (p != CGROUP_MOUNT, p != CGROUP_MOUNT / "unified", str(p)))
    unified = v2_mounts[0]
    try:
        controllers = frozenset((unified / "cgroup.controllers").read_text().split())
    except OSError as e:
        raise CgroupError(f"cannot read {unified}/cgroup.controllers: {e.strerror}") from e
    if "memory" in controllers:
        return Hierarchy("v2", unified, {}, controllers)
    if "memory" not in v1:
        raise CgroupError(f"no memory controller: not in {unified}/cgroup.controllers "
                          f"({' '.join(sorted(controllers)) or 'empty'}) and no v1 memory mount")
    return Hierarchy("hybrid", unified, {k: v for k, v in v1.items() if k in ("memory", "cpu", "pids")}, controllers)


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        raise CgroupError(f"write {value!r} to {path}: {e.strerror or e}") from e


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise CgroupError(f"read {path}: {e.strerror or e}") from e


def parse_keyed(text: str) -> dict[str, str]:
    """Parse 'key value' lines (cgroup.events, memory.events, memory.oom_control)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k:
            out[k] = v.strip()
    return out


def _check_name(kind: str, name: str) -> None:
    if not name or "/" in name or name in (".", "..") or name.startswith("."):
        raise CgroupError(f"bad cgroup {kind} name {name!r}: must be a plain directory name")


def _rmdir_tree(top: Path) -> None:
    """rmdir `top` and every directory below it, children first. Missing dirs are fine.

    Raises CgroupError when a directory still holds processes (EBUSY).
    """
    if not top.exists():
        return
    for dirpath, _dirs, _files in os.walk(top, topdown=False):
        try:
            os.rmdir(dirpath)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CgroupError(f"rmdir {dirpath}: {e.strerror}") from e


def _rmdir_retry(d: Path, tries: int = 50) -> None:
    """_rmdir_tree, retried briefly: a v1 memcg or a just-killed cgroup2 directory can stay
    busy for a few ms after its last task exits."""
    for _ in range(tries - 1):
        try:
            _rmdir_tree(d)
            return
        except CgroupError:
            time.sleep(0.02)
    _rmdir_tree(d)


class JobCgroup:
    """The cgroups of one job: a cgroup2 directory plus v1 directories on a hybrid host.

    Paths are computed from (hierarchy, root name, class, job id), so a restarted agent
    rebuilds the same object from the store and reattaches the job.
    """

    def __init__(self, hierarchy: Hierarchy, root_name: str, job_class: str, job_id: str) -> None:
        _check_name("root", root_name)
        _check_name("class", job_class)
        _check_name("job", job_id)
        self.hierarchy = hierarchy
        self.root_name = root_name
        self.job_class = job_class
        self.job_id = job_id
        rel = Path(root_name) / job_class / job_id
        self.unified = hierarchy.unified / rel
        self.v1 = {ctrl: mnt / rel for ctrl, mnt in hierarchy.v1.items()}

    def __repr__(self) -> str:
        return f"JobCgroup({self.unified})"

    # -- paths -------------------------------------------------------------------------
    @property
    def memory_dir(self) -> Path:
        """The directory holding this job's memory controller files."""
        return self.unified if self.hierarchy.memory_in_v2 else self.v1["memory"]

    @property
    def memory_pressure_path(self) -> Path:
        """cgroup2 `memory.pressure` (PSI) of this job; present on hybrid hosts too."""
        return self.unified / "memory.pressure"

    @property
    def events_path(self) -> Path:
        """cgroup2 `cgroup.events` (populated, frozen)."""
        return self.unified / "cgroup.events"

    def all_dirs(self) -> list[Path]:
        return [self.unified, *self.v1.values()]

    def procs_files(self) -> list[Path]:
        """Every cgroup.procs a process of this job must be written into, cgroup2 first."""
        return [d / "cgroup.procs" for d in self.all_dirs()]

    # -- life --------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.unified.is_dir()

    def create(self) -> None:
        """Create the job's directories (parents must exist: `CgroupTree.ensure`).

        An existing directory is reused (reattachment). Raises CgroupError on failure.
        """
        for d in self.all_dirs():
            if not d.parent.is_dir():
                raise CgroupError(f"parent {d.parent} missing; call CgroupTree.ensure() first")
            try:
                d.mkdir(exist_ok=True)
            except OSError as e:
                raise CgroupError(f"mkdir {d}: {e.strerror}") from e

    @property
    def cgroup_id(self) -> int:
        """The cgroup2 id: the directory's inode number, = bpf_skb_cgroup_id() of its sockets."""
        try:
            return os.stat(self.unified).st_ino
        except OSError as e:
            raise CgroupError(f"stat {self.unified}: {e.strerror}") from e

    def attach(self, pid: int) -> None:
        """Move process `pid` (all its threads) into every hierarchy of this job."""
        for f in self.procs_files():
            _write(f, str(pid))

    def pids(self) -> list[int]:
        """Processes in the job's cgroup2 directory and its sub-directories (sorted)."""
        out: set[int] = set()
        if not self.unified.exists():
            return []
        for dirpath, _dirs, _files in os.walk(self.unified):
            try:
                text = (Path(dirpath) / "cgroup.procs").read_text()
            except OSError:
                continue
            out.update(int(x) for x in text.split())
        return sorted(out)

    def events(self) -> dict[str, str]:
        return parse_keyed(_read(self.events_path))

    def populated(self) -> bool:
        """True while any process lives in the job's cgroup2 subtree; False if it is gone."""
        try:
            return self.events().get("populated") == "1"
        except CgroupError:
            return False

    # -- freeze / thaw / kill --------------------------------------------------------------
    def frozen(self) -> bool:
        """The kernel's flag: every task of the job is frozen now (cgroup.events)."""
        return self.events().get("frozen") == "1"

    def freeze_requested(self) -> bool:
        """A freeze was asked for (cgroup.freeze 1), whether or not it has taken hold: a task
        waiting at a held memory limit (or in uninterruptible sleep) freezes only once its wait
        ends, and then stays frozen until thawed."""
        return _read(self.unified / "cgroup.freeze").strip() == "1"

    def _set_frozen(self, want: bool, timeout: float | None) -> bool:
        _write(self.unified / "cgroup.freeze", "1" if want else "0")
        if timeout is None:
            return True
        target = "1" if want else "0"
        deadline = time.monotonic() + timeout
        # cgroup.events raises POLLPRI on change; poll it instead of spinning.
        fd = os.open(self.events_path, os.O_RDONLY)
        try:
            p = select.poll()
            p.register(fd, select.POLLPRI | select.POLLERR)
            while True:
                os.lseek(fd, 0, os.SEEK_SET)
                state = parse_keyed(os.read(fd, 4096).decode()).get("frozen")
                if state == target:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                p.poll(min(left, 0.05) * 1000)
        finally:
            os.close(fd)

    async def freeze_async(self, timeout: float = FREEZE_WAIT_S) -> bool:
        """:meth:`freeze` for the event loop: see :func:`set_frozen_async`."""
        return await set_frozen_async(self, True, timeout)

    async def thaw_async(self, timeout: float = FREEZE_WAIT_S) -> bool:
        """:meth:`thaw` for the event loop: see :func:`set_frozen_async`."""
        return await set_frozen_async(self, False, timeout)

    def freeze(self, timeout: float | None = FREEZE_WAIT_S) -> bool:
        """Freeze every process of the job. True once cgroup.events says `frozen 1`,
        False if that did not happen within `timeout` (the freeze stays requested)."""
        return self._set_frozen(True, timeout)

    def thaw(self, timeout: float | None = FREEZE_WAIT_S) -> bool:
        """Thaw the job. True once cgroup.events says `frozen 0` within `timeout`."""
        return self._set_frozen(False, timeout)

    def kill(self) -> None:
        """SIGKILL every process in the job's cgroup2 subtree at once (`cgroup.kill`)."""
        _write(self.unified / "cgroup.kill", "1")

    def signal(self, signum: int) -> int:
        """Send `signum` to every process of the job; returns how many were signalled."""
        n = 0
        for pid in self.pids():
            try:
                os.kill(pid, signum)
                n += 1
            except ProcessLookupError:
                pass
        return n

    # -- memory ------------------------------------------------------------------------
    def set_memory_limit(self, limit_bytes: int | None, *, oom_kill_disable: bool = False,
                         high_bytes: int | None = None) -> None:
        """Set the job's memory limit in the hierarchy that has the memory controller.

        v1: `memory.limit_in_bytes` (None = unlimited) and, with `oom_kill_disable`,
        `memory.oom_control` = 1 so a task at the limit waits instead of being killed.
        v2: `memory.max` and `memory.high` (`high_bytes`, default: unset), which throttles
        the allocator before the limit. Raises CgroupError on failure.
        """
        set_memory(self.hierarchy, self.memory_dir, limit_bytes,
                   oom_kill_disable=oom_kill_disable, high_bytes=high_bytes)

    def memory_limit(self) -> int | None:
        return read_memory_limit(self.hierarchy, self.memory_dir)

    def memory_usage(self) -> int:
        """Bytes charged to the job now (v1 memory.usage_in_bytes, v2 memory.current)."""
        return read_memory_usage(self.hierarchy, self.memory_dir)

    def memory_in_use(self) -> int:
        """Bytes charged to the job less its clean page cache (`read_memory_in_use`): what
        reclaiming the job would free that the kernel could not drop anyway."""
        return read_memory_in_use(self.hierarchy, self.memory_dir)

    def under_oom(self) -> bool:
        """A task of the job waits at its limit (`read_memory_waits`: v1 ``under_oom 1``, v2
        its memory in use at its ``memory.high``)."""
        return read_memory_waits(self.hierarchy, self.memory_dir)

    def set_cpus(self, cpus: float | None) -> bool:
        """Limit the job to `cpus` CPUs of time (None = unlimited). False if no cpu controller."""
        return set_cpu_quota(self.hierarchy, self, cpus)

    @property
    def pids_dir(self) -> Path | None:
        """The directory holding this job's pids controller files; None without the controller."""
        return self.unified if self.hierarchy.pids_in_v2 else self.v1.get("pids")

    def set_pids_max(self, limit: int | None) -> bool:
        """The most tasks (processes and threads) the job may have at once (None = ``max``): a
        fork or clone past it fails with EAGAIN inside the job. False if no pids controller.
        Raises CgroupError on failure."""
        return set_pids_max(self.pids_dir, limit)

    def pids_limit(self) -> dict[str, int | str] | None:
        """``{"current", "max", "refused"}`` of the job's pids controller (refused: forks and
        clones that failed at its pids.max); None without the controller or once gone."""
        return read_pids(self.pids_dir)

    def remove(self) -> None:
        """Remove the job's directories, children first. The job must hold no processes
        (kill it first); raises CgroupError (EBUSY) otherwise. Missing dirs are fine."""
        # Paths are <mount>/<root>/<class>/<job> by construction: only our directories.
        for d in self.all_dirs():
            _rmdir_retry(d)


# How often set_frozen_async looks at cgroup.events while it waits: a freeze of running tasks
# takes about 3 ms, so the first looks come soon; a task in uninterruptible sleep may take
# seconds, looked at every 50 ms.
FROZEN_LOOKS_S = (0.002, 0.005, 0.01, 0.02, 0.05)
# Freezes and thaws that did not take hold within their wait (a task in uninterruptible sleep:
# on hung storage, at a held memory limit), for the status ("migrate" stats and events say whose).
FREEZE_COUNTS = {"freeze_timeouts": 0, "thaw_timeouts": 0}


def freeze_counts() -> dict[str, int]:
    """Freezes and thaws that did not take hold within their wait, since the agent started."""
    return dict(FREEZE_COUNTS)


async def set_frozen_async(cg: Any, want: bool, timeout: float = FREEZE_WAIT_S) -> bool:
    """Asks the kernel to freeze (``want``) or thaw the cgroup ``cg`` and waits, on the event
    loop without blocking it, up to ``timeout`` seconds for ``cgroup.events`` to say it is so:
    True when it is, False when not within ``timeout`` (the request stays: a freeze takes hold
    once a task in uninterruptible sleep, on a hung FUSE or NFS mount, wakes). Blocking waits
    (``freeze(timeout=2.0)``) held the agent's loop for the whole ``timeout`` whenever a job had
    such a task. ``cg``: a :class:`JobCgroup` or anything with its ``freeze``/``thaw``
    (``timeout=0``: ask and look once) and ``frozen``. Raises CgroupError as they do."""
    import asyncio

    ask = cg.freeze if want else cg.thaw
    if ask(timeout=0):
        return True
    deadline = time.monotonic() + max(0.0, timeout)
    i = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            FREEZE_COUNTS["freeze_timeouts" if want else "thaw_timeouts"] += 1
            return False
        await asyncio.sleep(min(left, FROZEN_LOOKS_S[min(i, len(FROZEN_LOOKS_S) - 1)]))
        i += 1
        if bool(cg.frozen()) == want:
            return True


def set_memory(h: Hierarchy, d: Path, limit_bytes: int | None, *, oom_kill_disable: bool = False,
               high_bytes: int | None = None) -> None:
    """Memory limit on a memory-controller directory `d` (a job's or a class parent's)."""
    if limit_bytes is not None and limit_bytes <= 0:
        raise CgroupError(f"memory limit {limit_bytes} must be a positive number of bytes")
    if h.memory_in_v2:
        # v2 has no oom_kill_disable: memory.high just below memory.max is how the allocator
        # waits (throttled, reclaiming) instead of being killed at the limit (`v2_hold_bytes`).
        if high_bytes is None and oom_kill_disable and limit_bytes is not None:
            high_bytes = v2_hold_bytes(limit_bytes)
        _write(d / "memory.max", "max" if limit_bytes is None else str(limit_bytes))
        _write(d / "memory.high", "max" if high_bytes is None else str(high_bytes))
        return
    _write(d / "memory.limit_in_bytes", "-1" if limit_bytes is None else str(limit_bytes))
    _write(d / "memory.oom_control", "1" if oom_kill_disable else "0")


# v2's stand-in for v1's oom_kill_disable: memory.high this far below memory.max (a share of the
# limit, at least V2_HOLD_MIN_BYTES). Above memory.high the kernel throttles the allocating task
# (it reclaims and sleeps) instead of letting it reach memory.max, where the OOM killer would pick
# a victim by size. Airlock's critical level (usage.critical, 0.95 by default) lies below it: a
# task waits here only once Airlock is already acting, as at v1's hold at the limit itself. It was
# at usage.high (0.85) before 2026-11-23; the throttle then stalled a job spiking past 0.85 (PSI
# full), which Airlock read as critical, and a suspended job was reclaimed instead of recovered.
V2_HOLD_SHARE = 0.02
V2_HOLD_MIN_BYTES = 4 << 20


def v2_hold_bytes(limit_bytes: int) -> int:
    """The memory.high that holds the allocator just below a v2 limit of ``limit_bytes``."""
    return max(1 << 20, limit_bytes - max(V2_HOLD_MIN_BYTES, int(limit_bytes * V2_HOLD_SHARE)))


def read_memory_waits(h: Hierarchy, d: Path) -> bool:
    """A task of `d` waits at its limit: v1 ``under_oom 1`` (held by oom_kill_disable); v2 its
    memory in use (`read_memory_in_use`: clean cache aside, which the kernel drops first) at its
    ``memory.high``, where the kernel throttles the allocator. False where no such limit is set."""
    if not h.memory_in_v2:
        return parse_keyed(_read(d / "memory.oom_control")).get("under_oom") == "1"
    text = _read(d / "memory.high").strip()
    if text == "max":
        return False
    high = int(text)
    return read_memory_in_use(h, d) >= high - max(1 << 20, high // 100)


def read_memory_limit(h: Hierarchy, d: Path) -> int | None:
    if h.memory_in_v2:
        text = _read(d / "memory.max").strip()
        return None if text == "max" else int(text)
    v = int(_read(d / "memory.limit_in_bytes").strip())
    return None if v >= (1 << 62) else v


def read_memory_usage(h: Hierarchy, d: Path) -> int:
    name = "memory.current" if h.memory_in_v2 else "memory.usage_in_bytes"
    return int(_read(d / name).strip())


def read_memory_in_use(h: Hierarchy, d: Path) -> int:
    """Bytes charged to `d` less its clean page cache: what the kernel cannot simply drop.

    v1 ``memory.usage_in_bytes`` and v2 ``memory.current`` count the page cache, and a job
    that reads a file larger than the free room fills any limit with it; at the limit the
    kernel drops clean file pages on demand. Dirty pages and pages under writeback stay
    counted (they must be written first), so do anonymous memory, shmem and kernel memory.
    Falls back to the plain usage when ``memory.stat`` cannot be read."""
    usage = read_memory_usage(h, d)
    try:
        stat = parse_keyed(_read(d / "memory.stat"))
        if h.memory_in_v2:
            file = int(stat["active_file"]) + int(stat["inactive_file"])
            busy = int(stat["file_dirty"]) + int(stat["file_writeback"])
        else:
            file = int(stat["total_active_file"]) + int(stat["total_inactive_file"])
            busy = int(stat["total_dirty"]) + int(stat["total_writeback"])
    except (CgroupError, KeyError, ValueError):
        return usage
    return max(0, usage - max(0, file - busy))


def set_pids_max(d: Path | None, limit: int | None) -> bool:
    """``pids.max`` of a pids-controller directory `d` (None: no controller here: False)."""
    if d is None:
        return False
    if limit is not None and limit < 1:
        raise CgroupError(f"task limit {limit} must be at least 1")
    _write(d / "pids.max", "max" if limit is None else str(limit))
    return True


def read_pids(d: Path | None) -> dict[str, int | str] | None:
    """current, max and refused (``pids.events`` max) of a pids-controller directory."""
    if d is None:
        return None
    try:
        mx = (d / "pids.max").read_text().strip()
        out: dict[str, int | str] = {"current": int((d / "pids.current").read_text()),
                                     "max": mx if mx == "max" else int(mx)}
        out["refused"] = int(parse_keyed((d / "pids.events").read_text()).get("max", "0"))
    except (OSError, ValueError):
        return None
    return out


def set_cpu_quota(h: Hierarchy, cg: JobCgroup, cpus: float | None) -> bool:
    if cpus is not None and cpus <= 0:
        raise CgroupError(f"cpus {cpus} must be > 0")
    if h.mode == "v2":
        if "cpu" not in h.v2_controllers:
            return False
        quota = "max" if cpus is None else str(int(cpus * CFS_PERIOD_US))
        _write(cg.unified / "cpu.max", f"{quota} {CFS_PERIOD_US}")
        return True
    d = cg.v1.get("cpu")
    if d is None:
        return False
    _write(d / "cpu.cfs_period_us", str(CFS_PERIOD_US))
    _write(d / "cpu.cfs_quota_us", "-1" if cpus is None else str(int(cpus * CFS_PERIOD_US)))
    return True


class CgroupTree:
    """The root directory (`root_name`) and the per-lifecycle-class parents in every hierarchy.

    `ensure()` creates what is missing and records what it created, so `remove()` removes
    only those (children first) and never a directory it did not make.
    """

    def __init__(self, hierarchy: Hierarchy, root_name: str = "laminar",
                 classes: Iterable[str] = LIFECYCLE_CLASSES) -> None:
        _check_name("root", root_name)
        self.hierarchy = hierarchy
        self.root_name = root_name
        self.classes = tuple(classes)
        for c in self.classes:
            _check_name("class", c)
        self.created: list[Path] = []

    def mounts(self) -> list[Path]:
        return [self.hierarchy.unified, *self.hierarchy.v1.values()]

    def root_dirs(self) -> list[Path]:
        return [m / self.root_name for m in self.mounts()]

    def class_dir(self, job_class: str, ctrl: str | None = None) -> Path:
        """The class parent in cgroup2 (`ctrl` None) or in v1 controller `ctrl`."""
        base = self.hierarchy.unified if ctrl is None else self.hierarchy.v1[ctrl]
        return base / self.root_name / job_class

    def class_memory_dir(self, job_class: str) -> Path:
        return self.class_dir(job_class, None if self.hierarchy.memory_in_v2 else "memory")

    def ensure(self) -> None:
        """Create the root and class parents where missing; enable v2 controllers downwards."""
        for m in self.mounts():
            for d in [m / self.root_name, *(m / self.root_name / c for c in self.classes)]:
                if not d.is_dir():
                    try:
                        d.mkdir()
                        self.created.append(d)
                    except FileExistsError:
                        pass
                    except OSError as e:
                        raise CgroupError(f"mkdir {d}: {e.strerror}") from e
        # v2 controllers enabled downwards: all three on a pure-v2 host; on a hybrid one only
        # pids, where the host left it to cgroup2
        want = ([c for c in ("memory", "cpu", "pids") if c in self.hierarchy.v2_controllers]
                if self.hierarchy.mode == "v2" else ["pids"] if self.hierarchy.pids_in_v2 else [])
        if want:
            u = self.hierarchy.unified
            for d in [u, u / self.root_name, *(u / self.root_name / c for c in self.classes)]:
                for c in want:
                    try:
                        _write(d / "cgroup.subtree_control", f"+{c}")
                    except CgroupError as e:
                        if d != u:
                            raise
                        # The host root may refuse (e.g. inside a container); say why later.
                        if isinstance(e.__cause__, OSError) and e.__cause__.errno not in (errno.EBUSY, errno.ENOENT):
                            raise

    def job(self, job_class: str, job_id: str) -> JobCgroup:
        if job_class not in self.classes:
            raise CgroupError(f"unknown lifecycle class {job_class!r}; expected one of {', '.join(self.classes)}")
        return JobCgroup(self.hierarchy, self.root_name, job_class, job_id)

    def job_ids(self, job_class: str) -> list[str]:
        """Job directories present under a class parent (cgroup2), e.g. after a restart."""
        d = self.class_dir(job_class)
        if not d.is_dir():
            return []
        return sorted(p.name for p in d.iterdir() if p.is_dir())

    def set_class_memory(self, job_class: str, limit_bytes: int | None, *, oom_kill_disable: bool = False,
                         high_bytes: int | None = None) -> None:
        """Limit a whole class (the node's budget for it). With `oom_kill_disable` (v1) the
        kernel holds the allocator of that class at its limit while Airlock decides."""
        set_memory(self.hierarchy, self.class_memory_dir(job_class), limit_bytes,
                   oom_kill_disable=oom_kill_disable, high_bytes=high_bytes)

    def root_pids_dir(self) -> Path | None:
        """The root name's directory in the pids controller (None: the host has none)."""
        m = self.hierarchy.pids_mount
        return None if m is None else m / self.root_name

    def set_root_pids_max(self, limit: int | None) -> bool:
        """The most tasks all jobs together may have (None = ``max``); False if no pids controller."""
        return set_pids_max(self.root_pids_dir(), limit)

    def root_pids(self) -> dict[str, int | str] | None:
        """`read_pids` of the root name's directory: all jobs' tasks, limit, forks refused at it."""
        return read_pids(self.root_pids_dir())

    def set_root_memory(self, limit_bytes: int | None, *, oom_kill_disable: bool = False) -> None:
        """Limit everything under the root name (the node's budget for all jobs)."""
        base = self.hierarchy.unified if self.hierarchy.memory_in_v2 else self.hierarchy.v1["memory"]
        set_memory(self.hierarchy, base / self.root_name, limit_bytes, oom_kill_disable=oom_kill_disable)

    def purge(self) -> None:
        """Kill every process under the root name and remove the whole subtree in every
        hierarchy, whoever created it. For tests and benchmarks, whose root names are unique
        (``laminar-t-…``), and for uninstall; never called by the agent on its own root."""
        for m in self.mounts():
            self.created.extend(d for d in [m / self.root_name, *(m / self.root_name / c for c in self.classes)]
                                if d.is_dir() and d not in self.created)
        self.remove(kill=True)

    def remove(self, kill: bool = False) -> None:
        """Remove the directories `ensure()` created (and any job dirs inside them), children
        first. With `kill`, first cgroup.kill every cgroup2 class parent we created and wait
        for them to empty. Raises CgroupError when something still holds processes."""
        if kill:
            for d in self.created:
                if d.is_relative_to(self.hierarchy.unified) and (d / "cgroup.kill").exists():
                    _write(d / "cgroup.kill", "1")
            deadline = time.monotonic() + 5
            for d in self.created:
                if d.is_relative_to(self.hierarchy.unified) and d.exists():
                    while parse_keyed(_read(d / "cgroup.events")).get("populated") == "1":
                        if time.monotonic() > deadline:
                            raise CgroupError(f"{d} still populated 5 s after cgroup.kill")
                        time.sleep(0.01)
        for d in sorted(self.created, key=lambda p: len(p.parts), reverse=True):
            _rmdir_retry(d)
        self.created.clear()


def remove_empty_tree(root_name: str, hierarchy: Hierarchy | None = None) -> dict[str, list[str]]:
    """Removes the agent's subtree ``<mount>/<root_name>`` in every hierarchy where it holds no
    process, children first, never killing anything (``laminarctl bpf unload``, uninstall).

    Returns ``{"removed": [...], "kept": [...]}``: a directory that still holds a job (rmdir
    answers EBUSY) is kept, with its ancestors."""
    h = hierarchy or detect()
    out: dict[str, list[str]] = {"removed": [], "kept": []}
    for mount in [h.unified, *h.v1.values()]:
        top = mount / root_name
        if not top.is_dir():
            continue
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, top]:
            try:
                d.rmdir()
                out["removed"].append(str(d))
            except FileNotFoundError:
                pass
            except OSError:
                out["kept"].append(str(d))
    return out
