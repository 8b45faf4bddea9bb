"""A job's working directory or PATH on storage that never answers must not stop the agent.

``submit --cwd`` is checked (it exists, its owner may enter it) and a command named without a
slash is looked up in the job's PATH before the job is accepted. Both checks used to run on the
agent's event loop (a stat as root, a child it waited for, shutil.which). On a hung mount (a hard
NFS mount whose server is gone) a stat never returns, so one submission, by any local user,
stopped every request of the agent, root's kill-switch included, until the storage came back.
Now both run in one child process given ``PROBE_S``.

The hung storage is real: a FUSE mount (allow_other, so root waits too) whose server never
answers, made with mount(2) on /dev/fuse by the test and aborted at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, api_json, wait_until
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel

MNT_DETACH = 2


@contextlib.contextmanager
def hung_mount() -> Iterator[Path]:
    """A FUSE mount nobody serves: every lookup under it waits until the mount is aborted."""
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse on this kernel")
    mnt = Path(f"/tmp/lm-t-hung-{secrets.token_hex(3)}")
    mnt.mkdir(mode=0o755)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    try:
        if libc.mount(b"lm-t-hung", str(mnt).encode(), b"fuse.lm-t-hung", 0, opts) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount fuse on {mnt}: {os.strerror(err)}")
        yield mnt
    finally:
        libc.umount2(str(mnt).encode(), MNT_DETACH)
        os.close(fd)  # aborts the connection: whatever still waits gets ENOTCONN
        with contextlib.suppress(OSError):
            mnt.rmdir()


def waits_in_fuse(root_pid: int) -> bool:
    """Whether `root_pid` or a descendant sleeps waiting for FUSE."""
    pids = [root_pid]
    seen = 0
    while seen < len(pids):
        pid = pids[seen]
        seen += 1
        try:
            if "fuse" in Path(f"/proc/{pid}/wchan").read_text():
                return True
            for tid in os.listdir(f"/proc/{pid}/task"):
                children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                pids += [int(c) for c in children]
        except OSError:
            continue
    return False


@pytest.mark.parametrize("where", ["cwd", "PATH"])
def test_a_cwd_or_path_on_hung_storage_does_not_stop_the_agent(agent: AgentProc, where: str) -> None:
    agent_pid = agent.json("status")["agent"]["pid"]
    with local_user("hung") as user, hung_mount() as mnt:
        answer: dict[str, Any] = {}
        spec: dict[str, Any] = {"command": ["/bin/true"], "cwd": str(mnt / "home")} if where == "cwd" else \
            {"command": ["lm-t-tool"], "env": {"PATH": f"{mnt}/bin:/usr/bin"}}

        def submit() -> None:
            answer["submit"] = call_as(user, agent.sock, "POST", "/v1/jobs", spec)

        t = threading.Thread(target=submit, daemon=True)
        t.start()
        wait_until(lambda: waits_in_fuse(agent_pid), 30, "the agent's cwd check to reach the hung mount")
        # root is answered while the submission still waits on the storage
        try:
            code, status = api_json(agent.sock, "GET", "/v1/status", None, timeout=8)
        except TimeoutError:
            pytest.fail("the agent did not answer root while a submission's cwd check waited on hung storage")
        assert code == 200 and status["agent"]["pid"] == agent_pid
        assert t.is_alive(), answer
        t.join(60)
        assert not t.is_alive()
        code, out, raw = answer["submit"]
        assert code == 400 and "did not answer within" in out["error"] and str(mnt) in out["error"], raw
    assert not agent.json("jobs"), "a refused submission left a job"


def test_the_probe_still_finds_commands_and_refuses_what_it_should(agent: AgentProc, tmp_path: Path) -> None:
    """What the checks answered before, they answer now (the probe is a shell script)."""
    with local_user("probe") as user:
        for spec, needle in ((({"command": ["lm-t-no-such-tool"]}), "not found in PATH"),
                             ({"command": ["true"], "env": {"PATH": "/nonexistent:/usr/bin/*"}}, "not found in PATH"),
                             ({"command": ["/bin/true"], "cwd": "/nonexistent-lm-t"}, "no such directory"),
                             ({"command": ["/bin/true"], "cwd": "/root"}, "no such directory that uid")):
            code, out, raw = call_as(user, agent.sock, "POST", "/v1/jobs", spec)
            assert code == 400 and needle in out["error"], (spec, raw)
        code, job, raw = call_as(user, agent.sock, "POST", "/v1/jobs",
                                 {"command": ["sh", "-c", "pwd"], "cwd": "/tmp", "env": {"PATH": "/nonexistent::/bin"}})
        assert code == 201, raw
        final = wait_until(lambda: (j := agent.json("job", "show", job["id"]))["state"] == "exited" and j, 30,
                           "the job to end", agent.log)
        assert final["exit_code"] == 0 and Path(job["log"]).read_text() == "/tmp\n"


@pytest.fixture
def open_agent(veth_pair: Any) -> Iterator[AgentProc]:
    """A laminard whose state directory other users can pass (not under pytest's 0700 tmp_path),
    so that a job run as another user reaches its checkpoint directory."""
    import shutil

    base = Path(f"/tmp/lm-t-open-{secrets.token_hex(3)}")
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    a = AgentProc(base, veth_pair.ifname_a, veth_pair.a)
    try:
        a.start()
        yield a
    finally:
        a.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def test_a_checkpoint_entry_linking_into_hung_storage_does_not_stop_the_agent(open_agent: AgentProc) -> None:
    """The agent reads how old a running job's newest checkpoint is (its work at risk) from the
    entries of its checkpoint directory, which the job's owner writes; Airlock asks on every
    tick. A stat that follows the owner's symlink into a hung mount never returns."""
    agent = open_agent
    agent_pid = agent.json("status")["agent"]["pid"]
    with local_user("link") as user, hung_mount() as mnt:
        # Not named like a jobkit checkpoint (ckpt-<n>): the migration layer's own look at those
        # (jobkit.list_checkpoints: is_dir() before is_symlink()) follows such a link too, on the
        # loop when its periodic archive is due; that one is not this module's to fix.
        link = f'ln -s {mnt}/ckpt "$LAMINAR_CKPT_DIR/newest" && echo linked && exec sleep 1000'
        code, job, raw = call_as(user, agent.sock, "POST", "/v1/jobs", {"command": ["/bin/sh", "-c", link]})
        assert code == 201, raw
        wait_until(lambda: Path(job["log"]).read_text() == "linked\n", 30, "the job to make its link")
        # a stop records the work lost, asking how old the newest checkpoint is (Airlock asks too,
        # under pressure): the agent must not wait on the mount for it
        answer: dict[str, Any] = {}

        def stop() -> None:
            answer["stop"] = call_as(user, agent.sock, "POST", f"/v1/jobs/{job['id']}/stop", {"grace_s": 0})

        t = threading.Thread(target=stop, daemon=True)
        t.start()
        t.join(20)
        try:
            code, status = api_json(agent.sock, "GET", "/v1/status", None, timeout=8)
        except TimeoutError:
            pytest.fail(f"the agent stopped answering when asked about {job['id']}, whose checkpoint directory "
                        f"links into hung storage (waiting in FUSE: {waits_in_fuse(agent_pid)})")
        assert code == 200
        t.join(60)
        code, out, raw = answer["stop"]
        assert code == 201 and out["state"] == "stopped", raw
