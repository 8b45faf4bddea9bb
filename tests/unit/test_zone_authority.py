"""A zone member's authority (laminar.zone.authority), decided in memory: what a peer's job may
run as here, who may speak for a job key, who may reclaim this node or return it to its pool,
and whose reservation an offer is. The real agents meet the same rules in
tests/cluster/test_member_authority.py; these pin each rule and its words."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.policy import placement as pl
from laminar.runtime.grants import Grants
from laminar.runtime.launch import JOB_TRAMPOLINE, check_owner_ids, drop_privileges_argv
from laminar.runtime.spec import JobError
from laminar.zone import authority as au
from laminar.zone import wire
from laminar.zone.component import Arbiter, demand_to_probe

USER = au.Account("lmt-user", 1000, frozenset({1000, 27}))
ACCOUNTS = {1000: USER, 0: au.Account("root", 0, frozenset({0}))}
POLICY = au.Policy(1, frozenset({2}))


def account(uid: int) -> au.Account | None:
    return ACCOUNTS.get(uid)


def run_as(req: dict, origin: int = 2, sender: int = 2, policy: au.Policy = POLICY, **kw: object) -> au.RunAs:
    return au.peer_run_as(req, policy=policy, origin=origin, sender=sender, account=account, **kw)  # type: ignore[arg-type]


def refused(req: dict, reason: str, match: str, **kw: object) -> None:
    with pytest.raises(au.Refused, match=match) as e:
        run_as(req, **kw)
    assert e.value.reason == reason


@pytest.mark.parametrize("uid", [-1, 4294967295, 2**32, "0", 1.0, True, None])
def test_an_owner_id_out_of_range_or_not_an_int_is_refused_naming_it(uid: object) -> None:
    refused({"owner_uid": uid, "owner_gid": 1000}, "bad_id", "is not a user or group id")
    refused({"owner_uid": 1000, "owner_gid": uid}, "bad_id", "is not a user or group id")


def test_a_missing_owner_is_never_root() -> None:
    refused({}, "bad_id", "names no owner_uid")
    refused({"owner_uid": 1000}, "bad_id", "names no owner_gid")


def test_root_needs_both_origin_and_sender_in_root_from() -> None:
    assert run_as({"owner_uid": 0, "owner_gid": 0}).uid == 0  # node 2 is listed
    refused({"owner_uid": 0, "owner_gid": 0}, "root", r"from node 3 \(the job.s origin\).*zone.root_from may hand root jobs here \(listed: 2\)",
            origin=3, sender=3)
    # relayed by a listed node, the origin still counts (a keeper placing node 3's job)
    refused({"owner_uid": 0, "owner_gid": 0}, "root", "node 3 .the job's origin.", origin=3, sender=2)
    # and a listed origin does not launder an unlisted sender
    refused({"owner_uid": 0, "owner_gid": 0}, "root", "node 3 .which hands it here.", origin=2, sender=3)
    # this node itself is always trusted (its own placements, a job coming home)
    assert run_as({"owner_uid": 0, "owner_gid": 0}, origin=1, sender=1, policy=au.Policy(1)).uid == 0
    refused({"owner_uid": 0, "owner_gid": 0}, "root", "listed: none", policy=au.Policy(1))


def test_a_uid_without_an_account_is_refused_unless_allowed_and_never_with_gid_0() -> None:
    refused({"owner_uid": 4242, "owner_gid": 4242}, "unknown_uid", 'zone.peer_unknown_uids = "refuse"')
    allow = au.Policy(1, unknown_uids="allow")
    assert run_as({"owner_uid": 4242, "owner_gid": 4242}, policy=allow) == au.RunAs(4242, 4242)
    refused({"owner_uid": 4242, "owner_gid": 0}, "gid", "gid 0", policy=allow)


def test_the_gid_must_be_one_of_the_uids_groups() -> None:
    assert run_as({"owner_uid": 1000, "owner_gid": 27}).gid == 27  # a supplementary group of its own
    refused({"owner_uid": 1000, "owner_gid": 0}, "gid", r"gid 0 .* is not a group of uid 1000 \(lmt-user\)")
    refused({"owner_uid": 1000, "owner_gid": 6}, "gid", "may run with one of 27")


def test_the_destinations_grants_apply_to_the_peers_uid() -> None:
    grants = Grants.from_config({"default_classes": ["standard"], "default_priority_max": 50,
                                 "grant": [{"users": [1000], "classes": ["transient"], "priority_max": 10}]})
    req = {"owner_uid": 1000, "owner_gid": 1000}
    assert run_as(req, grants=grants, job_class="standard", priority=50).uid == 1000
    refused(req, "grants", r"node 1's \[grants\] refuse .* long-resident at priority 90", grants=grants,
            job_class="long-resident", priority=90)
    # root is not bound by grants (as for a local submission)
    assert run_as({"owner_uid": 0, "owner_gid": 0}, grants=grants, job_class="long-resident", priority=99).uid == 0


def test_cpus_and_memory_are_clamped_to_the_reservation() -> None:
    got = run_as({"owner_uid": 1000, "owner_gid": 1000}, cpus=64.0, memory_mb=65536, reserved=(1.0, 256))
    assert (got.cpus, got.memory_mb) == (1.0, 256) and len(got.clamped) == 2
    same = run_as({"owner_uid": 1000, "owner_gid": 1000}, cpus=0.5, memory_mb=None, reserved=(1.0, 256))
    assert (same.cpus, same.memory_mb, same.clamped) == (0.5, None, ())


def test_the_chain_check_is_the_part_no_other_node_decides_differently() -> None:
    assert au.chain_refusal({"owner_uid": 4242, "owner_gid": 4242}, policy=POLICY, origin=3, sender=3) is None
    e = au.chain_refusal({"owner_uid": 0, "owner_gid": 0}, policy=POLICY, origin=2, sender=3)
    assert e is not None and e.reason == "root"
    e = au.chain_refusal({"owner_uid": -1, "owner_gid": 0}, policy=POLICY, origin=2, sender=2)
    assert e is not None and e.reason == "bad_id"


def test_a_job_key_belongs_to_its_node() -> None:
    assert au.key_owner("n12-job-3") == 12 and au.key_owner("n3-x") == 3
    for bad in ("job-3", "n-job", "nx-job-1", "n1-", "n1-a/b", "n1-job\n", 7):
        assert au.key_owner(bad) is None, bad  # type: ignore[arg-type]


def test_who_may_hand_a_keeper() -> None:
    g = au.keeper_refusal
    assert g(1, "n1-job-1", 1, False, None) is None  # its own node
    assert g(1, "n1-job-1", 1, False, 1, "keeping") is None  # again
    assert g(2, "n1-job-1", 1, True, None) is None  # passed on with a stopped job, no keeper here
    assert g(2, "n1-job-1", 1, False, 2, "keeping") is None  # by the node that handed it
    e = g(3, "n1-job-1", 1, False, None)
    assert e is not None and e.reason == "keeper" and "take_over" in str(e)
    e = g(3, "n1-job-1", 1, True, 1, "keeping")  # overwrite node 1's keeper: refused
    assert e is not None and e.reason == "keeper" and "node 1 handed this node that keeper" in str(e)
    e = g(3, "n1-job-1", 3, True, None)  # src_node must be the key's node
    assert e is not None and e.reason == "key"
    e = g(3, "job-1", 3, True, None)
    assert e is not None and e.reason == "key"
    # a root job passed on by a node not trusted with root: refused at once
    e = g(3, "n1-job-1", 1, True, None, root_request=True, policy=POLICY)
    assert e is not None and e.reason == "root" and "zone.root_from" in str(e)
    assert g(2, "n1-job-1", 1, True, None, root_request=True, policy=POLICY) is None
    # the key's own node hands its job where another node's take-over of it runs: elsewhere
    e = g(1, "n1-job-1", 1, False, 3, "resumed")
    assert e is not None and e.reason == "keeper" and "take-over of it handed here by node 3" in str(e)


def test_who_may_release_a_keeper_or_send_its_checkpoints() -> None:
    assert au.release_refusal(3, "n1-job-1", None) is None  # nothing kept here: nothing to refuse
    assert au.release_refusal(1, "n1-job-1", 2) is None and au.release_refusal(2, "n1-job-1", 2) is None
    e = au.release_refusal(3, "n1-job-1", 1)
    assert e is not None and e.reason == "release" and "only node 1" in str(e)
    assert au.offer_refusal(3, "n1-job-1", None) is None  # a pass-on's checkpoint comes before its keeper
    assert au.offer_refusal(1, "n1-job-1", 2) is None and au.offer_refusal(2, "n1-job-1", 2) is None
    e = au.offer_refusal(3, "n1-job-1", 1)
    assert e is not None and e.reason == "offer"
    assert au.checkpoint_senders("n1-job-1", 2) == {"1", "2"}
    assert au.checkpoint_senders("n1-job-1", None, 1) == {"1"}


def test_node_operations_come_only_from_listed_nodes() -> None:
    assert au.node_op_refusal("reclaim", 1, [], "migrate.reclaim_from", 1) is None  # its own
    assert au.node_op_refusal("reclaim", 4, [4], "migrate.reclaim_from", 1) is None
    e = au.node_op_refusal("reclaim", 3, [4], "migrate.reclaim_from", 1)
    assert e is not None and e.reason == "reclaim" and "migrate.reclaim_from" in str(e) and "listed: 4" in str(e)
    e = au.node_op_refusal("return", 3, [], "loan.return_from", 1)
    assert e is not None and e.reason == "loan_return"


def test_an_offer_answers_only_its_prober() -> None:
    a = Arbiter(pl.NodeCapacity(1, 1, cpus=8, memory_mb=8000, gpu_free=(1.0, 1.0)), hold_s=30)
    offer = a.on_probe(demand_to_probe(pl.Demand(gpus=1), 77, 5.0), 100.0, node=2)
    assert isinstance(offer, wire.Offer) and a.prober[77] == 2
    # another node cannot take, commit, release or drop it
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=1), 77, 5.0), 100.0, node=3), wire.Refuse)
    assert a.on_commit(wire.Commit(77, 1000), 100.0, node=3).status == int(pl.RefuseReason.UNKNOWN_PLACEMENT)
    a.on_release(wire.Release(77), 100.0, node=3)
    a.drop_unused([77], node=3)
    assert 77 in a.held and a.bind(77, 100.0, 3) is None
    assert a.counts["not_prober"] == 4
    # its prober can
    assert a.on_commit(wire.Commit(77, 1000), 100.0, node=2).status == 0
    placed = a.bind(77, 100.0, 2)
    assert placed is not None and placed.submitter == 2
    assert a.bind(77, 100.0, 3) is None and a.bind(77, 100.0, 2) is placed


def test_one_node_holds_at_most_max_held_per_node_offers() -> None:
    a = Arbiter(pl.NodeCapacity(1, 1, cpus=64, memory_mb=64000, gpu_free=(1.0,) * 8), max_held_per_node=2)
    got = [a.on_probe(demand_to_probe(pl.Demand(gpus=0, cpus=1), pid, 5.0), 100.0, node=3) for pid in (1, 2, 3)]
    assert [type(x) for x in got] == [wire.Offer, wire.Offer, wire.Refuse] and a.counts["held_per_node"] == 1
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=0, cpus=1), 9, 5.0), 100.0, node=2), wire.Offer)


def test_refusals_are_counted_by_reason() -> None:
    r = au.Refusals()
    r.note(au.Refused("root", "x"), 3)
    r.note(au.Refused("root", "y"), 3)
    r.note(au.Refused("offer", "z"), 4)
    d = r.as_dict()
    assert d["refused"]["root"] == 2 and d["refused"]["offer"] == 1 and d["total"] == 3
    assert d["recent"][-1]["node"] == 4 and set(d["refused"]) == set(au.REASONS)


def test_identity_warnings_name_what_weakens_it() -> None:
    assert au.identity_warnings("require", True, [], True) == []
    assert au.identity_warnings("accept", True, [], False) == []  # the one-node zone
    w = au.identity_warnings("send", True, [2, 3], True)
    assert len(w) == 2 and "node(s) 2, 3 have no pubkey" in w[0] and 'node_keys = "send"' in w[1]


@pytest.mark.parametrize("uid, gid", [(-1, 1000), (4294967295, 1000), (1000, -1), (1000, 4294967295), (True, 0)])
def test_the_job_manager_refuses_owner_ids_that_setpriv_takes_for_unchanged(uid: object, gid: object) -> None:
    with pytest.raises(JobError, match="unchanged"):
        check_owner_ids(uid, gid)
    with pytest.raises(JobError, match="unchanged"):
        drop_privileges_argv(uid, gid)  # type: ignore[arg-type]


def test_the_trampoline_refuses_to_run_as_other_ids_than_its_owners() -> None:
    """The last step before a job's command checks that the drop happened: run here as this
    process's ids it execs; told other ids (a drop that did not happen) it exits 126 naming
    both, and the command never runs."""
    r, w = os.pipe()
    os.write(w, b"{}")
    os.close(w)
    me = f"{os.getuid()}:{os.getgid()}"
    ok = subprocess.run([sys.executable, "-I", "-S", "-c", JOB_TRAMPOLINE, str(r), me, "", "/bin/echo", "ran"],
                        pass_fds=(r,), capture_output=True, text=True, check=False)
    os.close(r)
    assert ok.returncode == 0 and ok.stdout == "ran\n", ok
    r, w = os.pipe()
    os.write(w, b"{}")
    os.close(w)
    other = f"{os.getuid() + 4242}:{os.getgid()}"
    bad = subprocess.run([sys.executable, "-I", "-S", "-c", JOB_TRAMPOLINE, str(r), other, "", "/bin/echo", "ran"],
                         pass_fds=(r,), capture_output=True, text=True, check=False)
    os.close(r)
    assert bad.returncode == 126 and bad.stdout == "" and f"should run as uid {os.getuid() + 4242}" in bad.stderr, bad


def test_the_zone_counts_what_it_refuses_another_nodes_reservation(tmp_path: Path) -> None:
    """Through a real zone component: node 3 commits and releases node 2's offer (ignored,
    counted as ``placement``), then node 2 commits its own."""
    from test_loan_component import make_comp, run

    comp = make_comp(tmp_path, pool="training", gpus=2)

    def check() -> None:
        offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), 0x77, 5.0))
        assert isinstance(offer, wire.Offer)
        ack = comp.handle_request(3, wire.Commit(0x77, 1000))
        assert isinstance(ack, wire.CommitAck) and ack.status == int(pl.RefuseReason.UNKNOWN_PLACEMENT)
        assert comp.handle_request(3, wire.Release(0x77)) is None and 0x77 in comp.arbiter.held
        got = comp.stats()["authority"]
        assert got["refused"]["placement"] == 2 and got["recent"][-1]["node"] == 3, got
        assert "node 2 probed for it" in got["recent"][-1]["error"]
        ack = comp.handle_request(2, wire.Commit(0x77, 1000))
        assert isinstance(ack, wire.CommitAck) and ack.status == 0
        assert comp.status()["authority"]["placement"] == 2

    run(comp, check)
