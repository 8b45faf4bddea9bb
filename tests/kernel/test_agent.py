"""The agent on a real kernel: a laminard process on a veth uplink in a namespace of the test's own.

These are the foundation's acceptance tests: pins with named fields, a job's UDP flood cut by the
kill-switch while another job's traffic passes, counters equal to what was sent, the switch
still enforcing after ``kill -9`` of the agent, reattachment on restart, ``bpf unload`` restoring
the interface, pressure events with the right cgroup, and the control socket's credential check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import NOBODY, VENV_BIN, AgentProc, wait_until

from laminar.airlock.cgroups import detect

pytestmark = pytest.mark.kernel

HERE = Path(__file__).resolve().parent
PAYLOAD = 100
BURST = 200


def unit_capabilities() -> list[str]:
    """The capability bounding set of systemd/laminard.service, as setpriv names them."""
    unit = (HERE.parents[1] / "systemd/laminard.service").read_text()
    line = next(x for x in unit.splitlines() if x.startswith("CapabilityBoundingSet="))
    return [c.removeprefix("CAP_").lower() for c in line.split("=", 1)[1].split()]


@pytest.fixture
def receiver(veth_pair: Any, tmp_path: Path) -> Iterator[Callable[[], dict[str, int]]]:
    out = tmp_path / "counts.json"
    proc = veth_pair.b.popen(sys.executable, str(HERE / "udp_tools.py"), "recv", "5001,5002", str(out))

    def counts() -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads(out.read_text()).items()}
        except (OSError, ValueError):
            return {"5001": 0, "5002": 0}

    try:
        wait_until(out.exists, 10, "the receiver to start")
        yield counts
    finally:
        proc.kill()
        proc.wait(10)


def submit_sender(agent: AgentProc, dst: str, port: int, go: Path, *extra: str) -> dict[str, Any]:
    return agent.json("submit", "--name", f"udp-{port}", *extra, "--", sys.executable, str(HERE / "udp_tools.py"),
                      "send", dst, str(port), str(BURST), str(PAYLOAD), str(go))


def job_stats(agent: AgentProc, cgroup_id: int) -> dict[str, int]:
    dump = agent.json("bpf", "dump", "lm_job_stats")
    for e in dump["entries"]:
        if int(e["key"]["cgroup_id"]) == cgroup_id:
            return e["value"]
    return {}


def growing(counts: Callable[[], dict[str, int]], port: str, window: float = 0.5) -> bool:
    a = counts()[port]
    time.sleep(window)
    return counts()[port] > a


def stopped(counts: Callable[[], dict[str, int]], port: str) -> bool:
    """No packet for the port arrives over a full second once in-flight ones have drained."""
    time.sleep(0.3)
    a = counts()[port]
    time.sleep(1.0)
    return counts()[port] == a


def filters(ns: Any, ifname: str, direction: str) -> list[str]:
    out = ns.run("tc", "filter", "show", "dev", ifname, direction).stdout
    return [line for line in out.splitlines() if "direct-action" in line]  # one such line per bpf filter


def test_killswitch_counters_kill9_reattach_unload(agent: AgentProc, veth_pair: Any, receiver: Any, tmp_path: Path) -> None:
    st = agent.json("status")
    progs = {(p["direction"], p["name"]) for p in st["netguard"]["programs"]}
    assert {("egress", "lm_egress"), ("ingress", "lm_ingress")} <= progs
    assert st["netguard"]["ifname"] == veth_pair.ifname_a
    assert st["netguard"]["reattached_pins"] is False

    go1, go2 = tmp_path / "go1", tmp_path / "go2"
    j1 = submit_sender(agent, veth_pair.addr_b, 5001, go1)
    j2 = submit_sender(agent, veth_pair.addr_b, 5002, go2)

    # The paced bursts arrive in full, and netguard counted exactly what each job sent.
    wait_until(lambda: receiver()["5001"] >= BURST and receiver()["5002"] >= BURST, 30, "both bursts")
    s1 = wait_until(lambda: (s := job_stats(agent, j1["cgroup_id"])) and s["tx_packets"] >= BURST and s, 10,
                    "job 1 counters")
    assert receiver()["5001"] == BURST
    assert s1["tx_packets"] == BURST
    assert s1["tx_bytes"] == BURST * (PAYLOAD + 8 + 20 + 14)  # UDP + IPv4 + Ethernet headers
    assert s1["drop_packets"] == 0

    # bpftool, the tool network engineers use, prints every pin with named fields (BTF).
    for name, field in (("lm_jobs", "job_id"), ("lm_job_stats", "tx_packets"), ("lm_global", "abi_version")):
        out = subprocess.run(["bpftool", "map", "dump", "pinned", str(agent.pin_root / name)],
                             capture_output=True, text=True, check=True).stdout
        assert f'"{field}"' in out, out
    for name in ("lm_flows", "lm_stats"):  # (a ring buffer has no key/value type to describe)
        out = subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(agent.pin_root / name)],
                             capture_output=True, text=True, check=True).stdout
        info = json.loads(out)
        assert info["name"] == name and info.get("btf_id", 0) > 0, info

    go1.touch()
    go2.touch()
    wait_until(lambda: growing(receiver, "5001") and growing(receiver, "5002"), 10, "both floods")

    out = agent.ctl("killswitch", "on", "--job", j1["id"])
    assert j1["id"] in out.stdout
    assert stopped(receiver, "5001"), "job 1's flood still passes after killswitch on"
    assert growing(receiver, "5002"), "job 2's traffic stopped with job 1's switch"
    assert job_stats(agent, j1["cgroup_id"])["drop_packets"] > 0

    # kill -9: nothing is left to flip the switch back, and the data plane keeps enforcing.
    agent.kill9()
    assert stopped(receiver, "5001")
    assert growing(receiver, "5002")

    # A restart reattaches the pins and the jobs instead of duplicating anything.
    agent.start()
    st = agent.json("status")
    assert st["netguard"]["reattached_pins"] is True
    assert len(filters(veth_pair.a, veth_pair.ifname_a, "egress")) == 1
    assert len(filters(veth_pair.a, veth_pair.ifname_a, "ingress")) == 1
    jobs = {j["id"]: j for j in agent.json("jobs")}
    assert jobs[j1["id"]]["state"] == "running" and jobs[j2["id"]]["state"] == "running"
    assert stopped(receiver, "5001")

    agent.ctl("killswitch", "off", "--job", j1["id"])
    wait_until(lambda: growing(receiver, "5001"), 10, "job 1's traffic to come back")

    # The node-wide switch cuts every job; off restores them.
    agent.ctl("killswitch", "on", "--all")
    assert stopped(receiver, "5001") and stopped(receiver, "5002")
    agent.ctl("killswitch", "off", "--all")
    wait_until(lambda: growing(receiver, "5001") and growing(receiver, "5002"), 10, "traffic after --all off")

    # Unload: filters, clsact and pins go; the interface is as it was; the agent stops.
    res = agent.json("bpf", "unload")
    assert res["filters_removed"] == 2 and res["clsact_removed"] is True
    assert agent.proc is not None
    agent.proc.wait(30)
    assert agent.proc.returncode == 0, agent.log()
    assert not any(agent.pin_root.glob("lm_*"))
    qdiscs = veth_pair.a.run("tc", "qdisc", "show", "dev", veth_pair.ifname_a).stdout
    assert "clsact" not in qdiscs
    # The agent's cgroup subtree stays only where jobs still run (both senders do).
    for job in (j1, j2):
        assert job["cgroup"] in res["cgroups_kept_busy"]


def test_pressure_event_names_the_jobs_cgroup(agent: AgentProc, tmp_path: Path) -> None:
    follow = subprocess.Popen(agent.argv(str(VENV_BIN / "laminarctl"), "--socket", str(agent.sock), "-o", "json",
                                         "events", "--follow", "--kind", "pressure"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        hog = ("import time\nb=[]\nfor i in range(200):\n    b.append(bytearray(1<<20))\n    time.sleep(0.002)\n"
               "time.sleep(60)\n")
        job = agent.json("submit", "--name", "hog", "--memory", "32M", "--class", "transient", "--",
                         sys.executable, "-c", hog)
        assert follow.stdout is not None
        line = follow.stdout.readline()
        assert line, follow.stderr.read() if follow.stderr else ""
        first = json.loads(line)
        assert first["kind"] == "pressure"
        events = agent.json("events", "--kind", "pressure", "--limit", "500")
        mine = [e for e in events if e.get("cgroup_id") == job["cgroup_id"]]
        assert mine, f"no pressure event for job cgroup {job['cgroup_id']}: {events[-5:]}"
        assert all(e.get("job") == job["id"] for e in mine)
        assert {e["type"] for e in mine} & {"memcg_reclaim_begin", "oom_victim", "direct_reclaim_begin"}
    finally:
        follow.kill()
        follow.wait(10)


def test_unprivileged_caller_may_read_but_not_flip(agent: AgentProc) -> None:
    assert agent.ctl("status", user=NOBODY).returncode == 0
    for args in (("killswitch", "on", "--all"), ("bpf", "unload")):
        r = agent.ctl(*args, user=NOBODY, check=False)
        assert r.returncode == 4, r
        assert "permission denied" in r.stderr and "uid 65534" in r.stderr
    # Nothing changed: the node-wide switch is still open and the data plane is still there.
    assert agent.json("killswitch", "status")["global"]["flags"] == []
    assert agent.json("status")["agent"]["api_refused"] >= 2


def test_unload_removes_an_empty_cgroup_subtree(agent: AgentProc) -> None:
    h = detect()  # hybrid: the cgroup2 tree and the v1 memory one; pure v2: one tree
    roots = [h.unified / agent.cgroup_root, *([] if h.memory_in_v2 else [h.v1["memory"] / agent.cgroup_root])]
    assert all(r.is_dir() for r in roots)
    res = agent.json("bpf", "unload")
    assert res["cgroups_removed"] > 0 and res["cgroups_kept_busy"] == []
    assert not any(r.exists() for r in roots)


def test_bad_cli_input_against_a_running_agent(agent: AgentProc) -> None:
    r = agent.ctl("killswitch", "on", "--job", "job-999", check=False)
    assert r.returncode == 1 and "unknown job 'job-999'" in r.stderr
    r = agent.ctl("killswitch", "arm", "--all", check=False)
    assert r.returncode == 2 and "--at" in r.stderr
    r = agent.ctl("killswitch", "arm", "--all", "--at", "soon", check=False)
    assert r.returncode == 2 and "'soon'" in r.stderr
    r = agent.ctl("bpf", "dump", "lm_nope", check=False)
    assert r.returncode == 1 and "no map 'lm_nope'" in r.stderr


def test_agent_works_with_only_the_units_capabilities(veth_pair: Any, tmp_path: Path, receiver: Any) -> None:
    """The unit grants a bounded capability set; the agent must start and enforce with exactly that."""
    caps = unit_capabilities()
    assert "sys_module" not in caps and "sys_ptrace" not in caps
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
    try:
        a.start(prefix=("setpriv", "--bounding-set", "-all," + ",".join("+" + c for c in caps), "--inh-caps", "-all",
                        "--"))
        assert a.proc is not None
        status = Path(f"/proc/{a.proc.pid}/status").read_text()
        bnd = int(next(x for x in status.splitlines() if x.startswith("CapBnd:")).split()[1], 16)
        assert bnd & (1 << 16) == 0  # CAP_SYS_MODULE is not held
        go = tmp_path / "go"
        job = submit_sender(a, veth_pair.addr_b, 5001, go)
        wait_until(lambda: receiver()["5001"] >= BURST, 30, "the burst")
        go.touch()
        a.ctl("killswitch", "on", "--job", job["id"])
        assert stopped(receiver, "5001")
    finally:
        a.cleanup()


def test_ready_notification_and_metrics(veth_pair: Any, tmp_path: Path) -> None:
    """systemd hears READY=1 once the agent serves; Prometheus metrics answer on the netns loopback."""
    import socket as so

    notify_path = tmp_path / "notify.sock"
    listener = so.socket(so.AF_UNIX, so.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(60)
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a, extra_toml="")
    a.config_path.write_text(a.config_path.read_text().replace('listen = ""', 'listen = "127.0.0.1:19477"'))
    os.environ["NOTIFY_SOCKET"] = str(notify_path)
    try:
        a.start(wait=False)
        msg = listener.recv(4096).decode()
        assert "READY=1" in msg and f"MAINPID={a.proc.pid if a.proc else ''}" in msg
        a.wait_ready()
        a.ctl("events")  # one API request so the counters have something to show
        out = veth_pair.a.run(sys.executable, "-c",
                              "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:19477/metrics').read().decode())")
        assert 'laminar_events_total{kind="agent"}' in out.stdout
        assert "laminar_agent_start_time_seconds" in out.stdout
        # the checkpoint transfer's counts (records failing authentication, offers refused for room)
        assert "laminar_transfer_records_rejected_total 0.0" in out.stdout
        assert "laminar_transfer_offers_refused_no_room_total 0.0" in out.stdout
    finally:
        os.environ.pop("NOTIFY_SOCKET", None)
        listener.close()
        a.cleanup()


def test_make_install_writes_the_unit_with_this_venv(tmp_path: Path) -> None:
    repo = HERE.parents[1]
    r = subprocess.run(["make", "-C", str(repo), "install", f"DESTDIR={tmp_path}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    unit = (tmp_path / "etc/systemd/system/laminard.service").read_text()
    assert f"ExecStart={repo}/.venv/bin/laminard --config /etc/laminar/laminard.toml" in unit
    assert "Type=notify" in unit and "@BINDIR@" not in unit
    assert (tmp_path / "etc/laminar/laminard.toml").read_text() == (repo / "systemd/laminard.toml").read_text()
    assert "d /run/laminar" in (tmp_path / "usr/lib/tmpfiles.d/laminar.conf").read_text()
