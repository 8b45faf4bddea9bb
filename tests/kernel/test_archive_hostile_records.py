"""A real agent whose archive holds files planted to stop it (issue 31, item 5; the audit's A6):
a FIFO where a keeper record is read, JSON nested past the parser's limit, a 50 MB record, and a
key directory that is a link into a FUSE mount whose server is stopped (every open, stat or
listing through it waits in the kernel, unkillably). The agent's archive rounds go on (each
file refused and counted by reason; the link never followed, so no thread of the agent waits on
the hung mount), its status reports no stall, and meanwhile root's ``status`` and
``killswitch`` keep answering within the liveness bound (tests/liveness.py).

Before: the FIFO's open waited for a writer, holding the archive's one thread (every claim,
publish and sweep behind it; the status said "stalled" as if the NFS server were down); the
deep JSON raised RecursionError out of every round; the link was followed by the round's globs
into the hung mount.

The hung storage is real (tests/fuserig.py: a FUSE mount whose server is SIGSTOPped).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until
from fuserig import eio_mount, fuse_waiters
from liveness import RootLiveness

pytestmark = pytest.mark.kernel

MIGRATE = "[migrate]\narchive_dir = \"{arch}\"\npoll_s = 0.2\narchive_gc_s = 0.5\n"
WAIT_S = 60.0


def migrate_status(a: AgentProc) -> dict[str, Any]:
    return dict(a.json("status")["migrate"])


def test_planted_records_and_a_link_into_a_hung_mount_stop_no_round(veth_pair: Any, tmp_path: Path) -> None:
    arch = tmp_path / "archive"
    arch.mkdir()
    os.chmod(arch, 0o755)
    backing = tmp_path / "backing"
    backing.mkdir()
    (backing / "guard.json").write_text("{}")
    with eio_mount(backing) as fs:
        a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a, extra_toml=MIGRATE.format(arch=arch))
        try:
            # what someone who can write the share plants (as root on another host: the owner and
            # mode of what it makes look like an agent's)
            for i in range(1, 4):
                (arch / f"n5-job-{i}").mkdir(mode=0o700)
            os.mkfifo(arch / "n5-job-1" / "guard.json")
            (arch / "n5-job-2" / "guard.json").write_text("[" * 200_000)
            with open(arch / "n5-job-3" / "guard.json", "wb") as f:
                f.truncate(50 << 20)
            os.symlink(fs.path, arch / "n5-job-4")  # a key directory: a link into the mount
            fs.hang()

            a.start()
            job = a.json("submit", "--name", "lm-t-archive-hostile", "--", "sleep", "600")
            wait_until(lambda: a.json("job", "show", job["id"])["state"] == "running", WAIT_S, "the job running",
                       a.log)
            with RootLiveness(a.sock, job["id"]) as live:
                start = migrate_status(a)["archive"]["rounds"]
                wait_until(lambda: migrate_status(a)["archive"]["rounds"] >= start + 15, WAIT_S,
                           "15 more archive rounds", a.log)
            live.check(bound_s=2.0)
            st = migrate_status(a)
            counts = st["counts"]
            for reason in ("not_regular", "bad_json", "too_large", "link"):
                assert counts.get(f"archive_unverified_{reason}", 0) == 1, (reason, counts)  # once per file
            assert st["archive"]["stalled_s"] is None, st["archive"]
            assert {r["reason"] for r in st["archive"]["refused"]} >= {"not_regular", "bad_json", "too_large", "link"}
            assert fuse_waiters(a.proc.pid) == []  # no thread of the agent waits on the hung mount
            time.sleep(1.0)  # a few more rounds and sweeps: still nothing counted twice, nothing waits
            assert migrate_status(a)["counts"].get("archive_unverified_not_regular") == 1
            assert fuse_waiters(a.proc.pid) == []
            assert (arch / "n5-job-1" / "guard.json").exists() and os.path.islink(arch / "n5-job-4")  # left as they are
        finally:
            fs.heal()  # the agent stops with its storage answering
            a.cleanup()
