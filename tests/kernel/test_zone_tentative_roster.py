"""An IPv6 roster address still tentative when laminard starts (duplicate address detection runs
for a second or more after an address is added: a node's boot, when systemd starts the agent).
The zone waits a little for it (``roster_wait_s`` of laminar.zone.rebind.Rebind), then listens
on ``::`` and looks every ``interval_s`` until the address is usable; then the zone's datagrams, its
hand-overs and the checkpoint-transfer listener all move onto it (peers check the source:
zone.check_source). Before, the agent stayed on ``::`` until restarted, and the kernel picked
the source of everything it sent (on a host with several addresses, often not the roster's).

A real laminard in a namespace whose address is added without ``nodad`` (DAD made to last
about 9 s with three probes 3 s apart, so it outlasts the agent's start and its wait), and
a ZoneComponent in a namespace for the wait alone."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agentproc import AgentProc
from conftest import REPO, Netns, delete_netns, kernel_ready, make_netns

pytestmark = [pytest.mark.kernel, pytest.mark.skipif(kernel_ready() is not None, reason=str(kernel_ready()))]

ROSTER = "fd68::1"
IF = "lmtdad0"


def _node(tag: str, dad_probes: int, dad_gap_ms: int) -> Netns:
    """A namespace with an up veth (carrier: DAD runs), a second address the kernel could pick
    as the source, and the roster address added tentative."""
    ns = make_netns(tag)
    ns.run("ip", "link", "add", IF, "type", "veth", "peer", "name", f"{IF}p")
    ns.run("sysctl", "-qw", f"net.ipv6.conf.{IF}.dad_transmits={dad_probes}")
    ns.run("sysctl", "-qw", f"net.ipv6.neigh.{IF}.retrans_time_ms={dad_gap_ms}")
    ns.run("ip", "link", "set", f"{IF}p", "up")
    ns.run("ip", "link", "set", IF, "up")
    ns.run("ip", "addr", "add", "10.68.0.1/24", "dev", IF)
    ns.run("ip", "route", "add", "default", "via", "10.68.0.254", "dev", IF)
    ns.run("ip", "addr", "add", "fd68::9/64", "dev", IF, "nodad")
    ns.run("ip", "addr", "add", f"{ROSTER}/64", "dev", IF)  # no nodad: tentative while DAD runs
    return ns


def _tentative(ns: Netns) -> bool:
    out = subprocess.run(ns.argv("ip", "-6", "-o", "addr", "show", "dev", IF, "tentative"), capture_output=True,
                         text=True, check=True).stdout
    return ROSTER in out


def _listening(ns: Netns, pid: int) -> list[str]:
    """Local addresses of pid's listening TCP and bound UDP sockets, as ``proto addr:port``."""
    out = []
    for proto, flag in (("udp", "-u"), ("tcp", "-t")):
        res = subprocess.run(ns.argv("ss", "-Hlnp", flag), capture_output=True, text=True, check=True).stdout
        for line in res.splitlines():
            if f"pid={pid}," in line:
                out.append(f"{proto} {line.split()[3]}")
    return sorted(out)


def _keys(tmp: Path) -> Path:
    keys = tmp / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    return keys


def test_a_tentative_roster_address_is_listened_on_once_usable(tmp_path: Path) -> None:
    ns = _node("dad", 3, 3000)
    agent = None
    try:
        assert _tentative(ns), "the roster address should be tentative right after it was added"
        zone = (f'[zone]\nnode_id = 1\nkeys_file = "{_keys(tmp_path)}"\n'
                f'[[zone.nodes]]\nid = 1\nzone = 1\naddr = "{ROSTER}"\n'
                '[[zone.nodes]]\nid = 2\nzone = 1\naddr = "fd68::2"\n')
        agent = AgentProc(tmp_path, IF, netns=ns, extra_toml=zone)
        agent.start()
        assert agent.proc is not None
        pid = agent.proc.pid  # nsenter execs laminard: the same process
        deadline = time.monotonic() + 40
        while _tentative(ns) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _tentative(ns), "DAD never finished"
        want = [f"tcp [{ROSTER}]:7441", f"tcp [{ROSTER}]:7442", f"udp [{ROSTER}]:7440"]
        deadline = time.monotonic() + 15  # the zone looks every 2 s (REBIND_INTERVAL_S)
        while _listening(ns, pid) != want and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _listening(ns, pid) == want, agent.log()
        if "listening on :: until it is usable" in agent.log():  # (else the start outlasted DAD: waited)
            assert "usable now: listening on it" in agent.log()
    finally:
        if agent is not None:
            agent.cleanup()
        delete_netns(ns)


