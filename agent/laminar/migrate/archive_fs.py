"""File work in ``migrate.archive_dir`` that never follows a link, never waits on a FIFO and
never reads more than it can hold: everything relative to directory file descriptors opened
with ``O_NOFOLLOW`` (``openat``, ``mkdirat``, ``renameat``, ``unlinkat``: Python's ``dir_fd=``),
records opened ``O_NONBLOCK`` and checked to be regular files under a size cap before they are
read, listings cut at a bound. The archive is shared storage that other hosts (and, on a bad
export, users) may write: a name there can be swapped for a link to ``/etc`` at any moment, so
no path string built from what is there is ever handed to an open, chmod or remove. Blocking
file I/O: the archive's lane (:class:`laminar.migrate.archive.ArchiveLane`) runs all of it.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from laminar.migrate.archive_auth import CKPT_MAX_FILES, RECORD_MAX_BYTES, Refused

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_BLOCK = 1 << 20


class RootError(OSError):
    """``archive_dir`` cannot be used (a link, not a directory, owned by another uid, writable
    by group or others); the message names the path, what was found and the fix."""


def open_root(path: Path, owner: int) -> int:
    """An fd of the archive's root directory ``path`` (made, 0755, when missing), once it is a
    real directory (not a link) owned by ``owner`` (``migrate.archive_uid``) or by this
    process's uid and not writable by group or others. Raises RootError, or OSError from the
    storage."""
    try:
        fd = os.open(path, O_DIR)
    except FileNotFoundError:
        os.makedirs(path, 0o755, exist_ok=True)
        fd = os.open(path, O_DIR)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise RootError(f"migrate.archive_dir {path} is not a directory (a symbolic link or a file): point "
                            "archive_dir at the real directory") from None
        raise
    st = os.fstat(fd)
    why = None
    if st.st_uid not in (owner, os.geteuid()):
        why = (f"is owned by uid {st.st_uid}: it must be owned by root (or migrate.archive_uid, {owner}, the uid "
               f"an export squashes root to): chown {owner} {path}")
    elif st.st_mode & 0o022:
        why = (f"has mode {stat.S_IMODE(st.st_mode):04o}: writable by group or others, anyone who can write it can "
               f"plant or remove records: chmod go-w {path} (only the zone's agents may write the archive)")
    if why is not None:
        os.close(fd)
        raise RootError(f"migrate.archive_dir {path} {why}; the archive is not used until then")
    return fd


def open_dir(dirfd: int, name: str) -> int:
    """An fd of the directory ``name`` in ``dirfd``; :class:`Refused` (``link``, ``not_dir``)
    for anything else; FileNotFoundError when it is gone."""
    try:
        return os.open(name, O_DIR, dir_fd=dirfd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:  # (O_DIRECTORY | O_NOFOLLOW on a link answers ENOTDIR or ELOOP)
            link = stat.S_ISLNK(lstat_at(dirfd, name).st_mode)
        except OSError:
            link = False
        if link:
            raise Refused("link", f"{name} is a symbolic link") from None
        raise Refused("not_dir", f"{name} is not a directory") from None


def check_owned(fd: int, owner: int, name: str) -> None:
    """Refused (``foreign_owner``) unless the directory ``fd`` is ``owner``'s (or this process's)
    and not writable by group or others: what the agents make in the archive, never a user's."""
    st = os.fstat(fd)
    if st.st_uid not in (owner, os.geteuid()) or st.st_mode & 0o022:
        raise Refused("foreign_owner", f"{name} is owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}")


