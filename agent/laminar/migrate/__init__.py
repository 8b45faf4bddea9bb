"""Reclaim-aware migration: hazard model, checkpoint schedule, destination choice, transfer.

Policy (pure, shared by the agent and the simulator): :mod:`.hazard`, :mod:`.ckpt_schedule`,
:mod:`.destination`. Mechanism: :mod:`.transfer` (agent-to-agent checkpoint transfer over TCP)
and :mod:`.reclaim` (the reclaim contract component of the agent).
"""
