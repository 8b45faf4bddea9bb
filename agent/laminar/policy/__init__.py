"""Laminar's policy: the decisions, as pure functions and data, shared by the agent and the simulator.

Nothing here does I/O: no subprocess, socket, SQLite, cffi/ctypes, asyncio or file system, and
no import of the agent's mechanism (store, API, BPF, runtime, cgroups, transports). Every
function takes the facts it decides on (sizes, rates, clocks, what a peer said) as arguments;
the agent's components gather those facts and act on the answers, and the simulator
(:mod:`laminar.sim`) calls the same functions with simulated facts.
``tests/unit/test_policy_boundary.py`` fails when a module here imports mechanism, or when the
simulator's import closure reaches a module that does.

- :mod:`.placement`: fit, arbitration, zone choice, probing, late binding, retries.
- :mod:`.packing`: fragmentation-aware GPU packing (FGD); :mod:`.mixlearn`: learning the shape mix.
- :mod:`.loaning`: which loaned servers to return (Aryl's server preemption cost);
  :mod:`.elastic`: giving freed GPUs to elastic jobs (multiple-choice knapsack).
- :mod:`.hazard`: the departure hazard per provider; :mod:`.notice`: the odds that a departure
  comes without notice.
- :mod:`.ckpt_schedule`: checkpoint intervals under the hazard and the shared uplink.
- :mod:`.prestage`: whether a job's checkpoints are shipped off its node as they are written.
- :mod:`.destination`: where a job moves; :mod:`.keeper`: which peer holds a job's copy.
- :mod:`.ladder`: Airlock's survival ladder; :mod:`.admission`: admission by class capacity.
- :mod:`.shaper`: the rates of migration traffic at the node's edge.
"""
