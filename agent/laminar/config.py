"""laminard's configuration: an optional TOML file over an embedded default.

Every key has a default, so with no file the agent is a one-node zone on the interface of the
default route, with its state in ``/var/lib/laminar``. A file is validated whole before anything
starts: an unknown section or key, or a value of the wrong type or range, is refused with the
key, the value and what is allowed, and nothing is changed.

Example (``/etc/laminar/laminard.toml``)::

    [agent]
    node = "gpu-17"

    [net]
    uplink = "eth1"

    [metrics]
    listen = "127.0.0.1:9477"

Who may submit which Airlock class, up to which priority (``[grants]``): root may submit
anything; every other local user gets ``default_classes`` (standard and transient) up to
``default_priority_max`` (50), plus what a grant to their uid or one of their groups adds::

    [[grants.grant]]
    users = ["alice", 1001]          # names or uids
    groups = ["ml-prod"]             # names or gids (primary or supplementary)
    classes = ["long-resident", "standard", "transient"]
    priority_max = 90

A submission is allowed when one rule that applies to the caller (the default, or a grant)
lists its class and allows its priority. A grant naming an unknown user or group is refused
with the value, like every other bad value (docs/operations.md, "Who may submit what").

``laminard --check-config FILE`` validates a file and prints the effective configuration.
"""

from __future__ import annotations

import grp
import logging
import pwd
import socket
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

log = logging.getLogger("laminar.config")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key, the value and the fix."""


Check = Callable[[Any], str | None]  # returns what is wrong, or None


@dataclass(frozen=True)
class Field:
    kind: type | tuple[type, ...]
    default: Any
    doc: str
    check: Check | None = None


def admin_socket_path(socket_path: str) -> str:
    """The admin socket beside the control socket `socket_path` (``agent.socket``): the same
    directory, ``.admin`` before a ``.sock`` suffix (``/run/laminar/laminard.admin.sock``), else
    ``.admin`` appended. Only root and the control group may open it (laminar.api)."""
    if socket_path.endswith(".sock"):
        return socket_path[:-len(".sock")] + ".admin.sock"
    return socket_path + ".admin"


def _range(lo: float, hi: float) -> Check:
    return lambda v: None if lo <= v <= hi else f"out of range {lo}..{hi}"


def _one_of(*allowed: str) -> Check:
    return lambda v: None if v in allowed else f"must be one of {', '.join(allowed)}"


def _abs_path(v: str) -> str | None:
    return None if v.startswith("/") else "must be an absolute path"


# A Unix socket's path holds at most 107 bytes (sun_path is 108, with its NUL).
SUN_PATH_MAX = 107


def _socket_path(v: str) -> str | None:
    """An absolute path short enough for the socket and the admin socket beside it."""
    if not v.startswith("/"):
        return "must be an absolute path"
    admin = admin_socket_path(v)
    if len(admin.encode()) > SUN_PATH_MAX:
        return (f"too long for a Unix socket: the admin socket beside it, {admin!r}, would be "
                f"{len(admin.encode())} bytes, at most {SUN_PATH_MAX}; choose a shorter path")
    return None


def _listen(v: str) -> str | None:
    if v == "":
        return None
    host, _, port = v.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "must be HOST:PORT (e.g. 127.0.0.1:9477) or empty to disable"
    return None


GPUS_MAX = 1024  # laminar.runtime.gpus.GPUS_MAX: no node has more


def _gpus(v: Any) -> str | None:
    if isinstance(v, bool):
        return f"must be a count (0..{GPUS_MAX}) or a list of GPU indices (0..{GPUS_MAX - 1})"
    if isinstance(v, int):
        return None if 0 <= v <= GPUS_MAX else f"a count must be >= 0 and at most {GPUS_MAX} (0..{GPUS_MAX})"
    if isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < GPUS_MAX for i in v):
        return None if len(set(v)) == len(v) else "GPU indices must be unique"
    return f"must be a count (0..{GPUS_MAX}) or a list of GPU indices (0..{GPUS_MAX - 1})"


def _name(v: str) -> str | None:
    ok = v and all(c.isalnum() or c in "-_." for c in v) and len(v) <= 63 and not v.startswith(".")
    return None if ok else "must be 1-63 characters of letters, digits, '-', '_' or '.', not starting with '.'"


# Airlock's lifecycle classes, most protected first (laminar.airlock.cgroups.LIFECYCLE_CLASSES).
CLASSES = ("long-resident", "standard", "transient")
PRIORITY_MAX = 100  # laminar.runtime.spec.PRIORITY_MAX
GRANT_KEYS = ("users", "groups", "classes", "priority_max")


def _classes(v: Any) -> str | None:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
        return f"must be a non-empty list of classes from {', '.join(CLASSES)}"
    bad = [c for c in v if c not in CLASSES]
    return f"unknown class(es) {bad}; classes are {', '.join(CLASSES)}" if bad else None


def _principal(kind: str, v: Any) -> str | None:
    """A user or group given by name (must exist here) or by number (>= 0)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return None if v >= 0 else f"{kind} {v}: an id must be >= 0"
    if isinstance(v, str) and v:
        try:
            (pwd.getpwnam if kind == "user" else grp.getgrnam)(v)
        except KeyError:
            return f"{kind} {v!r} does not exist on this host (give its number, or create it first)"
        return None
    return f"{kind} {v!r}: expected a name or a number"


