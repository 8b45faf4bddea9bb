"""The control socket under a flood of idle connections from an unprivileged user (real laminard).

Any local user may connect to the control socket (0666). The server used to wait for a
request's bytes with no time limit and no bound on the connections it held open, so one
unprivileged user who opened connections and sent nothing (or half a request line) used up
the agent's file descriptors (1024 under systemd's default soft limit): the agent could no
longer accept, so root's ``laminarctl killswitch on`` went unanswered, and every component
that opens a file (a cgroup's ``cgroup.freeze``, a PSI trigger, the store) failed with EMFILE.
Now a caller that is neither root nor in the control group has a bounded number of open
connections (the ones past it are answered 503 and closed at once), and every request must
arrive whole within ``[agent] request_timeout_s`` (10 s; 1 s for the agent of the test that waits
for it).

The agent is started with an open-files limit of 1024 that it cannot raise (soft = hard; the agent
raises its soft limit to the hard one at start): what one user's connections may take is bounded
by the agent, not by a large limit.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import resource
import signal
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import NOBODY, AgentProc, api_json
from userrig import User, local_user

# serial: it floods the agent with connections and needs the machine's CPUs to itself to mean anything
pytestmark = [pytest.mark.kernel, pytest.mark.serial]

SOFT_NOFILE = 1024  # systemd's default soft limit for a service (DefaultLimitNOFILE=1024:524288), as the hard one
REQUEST_TIMEOUT_S = 1.0  # [agent] request_timeout_s of the agent that must drop a request (default 10)


@pytest.fixture
def agent(veth_pair: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[AgentProc]:
    """A laminard whose RLIMIT_NOFILE is 1024, soft and hard; a test parametrizing ``agent`` (indirect) gives
    more ``[agent]`` keys."""
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a, agent_toml=getattr(request, "param", ""))
    try:
        a.start(prefix=("prlimit", f"--nofile={SOFT_NOFILE}:{SOFT_NOFILE}"))
        yield a
    finally:
        a.cleanup()


def flood_as(uid: int, sock: Path, count: int) -> tuple[int, int, int]:
    """Forks a child that drops to `uid`, opens up to `count` connections to `sock`, sends half a
    request line on each and holds them. Returns (child pid, fd to close to let it go, connections
    made). The child stops early once the agent accepts no more for 3 s."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.close(ready_r)
            os.close(hold_w)
            resource.setrlimit(resource.RLIMIT_NOFILE, (count + 256, count + 256))
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            held: list[socket.socket] = []
            stuck_since: float | None = None
            while len(held) < count:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(str(sock))
                except BlockingIOError:  # the backlog is full: the agent is not accepting
                    s.close()
                    stuck_since = stuck_since or time.monotonic()
                    if time.monotonic() - stuck_since > 3:
                        break
                    time.sleep(0.01)
                    continue
                stuck_since = None
                try:
                    s.send(b"GET /v1/status HTTP/1.1\r\n")
                except OSError:
                    pass
                held.append(s)
            os.write(ready_w, f"{len(held)}\n".encode())
            os.read(hold_r, 1)  # until the parent closes its end
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(hold_r)
    with os.fdopen(ready_r) as f:
        made = int(f.readline() or "0")
    return pid, hold_w, made


