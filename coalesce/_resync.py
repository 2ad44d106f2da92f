"""What the recorder does at a loss: it is given the refused batches and, with
``loss_marker=resync``, the sender sends its program after the loss marker, in-band,
a chunk a step, before any later batch.

With ``loss_marker=resync``, a backlog past its budget *collapses* into the state:
once ``publish()`` has refused a batch, the sender stops sending what waits and
gives it to the recorder instead, a window a step (recording costs less than
encoding and sending), up to and past the refusal; then the loss marker, and the
recorder's program after it.  So the marker is reached at once, the refused
batches never wait long for it, and what a consumer ends with is the state of
every batch published, sent or not: the compaction rules' limit (a long enough
backlog compacts to "clear, then the state").  Memory is the recorder's, bounded
by the blocks it holds (``snapshot_max_blocks``), plus the refused batches
between a refusal and the collapse that takes them.

The sender thread owns one :class:`Resync` when it records (snapshots, or
resyncs on); each method is bounded work (a window, a chunk of the program, or
the refused batches of one loss).
"""

from __future__ import annotations

from typing import Any

from coalesce._backlog import Backlog, is_loss
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
        backlog: Backlog,
        feed: Feed,
        stream: Stream,
        encoder: Encoder,
        rank: int,
        settings: Settings,
        totals: Totals,
        limited: RateLimited,
    ) -> None:
        self._backlog = backlog
        self._feed = feed
        self._stream = stream
        self._encoder = encoder
        self._rank = rank
        self._sends = LossMarker(settings.loss_marker) is LossMarker.RESYNC
        self._totals = totals
        self._dropped_seen = 0  # the backlog's refusals when the last collapse began
        self._collapsing = 0  # items of the backlog still to record in this collapse
        self._limited = limited
        self._told = LossMarker(settings.loss_marker).told

    @property
    def running(self) -> bool:
        """A resync is under way: its chunks go out before any later batch."""
        return self._feed.resyncing

    def after_loss(self, marker: Any, begin: bool = True) -> None:
        """The backlog's loss marker: the recorder gets what was refused (or, past the
        bound the marker could carry, is invalidated); with ``loss_marker=resync``
        and ``begin``, a resync begins (while the recorder is exact and no reply is
        being built)."""
        feed = self._feed
        feed.record(marker.refused or ())
        if marker.overflow:
            feed.invalidate("more batches refused than the record bound keeps")
        if self._sends and begin:
            feed.settle()
            feed.start_resync()

    @property
    def collapsing(self) -> bool:
        """The backlog collapses now: ``publish()`` refused a batch since the last
        collapse began (``loss_marker=resync`` only), or one is under way.  O(1)."""
        return self._sends and (
            self._collapsing > 0 or self._backlog.batches_dropped != self._dropped_seen
        )

    def collapse(self, events: int) -> tuple[int, int]:
        """One step of a collapse: the next ``events`` waiting (or a loss marker) given
        to the recorder, not sent.  Returns (batches, events) taken: the caller
        finishes with them.  Once what waited when the collapse began is recorded,
        the loss is shown and the resync begins."""
        backlog = self._backlog
        if self._collapsing <= 0:
            self._collapsing = len(backlog)
            self._dropped_seen = backlog.batches_dropped
        before = backlog.events_out
        item: Any = backlog.take(events) if len(backlog) else []
        self._collapsing -= 1 if is_loss(item) else len(item)
        taken = (0, 0)
        if is_loss(item):
            self._stream.lose()
            self.after_loss(item, begin=False)
        else:
            assert isinstance(item, list)
            self._feed.record(item)
            taken = (len(item), backlog.events_out - before)
            self._totals.batches_collapsed += taken[0]
            self._totals.events_collapsed += taken[1]
        if self._collapsing <= 0 or not len(backlog):
            self._collapsing = 0
            self._stream.lose()  # (what was not sent is told, then restored)
            self._feed.settle()
            self._feed.start_resync()
        return taken

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
            self._limited.failure("cut short", "a resync was cut short", exc, self._told)
            return
        if chunk is None:
            self._totals.resyncs += 1
        elif payload is not None:  # (None: a step spent walking the recorder's keys)
            stream.emit(payload, len(chunk))
            self._totals.resync_events += len(chunk)
