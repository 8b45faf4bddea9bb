"""A job's secrets under a real laminard, read by a real other local user.

Before: ``GET /v1/jobs`` and ``GET /v1/jobs/{id}`` gave every local user every job's whole spec,
env values (tokens) included; the job's log was 0640 (readable by the owner's group), the store
holding the specs 0644 and the checkpoint directory 0755. Now env values are shown to the job's
owner and root only (others get the names with ``<redacted>``), and the files are the owner's
alone (mode 0600/0700; store: root's).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from agentproc import AgentProc, wait_until
from userrig import call_as, local_user

from laminar.runtime.record import REDACTED

pytestmark = pytest.mark.kernel

ROOT_TOKEN = "lm-s7-root-token-9f2c"
USER_TOKEN = "lm-s7-user-token-41ab"


def private(p: Path, uid: int, mode: int) -> str | None:
    """What is wrong with `p`'s owner and mode, or None: owned by `uid`, nothing for group/other."""
    st = p.stat()
    if st.st_uid != uid:
        return f"{p} owned by uid {st.st_uid}, expected {uid}"
    if stat.S_IMODE(st.st_mode) != mode:
        return f"{p} has mode {stat.S_IMODE(st.st_mode):o}, expected {mode:o}"
    return None


def test_env_values_and_job_files_are_the_owners_alone(agent: AgentProc) -> None:
    with local_user("user") as user:
        status, mine, _ = call_as(None, agent.sock, "POST", "/v1/jobs",
                                  {"command": ["sleep", "600"], "name": "lm-s7-root", "env": {"API_TOKEN": ROOT_TOKEN}})
        assert status == 201, mine
        status, theirs, _ = call_as(user, agent.sock, "POST", "/v1/jobs",
                                    {"command": ["sleep", "600"], "name": "lm-s7-user", "env": {"HF_TOKEN": USER_TOKEN}})
        assert status == 201, theirs
        assert theirs["owner_uid"] == user.uid and theirs["spec"]["env"] == {"HF_TOKEN": USER_TOKEN}
        for j in (mine, theirs):
            wait_until(lambda j=j: agent.json("job", "show", j["id"])["state"] == "running", 30, f"{j['id']} to run")

        # the other user: root's job is listed and shown, its env names but no value
        for path in ("/v1/jobs", f"/v1/jobs/{mine['id']}"):
            status, out, raw = call_as(user, agent.sock, "GET", path)
            assert status == 200, out
            assert ROOT_TOKEN.encode() not in raw, f"{path} shows root's token to uid {user.uid}"
            rec = out if isinstance(out, dict) else next(j for j in out if j["id"] == mine["id"])
            assert rec["spec"]["env"] == {"API_TOKEN": REDACTED} and rec["env_redacted"] is True
            assert rec["state"] == "running" and rec["owner_uid"] == 0 and rec["class"] == "standard"
            assert rec["spec"]["command"] == ["sleep", "600"]
        # ... and its own job in full
        status, out, _ = call_as(user, agent.sock, "GET", f"/v1/jobs/{theirs['id']}")
        assert out["spec"]["env"] == {"HF_TOKEN": USER_TOKEN} and out["env_redacted"] is False
        # root sees both in full
        listed = {j["id"]: j for j in agent.json("jobs")}
        assert listed[mine["id"]]["spec"]["env"] == {"API_TOKEN": ROOT_TOKEN}
        assert listed[theirs["id"]]["spec"]["env"] == {"HF_TOKEN": USER_TOKEN}

        # the CLI still renders for the other user (tables and JSON), without the token
        for args in (("jobs",), ("job", "show", mine["id"]), ("-o", "json", "job", "show", mine["id"])):
            r = agent.ctl(*args, user=user.uid)
            assert r.returncode == 0, r.stderr
            assert ROOT_TOKEN not in r.stdout and mine["id"] in r.stdout
        shown = json.loads(agent.ctl("-o", "json", "job", "show", mine["id"], user=user.uid).stdout)
        assert shown["spec"]["env"] == {"API_TOKEN": REDACTED}

        # files: each job's log and checkpoint directory are its owner's alone; the store root's
        problems = [
            private(Path(mine["log"]), 0, 0o600), private(Path(theirs["log"]), user.uid, 0o600),
            private(Path(mine["ckpt_dir"]), 0, 0o700), private(Path(theirs["ckpt_dir"]), user.uid, 0o700),
            private(agent.state_dir / "laminar.db", 0, 0o600),
        ]
        for side in ("-wal", "-shm"):
            f = agent.state_dir / f"laminar.db{side}"
            if f.exists():
                problems.append(private(f, 0, 0o600))
        assert [p for p in problems if p] == []
        for d in ("logs", "ckpt"):  # reachable by path, not listable
            assert stat.S_IMODE((agent.state_dir / d).stat().st_mode) == 0o711
        # the owner's job still writes its log (the agent opened it for the job as root)
        assert os.access(theirs["log"], os.R_OK)

        for j in (mine, theirs):
            agent.ctl("job", "stop", j["id"], "--grace", "0")
