"""The backlog: the hand-off from the engine thread to the sender thread.

One ``collections.deque``: the engine thread appends, the sender thread pops
from the other end.  Both are atomic under the GIL, so neither side ever waits
for the other and no lock exists.  Each counter is written by one thread only
and merely read by the other.

Each batch is queued with the event count ``publish()`` saw, so the
accounting never reads a batch again: a caller that mutates a batch after
publishing it cannot make the sender's counters (or the sender) fail.

Loss is recorded in order: when ``offer()`` refuses a batch it remembers it,
and the next batch it accepts is preceded by a ``LOSS`` marker, so the sender
shows the loss (``coalesce._stream``) exactly where it happened.  With a record
bound (a recorder on the sender's side), each refused batch takes its own place
in the queue instead, inside a marker that carries it to the recorder (never
sent), up to ``record_events`` such events waiting at once.

Two budgets, as in vLLM plus one.  ``max_events`` bounds the events not yet
sent (and, separately, the batches), the memory bound.
``max_batches`` (vLLM's ``max_queue_size``) bounds the batches in the
hand-off deque, but only against a sender that has stopped taking: a full
deque refuses batches once the sender has taken nothing from it for
``stall_timeout`` seconds.  vLLM's blocking queue makes the engine wait
whenever it is full, and a sender that is merely late (on a busy machine it
may get no CPU for two engine steps) is exactly where vLLM only waits, so a
non-blocking publisher must not lose data there.  Under pressure the sender
also moves what is in the deque to a staging deque of its own (:meth:`stage`,
O(1) per batch), in order, so the deque rarely fills at all; staged batches
still count against ``max_events``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Final

from coalesce.stats import BacklogStats

__all__ = ["LOSS", "Backlog", "is_loss"]


class _Loss:
    """Batches were refused here.  With a record bound, it carries the one refused
    (for the recorder only: it is never sent) and its events, or ``overflow``: more
    were refused than the bound let the queue keep."""

    __slots__ = ("events", "overflow", "refused")

    def __init__(
        self, refused: list[Any] | None = None, overflow: bool = False, events: int = 0
    ) -> None:
        self.refused = refused
        self.overflow = overflow
        self.events = events

    def __repr__(self) -> str:
        return "LOSS"


LOSS: Final = _Loss()
"""Marker in the backlog: batches were lost here; the sender's stream shows it."""


def is_loss(item: Any) -> bool:
    """A loss marker (``LOSS``, or one carrying refused batches).  O(1)."""
    return type(item) is _Loss