def _grants(v: Any) -> str | None:
    """[[grants.grant]] tables: users and/or groups, classes, priority_max."""
    for i, g in enumerate(v, 1):
        where = f"grant {i}"
        if not isinstance(g, dict):
            return f"{where} = {g!r}: expected a table with {', '.join(GRANT_KEYS)}"
        unknown = sorted(set(g) - set(GRANT_KEYS))
        if unknown:
            return f"{where}: unknown key(s) {unknown}; allowed: {', '.join(GRANT_KEYS)}"
        for key, kind in (("users", "user"), ("groups", "group")):
            if not isinstance(g.get(key, []), list):
                return f"{where}: {key} = {g[key]!r}: expected a list of names or numbers"
            for x in g.get(key, []):
                why = _principal(kind, x)
                if why:
                    return f"{where}: {why}"
        if not g.get("users") and not g.get("groups"):
            return f"{where}: names no one; give users = [...] and/or groups = [...]"
        if "classes" not in g:
            return f"{where}: missing classes = [...] (from {', '.join(CLASSES)})"
        why = _classes(g["classes"])
        if why:
            return f"{where}: classes = {g['classes']!r}: {why}"
        pm = g.get("priority_max")
        if isinstance(pm, bool) or not isinstance(pm, int) or not 0 <= pm <= PRIORITY_MAX:
            return f"{where}: priority_max = {pm!r}: expected an integer 0..{PRIORITY_MAX}"
    return None


