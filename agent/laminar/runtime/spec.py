"""A job spec (:class:`JobSpec`): what to run and with what, as a user submits it
(``laminarctl submit``, ``POST /v1/jobs``) or an agent hands it over, and its checks: every
field read in linear time within its range (:func:`parse_memory_mb`, :func:`parse_gpus`,
:func:`parse_signal`, :func:`parse_grace_s`), the caps on what a spec may hold
(:func:`check_spec_size`, ``SPEC_BYTES_MAX``), the env names the agent keeps to itself; and the
errors a job request is refused with (:class:`JobError` and its kinds), each naming the value
and what would be right."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any

from ..airlock.cgroups import LIFECYCLE_CLASSES
from ..inputs import NUMBER_TEXT_MAX, brief, size_mib
from . import gpus as gpumod
from . import provenance

PRIORITY_MIN, PRIORITY_MAX, PRIORITY_DEFAULT = 0, 100, 50
MEMORY_MB_MAX = 1 << 30  # 1 PiB in MiB: anything larger is a typo
STOP_GRACE_MAX_S = 3600.0  # a longer grace is a typo (a second stop is refused while one waits)
CPUS_MIN = 0.01  # the kernel's smallest CFS quota: 1 ms per 100 ms period


class JobError(ValueError):
    """A job request that cannot be done; the message names the value and what is allowed.
    `reason`: a short stable word for the API's refusal counts (``api.refused_by_reason``)."""

    def __init__(self, message: str = "", reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class ReservedEnvError(JobError):
    """A spec whose env sets a name the agent sets itself (laminar.runtime.provenance)."""


class ResumeFromError(JobError):
    """A local user's ``resume_from`` in the agent's own trees (`laminar.runtime.checks.SubmitChecks.resume_from`)."""


class QuotaError(JobError):
    """The submitting user has as many jobs not yet ended as config ``jobs.max_per_user``
    allows (429 in the API); nothing was created."""


class AdmissionError(JobError):
    """A job that could never start on this node: its memory limit exceeds its class's cap."""


def parse_memory_mb(value: Any) -> int | None:
    """'512M', '2G', '1.5G', '2048' (MiB), 512 (MiB) -> MiB; None/'' -> None (no limit). Read in
    linear time (`laminar.inputs.size_mib`: at most NUMBER_TEXT_MAX characters, checked first);
    JobError naming the value (cut) and the range otherwise, never an OverflowError."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise JobError(f"memory {value!r}: expected a size like 512M or 2G, or MiB as an integer")
    if isinstance(value, int):
        mb = value
    else:
        mb_text = size_mib(str(value)) if isinstance(value, (str, float)) else None
        if mb_text is None:
            raise JobError(f"memory {brief(value)}: expected a size like 512M or 2G, or MiB as an integer "
                           f"(at most {NUMBER_TEXT_MAX} characters)")
        mb = mb_text
    if not 1 <= mb <= MEMORY_MB_MAX:
        raise JobError(f"memory {brief(value)}: must be between 1 MiB and {MEMORY_MB_MAX} MiB")
    return mb


def parse_signal(value: Any) -> str:
    """'SIGUSR1', 'USR1', 10 -> 'SIGUSR1'. SIGKILL and SIGSTOP are refused: no process can
    catch them, so a job could never checkpoint on one (laminar.jobkit fails at its start)."""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            name = signal.Signals(value).name
        else:
            name = str(value).upper()
            name = signal.Signals[name if name.startswith("SIG") else "SIG" + name].name
    except (KeyError, ValueError):
        raise JobError(f"checkpoint signal {_brief(value)}: expected a signal name like SIGUSR1 or a number") from None
    if name in ("SIGKILL", "SIGSTOP"):
        raise JobError(f"checkpoint signal {_brief(value)}: {name} cannot be caught, so the job could never checkpoint "
                       "on it; use a catchable signal such as SIGUSR1 (the default) or SIGUSR2")
    return name


def parse_grace_s(value: Any) -> float | None:
    """A stop's grace (seconds from SIGTERM to the kill): None (the agent's default) or a
    finite number 0..STOP_GRACE_MAX_S; JobError naming the value otherwise (JSON's
    ``Infinity`` and ``NaN`` included: a grace that never ends would leave the job unstoppable)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= STOP_GRACE_MAX_S:
        raise JobError(f"grace_s {_brief(value)}: expected seconds from 0 to {STOP_GRACE_MAX_S:g}")
    return float(value)


