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
(:meth:`laminar.zone.keyring.Keyring.reload_keys`); a bad file is refused whole and the
keys in use stay. Agents from before roles refuse a file with a third field: upgrade first.

The one-node default needs no file: :func:`ephemeral_keys` makes a random in-memory key.

**Node keys.** A node may have a static X25519 key pair of its own: the private key in a
root-only file (``[zone] node_key_file``, one line of 64 hex digits; checked as the zone key
file is; :func:`generate_node_key`, ``laminarctl zone keys node-gen --out PATH``), the public
key in its ``[[zone.nodes]]`` entry (``pubkey``, 64 hex digits: :func:`parse_pubkey`). For two
nodes that both have one, :class:`PairKeys` derives the MAC key of their traffic from the zone
key and their DH secret (:func:`pair_key`), so only those two can sign it; the zone key stays
the root of trust and its rotation applies to pair keys unchanged (``docs/protocol.md``,
*Node keys*)::

    >>> a, b = secrets.token_bytes(32), secrets.token_bytes(32)
    >>> pubs = {1: public_key(a), 2: public_key(b)}
    >>> zone_key = bytes(32)
    >>> PairKeys(1, a, pubs).key(zone_key, 2) == PairKeys(2, b, pubs).key(zone_key, 1)
    True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
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


def check_file_safe(path: Path, what: str = "zone keys",
                    create: str = "create it (mode 0600, one line '<zone> <64+ hex digits>') or configure zone.keys_file",
                    ) -> None:
    """Raise :class:`KeyFileError` unless ``path`` is a regular file owned by root or by us and
    neither group- nor other-readable (or writable). ``what`` starts each message (``zone keys``,
    ``node key``); ``create`` says how to make a missing file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise KeyFileError(f"{what}: {path} does not exist; {create}") from None
    except PermissionError as e:
        raise KeyFileError(f"{what}: cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{what}: {path} is not a regular file")
    if st.st_uid not in (0, os.geteuid()):
        raise KeyFileError(f"{what}: {path} is owned by uid {st.st_uid}; it must be owned by root")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"{what}: {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be readable by its owner only "
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


# --------------------------------------------------------------------------- node keys

PUBKEY_HEX = 64  # a roster pubkey: an X25519 public key, 32 bytes written as 64 hex digits
PAIR_LABEL = b"laminar-pair-v1"
DEFAULT_NODE_KEY_FILE = "/etc/laminar/node.key"
PAIR_CACHE_MAX = 1 << 18  # derived pair keys kept (peers x zone keys): a reload's old ones go with the rest
# ``[zone] node_keys``: how a node with a node key treats the peers whose pubkey the roster lists.
# "accept": signs with the zone key, takes a pair MAC or a zone-key MAC (a node not yet on the new
# roster still hears it and is heard); "send": signs with the pair key, takes either; "require"
# (the default): signs with the pair key and takes only a pair MAC. A zone rolls out node keys by
# restarting every node in each mode in turn (docs/operations.md, Node keys): two nodes one step
# apart (or one not restarted yet and one in accept) always take each other's traffic.
NODE_KEY_MODES = ("accept", "send", "require")
_NODE_KEY_CREATE = "create it with 'laminarctl zone keys node-gen --out PATH' or configure zone.node_key_file"


def parse_pubkey(value: object, where: str) -> bytes:
    """The 32 bytes of a roster ``pubkey`` (:data:`PUBKEY_HEX` hex digits, either case).
    Raises ValueError naming ``where`` (the roster entry) and the value."""
    ok = isinstance(value, str) and len(value) == PUBKEY_HEX
    try:
        raw = bytes.fromhex(value) if ok else b""  # type: ignore[arg-type]
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{where}: pubkey {value!r} is not a node public key: expected {PUBKEY_HEX} hex digits "
                         "(the line 'laminarctl zone keys node-gen' prints for the node)")
    return raw


def public_key(private: bytes) -> bytes:
    """The X25519 public key (32 bytes) of the private key ``private`` (32 bytes)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def node_key_text(private: bytes) -> str:
    """A node key file's text for ``private``: a comment with its public key, then the key."""
    return (f"# laminar node key (X25519, private: owner root, mode 0600)\n"
            f"# its roster line: pubkey = \"{public_key(private).hex()}\"\n{private.hex()}\n")


def parse_node_key(text: str, source: str = "<string>") -> bytes:
    """The private key (32 bytes) in a node key file's text: one line of 64 hex digits (blank
    lines and ``#`` comments ignored). Raises :class:`KeyFileError` naming the file."""
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    if len(lines) != 1:
        raise KeyFileError(f"node key: {source}: expected one line of {PUBKEY_HEX} hex digits (an X25519 private "
                           f"key), got {len(lines)} lines; make one with 'laminarctl zone keys node-gen --out {source}'")
    try:
        key = bytes.fromhex(lines[0])
    except ValueError:
        key = b""
    if len(key) != 32:
        raise KeyFileError(f"node key: {source}: the key is not {PUBKEY_HEX} hex digits (an X25519 private key); make "
                           f"one with 'laminarctl zone keys node-gen --out {source}'")
    return key