# The schema: section -> key -> Field. Components read their section through Config.
SCHEMA: dict[str, dict[str, Field]] = {
    "agent": {
        "node": Field(str, "", "this node's name (default: the host name)", lambda v: None if v == "" else _name(v)),
        "state_dir": Field(str, "/var/lib/laminar", "SQLite store, job logs, checkpoints", _abs_path),
        "socket": Field(str, "/run/laminar/laminard.sock", "control API (HTTP+JSON on a Unix socket)", _socket_path),
        "control_group": Field(str, "laminar", "group whose members may change policy and flip switches (besides root)"),
        "log_level": Field(str, "info", "stderr log level", _one_of("debug", "info", "warning", "error")),
        "shutdown_timeout_s": Field((int, float), 10.0, "how long the whole stop on SIGTERM may take, all components together", _range(0.1, 300)),
        "request_timeout_s": Field((int, float), 10.0, "a control API request must arrive whole within this (else 408), "
                                   "and a client take its answer", _range(0.1, 600)),
        "user_events_burst": Field(int, 2000, "events one local user's actions (their jobs queued, started, "
                                   "stopped...) may have stored at once; past it they reach live streams only, "
                                   "and one event says how many were not stored (0: no limit)", _range(0, 1_000_000)),
        "user_events_per_s": Field((int, float), 0.2, "how fast a user's event budget refills (events a second)",
                                   _range(0.001, 1000)),
    },
    "bpf": {
        "pin_root": Field(str, "/sys/fs/bpf/laminar", "where maps are pinned (bpffs)", _abs_path),
        "object_dir": Field(str, "", "directory with netguard.bpf.o/pressure.bpf.o (default: the bundled ones)",
                            lambda v: None if v == "" else _abs_path(v)),
        "pressure": Field(bool, True, "attach the memory-pressure tracepoints"),
    },
    "net": {
        "uplink": Field(str, "", "interface netguard attaches to (default: the default route's)"),
        "ingress": Field(bool, True, "attach netguard on ingress as well as egress"),
        "tunnels": Field(bool, True, "also attach netguard's ingress program to the tunnel devices (vxlan, geneve, "
                         "gre, gretap, ipip, sit, ip6tnl, ip6gre, erspan) on the uplink or bound to no interface, "
                         "where decapsulated traffic arrives (docs/operations.md, 'Tunnels')"),
        "tunnel_scan_s": Field((int, float), 2.0, "how often tunnel devices are looked for besides on every "
                               "interface change (a netlink link event; 0: on those only)", _range(0, 3600)),
    },
    "metrics": {
        "listen": Field(str, "127.0.0.1:9477", "Prometheus endpoint; empty disables", _listen),
    },
    "cgroups": {
        "root": Field(str, "laminar", "name of the cgroup subtree the agent creates and owns", _name),
    },
    "gpus": {
        "declared": Field((int, list), 0, "GPUs this node declares when NVML finds none (count or indices)", _gpus),
        "owner": Field(str, "laminar", "who assigns this node's GPUs: \"laminar\" (submit and placements), or "
                       "\"scheduler\" (Slurm's gres, Kubernetes' device plugin: Laminar hands out none; adopted jobs "
                       "hold the GPUs their scheduler gave)", _one_of("laminar", "scheduler")),
    },
    "grants": {
        "default_classes": Field(list, ["standard", "transient"], "Airlock classes every local user may submit "
                                 "(root may submit any class at any priority)", _classes),
        "default_priority_max": Field(int, 50, "the highest priority every local user may give a job",
                                      _range(0, PRIORITY_MAX)),
        "grant": Field(list, [], "more for some users or groups: [[grants.grant]] users = [...], groups = [...], "
                                 "classes = [...], priority_max = N", _grants),
    },
}


