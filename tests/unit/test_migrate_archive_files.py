"""The archive's files and its claim (ReclaimComponent._archive/_claim/_unclaim/_claim_done):
real files in a temporary directory, two components with different node ids standing for two
agents that share the archive."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from laminar.jobkit import Checkpointer, CheckpointError, verify_checkpoint
from laminar.migrate import reclaim
from laminar.migrate.reclaim import ReclaimComponent


def agent_of(node: int, archive: Path) -> ReclaimComponent:
    c = ReclaimComponent()
    c.agent = SimpleNamespace(zone=SimpleNamespace(node_id=node))
    c.s = {"archive_dir": str(archive)}
    return c


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return Checkpointer(job_id="j1", ckpt_dir=tmp_path / "ck", install_signal=False).save(b"weights", step=7)


def test_archive_copies_a_verified_checkpoint_and_writes_the_record(tmp_path: Path, ckpt: Path) -> None:
    a = agent_of(1, tmp_path / "arch")
    out = a._archive("n1-job-1", ckpt, {"key": "n1-job-1", "src_node": 1, "src_job": "job-1", "request": {"x": 1}})
    assert out == tmp_path / "arch" / "n1-job-1" / "ckpt-7"
    verify_checkpoint(out)
    rec = json.loads((out.parent / "guard.json").read_text())
    assert rec["ckpt"] == "ckpt-7" and rec["archived_by"] == 1 and rec["request"] == {"x": 1}
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    assert a._archived("n1-job-1") and not a._archived("n9-job-9")


def test_a_corrupt_checkpoint_is_never_archived(tmp_path: Path, ckpt: Path) -> None:
    (ckpt / "state.bin").write_bytes(b"tampered")
    a = agent_of(1, tmp_path / "arch")
    with pytest.raises(CheckpointError):
        a._archive("k", ckpt, {"key": "k"})
    d = tmp_path / "arch" / "k"
    assert not (d / "ckpt-7").exists() and not (d / "guard.json").exists()
    assert not [p for p in d.iterdir()]


def test_one_node_wins_the_claim_and_a_running_job_is_never_claimed_again(tmp_path: Path, ckpt: Path) -> None:
    a, b = agent_of(1, tmp_path / "arch"), agent_of(2, tmp_path / "arch")
    a._archive("k", ckpt, {"key": "k"})
    assert b._claim("k")
    assert not a._claim("k")  # held by node 2
    b._unclaim("k")  # node 2 found no room
    assert a._claim("k")
    a._claim_done("k", "node 1")
    assert a._archive_runner("k") == "1"
    assert not b._claim("k") and not a._claim("k")
    # a guard archiving the same job again does not re-arm a record someone runs
    b._archive("k", ckpt, {"key": "k"})
    assert sorted(p.name for p in (tmp_path / "arch" / "k").glob("*.json")) == ["running-1.json"]


def test_a_stale_claim_of_a_node_that_died_trying_is_taken_over(tmp_path: Path, ckpt: Path) -> None:
    a, b = agent_of(1, tmp_path / "arch"), agent_of(2, tmp_path / "arch")
    a._archive("k", ckpt, {"key": "k"})
    assert a._claim("k")
    assert not b._claim("k")  # fresh: node 1 may still be starting it
    old = time.time() - reclaim.ARCHIVE_CLAIM_STALE_S - 5
    os.utime(tmp_path / "arch" / "k" / "claimed-1.json", (old, old))
    assert b._claim("k")
    assert [p.name for p in (tmp_path / "arch" / "k").glob("*.json")] == ["claimed-2.json"]


def test_no_archive_configured_claims_nothing(tmp_path: Path) -> None:
    c = agent_of(1, tmp_path)
    c.s = {"archive_dir": ""}
    assert c._archive_root() is None and not c._claim("k") and not c._archived("k")
