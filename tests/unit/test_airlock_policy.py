"""Airlock policy: validated whole, refused with every problem named, stored versioned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laminar.airlock.policy import DEFAULT, PolicyError, PolicyStore, parse, validate
from laminar.store import Store


def test_defaults_are_valid() -> None:
    assert validate({}) == validate(DEFAULT)


def test_threshold_out_of_range_is_named() -> None:
    with pytest.raises(PolicyError) as e:
        validate({"thresholds": {"memory.some": 1.7}})
    assert "policy: threshold 1.7 out of range 0..1 for memory.some" in str(e.value)


def test_every_problem_is_listed() -> None:
    with pytest.raises(PolicyError) as e:
        validate({"thresholds": {"usage.high": 0.99, "usage.critical": 0.9}, "rungs": {"suspend": {"budget_s": -1}},
                  "class_weights": {"batch": 2}, "bogus": 1})
    msg = str(e.value)
    assert "unknown key 'bogus'" in msg
    e2 = pytest.raises(PolicyError, validate, {"thresholds": {"usage.high": 0.99, "usage.critical": 0.9},
                                                "rungs": {"suspend": {"budget_s": -1}}, "class_weights": {"batch": 2}})
    msg = str(e2.value)
    assert "usage.high 0.99 must not exceed usage.critical 0.9" in msg
    assert "rungs.suspend.budget_s -1 out of range" in msg
    assert "unknown class 'batch'" in msg


def test_recover_below_must_sit_under_high() -> None:
    with pytest.raises(PolicyError, match="would flap"):
        validate({"hysteresis": {"recover_below": 0.9}})


def test_partial_document_merges_over_defaults() -> None:
    p = validate({"rungs": {"suspend": {"budget_s": 2}}})
    assert p["rungs"]["suspend"]["budget_s"] == 2
    assert p["rungs"]["readdress"] == DEFAULT["rungs"]["readdress"]


def test_parse_json_and_toml() -> None:
    assert parse('{"readdress": false}') == {"readdress": False}
    assert parse("readdress = false\n[thresholds]\n\"memory.some\" = 0.2\n") == {
        "readdress": False, "thresholds": {"memory.some": 0.2}}
    with pytest.raises(PolicyError, match="neither valid JSON nor valid TOML"):
        parse("{{{")


def test_invalid_policy_keeps_the_old_one(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    ps = PolicyStore(store)
    assert ps.current().version == 0
    v1 = ps.set({"thresholds": {"memory.some": 0.2}}, uid=0)
    assert v1.version == 1
    with pytest.raises(PolicyError):
        ps.set({"thresholds": {"memory.some": 1.7}})
    cur = ps.current()
    assert cur.version == 1 and cur["thresholds"]["memory.some"] == 0.2
    assert [h["version"] for h in ps.history()] == [1]
    store.close()


def test_a_job_default_above_the_configs_class_cap_is_refused_naming_both() -> None:
    """job_default_mb was checked against the policy's own class_caps_mb only: a default above
    the config's [airlock] class_budget_mb was accepted, and every job of that class submitted
    without --memory was then refused as one that could never start."""
    with pytest.raises(PolicyError) as e:
        validate({"job_default_mb": {"transient": 1024}}, {"transient": 512})
    assert ("policy: job_default_mb.transient 1024 exceeds the transient class's cap of 512 MiB "
            "([airlock] class_budget_mb in the agent's config)") in str(e.value)
    assert "at most 512" in str(e.value)
    assert validate({"job_default_mb": {"transient": 512}}, {"transient": 512})["job_default_mb"] == {"transient": 512}
    assert validate({"job_default_mb": {"standard": 1024}}, {"transient": 512})  # another class's cap


def test_the_last_rungs_old_name_is_read_as_kill(tmp_path: Path) -> None:
    """Airlock's last rung was called ``reclaim`` (a word now kept for an owner's reclaim of a
    node): a policy file, or a document stored by an older agent, that sets it by that name
    still sets the kill rung; one that gives both names is refused, naming them."""
    assert validate({"rungs": {"reclaim": {"budget_s": 3.0}}})["rungs"]["kill"] == {"budget_s": 3.0}
    assert "reclaim" not in validate({"rungs": {"reclaim": {"budget_s": 3.0}}})["rungs"]
    with pytest.raises(PolicyError, match=r"rungs.reclaim is the old name of rungs.kill; give one of them"):
        validate({"rungs": {"reclaim": {"budget_s": 3.0}, "kill": {"budget_s": 1.0}}})
    store = Store(tmp_path / "laminar.db")
    try:
        ps = PolicyStore(store)
        old = {**DEFAULT, "rungs": {"suspend": {"budget_s": 5.0}, "readdress": {"budget_s": 30.0, "max_hops": 2},
                                    "reclaim": {"budget_s": 2.0}}}
        with store.tx() as db:  # as an agent of before the rename stored its effective policy
            db.execute("INSERT INTO airlock_policy(version, ts, uid, doc) VALUES (1, 1.0, 0, ?)", (json.dumps(old),))
        assert ps.current().doc["rungs"]["kill"] == {"budget_s": 2.0}
    finally:
        store.close()