def test_idle_connections_of_an_unprivileged_user_do_not_lock_root_out(agent: AgentProc) -> None:
    status = agent.json("status")
    agent_pid = status["agent"]["pid"]
    assert f"{SOFT_NOFILE}" in Path(f"/proc/{agent_pid}/limits").read_text()
    child, hold, made = flood_as(NOBODY, agent.sock, SOFT_NOFILE + 200)
    try:
        assert made > 0
        # root (the operator) must still be served: a kill-switch request is exactly this.
        try:
            code, out = api_json(agent.sock, "GET", "/v1/status", None, timeout=20)
        except (TimeoutError, OSError) as e:
            fds = len(os.listdir(f"/proc/{agent_pid}/fd"))
            pytest.fail(f"root's request went unanswered ({e!r}) while uid {NOBODY} held {made} idle "
                        f"connections; the agent has {fds} fds open (soft limit {SOFT_NOFILE})")
        assert code == 200, out
        assert out["agent"]["pid"] == agent_pid
        fds = len(os.listdir(f"/proc/{agent_pid}/fd"))
        assert fds < SOFT_NOFILE // 2, f"the agent holds {fds} fds for one user's idle connections"
        # the unprivileged user itself is refused with a reason past its share, not hung
        r = agent.ctl("status", user=NOBODY, check=False, timeout=30)
        assert r.returncode != 0 and "busy" in r.stderr, (r.returncode, r.stderr)
    finally:
        os.close(hold)
        os.waitpid(child, 0)
    # once the flood is gone the same user is served again
    r = agent.ctl("status", user=NOBODY, check=False, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("agent", [f"request_timeout_s = {REQUEST_TIMEOUT_S}\n"], indirect=True, ids=["timeout-1s"])
def test_a_request_that_never_completes_is_dropped(agent: AgentProc) -> None:
    """Half a request line, then silence: the agent answers 408 and closes, it does not wait forever."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(REQUEST_TIMEOUT_S + 20)
    try:
        s.connect(str(agent.sock))
        s.sendall(b"POST /v1/killswitch HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        raw = b""
        try:
            while chunk := s.recv(65536):
                raw += chunk
        except TimeoutError:
            pytest.fail("the agent held a request that never completed for longer than its timeout")
        except OSError as e:
            assert e.errno == errno.ECONNRESET, e
    finally:
        s.close()
    assert raw.split()[1] == b"408", raw
    assert f"within {REQUEST_TIMEOUT_S:g} s".encode() in raw, raw  # the configured timeout, not the default


def _connect_loop(user: User, sock: Path) -> int:
    """Forks a child that, as `user`, connects to `sock` and hangs up in a loop until killed."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups(list(user.groups))
            os.setgid(user.gid)
            os.setuid(user.uid)
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                with contextlib.suppress(OSError):
                    s.connect(str(sock))
                s.close()
        finally:
            os._exit(0)
    return pid


def _as_user(user: User, fn: Callable[[], str]) -> str:
    """What `fn` returns (a line of text), run in a forked child that dropped to `user`'s uid,
    primary gid and groups."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = "child failed"
        try:
            os.close(r)
            os.setgroups(list(user.groups))
            os.setgid(user.gid)
            os.setuid(user.uid)
            try:
                out = fn()
            except Exception as e:
                out = f"{type(e).__name__}: {e}"
        finally:
            os.write(w, out.encode()[:4000])
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def test_a_user_connecting_in_a_loop_does_not_crowd_root_or_the_control_group_out(veth_pair: Any,
                                                                                   tmp_path: Path) -> None:
    """One local user connects and hangs up in a loop (six processes): the public socket's queue of
    connections not yet accepted stays full however fast the agent answers. root's and a control
    group member's laminarctl used to fail at once ("internal error: BlockingIOError") whenever they
    met the full queue; now they are served on the admin socket, which the flooder cannot open, and
    another unprivileged user waits for room instead of failing."""
    from laminarctl.client import Client

    with local_user("flood") as flooder, local_user("ops", extra_group=True) as member:
        group = grp.getgrgid(member.groups[1]).gr_name
        a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
        a.config_path.write_text(a.config_path.read_text().replace(
            'log_level = "debug"\n', f'log_level = "debug"\ncontrol_group = "{group}"\n'))
        kids: list[int] = []
        try:
            a.start()
            admin = Path(a.json("status")["agent"]["admin_socket"])
            st = admin.stat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, member.groups[1])
            kids = [_connect_loop(flooder, a.sock) for _ in range(6)]
            full = 0
            for _ in range(400):  # the flood does fill the public queue (else this test shows nothing)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(str(a.sock))
                except BlockingIOError:
                    full += 1
                finally:
                    s.close()
                if full >= 3:
                    break
                time.sleep(0.005)
            assert full >= 3, "the flood never filled the public socket's queue"
            # The flooder cannot reach the admin socket.
            assert "PermissionError" in _as_user(flooder, lambda: repr(socket.socket(socket.AF_UNIX).connect(str(admin))))
            # laminarctl's own main() run in this (root) process: the CLI's code, client and error
            # handling, without an interpreter start per call (seconds each while six flooders
            # hold the CI's two cores)
            failed = [err for code, err in (_ctl_here("--socket", str(a.sock), "status") for _ in range(20))
                      if code != 0]
            assert not failed, f"root's laminarctl failed {len(failed)} of 20 times during the flood: {failed[:2]}"

            def member_status() -> str:
                c = Client(str(a.sock))
                return ",".join(str(c.get("/v1/status")["agent"]["node"]) for _ in range(10))

            out = _as_user(member, member_status)
            assert out.split(",") == [a.json("status")["agent"]["node"]] * 10, out
            # Someone else outside the control group waits for room in the public queue and is served.
            r = a.ctl("status", user=NOBODY, check=False, timeout=120)
            assert r.returncode == 0, r.stderr
        finally:
            for k in kids:
                os.kill(k, signal.SIGKILL)
                os.waitpid(k, 0)
            a.cleanup()


def _ctl_here(*argv: str) -> tuple[int, str]:
    """laminarctl's main() in this process: (exit code, what it wrote to stderr)."""
    import io

    from laminarctl.main import main as ctl

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ctl(list(argv))
    return code, err.getvalue()


def _answer_on(path: Path, who: str) -> socket.socket:
    """A listening socket at `path` whose thread answers one JSON object naming `who` per connection."""
    import threading

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    os.chmod(path, 0o666)
    srv.listen(8)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                c.recv(65536)
                body = f'{{"who": "{who}"}}'.encode()
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_root_does_not_talk_to_an_admin_socket_another_user_put_in_a_shared_directory(tmp_path: Path) -> None:
    """agent.socket in a shared directory (/tmp): another user can put a socket of their own at
    the admin socket's path; laminarctl run by root must not send its requests there."""
    from laminar.config import admin_socket_path
    from laminarctl.client import Client

    shared = Path(f"/tmp/lm-t-shared-{os.getpid()}-{time.monotonic_ns() % 100000}")
    shared.mkdir(mode=0o1777)
    os.chmod(shared, 0o1777)
    public = shared / "laminard.sock"
    servers: list[socket.socket] = []
    try:
        with local_user("squat") as squatter:
            servers.append(_answer_on(public, "agent"))
            servers.append(_answer_on(Path(admin_socket_path(str(public))), "squatter"))
            os.chown(admin_socket_path(str(public)), squatter.uid, squatter.gid)
            assert Client(str(public), timeout=10).get("/v1/status") == {"who": "agent"}
    finally:
        for s in servers:
            s.close()
        import shutil

        shutil.rmtree(shared, ignore_errors=True)
