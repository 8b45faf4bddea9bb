"""A real systemd for tests: this machine's own root booted in a systemd-nspawn container.

The development and CI machines run no systemd as PID 1, so `systemd/laminard.service` could
only be checked with `systemd-analyze verify`. `SystemdContainer` boots the host's systemd
(PID 1 of a new pid namespace) on a throw-away copy of the host's root, installs laminard
there with `make install` and lets a test drive it with `systemctl`, so the unit's sandbox
(capability bounding set, NoNewPrivileges, ProtectSystem, RestrictAddressFamilies, Type=notify,
KillMode=process, Restart=) is applied by systemd itself::

    with SystemdContainer() as box:
        box.install()                          # make -o setup install, inside the container
        box.sh("systemctl start laminard")     # returns once the agent sent READY=1
        box.ctl("status")                      # laminarctl inside the container

What the container is given, and why (a systemd host gives the agent the same):

- root: an overlay of `/` (read-only lower) under a tmpfs, so the install, `/etc/laminar`,
  `/var/lib/laminar` and `/run/laminar` are the container's own and vanish with it (a checkout
  or interpreter on another file system is bound in);
- cgroups: nspawn's own hybrid layout, rooted (through a cgroup namespace) at host cgroups
  ``laminar-sd-<hex>`` that this rig creates in every v1 hierarchy but cpuset and in cgroup2;
  nspawn mounts the v1 controllers read-only; the container's PID 1 is a shell that remounts
  ``memory``, ``cpu``, ``freezer`` and ``pids`` read-write, as on a hybrid host, and then execs
  systemd (so systemd puts the unit in its v1 memory and pids cgroups, as on a node);
- bpffs: a private instance (``mount -t bpf``) at the container's ``/sys/fs/bpf`` (nspawn's
  ``/sys`` has none; systemd mounts one at boot on a host), tracefs read-only;
- network: a private namespace with a veth pair ``lmsd0``/``lmsd1`` and a default route over
  ``lmsd0``, the agent's uplink with the shipped config (never the host's eth0);
- capabilities: nspawn's default set plus CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN, and the
  ``bpf`` and ``perf_event_open`` system calls, which nspawn's seccomp filter otherwise refuses.
  CAP_SYS_RESOURCE stays out: this machine's root lacks it (PLATFORM.md), so systemd cannot
  apply the unit's ``OOMScoreAdjust=-900`` or ``LimitMEMLOCK=infinity`` here.

`close()` (also on failure) powers the container off, kills what is left of it, unmounts the
overlay and the bpffs and removes the cgroups and nspawn's runtime entries. Machine names are
``lm-sd-<hex>``: several runs may go on at once.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parents[1]
CGROUP = Path("/sys/fs/cgroup")
# v1 hierarchies the container is rooted in (cpuset is left out: a new v1 cpuset cgroup has no
# CPUs until cpuset.cpus is written, and the agent does not use it).
HIERARCHIES = ("memory", "cpu", "cpuacct", "freezer", "pids", "blkio", "devices", "systemd", "unified")
# v1 controllers a systemd host mounts read-write, that the agent writes (job memory limits, CPU
# quotas) or that systemd puts the unit in (pids: TasksMax=); nspawn mounts them read-only.
WRITABLE = ("memory", "cpu", "freezer", "pids")
# Units of this host that do nothing for the test and only slow the boot (earlyoom would also
# read the host's memory as the container's).
MASKED = ("earlyoom.service", "postgresql.service", "postgresql@15-main.service", "console-getty.service")
BOOT_TIMEOUT_S = 60.0
NOBODY = 65534


def missing() -> str | None:
    """Why the container cannot be booted here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root"
    for tool, pkg in (("systemd-nspawn", "systemd-container"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install {pkg}; `make setup` installs it)"
    if not Path("/lib/systemd/systemd").exists():
        return "no /lib/systemd/systemd to boot (apt-get install systemd)"
    if not (CGROUP / "unified").is_dir() and not (CGROUP / "cgroup.controllers").exists():
        return "no cgroup2 mount"
    return None


def off_root_binds() -> list[str]:
    """nspawn options that bind the checkout and the venv's interpreter into the container where
    the root overlay does not show them: on another mount (a CI clone on its own file system), or
    under /tmp, where nspawn mounts a fresh tmpfs (the fresh-clone CI clones to /tmp/fresh-ci-*:
    `make -C <checkout> install` found no checkout there). The checkout is bound writable, as
    `make install` writes its bytecode."""
    root_dev = os.stat("/").st_dev
    out = []
    for path, opt in ((REPO, "--bind"), ((REPO / ".venv" / "bin" / "python3").resolve().parents[1], "--bind-ro")):
        if os.stat(path).st_dev != root_dev or Path("/tmp") in (path, *path.parents):
            out.append(f"{opt}={path}")
    return out


class ContainerError(RuntimeError):
    """The container did not boot or a command in it failed; the message holds its output."""


class SystemdContainer:
    """One booted container (see the module docstring). Use as a context manager."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.name = f"lm-sd-{self.tag}"
        self.cgroup = f"laminar-sd-{self.tag}"
        self.base = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.root = self.base / "root"
        self.layer = self.base / "layer"
        self.bpffs = self.base / "bpffs"
        self.console = self.base / "console.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self._mounted: list[Path] = []
        self._cgroups: list[Path] = []

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> SystemdContainer:
        try:
            self.boot()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _mount(self, argv: list[str], target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", *argv, str(target)], check=True, capture_output=True, text=True)
        self._mounted.append(target)

    def boot(self) -> None:
        """Mounts the root overlay, boots systemd and waits until it is up.

        Raises ContainerError (with the console's tail) when it is not up in BOOT_TIMEOUT_S."""
        self._mount(["-t", "tmpfs", "-o", "mode=0755", f"{self.name}-layer"], self.layer)
        (self.layer / "upper").mkdir()
        (self.layer / "work").mkdir()
        self._mount(["-t", "overlay", "-o", f"lowerdir=/,upperdir={self.layer}/upper,workdir={self.layer}/work",
                     f"{self.name}-root"], self.root)
        # A fresh node: none of this host's own Laminar state or install shows through.
        for p in ("var/lib/laminar", "etc/laminar", "etc/systemd/system/laminard.service",
                  "usr/lib/tmpfiles.d/laminar.conf"):
            q = self.root / p
            if q.is_dir() and not q.is_symlink():
                shutil.rmtree(q)
            elif q.exists() or q.is_symlink():
                q.unlink()
        self._start()

    def reboot(self) -> None:
        """Powers the container off and boots it again on the same root (what was installed and
        written stays; processes, cgroups, /run and the bpffs are new, as after a node's reboot)."""
        self._poweroff()
        self._start()

    def _start(self) -> None:
        self._mount(["-t", "bpf", f"{self.name}-bpf"], self.bpffs)
        for h in HIERARCHIES:
            d = CGROUP / h / self.cgroup
            if (CGROUP / h).is_dir():
                d.mkdir()
                self._cgroups.append(d)
        # PID 1 is a shell that gives the container what a node has before systemd starts, then
        # becomes systemd: v1 controllers writable (so systemd puts the unit in them, as on a
        # hybrid host) and an uplink with the default route (never the host's eth0).
        init = (" ".join(f"mount -o remount,bind,rw /sys/fs/cgroup/{c} &&" for c in WRITABLE) +
                " ip link add lmsd0 type veth peer name lmsd1 && ip addr add 10.253.0.1/24 dev lmsd0 &&"
                " ip link set lmsd0 up && ip link set lmsd1 up && ip route add default via 10.253.0.2 dev lmsd0 &&"
                " exec /lib/systemd/systemd " + " ".join(f"systemd.mask={u}" for u in MASKED))
        argv = ["systemd-nspawn", "-D", str(self.root), "--kill-signal=SIGRTMIN+3", "-M", self.name,
                "--register=no", "--keep-unit", "--private-network", "--capability=CAP_BPF,CAP_PERFMON,CAP_NET_ADMIN",
                "--system-call-filter=bpf perf_event_open", "--bind-ro=/sys/kernel/tracing",
                f"--bind={self.bpffs}:/sys/fs/bpf", *off_root_binds(), "/bin/sh", "-c", init]
        procs = [d / "cgroup.procs" for d in self._cgroups]

        def enter_cgroups() -> None:  # in the child, before exec: the container's cgroup roots
            for p in procs:
                with open(p, "w") as f:
                    f.write(str(os.getpid()))

        self.leader = 0
        with open(self.console, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         preexec_fn=enter_cgroups, start_new_session=True)
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited with {self.proc.returncode}:\n{self.console_tail()}")
            self.leader = self._find_leader()
            if self.leader:
                r = self.sh("systemctl is-system-running --wait", check=False, timeout=deadline - time.monotonic())
                state = r.stdout.strip()
                if state == "running":
                    return
                if state == "degraded":
                    failed = self.sh("systemctl --failed --no-legend", check=False).stdout
                    raise ContainerError(f"container {self.name} booted degraded:\n{failed}")
            time.sleep(0.1)
        raise ContainerError(f"container {self.name} not up after {BOOT_TIMEOUT_S} s:\n{self.console_tail()}")

    def _find_leader(self) -> int:
        """The container's PID 1 as the host sees it (nspawn's child running systemd), or 0."""
        assert self.proc is not None
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return 0
        for k in kids:
            try:
                if Path(f"/proc/{k}/comm").read_text().strip() == "systemd":
                    return int(k)
            except OSError:
                continue
        return 0

    def _poweroff(self) -> None:
        """Powers the container off (SIGKILL to what is left after 20 s), removes its cgroups and
        unmounts its bpffs."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)  # nspawn: the kill signal (poweroff) to PID 1
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                for pid in (self.leader, self.proc.pid):
                    if pid:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)  # the leader's death ends its pid namespace
                self.proc.wait(10)
        for d in self._cgroups:
            self._remove_cgroup(d)
        self._cgroups.clear()
        if self.bpffs in self._mounted:
            self._umount(self.bpffs)
            self._mounted.remove(self.bpffs)

    @staticmethod
    def _umount(m: Path) -> None:
        if subprocess.run(["umount", str(m)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(m)], capture_output=True)

    def console_tail(self, n: int = 4000) -> str:
        try:
            return self.console.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        """Powers the container off and removes everything the rig made: mounts, cgroups,
        nspawn's runtime entries, the temporary directory."""
        self._poweroff()
        for m in reversed(self._mounted):
            self._umount(m)
        self._mounted.clear()
        for sub in ("propagate", "locks", "unix-export"):
            p = Path("/run/systemd/nspawn") / sub / self.name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists() or p.is_symlink():
                p.unlink(missing_ok=True)
        for sub in ("propagate", "locks", "unix-export", ""):  # nspawn's runtime directories, when empty
            with contextlib.suppress(OSError):
                (Path("/run/systemd/nspawn") / sub).rmdir()
        shutil.rmtree(self.base, ignore_errors=True)

    @staticmethod
    def _remove_cgroup(top: Path) -> None:
        """Kills what still runs in `top` (the container's own processes) and removes it, children
        first; a v1 memcg can stay busy a few ms after its last task left, hence the retries."""
        for _ in range(100):
            if not top.exists():
                return
            busy = False
            for dirpath, _dirs, _files in os.walk(top, topdown=False):
                d = Path(dirpath)
                with contextlib.suppress(OSError):
                    for pid in (d / "cgroup.procs").read_text().split():
                        busy = True
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                with contextlib.suppress(OSError):
                    d.rmdir()
            if not top.exists():
                return
            time.sleep(0.05 if busy else 0.02)
        raise ContainerError(f"cgroup {top} could not be removed")

    # ---- commands in the container ---------------------------------------------------------

    def sh(self, script: str, check: bool = True, timeout: float = 60.0, user: int | str | None = None,
           cwd: str = "/") -> subprocess.CompletedProcess[str]:
        """Runs `script` with /bin/sh in all the container's namespaces: as root; as uid `user`
        (an int: its gid the same, no supplementary groups); or as the container's user named
        `user` (its group of the same name and its supplementary groups). Raises ContainerError
        on a non-zero exit when `check`."""
        inner = ["sh", "-c", f"cd {cwd} && {script}"]
        if isinstance(user, int):
            inner = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *inner]
        elif user is not None:
            inner = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *inner]
        r = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "--", *inner], capture_output=True,
                           text=True, timeout=max(timeout, 1.0))
        if check and r.returncode != 0:
            raise ContainerError(f"in {self.name}: {script!r} exited {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def ctl(self, *args: str, check: bool = True, user: int | str | None = None, cwd: str = "/") -> subprocess.CompletedProcess[str]:
        """laminarctl (the checkout's) inside the container."""
        quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in args)
        return self.sh(f"{REPO}/.venv/bin/laminarctl {quoted}", check=check, user=user, cwd=cwd)

    def install(self) -> None:
        """`make install` inside the container, as an operator runs it (setup already done by
        the checkout: the venv and BPF objects are the ones the tests use).

        Then, in the container only, lets every user pass (search, not list) the directories
        above the checkout and above the venv's interpreter: on this machine the interpreter
        lies under /root (0700) and a CI clone may sit in a 0700 directory, where no user but
        root could run the checkout's laminarctl (a node installs it where its users reach it)."""
        self.sh(f"make -C {REPO} -o setup install", timeout=120)
        dirs: set[Path] = set()
        for p in (REPO / ".venv" / "bin" / "laminarctl", (REPO / ".venv" / "bin" / "python3").resolve()):
            dirs.update(p.parents)
        self.sh("chmod o+x " + " ".join(sorted(str(d) for d in dirs)))

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show -p ...` as a dict."""
        out = self.sh(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, lines: int = 60) -> str:
        return self.sh(f"journalctl -u {unit} --no-pager -o short-precise -n {lines}", check=False).stdout
