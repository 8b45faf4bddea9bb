"""Jobs get the site's limits, not the agent's: the resource limits, task limit, umask and nice
value a job (and every helper that runs as a job's owner) starts with.

A job is a child of the agent, and the unit gives the agent ``LimitMEMLOCK=infinity`` (BPF maps
on kernels before 5.11 are charged to it), ``LimitNOFILE=65536``, ``Nice=-10`` and whatever
systemd's defaults are for the rest. A job used to inherit all of it: unevictable memory without
limit, and (with no task limit on its cgroup) room to fork the host out of pids. Now every job
gets, explicitly, **all sixteen** rlimits of its owner's *profile*, so nothing of the agent's
leaks, whatever the agent was started with:

    profile = [job_limits] defaults  (what a login on a stock Debian 12 starts from)
              overlaid with /etc/security/limits.conf and limits.d/*.conf for the owner,
              read with pam_limits' semantics (Debian's), when ``pam_limits = true``

The defaults (config ``[job_limits]``, kernel units as in ``/proc/PID/limits`` and ``prlimit``:
bytes with K/M/G/T suffixes, seconds, counts, ``unlimited``): ``memlock = "8M"`` (8 MiB, the
kernel's default since 5.16 and systemd's since 253), ``nofile = "1024:524288"`` (systemd's
``DefaultLimitNOFILE``; soft 1,024 because ``select()`` fails above 1,023), ``core =
"0:unlimited"``, ``stack = "8M:unlimited"``, ``nproc`` and ``sigpending`` ``"auto"`` (the
kernel's boot default, ``threads-max / 2``), ``msgqueue = "819200"``, ``nice = "0"``, ``rtprio =
"0"`` and ``unlimited`` for cpu, fsize, data, rss, as, locks and rttime.

limits.conf, as Debian's pam_limits reads it (``man limits.conf``; checked against ``runuser``,
which runs pam_limits, in tests/kernel/test_job_limits.py): ``limits.conf`` first, then
``limits.d/*.conf`` in byte order of their names; a line is ``<domain> <soft|hard|-> <item>
<value>``; a line for the user (by name, or a uid range ``a:b``, ``a:``, ``:a``) beats one for a
group (``@name``: any of the user's groups; ``@:gid`` likewise; ``@a:b`` and ``@a:``: the primary
group only), which beats ``*``; among equals the later line wins. ``*`` and ``@`` lines do not
apply to root (Debian). Values are pam's units: KiB for core, data, fsize, memlock, rss, stack
and as, minutes for cpu, bytes for msgqueue, ``nice`` n is RLIMIT_NICE ``20 - n``; ``-1``, ``-``,
``unlimited`` and ``infinity`` mean no limit (``nofile``: ``fs.nr_open``). A soft limit above its
hard one is lowered to it. ``priority`` is the job's nice value, ``nonewprivs 1`` starts it with
no_new_privs. ``<domain> -`` (two fields) that matches: no line applies, the job gets the
defaults, as pam_limits then sets nothing. Not applied (they are about logins, not processes):
``maxlogins``, ``maxsyslogins``, ``%`` domains, and Debian's ``chroot``. A file that exists but
cannot be read refuses the job's start, as pam_limits refuses the login.

Applied as root before the drop to the owner (`launch_argv`): util-linux ``prlimit`` sets the
sixteen limits on itself and execs the rest, so RLIMIT_NPROC holds when ``setpriv`` changes the
uid, as at a login (a user already at its ``nproc`` cannot start one more job: its exec fails
with EAGAIN); coreutils ``nice`` gives the nice value (the agent's ``Nice=-10`` must not pass to
jobs); ``setpriv --no-new-privs`` only where asked. The launcher's shell sets the umask
(``umask = "022"``, a Debian login's ``UMASK`` of ``/etc/login.defs``). Where the agent may not
raise a hard limit (no CAP_SYS_RESOURCE, as in some containers) a hard limit above the agent's
own is lowered to it, and the job's record says so (``clamped``).

Tasks: every job cgroup gets ``pids.max`` (``pids_max``, default ``"33%"`` of the kernel's task
limit ``min(pid_max, threads-max)``, what systemd gives a login's user slice), and the agent's
cgroup root gets ``all_jobs_pids_max`` (default ``"80%"``): all jobs together never take the last
fifth, which the agent, sshd and root need to fork. On a hybrid host this is the v1 pids
hierarchy (laminar.airlock.cgroups). Root's jobs get root's profile (defaults plus lines naming
``root`` or a uid range holding 0); the kernel never enforces RLIMIT_NPROC on root, and a root
job may raise its own limits, so for them ``pids.max`` is the bound that holds. A job arriving
from a peer (a hand-over, a move, a resume) gets its owner's profile on this node, like any other.

What a job got is in its record: ``laminarctl job show`` (``limits``), ``-o json``.
"""

