"""netguard on a real veth pair: job identification, kill-switches, flows and counters.

Namespace `a` is the node: netguard's programs are loaded with a pin root of the test's own
(/sys/fs/bpf/laminar-t-<hex>) and attached to its veth's clsact hooks by a helper process
that enters only the network namespace (`nsenter --net`), as the agent does. Jobs are
cgroup2 directories of the test's own (/sys/fs/cgroup/unified/laminar-t-<hex>/job-*) whose
processes send or receive UDP across the pair; namespace `b` holds the peer.

No timing assertions: a packet that must not arrive is shown missing by sending a marker
from a job that still passes afterwards and waiting (bounded) for the marker.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from laminar.bpf import abi
from laminar.bpf.libbpf import BpfMap

pytestmark = pytest.mark.kernel

CGROUP2 = Path("/sys/fs/cgroup/unified")
PAYLOAD = 64
FRAME = 14 + 20 + 8 + PAYLOAD  # skb->len at tc: Ethernet + IPv4 + UDP + payload
PORT_X, PORT_Y = 7001, 7002
WAIT_S = 10.0

# Runs in namespace a: load netguard pinned under argv[1], attach to interface argv[2].
LOADER = """
import sys
from laminar.bpf.libbpf import BpfObject, object_path
from laminar.net import tc
obj = BpfObject.open(object_path("netguard"), pin_root=sys.argv[1])
obj.load()
idx = tc.ifindex_of(sys.argv[2])
tc.ensure_clsact(idx)
tc.attach_bpf(idx, "egress", obj.program("lm_egress").fd, "lm_egress")
tc.attach_bpf(idx, "ingress", obj.program("lm_ingress").fd, "lm_ingress")
print("attached", flush=True)
"""

# A UDP sender: prints its source port, then for each "send N HOST PORT" line sends N datagrams.
SENDER = f"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
payload = b"x" * {PAYLOAD}
for line in sys.stdin:
    _, n, host, port = line.split()
    for _ in range(int(n)):
        try:
            s.sendto(payload, (host, int(port)))
        except OSError:
            pass  # a drop may surface as ENOBUFS; the counters tell
    print("sent", flush=True)
"""

# A UDP receiver on argv[1]:argv[2]; "count" prints {"ip:port": datagrams} received so far.
RECEIVER = """
import json, socket, sys, threading
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
s.bind((sys.argv[1], int(sys.argv[2])))
counts, lock = {}, threading.Lock()
def rx():
    while True:
        _, (ip, port) = s.recvfrom(4096)
        with lock:
            counts[f"{ip}:{port}"] = counts.get(f"{ip}:{port}", 0) + 1
threading.Thread(target=rx, daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    with lock:
        print(json.dumps(counts), flush=True)
"""


def wait_until(pred: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Proc:
    p: subprocess.Popen[str]
    first_line: str

    def ask(self, line: str) -> str:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=WAIT_S)


