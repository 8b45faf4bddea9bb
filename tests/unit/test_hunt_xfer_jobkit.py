"""jobkit bugs found by the hunt, reproduced with real files and real processes.

The agent (root) runs :func:`laminar.jobkit.latest_checkpoint` / ``verify_checkpoint`` on the
directory the job's user writes (``LAMINAR_CKPT_DIR``), on its event loop (the periodic
checkpoint driver every ``poll_s``, a reclaim's wait for the final checkpoint), then snapshots
and ships what verified. Both followed whatever the job put there:

- a FIFO named like a checkpoint file (or MANIFEST.json) blocked the open forever, and a
  symbolic link to ``/dev/zero`` with a manifest size of 0 was hashed forever: an unprivileged
  job could hang the whole agent;
- a ``ckpt-<n>`` that is a symbolic link to another job's checkpoint directory (another user's,
  unreadable to the job) verified, so the agent would ship it and resume the job from it.

A checkpoint is a directory of regular files; anything else is refused with a clear error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from laminar import jobkit
from laminar.jobkit import MANIFEST, Checkpointer, CheckpointError, latest_checkpoint, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _verify_in_a_process(path: Path) -> str:
    """verify_checkpoint(path) in a real process; its outcome, or 'hung' after a generous wait."""
    code = ("import sys\nfrom laminar import jobkit\ntry:\n    jobkit.verify_checkpoint(sys.argv[1])\n"
            "    print('verified')\nexcept jobkit.CheckpointError as e:\n    print('refused:', e)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO / "agent")})
    except subprocess.TimeoutExpired:
        return "hung"
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _manifest_for(d: Path, name: str, size: int, sha: str) -> None:
    (d / MANIFEST).write_text(json.dumps({"version": jobkit.FORMAT_VERSION, "job_id": "j", "step": 1,
                                          "format": "bytes", "files": [{"name": name, "size": size, "sha256": sha}]}))


EMPTY_SHA = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_a_fifo_in_a_checkpoint_is_refused_not_waited_on(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt-1"
    ck.mkdir()
    os.mkfifo(ck / "state.bin")
    _manifest_for(ck, "state.bin", 0, EMPTY_SHA)
    out = _verify_in_a_process(ck)
    assert out.startswith("refused:") and "regular file" in out, out


def test_a_fifo_manifest_is_refused_not_waited_on(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt-1"
    ck.mkdir()
    (ck / "state.bin").write_bytes(b"")
    os.mkfifo(ck / MANIFEST)
    out = _verify_in_a_process(ck)
    assert out.startswith("refused:") and "regular file" in out, out
    assert latest_checkpoint(tmp_path) is None


def test_a_link_to_an_endless_device_is_refused_not_hashed_forever(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt-1"
    ck.mkdir()
    os.symlink("/dev/zero", ck / "state.bin")
    _manifest_for(ck, "state.bin", 0, EMPTY_SHA)
    out = _verify_in_a_process(ck)
    assert out.startswith("refused:") and "regular file" in out, out


def test_a_linked_file_is_refused_even_with_matching_content(tmp_path: Path) -> None:
    other = Checkpointer(job_id="bob", ckpt_dir=tmp_path / "bob", install_signal=False).save(b"bob's weights", step=3)
    ck = tmp_path / "alice" / "ckpt-9"
    ck.mkdir(parents=True)
    os.symlink(other / "state.bin", ck / "state.bin")
    (ck / MANIFEST).write_bytes((other / MANIFEST).read_bytes())
    with pytest.raises(CheckpointError, match="regular file"):
        verify_checkpoint(ck)
    assert latest_checkpoint(tmp_path / "alice") is None


def test_a_linked_checkpoint_directory_is_not_a_checkpoint_of_this_job(tmp_path: Path) -> None:
    bob = Checkpointer(job_id="bob", ckpt_dir=tmp_path / "bob", install_signal=False).save(b"bob's weights", step=3)
    alice = Checkpointer(job_id="alice", ckpt_dir=tmp_path / "alice", install_signal=False)
    mine = alice.save(b"alice's weights", step=5)
    os.symlink(bob, tmp_path / "alice" / "ckpt-999")  # planted by alice's job
    assert [p.name for p in jobkit.list_checkpoints(tmp_path / "alice")] == ["ckpt-5"]
    assert latest_checkpoint(tmp_path / "alice") == mine
    with pytest.raises(CheckpointError, match="link"):
        verify_checkpoint(tmp_path / "alice" / "ckpt-999")
    # the job's own resume from its directory takes its own checkpoint, not the link
    got = Checkpointer(ckpt_dir=tmp_path / "x", resume_from=tmp_path / "alice", install_signal=False).resume()
    assert got == b"alice's weights"


@pytest.mark.parametrize("name", ["a\x00b", "x" * 300])
def test_a_manifest_name_the_kernel_refuses_is_a_checkpoint_error(tmp_path: Path, name: str) -> None:
    # A NUL byte (ValueError) or an over-long name (OSError) escaped verify_checkpoint and
    # latest_checkpoint: the agent's periodic-checkpoint round failed for every job on the node.
    good = Checkpointer(ckpt_dir=tmp_path, install_signal=False).save(b"ok", step=1)
    ck = tmp_path / "ckpt-2"
    ck.mkdir()
    _manifest_for(ck, name, 0, EMPTY_SHA)
    with pytest.raises(CheckpointError):
        verify_checkpoint(ck)
    assert latest_checkpoint(tmp_path) == good
