"""The contract between the scheduler component and one scheduler's backend (design-34 §3).

A backend is what the agent does *through* one scheduler: the component
(:mod:`laminar.sched.component`) calls it, never the reverse. Every call runs on the event loop
and must not block it: a backend runs its commands or HTTP requests off the loop, bounded in
time and output, and raises :class:`BackendError` (naming what it ran and what the scheduler
said) when the scheduler refuses or does not answer.

=================  =======================================  =====================================
call               Slurm (``sched/slurm.py``)                Kubernetes (``sched/kubernetes.py``)
=================  =======================================  =====================================
``drain``          ``scontrol update state=drain reason=``   cordon (node ``spec.unschedulable``)
``undrain``        ``scontrol update state=resume``          uncordon
``give_back``      ``scontrol requeue <job>``                eviction (429: a PDB holds, retry)
``publish``        job comment ``laminar-ckpt=<t> <path>``   pod annotation ``laminar.io/last-checkpoint``
``tick``           nothing                                   discover and adopt pods
=================  =======================================  =====================================

A backend's module offers ``build(agent, newest) -> Backend`` (``agent``: the scheduler
component's view of the agent, ``laminar.components.SchedAgent``; ``newest(job)``: the path of
the job's newest checkpoint as the agent last listed it, or None) and registers its config
section with an ``enabled`` key; the component lists it in
:data:`laminar.sched.component.BACKENDS` and builds it when enabled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..policy.sched import Scheduler
    from ..runtime.record import Job


class BackendError(RuntimeError):
    """A scheduler refused a call or did not answer in time; the message names the command
    (or request) and what the scheduler said."""


class Backend(Protocol):
    """One scheduler as the scheduler component acts through it (the module docs)."""

    scheduler: Scheduler

    async def drain(self, reason: str) -> None:
        """Stop the scheduler from placing new work on this node (``reason`` shown to its
        operators). Idempotent. Raises BackendError."""
        ...

    async def undrain(self, reason: str) -> None:
        """Undo :meth:`drain` (the reclaim was withdrawn). Idempotent. Raises BackendError."""
        ...

    async def give_back(self, job: Job, ckpt: str | None, deadline_mono: float | None = None) -> str:
        """Hand the adopted ``job`` back to its scheduler to run again elsewhere (``ckpt``: the
        path of the checkpoint it resumes from, None when it has none; ``deadline_mono``: the
        reclaim window's end, which retries and waits stay within). Returns a short text of what
        was done (for the event). Raises BackendError."""
        ...

    async def publish(self, job: Job, ckpt_time: float) -> None:
        """Tell the scheduler the job's last verified checkpoint (wall time ``ckpt_time``), so
        its preemption can pick the victim with the least work at risk. Raises BackendError."""
        ...

    async def tick(self) -> None:
        """One round of the backend's own work (Kubernetes: discover and adopt pods; Slurm:
        nothing). Raises nothing it can handle itself; an exception is logged by the component."""
        ...


__all__ = ["Backend", "BackendError"]
