"""A job's ``ckpt-<n>`` symbolic link into storage that never answers does not hang whoever
lists the job's checkpoints (the agent does it for every job, on its event loop).

``list_checkpoints`` asked ``is_dir()`` (which follows the link) before ``is_symlink()``: a
link into a hung mount (a hard NFS mount whose server is gone; here a real FUSE mount nobody
serves) stopped the caller until the storage came back.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from test_jobs_cwd_hung_storage import hung_mount

from laminar import jobkit

pytestmark = pytest.mark.kernel


def test_a_checkpoint_link_into_hung_storage_is_skipped_without_following_it(tmp_path: Path) -> None:
    ck = jobkit.Checkpointer(job_id="lm-t-hung", ckpt_dir=tmp_path / "ck", install_signal=False)
    real = ck.save(b"state", step=1)
    with hung_mount() as mnt:
        (tmp_path / "ck" / "ckpt-9").symlink_to(mnt / "ckpt-9")
        got: list[list[Path]] = []
        t = threading.Thread(target=lambda: got.append(jobkit.list_checkpoints(tmp_path / "ck")), daemon=True)
        t.start()
        t.join(30)  # liveness, not speed: before the fix it returned only when the mount was aborted
        assert not t.is_alive(), "list_checkpoints followed the link into the hung mount"
    assert got == [[real]]
