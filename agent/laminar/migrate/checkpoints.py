"""The jobs' checkpoints as a move sees them (:class:`Checkpoints`, a part of
:class:`laminar.migrate.reclaim.ReclaimComponent`: its ``checkpoints``).

A move and a prestage need a job's newest verified checkpoint and its transfer manifest, built
in one read beside the check of the job's own manifest (:meth:`Checkpoints.checked_manifest`):
by way of the checkpoint driver's check of the job's listing when there is one
(:meth:`Checkpoints.newest_checked_once`, :meth:`Checkpoints.driver_checked`), else listed and
checked here, off the loop, in the job's owner's lane (:meth:`Checkpoints.check_now`,
:meth:`Checkpoints.tools`); a move waits for the new checkpoint it asked for
(:meth:`Checkpoints.wait_new`). The plan's size of a job that has not checkpointed yet is the
memory it holds, GPU memory included (:meth:`Checkpoints.ckpt_bytes`; NVML read in
:meth:`Checkpoints.tick`, at most every GPU_MEM_EVERY_S). Whether a job prestages is the pure
rule :func:`laminar.policy.prestage.should_prestage`, given its facts here
(:meth:`Checkpoints.should_prestage`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar import jobkit
from laminar.airlock.cgroups import CgroupError
from laminar.migrate import ckpt_driver
from laminar.migrate.constants import DEFAULT_CKPT_BYTES
from laminar.migrate.mover import _same_files
from laminar.migrate.transfer import DEFAULT_CHUNK, Manifest, TransferError, build_manifest
from laminar.offloop import Lane, LaneBusy
from laminar.policy import prestage
from laminar.runtime.ckpt_scan import CkptScanner

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.ckpt_driver import CkptDriver
    from laminar.migrate.evacuation import Evacuation
    from laminar.migrate.evidence import Evidence

log = logging.getLogger("laminar.migrate")

GPU_MEM_EVERY_S = 10.0  # NVML's GPU memory per process read at most this often (planning sizes)

# The look at whether a checked checkpoint's files are still those checked (a stat of each, in
# the job's directory: in its owner's lane, never longer than this).
SAME_FILES_S = 10.0


class CheckpointsHost(Protocol):
    """What :class:`Checkpoints` uses of the component that holds it (ReclaimComponent and its parts)."""

    agent: MigrateAgent
    evidence: Evidence
    ckpt: CkptDriver | None
    evacuating: set[str]
    evacuation: Evacuation
    s: dict[str, Any]

    def job_key(self, job: Any) -> str: ...
    @property
    def zone(self) -> Any: ...


class Checkpoints:
    """A move's view of the jobs' checkpoints, and their planning sizes (see the module's doc): a part of
    :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``checkpoints``). ``host``: the component."""

    def __init__(self, host: CheckpointsHost) -> None:
        self.host = host
        self._gpu_mem: dict[int, int] = {}  # pid -> GPU bytes, NVML's last read (tick)
        self._gpu_mem_at = -math.inf
        # a checkpoint listing and check lane for a component without the checkpoint driver
        self._own_ckpt_tools: tuple[CkptScanner, Lane] | None = None

    def ckpt_bytes(self, job: Any) -> int:
        """Size of the job's newest checkpoint (the planning size of its next one). A job that
        has not checkpointed yet is planned at the memory it holds (its cgroup's, less clean
        page cache: the state it could write is in there), plus, for a job with GPUs, the GPU
        memory NVML attributes to the processes in its cgroup (its state is mostly there, which
        the cgroup does not count), at least DEFAULT_CKPT_BYTES: a reclaim that planned a 1 GiB
        job as 64 MiB asked for its checkpoint too late for the transfer, and the job was lost
        at the window's end. Planning too large only asks earlier; the move is ranked again
        with the checkpoint's real size."""
        verified = self.host.ckpt.verified_bytes(job) if self.host.ckpt is not None and job.ckpt_dir else None
        if verified is not None:  # by its verified manifest: never a stat of the job's files
            return verified or DEFAULT_CKPT_BYTES
        held = 0
        cg = getattr(job, "cgroup", None)
        if cg is not None and getattr(job, "active", False):
            try:
                held = int(cg.memory_in_use())
            except (OSError, ValueError, CgroupError):  # gone meanwhile, or no memory controller
                held = 0
            if getattr(job, "gpus", None):
                held += self._gpu_memory(cg)
        return max(DEFAULT_CKPT_BYTES, held)

    def _gpu_memory(self, cg: Any) -> int:
        """GPU memory (bytes) NVML attributed to the processes in the cgroup ``cg`` at its last
        read (:meth:`tick`; never NVML itself here: this runs on the event loop, and
        an NVML init can take a driver's start-up); 0 where NVML or the cgroup cannot tell (the
        plan then goes by the cgroup's memory alone)."""
        try:
            pids = set(cg.pids())
        except (OSError, ValueError, CgroupError):
            return 0
        return sum(v for pid, v in self._gpu_mem.items() if pid in pids)

    async def tick(self, now: float) -> None:
        """Reads NVML's GPU memory per process, in a worker thread, at most every
        GPU_MEM_EVERY_S (by the monotonic clock; ``now``, the watch's wall clock, is not read), and
        only while a job with GPUs has no checkpoint yet (the one case
        :meth:`ckpt_bytes` needs it)."""
        jobs = self.host.agent.jobs
        if jobs is None or time.monotonic() - self._gpu_mem_at < GPU_MEM_EVERY_S:
            return
        self._gpu_mem_at = time.monotonic()  # the checkpoint listings below too: not every round
        listed = self.host.ckpt.listed if self.host.ckpt is not None else (lambda j: None)
        if not any(getattr(j, "gpus", None) and not (j.ckpt_dir and listed(j)) for j in jobs.active()):
            self._gpu_mem = {}
            return
        from laminar.runtime import gpus

        self._gpu_mem = await asyncio.to_thread(gpus.nvml_process_memory)

    def should_prestage(self, job: Any) -> bool:
        mode = self.host.s["prestage"]
        if mode != "auto":  # the mode decides alone: no fact is read (as before the rule moved)
            return prestage.should_prestage(mode, False)
        w = float(self.host.s["expected_notice_s"])
        return prestage.should_prestage(mode, lambda: self.host.evacuation.fits_window(job, w), window_s=w,
                                        unannounced_frac=self.host.evidence.notice_odds.unannounced_frac,
                                        unannounced_threshold=float(self.host.s["prestage_unannounced"]))

    async def wait_new(self, job: Any, after: Path | None, timeout: float,
                               found: Callable[[Path], object] | None = None,
                               alive: Callable[[], bool] | None = None) -> tuple[Path | None, Manifest | None]:
        """The job's first verified checkpoint newer than ``after`` and its transfer manifest,
        or (None, None) after ``timeout`` (or once the job is gone, or ``alive()`` is false);
        hashed off the event loop (:func:`ckpt_driver.wait_new_checkpoint`; ``found`` is called
        with each one before its check). The check is the manifest's build, which checks the
        files against the job's manifest while it hashes the chunks (one read, the two hashes
        side by side): the move then sends without hashing the checkpoint again."""
        built: dict[Path, Manifest] = {}

        def check(p: Path) -> None:
            try:
                built[p] = self.checked_manifest(job, p)
            except TransferError as e:  # corrupt, or saved again while it was read: not this one
                raise jobkit.CheckpointError(str(e)) from None

        scan, lane = self.tools()
        new = await ckpt_driver.wait_new_checkpoint(job.ckpt_dir, after, timeout,
                                                    lambda: bool(job.active) and (alive is None or alive()),
                                                    check=check, found=found, job=job, scanner=scan, lane=lane,
                                                    settings=self.host.s)
        return new, None if new is None else built.get(new)

    def checked_manifest(self, job: Any, p: Path) -> Manifest:
        """The transfer manifest of ``job``'s checkpoint ``p``, its files checked against the
        job's manifest beside the chunks' hashes (one read of each byte by each, in threads):
        a send given it hashes nothing again. Blocking (callers run it in a thread). Raises
        TransferError (corrupt, or saved again while it was read) or OSError."""
        return build_manifest(p, self.host.job_key(job), int(self.host.s.get("chunk_kb", DEFAULT_CHUNK >> 10)) << 10)

    def driver_checked(self, job: Any) -> tuple[Path | None] | None:
        """(``job``'s newest verified checkpoint, or None: none verified) as the checkpoint
        driver's last check of the job's listing found it, while that listing holds; None when
        there is no such check (:meth:`ckpt_driver.CkptDriver.checked`). Lists the job's
        checkpoint directory (no checkpoint is read)."""
        hit = self.host.ckpt.checked(job) if self.host.ckpt is not None and job.ckpt_dir else None
        return None if hit is None else (hit[0],)

    def prestage_manifest(self, job: Any) -> bool:
        """Whether the checkpoint driver's check of ``job``'s new checkpoints should build their
        transfer manifest (:meth:`_newest_checked`): this agent prestages the job now."""
        return (self.host.zone is not None and self.host.s["prestage"] != "off" and job.id not in self.host.evacuating
                and self.should_prestage(job))

    async def newest_checked_once(self, job: Any) -> tuple[Path | None, Manifest | None]:
        """:meth:`_newest_checked` by way of the checkpoint driver's check of ``job``'s listing
        (:meth:`ckpt_driver.CkptDriver.check`: done once, whoever asks first, with the manifest
        for a job this agent prestages), when it found a checkpoint and built its manifest and
        the checkpoint's files are still the ones it read (the same inode, size and mtime:
        :func:`_same_files`); else built here, in a thread."""
        if self.host.ckpt is not None and job.ckpt_dir:
            ckpt, m = await self.host.ckpt.check(job, manifest=True)
            if ckpt is not None and m is not None:
                scan, lane = self.tools()
                try:  # a stat of each of the job's files: the job's storage, in its owner's lane
                    m = await lane.run(getattr(job, "owner_uid", 0), _same_files, m, ckpt, timeout_s=SAME_FILES_S)
                except (TimeoutError, LaneBusy):
                    return None, None
                if m is not None:
                    return ckpt, m
        got, built, _ = await self.check_now(job, manifest=True)
        return got, built

    def tools(self) -> tuple[CkptScanner, Lane]:
        """The checkpoint driver's scanner and check lane (the job manager's scanner, which
        Airlock reads too), or, for a component without a driver, ones of its own."""
        if self.host.ckpt is not None:
            return self.host.ckpt.scan, self.host.ckpt.lane
        if self._own_ckpt_tools is None:
            scan = getattr(self.host.agent.jobs, "ckpt_scan", None) or CkptScanner()
            self._own_ckpt_tools = (scan, Lane("ckpt-verify", workers=ckpt_driver.VERIFY_WORKERS,
                                               timeout_s=float(self.host.s.get("verify_timeout_s",
                                                                          ckpt_driver.VERIFY_TIMEOUT_S))))
        return self._own_ckpt_tools

    async def check_now(self, job: Any, manifest: bool) -> tuple[Path | None, Manifest | None, Any]:
        """``job``'s newest checkpoint that passes its check, the transfer manifest the check
        built (``manifest``) and what it found (:class:`ckpt_driver.Checked`), or (None, None,
        None): listed and checked off the loop, in the job's owner's lanes, within the settings'
        limits (:func:`ckpt_driver.check_newest`); a listing or check that does not finish in
        time finds none."""
        if not job.ckpt_dir:
            return None, None, None
        scan, lane = self.tools()
        listing = await scan.refresh(job)
        if listing is None or not listing.ckpts:
            return None, None, None
        build = (lambda p: self.checked_manifest(job, p)) if manifest else None
        try:
            return await lane.run(getattr(job, "owner_uid", 0), ckpt_driver.check_newest, listing.paths(), self.host.s,
                                  build)  # type: ignore[no-any-return]
        except (TimeoutError, LaneBusy) as e:
            log.info("migrate: %s: checking its checkpoints: %s", job.id, e)
            return None, None, None
