"""The job's side of Laminar's checkpoint contract, in a few lines of the job's own code.

The agent starts every job with:

* ``LAMINAR_JOB_ID``: the job's id;
* ``LAMINAR_CKPT_DIR``: where the job writes its checkpoints;
* ``LAMINAR_CKPT_SIGNAL``: the signal that asks for a checkpoint (default ``SIGUSR1``);
* ``LAMINAR_RESUME_FROM`` (only when restarted from a checkpoint, on this node or on another
  one after a migration): a checkpoint directory the agent has verified.

A PyTorch training loop honours the contract like this::

    from laminar import jobkit

    ckpt = jobkit.Checkpointer()
    state = ckpt.resume()                      # None on a fresh start
    if state is not None:
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
    for step in range(start, steps):
        train_one_step()
        if ckpt.requested():
            ckpt.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, step=step + 1)

The signal handler only sets a flag: the checkpoint is written between steps, where the state
is consistent. :meth:`Checkpointer.save` commits atomically: it streams the state into a
temporary directory (hashing it on the way, with no second copy of it in the job's memory:
checkpoints are often taken when memory is short), fsyncs every file, writes ``MANIFEST.json`` (each file's size and SHA-256, the step,
the job id), fsyncs, and renames the directory into place (``ckpt-<step>``), so a checkpoint
either exists whole or not at all, whatever happens during the write. :func:`verify_checkpoint`
re-checks a directory against its manifest; :meth:`Checkpointer.resume` never loads a
checkpoint that fails it, and loads exactly the bytes it verified: it reads the state file
once, checks the bytes it read against the manifest's size and SHA-256 and deserializes those,
never reading the file again (storage that answers a second read with other bytes: a file
replaced meanwhile, a racing writer, flaky network storage, cannot slip in unverified state).
Memory: torch state is copied, hashed on the way, into a memfd then sealed against any write,
and the tensors map its pages (``torch.load(mmap=True)``, copy-on-write): one copy of the
state, as when torch read the file itself; ``bytes`` state is read into the ``bytes`` returned
(one copy); pickle state is read into memory and unpickled from there (the file's size beside
the state until ``resume()`` returns). Where there is no memfd, torch state is loaded as
pickle's is.

**A job of several processes** (DDP under ``torchrun``, a multi-node job's members): every
rank makes a :class:`Checkpointer`; only rank 0 writes (``rank=``, by default
``torch.distributed``'s rank once it is initialized, else ``$RANK``, else 0). The agent sends
the signal to every process, which do not all see it at the same step, so the loop asks
:meth:`Checkpointer.requested_all` (one tiny all_reduce, every step, on every rank: every rank
agrees on the step to checkpoint) and every rank calls ``save(state, step=...)`` (rank 0 commits,
the others only clear their flag). :meth:`Checkpointer.resume`, called on every rank after
``init_process_group``, loads on every rank the checkpoint rank 0 chose (one broadcast): the
same path on every member, the checkpoint directory being storage they all reach. After
TorchElastic restarted the workers (``TORCHELASTIC_RESTART_COUNT`` > 0: a member failed, or
the membership changed) it resumes from the newest checkpoint in ``LAMINAR_CKPT_DIR``, newer
than the ``LAMINAR_RESUME_FROM`` the job was started with. :func:`global_batch` keeps the
global batch and the data order whatever the world size::

    ckpt = jobkit.Checkpointer()
    dist.init_process_group("gloo")
    state = ckpt.resume()
    for step in range(start, steps):
        s = jobkit.global_batch(step, dist.get_rank(), dist.get_world_size(), 64, len(data), seed)
        loss = loss_fn(model(x[s.indices]), y[s.indices], reduction="sum") * s.loss_scale
        ...
        if ckpt.requested_all():
            ckpt.save({...}, step=step + 1)

State may be ``bytes`` (stored as is, returned as ``bytes``) or anything ``torch.save``
accepts (a state dict; loaded back with ``torch.load(weights_only=True)``); without torch,
other objects are pickled. This module uses only the standard library (torch when given torch
state), so a job can import it without the agent's dependencies.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import stat
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from concurrent.futures import Future

MANIFEST = "MANIFEST.json"
# Records the agent's transfer adds beside a checkpoint it received and verified
# (laminar.migrate.transfer); not part of the job's checkpoint.
SIDECARS = frozenset({"VERIFIED", "TRANSFER.json"})
FORMAT_VERSION = 1
_NAME = re.compile(r"ckpt-[0-9]{1,18}")  # ASCII digits, full match: "ckpt-5\n" and "ckpt-٥" are not ckpt-5
_WRITING = re.compile(r"\.(tmp|old)-ckpt-([0-9]{1,18})-([0-9]{1,10})")  # a save's temporary / replaced checkpoint, by pid
_HASH_BLOCK = 1 << 20
_COPY_BLOCK = 4 << 20  # a resume's copy into its memfd: larger blocks, fewer hand-offs to the hash thread
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists files: anything larger is not one
# A file whose blocks on disk are fewer than 1/SPARSE_RATIO of its length, past SPARSE_MIN_BYTES,
# is refused by a check with ``refuse_sparse`` (the agent's): a checkpoint is written, not
# seeked over, and a 10 TiB file of holes would be hashed for hours. (A compressing file system
# reports fewer blocks too, by a factor of a few: the ratio leaves room for that.)
SPARSE_RATIO = 64
SPARSE_MIN_BYTES = 1 << 30
EXTRA_NAMED_MAX = 10  # files not in a manifest named in a check's error (the rest counted)


class Limits:
    """What one check may cost (the agent's; a job checking its own checkpoint has none):
    ``max_bytes`` the most bytes its manifest may declare, ``deadline`` a ``time.monotonic()``
    past which it stops (between blocks), ``refuse_sparse`` whether a sparse file is refused
    (:data:`SPARSE_RATIO`)."""

    __slots__ = ("max_bytes", "deadline", "refuse_sparse")

    def __init__(self, max_bytes: int | None = None, deadline: float | None = None, refuse_sparse: bool = False) -> None:
        self.max_bytes = max_bytes
        self.deadline = deadline
        self.refuse_sparse = refuse_sparse

    def check_time(self, p: Path) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise LimitError(f"checkpoint {p}: its check ran out of time (migrate.verify_timeout_s)", "out_of_time")


NO_LIMITS = Limits()


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete or corrupt; the message says which and why."""


class LimitError(CheckpointError):
    """A checkpoint refused by a check's :class:`Limits`; ``reason``: ``too_large`` (its
    manifest declares more than ``max_bytes``), ``sparse``, ``out_of_time``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_regular(path: Path) -> int:
    """An fd of ``path`` opened for reading only if it is a regular file: a symbolic link, a
    pipe or a device is refused (OSError) without blocking, so a directory the job's user
    writes can neither stall nor redirect what the agent reads."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def file_sha256(path: Path, limits: Limits = NO_LIMITS) -> str:
    """SHA-256 of the regular file ``path`` (hex); OSError for a link, pipe or device;
    CheckpointError once ``limits.deadline`` passes (looked at between blocks)."""
    h = hashlib.sha256()
    with open(_open_regular(path), "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
            limits.check_time(path.parent)
    return h.hexdigest()


def _check_dir(p: Path) -> None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {p}: no such directory") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"checkpoint {p}: not a directory (a symbolic link is never a checkpoint)")


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``, unverified. Raises CheckpointError."""
    p = Path(path)
    try:
        with open(_open_regular(p / MANIFEST), "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {p}: no {MANIFEST} (incomplete or not a checkpoint)") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {p}: {MANIFEST} is not a readable regular file: {e}") from None
    return parse_manifest(raw, str(p))


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest ``raw`` (a ``MANIFEST.json``'s bytes; ``where`` names its checkpoint in
    errors), checked as :func:`read_manifest` checks it. Raises CheckpointError."""
    p = where
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"checkpoint {p}: {MANIFEST} exceeds {MAX_MANIFEST_BYTES} bytes")
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {p}: unreadable {MANIFEST}: {e}") from None
    if not isinstance(m, dict) or not isinstance(m.get("files"), list) or m.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {p}: {MANIFEST} is not a version {FORMAT_VERSION} manifest")
    if not m["files"]:
        raise CheckpointError(f"checkpoint {p}: {MANIFEST} lists no file (a checkpoint holds the job's state)")
    step = m.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {p}: step {step!r} in {MANIFEST} is not an integer >= 0")
    for f in m["files"]:
        name = f.get("name") if isinstance(f, dict) else None
        if (not isinstance(name, str) or "/" in name or "\x00" in name or name in ("", ".", "..", MANIFEST)
                or name in SIDECARS):
            raise CheckpointError(f"checkpoint {p}: bad file name {name!r} in {MANIFEST}")
    return m


def verify_checkpoint(path: str | os.PathLike[str], *, hashed: Mapping[str, str] | None = None,
                      limits: Limits = NO_LIMITS) -> dict[str, Any]:
    """The manifest of ``path`` after checking that every file it lists exists with the size
    and SHA-256 it records and that no other file is present. A checkpoint is a directory (not a
    symbolic link to one) of regular files: a link, pipe or device is refused. Raises
    CheckpointError naming the first problem: a checkpoint that fails this is never to be
    restored.

    ``hashed`` (name -> SHA-256 hex) is for a caller that hashed some files' bytes itself, as it
    wrote them (the transfer receiver): those files are checked for presence, type and size and
    their given hash against the manifest's, not read again. A job restoring a checkpoint never
    passes it: :func:`Checkpointer.resume` hashes what it deserializes.

    ``limits`` (the agent's): what the check may cost (:class:`Limits`); past them it raises
    CheckpointError before hashing (a manifest declaring more than ``max_bytes``, a sparse file)
    or as soon as the deadline passes."""
    return _verify(Path(path), load=False, hashed=hashed or {}, limits=limits)[0]


def precheck(path: str | os.PathLike[str], limits: Limits = NO_LIMITS) -> dict[str, Any]:
    """The manifest of ``path`` after the checks of :func:`verify_checkpoint` that read no
    file's contents: a directory of exactly the manifest's files, regular files of the sizes it
    records, within ``limits`` (declared bytes, no sparse file). Raises CheckpointError. What
    hashes a checkpoint another way (the transfer manifest's build) runs it first."""
    return _precheck(Path(path), limits)


def _precheck(p: Path, limits: Limits) -> dict[str, Any]:
    _check_dir(p)
    m = read_manifest(p)
    listed = {f["name"] for f in m["files"]}
    declared = 0
    for f in m["files"]:
        z = f.get("size")
        if not isinstance(z, int) or isinstance(z, bool) or z < 0:
            raise CheckpointError(f"checkpoint {p}: {f['name']}: size {z!r} in {MANIFEST} is not an integer >= 0")
        declared += z
    if limits.max_bytes is not None and declared > limits.max_bytes:
        raise LimitError(f"checkpoint {p}: its {MANIFEST} declares {declared} bytes, more than the "
                         f"{limits.max_bytes} a check may read (migrate.verify_max_bytes)", "too_large")
    extra: list[str] = []
    seen = 0
    try:  # not through a link swapped in since the lstat
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"checkpoint {p}: not a readable directory: {e.strerror or e}") from None
    try:
        it = os.scandir(fd)  # at most the listed files, the manifest, the sidecars and a few more are read
    finally:
        os.close(fd)  # (scandir reads a duplicate)
    with it:
        for ent in it:
            if ent.name == MANIFEST or ent.name in listed or ent.name in SIDECARS:
                continue
            extra.append(ent.name)
            seen += 1
            if seen > EXTRA_NAMED_MAX:
                break
    if extra:
        more = " and more" if len(extra) > EXTRA_NAMED_MAX else ""
        raise CheckpointError(f"checkpoint {p}: files not in the manifest: {sorted(extra[:EXTRA_NAMED_MAX])}{more}")
    for f in m["files"]:
        fp = p / f["name"]
        try:
            st = os.lstat(fp)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {p}: {f['name']} is missing") from None
        except OSError as e:  # a name the file system refuses (too long, ...)
            raise CheckpointError(f"checkpoint {p}: {f['name']!r}: {e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"checkpoint {p}: {f['name']} is not a regular file (a link, pipe or device)")
        if st.st_size != f.get("size"):
            raise CheckpointError(f"checkpoint {p}: {f['name']} has {st.st_size} bytes, manifest says {f.get('size')}")
        if (limits.refuse_sparse and st.st_size >= SPARSE_MIN_BYTES
                and st.st_blocks * 512 * SPARSE_RATIO < st.st_size):
            raise LimitError(f"checkpoint {p}: {f['name']} is sparse: {st.st_size} bytes long, "
                             f"{st.st_blocks * 512} on disk (a checkpoint's files are written whole)", "sparse")
        limits.check_time(p)
    return m


def _read_whole(fd: int, size: int) -> bytes:
    """Everything ``fd`` (a regular file of ``size`` bytes by fstat, read from its start; closed
    here) holds, in one ``bytes`` object sized from fstat up front: no second copy while it is
    read. OSError when fstat reports another size."""
    with open(fd, "rb", buffering=0) as raw:
        if os.fstat(fd).st_size != size:
            raise OSError(f"its size changed to {os.fstat(fd).st_size} bytes while it was opened")
        return raw.readall()


def _memfd() -> int | None:
    """A new sealable memfd, or None where there is none (not Linux, a sandbox refusing it)."""
    try:
        return os.memfd_create("laminar-resume", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError):
        return None


def _copy_sealed(fd: int, size: int, mfd: int) -> tuple[int, str]:
    """(bytes copied, SHA-256 hex) of what ``fd`` (read from its start; closed here) holds,
    copied block by block into the empty memfd ``mfd``, which is then sealed against every
    write, growth and shrink: no process, the job's own included, can change those bytes
    afterwards. Stops past ``size + 1`` bytes. The caller closes ``mfd`` (also on an error).

    Each block is hashed in a second thread while this one writes it into the memfd and reads
    the next (hashlib lets go of the GIL): the hash is of the very buffer written, and a buffer
    is read into again only once its hash is done (three in turn). One GiB took 0.88 s with the
    two in one thread, 0.55 s now (the hash alone: 0.49 s)."""
    from concurrent.futures import ThreadPoolExecutor  # here: a job that never resumes does not import it

    h = hashlib.sha256()
    total = 0
    bufs = [memoryview(bytearray(_COPY_BLOCK)) for _ in range(3)]
    hashing: collections.deque[Future[None]] = collections.deque()
    with ThreadPoolExecutor(1, thread_name_prefix="laminar-resume-hash") as ex, open(fd, "rb", buffering=0) as src:
        i = 0
        while total <= size:
            if len(hashing) == len(bufs) - 1:
                hashing.popleft().result()  # the buffer read into next is no longer hashed
            buf = bufs[i % len(bufs)]
            n = src.readinto(buf)
            if not n:
                break
            total += n
            view = buf[:n]
            hashing.append(ex.submit(h.update, view))  # in order: one thread
            done = 0
            while done < n:
                done += os.write(mfd, view[done:n])
            i += 1
        for f in hashing:
            f.result()
    fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    return total, h.hexdigest()


def _verify(p: Path, load: bool, hashed: Mapping[str, str] | None = None,
            limits: Limits = NO_LIMITS) -> tuple[dict[str, Any], bytes | int | None]:
    """:func:`verify_checkpoint`'s manifest and, with ``load``, the manifest's first file (the
    job's state) read once and checked against the size and SHA-256 the manifest records as
    read, so what the caller deserializes is exactly what was verified, whatever the storage
    answers to a later read (a file replaced meanwhile, a racing writer, flaky network storage):
    torch state as a sealed memfd (an int: :func:`_copy_sealed`; the caller closes it), where
    Linux has memfds; any other, in memory (``bytes``)."""
    m = _precheck(p, limits)  # nothing hashed before the whole directory is as its manifest says
    data: bytes | int | None = None
    try:
        for i, f in enumerate(m["files"]):
            fp = p / f["name"]
            try:
                st = os.lstat(fp)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {p}: {f['name']} is missing") from None
            except OSError as e:  # a name the file system refuses (too long, ...)
                raise CheckpointError(f"checkpoint {p}: {f['name']!r}: {e.strerror or e}") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"checkpoint {p}: {f['name']} is not a regular file (a link, pipe or device)")
            size = st.st_size
            if size != f.get("size"):
                raise CheckpointError(f"checkpoint {p}: {f['name']} has {size} bytes, manifest says {f.get('size')}")
            try:
                mfd = _memfd() if load and i == 0 and m.get("format") == "torch" else None
                if mfd is not None:
                    try:
                        got, digest = _copy_sealed(_open_regular(fp), size, mfd)
                    except BaseException:
                        os.close(mfd)
                        raise
                    if got != size or digest != f.get("sha256"):
                        os.close(mfd)
                    else:
                        data = mfd
                    if got != size:
                        raise CheckpointError(f"checkpoint {p}: {f['name']} read {got} bytes, manifest says {size}")
                elif not load and hashed and f["name"] in hashed:
                    digest = hashed[f["name"]]
                elif load and i == 0:
                    data = _read_whole(_open_regular(fp), size)
                    if len(data) != size:
                        raise CheckpointError(f"checkpoint {p}: {f['name']} read {len(data)} bytes, manifest says {size}")
                    digest = hashlib.sha256(data).hexdigest()
                else:
                    digest = file_sha256(fp) if limits is NO_LIMITS else file_sha256(fp, limits)
            except OSError as e:
                raise CheckpointError(f"checkpoint {p}: {f['name']} is not a readable regular file: {e}") from None
            if digest != f.get("sha256"):
                raise CheckpointError(f"checkpoint {p}: {f['name']} does not match its SHA-256 (corrupt)")
    except BaseException:
        if isinstance(data, int):  # a later file failed: the state's memfd goes
            os.close(data)
        raise
    return m, data


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _sweep_dead_saves(d: Path) -> None:
    """Removes what saves killed half-way left in ``d`` (``.tmp-ckpt-<step>-<pid>`` of a pid
    that is gone: up to a whole checkpoint each). A replaced checkpoint (``.old-ckpt-...``)
    whose save died between its two renames is the only one of its step: it is put back."""
    for p in d.iterdir():
        m = _WRITING.fullmatch(p.name)
        if m is None or int(m.group(3)) == os.getpid() or _pid_alive(int(m.group(3))):
            continue
        if p.is_symlink() or not p.is_dir():
            continue
        final = d / f"ckpt-{m.group(2)}"
        if m.group(1) == "old" and not os.path.lexists(final):
            try:
                os.rename(p, final)
                continue
            except OSError:
                pass
        shutil.rmtree(p, ignore_errors=True)


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[Path]:
    """Committed checkpoint directories under ``ckpt_dir`` (``ckpt-<n>``), oldest first; a
    symbolic link of that name is not one, and nothing is followed (an entry's type is its
    directory entry's: nothing behind a link or a mount point is reached). Unbounded: the job's
    own view of its directory; the agent reads jobs' directories with
    :mod:`laminar.runtime.ckpt_scan`, bounded and off its event loop."""
    d = Path(ckpt_dir)
    try:
        with os.scandir(d) as it:
            found = [d / e.name for e in it if _NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    return sorted(found, key=lambda p: int(p.name[5:]))


def workers(default: int | None = None) -> int | None:
    """An elastic job's current worker count: the agent rewrites the file ``LAMINAR_WORKERS_FILE``
    names (``{"workers": n, "gpus": [...]}``) and sends ``SIGUSR2`` when it changes. ``default``
    when there is no such file yet (or the job is not elastic)."""
    path = os.environ.get("LAMINAR_WORKERS_FILE")
    if not path:
        return default
    try:
        return int(json.loads(Path(path).read_text())["workers"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def latest_checkpoint(ckpt_dir: str | os.PathLike[str], *, tries: int | None = None,
                      limits: Limits = NO_LIMITS, names: list[Path] | None = None) -> Path | None:
    """The newest checkpoint under ``ckpt_dir`` that passes :func:`verify_checkpoint`, or None.
    ``tries``: at most that many of the newest are checked (the agent's: a job cannot make it
    check a thousand); ``limits``: each check's (:class:`Limits`; its deadline bounds them all);
    ``names``: the checkpoints to look at (a listing taken already), else listed here."""
    return newest_verified(ckpt_dir, tries=tries, limits=limits, names=names)[0]


def newest_verified(ckpt_dir: str | os.PathLike[str], *, tries: int | None = None, limits: Limits = NO_LIMITS,
                    names: list[Path] | None = None) -> tuple[Path | None, dict[str, Any] | None]:
    """:func:`latest_checkpoint` and the manifest it verified: (path, manifest) or (None, None)."""
    cands = list(reversed(list_checkpoints(ckpt_dir) if names is None else names))
    for p in cands if tries is None else cands[:tries]:
        try:
            return p, verify_checkpoint(p, limits=limits)
        except CheckpointError:
            if limits.deadline is not None and time.monotonic() > limits.deadline:
                break
            continue
    return None, None


def _dist() -> Any | None:
    """``torch.distributed`` when this process is in an initialized group of more than one,
    else None. torch is never imported here: a job that has not imported it is in no group."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist


class BatchSlice(NamedTuple):
    """One rank's part of one step's global batch (:func:`global_batch`)."""

    indices: list[int]  # sample indices, in the global batch's order
    start: int  # where they start in the global batch
    loss_scale: float  # multiply the *sum* of this rank's per-sample losses by it


GLOBAL_BATCH_MAX = 1 << 24
N_SAMPLES_MAX = 1 << 62
_FEISTEL_ROUNDS = 4


def _shuffled(position: int, n: int, key: bytes) -> int:
    """The sample at ``position`` (0..n-1) of a pseudo-random permutation of range(n) keyed by
    ``key``: a Feistel network over the smallest even number of bits that holds n, walked
    until it lands below n (expected fewer than 4 walks). O(1) memory and work per position,
    the same on every machine and Python (BLAKE2b): no list of n indices is ever built."""
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = bits // 2
    mask = (1 << half) - 1
    x = position
    while True:
        left, right = x >> half, x & mask
        for r in range(_FEISTEL_ROUNDS):
            f = int.from_bytes(hashlib.blake2b(right.to_bytes(8, "little"), digest_size=8, key=key,
                                               salt=r.to_bytes(16, "little")).digest(), "little")
            left, right = right, left ^ (f & mask)
        x = (left << half) | right
        if x < n:
            return x


def global_batch(step: int, rank: int, world: int, global_batch: int, n_samples: int, seed: int) -> BatchSlice:
    """Rank ``rank``'s slice of step ``step``'s global batch, the same global batch whatever
    the world size, so a job resized from 3 workers to 2 computes what an unresized one would.

    The data order: positions ``step * global_batch`` to ``(step + 1) * global_batch - 1`` of
    an endless sequence of epochs, epoch ``e`` a permutation of ``range(n_samples)`` drawn from
    ``(seed, e)``. The slice: the global batch cut into ``world`` contiguous parts whose sizes
    differ by at most one (the first ``global_batch % world`` ranks hold one more; a rank may
    hold none when the batch is smaller than the world).

    The loss scale ``world / global_batch``: DDP averages the ranks' gradients (divides their
    sum by ``world``), so each rank's loss is the *sum* of its samples' losses times
    ``loss_scale``, and the average is the gradient of the mean loss over the global batch,
    uneven slices included::

        s = global_batch(step, rank, world, 64, len(data), seed)
        loss = loss_fn(model(x[s.indices]), y[s.indices], reduction="sum") * s.loss_scale

    Work: O(global_batch / world) hashes. ValueError naming the value that is out of range."""
    for name, v, lo, hi in (("step", step, 0, 1 << 62), ("world", world, 1, 1 << 20),
                            ("global_batch", global_batch, 1, GLOBAL_BATCH_MAX),
                            ("n_samples", n_samples, 1, N_SAMPLES_MAX), ("seed", seed, 0, (1 << 64) - 1)):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ValueError(f"jobkit.global_batch: {name} {v!r} is not an integer in {lo}..{hi}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"jobkit.global_batch: rank {rank!r} is not in 0..{world - 1} (world {world})")
    base, extra = divmod(global_batch, world)
    start = rank * base + min(rank, extra)
    size = base + (1 if rank < extra else 0)
    out: list[int] = []
    key = b""
    epoch = -1
    for pos in range(step * global_batch + start, step * global_batch + start + size):
        e, within = divmod(pos, n_samples)
        if e != epoch:
            epoch = e
            key = hashlib.blake2b(f"{seed}/{e}".encode(), digest_size=32).digest()
        out.append(_shuffled(within, n_samples, key))
    return BatchSlice(indices=out, start=start, loss_scale=world / global_batch)


class Checkpointer:
    """The job's handle on the contract. Arguments default to the ``LAMINAR_*`` environment.

    ``keep``: how many committed checkpoints to keep in ``ckpt_dir``: after a new one commits,
    it and the ``keep - 1`` newest with a lower step stay, the older ones are removed (one with
    a higher step, left by another run, is neither counted nor removed). ``install_signal``: set the checkpoint signal's handler (only
    possible from the main thread)."""

    def __init__(
        self,
        job_id: str | None = None,
        ckpt_dir: str | os.PathLike[str] | None = None,
        resume_from: str | os.PathLike[str] | None = None,
        signum: int | None = None,
        keep: int = 2,
        install_signal: bool = True,
        rank: int | None = None,
    ) -> None:
        env = os.environ
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise CheckpointError(f"jobkit: rank must be an integer >= 0, got {rank!r}")
        self._rank = rank
        self.job_id = job_id or env.get("LAMINAR_JOB_ID", "local")
        cd = ckpt_dir or env.get("LAMINAR_CKPT_DIR")
        if not cd:
            raise CheckpointError("jobkit: no checkpoint directory: LAMINAR_CKPT_DIR is unset and none was given")
        self.ckpt_dir = Path(cd)
        rf = resume_from if resume_from is not None else env.get("LAMINAR_RESUME_FROM") or None
        self.resume_from = Path(rf) if rf else None
        if keep < 1:
            raise CheckpointError(f"jobkit: keep must be >= 1, got {keep}")
        self.keep = keep
        self._flag = threading.Event()
        self.resumed_step: int | None = None
        self.saved: list[Path] = []
        if signum is None:
            name = env.get("LAMINAR_CKPT_SIGNAL", "SIGUSR1")
            try:
                signum = int(signal.Signals[name])
            except KeyError:
                raise CheckpointError(f"jobkit: LAMINAR_CKPT_SIGNAL={name!r} is not a signal name (e.g. SIGUSR1)") from None
        self.signum = signum
        if install_signal:
            signal.signal(signum, self._on_signal)

    @property
    def rank(self) -> int:
        """This process's rank: the ``rank`` given, else ``torch.distributed``'s once initialized,
        else ``$RANK`` (torchrun's, a multi-node job's), else 0. Only rank 0 writes."""
        if self._rank is not None:
            return self._rank
        dist = _dist()
        if dist is not None:
            return int(dist.get_rank())
        try:
            return max(0, int(os.environ.get("RANK", "0")))
        except ValueError:
            return 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._flag.set()

    def request(self) -> None:
        """Ask for a checkpoint from inside the job (what the signal does)."""
        self._flag.set()

    def requested(self) -> bool:
        """True when a checkpoint has been asked for and not yet saved."""
        return self._flag.is_set()

    def requested_all(self) -> bool:
        """:meth:`requested` agreed by every rank of an initialized ``torch.distributed`` group
        of more than one (one all_reduce of one integer, MAX): True on every rank when any rank
        was asked, so all checkpoint at the same step. A collective: call it on every rank at
        the same point of every step. Without such a group, :meth:`requested`."""
        dist = _dist()
        if dist is None:
            return self.requested()
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        flag = torch.tensor([1 if self._flag.is_set() else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save(self, state: Any, step: int | None = None, meta: dict[str, Any] | None = None) -> Path:
        """Commits ``state`` atomically as ``ckpt_dir/ckpt-<step>`` (step defaults to a
        nanosecond timestamp) and clears the request. Returns the checkpoint's directory.
        Saving the same step twice replaces the earlier checkpoint, atomically too. What saves
        killed half-way left here (their temporaries) is removed first.

        On a rank other than 0 (:attr:`rank`) nothing is written: the request is cleared and the
        directory rank 0 commits is returned; ``step`` is then required (every rank names the
        same checkpoint)."""
        if self.rank != 0:
            if step is None:
                raise CheckpointError(f"jobkit: rank {self.rank}: save needs step= (rank 0 names the checkpoint by it)")
            if int(step) < 0:
                raise CheckpointError(f"jobkit: step must be >= 0, got {step}")
            self._flag.clear()
            return self.ckpt_dir / f"ckpt-{int(step)}"
        n = time.time_ns() if step is None else int(step)
        if n < 0:
            raise CheckpointError(f"jobkit: step must be >= 0, got {step}")
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        _sweep_dead_saves(self.ckpt_dir)
        final = self.ckpt_dir / f"ckpt-{n}"
        tmp = self.ckpt_dir / f".tmp-ckpt-{n}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            fname, fmt = _format_of(state)
            with open(tmp / fname, "wb") as f:
                out = _HashingWriter(f)
                _serialize_into(state, fmt, out)
                f.flush()
                os.fsync(f.fileno())
            manifest = {
                "version": FORMAT_VERSION,
                "job_id": self.job_id,
                "step": n,
                "format": fmt,
                "created": time.time(),
                "meta": meta or {},
                "files": [{"name": fname, "size": out.size, "sha256": out.sha.hexdigest()}],
            }
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            old = None
            if final.exists():
                old = self.ckpt_dir / f".old-ckpt-{n}-{os.getpid()}"
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(self.ckpt_dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._flag.clear()
        self.saved.append(final)
        # The new one and the keep-1 newest *older* ones stay: a checkpoint of a higher step (a
        # corrupt one the job resumed past, another timeline) never counts against the new one.
        older = [p for p in list_checkpoints(self.ckpt_dir) if int(p.name[5:]) < n]
        for p in older[: max(0, len(older) - (self.keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
        return final

    def resume(self, weights_only: bool = True) -> Any | None:
        """The state of ``LAMINAR_RESUME_FROM`` (a checkpoint directory, or a directory of
        checkpoints: the newest one that verifies as it is loaded), or None on a fresh start.
        Raises CheckpointError when the checkpoint named does not verify, or when no checkpoint
        of the directory does: a corrupt checkpoint is never loaded.

        In a directory, each checkpoint from the newest down is read once and verified as it is
        read; the first that verifies is loaded, and the newer ones that did not are named on
        stderr. (The newest was verified by one read and loaded by a second before: a second
        read that disagreed, storage failing or the file replaced in between, failed the
        resume although an older checkpoint was whole.)

        In an initialized ``torch.distributed`` group of more than one, call it on every rank
        (a collective): rank 0 chooses and loads, then every other rank loads the very checkpoint
        rank 0 loaded (verifying it as it reads it); a checkpoint rank 0 could not resume fails
        every rank. After a TorchElastic restart of the workers the source is the job's own
        checkpoint directory when it holds one (``LAMINAR_RESUME_FROM`` names what the job was
        started from, older than what it saved since)."""
        dist = _dist()
        if dist is None:
            return self._resume_here(self._resume_source(), weights_only)
        # every rank loads what rank 0 chose: ranks that listed the directory a moment apart
        # (a save committing meanwhile) would resume from different steps
        chosen: list[Any] = [None]
        err: Exception | None = None
        state = None
        if dist.get_rank() == 0:
            try:
                src = self._resume_source()
                state = self._resume_here(src, weights_only, chosen)
            except Exception as e:  # told to the others, or they wait in the broadcast for ever
                err, chosen[0] = e, ("error", f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(chosen, src=0)
        if err is not None:
            raise err
        if dist.get_rank() == 0:
            return state
        if isinstance(chosen[0], tuple):
            raise CheckpointError(f"jobkit: rank 0 could not resume: {chosen[0][1]}")
        return self._resume_here(None if chosen[0] is None else Path(chosen[0]), weights_only)

    def _resume_source(self) -> Path | None:
        """Where to resume from: after a TorchElastic restart of the workers, the job's own
        checkpoint directory when it holds a checkpoint (newer than what the job started from);
        else ``resume_from``."""
        try:
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError:
            restarts = 0
        if restarts > 0 and list_checkpoints(self.ckpt_dir):
            return self.ckpt_dir
        return self.resume_from

    def _resume_here(self, src: Path | None, weights_only: bool, chosen: list[Any] | None = None) -> Any | None:
        """:meth:`resume` from ``src`` in this process alone; ``chosen[0]`` is set to the
        checkpoint loaded (a directory of checkpoints resolved to one)."""
        if src is None:
            return None
        # the state file is read once, into memory, and verified there: what is loaded is what
        # was verified, whatever a second read of the storage would answer
        if (src / MANIFEST).exists():
            m, data = _verify(src, load=True)
        else:
            skipped: list[str] = []
            for cand in reversed(list_checkpoints(src)):
                try:
                    m, data = _verify(cand, load=True)
                except CheckpointError as e:
                    skipped.append(str(e))
                    continue
                src = cand
                break
            else:
                raise CheckpointError(f"jobkit: LAMINAR_RESUME_FROM={src} holds no verified checkpoint"
                                      + (f" ({'; '.join(skipped)})" if skipped else ""))
            if skipped:
                print(f"jobkit: resuming from {src.name}, the newest checkpoint that verifies; newer ones did not: "
                      f"{'; '.join(skipped)}", file=sys.stderr, flush=True)
        self.resumed_step = int(m.get("step", 0))
        if chosen is not None:
            chosen[0] = str(src)
        return _deserialize(src / m["files"][0]["name"], b"" if data is None else data, m.get("format", "bytes"),
                            weights_only)


class _HashingWriter:
    """A write-only file that hashes and counts what goes through it, so a checkpoint is
    serialized straight to disk, hashed on the way: the job never holds a second copy of its
    state in memory (a checkpoint is often taken when memory is short)."""

    def __init__(self, f: io.BufferedWriter) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        self._f.write(mv)
        self.sha.update(mv)
        self.size += mv.nbytes
        return mv.nbytes

    def flush(self) -> None:
        self._f.flush()


def _format_of(state: Any) -> tuple[str, str]:
    """(file name, format) of ``state``: bytes as is, else torch when it can be imported, else
    pickle."""
    if isinstance(state, (bytes, bytearray, memoryview)):
        return "state.bin", "bytes"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "state.pkl", "pickle"
    return "state.pt", "torch"


def _serialize_into(state: Any, fmt: str, out: _HashingWriter) -> None:
    if fmt == "bytes":
        out.write(state)
    elif fmt == "pickle":
        pickle.dump(state, out, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        import torch

        torch.save(state, out)  # type: ignore[arg-type]  # torch needs only write() and flush()


def _deserialize(path: Path, data: bytes | int, fmt: str, weights_only: bool) -> Any:
    """The state in ``data`` (the verified bytes of ``path``, or a sealed memfd of them, closed
    here); the file is never read again."""
    if isinstance(data, int):
        import torch

        try:  # the tensors map the sealed memfd's pages: no second copy of the state
            if os.path.exists(f"/proc/self/fd/{data}"):
                return torch.load(f"/proc/self/fd/{data}", map_location="cpu", weights_only=weights_only, mmap=True)
            with open(data, "rb", closefd=False) as f:  # no /proc: read from it (a second copy meanwhile)
                return torch.load(f, map_location="cpu", weights_only=weights_only)
        finally:
            os.close(data)
    if fmt == "bytes":
        return data
    if fmt == "torch":
        import torch

        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)  # shares data: no copy
    if fmt == "pickle":
        return pickle.loads(data)
    raise CheckpointError(f"jobkit: {path}: unknown checkpoint format {fmt!r} (bytes, torch or pickle)")
