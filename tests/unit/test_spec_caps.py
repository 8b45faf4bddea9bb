"""What a job spec may hold (laminar.runtime.spec.SPEC_BYTES_MAX and the per-item caps), on every
path that builds one: JobSpec.from_dict (the API, a placement, a peer's hand-over, a keeper's
take-over, an archive record) and JobSpec.validate (a spec built in code)."""

from __future__ import annotations

import pytest

from laminar.runtime import spec as J
from laminar.runtime.spec import JobError, JobSpec


def test_the_whole_spec_is_capped_with_its_size_and_the_cap_named() -> None:
    env = {"A": "a" * 30_000, "B": "b" * 30_000}
    # command ["/bin/true"]: 10 bytes; A and B: 30,003 each; C: the rest up to the cap
    env["C"] = "c" * (J.SPEC_BYTES_MAX - 10 - 2 * 30_003 - 3)
    assert JobSpec.from_dict({"command": ["/bin/true"], "env": env}).env["C"]
    env["C"] += "c"
    with pytest.raises(JobError) as e:
        JobSpec.from_dict({"command": ["/bin/true"], "env": env})
    assert str(e.value).startswith(f"job spec: {J.SPEC_BYTES_MAX + 1} bytes, at most {J.SPEC_BYTES_MAX}")
    assert e.value.reason == "spec_too_large"
    spec = JobSpec(command=["/bin/true"], env=env)  # built in code: validate() refuses it the same
    with pytest.raises(JobError, match="bytes, at most 65536"):
        spec.validate()


@pytest.mark.parametrize("d,want", [
    ({"command": ["x"] * (J.ARGV_ITEMS_MAX + 1)}, "arguments, at most"),
    ({"command": ["x", "y" * (J.ARG_BYTES_MAX + 1)]}, "argument 1 is"),
    ({"command": ["x"], "env": {f"E{i}": "" for i in range(J.ENV_NAMES_MAX + 1)}}, "names, at most"),
    ({"command": ["x"], "env": {"N" * (J.ENV_NAME_BYTES_MAX + 1): ""}}, "bytes, at most 256"),
    ({"command": ["x"], "env": {"V": "v" * (J.ENV_VALUE_BYTES_MAX + 1)}}, "value of"),
    ({"command": ["x"], "cwd": "/" + "d" * J.PATH_BYTES_MAX}, "cwd: 4097 bytes"),
    ({"command": ["x"], "resume_from": "/" + "r" * J.PATH_BYTES_MAX}, "resume_from: 4097 bytes"),
])
def test_each_item_is_capped(d: dict, want: str) -> None:
    with pytest.raises(JobError, match=want):
        JobSpec.from_dict(d)


def test_numbers_and_strings_are_refused_without_quoting_them_whole() -> None:
    for d in ({"command": ["x"], "memory": "1" + " " * 100_000 + "x"}, {"command": ["x"], "memory": "9" * 400},
              {"command": ["x"], "memory_mb": 10 ** 400}, {"command": ["x"], "gpus": "²"},
              {"command": ["x"], "gpus": "1" * 5000}, {"command": ["x"], "priority": 10 ** 4000},
              {"command": ["x"], "checkpoint_signal": "S" * 100_000}, {"command": ["x"], "x" * 100_000: 1},
              {"command": ["x"], "elastic_min": 1, "elastic_max": 10 ** 12}):
        with pytest.raises(JobError) as e:
            JobSpec.from_dict(d)
        assert len(str(e.value)) < 400, str(e.value)[:500]


def test_elastic_max_is_bounded_by_the_gpus_a_node_can_have() -> None:
    assert JobSpec.from_dict({"command": ["x"], "elastic_min": 1, "elastic_max": J.ELASTIC_MAX}).elastic_max == 1024
    with pytest.raises(JobError, match="max <= 1024"):
        JobSpec.from_dict({"command": ["x"], "elastic_min": 1, "elastic_max": J.ELASTIC_MAX + 1})


def test_as_dict_copies_what_a_caller_may_change() -> None:
    """as_dict is built by hand (no dataclasses.asdict deep copy) but still hands out copies of
    the containers: requeue_spec edits the env of what it gets."""
    s = JobSpec.from_dict({"command": ["a", "b"], "env": {"K": "v"}, "gpus": [0, 1], "class": "transient"})
    d = s.as_dict()
    d["env"]["K2"] = "w"
    d["command"].append("c")
    d["gpus"].append(2)
    assert s.env == {"K": "v"} and s.command == ["a", "b"] and s.gpus == [0, 1]
    assert list(d)[-1] == "class" and d["class"] == "transient"
    assert JobSpec.from_dict(s.as_dict()) == s
