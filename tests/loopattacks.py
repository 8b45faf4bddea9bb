"""Attacks a local user makes on the agent's event loop and on the state it keeps for them.

Each attack runs in a forked child that dropped to a real local user (tests/userrig.py
``local_user``: its uid, gid and groups), so the agent sees that user through SO_PEERCRED (the
control socket) or, for the metrics port, as the owner of the connecting socket. The child
speaks raw HTTP, as an attacker would (no laminarctl input checks in the way), and reports what
it saw: the status codes, the first error texts, how many connections it held.

Used by tests/kernel/test_security_loop.py (which asserts the refusals and that root's
``status`` and kill-switch stay live: tests/liveness.py) and by bench/diag/loop_stall.py (which
measures how long each attack held the agent's loop, before and after the fixes).

    with attacker(user, netns) as run:
        out = run(memory_regex, sock, 16_000)     # {"codes": {"400": 1}, "errors": [...]}
"""

from __future__ import annotations

import contextlib
import ctypes
import encodings.idna  # noqa: F401 - the children, dropped to a user, may not read the stdlib's files
import json
import os
import resource
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000


def raw_request(sock: str | Path | tuple[str, int], method: str, path: str, body: bytes | str | None = None,
                timeout: float = 120.0) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a Unix socket path or a TCP (host, port): (status, body). Status 0
    with the error's text as the body when the connection failed or was closed unanswered."""
    data = body.encode() if isinstance(body, str) else (body or b"")
    fam = socket.AF_INET if isinstance(sock, tuple) else socket.AF_UNIX
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock if isinstance(sock, tuple) else str(sock))
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: laminar\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        raw = b""
        while chunk := s.recv(1 << 20):
            raw += chunk
    except OSError as e:
        return 0, repr(e).encode()
    finally:
        s.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    try:
        return int(head.split()[1]), payload
    except (IndexError, ValueError):
        return 0, raw[:200]


def _tally(results: list[tuple[int, bytes]]) -> dict[str, Any]:
    codes = Counter(str(c) for c, _ in results)
    errors = []
    for c, raw in results:
        if c >= 400 or c == 0:
            try:
                errors.append(json.loads(raw).get("error", "")[:300])
            except (ValueError, AttributeError):
                errors.append(raw[:300].decode("latin-1"))
    return {"codes": dict(codes), "errors": errors[:8]}


