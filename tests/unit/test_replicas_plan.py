"""What ``laminarctl replicas`` says the GC will do with a key (``replica_gc_plan``, policy) agrees
with the GC's own rule, state by state; and what a caller who may not see whose job a replica is
gets (``redact_replica``)."""

from __future__ import annotations

from laminar.migrate.reclaim import REPLICA_LATE_S, keeper_confirmation, redact_replica, replica_gc_plan

NOW = 1_800_000_000.0


def plan(state: str | None, held: dict[str, float], **kw: object) -> dict[str, object]:
    return replica_gc_plan(state=state, held=held, in_use=kw.pop("in_use", ()), now=NOW, **kw)  # type: ignore[arg-type]


def test_keepers_waiting_failed_and_archived_keys_are_kept_with_the_reason() -> None:
    held = {"ckpt-3": NOW - 50, "ckpt-9": NOW - 10}
    g = plan("keeping", held, updated=NOW - 100, src_node=4, keeper_check_s=600.0)
    assert g["removes"] == [] and g["at"] is None and g["keeps"] == ["ckpt-9", "ckpt-3"]
    assert "node 4" in str(g["why"]) and "asked whether it still does" in str(g["why"])
    assert "take-over places it" in str(plan("keeping", held, take_over=True, src_node=4)["why"])
    w = plan("waiting", held, src_node=4, next_look=NOW + 30)
    assert w["removes"] == [] and "waiting for room" in str(w["why"]) and "next look" in str(w["why"])
    for state in ("failed", "archived"):
        p = plan(state, held)
        assert p["removes"] == [] and "operator" in str(p["why"]) and "laminarctl replicas drop" in str(p["why"])
    t = plan("released", held, updated=NOW - 100, taking=True)
    assert t["removes"] == [] and "take-over" in str(t["why"])


def test_done_keys_lose_what_no_local_job_uses_at_the_next_round_but_late_checkpoints() -> None:
    held = {"ckpt-1": NOW - 500, "ckpt-2": NOW - 400, "ckpt-3": NOW - 5}  # ckpt-3 came after the release
    p = plan("released", held, updated=NOW - 100, in_use={"ckpt-1"}, next_round=NOW + 12)
    assert p["removes"] == ["ckpt-2"] and p["at"] == NOW + 12 and p["keeps"] == ["ckpt-3", "ckpt-1"]
    assert "came after" in str(p["why"]) and "local job" in str(p["why"])
    only_late = plan("released", {"ckpt-3": NOW - 5, "ckpt-4": NOW - 2}, updated=NOW - 100, next_round=NOW + 12)
    assert only_late["removes"] == ["ckpt-4", "ckpt-3"] and only_late["at"] == NOW - 2 + REPLICA_LATE_S
    assert only_late["keeps"] == [] and "came after" in str(only_late["why"])
    old_late = {"ckpt-3": NOW - REPLICA_LATE_S - 1}  # committed after the row changed, but long ago
    assert plan("resumed", old_late, updated=NOW - REPLICA_LATE_S - 10)["removes"] == ["ckpt-3"]
    empty = plan("handed-over", {}, updated=NOW - 100, row_keep_s=86400.0)
    assert empty["removes"] == [] and empty["row_at"] == NOW - 100 + 86400.0


def test_unclaimed_keys_go_after_the_orphan_age_unless_a_local_job_uses_them() -> None:
    held = {"ckpt-4": NOW - 70, "ckpt-5": NOW - 60}
    p = plan(None, held, newest_mtime=NOW - 60, orphan_s=21600.0)
    assert p["removes"] == ["ckpt-5", "ckpt-4"] and p["at"] == NOW - 60 + 21600.0
    u = plan(None, held, newest_mtime=NOW - 60, in_use={"ckpt-4", "ckpt-5"})
    assert u["removes"] == [] and "local job" in str(u["why"])


def test_a_redacted_replica_keeps_sizes_and_plan_but_not_whose_job() -> None:
    r = {"key": "n2-job-1", "src_job": "job-1", "owner_uid": 1000, "job_id": "job-4", "used_by": ["job-4"],
         "last_error": "job-1: no room", "state": "keeping", "bytes": 123, "gc_why": "keeping the job of node 2",
         "droppable": "n2-job-1 is keeping: job job-1 ..."}
    x = redact_replica(r)
    assert x["redacted"] is True and x["bytes"] == 123 and x["state"] == "keeping"
    assert "job-1" not in str(x) and "1000" not in str(x)


def test_a_keeper_is_unconfirmed_once_its_source_left_a_question_unanswered_and_says_since_when() -> None:
    def conf(**kw: object) -> dict[str, object]:
        args: dict[str, object] = {"state": "keeping", "take_over": False, "updated": NOW - 900, "answered": None,
                                   "unanswered": 0, "now": NOW, **kw}
        return keeper_confirmation(**args)  # type: ignore[arg-type]

    # never asked, or answered: confirmed; heard from at the keeper message or the answer, the later
    assert conf() == {"unconfirmed": False, "heard_at": NOW - 900, "silent_s": 900.0}
    assert conf(answered=NOW - 60) == {"unconfirmed": False, "heard_at": NOW - 60, "silent_s": 60.0}
    # one question unanswered is enough; silent since it last answered (or sent the keeper)
    assert conf(answered=NOW - 700, unanswered=1) == {"unconfirmed": True, "heard_at": NOW - 700, "silent_s": 700.0}
    assert conf(unanswered=3) == {"unconfirmed": True, "heard_at": NOW - 900, "silent_s": 900.0}
    # a new keeper message after the last answer counts as hearing from the source
    assert conf(updated=NOW - 5, answered=NOW - 700, unanswered=1)["silent_s"] == 5.0
    # keepers that are never asked are never unconfirmed
    for kw in ({"take_over": True}, {"state": "waiting"}, {"state": "released"}, {"state": None}):
        assert conf(unanswered=2, **kw) == {"unconfirmed": False, "heard_at": None, "silent_s": None}


def test_the_needs_error_is_not_shown_to_a_caller_who_may_not_see_whose_job_it_is() -> None:
    r = redact_replica({"key": "n2-job-1", "state": "keeping", "unconfirmed": True, "needs_error": "refused",
                        "source_silent_s": 70.0})
    assert r["needs_error"] is None and r["unconfirmed"] is True and r["source_silent_s"] == 70.0