SCRIPT = """
import asyncio, json, sys
from laminar.zone.component import ZoneComponent
nodes = [{"id": 1, "zone": 1, "addr": sys.argv[1]}, {"id": 2, "zone": 1, "addr": "fd68::2"}]
async def main():
    comp = ZoneComponent(settings={"node_id": 1, "nodes": nodes, "keys_file": sys.argv[2], "summary_interval_s": 600},
                         gpus=0, loan={"elastic_interval_s": 0})
    comp.rebind.interval_s = 3600  # only the wait at start can bind it
    await comp.start(None)
    try:
        print(json.dumps([comp.listen_host, comp.endpoint.sock.getsockname()[0],
                          [s.getsockname()[0] for s in comp.server.server.sockets]]))
    finally:
        await comp.stop()
asyncio.run(main())
"""


def test_the_zone_waits_for_a_roster_address_still_tentative_at_start(tmp_path: Path) -> None:
    ns = _node("dadw", 1, 1000)  # the default DAD: about 1 to 2 s
    try:
        assert _tentative(ns)
        env = {**os.environ, "PYTHONPATH": f"{REPO}/agent"}
        res = subprocess.run(ns.argv(sys.executable, "-c", SCRIPT, ROSTER, str(_keys(tmp_path))), capture_output=True,
                             text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == [ROSTER, ROSTER, [ROSTER]], res.stderr
    finally:
        delete_netns(ns)


def _zone_events(agent: AgentProc) -> list[str]:
    out = agent.ctl("-o", "json", "events", "--kind", "zone", "--limit", "200").stdout
    return [str(e.get("message", "")) for e in json.loads(out)]


def test_an_explicit_listen_address_still_tentative_is_listened_on_once_usable(tmp_path: Path) -> None:
    """``zone.listen`` naming the address itself, still tentative at start: the agent starts
    (listening on :: meanwhile, with a zone event saying why) and moves onto it once DAD is done,
    the transfer listener too. Before, it waited 5 s and then failed to start on EADDRNOTAVAIL
    ("Cannot assign requested address", naming neither key nor address)."""
    ns = _node("dadl", 3, 3000)
    agent = None
    try:
        assert _tentative(ns), "the listen address should be tentative right after it was added"
        zone = (f'[zone]\nnode_id = 1\nlisten = "{ROSTER}"\nkeys_file = "{_keys(tmp_path)}"\n'
                f'[[zone.nodes]]\nid = 1\nzone = 1\naddr = "{ROSTER}"\n'
                '[[zone.nodes]]\nid = 2\nzone = 1\naddr = "fd68::2"\n')
        agent = AgentProc(tmp_path, IF, netns=ns, extra_toml=zone)
        agent.start()
        assert agent.proc is not None
        pid = agent.proc.pid
        waited = _tentative(ns)  # (else the start outlasted DAD: nothing was left to wait for)
        if waited:
            events = _zone_events(agent)
            assert any(f"zone.listen address {ROSTER} is still tentative" in e and "listening on ::" in e
                       for e in events), events
        deadline = time.monotonic() + 40
        while _tentative(ns) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _tentative(ns), "DAD never finished"
        want = [f"tcp [{ROSTER}]:7441", f"tcp [{ROSTER}]:7442", f"udp [{ROSTER}]:7440"]
        deadline = time.monotonic() + 15  # the zone looks every 2 s (REBIND_INTERVAL_S)
        while _listening(ns, pid) != want and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _listening(ns, pid) == want, agent.log()
        if waited:
            assert any(f"zone.listen address {ROSTER} is usable now: listening on it" in e
                       for e in _zone_events(agent)), agent.log()
    finally:
        if agent is not None:
            agent.cleanup()
        delete_netns(ns)


def _failed_start(agent: AgentProc) -> str:
    """Start ``agent``, which must exit non-zero; its log."""
    agent.start(wait=False)
    assert agent.proc is not None
    try:
        rc = agent.proc.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"laminard kept running:\n{agent.log()}") from None
    assert rc != 0, agent.log()
    return agent.log()