@dataclass
class Env:
    pair: Any
    pin_root: Path
    cg_root: Path
    procs: list[Proc] = field(default_factory=list)

    def cgroup(self, name: str) -> tuple[Path, int]:
        """A cgroup2 dir under the test's root and its id (the kernfs inode number, what
        bpf_skb_cgroup_id() returns)."""
        path = self.cg_root / name
        path.mkdir(exist_ok=True)
        return path, os.stat(path).st_ino

    def spawn(self, ns: Any, code: str, *args: str, cgroup: Path | None = None) -> Proc:
        def enter_cgroup() -> None:
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(str(os.getpid()))

        p = subprocess.Popen(
            ns.argv(sys.executable, "-c", code, *args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=enter_cgroup,
        )
        assert p.stdout
        proc = Proc(p, p.stdout.readline().strip())
        self.procs.append(proc)
        assert proc.first_line, f"helper {code[:30]!r} died at start"
        return proc

    def map(self, name: str) -> BpfMap:
        return BpfMap.from_pin(self.pin_root / name)

    def register(self, cgid: int, job_id: int, flags: int = 0, kill_at_ns: int = 0) -> None:
        with self.map("lm_jobs") as m:
            m.update(cgid, bytes(abi.LmJob(job_id=job_id, flags=flags, kill_at_ns=kill_at_ns)))

    def counters(self, cgid: int) -> abi.LmCounters:
        with self.map("lm_job_stats") as m:
            raw = m.lookup(cgid)
        return abi.LmCounters.from_buffer_copy(raw) if raw else abi.LmCounters()

    def set_global(self, flags: int, kill_at_ns: int = 0) -> None:
        with self.map("lm_global") as m:
            m.update(0, bytes(abi.LmGlobal(flags=flags, abi_version=abi.LM_ABI_VERSION, kill_at_ns=kill_at_ns)))

    def stat(self, slot: int) -> int:
        with self.map("lm_stats") as m:
            return m.lookup_percpu_sum(slot)


@pytest.fixture
def env(veth_pair: Any) -> Iterator[Env]:
    tag = secrets.token_hex(3)
    pin_root = Path(f"/sys/fs/bpf/laminar-t-{tag}")
    cg_root = CGROUP2 / f"laminar-t-{tag}"
    cg_root.mkdir()
    e = Env(veth_pair, pin_root, cg_root)
    try:
        out = subprocess.run(
            veth_pair.a.argv(sys.executable, "-c", LOADER, str(pin_root), veth_pair.ifname_a),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "attached" in out.stdout, out.stderr
        yield e
    finally:
        for p in e.procs:
            p.stop()
        if (cg_root / "cgroup.kill").exists():
            (cg_root / "cgroup.kill").write_text("1")
        for d in sorted(cg_root.glob("*/"), reverse=True):
            if d.is_dir():
                wait_until(lambda: not (d / "cgroup.procs").read_text().strip(), f"{d} empty")  # noqa: B023
                d.rmdir()
        cg_root.rmdir()
        shutil.rmtree(pin_root, ignore_errors=True)


def received(rx: Proc, sender: Proc, addr: str) -> int:
    return int(json.loads(rx.ask("count")).get(f"{addr}:{sender.first_line}", 0))


def send(sender: Proc, n: int, host: str, port: int) -> None:
    assert sender.ask(f"send {n} {host} {port}") == "sent"


def test_filters_attached(env: Env) -> None:
    out = env.pair.a.run("tc", "filter", "show", "dev", env.pair.ifname_a, "egress").stdout
    assert "lm_egress" in out and "direct-action" in out
    out = env.pair.a.run("tc", "filter", "show", "dev", env.pair.ifname_a, "ingress").stdout
    assert "lm_ingress" in out


def test_unregistered_traffic_passes_and_is_not_counted(env: Env) -> None:
    pair = env.pair
    cg, cgid = env.cgroup("job-free")
    rx = env.spawn(pair.b, RECEIVER, pair.addr_b, str(PORT_X))
    tx = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cg)
    send(tx, 30, pair.addr_b, PORT_X)
    wait_until(lambda: received(rx, tx, pair.addr_a) == 30, "30 datagrams at the peer")
    assert env.counters(cgid).tx_packets == 0  # not a job: no row
    assert env.stat(abi.LM_STAT_PASS) >= 30


def test_job_kill_stops_that_job_only(env: Env) -> None:
    pair = env.pair
    cgx, idx = env.cgroup("job-x")
    cgy, idy = env.cgroup("job-y")
    env.register(idx, 1)
    env.register(idy, 2)
    rx = env.spawn(pair.b, RECEIVER, pair.addr_b, str(PORT_X))
    tx_x = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cgx)
    tx_y = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cgy)

    # Both pass; counters match what was sent, frame by frame.
    send(tx_x, 50, pair.addr_b, PORT_X)
    send(tx_y, 20, pair.addr_b, PORT_X)
    wait_until(lambda: received(rx, tx_x, pair.addr_a) == 50, "job x's 50 datagrams")
    wait_until(lambda: received(rx, tx_y, pair.addr_a) == 20, "job y's 20 datagrams")
    cx = env.counters(idx)
    assert (cx.tx_packets, cx.tx_bytes, cx.drop_packets) == (50, 50 * FRAME, 0)
    assert env.counters(idy).tx_packets == 20

    # Kill job x: its next packets are dropped, job y's still pass.
    env.register(idx, 1, flags=abi.LM_JOB_KILL)
    drops_before = env.stat(abi.LM_STAT_DROP_JOB)
    send(tx_x, 40, pair.addr_b, PORT_X)
    send(tx_y, 20, pair.addr_b, PORT_X)
    wait_until(lambda: received(rx, tx_y, pair.addr_a) == 40, "job y's marker datagrams")
    assert received(rx, tx_x, pair.addr_a) == 50
    cx = env.counters(idx)
    assert (cx.tx_packets, cx.drop_packets, cx.drop_bytes) == (50, 40, 40 * FRAME)
    assert env.stat(abi.LM_STAT_DROP_JOB) - drops_before == 40
    assert env.counters(idy).tx_packets == 40

    # Off again: job x passes.
    env.register(idx, 1)
    send(tx_x, 10, pair.addr_b, PORT_X)
    wait_until(lambda: received(rx, tx_x, pair.addr_a) == 60, "job x's traffic after the switch is off")


