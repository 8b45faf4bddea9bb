"""Laminar beside a scheduler (issue 34): the agent's scheduler component and its backends.

A job taken from a scheduler (Slurm, Kubernetes) is *adopted* (``laminar.runtime.adopt``);
this package is what the agent does back through that scheduler:

- :mod:`laminar.sched.backend`: the :class:`~laminar.sched.backend.Backend` protocol every
  scheduler's backend implements (drain, undrain, give back, publish, tick);
- :mod:`laminar.sched.slurm`: the Slurm backend and its ``scontrol`` client;
- :mod:`laminar.sched.kubernetes`: the Kubernetes backend (cordon, eviction, annotations);
- :mod:`laminar.sched.component`: ``SchedulerComponent`` (``agent.schedulers``), which ticks the
  enabled backends, publishes each adopted job's last checkpoint and carries out an owner's
  reclaim through the scheduler (drain the node, checkpoint, give the job back).
"""