def _parallel(n: int, fn: Callable[[], tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    lock = threading.Lock()

    def one() -> None:
        r = fn()
        with lock:
            out.append(r)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# -- the attacks (each runs as the user, in the child) ------------------------------------------

def submit(sock: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One POST /v1/jobs with `spec` as given."""
    return _tally([raw_request(sock, "POST", "/v1/jobs", json.dumps(spec))])


def submit_placement(sock: str, body: dict[str, Any]) -> dict[str, Any]:
    """One POST /v1/placements with `body`; the answer's outcome and reason are in ``answers``."""
    code, raw = raw_request(sock, "POST", "/v1/placements", json.dumps(body), timeout=300)
    out = _tally([(code, raw)])
    with contextlib.suppress(ValueError):
        out["answers"] = [json.loads(raw)]
    return out


def submit_many(sock: str, spec: dict[str, Any], count: int) -> dict[str, Any]:
    """`count` POST /v1/jobs one after the other; the ids of the jobs made in ``ids``."""
    results = [raw_request(sock, "POST", "/v1/jobs", json.dumps(spec)) for _ in range(count)]
    out = _tally(results)
    out["ids"] = [json.loads(raw)["id"] for code, raw in results if code == 201]
    return out


def submit_parallel(sock: str, spec: dict[str, Any], count: int) -> dict[str, Any]:
    """`count` POST /v1/jobs at once."""
    body = json.dumps(spec)
    return _tally(_parallel(count, lambda: raw_request(sock, "POST", "/v1/jobs", body)))


def memory_regex(sock: str, spaces: int) -> dict[str, Any]:
    """C1: a memory size whose spaces the old size regex backtracked over (O(n^2) on the loop)."""
    return submit(sock, {"command": ["/bin/true"], "memory": "1" + " " * spaces + "x"})


def huge_numbers(sock: str) -> dict[str, Any]:
    """M3: numbers past every range and characters int() cannot read, in each field that
    takes a number: each must be a 400 naming the value, never a 500."""
    bodies = [
        ("/v1/jobs", {"command": ["/bin/true"], "memory": "9" * 400}),
        ("/v1/jobs", {"command": ["/bin/true"], "memory": "9" * 400 + "G"}),
        ("/v1/jobs", {"command": ["/bin/true"], "memory_mb": 10 ** 400}),
        ("/v1/jobs", {"command": ["/bin/true"], "gpus": "²"}),
        ("/v1/jobs", {"command": ["/bin/true"], "gpus": "1" * 5000}),
        ("/v1/jobs", {"command": ["/bin/true"], "cpus": 10 ** 400}),
        ("/v1/jobs", {"command": ["/bin/true"], "priority": 10 ** 400}),
        ("/v1/jobs", {"command": ["/bin/true"], "elastic_min": 1, "elastic_max": 10 ** 12}),
        ("/v1/placements", {"spec": {"command": ["/bin/true"]}, "memory_mb": "1e400"}),
        ("/v1/placements", {"spec": {"command": ["/bin/true"]}, "gpu_model": []}),
        ("/v1/placements", {"spec": {"command": ["/bin/true"]}, "pool": {}}),
        ("/v1/placements", {"spec": {"command": ["/bin/true"]}, "gpus": "²"}),
        ("/v1/placements", {"spec": {"command": ["/bin/true"]}, "cpus": 10 ** 400}),
        ("/v1/placements", {"spec": {"command": ["/bin/true"], "memory": "9" * 400}}),
    ]
    out = []
    for path, body in bodies:
        text = json.dumps(body).replace('"1e400"', "1e400")  # a JSON number Python reads as inf
        out.append(raw_request(sock, "POST", path, text))
    return _tally(out)


def policy_dotted(sock: str, chars: int) -> dict[str, Any]:
    """C2: dotted TOML keys (the parser is quadratic in them) to the unprivileged validate."""
    text = "a" + ".a" * (chars // 2) + " = 1"
    return _tally([raw_request(sock, "POST", "/v1/policy/validate", json.dumps({"text": text}))])


def policy_nested(sock: str, depth: int = 100_000) -> dict[str, Any]:
    """M3: arrays nested past Python's recursion limit (a RecursionError: 500 before)."""
    text = "a = " + "[" * depth + "]" * depth
    return _tally([raw_request(sock, "POST", "/v1/policy/validate", json.dumps({"text": text}))])


def policy_parallel(sock: str, n: int, chars: int) -> dict[str, Any]:
    """n validations at once, each with dotted keys of `chars` characters."""
    text = "a" + ".a" * (chars // 2) + " = 1"
    body = json.dumps({"text": text})
    return _tally(_parallel(n, lambda: raw_request(sock, "POST", "/v1/policy/validate", body)))


def big_env_jobs(sock: str, count: int, env_bytes: int, names: int = 1000) -> dict[str, Any]:
    """H3: `count` sleeping jobs, each with an env of about `env_bytes` in `names` entries (the
    per-spec caps allow 1024 names and 64 KiB: this is the most a user may send)."""
    per = max(0, env_bytes // names - 8)
    env = {f"E{i}": "v" * per for i in range(names)}
    spec = json.dumps({"command": ["/bin/sleep", "600"], "env": env})
    return _tally([raw_request(sock, "POST", "/v1/jobs", spec) for _ in range(count)])


def get_many(sock: str | tuple[str, int], path: str, conns: int, rounds: int = 1) -> dict[str, Any]:
    """`conns` connections at once, each asking GET `path` `rounds` times."""
    def one() -> tuple[int, bytes]:
        last: tuple[int, bytes] = (0, b"")
        for _ in range(rounds):
            last = raw_request(sock, "GET", path)
        return last[0], last[1][:2000]
    return _tally(_parallel(conns, one))


def hammer(sock: str, path: str, conns: int, seconds: float) -> dict[str, Any]:
    """`conns` connections asking GET `path` in a loop for `seconds`: how many were answered."""
    end = time.monotonic() + seconds
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def one() -> tuple[int, bytes]:
        while time.monotonic() < end:
            c, _ = raw_request(sock, "GET", path, timeout=30)
            with lock:
                counts[str(c)] += 1
        return 200, b""
    _parallel(conns, one)
    return {"codes": dict(counts), "errors": []}


def idle_connections(addr: str | tuple[str, int], count: int, hold_s: float, payload: bytes = b"") -> dict[str, Any]:
    """Opens up to `count` connections to `addr` (a Unix path or a TCP (host, port)), sends
    `payload` on each (nothing: idle) and holds them `hold_s`; then says how many connected,
    how many the agent closed while they were held and what it answered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 64)), hard))
    held: list[socket.socket] = []
    failed = 0
    for _ in range(count):
        fam = socket.AF_INET if isinstance(addr, tuple) else socket.AF_UNIX
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(addr if isinstance(addr, tuple) else str(addr))
            if payload:
                s.sendall(payload)
        except OSError:
            failed += 1
            s.close()
            continue
        held.append(s)
    time.sleep(hold_s)
    closed = 0
    answers: Counter[str] = Counter()
    for s in held:
        s.setblocking(False)
        try:
            data = s.recv(4096)
            if data:
                answers[data.split(b"\r\n", 1)[0].decode("latin-1")[:60]] += 1
            closed += 1  # an answer or EOF: the agent is done with it
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    return {"connected": len(held), "failed": failed, "closed_by_agent": closed, "answers": dict(answers)}


def follow_no_read(sock: str, count: int, hold_s: float) -> dict[str, Any]:
    """`count` event streams (follow=1) whose reader never reads, held `hold_s`; then reads
    each and says how it ended (the last line the agent sent, whether it closed)."""
    held = []
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(str(sock))
        s.sendall(b"GET /v1/events?follow=1 HTTP/1.1\r\nHost: laminar\r\n\r\n")
        held.append(s)
    time.sleep(hold_s)
    ends: Counter[str] = Counter()
    for s in held:
        raw = b""
        closed = False
        until = time.monotonic() + 3.0  # what the agent sent, and whether it closed: read for 3 s at most
        try:
            while time.monotonic() < until:
                s.settimeout(max(0.01, until - time.monotonic()))
                chunk = s.recv(1 << 20)
                if not chunk:
                    closed = True
                    break
                raw += chunk
        except OSError:
            pass
        lines = [ln for ln in raw.split(b"\n") if ln.strip()]
        last = lines[-1][:200].decode("latin-1") if lines else ""
        kind = ""
        with contextlib.suppress(ValueError, AttributeError):
            kind = json.loads(last).get("kind", "")
        ends[f"closed={closed} last={kind or last[:40]}"] += 1
        s.close()
    return {"ends": dict(ends)}


# -- running them as a user ---------------------------------------------------------------------

def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


class Running:
    """An attack running in its child: :meth:`result` waits for it (and kills it past `timeout`)."""

    def __init__(self, pid: int, fd: int, what: str) -> None:
        self.pid, self.fd, self.what = pid, fd, what

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        import select

        out = b""
        deadline = time.monotonic() + timeout
        with os.fdopen(self.fd, "rb") as f:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([f], [], [], left)[0]:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    raise TimeoutError(f"attack {self.what} still running after {timeout} s")
                chunk = os.read(f.fileno(), 1 << 16)
                if not chunk:
                    break
                out += chunk
        os.waitpid(self.pid, 0)
        res = json.loads(out or b"{}")
        if "exception" in res:
            raise RuntimeError(f"attack {self.what} failed in its child: {res['exception']}")
        return res

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def start_as(user: Any, netns: str | None, fn: Callable[..., dict[str, Any]], *args: Any) -> Running:
    """Starts ``fn(*args)`` in a forked child that entered network namespace `netns` (a
    /run/netns path; None: this one) and dropped to `user` (a userrig.User)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.close(r)
            if netns:
                _setns(netns)
            os.setgroups(list(user.groups))
            os.setgid(user.gid)
            os.setuid(user.uid)
            try:
                res = fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                res = {"exception": repr(e)}
            os.write(w, json.dumps(res).encode())
        finally:
            os._exit(0)
    os.close(w)
    return Running(pid, r, getattr(fn, "__name__", "attack"))


def run_as(user: Any, netns: str | None, fn: Callable[..., dict[str, Any]], *args: Any,
           timeout: float = 600.0) -> dict[str, Any]:
    return start_as(user, netns, fn, *args).result(timeout)


@contextlib.contextmanager
def attacker(user: Any, netns: str | None = None) -> Iterator[Callable[..., dict[str, Any]]]:
    """``run(fn, *args)`` runs an attack as `user` and returns its report."""
    yield lambda fn, *args, **kw: run_as(user, netns, fn, *args, **kw)


def agent_threads(pid: int) -> int:
    """The agent's thread count (``Threads:`` of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def agent_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def laminard_pid(agent: Any) -> int:
    """The laminard process of an AgentProc (its Popen runs nsenter, which execs laminard)."""
    return int(agent.proc.pid)