class Backlog:
    """Bounded by the caller's budget, not by blocking.

    Engine thread: :meth:`offer`.  Sender thread: :meth:`mark_pending_loss` (at shutdown),
    :meth:`next_is_batch`,
    :meth:`take_one`, :meth:`take`, :meth:`refuse_all`.  Any thread: the read-only
    properties.
    """

    def __init__(
        self,
        max_batches: int,
        max_events: int,
        stall_timeout: float = 0.0,
        record_events: int = 0,
    ) -> None:
        # items: (batch, n_events) or LOSS
        self._q: deque[Any] = deque()  # the hand-off: engine appends, sender pops
        self._staged: deque[Any] = deque()  # the sender's own, taken from before _q
        self.max_batches = max_batches
        self.max_events = max_events
        self.stall_timeout = stall_timeout
        self._refusing = False  # refuse_all(): the sender has stopped for good
        # written by the engine thread
        self.batches_in = self.events_in = 0
        self.batches_dropped = self.events_dropped = 0
        self.peak = 0
        self._unmarked_loss = False
        # record_events > 0 (a recorder): refused batches take their place in the
        # queue, in markers, up to that many events waiting at once (O(1) each)
        self.record_events = record_events
        self.refused_in = 0  # events of refused batches queued (engine thread)
        self._overflowing = False  # the bound was passed; its marker is queued
        self._full_out = -1  # batches_out when the deque was last seen full
        self._full_since = 0.0
        # written by the sender thread
        self.batches_out = 0  # batches that left the hand-off deque (staged or taken)
        self.events_out = 0  # events taken for sending
        self.staged = 0  # batches in the staging deque
        self.abandoned_batches = self.abandoned_events = 0  # taken, then not sent
        self.refused_out = 0  # events of refused batches taken to the recorder

    # -- engine thread -------------------------------------------------------

    def offer(self, batch: Any, n_events: int) -> bool:
        """Queue ``batch`` unless the budget is spent.  O(1); never blocks.

        The budget: ``max_events`` events (and batches) not yet sent, and
        ``max_batches`` batches in the hand-off deque once the sender has
        taken nothing from it for ``stall_timeout`` (module docstring).  Over
        budget the batch is refused (returns False) and counted; the loss will
        be shown on the wire (a loss marker, or a sequence gap).
        """
        pending = self.batches_in - self.batches_out
        if (
            self._refusing
            or self.pending_events + n_events > self.max_events
            or pending + self.staged >= self.max_events
            or (pending >= self.max_batches and self._stalled())
        ):
            self.batches_dropped += 1
            self.events_dropped += n_events
            if self.record_events and not self._refusing:
                self._refused(batch, n_events)
            else:
                self._unmarked_loss = True
            return False
        q = self._q
        self._overflowing = False
        if self._unmarked_loss:
            self._unmarked_loss = False
            q.append(LOSS)
        q.append((batch, n_events))
        self.batches_in += 1
        self.events_in += n_events
        n = self.batches_in - self.batches_out
        if n > self.peak:
            self.peak = n
        return True

    def _refused(self, batch: Any, n_events: int) -> None:
        """Queue a refused batch in its place, for the recorder, or once per episode
        the marker that says the bound was passed.  O(1)."""
        if self.refused_in - self.refused_out + n_events <= self.record_events:
            self._q.append(_Loss([batch], events=n_events))
            self.refused_in += n_events
        elif not self._overflowing:
            self._overflowing = True
            self._q.append(_Loss(overflow=True))

    def _stalled(self) -> bool:
        """The hand-off deque is full: has the sender taken nothing for ``stall_timeout``?

        O(1): one clock read, only while the deque is full.
        """
        if self.stall_timeout <= 0:
            return True
        now = time.monotonic()
        out = self.batches_out
        if out != self._full_out:  # it took something since the last look: a new wait
            self._full_out = out
            self._full_since = now
            return False
        return now - self._full_since >= self.stall_timeout

    # -- sender thread -------------------------------------------------------

    def mark_pending_loss(self) -> None:
        """Put the marker for refused batches in now (no later batch will)."""
        if self._unmarked_loss:
            self._unmarked_loss = False
            self._q.append(LOSS)

    def refuse_all(self) -> None:
        """From now on :meth:`offer` refuses every batch (the sender has stopped for good)."""
        self._refusing = True

    def stage(self) -> int:
        """Move everything in the hand-off deque to the staging deque, in order.

        O(items moved), each a ``popleft`` and an ``append``: the batch budget
        is freed, the events stay counted.  Returns the batches moved.
        """
        q, staged = self._q, self._staged
        moved = 0
        for _ in range(len(q)):
            item = q.popleft()
            staged.append(item)
            if not is_loss(item):
                moved += 1
        self.batches_out += moved
        self.staged += moved
        return moved

    def _source(self) -> deque[Any]:
        return self._staged if self._staged else self._q

    def _took(self, src: deque[Any], batches: int, events: int) -> None:
        if src is self._staged:
            self.staged -= batches
        else:
            self.batches_out += batches
        self.events_out += events

    def next_is_batch(self) -> bool:
        """Whether a batch (not a loss marker) is the next item waiting.  O(1)."""
        src = self._source()
        return bool(src) and not is_loss(src[0])

    def take_one(self) -> tuple[Any, int] | _Loss:
        """Pop the oldest item: ``(batch, events)``, or a loss (:meth:`_losses`).  O(1)
        but for a run of markers.  Must not be empty."""
        src = self._source()
        if is_loss(src[0]):
            return self._losses(src)
        item = src.popleft()
        self._took(src, 1, item[1])
        return item  # type: ignore[no-any-return]

    def _losses(self, src: deque[Any]) -> _Loss:
        """Pop the run of loss markers at the head of ``src``: one loss, carrying every
        refused batch of the run in order.  O(markers)."""
        first = src.popleft()
        if not src or not is_loss(src[0]):
            self.refused_out += first.events
            return first  # type: ignore[no-any-return]
        refused: list[Any] = list(first.refused or ())
        overflow, events = first.overflow, first.events
        while src and is_loss(src[0]):
            item = src.popleft()
            refused += item.refused or ()
            overflow = overflow or item.overflow
            events += item.events
        self.refused_out += events
        return _Loss(refused or None, overflow, events)

    def take(self, max_events: int) -> list[Any] | _Loss:
        """Pop batches holding up to ``max_events`` events (at least one batch).

        Stops before a ``LOSS`` marker; if the oldest item is one, pops and
        returns ``LOSS``.  Takes from the staging deque while it has anything,
        then from the hand-off deque.  O(batches taken).  Must not be empty.
        """
        src = self._source()
        if is_loss(src[0]):
            return self._losses(src)
        out: list[Any] = []
        events = 0
        while src and not is_loss(src[0]):
            n = src[0][1]
            if out and events + n > max_events:
                break
            out.append(src.popleft()[0])
            events += n
        self._took(src, len(out), events)
        return out

    def abandon(self, batches: int, events: int) -> None:
        """Count batches taken and then not sent (the sender failed with them in hand)
        as dropped.  O(1)."""
        self.abandoned_batches += batches
        self.abandoned_events += events

    def drain(self) -> tuple[int, int]:
        """Discard what is left (shutdown past its deadline), counted as dropped;
        return (batches, events)."""
        batches = events = 0
        for src in (self._staged, self._q):
            n = e = 0
            while src:
                item = src.popleft()
                if is_loss(item):
                    self.refused_out += item.events
                else:
                    n += 1
                    e += item[1]
            self._took(src, n, e)
            batches, events = batches + n, events + e
        self.abandon(batches, events)
        return batches, events

    # -- any thread ----------------------------------------------------------

    def __len__(self) -> int:
        """Items waiting, staged or not (batches and markers).  O(1)."""
        return len(self._q) + len(self._staged)

    @property
    def pending(self) -> int:
        """Batches in the hand-off deque (what ``max_batches`` bounds).  O(1)."""
        return self.batches_in - self.batches_out

    @property
    def waiting(self) -> int:
        """Batches not yet taken for sending: in the hand-off deque or staged.  O(1)."""
        return self.batches_in - self.batches_out + self.staged

    @property
    def pending_events(self) -> int:
        """Events in those batches (what ``max_events`` bounds).  O(1)."""
        return self.events_in - self.events_out

    def stats(self) -> BacklogStats:
        """The counters, frozen: refused and abandoned batches both count as dropped.
        O(1)."""
        return BacklogStats(
            batches_in=self.batches_in,
            events_in=self.events_in,
            batches_dropped=self.batches_dropped + self.abandoned_batches,
            events_dropped=self.events_dropped + self.abandoned_events,
            backlog_batches=self.waiting,
            backlog_events=self.pending_events,
            backlog_peak=self.peak,
        )

    def check(self) -> None:
        """Assert the invariants (tests call it after every mutation).  O(items)."""
        queued = [x for x in self._q if not is_loss(x)]
        staged = [x for x in self._staged if not is_loss(x)]
        assert len(queued) == self.pending >= 0, "counters match the hand-off deque"
        assert len(staged) == self.staged >= 0, "counters match the staging deque"
        assert sum(n for _, n in queued + staged) == self.pending_events >= 0
        if self.stall_timeout <= 0:
            assert self.pending <= self.max_batches, "the batch budget"
        assert self.pending_events <= self.max_events, "the event budget holds"
        assert self.waiting <= self.max_events, "the event budget bounds the batches too"
        assert self.peak >= self.pending
        # Adjacent markers are allowed: the sender turns a run of them into one gap.
