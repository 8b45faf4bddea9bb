"""One look at ``migrate.archive_dir`` as the agents may trust it (:class:`View`): the root
opened once (a real directory of the archive's owner, :func:`laminar.migrate.archive_fs.open_root`),
each key directory opened without following a link and checked to be the archive owner's, at
most ARCHIVE_DIR_MAX of its entries listed, and every record read through
:func:`laminar.migrate.archive_fs.read_small` and verified
(:class:`laminar.migrate.archive_auth.ArchiveAuth`) before anything is decided from it. What
does not verify is never claimed, renamed, removed or taken as evidence; it is counted once per
file by reason (:class:`Refusals`: ``migrate.counts.archive_unverified_<reason>``, the latest
in the status). Blocking file I/O: the archive's lane runs it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar.migrate import archive_fs
from laminar.migrate.archive_auth import OWNER_KINDS, ArchiveAuth, Refused, check_fresh
from laminar.migrate.constants import _SAFE_KEY

log = logging.getLogger("laminar.migrate")

ARCHIVE_DIR_MAX = 64  # entries of one key directory looked at: an agent writes a handful there
REFUSED_KEEP = 4096  # files already counted as refused (by identity): not counted or read again
REFUSED_SAMPLES = 10  # the latest refusals the status shows
DONE_DIR = ".done"
_NODE_FILE = re.compile(r"(claimed|running)-(\d{1,10})\.json")
# A running job's periodic checkpoint in the archive: its record (who runs it, its keeper).
LIVE_RECORD = "live.json"
# A round (and a sweep) reads at most this many entries of the archive's root; the next one goes
# on from there (a pass over a larger archive takes several): a million planted directories cost
# each round this many, not a million.
ARCHIVE_SCAN_MAX = 2048


_TMP_COPY = re.compile(r"\.tmp-(.+)-(\d+)-(\d+)")
_CKPT_STEP = re.compile(r"ckpt-(\d+)")


class Refusals:
    """Files of the archive this agent refused, counted by reason into ``counts``
    (``archive_unverified_<reason>``) once per file: a file is known by (where, inode, size,
    mtime, ctime), so a planted record is counted, logged and read once, not at every round,
    and one rewritten in place is looked at again. The latest REFUSED_SAMPLES are kept for the
    status."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self._known: collections.OrderedDict[tuple[Any, ...], str] = collections.OrderedDict()
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=REFUSED_SAMPLES)

    def known(self, ident: tuple[Any, ...] | None) -> bool:
        if ident is None or ident not in self._known:
            return False
        self._known.move_to_end(ident)
        return True

    def note(self, where: str, e: Refused, ident: tuple[Any, ...] | None = None) -> None:
        if ident is not None:
            if self.known(ident):
                return
            self._known[ident] = e.reason
            while len(self._known) > REFUSED_KEEP:
                self._known.popitem(last=False)
        name = f"archive_unverified_{e.reason}"
        self.counts[name] = self.counts.get(name, 0) + 1
        self.samples.append({"path": where, "reason": e.reason, "detail": e.detail[:200]})
        log.warning("migrate: archive: %s refused (%s): %s; left as it is", where, e.reason, e.detail)


@dataclass(frozen=True)
class Sealed:
    """A record that verified: its ``body``, its envelope ``env`` (as read), its file ``name``."""

    body: dict[str, Any]
    env: dict[str, Any]
    name: str

    @property
    def owner(self) -> dict[str, Any]:
        """The body of the job's own record (keeper or live): this one, or the one a claim or a
        run record holds."""
        return dict(self.owner_env["body"])

    @property
    def owner_env(self) -> dict[str, Any]:
        env, body = self.env, self.body
        if body["kind"] == "claim":
            env = body["taken"]
            body = env["body"]
        return env if body["kind"] in OWNER_KINDS else dict(body["record"])

    @property
    def taken(self) -> tuple[dict[str, Any], str]:
        """(the envelope a claim took, the name it had): a bare claim's is this very record."""
        if self.body["kind"] == "claim":
            return dict(self.body["taken"]), str(self.body["from"])
        k = self.body["kind"]
        return self.env, {"guard": "guard.json", "live": "live.json"}.get(k, f"running-{self.body['writer']}.json")

    @property
    def node(self) -> int | None:
        """The node a ``claimed-<n>``/``running-<n>`` file names."""
        m = _NODE_FILE.fullmatch(self.name)
        return int(m[2]) if m else None


