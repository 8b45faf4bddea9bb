"""Multi-node jobs, pure: the states of a job's members and of the job itself, the one table of
the job's legal moves, and what the job's origin does when one of its members ends
(:func:`on_member_end`). Shared by the agent (:mod:`laminar.members.component`) and the
simulator.

A *multi-node job* has one id and ``workers`` members, one per node; member 0's node hosts the
rendezvous endpoint. Its *origin* (the node it was submitted on) keeps its record and decides.
The job is *rigid* (``workers_min == workers_max``: all members or none) or *elastic* (it goes
on while at least ``workers_min`` members live; TorchElastic re-forms the group).

The decision when member ``i`` ends in ``state``:

- every member ``exited`` (code 0): the job ended ok;
- ``exited`` while others still live: nothing to do yet (the others finish on their own);
- ``failed`` or ``lost``, member 0 (the rendezvous host): the endpoint is gone, so restart;
- ``failed`` or ``lost``, elastic, live members still ``>= workers_min``: continue (resizing);
- ``failed`` or ``lost`` otherwise: restart from the last verified checkpoint, up to
  ``max_restarts``; past it the job ended failed;
- ``stopped`` (someone stopped the member on its node): the job ends (a member stopped on
  purpose is not a failure to repair);
- an elastic job whose last live member ended with at least one ``exited``: ended ok.

>>> v = JobView(workers=3, workers_min=3, workers_max=3, members=(MemberState.RUNNING,) * 3)
>>> on_member_end(v, 1, MemberState.FAILED).action
<Action.RESTART: 'restart'>
>>> step(MultiState.RUNNING, Event.RESTART)
(<MultiState.RESTARTING: 'restarting'>, (<Effect.STOP_MEMBERS: 'stop-members'>,))
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, replace

from laminar.policy import machine

WORKERS_MAX = 64
"""The most members a job may have (and so the most a peer's message may name)."""
MAX_RESTARTS = 3
"""Restarts of the whole job after which a failing rigid job ends failed."""


class MemberState(enum.StrEnum):
    """A member's state: the value is what ``multinode_members.state`` stores."""

    STARTING = "starting"
    """Handed over (or relaunched); its local job has not reported running yet."""
    RUNNING = "running"
    EXITED = "exited"
    """Its local job exited with code 0."""
    FAILED = "failed"
    """Its local job exited non-zero, was killed, or could not start."""
    LOST = "lost"
    """Its node left the zone without notice (the zone's liveness says it is dead)."""
    STOPPED = "stopped"
    """Stopped: by the origin's order (the job's stop or restart), or on its node."""


LIVE = frozenset({MemberState.STARTING, MemberState.RUNNING})

# A member's state in one letter: the origin's periodic view tells every member's node the
# states of all members in one string (64 members fit a datagram with room to spare).
STATE_LETTERS: dict[MemberState, str] = {MemberState.STARTING: "s", MemberState.RUNNING: "r",
                                         MemberState.EXITED: "e", MemberState.FAILED: "f",
                                         MemberState.LOST: "l", MemberState.STOPPED: "x"}
_LETTER_STATES = {v: k for k, v in STATE_LETTERS.items()}


def states_text(states: tuple[MemberState, ...] | list[MemberState]) -> str:
    """``states`` as one letter each (:data:`STATE_LETTERS`)."""
    return "".join(STATE_LETTERS[MemberState(s)] for s in states)


def states_of(text: object, count: int) -> tuple[MemberState, ...] | None:
    """The member states a view's letters say, or None unless ``text`` is exactly ``count``
    known letters (a peer's word: checked before anything reads it)."""
    if not isinstance(text, str) or len(text) != count or any(c not in _LETTER_STATES for c in text):
        return None
    return tuple(_LETTER_STATES[c] for c in text)
ENDED = frozenset(set(MemberState) - LIVE)


class MultiState(enum.StrEnum):
    """A multi-node job's state: the value is what ``multinode_jobs.state`` stores."""

    PLACING = "placing"
    """Submitted: the gang is being placed."""
    STARTING = "starting"
    """Placed (or relaunched): waiting for every member to report running."""
    RUNNING = "running"
    RESIZING = "resizing"
    """An elastic job lost members and goes on with fewer: until the survivors report running."""
    RESTARTING = "restarting"
    """The members are being stopped and relaunched with the next generation."""
    ENDED = "ended"
    """Ended: ``end_reason`` says why (``ok``, ``failed: ...``, ``stopped``, ``not placed: ...``)."""


class Event(enum.StrEnum):
    """What moves a multi-node job."""

    PLACED = "placed"
    """The gang placement handed every member over."""
    ALL_RUNNING = "all-running"
    """Every live member of the current generation reports running."""
    SHRINK = "shrink"
    """An elastic job's member failed or was lost and enough members live: it goes on."""
    RESTART = "restart"
    """A member failed (rigid, member 0, or too few left): stop the others and relaunch."""
    RELAUNCHED = "relaunched"
    """Every member was relaunched with the next generation."""
    END = "end"
    """The job ended: every member exited, too many restarts, a stop, a placement that failed."""


class Effect(enum.StrEnum):
    """What the origin does besides writing the state."""

    UNCHANGED = "unchanged"
    """Nothing is written: the event does not apply to a job in this state (a late report)."""
    STOP_MEMBERS = "stop-members"
    """ORDER stop to every live member."""
    RELAUNCH = "relaunch"
    """Relaunch every member with the next generation."""


class IllegalTransition(machine.Refused):
    """An event the table does not allow in a multi-node job's state."""

    record = "multi-node job"
    noun = "state"


S, E, F = MultiState, Event, Effect
NOT_ENDED = tuple(s for s in S if s is not S.ENDED)


def _table() -> machine.Table[MultiState, Event, Effect]:
    b: machine.Builder[MultiState, Event, Effect] = machine.Builder()
    put = b.put
    put([S.PLACING], E.PLACED, S.STARTING)
    put([s for s in S if s is not S.PLACING], E.PLACED, None, F.UNCHANGED)
    put([S.STARTING, S.RESIZING], E.ALL_RUNNING, S.RUNNING)
    put([S.PLACING, S.RUNNING, S.RESTARTING, S.ENDED], E.ALL_RUNNING, None, F.UNCHANGED)
    put([S.STARTING, S.RUNNING, S.RESIZING], E.SHRINK, S.RESIZING)
    put([S.PLACING, S.RESTARTING, S.ENDED], E.SHRINK, None, F.UNCHANGED)
    put([S.STARTING, S.RUNNING, S.RESIZING], E.RESTART, S.RESTARTING, F.STOP_MEMBERS)
    put([S.PLACING, S.RESTARTING, S.ENDED], E.RESTART, None, F.UNCHANGED)
    put([S.RESTARTING], E.RELAUNCHED, S.STARTING, F.RELAUNCH)
    put([s for s in S if s is not S.RESTARTING], E.RELAUNCHED, None, F.UNCHANGED)
    put(NOT_ENDED, E.END, S.ENDED, F.STOP_MEMBERS)
    put([S.ENDED], E.END, None, F.UNCHANGED)
    return b.table


TRANSITIONS: machine.Table[MultiState, Event, Effect] = _table()
"""(state, event) -> (new state, effects): every move of a multi-node job."""


def step(state: MultiState | str, event: Event | str) -> tuple[MultiState, tuple[Effect, ...]]:
    """Where ``event`` takes a job in ``state`` and what the origin does besides writing it.
    Raises IllegalTransition when the table does not allow it, ValueError for a state or event
    that is not one. (The table is total: every (state, event) has an entry.)"""
    return machine.step(TRANSITIONS, MultiState(state), Event(event), IllegalTransition)


def writes(state: MultiState | str, event: Event | str) -> bool:
    """Whether ``event`` changes a job in ``state`` (a move that is not UNCHANGED)."""
    return F.UNCHANGED not in step(state, event)[1]


def mermaid() -> str:
    """The state diagram (``stateDiagram-v2``) of the moves that write."""
    return machine.mermaid(TRANSITIONS, MultiState, MultiState.PLACING, Effect.UNCHANGED)


# -- the decision when a member ends ------------------------------------------------------------


class Action(enum.StrEnum):
    CONTINUE = "continue"
    """Nothing to repair: the job goes on (with fewer members when one ended)."""
    RESTART = "restart"
    """Stop the live members, relaunch every member with the next generation."""
    END_OK = "end-ok"
    END_FAILED = "end-failed"


@dataclass(frozen=True)
class JobView:
    """What the decision reads of a job: its bounds, its members' states (by index) and the
    restarts it had."""

    workers: int
    workers_min: int
    workers_max: int
    members: tuple[MemberState, ...]
    restarts: int = 0
    max_restarts: int = MAX_RESTARTS

    @property
    def elastic(self) -> bool:
        return self.workers_min < self.workers_max

    @property
    def live(self) -> int:
        return sum(1 for m in self.members if m in LIVE)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    shrink: bool = False
    """CONTINUE because a member failed or was lost (the job is resizing), not because one exited."""


def on_member_end(view: JobView, index: int, state: MemberState | str, airlock_kill: bool = False) -> Decision:
    """What the origin does when member ``index`` of the job ``view`` reports ``state`` (the
    view's own entry for it is replaced first). A state that is not an end (starting,
    running) answers CONTINUE. ``airlock_kill``: the member was killed by its node's Airlock
    (memory pressure): a rigid job ends (restarting it would put the same pressure back on
    that node), an elastic one loses that member as for any failure. Raises ValueError for
    an index out of range or a state that is not one."""
    state = MemberState(state)
    if not 0 <= index < len(view.members):
        raise ValueError(f"member {index}: the job has members 0..{len(view.members) - 1}")
    members = view.members[:index] + (state,) + view.members[index + 1:]
    v = replace(view, members=members)
    if state in LIVE:
        return Decision(Action.CONTINUE, f"member {index} is {state.value}")
    if all(m is MemberState.EXITED for m in members):
        return Decision(Action.END_OK, "ok")
    if state is MemberState.STOPPED:
        return Decision(Action.END_FAILED, f"member {index} was stopped on its node")
    if state is MemberState.EXITED:
        if v.live:
            return Decision(Action.CONTINUE, f"member {index} exited 0; {v.live} member(s) still run")
        if v.elastic and MemberState.EXITED in members:
            done = sum(1 for m in members if m is MemberState.EXITED)
            return Decision(Action.END_OK, f"ok with {done} of {v.workers} members")
        return _restart_or_end(v, f"member {index} exited 0 after the others failed")
    # failed or lost
    why = f"member {index} {state.value}"
    if airlock_kill and not v.elastic:
        return Decision(Action.END_FAILED, f"failed: member {index} killed by Airlock on its node (memory pressure)")
    if airlock_kill:
        why = f"member {index} killed by Airlock"
    if index == 0:
        return _restart_or_end(v, f"{why} (the rendezvous host)")
    if v.elastic and v.live >= v.workers_min:
        return Decision(Action.CONTINUE, f"{why}; {v.live} member(s) go on (min {v.workers_min})", shrink=True)
    if v.elastic:
        return _restart_or_end(v, f"{why}; {v.live} member(s) left, fewer than min {v.workers_min}")
    return _restart_or_end(v, why)


def _restart_or_end(v: JobView, why: str) -> Decision:
    if v.restarts >= v.max_restarts:
        return Decision(Action.END_FAILED, f"failed: {why}, after {v.restarts} restart(s) (at most {v.max_restarts})")
    return Decision(Action.RESTART, f"{why}: restart {v.restarts + 1} of at most {v.max_restarts}")


if __name__ == "__main__":
    raise SystemExit(machine.main(sys.argv[1:], "laminar.policy.members", mermaid))
