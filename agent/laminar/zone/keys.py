"""Per-zone keys for authenticating zone datagrams and job hand-overs.

The key file is plain text, one key a line, ``<zone id> <key in hex> [role]``; ``*`` in place
of a zone id gives keys for every zone not named. Blank lines and ``#`` comments are
ignored::

    # /etc/laminar/zone.keys  (owner root, mode 0600)
    1  6f1c…64 hex digits or more…
    2  a9d0…
    *  0b7e…

Each key must hold at least :data:`MIN_KEY_BYTES` bytes (64 hex digits). The file must be a
regular file owned by root (or by the user running the agent) and readable by its owner
only: a group- or other-readable key is refused, because anyone who reads it can forge
placements. Make one with::

    umask 077; printf '* %s\\n' "$(openssl rand -hex 32)" > /etc/laminar/zone.keys

**Rotation.** The optional third field gives a key's *role*: ``current`` (the default: a line
of two fields is the current key, so a file from before roles means what it meant), ``next``
or ``previous``. A zone has exactly one current key and at most one next and one previous::

    1  a9d0…               # current: signs what this node sends to zone 1
    1  77e2…  next         # accepted from peers too (they may sign with it already)
    1  0b7e…  previous     # accepted from peers too (they may still sign with it)

A node signs with the current key of the receiver's zone and accepts a datagram signed with
any of the zone's keys (the current one is tried first: the hot path costs one MAC as before).
The operator's procedure, node by node at each step (``docs/operations.md``, "Rotating a zone
key"): add the new key as ``next`` everywhere, then make it ``current`` (the old one
``previous``) everywhere, then remove the old one. A zone named on its own lines takes none of
the ``*`` keys. An agent re-reads the file on SIGHUP or ``laminarctl zone keys reload``
(:meth:`laminar.zone.component.ZoneComponent.reload_keys`); a bad file is refused whole and the
keys in use stay. Agents from before roles refuse a file with a third field: upgrade first.

The one-node default needs no file: :func:`ephemeral_keys` makes a random in-memory key.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

MIN_KEY_BYTES = 32
ANY_ZONE = -1
ROLES = ("current", "next", "previous")  # the order a receiver tries a zone's keys in


class KeyFileError(Exception):
    """The key file is missing, unsafe or malformed; the message says what and how to fix it."""


class ZoneKey(bytes):
    """A zone's current key (it is the key's bytes) that knows the zone's other keys:
    ``accepted`` is every key the zone accepts, the current one first. Code that takes a key as
    bytes (the checkpoint transfer's key lookup) keeps working; code that accepts a proof under
    any of the zone's keys reads ``accepted`` (``getattr(key, "accepted", (key,))``)."""

    accepted: tuple[bytes, ...]


def fingerprint(key: bytes) -> str:
    """A short, non-secret name for a key (8 hex digits of a hash of it): what
    ``laminarctl zone keys`` shows, so two nodes' keys can be compared without showing them."""
    return hashlib.sha256(b"laminar-zone-key-id\0" + key).hexdigest()[:8]


@dataclass(frozen=True)
class ZoneKeys:
    """Keys by zone id; :data:`ANY_ZONE` holds the wildcard keys, if any.

    ``keys`` holds each zone's current key; ``others`` its ``next`` and ``previous`` keys, as
    ``(role, key)`` pairs in :data:`ROLES` order (none for a file without roles)."""

    keys: Mapping[int, bytes]
    source: str
    others: Mapping[int, tuple[tuple[str, bytes], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.others:
            cur = dict(self.keys)
            for z, extra in self.others.items():
                if extra and z in cur:
                    k = ZoneKey(cur[z])
                    k.accepted = (bytes(cur[z]), *(x for _, x in extra))
                    cur[z] = k
            object.__setattr__(self, "keys", cur)

    def get(self, zone: int) -> bytes | None:
        """The key signing traffic for ``zone`` (its current key), or None if this node holds
        none. A zone with other keys gets a :class:`ZoneKey` (``accepted`` lists them all)."""
        k = self.keys.get(zone)
        return k if k is not None else self.keys.get(ANY_ZONE)

    def entry(self, zone: int) -> int | None:
        """Which line group holds ``zone``'s keys: ``zone`` itself, :data:`ANY_ZONE`, or None."""
        if zone in self.keys:
            return zone
        return ANY_ZONE if ANY_ZONE in self.keys else None

    def accepted(self, zone: int) -> tuple[tuple[str, bytes], ...]:
        """Every ``(role, key)`` a datagram for ``zone`` may be signed with, current first;
        empty when this node holds no key for it."""
        e = self.entry(zone)
        if e is None:
            return ()
        return (("current", bytes(self.keys[e])), *self.others.get(e, ()))

    def zones(self) -> list[int]:
        return sorted(z for z in self.keys if z != ANY_ZONE)

    def describe(self) -> list[dict[str, object]]:
        """Every key as ``{zone, role, fingerprint}`` (zone ``"*"`` for the wildcard); no secret."""
        out: list[dict[str, object]] = []
        for z in sorted(self.keys):
            for role, k in self.accepted(z):
                out.append({"zone": "*" if z == ANY_ZONE else z, "role": role, "fingerprint": fingerprint(k)})
        return out


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
    line for a bad zone id, bad hex, a short key, an unknown role, a role given twice for a
    zone, one key listed twice for a zone, or a zone with a next or previous key but no current
    one; and for no key at all. Nothing of a refused file is used."""
    roles: dict[int, dict[str, bytes]] = {}
    first_line: dict[int, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise KeyFileError(f"zone keys: {source}:{lineno}: expected '<zone id> <hex key> [current|next|previous]', "
                               f"got {len(parts)} fields")
        zs, hx = parts[0], parts[1]
        role = parts[2] if len(parts) == 3 else "current"
        if role not in ROLES:
            raise KeyFileError(f"zone keys: {source}:{lineno}: expected a role ({', '.join(ROLES)}) as the third "
                               f"field for zone {zs}, got {role!r}")
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
        have = roles.setdefault(zone, {})
        first_line.setdefault(zone, lineno)
        if role in have:
            what = "given twice" if role == "current" else f"has two {role} keys"
            raise KeyFileError(f"zone keys: {source}:{lineno}: zone {zs} {what} (a zone has one current key and at "
                               "most one next and one previous)")
        if key in have.values():
            raise KeyFileError(f"zone keys: {source}:{lineno}: zone {zs}: this {role} key is listed already for it "
                               "under another role")
        have[role] = key
    if not roles:
        raise KeyFileError(f"zone keys: {source} holds no key")
    for zone, have in roles.items():
        if "current" not in have:
            zs = "*" if zone == ANY_ZONE else str(zone)
            raise KeyFileError(f"zone keys: {source}:{first_line[zone]}: zone {zs} has no current key (a line "
                               f"'{zs} <hex key>' without a role); it lists only {' and '.join(sorted(have))}")
    keys = {z: h["current"] for z, h in roles.items()}
    others = {z: tuple((r, h[r]) for r in ROLES[1:] if r in h) for z, h in roles.items()}
    return ZoneKeys(keys, source, {z: o for z, o in others.items() if o})


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
