"""IPv6 roster addresses: how ``[[zone.nodes]]`` addresses are written and shown.

An IPv6 address with a port is written in brackets (``[fd00::1]:7440``: its colons would run
into the port's); a bare IPv6 address takes the default port. ``laminarctl zone peers`` shows
addresses the same way, so what it prints can be pasted back into a config.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from ports import free_port
from test_zone_handover import SubmittingJobs
from test_zone_replay import until

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import HANDOVER_OK, ZoneComponent, demand_to_probe
from laminar.zone.membership import Membership, MembershipError, canonical_ip, host_port, members_from_config

# a hand-over names its job's owner (a missing one is refused: laminar.zone.authority); nobody
# has an account on every Debian host and needs no zone.root_from
NOBODY_IDS = {"owner_uid": 65534, "owner_gid": 65534}


@pytest.mark.parametrize(
    "addr, host, port",
    [
        ("10.0.0.1", "10.0.0.1", 7440),
        ("10.0.0.1:7500", "10.0.0.1", 7500),
        ("fd00::1", "fd00::1", 7440),
        ("[fd00::1]", "fd00::1", 7440),
        ("[fd00::1]:7500", "fd00::1", 7500),
        ("[FD00:0::1]:7500", "FD00:0::1", 7500),
    ],
)
def test_roster_addresses_in_every_written_form(addr, host, port):
    (m,) = members_from_config([{"id": 1, "zone": 1, "addr": addr}], 7440, 7441)
    assert (m.addr, m.port) == (host, port)


@pytest.mark.parametrize(
    "addr, match",
    [
        ("[10.0.0.1]:7500", "brackets are for IPv6"),
        ("[fd00::1]:", "port after"),
        ("[fd00::1]7500", r"expected '\[IPv6\]'"),
        ("[fd00::1", r"expected '\[IPv6\]'"),
        ("[fd00::1]:70000", "port must be 1..65535"),
        ("[host.example]:7500", "not an IPv6 address"),
        ("[fe80::2]:7500", "link-local address"),
        ("fe80::2", "link-local address"),
        ("[fe80::2%lmt0]:7500", "link-local address"),
    ],
)
def test_bad_bracket_forms_are_named(addr, match):
    with pytest.raises(MembershipError, match=match) as e:
        members_from_config([{"id": 3, "zone": 1, "addr": addr}], 7440, 7441)
    assert "zone.nodes[0]" in str(e.value)


def test_peers_show_ipv6_addresses_in_the_form_the_config_takes():
    rows = [{"id": 1, "zone": 1, "addr": "[fd00::1]:7500"}, {"id": 2, "zone": 1, "addr": "10.0.0.2:7500"}]
    m = Membership(1, members_from_config(rows, 7440, 7441))
    shown = {r["node"]: r["addr"] for r in m.peers(0.0)}
    assert shown == {1: "[fd00::1]:7500", 2: "10.0.0.2:7500"}
    # and that is read back as the same member
    again = members_from_config([{"id": 1, "zone": 1, "addr": shown[1]}], 7440, 7441)[0]
    assert (again.addr, again.port) == ("fd00::1", 7500)
    assert m.udp_sources()[1] == (canonical_ip("FD00:0::1"), 7500)


def _port(family: int, kind: int) -> int:
    return free_port(kind, "::1" if family == socket.AF_INET6 else "127.0.0.1", family)


async def _with_nodes(tmp: Path, hosts: dict[int, str], body: Callable[[dict[int, ZoneComponent]], Awaitable[None]],
                      listen: str | None = None, jobs: Callable[[int], Any] | None = None) -> None:
    """Real networked ZoneComponents on loopback, node -> roster IP in ``hosts`` (written
    ``[IP]:PORT`` for IPv6), all listening on ``listen`` (None: the default, zone.listen unset)."""
    keys = tmp / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    fam = {n: socket.AF_INET6 if ":" in h else socket.AF_INET for n, h in hosts.items()}
    ports = {n: (_port(fam[n], socket.SOCK_DGRAM), _port(fam[n], socket.SOCK_STREAM)) for n in hosts}
    nodes = [{"id": n, "zone": 1, "addr": host_port(hosts[n], u), "handover_port": t} for n, (u, t) in ports.items()]
    comps = {}
    for n, (u, t) in ports.items():
        settings = {"node_id": n, "nodes": nodes, "keys_file": str(keys), "port": u, "handover_port": t,
                    "cpus": 8, "memory_mb": 8000, "summary_interval_s": 600, **({"listen": listen} if listen else {})}
        comps[n] = ZoneComponent(settings=settings, jobs=jobs(n) if jobs else None, gpus=2, loan={"elastic_interval_s": 0})
    started = []
    try:
        for c in comps.values():
            await c.start(None)
            started.append(c)
        await body(comps)
    finally:
        for c in started:
            await c.stop()


SUMMARY = wire.Summary(gpu_free_centi=(100,) * 7, cpus_milli=777_000, memory_mb=77_777, draining=False)


def test_an_ipv6_zone_with_the_default_listen_address_talks(tmp_path: Path) -> None:
    """Roster addresses IPv6, zone.listen left at its default (0.0.0.0): node 1's datagrams reach
    node 2 and node 2's hand-over reaches node 1, each from its roster address. Before, the
    default bound an IPv4 socket, which cannot send to an IPv6 address: every datagram was a
    send error (the zone looked up and never heard a peer) and hand-overs were refused."""
    tables = {n: SubmittingJobs(tmp_path / f"state{n}") for n in (1, 2)}
    spec = json.dumps({"spec": {"command": ["sleep", "1"], "name": "v6"}, **NOBODY_IDS}).encode()

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2 = comps[1], comps[2]
        before = n2.endpoint.received
        n1.endpoint.send(2, SUMMARY)
        assert await until(lambda: n2.endpoint.received > before), n1.endpoint.send_errors
        assert n1.endpoint.send_errors == 0
        assert n2.membership.state[1].last_summary is not None
        assert n2.decoder.drops["wrong_source"] == 0
        pid = 0x6606
        offer = n1.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 30.0))
        assert isinstance(offer, wire.Offer)
        ack = await n2.submitter.t.handover(1, 0, wire.Handover(pid, spec), 5.0)
        assert ack.status == HANDOVER_OK, ack
        assert len(tables[1].jobs) == 1 and n1.tcp_decoder is not None
        assert n1.tcp_decoder.drops["wrong_source"] == 0

    asyncio.run(_with_nodes(tmp_path, {1: "::1", 2: "::1"}, body, jobs=tables.get))


def test_a_dual_stack_listen_address_reaches_ipv4_peers(tmp_path: Path) -> None:
    """zone.listen = '::' (one socket for both families) with IPv4 roster addresses: node 1
    sends to node 2 (v4-mapped) and takes node 2's hand-over. Before, the '::' socket could not
    send to an IPv4 address (every datagram a send error) and the '::' hand-over server took
    IPv6 connections only."""
    tables = {n: SubmittingJobs(tmp_path / f"state{n}") for n in (1, 2)}
    spec = json.dumps({"spec": {"command": ["sleep", "1"], "name": "dual"}, **NOBODY_IDS}).encode()

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2 = comps[1], comps[2]
        before = n2.endpoint.received
        n1.endpoint.send(2, SUMMARY)
        assert await until(lambda: n2.endpoint.received > before), n1.endpoint.send_errors
        assert n1.endpoint.send_errors == 0 and n2.decoder.drops["wrong_source"] == 0
        pid = 0x4404
        assert isinstance(n1.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 30.0)), wire.Offer)
        ack = await n2.submitter.t.handover(1, 0, wire.Handover(pid, spec), 5.0)
        assert ack.status == HANDOVER_OK, ack

    asyncio.run(_with_nodes(tmp_path, {1: "127.0.0.1", 2: "127.0.0.1"}, body, listen="::", jobs=tables.get))


def test_an_ipv6_roster_address_not_on_this_host_listens_on_any_address(tmp_path: Path) -> None:
    """zone.listen unset binds the roster address itself on an IPv6 roster (so traffic leaves
    from it); where this host does not hold it (NAT, an address still tentative at boot) the
    agent listens on '::' rather than failing to start."""
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    u, t = _port(socket.AF_INET6, socket.SOCK_DGRAM), _port(socket.AF_INET6, socket.SOCK_STREAM)
    nodes = [{"id": 1, "zone": 1, "addr": f"[fd00:0:1ab::7]:{u}", "handover_port": t},
             {"id": 2, "zone": 1, "addr": "[::1]:7440"}]
    comp = ZoneComponent(settings={"node_id": 1, "nodes": nodes, "keys_file": str(keys), "port": u, "handover_port": t,
                                   "summary_interval_s": 600}, gpus=0, loan={"elastic_interval_s": 0})

    async def run() -> None:
        await comp.start(None)
        try:
            assert comp.listen_host == "::"
            assert comp.endpoint.sock.getsockname()[:2] == ("::", u)
        finally:
            await comp.stop()

    asyncio.run(run())


@pytest.mark.parametrize("listen", ["fd00:0:1ab::7", "192.0.2.77"])
def test_an_explicit_listen_address_not_on_this_host_fails_the_start_naming_it(tmp_path: Path, listen: str) -> None:
    """zone.listen set to an address this host does not hold: the start fails saying which
    address and what to do, where the roster address's default would listen on any address.
    Before, the error was the socket's bare "[Errno 99] Cannot assign requested address". (A
    tentative and a DAD-failed one: tests/kernel/test_zone_tentative_roster.py.)"""
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    nodes = [{"id": 1, "zone": 1, "addr": "[::1]:7440"}, {"id": 2, "zone": 1, "addr": "[::1]:7450"}]
    comp = ZoneComponent(settings={"node_id": 1, "nodes": nodes, "keys_file": str(keys), "listen": listen,
                                   "summary_interval_s": 600}, gpus=0, loan={"elastic_interval_s": 0})

    async def run() -> None:
        try:
            await comp.start(None)
        finally:
            await comp.stop()

    with pytest.raises(RuntimeError, match=rf"zone\.listen {listen} is not an address of this host"):
        asyncio.run(run())


def test_the_transfer_command_line_takes_bracketed_ipv6_addresses() -> None:
    """``python -m laminar.migrate.transfer serve --listen [fd00::2]:7480`` / ``send --to ...``:
    the brackets are the address's writing, not part of it (before, '[fd00::2]' went to the
    resolver and the command failed to bind or connect)."""
    import argparse

    from laminar.migrate.transfer.cli import _hostport

    assert _hostport("[fd00::2]:7480") == ("fd00::2", 7480)
    assert _hostport("10.0.0.2:7480") == ("10.0.0.2", 7480)
    with pytest.raises(argparse.ArgumentTypeError, match="HOST:PORT"):
        _hostport("[fd00::2]")


@pytest.mark.parametrize("section, value", [("zone", "[fd00::1]"), ("zone", "[fd00::1]:7440"), ("zone", "host.example"),
                                            ("migrate", "[fd00::1]"), ("migrate", "10.0.0.1:7442")])
def test_a_listen_address_that_cannot_be_bound_is_refused_by_the_config_check(tmp_path: Path, section: str,
                                                                               value: str) -> None:
    """zone.listen / migrate.listen name one IP address (no brackets, no port: the ports are
    their own keys). '[fd00::1]', written as in zone.nodes, passed --check-config and then
    laminard failed to start on a resolver error that did not name the key."""
    import laminar.migrate.reclaim  # noqa: F401  (registers [migrate])
    import laminar.zone.component  # noqa: F401  (registers [zone])
    from laminar.config import ConfigError, load

    p = tmp_path / "laminard.toml"
    p.write_text(f'[{section}]\nlisten = "{value}"\n')
    with pytest.raises(ConfigError, match=rf"{section}\.listen.*IP address"):
        load(p)
    p.write_text(f'[{section}]\nlisten = "fd00::1"\n')
    assert load(p).section(section)["listen"] == "fd00::1"


def test_a_roster_mixing_ipv4_and_ipv6_is_refused_while_sources_are_checked(tmp_path: Path) -> None:
    """With zone.check_source a node is heard only from its listed address, so a node listed by
    IPv6 and one listed by IPv4 can never hear each other (neither can send from its listed
    address to the other's). The agent refuses to start naming one of each; before, it started
    and the two families' nodes silently never heard each other (send errors, or wrong_source).
    Without the check (NAT'd, dual-stack listen '::') such a roster is taken."""
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    u, t = _port(socket.AF_INET6, socket.SOCK_DGRAM), _port(socket.AF_INET6, socket.SOCK_STREAM)
    nodes = [{"id": 1, "zone": 1, "addr": f"[::1]:{u}", "handover_port": t}, {"id": 2, "zone": 1, "addr": "127.0.0.1:7440"}]

    async def run(check: bool) -> str:
        comp = ZoneComponent(settings={"node_id": 1, "nodes": nodes, "keys_file": str(keys), "port": u, "handover_port": t,
                                       "summary_interval_s": 600, "check_source": check, "listen": "::"},
                             gpus=0, loan={"elastic_interval_s": 0})
        try:
            await comp.start(None)
        except RuntimeError as e:
            return str(e)
        await comp.stop()
        return ""

    err = asyncio.run(run(True))
    assert "node 1 (::1)" in err and "node 2 (127.0.0.1)" in err and "one family" in err, err
    assert asyncio.run(run(False)) == ""


def test_a_failed_handover_names_an_ipv6_peer_in_brackets() -> None:
    """The hand-over's errors name the peer as a config writes it, ``[::1]:PORT``; before they
    read ``::1:PORT``, which is ambiguous (is the port part of the address?) and cannot be
    pasted back into zone.nodes."""
    from laminar.zone.keys import ephemeral_keys
    from laminar.zone.transport import HandoverError, handover

    keys = ephemeral_keys()
    closed = _port(socket.AF_INET6, socket.SOCK_STREAM)  # bound and closed: nothing listens there

    async def run() -> str:
        try:
            await handover(wire.Encoder(1, keys), wire.Decoder(keys, {1: 1, 2: 1}, node=1), 1, "::1", closed,
                           wire.Handover(0x77, b"{}"), 5.0, to=2)
        except HandoverError as e:
            return str(e)
        raise AssertionError("a hand-over to a closed port succeeded")

    err = asyncio.run(run())
    assert f"[::1]:{closed}" in err, err


def test_a_zone_port_in_use_names_the_ipv6_address_in_brackets(tmp_path: Path) -> None:
    """zone.port taken on zone.listen's address: the start fails naming what it could not bind,
    ``[::1]:PORT`` (UDP) and the key; before, the bare "[Errno 98] Address already in use"."""
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as taken:
        taken.bind(("::1", 0))
        u = taken.getsockname()[1]
        nodes = [{"id": 1, "zone": 1, "addr": f"[::1]:{u}"}, {"id": 2, "zone": 1, "addr": "[::1]:7450"}]
        comp = ZoneComponent(settings={"node_id": 1, "nodes": nodes, "keys_file": str(keys), "port": u,
                                       "handover_port": _port(socket.AF_INET6, socket.SOCK_STREAM),
                                       "summary_interval_s": 600}, gpus=0, loan={"elastic_interval_s": 0})

        async def run() -> None:
            try:
                await comp.start(None)
            finally:
                await comp.stop()

        with pytest.raises(RuntimeError, match=rf"\[::1\]:{u}.*zone\.port") as e:
            asyncio.run(run())
    assert "Address already in use" in str(e.value)
