"""A real Slurm for tests (Debian's slurmctld, slurmd, munge): one controller and one slurmd per
laminard of a :class:`harness.Cluster`, with the laminar SPANK plugin on every node.

    with (Cluster.create(tmp, zones=1, per_zone=2, gpus=0, zone_extra=adopt_toml(tmp)) as c,
          SlurmRig.create(tmp, c) as s):
        job = s.sbatch("--laminar-class", "long-resident", "--wrap", "sleep 300")
        s.wait_state(job, "RUNNING")
        s.run("srun", "--laminar-class", "nope", "true", node=0, user=u, check=False)

- one ``munged`` of the rig's own (its own key, socket, pid, seed and log file, ``--socket``);
- ``slurmctld`` on the host side of the cluster's bridge (the bridge's address), in a UTS
  namespace of its own whose hostname is the controller's name (slurmctld checks it);
- one ``slurmd`` per agent, in that agent's network namespace plus a UTS namespace (hostname =
  its Slurm NodeName, ``lmt-<tag>-n<i>``) and a mount namespace of its own, in which that agent's
  socket directory is bind-mounted at the path plugstack.conf names: the plugin, loaded by
  slurmstepd (a child of this slurmd), reaches its own node's agent. ``node=i`` runs a command
  (srun, sbatch) in node i's namespaces, so srun's local check asks that node's agent too.

``ProctrackType=proctrack/linuxproc`` (the task is not in a Slurm cgroup: the agent moves it into
its own), ``TaskPlugin=task/none``, ``SelectType=select/cons_tres``, ``JobRequeue=1``, ports of
the rig's own. Logs and state live under the test's tmp dir; the files a job's user must
read (slurm.conf, plugstack.conf, the plugin, munge's socket) and slurmd's spool (slurmstepd's
Unix sockets: a short path) under ``/run/lmt-slurm-<tag>`` (0755: pytest's tmp dir is root's
alone, and too long a path for a socket). On exit, also when the test fails: every job
cancelled, every process in the rig's UTS namespaces killed (slurmd, slurmctld and the
slurmstepd and job processes they started, wherever they daemonized to), munged stopped, every
directory the rig made removed.

Slurm's and munge's binaries come from ``make`` (APT_PKGS); :func:`slurm_ready` says why the
rig cannot run here (in CI, CI=true, a cluster test that skips counts as failed).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentproc import REPO, cleanup_all

SPANK_SO = REPO / "build" / "spank" / "laminar_spank.so"
BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd", "srun", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def slurm_ready() -> str | None:
    """Why the rig cannot run here, or None: root, Slurm and munge installed, the plugin built."""
    if os.geteuid() != 0:
        return "needs root"
    missing = [b for b in BINARIES if which(b) is None]
    if missing:
        return f"missing {', '.join(missing)} (make apt installs slurmctld slurmd slurm-client munge)"
    if not SPANK_SO.exists():
        return f"{SPANK_SO} not built (make spank)"
    return None


def adopt_toml(tmp: Path) -> str:
    """An ``[adopt]`` section for the agents of a test with this rig (``Cluster.create(...,
    zone_extra=adopt_toml(tmp))``): adopted jobs' checkpoint dirs under the test's own dir. Slurm
    job ids start at 1 in every rig, so the default ``/var/lib/laminar/adopted`` would hold
    another test's ``slurm-1`` (and outlive the test)."""
    return f'\n[adopt]\nckpt_root = "{Path(tmp) / "adopted"}"\n'


def _free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick), for the rig's own daemons."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def _uts(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return None