def test_armed_deadline_drops_after_it(env: Env) -> None:
    pair = env.pair
    cgx, idx = env.cgroup("job-x")
    cgy, idy = env.cgroup("job-y")
    env.register(idy, 2)
    rx = env.spawn(pair.b, RECEIVER, pair.addr_b, str(PORT_X))
    tx_x = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cgx)
    tx_y = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cgy)

    # Armed with a deadline an hour away: still passes.
    env.register(idx, 1, flags=abi.LM_JOB_ARMED, kill_at_ns=time.monotonic_ns() + 3600 * 10**9)
    send(tx_x, 10, pair.addr_b, PORT_X)
    wait_until(lambda: received(rx, tx_x, pair.addr_a) == 10, "job x's traffic before its deadline")

    # Armed with a deadline that has passed (bpf_ktime_get_ns is CLOCK_MONOTONIC): dropped.
    deadline = time.monotonic_ns() + 200_000_000
    env.register(idx, 1, flags=abi.LM_JOB_ARMED, kill_at_ns=deadline)
    wait_until(lambda: time.monotonic_ns() > deadline, "the deadline")
    send(tx_x, 25, pair.addr_b, PORT_X)
    send(tx_y, 5, pair.addr_b, PORT_X)
    wait_until(lambda: received(rx, tx_y, pair.addr_a) == 5, "job y's marker datagrams")
    assert received(rx, tx_x, pair.addr_a) == 10
    assert env.counters(idx).drop_packets == 25


def test_global_switches(env: Env) -> None:
    pair = env.pair
    cgl, idl = env.cgroup("job-lent")
    cgo, ido = env.cgroup("job-own")
    cgf, _ = env.cgroup("not-a-job")
    env.register(idl, 1, flags=abi.LM_JOB_LENT)
    env.register(ido, 2)
    rx = env.spawn(pair.b, RECEIVER, pair.addr_b, str(PORT_X))
    lent = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cgl)
    own = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cgo)
    free = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cgf)

    def round_(expect_lent: int, expect_own: int, expect_free: int) -> None:
        for s in (lent, own, free):
            send(s, 5, pair.addr_b, PORT_X)
        wait_until(lambda: received(rx, free, pair.addr_a) == expect_free, "the unregistered marker")
        assert received(rx, lent, pair.addr_a) == expect_lent
        assert received(rx, own, pair.addr_a) == expect_own

    round_(5, 5, 5)
    env.set_global(abi.LM_GLOBAL_KILL_LENT)  # lent capacity goes back now
    round_(5, 10, 10)
    env.set_global(abi.LM_GLOBAL_ARMED, kill_at_ns=time.monotonic_ns() + 3600 * 10**9)  # not yet
    round_(10, 15, 15)
    env.set_global(abi.LM_GLOBAL_ARMED, kill_at_ns=time.monotonic_ns() - 1)  # deadline passed
    round_(10, 20, 20)
    drops = env.stat(abi.LM_STAT_DROP_GLOBAL)
    env.set_global(abi.LM_GLOBAL_KILL_JOBS)  # every job; traffic of no job still passes
    round_(10, 20, 25)
    assert env.stat(abi.LM_STAT_DROP_GLOBAL) - drops == 10
    env.set_global(0)
    round_(15, 25, 30)


