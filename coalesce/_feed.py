"""The recorder's feed: what the sender thread sent or refused, into the recorder.

The sender gives every batch ``publish()`` accepted or refused, in publish order,
to :meth:`Feed.record`, and it records them as they came, a list in one call
(by default: with the recorder's state in C, that costs less than compacting
them first).  With the policy's ``record_window`` set (an A/B), batches sent as
they came are gathered, up to that many events, and recorded as the
compactor's output of each window of them: the same state for every subscriber
model, fewer events.  What is gathered is recorded (:meth:`Feed.settle`) before
a walk of the recorder begins, before an invalidation, and whenever the sender
has caught up.

A *walk* is the recorder's program being written out a chunk at a time: a
snapshot reply (``coalesce._snapshot``) or an in-band resync after a loss marker
(:meth:`Feed.start_resync`).  One walk at a time; while it runs the recorder is
frozen and what the sender gives it waits in a deferred list (O(1) a batch),
recorded once the walk ends.  Past ``max_deferred_events`` waiting, the walk is
abandoned so that the list stays bounded.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any

from coalesce._kinds import event_count
from coalesce._policy import DEFAULT_POLICY, Policy
from coalesce._recorder import Recorder
from coalesce.compactor import compact
from coalesce.stats import SnapshotStats

__all__ = ["SNAPSHOTS_REFUSED", "Feed", "Walk"]

log = logging.getLogger("coalesce")

SNAPSHOTS_REFUSED = "snapshot requests are answered -2"
"""What the log says goes while the recorder is not exact, with snapshots on."""

Walk = Generator[list[Any], None, None]
"""The recorder's program, a chunk (one batch's events) at a time."""


class Feed:
    """The recorder's feed and its walks.  See the module docstring."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        max_deferred_events: int,
        policy: Policy = DEFAULT_POLICY,
        accelerated: bool = True,
        uses: str = SNAPSHOTS_REFUSED,
    ) -> None:
        self.recorder = recorder
        self._uses = uses  # what the log says goes while it is not exact
        self._accelerated = accelerated
        self._window = policy.record_window
        self._least = policy.record_from
        self._max_deferred = max_deferred_events
        self._gathered: list[Any] = []
        self._gathered_events = 0
        self._deferred: deque[Any] = deque()
        self._deferred_events = 0
        self._walk: Walk | None = None
        self._abandon: Callable[[str], None] | None = None  # the walk's owner's
        self._resync: Walk | None = None
        self._was_valid = True

    def stats(self) -> SnapshotStats:
        """The recorder's gauges (a publisher that records for resyncs only).  O(1)."""
        return SnapshotStats(snapshot_blocks=self.recorder.held, snapshot_exact=self.recorder.valid)

    # -- what the sender gives it ----------------------------------------------------

    def record(self, batches: Iterable[Any], compacted: bool = False) -> None:
        """Give the recorder ``batches`` (sent or refused), in publish order.

        ``compacted``: already the rules' output; recorded at once, after what
        was gathered before them.  Else gathered, up to ``record_window`` events,
        then recorded as the compactor's output of them (:meth:`settle`).
        While a walk runs they wait in the deferred list instead.  O(hashes),
        amortised.
        """
        for batch in batches:  # (a walk abandoned on the way unfreezes it)
            if self._walk is not None:
                self._defer(batch)
            elif compacted:
                self.settle()
                self._record([batch])
            else:
                self._gathered.append(batch)
                self._gathered_events += event_count(batch)
        if self._gathered_events >= self._window:
            self.settle()

    def encode(self, batch: Any) -> bytes | None:
        """``batch`` encoded (as msgspec encodes it) and recorded in one pass
        (:meth:`Recorder.encode`), when nothing gathered or deferred waits before
        it and no walk runs; else None, nothing recorded: encode it and
        :meth:`record` it apart.  O(events + hashes)."""
        if self._walk is not None or self._gathered or self._window > 0:
            return None
        payload = self.recorder.encode(batch)
        if self.recorder.valid != self._was_valid:
            self._say()
        return payload

    def settle(self) -> None:
        """Record what was gathered, in windows of about ``record_window`` events,
        each as the compactor's output of it (as it was, where the rules cannot
        handle it, or under ``record_from`` events).  O(events and hashes gathered)."""
        if not self._gathered:
            return
        gathered, self._gathered = self._gathered, []
        total, self._gathered_events = self._gathered_events, 0
        if total < self._least or self._window <= 0:
            self._record(gathered)
            return
        start = events = 0
        for i, batch in enumerate(gathered):
            events += event_count(batch)
            if events >= self._window or i + 1 == len(gathered):
                self._record_window(gathered[start : i + 1], events)
                start, events = i + 1, 0

    def invalidate(self, reason: str) -> None:
        """Batches were lost before reaching the recorder: it cannot be exact (a walk
        under way is abandoned)."""
        self.settle()
        if self._abandon is not None:
            self._abandon(reason)
        self.recorder.invalidate(reason)
        self._say()

    def _record_window(self, window: list[Any], events: int) -> None:
        if events >= self._least:
            with contextlib.suppress(Exception):  # as it was: the recorder says what it cannot read
                window = compact(window, accelerated=self._accelerated)[0]
        self._record(window)

    def _defer(self, batch: Any) -> None:
        self._deferred.append(batch)
        self._deferred_events += event_count(batch)
        if self._deferred_events > self._max_deferred and self._abandon is not None:
            self._abandon("the live stream outran it")

    def _record(self, batches: list[Any]) -> None:
        """Record ``batches``, in order (one C call for the list), and say when the
        recorder became exact or unavailable."""
        self.recorder.record_many(batches)
        if self.recorder.valid != self._was_valid:
            self._say()

    def _say(self) -> None:
        rec = self.recorder
        self._was_valid = rec.valid
        if rec.valid:
            log.info("kv-coalesce: the snapshot recorder is exact again (after a clear)")
        else:
            log.warning(
                "kv-coalesce: the recorder is not exact (%s) until the next "
                "AllBlocksCleared: %s",
                rec.reason,
                self._uses,
            )

    # -- walks -----------------------------------------------------------------------

    @property
    def walking(self) -> bool:
        """A walk (a snapshot reply or a resync) is under way: the recorder is frozen."""
        return self._walk is not None

    def begin_walk(self, abandon: Callable[[str], None]) -> Walk | None:
        """Settle, then freeze the recorder and return its program, or None (nothing
        begun) while it is not exact.  ``abandon(reason)`` is called if the walk must
        stop early (the deferred list overran, or the recorder was invalidated);
        it must call :meth:`end_walk`."""
        assert self._walk is None, "one walk at a time"
        self.settle()
        if not self.recorder.valid:
            return None
        self._walk = walk = self.recorder.chunks()
        self._abandon = abandon
        return walk

    def end_walk(self) -> None:
        """End the walk (whole or not), then record what waited meanwhile."""
        walk, self._walk, self._abandon = self._walk, None, None
        if walk is not None:
            walk.close()
        deferred, self._deferred, self._deferred_events = self._deferred, deque(), 0
        self.record(deferred)

    def invalid_event(self, exc: BaseException) -> str:
        """A walk met a recorded event that does not encode: the recorder cannot serve
        its state (until the next clear).  Returns the reason."""
        why = f"a recorded event does not encode ({type(exc).__name__})"
        if self._abandon is not None:
            self._abandon(why)
        self.recorder.invalidate(f"{why}: {exc!s:.200}")
        self._say()
        return why

    # -- the in-band resync ------------------------------------------------------------

    @property
    def resyncing(self) -> bool:
        """A resync is under way: its chunks go out before any later batch."""
        return self._resync is not None

    def start_resync(self) -> bool:
        """Begin a resync of the recorder's state (after a loss marker).  False, and
        nothing begun, while the recorder is not exact or another walk runs."""
        if self._walk is not None:
            return False
        self._resync = self.begin_walk(lambda _why: self.abandon_resync())
        return self._resync is not None

    def resync_chunk(self) -> list[Any] | None:
        """The resync's next chunk of the program, or None once it has ended.  O(chunk)."""
        walk = self._resync
        assert walk is not None
        try:
            chunk = next(walk, None)
        except Exception:
            self.abandon_resync()
            raise
        if chunk is None:
            self.abandon_resync()  # ended: the same clean-up
        return chunk

    def abandon_resync(self) -> None:
        """End the resync now (whole or not) and let the recorder catch up."""
        if self._resync is not None:
            self._resync = None
            self.end_walk()

    def close(self) -> None:
        """Drop any walk and what waits (the sender thread stops)."""
        if self._walk is not None:
            self._walk.close()
        self._walk = self._resync = self._abandon = None
        self._deferred.clear()
