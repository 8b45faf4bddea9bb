"""Who may submit which Airlock class at which priority (config ``[grants]``), without root.

The policy is pure (`Grants.refusal`); the config refuses a bad ``[grants]`` whole, naming the
value. The agent enforcing it against real other users: tests/kernel/test_jobs_grants_agent.py.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from laminar import config
from laminar.runtime.grants import Grants

ME = pwd.getpwuid(os.getuid()).pw_name


def load(tmp_path: Path, text: str) -> config.Config:
    p = tmp_path / "grants.toml"
    p.write_text(text)
    return config.load(p)


def test_the_default_gives_every_user_standard_and_transient_up_to_50() -> None:
    g = Grants.from_config(config.load(None).section("grants"))
    assert g.refusal(1234, {1234}, "standard", 50) is None
    assert g.refusal(1234, {1234}, "transient", 0) is None
    why = g.refusal(1234, {1234}, "long-resident", 50)
    assert why is not None and "class long-resident at priority 50" in why and "uid 1234" in why
    assert "standard, transient up to priority 50" in why
    why = g.refusal(1234, {1234}, "standard", 51)
    assert why is not None and "priority 51" in why
    assert g.refusal(0, {0}, "long-resident", 100) is None  # root: anything


def test_a_grant_applies_by_uid_by_name_and_by_supplementary_group(tmp_path: Path) -> None:
    c = load(tmp_path, f"""
[grants]
default_priority_max = 40

[[grants.grant]]
users = [1234, "{ME}"]
classes = ["long-resident"]
priority_max = 90

[[grants.grant]]
groups = [777]
classes = ["standard"]
priority_max = 100
""")
    g = Grants.from_config(c.section("grants"))
    me = pwd.getpwnam(ME).pw_uid
    for uid in (1234, me):
        if uid == 0:
            continue
        assert g.refusal(uid, {5}, "long-resident", 90) is None
        assert g.refusal(uid, {5}, "long-resident", 91) is not None
        # the grant's cap is its own: standard stays under the default's 40 for this caller
        assert g.refusal(uid, {5}, "standard", 41) is not None
    assert g.refusal(4321, {4321, 777}, "standard", 100) is None  # 777 as a supplementary group
    assert g.refusal(4321, {4321, 777}, "long-resident", 10) is not None
    why = g.refusal(4321, {4321}, "standard", 41)
    assert why is not None and "standard, transient up to priority 40" in why and "granted" not in why
    why = g.refusal(1234, {1234}, "long-resident", 95)
    assert why is not None and "long-resident up to priority 90 (granted to user 1234" in why


@pytest.mark.parametrize("text, needles", [
    ("[grants]\ndefault_classes = ['long-resident', 'gold']\n", ["grants.default_classes", "'gold'", "long-resident, standard, transient"]),
    ("[grants]\ndefault_classes = []\n", ["grants.default_classes = []", "non-empty"]),
    ("[grants]\ndefault_priority_max = 101\n", ["grants.default_priority_max = 101", "out of range"]),
    ("[[grants.grant]]\nusers = ['lm-s7-no-such-user']\nclasses = ['standard']\npriority_max = 60\n",
     ["grant 1", "user 'lm-s7-no-such-user' does not exist"]),
    ("[[grants.grant]]\ngroups = ['lm-s7-no-such-group']\nclasses = ['standard']\npriority_max = 60\n",
     ["group 'lm-s7-no-such-group' does not exist"]),
    ("[[grants.grant]]\nusers = [1]\nclasses = ['platinum']\npriority_max = 60\n", ["grant 1: classes = ['platinum']"]),
    ("[[grants.grant]]\nusers = [1]\nclasses = ['standard']\npriority_max = 200\n", ["grant 1: priority_max = 200"]),
    ("[[grants.grant]]\nusers = [1]\nclasses = ['standard']\n", ["grant 1: priority_max = None"]),
    ("[[grants.grant]]\nusers = [1]\npriority_max = 60\n", ["grant 1: missing classes"]),
    ("[[grants.grant]]\nclasses = ['standard']\npriority_max = 60\n", ["grant 1: names no one"]),
    ("[[grants.grant]]\nusers = [-3]\nclasses = ['standard']\npriority_max = 60\n", ["user -3"]),
    ("[[grants.grant]]\nuser = [1]\nclasses = ['standard']\npriority_max = 60\n", ["unknown key(s) ['user']"]),
    ("[grants]\ngrant = 'everyone'\n", ["grants.grant = 'everyone'", "expected a list"]),
])
def test_a_bad_grants_section_is_refused_whole_naming_the_value(tmp_path: Path, text: str, needles: list[str]) -> None:
    with pytest.raises(config.ConfigError) as e:
        load(tmp_path, "[agent]\nnode = 'lm-s7'\n" + text)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_the_grants_defaults_print_as_toml_that_reads_back_equal() -> None:
    import tomllib

    shipped = tomllib.loads(config.defaults_toml())
    assert shipped["grants"] == {"default_classes": ["standard", "transient"], "default_priority_max": 50, "grant": []}
