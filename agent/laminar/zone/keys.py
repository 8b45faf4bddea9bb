"""Per-zone keys for authenticating zone datagrams and job hand-overs.

The key file is plain text, one key a line, ``<zone id> <key in hex>``; ``*`` in place of a
zone id gives a key for every zone not named. Blank lines and ``#`` comments are ignored::

    # /etc/laminar/zone.keys  (owner root, mode 0600)
    1  6f1c…64 hex digits or more…
    2  a9d0…
    *  0b7e…

Each key must hold at least :data:`MIN_KEY_BYTES` bytes (64 hex digits). The file must be a
regular file owned by root (or by the user running the agent) and readable by its owner
only: a group- or other-readable key is refused, because anyone who reads it can forge
placements. Make one with::

    umask 077; printf '* %s\\n' "$(openssl rand -hex 32)" > /etc/laminar/zone.keys

The one-node default needs no file: :func:`ephemeral_keys` makes a random in-memory key.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MIN_KEY_BYTES = 32
ANY_ZONE = -1


class KeyFileError(Exception):
    """The key file is missing, unsafe or malformed; the message says what and how to fix it."""


@dataclass(frozen=True)
class ZoneKeys:
    """Keys by zone id; :data:`ANY_ZONE` holds the wildcard key, if any."""

    keys: Mapping[int, bytes]
    source: str

    def get(self, zone: int) -> bytes | None:
        """The key authenticating traffic of ``zone``, or None if this node holds none."""
        k = self.keys.get(zone)
        return k if k is not None else self.keys.get(ANY_ZONE)

    def zones(self) -> list[int]:
        return sorted(z for z in self.keys if z != ANY_ZONE)


def ephemeral_keys() -> ZoneKeys:
    """A random wildcard key held in memory only: the one-node zone, which talks to no one."""
    return ZoneKeys({ANY_ZONE: secrets.token_bytes(MIN_KEY_BYTES)}, "ephemeral (one-node zone)")


def check_file_safe(path: Path) -> None:
    """Raise :class:`KeyFileError` unless ``path`` is a regular file owned by root or by us and
    neither group- nor other-readable (or writable)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise KeyFileError(
            f"zone keys: {path} does not exist; create it (mode 0600, one line '<zone> <64+ hex digits>') "
            "or configure zone.keys_file"
        ) from None
    except PermissionError as e:
        raise KeyFileError(f"zone keys: cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"zone keys: {path} is not a regular file")
    if st.st_uid not in (0, os.geteuid()):
        raise KeyFileError(f"zone keys: {path} is owned by uid {st.st_uid}; it must be owned by root")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"zone keys: {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be readable by its owner only "
            f"(chmod 600 {path})"
        )


def parse_keys(text: str, source: str = "<string>") -> ZoneKeys:
    """Parse key-file text (see the module docstring). Raises :class:`KeyFileError` naming the
    line for a bad zone id, bad hex, a short key or a zone given twice; and for no key at all."""
    keys: dict[int, bytes] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileError(f"zone keys: {source}:{lineno}: expected '<zone id> <hex key>', got {len(parts)} fields")
        zs, hx = parts
        if zs == "*":
            zone = ANY_ZONE
        else:
            try:
                zone = int(zs)
            except ValueError:
                raise KeyFileError(f"zone keys: {source}:{lineno}: zone id {zs!r} is not an integer or '*'") from None
            if not 0 <= zone < 2**16:
                raise KeyFileError(f"zone keys: {source}:{lineno}: zone id {zone} out of range 0..65535")
        try:
            key = bytes.fromhex(hx)
        except ValueError:
            raise KeyFileError(f"zone keys: {source}:{lineno}: key for zone {zs} is not hex") from None
        if len(key) < MIN_KEY_BYTES:
            raise KeyFileError(
                f"zone keys: {source}:{lineno}: key for zone {zs} has {len(key)} bytes, at least {MIN_KEY_BYTES} "
                f"are needed (openssl rand -hex {MIN_KEY_BYTES})"
            )
        if zone in keys:
            raise KeyFileError(f"zone keys: {source}:{lineno}: zone {zs} given twice")
        keys[zone] = key
    if not keys:
        raise KeyFileError(f"zone keys: {source} holds no key")
    return ZoneKeys(keys, source)


def load_keys(path: str | os.PathLike[str], need_zones: list[int] | None = None) -> ZoneKeys:
    """Load and check the key file at ``path``; with ``need_zones``, also require a key for
    each of them. Raises :class:`KeyFileError` with a message an operator can act on."""
    p = Path(path)
    check_file_safe(p)
    keys = parse_keys(p.read_text(), str(p))
    for z in need_zones or ():
        if keys.get(z) is None:
            raise KeyFileError(f"zone keys: {p} holds no key for zone {z} (add a line '{z} <hex key>' or '* <hex key>')")
    return keys
