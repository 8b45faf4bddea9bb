"""The scheduler component (``agent.schedulers``): the agent's side of the schedulers it works
beside (design-34 §3).

It builds one backend (:class:`laminar.sched.backend.Backend`) per scheduler enabled in the
config (``[slurm] enabled``: :mod:`laminar.sched.slurm`; ``[kubernetes] enabled``:
:mod:`laminar.sched.kubernetes`), and

- every ``[schedulers] tick_s``: runs each backend's ``tick`` and publishes to its scheduler the
  last verified checkpoint of each adopted job whose checkpoint changed since it was last told
  (:func:`laminar.policy.sched_reclaim.should_publish`; Slurm: the job's comment
  ``laminar-ckpt=<unix time> <path>``);
- gives an owner's reclaim (:mod:`laminar.migrate.evacuation`) three calls:
  :meth:`SchedulerComponent.start_drain` (the reclaim begins: the node drained in every
  scheduler, so nothing new is placed here), :meth:`SchedulerComponent.undrain` (the reclaim
  was withdrawn) and :meth:`SchedulerComponent.evacuate` (one adopted job: its checkpoint signal,
  a checkpoint newer than the signal waited for within the window, published, then the job
  given back to its scheduler, which runs it again elsewhere from that checkpoint).

It acts, it decides nothing: the decisions are :mod:`laminar.policy.sched_reclaim`. A scheduler
that refuses or does not answer costs an event (kind ``sched``) and a log line; the reclaim goes
on (at the window's end the kill-switch, armed by the reclaim for every active job, cuts what
still runs, and the job is stopped there as any other).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..policy import sched_reclaim as sr
from ..tasks import cancel_until_done, unless_set
from . import kubernetes, slurm
from .backend import Backend, BackendError

if TYPE_CHECKING:
    from ..components import SchedAgent
    from ..runtime.record import Job

log = logging.getLogger("laminar.sched")

# What an evacuation keeps of the window for the give-back itself (a scheduler command: Slurm's
# default [slurm] timeout_s of 10 s, and a margin): the checkpoint wait ends this long before the
# window does, or, in a shorter window, a share of it (sched_reclaim.ckpt_wait_s).
GIVE_BACK_RESERVE_S = 12.0


def config_fields() -> dict[str, Any]:
    """The ``[schedulers]`` config section."""
    from laminar.config import Field, _range

    return {
        "tick_s": Field((int, float), 5.0, "how often each scheduler's backend runs its round and adopted jobs' new "
                        "checkpoints are published to their scheduler", _range(0.05, 3600)),
    }


def _register() -> None:
    from laminar.config import register_section

    register_section("schedulers", config_fields())


_register()


# The backends, in the order they are built and called: scheduler -> its module's ``build``
# (``build(agent, newest) -> Backend``; the module registers its config section, whose
# ``enabled`` key turns it on). Imported with this module, so their sections are known before
# the config is read (laminar.agent.import_components).
BACKENDS: dict[str, Callable[[SchedAgent, Callable[[Job], str | None]], Backend]] = {
    "slurm": slurm.build,
    "kubernetes": kubernetes.build,
}


def build_backends(agent: SchedAgent, newest: Callable[[Job], str | None]) -> list[Backend]:
    """The backends the config enables (``[<scheduler>] enabled``), in BACKENDS' order. Raises
    BackendError (a bad ``[slurm] node_name``: the agent does not start)."""
    return [build(agent, newest) for name, build in BACKENDS.items() if agent.config.section(name)["enabled"]]


class SchedulerComponent:
    """The agent's schedulers (the module's docs). ``backends``: given by a test (stand-ins);
    None: built from the config at start."""

    agent_attr = "schedulers"
    status_key = "schedulers"

    def __init__(self, backends: list[Backend] | None = None) -> None:
        self._given = backends
        self.backends: list[Backend] = []
        self._agent: SchedAgent | None = None
        self._loop_task: asyncio.Task[Any] | None = None
        self._drain_task: asyncio.Task[Any] | None = None
        self._lane: Any = None  # the checkpoint check lane (laminar.offloop.Lane), made at the first evacuation
        self.published: dict[str, float] = {}  # job id -> the checkpoint time its scheduler was last told
        self._publish_failed: dict[str, str] = {}  # job id -> the last publish error (an event once per change)
        self.drained: dict[str, str] = {}  # scheduler -> the reason it was drained with (this reclaim)
        self.counts = {"published": 0, "publish_failed": 0, "drained": 0, "undrained": 0, "given_back": 0,
                       "give_back_failed": 0, "ckpt_new": 0, "ckpt_none": 0, "withdrawn": 0}

    @property
    def agent(self) -> SchedAgent:
        if self._agent is None:
            raise RuntimeError("schedulers: not started")
        return self._agent

    async def start(self, agent: SchedAgent) -> None:
        self._agent = agent
        self.backends = list(self._given) if self._given is not None else build_backends(agent, self.newest_path)
        if self.backends:
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
            self._emit(f"acting through {', '.join(str(b.scheduler) for b in self.backends)}",
                       schedulers=[str(b.scheduler) for b in self.backends])

    async def stop(self) -> None:
        await cancel_until_done([t for t in (self._loop_task, self._drain_task) if t is not None])
        self._loop_task = None

    def _emit(self, message: str, **fields: Any) -> None:
        with contextlib.suppress(Exception):
            self.agent.events.emit("sched", message, **fields)

    # -- the round -----------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(float(self.agent.config.section("schedulers")["tick_s"]))

    async def tick(self) -> None:
        """One round: each backend's ``tick``, then the new checkpoints published. Raises nothing."""
        for b in self.backends:
            try:
                await b.tick()
            except Exception as e:
                log.warning("sched: %s: its round failed: %s", b.scheduler, e)
        await self.publish_new()

    def backend_for(self, job: Job) -> Backend | None:
        """The backend of the scheduler ``job`` was adopted from (None: not adopted, or from a
        scheduler not enabled here)."""
        s = job.origin.scheduler
        if not s:
            return None
        for b in self.backends:
            if b.scheduler == s:
                return b
        return None

    def handles(self, job: Job) -> bool:
        """Whether an owner's reclaim gives ``job`` back to its scheduler (:meth:`evacuate`)
        rather than moving it to another Laminar node."""
        return self.backend_for(job) is not None

    @staticmethod
    def newest_path(job: Job) -> str | None:
        """The path of ``job``'s newest verified checkpoint as last checked (no I/O), None
        while none verified."""
        verified = job.verified_checkpoint()
        return None if verified is None else verified[0]

    async def publish_new(self) -> None:
        """Tells each adopted job's scheduler its last checkpoint where it changed since it was
        told (one call per job and change). Raises nothing: a failure is an event, once per
        different error and job."""
        jobs = self.agent.jobs
        if jobs is None or not self.backends:
            return
        live = set()
        for job in jobs.active():
            b = self.backend_for(job)
            if b is None:
                continue
            live.add(job.id)
            verified = job.verified_checkpoint()
            t = None if verified is None else verified[1]
            if not sr.should_publish(self.published.get(job.id), t):
                continue
            assert t is not None
            await self._publish(b, job, t)
        for jid in set(self.published) - live:
            self.published.pop(jid, None)
            self._publish_failed.pop(jid, None)

    async def _publish(self, b: Backend, job: Job, t: float) -> bool:
        try:
            await b.publish(job, t)
        except BackendError as e:
            self.counts["publish_failed"] += 1
            if self._publish_failed.get(job.id) != str(e):
                self._publish_failed[job.id] = str(e)
                self._emit(f"job {job.id}: its last checkpoint not published to {b.scheduler}: {e}", job=job.id,
                           scheduler=str(b.scheduler), outcome="publish-failed")
            return False
        self.published[job.id] = t
        self._publish_failed.pop(job.id, None)
        self.counts["published"] += 1
        return True

    # -- the reclaim ---------------------------------------------------------------------------

    def start_drain(self, reason: str) -> None:
        """A reclaim begins: drains this node in every scheduler, in a task of its own (the
        reclaim's start does not wait; :meth:`evacuate` waits for it before it gives a job back,
        so the job is not placed here again). Idempotent."""
        if not self.backends:
            return
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.get_running_loop().create_task(self.drain(reason))

    async def drain(self, reason: str) -> None:
        """Drains this node in every scheduler (``reason``: the reclaim's). Raises nothing: a
        scheduler that refuses is an event."""
        for b in self.backends:
            try:
                await b.drain(reason)
            except BackendError as e:
                self._emit(f"node not drained in {b.scheduler}: {e}", scheduler=str(b.scheduler), outcome="drain-failed")
                continue
            self.drained[str(b.scheduler)] = reason
            self.counts["drained"] += 1
            self._emit(f"node drained in {b.scheduler} ({reason})", scheduler=str(b.scheduler), outcome="drained",
                       reason=reason)

    async def undrain(self, reason: str) -> None:
        """The reclaim was withdrawn: this node takes work from its schedulers again (a backend
        resumes only what it drained itself). Raises nothing."""
        if self._drain_task is not None and not self._drain_task.done():
            with contextlib.suppress(Exception):
                await self._drain_task
        for b in self.backends:
            try:
                await b.undrain(reason)
            except BackendError as e:
                self._emit(f"node not resumed in {b.scheduler}: {e}", scheduler=str(b.scheduler),
                           outcome="undrain-failed")
                continue
            self.drained.pop(str(b.scheduler), None)
            self.counts["undrained"] += 1
            self._emit(f"node resumed in {b.scheduler} ({reason})", scheduler=str(b.scheduler), outcome="undrained",
                       reason=reason)

    def _lane_of(self) -> Any:
        if self._lane is None:
            from ..migrate import ckpt_driver
            from ..offloop import Lane

            self._lane = Lane("sched-ckpt-verify", workers=2, timeout_s=ckpt_driver.VERIFY_TIMEOUT_S)
        return self._lane

    async def evacuate(self, job: Job, deadline_mono: float, cancel: asyncio.Event | None = None) -> dict[str, Any]:
        """An owner's reclaim of this node gives ``job`` back to its scheduler: its checkpoint
        signal (``jobs.request_checkpoint``), a verified checkpoint newer than the signal
        waited for until the give-back must begin (:func:`sched_reclaim.ckpt_wait_s`), its time
        published, then the job given back (Slurm: requeued; it resumes elsewhere from the
        newest verified checkpoint in its shared checkpoint directory). Without a new one it is
        given back with the one it had (or none). ``cancel`` set (the reclaim withdrawn) before
        the give-back begins: the job is not given back and runs on here. Returns what was done
        (also an event); raises nothing."""
        from ..migrate import ckpt_driver

        b = self.backend_for(job)
        jobs = self.agent.jobs
        if b is None or jobs is None:
            return {"job": job.id, "outcome": "not-adopted"}
        sched = str(b.scheduler)
        scan = jobs.ckpt_scan
        listing = await scan.refresh(job) if job.ckpt_dir else None
        after = listing.paths()[-1] if listing is not None and listing.ckpts else None
        signalled = jobs.request_checkpoint(job)
        wait_s = sr.ckpt_wait_s(time.monotonic(), deadline_mono, GIVE_BACK_RESERVE_S) if signalled else 0.0
        self._emit(f"job {job.id} ({sched} {job.origin.scheduler_ref}): "
                   + (f"checkpoint asked; waiting up to {wait_s:.1f} s" if signalled
                      else "it does not catch its checkpoint signal: given back with the checkpoint it has"),
                   job=job.id, scheduler=sched, outcome="checkpoint-asked" if signalled else "no-signal")
        new: Path | None = None
        if signalled and job.ckpt_dir:
            # bounded as a whole: a check (in its lane) must not hold the give-back past the window
            with contextlib.suppress(TimeoutError):
                new = await unless_set(cancel, asyncio.wait_for(ckpt_driver.wait_new_checkpoint(
                    job.ckpt_dir, after, wait_s, lambda: bool(job.active), job=job, scanner=scan, lane=self._lane_of()),
                    max(1.0, wait_s + 1.0)))
        if cancel is not None and cancel.is_set():
            return self._withdrawn(job, sched)
        ckpt: Path | None = new
        if new is not None:
            self.counts["ckpt_new"] += 1
            now = time.time()
            job.ckpt_verified = (str(new), now)  # checked just now, by wait_new_checkpoint (the driver's next check agrees)
            await self._publish(b, job, now)
        else:
            self.counts["ckpt_none"] += 1
            if job.ckpt_dir:  # the newest of those it has that passes its check (none waited for)
                with contextlib.suppress(TimeoutError):
                    ckpt = await asyncio.wait_for(ckpt_driver.wait_new_checkpoint(
                        job.ckpt_dir, None, 0.0, lambda: True, job=job, scanner=scan, lane=self._lane_of()),
                        max(1.0, sr.ckpt_wait_s(time.monotonic(), deadline_mono, GIVE_BACK_RESERVE_S)))
        if self._drain_task is not None and not self._drain_task.done():  # not placed here again
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(self._drain_task), max(0.0, deadline_mono - time.monotonic()))
        if cancel is not None and cancel.is_set():  # (withdrawn while the drain was awaited)
            return self._withdrawn(job, sched)
        try:
            done = await b.give_back(job, None if ckpt is None else str(ckpt), deadline_mono)
        except BackendError as e:
            self.counts["give_back_failed"] += 1
            self._emit(f"job {job.id} not given back to {sched}: {e}; the window's end stops it here", job=job.id,
                       scheduler=sched, outcome="give-back-failed")
            return {"job": job.id, "outcome": "give-back-failed", "error": str(e),
                    "checkpoint": None if ckpt is None else str(ckpt)}
        self.counts["given_back"] += 1
        self._emit(f"job {job.id}: {done}", job=job.id, scheduler=sched, outcome="given-back",
                   checkpoint=None if ckpt is None else str(ckpt), new_checkpoint=new is not None)
        return {"job": job.id, "outcome": "given-back", "checkpoint": None if ckpt is None else str(ckpt),
                "new_checkpoint": new is not None, "done": done}

    def _withdrawn(self, job: Job, sched: str) -> dict[str, Any]:
        self.counts["withdrawn"] += 1
        self._emit(f"job {job.id} ({sched} {job.origin.scheduler_ref}): the reclaim was withdrawn before the job was "
                   "given back: it runs on here", job=job.id, scheduler=sched, outcome="withdrawn")
        return {"job": job.id, "outcome": "withdrawn"}

    def status(self) -> dict[str, Any]:
        return {"schedulers": [str(b.scheduler) for b in self.backends], "drained": dict(self.drained),
                "counts": dict(self.counts),
                "backends": {str(b.scheduler): (b.status() if hasattr(b, "status") else {}) for b in self.backends}}


__all__ = ["BACKENDS", "GIVE_BACK_RESERVE_S", "SchedulerComponent", "build_backends", "config_fields"]
