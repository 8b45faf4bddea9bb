"""Control-group membership is decided from the caller's groups at connect(), not from its pid later.

The authorizer used to read the supplementary groups of the pid that ``SO_PEERCRED`` reported,
from ``/proc/<pid>/status``, when the request was dispatched. That pid is only the process that
called connect(): it may have exited since (after handing the socket to another process, or
with the socket inherited by a child), and once its pid was reused by a process that happens to
be in the control group (an operator's shell, a cron job), an unprivileged user's connection
passed for a member's: a kill-switch flip, a policy change or ``bpf unload`` by anyone who can
cycle pids. Now the groups come from ``SO_PEERGROUPS``, which the kernel records at connect()
with the uid and gid.

The pid reuse is made to happen here (the test writes ``/proc/sys/kernel/ns_last_pid``, as pid
wrap-around would by chance); the second uid is ``nobody``, and the control group a group of
the test's own (``lm-s7-h5``), removed afterwards.
"""

from __future__ import annotations

import asyncio
import grp
import os
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from laminar.api import ApiServer, Authorizer, Request, Route

# serial: it steers the kernel's next pid (ns_last_pid), which any other test's fork would take
pytestmark = [pytest.mark.kernel, pytest.mark.serial]

GROUP = "lm-s7-h5"
NOBODY = 65534


@pytest.fixture
def control_gid() -> Iterator[int]:
    subprocess.run(["groupadd", "--system", GROUP], check=True, capture_output=True)
    try:
        yield grp.getgrnam(GROUP).gr_gid
    finally:
        subprocess.run(["groupdel", GROUP], capture_output=True)


@pytest.fixture
def server(control_gid: int) -> Iterator[Path]:
    """An ApiServer with one privileged route, on its own loop in a thread (socket in a directory
    nobody can enter: pytest's tmp_path is root's only)."""
    path = Path(f"/run/lm-s7-h5-{secrets.token_hex(3)}/api.sock")
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def priv(req: Request) -> dict[str, Any]:
        return {"done": True, "uid": req.peer.uid}

    async def main() -> None:
        srv = ApiServer(path, Authorizer(GROUP))
        srv.add([Route("POST", "/v1/priv", priv, privileged=True)])
        await srv.start()
        state["loop"] = asyncio.get_running_loop()
        state["stop"] = asyncio.Event()
        ready.set()
        await state["stop"].wait()
        await srv.stop()

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield path
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        t.join(10)
        shutil.rmtree(path.parent, ignore_errors=True)


def _exchange(s: socket.socket) -> int:
    """The status of a privileged request on `s` (read up to the end of the header: a forked
    process of this test may hold a copy of the server's end, so EOF may never come)."""
    s.settimeout(30)
    s.sendall(b"POST /v1/priv HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    raw = b""
    while b"\r\n\r\n" not in raw and (chunk := s.recv(65536)):
        raw += chunk
    return int(raw.split()[1])


def _connect_as(path: Path, uid: int, gid: int, groups: list[int]) -> tuple[socket.socket, int]:
    """A connection made by a child process running as uid/gid/groups, which then exits.
    Returns the connected socket (passed back to us) and the child's pid (now free)."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            ours.close()
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(path))
            socket.send_fds(theirs, [b"x"], [c.fileno()])
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    ours.close()
    os.waitpid(pid, 0)
    return socket.socket(fileno=fds[0]), pid


def _member_at_pid(target: int, gid: int) -> tuple[int, int] | None:
    """Forks a process in the control group (supplementary) that lands on pid `target`; returns
    (pid, fd to close to end it), or None when another process took the pid first."""
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(target - 1))
    pid = os.fork()
    if pid == 0:
        try:
            os.close(w)
            os.close(ready_r)
            os.setgroups([gid])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(ready_w, b"1")
            os.read(r, 1)
        finally:
            os._exit(0)
    os.close(r)
    os.close(ready_w)
    os.read(ready_r, 1)
    os.close(ready_r)
    if pid != target:
        os.close(w)
        os.waitpid(pid, 0)
        return None
    return pid, w


def test_a_reused_pid_does_not_lend_its_groups_to_an_earlier_connection(server: Path, control_gid: int) -> None:
    for _ in range(20):
        conn, attacker_pid = _connect_as(server, NOBODY, NOBODY, [])
        member = _member_at_pid(attacker_pid, control_gid)
        if member is None:
            conn.close()
            continue
        try:
            groups = Path(f"/proc/{attacker_pid}/status").read_text()
            assert f"\t{control_gid}" in groups or f" {control_gid}" in groups  # the pid is the member's now
            status = _exchange(conn)
        finally:
            conn.close()
            os.close(member[1])
            os.waitpid(member[0], 0)
        assert status == 403, (f"uid {NOBODY} with no groups was let through a privileged route because pid "
                               f"{attacker_pid}, which connected, is now a process of group {GROUP}")
        return
    pytest.skip("could not place a process on the freed pid (the machine is busy forking)")


def test_a_member_by_supplementary_group_is_allowed_even_after_it_exits(server: Path, control_gid: int) -> None:
    conn, _ = _connect_as(server, NOBODY, NOBODY, [control_gid])
    try:
        assert _exchange(conn) == 201
    finally:
        conn.close()
    conn, _ = _connect_as(server, NOBODY, NOBODY, [])
    try:
        assert _exchange(conn) == 403
    finally:
        conn.close()
    # more groups than Python's getsockopt can take in one call (256)
    many = [g for g in range(200_000, 200_400)] + [control_gid]
    conn, _ = _connect_as(server, NOBODY, NOBODY, many)
    try:
        assert _exchange(conn) == 201
    finally:
        conn.close()
