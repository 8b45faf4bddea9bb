"""A real laminard process for tests: its own config, state dir, socket, pin root and cgroup root.

The agent runs inside a test network namespace through ``nsenter --net`` (so /sys, the pins and
the kernel BTF stay visible), attached to that namespace's veth as its uplink. ``cleanup()``
stops it and removes everything it made (filters, clsact, pins, cgroups), also after a failure
and also when Ctrl-C arrives during the cleanup (:func:`cleanup_all`: the run still stops).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"
NOBODY = 65534


def cleanup_all(*steps: Callable[[], object]) -> None:
    """Runs every cleanup step in order, also when one fails or Ctrl-C (KeyboardInterrupt) arrives
    during one, then raises what came first, a KeyboardInterrupt before any error: Ctrl-C while
    a fixture cleans up still stops the run, and leaves no agent, namespace, pin or cgroup behind.
    (Without this, a KeyboardInterrupt in the first step skipped all the others.)"""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - raised again below, after the other steps
            if first is None or (isinstance(e, KeyboardInterrupt) and not isinstance(first, KeyboardInterrupt)):
                first = e
    if first is not None:
        raise first


class AgentProc:
    def __init__(self, tmp: Path, uplink: str, netns: Any = None, extra_toml: str = "", node: str | None = None,
                 agent_toml: str = "", net_toml: str = "") -> None:
        """`extra_toml`: sections after the test's own; `agent_toml`, `net_toml`: more ``[agent]``,
        ``[net]`` keys (lines)."""
        self.tag = secrets.token_hex(3)
        self.tmp = tmp
        self.netns = netns
        self.state_dir = tmp / f"state-{self.tag}"
        self.sock = Path(f"/run/laminar-t-{self.tag}/laminard.sock")
        self.pin_root = Path(f"/sys/fs/bpf/laminar-t-{self.tag}")
        self.cgroup_root = f"laminar-t-{self.tag}"
        self.log_path = tmp / f"laminard-{self.tag}.log"
        self.config_path = tmp / f"laminard-{self.tag}.toml"
        self.config_path.write_text(
            f'[agent]\nnode = "{node or "n-" + self.tag}"\nstate_dir = "{self.state_dir}"\nsocket = "{self.sock}"\n'
            f'log_level = "debug"\n{agent_toml}\n[bpf]\npin_root = "{self.pin_root}"\n\n[net]\nuplink = "{uplink}"\n{net_toml}\n'
            f'[metrics]\nlisten = ""\n\n[cgroups]\nroot = "{self.cgroup_root}"\n\n{extra_toml}')
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self, *argv: str) -> list[str]:
        return self.netns.argv(*argv) if self.netns is not None else list(argv)

    def start(self, wait: bool = True, timeout: float = 60.0, prefix: tuple[str, ...] = ()) -> None:
        """Starts laminard (prefix: a wrapper such as setpriv, run inside the namespace)."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(*prefix, str(VENV_BIN / "laminard"), "--config", str(self.config_path)),
                                     stdout=log, stderr=log, start_new_session=True)
        log.close()
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"laminard exited with {self.proc.returncode}:\n{self.log()}")
            r = self.ctl("-o", "json", "status", check=False)
            if r.returncode == 0:
                return json.loads(r.stdout)
            last = r.stderr
            time.sleep(0.2)
        raise TimeoutError(f"laminard not ready after {timeout} s ({last}):\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-8000:]
        except OSError:
            return ""

    def ctl(self, *args: str, check: bool = True, user: int | None = None, timeout: float | None = None,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Runs laminarctl against this agent; `user`: as that uid/gid with no groups (see ctl_as).
        In this process (:func:`ctl_here`) unless it is run as another user, with `input`, with a
        `timeout` (a process is killed at it: TimeoutExpired; default 60 s), off the main thread
        or for a command that acts on this node itself (LOCAL_COMMANDS)."""
        if user is not None:
            r = ctl_as(user, ["--socket", str(self.sock), *args], input)
        elif (input is None and timeout is None and threading.current_thread() is threading.main_thread()
              and not LOCAL_COMMANDS & set(args)):
            time.sleep(CTL_LATENCY_S)
            r = ctl_here(["--socket", str(self.sock), *args])
        else:
            argv = [str(VENV_BIN / "laminarctl"), "--socket", str(self.sock), *args]
            r = subprocess.run(self.argv(*argv), text=True, capture_output=True, timeout=timeout or 60.0, input=input)
        if check and r.returncode != 0:
            raise AssertionError(f"laminarctl {' '.join(args)} exited {r.returncode}: {r.stderr}\n--- agent log ---\n{self.log()}")
        return r

    def json(self, *args: str) -> Any:
        return json.loads(self.ctl("-o", "json", *args).stdout)

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 30 s, or at once when Ctrl-C interrupts the wait (raised again)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            except KeyboardInterrupt:
                self.proc.kill()
                self.proc.wait(10)
                raise
        return self.proc.returncode

    def cleanup(self) -> None:
        """Stops the agent and removes its jobs, data plane, pins and cgroups (every step, also
        when one fails or Ctrl-C arrives: :func:`cleanup_all`)."""
        cleanup_all(
            self.stop,
            lambda: subprocess.run(self.argv(str(VENV_BIN / "laminarctl"), "--socket", str(self.sock), "bpf", "unload",
                                             "--force", "--config", str(self.config_path)),
                                   capture_output=True, timeout=60),
            lambda: shutil.rmtree(self.pin_root, ignore_errors=True),
            lambda: remove_cgroup_tree(self.cgroup_root),
            lambda: shutil.rmtree(self.sock.parent, ignore_errors=True))


def _kill_and_rmdir(d: Path) -> None:
    for child in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _kill_and_rmdir_one(child)
    _kill_and_rmdir_one(d)


def _kill_and_rmdir_one(d: Path) -> None:
    kill = d / "cgroup.kill"
    if kill.exists():
        try:
            kill.write_text("1")
        except OSError:
            pass
    procs = d / "cgroup.procs"
    tasks = d / "tasks"
    for f in (procs, tasks):
        if f.exists():
            try:
                for pid in f.read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            except OSError:
                pass
    freezer = d / "freezer.state"
    if freezer.exists():
        try:
            freezer.write_text("THAWED")
        except OSError:
            pass
    for _ in range(50):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


def remove_cgroup_tree(name: str) -> None:
    """Removes /sys/fs/cgroup/*/<name> trees (only names with the test prefix)."""
    assert name.startswith("laminar-t-"), name
    for hier in Path("/sys/fs/cgroup").iterdir():
        d = hier / name
        if d.is_dir():
            _kill_and_rmdir(d)


# laminarctl commands that do their work here, not only through the agent's socket: ``bpf unload
# --force`` unloads offline (the agent's filters, in its network namespace), ``sim`` runs the
# simulator. They run as a process in the agent's namespace, as a user runs them.
LOCAL_COMMANDS = frozenset({"bpf", "sim"})
# A wait before each in-process call (none by default). The suite was written against laminarctl
# processes (0.21 s to start idle here, ~0.4 s on a loaded CI VM), and tests that read one field
# right after waiting for another relied on that gap where the agent updated the two a moment
# apart (a moved job read `migrated` before its move said `done`: fixed in the agent since; an
# archive's tombstone, Airlock's kill -9 test: those tests wait for what they check now).
# LM_T_CTL_LATENCY_S=0.2 brings the gap back, to tell such a read from a real failure.
CTL_LATENCY_S = float(os.environ.get("LM_T_CTL_LATENCY_S", "0"))


def ctl_here(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """laminarctl's own ``main`` run in this process, its stdout and stderr captured: what the
    command prints and the status it exits with, as a ``laminarctl`` process would give them
    (the CLI is a client of the agent's Unix socket, which any network namespace reaches; as
    root, the same caller as that process). A process per call cost about 0.2 s of CPU, and tests
    poll an agent's state every 0.1 s: a core spent starting interpreters beside the agents under
    test. The CLI's own process (its entry point, exit codes, other users) is tested as a process
    (tests/kernel/test_ctl_exit_codes.py, ``user=``, ``input=``)."""
    import io

    from laminarctl.main import main as ctl

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = ctl(list(argv))
        except SystemExit as e:  # argparse's usage errors, --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return subprocess.CompletedProcess(["laminarctl", *argv], code, out.getvalue(), err.getvalue())


def ctl_as(uid: int, argv: list[str], input: str | None = None) -> subprocess.CompletedProcess[str]:
    """laminarctl run in a forked child that dropped to `uid` (gid the same, no groups).

    The child does not exec: the checkout may sit in a directory only root can enter (a CI
    clone under a 0700 temp dir), so everything the CLI needs is imported and warmed up here,
    as root, before the fork."""
    from rich.cells import cell_len

    from laminarctl import output
    from laminarctl.main import build_parser
    from laminarctl.main import main as ctl

    build_parser()
    ctl(["--socket", "/nonexistent/laminard.sock", "status"])  # warms up the error path's imports
    # rich loads its unicode width tables lazily, on the first table it lays out: do it here.
    cell_len("status ü 漢")
    output.table([{"k": "ü", "v": 1.5}], ["k", "v"], title="warm-up")
    output.kv({"k": [1], "v": None}, title="warm-up")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 99
        try:
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):  # else stdin never reaches EOF
                os.close(fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            import sys

            # pytest captures by swapping the sys streams: point them back at the real fds.
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            code = ctl(argv)
        finally:
            try:
                import sys

                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    for fd in (out_w, err_w, in_r):
        os.close(fd)
    with os.fdopen(in_w, "w") as f:
        f.write(input or "")
    with os.fdopen(out_r) as fo, os.fdopen(err_r) as fe:
        out, err = fo.read(), fe.read()
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(["laminarctl", *argv], os.waitstatus_to_exitcode(status), out, err)


def api_request(sock: Path, method: str, path: str, body: str | bytes | None = None,
                timeout: float = 20.0) -> tuple[int, bytes]:
    """One raw HTTP/1.1 request to a laminard's control socket, bypassing laminarctl's own input
    checks (a body laminarctl would refuse, an answer it would not show): (status, raw body)."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(sock))
        data = body.encode() if isinstance(body, str) else (body or b"")
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: laminar\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    finally:
        s.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


def api_json(sock: Path, method: str, path: str, body: str | bytes | None = None,
             timeout: float = 20.0) -> tuple[int, Any]:
    """:func:`api_request` with the answer parsed as JSON."""
    status, payload = api_request(sock, method, path, body, timeout)
    return status, json.loads(payload)


def wait_until(fn: Callable[[], Any], timeout: float, what: str, diag: Callable[[], str] = lambda: "") -> Any:
    """Polls ``fn`` every 0.1 s until it returns something true (returned); fails the test after
    ``timeout`` s naming ``what``, with ``diag()`` (e.g. the agent's story) appended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{diag()}")


@contextlib.contextmanager
def jobkit_base(prefix: str) -> Iterator[Path]:
    """A fresh directory ``/tmp/<prefix>...`` that other users may traverse (0711; pytest's tmp
    is root's alone), for agents' state directories whose jobs run as another user, with jobkit
    under ``lib/`` where that user can read it (the checkout may sit under a directory closed to
    them: a fresh clone under a 0700 temporary directory); such a job puts ``<base>/lib`` first
    on its ``sys.path``. Removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        os.chmod(d, 0o711)
        lib = d / "lib" / "laminar"
        lib.mkdir(parents=True)
        (lib / "__init__.py").write_text("")
        shutil.copy(REPO / "agent" / "laminar" / "jobkit.py", lib / "jobkit.py")
        for p in (d / "lib", lib):
            os.chmod(p, 0o755)
        for f in lib.iterdir():
            os.chmod(f, 0o644)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def agent_factory(tmp: Path, veth: Any, default_toml: str) -> Iterator[Callable[..., AgentProc]]:
    """``make(extra_toml=default_toml)`` starts a laminard on ``veth``'s end A; every agent made
    is cleaned up on exit, also when the test fails."""
    made: list[AgentProc] = []

    def make(extra_toml: str = default_toml) -> AgentProc:
        a = AgentProc(tmp, veth.ifname_a, veth.a, extra_toml=extra_toml)
        made.append(a)
        a.start()
        return a

    try:
        yield make
    finally:
        for a in made:
            a.cleanup()
