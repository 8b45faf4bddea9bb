"""Node keys on the checkpoint transfer and its control messages (laminar.migrate.transfer, the
Receiver's ``pair_keys``; ReclaimComponent._peer and _pair_candidates): between two nodes with
node keys a connection authenticates under their pair key, as the zone's datagrams do, so a zone
member holding the zone key cannot open a transfer or send a control message (a keeper, a reclaim
notice, a release) in another node's name. Before, transfers and control messages authenticated
with the zone key alone, and only the source-address check bound the node id.

A real Receiver on loopback and real clients (send_control: a full handshake, then one MAC'd
control message); the migrate components are real, not started, with a stand-in zone that holds
the roster, the zone key and each node's real PairKeys. The address check is off (``sources``
None) to isolate the key property, as in tests/unit/test_zone_node_keys.py.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from standin_agent import standin_agent

from laminar.components import MigrateAgent
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.transfer import Receiver, TransferError, send_control
from laminar.zone.keys import PairKeys, public_key

ZK = secrets.token_bytes(32)
PRIV = {n: secrets.token_bytes(32) for n in (1, 2, 3)}
PUB = {n: public_key(k) for n, k in PRIV.items()}  # node 4 has no node key


def component(node: int, mode: str = "require") -> ReclaimComponent:
    c = ReclaimComponent()
    pairs = PairKeys(node, PRIV[node], PUB, mode=mode) if node in PRIV else None
    members = {n: SimpleNamespace(addr="127.0.0.1", zone=1) for n in (1, 2, 3, 4)}
    c.agent = standin_agent(MigrateAgent, zone=SimpleNamespace(networked=True, node_id=node, pairs=pairs, keys={1: ZK},
                                                   membership=SimpleNamespace(by_node=members)))
    c.s = {"port": 0}
    return c


def control_from(sender: int, claim: str, receiver_mode: str = "require", key: bytes | None = None,
                 tmp: Path | None = None) -> Any:
    """A control message from node ``sender`` (with the key its component picks for node 1, or
    ``key``) whose hello names node ``claim``, to node 1's Receiver: its answer, or the
    TransferError that refused it."""
    one = component(1, receiver_mode)
    got: list[tuple[str, str]] = []

    def on_control(node: str, op: str, body: Any) -> Any:
        got.append((node, op))
        return {"ok": node}

    async def main() -> Any:
        assert tmp is not None
        rcv = Receiver(tmp / f"rcv-{secrets.token_hex(3)}", ZK, on_control=on_control, pair_keys=one._pair_candidates)
        port = await rcv.start("127.0.0.1", 0)
        try:
            k = key if key is not None else component(sender)._peer(1)[2]
            return await send_control("127.0.0.1", port, k, "lm-t-op", {"x": 1}, zone=1, node=claim, timeout=5)
        except TransferError as e:
            return e
        finally:
            await rcv.stop()

    res = asyncio.run(main())
    assert got == ([] if isinstance(res, TransferError) else [(claim, "lm-t-op")])
    return res


def test_two_nodes_with_node_keys_authenticate_under_their_pair_key(tmp_path: Path) -> None:
    k21 = component(2)._peer(1)[2]
    assert k21 == PairKeys(1, PRIV[1], PUB).key(ZK, 2) != ZK
    assert control_from(2, "2", tmp=tmp_path) == {"ok": "2"}


def test_a_member_with_the_zone_key_cannot_talk_in_another_nodes_name(tmp_path: Path) -> None:
    for key in (ZK, component(3)._peer(1)[2]):  # the zone key; node 3's own pair key with node 1
        res = control_from(3, "2", key=key, tmp=tmp_path)
        assert isinstance(res, TransferError) and "failed authentication" in str(res), res  # either end finds it
    # node 3 in its own name is taken (its pair key)
    assert control_from(3, "3", tmp=tmp_path) == {"ok": "3"}


def test_a_node_without_a_node_key_keeps_the_zone_key(tmp_path: Path) -> None:
    assert component(4)._peer(1)[2] == ZK
    assert control_from(4, "4", tmp=tmp_path) == {"ok": "4"}


@pytest.mark.parametrize("mode", ["accept", "send"])
def test_during_a_roll_out_the_zone_key_is_taken_from_a_node_with_a_pubkey(tmp_path: Path, mode: str) -> None:
    # node 2 before its restart onto the roster with pubkeys signs with the zone key
    assert control_from(2, "2", receiver_mode=mode, key=ZK, tmp=tmp_path) == {"ok": "2"}
    assert control_from(2, "2", receiver_mode=mode, tmp=tmp_path) == {"ok": "2"}  # and its pair key
    # in accept, a node signs with the zone key (a peer not restarted yet checks only that)
    assert (component(2, mode)._peer(1)[2] == ZK) is (mode == "accept")
