"""The reclaim contract and migration between agents (``agent.migrate``).

An owner (or an inference scheduler) takes a node back with a notice window::

    laminarctl reclaim --notice 60s              # this node
    laminarctl reclaim --notice 60s --node 4     # node 4 of the zone (forwarded to its agent)
    POST /v1/reclaim {"notice_s": 60, "node": 4, "reason": "owner"}     (privileged)

The reclaimed node's agent then

1. tells the zone (the zone's reclaim notice: it stops taking placements, its peers record the
   window) and arms the kill-switch of every job on the node for the window's end
   (``netguard.arm_job``): whatever still runs then loses its network at once;
2. plans the evacuation with :func:`laminar.policy.ckpt_schedule.notice_schedule` (who is
   signalled when, as late as is safe; transfer deadlines);
3. for each job: sends the checkpoint signal, waits for the job's new checkpoint (jobkit's
   layout in ``LAMINAR_CKPT_DIR``), freezes the job as soon as it is there (steps after the
   checkpoint would be lost anyway), checks it against its manifest while it builds the
   transfer manifest (one read), ranks the zone's nodes with
   :func:`laminar.policy.destination.rank` (resource fit from their summaries, whether the
   transfer fits what is left of the window, survival from the hazard model, zone topology),
   reserves the best through the zone (probe, offer, commit), sends the checkpoint to the
   destination's transfer endpoint (:mod:`laminar.migrate.transfer`: authenticated, chunked,
   resumable; registered with the shaper, ``agent.transfers``, with the window's deadline; what
   is sent is a snapshot under ``<root>/outgoing/``: hard links to, or copies of, the job's
   regular files only, never read through a link or opened as a pipe or device, since the job's
   user may swap a file after it was verified; snapshots a crash left there go at start),
   hands the job spec over with ``resume_from`` naming the verified checkpoint *on the
   destination*, and stops its own copy (state ``migrated``). The destination verifies the
   checkpoint again before the job starts there with ``LAMINAR_RESUME_FROM``;
4. at the window's end, stops whatever is still running (state ``reclaimed``).

The reclaim is stored with its window's end in wall-clock time (table ``migrate_reclaim``) and by
the boot's clock (:func:`drain.window_left`: a step of the wall clock does not move it): an
agent restarted inside the window restores it (queue hold, draining, kill-switch, the evacuation
of what has not moved; nothing that must not run twice runs twice: :meth:`ReclaimComponent._begin_reclaim`),
and one started after the window ended clears it (the owner gave the node back), with an event.

The component is :class:`ReclaimComponent`, in parts: this module has the reclaim, the moves and the
storage holders; it holds :class:`laminar.migrate.buddies.Prestage` (its ``prestage``: prestaging,
buddies and releases, *When the source dies*), and its other parts: :mod:`laminar.migrate.archive`
the archive, the guard of last resort (``archive_dir``: stopped jobs' and periodic checkpoints,
claims, the sweep, a hung archive); :mod:`laminar.migrate.guard` a guard's take-over of a
dead source's job (*The retrying guard*); :mod:`laminar.migrate.replicas` the replicas held here
(what goes, the guard's check with its source, the operator's view and drop);
:mod:`laminar.migrate.withdraw` a reclaim withdrawn (*A reclaim withdrawn*);
:mod:`laminar.migrate.settle` an operator's settle of an unanswered hand-over. The tunables more
than one part of the component uses are in :mod:`laminar.migrate.constants`, its errors in
:mod:`laminar.migrate.errors`. The component's tables are in :mod:`laminar.migrate.schema`.

**A move cut during its hand-over.** Once a hand-over's frame may have reached the destination, no
answer is never taken for a refusal (:meth:`Guard.handover` with ``confirm``): the
same hand-over (idempotent by placement id there) is sent again until the destination says
whether it runs the job, which stays frozen here meanwhile; then it is stopped here (it runs
there) or thawed (it does not). A move without a window (a loan return's :meth:`ReclaimComponent.move_now`,
Airlock's :meth:`ReclaimComponent.readdress`) is recorded before its freeze and before its
hand-over (table ``migrate_moves``), so a restart settles one the agent's stop or crash cut
the same way (:meth:`ReclaimComponent._restore_moves`): never frozen for good, never two
copies, never none.

**No room anywhere: storage holders.** When no peer can run a job during the window (none has
the GPUs, memory or CPUs free, or every reservation is refused), its final checkpoint still
leaves the node: the agent asks the live peers for their free disk (control message ``space``,
less their ``holder_reserve_mb``), ranks them with :func:`laminar.policy.holder.choose_holder`
(disk, transfer vs what is left of the window, survival, the job's buddy first at equal
odds), sends the checkpoint to the best one (same transfer, shaped to the window), stops the
job (state ``reclaimed``, ``work_lost_s`` = time trained after the checkpoint) and hands that
peer the guard with ``take_over``. The move's phase is ``held``. Prestaging uses a holder too
when no peer has room (the buddy then only stores the replicas).

**A guard reclaimed.** A guard that is itself reclaimed passes every job it holds for a
stopped source (``waiting``, or ``take_over``) on to the best holder among its live peers
(state ``passed``).

A root job's ``resume_from`` outside ``xfer/`` is checked in a child process like another
user's (:func:`verify_as_owner`), bounded by ``VERIFY_STALL_S``.

Progress: events of kind ``migrate`` and ``GET /v1/migrations/{job}`` (what
``laminarctl job show ID --follow`` draws as a progress bar).

Config (``[migrate]``)::

    [migrate]
    port = 7442              # TCP port of the checkpoint transfer endpoint (the same on every node)
    notice_margin = 0.8      # share of a notice window planned transfers may use
    hazard_prior_rate_per_h = 0.0417   # departures per node-hour before any is seen
    spot_traces = ""         # calibrate the hazard from spot traces (a file or directory)
    path_mbit = 1000         # path bandwidth to peers assumed for planning
    rate_mbit = 0            # pace transfers in user space too (0: the shaper only)
    chunk_kb = 1024          # transfer chunk size
    prestage = "auto"        # auto | always | off
    expected_notice_s = 60   # the window "auto" plans for
    dead_after_s = 3         # silence after a notice that declares the source dead
    orphan_after_s = 0       # silence without a notice that does (0: never; a partition doubles jobs until it heals)
    fence_after_s = 0        # hearing no member this long freezes the jobs the zone would resume (0: off; < orphan_after_s)
    holder = true            # no room for a job during a reclaim: its final checkpoint goes to a storage holder
    holder_reserve_mb = 1024 # disk this node keeps free when it offers to hold checkpoints
    retry_base_s = 2         # a guard that finds no room looks again after this, doubling each time
    retry_max_s = 30         # ... up to this
    archive_dir = ""         # storage outside the pool for stopped jobs no live peer can keep (empty: off)
    replica_guard_check_s = 600  # a guard unchanged this long is checked with its source (0: never)
    replica_orphan_s = 21600 # replicas of a key no guard named go after this (>= 3600)
    replica_row_keep_s = 86400   # done replica rows whose directory is gone are deleted after this (>= 3600)
    replica_gc_s = 30        # how often every held replica is looked at
    archive_gc_s = 10        # how often this agent sweeps archive_dir

Between reclaims the component also asks each job for periodic checkpoints at the interval the
hazard sets (:mod:`laminar.migrate.ckpt_driver`, its keys in the same section; the plan is
``GET /v1/checkpoints``, ``laminarctl checkpoints``).

The readdress hook Airlock calls for its re-address rung is :meth:`ReclaimComponent.readdress`
(a move without a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import pwd
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from laminar import jobkit
from laminar.airlock.cgroups import CgroupError, set_frozen_async
from laminar.airlock.cgroups import freeze_counts as cgroup_freeze_counts
from laminar.config import Field, _one_of, _range, register_section
from laminar.migrate import ckpt_driver, drain, ledger
from laminar.migrate.archive import Archive
from laminar.migrate.archive_auth import PRESIGNED, ArchiveAuth, manifest_digest, owner_body
from laminar.migrate.archive_gc import ARCHIVE_GC_S
from laminar.migrate.archive_lane import ArchiveWait, _progress
from laminar.migrate.archive_stopped import ARCHIVE_WAIT_MARGIN_S
from laminar.migrate.buddies import Prestage
from laminar.migrate.constants import (
    DEFAULT_REMAINING_S,
    HOLD_MIN_S,
    MIGRATED_ENV,
    REPLICA_LATE_S,
    WINDOW_ENDED,
    valid_ckpt_name,
    valid_key,
)
from laminar.migrate.errors import HandoverSettled, MigrateError
from laminar.migrate.evidence import EvidenceStore, NoticeOdds
from laminar.migrate.fence import Fence, check_fence_settings
from laminar.migrate.guard import Guard
from laminar.migrate.hazard import (
    DEFAULT_PRIOR_RATE_PER_H,
    HazardError,
    HazardModel,
    calibrate_from_spot_traces,
)
from laminar.migrate.replica_policy import guard_confirmation as guard_confirmation
from laminar.migrate.replica_policy import guard_needed as guard_needed
from laminar.migrate.replica_policy import redact_replica
from laminar.migrate.replica_policy import replica_gc_plan as replica_gc_plan
from laminar.migrate.replica_policy import replica_victims as replica_victims
from laminar.migrate.replicas import RESUME_DIR, Replicas
from laminar.migrate.replicas import RESUME_KEEP_S as RESUME_KEEP_S
from laminar.migrate.schema import MOVES_SCHEMA, RECLAIM_SCHEMA, REPLICAS_SCHEMA, upgrade_moves
from laminar.migrate.settle import Settle
from laminar.migrate.transfer import (
    DEFAULT_CHUNK,
    Committed,
    Flow,
    Manifest,
    PeerSilentError,
    Progress,
    Receiver,
    StatsCollector,
    TransferError,
    build_manifest,
    latest_verified,
    send_checkpoint,
    send_control,
    verified_checkpoint,
)
from laminar.migrate.transfer.manifest import _source_state
from laminar.migrate.trees import _remove_tree
from laminar.migrate.vouch import Vouch
from laminar.migrate.withdraw import Withdraw
from laminar.offloop import Lane, LaneBusy
from laminar.policy import ckpt_schedule as cs
from laminar.policy import custody, prestage
from laminar.policy import destination as dst
from laminar.policy import moves as mp
from laminar.policy.endcause import EndCause
from laminar.policy.holder import HolderCandidate, RetrySchedule, choose_holder
from laminar.runtime.ckpt_scan import CkptScanner
from laminar.runtime.holds import Hold, Holds, holds_of
from laminar.runtime.provenance import request_origin
from laminar.zone import authority as au
from laminar.zone.gate import Gate
from laminar.zone.membership import canonical_ip, listen_check

log = logging.getLogger("laminar.migrate")

DEFAULT_PORT = 7442
DEFAULT_CKPT_BYTES = 64 << 20  # planning size of a job that has not checkpointed yet
# A job writes its checkpoint at its next step boundary: plan for this much until one has been seen.
DEFAULT_CKPT_PAUSE_S = 2.0
TRANSFER_MIN_S = 0.25  # the shortest deadline a late transfer is given
# Exposure accrues every poll; the store is written at most this often for it (a departure is
# written at once). A crash loses at most this much exposure, which only makes the rate a
# little higher (the cautious side).
EVIDENCE_SAVE_S = 60.0
GPU_MEM_EVERY_S = 10.0  # NVML's GPU memory per process read at most this often (planning sizes)
# The prestage rule's fit of all jobs' final checkpoints in a notice window is computed at most
# this often (a prestage round is every poll_s; the sizes it reads change at commits only).
PRESTAGE_FIT_S = 0.25
# How long a move waits for its job to be frozen (or thawed), without blocking the loop.
FREEZE_WAIT_S = 2.0
# The look at whether a checked checkpoint's files are still those checked (a stat of each, in
# the job's directory: in its owner's lane, never longer than this).
SAME_FILES_S = 10.0
# How often every held key is looked at (released, handed over, placed elsewhere, ...): the default
# of ``[migrate] replica_gc_s``.
REPLICA_GC_S = 30.0
# A move's (or a hold's) transfer to a destination that says nothing (transfer.PeerSilentError: no
# connection accepted in CONNECT_TIMEOUT_S, no handshake answer in HANDSHAKE_TIMEOUT_S) tries it
# this many more times, then goes on to the next candidate: one more try covers a lost SYN or a
# busy agent, the transfer's whole ladder (6 tries: ~26 s connecting, ~63 s handshaking) would
# eat most of a notice window. Other errors keep the ladder.
MOVE_SILENT_RETRIES = 1
# A reclaim's notice, cancel or withdrawal from another node dated further than this from this
# node's clock is refused: a replayed or badly delayed message must not reclaim the node.
CONTROL_DATED_S = 60
# The control ops that only a node of ``migrate.reclaim_from`` may send.
RECLAIM_FROM_OPS = ("reclaim", "reclaim-cancel")

CONFIG_FIELDS = {
    "port": Field(int, DEFAULT_PORT, "TCP port of the checkpoint transfer endpoint (the same on every node)",
                  _range(1, 65535)),
    "listen": Field(str, "", "address the transfer endpoint binds and, when it names one address, the one this "
                    "node's transfer connections leave from (peers check it against its zone.nodes entry; "
                    "empty: zone.listen)", listen_check),
    "notice_margin": Field(float, cs.NOTICE_MARGIN, "share of a notice window planned transfers may use",
                           _range(0.1, 1.0)),
    "hazard_prior_rate_per_h": Field(float, DEFAULT_PRIOR_RATE_PER_H, "departures per node-hour before any is seen",
                                     _range(0.0, 100.0)),
    "spot_traces": Field(str, "", "calibrate the hazard model from these spot traces (file or directory)"),
    "path_mbit": Field((int, float), 1000.0, "path bandwidth to peers assumed for planning (Mbit/s)",
                       _range(0.001, 10_000_000)),
    "rate_mbit": Field((int, float), 0.0, "pace checkpoint transfers in user space (Mbit/s; 0: the shaper only)",
                       _range(0, 10_000_000)),
    "chunk_kb": Field(int, 1024, "checkpoint transfer chunk size (KiB)", _range(1, 65536)),
    "prestage": Field(str, "auto", "ship checkpoints to the job's buddy as they are written: auto (when the final "
                      "one would not fit expected_notice_s), always, off", _one_of("auto", "always", "off")),
    "expected_notice_s": Field((int, float), 60.0, "the notice window prestage = auto plans for", _range(0, 86400)),
    "poll_s": Field((int, float), 0.5, "how often checkpoints, replicas and peers are looked at", _range(0.05, 60)),
    "dead_after_s": Field((int, float), 3.0, "zone silence after a reclaim notice that declares the source dead",
                          _range(0.1, 3600)),
    "orphan_after_s": Field((int, float), 0.0, "zone silence without a notice that declares the source dead "
                            "(0: never)", _range(0, 86400)),
    "fence_after_s": Field((int, float), 0.0, "a node that hears no other member of the roster for this long "
                           "freezes the jobs the zone would resume elsewhere (a buddy or an archived copy) until it "
                           "hears one again and finds them not taken over (self-fencing; must be less than "
                           "orphan_after_s; 0: off)", _range(0, 86400)),
    "ckpt_wait_s": Field((int, float), 30.0, "how long a job gets to write its checkpoint after the signal",
                         _range(0.1, 3600)),
    "prestage_unannounced": Field((int, float), 0.02, "prestage = auto also keeps an off-node replica while the "
                                  "learned share of departures without notice is at least this", _range(0.0, 1.0)),
    "holder": Field(bool, True, "when no peer has room for a job during a reclaim, send its final checkpoint to a live "
                    "peer with the disk space (a storage holder), which resumes the job when room frees"),
    "holder_reserve_mb": Field((int, float), 1024.0, "disk space this node keeps free when it offers to hold "
                               "checkpoints (MiB)", _range(0, 1 << 30)),
    "archive_dir": Field(str, "", "storage outside the pool, shared by the zone's agents (an NFS mount): a stopped "
                         "job's checkpoint and guard go there when no live peer can keep them, and any agent with room "
                         "claims it; running jobs' periodic checkpoints go there too while departures without notice "
                         "are plausible (prestage_unannounced) (empty: off)"),
    "archive_uid": Field(int, 0, "the uid that owns archive_dir and what the agents write there: root (0) unless the "
                         "export squashes root (root_squash or all_squash: then the uid it maps the agents' root to, "
                         "e.g. 65534). The agent uses the archive only while archive_dir is a real directory of this "
                         "uid that neither group nor others may write", _range(0, 2**32 - 2)),
    "retry_base_s": Field((int, float), 2.0, "a guard that finds no room looks again after this, doubling each time",
                          _range(0.05, 3600)),
    "retry_max_s": Field((int, float), 30.0, "the longest wait between a guard's looks for room", _range(0.05, 86400)),
    "replica_guard_check_s": Field((int, float), 600.0, "a guard held here that has not changed for this long is "
                                   "checked with its live source (control op needs): it ends when the source says the "
                                   "job ended, moved, or has another buddy (0: never)", _range(0, 86400 * 30)),
    "replica_orphan_s": Field((int, float), 21600.0, "a key's directory of replicas with no guard row here (its guard "
                              "never came) that no local job uses goes when nothing in it changed for this long",
                              _range(REPLICA_LATE_S, 86400 * 365)),
    "replica_row_keep_s": Field((int, float), 86400.0, "a done replica row (released, handed over, placed, passed, "
                                "resumed) whose directory is gone is deleted after this (a late guard of it is then "
                                "a new guard)", _range(REPLICA_LATE_S, 86400 * 365)),
    "replica_gc_s": Field((int, float), REPLICA_GC_S, "how often every replica held here is looked at (released, "
                          "handed over, placed elsewhere: its checkpoints go; guards due a check with their source)",
                          _range(0.1, 86400)),
    "archive_gc_s": Field((int, float), ARCHIVE_GC_S, "how often this agent sweeps archive_dir for what no job "
                          "needs any more (listing shared storage is not free)", _range(0.1, 86400)),
    "reclaim_from": Field(list, [], "nodes that may reclaim this node, or cancel its reclaim, from their own API "
                          "(laminarctl reclaim --node N there, forwarded as control op reclaim/reclaim-cancel); "
                          "default none: only this node's own API (docs/protocol.md, Authority)", au.check_node_list),
    **ckpt_driver.CONFIG_FIELDS,  # periodic checkpoints (laminar.migrate.ckpt_driver)
}
register_section("migrate", CONFIG_FIELDS)

# The check of a checkpoint as a job's owner (argv: jobkit's file, the path, uid, gid): jobkit is
# loaded while still root (the owner may not reach the agent's code), then the process takes
# the owner's uid, gid and groups (its passwd entry's, as the job's setpriv --init-groups; none
# without one) for good before it looks at the path. It prints one JSON line: {} (verified),
# {"denied": strerror} (the owner cannot reach or open the path itself) or {"error": jobkit's}.
_VERIFY_AS_OWNER = """
import importlib.util, json, os, pwd, sys, time
spec = importlib.util.spec_from_file_location("laminar_jobkit", sys.argv[1])
jobkit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(jobkit)
path, uid, gid = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
limits = jobkit.Limits(int(sys.argv[5]), time.monotonic() + float(sys.argv[6]), refuse_sparse=True)
try:
    os.initgroups(pwd.getpwuid(uid).pw_name, gid)
except KeyError:
    os.setgroups([])
os.setgid(gid)
os.setuid(uid)
try:
    jobkit.verify_checkpoint(path, limits=limits)
    out = {}
