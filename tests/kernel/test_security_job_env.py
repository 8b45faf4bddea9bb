"""A user's job env must never reach a process that still runs as root.

The agent starts a job through a pre-exec step that runs as root (join the job's cgroups, set
its oom_score_adj), then drops to the job's owner and execs the command. The job's env
(``spec.env``, the submitter's to choose) must only apply after the drop: a ``PATH`` or a
``LD_PRELOAD`` seen by the root step makes it run the submitter's code as root, with the agent's
capabilities: any local user becomes root.

A real laminard, a real second user (tests/userrig.py), a real preload library built with the
C compiler. Each probe records the uid it ran as; none may be 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agentproc import AgentProc, wait_until
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel

PRELOAD_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void lm_probe(void) {
    const char *out = getenv("LMT_PROBE_OUT");
    if (!out) return;
    int fd = open(out, O_WRONLY | O_APPEND | O_CREAT, 0666);
    if (fd < 0) return;
    char line[32];
    int n = snprintf(line, sizeof line, "%u\n", (unsigned)geteuid());
    write(fd, line, (size_t)n);
    close(fd);
}
"""


@pytest.fixture
def probe_dir() -> Iterator[Path]:
    """A directory every user may read and write (the probes write into it), removed after."""
    d = Path(f"/tmp/lm-sec-env-{os.getpid()}-{os.urandom(2).hex()}")
    d.mkdir()
    os.chmod(d, 0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def uids_seen(out: Path) -> list[int]:
    try:
        return [int(x) for x in out.read_text().split()]
    except (OSError, ValueError):
        return []


def submit_and_wait(agent: AgentProc, user: object, env: dict[str, str]) -> dict[str, object]:
    status, job, raw = call_as(user, agent.sock, "POST", "/v1/jobs",  # type: ignore[arg-type]
                               {"name": "lm-sec-env", "command": ["/bin/sleep", "60"], "env": env})
    assert status == 201, raw
    wait_until(lambda: agent.json("job", "show", job["id"])["state"] == "running", 30, "the job to run")
    return job


def test_a_users_path_is_not_searched_as_root(agent: AgentProc, probe_dir: Path) -> None:
    out = probe_dir / "uids"
    fake = probe_dir / "setpriv"  # what the root step looks up by name
    fake.write_text(f'#!/bin/sh\n/usr/bin/id -u >> {out}\nexec /usr/bin/setpriv "$@"\n')
    os.chmod(fake, 0o755)
    with local_user("envpath") as user:
        job = submit_and_wait(agent, user, {"PATH": f"{probe_dir}:/usr/bin:/bin"})
        assert job["owner_uid"] == user.uid
        time.sleep(0.5)
        assert 0 not in uids_seen(out), f"a program from the user's PATH ran as root: {uids_seen(out)}"


def test_a_users_ld_preload_is_not_loaded_as_root(agent: AgentProc, probe_dir: Path) -> None:
    cc = shutil.which("clang") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src, lib, out = probe_dir / "probe.c", probe_dir / "probe.so", probe_dir / "uids"
    src.write_text(PRELOAD_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    os.chmod(lib, 0o755)
    out.touch()
    os.chmod(out, 0o666)  # whoever loads the probe first, every later process may append
    with local_user("envpreload") as user:
        submit_and_wait(agent, user, {"LD_PRELOAD": str(lib), "LMT_PROBE_OUT": str(out)})
        # the job itself loads it, as its owner: the probe works, and the check below can fail
        wait_until(lambda: user.uid in uids_seen(out), 30, "the job (as its owner) to load the preload")
        assert 0 not in uids_seen(out), f"the user's LD_PRELOAD was loaded by a root process: {uids_seen(out)}"
