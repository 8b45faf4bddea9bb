"""Agent-to-agent checkpoint transfer over TCP: chunked, checksummed, resumable, authenticated,
encrypted.

A checkpoint is a directory written by :mod:`laminar.jobkit` (``ckpt-<step>/`` with
``MANIFEST.json``). The source agent sends it to the destination agent's transfer endpoint;
the destination commits it under ``<root>/checkpoints/<job>/<ckpt>/`` only after verifying all
of it, and only a committed checkpoint is ever handed to ``LAMINAR_RESUME_FROM``.

Protocol (one TCP connection; each message is a 4-byte big-endian length, a JSON header, and
for ``chunk`` the raw bytes the header announces):

1. ``hello {v, zone, node, nonce_c}`` -> ``challenge {nonce_s, mac_s}`` -> ``auth {mac_c}`` -> ``ok``:
   mutual HMAC-SHA256 challenge-response with the zone key (:mod:`laminar.zone.keys`), so
   neither side talks checkpoints with a node outside the zone. Both MACs cover the hello's
   claims (version, zone, node: :func:`hello_identity`), so a peer on the path cannot change
   them; and since the key is the zone's, a destination given ``sources`` (the agent: the
   zone roster, ``zone.check_source``) refuses a sender whose connection does not come from
   the roster address of the node it names (``wrong_source``, counted). Everything after ``ok``, both
   ways, travels in AES-256-GCM records (:class:`_Channel`): keys per connection and direction
   from HKDF-SHA256 of the zone key and both nonces (:func:`derive_keys`), the record's number
   as nonce; a changed, replayed, reordered or missing record ends the connection, counted in
   ``STATS.records_rejected``. A peer of another PROTOCOL_VERSION is refused with an error
   naming both (a zone's agents upgrade together; docs/protocol.md);
2. ``offer {manifest, mac}``: the *transfer manifest* lists the files (name, size, SHA-256),
   the chunk size and every chunk's SHA-256; its digest is the SHA-256 of its canonical JSON and
   ``mac`` is HMAC(zone key, digest), so the destination knows the manifest, and through it
   every byte, comes from a zone member. The destination first checks its free disk
   (:func:`offer_room`: the checkpoint, what transfers in progress still lack, a margin) and
   refuses an offer that does not fit (``error`` with ``reason: no-room``, :class:`NoRoomError`
   at the sender, fatal: try another destination); so it does when its disk fills later (another
   writer took the room): a write that fails with ENOSPC or EDQUOT ends the transfer with a
   no-room refusal naming the error (EIO: a fatal error naming it), the chunks persisted so far
   kept for a resume. The answer is ``have {chunks}`` (the chunks the
   destination already holds, persisted: this is how a transfer resumes after a broken
   connection, a dead sender or a restarted destination) or ``committed`` if it has it all;
3. ``chunk {i, len}`` + bytes for each missing chunk; the destination checks that it fits the
   manifest, writes it at its offset in a partial file, and records it as held only after the
   data is on disk (fdatasync, then an fsync'd append to ``have.log``); it reports progress with
   ``ack {bytes}``;
4. ``done`` -> the destination splits the partial file into the checkpoint's files (the
   first, the largest, is the partial file itself, moved, when its bytes were hashed in order
   as they were written), checks every file against the manifest and the job's manifest (and,
   when one fails, every chunk, to name them), and answers ``need {chunks}`` (chunks missing,
   or that failed on the way, on disk or in the copy: the partial file is put back and the
   sender sends them again) or, after an atomic commit (files fsync'd, a ``VERIFIED`` marker,
   rename), ``committed {digest, path, mac}``: the MAC (zone key, this connection's server
   nonce, digest, path) lets the sender believe only the destination that it is delivered.
   Each byte is hashed once, in worker threads (docs/protocol.md, "Cost").

A connection may instead carry one *control message* after the handshake (``ctl {op, body,
mac}`` -> ``ctl-ok {result, mac}``; :func:`send_control`): the MACs cover the op, the body (or
result) and the server's nonce of this connection, so neither is forgeable, replayable, or
turned into another operation on the way; it is answered as asked by the hello's node,
authenticated and checked as above. An agent from before these MACs fails them with a
clear error (both sides of a zone run the same version).

Before the peer has authenticated, the endpoint reads at most MAX_HANDSHAKE bytes per message,
the whole handshake within HANDSHAKE_DEADLINE_S, and a :class:`laminar.zone.gate.Gate` decides who
may connect at all and how many connections each address and member holds (the agent's: only
roster addresses with ``zone.check_source``). After it, headers are small (CTL_MAX) but for an
offer's and a keeper's, a chunk's payload is read only once an offer was accepted and only up to
its chunk size, and large JSON is parsed only under MAX_SEPARATORS (see :func:`_recv`). Partial
transfers no connection has touched for INCOMING_STALE_S, and a commit's temporary left by a
crash, are removed (:meth:`Receiver.sweep`, at start and after each commit). The reclaim component uses
it to forward a reclaim notice and to hand a job's keeper (its spec) to the node holding its
replicas (:mod:`laminar.migrate.reclaim`).

The sender re-hashes every chunk it reads (in a thread, ahead of the socket) and checks the
files against the job's own manifest before it sends ``done`` (:func:`check_source`, in a
thread beside the transfer: the first byte leaves after the chunks' hashes alone), so a
checkpoint corrupted on the source disk is refused there, never committed. A checkpoint the job saves again meanwhile (jobkit replaces the
directory) is told apart from a corrupt one by its files' identities (inode, size, mtime):
the sender builds its manifest again and sends the new one, at most
MAX_SOURCE_CHANGES times (:func:`send_checkpoint`).

Shaping: the sender calls a :class:`FlowHook` with the connection's 5-tuple, the bytes to send
and the deadline, so the node's shaper can put the flow in its class and the kill-switch can
cut it at the window's end (engineer H5's ``laminar.net.transfers``; see
:func:`default_flow_hook`); ``rate_bps`` paces the sender in user space as well. While it sends,
the sender tells the hook every ACK_POLL_S how many of those bytes the peer's TCP has
acknowledged (``tcpi_bytes_acked`` from TCP_INFO, or the bytes written less SIOCOUTQ on a kernel
without it), so the shaper decides on confirmed bytes rather than an estimate.

Command line (used by the kernel tests; the agent uses :class:`Receiver` and
:func:`send_checkpoint`)::

    python -m laminar.migrate.transfer serve --root /var/lib/laminar/xfer --listen 10.0.0.2:7480 --key-file zone.keys
    python -m laminar.migrate.transfer send --to 10.0.0.2:7480 --job j1 --ckpt /ck/j1/ckpt-40 --key-file zone.keys

The package, by responsibility: :mod:`.errors` (what goes wrong, and the process-wide counts
of it), :mod:`.manifest` (the transfer manifest of a checkpoint: built, checked),
:mod:`.channel` (the MACs, the framing, the AES-GCM records of an authenticated connection),
:mod:`.progress` (what a transfer reports: progress, and its flow and acknowledged bytes to the
shaper), :mod:`.send` (the sender), :mod:`.incoming` (a checkpoint being received, on disk),
:mod:`.receive` (the :class:`Receiver`: the endpoint, the receive and the commit),
:mod:`.committed` (committed copies and whether they still verify), :mod:`.cli` (the command
line). This module exports their public names; a tunable (a timeout, a size) is read where it
is defined, so a test changes it there.
"""

