"""The checkpoint signal never kills a job: real processes in real cgroups.

``JobManager.request_checkpoint`` is what the loan return, the reclaim and Airlock's
re-address send a job before moving it. SIGUSR1's default action kills, so a job whose main
process has no handler (still starting, or without the checkpoint contract) is not signalled
(``SigCgt`` of /proc/<pid>/status); one that catches it is.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from jobrig import job_manager, until

from laminar.runtime.signals import catches_signal
from laminar.runtime.spec import JobSpec

pytestmark = pytest.mark.kernel

CATCHER = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *a: open(sys.argv[1], "w").write("checkpointed"))
while True:
    time.sleep(0.05)
"""



def test_request_checkpoint_signals_only_a_job_that_catches_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            plain = await jobs.submit(JobSpec(["sleep", "600"], name="lm-plain").validate())
            out = tmp_path / "catcher.out"
            catcher = await jobs.submit(JobSpec([sys.executable, "-c", CATCHER, str(out)], name="lm-catch").validate())
            assert plain.pid and catcher.pid
            assert not catches_signal(plain.pid, "SIGUSR1")
            assert jobs.request_checkpoint(plain) is False
            await asyncio.sleep(0.3)
            assert jobs.get(plain.id).state == "running"  # not killed by a SIGUSR1 it does not catch
            assert await until(lambda: catches_signal(catcher.pid, "SIGUSR1"), 20), "the catcher's handler"
            assert jobs.request_checkpoint(catcher) is True
            assert await until(lambda: out.exists() and out.read_text() == "checkpointed", 10)
            assert jobs.get(catcher.id).state == "running"

    asyncio.run(main())
