"""A job's working directory is entered as the job's owner, never on root's rights.

The agent (root) used to chdir into ``--cwd`` before dropping to the caller's uid, so any local
user could open files under directories closed to them (a 0700 home whose ``data/`` is 0755):
``laminarctl submit --cwd /home/alice/data -- cat secrets`` printed alice's file into the
caller's log. Now submit refuses such a directory (naming it and the uid), and the job enters
its directory only after the drop, so a directory closed while the job waited in the queue is
not entered either. Real processes, cgroups and users (nobody); `JobManager` on its own.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobrig import job_manager, until

from laminar.policy import admission
from laminar.runtime.spec import JobError, JobSpec

pytestmark = pytest.mark.kernel

NOBODY = 65534
SECRET = "lm-t root-only secret"


@pytest.fixture
def tree() -> Iterator[Path]:
    """/tmp/lm-t-<hex> (0755) / closed (0700, root) / data (0755) / secret.txt (0644)."""
    top = Path(f"/tmp/lm-t-cwd-{secrets.token_hex(3)}")
    top.mkdir()
    try:
        os.chmod(top, 0o755)
        (top / "closed" / "data").mkdir(parents=True)
        os.chmod(top / "closed", 0o700)
        os.chmod(top / "closed" / "data", 0o755)
        (top / "closed" / "data" / "secret.txt").write_text(SECRET)
        os.chmod(top / "closed" / "data" / "secret.txt", 0o644)
        (top / "open").mkdir()
        os.chmod(top / "open", 0o755)
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)



def test_cwd_is_entered_as_the_owner(tmp_path: Path, tree: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            closed = str(tree / "closed" / "data")
            # 1. refused at submit, naming the directory and the uid; nothing stored
            with pytest.raises(JobError, match=f"cwd '{closed}': no such directory that uid {NOBODY} may enter"):
                await jobs.submit(JobSpec(["cat", "secret.txt"], cwd=closed).validate(), NOBODY, NOBODY)
            # ... and with the same words as a directory that does not exist there: the answer does
            # not tell the user what lies in a directory closed to them
            with pytest.raises(JobError) as absent:
                await jobs.submit(JobSpec(["true"], cwd=str(tree / "closed" / "nope")).validate(), NOBODY, NOBODY)
            with pytest.raises(JobError) as present:
                await jobs.submit(JobSpec(["true"], cwd=closed).validate(), NOBODY, NOBODY)
            assert str(absent.value).replace("nope", "data") == str(present.value)
            # the same for a command looked up in a PATH directory closed to the user
            (tree / "closed" / "data" / "lm-t-tool").write_text("#!/bin/sh\n")
            os.chmod(tree / "closed" / "data" / "lm-t-tool", 0o755)
            for name in ("lm-t-tool", "lm-t-none"):
                with pytest.raises(JobError, match="not found in PATH"):
                    await jobs.submit(JobSpec([name], env={"PATH": closed}).validate(), NOBODY, NOBODY)
            assert jobs.list() == []
            # root's own jobs still go anywhere
            mine = await jobs.submit(JobSpec(["cat", "secret.txt"], cwd=closed).validate())
            await jobs.wait(mine.id, 30)
            assert mine.log_path is not None and SECRET in mine.log_path.read_text()
            # 2. an open directory works for the owner, and is its working directory
            ok = await jobs.submit(JobSpec(["sh", "-c", "pwd; id -u"], cwd=str(tree / "open")).validate(), NOBODY, NOBODY)
            await jobs.wait(ok.id, 30)
            done = jobs.get(ok.id)
            assert done is not None and done.exit_code == 0, done
            assert ok.log_path is not None and ok.log_path.read_text().split() == [str(tree / "open"), str(NOBODY)]
            # 3. closed while the job waited in the queue: the job cannot enter it at its start
            jobs.set_admission(lambda: admission.Limits({"transient": 100}))
            hold = await jobs.submit(JobSpec(["sleep", "600"], memory_mb=100, job_class="transient").validate())
            os.chmod(tree / "closed", 0o755)
            late = await jobs.submit(JobSpec(["cat", "secret.txt"], cwd=closed, memory_mb=100,
                                             job_class="transient").validate(), NOBODY, NOBODY)
            assert late.state == "queued"
            os.chmod(tree / "closed", 0o700)
            await jobs.stop(hold.id, "make room", grace_s=0)
            assert await until(lambda: (j := jobs.get(late.id)) is not None and j.state == "exited", 30), jobs.get(late.id)
            log = late.log_path.read_text() if late.log_path is not None else ""
            assert SECRET not in log, log
            assert "cannot enter" in log, log
            assert jobs.get(late.id).exit_code == 126  # type: ignore[union-attr]

    asyncio.run(main())
