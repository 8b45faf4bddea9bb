"""The archive's files and its claim (StoppedCopies.publish/claim/unclaim/claim_done):
real files in a temporary directory, two components with different node ids standing for two
agents that share the archive (tests/archiverig.py: each holds the zone's key, so what they write
is signed and what they read verified)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from archiverig import agent_of, record, reseal

from laminar.jobkit import Checkpointer, CheckpointError, verify_checkpoint
from laminar.migrate.archive_claims import ARCHIVE_CLAIM_STALE_S

K = "n1-job-1"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return Checkpointer(job_id="j1", ckpt_dir=tmp_path / "ck", install_signal=False).save(b"weights", step=7)


def test_archive_copies_a_verified_checkpoint_and_writes_the_record(tmp_path: Path, ckpt: Path) -> None:
    a = agent_of(1, tmp_path / "arch")
    out = a.archive.stopped.publish("n1-job-1", ckpt, record(K))
    assert out == tmp_path / "arch" / "n1-job-1" / "ckpt-7"
    verify_checkpoint(out)
    rec = json.loads((out.parent / "guard.json").read_text())["body"]
    assert rec["ckpt"] == "ckpt-7" and rec["writer"] == 1 and rec["request"] == record(K)["request"]
    assert oct(os.lstat(out.parent).st_mode & 0o777) == "0o700"  # root's alone: the request's env is in it
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    assert a.archive.archived("n1-job-1") and not a.archive.archived("n9-job-9")


def test_a_corrupt_checkpoint_is_never_archived(tmp_path: Path, ckpt: Path) -> None:
    (ckpt / "state.bin").write_bytes(b"tampered")
    a = agent_of(1, tmp_path / "arch")
    with pytest.raises(CheckpointError):
        a.archive.stopped.publish(K, ckpt, record(K))
    d = tmp_path / "arch" / K
    assert not (d / "ckpt-7").exists() and not (d / "guard.json").exists()
    assert not [p for p in d.iterdir()]


def test_one_node_wins_the_claim_and_a_running_job_is_never_claimed_again(tmp_path: Path, ckpt: Path) -> None:
    a, b = agent_of(1, tmp_path / "arch"), agent_of(2, tmp_path / "arch")
    a.archive.stopped.publish(K, ckpt, record(K))
    assert b.archive.claims.claim(K)
    assert not a.archive.claims.claim(K)  # held by node 2
    b.archive.claims.unclaim(K)  # node 2 found no room
    assert a.archive.claims.claim(K)
    a.archive.claims.claim_done(K, "node 1")
    assert a.archive.runner(K) == "1"
    assert not b.archive.claims.claim(K) and not a.archive.claims.claim(K)
    # a keeper archiving the same job again does not re-arm a record someone runs
    a.archive.stopped.publish(K, ckpt, record(K))
    assert sorted(p.name for p in (tmp_path / "arch" / K).glob("*.json")) == ["running-1.json"]


def test_a_stale_claim_of_a_node_that_died_trying_is_taken_over(tmp_path: Path, ckpt: Path) -> None:
    a, b = agent_of(1, tmp_path / "arch"), agent_of(2, tmp_path / "arch")
    a.archive.stopped.publish(K, ckpt, record(K))
    assert a.archive.claims.claim(K)
    assert not b.archive.claims.claim(K)  # fresh: node 1 may still be starting it
    claim = tmp_path / "arch" / K / "claimed-1.json"
    os.utime(claim, (1e9, 1e9))  # an mtime set far back says nothing: the claim's signed note does
    assert not b.archive.claims.claim(K)
    reseal(a, claim, ts=time.time() - ARCHIVE_CLAIM_STALE_S - 5)  # node 1 claimed it that long ago
    assert b.archive.claims.claim(K)
    assert [p.name for p in (tmp_path / "arch" / K).glob("*.json")] == ["claimed-2.json"]


def test_no_archive_configured_claims_nothing(tmp_path: Path) -> None:
    c = agent_of(1, tmp_path)
    c.s = {"archive_dir": ""}
    assert c.archive.root() is None and not c.archive.claims.claim(K) and not c.archive.archived(K)
