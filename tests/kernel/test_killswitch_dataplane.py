"""Kill-switch on the real data plane: netguard on a veth pair in namespaces, real UDP floods.

The armed switch is tested with the real agent: laminard (tests/agentproc.py) runs in the node's
namespace, a flooding job is submitted to it, ``laminarctl killswitch arm --job J --at +2s`` arms
the job's switch and the agent is then SIGSTOPped, so what cuts the job's traffic at the deadline
is the data plane alone (the program compares ``bpf_ktime_get_ns()`` with ``kill_at_ns``).

The other tests drive the maps directly (per flow, ingress, one job's switch against another's).
Their netguard is loaded and attached by a small process that does what NetGuard.start does
(open with pins, load, clsact, attach both directions), so they need no agent.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from agentproc import AgentProc

from laminar.bpf import abi
from laminar.bpf.libbpf import BpfMap
from laminar.net import killswitch as ks

pytestmark = pytest.mark.kernel
REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

# The stand-in for laminard's data-plane start-up (see the module docstring).
STANDIN = r"""
import signal, sys
from laminar.bpf.libbpf import BpfObject, object_path
from laminar.net import tc
pin_root, ifname = sys.argv[1], sys.argv[2]
obj = BpfObject.open(object_path("netguard"), pin_root=pin_root)
obj.load()
idx = tc.ifindex_of(ifname)
tc.ensure_clsact(idx)
for direction, name in (("egress", "lm_egress"), ("ingress", "lm_ingress")):
    tc.attach_bpf(idx, direction, obj.program(name).fd, name)
# More devices for lm_ingress: "tunnels" (the tunnels NetGuard.start attaches to: netguard.tunnels_over)
# or an interface's name.
from laminar.net import netguard
more = []
for dev in sys.argv[3:]:
    more += list(netguard.tunnels_over(idx).values()) if dev == "tunnels" else [dev]
for dev in more:
    netguard.attach_tunnel(tc.ifindex_of(dev), obj.program("lm_ingress").fd)
print("ready", *more, flush=True)
signal.pause()
"""

# UDP flood: argv dst_ip dst_port src_port seconds; prints packets sent.
SENDER = r"""
import socket, sys, time
dst, dport, sport, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", sport))
end = time.monotonic() + secs
n = 0
payload = b"x" * 64
while time.monotonic() < end:
    for _ in range(64):
        try:
            s.sendto(payload, (dst, dport)); n += 1
        except OSError:
            pass  # the kill-switch drops on egress: the kernel may report it
print(n, flush=True)
"""

# UDP receiver: argv seconds port...; prints {port: [count, last_arrival_monotonic_ns, arrivals...]}.
RECEIVER = r"""
import json, selectors, socket, sys, time
secs = float(sys.argv[1]); ports = [int(p) for p in sys.argv[2:]]
sel = selectors.DefaultSelector()
for p in ports:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", p)); s.setblocking(False)
    sel.register(s, selectors.EVENT_READ, p)
times = {p: [] for p in ports}
print("ready", flush=True)
end = time.monotonic() + secs
while time.monotonic() < end:
    for key, _ in sel.select(0.05):
        while True:
            try:
                key.fileobj.recv(2048)
            except BlockingIOError:
                break
            times[key.data].append(time.monotonic_ns())
