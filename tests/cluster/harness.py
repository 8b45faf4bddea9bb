"""A real cluster of laminard agents for tests and benchmarks: one network namespace per agent,
all on one bridge of the test's own (``lmt-br-<rand>``), talking real UDP and TCP.

    with Cluster.create(tmp_path, zones=3, per_zone=3, gpus=2) as c:
        r = c.place(0, {"name": "x", "command": ["sleep", "30"]}, gpus=1)
        c.nodes[4].json("jobs")

Each agent gets its own state dir, socket, pin root and cgroup root (``tests/agentproc.py``),
declared GPUs, and a ``[zone]`` section listing all nodes; every zone has its own key, and the
key file (mode 0600) holds all of them. With ``node_keys=True`` every node also gets a node key
(``Cluster.node_key_files``) and its pubkey in the roster (docs/protocol.md, *Node keys*).
Everything (agents, their jobs and cgroups, namespaces, veths, the bridge) is removed on exit,
also when the test fails.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from agentproc import VENV_BIN, AgentProc, cleanup_all  # noqa: E402
from conftest import Netns, delete_netns, kernel_ready, make_netns, run  # noqa: E402

from laminar.zone.keys import generate_node_key  # noqa: E402

UDP_PORT = 7440
TCP_PORT = 7441


def cluster_ready() -> str | None:
    """Why a cluster cannot run here, or None."""
    return kernel_ready()


def parse_events(text: str) -> list[dict[str, Any]]:
    """The JSON objects a job printed one per line (its log); other lines are skipped."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def wait_until(fn: Callable[[], Any], timeout: float = 30.0, what: str = "condition", every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# a UDP datagram with a source address of one's choosing: IPv4 and UDP headers written by hand
# (IPPROTO_RAW: the kernel takes the IP header as given, filling in its checksum; UDP checksum 0: none)
_SPOOF = """
import socket, struct, sys
src, sport, dst, dport, data = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), bytes.fromhex(sys.argv[5])
udp = struct.pack("!HHHH", sport, dport, 8 + len(data), 0) + data
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as s:
    s.sendto(ip + udp, (dst, 0))
"""


class ZoneAgent(AgentProc):
    """A real laminard for zone tests, with two differences from ``laminard`` itself:

    - the zone component is imported before the config is read, so the ``[zone]`` section is
      known even where laminar.config does not list it itself;
    - Airlock is left out (``airlock=False``): it treats an OOM kill anywhere on the host as a
      critical signal, and on this shared machine other tests' memory storms would make it
      reclaim the cluster's jobs, which would hide what these tests check (placement).
    """

    airlock = False

    def start(self, wait: bool = True, timeout: float = 60.0) -> None:
        log = open(self.log_path, "ab")
        drop = "" if self.airlock else "A.COMPONENTS[:] = [c for c in A.COMPONENTS if 'airlock' not in c]; "
        code = f"import sys, laminar.zone.component, laminar.agent as A; {drop}sys.exit(A.main())"
        self.proc = subprocess.Popen(self.argv(str(VENV_BIN / "python"), "-c", code, "--config", str(self.config_path)),
                                     stdout=log, stderr=log, start_new_session=True)
        log.close()
        if wait:
            self.wait_ready(timeout)


@dataclass
class Node:
    index: int  # 0-based
    node_id: int
    zone: int
    addr: str  # as `ip` prints it (an IPv6 one canonical: no leading zeros), whatever the roster spelling
    netns: Netns
    host_if: str
    agent: ZoneAgent
    mac: str = ""

    def json(self, *args: str) -> Any:
        return self.agent.json(*args)

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.agent.ctl(*args, check=check)


