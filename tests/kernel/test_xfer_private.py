"""Checkpoint replicas on a node are root's alone.

The agent's state directory is 0711 (a job running as its user must reach its own
``ckpt/<job>``), so every directory below it decides for itself who may look. ``xfer/`` holds
other users' checkpoints (keepers' replicas, keepers' copies, outgoing snapshots): a real other
user must not read them, also when an older version left the directory open.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from agentproc import AgentProc
from userrig import local_user, read_as

pytestmark = pytest.mark.kernel


def test_replicas_are_not_readable_by_other_users(veth_pair) -> None:
    # pytest's tmp_path is under a 0700 directory: the other user could read nothing there anyway
    tmp = Path(tempfile.mkdtemp(prefix="lm-s7-xfer-"))
    os.chmod(tmp, 0o711)
    a = AgentProc(tmp, veth_pair.ifname_a, veth_pair.a)
    # what an older version left: an open xfer/ with a replica readable by all
    replica = a.state_dir / "xfer" / "checkpoints" / "k-s7" / "ckpt-1" / "weights.pt"
    replica.parent.mkdir(parents=True)
    os.chmod(a.state_dir, 0o711)
    for d in (a.state_dir / "xfer", a.state_dir / "xfer" / "checkpoints", replica.parent.parent, replica.parent):
        os.chmod(d, 0o755)
    replica.write_bytes(b"secret weights")
    os.chmod(replica, 0o644)
    with local_user("xfer") as other:
        assert read_as(other, replica) == "read"  # the setup really is open
        try:
            a.start()
            mode = stat.S_IMODE(os.stat(a.state_dir / "xfer").st_mode)
            assert mode & 0o077 == 0, f"xfer/ is {mode:o}"
            assert read_as(other, replica) == os.strerror(13)  # EACCES
            assert replica.read_bytes() == b"secret weights"  # nothing of the node's own data lost
        finally:
            a.cleanup()
            shutil.rmtree(tmp, ignore_errors=True)


def test_archived_records_and_checkpoints_are_root_s_alone(tmp_path: Path) -> None:
    """The archive (shared storage) holds the job's request, env values included, and its
    checkpoint: a real other user reaching the archive reads neither, even where an older version
    left the job's directory open."""
    from archiverig import agent_of, record, request

    from laminar.jobkit import Checkpointer
    from laminar.migrate.archive_view import LIVE_RECORD

    arch = Path(tempfile.mkdtemp(prefix="lm-s7-arch-"))
    try:
        os.chmod(arch, 0o755)  # an NFS mount every user of the node can reach
        (arch / "n1-job-2").mkdir(mode=0o755)
        os.chmod(arch / "n1-job-2", 0o755)
        c = agent_of(1, arch)  # node 1, holding the zone's keys: its records are signed
        job = Checkpointer(job_id="j1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=3)
        with local_user("arch") as other:
            for key in ("n1-job-1", "n1-job-2"):
                rec = {**record(key), "periodic": True}
                rec["request"] = request(env={"HF_TOKEN": "lm-s7-token"})
                d = c.archive.periodic.publish_live(key, job.save(b"weights", step=5), rec)
                assert d is not None
                os.chmod(d / "state.bin", 0o644)  # even a copy whose files are open
                assert read_as(other, d.parent / LIVE_RECORD) == os.strerror(13), key
                assert read_as(other, d / "state.bin") == os.strerror(13), key
                assert "lm-s7-token" in (d.parent / LIVE_RECORD).read_text()  # root (every agent) still can
    finally:
        shutil.rmtree(arch, ignore_errors=True)
