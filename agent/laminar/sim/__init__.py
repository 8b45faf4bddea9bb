"""Trace-driven simulator: the same policy code as the agents, against baselines.

- :mod:`laminar.sim.trace`: readers for the Alibaba GPU trace, the Pollux workloads and the
  spot traces (bad input raises :class:`~laminar.sim.trace.TraceError` naming file and line).
- :mod:`laminar.sim.cluster`: the node model and the two placements (Laminar's probe-first
  through :mod:`laminar.policy.placement`, and centralized best-fit).
- :mod:`laminar.sim.engine`: the discrete-event simulator and the policies ``laminar``,
  ``bestfit``, ``noloan``, ``requeue``.
- :mod:`laminar.sim.allocation`: the FGD artifact's experiment (GPU allocation ratio when the
  arrived demand reaches 130% of capacity).
- :mod:`laminar.sim.cli`: ``laminarctl sim``.

See docs/simulator.md for the model, its assumptions and the metrics' definitions.
"""
