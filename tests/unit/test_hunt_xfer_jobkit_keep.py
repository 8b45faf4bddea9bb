"""jobkit ``keep`` (hunt bug): pruning went by position in the list of all checkpoints, so a job
that resumed from an older checkpoint (a newer one was corrupt, or of another timeline) and
saved again with ``keep=1`` removed the checkpoint it had just written, leaving only the
corrupt one. Real files.
"""

from __future__ import annotations

from pathlib import Path

from laminar import jobkit
from laminar.jobkit import Checkpointer, latest_checkpoint, verify_checkpoint


def test_keep_never_removes_the_checkpoint_just_saved(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    old = Checkpointer(ckpt_dir=d, keep=5, install_signal=False)
    good = old.save(b"step 80", step=80)
    bad = old.save(b"step 100", step=100)
    (bad / "state.bin").write_bytes(b"step 1XX")  # corrupt at rest: same size, other bytes
    assert latest_checkpoint(d) == good
    # restarted from ckpt-80, the job trains on and saves step 90 with keep=1
    ck = Checkpointer(ckpt_dir=d, resume_from=d, keep=1, install_signal=False)
    assert ck.resume() == b"step 80"
    p = ck.save(b"step 90", step=90)
    assert verify_checkpoint(p)["step"] == 90
    assert latest_checkpoint(d) == p  # a good checkpoint is left (ckpt-100 does not verify)
    assert not (d / "ckpt-80").exists()  # older than the new one: pruned as asked
    # keep=2: the new one and one older one stay
    ck2 = Checkpointer(ckpt_dir=d, keep=2, install_signal=False)
    ck2.save(b"step 95", step=95)
    assert {x.name for x in jobkit.list_checkpoints(d)} >= {"ckpt-90", "ckpt-95"}
