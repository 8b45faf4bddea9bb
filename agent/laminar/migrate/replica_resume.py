"""A job's owner's copies of the replicas it resumes from (``<state_dir>/RESUME_DIR/<key>/ckpt-<n>/``,
hard links the owner may read; :meth:`laminar.migrate.reclaim.ReclaimComponent.check_resume`),
and their GC: a piece of :class:`laminar.migrate.replicas.Replicas` (its ``resumes``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar.migrate.constants import (
    _CKPT_NAME,
    _SAFE_KEY,
    REPLICA_TRASH,
    RESUME_DIR,
    RESUME_KEEP_S,
)
from laminar.migrate.trees import _remove_tree

if TYPE_CHECKING:
    from laminar.migrate.replicas import Replicas

log = logging.getLogger("laminar.migrate")


class ResumeCopies:
    """The resume copies of the replicas held here, and the owners they are made for.
    ``replicas``: the part that holds it."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.host = replicas.host
        self.owners: dict[str, tuple[int, int]] = {}  # key -> (uid, gid) of its job's owner (keepers held here)


    def note_owner(self, key: str, request: Any) -> None:
        """Records whose job ``key`` is from its keeper's request (a dict, or its JSON)."""
        try:
            req = json.loads(request) if isinstance(request, str) else request
            self.owners[key] = (int(req.get("owner_uid", 0) or 0), int(req.get("owner_gid", 0) or 0))
        except (ValueError, TypeError, AttributeError):
            pass

    def root(self) -> Path:
        return Path(self.host.agent.config.state_dir) / RESUME_DIR

    def copy(self, path: Path, uid: int, gid: int) -> Path:
        """The checkpoint a job of ``uid`` resumes from when ``path`` is a replica under
        ``xfer/`` (root's alone): ``<state_dir>/RESUME_DIR/<key>/<ckpt>/`` (RESUME_DIR's layout),
        made anew in a directory only root can reach, then renamed into place (hard links where
        the files are root's and readable, copies otherwise and across filesystems); links and
        anything but regular files in ``path`` are refused. ``path`` itself for root's jobs (a
        checkpoint claimed from the archive is already fetched into RESUME_DIR for its owner:
        :meth:`Claims.fetch`).
        Blocking (callers run it in a thread). Raises OSError."""
        if uid == 0:
            return path
        key, name = path.parent.name, path.name
        if not _SAFE_KEY.fullmatch(key) or not _CKPT_NAME.fullmatch(name):
            raise OSError(f"{path} is not a replica's checkpoint (<key>/ckpt-<n>)")
        base = self.base()
        tmp = base / f".tmp-{key}-{name}-{time.monotonic_ns()}"
        os.mkdir(tmp, 0o700)
        try:
            for f in os.listdir(path):
                src = path / f
                fst = os.lstat(src)
                if not stat.S_ISREG(fst.st_mode):
                    raise OSError(f"{src} is not a regular file")
                linked = False
                if fst.st_uid == 0 and fst.st_mode & 0o004 and not fst.st_mode & 0o022:
                    try:  # root's, readable, not writable: shared
                        os.link(src, tmp / f, follow_symlinks=False)
                        linked = True
                    except OSError:  # another filesystem (the archive's): copied
                        pass
                if not linked:  # a file only root may read (or anyone may write), or elsewhere: the owner's copy
                    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    try:
                        with os.fdopen(os.dup(fd), "rb") as fin, open(tmp / f, "xb") as fout:
                            shutil.copyfileobj(fin, fout, 4 << 20)
                    finally:
                        os.close(fd)
                    os.chmod(tmp / f, 0o644)
        except BaseException:
            _remove_tree(tmp)
            raise
        return self.install(tmp, key, name, uid, gid)

    def base(self) -> Path:
        """RESUME_DIR, made when missing: a directory of root's (0711). Raises OSError."""
        base = self.root()
        base.mkdir(exist_ok=True)
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
            raise OSError(f"{base} is not a directory of root's")
        os.chmod(base, 0o711)
        return base

    def install(self, tmp: Path, key: str, name: str, uid: int, gid: int) -> Path:
        """Puts the checkpoint made in ``tmp`` (a directory only root can reach, in RESUME_DIR, of
        files mode 0644) in place as ``RESUME_DIR/<key>/<name>`` for the job of ``uid``/``gid``
        (``<key>/`` theirs, 0500: they cannot swap it for a link); an older one of the name is
        replaced. ``tmp`` is removed on a failure. Raises OSError."""
        try:
            os.chmod(tmp, 0o755)
            kd = self.root() / key
            with contextlib.suppress(FileExistsError):
                os.mkdir(kd, 0o500)
            kst = os.lstat(kd)
            if not stat.S_ISDIR(kst.st_mode):
                raise OSError(f"{kd} is not a directory")
            os.chown(kd, uid, gid, follow_symlinks=False)
            os.chmod(kd, 0o500)  # an entry of root's base: its owner cannot swap it for a link
            dfd = os.open(kd, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                with contextlib.suppress(FileNotFoundError):
                    old = os.lstat(name, dir_fd=dfd)
                    _remove_tree(kd / name) if stat.S_ISDIR(old.st_mode) else os.unlink(name, dir_fd=dfd)
                os.rename(tmp, name, dst_dir_fd=dfd)
            finally:
                os.close(dfd)
        except BaseException:
            _remove_tree(tmp)
            raise
        return kd / name

    def gc(self, now: float | None = None) -> list[Path]:
        """Removes the resume copies (RESUME_DIR) no local job names any more (the rule of
        :meth:`_replica_user_jobs`) once older than RESUME_KEEP_S, a crashed copy's ``.tmp-*`` as
        old, and emptied ``<key>/`` directories. Renamed into the replica trash, removed in a
        thread. Returns what went."""
        if self.host.root is None:
            return []
        now = time.time() if now is None else now
        base = self.root()
        try:
            keys = os.listdir(base)
        except OSError:
            return []
        used = {(k, n) for k, names in self._users().items() for n in names}
        gone: list[Path] = []
        trash = self.host.root / REPLICA_TRASH
        trash.mkdir(exist_ok=True)

        def old(p: Path) -> bool:
            try:
                return now - os.lstat(p).st_mtime >= RESUME_KEEP_S
            except OSError:
                return False

        for k in keys:
            kd = base / k
            try:
                is_dir = stat.S_ISDIR(os.lstat(kd).st_mode)
            except OSError:
                continue
            victims: list[Path] = []
            if k.startswith(".tmp-") or not is_dir:
                victims = [kd] if old(kd) else []
            else:
                try:
                    names = os.listdir(kd)
                except OSError:
                    continue
                victims = [kd / n for n in names if (k, n) not in used and old(kd / n)]
                if not names and old(kd):
                    with contextlib.suppress(OSError):
                        os.rmdir(kd)
            for v in victims:
                dest = trash / f"resume-{v.parent.name}-{v.name}.{time.monotonic_ns()}"
                try:
                    os.rename(v, dest)
                except OSError:
                    continue
                gone.append(dest)
        self.replicas.remove_later(gone)
        return gone

    def _users(self) -> dict[str, set[str]]:
        """key -> the names under ``RESUME_DIR/<key>/`` a local job may still resume from."""
        out: dict[str, set[str]] = {}
        base = self.root()
        for _jid, rf in self.replicas.users_of_resume_from():
            p = Path(os.path.normpath(rf))
            if p.parent.parent == base:
                out.setdefault(p.parent.name, set()).add(p.name)
        return out