def test_ingress_kill(env: Env) -> None:
    pair = env.pair
    cgx, idx = env.cgroup("job-x")
    cgy, idy = env.cgroup("job-y")
    env.register(idx, 1)
    env.register(idy, 2)
    # Receivers in the node's namespace, inside the job cgroups; the peer sends to them.
    rx_x = env.spawn(pair.a, RECEIVER, pair.addr_a, str(PORT_X), cgroup=cgx)
    rx_y = env.spawn(pair.a, RECEIVER, pair.addr_a, str(PORT_Y), cgroup=cgy)
    peer = env.spawn(pair.b, SENDER, pair.addr_b)

    send(peer, 30, pair.addr_a, PORT_X)
    wait_until(lambda: received(rx_x, peer, pair.addr_b) == 30, "30 datagrams into job x")
    cx = env.counters(idx)
    assert (cx.rx_packets, cx.rx_bytes, cx.tx_packets) == (30, 30 * FRAME, 0)

    env.register(idx, 1, flags=abi.LM_JOB_KILL)
    send(peer, 20, pair.addr_a, PORT_X)
    send(peer, 7, pair.addr_a, PORT_Y)
    wait_until(lambda: received(rx_y, peer, pair.addr_b) == 7, "job y's marker datagrams")
    assert received(rx_x, peer, pair.addr_b) == 30
    cx = env.counters(idx)
    assert (cx.rx_packets, cx.drop_packets) == (30, 20)
    assert env.counters(idy).rx_packets == 7


def test_flow_kill_and_class(env: Env) -> None:
    pair = env.pair
    cgf, _ = env.cgroup("not-a-job")
    rx = env.spawn(pair.b, RECEIVER, pair.addr_b, str(PORT_X))
    tx = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cgf)
    marker = env.spawn(pair.a, SENDER, pair.addr_a, cgroup=cgf)
    key = abi.flow_key(pair.addr_a, pair.addr_b, int(tx.first_line), PORT_X, "udp")

    with env.map("lm_flows") as flows:
        flows.update(key, bytes(abi.LmFlow(job_id=9, priority=0x10020)))
        shaped = env.stat(abi.LM_STAT_SHAPED)
        send(tx, 12, pair.addr_b, PORT_X)
        wait_until(lambda: received(rx, tx, pair.addr_a) == 12, "the flow's datagrams")
        f = abi.LmFlow.from_buffer_copy(flows.lookup(key) or b"")
        assert (f.packets, f.bytes) == (12, 12 * FRAME)
        assert env.stat(abi.LM_STAT_SHAPED) - shaped == 12

        flows.update(key, bytes(abi.LmFlow(job_id=9, flags=abi.LM_FLOW_KILL)))
        send(tx, 8, pair.addr_b, PORT_X)
        send(marker, 3, pair.addr_b, PORT_X)
        wait_until(lambda: received(rx, marker, pair.addr_a) == 3, "the marker datagrams")
        assert received(rx, tx, pair.addr_a) == 12
        assert env.stat(abi.LM_STAT_DROP_FLOW) >= 8

        assert flows.delete(key)
        send(tx, 4, pair.addr_b, PORT_X)
        wait_until(lambda: received(rx, tx, pair.addr_a) == 16, "the flow after its entry is gone")


