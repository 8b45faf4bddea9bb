"""The errors of the migrate component (:mod:`laminar.migrate.reclaim` and its parts)."""

from __future__ import annotations


class MigrateError(Exception):
    """A move that cannot go on; the message says why."""


class HandoverSettled(MigrateError):
    """A hand-over an operator settled as not taken by its node (``laminarctl job settle
    --run-here``): the move ends here, it is not tried on another node."""


class ReplicaRefused(MigrateError):
    """An operator's drop of a key's replicas that is refused now (the message says why and what to do)."""