from __future__ import annotations

import glob
import grp
import os
import pwd
import re
import resource
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import Field, register_section

# RLIM_INFINITY as the kernel has it (Python's resource module spells it -1)
INF = (1 << 64) - 1

# Every rlimit Linux has (name as prlimit and limits.conf spell it -> RLIMIT_* number, the unit of
# its [job_limits] value). All sixteen are set for every job: one left out would be the agent's.
RLIMITS: dict[str, tuple[int, str]] = {
    "as": (9, "bytes"), "core": (4, "bytes"), "cpu": (0, "seconds"), "data": (2, "bytes"),
    "fsize": (1, "bytes"), "locks": (10, "count"), "memlock": (8, "bytes"), "msgqueue": (12, "bytes"),
    "nice": (13, "count"), "nofile": (7, "count"), "nproc": (6, "count"), "rss": (5, "bytes"),
    "rtprio": (14, "count"), "rttime": (15, "microseconds"), "sigpending": (11, "count"), "stack": (3, "bytes"),
}
# What a login on a stock Debian 12 (systemd 252, kernel >= 5.16, empty limits.conf) starts from.
DEFAULTS: dict[str, str] = {
    "as": "unlimited", "core": "0:unlimited", "cpu": "unlimited", "data": "unlimited", "fsize": "unlimited",
    "locks": "unlimited", "memlock": "8M", "msgqueue": "819200", "nice": "0", "nofile": "1024:524288",
    "nproc": "auto", "rss": "unlimited", "rtprio": "0", "rttime": "unlimited", "sigpending": "auto",
    "stack": "8M:unlimited",
}
AUTO_ITEMS = ("nproc", "sigpending")  # "auto": threads-max / 2, the kernel's own default for them
# pam_limits' items in KiB, and cpu in minutes
PAM_KIB = ("fsize", "data", "stack", "core", "rss", "memlock", "as")
PAM_ITEMS = ("cpu", "fsize", "data", "stack", "core", "rss", "nproc", "nofile", "memlock", "as", "locks",
             "sigpending", "msgqueue", "nice", "rtprio")
# pam_limits' precedence levels (lower wins); the [job_limits] defaults are below all of them
USER, GROUP, DEFAULT, NONE = 0, 1, 4, 6
# Bounds on what is read of the site's files (root's own configuration, but read on the agent's
# event loop: a runaway file must not hold it).
CONF_FILES_MAX = 1024
CONF_BYTES_MAX = 1 << 20
# How long an owner's passwd and group answers are reused (NSS may be remote: LDAP, SSSD).
OWNER_TTL_S = 60.0
CAP_SYS_NICE, CAP_SYS_RESOURCE = 23, 24
# The oom_score_adj of a helper that runs as a job's owner (the first the kernel picks, as the
# transient class's jobs): it must never be the agent's -900, which setuid keeps.
HELPER_OOM_SCORE_ADJ = 1000

PRLIMIT = next((p for p in ("/usr/bin/prlimit", "/bin/prlimit") if os.path.exists(p)), "/usr/bin/prlimit")
NICE = next((p for p in ("/usr/bin/nice", "/bin/nice") if os.path.exists(p)), "/usr/bin/nice")
SETPRIV = next((p for p in ("/usr/bin/setpriv", "/bin/setpriv", "/usr/sbin/setpriv") if os.path.exists(p)),
               "/usr/bin/setpriv")
