"""Zone coordination: probe-first, execute-later placement between agents.

- :mod:`laminar.policy.placement`: the pure placement policy (fit, arbitration, zone choice,
  probing, late binding, retries), shared by the agent and the simulators.
- :mod:`laminar.zone.wire`: the authenticated UDP datagram format (``docs/protocol.md``).
- :mod:`laminar.zone.keys`: loading the per-zone keys.
- :mod:`laminar.zone.membership`: zones, nodes and liveness from the config and traffic.
- :mod:`laminar.zone.arbiter`, :mod:`laminar.zone.submitter`: the node and submitter halves of
  placement (socket-free: the simulator runs them too).
- :mod:`laminar.zone.component`: the agent component (UDP endpoint, message dispatch,
  inventory), with its parts :mod:`laminar.zone.keyring` (key reloads, sequence floor),
  :mod:`laminar.zone.handovers` (jobs handed to this node), :mod:`laminar.zone.summaries`
  (capacity summaries), :mod:`laminar.zone.liveness` (heartbeats to suspects),
  :mod:`laminar.zone.rebind` (the listen address) and :mod:`laminar.zone.loan`; its routes are
  :mod:`laminar.zone.routes`'s and its settings are :mod:`laminar.zone.config`'s.
- :mod:`laminar.zone.simnet`: a simulated transport (a fake: large zones cannot exist here)
  running the same policy code, for the placement benchmark.
"""