@dataclass
class Cluster:
    tmp: Path
    bridge: str
    subnet: str
    keys: dict[int, bytes]
    keys_file: Path
    nodes: list[Node] = field(default_factory=list)
    node_key_files: dict[int, Path] = field(default_factory=dict)  # node id -> its node key (node_keys=True)
    node_pubkeys: dict[int, str] = field(default_factory=dict)  # node id -> its node key's pubkey (hex)

    @classmethod
    @contextmanager
    def create(cls, tmp: Path, zones: int = 3, per_zone: int = 3, gpus: int = 2, cpus: int = 8,
               memory_mb: int = 16_000, pools: dict[int, str] | None = None, handover_timeout_s: float = 10.0,
               zone_extra: str = "", node_extra: dict[int, str] | None = None,
               probe_timeout_s: float = 0.2, ipv6: bool = False, node_keys: bool = False,
               roster_pubkeys: bool = True, root_from: list[int] | None = None,
               airlock: tuple[int, ...] = ()) -> Iterator[Cluster]:
        """``ipv6``: the nodes' roster addresses are IPv6 (a ULA /64, written ``[addr]:port``),
        and the namespaces have no IPv4 address at all (an IPv6-only fabric). ``node_keys``:
        every node has a node key file and its pubkey in the roster (pair MACs everywhere); with
        ``roster_pubkeys=False`` the key files are there (``node_key_files``, ``node_pubkeys``)
        but the roster lists no pubkey yet (zone-key MACs, until a config lists them).
        ``root_from``: ``[zone] root_from`` of every node; None (the default): every node of the
        cluster, which is one operator's machines running the tests' jobs as root (the agent's
        own default is none: docs/protocol.md, *Authority*). ``airlock``: the nodes (0-based
        indexes) whose agent runs Airlock (``ZoneAgent.airlock``; give them an ``[airlock]``
        budget of the test's own through ``node_extra``)."""
        tag = secrets.token_hex(3)
        bridge = f"lmt-br-{tag}"
        subnet = f"10.{secrets.randbelow(100) + 120}.{secrets.randbelow(250) + 1}"
        if ipv6:  # a random fd00::/8 ULA /48 prefix; no DAD, so the addresses can be bound at once.
            # Its second and third groups are written with a leading zero ("fd62:0147:0c4b::1"), a
            # spelling operators use that the agent must treat as the address ``ip`` prints
            # ("fd62:147:c4b::1"): the roster is written so, Node.addr is the canonical form.
            subnet = f"fd{secrets.token_hex(1)}:0{secrets.randbelow(0xF00) + 0x100:x}:0{secrets.randbelow(0xF00) + 0x100:x}:"
        sep, plen, nodad = (":", "64", ("nodad",)) if ipv6 else (".", "24", ())
        tmp = Path(tmp) / f"cluster-{tag}"
        tmp.mkdir(parents=True)
        keys = {z: secrets.token_bytes(32) for z in range(1, zones + 1)}
        keys_file = tmp / "zone.keys"
        keys_file.write_text("".join(f"{z} {k.hex()}\n" for z, k in keys.items()))
        os.chmod(keys_file, 0o600)
        c = cls(tmp, bridge, subnet, keys, keys_file)
        created_ns: list[Netns] = []
        try:
            run("ip", "link", "add", bridge, "type", "bridge")
            run("ip", "addr", "add", f"{subnet}{sep}fe/{plen}" if ipv6 else f"{subnet}.254/24", "dev", bridge, *nodad)
            run("ip", "link", "set", bridge, "up")
            n = zones * per_zone
            trusted = list(range(1, n + 1)) if root_from is None else list(root_from)
            if node_keys:
                c.node_key_files = {i + 1: tmp / f"node{i + 1}.key" for i in range(n)}
            c.node_pubkeys = {nid: generate_node_key(path).hex() for nid, path in c.node_key_files.items()}
            pubs = c.node_pubkeys if roster_pubkeys else {}
            members = []
            for i in range(n):
                zone = 1 + i // per_zone
                addr = f"{subnet}{sep}{i + 1}"
                pool = (pools or {}).get(i, "")
                members.append({"id": i + 1, "zone": zone, "addr": f"[{addr}]:{UDP_PORT}" if ipv6 else f"{addr}:{UDP_PORT}",
                                "handover_port": TCP_PORT,
                                **({"pool": pool} if pool else {})})
            nodes_toml = "".join(
                f'\n[[zone.nodes]]\nid = {m["id"]}\nzone = {m["zone"]}\naddr = "{m["addr"]}"\nhandover_port = {TCP_PORT}\n'
                + (f'pool = "{m["pool"]}"\n' if m.get("pool") else "")
                + (f'pubkey = "{pubs[m["id"]]}"\n' if m["id"] in pubs else "")
                for m in members)
            for i in range(n):
                ns = make_netns(f"z{i}")
                created_ns.append(ns)
                host_if, ns_if = f"lmt{tag}{i:02d}h", f"lmt{tag}{i:02d}n"
                run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", ns.name)
                run("ip", "link", "set", host_if, "master", bridge)
                run("ip", "link", "set", host_if, "up")
                addr = f"{subnet}{sep}{i + 1}"
                ns.run("ip", "addr", "add", f"{addr}/{plen}", "dev", ns_if, *nodad)
                ns.run("ip", "link", "set", ns_if, "up")
                mac = json.loads(ns.run("ip", "-j", "link", "show", "dev", ns_if).stdout)[0]["address"]
                zone_toml = (
                    f'[gpus]\ndeclared = {gpus}\n\n[zone]\nnode_id = {i + 1}\nport = {UDP_PORT}\n'
                    f'handover_port = {TCP_PORT}\nkeys_file = "{keys_file}"\ncpus = {cpus}\nmemory_mb = {memory_mb}\n'
                    f'summary_interval_s = 0.3\nprobe_timeout_s = {probe_timeout_s}\nhandover_timeout_s = {handover_timeout_s}\n'
                    f'root_from = {trusted}\n'
                    + (f'node_key_file = "{c.node_key_files[i + 1]}"\n' if node_keys else "")
                    + f'{zone_extra}\n'
                    f'{(node_extra or {}).get(i, "")}\n{nodes_toml}'
                )
                agent = ZoneAgent(tmp, ns_if, ns, extra_toml=zone_toml, node=f"z{1 + i // per_zone}n{i + 1}")
                if i in airlock:
                    agent.airlock = True
                c.nodes.append(Node(i, i + 1, 1 + i // per_zone, str(ipaddress.ip_address(addr)), ns, host_if, agent, mac))
            for nd in c.nodes:
                nd.agent.start(wait=False)
            for nd in c.nodes:
                nd.agent.wait_ready(90)
            c.wait_converged()
            yield c
        finally:
            # every step runs, also when Ctrl-C arrives during one (then raised again: the run stops)
            cleanup_all(lambda: c._terminate(), *(lambda nd=nd: c._cleanup_node(nd) for nd in c.nodes),
                        *(lambda ns=ns: delete_netns(ns) for ns in created_ns),
                        lambda: run("ip", "link", "delete", bridge, check=False))

    def _terminate(self) -> None:
        """SIGTERM to every running agent at once, so that they stop side by side."""
        for nd in self.nodes:
            if nd.agent.proc is not None and nd.agent.proc.poll() is None:
                nd.agent.proc.terminate()

    @staticmethod
    def _cleanup_node(nd: Node) -> None:
        try:
            nd.agent.cleanup()
        except Exception as e:  # keep cleaning the others; Ctrl-C goes on to cleanup_all
            print(f"cleanup of node {nd.node_id} failed: {e}", file=sys.stderr)

    def wait_converged(self, timeout: float = 30.0) -> None:
        """Until every agent holds a fresh summary of every other zone and a summary from every
        running peer of its own zone (placements can go anywhere: before its peers' summaries are
        in, a node of a one-zone cluster sees no fit on them and a placement is queued out)."""
        zones = {nd.zone for nd in self.nodes}

        def running(nd: Node) -> bool:
            return nd.agent.proc is not None and nd.agent.proc.poll() is None

        def ok() -> bool:
            up = {nd.node_id for nd in self.nodes if running(nd)}
            for nd in self.nodes:
                if nd.node_id not in up:
                    continue
                st = nd.json("zone", "stats")
                if set(map(int, st["zone_summaries"])) != zones - {nd.zone}:
                    return False
                heard = {int(p["node"]) for p in nd.json("zone", "peers") if p.get("summary_age_s") is not None}
                if {m.node_id for m in self.nodes if m.zone == nd.zone and m.node_id in up} - {nd.node_id} - heard:
                    return False
            return True

        wait_until(ok, timeout, "zone summaries to reach every agent", every=0.3)

    def send_spoofed(self, index: int, src: Node, dst: Node, data: bytes) -> None:
        """From node ``index``'s (0-based) namespace, send ``data`` as one UDP datagram to
        ``dst``'s zone port that claims to come from ``src``'s roster address and port (a raw
        socket writes the IP header: what a host on the segment that spoofs addresses can do).
        IPv4 clusters only."""
        if ":" in src.addr:
            raise ValueError("send_spoofed: IPv4 clusters only")
        self.nodes[index].netns.run(str(VENV_BIN / "python"), "-c", _SPOOF, src.addr, str(UDP_PORT), dst.addr,
                                    str(UDP_PORT), data.hex())

    def place(self, index: int, spec: dict[str, Any], gpus: float = 0.0, **extra: Any) -> dict[str, Any]:
        """POST /v1/placements on node ``index`` (0-based): the result (outcome, node, job id, times)."""
        from laminarctl.client import Client

        body = {"spec": spec, "gpus": gpus, **extra}
        out: dict[str, Any] = Client(str(self.nodes[index].agent.sock), timeout=180).post("/v1/placements", body)
        return out

    def multinode_view(self, index: int, job: str) -> dict[str, Any]:
        """The multi-node job's view as node ``index`` (0-based) shows it (GET /v1/jobs/{id}: on
        a node that hosts a member, the member's local job with the view under ``multinode``)."""
        from laminarctl.client import Client

        got = Client(str(self.nodes[index].agent.sock), timeout=60).get(f"/v1/jobs/{job}")
        return dict(got.get("multinode") or got)

    def jobs(self) -> dict[int, list[dict[str, Any]]]:
        """Active jobs per node id (agents that are down are skipped)."""
        out: dict[int, list[dict[str, Any]]] = {}
        for nd in self.nodes:
            if nd.agent.proc is None or nd.agent.proc.poll() is not None:
                continue
            out[nd.node_id] = [j for j in nd.json("jobs") if j["state"] in ("running", "suspended")]
        return out


@contextmanager
def off_roster_host(cluster: Cluster, addrs: int, first: int = 100) -> Iterator[tuple[Netns, list[str]]]:
    """A namespace of its own on ``cluster``'s bridge with ``addrs`` addresses of the cluster's
    subnet (``.first`` on), none in the roster: what a host that is not a member can send from.
    Its veth and namespace are removed on the way out, also when the body fails."""
    ns = make_netns("off")
    tag = secrets.token_hex(2)
    host_if, ns_if = f"lmto{tag}h", f"lmto{tag}n"
    try:
        run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", ns.name)
        run("ip", "link", "set", host_if, "master", cluster.bridge)
        run("ip", "link", "set", host_if, "up")
        out = [f"{cluster.subnet}.{first + k}" for k in range(addrs)]
        for a in out:
            ns.run("ip", "addr", "add", f"{a}/24", "dev", ns_if)
        ns.run("ip", "link", "set", ns_if, "up")
        yield ns, out
    finally:
        run("ip", "link", "delete", host_if, check=False)
        delete_netns(ns)
