"""How a member of a multi-node job starts: the argv it runs and the environment the agent adds.

The origin hands member ``i`` a hand-over whose spec JSON carries, beside the JobSpec keys, the
*member block* (:class:`MemberBlock`)::

    {"job": "job-7-n3", "origin": 3, "index": 1, "count": 3, "min": 2, "max": 4,
     "nodes": [[5, "10.9.0.5"], [8, "10.9.0.8"], [2, "10.9.0.2"]],
     "endpoint": "10.9.0.5:29517", "launcher": "torchrun", "generation": 0}

:func:`launch` turns the block and the spec's command into what the member runs. With the
``torchrun`` launcher, ``python train.py --lr 0.1`` becomes::

    python -m torch.distributed.run --nnodes=2:4 --nproc-per-node=1 --rdzv-backend=c10d
        --rdzv-endpoint=10.9.0.5:29517 --rdzv-id=job-7-n3 --max-restarts=3
        --local-addr=10.9.0.8 --rdzv-conf=is_host=0,last_call_timeout=5 train.py --lr 0.1

(the same ``python``: the user's environment provides torch; ``python -m mod args`` becomes
``... -m mod args``). With ``plain`` the command runs as it is. Either way the member gets
``MASTER_ADDR``, ``MASTER_PORT`` (the endpoint), ``WORLD_SIZE`` (count), ``RANK`` (index),
``LOCAL_RANK=0``, ``LAMINAR_MEMBERS`` (the members' addresses in index order, comma-separated),
``LAMINAR_MEMBER`` (index), ``LAMINAR_JOB_ID`` and, when the node's own address is on one of its
interfaces, ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` naming it (:func:`interface_of`:
nodes in network namespaces share one host name, so gloo must not resolve it). torchrun sets
``RANK``/``WORLD_SIZE``/``MASTER_*`` again for its workers, from the rendezvous.

``--rdzv-conf`` carries two things the design's argv did not, both needed on a real cluster:

* ``is_host``: member 0's torchrun hosts the c10d store, the others connect to it. Left out,
  torchrun guesses by resolving the host name and comparing its addresses with the endpoint's:
  in network namespaces (one host name, the namespace's own address) nobody matched, nobody
  hosted the store, and every member timed out.
* ``last_call_timeout`` (:data:`LAST_CALL_S`): once ``min`` members joined, torchrun waits this
  long for more before it starts; its default (30 s) delayed every elastic job placed with
  fewer than ``max`` members by 30 s. A member later than that joins through a membership
  change (TorchElastic restarts the workers; no ``--max-restarts`` is spent on it).

The torchrun launcher's env also sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(:data:`TORCHRUN_ENV`): by default (torch 2.5 on) torchrun's workers share the rendezvous
host's store, whose keys outlive a restart of the workers; after a member failed, a restarted
worker read the gloo address its dead predecessor had published and failed to connect, again
and again until ``--max-restarts`` ran out (seen here with torch 2.13; pytorch/pytorch#135712).
With it, each round's rank-0 worker hosts a new store on its node's ``--local-addr``.

Everything here is pure except :func:`interface_of`, which reads the node's interfaces.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

JOB_ID = re.compile(r"job-[0-9]{1,18}-n([0-9]{1,10})")  # a multi-node job's id; the group: the origin's node id
WORKERS_MAX = 64  # members of one job (runtime.spec.WORKERS_MAX)
NODE_ID_MAX = 2**32 - 1  # node ids are u32 on the zone's wire
GENERATION_MAX = 2**31 - 1
LAUNCHERS = ("torchrun", "plain")
MAX_RESTARTS = 3  # torchrun's --max-restarts: worker-group restarts on a member's failure before it gives up
PORT_BASE = 29400  # endpoint ports: PORT_BASE .. PORT_BASE + PORT_SPAN - 1 (TorchElastic's usual 29400 up)
PORT_SPAN = 600
LAST_CALL_S = 5  # rendezvous last call (see the module's docstring)
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see the module's docstring
_ADDR_CHARS_MAX = 64  # an IPv6 address's text is at most 45 characters
_ENDPOINT_CHARS_MAX = 80
_JOB_CHARS_MAX = 32  # "job-" 18 digits "-n" 10 digits
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_CONF_KEY = re.compile(r"[a-z_]{1,40}")
_CONF_VALUE = re.compile(r"[A-Za-z0-9_.]{1,40}")
_KEYS = ("job", "origin", "index", "count", "min", "max", "nodes", "endpoint", "launcher", "generation")


class LaunchError(ValueError):
    """A member block or a command that cannot be launched; the message names the value and
    what is allowed."""


def _brief(v: Any, n: int = 60) -> str:
    r = repr(v) if not isinstance(v, (str, bytes)) or len(v) <= 4 * n else repr(v[: 4 * n])
    return r if len(r) <= n else r[: n - 3] + "..."


def _int(d: Mapping[str, Any], key: str, lo: int, hi: int, why: str = "") -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise LaunchError(f"member block: {key} {_brief(v)} is not an integer (allowed: {lo}..{hi}{why})")
    if not lo <= v <= hi:
        raise LaunchError(f"member block: {key} {v} out of range {lo}..{hi}{why}")
    return v


def _addr(v: Any, where: str) -> str:
    if not isinstance(v, str) or len(v) > _ADDR_CHARS_MAX:
        raise LaunchError(f"member block: {where} {_brief(v)} is not an IP address string")
    try:
        return str(ipaddress.ip_address(v))
    except ValueError:
        raise LaunchError(f"member block: {where} {_brief(v)} is not an IP address (IPv4 or IPv6)") from None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(address, port) of ``"10.9.0.5:29517"`` or ``"[fd00::5]:29517"``; LaunchError naming
    the value otherwise (the address an IP address, the port 1..65535 in decimal digits)."""
    if not isinstance(endpoint, str) or len(endpoint) > _ENDPOINT_CHARS_MAX or ":" not in endpoint:
        raise LaunchError(f"member block: endpoint {_brief(endpoint)} is not \"address:port\"")
    host, _, port = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise LaunchError(f"member block: endpoint {_brief(endpoint)}: brackets are for an IPv6 address")
    elif ":" in host:
        raise LaunchError(f"member block: endpoint {_brief(endpoint)}: an IPv6 address goes in brackets, [addr]:port")
    if not port.isascii() or not port.isdigit() or len(port) > 5 or not 1 <= int(port) <= 65535:
        raise LaunchError(f"member block: endpoint {_brief(endpoint)}: port {_brief(port)} is not 1..65535")
    return _addr(host, "endpoint address"), int(port)