except PermissionError as e:
    out = {"denied": e.strerror or str(e)}
except jobkit.CheckpointError as e:
    out = {"error": str(e)}
except OSError as e:
    out = {"error": f"checkpoint {path}: {e}"}
print(json.dumps(out))
"""


# The owner's check of a checkpoint (:func:`verify_as_owner`) that makes no progress for this long
# (no byte read, no CPU time: storage that does not answer, an NFS or FUSE mount whose server is
# gone) is killed and the checkpoint refused. A slow check that keeps reading is waited for
# (hashing takes ~1 s per GiB); this is only for one that reads nothing at all: an NFS server's
# failover takes up to a minute or two.
VERIFY_STALL_S = 120.0


def verify_as_owner(path: str, uid: int, gid: int, stall_s: float | None = None, *,
                    max_bytes: int = ckpt_driver.VERIFY_MAX_BYTES, timeout_s: float = ckpt_driver.VERIFY_TIMEOUT_S) -> None:
    """Verifies the checkpoint ``path`` (jobkit's check) with the permissions of ``uid``, ``gid``
    and the uid's groups, in a child process that dropped to them, never as root: what a job of
    that user could read, and no more. Blocking (callers run it in a thread), but bounded: a
    child that makes no progress for ``stall_s`` (default :data:`VERIFY_STALL_S`; no byte read,
    no CPU time: storage that hangs) is killed and never waited for beyond a second more (a read
    of a dead NFS or FUSE server can hold it unkillable, in D state; it is reaped once it ends).
    Raises ValueError naming the path and the uid (and, for a hang, the time waited); its text
    holds only what that user could have learnt by looking at the path themselves (a checkpoint
    they cannot reach is refused alike whether it is valid, corrupt or absent). For uid 0 (a
    root job's checkpoint, checked in a child only for the bound) the texts are root's: jobkit's
    error as ``checkpoint <path> is not restorable: <error>``, no owner named.

    The check has jobkit's limits too (:class:`jobkit.Limits`): a manifest declaring more than
    ``max_bytes``, or a sparse file, is refused unread, and the check stops after ``timeout_s``
    (a child still running a few seconds past it is killed): a hand-made manifest naming a
    10 TiB sparse file was hashed for hours, holding the caller's thread."""
    from laminar.runtime import joblimits

    stall_s = VERIFY_STALL_S if stall_s is None else stall_s
    who = "" if uid == 0 else f" as uid {uid} (the job's owner)"
    # the owner's limits, nice value and an oom_score_adj of its own, not the agent's (a job's
    # owner's profile: joblimits; its LimitsError is a ValueError naming the limits file)
    argv = [*joblimits.helper_argv(uid, gid), sys.executable, "-I", "-c", _VERIFY_AS_OWNER, jobkit.__file__, path,
            str(uid), str(gid), str(int(max_bytes)), repr(float(timeout_s))]
    end = time.monotonic() + float(timeout_s) + 5.0
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={}, cwd="/")
    seen, since = _progress(f"/proc/{proc.pid}"), time.monotonic()
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=min(1.0, stall_s))
            break
        except subprocess.TimeoutExpired:
            now, progress = time.monotonic(), _progress(f"/proc/{proc.pid}")
            if progress != seen and now < end:
                seen, since = progress, now
                continue
            if now - since < stall_s and now < end:
                continue
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=1.0)  # reaped now unless unkillable (then by subprocess, later)
            if now >= end:
                raise ValueError(f"checkpoint {path} could not be checked{who}: the check took more than "
                                 f"{timeout_s:g} s and was stopped") from None
            raise ValueError(f"checkpoint {path} could not be checked{who}: the check read nothing for {stall_s:g} s "
                             "(its storage does not answer) and was stopped") from None
    try:
        out = json.loads(stdout)
    except ValueError:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"checkpoint {path} could not be checked{who}: exit {proc.returncode}: {tail}") from None
    if uid == 0 and ("denied" in out or "error" in out):
        raise ValueError(f"checkpoint {path} is not restorable: {out.get('error') or out['denied']}")
    if "denied" in out:
        raise ValueError(f"checkpoint {path}: uid {uid} (the job's owner) cannot read it: {out['denied']}")
    if "error" in out:
        raise ValueError(f"checkpoint {path} is not restorable: {out['error']} (checked as uid {uid}, the job's "
                         "owner)")


def _same_files(m: Manifest, snap: Path) -> Manifest | None:
    """``m`` (built from the job's checkpoint directory) for its snapshot ``snap``, when ``snap``
    holds the very files ``m`` was built from (the same inode, size and mtime: hard links made
    since), with ``snap``'s own identity as its source; else None (copied, or saved again
    since: the manifest is built again from the snapshot)."""
    if not m.source:
        return None
    try:
        now = _source_state(snap)
    except (OSError, TransferError):
        return None
    return replace(m, source=(now[0], m.source[1])) if now[1] == m.source[1] else None


def _snapshot_file(src: Path, dst: Path) -> None:
    """Puts the regular file ``src`` at ``dst``: a hard link to it (never to what a link points
    to), else a copy read through a descriptor opened without following links and without
    blocking (a pipe swapped in is not waited on), checked to be the regular file lstat saw.
    Raises CheckpointError for anything but a regular file (a link, pipe, device, directory),
    OSError when it cannot be read."""
    st = os.lstat(src)
    if not stat.S_ISREG(st.st_mode):
        raise jobkit.CheckpointError(f"checkpoint {src.parent}: {src.name} is not a regular file (a link, pipe, "
                                     "device or directory); not sent")
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        pass
    else:
        if not stat.S_ISREG(os.lstat(dst).st_mode):  # swapped between the lstat and the link
            os.unlink(dst)
            raise jobkit.CheckpointError(f"checkpoint {src.parent}: {src.name} changed into something other than a "
                                         "regular file; not sent")
        return
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise jobkit.CheckpointError(f"checkpoint {src.parent}: {src.name} changed into something other than a "
                                         "regular file; not sent")
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as fin, open(dst, "xb") as fout:
            shutil.copyfileobj(fin, fout, 4 << 20)
        os.utime(dst, ns=(fst.st_atime_ns, fst.st_mtime_ns))
    finally:
        os.close(fd)


def parse_duration(v: Any) -> float:
    """60, 60.0, "60", "60s", "2m", "1h" -> seconds. Raises ValueError naming the value (cut:
    laminar.inputs.brief); text longer than NUMBER_TEXT_MAX and integers past a float (10**400:
    an OverflowError, a 500 before) included."""
    from laminar.inputs import NUMBER_TEXT_MAX, brief

    bad = f"duration {brief(v)}: expected seconds or a number with s, m or h (60s, 2m)"
    if isinstance(v, bool):
        raise ValueError(bad)
    if isinstance(v, int | float):
        try:
            secs = float(v)
        except OverflowError:
            raise ValueError(f"duration {brief(v)}: must be > 0 and finite") from None
    else:
        t = str(v).strip().lower()
        if len(t) > NUMBER_TEXT_MAX or not t.isascii():
            raise ValueError(bad)
        mult = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(t[-1:], None)
        num = t[:-1] if mult else t
        try:
            secs = float(num) * (mult or 1.0)
        except ValueError:
            raise ValueError(bad) from None
    if not math.isfinite(secs) or secs <= 0:
        raise ValueError(f"duration {brief(v)}: must be > 0")
    return secs


@dataclass
class Move:
    """One job's move (shown by GET /v1/migrations/{job})."""

    job: str
    key: str
    reason: str
    phase: str = "planned"  # planned, checkpoint, reserve, transfer, handover, done, hold, held, archived, archiving, failed
    ckpt: str = ""
    dest: int | None = None
    dest_job: str = ""
    done_bytes: int = 0
    total_bytes: int = 0
    deadline: float | None = None  # wall clock
    error: str = ""
    started: float = field(default_factory=time.time)
    ended: float | None = None
    ranked: list[dict[str, Any]] = field(default_factory=list)
    # the final checkpoint's transfer manifest, built as it was checked: sent as it is (not shown)
    manifest: Manifest | None = field(default=None, repr=False, compare=False)
    # why it moves, as its record in the store says (laminar.policy.moves.Cause; not shown)
    cause: str = field(default="move_now", repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("manifest", "cause")}


class _ShaperHook:
    """Adapts the shaper's transfer registry (``agent.transfers``: add/report/remove, netlink
    on its own thread) to the transfer's FlowHook. Progress is the bytes the destination's TCP
    acknowledged (the sender reads them from its socket), reported to the registry as such
    (``report(..., acked=True)``), so the shaper decides on them instead of its leaf's estimate;
    one report per transfer is under way at a time (the newest value goes next), and a transfer
    is removed only after its reports."""

    def __init__(self, reg: Any, job: Any) -> None:
        self.reg = reg
        self.job = job
        self._want: dict[Any, int] = {}  # handle -> newest acknowledged bytes
        self._told: dict[Any, int] = {}  # handle -> what the registry has
        self._reporting: dict[Any, asyncio.Task[None]] = {}

    async def register(self, flow: Flow, job_id: str, total_bytes: int, deadline_monotonic: float | None) -> Any:
        if deadline_monotonic is None or total_bytes <= 0:
            return None
        from laminar.net.killswitch import FlowKey

        try:
            key = FlowKey("tcp", flow.saddr, flow.sport, flow.daddr, flow.dport)
            t = await self.reg._run(self.reg.add, self.job.id, int(self.job.num), key, total_bytes,
                                    max(0.05, deadline_monotonic - time.monotonic()))
        except Exception as e:  # shaping off, or the deadline is already infeasible: send unshaped
            log.info("migrate: transfer of %s not shaped: %s", self.job.id, e)
            return None
        return t.id

    def progress(self, handle: Any, acked_bytes: int) -> None:
        if handle is None or acked_bytes <= self._want.get(handle, -1):
            return
        self._want[handle] = acked_bytes
        if handle not in self._reporting:
            self._reporting[handle] = asyncio.get_running_loop().create_task(self._report(handle))

    async def _report(self, handle: Any) -> None:
        try:
            while (n := self._want.get(handle, 0)) > self._told.get(handle, -1):
                try:
                    await self.reg._run(self.reg.report, handle, n, acked=True)
                except Exception as e:  # removed meanwhile, or shaping went away: the next one may do
                    log.debug("migrate: progress of transfer %s not reported: %s", handle, e)
                self._told[handle] = n
        finally:
            self._reporting.pop(handle, None)

    async def unregister(self, handle: Any) -> Any:
        if handle is not None:
            task = self._reporting.get(handle)
            if task is not None:  # the last bytes first: the registry says where it ended
                with contextlib.suppress(Exception):
                    await task
            self._want.pop(handle, None)
            self._told.pop(handle, None)
            with contextlib.suppress(Exception):
                await self.reg._run(self.reg.remove, handle)


GUARD_INSTANTS = ("window_end", "not_before")  # wall-clock instants a guard message's request carries


SENT_MANIFESTS_KEEP = 4096  # checkpoints last sent, per job key, remembered for the guard that follows (_presign)


def _manifest_facts(ckpt: Path) -> tuple[str, int, int]:
    """(SHA-256 of its MANIFEST.json, bytes, files) of the checkpoint ``ckpt`` (a snapshot of
    root's): what an archived record of it signs. Raises OSError/ValueError/CheckpointError."""
    raw = (ckpt / jobkit.MANIFEST).read_bytes()
    files = jobkit.parse_manifest(raw, str(ckpt))["files"]
    return manifest_digest(raw), sum(int(f["size"]) for f in files), len(files)


def _in_own_clock(body: dict[str, Any]) -> dict[str, Any]:
    """A guard message's request with its instants (GUARD_INSTANTS: the end of the source's
    reclaim window, the moment before which the guard must not act) moved from the sender's
    wall clock to this node's: shifted by this node's time less the sender's ``clock`` when it
    sent the message. The shift holds the skew between the two clocks and the message's
    transit, so an instant lands at most a transit later than it was meant, never earlier: a
    guard whose clock runs ahead no longer takes over before the window ends. A message
    without ``clock`` (an agent of before 2026-11-24) is taken as it is. Raises ValueError for
    a ``clock`` or an instant that is not a finite number."""
    def instant(name: str, v: Any) -> float:
        try:
            t = float(v)
        except (TypeError, ValueError):
            t = math.nan
        if isinstance(v, bool) or not math.isfinite(t):
            raise ValueError(f"guard: {name} {v!r} is not a finite number (seconds since the epoch)")
        return t

    req = dict(body["request"])
    if body.get("clock") is None:
        return req
    shift = time.time() - instant("clock", body["clock"])
    for f in GUARD_INSTANTS:
        if req.get(f) is not None:
            req[f] = instant(f, req[f]) + shift
    return req


