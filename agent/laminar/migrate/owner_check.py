"""The check of a checkpoint as its job's owner (:func:`verify_as_owner`), before a job starts
with ``resume_from`` a path outside this node's transfer directory
(:meth:`laminar.migrate.reclaim.ReclaimComponent.check_resume`): in a child process that took the
owner's uid, gid and groups, bounded by VERIFY_STALL_S without progress (docs/migration.md).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

from laminar import jobkit
from laminar.migrate import ckpt_driver
from laminar.migrate.archive_lane import _progress

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