print(json.dumps({p: t for p, t in times.items()}), flush=True)
"""


@dataclass
class DataPlane:
    pin_root: Path
    standin: subprocess.Popen[str]
    more: list[str] = field(default_factory=list)

    def map(self, name: str) -> BpfMap:
        return BpfMap.from_pin(self.pin_root / name)


def start_dataplane(ns_argv: list[str], ifname: str, tag: str, *more: str) -> DataPlane:
    """Starts the stand-in in the node's namespace; returns once netguard is attached (to `ifname`,
    and lm_ingress to each of `more`: an interface, or "tunnels" for those NetGuard attaches to).
    The devices lm_ingress went on besides `ifname` are in ``DataPlane.more``."""
    pin_root = Path(f"/sys/fs/bpf/laminar-t-{tag}-{os.getpid()}")
    env = {**os.environ, "PYTHONPATH": f"{REPO}/agent"}
    p = subprocess.Popen([*ns_argv, PY, "-c", STANDIN, str(pin_root), ifname, *more], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    line = p.stdout.readline()
    if line.split()[:1] != ["ready"]:
        p.kill()
        p.wait()
        shutil.rmtree(pin_root, ignore_errors=True)
        raise RuntimeError(f"netguard stand-in failed: {line} {p.stderr.read() if p.stderr else ''}")
    return DataPlane(pin_root, p, line.split()[1:])


def stop_dataplane(dp: DataPlane) -> None:
    if dp.standin.poll() is None:
        dp.standin.send_signal(signal.SIGCONT)
        dp.standin.kill()
    dp.standin.wait()
    shutil.rmtree(dp.pin_root, ignore_errors=True)


@pytest.fixture
def node(veth_pair) -> Iterator[tuple[object, DataPlane]]:  # type: ignore[no-untyped-def]
    dp = start_dataplane(veth_pair.a.argv(), veth_pair.ifname_a, "ks")
    try:
        yield veth_pair, dp
    finally:
        stop_dataplane(dp)


def receiver(ns, secs: float, *ports: int) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    p = ns.popen(PY, "-c", RECEIVER, str(secs), *map(str, ports), stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def arrivals(p: subprocess.Popen[str]) -> dict[int, list[int]]:
    out, _ = p.communicate(timeout=60)
    return {int(k): v for k, v in json.loads(out).items()}


def flood(ns, dst: str, dport: int, sport: int, secs: float, **kw) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    return ns.popen(PY, "-c", SENDER, dst, str(dport), str(sport), str(secs), stdout=subprocess.PIPE, **kw)


def test_armed_job_cut_at_deadline_with_the_agent_sigstopped(veth_pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    vp = veth_pair
    agent = AgentProc(tmp_path, vp.ifname_a, vp.a)
    stopped = False
    try:
        agent.start()
        assert agent.proc is not None
        rx = receiver(vp.b, 7.0, 9021)
        job = agent.json("submit", "--name", "flood", "--", PY, "-c", SENDER, vp.addr_b, "9021", "41021", "5")
        time.sleep(1.0)  # the flood is flowing
        out = agent.ctl("killswitch", "arm", "--job", job["id"], "--at", "+2s")
        assert job["id"] in out.stdout
        os.kill(agent.proc.pid, signal.SIGSTOP)  # nobody in user space is left to enforce anything
        stopped = True
        time.sleep(0.2)
        state = Path(f"/proc/{agent.proc.pid}/stat").read_text().split()[2]
        assert state == "T", f"laminard not stopped (state {state})"
        # The deadline as the agent wrote it, read from the pin (the agent cannot answer now).
        raw = BpfMap.from_pin(agent.pin_root / "lm_jobs").lookup(int(job["cgroup_id"]).to_bytes(8, "little"))
        assert raw is not None, "the job is not in lm_jobs"
        entry = abi.LmJob.from_buffer_copy(raw)
        assert entry.flags & abi.LM_JOB_ARMED and not entry.flags & abi.LM_JOB_KILL
        deadline = int(entry.kill_at_ns)
        assert deadline - time.monotonic_ns() > 500_000_000, "armed too close: the test cannot tell the cut apart"
        times = arrivals(rx)[9021]
        assert Path(f"/proc/{agent.proc.pid}/stat").read_text().split()[2] == "T", "laminard ran during the test"
    finally:
        if stopped and agent.proc is not None:
            os.kill(agent.proc.pid, signal.SIGCONT)
        agent.cleanup()
    before = [t for t in times if t < deadline]
    assert len(before) > 100, "the job's flood did not get through before the deadline"
    assert [t for t in before if deadline - t < 200_000_000], "the flood stopped well before the deadline"
    # After the deadline: at most what was already in flight (in the veth/socket queues) when it passed.
    late = [t for t in times if t - deadline > 50_000_000]
    assert late == [], f"{len(late)} packets arrived more than 50 ms after the deadline"


def test_armed_flow_cut_at_deadline(node) -> None:  # type: ignore[no-untyped-def]
    vp, dp = node
    flows = dp.map("lm_flows")
    key = ks.FlowKey("udp", vp.addr_a, 41001, vp.addr_b, 9001)
    rx = receiver(vp.b, 4.0, 9001)
    tx = flood(vp.a, vp.addr_b, 9001, 41001, 3.0)
    time.sleep(0.3)
    deadline = ks.deadline_ns(1.0)
    ks.apply_flow_switch(flows, key, "arm", deadline)
    tx.wait(timeout=30)
    times = arrivals(rx)[9001]
    before = [t for t in times if t < deadline]
    assert len(before) > 100, "the flood did not get through before the deadline"
    late = [t for t in times if t - deadline > 50_000_000]
    assert late == [], f"{len(late)} packets arrived more than 50 ms after the deadline"
    entry = ks.FlowEntry.unpack(flows.lookup(key.pack()) or b"")
    assert entry.flags & ks.LM_FLOW_ARMED


def test_flow_cut_on_ingress(node) -> None:  # type: ignore[no-untyped-def]
    vp, dp = node
    flows = dp.map("lm_flows")
    # Flow keyed in egress orientation on the node (a -> b); the flood comes from b to a.
    key = ks.FlowKey("udp", vp.addr_a, 9002, vp.addr_b, 41002)
    rx = receiver(vp.a, 3.0, 9002)
    tx = flood(vp.b, vp.addr_a, 9002, 41002, 2.5)
    time.sleep(0.8)
    cut = time.monotonic_ns()
    ks.apply_flow_switch(flows, key, "on", None)
    tx.wait(timeout=30)
    times = arrivals(rx)[9002]
    assert any(t < cut for t in times), "no packet got in before the cut"
    assert not [t for t in times if t - cut > 50_000_000], "ingress packets still got in after the cut"
    # Restoring lets the flow in again.
    ks.apply_flow_switch(flows, key, "off", None)
    rx = receiver(vp.a, 1.5, 9002)
    tx = flood(vp.b, vp.addr_a, 9002, 41002, 1.0)
    tx.wait(timeout=30)
    assert len(arrivals(rx)[9002]) > 100


def _cgroup2() -> Path:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        f = line.split()
        if f[2] == "cgroup2":
            return Path(f[1])
    pytest.skip("no cgroup2 mount")


def test_one_jobs_switch_leaves_another_job_alone(node) -> None:  # type: ignore[no-untyped-def]
    from laminar.net.netguard import NetGuard

    vp, dp = node
    root = _cgroup2() / f"laminar-t-ks-{os.getpid()}"
    cgs = [root / "j1", root / "j2"]
    procs: list[subprocess.Popen[str]] = []
    try:
        for cg in cgs:
            cg.mkdir(parents=True)
        ng = NetGuard()
        ng.maps = {name: dp.map(name) for name in ("lm_jobs", "lm_job_stats", "lm_global", "lm_flows", "lm_stats")}
        ids = [os.stat(cg).st_ino for cg in cgs]  # the cgroup2 id is the directory's inode number
        ng.register_job(ids[0], 1)
        ng.register_job(ids[1], 2)
        rx = receiver(vp.b, 4.0, 9011, 9012)
        for i, cg in enumerate(cgs):
            procs.append(flood(vp.a, vp.addr_b, 9011 + i, 41011 + i, 3.0,
                               preexec_fn=lambda cg=cg: (cg / "cgroup.procs").write_text(str(os.getpid()))))
        time.sleep(1.0)
        cut = time.monotonic_ns()
        ng.set_job_kill(ids[0], True)
        for p in procs:
            p.wait(timeout=30)
        times = arrivals(rx)
        j1_after = [t for t in times[9011] if t - cut > 50_000_000]
        j2_after = [t for t in times[9012] if t - cut > 50_000_000]
        assert [t for t in times[9011] if t < cut], "job 1's flood never got through"
        assert j1_after == [], "job 1's traffic passed after its switch was flipped"
        assert len(j2_after) > 100, "job 2's traffic was cut with job 1's"
        assert ng.job_counters(ids[0])["drop_packets"] > 0
        assert ng.job_counters(ids[1])["drop_packets"] == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for cg in cgs:
            if cg.exists():
                cg.rmdir()
        if root.exists():
            root.rmdir()


def test_bad_flow_requests_change_nothing(node) -> None:  # type: ignore[no-untyped-def]
    _vp, dp = node
    flows = dp.map("lm_flows")
    before = list(flows.items())
    with pytest.raises(ks.KillSwitchError, match="in the past"):
        ks.parse_action({"action": "arm", "at_s": -3})
    with pytest.raises(ks.KillSwitchError, match="not understood"):
        ks.FlowKey.parse("tcp:10.0.0.1->10.0.0.2")
    with pytest.raises(ks.KillSwitchError, match="no lm_flows entry"):
        ks.apply_flow_switch(flows, ks.FlowKey.parse("tcp:10.9.9.9:1->10.9.9.8:2"), "on", None, create=False)
    assert list(flows.items()) == before
