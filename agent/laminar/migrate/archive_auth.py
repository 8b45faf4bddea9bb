"""Authenticated archive records: ``migrate.archive_dir`` is shared storage, and nothing read
from it is trusted until it verifies (docs/migration.md, *Who may write the archive*).

Every record the agents write there is an **envelope**, one JSON object::

    {"v": 1, "body": {...}, "zmac": "<64 hex>", "nmac": {"<node>": "<32 hex>", ...}}

A reader acts on ``body`` alone, and only once the envelope verifies:

* ``zmac`` (always): HMAC-SHA256 of ``laminar-archive-v1 \\0 <canonical body>`` under a key
  derived (HKDF-SHA256, :func:`archive_key`) from the zone key of the body's ``zone``. The writer
  uses its zone's current key; a reader tries each key the zone accepts (current, next,
  previous: :meth:`laminar.zone.keys.ZoneKeys.accepted`), so a key rotation leaves records
  written before it readable as long as the old key stays ``previous``. Someone who can write the
  share but holds no zone key (a user, another host, an agent of another zone) cannot make a
  record any agent accepts.
* ``nmac`` (when the writer has a node key: ``[zone] node_key_file``): for each roster node R with
  a pubkey (the writer included), the first 16 bytes of the same MAC under a key derived from the
  pair key of the writer and R (:meth:`laminar.zone.keys.PairKeys.key`). Only the writer and R can
  make R's entry, so R knows who wrote the record: the zone key alone no longer lets one member
  write as another. A reader whose ``node_keys = require`` covers the writer requires its entry
  (refused ``not_for_me`` without one: a node added to the roster after the record was written
  cannot verify it until its writer writes it again); in ``accept``/``send`` a record without one
  is taken on its zone MAC. 16 bytes a node: about 45 bytes of JSON per roster node with a
  pubkey (11 KiB for 256), against the 1 MiB a record may hold (:data:`RECORD_MAX_BYTES`).

**What a body says, and who may say it** (:func:`check_body`): every field a reader acts on is
in the body, and checked before anything is done with it.

* ``keeper`` and ``live`` (a stopped job's claimable record; a running job's periodic one): the
  job's ``key``, which must be ``n<src_node>-<src_job>`` and the name of its directory; the
  ``request`` (spec, ``owner_uid``/``owner_gid`` as integers: a missing uid is refused, never
  read as root; ``gpus``); ``ckpt`` (``ckpt-<n>``: a name in the key's directory, never a path);
  ``manifest_sha256``, ``bytes`` and ``files`` of that checkpoint (its payload is checked against
  the manifest whose digest this is, never against the manifest beside it alone); ``nonce``;
  ``ts``. Its writer must be ``src_node``: a job's node signs its records, also the one its keeper
  publishes when it finds no room (the node presigns it when it hands the keeper over:
  :data:`PRESIGNED`, carried in the keeper's request).
* ``claim`` (``claimed-<node>.json``: a node's claim, taken by renaming the record, then noted):
  the record it took (verified as the file it was), the name it took it from, when (``ts``: a
  claim older than ARCHIVE_CLAIM_STALE_S whose node never ran the job is taken over; a file's
  mtime is anyone's to set); its writer is the node its file name gives.
* ``run`` (``running-<node>.json``: a claim whose node started the job): the claimed owner
  record (verified the same way), where the job now runs (``resumed``); its writer is the node
  its file name gives.
* ``done`` (``.done/<key>``: a claimed job that ended or was superseded): the runner, why, when.

Refusals raise :class:`Refused` with one of :data:`REASONS` (counted as
``migrate.counts.archive_unverified_<reason>``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import struct
from collections.abc import Callable, Mapping
from typing import Any

from laminar.migrate.constants import _CKPT_NAME, _SAFE_KEY

ENVELOPE_V = 1
LABEL = b"laminar-archive-v1"
RECORD_MAX_BYTES = 1 << 20  # a record (envelope) read from the archive: larger is refused unread
NMAC_BYTES = 16  # a node MAC entry: HMAC-SHA256 truncated to 128 bits (as RFC 4868 does)
# A claimable record older than this is refused (``expired``): the ``.done`` marker that refuses a
# replayed copy of a claimed record is kept at least as long (ARCHIVE_DONE_KEEP_S), so a copy
# taken before the claim can never be claimed again after its marker went. A day less, for
# clocks that disagree.
RECORD_MAX_AGE_S = 29 * 86400.0
CKPT_MAX_FILES = 4096  # a checkpoint's files (a signed manifest listing more is refused before any copy)
UID_MAX = 2**32 - 2  # (uid_t; -1 is "no change" to the kernel)
GPUS_MAX = 4096
NODE_MAX = 2**32 - 1
# The keeper's request carries its job node's presigned keeper record under this name
# (:meth:`ReclaimComponent._presign`): the record the keeper publishes when it finds no room.
PRESIGNED = "archive_record"

KINDS = ("guard", "live", "run", "claim", "done")
OWNER_KINDS = ("guard", "live")
DONE_WHYS = ("ended there", "ended", "superseded")
# Why a file in the archive was refused (migrate.counts.archive_unverified_<reason>).
REASONS = (
    "link",            # a key directory, .done or .gc that is a symbolic link
    "not_dir",         # a key directory that is not a directory
    "foreign_owner",   # a key directory not owned by the archive's owner (archive_uid), or writable by others
    "not_regular",     # a record that is a FIFO, device, directory or link
    "too_large",       # a record over RECORD_MAX_BYTES
    "unreadable",      # a record the storage refused to read (EIO, EACCES)
    "bad_json",        # not JSON (or nested too deep)
    "no_envelope",     # JSON, but not an envelope: a record from before authentication, or a forgery
    "bad_schema",      # a field missing, of the wrong type, or out of range
    "unknown_key",     # this node holds no key for the body's zone
    "not_member",      # the writer is not a roster member of that zone
    "bad_mac",         # the zone MAC does not verify under any of the zone's keys
    "not_for_me",      # node keys required, and the record has no node MAC for this node
    "bad_nmac",        # this node's node MAC does not verify
    "not_owner",       # the writer may not speak for the job (not its node; a run record of another node)
    "key_mismatch",    # the body's key is not its directory's (or its marker's) name
    "bad_ckpt",        # the checkpoint is not a ckpt-<n> name, or not a real directory of regular files
    "manifest_mismatch",  # the checkpoint's manifest or files are not what the record signed
    "too_big_ckpt",    # the signed checkpoint does not fit (file count, or local free space)
    "replayed",        # a claimable record beside a claim of it, or of a key that is done
    "expired",         # a claimable record older than RECORD_MAX_AGE_S
)
_KEY = re.compile(r"n(\d{1,10})-(.+)")


class Refused(Exception):
    """A record (or a file the archive holds) that is not acted on: ``reason`` one of
    :data:`REASONS`, ``detail`` what was found."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def canonical(body: Any) -> bytes:
    """The bytes a MAC covers: sorted keys, no spaces, ASCII. ValueError for NaN/inf."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def archive_key(zone_key: bytes, zone: int) -> bytes:
    """The archive's MAC key of ``zone`` under ``zone_key``: HKDF-SHA256 (RFC 5869, one block)
    with the zone id as salt and :data:`LABEL` as info, so an archive MAC is never a datagram's."""
    prk = hmac.digest(struct.pack("!H", zone & 0xFFFF), bytes(zone_key), "sha256")
    return hmac.digest(prk, LABEL + b"\x01", "sha256")