def _pids_in_uts(ns: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and _uts(int(d)) == ns:
            out.append(int(d))
    return out


@dataclass
class SlurmNode:
    index: int
    name: str  # NodeName and the hostname in its UTS namespace
    addr: str
    netns: str  # /run/netns/<name>
    agent_sock_dir: Path  # the agent's socket dir, bind-mounted at the plugin's socket dir
    proc: subprocess.Popen[bytes] | None = None
    uts: str | None = None  # its UTS namespace (every process slurmd started shares it)


@dataclass
class SlurmRig:
    tag: str
    state: Path  # under the test's tmp dir: logs, spool, state, munge key
    public: Path  # /run/lmt-slurm-<tag>: what a job's user reads
    ctl_name: str
    ctl_addr: str
    nodes: list[SlurmNode] = field(default_factory=list)
    munged: subprocess.Popen[bytes] | None = None
    ctld: subprocess.Popen[bytes] | None = None
    ctld_uts: str | None = None

    @property
    def conf(self) -> Path:
        return self.public / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.public / "munge" / "munge.socket"

    @property
    def plugin_socket(self) -> Path:
        """The agent socket's path as the plugin sees it (in each slurmd's mount namespace)."""
        return self.public / "agent" / "laminard.sock"

    def agents_act_through_slurm(self, cluster: Any, tick_s: float = 0.5) -> None:
        """Restart each agent of ``cluster`` (the rig's nodes, in order) with ``[slurm] enabled`` as
        its Slurm node: the rig's node names are known only once it runs. Their scontrol finds the
        rig's slurm.conf through ``SLURM_CONF``, which the caller sets in the environment first."""
        for n in self.nodes:
            agent = cluster.nodes[n.index].agent
            agent.stop()
            with open(agent.config_path, "a") as f:
                f.write(f'\n[slurm]\nenabled = true\nnode_name = "{n.name}"\ntimeout_s = 10\n'
                        f'\n[schedulers]\ntick_s = {tick_s}\n')
            agent.start()
        cluster.wait_converged()

    def set_plugin_args(self, plugin_args: str = "") -> None:
        """Writes plugstack.conf with the plugin's arguments (besides its socket): srun and each
        step's slurmstepd read it anew, so the next step runs with them."""
        so = self.public / "laminar_spank.so"
        (self.public / "plugstack.conf").write_text(
            f"required {so} socket={self.plugin_socket} {plugin_args}\n".replace(" \n", "\n"))

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @classmethod
    @contextmanager
    def create(cls, tmp: Path, cluster: Any, nodes: Sequence[int] | None = None, cpus: int = 2,
               plugin_args: str = "", partitions: str | None = None, conf_extra: str = "",
               gpus: int = 0) -> Iterator[SlurmRig]:
        """A Slurm over ``cluster``'s agents (``nodes``: their 0-based indexes, default all);
        ``plugin_args``: more plugstack.conf arguments (``adopt=all``); ``partitions``: the
        PartitionName lines (default one partition ``lmt`` of every node), ``{nodes}`` in them
        replaced by the node names in order (``{n0}``, ``{n1}``: one node's); ``conf_extra``: more
        slurm.conf lines (preemption's, for instance); ``gpus``: gres GPUs per node, on FAKE
        device files (:meth:`_write_gres`), 0: no gres."""
        reason = slurm_ready()
        if reason:
            raise RuntimeError(f"slurm rig: {reason}")
        tag = secrets.token_hex(3)
        state = Path(tmp) / f"slurm-{tag}"
        public = Path(f"/run/lmt-slurm-{tag}")
        rig = cls(tag, state, public, f"lmt-{tag}-ctl", f"{cluster.subnet}.254")
        for i in (range(len(cluster.nodes)) if nodes is None else nodes):
            nd = cluster.nodes[i]
            rig.nodes.append(SlurmNode(i, f"lmt-{tag}-n{i}", nd.addr, nd.netns.path, nd.agent.sock.parent))
        try:
            rig._write(cpus, plugin_args, partitions, conf_extra, gpus)
            rig._start_munged()
            rig._start_ctld()
            for n in rig.nodes:
                rig._start_slurmd(n)
            rig.wait_idle(60)
            yield rig
        finally:
            cleanup_all(rig._cancel_all, *(lambda n=n: rig._kill_node(n) for n in rig.nodes), rig._kill_ctld,
                        rig._kill_munged, lambda: shutil.rmtree(public, ignore_errors=True),
                        lambda: shutil.rmtree(state, ignore_errors=True))

    # ------------------------------------------------------------------------ setup

    def _write(self, cpus: int, plugin_args: str, partitions: str | None = None, conf_extra: str = "",
               gpus: int = 0) -> None:
        self.state.mkdir(parents=True)
        self.public.mkdir(mode=0o755)
        os.chmod(self.public, 0o755)  # whatever the umask
        for d in ("munge", "agent"):
            (self.public / d).mkdir(mode=0o755)
            os.chmod(self.public / d, 0o755)
        (self.state / "ctld").mkdir(mode=0o700)
        # slurmstepd's Unix sockets live in the spool dir: its path must stay short (sun_path is
        # 108 bytes), which pytest's tmp dir is not
        for d in ("spool", *(f"spool/{n.name}" for n in self.nodes)):
            (self.public / d).mkdir(mode=0o700)
        key = self.state / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        so = self.public / "laminar_spank.so"
        shutil.copyfile(SPANK_SO, so)
        os.chmod(so, 0o755)
        self.set_plugin_args(plugin_args)
        ctld_port, slurmd_port = _free_port(), _free_port()
        gres = self._write_gres(gpus)
        nodes = "".join(f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} CPUs={cpus} "
                        f"RealMemory=1000 {gres}State=UNKNOWN\n" for n in self.nodes)
        s = self.state
        self.conf.write_text(
            f"ClusterName=lmt{self.tag}\n"
            f"SlurmctldHost={self.ctl_name}({self.ctl_addr})\n"
            f"SlurmctldPort={ctld_port}\nSlurmdPort={slurmd_port}\n"
            f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={self.munge_socket}\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            f"StateSaveLocation={s}/ctld\nSlurmdSpoolDir={self.public}/spool/%n\n"
            f"SlurmctldPidFile={s}/slurmctld.pid\nSlurmdPidFile={s}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={s}/slurmctld.log\nSlurmdLogFile={s}/slurmd-%n.log\n"
            "SlurmctldDebug=info\nSlurmdDebug=debug\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
            "SchedulerType=sched/backfill\nJobRequeue=1\nReturnToService=2\n"
            "MpiDefault=none\nSwitchType=switch/none\nJobAcctGatherType=jobacct_gather/none\n"
            "AccountingStorageType=accounting_storage/none\nJobCompType=jobcomp/none\n"
            "SlurmdParameters=config_overrides\nMailProg=/bin/true\n"
            "KillWait=2\nMinJobAge=600\nInactiveLimit=0\nSlurmdTimeout=60\nSlurmctldTimeout=60\n"
            f"PlugStackConfig={self.public}/plugstack.conf\n"
            + ("GresTypes=gpu\n" if gpus else "")
            + conf_extra
            + nodes
            + self._partitions(partitions))
        os.chmod(self.conf, 0o644)

    def fake_gpu(self, i: int) -> Path:
        """The FAKE device file gres.conf names as GPU ``i`` (no GPU behind it: /dev/null's numbers)."""
        return self.public / "dev" / f"laminar-fake-gpu{i}"

    def _write_gres(self, gpus: int) -> str:
        """``gpus`` FAKE GPUs for Slurm's gres (none: ""): character devices with /dev/null's
        numbers (1:3), ``laminar-fake-gpu<i>``, in the rig's public dir, which every slurmd sees
        (a file, not a mount: its own mount namespace shares the filesystem) and the rig removes
        with it; gres.conf (beside slurm.conf, where Slurm reads it) names them for every node.
        slurmd only stats them (TaskPlugin=task/none constrains no device); SLURM_STEP_GPUS
        counts them by the number that ends their name. The node lines' ``Gres=`` is returned."""
        if not gpus:
            return ""
        (self.public / "dev").mkdir(mode=0o755)
        for i in range(gpus):
            os.mknod(self.fake_gpu(i), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        files = str(self.fake_gpu(0))[:-1] + (f"[0-{gpus - 1}]" if gpus > 1 else "0")
        (self.public / "gres.conf").write_text(f"# FAKE GPUs of the test rig (tests/slurmrig.py): /dev/null's numbers\n"
                                               f"Name=gpu File={files}\n")
        os.chmod(self.public / "gres.conf", 0o644)
        return f"Gres=gpu:{gpus} "

    def _partitions(self, lines: str | None) -> str:
        if lines is None:
            return "PartitionName=lmt Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        names = {f"n{i}": n.name for i, n in enumerate(self.nodes)}
        return lines.format(nodes=",".join(n.name for n in self.nodes), **names).rstrip("\n") + "\n"

    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.state / log, "ab") as f:
            return subprocess.Popen(argv, stdout=f, stderr=f, env=self.env(), start_new_session=True)

    def _start_munged(self) -> None:
        s = self.state
        self.munged = self._spawn([str(which("munged")), "--foreground", "--force", f"--socket={self.munge_socket}",
                                   f"--key-file={s}/munge.key", f"--pid-file={s}/munged.pid",
                                   f"--seed-file={s}/munged.seed", f"--log-file={s}/munged.log"], "munged.out")
        self._wait(lambda: self.munge_socket.exists(), 20, "munged's socket",
                   lambda: self.munged is not None and self.munged.poll() is not None, "munged.log")

    def _start_ctld(self) -> None:
        self.ctld = self._spawn(["unshare", "--uts", "--", "sh", "-c",
                                 'hostname "$0" && exec "$1" -D -c', self.ctl_name, str(which("slurmctld"))],
                                "slurmctld.out")
        self.ctld_uts = self._wait_uts(self.ctld, "slurmctld")
        self._wait(lambda: self._ok("scontrol", "ping"), 30, "slurmctld to answer",
                   lambda: self.ctld is not None and self.ctld.poll() is not None, "slurmctld.log")

    def _start_slurmd(self, n: SlurmNode) -> None:
        mnt = self.public / "agent"
        script = 'hostname "$0" && mount --bind "$1" "$2" && exec "$3" -D -N "$0"'
        n.proc = self._spawn(["nsenter", f"--net={n.netns}", "--", "unshare", "--uts", "--mount",
                              "--propagation", "private", "--", "sh", "-c", script, n.name, str(n.agent_sock_dir),
                              str(mnt), str(which("slurmd"))], f"slurmd-{n.name}.out")
        n.uts = self._wait_uts(n.proc, "slurmd")

    def _wait_uts(self, proc: subprocess.Popen[bytes], comm: str) -> str:
        """The daemon's own UTS namespace, once the wrapper has exec'd into it."""
        def ready() -> bool:
            try:
                return Path(f"/proc/{proc.pid}/comm").read_text().strip() == comm
            except OSError:
                return False
        self._wait(ready, 20, f"{comm} to start", lambda: proc.poll() is not None, f"{comm}.out")
        ns = _uts(proc.pid)
        assert ns is not None and ns != _uts(os.getpid()), (comm, ns)
        return ns

    def _wait(self, fn: Any, timeout: float, what: str, died: Any = lambda: False, log: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if fn():
                return
            if died():
                break
            time.sleep(0.2)
        raise RuntimeError(f"slurm rig: no {what} after {timeout} s\n{self.logs(log)}")

    def logs(self, only: str = "") -> str:
        out = []
        for p in sorted(self.state.glob("*.log")) + sorted(self.state.glob("*.out")):
            if only and not p.name.startswith(only.split(".")[0]):
                continue
            try:
                out.append(f"--- {p.name}\n{p.read_text()[-4000:]}")
            except OSError:
                pass
        return "\n".join(out)

    # ------------------------------------------------------------------ commands

    def argv(self, *argv: str, node: int | None = None, user: Any = None) -> list[str]:
        """``argv`` as run in node ``node``'s namespaces (None: on the host), as ``user`` (a
        userrig User; None: root)."""
        out = list(argv)
        if user is not None:
            out = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--", *out]
        if node is not None:
            n = self.nodes[node]
            assert n.proc is not None
            out = ["nsenter", "-t", str(n.proc.pid), "-n", "-m", "-u", "--", *out]
        return out

    def run(self, *argv: str, node: int | None = None, user: Any = None, check: bool = True,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(self.argv(*argv, node=node, user=user), env=self.env(), text=True,
                           capture_output=True, timeout=timeout, cwd="/tmp")
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}: {r.stdout}{r.stderr}\n{self.logs()}")
        return r

    def _ok(self, *argv: str) -> bool:
        try:
            return self.run(*argv, check=False, timeout=20).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def sbatch(self, *args: str, node: int | None = None, user: Any = None) -> str:
        """Submits a batch job (``--parsable``): its Slurm job id."""
        out = self.run("sbatch", "--parsable", *args, node=node, user=user).stdout.strip()
        job = out.split(";")[0]
        assert job.isdigit(), out
        return job

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields (one word each)."""
        text = self.run("scontrol", "-o", "show", "job", job).stdout
        out = {}
        for word in text.split():
            k, sep, v = word.partition("=")
            if sep:
                out[k] = v
        return out

    def wait_state(self, job: str, state: str, timeout: float = 60.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        got: dict[str, str] = {}
        while time.monotonic() < deadline:
            got = self.job(job)
            if got.get("JobState") == state:
                return got
            time.sleep(0.3)
        raise AssertionError(f"slurm job {job} not {state} after {timeout} s: {got}\n{self.logs()}")

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until every node has registered and is idle."""
        names = {n.name for n in self.nodes}

        def idle() -> bool:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=20)
            seen = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
            return all(seen.get(n) == "idle" for n in names)
        died = lambda: any(n.proc is not None and n.proc.poll() is not None for n in self.nodes)  # noqa: E731
        self._wait(idle, timeout, "idle nodes", died)

    # ------------------------------------------------------------------ teardown

    def _cancel_all(self) -> None:
        if self.ctld is not None and self.ctld.poll() is None:
            self.run("scancel", "--full", "--quiet", "--partition", "lmt", check=False, timeout=20)

    @staticmethod
    def _kill_ns(ns: str | None, proc: subprocess.Popen[bytes] | None) -> None:
        """SIGTERM, then SIGKILL, to every process in the UTS namespace ``ns`` (a daemon and all
        it started, daemonized or not), until none is left."""
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if ns is None:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
            return
        for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL, signal.SIGKILL):
            pids = _pids_in_uts(ns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        left = _pids_in_uts(ns)
        if left:
            raise RuntimeError(f"slurm rig: processes {left} left in {ns}")

    def _kill_node(self, n: SlurmNode) -> None:
        self._kill_ns(n.uts, n.proc)

    def _kill_ctld(self) -> None:
        self._kill_ns(self.ctld_uts, self.ctld)

    def _kill_munged(self) -> None:
        if self.munged is not None and self.munged.poll() is None:
            self.munged.terminate()
            try:
                self.munged.wait(10)
            except subprocess.TimeoutExpired:
                self.munged.kill()
                self.munged.wait(10)
