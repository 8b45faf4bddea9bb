"""Zone coordination: probe-first, execute-later placement between agents.

- :mod:`laminar.policy.placement`: the pure placement policy (fit, arbitration, zone choice,
  probing, late binding, retries), shared by the agent and the simulators.
- :mod:`laminar.zone.wire`: the authenticated UDP datagram format (``docs/protocol.md``).
- :mod:`laminar.zone.keys`: loading the per-zone keys.
- :mod:`laminar.zone.membership`: zones, nodes and liveness from the config and traffic.
- :mod:`laminar.zone.component`: the agent component (UDP endpoint, arbitration, submitter).
- :mod:`laminar.zone.simnet`: a simulated transport (a fake: large zones cannot exist here)
  running the same policy code, for the placement benchmark.
"""
