"""A job adopted from a scheduler (laminar.policy.sched): its ref checked in full, its checkpoint
directory's name, and its origin columns written and read back (laminar.runtime.provenance)."""

from __future__ import annotations

import sqlite3

import pytest

from laminar.policy.sched import NAME_MAX, Scheduler, check_ref, ckpt_dir_name, label, parse_scheduler
from laminar.runtime import provenance as pv
from laminar.runtime.provenance import JobOrigin


@pytest.mark.parametrize("ref", ["1", "1234", "9999999999"])
def test_a_slurm_ref_is_the_job_id_in_digits(ref: str) -> None:
    assert check_ref(Scheduler.SLURM, ref) == ref
    assert ckpt_dir_name("slurm", ref) == f"slurm-{ref}"


@pytest.mark.parametrize("ref", ["", "12345678901", "12.0", "12_3", "-1", " 1", "1\n", "١٢", "a", 12, None])
def test_a_bad_slurm_ref_is_refused_naming_it(ref: object) -> None:
    with pytest.raises(ValueError) as e:
        check_ref("slurm", ref)
    assert repr(str(ref))[1:-1][:10] in str(e.value) and "digits" in str(e.value), e.value


@pytest.mark.parametrize("ref", ["default/train-0", "a/b", "team-a/x.y.z", f"{'n' * 63}/{'p' * 253}"])
def test_a_kubernetes_ref_is_namespace_slash_pod(ref: str) -> None:
    assert check_ref(Scheduler.KUBERNETES, ref) == ref
    name = ckpt_dir_name(Scheduler.KUBERNETES, ref)
    assert name.startswith("kubernetes-") and "/" not in name and len(name) <= NAME_MAX


@pytest.mark.parametrize("ref", ["default", "a/b/c", "/pod", "ns/", "NS/pod", "ns/Pod", "-ns/pod", "ns/pod-",
                                 "n.s/pod", "ns/po_d", "ns/..", f"{'n' * 64}/pod", f"ns/{'p' * 254}", "ns/pod\n", 7])
def test_a_bad_kubernetes_ref_is_refused_naming_it(ref: object) -> None:
    with pytest.raises(ValueError) as e:
        check_ref("kubernetes", ref)
    assert "kubernetes ref" in str(e.value) and repr(str(ref))[1:-1][:8] in str(e.value), e.value


def test_two_refs_never_share_a_checkpoint_directory() -> None:
    refs = ["a-b/c", "a/b-c", "a/b.c", "ab/c"]
    assert len({ckpt_dir_name("kubernetes", r) for r in refs}) == len(refs)
    long1, long2 = f"n/{'p' * 252}a", f"n/{'p' * 252}b"
    assert ckpt_dir_name("kubernetes", long1) != ckpt_dir_name("kubernetes", long2)
    assert ckpt_dir_name("kubernetes", "ns/pod") == "kubernetes-ns_pod"


def test_an_unknown_scheduler_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'pbs'.*slurm, kubernetes"):
        parse_scheduler("pbs")
    with pytest.raises(ValueError, match="'pbs'"):
        check_ref("pbs", "1")
    assert label("slurm", "12") == "slurm:12" and label(None, None) == "-"


def test_the_origin_keeps_its_scheduler_and_ref_in_its_columns() -> None:
    assert {"scheduler", "scheduler_ref"} <= set(pv.COLUMNS)
    assert any("scheduler_ref" in ix for ix in pv.INDEXES)
    origin = JobOrigin(scheduler=Scheduler.SLURM, scheduler_ref="42").checked()
    db = sqlite3.connect(":memory:")
    db.row_factory = sqlite3.Row
    db.execute(f"CREATE TABLE jobs ({', '.join(f'{c} {t}' for c, t in pv.COLUMNS.items())})")
    for ix in pv.INDEXES:
        db.execute(ix)
    db.execute(f"INSERT INTO jobs VALUES({', '.join('?' * len(pv.COLUMNS))})", origin.row())
    back = JobOrigin.from_row(db.execute("SELECT * FROM jobs").fetchone())
    assert back == origin and back.scheduler is Scheduler.SLURM
    assert back.as_dict()["scheduler"] == "slurm" and back.as_dict()["scheduler_ref"] == "42"
    plan = " ".join(str(r[-1]) for r in db.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM jobs WHERE scheduler=? AND scheduler_ref=?", ("slurm", "42")))
    assert "USING INDEX" in plan, plan
    # a hand-edited row that does not parse reads as absent
    db.execute("UPDATE jobs SET scheduler_ref='x/y'")
    assert JobOrigin.from_row(db.execute("SELECT * FROM jobs").fetchone()).scheduler is None


@pytest.mark.parametrize("fields", [{"scheduler": Scheduler.SLURM}, {"scheduler_ref": "1"},
                                    {"scheduler": Scheduler.SLURM, "scheduler_ref": "ns/pod"},
                                    {"scheduler": Scheduler.KUBERNETES, "scheduler_ref": "12"}])
def test_an_origin_with_half_or_a_wrong_ref_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="origin"):
        JobOrigin(**fields).checked()  # type: ignore[arg-type]
