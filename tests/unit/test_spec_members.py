"""The multi-node fields of a job spec (workers, workers_min, workers_max, launcher) and the
multi-node job id (docs/jobs.md, "The job model")."""

from __future__ import annotations

import json

import pytest

from laminar.runtime.spec import (
    JOB_ID_RE,
    LATER_FIELDS,
    WORKERS_MAX,
    JobError,
    JobSpec,
    is_multinode_id,
)


def spec(**kw: object) -> JobSpec:
    return JobSpec.from_dict({"command": ["python", "train.py"], **kw})


def test_one_node_specs_stay_as_they_were() -> None:
    s = spec()
    assert not s.is_multinode()
    assert not {"workers", "workers_min", "workers_max", "launcher"} & set(s.as_dict())
    one = spec(workers=1)  # one worker is a one-node job: the spec an older agent takes
    assert one.workers is None and not one.is_multinode()
    assert "workers" not in one.as_dict()
    for k in ("workers", "workers_min", "workers_max", "launcher"):
        assert LATER_FIELDS[k] is None


def test_rigid_and_elastic_multinode_specs() -> None:
    s = spec(workers=3, gpus=1, launcher="torchrun")
    assert s.is_multinode() and s.workers == 3 and s.workers_min is None
    d = s.as_dict()
    assert d["workers"] == 3 and d["launcher"] == "torchrun"
    assert JobSpec.from_dict(json.loads(json.dumps(d))) == s  # round trip through JSON
    e = spec(workers=3, workers_min=2, workers_max=4, launcher="plain")
    assert e.is_multinode() and (e.workers_min, e.workers, e.workers_max) == (2, 3, 4)
    top = spec(workers_min=2, workers_max=4)  # no count: placed at its most
    assert top.workers == 4
    assert spec(workers_min=1, workers_max=2, workers=1).is_multinode()  # may grow to 2 nodes
    assert spec(workers=WORKERS_MAX).workers == WORKERS_MAX


@pytest.mark.parametrize("kw, words", [
    ({"workers": 0}, ["workers 0", f"1 to {WORKERS_MAX}"]),
    ({"workers": -2}, ["workers -2", f"1 to {WORKERS_MAX}"]),
    ({"workers": WORKERS_MAX + 1}, [f"workers {WORKERS_MAX + 1}", f"1 to {WORKERS_MAX}"]),
    ({"workers": True}, ["workers True"]),
    ({"workers": 2.5}, ["workers 2.5"]),
    ({"workers": "3"}, ["workers '3'"]),
    ({"workers_min": 3, "workers_max": 2, "workers": 2}, ["3:2", "min 3 is more than max 2"]),
    ({"workers_min": 2}, ["workers_min 2", "both"]),
    ({"workers_max": 4, "workers": 3}, ["workers_max 4", "both"]),
    ({"workers_min": 2, "workers_max": 4, "workers": 5}, ["workers 5", "2 <= workers <= 4"]),
    ({"workers_min": 2, "workers_max": 4, "workers": 1}, ["workers 1", "2 <= workers <= 4"]),
    ({"workers_min": 1, "workers_max": 1}, ["1:1", "2 nodes at least"]),
    ({"workers_min": 0, "workers_max": 3}, ["workers_min 0"]),
    ({"workers_max": WORKERS_MAX + 1, "workers_min": 2}, [f"workers_max {WORKERS_MAX + 1}"]),
    ({"workers": 3, "launcher": "mpirun"}, ["launcher 'mpirun'", "torchrun, plain"]),
    ({"launcher": "plain"}, ["launcher 'plain'", "only for a multi-node job"]),
    ({"workers": 3, "elastic_min": 1, "elastic_max": 2}, ["elastic_min 1", "workers 3", "not both"]),
    ({"workers_min": 2, "workers_max": 3, "elastic_min": 1, "elastic_max": 2}, ["not both"]),
    ({"workers": 2, "gpus": [0, 1]}, ["gpus [0, 1]", "count of GPUs per worker"]),
])
def test_refusals_name_the_value_and_what_is_allowed(kw: dict[str, object], words: list[str]) -> None:
    with pytest.raises(JobError) as e:
        spec(**kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert e.value.reason == "workers_invalid"


def test_the_gpu_elastic_fields_keep_their_meaning_on_one_node() -> None:
    s = spec(elastic_min=1, elastic_max=4)
    assert not s.is_multinode() and s.elastic_max == 4


def test_job_ids() -> None:
    assert is_multinode_id("job-7-n3") and is_multinode_id("job-123456789012345678-n1234567890")
    for bad in ("job-7", "job-7-n", "job-7-3", "job--n3", "job-7-n3x", "job-1234567890123456789-n1",
                "job-7-n12345678901", "7-n3", "job-7-n3/..", ""):
        assert not is_multinode_id(bad), bad
    assert JOB_ID_RE.fullmatch("job-7") and JOB_ID_RE.fullmatch("job-7-n3")
    assert not JOB_ID_RE.fullmatch("job-7-n3-n4")
