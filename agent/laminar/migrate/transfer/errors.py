"""What goes wrong in a checkpoint transfer (:class:`TransferError` and its kinds, each
saying whether trying again can help), and the process-wide counts of what was refused
(:data:`STATS`, exported to prometheus by :class:`StatsCollector`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TransferError(Exception):
    """A transfer that cannot go on: authentication failed, bad manifest, corrupt source,
    peer error, or too many failed rounds. The message says which. ``fatal``: trying again
    cannot help (authentication, a corrupt source, a conflicting checkpoint)."""

    def __init__(self, msg: str, fatal: bool = False) -> None:
        super().__init__(msg)
        self.fatal = fatal


class SourceChangedError(TransferError):
    """The checkpoint changed under the sender (a job re-saved the same step: jobkit replaces
    its directory with new files): the manifest no longer describes what is on disk. Not
    fatal: :func:`send_checkpoint` builds the manifest again and sends what is there now, at
    most MAX_SOURCE_CHANGES times."""


class PeerSilentError(TransferError):
    """The destination said nothing: it did not accept the connection in CONNECT_TIMEOUT_S, or
    did not answer the handshake in HANDSHAKE_TIMEOUT_S (its host gone, a blackhole, its agent
    hung). Not fatal (it may come back); :func:`send_checkpoint` tries such a peer again only
    ``silent_retries`` times, so a caller with another destination (a prestage) goes there
    after one timeout instead of the whole retry ladder."""


class RefusedMessage(TransferError):
    """A message refused for its size or shape before it was parsed or its payload read
    (:func:`_recv`); ``reason`` names the counter a Receiver counts it under
    (:data:`REFUSED_REASONS`): ``too_large``, ``too_dense`` (JSON of more than MAX_SEPARATORS
    separators), ``chunk_before_offer``. Not fatal."""

    def __init__(self, msg: str, reason: str) -> None:
        super().__init__(msg)
        self.reason = reason


REFUSED_REASONS = ("too_large", "too_dense", "chunk_before_offer")


class RecordError(TransferError):
    """A record after the handshake failed authentication (modified, replayed, reordered,
    dropped on the way, or not a record at all). The connection ends; nothing it carried
    from then on is used. Not fatal: a new connection (new keys) may get through."""


class NoRoomError(TransferError):
    """The destination refused an offer: its receive root lacks the disk space. ``need`` and
    ``avail`` are bytes. Fatal for this destination: the caller picks another."""

    def __init__(self, msg: str, need: int, avail: int) -> None:
        super().__init__(msg, fatal=True)
        self.need = need
        self.avail = avail


@dataclass
class TransferStats:
    """Process-wide counters of this module (both sides): ``records_rejected``, records that
    failed authentication (each ends its connection); ``offers_refused_no_room``, offers a
    Receiver here refused for disk space; ``wrong_source``, connections a Receiver here refused
    because they did not come from the roster address of the node their hello named
    (:class:`Receiver`'s ``sources``). Read them, never reset them (tests take deltas)."""

    records_rejected: int = 0
    offers_refused_no_room: int = 0
    wrong_source: int = 0


STATS = TransferStats()


class StatsCollector:
    """STATS for a prometheus_client registry (``registry.register(StatsCollector())``):
    ``laminar_transfer_records_rejected_total``,
    ``laminar_transfer_offers_refused_no_room_total`` and
    ``laminar_transfer_wrong_source_total``."""

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("laminar_transfer_records_rejected", "checkpoint-transfer records that failed "
                                  "authentication (changed, replayed, reordered or dropped on the way); each ended "
                                  "its connection", value=STATS.records_rejected)
        yield CounterMetricFamily("laminar_transfer_offers_refused_no_room", "checkpoint offers this agent refused "
                                  "for lack of disk space", value=STATS.offers_refused_no_room)
        yield CounterMetricFamily("laminar_transfer_wrong_source", "checkpoint-transfer connections this agent "
                                  "refused: not from the roster address of the node their hello named (or a node "
                                  "the roster does not list)", value=STATS.wrong_source)