def test_bpftool_dump_shows_named_fields(env: Env) -> None:
    _, cgid = env.cgroup("job-x")
    env.register(cgid, 4242, flags=abi.LM_JOB_LENT)
    out = subprocess.run(
        ["bpftool", "-j", "map", "dump", "pinned", str(env.pin_root / "lm_jobs")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # bpftool -j puts the BTF-decoded entry under "formatted"
    entries = [e.get("formatted", e) for e in json.loads(out)]
    assert {"key": cgid, "value": {"job_id": 4242, "flags": abi.LM_JOB_LENT, "kill_at_ns": 0}} in entries
    env.set_global(abi.LM_GLOBAL_KILL_LENT)
    with env.map("lm_flows") as flows:
        flows.update(abi.flow_key("10.0.0.1", "10.0.0.2", 1, 2, "tcp"), bytes(abi.LmFlow(job_id=4242, priority=0x10020)))
    with env.map("lm_job_stats") as stats:
        stats.update(cgid, bytes(abi.LmCounters(tx_packets=3)))
    expect = {
        "lm_jobs": ("job_id", "kill_at_ns"),
        "lm_job_stats": ("tx_packets", "drop_bytes"),
        "lm_global": ("abi_version", "kill_at_ns"),
        "lm_flows": ("saddr", "dport", "proto", "priority", "packets"),
    }
    for name, fields in expect.items():
        out = subprocess.run(
            ["bpftool", "map", "dump", "pinned", str(env.pin_root / name)], check=True, capture_output=True, text=True
        ).stdout
        for f in fields:
            assert f'"{f}"' in out, f"bpftool dump of {name} lacks the field {f}: {out}"


# TCP sink in the peer: accepts one connection, reads to EOF, prints the byte count.
TCP_SINK = """
import socket, sys
srv = socket.socket()
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1)
print("ready", flush=True)
c, _ = srv.accept(); n = 0
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    n += len(b)
print(n, flush=True)
"""

# TCP source in a job: from argv[1]:argv[2] to argv[3]:argv[4], argv[5] bytes, then close.
TCP_SOURCE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.connect((sys.argv[3], int(sys.argv[4])))
print("connected", flush=True)
s.sendall(b"\\0" * int(sys.argv[5])); s.close()
"""


def test_tcp_job_flow_both_directions(env: Env) -> None:
    """A job's TCP transfer registered as a flow with an HTB priority: it completes, the flow
    counts both directions, and the job is identified on ingress (its ACKs) by socket lookup."""
    pair = env.pair
    cgx, idx = env.cgroup("job-x")
    env.register(idx, 1)
    sport, total = 40000 + secrets.randbelow(20000), 2_000_000
    key = abi.flow_key(pair.addr_a, pair.addr_b, sport, PORT_X, "tcp")
    with env.map("lm_flows") as flows:
        flows.update(key, bytes(abi.LmFlow(job_id=1, priority=0x10020)))
        sink = env.spawn(pair.b, TCP_SINK, pair.addr_b, str(PORT_X))
        src = env.spawn(pair.a, TCP_SOURCE, pair.addr_a, str(sport), pair.addr_b, str(PORT_X), str(total), cgroup=cgx)
        assert src.first_line == "connected"
        assert sink.p.stdout is not None
        assert sink.p.stdout.readline().strip() == str(total)
        # The connection's last packets (the sink's FIN, the source's ACK of it) pass after the
        # sink read everything: both ends exit, then the counts are read once they stand still
        # (read before, the job's counters, read second, had the two the flow's had not).
        src.p.wait(10)
        sink.p.wait(10)
        f = abi.LmFlow.from_buffer_copy(flows.lookup(key) or b"")
        for _ in range(50):
            time.sleep(0.1)
            now = abi.LmFlow.from_buffer_copy(flows.lookup(key) or b"")
            if now.packets == f.packets:
                break
            f = now
        c = env.counters(idx)
    assert c.tx_bytes > total and c.rx_packets > 0 and c.drop_packets == 0
    # Every packet of the connection, both directions, is the flow's. The job's are all but
    # the last few ingress ones: once the closed socket is a time-wait sock the lookup (full
    # sockets only) finds none, so the final FIN/ACK may count for the flow alone.
    assert f.packets >= c.tx_packets + c.rx_packets >= f.packets - 3