def load_node_key(path: str | os.PathLike[str]) -> bytes:
    """This node's private key from its file (root-only, as the zone keys: :func:`check_file_safe`).
    Raises :class:`KeyFileError` with a message an operator can act on."""
    p = Path(path)
    check_file_safe(p, "node key", _NODE_KEY_CREATE)
    return parse_node_key(p.read_text(), str(p))


def generate_node_key(path: str | os.PathLike[str]) -> bytes:
    """Write a new node key file at ``path`` (mode 0600, created: an existing file is never
    replaced) and return its public key. Raises :class:`KeyFileError` when the file exists or
    cannot be created."""
    private = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"node key: {path} exists already; a node's key changes together with its roster pubkey "
                           "(docs/operations.md, 'Node keys'): remove the file first, or write to another path") from None
    except OSError as e:
        raise KeyFileError(f"node key: cannot create {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(node_key_text(private))
    return public_key(private)


def pair_key(zone_key: bytes, shared: bytes, a: int, b: int) -> bytes:
    """The MAC key of the pair of nodes ``a`` and ``b`` under ``zone_key``: HMAC-SHA256(zone
    key, ``laminar-pair-v1`` | X25519(a, b) | u32 min(a, b) | u32 max(a, b)). The same for
    (a, b) and (b, a); the zone key stays the root of trust (a node key alone derives nothing)."""
    lo, hi = sorted((a, b))
    return hmac.digest(zone_key, PAIR_LABEL + shared + struct.pack("!II", lo, hi), "sha256")


class PairKeys:
    """This node's pair keys: its node id and private key, and the roster's public keys by node
    id (this node's included: it must be the private key's, else :class:`KeyFileError` naming
    both). A datagram between this node and a node that :meth:`covers` is signed with
    :meth:`key` (per zone key, derived once and cached), not with the zone key itself, as its
    ``mode`` (:data:`NODE_KEY_MODES`) says: :meth:`signs`, :meth:`only`.

    The X25519 exchange with every listed node runs here, once: a public key that yields no
    secret (a low-order point) is refused naming the node."""

    def __init__(self, node: int, private: bytes, pubkeys: Mapping[int, bytes], source: str = "node key",
                 mode: str = "require") -> None:
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

        if mode not in NODE_KEY_MODES:
            raise ValueError(f"zone.node_keys = {mode!r}: expected one of {', '.join(NODE_KEY_MODES)}")

        own = public_key(private)
        listed = pubkeys.get(node)
        if listed != own:
            raise KeyFileError(
                f"node key: zone.nodes lists node {node}'s pubkey as {listed.hex() if listed else 'nothing'}, but "
                f"{source} is the private key of pubkey {own.hex()}: put pubkey = \"{own.hex()}\" in node {node}'s "
                "[[zone.nodes]] entry on every node, or configure zone.node_key_file with the key that belongs to it")
        priv = X25519PrivateKey.from_private_bytes(private)
        self.node = node
        self.public = own
        self.source = source
        self.mode = mode
        self.shared: dict[int, bytes] = {}
        for n, pub in pubkeys.items():
            try:
                self.shared[n] = priv.exchange(X25519PublicKey.from_public_bytes(pub))
            except ValueError:
                raise KeyFileError(f"node key: node {n}'s pubkey {pub.hex()} in zone.nodes is not usable (an X25519 "
                                   "key of low order: no shared secret); generate that node's key again") from None
        self._cache: dict[tuple[bytes, int], bytes] = {}

    def covers(self, peer: int) -> bool:
        """True when this node and ``peer`` have a pair key (the roster lists its pubkey)."""
        return peer in self.shared

    def signs(self, peer: int) -> bool:
        """True when what goes to ``peer`` is signed with the pair key (it :meth:`covers` the peer
        and the mode is not ``accept``)."""
        return self.mode != "accept" and peer in self.shared

    def only(self, peer: int) -> bool:
        """True when ``peer``'s datagrams verify only under the pair key (``require``); else a
        zone-key MAC from it is taken too."""
        return self.mode == "require" and peer in self.shared

    def signing_key(self, zone_key: bytes, peer: int) -> bytes:
        """What goes to ``peer`` is signed with: the pair key when :meth:`signs`, else ``zone_key``."""
        return self.key(bytes(zone_key), peer) if self.signs(peer) else zone_key

    def accepted(self, zone_keys: tuple[bytes, ...], peer: int) -> tuple[bytes, ...]:
        """The keys what ``peer`` sends may verify under, in order: with a pair key, the pair key
        under each of ``zone_keys``, then (unless :meth:`only`) ``zone_keys`` themselves; else
        ``zone_keys``."""
        if peer not in self.shared:
            return zone_keys
        pk = tuple(self.key(bytes(k), peer) for k in zone_keys)
        return pk if self.only(peer) else pk + zone_keys

    def key(self, zone_key: bytes, peer: int) -> bytes:
        """The pair key of this node and ``peer`` (which :meth:`covers`) under ``zone_key``."""
        k = self._cache.get((zone_key, peer))
        if k is None:
            if len(self._cache) >= PAIR_CACHE_MAX:
                self._cache.clear()
            k = self._cache[(bytes(zone_key), peer)] = pair_key(zone_key, self.shared[peer], self.node, peer)
        return k