class ReclaimComponent:
    """``laminar.migrate.reclaim:ReclaimComponent`` (agent attribute ``migrate``)."""

    agent_attr = "migrate"
    status_key = "migrate"

    def __init__(self) -> None:
        self.agent: Any = None
        self.s: dict[str, Any] = {}
        self.receiver: Receiver | None = None
        self._xfer_local: str | None = None  # the address transfer connections leave from (start)
        self.port = 0
        self.root: Path | None = None
        self.hazards: dict[str, HazardModel] = {}  # what the agent plans with: prior (+ traces) + seen
        self.seen: dict[str, HazardModel] = {}  # only what this agent observed (persisted)
        self.notice_odds = NoticeOdds()  # departures with and without notice (persisted)
        self.evidence: EvidenceStore | None = None
        self._evidence_saved = 0.0
        self._suspected: set[int] = set()  # peers already counted as departed without notice
        self.notices: dict[int, tuple[float, float]] = {}  # node -> (window end, wall; received, wall)
        self.reclaim: dict[str, Any] | None = None  # this node's reclaim in progress
        self.moves: dict[str, Move] = {}  # job id -> its latest move
        # each job's buddy, the checkpoint last shipped to it, the releases owed to old buddies (buddies.py)
        self.prestage = Prestage(self)
        self.evacuating: set[str] = set()
        self.fence = Fence(self)  # the jobs this node froze while cut off from its zone (fence.py)
        self.frozen_at: dict[str, float] = {}  # job id -> when a move froze it (wall clock)
        self.ckpt_latency: dict[str, float] = {}  # job id -> seconds its last requested checkpoint took
        self._gpu_mem: dict[int, int] = {}  # pid -> GPU bytes, NVML's last read (_gpu_memory_round)
        self._gpu_mem_at = -math.inf
        # the prestage rule's fit of every job's final checkpoint in a notice window, computed
        # once per round for all jobs (_should_prestage): (when, job id -> fits)
        self._fit: tuple[float, dict[str, bool]] = (-math.inf, {})
        # a checkpoint listing and check lane for a component without the checkpoint driver
        self._own_ckpt_tools: tuple[CkptScanner, Lane] | None = None
        self.replicas = Replicas(self)  # the replicas held here for other nodes' jobs (replicas.py)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[Any] | None = None
        self._unsubscribe: Any = None
        self.ckpt: ckpt_driver.CkptDriver | None = None  # periodic checkpoints
        self.counts: dict[str, int] = {"moves": 0, "moved": 0, "failed": 0, "prestaged": 0, "resumed": 0,
                                       "received": 0, "held": 0, "placed": 0, "retries": 0, "archived": 0}
        self._drain_task: asyncio.Task[Any] | None = None  # places this node's queued jobs elsewhere during a reclaim
        self.withdraw = Withdraw(self)  # the cancel of this node's reclaim, a peer's withdrawal (withdraw.py)
        self._superseding: set[str] = set()  # this node's jobs being stopped: a guard runs them (Replicas.answer_superseded)
        # the archive, the guard of last resort: its copies, claims, sweep and lane (archive.py)
        self.archive = Archive(self)
        # jobs whose final checkpoint is in the archive (or on its way there, late) while their
        # stop here is under way: never thawed nor moved again (any agent with room claims it)
        self._archive_keeps: set[str] = set()
        # key -> (checkpoint name, manifest SHA-256, bytes, files) last sent to a peer: what the
        # guard that follows it is handed, signed, to publish in the archive (_presign)
        self._sent_manifests: dict[str, tuple[str, str, int, int]] = {}
        self.vouch = Vouch(self, isolated=self.fence.isolated)  # other members' word on a silent peer (vouch.py)
        self._started = 0.0  # when this agent's component started (wall): a guard older than it may have missed news
        # a guard's watch of its sources, its take-over of a dead source's job, hand-overs (guard.py)
        self.guarding = Guard(self)
        self.settle = Settle(self)  # hand-overs not answered, an operator's settle of one (settle.py)

    # -- life cycle ---------------------------------------------------------------------------

    async def start(self, agent: Any) -> None:
        """Opens the replicas table, loads the hazard model, starts the transfer endpoint and
        the watch loop. Raises RuntimeError when the endpoint's port cannot be bound."""
        self.agent = agent
        self._started = time.time()
        self.s = {**{k: f.default for k, f in CONFIG_FIELDS.items()}, **agent.config.section("migrate")}
        agent.store.ensure_schema("migrate", REPLICAS_SCHEMA)
        agent.store.ensure_schema("migrate-reclaim", RECLAIM_SCHEMA)
        agent.store.ensure_schema("migrate-moves", MOVES_SCHEMA)
        with agent.store.tx() as db:  # an older agent's move records: all of them into migrate_moves
            upgraded = upgrade_moves(db)
        if upgraded:
            log.info("migrate: move records upgraded into migrate_moves: %s", upgraded)
        for r in agent.store.db.execute("SELECT key, request FROM migrate_replicas").fetchall():
            self.replicas.note_owner(str(r["key"]), r["request"])
        self._backfill_origins()
        self.prestage.restore()
        self.fence.restore()
        try:
            self.guarding.retry = RetrySchedule(float(self.s["retry_base_s"]), 2.0, float(self.s["retry_max_s"]))
            ckpt_driver.check_settings(self.s)
            check_fence_settings(self.s)
        except ValueError as e:
            raise RuntimeError(f"migrate: {e}") from None
        prior = float(self.s["hazard_prior_rate_per_h"])
        base = HazardModel("default", prior_rate_per_h=prior)
        if self.s["spot_traces"]:
            try:
                base = calibrate_from_spot_traces(self.s["spot_traces"], provider="default", prior_rate_per_h=prior)
            except (HazardError, OSError) as e:
                raise RuntimeError(f"migrate: spot_traces {self.s['spot_traces']!r}: {e}") from None
        # What this agent saw before a restart is evidence too: reload it on top of the prior.
        self.evidence = EvidenceStore(agent.store)
        seen, odds = self.evidence.load()
        self.seen = {"default": seen.get("default") or HazardModel("default")}
        self.notice_odds = odds.get("default") or NoticeOdds()
        self.hazards["default"] = base.merged(self.seen["default"])
        self._evidence_saved = time.monotonic()
        self.root = agent.config.state_dir / "xfer"
        # Root's alone: replicas, holders' copies and outgoing snapshots are other users' jobs'
        # checkpoints (the state directory is 0711 so a job can reach its own ckpt/<job>; a
        # version before this one left this directory 0755 and its files 0644).
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        zone = getattr(agent, "zone", None)
        networked = bool(zone is not None and zone.networked)
        # zone.listen as the zone bound it (0.0.0.0 is the roster address when this host holds it,
        # IPv4 or IPv6, else 0.0.0.0 or ::: membership.bind_host, ZoneComponent.start)
        host = self.s["listen"] or (getattr(zone, "listen_host", zone.s["listen"]) if zone is not None and networked
                                    else "127.0.0.1")
        # A peer's connections leave from this address when it names one (this node's roster
        # address on a host with several), and the node id a peer's hello claims must be the
        # one whose roster address its connection comes from (zone.check_source, as the zone's
        # own messages: the key is the zone's, any member could claim any node id).
        self._xfer_local = None if host in ("", "0.0.0.0", "::") else str(host)
        check = networked and bool(getattr(zone, "s", {}).get("check_source", True))
        # who may hold the port before authenticating (laminar.zone.gate): the roster's addresses,
        # a share each, and with zone.check_source nobody else
        gate = Gate(lambda: zone.membership.roster_ips(), check_source=check) if networked and zone is not None else Gate()
        self.receiver = Receiver(self.root, self._key_lookup, on_commit=self._on_commit, on_progress=self._on_rx_progress,
                                 on_control=self._on_control, sources=self._roster_ip if check else None,
                                 pair_keys=self._pair_candidates, gate=gate, may_offer=self._may_offer)
        metrics = getattr(agent, "metrics", None)
        if metrics is not None:
            with contextlib.suppress(ValueError):  # the counts are process-wide: registered once per registry
                metrics.register(StatsCollector())
        try:
            self.port = await self.receiver.start(host, int(self.s["port"]) if networked else 0)
        except OSError as e:
            from laminar.zone.membership import host_port

            raise RuntimeError(f"migrate: cannot listen on {host_port(str(host), int(self.s['port']))} for checkpoint transfers: "
                               f"{e.strerror or e}; set migrate.port to a free port") from None
        rebind: Any = getattr(zone, "rebind", None)
        if zone is not None and networked and not self.s["listen"] and hasattr(rebind, "on_rebind"):
            # the zone listens on :: while its roster address is not usable (tentative at boot),
            # then on the address: so do transfers, and they connect from it again
            rebind.on_rebind.append(self._follow_zone_listen)
            if zone.listen_host != host:
                await self._follow_zone_listen(zone.listen_host)
        # Nothing is being sent yet: every snapshot under outgoing/ is a crashed send's, and what
        # is in the replica trash was being removed when the agent stopped.
        await asyncio.to_thread(self._sweep_outgoing)
        await asyncio.to_thread(self.replicas.empty_trash)
        self._unsubscribe = agent.events.subscribe(self._on_event)
        self._loop_task = asyncio.get_running_loop().create_task(self._watch())
        self.ckpt = ckpt_driver.CkptDriver(self)
        self._spawn(self.ckpt.run())
        self.archive.stopped.restore_late_copies()  # before the reclaim's restore: by the job states the stop left
        self._restore_reclaim()
        self._restore_moves()
        self._restore_move_holds()
        self.guarding.restore_replica_handovers()

    def _backfill_origins(self) -> None:
        """After an upgrade: the job manager records the migration key of the jobs this node's
        guards resumed (a ``resumed`` row names its job; what it gave the job to resume from is
        the job's ``resume_from``) and of the live jobs a move or a guard's placement handed here
        (placed through the zone, and resuming from a replica of a key a guard here names, or
        its owner's copy of one: only ``check_resume`` gives such a path). Before, only their env
        said so, which this reads nothing of (laminar.runtime.provenance). Not recoverable: the
        key of a job handed here that ended already (its placement is forgotten), and a
        requeue's origin (nothing read it)."""
        jobs = getattr(self.agent, "jobs", None)
        if jobs is None or not hasattr(getattr(jobs, "table", None), "backfill_origin"):
            return
        db = self.agent.store.db
        for r in db.execute("SELECT key, job_id FROM migrate_replicas WHERE state='resumed' AND job_id IS NOT NULL"
                            ).fetchall():
            job = jobs.get(str(r["job_id"]))
            if job is not None and not getattr(job.origin, "migrated_from", None) and valid_key(str(r["key"])):
                rf = job.spec.resume_from if isinstance(job.spec.resume_from, str) else None
                jobs.table.backfill_origin(job.id, migrated_from=str(r["key"]), resume_given=rf)
        keys = {str(r[0]) for r in db.execute("SELECT key FROM migrate_replicas")}
        try:
            placed = {str(r[0]) for r in db.execute("SELECT job_id FROM zone_placed")}
        except sqlite3.OperationalError:  # no zone on this node
            placed = set()
        state = Path(self.agent.config.state_dir)
        for job in list(getattr(jobs, "jobs", {}).values()):
            rf = job.spec.resume_from
            if job.id not in placed or job.origin.migrated_from or not isinstance(rf, str):
                continue
            p = Path(os.path.normpath(rf))
            if p.parent.parent in (state / "xfer" / "checkpoints", state / RESUME_DIR) and p.parent.name in keys \
                    and valid_key(p.parent.name) and valid_ckpt_name(p.name):
                jobs.table.backfill_origin(job.id, migrated_from=p.parent.name, resume_given=str(p))

    async def _follow_zone_listen(self, host: str) -> None:
        """The zone listens on its roster address ``host`` now: transfers listen on it and
        leave from it (zone.check_source at the peers). When the port cannot be bound there
        (taken in the moment the old socket was closed), it is tried again every
        ``interval_s`` of the zone's ``rebind`` until it is, as long as the zone stays on ``host``: meanwhile the
        old address listens, or, when it could not be bound again either, nothing does."""
        if self.receiver is None or self.receiver.port is None:
            return
        try:
            await self._relisten_xfer(host)
        except OSError as e:
            log.warning("migrate: cannot listen for checkpoint transfers on %s yet (%s): tried again", host, e)
            self._spawn(self._relisten_xfer_until(host))

    async def _relisten_xfer(self, host: str) -> None:
        assert self.receiver is not None
        await self.receiver.relisten(host)
        self._xfer_local = host
        log.info("migrate: listening for checkpoint transfers on %s (the zone's roster address) now", host)

    async def _relisten_xfer_until(self, host: str) -> None:
        every = float(getattr(getattr(self.zone, "rebind", None), "interval_s", 0) or 2.0)
        while True:
            await asyncio.sleep(every)
            z = self.zone
            if self.receiver is None or (z is not None and getattr(z, "listen_host", host) != host):
                return  # stopped, or the zone moved on (its next rebind calls _follow_zone_listen again)
            try:
                await self._relisten_xfer(host)
                return
            except OSError as e:
                log.debug("migrate: checkpoint transfers on %s: %s", host, e)

    def _sweep_outgoing(self) -> list[Path]:
        """Removes every snapshot under ``<root>/outgoing/`` (called at start, before any send:
        each one is what a send cut off by a crash left) and returns what went. Links are removed
        as links (:func:`_remove_tree`); nothing outside ``outgoing/`` is touched."""
        assert self.root is not None
        gone = []
        try:
            entries = list((self.root / "outgoing").iterdir())
        except OSError:
            return []
        for e in entries:
            _remove_tree(e)
            gone.append(e)
            log.info("migrate: removed %s (a snapshot left by an interrupted send)", e)
        return gone

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        with contextlib.suppress(Exception):
            self.save_evidence()
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        # their ends (cancelled, or an error) are theirs; a cancel of this stop (the agent's stop
        # deadline) is not swallowed with them
        await asyncio.gather(*tasks, return_exceptions=True)
        self.archive.lane.close()
        if self.receiver is not None:
            await self.receiver.stop()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _emit(self, message: str, **fields: Any) -> None:
        self.agent.events.emit("migrate", message, **fields)

    # -- evidence (hazard and notice odds, persisted in the store) -----------------------------

    def observe_exposure(self, t0: float, t1: float, nodes: float = 1.0) -> None:
        """``nodes`` nodes were up from ``t0`` to ``t1``: exposure for the hazard. Written to the
        store at most every EVIDENCE_SAVE_S."""
        for m in (self.hazards["default"], self.seen.setdefault("default", HazardModel("default"))):
            m.observe_exposure(t0, t1, nodes)
        if time.monotonic() - self._evidence_saved >= EVIDENCE_SAVE_S:
            self.save_evidence()

    def observe_departure(self, ts: float, announced: bool) -> None:
        """A node of the zone departed at ``ts`` (this one or a peer), with or without a usable
        notice: hazard evidence and notice odds, written to the store at once."""
        for m in (self.hazards["default"], self.seen.setdefault("default", HazardModel("default"))):
            m.observe_reclaim(ts)
        self.notice_odds.observe(announced)
        self.save_evidence()

    def _evidence_status(self) -> dict[str, Any]:
        """The evidence this agent gathered (its store's, not the configured prior): departures
        with and without notice, exposure, and the ``default`` hazard's rate now."""
        seen = self.seen.get("default") or HazardModel("default")
        return {"announced": self.notice_odds.announced, "unannounced": self.notice_odds.unannounced,
                "departures": seen.total_events, "exposure_node_h": round(seen.total_exposure_h, 3),
                "rate_per_h_now": round(self.hazards["default"].rate_per_h(time.time()), 6),
                "unannounced_frac": round(self.notice_odds.unannounced_frac, 4)}

    def save_evidence(self) -> None:
        if self.evidence is None:
            return
        try:
            self.evidence.save("default", self.seen.setdefault("default", HazardModel("default")), self.notice_odds)
            self._evidence_saved = time.monotonic()
        except Exception as e:  # the store is the agent's; a failed write must not stop the watch
            log.warning("migrate: saving hazard evidence failed: %s", e)

    def exposed_nodes(self) -> float:
        """Nodes whose departures this agent counts: itself and its live zone peers (their
        reclaim notices and silences are observed here too)."""
        z = self.zone
        if z is None:
            return 1.0
        now = time.time()
        return float(1 + sum(1 for n in z.membership.by_node if n != self.node_id and n not in z.membership.suspects
                             and not self._announced(n, now)))

    def _announced(self, node: int, now: float) -> bool:
        """Whether ``node``'s departure was counted from its reclaim notice: the notice came and
        its window is open or ended less than an hour ago (a notice window may be hours long)."""
        notice = self.notices.get(node)
        return notice is not None and now < max(notice) + 3600

    def _departure_round(self) -> None:
        """A peer that turned suspect (silent) with no reclaim notice departed without notice;
        counted once per silence (it counts again only after it was heard from)."""
        z = self.zone
        if z is None:
            return
        now = time.time()
        sus = set(z.membership.suspects)
        self._suspected &= sus
        for n in sorted(sus - self._suspected):
            self._suspected.add(n)
            if self._announced(n, now):
                continue  # announced: counted when its notice came
            self.observe_departure(now, announced=False)
            log.info("migrate: node %d fell silent without a reclaim notice (unannounced departure)", n)

    # -- zone helpers -------------------------------------------------------------------------

    @property
    def zone(self) -> Any:
        z = getattr(self.agent, "zone", None)
        return z if z is not None and z.networked else None

    def _key_lookup(self, zone: int) -> bytes | None:
        z = getattr(self.agent, "zone", None)
        return z.keys.get(zone) if z is not None else None

    @property
    def node_id(self) -> int:
        z = getattr(self.agent, "zone", None)
        return int(z.node_id) if z is not None else 0

    def _member(self, node: int) -> Any:
        z = self.zone
        if z is None or node not in z.membership.by_node:
            raise MigrateError(f"node {node} is not a member of this zone (see `laminarctl zone peers`)")
        return z.membership.by_node[node]

    def _peer(self, node: int) -> tuple[str, int, bytes, int]:
        """(address, port, key, zone) of a node's transfer endpoint. The key is the pair key of
        this node and ``node`` under the zone's current key when the zone signs datagrams to it
        with that (node keys: :meth:`laminar.zone.keys.PairKeys.signs`), else the zone key."""
        m = self._member(node)
        key = self._key_lookup(m.zone)
        if key is None:
            raise MigrateError(f"no key for zone {m.zone} of node {node}")
        pairs = getattr(self.zone, "pairs", None)
        return m.addr, int(self.s["port"]), key if pairs is None else pairs.signing_key(key, node), int(m.zone)

    def _pair_candidates(self, node: int, keys: tuple[bytes, ...]) -> tuple[bytes, ...]:
        """The keys a transfer or control connection naming ``node`` may authenticate under
        (the Receiver's ``pair_keys``): with node keys covering it, its pair keys under each of
        the zone's ``keys``, then (unless ``node_keys = require``) those keys too; else ``keys``."""
        pairs = getattr(self.zone, "pairs", None)
        return keys if pairs is None else pairs.accepted(keys, node)

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any:
        if op in ("guard", "superseded") and isinstance(body, dict):
            # this node's wall clock as it sends: the guard reads the instants in the request
            # (window_end, not_before) in its own clock, whatever the skew (_on_control); the
            # source, a take-over's instant (``superseded``: Replicas.answer_superseded)
            body = {**body, "clock": time.time()}
        addr, port, key, zone = self._peer(node)
        return await send_control(addr, port, key, op, body, zone=zone, node=str(self.node_id), timeout=timeout,
                                  local_host=self._xfer_local)

    def _roster_ip(self, node: int) -> str | None:
        """The canonical IP of ``node``'s ``[[zone.nodes]]`` entry, where its transfer connections
        must come from (the Receiver's ``sources``); None for a node the roster does not list."""
        z = self.zone
        m = z.membership.by_node.get(node) if z is not None else None
        if m is None:
            return None
        try:
            return canonical_ip(str(m.addr))
        except ValueError:
            return None

    def _heard_over_tcp(self, node: str) -> None:
        z = self.zone
        if z is None:
            return
        with contextlib.suppress(Exception):  # (not a node id, not in the roster: nothing to note)
            wall = getattr(z, "wall", time.time)
            z.membership.seen(int(node), wall(), z.clock())

    def _last_seen(self, node: int) -> float:
        z = self.zone
        if z is None or node not in z.membership.state:
            return -1.0
        return float(z.membership.state[node].last_seen)

    # -- planning -----------------------------------------------------------------------------

    def job_key(self, job: Any) -> str:
        """The job's name across nodes (job ids are per node): ``n<node>-<job id>``."""
        return f"n{self.node_id}-{job.id}"

    def _need(self, job: Any) -> tuple[Any, dst.Resources]:
        """The demand a move of ``job`` places (its pool too, when the zone placed it with one:
        a lent training job asks for the training pool again, so a busy inference node refuses
        it and an idle one takes it on loan) and the resources a destination must have."""
        from laminar.policy.placement import Demand

        spec = job.spec
        gpus = len(job.gpus) if job.gpus else (spec.gpus if isinstance(spec.gpus, int) else len(spec.gpus))
        cpus = float(spec.cpus or 1.0)
        mem = int(spec.memory_mb or 256)
        pool = None
        arb = getattr(getattr(self.agent, "zone", None), "arbiter", None)
        for p in getattr(arb, "placed", {}).values():
            if p.job_id == job.id:
                pool = p.reservation.demand.pool
                break
        return Demand(gpus=float(gpus), cpus=cpus, memory_mb=mem, pool=pool), dst.Resources(gpus, mem << 20, cpus)

    def candidates(self, need: dst.Resources) -> list[dst.Candidate]:
        """Every zone member that may take a job: not this node, not suspect, not draining,
        not under a reclaim notice. Free resources from its summary (unknown: assumed to fit;
        the probe decides), survival from its provider's hazard model (the node's owner)."""
        z = self.zone
        if z is None:
            return []
        now = time.time()
        path_bps = float(self.s["path_mbit"]) * 1e6 / 8
        out = []
        for n, m in z.membership.by_node.items():
            if n == self.node_id or n in z.membership.suspects:
                continue
            if n in self.notices and self.notices[n][0] > now - 3600:
                continue
            st = z.membership.state[n]
            cap = st.last_summary
            if cap is not None and cap.draining:
                continue
            free = need if cap is None else dst.Resources(sum(1 for f in cap.gpu_free if f >= 0.999),
                                                          int(cap.memory_mb) << 20, float(cap.cpus))
            provider = m.owner or "default"
            hz = self.hazards.get(provider) or self.hazards["default"]
            surv = hz.survival(now, DEFAULT_REMAINING_S)
            # Racks are not configured: topology is the zone (rack = zone).
            out.append(dst.Candidate(str(n), str(m.zone), str(m.zone), free, path_bps, survival=surv, provider=provider))
        return out

    def rank_for(self, job: Any, ckpt_bytes: float, window_s: float | None, prestaged: bool) -> list[dst.Ranked]:
        _, need = self._need(job)
        z = self.zone
        zone = str(z.zone) if z is not None else "0"
        buddy = self.prestage.buddy.get(job.id)
        req = dst.MoveRequest(self.job_key(job), need, ckpt_bytes, DEFAULT_REMAINING_S, window_s, str(self.node_id),
                              zone, zone, frozenset({str(buddy)}) if prestaged and buddy else frozenset())
        ranked = dst.rank(req, self.candidates(need), margin=float(self.s["notice_margin"]))
        feasible = [r for r in ranked if r.feasible]
        # The buddy holds the job's fallback checkpoint: prefer it at (nearly) equal cost, so one
        # node guards the job before and after the move.
        if buddy is not None and feasible and feasible[0].candidate.node != str(buddy):
            for i, r in enumerate(feasible):
                if r.candidate.node == str(buddy) and r.expected_loss_s <= feasible[0].expected_loss_s + 1.0:
                    feasible.insert(0, feasible.pop(i))
                    break
        return feasible + [r for r in ranked if not r.feasible]

    def _ckpt_bytes(self, job: Any) -> int:
        """Size of the job's newest checkpoint (the planning size of its next one). A job that
        has not checkpointed yet is planned at the memory it holds (its cgroup's, less clean
        page cache: the state it could write is in there), plus, for a job with GPUs, the GPU
        memory NVML attributes to the processes in its cgroup (its state is mostly there, which
        the cgroup does not count), at least DEFAULT_CKPT_BYTES: a reclaim that planned a 1 GiB
        job as 64 MiB asked for its checkpoint too late for the transfer, and the job was lost
        at the window's end. Planning too large only asks earlier; the move is ranked again
        with the checkpoint's real size."""
        verified = self.ckpt.verified_bytes(job) if self.ckpt is not None and job.ckpt_dir else None
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
        read (:meth:`_gpu_memory_round`; never NVML itself here: this runs on the event loop, and
        an NVML init can take a driver's start-up); 0 where NVML or the cgroup cannot tell (the
        plan then goes by the cgroup's memory alone)."""
        try:
            pids = set(cg.pids())
        except (OSError, ValueError, CgroupError):
            return 0
        return sum(v for pid, v in self._gpu_mem.items() if pid in pids)

    async def _gpu_memory_round(self) -> None:
        """Reads NVML's GPU memory per process, in a worker thread, at most every
        GPU_MEM_EVERY_S, and only while a job with GPUs has no checkpoint yet (the one case
        :meth:`_ckpt_bytes` needs it)."""
        jobs = getattr(self.agent, "jobs", None)
        if jobs is None or time.monotonic() - self._gpu_mem_at < GPU_MEM_EVERY_S:
            return
        self._gpu_mem_at = time.monotonic()  # the checkpoint listings below too: not every round
        listed = self.ckpt.listed if self.ckpt is not None else (lambda j: None)
        if not any(getattr(j, "gpus", None) and not (j.ckpt_dir and listed(j)) for j in jobs.active()):
            self._gpu_mem = {}
            return
        from laminar.runtime import gpus

        self._gpu_mem = await asyncio.to_thread(gpus.nvml_process_memory)

    def _should_prestage(self, job: Any) -> bool:
        mode = self.s["prestage"]
        if mode != "auto":  # the mode decides alone: no fact is read (as before the rule moved)
            return prestage.should_prestage(mode, False)
        w = float(self.s["expected_notice_s"])
        return prestage.should_prestage(mode, lambda: self._fits_window(job, w), window_s=w,
                                        unannounced_frac=self.notice_odds.unannounced_frac,
                                        unannounced_threshold=float(self.s["prestage_unannounced"]))

    def _fits_window(self, job: Any, w: float) -> bool:
        """Whether ``job``'s final checkpoint fits a notice window of ``w`` (the prestage rule's fit)."""
        # The reclaim moves every job of the node through one uplink in one window
        # (notice_schedule): a job whose final checkpoint fits the window alone may not fit
        # beside its neighbours, so fit is judged over all of them, as the evacuation plans.
        # Once per round for all of them (PRESTAGE_FIT_S), from the sizes known (no file read):
        # judged per job, a round was quadratic in the jobs of the node.
        at, fits = self._fit
        if time.monotonic() - at > PRESTAGE_FIT_S or job.id not in fits:
            jobs_mgr = getattr(self.agent, "jobs", None)
            others = [j for j in (jobs_mgr.active() if jobs_mgr is not None else []) if j.id != job.id]
            link = float(self.s["path_mbit"]) * 1e6 / 8
            cands = [cs.CkptJob(j.id, float(self._ckpt_bytes(j))) for j in (job, *others)]
            fits = cs.notice_fit(cands, link, w, float(self.s["notice_margin"]))
            self._fit = (time.monotonic(), fits)
        return fits[job.id]

    # -- the reclaim --------------------------------------------------------------------------

    async def announce(self, notice_s: float, node: int | None = None, reason: str = "") -> dict[str, Any]:
        """A reclaim of ``node`` (None or this node: here) with ``notice_s`` of notice. Another
        node's reclaim is forwarded to its agent (authenticated control message). Raises
        MigrateError for a node outside the zone or one that cannot be reached."""
        notice_s = parse_duration(notice_s)
        reason = reason or "reclaim announced"
        if node is not None and node != self.node_id:
            try:
                res = await self._control(node, "reclaim", {"notice_s": notice_s, "reason": reason, "ts": time.time()})
            except (OSError, TimeoutError, TransferError) as e:
                raise MigrateError(f"reclaim of node {node}: its agent did not take the notice: {e}") from None
            return {"forwarded_to": node, **(res or {})}
        return self.start_reclaim(notice_s, reason)

    async def cancel(self, node: int | None = None, reason: str = "") -> dict[str, Any]:
        """Cancels the reclaim of ``node`` (None or this node: here, :meth:`Withdraw.cancel_reclaim`);
        another node's cancel is forwarded to its agent (control op ``reclaim-cancel``) as the
        reclaim itself is. Raises LookupError when that node has no reclaim, MigrateError for a
        node outside the zone, one that cannot be reached, or a cancel already running."""
        if node is None or node == self.node_id:
            return await self.withdraw.cancel_reclaim(reason)
        try:
            res = await self._control(node, "reclaim-cancel", {"reason": reason, "ts": time.time()}, timeout=30.0)
        except (OSError, TimeoutError, TransferError) as e:
            raise MigrateError(f"reclaim cancel of node {node}: its agent did not take it: {e}") from None
        if isinstance(res, dict) and "refused" in res:
            raise (LookupError if res.get("not_found") else MigrateError)(str(res["refused"]))
        return {"forwarded_to": node, **(res or {})}

    def start_reclaim(self, notice_s: float, reason: str) -> dict[str, Any]:
        """Plans and starts the evacuation of this node (idempotent while one runs: the earlier
        window stays, a shorter one replaces it). Stored (``migrate_reclaim``) so that an agent
        restarted inside the window restores it (:meth:`_restore_reclaim`)."""
        now = time.time()
        end = now + notice_s
        if self.reclaim is not None and not self.reclaim["task"].done():
            if end >= self.reclaim["deadline"]:
                return self.reclaim_status()
            self.reclaim["task"].cancel()
        elif not self.withdraw.cancelling:  # a new reclaim: what an earlier one did to jobs is history
            # (not while a cancel runs: its placement in flight is this reclaim's to remember), but
            # a move still finishing (a cancelled reclaim's) keeps its record: a restart settles it
            with self.agent.store.tx() as db:
                ledger.drop_moves(db, [j for j in self._move_phases() if j not in self.evacuating], only=mp.WINDOWED,
                                  counts=self.counts)
        with self.agent.store.tx() as db:
            db.execute("DELETE FROM migrate_reclaim")
            db.execute("INSERT INTO migrate_reclaim VALUES (?, ?, ?, ?, ?)", (self.node_id, notice_s, reason, now, end))
        drain.note_window(self.agent.store, now, notice_s)  # the end by the boot's clock: a wall-clock step moves it not
        self.agent.store.del_meta(drain.CANCEL_META)  # a cancel under way is superseded: a restart restores this one
        self.observe_departure(now, announced=True)
        self._begin_reclaim(notice_s, reason, now, end, restored=False)
        return self.reclaim_status()

    def _restore_reclaim(self) -> None:
        """At start: a stored reclaim whose window is still open is restored (the queue hold,
        draining in the zone, the kill-switch armed for the window's end, the evacuation of what
        has not moved; :meth:`_begin_reclaim`); one whose window ended is cleared (the owner took
        the node and gave it back: it is a node again), with a ``migrate`` event saying so."""
        db = self.agent.store.db
        row = db.execute("SELECT * FROM migrate_reclaim").fetchone()
        marker = self.agent.store.get_meta(drain.CANCEL_META)
        if marker is not None or row is None:
            # a cancel the agent's restart interrupted: what it left is settled as it would have
            with self.agent.store.tx() as tx:
                tx.execute("DELETE FROM migrate_reclaim")
            phases = self._move_phases()
            if marker is not None or phases:
                self._spawn(self.withdraw.settle_cancelled(phases, marker if isinstance(marker, dict) else None))
            return
        now = time.time()
        # what is left by the boot's clock (a step of the wall clock since does not count), or
        # after a reboot by the wall clock, never more than the notice
        left = drain.window_left(self.agent.store, float(row["notice_s"]), float(row["announced"]),
                                 float(row["deadline"]))
        end = now + left
        if abs(end - float(row["deadline"])) < 1.0:
            end = float(row["deadline"])  # the clocks agree: the end as stored (and as the guards were told)
        if left <= 0:
            with self.agent.store.tx() as tx:
                tx.execute("DELETE FROM migrate_reclaim")
                ledger.drop_moves(tx, self._move_phases(), only=mp.WINDOWED, counts=self.counts)
            jobs_mgr = getattr(self.agent, "jobs", None)
            if jobs_mgr is not None and getattr(jobs_mgr, "held", None) == drain.hold_reason(int(row["node"])):
                jobs_mgr.hold_queue(None)  # the window ended between the job manager's start and this one
            cut = self._cut_at_window_end(float(row["announced"]))
            for j in cut:  # what the window's end does: the agent was down then (its guard resumes it)
                self._spawn(self._stop_cut(j))
            self._emit(f"reclaim of node {row['node']} cleared: its window ended {-left:.1f} s before this "
                       "agent started (the owner gave the node back); it takes jobs again"
                       + (f"; stopped as reclaimed, their traffic cut at the window's end: {', '.join(j.id for j in cut)}"
                          if cut else ""), phase="reclaim-cleared", notice_s=float(row["notice_s"]), window_end=end,
                       reason=str(row["reason"]), stopped=[j.id for j in cut])
            # the peers forget its notice
            self._spawn(self.withdraw.retell_withdrawn(None, 0.0, at_once=True, marker=False))
            return
        self._begin_reclaim(float(row["notice_s"]), str(row["reason"]), float(row["announced"]), end, restored=True)

    def _begin_reclaim(self, notice_s: float, reason: str, announced: float, end: float, restored: bool) -> None:
        """Carries out this node's reclaim whose window ends at ``end`` (wall clock): holds the
        queue, drains the node in the zone (peers told of what is left of the window), arms the
        kill-switch of every active job for the window's end, plans and runs the evacuation and
        the placement of queued jobs elsewhere. ``restored``: the agent restarted inside the
        window: what must not run twice does not (the hazard's departure is not counted again; a
        job whose hand-over was sent is stopped here, not moved again; one its move froze is
        thawed and moved again; a queued job whose placement was not settled stays queued)."""
        left = max(0.0, end - time.time())
        jobs_mgr = getattr(self.agent, "jobs", None)
        active = list(jobs_mgr.active()) if jobs_mgr is not None else []
        if jobs_mgr is not None and hasattr(jobs_mgr, "hold_queue"):
            # the room the moves free must not start queued jobs on a node about to go (drain.py)
            jobs_mgr.hold_queue(drain.hold_reason(self.node_id))
        z = getattr(self.agent, "zone", None)
        told = 0
        if z is not None:
            with contextlib.suppress(Exception):
                told = z.reclaim_notice(left, reason)
        deadline_ns = time.monotonic_ns() + int(left * 1e9)
        armed = []
        ng = getattr(self.agent, "netguard", None)
        for j in active:
            if ng is not None:
                try:
                    ng.arm_job(j.cgroup_id, deadline_ns)
                    armed.append(j.id)
                except Exception as e:
                    log.warning("migrate: arming the kill-switch of %s failed: %s", j.id, e)
        phases = self._move_phases() if restored else {}
        handed = [j for j in active if phases.get(j.id, ("", None))[0] == "handover"]
        # a job whose archived record was being published when the agent stopped is stopped, not
        # moved again (StoppedCopies.restore_late_copies): the archive resumes it
        active = [j for j in active if j not in handed and j.id not in self.archive.stopped.late_stopping]
        for j in active:
            if phases.get(j.id, ("", None))[0] == "frozen":  # its move froze it: it checkpoints again
                with contextlib.suppress(Exception):
                    self._holds().adopt(j, Hold.MOVE)
                    self._holds().release(j, Hold.MOVE, timeout=0)  # asked; not waited for (on the loop)
        for j in handed:
            self._spawn(self.withdraw.stop_handed(j, phases[j.id][1]))
        placing = [jid for jid, (ph, _) in phases.items() if ph == "placing"
                   and jobs_mgr is not None and getattr(jobs_mgr.get(jid), "state", None) == "queued"]
        link = float(self.s["path_mbit"]) * 1e6 / 8
        # A job's checkpoint is not instant: it is written at its next step boundary. The pause
        # planned for is what this job took last time (else DEFAULT_CKPT_PAUSE_S).
        plan = cs.notice_schedule([cs.CkptJob(j.id, float(self._ckpt_bytes(j)),
                                              pause_s=self.ckpt_latency.get(j.id, DEFAULT_CKPT_PAUSE_S))
                                   for j in active], link, left, float(self.s["notice_margin"]))
        steps = {st.job_id: st for st in plan}
        now_mono = time.monotonic()
        self.reclaim = {"notice_s": notice_s, "reason": reason, "announced": announced, "deadline": end,
                        "deadline_mono": now_mono + left, "planned_mono": now_mono, "peers_told": told,
                        "armed": armed, "plan": [st.__dict__ for st in plan], "cancel": asyncio.Event()}
        if restored:
            self.reclaim["restored"] = time.time()
            self.reclaim["handed_over"] = [j.id for j in handed]
        self.reclaim["task"] = self._spawn(self._execute(active, steps))
        if self._drain_task is None or self._drain_task.done():  # one drain; it follows a shorter window
            self._drain_task = self._spawn(drain.place_queued_elsewhere(
                self, lambda: float(self.reclaim["deadline_mono"]) if self.reclaim else 0.0, skip=placing))
        for jid in placing:
            self._emit(f"queued job {jid} stays queued on reclaimed node {self.node_id}, held: its placement "
                       "elsewhere was asked for before the agent restarted and may have run there", job=jid,
                       outcome="unsettled")
        if restored:
            self._emit(f"reclaim of node {self.node_id} restored after an agent restart: {left:.1f} s of its window "
                       f"left; queue held, kill-switch armed for {len(armed)} jobs, {len(active)} jobs to move"
                       + (f", {len(handed)} handed over before the restart stopped here" if handed else ""),
                       phase="reclaim-restored", left_s=round(left, 3), jobs=[j.id for j in active],
                       handed_over=[j.id for j in handed], peers_told=told, plan=self.reclaim["plan"])
            return
        self._emit(f"reclaim of node {self.node_id} announced: {notice_s:g} s of notice ({reason}); "
                   f"{len(active)} jobs to move, kill-switch armed for the window's end",
                   notice_s=notice_s, jobs=[j.id for j in active], peers_told=told, plan=self.reclaim["plan"])

    def _cut_at_window_end(self, announced: float) -> list[Any]:
        """The running jobs of a reclaim whose window ended while no agent ran: those the
        reclaim armed (running when it was announced, wall clock ``announced``) whose armed
        deadline has passed, so the data plane cuts their traffic (the pinned maps outlived the
        agent); nobody stopped them at the window's end."""
        from laminar.bpf import abi
        from laminar.net.killswitch import cut_by_deadline

        jobs_mgr = getattr(self.agent, "jobs", None)
        ng = getattr(self.agent, "netguard", None)
        if jobs_mgr is None or ng is None:
            return []
        out = []
        for j in jobs_mgr.active():
            if j.started is not None and j.started > announced:
                continue  # started after the notice: the reclaim did not arm it
            try:
                e = ng.job_entry(j.cgroup_id)
            except Exception:
                continue
            if e is not None and cut_by_deadline(e.flags, e.kill_at_ns, abi.LM_JOB_ARMED):
                out.append(j)
        return out

    async def _stop_cut(self, job: Any) -> None:
        try:
            await self.agent.jobs.stop(job.id, f"node {self.node_id} reclaimed: {WINDOW_ENDED} while the agent "
                                       "was down, before the job moved (its traffic was cut then)", grace_s=0,
                                       state="reclaimed", cause=EndCause.WINDOW_ENDED)
        except Exception as e:
            log.warning("migrate: stopping %s, cut at the window's end while the agent was down: %s", job.id, e)

    def _move_phases(self) -> dict[str, tuple[str, int | None]]:
        """The reclaim's move records (``migrate_moves``, cause ``reclaim``): job id -> (phase, node)."""
        return {str(r["job_id"]): (str(r["phase"]), None if r["node"] is None else int(r["node"]))
                for r in ledger.move_records(self.agent.store.db, mp.WINDOWED)}

    def _note_move(self, job_id: str, event: mp.Event, node: int | None = None, pid: int | None = None,
                   request: dict[str, Any] | None = None) -> None:
        """Records what the reclaim did to ``job_id`` that a restart must not do twice
        (``migrate_moves``, cause ``reclaim``): ``freeze`` (its move froze it), ``hand-over``
        (with the node, its placement id and the request), ``place``."""
        with self.agent.store.tx() as db:
            ledger.record_move(db, job_id, event, cause=mp.Cause.RECLAIM, thaw=event is mp.Event.FREEZE, node=node,
                               pid=pid, request=request, counts=self.counts)

    def _holds(self) -> Holds:
        """The job manager's holds (runtime/holds.py): a move's freeze is its ``move`` hold, the
        fence's its ``fence`` hold (fence.py)."""
        return holds_of(self.agent.jobs)

    def _unhold(self, job: Any, froze: bool, timeout: float | None = None) -> bool:
        """Ends a move's hold on ``job`` (a job, or its id): released (thawed, unless another hold keeps it
        frozen) when the move froze it (``froze``), else dropped as it was (a job found frozen:
        the freeze was not the move's to undo). True when thawed."""
        if froze:
            return self._holds().release(job, Hold.MOVE, timeout=timeout)
        self._holds().drop(job, Hold.MOVE)
        return False

    async def _unhold_wait(self, job: Any, froze: bool, timeout: float) -> bool:
        """:meth:`_unhold`, the thaw waited for without blocking the loop."""
        if froze:
            return await self._holds().release_wait(job, Hold.MOVE, timeout)
        self._holds().drop(job, Hold.MOVE)
        return False

    def _restore_move_holds(self) -> None:
        """At start, after the moves' restore: a move's hold (kept by the job manager) that no
        record of a move accounts for was cut where none was kept (the agent died between the
        freeze and its record, or the job was frozen already): released, so the job is thawed
        unless another hold (Airlock's) keeps it frozen; never frozen for good."""
        if getattr(self.agent, "jobs", None) is None:
            return
        holds = self._holds()
        known = set(self._move_phases()) | set(self.evacuating) | set(self.archive.stopped.late_stopping) | set(self._archive_keeps)
        known |= {str(r["job_id"]) for r in ledger.move_records(self.agent.store.db)}
        for jid in sorted(holds.held_by(Hold.MOVE) - known):
            try:
                holds.release(jid, Hold.MOVE, timeout=0)
            except Exception as e:
                log.warning("migrate: releasing the move hold of %s, cut by the agent's stop: %s", jid, e)

    def _forget_move(self, job_id: str) -> None:
        """The reclaim's record of ``job_id``'s move goes."""
        with self.agent.store.tx() as db:
            ledger.drop_moves(db, [job_id], only=mp.WINDOWED, counts=self.counts)

    def _record_move(self, job_id: str, event: mp.Event, reason: str = "", thaw: bool | None = None,
                     node: int | None = None, pid: int | None = None, request: dict[str, Any] | None = None,
                     cause: mp.Cause = mp.Cause.MOVE_NOW) -> None:
        """Records where a move without a window (``migrate_moves``, ``cause`` one of
        :data:`ledger.WINDOWLESS`) is, before it gets there (``freeze``: before the freeze;
        ``hand-over``: before the hand-over is sent). A later phase keeps the earlier
        ``reason`` and ``thaw``."""
        with self.agent.store.tx() as db:
            ledger.record_move(db, job_id, event, cause=cause, reason=reason, thaw=bool(thaw), node=node, pid=pid,
                               request=request, counts=self.counts)

    def _drop_move_record(self, job_id: str) -> None:
        """The record of ``job_id``'s move without a window goes."""
        with self.agent.store.tx() as db:
            ledger.drop_moves(db, [job_id], only=ledger.WINDOWLESS, counts=self.counts)

    def _restore_moves(self) -> None:
        """At start: settles the moves without a window (a loan return's, Airlock's re-address)
        that the agent's stop or crash cut (``migrate_moves``). One cut before its hand-over was
        sent: the job is thawed (when the move froze it) and runs here, with a ``migrate`` event
        (phase ``move-cut``). One whose hand-over may have been sent: the destination is asked
        (:meth:`_settle_cut_move`), the job frozen and left alone by Airlock until it answers.
        A job that ended meanwhile only loses its record."""
        jobs_mgr = getattr(self.agent, "jobs", None)
        for r in ledger.move_records(self.agent.store.db, ledger.WINDOWLESS):
            jid = str(r["job_id"])
            job = jobs_mgr.get(jid) if jobs_mgr is not None else None
            if job is None or not job.active:
                self._drop_move_record(jid)
                continue
            if r["phase"] == "gone":  # an operator settled that its node runs it; the stop here was cut
                self.evacuating.add(jid)  # a reclaim restored in this start does not move it meanwhile
                self._spawn(self.settle.stop_settled(job, int(r["node"]), "the agent's restart"))
                continue
            if r["phase"] == "handover" and r["node"] is not None and r["pid"] is not None:
                self.evacuating.add(jid)  # Airlock leaves it frozen (AirlockManager.moving)
                self._holds().adopt(job, Hold.MOVE)
                self._spawn(self._settle_cut_move(job, int(r["node"]), int(r["pid"]), json.loads(r["request"]),
                                                  str(r["reason"]), bool(r["thaw"])))
                continue
            self._holds().adopt(job, Hold.MOVE)
            with contextlib.suppress(Exception):
                # thawed unless the job was frozen before the move (its other hold keeps it)
                self._unhold(job, bool(r["thaw"]), timeout=0)  # asked; not waited for (on the loop)
            self._drop_move_record(jid)
            self._emit(f"{jid}: its move ({r['reason']}) was cut before its hand-over by the agent's stop; "
                       + ("thawed, it runs here" if r["thaw"] else "it runs here, left as it was before the move"),
                       job=jid, phase="move-cut", reason=str(r["reason"]))

    async def _settle_cut_move(self, job: Any, node: int, pid: int, req: dict[str, Any], reason: str,
                               thaw: bool) -> None:
        """A move whose hand-over to ``node`` (placement ``pid``, request ``req``) may have been
        sent before the agent stopped: ``node`` is asked, with the same hand-over, until it
        answers (:meth:`Guard.handover`). It runs the job: the copy here is stopped (state
        ``migrated``). It does not: the job is thawed here (when the move froze it) and runs
        on. Either way a ``migrate`` event says so and the record goes; a cancel (the agent
        stops again) leaves the record for the next start. ``node`` cannot be asked (no zone, or
        it left the roster): the job stays frozen here and in ``evacuating`` (no reclaim's move,
        no Airlock re-address of it: ``node`` may run it) until an operator settles it
        (:meth:`Settle.settle_handover`) or a later start asks ``node``."""
        mv = Move(job.id, self.job_key(job), reason, phase="handover", dest=node)
        self.moves[job.id] = mv
        held = False
        try:
            try:
                dest_job = await self.guarding.handover(node, pid, req, confirm=True, sent=True, job_id=job.id)
            except MigrateError as e:
                mv.phase, mv.error = "failed", str(e)
                with contextlib.suppress(Exception):
                    await self._unhold_wait(job, thaw, 2.0)
                self._drop_move_record(job.id)
                self._emit(f"{job.id}: its move to node {node} ({reason}) was cut by the agent's stop during the "
                           f"hand-over; node {node} did not start it ({e}), so it runs here"
                           + (", thawed" if thaw else ""), job=job.id, node=node, phase="move-cut", error=str(e))
                return
            mv.phase, mv.dest_job = "done", dest_job
            self.counts["moved"] += 1
            with contextlib.suppress(Exception):
                await self.agent.jobs.stop(job.id, f"migrated to node {node} as {dest_job} (its hand-over, cut by "
                                           "the agent's stop, was confirmed there after the restart)", grace_s=1.0,
                                           state="migrated", cause=EndCause.MIGRATED)
            self._drop_move_record(job.id)
            self._emit(f"{job.id}: its move to node {node} ({reason}) was cut by the agent's stop during the "
                       f"hand-over; node {node} runs it as {dest_job}, so it is stopped here", job=job.id, node=node,
                       dest_job=dest_job, phase="done")
        except (KeyError, AttributeError) as e:  # no zone, or the node left its roster: asked at the next start
            mv.error = f"cannot ask node {node}: {e!r}"
            self._emit(f"{job.id}: its move to node {node} was cut by the agent's stop during the hand-over and node "
                       f"{node} cannot be asked ({e!r}); the job stays frozen here (it may run there) until a start "
                       "that can ask it, or an operator's call", job=job.id, node=node, phase="unconfirmed")
            held = True  # still being moved: the settle (Settle._settle_move) takes it out of evacuating
        finally:
            mv.ended = time.time()
            if not held:
                self.evacuating.discard(job.id)

    def reclaim_status(self) -> dict[str, Any]:
        r = self.reclaim
        out: dict[str, Any] = {"node": self.node_id, "reclaim": None,
                               "notices": {str(n): {"window_end": e, "received": rcv} for n, (e, rcv) in self.notices.items()}}
        if r is not None:
            out["reclaim"] = {k: v for k, v in r.items() if k not in ("task", "cancel")} | {
                "left_s": round(max(0.0, r["deadline"] - time.time()), 3), "done": r["task"].done()}
        return out

    async def _execute(self, jobs: list[Any], steps: dict[str, cs.NoticeStep]) -> None:
        """The evacuation, then, at the window's end, the stop of what still runs. Withdrawn
        (``cancel`` set, :meth:`Withdraw.cancel_reclaim`): no move begins any more, a move already begun
        finishes (never cut: its job must not stay frozen or end up nowhere) and nothing is
        stopped at the window's end."""
        assert self.reclaim is not None
        t0 = self.reclaim["planned_mono"]
        deadline = self.reclaim["deadline_mono"]
        cancel: asyncio.Event = self.reclaim["cancel"]

        async def one(job: Any) -> None:
            st = steps.get(job.id)
            if st is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancel.wait(), max(0.0, t0 + st.signal_at_s - time.monotonic()))
            while job.id in self.evacuating and not cancel.is_set():
                # a move begun before this reclaim (a withdrawn reclaim's, finishing; Airlock's,
                # a loan's) runs on: never two moves of one job (two hand-overs: two copies)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancel.wait(), 0.2)
            while job.id in self.fence.fenced_jobs and job.active and not cancel.is_set():
                # fenced (this node heard none of its zone; fence.py): the zone may have taken it
                # over, and a move now would start a second lineage of it. Its settling stops it
                # (taken over) or thaws it (moved then); unsettled at the window's end, it is
                # stopped there as the rest (its guard resumes it)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancel.wait(), 0.2)
            if cancel.is_set():
                return  # withdrawn before this job's move began
            if not job.active:
                return  # the earlier move took it away (or it ended, or its fence settled it as taken)
            prev = self.moves.get(job.id)
            if prev is not None and job.id in self._archive_keeps:
                await self._stop_archived(job, prev)  # an earlier plan's move, cut while it stopped the job
                return
            await self._move(job, f"reclaim of node {self.node_id}", deadline, final=st is None or st.final,
                             transfer_deadline=None if st is None else t0 + st.deadline_s)

        work = asyncio.ensure_future(asyncio.gather(*(one(j) for j in jobs), self._pass_guards(deadline, cancel),
                                                    return_exceptions=True))
        # cut with its moves still unwinding, a gather ends with a CancelledError that the cut
        # (which re-raises its own) never reads: read here, or asyncio logs it as never retrieved
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait({work}, timeout=max(0.0, deadline - time.monotonic()))
            if not cancel.is_set():
                if not work.done():  # the window ended: what is still moving is cut
                    work.cancel()
                    await asyncio.wait({work})  # (a cancel of this task itself still propagates)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancel.wait(), max(0.0, deadline - time.monotonic()))
            if cancel.is_set():
                await asyncio.wait({work})  # moves begun before the withdrawal finish (or fail and thaw their job)
                return
        except asyncio.CancelledError:  # a shorter window replaced this one, or the agent stops
            work.cancel()
            raise
        jobs_mgr = self.agent.jobs
        for j in list(jobs_mgr.active()):
            if cancel.is_set():
                return  # withdrawn while the window's end stopped jobs: the rest run on
            try:
                await jobs_mgr.stop(j.id, f"node {self.node_id} reclaimed: {WINDOW_ENDED} before the job moved",
                                    grace_s=0, state="reclaimed", cause=EndCause.WINDOW_ENDED)
            except Exception as e:
                log.debug("migrate: stopping %s at the window's end: %s", j.id, e)
        self._emit(f"reclaim of node {self.node_id}: window ended", moved=self.counts["moved"])

    async def move_now(self, job: Any, reason: str) -> Move:
        """Move ``job`` elsewhere now, without a deadline: checkpoint, reserve, transfer, hand
        over, stop here (state ``migrated``). The loan return's ``migrate`` action. Never
        raises: a failed move (phase ``failed``) leaves the job running here."""
        return await self._move(job, reason, None, final=True, cause=mp.Cause.MOVE_NOW)

    async def readdress(self, job: Any) -> dict[str, Any]:
        """Airlock's re-address rung: move ``job`` elsewhere now, without a deadline (Airlock has
        already sent the checkpoint signal; a new checkpoint is waited for all the same)."""
        return (await self._move(job, "airlock re-address", None, final=True, cause=mp.Cause.READDRESS)).as_dict()

    # -- one move -----------------------------------------------------------------------------

    async def _wait_checkpoint(self, job: Any, after: Path | None, timeout: float,
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
                built[p] = self._checked_manifest(job, p)
            except TransferError as e:  # corrupt, or saved again while it was read: not this one
                raise jobkit.CheckpointError(str(e)) from None

        scan, lane = self._ckpt_tools()
        new = await ckpt_driver.wait_new_checkpoint(job.ckpt_dir, after, timeout,
                                                    lambda: bool(job.active) and (alive is None or alive()),
                                                    check=check, found=found, job=job, scanner=scan, lane=lane,
                                                    settings=self.s)
        return new, None if new is None else built.get(new)

    def _checked_manifest(self, job: Any, p: Path) -> Manifest:
        """The transfer manifest of ``job``'s checkpoint ``p``, its files checked against the
        job's manifest beside the chunks' hashes (one read of each byte by each, in threads):
        a send given it hashes nothing again. Blocking (callers run it in a thread). Raises
        TransferError (corrupt, or saved again while it was read) or OSError."""
        return build_manifest(p, self.job_key(job), int(self.s.get("chunk_kb", DEFAULT_CHUNK >> 10)) << 10)

    def _driver_checked(self, job: Any) -> tuple[Path | None] | None:
        """(``job``'s newest verified checkpoint, or None: none verified) as the checkpoint
        driver's last check of the job's listing found it, while that listing holds; None when
        there is no such check (:meth:`ckpt_driver.CkptDriver.checked`). Lists the job's
        checkpoint directory (no checkpoint is read)."""
        hit = self.ckpt.checked(job) if self.ckpt is not None and job.ckpt_dir else None
        return None if hit is None else (hit[0],)

    def _prestage_manifest(self, job: Any) -> bool:
        """Whether the checkpoint driver's check of ``job``'s new checkpoints should build their
        transfer manifest (:meth:`_newest_checked`): this agent prestages the job now."""
        return (self.zone is not None and self.s["prestage"] != "off" and job.id not in self.evacuating
                and self._should_prestage(job))

    async def _newest_checked_once(self, job: Any) -> tuple[Path | None, Manifest | None]:
        """:meth:`_newest_checked` by way of the checkpoint driver's check of ``job``'s listing
        (:meth:`ckpt_driver.CkptDriver.check`: done once, whoever asks first, with the manifest
        for a job this agent prestages), when it found a checkpoint and built its manifest and
        the checkpoint's files are still the ones it read (the same inode, size and mtime:
        :func:`_same_files`); else built here, in a thread."""
        if self.ckpt is not None and job.ckpt_dir:
            ckpt, m = await self.ckpt.check(job, manifest=True)
            if ckpt is not None and m is not None:
                scan, lane = self._ckpt_tools()
                try:  # a stat of each of the job's files: the job's storage, in its owner's lane
                    m = await lane.run(getattr(job, "owner_uid", 0), _same_files, m, ckpt, timeout_s=SAME_FILES_S)
                except (TimeoutError, LaneBusy):
                    return None, None
                if m is not None:
                    return ckpt, m
        got, built, _ = await self._check_now(job, manifest=True)
        return got, built

    def _ckpt_tools(self) -> tuple[CkptScanner, Lane]:
        """The checkpoint driver's scanner and check lane (the job manager's scanner, which
        Airlock reads too), or, for a component without a driver, ones of its own."""
        if self.ckpt is not None:
            return self.ckpt.scan, self.ckpt.lane
        if self._own_ckpt_tools is None:
            scan = getattr(getattr(self.agent, "jobs", None), "ckpt_scan", None) or CkptScanner()
            self._own_ckpt_tools = (scan, Lane("ckpt-verify", workers=ckpt_driver.VERIFY_WORKERS,
                                               timeout_s=float(self.s.get("verify_timeout_s",
                                                                          ckpt_driver.VERIFY_TIMEOUT_S))))
        return self._own_ckpt_tools

    async def _check_now(self, job: Any, manifest: bool) -> tuple[Path | None, Manifest | None, Any]:
        """``job``'s newest checkpoint that passes its check, the transfer manifest the check
        built (``manifest``) and what it found (:class:`ckpt_driver.Checked`), or (None, None,
        None): listed and checked off the loop, in the job's owner's lanes, within the settings'
        limits (:func:`ckpt_driver.check_newest`); a listing or check that does not finish in
        time finds none."""
        if not job.ckpt_dir:
            return None, None, None
        scan, lane = self._ckpt_tools()
        listing = await scan.refresh(job)
        if listing is None or not listing.ckpts:
            return None, None, None
        build = (lambda p: self._checked_manifest(job, p)) if manifest else None
        try:
            return await lane.run(getattr(job, "owner_uid", 0), ckpt_driver.check_newest, listing.paths(), self.s,
                                  build)  # type: ignore[no-any-return]
        except (TimeoutError, LaneBusy) as e:
            log.info("migrate: %s: checking its checkpoints: %s", job.id, e)
            return None, None, None

    async def _move(self, job: Any, reason: str, deadline_mono: float | None, final: bool = True,
                    transfer_deadline: float | None = None, cause: mp.Cause | None = None) -> Move:
        """Checkpoint, reserve, transfer, hand over, stop here. ``deadline_mono``: the window's
        end; ``transfer_deadline``: when the plan wants the transfer done (what the shaper
        paces to; the rest of the window is for the hand-over); ``cause``: what its record says
        (default: ``reclaim`` with a window, else ``move_now``). Never raises: the outcome is
        in the returned Move (phase done or failed) and in ``migrate`` events."""
        mv = Move(job.id, self.job_key(job), reason,
                  deadline=None if deadline_mono is None else time.time() + deadline_mono - time.monotonic(),
                  cause=cause or (mp.Cause.RECLAIM if deadline_mono is not None else mp.Cause.MOVE_NOW))
        self.moves[job.id] = mv
        self.evacuating.add(job.id)
        self.prestage.supersede(job.id)
        self.counts["moves"] += 1
        frozen = False
        try:
            if job.id in self.fence.fenced_jobs:
                raise MigrateError(f"{job.id} is fenced (node {self.node_id} heard none of its zone; "
                                   "migrate.fence_after_s): it moves once its fence is settled, if nobody took it over")
            if self.zone is None:
                raise MigrateError("this node is in a one-node zone: there is nowhere to move the job")
            # the newest verified checkpoint: the checkpoint driver's check of the job's listing
            # (nothing read here while it holds: a whole read of a checkpoint of many GB before
            # the final checkpoint is even asked for, seconds of the window; else checked now)
            before_manifest = None
            before_size: int | None = None
            if self.ckpt is not None and job.ckpt_dir:
                before, before_manifest = await self.ckpt.check(job, manifest=False)
                before_size = self.ckpt.verified_bytes(job) if before is not None else None
            else:
                before, _, info = await self._check_now(job, manifest=False)
                before_size = info.size_bytes if info is not None else None
            ckpt = before
            held = False

            async def hold(_seen: Path | None = None) -> None:
                """Freezes the job (once): its steps after the checkpoint are lost anyway. Done as
                soon as the final checkpoint is there, before it is checked: the job's cores go to
                the check, and no more steps are thrown away meanwhile (a check reads the whole
                checkpoint: seconds for many GB). Only what this move froze is thawed if it
                fails: a job Airlock had suspended (already frozen) stays as Airlock left it."""
                nonlocal frozen, held
                if held:
                    return
                held = True
                already = False
                with contextlib.suppress(Exception):
                    already = bool(job.cgroup.frozen())
                if deadline_mono is None:  # before the freeze: a restart thaws what a crash cut (_restore_moves)
                    self._record_move(job.id, mp.Event.FREEZE, reason=reason, thaw=not already, cause=mp.Cause(mv.cause))
                took = already
                with contextlib.suppress(Exception):
                    # the move's hold (runtime/holds.py), waited for without blocking the loop: a
                    # task of the job in uninterruptible sleep (its own hung FUSE mount) freezes
                    # only once it wakes
                    took = await self._holds().hold_wait(job, Hold.MOVE, FREEZE_WAIT_S)
                    frozen = not already
                if not took:
                    self.counts["freeze_timeouts"] = self.counts.get("freeze_timeouts", 0) + 1
                    self._emit(f"{job.id}: not frozen within {FREEZE_WAIT_S:g} s (a task of it in uninterruptible "
                               "sleep: hung storage?); the freeze stays asked for, the move goes on", job=job.id,
                               phase="freeze-pending")
                if frozen and deadline_mono is not None:  # a reclaim's: a restart thaws it and moves it again
                    self._note_move(job.id, mp.Event.FREEZE)
                self.frozen_at[job.id] = time.time()

            if final:
                mv.phase = "checkpoint"
                asked_ok = self.agent.jobs.request_checkpoint(job)
                if asked_ok:
                    self._emit(f"{job.id}: checkpoint requested ({reason})", job=job.id, phase=mv.phase)
                else:
                    self._emit(f"{job.id}: its process does not catch {job.spec.checkpoint_signal} (sending it would "
                               f"kill it): no final checkpoint ({reason})", job=job.id, phase=mv.phase)
                wait = float(self.s["ckpt_wait_s"]) if asked_ok else 0.0
                if deadline_mono is not None:
                    wait = min(wait, max(0.0, deadline_mono - time.monotonic()))
                asked = time.monotonic()
                # frozen once its checkpoint is there; a checkpoint that then fails its check ends
                # the wait (a frozen job saves no other): the last verified one is moved
                new, mv.manifest = await self._wait_checkpoint(job, before, wait, found=hold, alive=lambda: not held)
                if new is not None:
                    self.ckpt_latency[job.id] = time.monotonic() - asked
                elif held:
                    self._emit(f"{job.id}: its final checkpoint failed its check; "
                               + ("moving the last one" if before else "it has no other"), job=job.id)
                else:
                    self._emit(f"{job.id}: no new checkpoint within {wait:.1f} s; moving the last one"
                               if before else f"{job.id}: no checkpoint within {wait:.1f} s", job=job.id)
                ckpt = new or before
                if new is None:
                    mv.manifest = before_manifest  # (the send checks it holds: _same_files)
            else:
                mv.manifest = before_manifest
            if ckpt is None:
                raise MigrateError("the job has no verified checkpoint to move (does it use laminar.jobkit?)")
            await hold()
            mv.ckpt = ckpt.name
            # its size by its check (the manifest it verified): never a stat of the job's files
            if mv.manifest is not None and mv.manifest.ckpt_id == ckpt.name:
                size = int(mv.manifest.total_bytes)
            else:
                size = before_size if ckpt == before and before_size is not None else DEFAULT_CKPT_BYTES
            window = None if deadline_mono is None else max(0.0, deadline_mono - time.monotonic())
            prestaged = self.prestage.shipped.get(job.id) == ckpt.name
            ranked = self.rank_for(job, float(size), window, prestaged)
            mv.ranked = [{"node": int(r.candidate.node), "feasible": r.feasible,
                          "expected_loss_s": None if math.isinf(r.expected_loss_s) else round(r.expected_loss_s, 3),
                          "reasons": list(r.reasons)} for r in ranked]
            feasible = [r for r in ranked if r.feasible]
            xfer = deadline_mono
            if transfer_deadline is not None and deadline_mono is not None:
                # late (the checkpoint took longer than planned): as soon as the shaper can,
                # never past the window
                xfer = min(deadline_mono, max(transfer_deadline, time.monotonic() + TRANSFER_MIN_S))
            errors = []
            if not feasible:
                errors.append("no destination fits: " + "; ".join(
                    f"node {r.candidate.node}: {', '.join(r.reasons)}" for r in ranked[:4]) if ranked else
                    "no destination fits: no live peer in the zone")
            # a node a move or a prestage found silent lately is left out: another job of this
            # reclaim would pay the same timeouts there (it is back once the zone hears from it)
            silent = self.prestage.silent_peers()
            errors += [f"node {r.candidate.node}: found silent lately" for r in feasible if int(r.candidate.node) in silent]
            feasible = [r for r in feasible if int(r.candidate.node) not in silent]
            for r in feasible:
                node = int(r.candidate.node)
                try:
                    await self._move_to(job, mv, ckpt, node, xfer)
                    break
                except HandoverSettled:
                    raise  # the operator's call: the job runs here, not on another node
                except (MigrateError, TransferError, OSError, TimeoutError) as e:
                    if isinstance(e, PeerSilentError):
                        self.prestage.mark_silent(node)
                    errors.append(f"node {node}: {e}")
                    self._emit(f"{job.id}: move to node {node} failed: {e}", job=job.id, node=node)
            else:
                if deadline_mono is None or not self.s["holder"]:
                    raise MigrateError("; ".join(errors))
                # Nowhere to run it during the window: the final checkpoint still leaves the node.
                await self._hold(job, mv, ckpt, size, xfer, "; ".join(errors), deadline_mono)
                return mv
            mv.phase = "done"
            self.counts["moved"] += 1
            if deadline_mono is not None:
                self._forget_move(job.id)
            else:
                self._drop_move_record(job.id)
            return mv
        except (MigrateError, TransferError, OSError) as e:
            mv.phase, mv.error = "failed", str(e)
            self.counts["failed"] += 1
            self._emit(f"{job.id}: move failed: {e}", job=job.id, phase="failed", error=str(e))
            with contextlib.suppress(Exception):
                await self._unhold_wait(job, frozen, FREEZE_WAIT_S)
            with contextlib.suppress(Exception):
                if deadline_mono is not None:
                    self._forget_move(job.id)
                else:
                    self._drop_move_record(job.id)
            return mv
        except asyncio.CancelledError:  # cut: the window's end, a shorter window, the agent stopping
            # what this move froze is thawed unless its hand-over was sent (the destination may
            # run it; done: it does): a later move of the job, which finds it frozen already, would never thaw it
            # _archive_keeps: its checkpoint is (or goes) in the archive, where any agent with room
            # claims it; the window's end, a new plan (_stop_archived) or a restart stops it
            if mv.phase not in ("handover", "done") and job.id not in self._archive_keeps:
                thawed = not frozen
                with contextlib.suppress(Exception):
                    # asked, and looked at once: this task is being cancelled (no wait here)
                    thawed = self._unhold(job, frozen, timeout=0) or not frozen
                if thawed and deadline_mono is None:  # else its record has a restart thaw it
                    with contextlib.suppress(Exception):
                        self._drop_move_record(job.id)
            raise
        except Exception as e:  # a bug must not leave the job frozen
            log.exception("migrate: move of %s", job.id)
            mv.phase, mv.error = "failed", repr(e)
            with contextlib.suppress(Exception):
                await self._unhold_wait(job, frozen, FREEZE_WAIT_S)
            with contextlib.suppress(Exception):
                if deadline_mono is not None:
                    self._forget_move(job.id)
                else:
                    self._drop_move_record(job.id)
            return mv
        finally:
            mv.ended = time.time()
            self.evacuating.discard(job.id)

    # -- storage holders ----------------------------------------------------------------------

    async def _disk_free(self, nodes: list[int], need_bytes: int) -> dict[int, float | None]:
        """Each node's free disk for checkpoints (its answer to ``space``; None: no answer)."""
        async def ask(n: int) -> float | None:
            try:
                res = await self._control(n, "space", {"bytes": int(need_bytes)}, timeout=2.0)
                return float(res["free_bytes"])
            except (MigrateError, TransferError, OSError, TimeoutError, KeyError, TypeError, ValueError) as e:
                log.info("migrate: node %d did not say its free disk space: %s", n, e)
                return None

        answers = await asyncio.gather(*(ask(n) for n in nodes))
        return dict(zip(nodes, answers, strict=True))

    async def rank_holders(self, key: str, size: int, window_s: float | None, prefer: int | None) -> list[Any]:
        """Live peers that could hold a checkpoint of ``size`` bytes (not suspect, not draining,
        not under a reclaim notice), ranked by :func:`laminar.policy.holder.choose_holder`
        with their own answers about free disk space."""
        cands = self.candidates(dst.Resources())
        free = await self._disk_free([int(c.node) for c in cands], size)
        hc = [HolderCandidate(c.node, c.zone, free[int(c.node)], c.path_bps, float(c.survival or 0.0)) for c in cands]
        z = self.zone
        return choose_holder(hc, float(size), window_s, margin=float(self.s["notice_margin"]),
                             src_zone=None if z is None else str(z.zone),
                             prefer=() if prefer is None else (str(prefer),))

    async def _hold(self, job: Any, mv: Move, ckpt: Path, size: int, xfer_deadline: float | None, why: str,
                    window_end: float) -> None:
        """No peer can run ``job`` now: send its final checkpoint to the best storage holder,
        hand it the guard (as a buddy's: it takes the job over at this node's window end, should
        this agent die now), stop the job here (state ``reclaimed``) and tell the holder to take
        it over (``take_over``), so it places the job as soon as room frees. Raises MigrateError
        when no holder takes it. With ``archive_dir``, the copy beside the holder is archived
        before the holder is told to take over, so its take-over claims the record (one node
        runs the job).
        The archive (a copy beside the holder, or the job's only one when no holder takes it) is
        waited for until ARCHIVE_WAIT_MARGIN_S before ``window_end`` (the reclaim's window, not
        the transfer's plan: the copy comes after the transfer), never longer
        (:meth:`StoppedCopies.publish_until`): one that does not answer by then publishes nothing later."""
        mv.phase = "hold"
        window = None if xfer_deadline is None else max(0.0, xfer_deadline - time.monotonic())
        ranked = await self.rank_holders(self.job_key(job), size, window, self.prestage.buddy.get(job.id))
        mv.ranked += [{"node": int(r.candidate.node), "feasible": r.feasible, "holder": True,
                       "reasons": list(r.reasons)} for r in ranked]
        errors = [why]
        if not any(r.feasible for r in ranked):
            errors.append("no holder: " + ("; ".join(f"node {r.candidate.node}: {', '.join(r.reasons)}"
                                                      for r in ranked[:4]) or "no live peer in the zone"))
        silent = self.prestage.silent_peers()  # a node a move or a prestage found silent lately: left out
        for r in (r for r in ranked if r.feasible and int(r.candidate.node) not in silent):
            node = int(r.candidate.node)
            mv.dest = node
            self._emit(f"{job.id}: no room for it in the zone ({why}); sending {ckpt.name} to node {node} to hold",
                       job=job.id, node=node, phase="hold")
            try:
                await self._send(job, ckpt, node, xfer_deadline, mv, silent_retries=MOVE_SILENT_RETRIES,
                                 manifest=mv.manifest)
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                if isinstance(e, PeerSilentError):
                    self.prestage.mark_silent(node)
                errors.append(f"holder {node}: {e}")
                continue
            # The holder guards the job before it stops here (as a buddy: it takes the job over
            # when this node's window ends, which the guard carries): an agent crash between the
            # stop and the take-over below leaves the job its keeper. Told to take over only
            # once the job is stopped, it never runs it beside this node.
            old = self.prestage.buddy.get(job.id)
            try:
                await self._guard(job, node, ckpt.name)
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                errors.append(f"holder {node} has {ckpt.name} but did not take the guard: {e}")
                continue
            self.prestage.set_buddy(job.id, node)
            if old is not None and old != node:  # its guard of an older checkpoint is not needed (not awaited:
                self._spawn(self.prestage.release(old, self.job_key(job)))  # a silent old buddy delays nothing)
            lost = max(0.0, self.frozen_at.pop(job.id, time.time()) - ckpt.stat().st_mtime)
            with contextlib.suppress(Exception):  # stopped before the holder may resume it
                await self.agent.jobs.stop(job.id, f"node {self.node_id} reclaimed with no room in the zone: "
                                           f"{ckpt.name} held by node {node}, which resumes the job when room frees",
                                           grace_s=1.0, state="reclaimed", work_lost_s=round(lost, 3),
                                           cause=EndCause.HELD_ELSEWHERE)
            if self.archive.root() is not None:  # the holder is one node: the archive outlives it
                # archived before the holder is told to take over: its take-over then claims the
                # record (the lock); told first, it could place the job from its replica while the
                # archive held nothing, and the record published after would be claimed by any
                # agent with room (the job twice)
                try:
                    await self.archive.stopped.publish_until(f"archiving {job.id}", self.job_key(job), ckpt, {
                        "key": self.job_key(job), "src_node": self.node_id, "src_job": job.id,
                        "request": self._request(job, True)}, window_end - ARCHIVE_WAIT_MARGIN_S)
                except (OSError, jobkit.CheckpointError, MigrateError) as e:
                    # a hung one publishes nothing later (given up): the holder alone keeps the job
                    log.warning("migrate: archiving %s failed: %s", job.id, e)
                    self._emit(f"{job.id}: not archived beside holder {node}: {e}", job=job.id, node=node,
                               phase="hold")
            try:
                await self._guard(job, node, ckpt.name, take_over=True)
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                raise MigrateError(f"holder {node} guards {ckpt.name} but was not told to take the job over now: "
                                   f"{e}; it takes it over when this node's window ends") from None
            mv.phase = "held"
            self.counts["held"] += 1
            self._emit(f"{job.id}: {ckpt.name} held by node {node}; it resumes the job when room frees",
                       job=job.id, node=node, ckpt=ckpt.name, phase="held")
            return
        if self.archive.root() is not None:
            # no live peer keeps it: the archive does, and any agent with room claims it
            buddy = self.prestage.buddy.get(job.id)
            key = self.job_key(job)
            record = {"key": key, "src_node": self.node_id, "src_job": job.id, "request": self._request(job, True)}
            late_ok = buddy is None
            # given up only if this wait is cut (a shorter window, the agent's stop): the job is
            # then thawed and moved again, and a copy published later would be a second one
            aw = ArchiveWait() if late_ok else None
            if late_ok:  # a restart takes the copy up again, never publishing it twice (StoppedCopies.restore_late_copies)
                self.archive.stopped.late_row_add(key, job.id, ckpt, record)

            def settled(e: BaseException | None) -> None:
                self.archive.stopped.late_row_drop(key)
                self._late_copy_settled(mv, e)
            try:
                # with no buddy, a late copy is still wanted: it is the job's only one once this
                # node is gone (published if the storage answers before then)
                path = await self.archive.stopped.publish_until(f"archiving {job.id}", key, ckpt, record,
                                                 window_end - ARCHIVE_WAIT_MARGIN_S, late_ok=late_ok,
                                                 settled=settled if late_ok else None,
                                                 mark=(lambda: self.archive.stopped.late_mark(key)) if late_ok else None, wait=aw)
            except asyncio.CancelledError:
                if aw is not None and aw.given_up:
                    self.archive.stopped.late_row_drop(key)  # nothing is published: the job is thawed (_move)
                elif aw is not None:  # its record was being put in place: the job stays frozen, stopped
                    self._archive_keeps.add(job.id)  # by the window's end, a new plan or a restart
                raise
            except MigrateError as e:
                if not late_ok:  # a hung archive: as with none, the move fails (its job thawed)
                    errors.append(f"{e}: nothing archived; its buddy, node {buddy}, still guards it")
                    raise MigrateError("; ".join(errors)) from None
                self.archive.stopped.late_row_late(key)  # before the stop: a restart that finds the job reclaimed takes it up
                self._archive_keeps.add(job.id)
                mv.phase, mv.dest = "archiving", None  # before the stop: the copy may land meanwhile
                # Its copy goes on past the window, and the job stops now: thawed, it would run on
                # here beside the copy any agent with room claims once it is published (the job
                # twice), and its steps from here are lost at the window's end anyway.
                lost = max(0.0, self.frozen_at.pop(job.id, time.time()) - ckpt.stat().st_mtime)
                with contextlib.suppress(Exception):
                    await self.agent.jobs.stop(job.id, f"node {self.node_id} reclaimed with no room, no holder and no "
                                               f"buddy in the zone: {e}; {ckpt.name} is published there if it answers "
                                               "before the node goes, and the first agent with room resumes it",
                                               grace_s=1.0, state="reclaimed", work_lost_s=round(lost, 3),
                                               cause=EndCause.ARCHIVED)
                self._archive_keeps.discard(job.id)
                self.counts["archive_late"] = self.counts.get("archive_late", 0) + 1
                self._emit(f"{job.id}: {'; '.join(errors)}; {e}: {ckpt.name} is still being archived (an event "
                           "says when it is there)", job=job.id, ckpt=ckpt.name, phase="archiving")
                return
            except BaseException:
                if late_ok:
                    self.archive.stopped.late_row_drop(key)
                raise
            self._archive_keeps.add(job.id)  # cut in the stop, the job is not thawed (_move): the archive resumes it
            lost = max(0.0, self.frozen_at.pop(job.id, time.time()) - ckpt.stat().st_mtime)
            with contextlib.suppress(Exception):
                await self.agent.jobs.stop(job.id, f"node {self.node_id} reclaimed with no room and no holder in the "
                                           f"zone: {ckpt.name} archived in {path.parent}; the first agent with room "
                                           "resumes it", grace_s=1.0, state="reclaimed", work_lost_s=round(lost, 3),
                                           cause=EndCause.ARCHIVED)
            self._archive_keeps.discard(job.id)
            if late_ok:  # after the stop: a restart before it finds the record published and the job here
                self.archive.stopped.late_row_drop(key)
            old = self.prestage.forget_buddy(job.id)
            if old is not None:
                await self.prestage.release(old, self.job_key(job))
            mv.phase, mv.dest = "archived", None
            self.counts["archived"] += 1
            self._emit(f"{job.id}: {'; '.join(errors)}; {ckpt.name} archived in {path.parent}", job=job.id,
                       ckpt=ckpt.name, phase="archived")
            return
        raise MigrateError("; ".join(errors))

    async def _stop_archived(self, job: Any, mv: Move) -> None:
        """A job whose move (an earlier plan's, cut by a shorter window) archived its checkpoint,
        or was archiving it, before it could stop the job (``_archive_keeps``): stopped here
        (``reclaimed``), never moved again (the archive's record is claimable: it would run twice)."""
        with contextlib.suppress(Exception):
            await set_frozen_async(job.cgroup, False, 2.0)  # a frozen job is not killed by a signal until it thaws
        what = mv.ckpt or "its checkpoint"
        try:
            await self.agent.jobs.stop(job.id, f"node {self.node_id} reclaimed: {what} is in the archive, or on its "
                                       "way there; the first agent with room resumes it", grace_s=0, state="reclaimed",
                                       cause=EndCause.ARCHIVED)
        except Exception as e:
            log.warning("migrate: stopping %s, archived before a new plan: %s", job.id, e)
        self._archive_keeps.discard(job.id)
        self._emit(f"{job.id}: {what} archived (or on its way there) by an earlier plan's move, cut before it "
                   "stopped the job; stopped here, not moved again", job=job.id, phase="archive-stop")

    def _late_copy_settled(self, mv: Move, error: BaseException | None) -> None:
        """The end of a move's copy that went on past its window's wait (phase ``archiving``):
        in the archive now (``error`` None), the move reads ``archived``, as one whose copy
        landed in time; refused by the storage, it reads ``failed`` with the error, and a
        ``migrate`` event (phase ``failed``) says the job's checkpoint is nowhere else."""
        if mv.phase != "archiving":
            return
        if error is None:
            mv.phase = "archived"
            self.counts["archived"] += 1
            return
        mv.phase, mv.error = "failed", f"archiving {mv.ckpt or 'its checkpoint'} failed after the window's wait: {error}"
        self.counts["failed"] += 1
        self._emit(f"{mv.job}: {mv.error}; the job's checkpoint is only on this node (its ckpt directory)",
                   job=mv.job, phase="failed", error=str(error))

    async def _pass_guards(self, deadline_mono: float, withdrawn: asyncio.Event | None = None) -> None:
        """This node is reclaimed: every job it guards whose source has stopped it (a held
        checkpoint, ``take_over``, or a guard waiting for room) goes on to the best storage
        holder among the live peers, with its newest verified checkpoint and the guard, so the
        job is not lost with this node. (A guard of a job that still runs at its source needs
        nothing: the source sees this node's notice and picks another buddy.) ``withdrawn`` set
        (the reclaim was cancelled): the guards not passed yet stay here."""
        db = self.agent.store.db
        rows = db.execute("SELECT * FROM migrate_replicas WHERE state IN ('guarding', 'waiting')").fetchall()
        for row in rows:
            if withdrawn is not None and withdrawn.is_set():
                return
            key = row["key"]
            try:
                req = json.loads(row["request"])
            except ValueError:
                continue
            if row["state"] != "waiting" and not req.get("take_over"):
                continue
            # a take-over in flight ends first (it may place the job); one that still waits (on a hung
            # archive: its claim) when the window is nearly over keeps the guard here, and the next go on
            until = deadline_mono - ARCHIVE_WAIT_MARGIN_S
            while key in self.guarding.taking and time.monotonic() < until and not (withdrawn and withdrawn.is_set()):
                await asyncio.sleep(0.05)
            if key in self.guarding.taking:
                if not (withdrawn and withdrawn.is_set()):
                    busy = self.archive.lane.busy
                    self._emit(f"{key}: could not pass its guard on before this node left: its take-over in flight "
                               "did not end within the window" + (f" (the archive's lane waits on: {busy[0]})"
                                                                  if busy else ""), key=key, phase="failed")
                continue
            row = db.execute("SELECT * FROM migrate_replicas WHERE key=?", (key,)).fetchone()
            if row is None or row["state"] not in ("guarding", "waiting"):
                continue
            self.guarding.taking.add(key)
            try:
                await self._pass_one(row, req, deadline_mono)
            except Exception as e:  # the next guard is tried; this one is lost with the node
                log.warning("migrate: passing the guard of %s on failed: %s", key, e)
                self._emit(f"{key}: could not pass its guard on before this node left: {e}", key=key, phase="failed")
            finally:
                self.guarding.taking.discard(key)

    async def _pass_one(self, row: Any, req: dict[str, Any], deadline_mono: float) -> None:
        key = row["key"]
        assert self.root is not None
        refused = self.guarding.chain_refusal(row, req)
        if refused is not None:  # a guard this node may not act on is not passed on either (no laundering)
            raise MigrateError(f"not passed on: {refused}")
        senders = au.checkpoint_senders(key, self.guarding.guard_sender(key, int(row["src_node"])), int(row["src_node"]))
        path = await asyncio.to_thread(latest_verified, self.root, key, senders)  # may hash it whole: not on the loop
        if path is None:
            return
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        window = max(0.0, deadline_mono - time.monotonic())
        ranked = [r for r in await self.rank_holders(key, size, window, None)
                  if r.feasible and int(r.candidate.node) != int(row["src_node"])]
        errors = []
        for r in ranked:
            node = int(r.candidate.node)
            try:
                addr, port, zkey, zone = self._peer(node)
                await send_checkpoint(addr, port, path, key, zkey, zone=zone, node=str(self.node_id),
                                      chunk_size=int(self.s["chunk_kb"]) << 10, local_host=self._xfer_local,
                                      rate_bps=float(self.s["rate_mbit"]) * 1e6 or None, deadline_monotonic=deadline_mono)
                await self._control(node, "guard", {"key": key, "src_node": int(row["src_node"]),
                                                    "src_job": row["src_job"], "ckpt": path.name,
                                                    "request": {**req, "take_over": True}})
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                errors.append(f"node {node}: {e}")
                continue
            self.guarding.set_replica(key, custody.Event.PASS, f"node {node}")
            self._emit(f"{key}: this node is reclaimed; {path.name} and the job's guard passed on to node {node}",
                       key=key, node=node, ckpt=path.name, phase="passed")
            return
        if self.archive.root() is not None:
            try:
                # a late copy is still wanted (it is the job's only one once this node is gone) and
                # consistent: this guard stays, and its own take-over goes through the archive's
                # claim, queued on the lane behind that copy, as does any other node's
                await self.archive.stopped.publish_until(f"archiving {key}", key, path, {
                    "key": key, "src_node": int(row["src_node"]), "src_job": row["src_job"],
                    "request": {**req, "take_over": True}}, deadline_mono - ARCHIVE_WAIT_MARGIN_S, late_ok=True)
            except MigrateError as e:
                raise MigrateError("; ".join([*errors, f"{e}: its copy is published if the archive answers later "
                                              "(the job is then claimed from there); this node keeps the guard "
                                              "meanwhile"])) from None
            self.guarding.set_replica(key, custody.Event.ARCHIVE)
            self._emit(f"{key}: this node is reclaimed and no live peer can hold it; {path.name} archived", key=key,
                       ckpt=path.name, phase="archived")
            return
        raise MigrateError("; ".join(errors) or "no live peer can hold it")

    async def _reserve(self, node: int, demand: Any, hold_s: float) -> int:
        """Probe ``node`` and commit its offer through the zone: the placement id holding the
        capacity. Raises MigrateError when it refuses or stays silent."""
        from laminar.zone import wire
        from laminar.zone.component import demand_to_probe

        z = self.zone
        t = z.submitter.t
        pid = z.submitter.new_placement_id()
        q = t.expect(pid)
        timeout = max(0.5, 3 * float(z.s["probe_timeout_s"]))
        try:
            for body, want in ((demand_to_probe(demand, pid, max(2.0, float(z.s["lease_s"]))), (wire.Offer, wire.Refuse)),
                               (wire.Commit(pid, int(min(600.0, hold_s) * 1000)), (wire.CommitAck,))):
                t.send(node, body)
                end = time.monotonic() + timeout
                while True:
                    left = end - time.monotonic()
                    if left <= 0:
                        raise MigrateError(f"node {node} did not answer the {type(body).__name__.lower()} in {timeout:.1f} s")
                    try:
                        n, ans = await asyncio.wait_for(q.get(), left)
                    except TimeoutError:
                        continue
                    if n == node and isinstance(ans, want):
                        break
                if isinstance(ans, wire.Refuse):
                    raise MigrateError(f"node {node} refused the reservation (reason {ans.reason})")
                if isinstance(ans, wire.CommitAck) and ans.status != 0:
                    raise MigrateError(f"node {node} did not commit the reservation (status {ans.status})")
            return pid
        except BaseException:
            t.send(node, wire.Release(pid))
            raise
        finally:
            t.forget(pid)

    async def _move_to(self, job: Any, mv: Move, ckpt: Path, node: int, deadline_mono: float | None) -> None:
        from laminar.zone import wire

        demand, _ = self._need(job)
        mv.dest = node
        mv.phase = "reserve"
        left = None if deadline_mono is None else deadline_mono - time.monotonic()
        pid = await self._reserve(node, demand, max(HOLD_MIN_S, 2 * (left or 0.0)))
        z = self.zone
        try:
            mv.phase = "transfer"
            self._emit(f"{job.id}: node {node} reserved; sending {ckpt.name}", job=job.id, node=node, phase=mv.phase)
            remote = await self._send(job, ckpt, node, deadline_mono, mv, silent_retries=MOVE_SILENT_RETRIES,
                                      manifest=mv.manifest)
            mv.phase = "handover"
            old = self.prestage.buddy.get(job.id)
            await self._guard(job, node, ckpt.name)  # the destination guards the job from now on
            self.prestage.set_buddy(job.id, node)
            if old is not None and old != node:
                # beside the hand-over, not before it: the job is frozen, and an old buddy gone
                # silent held it up to _control's timeout (a release not answered is sent again)
                self._spawn(self.prestage.release(old, self.job_key(job)))
            spec = job.spec.as_dict()
            spec.pop("gpus", None)
            spec["resume_from"] = remote
            # lent is this node's placement's (the destination marks the job lent if it takes it on
            # loan); the key goes in the request's origin (laminar.runtime.provenance), and in the
            # env too for an agent of an older release, which reads it there
            spec["env"] = {**(spec.get("env") or {}), MIGRATED_ENV: self.job_key(job)}
            spec["lent"] = False
            req = {"spec": spec, "owner_uid": job.owner_uid, "owner_gid": job.owner_gid,
                   "origin": request_origin(migrated_from=self.job_key(job), resume_given=True)}
            if deadline_mono is not None:  # a reclaim's: once sent, a restart never moves it again
                self._note_move(job.id, mp.Event.HAND_OVER, node, pid=pid, request=req)
            else:  # a loan return's, Airlock's: a restart asks node whether it took the job (_restore_moves)
                self._record_move(job.id, mp.Event.HAND_OVER, node=node, pid=pid, request=req, cause=mp.Cause(mv.cause))
            dest_job = await self.guarding.handover(node, pid, req, confirm=True, job_id=job.id)
        except BaseException:
            z.submitter.t.send(node, wire.Release(pid))
            raise
        # done before the stop here: whoever sees the job read ``migrated`` sees its move done
        # (a cut from here on leaves the job frozen, as at ``handover``: node runs it)
        mv.phase, mv.dest_job = "done", dest_job
        self._emit(f"{job.id} moved to node {node} as {dest_job}, resuming from {ckpt.name}", job=job.id, node=node,
                   dest_job=dest_job, ckpt=ckpt.name, phase="done")
        _, lane = self._ckpt_tools()
        try:  # (the job's directory: in its owner's lane, never through a link)
            made = await lane.run(getattr(job, "owner_uid", 0), lambda: os.lstat(ckpt).st_mtime, timeout_s=2.0)
        except (OSError, TimeoutError, LaneBusy):
            made = time.time()
        lost = max(0.0, self.frozen_at.pop(job.id, time.time()) - made)  # trained after it, then frozen
        with contextlib.suppress(Exception):
            await self.agent.jobs.stop(job.id, f"migrated to node {node} as {dest_job} (from {ckpt.name})",
                                       grace_s=1.0, state="migrated", work_lost_s=round(lost, 3),
                                       cause=EndCause.MIGRATED)

    async def _send(self, job: Any, ckpt: Path, node: int, deadline_mono: float | None, mv: Move | None,
                    silent_retries: int | None = None, manifest: Manifest | None = None) -> str:
        """Sends ``ckpt`` to ``node``'s endpoint; returns its committed path there.
        ``silent_retries``: :func:`send_checkpoint`'s (a prestage passes 0, a move
        :data:`MOVE_SILENT_RETRIES`). ``manifest``: ``ckpt``'s, built (files checked) when it
        was found; sent as it is when the snapshot holds the very files it describes (hard
        links: same inode, size and mtime), else built again from the snapshot."""
        addr, port, key, zone = self._peer(node)
        hook = _ShaperHook(self.agent.transfers, job) if getattr(self.agent, "transfers", None) is not None else None
        last = [0.0]

        def progress(p: Progress) -> None:
            if mv is None:
                return
            mv.done_bytes, mv.total_bytes = p.done_bytes, p.total_bytes
            now = time.monotonic()
            if now - last[0] >= 0.5 or p.done_bytes >= p.total_bytes:
                last[0] = now
                self._emit(f"{job.id}: {p.done_bytes}/{p.total_bytes} bytes of {p.ckpt_id} at node {node}",
                           persist=False, job=job.id, node=node, done_bytes=p.done_bytes, total_bytes=p.total_bytes,
                           phase="transfer")

        rate = float(self.s["rate_mbit"]) * 1e6 or None
        # the job's directory is read in its owner's lane (storage the owner controls may hang;
        # a thread of the default executor stuck there kept the agent from ever exiting)
        _, lane = self._ckpt_tools()
        try:
            snap = await lane.run(getattr(job, "owner_uid", 0), self._snapshot, ckpt, self.job_key(job),
                                  timeout_s=float(self.s.get("verify_timeout_s", ckpt_driver.VERIFY_TIMEOUT_S)))
        except (TimeoutError, LaneBusy) as e:
            raise MigrateError(f"{job.id}: its checkpoint {ckpt.name} could not be read in time: {e}") from None
        try:
            if self.archive.root() is not None:  # what the guard that follows is handed, signed (_presign)
                self._sent_manifests.pop(self.job_key(job), None)
                with contextlib.suppress(OSError, ValueError, jobkit.CheckpointError):
                    self._sent_manifests[self.job_key(job)] = (ckpt.name, *await asyncio.to_thread(_manifest_facts, snap))
                while len(self._sent_manifests) > SENT_MANIFESTS_KEEP:  # (the oldest: of jobs long gone)
                    self._sent_manifests.pop(next(iter(self._sent_manifests)))
            if manifest is not None:
                manifest = await asyncio.to_thread(_same_files, manifest, snap)
            res = await send_checkpoint(addr, port, snap, self.job_key(job), key, zone=zone, node=str(self.node_id),
                                        chunk_size=int(self.s["chunk_kb"]) << 10, rate_bps=rate, local_host=self._xfer_local,
                                        deadline_monotonic=deadline_mono, progress=progress, flow_hook=hook,
                                        silent_retries=silent_retries, manifest=manifest)
        finally:
            shutil.rmtree(snap, ignore_errors=True)
        if mv is not None:
            mv.done_bytes = mv.total_bytes = res.total_bytes
        return res.remote_path

    def _snapshot(self, ckpt: Path, key: str) -> Path:
        """A copy of ``ckpt`` the job cannot take away mid-transfer (jobkit removes old
        checkpoints as it writes new ones): hard links (files are never rewritten in place),
        a copy where links fail. Only regular files are taken, and never through a link: the
        directory is the job user's, who may swap a file for a link, a pipe or a device after it
        was verified (the agent is root); such a checkpoint is refused (:func:`_snapshot_file`).
        The copy's shape is checked here (its manifest, every file it lists there with its size,
        nothing else); its bytes are not hashed again here: :func:`send_checkpoint` checks them
        against the manifest beside the transfer (``check_source``), and the destination commits
        nothing before that check passed (a pass here held the first byte back by a read of the
        whole checkpoint, 0.55 s per GiB). Blocking file I/O (callers run it in a thread).
        Raises CheckpointError/OSError when the checkpoint is gone or is not a directory of
        regular files."""
        assert self.root is not None
        out = self.root / "outgoing" / key / ckpt.name
        tmp = out.with_name(f".tmp-{ckpt.name}-{time.monotonic_ns()}")
        tmp.mkdir(parents=True)
        try:
            for f in ckpt.iterdir():
                _snapshot_file(f, tmp / f.name)
            listed = jobkit.read_manifest(tmp)["files"]
            jobkit.verify_checkpoint(tmp, hashed={f["name"]: str(f.get("sha256")) for f in listed})
            shutil.rmtree(out, ignore_errors=True)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out

    def _request(self, job: Any, take_over: bool) -> dict[str, Any]:
        """What a guard needs to resume ``job``: its spec (GPUs as a count), owner, GPUs."""
        spec = job.spec.as_dict()
        spec.pop("gpus", None)
        req: dict[str, Any] = {"spec": spec, "owner_uid": job.owner_uid, "owner_gid": job.owner_gid,
                               "gpus": self._need(job)[1].gpus}
        if take_over:
            req["take_over"] = True
        return req

    async def _guard(self, job: Any, node: int, ckpt_name: str, take_over: bool = False) -> None:
        """Hands ``node`` the guard of ``job`` (its spec and owner). ``take_over``: the job is
        stopped here, so the guard places it at once (not when this node is declared dead).
        While this node has a reclaim (in its window, or reclaimed: the window ended and the
        reclaim was neither withdrawn nor cleared by a restart) the guard also learns the
        window's end: it declares this node dead then, even after a restart that lost the zone's
        notice, and a guard message without it tells the guard that this node has no reclaim
        (one that came after the notice's window ended is of a node back from its reclaim:
        :meth:`Guard.notice`). Before, a message sent after the reclaim's own task ended (a
        prestage in flight at the window's end) left it out."""
        spec = job.spec.as_dict()
        spec.pop("gpus", None)
        request: dict[str, Any] = {"spec": spec, "owner_uid": job.owner_uid, "owner_gid": job.owner_gid,
                                   "gpus": self._need(job)[1].gpus}
        if self.reclaim is not None:
            request["window_end"] = self.reclaim["deadline"]
        if take_over:
            request["take_over"] = True
        signed = self._presign(job, request, ckpt_name)
        if signed is not None:
            request[PRESIGNED] = signed
        await self._control(node, "guard", {
            "key": self.job_key(job), "src_node": self.node_id, "src_job": job.id, "ckpt": ckpt_name,
            "request": request})

    def _presign(self, job: Any, request: dict[str, Any], ckpt_name: str) -> dict[str, Any] | None:
        """The guard record of ``job`` this node signs for its guard (with ``archive_dir``): the
        record the guard publishes in the archive when it finds no room (as this node would;
        :meth:`StoppedCopies._presigned`), naming ``ckpt_name`` as last sent (its manifest's
        SHA-256, bytes and files, noted by :meth:`_send`). Only a job's node signs its records,
        so no other node can publish one for it. None when nothing of it was sent lately or this
        node holds no zone key (the guard then keeps the job without archiving it)."""
        key = self.job_key(job)
        sent = self._sent_manifests.get(key)
        auth = ArchiveAuth.of(getattr(self.agent, "zone", None))
        if self.archive.root() is None or sent is None or sent[0] != ckpt_name or auth is None:
            return None
        body = owner_body("guard", {"key": key, "src_node": self.node_id, "src_job": job.id, "request": request},
                          ckpt_name, sent[1], sent[2], sent[3], time.time())
        return dict(json.loads(auth.seal(body)))

    # -- prestaging and guarding --------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                self._departure_round()
                self.fence.tick(time.time())
                self.vouch.tick(time.time())
                self.prestage.tick(time.time())
                self.archive.tick(time.time())
                self.replicas.recheck_guards(time.time())
                await self.guarding.tick(time.time())
                self.replicas.tick(time.time())
            except Exception:
                log.exception("migrate: watch round failed")
            try:
                await self._gpu_memory_round()
            except Exception:
                log.exception("migrate: reading GPU memory per process failed")
            await asyncio.sleep(float(self.s["poll_s"]))

    # -- the endpoint's callbacks -------------------------------------------------------------

    # -- authority: who may speak for a job key (laminar.zone.authority) ------------------------

    def _refusals(self) -> au.Refusals:
        """Where peers' refusals are counted: the zone's (``authority`` in zone stats and status)."""
        got = getattr(self.zone, "authority", None)
        if isinstance(got, au.Refusals):
            return got
        if not hasattr(self, "_own_refusals"):
            self._own_refusals = au.Refusals()
        return self._own_refusals

    def _refuse(self, e: au.Refused, node: int | None) -> ValueError:
        """Counts ``e`` and returns it as the ValueError a control op is refused with (its text
        goes back to the sender)."""
        self._refusals().note(e, node)
        log.warning("migrate: refused %s", e)
        return ValueError(str(e))

    def _guard_holder(self, key: str) -> int | None:
        """The node that handed this node its live guard of ``key`` (the key's node, or the node
        that passed it on or placed the job here: ``migrate_guard_from``; else the row's source);
        None when no live guard of it is held here (au.BINDING_STATES)."""
        return self._guard_held(key)[0]

    def _guard_held(self, key: str) -> tuple[int | None, str | None]:
        """(:meth:`_guard_holder`, the row's state; None when there is no row)."""
        db = self.agent.store.db
        row = db.execute("SELECT src_node, state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        if row is None or str(row["state"]) not in au.BINDING_STATES:
            return None, None if row is None else str(row["state"])
        got = db.execute("SELECT node FROM migrate_guard_from WHERE key=?", (key,)).fetchone()
        return (int(got["node"]) if got is not None else int(row["src_node"])), str(row["state"])

    def _may_offer(self, node: str, key: str) -> str | None:
        """The transfer endpoint's question before it takes a checkpoint of ``key`` from ``node``:
        None, or why not (counted; au.offer_refusal)."""
        try:
            asker = int(node)
        except ValueError:
            return f"node {node!r} is not a node id"
        e = au.offer_refusal(asker, key, self._guard_holder(key))
        if e is None:
            return None
        self._refusals().note(e, asker)
        return str(e)

    def _on_commit(self, c: Committed) -> None:
        self.replicas.forget_scan()  # the replica view walks again (a commit changed the root)
        self.counts["received"] += 1
        self._emit(f"received {c.job_id}/{c.ckpt_id} from node {c.peer_node}, verified", key=c.job_id, ckpt=c.ckpt_id,
                   src_node=c.peer_node, path=str(c.path), phase="received")
        holder = self._guard_holder(c.job_id)
        if str(c.peer_node) not in au.checkpoint_senders(c.job_id, holder) or (
                holder is None and str(c.peer_node) != str(au.key_owner(c.job_id))):
            # a copy from a node that does not guard the key here (a guard passed on comes before
            # its guard message): it replaces nothing, and a take-over reads only its guard's copies
            return
        try:
            self.replicas.gc(c.job_id, newest=c.ckpt_id)  # the older replicas of the key go
        except Exception:  # the GC must never fail a commit (the sender was told it is delivered)
            log.exception("migrate: replica GC of %s", c.job_id)

    def _on_rx_progress(self, p: Progress) -> None:
        pass

    def _on_control(self, node: str, op: str, body: Any) -> Any:
        """A control operation from another node (``node``: its id, as the transfer endpoint's
        hello gave it): answered by its handler in :attr:`_CONTROL_OPS`. Raises ValueError for a
        body that is not an object, an asker that is not a node id, or an unknown op; a
        ``reclaim`` or ``reclaim-cancel`` from a node not in ``migrate.reclaim_from`` is refused."""
        # an authenticated message from a roster member (its hello's node, checked against its
        # roster address): it is alive, as an authenticated datagram says (Membership.seen).
        # Before, only datagrams counted: a guard that had the source's message in hand could still
        # take it for silent (its datagrams not yet heard after a partition) and take its job over
        self._heard_over_tcp(node)
        if not isinstance(body, dict):
            raise ValueError(f"body of {op!r} must be an object")
        try:
            asker = int(node)
        except ValueError:
            raise ValueError(f"{op}: the asking node {node!r} is not a node id") from None
        handler = self._CONTROL_OPS.get(op)
        if handler is None:
            raise ValueError(f"unknown control operation {op!r} ({', '.join(self._CONTROL_OPS)})")
        if op in RECLAIM_FROM_OPS:  # another node reclaims this one: migrate.reclaim_from only
            e = au.node_op_refusal(op, asker, [int(n) for n in self.s.get("reclaim_from") or []],
                                   "migrate.reclaim_from", self.node_id)
            if e is not None:
                raise self._refuse(e, asker)
        return handler(self, node, asker, body)

    @staticmethod
    def _check_dated(body: dict[str, Any], what: str) -> None:
        """A reclaim's notice, cancel or withdrawal is answered only within CONTROL_DATED_S of
        this node's clock (its ``ts``): ValueError otherwise."""
        ts = float(body.get("ts", 0))
        if abs(time.time() - ts) > CONTROL_DATED_S:
            raise ValueError(f"{what} dated {ts} is more than {CONTROL_DATED_S:g} s from this node's clock")

    def _op_guard(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        key = str(body["key"])
        src = body.get("src_node")
        if isinstance(src, str) and src.isascii() and src.isdigit():
            src = int(src)
        got = body.get("request")
        req_in: dict[str, Any] = got if isinstance(got, dict) else {}
        policy = getattr(self.zone, "policy", None)
        e = au.guard_refusal(asker, key, src, req_in.get("take_over") is True, *self._guard_held(key),
                             root_request=req_in.get("owner_uid", 0) == 0,
                             policy=policy if isinstance(policy, au.Policy) else au.Policy(self.node_id))
        if e is not None:
            raise self._refuse(e, asker)
        self._check_guarded_ckpt(key, str(body["ckpt"]))
        req = _in_own_clock(body)
        with self.agent.store.tx() as db:
            # guarding, but a copy its take-over acted on (resumed, handed-over, placed) stays so
            ledger.move(db, key, custody.Event.GUARD, counts=self.counts, ckpt=str(body["ckpt"]), request=json.dumps(req),
                        insert={"src_node": int(body["src_node"]), "src_job": str(body["src_job"]),
                                "request": json.dumps(req), "ckpt": str(body["ckpt"])})
            # the source just spoke about this guard: its earlier silence no longer counts
            ledger.guard_heard(db, key)
            # who handed it: with the key's node, the only one who may change or release it
            ledger.guard_from(db, key, asker)
        self.replicas.note_owner(key, req)
        try:  # the guard names a newer checkpoint: the older ones go (when it is held here)
            self.replicas.gc(key, newest=str(body["ckpt"]))
        except Exception:
            log.exception("migrate: replica GC of %s", key)
        return {"guarding": key}

    def _op_space(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """May this node hold a checkpoint? (storage holders, _hold)"""
        assert self.root is not None
        assert self.receiver is not None
        # what an offer may take now (the free space less what transfers in progress still
        # lack and the receiver's margin), less what this node keeps for itself as a holder
        free = self.receiver.free_for_offers() - float(self.s["holder_reserve_mb"]) * (1 << 20)
        return {"free_bytes": max(0.0, free)}

    def _op_release(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        key = str(body["key"])
        e = au.release_refusal(asker, key, self._guard_holder(key))
        if e is not None:
            raise self._refuse(e, asker)
        row = self.agent.store.db.execute("SELECT state, updated FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        # taken over here and run here: the source still runs its copy, or it would not release
        # this guard; the answer says so (as ``superseded`` would: a release may come first)
        runs = self.guarding.runs_here(key) if row is not None and row["state"] == "resumed" else None
        # taken over and placed on another node (no room here): the same, naming that node, as
        # ``taken`` does. Before, the answer said only "released", and a source whose buddy had
        # changed (this guard was the old one) refused this node's ``superseded`` after it: a
        # fenced copy was thawed beside the placed one (bench/chaos.py --no-archive, seed 43)
        placed = self.archive.placed_as(key) if row is not None and row["state"] == "placed" else None
        with self.agent.store.tx() as db:
            ledger.move(db, key, custody.Event.RELEASE, counts=self.counts)  # a live guard only (the table)
        try:  # nothing here needs the key's checkpoints any more (but a local job resumed from one)
            self.replicas.gc(key)
        except Exception:
            log.exception("migrate: replica GC of %s", key)
        if runs is not None or placed is not None:
            assert row is not None
            node_job = (self.node_id, runs) if runs is not None else placed
            assert node_job is not None
            return {"released": key, "superseded": {"node": node_job[0], "job": node_job[1],
                                                    "at": float(row["updated"]), "clock": time.time()}}
        return {"released": key}

    def _op_reclaim(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """Another node reclaims this one (``laminarctl reclaim --node``)."""
        self._check_dated(body, "reclaim notice")
        return self.start_reclaim(parse_duration(body["notice_s"]), f"{body.get('reason', '')} (from node {node})")

    def _op_reclaim_cancel(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        self._check_dated(body, "reclaim-cancel")
        return self._cancel_for(node, str(body.get("reason") or ""))

    def _op_reclaim_withdrawn(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """The sender's own reclaim is withdrawn: its notice is forgotten."""
        self._check_dated(body, "reclaim-withdrawn")
        return {"withdrawn": int(node), "guards": self.withdraw.withdrawn_notice(int(node))}

    def _op_superseded(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """A guard took one of this node's jobs over and runs it."""
        return self.replicas.answer_superseded(node, body)

    def _op_needs(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """A node holding a guard of one of this node's jobs asks whether it still must."""
        return self.replicas.answer_needs(node, str(body["key"]))

    def _op_dropped(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """An operator dropped the guard of one of this node's jobs there, by force."""
        return self.prestage.answer_dropped(node, str(body["key"]))

    def _op_taken(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """A job's node, fenced while cut off and heard again: did this node take it over?"""
        return self.fence.answer_taken(node, str(body["key"]))

    def _op_heard(self, node: str, asker: int, body: dict[str, Any]) -> Any:
        """A node that hears nothing from a peer: when did this node last hear it?"""
        return self.vouch.answer_heard(node, body)

    # op -> its handler (self, the asking node as the endpoint gave it, its id, the body), in the
    # order the answer to an unknown op lists them
    _CONTROL_OPS: ClassVar[dict[str, Callable[[ReclaimComponent, str, int, dict[str, Any]], Any]]] = {
        "guard": _op_guard, "release": _op_release, "reclaim": _op_reclaim, "reclaim-cancel": _op_reclaim_cancel,
        "reclaim-withdrawn": _op_reclaim_withdrawn, "space": _op_space, "superseded": _op_superseded,
        "needs": _op_needs, "dropped": _op_dropped, "taken": _op_taken, "heard": _op_heard,
    }

    async def _cancel_for(self, node: str, reason: str) -> dict[str, Any]:
        """Control op ``reclaim-cancel``: another node cancels this node's reclaim (``laminarctl
        reclaim cancel --node``). Nothing to cancel is answered ``{"refused": why}``."""
        try:
            return await self.withdraw.cancel_reclaim(f"{reason or 'reclaim cancelled'} (from node {node})")
        except (LookupError, MigrateError) as e:
            return {"refused": str(e), "not_found": isinstance(e, LookupError)}

    def _check_guarded_ckpt(self, key: str, ckpt: str) -> None:
        """A guard is taken only for a checkpoint held here (``<root>/checkpoints/<key>/<ckpt>/``,
        a directory, not a link): every guard follows the transfer of the checkpoint it names, and
        one that is not here was dropped in between (an operator's drop of a key no guard had named
        yet, with or without force) or never came. Taking it would leave this node guarding a job
        with nothing to resume it from while its source counts on it; refused (ValueError), the
        source's prestage or move fails and it tries another node (a guard it had stays)."""
        if not valid_key(key) or not valid_ckpt_name(ckpt):
            raise ValueError(f"guard of {key!r}: {ckpt!r} is not a checkpoint name (ckpt-<n>) of a replica key")
        assert self.root is not None
        try:
            held = stat.S_ISDIR(os.lstat(self.root / "checkpoints" / key / ckpt).st_mode)
        except OSError:
            held = False
        if not held:
            raise ValueError(f"guard of {key}: {ckpt} is not held on node {self.node_id} (dropped by its operator, "
                             "or never received): not guarding it")

    def _on_event(self, e: dict[str, Any]) -> None:
        """Records the zone's reclaim notices of other nodes (zone events with deadline_ms)."""
        if e.get("kind") == "zone" and "deadline_ms" in e and "node" in e:
            now = time.time()
            node = int(e["node"])
            fresh = node not in self.notices or self.notices[node][1] < now - 3600
            self.notices[node] = (now + int(e["deadline_ms"]) / 1000, now)
            if fresh:  # a repeated notice of the same reclaim is one departure
                self.observe_departure(now, announced=True)

    def check_resume(self, path: str, owner_uid: int = 0, owner_gid: int | None = None) -> str:
        """What the zone's hand-over calls before a job of ``owner_uid`` starts with
        ``resume_from``; the path the job is given. A path under this node's transfer root must
        be a committed, still-valid checkpoint (verified_checkpoint), any other must pass jobkit's
        own check. A replica (``<root>/checkpoints/<key>/ckpt-<n>``) whose guard named its job's
        owner is only for a job of that owner (or root's), and that owner gets its own copy of it
        (:meth:`Replicas.resume_copy`: ``xfer/`` is root's alone). A job of a user other than root is
        refused any other path under the transfer root: a replica no guard here named the owner of
        (every source guards before it hands over; a hand-over without one would start the job
        with a ``LAMINAR_RESUME_FROM`` it cannot read, and a copy made on the hand-over's word
        would give whoever places a job naming a replica another user's checkpoint). Any other
        path of a non-root job is verified with the owner's own permissions (uid, ``owner_gid``,
        else the uid's passwd group, else 65534, and the uid's groups: :func:`verify_as_owner`),
        never as root: a checkpoint the owner cannot read is refused saying so, alike whether it
        is valid, corrupt or absent (as root, the refusal told a user whether a valid checkpoint
        lay where they cannot look). Raises ValueError."""
        p = Path(os.path.normpath(path))
        under_root = self.root is not None and self.root in p.parents
        replica = self.root is not None and p.parent.parent == self.root / "checkpoints"
        recorded = self.replicas.owners.get(p.parent.name) if replica else None
        if recorded is not None and owner_uid not in (0, recorded[0]):
            raise ValueError(f"checkpoint {path} is a replica of a job of uid {recorded[0]}: a job of uid "
                             f"{owner_uid} cannot resume from it")
        if under_root and recorded is None and owner_uid != 0:
            what = f"no guard of {p.parent.name} held here named its job's owner" if replica else \
                "it is not a replica a guard named"
            raise ValueError(f"checkpoint {path} lies in node {self.node_id}'s transfer directory, which only root "
                             f"may read, and {what}: a job of uid {owner_uid} is not given it")
        if not under_root and owner_uid != 0:
            if owner_gid is None:
                try:
                    owner_gid = pwd.getpwuid(owner_uid).pw_gid
                except KeyError:
                    owner_gid = 65534  # nogroup: no group's permission is assumed
            verify_as_owner(str(p), owner_uid, owner_gid)
            return str(p)
        if not under_root:  # storage that may hang (NFS, FUSE): checked in a child, bounded (root's texts)
            verify_as_owner(str(p), 0, 0)
            return str(p)
        try:
            verified_checkpoint(p)
        except (TransferError, jobkit.CheckpointError) as e:
            raise ValueError(f"checkpoint {path} is not restorable: {e}") from None
        if recorded is not None:  # a replica, and the guard said whose: the job must be able to read it
            try:
                p = self.replicas.resume_copy(p, *recorded)
            except OSError as e:
                raise ValueError(f"checkpoint {path}: cannot give the job's owner (uid {recorded[0]}) its copy: "
                                 f"{e}") from None
        return str(p)

    # -- status and API -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        r = self.reclaim
        return {"port": self.port, "counts": dict(self.counts), "buddies": {k: v for k, v in self.prestage.buddy.items()},
                "releases_pending": [{"node": n, "key": k} for n, k in sorted(self.prestage.releases)],
                "reclaim": None if r is None else {"deadline": r["deadline"], "done": r["task"].done()},
                "notices": sorted(self.notices),
                # jobs frozen while this node heard none of its zone (fence.py): job id -> since (wall clock)
                "fenced": dict(self.fence.fenced_jobs),
                # silent peers another member heard lately (vouch.py): not taken for gone
                "heard_elsewhere": sorted(self.vouch.held_back),
                # member -> how many take-over verdicts its word held back (a member holding many: vouch.py)
                "heard_vouchers": {str(n): k for n, k in sorted(self.vouch.vouchers.items())},
                "periodic_ckpt": None if self.ckpt is None else dict(self.ckpt.counts),
                # jobs' checkpoint directories: checks (failed, unfinished) and their lane; freezes
                # and thaws that did not take hold in time (a task in uninterruptible sleep)
                "ckpt": None if self.ckpt is None else {**self.ckpt.stats(), **cgroup_freeze_counts()},
                # what the hazard learned here (departures announced or not, node-hours watched)
                "evidence": self._evidence_status(),
                "archive": self.archive.status(),
                # transfer connections refused: not from the roster address of the node they named
                "transfer_wrong_source": 0 if self.receiver is None else self.receiver.wrong_source,
                # transfer connections refused or cut by reason (off_roster, source_busy, slow, ...)
                "transfer_gate": {} if self.receiver is None else self.receiver.stats()}

    def _sees_all(self, peer: Any) -> bool:
        """Whether ``peer`` sees every replica's job and owner: root or the control group."""
        if peer.uid == 0:
            return True
        auth = getattr(getattr(self.agent, "api", None), "auth", None)
        return bool(auth is not None and auth.allowed(peer))

    def routes(self) -> list[Any]:
        from laminar.api import ApiError, Request, Route
        from laminar.inputs import brief

        async def post_reclaim(req: Request) -> dict[str, Any]:
            b = req.body if isinstance(req.body, dict) else {}
            if "notice_s" not in b:
                raise ApiError(400, "reclaim: body must be {\"notice_s\": seconds (or \"60s\"), \"node\"?: id, \"reason\"?}")
            node = b.get("node")
            if node is not None and (isinstance(node, bool) or not isinstance(node, int) or not 0 < node < 1 << 32):
                raise ApiError(400, f"reclaim: node {brief(node)}: expected a node id (see `laminarctl zone peers`)")
            reason = b.get("reason")
            if reason is not None and (not isinstance(reason, str) or len(reason) > 200):
                raise ApiError(400, f"reclaim: reason {brief(reason)}: expected text of at most 200 characters")
            try:
                return await self.announce(b["notice_s"], node, reason or f"announced by uid {req.peer.uid}")
            except ValueError as e:
                raise ApiError(400, f"reclaim: {e}") from None
            except MigrateError as e:
                raise ApiError(409 if "not a member" not in str(e) else 404, str(e)) from None

        async def cancel_reclaim(req: Request) -> dict[str, Any]:
            b = {} if req.body is None else req.body
            if not isinstance(b, dict) or set(b) - {"node", "reason"}:
                raise ApiError(400, f"reclaim cancel: body {brief(b)}: expected {{\"node\"?: id, \"reason\"?: text}}")
            node = b.get("node")
            if node is not None and (isinstance(node, bool) or not isinstance(node, int) or not 0 < node < 1 << 32):
                raise ApiError(400, f"reclaim cancel: node {brief(node)}: expected a node id (see `laminarctl zone peers`)")
            reason = b.get("reason")
            if reason is not None and (not isinstance(reason, str) or len(reason) > 200):
                raise ApiError(400, f"reclaim cancel: reason {brief(reason)}: expected text of at most 200 characters")
            try:
                return await self.cancel(node, reason or f"cancelled by uid {req.peer.uid}")
            except LookupError as e:
                raise ApiError(404, f"reclaim cancel: {e.args[0]}") from None
            except MigrateError as e:
                raise ApiError(404 if "not a member" in str(e) else 409, f"reclaim cancel: {e}") from None

        async def get_reclaim(req: Request) -> dict[str, Any]:
            return self.reclaim_status()

        async def migrations(req: Request) -> list[dict[str, Any]]:
            return [self.settle.move_view(m) for m in self.moves.values()]

        async def handovers(req: Request) -> list[dict[str, Any]]:
            return self.settle.pending_handovers()

        async def settle(req: Request) -> dict[str, Any]:
            b = req.body
            if not isinstance(b, dict) or set(b) - {"decision"} or b.get("decision") not in ("run-here", "gone"):
                raise ApiError(400, f"settle: body {brief(b)}: expected {{\"decision\": \"run-here\" | \"gone\"}}")
            try:
                return await self.settle.settle_handover(req.params["job"], b["decision"],
                                                         by=f"uid {req.peer.uid}")
            except LookupError as e:
                raise ApiError(409, f"settle: {e.args[0]}") from None

        async def migration(req: Request) -> dict[str, Any]:
            jid = req.params["job"]
            mv = self.moves.get(jid)
            if mv is None and jid.isdigit():
                mv = self.moves.get(f"job-{jid}")
            if mv is None:
                raise ApiError(404, f"no move of job {jid!r} on this node")
            return self.settle.move_view(mv)

        async def replicas(req: Request) -> Any:
            totals = req.query.get("totals", "0")
            if totals not in ("0", "1", "false", "true"):
                raise ApiError(400, f"replicas: totals={totals!r}: expected 1 or 0")
            if self.root is None:
                view: dict[str, Any] = {"now": time.time(), "replicas": [], "totals": {}}
            else:
                api = getattr(self.agent, "api", None)  # the caller's worker-thread slot while it scans
                with api.work_slot(req.peer) if api is not None else contextlib.nullcontext():
                    scan = await self.replicas.scan()
                view = self.replicas.view(scan)
            rows = view["replicas"] if self._sees_all(req.peer) else \
                [r if r.get("owner_uid") == req.peer.uid else redact_replica(r) for r in view["replicas"]]
            if totals in ("1", "true"):
                return {"now": view["now"], "replicas": rows, "totals": view["totals"]}
            return rows

        async def drop_replica(req: Request) -> dict[str, Any]:
            b = {} if req.body is None else req.body
            if not isinstance(b, dict) or set(b) - {"force"} or not isinstance(b.get("force", False), bool):
                raise ApiError(400, f"replicas drop: body {brief(b)}: expected {{\"force\"?: true|false}}")
            try:
                return await self.replicas.drop_and_tell(req.params["key"], force=bool(b.get("force", False)),
                                                        by=f"uid {req.peer.uid}")
            except ValueError as e:
                raise ApiError(400, f"replicas drop: {e}") from None
            except LookupError as e:
                raise ApiError(404, f"replicas drop: {e.args[0]}") from None
            except MigrateError as e:
                raise ApiError(409, f"replicas drop: {e}") from None

        async def checkpoints(req: Request) -> dict[str, Any]:
            d = self.ckpt
            hz = self.hazards["default"]
            now = time.time()
            return {"periodic": bool(self.s["periodic"]), "uplink_mbit": None if d is None else d.link_bps * 8 / 1e6,
                    "hazard_per_h": hz.rate_per_h(now), "mtbf_s": hz.mtbf_s(now), "now": now,
                    "counts": None if d is None else dict(d.counts), "jobs": [] if d is None else d.view()}

        return [
            Route("GET", "/v1/checkpoints", checkpoints),
            Route("POST", "/v1/reclaim", post_reclaim, privileged=True),
            Route("POST", "/v1/reclaim/cancel", cancel_reclaim, privileged=True),
            Route("GET", "/v1/reclaim", get_reclaim),
            Route("GET", "/v1/migrations", migrations),
            Route("GET", "/v1/migrations/{job}", migration),
            Route("POST", "/v1/migrations/{job}/settle", settle, privileged=True),
            Route("GET", "/v1/migrate/handovers", handovers),
            Route("GET", "/v1/migrate/replicas", replicas),
            Route("POST", "/v1/migrate/replicas/{key}/drop", drop_replica, privileged=True),
        ]
