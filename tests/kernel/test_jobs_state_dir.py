"""A state directory the agent creates itself must let every job reach its checkpoint directory.

The job of a user other than root runs as that user and writes its checkpoints into
``LAMINAR_CKPT_DIR`` (``state_dir/ckpt/<job>``, 0700, the owner's; ``ckpt`` is 0711). The store
created a missing ``state_dir`` 0750 (root's), which no other user may pass through: every such
job's checkpoint failed with "Permission denied" (``make run`` on a node without the tmpfiles
entry, or a ``state_dir`` of the operator's choosing). systemd's ``StateDirectoryMode=0711`` hid
it. A real laminard, a real other user.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel

WRITE_CKPT = 'echo step-1 > "$LAMINAR_CKPT_DIR/ckpt-1" && echo saved'


def test_a_users_job_can_write_its_checkpoints_into_a_state_dir_the_agent_made(veth_pair: Any) -> None:
    # Not under pytest's tmp_path: that is 0700 root's, which no other user may pass either.
    base = Path(f"/tmp/lm-t-state-{secrets.token_hex(3)}")
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    a = AgentProc(base, veth_pair.ifname_a, veth_pair.a)
    try:
        assert not a.state_dir.exists()
        a.start()
        assert stat.S_IMODE(a.state_dir.stat().st_mode) & 0o001, oct(a.state_dir.stat().st_mode)
        with local_user("ckpt") as user:
            status, job, raw = call_as(user, a.sock, "POST", "/v1/jobs", {"command": ["/bin/sh", "-c", WRITE_CKPT]})
            assert status == 201, raw

            def ended() -> Any:
                j = a.json("job", "show", job["id"])
                return j if j["state"] not in ("queued", "running", "suspended") else None

            final = wait_until(ended, 30, f"{job['id']} to end", a.log)
            log = Path(job["log"]).read_text()
            assert final["exit_code"] == 0, (final["reason"], log)
            assert (Path(job["ckpt_dir"]) / "ckpt-1").read_text() == "step-1\n"
            assert (Path(job["ckpt_dir"]) / "ckpt-1").stat().st_uid == user.uid
    finally:
        a.cleanup()
        shutil.rmtree(base, ignore_errors=True)
