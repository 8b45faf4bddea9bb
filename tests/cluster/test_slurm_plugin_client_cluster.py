"""The SPANK plugin's HTTP client against agents that misbehave, at ``srun`` (the local check):
a stand-in agent (a Unix socket server in this test, named as such: a real laminard does not
hang or answer 70 KiB on purpose) listens at the plugin's socket path on the host, where the rig
leaves that path empty, and srun runs on the host against the rig's real Slurm.

- a silent agent: srun fails after the plugin's 10 s bound, naming it;
- an answer over 64 KiB: refused, named, not parsed;
- a refusal (403 with an ``error``): srun fails with that reason, JSON escapes decoded;
- an answer that is not JSON: refused, named;
- a stopped agent's socket (nobody listens): srun goes on, the node's agent decides;
- what the plugin sent: one POST /v1/jobs/adopt/check with the options and the caller's uid/gid.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from harness import Cluster
from slurmrig import SlurmRig, slurm_ready

pytestmark = pytest.mark.cluster

_reason = slurm_ready()
if _reason:  # in CI (CI=true) a cluster test that skips counts as failed (tests/conftest.py)
    pytestmark = [pytest.mark.cluster, pytest.mark.skip(reason=f"slurm rig: {_reason}")]


class StandinAgent:
    """A stand-in for laminard's control socket: answers each connection with ``answer`` (bytes,
    or None: reads the request and says nothing until the client closes), recording the
    requests. One connection at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.answer: bytes | None = b""
        self.requests: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.sock.listen(8)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(4096)
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = int([h.split(b":")[1] for h in head.split(b"\r\n")
                                  if h.lower().startswith(b"content-length")][0])
                    while len(body) < length:
                        body += conn.recv(4096)
                    self.requests.append(head + b"\r\n\r\n" + body)
                    if self.answer is None:  # silent until the client gives up and closes
                        conn.settimeout(30)
                        conn.recv(1)
                    else:
                        conn.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(10)
        self.path.unlink(missing_ok=True)


def http(status: int, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[tuple[SlurmRig, StandinAgent]]:
    with ExitStack() as stack:
        c = stack.enter_context(Cluster.create(tmp_path, zones=1, per_zone=1, gpus=0))
        s = stack.enter_context(SlurmRig.create(tmp_path, c))
        agent = StandinAgent(s.plugin_socket)  # on the host: the rig leaves this path empty there
        stack.callback(agent.close)
        yield s, agent


def test_the_plugins_client_is_bounded_and_reports_what_the_agent_said(standin):
    s, agent = standin
    srun = ("srun", "--laminar-class", "long-resident", "--laminar-priority", "70", "--laminar-checkpoint", "USR2",
            "true")
    # a refusal: the agent's reason, its JSON escapes decoded
    agent.answer = http(403, json.dumps({"error": "class \"long-resident\" is not yours: ask\u00e9 \\ 70",
                                         "other": [1, {"x": None}]}).encode())
    r = s.run(*srun, check=False)
    assert r.returncode != 0
    assert 'laminar: class "long-resident" is not yours: ask\u00e9 \\ 70' in r.stderr, r.stderr
    req = agent.requests[-1]
    head, _, body = req.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/jobs/adopt/check HTTP/1.1\r\n"), head
    assert json.loads(body) == {"scheduler": "slurm", "uid": 0, "gid": 0, "class": "long-resident", "priority": 70,
                                "checkpoint": "USR2"}
    # an answer over 64 KiB: not parsed
    agent.answer = http(200, b'{"ok": true, "pad": "' + b"x" * (70 << 10) + b'"}')
    r = s.run(*srun, check=False)
    assert r.returncode != 0 and "laminar: the agent's answer is over 65536 bytes" in r.stderr, r.stderr
    # not JSON
    agent.answer = http(200, b"<html>")
    r = s.run(*srun, check=False)
    assert r.returncode != 0 and "laminar: the agent's answer (HTTP 200) is not the JSON expected" in r.stderr
    # an error without a reason
    agent.answer = http(500, b"{}")
    r = s.run(*srun, check=False)
    assert r.returncode != 0 and "laminar: the agent refused (HTTP 500)" in r.stderr, r.stderr
    # silent: the 10 s bound, named
    agent.answer = None
    t0 = time.monotonic()
    r = s.run(*srun, check=False, timeout=40)
    took = time.monotonic() - t0
    assert r.returncode != 0 and "no answer from the agent at" in r.stderr and "10000 ms" in r.stderr, r.stderr
    assert 9.5 < took < 25, took
    # a yes: the local check passes (what the node's agent then says at the task's start is
    # test_slurm_adopt_cluster.py's)
    agent.answer = http(200, b'{"ok": true}')
    r = s.run(*srun, check=False)
    assert "init_post_opt() failed" not in r.stderr, r.stderr
    assert len(agent.requests) == 6
    # a stopped agent's socket file (nobody listens): nothing to ask here, srun goes on (the
    # node's agent decides at the task's start)
    agent.close()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(s.plugin_socket))
    stale.close()
    try:
        r = s.run(*srun, check=False)
        assert "init_post_opt() failed" not in r.stderr and "laminar: cannot reach" not in r.stderr, r.stderr
    finally:
        s.plugin_socket.unlink()
