"""Two writers of the kill-switch maps at once: no writer may clear a switch another one set.

The data plane is real: netguard loaded and attached to a veth in a namespace by the stand-in of
test_killswitch_dataplane, its maps pinned; the test opens the pinned ``lm_flows``/``lm_jobs``.
The transfer registry is the real one with a real HTB tree on the same veth.
(``lm_jobs``: test_killswitch_race_jobs.)

One thread does what the registry's thread does (``_write_flow``: read the flow's entry, set its
class, write it back; ``register_job`` for ``lm_jobs``) as fast as it can while the test's thread
(the event loop's part: ``laminarctl net kill-flow … on``, ``killswitch on --job``) sets the kill
bit; after each set, once the other writer has written twice more, the bit must still be set.
Before the fix the read-modify-write of one writer overwrote the other's bit within a few
hundred rounds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from flowrig import flow_entry, shaped_registry
from test_killswitch_dataplane import DataPlane

from laminar.bpf import abi
from laminar.net import killswitch as ks
from laminar.net.transfers import TransferRegistry

pytestmark = pytest.mark.kernel
ROUNDS = 2000


class Hammer:
    """Calls ``fn`` in a loop on its own thread; ``wait_writes(n)`` waits until n more calls ended."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.count = 0
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.fn()
                with self.cond:
                    self.count += 1
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            with self.cond:
                self.cond.notify_all()

    def __enter__(self) -> Hammer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def wait_writes(self, n: int = 2) -> None:
        with self.cond:
            target = self.count + n
            assert self.cond.wait_for(lambda: self.count >= target or self.error is not None, 10), "hammer stuck"
        if self.error is not None:
            raise self.error


@pytest.fixture
def shaped(veth_pair) -> Iterator[tuple[Any, DataPlane, TransferRegistry]]:  # type: ignore[no-untyped-def]
    with shaped_registry(veth_pair, "ksrace") as (dp, reg):
        yield veth_pair, dp, reg


def test_kill_flow_on_survives_the_registry_rewriting_the_entry(shaped) -> None:  # type: ignore[no-untyped-def]
    vp, _dp, reg = shaped
    key = ks.FlowKey("tcp", vp.addr_a, 40311, vp.addr_b, 7311)
    t = reg.add("job-1", 1, key, 10_000_000, 600, transfer_id="ckpt-race")
    lost = 0
    with Hammer(lambda: reg._write_flow(t)) as h:
        for _ in range(ROUNDS):
            reg.flow_switch("ckpt-race", {"action": "on"})
            h.wait_writes(2)
            e = flow_entry(reg, key)
            assert e is not None and e.priority, "the transfer's entry lost its class"
            if not e.flags & abi.LM_FLOW_KILL:
                lost += 1
                continue
            reg.flow_switch("ckpt-race", {"action": "off"})
            h.wait_writes(2)
            e = flow_entry(reg, key)
            assert e is not None and not e.flags & abi.LM_FLOW_KILL
    assert lost == 0, f"the kill bit was overwritten by the registry's write in {lost} of {ROUNDS} rounds"


def test_arm_survives_the_registry_rewriting_the_entry(shaped) -> None:  # type: ignore[no-untyped-def]
    vp, _dp, reg = shaped
    key = ks.FlowKey("tcp", vp.addr_a, 40312, vp.addr_b, 7312)
    t = reg.add("job-1", 1, key, 10_000_000, 600, transfer_id="ckpt-arm")
    lost = 0
    with Hammer(lambda: reg._write_flow(t)) as h:
        for _ in range(ROUNDS):
            reg.flow_switch("ckpt-arm", {"action": "arm", "at_s": 300})
            h.wait_writes(2)
            e = flow_entry(reg, key)
            assert e is not None
            if not (e.flags & abi.LM_FLOW_ARMED and e.kill_at_ns):
                lost += 1
                continue
            reg.flow_switch("ckpt-arm", {"action": "off"})
            h.wait_writes(2)
    assert lost == 0, f"the armed deadline was overwritten in {lost} of {ROUNDS} rounds"


def test_adhoc_off_does_not_delete_a_transfer_entry_written_meanwhile(shaped) -> None:  # type: ignore[no-untyped-def]
    """``kill-flow <5-tuple> off`` deletes an entry that only held the switch; the registry writing
    the same 5-tuple's class at that moment must not lose its entry (the flow would go unshaped).
    (The window is a few microseconds: this test did not catch it before the fix in 2 runs of 2000
    rounds; it guards the lock that now covers the 'off' and its delete.)"""
    vp, _dp, reg = shaped
    key = ks.FlowKey("tcp", vp.addr_a, 40313, vp.addr_b, 7313)
    t = reg.add("job-1", 1, key, 10_000_000, 600, transfer_id="ckpt-adhoc")
    del reg.transfers[t.id]  # as while add() runs: its entry is written before the dict knows it
    lost = 0
    with Hammer(lambda: reg._write_flow(t)) as h:
        for _ in range(ROUNDS):
            reg.flow_switch(str(key), {"action": "on"})
            reg.flow_switch(str(key), {"action": "off"})
            h.wait_writes(2)
            e = flow_entry(reg, key)
            if e is None or not e.priority:
                lost += 1
    reg.transfers[t.id] = t
    assert lost == 0, f"the transfer's entry (its class) was lost to a concurrent 'off' in {lost} of {ROUNDS} rounds"


def test_a_cut_outlives_the_transfer_that_ends(shaped) -> None:  # type: ignore[no-untyped-def]
    """A transfer removed (its sender says done, or the migration gives up) while its flow is cut or
    armed: the switch stays, without a class, until ``kill-flow … off`` (which then deletes the
    entry) or until its expiry (``shaping.flow_cut_linger_s``, 900 s by default:
    test_flow_cut_expiry); an uncut transfer's entry is deleted with it."""
    vp, _dp, reg = shaped
    cut = ks.FlowKey("tcp", vp.addr_a, 40314, vp.addr_b, 7314)
    armed = ks.FlowKey("tcp", vp.addr_a, 40315, vp.addr_b, 7315)
    plain = ks.FlowKey("tcp", vp.addr_a, 40316, vp.addr_b, 7316)
    for tid, key in (("ckpt-cut", cut), ("ckpt-armed", armed), ("ckpt-plain", plain)):
        reg.add("job-1", 1, key, 10_000_000, 600, transfer_id=tid)
    reg.flow_switch("ckpt-cut", {"action": "on"})
    reg.flow_switch("ckpt-armed", {"action": "arm", "at_s": 60})
    for tid in ("ckpt-cut", "ckpt-armed", "ckpt-plain"):
        reg.remove(tid)
    e = flow_entry(reg, cut)
    assert e is not None and e.flags & abi.LM_FLOW_KILL and e.priority == 0
    e = flow_entry(reg, armed)
    assert e is not None and e.flags & abi.LM_FLOW_ARMED and e.kill_at_ns and e.priority == 0
    assert flow_entry(reg, plain) is None
    res = reg.flow_switch(str(cut), {"action": "off"})
    assert res["entry_removed"] and flow_entry(reg, cut) is None
    reg.flow_switch(str(armed), {"action": "off"})
    assert flow_entry(reg, armed) is None
