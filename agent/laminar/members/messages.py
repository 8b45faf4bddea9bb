"""Member messages: the request/answer plumbing of :class:`laminar.members.component.MembersComponent`
(:class:`Messages`, its ``messages``).

Messages are the zone's MEMBER_REQUEST / MEMBER_ANSWER (op 1 report, 2 order, 3 view), sent like
the loan layer's: retransmitted with the same id, answers cached by (sender, id). Everything
a message says was stored before it is sent, and a report or order repeated (after a restart of
either side) changes nothing the second time. A message's JSON is at most ``PAYLOAD_MAX`` bytes
(one datagram), a checkpoint path in it at most ``PATH_MAX``.

:class:`Messages` is built with the component (what it uses of it: :class:`MessagesHost`) and
holds the requests awaiting their answer and the answers cached; it has no round.
:meth:`Messages.request` sends a request (the origin's and the member side's), and
:meth:`Messages.on_message` (the component's ``on_message``, which the zone calls) answers one:
a report goes to the origin side (:meth:`laminar.members.origin.OriginSide.on_report`), an order
or a view to the member side (:meth:`laminar.members.member.MemberSide.on_order`,
:meth:`~laminar.members.member.MemberSide.on_view`).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from laminar.runtime.spec import is_multinode_id
from laminar.zone import wire

if TYPE_CHECKING:
    from laminar.components import MembersAgent

    from .member import MemberSide
    from .origin import OriginSide

OP_REPORT = 1
OP_ORDER = 2
OP_VIEW = 3
STATUS_OK = 0
STATUS_ERROR = 1
ANSWER_CACHE = 512  # answers kept for retransmitted requests, by (sender, request id)
PAYLOAD_MAX = wire.MAX_DATAGRAM - wire.HEADER_SIZE - wire.MAC_SIZE - 9  # a member message's JSON, at most
PATH_MAX = 512  # a checkpoint path in a report or an order, at most


class MemberError(ValueError):
    """A member message refused: the answer's error."""


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MemberError(f"{what} {str(v)[:40]!r}: expected an integer {lo}..{hi}")
    return v


def _job_id(v: Any) -> str:
    if not isinstance(v, str) or not is_multinode_id(v):
        raise MemberError(f"job {str(v)[:40]!r}: expected a multi-node job id (job-<num>-n<node>)")
    return v


class MessagesHost(Protocol):
    """What :class:`Messages` uses of the component that holds it (MembersComponent and its parts)."""

    agent: MembersAgent | None
    counts: dict[str, int]
    member: MemberSide
    node: int
    origin: OriginSide
    s: dict[str, Any]
    send: Callable[[int, wire.MemberRequest], None] | None


class Messages:
    """Member requests sent and answered (see the module's doc): a part of
    :class:`laminar.members.component.MembersComponent` (its ``messages``). ``host``: the component."""

    def __init__(self, host: MessagesHost) -> None:
        self.host = host
        # request id -> (the node asked, its answer's future): an answer counts only from the node asked
        self._pending: dict[int, tuple[int, asyncio.Future[tuple[int, bytes]]]] = {}
        self._answered: OrderedDict[tuple[int, int], wire.MemberAnswer] = OrderedDict()

    def on_message(self, sender: int, body: wire.MemberRequest | wire.MemberAnswer) -> wire.MemberAnswer | None:
        """A MEMBER_REQUEST from ``sender``: the answer (cached by request id, so a repeat is
        not acted on twice). A MEMBER_ANSWER: delivered to the waiting request; None."""
        if isinstance(body, wire.MemberAnswer):
            got = self._pending.get(body.request_id)
            if got is not None and got[0] == sender and not got[1].done():
                got[1].set_result((body.status, body.payload))
            return None
        key = (sender, body.request_id)
        ans = self._answered.get(key)
        if ans is not None:
            return ans
        try:
            if len(body.payload) > PAYLOAD_MAX:
                raise MemberError(f"a member message of {len(body.payload)} bytes: at most {PAYLOAD_MAX}")
            req = json.loads(body.payload or b"{}")
            if not isinstance(req, dict):
                raise MemberError("a member message is a JSON object")
            if body.op == OP_REPORT:
                out = self.host.origin.on_report(sender, req)
            elif body.op == OP_ORDER:
                out = self.host.member.on_order(sender, req)
            elif body.op == OP_VIEW:
                out = self.host.member.on_view(sender, req)
            else:
                raise MemberError(f"unknown member operation {body.op} (1 report, 2 order, 3 view)")
            ans = wire.MemberAnswer(body.request_id, STATUS_OK, _dumps(out))
        except (MemberError, ValueError, TypeError, KeyError) as e:
            self.host.counts["refused"] += 1
            ans = wire.MemberAnswer(body.request_id, STATUS_ERROR, _dumps({"error": str(e)[:400]}))
        self._answered[key] = ans
        while len(self._answered) > ANSWER_CACHE:
            self._answered.popitem(last=False)
        return ans

    async def request(self, node: int, op: int, payload: dict[str, Any]) -> dict[str, Any]:
        """Sends a member request to ``node`` (this node: handled in process) and waits for the
        answer, retransmitting (same id) within ``request_timeout_s``. Raises MemberError when
        the node does not answer or answers with an error."""
        rid = wire.new_id()
        data = _dumps(payload)
        if len(data) > PAYLOAD_MAX:
            raise MemberError(f"a member message of {len(data)} bytes: at most {PAYLOAD_MAX}")
        body = wire.MemberRequest(rid, op, data)
        zone = self.host.agent.zone if self.host.agent is not None else None
        send = self.host.send
        if send is None and zone is not None and zone.endpoint is not None and node != self.host.node:
            endpoint = zone.endpoint

            def send(n: int, b: wire.MemberRequest) -> None:
                endpoint.send(n, b)
        if node == self.host.node or send is None:
            ans = self.on_message(self.host.node, body)
            assert ans is not None
            status, raw = ans.status, ans.payload
        else:
            fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
            self._pending[rid] = (node, fut)
            timeout = float(self.host.s["request_timeout_s"])
            try:
                for _ in range(3):
                    send(node, body)
                    try:
                        status, raw = await asyncio.wait_for(asyncio.shield(fut), timeout / 3)
                        break
                    except TimeoutError:
                        continue
                else:
                    if zone is not None:
                        zone.membership.missed(node, zone.clock())
                    raise MemberError(f"node {node} did not answer within {timeout:g} s")
            finally:
                self._pending.pop(rid, None)
        out = json.loads(raw or b"{}")
        if status != STATUS_OK:
            raise MemberError(f"node {node}: {out.get('error', 'error') if isinstance(out, dict) else out}")
        return out if isinstance(out, dict) else {}