def make_dir(dirfd: int, name: str, owner: int, mode: int = 0o700) -> int:
    """An fd of the directory ``name`` in ``dirfd``, made (``mode``) when missing; its mode set
    through the fd (never through a name a link may replace); refused when it is not a real
    directory of the archive's ``owner``."""
    try:
        os.mkdir(name, mode, dir_fd=dirfd)
    except FileExistsError:
        pass
    fd = open_dir(dirfd, name)
    try:
        check_owned(fd, owner, name)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(dirfd: int, name: str, cap: int = RECORD_MAX_BYTES) -> bytes:
    """The bytes of the regular file ``name`` in ``dirfd``, at most ``cap``: opened without
    following a link and without waiting (a FIFO's open returns at once), checked to be a
    regular file of at most ``cap`` bytes before anything is read, and read no further than
    that. :class:`Refused` (``not_regular``, ``too_large``, ``unreadable``); FileNotFoundError
    when it is gone."""
    try:
        fd = os.open(name, O_READ, dir_fd=dirfd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Refused("not_regular", f"{name} is a symbolic link") from None
        raise Refused("unreadable", f"{name}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not_regular", f"{name} is not a regular file (mode {st.st_mode:o})")
        if st.st_size > cap:
            raise Refused("too_large", f"{name} has {st.st_size} bytes, at most {cap} are read")
        chunks, got = [], 0
        while got <= cap:
            b = os.read(fd, min(_BLOCK, cap + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > cap:
            raise Refused("too_large", f"{name} grew past {cap} bytes while it was read")
        return b"".join(chunks)
    except OSError as e:
        raise Refused("unreadable", f"{name}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def write_new(dirfd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """``data`` written to the new file ``name`` in ``dirfd`` (never an existing one, never
    through a link) and fsync'd."""
    fd = os.open(name, O_NEW, mode, dir_fd=dirfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(dirfd: int, name: str, data: bytes, tmp: str) -> None:
    """``name`` in ``dirfd`` replaced atomically by ``data`` (written to ``tmp`` first, fsync'd,
    renamed); the temporary is removed on a failure."""
    try:
        write_new(dirfd, tmp, data)
        os.rename(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dirfd)
        except OSError:
            pass
        raise


def names(dirfd: int, limit: int) -> tuple[list[str], bool]:
    """The names in the directory ``dirfd``, at most ``limit`` (sorted), and whether there were
    more: a directory of a million planted entries costs ``limit`` of them."""
    with os.scandir(dirfd) as it:
        got = [e.name for e in itertools.islice(it, limit + 1)]
    return sorted(got[:limit]), len(got) > limit


def lstat_at(dirfd: int, name: str) -> os.stat_result:
    return os.stat(name, dir_fd=dirfd, follow_symlinks=False)


def remove_tree(dirfd: int, name: str) -> None:
    """Removes ``name`` in ``dirfd``: a file or a link as itself, a directory and everything in
    it without following any link (shutil.rmtree with ``dir_fd``). Errors are ignored."""
    try:
        st = lstat_at(dirfd, name)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, ignore_errors=True, dir_fd=dirfd)
        else:
            os.unlink(name, dir_fd=dirfd)
    except OSError:
        pass


def newest_mtime(dirfd: int, name: str, limit: int = 256) -> float:
    """The newest modification time of ``name`` in ``dirfd`` and of the entries directly in it
    when it is a directory (at most ``limit`` of them; links not followed): what says a
    temporary is a crashed writer's. +inf when it cannot be read (so it never looks old)."""
    try:
        st = lstat_at(dirfd, name)
    except OSError:
        return float("inf")
    m = st.st_mtime
    if stat.S_ISDIR(st.st_mode):
        try:
            fd = open_dir(dirfd, name)
        except (OSError, Refused):
            return float("inf")
        try:
            for n in names(fd, limit)[0]:
                try:
                    m = max(m, lstat_at(fd, n).st_mtime)
                except OSError:
                    continue
        except OSError:
            return float("inf")
        finally:
            os.close(fd)
    return m


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """A checkpoint manifest's JSON, checked as jobkit checks it (names, sizes, hashes): raises
    :class:`Refused` (``manifest_mismatch``, ``too_big_ckpt``)."""
    from laminar import jobkit

    try:
        m = jobkit.parse_manifest(raw, where)
    except jobkit.CheckpointError as e:
        raise Refused("manifest_mismatch", str(e)) from None
    files = m["files"]
    if len(files) > CKPT_MAX_FILES:
        raise Refused("too_big_ckpt", f"{where}: {len(files)} files, at most {CKPT_MAX_FILES}")
    for f in files:
        if not isinstance(f.get("size"), int) or isinstance(f.get("size"), bool) or f["size"] < 0 \
                or not isinstance(f.get("sha256"), str):
            raise Refused("manifest_mismatch", f"{where}: file {f.get('name')!r} without a size and sha256")
    if len({f["name"] for f in files}) != len(files):
        raise Refused("manifest_mismatch", f"{where}: a file listed twice")
    return m


def copy_checkpoint(src_fd: int, dst_fd: int | None, manifest_raw: bytes, where: str,
                    mode: int = 0o600) -> tuple[int, int]:
    """Copies the checkpoint the manifest ``manifest_raw`` describes from the directory
    ``src_fd`` into the empty directory ``dst_fd`` (None: only checks it in place): exactly the
    files it lists (each opened without following a link or waiting, a regular file of the
    listed size, hashed as it is read and compared with the listed SHA-256: what is written is
    what was hashed), then the manifest itself; each fsync'd, files of ``mode``. (bytes, files).
    Raises :class:`Refused` (``manifest_mismatch``: a file missing, of another kind, size or
    hash) or OSError from either storage."""
    m = parse_manifest(manifest_raw, where)
    total = 0
    for f in m["files"]:
        name = str(f["name"])
        try:
            sfd = os.open(name, O_READ, dir_fd=src_fd)
        except OSError as e:
            raise Refused("manifest_mismatch", f"{where}: {name}: {e.strerror or e}") from None
        try:
            st = os.fstat(sfd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != f["size"]:
                raise Refused("manifest_mismatch", f"{where}: {name} is not a regular file of {f['size']} bytes")
            h = hashlib.sha256()
            dfd = os.open(name, O_NEW, mode, dir_fd=dst_fd) if dst_fd is not None else None
            try:
                got = 0
                while got <= f["size"]:
                    b = os.read(sfd, min(_BLOCK, f["size"] + 1 - got))
                    if not b:
                        break
                    h.update(b)
                    got += len(b)
                    view = memoryview(b)
                    while dfd is not None and view:
                        view = view[os.write(dfd, view):]
                if dfd is not None:
                    os.fsync(dfd)
            finally:
                if dfd is not None:
                    os.close(dfd)
        finally:
            os.close(sfd)
        if got != f["size"] or h.hexdigest() != f["sha256"]:
            raise Refused("manifest_mismatch", f"{where}: {name} does not match its size and SHA-256")
        total += got
    if dst_fd is not None:
        from laminar import jobkit

        write_new(dst_fd, jobkit.MANIFEST, manifest_raw, mode)
        os.fsync(dst_fd)
    return total, len(m["files"])