def _pair_archive_key(pair_key: bytes) -> bytes:
    return hmac.digest(pair_key, LABEL + b" pair", "sha256")


def _msg(body: Mapping[str, Any]) -> bytes:
    return LABEL + b"\0" + canonical(body)


def manifest_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(16)


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_time(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _hex(v: Any, n: int) -> bool:
    return isinstance(v, str) and len(v) == n and all(c in "0123456789abcdef" for c in v)


def check_request(req: Any) -> dict[str, Any]:
    """The request a keeper or live record carries, checked: ``spec`` a valid job spec, integer
    ``owner_uid``/``owner_gid`` (never defaulted: a missing uid is not root), ``gpus`` an
    integer. Refused ``bad_schema`` naming the field."""
    from laminar.runtime.spec import JobError, JobSpec

    if not isinstance(req, dict):
        raise Refused("bad_schema", f"request {type(req).__name__}: expected an object")
    for f in ("owner_uid", "owner_gid"):
        if not _is_int(req.get(f), 0, UID_MAX):
            raise Refused("bad_schema", f"request {f} {req.get(f)!r}: expected an integer 0..{UID_MAX}")
    if not _is_int(req.get("gpus"), 0, GPUS_MAX):
        raise Refused("bad_schema", f"request gpus {req.get('gpus')!r}: expected an integer 0..{GPUS_MAX}")
    spec = req.get("spec")
    if not isinstance(spec, dict) or "gpus" in spec:
        raise Refused("bad_schema", "request spec: expected an object without gpus")
    try:
        JobSpec.from_dict(spec)
    except (JobError, TypeError, ValueError) as e:
        raise Refused("bad_schema", f"request spec: {e}") from None
    return req


def owner_request(req: Mapping[str, Any]) -> dict[str, Any]:
    """What of a keeper's request an archived record carries (and its node signs): the spec,
    its owner and GPUs; not a keeper's own notes (take_over, window_end, placement, ...)."""
    return {"spec": req["spec"], "owner_uid": req["owner_uid"], "owner_gid": req["owner_gid"], "gpus": req["gpus"]}


def check_body(body: Any, *, name: str, dir_key: str | None) -> dict[str, Any]:
    """``body`` (a verified envelope's) checked as the file ``name`` of the key directory
    ``dir_key`` (None: a ``.done`` marker named ``name``, or a record embedded in a run record)
    holds it: the kind the name allows, every field's type and range, the owner rule, the key.
    Raises :class:`Refused`."""
    if not isinstance(body, dict):
        raise Refused("bad_schema", "body: expected an object")
    kind = body.get("kind")
    if kind not in KINDS:
        raise Refused("bad_schema", f"kind {kind!r}: expected one of {', '.join(KINDS)}")
    key, writer = body.get("key"), body.get("writer")
    if not isinstance(key, str) or not _SAFE_KEY.match(key):
        raise Refused("bad_schema", f"key {key!r}: expected a job key")
    if not _is_int(writer, 0, NODE_MAX) or not _is_int(body.get("zone"), 0, 0xFFFF):
        raise Refused("bad_schema", f"writer {writer!r} / zone {body.get('zone')!r}: expected integers")
    if dir_key is not None and key != dir_key:
        raise Refused("key_mismatch", f"the record is of {key!r}, found in {dir_key!r}")
    allowed: tuple[str, ...] | None = {"guard.json": ("guard",), "live.json": ("live",)}.get(name)
    if name.startswith("claimed-"):
        allowed = ("guard", "live", "run", "claim")  # a claim: its node's note of it, or the record it took, as it was
    elif name.startswith("running-"):
        allowed = ("run",)
    elif dir_key is None:
        allowed = ("done",) if name == key else OWNER_KINDS
    if allowed is None or kind not in allowed:
        raise Refused("bad_schema", f"a {kind} record named {name!r}")
    if kind in OWNER_KINDS:
        return _check_owner(body)
    if kind == "claim":
        frm = body.get("from")
        if not isinstance(body.get("taken"), dict) or not isinstance(frm, str) or not _is_time(body.get("ts")) \
                or not (frm in ("guard.json", "live.json") or re.fullmatch(r"running-\d{1,10}\.json", frm)):
            raise Refused("bad_schema", "a claim needs ts, the record it took and the name it took it from")
        # (under another node's name: a claim that node took over, by rename, and has not noted yet)
        return body
    if kind == "run":
        res = body.get("resumed")
        if res is not None and not (isinstance(res, dict) and _is_int(res.get("node"), 0, NODE_MAX)
                                    and isinstance(res.get("job"), str) and _SAFE_KEY.match(res["job"])):
            raise Refused("bad_schema", f"resumed {res!r}: expected {{node, job}} or null")
        if not _is_time(body.get("ts")) or not isinstance(body.get("record"), dict):
            raise Refused("bad_schema", "a run record needs ts and the claimed record")
        if name.startswith("running-") and name != f"running-{writer}.json":
            raise Refused("not_owner", f"{name} written by node {writer}")
        return body
    # done
    if dir_key is None and name != key:
        raise Refused("key_mismatch", f"the marker of {key!r} named {name!r}")
    if not _is_int(body.get("runner"), 0, NODE_MAX) or body.get("why") not in DONE_WHYS or not _is_time(body.get("at")):
        raise Refused("bad_schema", "a done marker needs runner (a node), why and at")
    return body


def _check_owner(body: dict[str, Any]) -> dict[str, Any]:
    src, job = body.get("src_node"), body.get("src_job")
    if not _is_int(src, 0, NODE_MAX) or not isinstance(job, str) or not _SAFE_KEY.match(job):
        raise Refused("bad_schema", f"src_node {src!r} / src_job {job!r}")
    m = _KEY.fullmatch(body["key"])
    if m is None or int(m[1]) != src or m[2] != job:
        raise Refused("not_owner", f"key {body['key']!r} is not n{src}-{job}")
    if body["writer"] != src:
        raise Refused("not_owner", f"node {body['writer']} wrote a record of node {src}'s job {body['key']}")
    ckpt = body.get("ckpt")
    if not isinstance(ckpt, str) or not _CKPT_NAME.match(ckpt) or len(ckpt) > 30:
        raise Refused("bad_ckpt", f"ckpt {ckpt!r}: expected ckpt-<n>, a name in the key's directory")
    if not _hex(body.get("manifest_sha256"), 64) or not _hex(body.get("nonce"), 32):
        raise Refused("bad_schema", "manifest_sha256 (64 hex) and nonce (32 hex) are needed")
    if not _is_int(body.get("files"), 1, CKPT_MAX_FILES) or not _is_int(body.get("bytes"), 0, 2**53):
        raise Refused("too_big_ckpt" if _is_int(body.get("files"), 0, 2**53) else "bad_schema",
                      f"files {body.get('files')!r} (at most {CKPT_MAX_FILES}), bytes {body.get('bytes')!r}")
    if not _is_time(body.get("ts")):
        raise Refused("bad_schema", f"ts {body.get('ts')!r}")
    if body["kind"] == "live" and not (body.get("buddy") is None or _is_int(body.get("buddy"), 0, NODE_MAX)):
        raise Refused("bad_schema", f"buddy {body.get('buddy')!r}: expected a node or null")
    if not isinstance(body.get("resumed_copy", False), bool):
        raise Refused("bad_schema", "resumed_copy: expected true or false")
    check_request(body.get("request"))
    return body


def check_fresh(body: Mapping[str, Any], now: float) -> None:
    """Refuses (``expired``) a claimable record older than RECORD_MAX_AGE_S: a copy of it kept
    past its ``.done`` marker's life would otherwise be claimed again."""
    if now - float(body["ts"]) > RECORD_MAX_AGE_S:
        raise Refused("expired", f"written {(now - float(body['ts'])) / 86400:.1f} days ago")


class ArchiveAuth:
    """One node's view of archive authentication: what it signs with (its node id, its zone,
    the zone's keys, its pair keys) and what it accepts. Built from the zone component for each
    use (:meth:`of`), so a key reload applies at once."""

    def __init__(self, node: int, zone: int, keys: Any, pairs: Any = None,
                 zone_of: Callable[[int], int | None] | None = None) -> None:
        self.node = int(node)
        self.zone = int(zone)
        self.keys = keys
        self.pairs = pairs
        self.zone_of = zone_of

    @classmethod
    def of(cls, z: Any) -> ArchiveAuth | None:
        """From a zone component (``node_id``, ``zone``, ``keys``, ``pairs``, ``membership``), or
        None when it holds no keys (nothing in the archive can be signed or verified)."""
        keys = getattr(z, "keys", None)
        if z is None or keys is None:
            return None
        members = getattr(getattr(z, "membership", None), "by_node", None)

        def zone_of(n: int) -> int | None:
            m = members.get(n) if members is not None else None
            return int(m.zone) if m is not None else None
        return cls(int(z.node_id), int(getattr(z, "zone", 0) or 0), keys, getattr(z, "pairs", None),
                   zone_of if members is not None else None)

    @property
    def mode(self) -> str:
        """``node`` when this node signs with node MACs too (it has a node key), else ``zone``."""
        return "node" if self.pairs is not None else "zone"

    def seal(self, body: Mapping[str, Any]) -> bytes:
        """The envelope of ``body`` (``zone`` and ``writer`` set to this node's), as file bytes."""
        b = {**body, "zone": self.zone, "writer": self.node}
        zk = self.keys.get(self.zone)
        if zk is None:
            raise Refused("unknown_key", f"this node holds no key for its zone {self.zone}")
        msg = _msg(b)
        env: dict[str, Any] = {"v": ENVELOPE_V, "body": b,
                               "zmac": hmac.digest(archive_key(bytes(zk), self.zone), msg, "sha256").hex()}
        if self.pairs is not None:
            env["nmac"] = {str(r): hmac.digest(_pair_archive_key(self.pairs.key(bytes(zk), r)), msg,
                                               "sha256")[:NMAC_BYTES].hex()
                           for r in sorted(self.pairs.shared)}
        return canonical(env)

    def open(self, raw: bytes, *, name: str, dir_key: str | None) -> dict[str, Any]:
        """The body of the envelope ``raw`` (a file's bytes) once it verifies and its body
        passes :func:`check_body` as ``name`` in ``dir_key``. Raises :class:`Refused`."""
        try:
            env = json.loads(raw)
        except RecursionError:
            raise Refused("bad_json", "nested too deep") from None
        except ValueError as e:  # (UnicodeDecodeError too)
            raise Refused("bad_json", str(e)[:120]) from None
        return self.open_obj(env, name=name, dir_key=dir_key)

    def open_obj(self, env: Any, *, name: str, dir_key: str | None) -> dict[str, Any]:
        """:meth:`open` of an already parsed envelope (one embedded in a run record)."""
        if not isinstance(env, dict) or "body" not in env or "zmac" not in env:
            raise Refused("no_envelope", "a JSON record without body and zmac (from before authentication, or forged)")
        if set(env) - {"v", "body", "zmac", "nmac"} or env.get("v") != ENVELOPE_V:
            raise Refused("bad_schema", f"envelope fields {sorted(env)} / v {env.get('v')!r}")
        body, nmac = env["body"], env.get("nmac")
        if not isinstance(body, dict) or not _hex(env["zmac"], 64):
            raise Refused("bad_schema", "body must be an object and zmac 64 hex digits")
        if nmac is not None and not (isinstance(nmac, dict) and all(_hex(v, 2 * NMAC_BYTES) for v in nmac.values())):
            raise Refused("bad_schema", "nmac: expected {node: 32 hex digits}")
        if not _is_int(body.get("zone"), 0, 0xFFFF) or not _is_int(body.get("writer"), 0, NODE_MAX):
            raise Refused("bad_schema", f"zone {body.get('zone')!r} / writer {body.get('writer')!r}: expected integers")
        zone, writer = int(body["zone"]), int(body["writer"])
        accepted = self._accepted(zone)
        if not accepted:
            raise Refused("unknown_key", f"this node holds no key for zone {zone}")
        if self.zone_of is not None and self.zone_of(writer) != zone:
            raise Refused("not_member", f"node {writer} is not a member of zone {zone} in this node's roster")
        try:
            msg = _msg(body)
        except ValueError:
            raise Refused("bad_schema", "body holds a value JSON cannot carry") from None
        good = next((k for k in accepted
                     if hmac.compare_digest(hmac.digest(archive_key(k, zone), msg, "sha256").hex(), env["zmac"])), None)
        if good is None:
            raise Refused("bad_mac", f"the zone MAC does not verify under zone {zone}'s keys")
        self._check_nmac(writer, msg, nmac, accepted)
        checked = check_body(body, name=name, dir_key=dir_key)
        if checked["kind"] == "claim":  # what it took, verified as the file it was
            inner = self.open_obj(checked["taken"], name=checked["from"], dir_key=dir_key)
            if inner["key"] != checked["key"]:
                raise Refused("key_mismatch", f"a claim of {checked['key']!r} holds a record of {inner['key']!r}")
        if checked["kind"] == "run":  # the record it claimed: its owner's, verified as such
            self.open_obj(checked["record"], name="claimed", dir_key=None)
            inner = checked["record"]["body"]
            if inner.get("key") != checked["key"] or inner.get("kind") not in OWNER_KINDS:
                raise Refused("key_mismatch", f"a run record of {checked['key']!r} holds a record of {inner.get('key')!r}")
        return checked

    def _accepted(self, zone: int) -> tuple[bytes, ...]:
        """Every key ``zone`` accepts, current first (a plain mapping of zone -> key: that one)."""
        if hasattr(self.keys, "accepted"):
            return tuple(bytes(k) for _, k in self.keys.accepted(zone))
        k = self.keys.get(zone)
        return () if k is None else tuple(bytes(x) for x in getattr(k, "accepted", (k,)))

    def _check_nmac(self, writer: int, msg: bytes, nmac: dict[str, str] | None, accepted: tuple[bytes, ...]) -> None:
        pairs = self.pairs
        if pairs is None or not pairs.covers(writer):
            return  # no node key here, or none for the writer in the roster: the zone MAC is the word
        mine = (nmac or {}).get(str(self.node))
        if mine is None:
            if pairs.only(writer):
                raise Refused("not_for_me", f"node {writer}'s record has no node MAC for node {self.node} "
                              "(node_keys = require)")
            return
        for zk in accepted:
            want = hmac.digest(_pair_archive_key(pairs.key(zk, writer)), msg, "sha256")[:NMAC_BYTES].hex()
            if hmac.compare_digest(want, mine):
                return
        raise Refused("bad_nmac", f"node {writer}'s node MAC for node {self.node} does not verify")


def owner_body(kind: str, record: Mapping[str, Any], ckpt: str, manifest_sha256: str, nbytes: int, files: int,
               now: float) -> dict[str, Any]:
    """The body of a keeper or live record of ``record`` (the callers' ``{key, src_node,
    src_job, request, keeper?, resumed_copy?}``) naming the archived checkpoint ``ckpt``."""
    body: dict[str, Any] = {"kind": kind, "key": str(record["key"]), "src_node": int(record["src_node"]),
                            "src_job": str(record["src_job"]), "request": owner_request(record["request"]),
                            "ckpt": ckpt, "manifest_sha256": manifest_sha256, "bytes": int(nbytes),
                            "files": int(files), "nonce": new_nonce(), "ts": now}
    if kind == "live":
        keeper = record.get("buddy")
        body["buddy"] = None if keeper is None else int(keeper)
        body["resumed_copy"] = bool(record.get("resumed_copy"))
    return body
