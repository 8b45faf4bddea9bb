"""The node side of a hand-over checks a migrated job's ``resume_from`` as the job's owner: the
zone passes the placing user's uid AND gid to the migrate component's ``check_resume`` (the
check itself, run as that uid/gid/groups on real files, is tested in
tests/unit/test_replica_resume_unkept.py). Before, only the uid went, so the check took the
uid's passwd group instead of the gid the job runs with: a checkpoint readable only through the
job's gid was refused, and one readable through the passwd group but not the job's gid was
accepted and then failed to load in the job.

Real pieces: the zone component on loopback sockets (test_loan_component's rig). Stand-ins: the
job table (test_zone_handover_quota's) and the migrate component, which records what it was asked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from standin_agent import NoTakeOvers, standin_agent
from test_loan_component import make_comp, run
from test_zone_handover_quota import LimitedJobs

from laminar.components import ZoneAgent
from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import HANDOVER_OK, HANDOVER_REJECTED, demand_to_probe


class RecordingMigrate:
    """Stand-in for the migrate component: check_resume's contract (the path to resume from, or
    ValueError), recording each call's (path, uid, gid); no take-overs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int | None]] = []
        self.takeover = NoTakeOvers()

    def check_resume(self, path: str, owner_uid: int = 0, owner_gid: int | None = None) -> str:
        self.calls.append((path, owner_uid, owner_gid))
        return path


def test_a_handed_over_resume_from_is_checked_with_the_owners_uid_and_gid(tmp_path: Path) -> None:
    comp = make_comp(tmp_path, pool="training", jobs=LimitedJobs(tmp_path / "state"), gpus=2)
    assert comp._settings is not None
    comp._settings["peer_unknown_uids"] = "allow"  # uid 4242 has no account on this machine
    migrate = RecordingMigrate()

    async def check() -> None:
        comp.agent = standin_agent(ZoneAgent, migrate=migrate)
        comp.refresh_inventory()
        for pid, req in ((0x6161, {"owner_uid": 4242, "owner_gid": 5151}),  # gid given: that one
                         (0x6162, {"owner_uid": 4242})):  # none given: refused (never a default owner)
            offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 5.0))
            assert isinstance(offer, wire.Offer), offer
            body: dict[str, Any] = {"spec": {"command": ["sleep", "1"], "resume_from": f"/ckpt/{pid}"}, **req}
            ack = await comp.handovers.on_handover(2, wire.Handover(pid, json.dumps(body).encode()))
            if "owner_gid" in req:
                assert ack.status == HANDOVER_OK, ack
            else:
                assert ack.status == HANDOVER_REJECTED and "names no owner_gid" in ack.text, ack
        assert migrate.calls == [("/ckpt/24929", 4242, 5151)], migrate.calls

    run(comp, check)
