"""The transfer manifest of a jobkit checkpoint (:class:`Manifest`: its files, chunk size and
every chunk's SHA-256) and the reads behind it: built on the source (:func:`build_manifest`,
:func:`check_source` for one built ``unchecked``), checked when it arrives
(:meth:`Manifest.from_body`), and what tells one version of a checkpoint's files from another
(:func:`_source_state`), so a checkpoint re-saved under the sender is told apart from a corrupt
one."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from laminar import jobkit
from laminar.migrate.transfer.errors import SourceChangedError, TransferError

MANIFEST_VERSION = 1  # the transfer manifest's format (its digest, TRANSFER.json of committed copies): unchanged
DEFAULT_CHUNK = 1 << 20  # 1 MiB: a lost connection costs at most this much again per chunk in flight
MAX_CHUNK = 64 << 20
MAX_FILES = 10_000  # files a checkpoint may have to be transferred (the manifest's digest costs per file)
_HASH_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))  # threads hashing chunks beside the one hashing files: a core is left to the event loop
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # ASCII, and used with fullmatch (F10: "$" let "\n" in)
VERIFIED = "VERIFIED"
TRANSFER_MANIFEST = "TRANSFER.json"


@dataclass(frozen=True)
class Manifest:
    job_id: str
    ckpt_id: str
    chunk_size: int
    files: tuple[tuple[str, int, str], ...]  # (name, size, sha256)
    chunks: tuple[str, ...]
    # the sender's side only, never on the wire: what the files were when the manifest was
    # built (:func:`_source_state`), so a change under the sender is seen (empty: unknown)
    source: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    # the sender's side only: the files' SHA-256 are the job's MANIFEST.json's word, not yet
    # checked against the disk (build_manifest(check_files=False): :func:`check_source` does it)
    unchecked: bool = field(default=False, compare=False, repr=False)

    @functools.cached_property
    def total_bytes(self) -> int:
        return sum(f[1] for f in self.files)

    def body(self) -> dict[str, Any]:
        return {
            "v": MANIFEST_VERSION,
            "job_id": self.job_id,
            "ckpt_id": self.ckpt_id,
            "chunk_size": self.chunk_size,
            "files": [list(f) for f in self.files],
            "chunks": list(self.chunks),
        }

    @functools.cached_property
    def digest(self) -> str:  # computed once: a manifest of 100 GB in 1 MiB chunks is ~7 MB of JSON
        return hashlib.sha256(json.dumps(self.body(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def chunk_len(self, i: int) -> int:
        return min(self.chunk_size, self.total_bytes - i * self.chunk_size)

    @classmethod
    def from_body(cls, b: Any) -> Manifest:
        """Parses and checks a manifest received from a peer; raises TransferError."""
        try:
            if b["v"] != MANIFEST_VERSION:
                raise TransferError(f"transfer: manifest version {b['v']!r}, expected {MANIFEST_VERSION}")
            if len(b["files"]) > MAX_FILES:
                raise TransferError(f"transfer: the manifest lists {len(b['files'])} files, more than the {MAX_FILES} a "
                                    "transfer takes")
            m = cls(
                job_id=str(b["job_id"]),
                ckpt_id=str(b["ckpt_id"]),
                chunk_size=int(b["chunk_size"]),
                files=tuple((str(n), int(s), str(h)) for n, s, h in b["files"]),
                chunks=tuple(str(c) for c in b["chunks"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"transfer: malformed manifest: {e!r}") from None
        for name in (m.job_id, m.ckpt_id, *(f[0] for f in m.files)):
            if not isinstance(name, str) or not _SAFE.fullmatch(name) or name in (VERIFIED, TRANSFER_MANIFEST):
                raise TransferError(f"transfer: unsafe name {name!r} in manifest (letters, digits, '_', '.', '-')")
        if not 0 < m.chunk_size <= MAX_CHUNK:
            raise TransferError(f"transfer: chunk_size {m.chunk_size} out of range 1..{MAX_CHUNK}")
        expect = (m.total_bytes + m.chunk_size - 1) // m.chunk_size
        if len(m.chunks) != expect or any(s < 0 for _, s, _ in m.files):
            raise TransferError(f"transfer: manifest lists {len(m.chunks)} chunks, its sizes need {expect}")
        return m


class _SpanReadError(OSError):
    """A read of the concatenation that the storage refused (EIO, ...): ``span`` is the index
    of the file in the spans, ``offset`` where in that file the read failed."""

    def __init__(self, e: OSError, span: int, offset: int) -> None:
        super().__init__(e.errno, e.strerror)
        self.span, self.offset = span, offset

    def describe(self, root: Path, names: list[str]) -> str:
        """``<root>/<file>: a read from byte <offset> failed: <error>``: what a TransferError says."""
        return f"{root}/{names[self.span]}: a read from byte {self.offset} failed: [Errno {self.errno}] {self.strerror}"


def _pread_spans(spans: list[tuple[int, int, int]], start: int, view: memoryview) -> int:
    """Reads the concatenation of files (``spans``: fd, offset in the concatenation, size)
    from ``start`` into ``view``; the bytes read (fewer when a file is shorter than listed).
    Raises _SpanReadError naming the file and offset when the storage fails a read."""
    end, got = start + len(view), 0
    for j, (fd, off, size) in enumerate(spans):
        lo, hi = max(start, off), min(end, off + size)
        while lo < hi:
            try:
                k = os.preadv(fd, [view[lo - start:hi - start]], lo - off)
            except OSError as e:
                raise _SpanReadError(e, j, lo - off) from e
            if k <= 0:
                break
            lo += k
            got += k
    return got


def _ident(st: os.stat_result) -> tuple[int, ...]:
    """What tells one version of a file from another: a re-save makes new files (inode), a
    write in place moves mtime. Not ctime: a hard link made or removed moves it (the agent's
    snapshots link the job's files, and jobkit removes old checkpoints), the bytes stay."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _source_state(p: Path) -> tuple[Any, ...]:
    """The checkpoint directory ``p`` as it is now: its own identity and each file's (name,
    :func:`_ident`), sidecars left out; equal before and after a read means the read saw one
    version of every file. Raises OSError (gone: mid re-save, or removed) and
    SourceChangedError (replaced while listed)."""
    d0 = _ident(os.lstat(p))
    names = sorted(x.name for x in p.iterdir() if x.name not in jobkit.SIDECARS)
    files = tuple((n, _ident(os.lstat(p / n))) for n in names)
    if _ident(os.lstat(p)) != d0:
        raise SourceChangedError(f"transfer: {p} was replaced while it was listed")
    return d0, files


def build_manifest(ckpt_dir: str | os.PathLike[str], job_id: str, chunk_size: int = DEFAULT_CHUNK, *,
                   check_files: bool = True) -> Manifest:
    """The transfer manifest of a jobkit checkpoint directory. Checks the files against the
    job's own MANIFEST.json first (raises TransferError: a corrupt source is never shipped).
    Raises SourceChangedError when the checkpoint changed while it was read (a job that saved
    the same step again: its file hashes and its chunks' would describe two versions); the
    manifest remembers the files it describes (``source``), so the sender sees a change after.

    ``check_files=False`` (what :func:`send_checkpoint` does): only the chunks are hashed
    (every thread on them); the files' SHA-256 are taken from the job's MANIFEST.json, sizes
    checked, and the manifest is marked ``unchecked``: the caller runs :func:`check_source`
    beside the transfer and sends ``done`` only once it passed. The first byte leaves after
    one parallel pass instead of a sequential pass over the largest file."""
    p = Path(ckpt_dir)
    try:
        jobkit.read_manifest(p)  # a directory that is not a checkpoint fails before any hashing
    except jobkit.CheckpointError as e:
        raise TransferError(f"transfer: refusing to send {p}: {e}", fatal=True) from None
    if not 0 < chunk_size <= MAX_CHUNK:
        raise TransferError(f"transfer: chunk_size {chunk_size} out of range 1..{MAX_CHUNK}")
    before = _source_state(p)
    if len(before[1]) > MAX_FILES:
        raise TransferError(f"transfer: refusing to send {p}: {len(before[1])} files, more than the {MAX_FILES} a "
                            "transfer takes (save the job's state in fewer files)", fatal=True)

    def changed() -> bool:
        try:
            return _source_state(p) != before
        except (OSError, SourceChangedError):
            return True

    try:
        # the largest file first: the destination moves the first file into place rather than
        # copying it out of the partial file (Receiver._commit)
        sizes = sorted(((n, ident[2]) for n, ident in before[1]), key=lambda f: (-f[1], f[0]))
        m = _hash_checkpoint(p, job_id, chunk_size, sizes, check_files)
    except (TransferError, OSError) as e:
        if changed():  # what failed was reading two versions, not a corrupt source
            raise SourceChangedError(f"transfer: {p} changed while its manifest was built ({e})") from None
        raise
    if changed():
        raise SourceChangedError(f"transfer: {p} changed while its manifest was built (the job saved it again)")
    return replace(m, source=before)


def _hash_checkpoint(p: Path, job_id: str, chunk_size: int, sizes: list[tuple[str, int]],
                     check_files: bool = True) -> Manifest:
    """:func:`build_manifest`'s two passes over the files ``sizes`` lists (name, size); the
    chunks' alone without ``check_files``."""
    m0 = Manifest(job_id, p.name, chunk_size, tuple((n, z, "") for n, z in sizes), ())
    nchunks = (m0.total_bytes + chunk_size - 1) // chunk_size
    k = max(1, min(_HASH_THREADS + (0 if check_files else 1), nchunks))

    def hash_chunks(lo: int, hi: int) -> list[str]:
        out = []
        fds = [os.open(p / n, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW) for n, _ in sizes]
        try:
            spans = [(fd, sum(z for _, z in sizes[:j]), sizes[j][1]) for j, fd in enumerate(fds)]
            buf = memoryview(bytearray(chunk_size))
            for i in range(lo, hi):
                n = m0.chunk_len(i)
                if _pread_spans(spans, i * chunk_size, buf[:n]) != n:
                    raise TransferError(f"transfer: refusing to send {p}: a file shrank while it was read", fatal=True)
                out.append(hashlib.sha256(buf[:n]).hexdigest())
        except _SpanReadError as e:  # the storage failed a read (EIO): named, as jobkit's check names it
            raise TransferError(f"transfer: refusing to send {p}: {e.describe(p, [n for n, _ in sizes])}",
                                fatal=True) from None
        finally:
            for fd in fds:
                os.close(fd)
        return out

    if not check_files:
        try:
            claims = {f["name"]: f for f in jobkit.read_manifest(p)["files"]}
        except jobkit.CheckpointError as e:
            raise TransferError(f"transfer: refusing to send {p}: {e}", fatal=True) from None
        for n, z in sizes:
            if n in claims and claims[n].get("size") != z:
                raise TransferError(f"transfer: refusing to send {p}: {n} has {z} bytes, its manifest says "
                                    f"{claims[n].get('size')}", fatal=True)
        missing = sorted(set(claims) - {n for n, _ in sizes})
        if missing:
            raise TransferError(f"transfer: refusing to send {p}: {missing[0]} is missing", fatal=True)
        extra = sorted(n for n, _ in sizes if n not in claims and n != jobkit.MANIFEST)
        if extra:
            raise TransferError(f"transfer: refusing to send {p}: files not in its manifest: {extra}", fatal=True)
        with ThreadPoolExecutor(k, thread_name_prefix="lm-xfer-manifest") as ex:
            parts = [ex.submit(hash_chunks, j * nchunks // k, (j + 1) * nchunks // k) for j in range(k)]
            chunks = [c for f in parts for c in f.result()]
        files = [(n, z, str(claims[n]["sha256"]) if n in claims else jobkit.file_sha256(p / n)) for n, z in sizes]
        m = Manifest(job_id, p.name, chunk_size, tuple(files), tuple(chunks), unchecked=True)
        Manifest.from_body(m.body())
        return m
    # Two SHA-256 passes, side by side in threads (hashlib lets go of the GIL): jobkit's over
    # each file it lists, which checks them against the job's manifest and gives their
    # hashes, and the chunks'.
    with ThreadPoolExecutor(k + 1, thread_name_prefix="lm-xfer-manifest") as ex:
        job = ex.submit(jobkit.verify_checkpoint, p)
        parts = [ex.submit(hash_chunks, j * nchunks // k, (j + 1) * nchunks // k) for j in range(k)]
        try:
            listed = {f["name"]: f["sha256"] for f in job.result()["files"]}
        except jobkit.CheckpointError as e:
            raise TransferError(f"transfer: refusing to send {p}: {e}", fatal=True) from None
        chunks = [c for f in parts for c in f.result()]
    files = [(n, z, listed[n] if n in listed else jobkit.file_sha256(p / n)) for n, z in sizes]
    m = Manifest(job_id, p.name, chunk_size, tuple(files), tuple(chunks))
    Manifest.from_body(m.body())  # same checks as the receiver: unsafe names fail here
    return m


def check_source(ckpt_dir: str | os.PathLike[str], m: Manifest) -> None:
    """The check an ``unchecked`` manifest's files still need: every file against the job's
    MANIFEST.json (jobkit's, one pass over each) and those hashes against ``m``. Raises
    SourceChangedError when the checkpoint is another since ``m`` was built (a re-save: send
    the new one), TransferError (fatal) when it is the same and does not match (corrupt on the
    source disk: never shipped whole, never committed)."""
    p = Path(ckpt_dir)

    def changed() -> bool:
        try:
            return bool(m.source) and _source_state(p) != m.source
        except (OSError, SourceChangedError):
            return True

    try:
        listed = {f["name"]: f["sha256"] for f in jobkit.verify_checkpoint(p)["files"]}
    except jobkit.CheckpointError as e:
        if changed():
            raise SourceChangedError(f"transfer: {p} changed while it was sent ({e})") from None
        raise TransferError(f"transfer: refusing to send {p}: {e}", fatal=True) from None
    if changed():
        raise SourceChangedError(f"transfer: {p} changed while it was sent (the job saved it again)")
    for name, _size, sha in m.files:
        if name in listed and listed[name] != sha:
            raise TransferError(f"transfer: refusing to send {p}: {name} does not match the SHA-256 it was sent "
                                "under", fatal=True)
