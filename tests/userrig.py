"""Test helpers: real local users for the tests that need another uid, and API calls made as them.

``local_user(tag)`` creates a system user ``lm-s7-<tag>-<hex>`` with a group of its own (and,
with ``extra_group``, a second group ``lm-s7g-<hex>`` it is a member of) and deletes both
afterwards, also when the test fails. ``call_as(user, sock, method, path, body)`` makes one
request to a laminard's control socket from a forked child that has dropped to that user (its
uid, primary gid and supplementary groups), so the agent sees the user's real credentials
through SO_PEERCRED. ``read_as(user, path)`` says whether that user (or a bare uid: its gid the
same, no supplementary groups) could open a file, also from a forked child that dropped to it.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentproc import api_request


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def _retry(argv: list[str]) -> None:
    """useradd/groupadd/userdel, retried: another test on this machine may hold /etc/passwd's lock."""
    last = ""
    for _ in range(50):
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode == 0:
            return
        last = r.stderr
        if "lock" not in last and "busy" not in last and "currently used" not in last:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{' '.join(argv)}: {last}")


@contextlib.contextmanager
def local_user(tag: str, extra_group: bool = False) -> Iterator[User]:
    name = f"lm-s7-{tag}-{secrets.token_hex(2)}"
    gname = f"lm-s7g-{secrets.token_hex(3)}"
    made_group = False
    try:
        if extra_group:
            _retry(["groupadd", gname])
            made_group = True
        _retry(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group",
                *(["--groups", gname] if extra_group else []), name])
        pw = pwd.getpwnam(name)
        groups = (pw.pw_gid, *((grp.getgrnam(gname).gr_gid,) if extra_group else ()))
        yield User(name, pw.pw_uid, pw.pw_gid, groups)
    finally:
        with contextlib.suppress(KeyError, RuntimeError):
            uid = pwd.getpwnam(name).pw_uid
            # what still runs as the user (a job a test's agent started, not stopped yet) would
            # make userdel refuse ("currently used by process"): the user was left behind
            subprocess.run(["pkill", "-KILL", "-U", str(uid)], capture_output=True)
            try:
                _retry(["userdel", name])
            except RuntimeError:
                # still "used by process" after the retries (a killed process not reaped yet): the
                # user goes anyway, so no lm-s7-* user is left on the machine (a CI run left one)
                _retry(["userdel", "--force", name])
        with contextlib.suppress(KeyError, RuntimeError):
            grp.getgrnam(name)
            _retry(["groupdel", name])
        if made_group:
            with contextlib.suppress(KeyError, RuntimeError):
                grp.getgrnam(gname)
                _retry(["groupdel", gname])


def _request(sock: Path, method: str, path: str, body: Any) -> tuple[int, bytes]:
    return api_request(sock, method, path, None if body is None else json.dumps(body), timeout=60)


def call_as(user: User | None, sock: Path, method: str, path: str, body: Any = None) -> tuple[int, Any, bytes]:
    """(status, parsed JSON, raw body bytes) of one request made as `user` (None: as root)."""
    if user is None:
        status, raw = _request(sock, method, path, body)
        return status, json.loads(raw), raw
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups(list(user.groups))
            os.setgid(user.gid)
            os.setuid(user.uid)
            status, raw = _request(sock, method, path, body)
            with os.fdopen(w, "wb") as f:
                f.write(status.to_bytes(2, "big") + raw)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    _, st = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(st) != 0 or len(out) < 2:
        raise RuntimeError(f"request {method} {path} as {user.name} failed in the child (exit {st})")
    raw = out[2:]
    return int.from_bytes(out[:2], "big"), json.loads(raw), raw


def read_as(user: User | int, path: Path) -> str:
    """'read' when ``user`` could open and read ``path``, else the error's text (``os.strerror``:
    "Permission denied", ...), from a forked child that dropped to it. ``user`` an int: that uid
    with the gid of the same number and no supplementary groups."""
    uid, gid, groups = (user, user, []) if isinstance(user, int) else (user.uid, user.gid, list(user.groups))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        out = b"?"
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                with open(path, "rb") as fh:
                    fh.read(1)
                out = b"read"
            except OSError as e:
                out = (os.strerror(e.errno) if e.errno else str(e)).encode()
        finally:
            os.write(w, out)
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        got = fh.read().decode()
    os.waitpid(pid, 0)
    return got
