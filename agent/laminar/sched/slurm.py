"""Slurm as the agent acts through it: the ``scontrol`` client (:class:`Slurm`) and the Slurm
backend of the scheduler component (:class:`SlurmBackend`, design-34 §2-3).

The client runs ``scontrol`` as a child process, never on the event loop's time: each call is
bounded in time (``[slurm] timeout_s``, then the child is killed) and in output (at most
OUTPUT_MAX bytes of each stream: past it the child is killed and the call fails), with
``LC_ALL=C`` so what it prints parses the same everywhere. Every argument is checked before it
is given to ``scontrol`` (node names, job ids, the text of a reason or comment), and a failure
is a :class:`SlurmError` naming the command line and what ``scontrol`` wrote on stderr (or on
stdout, where it says a refusal there: ``Node x not found``).

=============================  ========================================================
call                           command line
=============================  ========================================================
``drain(node, reason)``        ``scontrol update NodeName=<node> State=DRAIN Reason=<reason>``
``undrain(node)``              ``scontrol update NodeName=<node> State=UNDRAIN``
``node(node)``                 ``scontrol show node <node> --oneliner`` (fields as a dict)
``requeue(job)``               ``scontrol requeue <job>``
``set_comment(job, text)``     ``scontrol update JobId=<job> Comment=<text>``
``job(job)``                   ``scontrol show job <job> --oneliner`` (fields as a dict)
``job_gpus(job, node)``        ``scontrol show job -d <job>`` (the GPU indices slurmctld gave
                               the job on ``node``: :func:`parse_job_gpus`)
=============================  ========================================================

The ``[slurm]`` config section::

    [slurm]
    enabled = false            # act through Slurm (drain, requeue, comment, GPUs checked) for adopted Slurm jobs
    node_name = ""             # this node's Slurm NodeName (default: the host's name)
    scontrol = "scontrol"      # the scontrol binary (a name found on PATH, or an absolute path)
    timeout_s = 10.0           # one scontrol call, at most
    publish_comment = true     # each adopted job's last checkpoint in its comment

The backend: ``drain`` drains the node with the reclaim's reason (``laminar: reclaim of node
...``), ``undrain`` clears the drain only when the reason it has is still Laminar's (an operator's own
drain stays), ``give_back`` requeues the job (Slurm ends its processes here and runs it again
elsewhere: the node is drained; the task there is adopted again and finds its checkpoint in the
shared checkpoint directory as ``LAMINAR_RESUME_FROM``), ``publish`` sets the job's comment to
``laminar-ckpt=<unix time> <path>`` after the user's own words (:mod:`laminar.policy.sched_reclaim`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..policy import sched_reclaim as sr
from .backend import BackendError

if TYPE_CHECKING:
    from ..runtime.record import Job

# How long a give-back waits for the requeued job's processes here to end before it releases
# Slurm's hold on the job's restart (a job that outlives it, Slurm's KillWait is 30 s, keeps the hold).
RELEASE_WAIT_S = 15.0

log = logging.getLogger("laminar.sched")

# What one scontrol call may print, per stream: a `show job` line is a few KiB; a million-line
# answer (a misconfigured wrapper, a Slurm bug) must not fill the agent's memory.
OUTPUT_MAX = 256 << 10
# How much of stderr an error quotes.
STDERR_QUOTE = 400
# A Slurm node name: what slurm.conf's NodeName takes (host names), bounded.
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A Slurm job id as Laminar refers to it (design-34: the job id, digits only; not the step).
_JOB = re.compile(r"[0-9]{1,10}")
# `scontrol show job -d` (22.05, not --oneliner, which runs them into the job's line): one line per
# group of the job's nodes that hold the same, "   Nodes=n[1-2] CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:0-1)"
_DETAIL = re.compile(r"\s+Nodes=(\S{1,4096})(?:\s.*)?")
_GRES_FIELD = re.compile(r"(?:^|\s)GRES=(\S{0,4096})")
# One GPU gres of a detail line's GRES: gpu, a type and a count optional ("gpu:a100:2"), its indices
# on the node ("IDX:0-1,3"); other gres (mps:100(0/100)) are not matched
_GRES_GPU = re.compile(r"(?:^|,)gpu(?::[A-Za-z0-9_.-]{1,64}){0,2}\(IDX:([^)]{0,4096})\)")
# A hostlist entry: literal text and bracket groups ("rack[1-2]-n[01-04,7]")
_HOSTLIST_PART = re.compile(r"([^\[\]]*)(?:\[([0-9,\-]{1,1024})\])?")
# The most GPU indices a detail line may list (laminar.runtime.gpus.GPUS_MAX: one past the highest)
GPU_INDEX_MAX = 1024
# `scontrol show ... --oneliner`: Key=Value pairs separated by spaces, where a value may hold
# spaces (Comment, Reason, Command): a field begins where a space is followed by Key=.
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


class SlurmError(BackendError):
    """scontrol failed, did not answer in time, printed too much, or was given a bad value; the
    message names the command line and what scontrol said."""


def config_fields() -> dict[str, Any]:
    """The ``[slurm]`` config section (the module's docs)."""
    from laminar.config import Field, _range

    def _binary(v: str) -> str | None:
        if not v or "\0" in v or (("/" in v) and not v.startswith("/")):
            return "expected a program name found on PATH or an absolute path"
        return None

    def _node(v: str) -> str | None:
        return None if v == "" or _NODE.fullmatch(v) else "expected a Slurm NodeName (letters, digits, . _ -; 64 at most)"

    return {
        "enabled": Field(bool, False, "act through Slurm for adopted Slurm jobs: drain this node on a reclaim, "
                         "checkpoint and requeue its jobs, publish each job's last checkpoint in its comment, check "
                         "a user's adopted job's GPUs with slurmctld (off: a user's task naming GPUs is refused)"),
        "node_name": Field(str, "", "this node's Slurm NodeName (default: the host's name)", _node),
        "scontrol": Field(str, "scontrol", "the scontrol binary: a name found on PATH or an absolute path", _binary),
        "timeout_s": Field((int, float), 10.0, "one scontrol call at most (then it is killed and the call fails)",
                           _range(0.1, 300)),
        "publish_comment": Field(bool, True, "write each adopted job's last checkpoint in its Slurm comment "
                                 "(laminar-ckpt=<unix time> <path>, after the user's own words)"),
    }


def _register() -> None:
    from laminar.config import register_section

    register_section("slurm", config_fields())


_register()


def check_node(node: str) -> str:
    """``node`` when it is a Slurm node name; SlurmError naming it otherwise."""
    if not isinstance(node, str) or not _NODE.fullmatch(node):
        raise SlurmError(f"slurm: node name {str(node)[:80]!r}: expected letters, digits, '.', '_' or '-' "
                         "(64 at most), as slurm.conf's NodeName")
    return node


def check_job(job_ref: str) -> str:
    """``job_ref`` when it is a Slurm job id (digits only, no step); SlurmError naming it otherwise."""
    if not isinstance(job_ref, str) or not _JOB.fullmatch(job_ref):
        raise SlurmError(f"slurm: job {str(job_ref)[:80]!r}: expected a Slurm job id (1 to 10 digits, no step)")
    return job_ref


def check_text(what: str, text: str, limit: int) -> str:
    """``text`` for a Reason= or Comment= value: printable, no newline, at most ``limit``
    characters; SlurmError naming it otherwise."""
    if not isinstance(text, str) or len(text) > limit or not text.isprintable():
        raise SlurmError(f"slurm: {what} {str(text)[:80]!r}: expected printable text on one line, "
                         f"{limit} characters at most")
    return text


def parse_oneliner(line: str) -> dict[str, str]:
    """``scontrol show ... --oneliner``'s Key=Value pairs as a dict (a value may hold spaces:
    a field begins where a space is followed by ``Key=``). The first line only."""
    line = line.strip().splitlines()[0] if line.strip() else ""
    out: dict[str, str] = {}
    marks = list(_FIELD.finditer(line))
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    return out


def _index_list(text: str, what: str) -> list[int]:
    """``0-1,3`` as [0, 1, 3] (each index below GPU_INDEX_MAX, each once); SlurmError naming
    ``what`` and the text otherwise."""
    out: list[int] = []
    for part in text.split(","):
        lo_s, sep, hi_s = part.partition("-")
        if not lo_s.isdigit() or (sep and not hi_s.isdigit()) or len(lo_s) > 6 or len(hi_s) > 6:
            raise SlurmError(f"slurm: {what}: IDX {text[:80]!r}: expected GPU indices such as 0-1,3")
        lo, hi = int(lo_s), int(hi_s) if sep else int(lo_s)
        if hi < lo or hi >= GPU_INDEX_MAX:
            raise SlurmError(f"slurm: {what}: IDX {text[:80]!r}: expected ranges lo-hi below {GPU_INDEX_MAX}")
        out.extend(range(lo, hi + 1))
        if len(out) > GPU_INDEX_MAX:
            raise SlurmError(f"slurm: {what}: IDX {text[:80]!r}: more than {GPU_INDEX_MAX} GPUs")
    if len(set(out)) != len(out):
        raise SlurmError(f"slurm: {what}: IDX {text[:80]!r}: an index given twice")
    return out


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets (a hostlist's entries)."""
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def in_hostlist(node: str, hostlist: str) -> bool:
    """Whether ``node`` is one of the Slurm hostlist ``hostlist`` names (``n1,n[3-5],r[1-2]-g[01-08]``;
    a zero-padded range's numbers have its width), without expanding it: a list of 100,000 nodes
    costs what its text costs."""
    for entry in _split_top(hostlist):
        parts = [(m.group(1), m.group(2)) for m in _HOSTLIST_PART.finditer(entry) if m.group(0)]
        if "".join(lit + (f"[{br}]" if br is not None else "") for lit, br in parts) != entry:
            continue  # not a hostlist entry we read: never a match
        if _match_parts(node, parts):
            return True
    return False


def _match_parts(name: str, parts: list[tuple[str, str | None]]) -> bool:
    if not parts:
        return name == ""
    (lit, br), rest = parts[0], parts[1:]
    if not name.startswith(lit):
        return False
    name = name[len(lit):]
    if br is None:
        return _match_parts(name, rest)
    run = len(name) - len(name.lstrip("0123456789"))
    for n in range(1, min(run, 12) + 1):  # the number's digits; the rest must match what follows
        digits, value = name[:n], int(name[:n])
        for r in br.split(","):
            lo_s, sep, hi_s = r.partition("-")
            if not lo_s.isdigit() or (sep and not hi_s.isdigit()):
                return False
            lo, hi = int(lo_s), int(hi_s) if sep else int(lo_s)
            padded = len(lo_s) > 1 and lo_s.startswith("0")
            if lo <= value <= hi and (len(digits) == len(lo_s) if padded else digits == str(value)) \
                    and _match_parts(name[n:], rest):
                return True
    return False


def parse_job_gpus(text: str, job_ref: str, node: str) -> tuple[int, ...]:
    """The GPU indices (``IDX``) slurmctld gave job ``job_ref`` on ``node``, from what
    ``scontrol show job -d <job>`` printed (22.05; :data:`_DETAIL`): the record whose ``JobId``
    is the job (an array's or a heterogeneous job's others are skipped), its detail lines whose
    ``Nodes=`` hostlist names ``node`` (other nodes' ignored); sorted. () when that line has no
    GPU gres. SlurmError naming the job and node when the record is not there, names no detail
    line of this node (the job holds nothing here per slurmctld, or ``[slurm] node_name`` is not
    this node's NodeName), or a GPU's IDX cannot be read (``N/A``, a malformed list)."""
    what = f"job {job_ref} on node {node}"
    record: list[str] | None = None
    for line in text.splitlines()[:10000]:
        if line.startswith("JobId="):
            if record is not None:
                break  # the job's own record ended
            if line.split(None, 1)[0] == f"JobId={job_ref}":
                record = []
        elif record is not None:
            record.append(line)
    if record is None:
        raise SlurmError(f"slurm: {what}: scontrol show job -d printed no record JobId={job_ref}")
    found: list[int] | None = None
    for line in record:
        m = _DETAIL.fullmatch(line)
        if m is None or not in_hostlist(node, m.group(1)):
            continue
        found = found or []
        gres = _GRES_FIELD.search(line)
        for g in _GRES_GPU.finditer(gres.group(1) if gres else ""):
            found += [i for i in _index_list(g.group(1), what) if i not in found]
    if found is None:
        raise SlurmError(f"slurm: {what}: slurmctld lists no allocation of the job on this node (is [slurm] "
                         "node_name this node's Slurm NodeName?)")
    return tuple(sorted(found))


async def _read_bounded(stream: asyncio.StreamReader | None, limit: int, over: Callable[[], None]) -> bytes | None:
    """What ``stream`` gives until its end, or None as soon as it passes ``limit`` bytes (then
    ``over()`` is called: it kills the child, whose other stream then ends too)."""
    if stream is None:
        return b""
    buf = bytearray()
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > limit:
            over()
            return None


class Slurm:
    """The ``scontrol`` client (the module's docs). ``scontrol``: the binary (a name on PATH or an
    absolute path); ``timeout_s``: one call at most."""

    def __init__(self, scontrol: str = "scontrol", timeout_s: float = 10.0, output_max: int = OUTPUT_MAX) -> None:
        self.scontrol = scontrol
        self.timeout_s = float(timeout_s)
        self.output_max = int(output_max)
        self.calls = 0
        self.failures = 0

    def _argv0(self) -> str:
        path = self.scontrol if self.scontrol.startswith("/") else shutil.which(self.scontrol)
        if not path:
            raise SlurmError(f"slurm: {self.scontrol!r} not found on PATH ({os.environ.get('PATH', '')[:200]}); "
                             "install slurm-client or set [slurm] scontrol to its absolute path")
        return path

    async def run(self, *args: str) -> str:
        """``scontrol <args>``'s stdout (text); SlurmError naming the command line and its
        stderr when it exits non-zero, takes longer than ``timeout_s`` (killed) or prints more
        than ``output_max`` bytes on a stream (killed)."""
        argv = [self._argv0(), *args]
        shown = " ".join(["scontrol", *args])[:300]
        self.calls += 1
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LC_ALL": "C"}
        for k in ("SLURM_CONF",):  # a site's (or a test rig's) slurm.conf is found the same way as by the admin
            if k in os.environ:
                env[k] = os.environ[k]
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                        stderr=subprocess.PIPE, env=env, start_new_session=True)
        except OSError as e:
            self.failures += 1
            raise SlurmError(f"slurm: {shown}: could not run: {e}") from None
        def kill() -> None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

        try:
            out, err = await asyncio.wait_for(asyncio.gather(_read_bounded(proc.stdout, self.output_max, kill),
                                                             _read_bounded(proc.stderr, self.output_max, kill)),
                                              self.timeout_s)
            if out is None or err is None:
                raise SlurmError(f"slurm: {shown}: printed more than {self.output_max} bytes; killed")
            rc = await asyncio.wait_for(proc.wait(), self.timeout_s)
        except TimeoutError:
            self.failures += 1
            raise SlurmError(f"slurm: {shown}: no answer within {self.timeout_s:g} s ([slurm] timeout_s); killed "
                             "(is slurmctld reachable from this node?)") from None
        except SlurmError:
            self.failures += 1
            raise
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5.0)
        if rc != 0:
            self.failures += 1
            # scontrol says some refusals on stdout ("Node x not found" of `show node`): quoted then
            said = (err.decode("utf-8", "replace").strip() or out.decode("utf-8", "replace").strip())[:STDERR_QUOTE] \
                or "(nothing on stderr or stdout)"
            raise SlurmError(f"slurm: {shown}: exit status {rc}: {said}")
        return out.decode("utf-8", "replace")

    async def drain(self, node: str, reason: str) -> None:
        """Drains ``node`` with ``reason`` (no new job starts there; running ones go on)."""
        await self.run("update", f"NodeName={check_node(node)}", "State=DRAIN",
                       f"Reason={check_text('reason', reason, sr.REASON_MAX)}")

    async def undrain(self, node: str) -> None:
        """Clears ``node``'s drain, and only that (``State=UNDRAIN``, Slurm 20.11 and later: a node
        that is also DOWN stays down; ``State=RESUME`` is refused for a drained node whose slurmd
        does not answer, and would bring back a node an operator set DOWN)."""
        await self.run("update", f"NodeName={check_node(node)}", "State=UNDRAIN")

    async def node(self, node: str) -> dict[str, str]:
        """``scontrol show node <node>``'s fields (``State``, ``Reason``, ...)."""
        return parse_oneliner(await self.run("show", "node", check_node(node), "--oneliner"))

    async def requeue(self, job_ref: str) -> None:
        """Requeues the job: Slurm ends its processes and runs it again where it may (a drained
        node is not one). Needs ``JobRequeue=1`` in slurm.conf or the job's ``--requeue``."""
        await self.run("requeue", check_job(job_ref))

    async def release_hold(self, job_ref: str) -> None:
        """Makes a requeued job eligible at once (``StartTime=now``): Slurm holds a requeued job
        about two minutes (``Reason=BeginTime``), for the node it left to end its processes."""
        await self.run("update", f"JobId={check_job(job_ref)}", "StartTime=now")

    async def set_comment(self, job_ref: str, text: str) -> None:
        """Sets the job's comment to ``text``."""
        await self.run("update", f"JobId={check_job(job_ref)}", f"Comment={check_text('comment', text, sr.COMMENT_MAX)}")

    async def job(self, job_ref: str) -> dict[str, str]:
        """``scontrol show job <job>``'s fields (``JobState``, ``NodeList``, ``Comment``, ``Restarts``, ...)."""
        return parse_oneliner(await self.run("show", "job", check_job(job_ref), "--oneliner"))


    async def job_gpus(self, job_ref: str, node: str) -> tuple[int, ...]:
        """The GPU indices slurmctld gave job ``job_ref`` on ``node`` (``scontrol show job -d``:
        :func:`parse_job_gpus`, and its SlurmError)."""
        check_node(node)
        return parse_job_gpus(await self.run("show", "job", "-d", check_job(job_ref)), job_ref, node)


