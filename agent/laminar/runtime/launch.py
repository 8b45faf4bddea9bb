"""How a job's process starts: the path probe run as its owner before a submission is
accepted (:func:`check_paths`), and the start itself (:func:`spawn`): as root, a tiny ``/bin/sh``
step (``ENTER_SH``) joins the job's cgroups and sets its ``oom_score_adj`` before anything of
the job runs, then the owner's limits and the drop to the owner (:func:`drop_privileges_argv`),
then ``JOB_TRAMPOLINE``, as the owner, applies the job's environment and execs its command."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..userbounds import Busy, UidSlots
from . import gpus as gpumod
from . import joblimits
from .record import Job
from .spec import JobError, JobSpec, QuotaError

# The pre-exec step: join every cgroup (exit 127 naming the file if one refuses), set
# oom_score_adj (best effort) and the owner's umask, then exec the rest: the owner's nice value and
# rlimits (joblimits.launch_argv), the drop, the trampoline. $0 is "laminar-job".
ENTER_SH = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do '
    'echo $$ > "$1" || { echo "laminar: cannot join cgroup $1" >&2; exit 127; }; shift; n=$((n-1)); done; '
    'echo "$1" > /proc/self/oom_score_adj 2>/dev/null; umask "$2"; shift 2; exec "$@"'
)

# What runs as root before a job's command (ENTER_SH, setpriv) runs with this environment and
# never with the job's: a user's PATH would pick the 'setpriv' root runs, a user's LD_PRELOAD,
# GCONV_PATH or LOCPATH would load the user's code into root's processes. The job's environment
# is applied by JOB_TRAMPOLINE, after the drop, as the job's owner.
ROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
SETPRIV = next((p for p in ("/usr/bin/setpriv", "/bin/setpriv", "/usr/sbin/setpriv") if os.path.exists(p)),
               "/usr/bin/setpriv")
# The last step before the job's command, already as its owner (``python3 -I -S``: no
# environment variable, site or user directory of anyone reaches it): reads the job's
# environment from the inherited file descriptor argv[1] (JSON; not in argv, which every user can
# read in /proc), enters the working directory argv[3] when not empty (exit 126 naming it if the
# owner may not), then execs the command with that environment (exit 127 if it is not found, 126
# if it cannot be run). Its nice value (not the agent's Nice=-10) and limits were set as root before.
# Before all that it checks that it runs as the owner ids argv[2] names ("uid:gid"), real,
# effective and saved alike (exit 126 naming them otherwise): a drop that did not happen (an id
# setresuid takes for "unchanged") never runs a user's command as root.
JOB_TRAMPOLINE = (
    "import json, os, sys\n"
    "fd, ids, cwd, cmd = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]\n"
    "u, g = (int(x) for x in ids.split(':'))\n"
    "if os.getresuid() != (u, u, u) or os.getresgid() != (g, g, g):\n"
    "    sys.stderr.write(f'laminar: the job should run as uid {u} gid {g}, not as {os.getresuid()} '\n"
    "                     f'{os.getresgid()}: not started\\n')\n"
    "    sys.exit(126)\n"
    "with os.fdopen(fd, 'rb') as f:\n"
    "    env = json.loads(f.read())\n"
    "if cwd:\n"
    "    try:\n"
    "        os.chdir(cwd)\n"
    "    except OSError as e:\n"
    "        sys.stderr.write(f'laminar: cannot enter {cwd} as uid {os.getuid()}: {e.strerror}\\n')\n"
    "        sys.exit(126)\n"
    "try:\n"
    "    os.execvpe(cmd[0], cmd, env)\n"
    "except OSError as e:\n"
    "    sys.stderr.write(f'laminar: cannot execute {cmd[0]!r}: {e.strerror}\\n')\n"
    "    sys.exit(127 if isinstance(e, FileNotFoundError) else 126)\n"
)
TRAMPOLINE_PYTHON = next((p for p in ("/usr/bin/python3", "/bin/python3") if os.path.exists(p)), sys.executable)


def check_owner_ids(uid: Any, gid: Any) -> None:
    """Raises JobError unless `uid` and `gid` are ids a job may run as: integers 0..2**32-2
    (-1, that is 2**32-1, means "leave unchanged" to setresuid: a job "as uid -1" would keep the
    agent's root)."""
    for what, v in (("owner uid", uid), ("owner gid", gid)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2**32 - 2:
            raise JobError(f"{what} {v!r}: expected an integer 0..{2**32 - 2} (-1 and 4294967295 mean 'unchanged' "
                           "to setresuid, which would leave the job root)")


def drop_privileges_argv(uid: int, gid: int) -> list[str]:
    """The argv prefix that runs what follows as `uid`/`gid` (with the user's groups when the
    uid has a passwd entry, else none). Raises JobError for an id out of range (check_owner_ids)."""
    check_owner_ids(uid, gid)
    try:
        pwd.getpwuid(uid)
        groups = "--init-groups"
    except KeyError:
        groups = "--clear-groups"
    return [SETPRIV, f"--reuid={uid}", f"--regid={gid}", groups, "--"]


# How long the filesystems a submission names (its working directory, its PATH) get to answer
# whether the directory exists and may be entered and where the command is: a hung NFS or FUSE
# mount never answers.
PROBE_S = 10.0
_REAPERS: set[asyncio.Task[Any]] = set()
# Path probes of one user (and of all users) that may exist at once, counted from the spawn
# until the probe is reaped, not until its submission is answered: a probe stuck on its owner's
# own hung mount (a FUSE server that read the request and never answers) is killed at PROBE_S
# but stays in uninterruptible sleep, unreaped, for as long as the mount hangs. Past the bound
# the submission is refused at once (429), so one user cannot leave processes (and, on Python
# 3.11 without the pidfd watcher, threads) piling up at one per submission.
PROBES_PER_UID = 4
PROBES_ALL_USERS = 64

# The probe, as the job's owner: $1 the command to find in $3 (a PATH) when not empty (exit 4 if no
# directory of it holds an executable file of that name, as shutil.which), $2 the working
# directory when not empty (exit 3 if it is not a directory), then exec "$@" (the owner's
# `cd` into it) with the directory as its $0.
PROBE_SH = (
    'exe=$1 dir=$2 path=$3; shift 3; '
    'if [ -n "$exe" ]; then set -f; IFS=:; found=; '
    'for d in $path; do if [ -f "$d/$exe" ] && [ -x "$d/$exe" ]; then found=1; break; fi; done; '
    'unset IFS; set +f; [ -n "$found" ] || exit 4; fi; '
    'if [ -n "$dir" ]; then [ -d "$dir" ] || exit 3; exec "$@" "$dir"; fi; exit 0'
)


async def check_paths(cwd: str | None, exe: str | None, path_env: str, uid: int, gid: int,
                      slots: UidSlots | None = None) -> None:
    """Raises JobError unless `exe` (when given) is an executable file in one of `path_env`'s
    directories, and `cwd` (when given) is a directory that `uid`/`gid` may enter, both asked as
    that user (root when uid is 0): asked as root, the answers told a user whether files exist
    in directories closed to them. The questions go to one child process with PROBE_S to answer,
    never to the agent's own thread: a stat on hung storage blocks until the storage answers,
    which would stop the event loop (every request, the kill-switch included) for as long. The
    child holds the user's limits (`joblimits.helper_argv`), not the agent's. `slots` counts the
    probe against `uid` until it is reaped (PROBES_PER_UID): QuotaError (429) past it."""
    if cwd is None and exe is None:
        return
    try:
        enter = [*joblimits.helper_argv(uid, gid), *(drop_privileges_argv(uid, gid) if uid else [])]
    except joblimits.LimitsError as e:
        raise JobError(str(e)) from None
    if slots is not None:
        try:
            slots.take(uid)
        except Busy as e:
            raise QuotaError(e.message, reason=e.reason) from None
    argv = [*enter, "/bin/sh", "-c", PROBE_SH, "laminar-probe", exe or "", cwd or "", path_env,
            "/bin/sh", "-c", 'cd -- "$0"']
    what = " and ".join([*([f"PATH {path_env!r}"] if exe else []), *([f"cwd {cwd!r}"] if cwd else [])])
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
    except OSError as e:
        if slots is not None:
            slots.release(uid)
        raise JobError(f"{what}: cannot check: {e}") from None
    except BaseException:
        if slots is not None:
            slots.release(uid)
        raise
    try:
        code = await asyncio.wait_for(proc.wait(), PROBE_S)
    except TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise JobError(f"{what}: the filesystem did not answer within {PROBE_S:g} s (hung storage?); choose "
                       "directories on storage that answers") from None
    finally:
        if proc.returncode is None:  # reaped once the kill lands (a process in D state: later)
            reaper = asyncio.get_running_loop().create_task(proc.wait())
            _REAPERS.add(reaper)
            reaper.add_done_callback(_REAPERS.discard)
            if slots is not None:  # the owner's probe counts until then
                reaper.add_done_callback(lambda _t: slots.release(uid))
        elif slots is not None:
            slots.release(uid)
    if code == 4:
        raise JobError(f"command {exe!r}: not found in PATH (as uid {uid}, who runs the job)")
    if code not in (0, 2, 3):  # 2, 3: cd or [ -d ] said no; else the check itself could not run as uid
        raise JobError(f"{what}: could not be checked as uid {uid} (exit {code}; a user at its process limit, "
                       "nproc, can start no more processes, nor jobs)")
    if code != 0:
        raise JobError(f"cwd {cwd!r}: no such directory that uid {uid} may enter (the job runs as its owner; a "
                       "directory is entered only with search permission on it and on every directory above it)")


def oom_score_adj_for(spec: JobSpec) -> int:
    """The kernel's fallback order mirrors Airlock's (see airlock.ladder.oom_score_adj)."""
    try:
        from ..policy.ladder import oom_score_adj
    except ImportError:  # ladder not present: a plain class-based order
        return {"long-resident": 0, "standard": 500, "transient": 1000}[spec.job_class]
    return oom_score_adj(spec.job_class, spec.priority)


def workers_file(state_dir: Path, job_id: str) -> Path:
    """An elastic job's worker count (``LAMINAR_WORKERS_FILE``; zone.loan writes it)."""
    return state_dir / "elastic" / f"{job_id}.json"


def spawn(job: Job, profile: joblimits.Profile, inventory: gpumod.GpuInventory | None,
          workers_file: Path | None) -> subprocess.Popen[bytes]:
    """Starts ``job``'s process with the owner's ``profile`` (as root: ENTER_SH joins its cgroups,
    then the owner's limits, the drop, JOB_TRAMPOLINE); ``inventory``: the node's GPUs (the
    job sees its own alone); ``workers_file``: an elastic job's worker count file (None: none).
    Raises OSError."""
    spec = job.spec
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": os.environ.get("LANG", "C.UTF-8")}
    if job.owner_uid:
        try:
            pw = pwd.getpwuid(job.owner_uid)
            env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
        except KeyError:
            pass
    env.update(spec.env)
    env.update(job.origin.env())  # for the job to read; the agent never reads a job's env back
    env.update(LAMINAR_JOB_ID=job.id, LAMINAR_JOB_NUM=str(job.num), LAMINAR_CKPT_DIR=str(job.ckpt_dir),
               LAMINAR_CKPT_SIGNAL=spec.checkpoint_signal)
    if spec.resume_from:
        env["LAMINAR_RESUME_FROM"] = spec.resume_from
    env.update(job.agent_env)  # the agent's own (a multi-node member's rendezvous): over the spec's
    if spec.elastic_min is not None and workers_file is not None:  # zone.loan writes it on a scale
        env["LAMINAR_WORKERS_FILE"] = str(workers_file)
    if inventory is not None:
        # exactly its own GPUs, by UUID in NVML's order; none ("") for a job without GPUs,
        # which would otherwise see every GPU of the node, those of other jobs too
        env.update(gpumod.cuda_env(inventory, job.gpus))
    files = [str(f) for f in job.cgroup.procs_files()]
    drop = drop_privileges_argv(job.owner_uid, job.owner_gid) if job.owner_uid else []
    # Another user's job enters its working directory in the trampoline, as the owner, not as
    # root: root may pass through directories the owner may not (a 0700 home), which would open
    # what lies below. Root's own job enters it at the spawn (a directory gone: the start fails).
    cwd = spec.cwd if not job.owner_uid else None
    # as root, after joining the cgroups: the owner's nice value, all its rlimits (nothing of the
    # agent's: LimitMEMLOCK=infinity, LimitNOFILE=65536, Nice=-10), then the drop
    argv = ["/bin/sh", "-c", ENTER_SH, "laminar-job", str(len(files)), *files,
            str(oom_score_adj_for(spec)), f"{profile.umask:04o}", *joblimits.launch_argv(profile), *drop,
            TRAMPOLINE_PYTHON, "-I", "-S", "-c", JOB_TRAMPOLINE,
            "", f"{job.owner_uid}:{job.owner_gid}" if drop else f"{os.getuid()}:{os.getgid()}",
            (spec.cwd or "") if job.owner_uid else "", *spec.command]
    env_fd = os.memfd_create("laminar-job-env", 0)  # inherited by the trampoline (pass_fds)
    try:
        os.write(env_fd, json.dumps(env).encode())
        os.lseek(env_fd, 0, os.SEEK_SET)
        argv[argv.index(JOB_TRAMPOLINE) + 1] = str(env_fd)
        assert job.log_path is not None
        with open(job.log_path, "ab", buffering=0) as logf:
            os.chmod(job.log_path, 0o600)  # what a job prints may be secret: not its group's to read
            if job.owner_uid:
                os.chown(job.log_path, job.owner_uid, job.owner_gid)
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    cwd=cwd or "/", env=ROOT_ENV, start_new_session=True, close_fds=True,
                                    pass_fds=(env_fd,))
    finally:
        os.close(env_fd)
