"""Two writers of ``lm_jobs`` at once: a job's kill bit set by one must survive the other.

netguard is real (the stand-in of test_killswitch_dataplane loads and attaches it on a veth in a
namespace, maps pinned); the test drives ``NetGuard`` over the pinned maps. One thread
re-registers the job (``register_job``: read the entry, set LM_JOB_LENT, write it back, as the job
manager does at start and reattachment) as fast as it can while the test's thread sets and clears
the job's switch (``killswitch on|off --job``); after each set, once the other thread has written
twice more, the bit must still be set. Before the fix it was lost a few times in 2000 rounds.
"""

from __future__ import annotations

import pytest
from test_killswitch_dataplane import start_dataplane, stop_dataplane
from test_killswitch_race_flows import ROUNDS, Hammer

from laminar.bpf import abi
from laminar.net.netguard import NetGuard

pytestmark = pytest.mark.kernel


def test_job_kill_survives_register_job_on_another_thread(veth_pair) -> None:  # type: ignore[no-untyped-def]
    dp = start_dataplane(veth_pair.a.argv(), veth_pair.ifname_a, "ksracej")
    try:
        ng = NetGuard()
        ng.maps = {name: dp.map(name) for name in abi.NETGUARD_MAPS}
        cg = 0x7A5C_0001
        ng.register_job(cg, 77)
        lost = 0
        with Hammer(lambda: ng.register_job(cg, 77, lent=True)) as h:
            for _ in range(ROUNDS):
                ng.set_job_kill(cg, True)
                h.wait_writes(2)
                j = ng.job_entry(cg)
                assert j is not None
                if not j.flags & abi.LM_JOB_KILL:
                    lost += 1
                    continue
                ng.set_job_kill(cg, False)
                h.wait_writes(2)
        assert lost == 0, f"the job's kill bit was overwritten by register_job in {lost} of {ROUNDS} rounds"
    finally:
        stop_dataplane(dp)
