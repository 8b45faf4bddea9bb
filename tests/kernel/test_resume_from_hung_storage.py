"""A job whose ``resume_from`` lies on storage that stops answering (the archive, any NFS or FUSE
mount whose server is gone) neither stops the agent nor hangs its submit.

Every place the agent touches a job's ``resume_from`` at submit, start or claim:

- a local submit (``POST /v1/jobs``, ``laminarctl submit --resume-from``): the path is handed
  to the job as ``LAMINAR_RESUME_FROM`` and never opened by the agent (the job reads it);
- a placement through the zone (``POST /v1/placements``; a hand-over of a moved, requeued or
  taken-over job is the same call on the destination): ``check_resume`` verifies the checkpoint
  in a worker thread, in a child process killed after ``VERIFY_STALL_S`` without progress (for a
  root job too, 50fc924), which then refuses it naming the path (that bound and its text:
  tests/kernel/test_verify_as_owner_hang.py);
- a claim from the archive (``Takeover.resume_here``): its copy for the job's owner runs on the archive's
  lane (tests/kernel/test_archive_hung_storage.py, tests/cluster/test_archive_hung_reclaim.py).

Here, for real: a checkpoint on a FUSE mount (tests/fuserig.py) whose server is stopped; a local
submit naming it answers and the job runs; a placement naming it waits for its check while the
agent answers, flips its kill switch and starts other jobs; once the storage answers, the check
ends and the job is placed with the path it named.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, api_json, wait_until
from fuserig import eio_mount

from laminar.jobkit import Checkpointer

pytestmark = pytest.mark.kernel

# Bounds for the suite only (how long a look may take before the test gives up): generous.
ANSWER_S = 20.0
WAIT_S = 60.0
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def checks_of(path: Path) -> list[int]:
    """The processes whose command line names ``path`` (the agent's check of it)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(path).encode() in argv and b"-c" in argv:
                out.append(int(d.name))
    return out


def call(a: AgentProc, method: str, route: str, body: Any) -> Any:
    """The agent's answer (2xx) through its control socket; fails the test when it does not answer
    within ANSWER_S (an agent whose loop waits on the hung storage)."""
    try:
        code, out = api_json(a.sock, method, route, json.dumps(body) if body is not None else None, timeout=ANSWER_S)
    except TimeoutError:
        pytest.fail(f"{method} {route}: no answer within {ANSWER_S} s (the agent waits on the hung storage)\n"
                    f"--- agent log ---\n{a.log()}")
    assert 200 <= code < 300, (code, out)
    return out


def test_a_resume_from_on_hung_storage_neither_stops_the_agent_nor_hangs_a_submit(
        veth_pair: Any, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    Checkpointer(job_id="lm-t-resume-hung", ckpt_dir=backing / "ckpts", install_signal=False).save(
        b"weights" * 4096, step=5)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lm-t-resume")
    with eio_mount(backing) as fs:
        a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
        try:
            a.start()
            path = fs.path / "ckpts" / "ckpt-5"
            fs.hang()

            # a local submit: handed to the job, never opened by the agent
            job = call(a, "POST", "/v1/jobs", {"command": SLEEP, "name": "lm-t-resume-local",
                                               "resume_from": str(path)})
            wait_until(lambda: a.json("job", "show", job["id"])["state"] == "running", WAIT_S, "the local job running",
                       a.log)

            # a placement through the zone: its check waits on the storage, off the agent's loop
            placed = pool.submit(api_json, a.sock, "POST", "/v1/placements",
                                 json.dumps({"spec": {"command": SLEEP, "name": "lm-t-resume-placed",
                                                      "resume_from": str(path)}}), 300.0)
            wait_until(lambda: checks_of(path), WAIT_S, f"the agent's check of {path}", a.log)
            assert not placed.done()
            call(a, "GET", "/v1/status", None)
            a.ctl("killswitch", "on", "--all", timeout=ANSWER_S)
            assert a.json("killswitch", "status")["global"]["flags"] != []
            a.ctl("killswitch", "off", "--all", timeout=ANSWER_S)
            other = call(a, "POST", "/v1/jobs", {"command": SLEEP, "name": "lm-t-resume-other"})
            wait_until(lambda: a.json("job", "show", other["id"])["state"] == "running", WAIT_S, "another job running",
                       a.log)
            assert checks_of(path) and not placed.done()  # (still waiting on the storage meanwhile)

            fs.heal()
            code, out = placed.result(timeout=WAIT_S)
            assert code == 201 and out["outcome"] == "placed", (code, out)
            shown = a.json("job", "show", out["job_id"])
            assert shown["spec"]["resume_from"] == str(path), shown
            wait_until(lambda: a.json("job", "show", out["job_id"])["state"] == "running", WAIT_S,
                       "the placed job running", a.log)
        finally:
            fs.heal()  # the agent stops with its storage answering
            pool.shutdown(wait=True)
            a.cleanup()


# periodic copies due (prestage_unannounced 0), a round every 0.2 s, stalled after 3 x 0.5 s without progress
MIGRATE = "[migrate]\narchive_dir = \"{arch}\"\npoll_s = 0.2\narchive_gc_s = 0.5\nprestage_unannounced = 0\n"


def test_a_job_resuming_from_other_hung_storage_does_not_stall_the_archive(veth_pair: Any, tmp_path: Path) -> None:
    """The archive's round looks for each running job's newest checkpoint to copy (before the job
    wrote one: the one it resumed from). A ``resume_from`` the agent did not give (a user's own,
    on storage of theirs that hangs) is not looked at there: the archive's one thread would
    wait on it, and every claim, publish and sweep (a reclaim's copy too) with it."""
    arch = tmp_path / "archive"
    arch.mkdir()
    backing = tmp_path / "backing"
    Checkpointer(job_id="lm-t-resume-hung", ckpt_dir=backing / "ckpts", install_signal=False).save(
        b"weights" * 4096, step=5)
    with eio_mount(backing) as fs:
        a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a, extra_toml=MIGRATE.format(arch=arch))
        try:
            a.start()
            fs.hang()
            job = call(a, "POST", "/v1/jobs", {"command": SLEEP, "name": "lm-t-resume-own",
                                               "resume_from": str(fs.path / "ckpts" / "ckpt-5")})
            wait_until(lambda: a.json("job", "show", job["id"])["state"] == "running", WAIT_S, "the job running", a.log)
            rounds = call(a, "GET", "/v1/status", None)["migrate"]["archive"]["rounds"]
            wait_until(lambda: call(a, "GET", "/v1/status", None)["migrate"]["archive"]["rounds"] >= rounds + 10,
                       WAIT_S, "archive rounds going on", a.log)
            assert call(a, "GET", "/v1/status", None)["migrate"]["archive"]["stalled_s"] is None
        finally:
            fs.heal()
            a.cleanup()
