"""What a :class:`laminar.migrate.transfer.receive.Receiver` committed
(``<root>/checkpoints/<job>/<ckpt>/``, with a ``VERIFIED`` marker and the transfer's record
``TRANSFER.json``), and whether a committed copy still verifies (:func:`verified_checkpoint`,
:func:`latest_verified`): what the agent checks right before it resumes a job from one."""

from __future__ import annotations

import json
import math
import os
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar import jobkit
from laminar.migrate.transfer.errors import TransferError
from laminar.migrate.transfer.manifest import TRANSFER_MANIFEST, VERIFIED, Manifest

# A committed copy whose files keep the identity recorded at its commit (inode, size, mtime, ctime:
# any write, truncation, replacement or link moves one) is not hashed again this long after it:
# the move's hand-over checks it seconds after the commit hashed it, and a second full read
# there is downtime (1.1 s per GiB here). Older copies (a keeper's replica, kept for days) are
# hashed again: the disk may have rotted them. jobkit hashes once more in the job at resume.
TRUST_UNCHANGED_S = 600.0


@dataclass(frozen=True)
class Committed:
    job_id: str
    ckpt_id: str
    path: Path
    digest: str
    peer_node: str


def _identity(st: os.stat_result) -> list[int]:
    """What a write, a truncation, a replacement or a new link of a file changes."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def verified_checkpoint(path: str | os.PathLike[str], now: float | None = None) -> Path:
    """``path`` if it is a committed transfer whose files still match (VERIFIED marker, the
    transfer manifest's digest, every file's SHA-256); raises TransferError otherwise. The
    agent calls this right before setting LAMINAR_RESUME_FROM. A file still holding the identity
    recorded at the commit (:data:`TRUST_UNCHANGED_S` at most after it, by ``now``, wall clock)
    is not hashed again: it has not been written, truncated, replaced or linked since it was
    hashed; any other is."""
    p = Path(path)
    try:
        meta = json.loads((p / TRANSFER_MANIFEST).read_text())
        marker = (p / VERIFIED).read_text().strip()
    except (OSError, json.JSONDecodeError) as e:
        raise TransferError(f"transfer: {p} is not a committed checkpoint: {e}") from None
    if not isinstance(meta, dict):
        raise TransferError(f"transfer: {p}: {TRANSFER_MANIFEST} is not a transfer record")
    m = Manifest.from_body(meta.get("body"))
    if m.digest != meta.get("digest") or marker != m.digest:
        raise TransferError(f"transfer: {p}: manifest digest does not match its VERIFIED marker")
    committed = meta.get("committed")
    age = math.inf
    if isinstance(committed, (int, float)) and not isinstance(committed, bool):
        age = (time.time() if now is None else now) - committed
    recorded = meta.get("ids")
    ids: dict[str, Any] = recorded if 0 <= age < TRUST_UNCHANGED_S and isinstance(recorded, dict) else {}
    for name, size, sha in m.files:
        f = p / name
        try:
            st = f.lstat()
            same = stat.S_ISREG(st.st_mode) and st.st_size == size and (
                ids.get(name) == _identity(st) or jobkit.file_sha256(f) == sha)  # a link or pipe: OSError
        except OSError:
            same = False
        if not same:
            raise TransferError(f"transfer: {p}: {name} changed since it was verified")
    return p


def sent_by(path: Path) -> str | None:
    """The node a committed checkpoint came from (its TRANSFER.json ``from_node``), None when unknown."""
    try:
        meta = json.loads((path / TRANSFER_MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    got = meta.get("from_node") if isinstance(meta, dict) else None
    return str(got) if got is not None else None


def latest_verified(root: str | os.PathLike[str], job_id: str,
                    senders: Collection[str] | None = None) -> Path | None:
    """The newest committed, still-valid checkpoint of ``job_id`` under a receiver's root;
    with ``senders``, only one those nodes sent (a copy another member pushed under the key is
    never resumed from: laminar.zone.authority.checkpoint_senders)."""
    d = Path(root) / "checkpoints" / job_id
    cands = sorted((p for p in d.glob("ckpt-*") if p.is_dir()), key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else -1)
    for p in reversed(cands):
        if senders is not None and sent_by(p) not in senders:
            continue
        try:
            return verified_checkpoint(p)
        except TransferError:
            continue
    return None