from laminar.migrate.transfer.channel import (
    PROTOCOL_VERSION,
    derive_keys,
    hello_identity,
    mac,
    version_mismatch,
)
from laminar.migrate.transfer.committed import Committed, latest_verified, sent_by, verified_checkpoint
from laminar.migrate.transfer.errors import (
    REFUSED_REASONS,
    STATS,
    NoRoomError,
    PeerSilentError,
    RecordError,
    RefusedMessage,
    SourceChangedError,
    StatsCollector,
    TransferError,
    TransferStats,
)
from laminar.migrate.transfer.incoming import Room, offer_room
from laminar.migrate.transfer.manifest import (
    DEFAULT_CHUNK,
    MANIFEST_VERSION,
    TRANSFER_MANIFEST,
    VERIFIED,
    Manifest,
    build_manifest,
    check_source,
)
from laminar.migrate.transfer.progress import (
    Flow,
    FlowHook,
    Progress,
    bytes_acked_of,
    default_flow_hook,
    tcp_bytes_acked,
    tcp_unacked_bytes,
)
from laminar.migrate.transfer.receive import KeyLookup, Receiver
from laminar.migrate.transfer.send import SendResult, send_checkpoint, send_control

__all__ = [
    "DEFAULT_CHUNK", "MANIFEST_VERSION", "PROTOCOL_VERSION", "REFUSED_REASONS", "STATS", "TRANSFER_MANIFEST",
    "VERIFIED", "Committed", "Flow", "FlowHook", "KeyLookup", "Manifest", "NoRoomError", "PeerSilentError",
    "Progress", "Receiver", "RecordError", "RefusedMessage", "Room", "SendResult", "SourceChangedError",
    "StatsCollector", "TransferError", "TransferStats", "build_manifest", "bytes_acked_of", "check_source",
    "default_flow_hook", "derive_keys", "hello_identity", "latest_verified", "mac", "offer_room", "sent_by",
    "send_checkpoint", "send_control", "tcp_bytes_acked", "tcp_unacked_bytes", "verified_checkpoint",
    "version_mismatch",
]
