"""Trees of files on disk the migrate component looks at and removes (the archive's, the
replicas'): links are never followed."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import stat
from pathlib import Path


class Budget:
    """How many more entries walks may look at (shared by the walks of one scan): a tree's file
    count comes from jobs elsewhere (a transfer manifest lists up to ~150k files), so a scan of
    many trees stops at a bound instead of taking minutes."""

    __slots__ = ("left",)

    def __init__(self, entries: int) -> None:
        self.left = entries

    def take(self, n: int = 1) -> bool:
        """Counts ``n`` entries; False once the budget is spent."""
        self.left -= n
        return self.left >= 0


def _newest_mtime(path: Path, budget: Budget | None = None) -> float:
    """The newest modification time of ``path`` and everything under it, links not followed
    (a link's own time). +inf when it cannot be read, or when ``budget`` runs out before the
    walk ends (so it never looks old)."""
    try:
        st = os.lstat(path)
    except OSError:
        return math.inf
    m = st.st_mtime
    if stat.S_ISDIR(st.st_mode):
        for top, dirs, files in os.walk(path, followlinks=False):
            if budget is not None and not budget.take(1 + len(dirs) + len(files)):
                return math.inf
            for n in dirs + files:
                with contextlib.suppress(OSError):
                    m = max(m, os.lstat(os.path.join(top, n)).st_mtime)
    return m


def _remove_tree(path: Path) -> None:
    """Removes ``path``: a link or a file as itself, a directory with shutil.rmtree (which never
    follows links inside it on Linux: ``rmtree.avoids_symlink_attacks``). Errors are ignored (what
    is left is a tombstone a later sweep removes)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def tree_bytes(path: Path, budget: Budget | None = None) -> int:
    """The bytes of the regular files at and under ``path`` (apparent sizes), links not followed
    (a link counts as nothing); 0 when it cannot be read; what ``budget`` leaves (the walk stops
    when it is spent)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if not stat.S_ISDIR(st.st_mode):
        return 0
    total = 0
    for top, dirs, files in os.walk(path, followlinks=False):
        if budget is not None and not budget.take(1 + len(dirs) + len(files)):
            break
        for n in files:
            with contextlib.suppress(OSError):
                fst = os.lstat(os.path.join(top, n))
                if stat.S_ISREG(fst.st_mode):
                    total += fst.st_size
    return total