def test_an_explicit_listen_address_not_on_this_host_fails_the_start_naming_it(tmp_path: Path) -> None:
    """``zone.listen`` names an address no interface here holds (a typo, another node's): the
    agent does not start, and says which address and why. Before, the error was the bare
    "[Errno 99] Cannot assign requested address"."""
    ns = _node("dada", 1, 1000)
    agent = None
    try:
        zone = (f'[zone]\nnode_id = 1\nlisten = "fd68::77"\nkeys_file = "{_keys(tmp_path)}"\n'
                f'[[zone.nodes]]\nid = 1\nzone = 1\naddr = "{ROSTER}"\n'
                '[[zone.nodes]]\nid = 2\nzone = 1\naddr = "fd68::2"\n')
        agent = AgentProc(tmp_path, IF, netns=ns, extra_toml=zone)
        log = _failed_start(agent)
        assert "zone.listen fd68::77" in log and "not an address of this host" in log, log
    finally:
        if agent is not None:
            agent.cleanup()
        delete_netns(ns)


def test_an_explicit_listen_address_that_failed_dad_fails_the_start_naming_it(tmp_path: Path) -> None:
    """``zone.listen`` names an address whose duplicate address detection failed (another host
    on the link holds it: here the peer namespace at the other end of the veth). It never
    becomes usable by itself, so the agent does not start, and says so."""
    ns, peer, agent = make_netns("dadd"), None, None
    try:
        peer = make_netns("daddp")
        ns.run("ip", "link", "add", IF, "type", "veth", "peer", "name", f"{IF}p", "netns", peer.name)
        peer.run("ip", "addr", "add", f"{ROSTER}/64", "dev", f"{IF}p", "nodad")
        peer.run("ip", "link", "set", f"{IF}p", "up")
        ns.run("ip", "link", "set", IF, "up")
        ns.run("ip", "addr", "add", "10.68.0.1/24", "dev", IF)
        ns.run("ip", "route", "add", "default", "via", "10.68.0.254", "dev", IF)
        ns.run("ip", "addr", "add", f"{ROSTER}/64", "dev", IF)  # DAD: the peer answers, it holds it

        def dadfailed() -> bool:
            return ROSTER in ns.run("ip", "-6", "-o", "addr", "show", "dev", IF, "dadfailed").stdout

        deadline = time.monotonic() + 30
        while not dadfailed() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dadfailed(), ns.run("ip", "-6", "-o", "addr", "show", "dev", IF).stdout
        zone = (f'[zone]\nnode_id = 1\nlisten = "{ROSTER}"\nkeys_file = "{_keys(tmp_path)}"\n'
                f'[[zone.nodes]]\nid = 1\nzone = 1\naddr = "{ROSTER}"\n'
                '[[zone.nodes]]\nid = 2\nzone = 1\naddr = "fd68::2"\n')
        agent = AgentProc(tmp_path, IF, netns=ns, extra_toml=zone)
        log = _failed_start(agent)
        assert f"zone.listen {ROSTER}" in log and "duplicate address detection failed" in log, log
    finally:
        if agent is not None:
            agent.cleanup()
        delete_netns(ns)
        if peer is not None:
            delete_netns(peer)
