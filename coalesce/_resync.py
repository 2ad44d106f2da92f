"""What the recorder does at a loss: it is given the refused batches and, with
``loss_marker=resync``, the sender sends its program after the loss marker, in-band,
a chunk a step, before any later batch.

The sender thread owns one :class:`Resync` when it records (snapshots, or
resyncs on); each method is bounded work (a chunk of the program, or the refused
batches of one loss).
"""

from __future__ import annotations

from typing import Any

from coalesce._feed import Feed
from coalesce._settings import LossMarker, Settings
from coalesce._stream import Stream
from coalesce._totals import RateLimited, Totals
from coalesce._wire import Encoder

__all__ = ["Resync"]


class Resync:
    """The recorder's side of a loss, and the in-band resync after it."""

    def __init__(
        self,
        feed: Feed,
        stream: Stream,
        encoder: Encoder,
        rank: int,
        settings: Settings,
        totals: Totals,
        limited: RateLimited,
    ) -> None:
        self._feed = feed
        self._stream = stream
        self._encoder = encoder
        self._rank = rank
        self._sends = LossMarker(settings.loss_marker) is LossMarker.RESYNC
        self._most_blocks = settings.budgets.resync_blocks
        self._totals = totals
        self._limited = limited
        self._told = LossMarker(settings.loss_marker).told

    @property
    def running(self) -> bool:
        """A resync is under way: its chunks go out before any later batch."""
        return self._feed.resyncing

    def after_loss(self, marker: Any) -> None:
        """The backlog's loss marker: the recorder gets what was refused (or, past the
        bound the marker could carry, is invalidated); with ``loss_marker=resync`` a
        resync begins, while the recorder is exact, no reply is being built, and it
        holds at most :attr:`~coalesce._settings.Budgets.resync_blocks` keys."""
        feed = self._feed
        feed.record(marker.refused or ())
        if marker.overflow:
            feed.invalidate("more batches refused than the record bound keeps")
        if self._sends:
            feed.settle()
            if feed.recorder.held <= self._most_blocks:
                feed.start_resync()

    def step(self, closing: bool) -> None:
        """Send the next chunk of the resync.  One cut short (``closing``: shutdown, or
        an event that does not encode) may have sent stores the state does not hold:
        another marker follows it."""
        feed, stream = self._feed, self._stream
        if closing:
            feed.abandon_resync()
            stream.lose()
            return
        try:
            chunk = feed.resync_chunk()
            payload = self._encoder.encode_now(chunk, self._rank) if chunk else None
        except Exception as exc:
            feed.abandon_resync()
            stream.lose()
            self._limited.warning(
                "resync",
                "kv-coalesce: a resync was cut short (%s: %.200s); %s",
                type(exc).__name__,
                exc,
                self._told,
            )
            return
        if chunk is None:
            self._totals.resyncs += 1
        elif payload is not None:  # (None: a step spent walking the recorder's keys)
            stream.emit(payload, len(chunk))
            self._totals.resync_events += len(chunk)