CHOOM = shutil.which("choom", path="/usr/bin:/bin") or ""


class LimitsError(ValueError):
    """The site's limits files cannot be read (a job's start is refused, naming the file)."""


# -- values ------------------------------------------------------------------------------------------
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_ONE = re.compile(r"(\d+)(?:([kmgt])(?:i?b)?)?", re.ASCII)


def threads_half() -> int:
    """``threads-max / 2``: the kernel's own RLIMIT_NPROC and RLIMIT_SIGPENDING for PID 1."""
    try:
        return max(1, int(Path("/proc/sys/kernel/threads-max").read_text()) // 2)
    except (OSError, ValueError):
        return 63_535


def kernel_tasks() -> int:
    """The most tasks the kernel lets exist: ``min(pid_max, threads-max)``."""
    out = []
    for f in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"):
        try:
            out.append(int(Path(f).read_text()))
        except (OSError, ValueError):
            pass
    return min(out) if out else 32_768


def nr_open() -> int:
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


def _one_value(item: str, text: str) -> int:
    t = text.strip().lower()
    if t in ("unlimited", "infinity"):
        return INF
    if t == "auto":
        if item not in AUTO_ITEMS:
            raise ValueError(f"'auto' is only for {' and '.join(AUTO_ITEMS)}")
        return threads_half()
    m = _ONE.fullmatch(t)
    if not m or (m.group(2) and RLIMITS[item][1] != "bytes"):  # a size suffix on a count is a mistake
        unit = ("bytes; K, M, G, T suffixes allowed" if RLIMITS[item][1] == "bytes" else RLIMITS[item][1])
        raise ValueError(f"{text!r} is not a number ({unit}) or 'unlimited'")
    v = int(m.group(1)) * _SUFFIX[m.group(2) or ""]
    if v >= INF:
        raise ValueError(f"{text!r} is too large; use 'unlimited'")
    return v


def parse_pair(item: str, text: str) -> tuple[int, int]:
    """A ``[job_limits]`` value: ``"SOFT:HARD"`` or one value for both -> (soft, hard). Raises
    ValueError saying what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("expected a value such as '1024:524288', '8M' or 'unlimited'")
    soft_t, sep, hard_t = text.partition(":")
    soft = _one_value(item, soft_t)
    hard = _one_value(item, hard_t) if sep else soft
    if soft > hard:
        raise ValueError(f"soft limit {soft_t.strip()} above the hard limit {hard_t.strip()}")
    return soft, hard


def _check_pair(item: str) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        try:
            parse_pair(item, v)
        except ValueError as e:
            return str(e)
        return None
    return check


def parse_pids(text: Any) -> int | None:
    """A ``pids_max`` value: a count (an integer >= 1), ``"N%"`` of the kernel's task limit
    (1..100) or ``"max"`` (None: no limit). Raises ValueError."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise ValueError(f"{text}: a task limit must be at least 1")
        return text
    if isinstance(text, str):
        t = text.strip()
        if t == "max":
            return None
        m = re.fullmatch(r"(\d+(?:\.\d+)?)%", t, re.ASCII)
        if m and 0 < float(m.group(1)) <= 100:
            return max(1, int(kernel_tasks() * float(m.group(1)) / 100))
    raise ValueError(f"{text!r}: expected a count (e.g. 4096), a share of the kernel's task limit "
                     "min(pid_max, threads-max) such as '33%', or 'max'")


def _check_pids(v: Any) -> str | None:
    try:
        parse_pids(v)
    except ValueError as e:
        return str(e)
    return None


def parse_umask(text: Any) -> int:
    if isinstance(text, str) and re.fullmatch(r"0?[0-7]{3}", text.strip(), re.ASCII):
        return int(text, 8)
    raise ValueError(f"{text!r}: expected an octal umask such as '022' or '077'")


def _check_umask(v: Any) -> str | None:
    try:
        parse_umask(v)
    except ValueError as e:
        return str(e)
    return None


def _abs(v: str) -> str | None:
    return None if v.startswith("/") else "must be an absolute path"


# Config [job_limits]: docs/operations.md, "What a job gets: the site's limits".
CONFIG_FIELDS: dict[str, Field] = {
    **{item: Field(str, DEFAULTS[item], f"RLIMIT_{item.upper()} of every job before limits.conf: SOFT:HARD or "
                   f"one value ({RLIMITS[item][1]}" + (", K/M/G/T" if RLIMITS[item][1] == "bytes" else "")
                   + (", auto: threads-max/2" if item in AUTO_ITEMS else "") + ", unlimited)", _check_pair(item))
       for item in sorted(RLIMITS)},
    "pam_limits": Field(bool, True, "overlay limits_conf and limits_dir/*.conf for the job's owner, as pam_limits "
                        "does for a login"),
    "limits_conf": Field(str, "/etc/security/limits.conf", "pam_limits' file (a missing file is empty)", _abs),
    "limits_dir": Field(str, "/etc/security/limits.d", "pam_limits' directory of *.conf files", _abs),
    "pids_max": Field((int, str), "33%", "pids.max of every job's cgroup: a count, a share of "
                      "min(pid_max, threads-max) ('33%', a login's user slice) or 'max'", _check_pids),
    "all_jobs_pids_max": Field((int, str), "80%", "pids.max of the agent's cgroup root, over all jobs together: "
                               "the rest stays for the agent, sshd and root", _check_pids),
    "umask": Field(str, "022", "the umask a job starts with (a Debian login's, /etc/login.defs UMASK)", _check_umask),
    "no_new_privs": Field(bool, False, "start every job with no_new_privs (setuid and file capabilities gain "
                          "nothing); limits.conf nonewprivs 1 does it for its users"),
}
register_section("job_limits", CONFIG_FIELDS)


# -- limits.conf -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Owner:
    """Who a profile is for: uid, passwd name (None without an entry), primary gid (the passwd
    entry's; the job's gid without one) and every gid the user is in."""

    uid: int
    name: str | None
    gid: int
    groups: frozenset[int]


@dataclass(frozen=True)
class Line:
    where: str       # "path:lineno"
    fields: tuple[str, ...]

    @property
    def text(self) -> str:
        return " ".join(self.fields)


def parse_conf(text: str, path: str) -> tuple[list[Line], list[str]]:
    """The lines of a limits.conf file as pam_limits splits them (comments from '#', blank lines
    dropped; domain, type, item and the rest as value) and the lines it would skip as invalid
    (neither four fields nor ``<domain> -``), each as ``path:n: text``."""
    lines: list[Line] = []
    bad: list[str] = []
    for n, raw in enumerate(text.split("\n"), 1):
        s = raw.lstrip().split("#", 1)[0]
        if not s.strip():
            continue
        parts = s.split(None, 3)
        if len(parts) == 4:
            parts[3] = parts[3].strip(" \t")
        if len(parts) == 4 or (len(parts) == 2 and parts[1].startswith("-")):
            lines.append(Line(f"{path}:{n}", tuple(parts)))
        else:
            bad.append(f"{path}:{n}: {s.strip()}")
    return lines, bad


def _strtoul(s: str) -> int | None:
    m = re.fullmatch(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)", s, re.ASCII)
    if not m:
        return None
    v = min(int(m.group(2)), (1 << 64) - 1)
    return ((-v) % (1 << 64) if m.group(1) == "-" else v) & 0xFFFFFFFF  # uid_t, as pam casts it


def _range(domain: str) -> tuple[str, int, int] | None:
    """pam_limits' parse_uid_range: ("none"|"one"|"min"|"mm", min, max); None for a bad range."""
    if ":" not in domain:
        return ("none", 0, 0)
    body = domain[1:] if domain[:1] in ("@", "%") else domain
    lo_t, _, hi_t = body.partition(":")
    lo = 0
    kind = "mm"
    if lo_t == "":
        kind = "one"
    else:
        got = _strtoul(lo_t)
        if got is None:
            return None
        lo = got
    if hi_t == "":
        return None if kind == "one" else ("min", lo, 0)
    hi = _strtoul(hi_t)
    if hi is None:
        return None
    return (kind, hi if kind == "one" else lo, hi)


def _strtoull(v: str) -> int | None:
    """C strtoull: leading digits (trailing text ignored), a '-' wraps; None when no digit."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)", v, re.ASCII)
    if not m:
        return None
    n = int(m.group(2))
    if n >= INF:
        return INF
    return (-n) % (1 << 64) if m.group(1) == "-" else n


def _strtol_int(v: str) -> int | None:
    m = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", v, re.ASCII)
    if not m:
        return None
    return max(-(1 << 31), min(int(m.group(1)), (1 << 31) - 1))


@dataclass
class Overlay:
    """limits.conf applied to a base: the limits, nice value, no_new_privs, the lines that
    applied and why nothing applied (a matching ``<domain> -`` line), if so."""

    limits: dict[str, tuple[int, int]]
    nice: int
    no_new_privs: bool
    applied: list[str] = field(default_factory=list)
    ignored_by: str | None = None


def overlay(base: dict[str, tuple[int, int]], files: Iterable[list[Line]], owner: Owner,
            group_gid: Callable[[str], int | None], nofile_unlimited: int, nice: int = 0,
            no_new_privs: bool = False) -> Overlay:
    """pam_limits (Debian 1.5) for `owner` over `base`, file by file; pure but for `group_gid`
    (a group's name -> gid, None if there is none). See the module docstring for the rules."""
    cur = {k: list(v) for k, v in base.items()}
    src = {k: [NONE, NONE] for k in base}
    out = Overlay({}, nice, no_new_privs)
    root = owner.uid == 0

    def member(name: str) -> bool:
        gid = group_gid(name)
        return gid is not None and gid in owner.groups

    def process(source: int, line: Line) -> None:
        _domain, ltype, item, value = line.fields
        ltype, item, value = ltype.lower(), item.lower(), value.lower()
        if item not in PAM_ITEMS and item not in ("priority", "nonewprivs"):
            return  # maxlogins, maxsyslogins (logins, not processes), Debian's chroot, unknown
        if ltype not in ("soft", "hard", "-") and item != "nonewprivs":
            return
        if item == "nonewprivs":
            out.no_new_privs = no_new_privs or value == "1"
            out.applied.append(f"{line.where}: {line.text}")
            return
        if item in ("priority", "nice"):
            iv = _strtol_int(value)
            if iv is None:
                return
            if item == "priority":
                out.nice = iv
                out.applied.append(f"{line.where}: {line.text}")
                return
            rv = 20 - max(-20, min(19, iv))
        elif value in ("-1", "-", "unlimited", "infinity"):
            rv = INF
        else:
            got = _strtoull(value)
            if got is None:
                return
            rv = got
        if rv != INF:
            if item == "cpu":
                rv = INF if rv >= INF // 60 else rv * 60
            elif item in PAM_KIB:
                rv = INF if rv >= INF // 1024 else rv * 1024
        if item == "nofile" and rv == INF:
            rv = nofile_unlimited
        # pam's process_limit: a type whose level is beaten returns, so a '-' line whose soft
        # half is beaten sets no hard limit either
        if ltype in ("soft", "-"):
            if src[item][0] < source:
                return
            cur[item][0], src[item][0] = rv, source
        if ltype in ("hard", "-"):
            if src[item][1] < source:
                return
            cur[item][1], src[item][1] = rv, source
        out.applied.append(f"{line.where}: {line.text}")

    def no_limits(line: Line) -> bool:
        domain = line.fields[0]
        rng = _range(domain)
        if rng is None:
            return False
        kind, lo, hi = rng
        if owner.name is not None and domain == owner.name:
            return True
        if domain.startswith("@"):
            if kind == "none":
                return member(domain[1:])
            if kind == "one":
                return hi in owner.groups
            return (kind == "min" or owner.gid <= hi) and owner.gid >= lo
        if kind == "none":
            return False
        return (kind == "min" or owner.uid <= hi) and owner.uid >= lo

    for lines in files:
        for line in lines:
            domain = line.fields[0]
            rng = _range(domain)
            if rng is None:
                continue  # pam: invalid uid range, skipped
            if len(line.fields) == 2:
                if no_limits(line):
                    return Overlay({k: (v[0], v[1]) for k, v in base.items()}, nice, no_new_privs,
                                   ignored_by=f"{line.where}: {line.text}")
                continue
            kind, lo, hi = rng
            if owner.name is not None and domain == owner.name:
                process(USER, line)
            elif domain.startswith("@") and not root:
                if kind == "none":
                    if member(domain[1:]):
                        process(GROUP, line)
                elif kind == "one":
                    if hi in owner.groups:
                        process(GROUP, line)
                elif (kind == "min" or owner.gid <= hi) and owner.gid >= lo:
                    process(GROUP, line)
            elif domain.startswith("%") and not root:
                continue  # maxlogins only
            elif kind == "none":
                if domain == "*" and not root:
                    process(DEFAULT, line)
            # a uid range (for root also '@'/'%' ranges, which Debian's pam reads as uid ranges)
            elif (kind != "one" or owner.uid == hi) and (kind == "min" or owner.uid <= hi) and owner.uid >= lo:
                process(USER, line)
    out.limits = {k: (min(v[0], v[1]), v[1]) for k, v in cur.items()}
    return out


# -- the profile ---------------------------------------------------------------------------------------
def _fmt(item: str, v: int) -> str:
    if v == INF:
        return "unlimited"
    if RLIMITS[item][1] == "bytes":
        for suffix, unit in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
            if v >= unit and v % unit == 0:
                return f"{v // unit}{suffix}"
    return str(v)


@dataclass(frozen=True)
class Profile:
    """What a job (or a helper) of one owner starts with."""

    uid: int
    limits: dict[str, tuple[int, int]]  # every item of RLIMITS -> (soft, hard)
    pids_max: int | None                # None: no limit ("max")
    umask: int
    nice: int
    no_new_privs: bool
    sources: tuple[str, ...] = ()       # "[job_limits]" and the limits.conf lines that applied
    clamped: dict[str, str] = field(default_factory=dict)  # item -> why it is below the profile

    def prlimit_args(self) -> list[str]:
        """``--as=S:H`` ... for every rlimit (prlimit spells infinity 'unlimited')."""
        def one(v: int) -> str:
            return "unlimited" if v == INF else str(v)
        return [f"--{k}={one(s)}:{one(h)}" for k, (s, h) in sorted(self.limits.items())]

    def record(self) -> dict[str, Any]:
        """The job's record of what it got (the store's ``jobs.limits``, ``job show``)."""
        def one(v: int) -> int | str:
            return "unlimited" if v == INF else v
        return {"rlimits": {k: [one(s), one(h)] for k, (s, h) in sorted(self.limits.items())},
                "pids_max": "max" if self.pids_max is None else self.pids_max,
                "umask": f"{self.umask:04o}", "nice": self.nice, "no_new_privs": self.no_new_privs,
                "from": list(self.sources), "clamped": dict(self.clamped)}


@dataclass(frozen=True)
class Settings:
    """The validated ``[job_limits]`` section."""

    base: dict[str, tuple[int, int]]
    pam_limits: bool
    limits_conf: Path
    limits_dir: Path
    pids_max: int | None
    all_jobs_pids_max: int | None
    umask: int
    no_new_privs: bool

    @classmethod
    def from_config(cls, section: dict[str, Any] | None) -> Settings:
        sec = {k: f.default for k, f in CONFIG_FIELDS.items()} | dict(section or {})
        return cls(base={k: parse_pair(k, sec[k]) for k in RLIMITS}, pam_limits=bool(sec["pam_limits"]),
                   limits_conf=Path(sec["limits_conf"]), limits_dir=Path(sec["limits_dir"]),
                   pids_max=parse_pids(sec["pids_max"]), all_jobs_pids_max=parse_pids(sec["all_jobs_pids_max"]),
                   umask=parse_umask(sec["umask"]), no_new_privs=bool(sec["no_new_privs"]))


def _caps() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def clamp(p: Profile, agent_hard: dict[str, int], may_raise: bool, nofile_max: int,
          agent_nice: int, may_renice: bool) -> Profile:
    """`p` as the agent can give it: a hard limit above the agent's own cannot be set without
    CAP_SYS_RESOURCE (`may_raise`), nor a nofile above ``fs.nr_open``, nor a nice value below the
    agent's own without CAP_SYS_NICE; each is lowered (soft with it) and named in ``clamped``."""
    limits = dict(p.limits)
    clamped = dict(p.clamped)
    for k, (s, h) in p.limits.items():
        cap = nofile_max if k == "nofile" else INF
        if not may_raise and agent_hard.get(k, INF) < h:
            cap = min(cap, agent_hard[k])
            why = "the agent's own hard limit (it lacks CAP_SYS_RESOURCE)"
        else:
            why = "fs.nr_open"
        if h > cap:
            limits[k] = (min(s, cap), cap)
            clamped[k] = f"hard {_fmt(k, h)} lowered to {_fmt(k, cap)}, {why}"
    nice = p.nice
    if nice < agent_nice and not may_renice:
        clamped["priority"] = f"nice {nice} raised to {agent_nice}, the agent's own (it lacks CAP_SYS_NICE)"
        nice = agent_nice
    return replace(p, limits=limits, clamped=clamped, nice=nice)


class Limiter:
    """Profiles for owners, from the settings and the site's files (re-read when they change)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()  # verify_as_owner asks from worker threads
        self._files_sig: tuple[Any, ...] | None = None
        self._files: list[list[Line]] = []
        self._bad: list[str] = []
        self._owners: dict[tuple[int, int], tuple[float, Owner, dict[str, int | None]]] = {}

    # the files: limits.conf, then limits.d/*.conf by name (bytes), hidden files not matched
    def _paths(self) -> list[Path]:
        s = self.settings
        names = sorted((os.path.basename(p) for p in glob.glob(glob.escape(str(s.limits_dir)) + "/*.conf")),
                       key=os.fsencode)
        if len(names) > CONF_FILES_MAX:
            raise LimitsError(f"{s.limits_dir}: {len(names)} *.conf files, more than {CONF_FILES_MAX} read")
        return [s.limits_conf, *(s.limits_dir / n for n in names)]

    def _read_files(self) -> list[list[Line]]:
        paths = self._paths()
        sig: list[Any] = []
        for p in paths:
            try:
                st = os.stat(p)
                sig.append((str(p), st.st_ino, st.st_mtime_ns, st.st_size))
            except FileNotFoundError:
                sig.append((str(p), None))
            except OSError as e:
                raise LimitsError(f"cannot read {p}: {e.strerror}; a job's limits need it (as a login's: "
                                  "pam_limits refuses the login)") from None
        key = tuple(sig)
        if key == self._files_sig:
            return self._files
        files: list[list[Line]] = []
        bad: list[str] = []
        for p, s in zip(paths, sig, strict=True):
            if s[1] is None:
                continue
            try:
                with open(p, "rb") as f:
                    data = f.read(CONF_BYTES_MAX + 1)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise LimitsError(f"cannot read {p}: {e.strerror}; a job's limits need it (as a login's: "
                                  "pam_limits refuses the login)") from None
            if len(data) > CONF_BYTES_MAX:
                raise LimitsError(f"{p}: larger than {CONF_BYTES_MAX} bytes; not a limits file")
            lines, skipped = parse_conf(data.decode("utf-8", "replace"), str(p))
            files.append(lines)
            bad += skipped
        self._files_sig, self._files, self._bad = key, files, bad
        return files

    def skipped_lines(self) -> list[str]:
        """limits.conf lines pam_limits would skip as invalid (after the last read)."""
        return list(self._bad)

    def _owner(self, uid: int, gid: int) -> tuple[Owner, dict[str, int | None]]:
        now = time.monotonic()
        hit = self._owners.get((uid, gid))
        if hit is not None and now - hit[0] < OWNER_TTL_S:
            return hit[1], hit[2]
        try:
            pw = pwd.getpwuid(uid)
            name, primary = pw.pw_name, pw.pw_gid
            groups = frozenset(os.getgrouplist(name, primary))
        except KeyError:  # no passwd entry: no user line can name it; its groups: the job's gid
            name, primary, groups = None, gid, frozenset({gid})
        owner = Owner(uid, name, primary, groups)
        gids: dict[str, int | None] = {}
        if len(self._owners) > 4096:
            self._owners.clear()
        self._owners[(uid, gid)] = (now, owner, gids)
        return owner, gids

    def profile(self, uid: int, gid: int) -> Profile:
        """The profile of an owner (uid, gid), clamped to what the agent can give. Raises
        LimitsError when a limits file exists but cannot be read."""
        s = self.settings
        with self._lock:
            files = self._read_files() if s.pam_limits else []
            owner, gids = self._owner(uid, gid)

            def group_gid(name: str) -> int | None:
                if name not in gids:
                    try:
                        gids[name] = grp.getgrnam(name).gr_gid
                    except KeyError:
                        gids[name] = None
                return gids[name]

            ov = overlay(s.base, files, owner, group_gid, nr_open(), no_new_privs=s.no_new_privs)
        sources = ("[job_limits]", *ov.applied)
        if ov.ignored_by:
            sources = ("[job_limits]", f"{ov.ignored_by} (no limits for this user: the defaults)")
        return _as_agent_can(Profile(uid, ov.limits, s.pids_max, s.umask, ov.nice, ov.no_new_privs, sources))

    def status(self) -> dict[str, Any]:
        """The settings, the defaults as this agent can give them (``clamped``: what it cannot)
        and the limits.conf lines pam_limits would skip, for ``laminarctl status``."""
        s = self.settings
        base = _as_agent_can(Profile(-1, dict(s.base), s.pids_max, s.umask, 0, s.no_new_privs))
        rec = base.record()
        return {"defaults": rec["rlimits"], "clamped": rec["clamped"], "pids_max": rec["pids_max"],
                "all_jobs_pids_max": "max" if s.all_jobs_pids_max is None else s.all_jobs_pids_max,
                "umask": rec["umask"], "no_new_privs": s.no_new_privs, "pam_limits": s.pam_limits,
                "limits_conf": str(s.limits_conf), "limits_dir": str(s.limits_dir),
                "skipped_lines": self.skipped_lines()[:20]}


def _as_agent_can(p: Profile) -> Profile:
    """`clamp` with this process's hard limits, capabilities and nice value (what its children,
    the launcher's root steps, start from)."""
    caps = _caps()
    hard = {k: INF if h in (resource.RLIM_INFINITY, INF) else h
            for k, (num, _unit) in RLIMITS.items() for h in (resource.getrlimit(num)[1],)}
    return clamp(p, hard, bool(caps >> CAP_SYS_RESOURCE & 1), nr_open(), os.getpriority(os.PRIO_PROCESS, 0),
                 bool(caps >> CAP_SYS_NICE & 1))


_active = Limiter(Settings.from_config(None))


def configure(section: dict[str, Any] | None) -> Limiter:
    """Makes the ``[job_limits]`` section (None: the defaults) the one jobs and helpers get."""
    global _active
    _active = Limiter(Settings.from_config(section))
    return _active


def launch_argv(p: Profile) -> list[str]:
    """What runs as root between joining the job's cgroups and the drop to its owner: its nice
    value (relative to the agent's, which the child inherits), its sixteen rlimits (prlimit sets
    them on itself and execs the rest), and no_new_privs where asked."""
    adj = p.nice - os.getpriority(os.PRIO_PROCESS, 0)
    out = [NICE, "-n", str(adj)] if adj else []
    out += [PRLIMIT, *p.prlimit_args(), "--"]
    if p.no_new_privs:
        out += [SETPRIV, "--no-new-privs", "--"]
    return out


def helper_argv(uid: int, gid: int) -> list[str]:
    """The prefix of a helper that runs as a job's owner (the path probe at submit, the check of
    a checkpoint): the owner's profile (`launch_argv`) and an oom_score_adj of its own
    (HELPER_OOM_SCORE_ADJ, never the agent's -900). Raises LimitsError as `Limiter.profile`."""
    p = _active.profile(uid, gid)
    return [*([CHOOM, "-n", str(HELPER_OOM_SCORE_ADJ), "--"] if CHOOM else []), *launch_argv(p)]