def _typename(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def register_section(name: str, fields: dict[str, Field]) -> None:
    """Adds a component's section to the schema (idempotent for the same fields)."""
    if name in SCHEMA and SCHEMA[name] != fields:
        raise ValueError(f"config section {name!r} registered twice with different fields")
    SCHEMA[name] = fields


# Keys renamed, by section: old name -> new name. A configuration that gives the old name is read
# as the new one for one release, with a logged note; one that gives both is refused.
OLD_KEYS: dict[str, dict[str, str]] = {}


def register_old_keys(section: str, names: dict[str, str]) -> None:
    """Declares ``section``'s keys renamed (old name -> new name), read for one release."""
    OLD_KEYS.setdefault(section, {}).update(names)


def _new_key_names(section: str, body: dict[str, Any], source: str, problems: list[str]) -> dict[str, Any]:
    """``body`` with the section's old key names (OLD_KEYS) replaced by the new ones, each noted
    in the log; a key given under both names is a problem (neither silently wins)."""
    old = OLD_KEYS.get(section, {})
    if not any(k in old for k in body):
        return body
    out: dict[str, Any] = {}
    for key, value in body.items():
        new = old.get(key)
        if new is None:
            out[key] = value
        elif new in body:
            problems.append(f"{source}: {section}.{key} and {section}.{new} both given: {key} is the old name "
                            f"of {new}; keep {new}")
        else:
            log.warning("config: %s: %s.%s is now %s.%s (the old name is read for one release)",
                        source, section, key, section, new)
            out[new] = value
    return out


def validate(data: dict[str, Any], source: str = "config") -> dict[str, dict[str, Any]]:
    """Returns the effective configuration (defaults filled in) or raises ConfigError listing
    every problem found, each with the key, the value and what is allowed."""
    problems: list[str] = []
    out: dict[str, dict[str, Any]] = {s: {k: f.default for k, f in fields.items()} for s, fields in SCHEMA.items()}
    for section, body in data.items():
        if section not in SCHEMA:
            problems.append(f"{source}: unknown section [{section}]; allowed: {', '.join(sorted(SCHEMA))}")
            continue
        if not isinstance(body, dict):
            problems.append(f"{source}: [{section}] must be a table, got {body!r}")
            continue
        fields = SCHEMA[section]
        body = _new_key_names(section, body, source, problems)
        for key, value in body.items():
            f = fields.get(key)
            if f is None:
                problems.append(f"{source}: unknown key {section}.{key}; allowed in [{section}]: {', '.join(sorted(fields))}")
                continue
            kinds = f.kind if isinstance(f.kind, tuple) else (f.kind,)
            if float in kinds and isinstance(value, int) and not isinstance(value, bool):
                value = float(value) if int not in kinds else value
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                problems.append(f"{source}: {section}.{key} = {value!r}: expected {_typename(f.kind)} ({f.doc})")
                continue
            why = f.check(value) if f.check else None
            if why:
                problems.append(f"{source}: {section}.{key} = {value!r}: {why} ({f.doc})")
                continue
            out[section][key] = value
    if problems:
        raise ConfigError("\n".join(problems))
    return out


class Config:
    """The effective configuration: ``config.net.uplink``, ``config.section("zone")``."""

    def __init__(self, values: dict[str, dict[str, Any]], source: str = "<defaults>") -> None:
        self.source = source
        self._values = values
        for section, body in values.items():
            setattr(self, section, SimpleNamespace(**body))
        if not values["agent"]["node"]:
            values["agent"]["node"] = socket.gethostname().split(".")[0]
            self.agent.node = values["agent"]["node"]

    def __getattr__(self, name: str) -> Any:  # sections registered by components
        raise AttributeError(f"no config section {name!r}")

    def section(self, name: str) -> dict[str, Any]:
        return dict(self._values[name])

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {s: dict(b) for s, b in self._values.items()}

    @property
    def gpus_declared(self) -> list[int]:
        v = self._values["gpus"]["declared"]
        return list(range(v)) if isinstance(v, int) else list(v)

    @property
    def state_dir(self) -> Path:
        return Path(self._values["agent"]["state_dir"])


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def defaults_toml() -> str:
    """Every registered key with its default and meaning, as a TOML file (systemd/laminard.toml)."""
    lines = ["# laminard configuration. Every key is optional; shown here with its default.",
             "# `laminard --check-config FILE` validates a file; docs/operations.md explains each section.",
             "# Generated by `laminard --print-defaults`.", ""]
    for section, fields in SCHEMA.items():
        lines.append(f"[{section}]")
        for key, f in fields.items():
            lines.append(f"# {f.doc}")
            lines.append(f"{key} = {_toml_value(f.default)}")
        lines.append("")
    return "\n".join(lines)


def load(path: str | Path | None) -> Config:
    """Reads and validates a TOML file (None: the embedded defaults). Raises ConfigError."""
    if path is None:
        return Config(validate({}), "<defaults>")
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"config: cannot read {p}: {e.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config: {p} is not valid TOML: {e}") from None
    return Config(validate(data, str(p)), str(p))