def _join_endpoint(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


@dataclass(frozen=True)
class MemberBlock:
    """One member's view of its multi-node job (the hand-over's ``"member"`` key)."""

    job: str
    origin: int  # the node that placed the job and keeps its record
    index: int  # this member: 0..count-1
    count: int  # members placed in this generation
    min: int  # elastic bounds (min == max: rigid)
    max: int
    nodes: tuple[tuple[int, str], ...]  # index -> (node id, address)
    endpoint: str  # the c10d rendezvous endpoint, on member 0's address
    launcher: str  # "torchrun" or "plain"
    generation: int  # restarts of the whole job

    @classmethod
    def from_dict(cls, d: Any) -> MemberBlock:
        """The block ``d`` (parsed JSON) checked in full; LaunchError (a ValueError) naming the
        first value that is wrong and what is allowed. Work is bounded by the sizes checked
        before anything is iterated (at most WORKERS_MAX nodes, short strings)."""
        if not isinstance(d, dict):
            raise LaunchError(f"member block: {_brief(d)} is not an object")
        unknown = [k for k in list(d)[: len(_KEYS) + 1] if k not in _KEYS]
        if unknown or len(d) > len(_KEYS):
            raise LaunchError(f"member block: unknown keys {_brief(sorted(map(str, unknown)))}; allowed: {list(_KEYS)}")
        missing = [k for k in _KEYS if k not in d]
        if missing:
            raise LaunchError(f"member block: missing {missing}")
        job = d["job"]
        m = JOB_ID.fullmatch(job) if isinstance(job, str) and len(job) <= _JOB_CHARS_MAX else None
        if m is None:
            raise LaunchError(f"member block: job {_brief(job)} is not a multi-node job id (job-<number>-n<origin node>)")
        origin = _int(d, "origin", 0, NODE_ID_MAX)
        if int(m.group(1)) != origin:
            raise LaunchError(f"member block: job {job} was not made by origin {origin} (its id ends in -n{origin})")
        count = _int(d, "count", 1, WORKERS_MAX)
        lo = _int(d, "min", 1, count, f" (count {count})")
        hi = _int(d, "max", count, WORKERS_MAX, f" (count {count})")
        index = _int(d, "index", 0, count - 1, f" (count {count})")
        raw = d["nodes"]
        if not isinstance(raw, (list, tuple)) or len(raw) != count:
            n = len(raw) if isinstance(raw, (list, tuple)) else _brief(raw)
            raise LaunchError(f"member block: nodes holds {n} members, count says {count} (a list of [node, address])")
        nodes: list[tuple[int, str]] = []
        for i, e in enumerate(raw):
            if not isinstance(e, (list, tuple)) or len(e) != 2:
                raise LaunchError(f"member block: nodes[{i}] {_brief(e)} is not [node id, address]")
            node = e[0]
            if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node <= NODE_ID_MAX:
                raise LaunchError(f"member block: nodes[{i}]: node {_brief(node)} is not a node id 0..{NODE_ID_MAX}")
            nodes.append((node, _addr(e[1], f"nodes[{i}] address")))
        if len({n for n, _ in nodes}) != count:
            raise LaunchError(f"member block: nodes {_brief(raw)} names a node twice (one member per node)")
        if len({a for _, a in nodes}) != count:
            raise LaunchError(f"member block: nodes {_brief(raw)} names an address twice (one member per node)")
        host, port = split_endpoint(d["endpoint"])
        if host != nodes[0][1]:
            raise LaunchError(f"member block: endpoint {d['endpoint']} is not on member 0's address {nodes[0][1]}")
        launcher = d["launcher"]
        if launcher not in LAUNCHERS:
            raise LaunchError(f"member block: launcher {_brief(launcher)}; allowed: {list(LAUNCHERS)}")
        generation = _int(d, "generation", 0, GENERATION_MAX)
        return cls(job=job, origin=origin, index=index, count=count, min=lo, max=hi, nodes=tuple(nodes),
                   endpoint=_join_endpoint(host, port), launcher=launcher, generation=generation)

    def to_dict(self) -> dict[str, Any]:
        """The block as JSON keys (what :meth:`from_dict` reads back)."""
        return {"job": self.job, "origin": self.origin, "index": self.index, "count": self.count,
                "min": self.min, "max": self.max, "nodes": [[n, a] for n, a in self.nodes],
                "endpoint": self.endpoint, "launcher": self.launcher, "generation": self.generation}

    @property
    def own_addr(self) -> str:
        """This member's address."""
        return self.nodes[self.index][1]

    @property
    def addresses(self) -> list[str]:
        """The members' addresses in index order."""
        return [a for _, a in self.nodes]


def endpoint_port(job: str, generation: int, attempt: int = 0) -> int:
    """The rendezvous port the origin picks for ``job``'s ``generation``:
    ``PORT_BASE + (hash(job, generation) + attempt) % PORT_SPAN``, with a hash that is the same
    in every process (SHA-256, not Python's salted ``hash``). ``attempt`` counts the ports
    member 0's agent refused as taken: the next one is tried."""
    h = int.from_bytes(hashlib.sha256(f"{job}/{generation}".encode()).digest()[:8], "big")
    return PORT_BASE + (h + attempt) % PORT_SPAN


def _script_of(command: Sequence[str]) -> list[str] | None:
    """What follows ``python`` in ``command`` when it is ``python X.py args`` or
    ``python -m module args`` (as torchrun's arguments: ``X.py args`` or ``-m module args``),
    else None."""
    if len(command) < 2 or not isinstance(command[0], str) or not os.path.basename(command[0]).startswith("python"):
        return None
    first = command[1]
    if first == "-m":
        if len(command) >= 3 and isinstance(command[2], str) and len(command[2]) <= 256 and _MODULE.fullmatch(command[2]):
            return ["-m", *command[2:]]
        return None
    if isinstance(first, str) and first.endswith(".py") and not first.startswith("-"):
        return list(command[1:])
    return None


def launcher_for(command: Sequence[str]) -> str:
    """The launcher of a spec that names none: ``torchrun`` when argv[0]'s base name starts
    with ``python`` and argv[1] is a ``.py`` file or ``-m module``, else ``plain``."""
    return "torchrun" if _script_of(command) is not None else "plain"


def torchrun_argv(block: MemberBlock, command: Sequence[str], rdzv_conf: Mapping[str, int | str] | None = None) -> list[str]:
    """``command`` (``python X.py args`` or ``python -m mod args``) run through torchrun as
    member ``block.index``: see the module's docstring. ``rdzv_conf``: more (or other)
    ``--rdzv-conf`` settings (keys ``[a-z_]``, values ``[A-Za-z0-9_.]``), after the two set
    here. LaunchError when the command is not one torchrun can start."""
    rest = _script_of(command)
    if rest is None:
        raise LaunchError(f"launcher torchrun: command {_brief(list(command[:3]))} is not `python X.py args` or "
                          f"`python -m module args`; start it that way or use launcher plain")
    conf: dict[str, int | str] = {"is_host": int(block.index == 0), "last_call_timeout": LAST_CALL_S}
    for k, v in (rdzv_conf or {}).items():
        if not _CONF_KEY.fullmatch(k) or not _CONF_VALUE.fullmatch(str(v)):
            raise LaunchError(f"launcher torchrun: rdzv-conf {_brief(k)}={_brief(v)}: keys [a-z_], values [A-Za-z0-9_.]")
        conf[k] = v
    return [command[0], "-m", "torch.distributed.run",
            f"--nnodes={block.min}:{block.max}", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={block.endpoint}", f"--rdzv-id={block.job}", f"--max-restarts={MAX_RESTARTS}",
            f"--local-addr={block.own_addr}", "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
            *rest]


def member_env(block: MemberBlock, ifname: str | None) -> dict[str, str]:
    """The variables the agent sets for member ``block.index`` (over the spec's env): the same
    for both launchers, and :data:`TORCHRUN_ENV` with torchrun's. ``ifname``: the interface holding the member's own address
    (:func:`interface_of`); None leaves ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` out."""
    host, port = split_endpoint(block.endpoint)
    env = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "WORLD_SIZE": str(block.count), "RANK": str(block.index),
           "LOCAL_RANK": "0", "LAMINAR_MEMBERS": ",".join(block.addresses), "LAMINAR_MEMBER": str(block.index),
           "LAMINAR_JOB_ID": block.job}
    if block.launcher == "torchrun":
        env.update(TORCHRUN_ENV)
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
        env["NCCL_SOCKET_IFNAME"] = ifname
    return env


@dataclass(frozen=True)
class Launch:
    """What one member runs: ``argv`` and the variables the agent sets over the spec's env."""

    argv: list[str]
    env: dict[str, str]


def launch(block: MemberBlock, command: Sequence[str], ifname: str | None,
           rdzv_conf: Mapping[str, int | str] | None = None) -> Launch:
    """Member ``block.index``'s argv and env (the module's docstring): through torchrun
    (:func:`torchrun_argv`) or, with the ``plain`` launcher, ``command`` unchanged.
    LaunchError when a torchrun launch's command is not ``python X.py``/``python -m mod``."""
    argv = torchrun_argv(block, command, rdzv_conf) if block.launcher == "torchrun" else list(command)
    return Launch(argv=argv, env=member_env(block, ifname))


def interface_of(addr: str) -> str | None:
    """The name of this node's (this network namespace's) interface that holds the address
    ``addr``, or None when none does (or ``addr`` is not an IP address). Reads the interfaces
    (psutil), unlike the rest of this module."""
    try:
        want = ipaddress.ip_address(addr)
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(a.address.split("%", 1)[0]) == want:
                    return name
            except ValueError:
                continue
    return None