def _has_nul(*texts: Any) -> bool:
    return any(isinstance(t, str) and "\0" in t for t in texts)


def _brief(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (an error names a huge value without quoting it whole;
    `laminar.inputs.brief`: nor builds its whole repr)."""
    return brief(value, limit)


def parse_gpus(value: Any) -> int | list[int]:
    """2 -> 2 (a count); '0,1' or [0, 1] -> [0, 1] (indices); None/'' -> 0. A count above
    ``gpus.GPUS_MAX``, or an index list longer than that or with an index past it, is refused."""
    top = gpumod.GPUS_MAX
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        raise JobError(f"gpus {value!r}: expected a count (2) or indices (0,1)")
    if isinstance(value, int):
        if not 0 <= value <= top:
            raise JobError(f"gpus {_brief(value)}: a count must be 0 to at most {top}")
        return value
    if isinstance(value, str):
        s = value.strip()
        if s.count(",") >= top:
            raise JobError(f"gpus {_brief(value)}: at most {top} indices")
        # ASCII digits only ('²'.isdigit() is true, and int() refuses it), and no more than a
        # count or an index can have (int() of 5,000 digits raises)
        parts = [x.strip() for x in s.split(",")]
        if not all(x.isascii() and x.isdigit() and len(x) <= 6 for x in parts):
            raise JobError(f"gpus {_brief(value)}: expected a count (2) or indices (0,1)")
        if len(parts) == 1:
            return parse_gpus(int(parts[0]))
        value = [int(x) for x in parts]
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        if len(value) > top:
            raise JobError(f"gpus {_brief(value)}: at most {top} indices (no node has more GPUs)")
        bad = [i for i in value if not 0 <= i < top]
        if bad:
            raise JobError(f"gpus {_brief(value)}: indices must be 0..{top - 1}, not {_brief(bad)}")
        if len(set(value)) != len(value):
            raise JobError(f"gpus {_brief(value)}: indices must be unique")
        return list(value)
    raise JobError(f"gpus {_brief(value)}: expected a count (2) or indices (0,1)")


# What a job spec may hold (docs/operations.md, "What a job spec may hold"). A spec is kept in
# memory while the job lives (256 per user), stored with its record, listed, sent to peers on a
# move: the API's 1 MiB body cap alone let one user hold gigabytes (a 1 MiB env is 8.7 MB of
# Python objects). SPEC_BYTES_MAX bounds what the user writes: command, env, cwd and resume_from
# together, in UTF-8 bytes (an argument and an env entry count one byte more: the NUL execve
# adds; "NAME=value" the '='). A spec at the cap still moves: its hand-over frame (at most
# laminar.zone.wire.MAX_FRAME) carries it whatever it escapes to in JSON.
SPEC_BYTES_MAX = 64 << 10
ARGV_ITEMS_MAX = 4096  # arguments of the command
ARG_BYTES_MAX = 32 << 10  # one argument (the kernel's own limit is 128 KiB)
ENV_NAMES_MAX = 1024  # names in the env
ENV_NAME_BYTES_MAX = 256  # one env name
ENV_VALUE_BYTES_MAX = 32 << 10  # one env value
PATH_BYTES_MAX = 4096  # cwd, resume_from (PATH_MAX)
# Elastic workers: one GPU each, and no node has more than gpus.GPUS_MAX GPUs (the options the
# elastic round builds per job grow with elastic_max - workers; see laminar.policy.elastic).
ELASTIC_MAX = gpumod.GPUS_MAX
# Members of a multi-node job (docs/jobs.md): one node each. 64 keeps a gang's placement (d x k
# probes), its hand-overs and every member's view (O(members) per message) small.
WORKERS_MAX = 64
LAUNCHERS = ("torchrun", "plain")
# A multi-node job's id: job-<the origin's job number>-n<the origin's node id> (docs/jobs.md)
MULTINODE_ID_RE = re.compile(r"job-[0-9]{1,18}-n[0-9]{1,10}")
# Any job id a job may have: a local job-N, or a multi-node job's id (a member's local job has it)
JOB_ID_RE = re.compile(r"job-[0-9]{1,18}(?:-n[0-9]{1,10})?")


def is_multinode_id(job_id: str) -> bool:
    """Whether ``job_id`` is a multi-node job's id (``job-7-n3``), not a local ``job-N``."""
    return isinstance(job_id, str) and MULTINODE_ID_RE.fullmatch(job_id) is not None


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_spec_size(spec: JobSpec) -> None:
    """Raises JobError when `spec` holds more than a spec may (the caps above), naming the size
    and the cap; before anything else reads it. Fields of the wrong type are left to
    `JobSpec.validate` (it names them)."""
    total = 0
    if isinstance(spec.command, list):
        if len(spec.command) > ARGV_ITEMS_MAX:
            raise JobError(f"command: {len(spec.command)} arguments, at most {ARGV_ITEMS_MAX}", reason="spec_too_large")
        for i, a in enumerate(spec.command):
            if isinstance(a, str):
                n = _utf8_len(a)
                if n > ARG_BYTES_MAX:
                    raise JobError(f"command: argument {i} is {n} bytes, at most {ARG_BYTES_MAX}",
                                   reason="spec_too_large")
                total += n + 1
    if isinstance(spec.env, dict):
        if len(spec.env) > ENV_NAMES_MAX:
            raise JobError(f"env: {len(spec.env)} names, at most {ENV_NAMES_MAX}", reason="spec_too_large")
        for k, v in spec.env.items():
            if not isinstance(k, str) or not isinstance(v, str):
                continue
            nk, nv = _utf8_len(k), _utf8_len(v)
            if nk > ENV_NAME_BYTES_MAX:
                raise JobError(f"env: name {_brief(k)} is {nk} bytes, at most {ENV_NAME_BYTES_MAX}",
                               reason="spec_too_large")
            if nv > ENV_VALUE_BYTES_MAX:
                raise JobError(f"env {_brief(k)}: value of {nv} bytes, at most {ENV_VALUE_BYTES_MAX}",
                               reason="spec_too_large")
            total += nk + nv + 2
    for what, path in (("cwd", spec.cwd), ("resume_from", spec.resume_from)):
        if isinstance(path, str):
            n = _utf8_len(path)
            if n > PATH_BYTES_MAX:
                raise JobError(f"{what}: {n} bytes, at most {PATH_BYTES_MAX}", reason="spec_too_large")
            total += n
    if total > SPEC_BYTES_MAX:
        raise JobError(f"job spec: {total} bytes, at most {SPEC_BYTES_MAX} (command, env, cwd and resume_from "
                       "together); pass large data in a file", reason="spec_too_large")


@dataclass
class JobSpec:
    """What to run and with what. Build with `JobSpec.from_dict` (validates) or directly and
    call `validate()`. JSON keys are the field names, with ``class`` for `job_class`."""

    command: list[str]
    name: str = ""
    memory_mb: int | None = None
    cpus: float | None = None
    gpus: int | list[int] = 0
    job_class: str = "standard"
    priority: int = PRIORITY_DEFAULT
    checkpoint_signal: str = "SIGUSR1"
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    lent: bool = False
    elastic_min: int | None = None
    elastic_max: int | None = None
    resume_from: str | None = None
    # the job's own hints, once env names (laminar.runtime.provenance): its expected remaining
    # single-worker seconds (elastic GPUs), and whether the checkpoint driver may ask it for
    # periodic checkpoints
    remaining_s: float | None = None
    periodic_checkpoints: bool = True
    # a multi-node job (docs/jobs.md): members on `workers` nodes (None or 1: one node), elastic
    # between workers_min and workers_max (both or neither), started by `launcher` (torchrun or
    # plain; None: chosen from the command, laminar.members.launch). gpus, cpus and memory_mb
    # are per worker.
    workers: int | None = None
    workers_min: int | None = None
    workers_max: int | None = None
    launcher: str | None = None

    def validate(self) -> JobSpec:
        """Checks every field; raises JobError naming the value and what would be right."""
        check_spec_size(self)
        if not isinstance(self.command, list) or not self.command or not all(isinstance(a, str) for a in self.command):
            raise JobError(f"command {_brief(self.command)}: expected a non-empty list of strings (argv)")
        if not self.command[0]:
            raise JobError("command: argv[0] is empty")
        if _has_nul(*self.command):
            raise JobError(f"command {_brief(self.command)}: an argument holds a NUL byte, which no argv can carry")
        if not isinstance(self.name, str) or len(self.name) > 63 or not all(c.isalnum() or c in "-_." for c in self.name):
            raise JobError(f"name {_brief(self.name)}: 0-63 characters of letters, digits, '-', '_' or '.'")
        self.memory_mb = parse_memory_mb(self.memory_mb)
        if self.cpus is not None:
            if isinstance(self.cpus, bool) or not isinstance(self.cpus, int | float) or not CPUS_MIN <= self.cpus <= 4096:
                raise JobError(f"cpus {_brief(self.cpus)}: expected a number of CPUs, at least {CPUS_MIN} (the kernel's "
                               "smallest quota) and at most 4096 (fractions allowed)")
            self.cpus = float(self.cpus)
        self.gpus = parse_gpus(self.gpus)
        if self.job_class not in LIFECYCLE_CLASSES:
            raise JobError(f"class {_brief(self.job_class)}: expected one of {', '.join(LIFECYCLE_CLASSES)}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise JobError(f"priority {_brief(self.priority)}: expected an integer {PRIORITY_MIN}..{PRIORITY_MAX} (higher survives longer)")
        self.checkpoint_signal = parse_signal(self.checkpoint_signal)
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k
                                                     for k, v in self.env.items()):
            raise JobError(f"env {_brief(self.env)}: expected a table of NAME = \"value\" strings")
        if _has_nul(*self.env, *self.env.values()):
            raise JobError(f"env {_brief(self.env)}: a name or value holds a NUL byte, which no environment can carry")
        _check_env_names(self.env)
        if self.cwd is not None and (not isinstance(self.cwd, str) or not self.cwd.startswith("/") or _has_nul(self.cwd)):
            raise JobError(f"cwd {_brief(self.cwd)}: expected an absolute path (with no NUL byte)")
        if not isinstance(self.lent, bool):
            raise JobError(f"lent {_brief(self.lent)}: expected true or false")
        if (self.elastic_min is None) != (self.elastic_max is None):
            raise JobError("elastic: give both elastic_min and elastic_max, or neither")
        if self.elastic_min is not None and self.elastic_max is not None:
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.elastic_min, self.elastic_max))
            if not ok or not 1 <= self.elastic_min <= self.elastic_max <= ELASTIC_MAX:
                raise JobError(f"elastic min {_brief(self.elastic_min)} / max {_brief(self.elastic_max)}: expected "
                               f"integers with 1 <= min <= max <= {ELASTIC_MAX} (a worker takes a GPU, and no node "
                               "has more)")
        if self.resume_from is not None and (not isinstance(self.resume_from, str) or _has_nul(self.resume_from)):
            raise JobError(f"resume_from {_brief(self.resume_from)}: expected a path (with no NUL byte)")
        if self.remaining_s is not None:
            lo, hi = provenance.REMAINING_S_MIN, provenance.REMAINING_S_MAX
            if isinstance(self.remaining_s, bool) or not isinstance(self.remaining_s, int | float) \
                    or not lo <= self.remaining_s <= hi:  # (NaN and infinity fail it)
                raise JobError(f"remaining_s {_brief(self.remaining_s)}: expected the job's remaining single-worker "
                               f"seconds, {lo:g} to {hi:g}")
            self.remaining_s = float(self.remaining_s)
        if not isinstance(self.periodic_checkpoints, bool):
            raise JobError(f"periodic_checkpoints {_brief(self.periodic_checkpoints)}: expected true or false")
        self._check_members()
        return self

    def _check_members(self) -> None:
        """The multi-node fields: JobError naming the value and what is allowed."""
        def whole(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for what, v in (("workers", self.workers), ("workers_min", self.workers_min),
                        ("workers_max", self.workers_max)):
            if v is not None and (not whole(v) or not 1 <= v <= WORKERS_MAX):
                raise JobError(f"{what} {_brief(v)}: expected a number of nodes, 1 to {WORKERS_MAX} (one member "
                               "per node)", reason="workers_invalid")
        if (self.workers_min is None) != (self.workers_max is None):
            raise JobError(f"workers_min {_brief(self.workers_min)} / workers_max {_brief(self.workers_max)}: give "
                           "both elastic bounds, or neither (a rigid job)", reason="workers_invalid")
        lo, hi = self.workers_min, self.workers_max
        if lo is not None and hi is not None:
            if lo > hi:
                raise JobError(f"elastic workers {lo}:{hi}: min {lo} is more than max {hi}; expected "
                               f"1 <= min <= max <= {WORKERS_MAX}", reason="workers_invalid")
            if self.workers is None:
                self.workers = hi  # placed at its most; TorchElastic goes on down to min
            elif not lo <= self.workers <= hi:
                raise JobError(f"workers {self.workers}: outside the elastic bounds {lo}:{hi}; expected "
                               f"{lo} <= workers <= {hi}", reason="workers_invalid")
            if hi < 2:
                raise JobError(f"elastic workers {lo}:{hi}: a multi-node job's max is 2 nodes at least "
                               f"(1:1 is a one-node job: leave the bounds out)", reason="workers_invalid")
        if self.workers == 1 and lo is None:
            self.workers = None  # one node: the spec an older agent takes
        if self.launcher is not None and self.launcher not in LAUNCHERS:
            raise JobError(f"launcher {_brief(self.launcher)}: expected one of {', '.join(LAUNCHERS)}",
                           reason="workers_invalid")
        if not self.is_multinode():
            if self.launcher is not None:
                raise JobError(f"launcher {_brief(self.launcher)}: only for a multi-node job (workers 2 to "
                               f"{WORKERS_MAX}); a one-node job runs its command as it is", reason="workers_invalid")
            return
        if self.elastic_min is not None or self.elastic_max is not None:
            raise JobError(f"elastic_min {_brief(self.elastic_min)} / elastic_max {_brief(self.elastic_max)} with "
                           f"workers {self.workers}: a job is either multi-node (workers, workers_min, workers_max: "
                           "nodes) or GPU-elastic on one node (elastic_min, elastic_max: GPUs), not both",
                           reason="workers_invalid")
        if isinstance(self.gpus, list):
            raise JobError(f"gpus {_brief(self.gpus)}: a multi-node job gives a count of GPUs per worker (each "
                           "member's node chooses its own), not indices", reason="workers_invalid")

    def is_multinode(self) -> bool:
        """Whether this spec asks for members on several nodes (workers 2 or more, or elastic
        bounds whose max is): the members component runs it, not one job manager."""
        top = self.workers_max if self.workers_max is not None else self.workers
        return isinstance(top, int) and not isinstance(top, bool) and top >= 2

    @classmethod
    def from_dict(cls, d: Any) -> JobSpec:
        """Validated spec from a JSON object; unknown keys are refused by name."""
        if not isinstance(d, dict):
            raise JobError(f"job spec must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        for short, full in (("class", "job_class"), ("memory", "memory_mb")):
            if short in d and full in d:  # two values for one thing: which one was meant?
                raise JobError(f"job spec: both {short!r} = {_brief(d[short])} and {full!r} = {_brief(d[full])}; "
                               f"give one of them")
        if "class" in d:
            d["job_class"] = d.pop("class")
        if "memory" in d:
            d["memory_mb"] = parse_memory_mb(d.pop("memory"))
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise JobError(f"job spec: unknown keys {_brief(unknown)}; allowed: {sorted(known | {'class', 'memory'})}")
        if "command" not in d:
            raise JobError("job spec: missing 'command' (argv list)")
        return cls(**d).validate()

    def as_dict(self) -> dict[str, Any]:
        """The spec as JSON keys (``class`` for job_class, last). Built by hand: shallow copies
        of the command, env and GPU list (their items are strings and ints), where
        dataclasses.asdict deep-copied everything (0.31 s for an env of 88,000 entries). The
        fields added since (`LATER_FIELDS`) are left out while they hold their defaults: an agent
        of an older release refuses a spec with a key it does not know, so a job that uses none of
        them still moves to it."""
        d = {f: getattr(self, f) for f in _SPEC_FIELDS}
        d["command"] = list(self.command) if isinstance(self.command, list) else self.command
        d["env"] = dict(self.env) if isinstance(self.env, dict) else self.env
        if isinstance(self.gpus, list):
            d["gpus"] = list(self.gpus)
        d["class"] = self.job_class
        for k, default in LATER_FIELDS.items():
            if d.get(k) == default:
                del d[k]
        return d


_SPEC_FIELDS = tuple(f for f in JobSpec.__dataclass_fields__ if f != "job_class")
# JobSpec fields added after a release, with their defaults (JobSpec.as_dict)
LATER_FIELDS: dict[str, Any] = {"remaining_s": None, "periodic_checkpoints": True, "workers": None,
                                "workers_min": None, "workers_max": None, "launcher": None}


def _check_env_names(env: dict[str, str]) -> None:
    """JobError naming the reserved names ``env`` sets (laminar.runtime.provenance) and what to
    use instead: the agent sets them itself, and never reads a job's environment back."""
    problem = provenance.reserved_env_error(env)
    if problem:
        raise ReservedEnvError(problem)