class View:
    """A look at the archive (a context manager: its directories are closed at the end)."""

    def __init__(self, root: Path, owner: int, auth: ArchiveAuth, refusals: Refusals, now: float,
                 create: bool = True) -> None:
        self.root = root
        self.owner = owner
        self.auth = auth
        self.refusals = refusals
        self.now = now
        self.rootfd = archive_fs.open_root(root, owner) if create else _open_existing_root(root, owner)
        self._fds: dict[str, int | None] = {}
        self._names: dict[str, list[str]] = {}

    def __enter__(self) -> View:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds.clear()
        with contextlib.suppress(OSError):
            os.close(self.rootfd)

    # -- directories -------------------------------------------------------------------------

    def dir(self, key: str, create: bool = False) -> int | None:
        """The fd of ``<archive>/<key>`` (or ``.done``), or None: gone, or refused (a link, not a
        directory, another owner's: counted). ``create``: made (0700) when missing."""
        if key in self._fds and (self._fds[key] is not None or not create):
            return self._fds[key]
        fd: int | None = None
        try:
            if create:
                fd = archive_fs.make_dir(self.rootfd, key, self.owner)
            else:
                fd = archive_fs.open_dir(self.rootfd, key)
                try:
                    archive_fs.check_owned(fd, self.owner, key)
                except BaseException:
                    os.close(fd)
                    raise
        except FileNotFoundError:
            fd = None
        except Refused as e:
            self.refusals.note(key, e, self._ident(self.rootfd, key))
            if create:
                raise
        self._fds[key] = fd
        return fd

    def names(self, key: str) -> list[str]:
        """At most ARCHIVE_DIR_MAX names in the key's directory ([] when it cannot be read)."""
        if key not in self._names:
            fd = self.dir(key)
            try:
                self._names[key] = archive_fs.names(fd, ARCHIVE_DIR_MAX)[0] if fd is not None else []
            except OSError:
                self._names[key] = []
        return self._names[key]

    def forget(self, key: str) -> None:
        """What this view knows of the key's directory is stale (this agent changed it)."""
        self._names.pop(key, None)

    # -- records ------------------------------------------------------------------------------

    def read(self, key: str, name: str) -> Sealed | None:
        """The record ``name`` of the key's directory once it verifies, else None (gone; refused:
        counted once)."""
        fd = self.dir(key)
        return None if fd is None else self._read(fd, key, name, f"{key}/{name}")

    def done(self, key: str) -> Sealed | None:
        """The verified ``.done/<key>`` marker, or None."""
        if not _SAFE_KEY.match(key):
            return None
        fd = self.dir(DONE_DIR)
        return None if fd is None else self._read(fd, None, key, f"{DONE_DIR}/{key}")

    def _read(self, fd: int, key: str | None, name: str, where: str) -> Sealed | None:
        ident = self._ident(fd, name, where)
        if ident is None or self.refusals.known(ident):
            return None
        try:
            raw = archive_fs.read_small(fd, name)
            try:
                env = json.loads(raw)
            except RecursionError:
                raise Refused("bad_json", "nested too deep") from None
            except ValueError as e:  # (UnicodeDecodeError too)
                raise Refused("bad_json", str(e)[:120]) from None
            body = self.auth.open_obj(env, name=name, dir_key=key)
        except FileNotFoundError:
            return None
        except Refused as e:
            self.refusals.note(where, e, ident)
            return None
        return Sealed(body, env, name)

    def _ident(self, fd: int, name: str, where: str | None = None) -> tuple[Any, ...] | None:
        try:
            st = archive_fs.lstat_at(fd, name)
        except OSError:
            return None
        return (where or name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def claims(self, key: str) -> list[Sealed]:
        """The verified claims in the key's directory: ``claimed-<n>.json`` (the record a node
        took, as it was) and ``running-<n>.json`` (a run record of node n), by name."""
        return [s for n in self.names(key) if _NODE_FILE.fullmatch(n) and (s := self.read(key, n)) is not None]

    def runs(self, key: str) -> list[Sealed]:
        """The verified running records in the key's directory (each its writer's, by its name)."""
        return [s for s in self.claims(key) if s.name.startswith("running-")]

    def claimable(self, key: str, name: str, counted: bool = True) -> Sealed | None:
        """The key's ``guard.json`` or ``live.json`` when it may be claimed: it verifies, is
        younger than RECORD_MAX_AGE_S, no verified claim of the key sits beside it and the key
        has no verified ``.done`` marker (else a copy of a record claimed before: ``replayed``)."""
        if name not in self.names(key):
            return None
        s = self.read(key, name)
        if s is None:
            return None
        where = f"{key}/{name}"
        ident = self._ident(self.dir(key) or self.rootfd, name, where)
        try:
            check_fresh(s.body, self.now)
            nonce = s.body["nonce"]
            claims = self.claims(key)
            if any(c.owner.get("nonce") == nonce for c in claims):
                raise Refused("replayed", f"a claim of this very record ({nonce}) is beside it")
            if claims:
                return None  # taken: a claim (of an older record of the key) is the lock
            if self.done(key) is not None:
                raise Refused("replayed", f"{DONE_DIR}/{key} says the key's claimed job ended or was superseded")
        except Refused as e:
            if counted:
                self.refusals.note(where, e, ident)
            return None
        return s


def _open_existing_root(root: Path, owner: int) -> int:
    """:func:`archive_fs.open_root` without making a missing root (FileNotFoundError)."""
    if not os.path.lexists(root):
        raise FileNotFoundError(str(root))
    return archive_fs.open_root(root, owner)