def this_node_name(configured: str) -> str:
    """``[slurm] node_name``, or this host's name (up to the first dot) when empty."""
    return check_node(configured or socket.gethostname().split(".")[0])


class SlurmBackend:
    """The scheduler component's Slurm backend (:class:`laminar.sched.backend.Backend`; the
    module's docs). ``newest``: the path of a job's newest checkpoint as the agent last listed
    it (published beside its time; None: the time alone)."""

    def __init__(self, client: Slurm, node: str, publish_comment: bool = True,
                 newest: Callable[[Job], str | None] | None = None) -> None:
        from ..policy.sched import Scheduler

        self.scheduler = Scheduler.SLURM
        self.client = client
        self.node = check_node(node)
        self.publish_comment = publish_comment
        self.newest = newest or (lambda job: None)
        self.drained_reason: str | None = None  # the reason this agent drained its node with (None: not drained)

    @staticmethod
    def _ref(job: Job) -> str:
        ref = job.origin.scheduler_ref
        if not ref:
            raise SlurmError(f"slurm: job {job.id} has no Slurm job id (it was not adopted from Slurm)")
        return check_job(ref)

    async def drain(self, reason: str) -> None:
        text = sr.drain_reason(self.node, reason)
        await self.client.drain(self.node, text)
        self.drained_reason = text

    async def undrain(self, reason: str) -> None:
        state = await self.client.node(self.node)
        if not sr.drained_by_us(state.get("Reason")):
            log.info("slurm: node %s not resumed: its drain reason %r is not Laminar's (%s)", self.node,
                     state.get("Reason"), reason)
            self.drained_reason = None
            return
        await self.client.undrain(self.node)
        self.drained_reason = None

    async def give_back(self, job: Job, ckpt: str | None, deadline_mono: float | None = None) -> str:
        ref = self._ref(job)
        await self.client.requeue(ref)
        done = f"slurm job {ref} requeued" + (f", to resume from {ckpt}" if ckpt else ", with no checkpoint")
        # Slurm's hold of a requeued job is for the processes it left here; the job's cgroup says
        # when they are gone, and from then on it may start elsewhere at once (a notice's downtime
        # was the hold: about 140 s of 145 on the real Slurm of bench/slurm_reclaim.py)
        end = time.monotonic() + RELEASE_WAIT_S
        if deadline_mono is not None:
            end = min(end, deadline_mono)
        while job.active and time.monotonic() < end:
            await asyncio.sleep(0.1)
        if job.active:
            return done + "; its processes here outlived the wait, so Slurm's hold stays"
        await self.client.release_hold(ref)
        return done + "; its processes here are gone and Slurm's hold on its restart released"

    async def publish(self, job: Job, ckpt_time: float) -> None:
        if not self.publish_comment:
            return
        ref = self._ref(job)
        fields = await self.client.job(ref)
        comment = fields.get("Comment")
        text = sr.merge_comment(None if comment in (None, "(null)") else comment,
                                sr.publish_text(ckpt_time, self.newest(job)))
        await self.client.set_comment(ref, text)

    async def tick(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"node": self.node, "drained": self.drained_reason, "calls": self.client.calls,
                "failures": self.client.failures}


def build(agent: Any, newest: Callable[[Job], str | None] | None = None) -> SlurmBackend:
    """The Slurm backend as the agent's ``[slurm]`` configures it (the scheduler component calls
    this when ``[slurm] enabled``; ``agent``: what it reads of the agent, its config). Raises
    SlurmError naming a bad node name."""
    s = agent.config.section("slurm")
    return SlurmBackend(Slurm(str(s["scontrol"]), float(s["timeout_s"])), this_node_name(str(s["node_name"])),
                        bool(s["publish_comment"]), newest)


__all__ = ["OUTPUT_MAX", "Slurm", "SlurmBackend", "SlurmError", "build", "check_job", "check_node", "check_text",
           "config_fields", "in_hostlist", "parse_job_gpus", "parse_oneliner", "this_node_name"]
