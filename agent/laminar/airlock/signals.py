"""Memory-pressure signals Airlock listens to, without polling where the kernel can tell us.

- **PSI triggers** (`PsiTrigger`) on ``/proc/pressure/memory`` (the node) and on a cgroup2
  ``memory.pressure`` (the jobs' subtree, each job): the kernel raises POLLPRI when stall time
  in a window exceeds a threshold. The window must be a multiple of 2 s unless the process
  holds CAP_SYS_RESOURCE (then 500 ms .. 10 s); `psi_window()` reads CapEff and says which.
- **v1 memcg eventfds** (`V1Eventfd`, hybrid hosts) registered through ``cgroup.event_control``
  on ``memory.oom_control`` (a task waits at the limit) or ``memory.pressure_level``
  (low/medium/critical reclaim pressure, "local" so only this cgroup's reclaim counts).
- **v2 ``memory.events``** (pure-v2 hosts): POLLPRI when ``high``/``max``/``oom`` counters move.
- The BPF tracepoint events arrive through the agent's event bus (kind "pressure").

`PriPoller` gathers POLLPRI file descriptors into one epoll fd that an asyncio loop can watch
with ``add_reader`` (asyncio's selector only waits for POLLIN).
"""

from __future__ import annotations

import os
import select
from pathlib import Path

CAP_SYS_RESOURCE = 24
# PSI trigger windows: unprivileged (no CAP_SYS_RESOURCE) windows must be multiples of 2 s.
PSI_WINDOW_UNPRIV_US = 2_000_000
PSI_WINDOW_PRIV_US = 1_000_000
# Stall threshold per window: 5% of the window stalled (some) raises the trigger.
PSI_STALL_SHARE = 0.05


def cap_eff(status: str | None = None) -> int:
    """The effective capability mask of this process (from /proc/self/status)."""
    text = status if status is not None else Path("/proc/self/status").read_text()
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def psi_window(status: str | None = None) -> tuple[int, str]:
    """(window in µs, why): 1 s with CAP_SYS_RESOURCE, else 2 s (the kernel's rule)."""
    if cap_eff(status) & (1 << CAP_SYS_RESOURCE):
        return PSI_WINDOW_PRIV_US, "1 s PSI trigger window (CAP_SYS_RESOURCE held)"
    return PSI_WINDOW_UNPRIV_US, "2 s PSI trigger window (no CAP_SYS_RESOURCE: windows must be multiples of 2 s)"


def read_psi(path: str | Path) -> tuple[float, float]:
    """(some avg10, full avg10) as fractions 0..1 from a PSI file; (0, 0) if unreadable."""
    some = full = 0.0
    try:
        for line in Path(path).read_text().splitlines():
            kind, *fields = line.split()
            vals = dict(f.split("=", 1) for f in fields)
            if kind == "some":
                some = float(vals["avg10"]) / 100
            elif kind == "full":
                full = float(vals["avg10"]) / 100
    except (OSError, KeyError, ValueError):
        pass
    return some, full


def mem_available() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes from /proc/meminfo."""
    vals: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, rest = line.partition(":")
        if k in ("MemAvailable", "MemTotal"):
            vals[k] = int(rest.split()[0]) * 1024
    return vals.get("MemAvailable", 0), vals.get("MemTotal", 0)


class PsiTrigger:
    """A PSI trigger: POLLPRI on `fileno()` when `stall_us` of `kind` stall accrue in a window.

    Raises OSError when the kernel refuses (e.g. a window not allowed without
    CAP_SYS_RESOURCE: EINVAL/EPERM) with the path and the trigger line in the message.
    """

    def __init__(self, path: str | Path, window_us: int, stall_us: int | None = None, kind: str = "some") -> None:
        self.path = Path(path)
        self.window_us = window_us
        self.stall_us = stall_us if stall_us is not None else int(window_us * PSI_STALL_SHARE)
        line = f"{kind} {self.stall_us} {self.window_us}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        try:
            os.write(self.fd, line.encode() + b"\0")
        except OSError as e:
            os.close(self.fd)
            raise OSError(e.errno, f"PSI trigger {line!r} on {self.path}: {e.strerror}") from None

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class V1Eventfd:
    """A v1 memcg notification: readable (POLLIN) each time the event happens.

    `target` is ``"oom_control"`` (OOM at the limit, also fires while tasks wait under
    oom_kill_disable) or ``"pressure_level"`` with `level` low|medium|critical (mode "local").
    """

    def __init__(self, memory_dir: str | Path, target: str, level: str | None = None) -> None:
        d = Path(memory_dir)
        self.file = d / f"memory.{target}"
        self.what = f"{d}/memory.{target}" + (f" {level}" if level else "")
        self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        tfd = os.open(d / f"memory.{target}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            arg = f"{self.efd} {tfd}" + (f" {level},local" if level else "")
            with open(d / "cgroup.event_control", "w") as f:
                f.write(arg)
        except OSError as e:
            os.close(self.efd)
            raise OSError(e.errno, f"register eventfd on {self.what}: {e.strerror}") from None
        finally:
            os.close(tfd)

    def fileno(self) -> int:
        return self.efd

    def cgroup_gone(self) -> bool:
        """True when the watched cgroup was removed. The kernel signals every eventfd registered
        on a v1 memory cgroup as it removes it (after the directory is gone), so an event read
        while this is true is that removal, not an OOM or pressure."""
        return not self.file.exists()

    def drain(self) -> int:
        """How many events arrived since the last drain (0 if none)."""
        try:
            return os.eventfd_read(self.efd)
        except BlockingIOError:
            return 0

    def close(self) -> None:
        if self.efd >= 0:
            os.close(self.efd)
            self.efd = -1


class PriPoller:
    """An epoll set for POLLPRI sources (PSI triggers, cgroup.events, memory.events) and
    POLLIN sources (eventfds); its own fd is readable whenever any of them fired."""

    def __init__(self) -> None:
        self.ep = select.epoll()
        self.tags: dict[int, str] = {}

    def fileno(self) -> int:
        return self.ep.fileno()

    def add(self, fd: int, tag: str, pri: bool = True) -> None:
        mask = (select.EPOLLPRI | select.EPOLLERR) if pri else select.EPOLLIN
        self.ep.register(fd, mask)
        self.tags[fd] = tag

    def remove(self, fd: int) -> None:
        try:
            self.ep.unregister(fd)
        except (OSError, ValueError):
            pass
        self.tags.pop(fd, None)

    def ready(self) -> list[tuple[int, str]]:
        """(fd, tag) for every source that fired; non-blocking."""
        return [(fd, tag) for fd, tag, _ in self.ready_events()]

    def ready_events(self) -> list[tuple[int, str, int]]:
        """(fd, tag, epoll mask) for every source that fired; non-blocking. EPOLLERR on a PSI
        trigger or a cgroup file means the file's cgroup is gone (kernfs reports a removed node
        as POLLERR|POLLPRI for as long as the file is open): no signal, a source to drop."""
        return [(fd, self.tags.get(fd, "?"), mask) for fd, mask in self.ep.poll(0)]

    def close(self) -> None:
        self.ep.close()
