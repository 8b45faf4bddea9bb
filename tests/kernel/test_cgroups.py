"""JobCgroup on this host's real hierarchy: create, attach, freeze/thaw, limit, id, kill, remove."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest

from laminar.airlock.cgroups import CgroupTree, detect

pytestmark = pytest.mark.kernel


def test_job_cgroup_lifecycle() -> None:
    h = detect()
    tree = CgroupTree(h, f"laminar-t-{secrets.token_hex(3)}")
    proc = None
    try:
        tree.ensure()
        cg = tree.job("transient", "j1")
        cg.create()
        cg.set_memory_limit(64 << 20, oom_kill_disable=h.mode == "hybrid")
        assert cg.memory_limit() == 64 << 20
        # The cgroup id is the cgroup2 directory's inode: what /proc/<pid>/cgroup and BPF see.
        assert cg.cgroup_id == os.stat(cg.unified).st_ino
        files = [str(f) for f in cg.procs_files()]
        # The process joins, then touches 8 MiB of its own: memory charged inside the cgroup.
        script = ('for f in "$@"; do echo $$ > "$f"; done; exec "$0" -c '
                  '"import time; b = bytearray(8 << 20); time.sleep(60)"')
        proc = subprocess.Popen(["/bin/sh", "-c", script, sys.executable, *files])
        deadline = time.monotonic() + 5
        while proc.pid not in cg.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cg.pids() == [proc.pid] and cg.populated()
        text = open(f"/proc/{proc.pid}/cgroup").read()
        assert f"0::/{tree.root_name}/transient/j1" in text
        assert cg.freeze() and cg.frozen()
        assert open(f"/proc/{proc.pid}/stat").read().split()[2] in ("S", "D", "T", "t")
        assert cg.thaw() and not cg.frozen()
        deadline = time.monotonic() + 5
        while cg.memory_usage() < 8 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cg.memory_usage() >= 8 << 20
        cg.kill()
        assert proc.wait(5) == -9
        deadline = time.monotonic() + 5
        while cg.populated() and time.monotonic() < deadline:
            time.sleep(0.01)
        cg.remove()
        assert not cg.unified.exists() and not cg.memory_dir.exists()
    finally:
        if proc and proc.poll() is None:
            proc.kill()
        tree.purge()
    assert not (h.unified / tree.root_name).exists()
