"""The sender thread: backlog -> compact -> encode -> send -> replay buffer.

:class:`Sender` owns the ladder level and the sender's counters; the publisher
facade only reads them (``stats()``) and sets :attr:`Sender.closed`.  The
thread holds no reference to the facade, so a publisher dropped without
``shutdown()`` can be collected, and its finaliser stops the thread.

Each turn of its loop: the services (replay and snapshot requests:
``coalesce._services``), then a resync chunk if one is under way, then one
step of the backlog, then, with nothing to do, a heartbeat or a sleep until
``publish()``, ``shutdown()`` or a request wakes it.
A step takes a batch or a window from the backlog and hands it to
:meth:`Sender._send`, the one send path: it compacts (or not, as the ladder
says), encodes, emits through the :class:`coalesce._stream.Stream` (the one
place that assigns seqs, shows losses and keeps messages for replay), gives
the recorder's feed what was sent, and finishes with what it took.

Nothing a caller can put in a batch stops this thread.  A window the
compactor rejects (it raises on a value of a type it cannot handle) is sent
batch by batch as it was given; a batch the encoder rejects is lost visibly.
If the loop itself ever fails, the thread marks itself dead, the backlog
refuses every later batch (``publish()`` returns ``DROPPED``), what was
waiting is counted as dropped, and the stream shows that loss at once.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from coalesce._backlog import Backlog, is_loss
from coalesce._feed import Feed
from coalesce._gate import Gate
from coalesce._kinds import event_count
from coalesce._pacing import Pacing
from coalesce._policy import Policy
from coalesce._resync import Resync
from coalesce._services import Services
from coalesce._settings import LossMarker, Settings
from coalesce._stream import Stream
from coalesce._totals import RateLimited, Totals
from coalesce._wire import Encoder
from coalesce.compactor import compact, compact_for_wire, compactable
from coalesce.stats import SenderStats

__all__ = ["IDLE_SLEEP", "SHALLOW_SLEEP", "How", "Level", "Sender"]

log = logging.getLogger("coalesce")

IDLE_SLEEP = 0.1
"""Seconds an idle sender sleeps at most: ``publish()`` and ``shutdown()`` wake
it, and so does a replay or snapshot request once it sleeps on its sockets, so
this only bounds how long a missed wake-up could last.  Every wake costs the
engine's process CPU and, while the engine holds the GIL, a forced switch;
vLLM's own sender looks every 0.1 s too."""

SHALLOW_SLEEP = 0.02
"""Seconds an idle sender with a replay or snapshot socket first sleeps on its
bell alone, the cheapest wake for ``publish()`` (a lock released); then it sleeps
on its sockets too (:meth:`Services.sleep`), where ``publish()`` must also write
to a pipe.  A request that comes in the first sleep waits at most this long."""


class Level(enum.IntEnum):
    """The ladder: what the sender does with the backlog (docs/backpressure.md)."""

    ONE_TO_ONE = 0
    """Each batch sent as it is: byte-identical to vLLM."""
    RULES = 1
    """Windows folded and run through every compaction rule."""
    FOLD_ONLY = 2
    """Windows (4x larger) only folded: drains at encoding speed."""


class How(enum.Enum):
    """How :meth:`Sender._send` sends what a step took."""

    AS_GIVEN = 0
    """Each batch encoded as it is."""
    RULES = 1
    """The window through every rule, then each result encoded."""
    FOLD = 2
    """The window folded only."""
    PARTS = 3
    """One batch larger than a window: the rules on each window's worth of it in turn."""
    WHOLE = 4
    """One batch larger than a window, near the event budget: folded with the next
    batch waiting, in one encode (:func:`~coalesce._policy.sends_whole`)."""


class Sender:
    """The sender thread and everything it owns.  See the module docstring."""

    def __init__(
        self,
        *,
        stream: Stream,
        encoder: Encoder,
        services: Services,
        backlog: Backlog,
        settings: Settings,
        policy: Policy,
        gate: Gate,
        rank: int,
        feed: Feed | None = None,
        accelerated: bool = True,
        native_send: bool = False,
        close_sockets: Callable[[], None] | None = None,
    ) -> None:
        self._stream = stream
        self._encoder = encoder
        self.services = services
        self._deep = False  # asleep on the sockets (and the services' bell) too
        self._backlog = backlog
        self._settings = settings
        self._gate = gate
        self.feed = feed
        self._native_send = native_send
        self.accelerated = accelerated
        """False: the rules run in Python even where the C ones are built (a test's hook)."""
        self._close_sockets = close_sockets
        self.limited = RateLimited()
        self.totals = Totals()
        self.loss_told = LossMarker(settings.loss_marker).told
        """What a loss's log line says subscribers learn (the facade's drop warning too)."""
        self._level = Level.ONE_TO_ONE
        self.pacing = Pacing(backlog, policy, settings.high_watermark)
        self.resync = None
        if feed is not None:
            self.resync = Resync(
                backlog, feed, stream, encoder, rank, settings, self.totals, self.limited
            )
        self._in_flight = (0, 0)  # (batches, events) taken and not yet finished with

        # shared with the facade
        self.done = 0
        """Input batches the sender has finished with (sent or counted lost)."""
        self.alive = True
        """False once the thread has stopped (after shutdown, or after a failure)."""
        self.failed = False
        """True if the thread stopped because of an error, not ``shutdown()``."""
        self.closed = False
        """Set by the facade: flush for ``shutdown_timeout``, then stop."""
        self.idle = False
        """The thread is (about to be) asleep; ``publish()`` may wake it."""
        self.stepping = False
        """In a step: what it took from the backlog is not finished with yet (a loss
        marker, whose refused batches are being recorded, counts in no ``done``)."""
        self._bell = threading.Lock()
        """Released = rung: the idle thread's ``acquire`` takes the ring (one lock
        release wakes it; an ``Event.set()`` costs about three times as much in the
        engine's thread: a ``Condition`` and its waiter list)."""
        self._bell.acquire()
        self._quiet = threading.Condition(threading.Lock())
        """Notified as the thread goes idle while a caller waits in ``flush()``, and
        as it stops (:meth:`wait_quiet`); its lock also guards ``pacing.flushers``."""
        self.thread = threading.Thread(target=self._run, name="coalesce-sender", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        """Wake the thread if it sleeps (else it finds the ring on its next sleep).
        O(1), never blocks; safe from any thread."""
        try:  # noqa: SIM105 - in publish(): contextlib.suppress costs a context manager
            self._bell.release()
        except RuntimeError:  # already rung
            pass
        if self._deep:  # (read after the release: see _sleep_serving)
            self.services.ring()

    def request_stop(self) -> None:
        """Ask the thread to flush and stop; returns at once.  Safe from any thread."""
        self.closed = True
        self.wake()

    @contextlib.contextmanager
    def flushing(self) -> Iterator[None]:
        """A caller blocks waiting for this thread (``flush()``, ``shutdown()``) for
        the duration: counted in ``pacing.flushers``."""
        with self._quiet:
            self.pacing.flushers += 1
        try:
            yield
        finally:
            with self._quiet:
                self.pacing.flushers -= 1

    def wait_quiet(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``done()`` holds, checked now, as the thread goes idle and as it
        stops, for at most ``timeout`` seconds; its last value.  Blocks the caller."""
        with self._quiet:
            return self._quiet.wait_for(done, timeout)

    def _tell_quiet(self) -> None:
        with self._quiet:
            self._quiet.notify_all()

    @property
    def resyncing(self) -> bool:
        """A resync is under way.  O(1); safe from any thread."""
        return self.resync is not None and self.resync.running

    def stats(self, accelerated: bool) -> SenderStats:
        """The sender's counters and gauges, frozen.  O(fields)."""
        return self.totals.stats(
            alive=self.alive, accelerated=accelerated, native_send=self._native_send
        )

    # -- the loop ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug, or a broken socket: never a silent stop
            self._die(exc)
        finally:
            self.alive = False
            self._tell_quiet()
            self.services.close()
            if self.feed is not None:
                self.feed.close()
            if self._close_sockets is not None:
                self._close_sockets()

    def _loop(self) -> None:
        backlog, gate, services, resync = self._backlog, self._gate, self.services, self.resync
        serving = services.any
        deadline: float | None = None
        while True:
            if gate.closed is not None:  # held by a test; one read otherwise
                gate.wait()
            did = serving and services.step()
            if self.closed and deadline is None:
                deadline = time.monotonic() + self._settings.shutdown_timeout
            if resync is not None and resync.running:  # before any later batch
                resync.step(closing=self.closed)
                did = True
            elif len(backlog):
                if deadline is not None and time.monotonic() > deadline:
                    self._abandon("shutdown timeout")
                    break
                self.stepping = True
                try:
                    self._step(flushing=deadline is not None)
                finally:  # (a step that fails has its window counted lost by _die)
                    self.stepping = False
                did = True
            elif self.closed:
                backlog.mark_pending_loss()
                if not len(backlog):
                    break
            if did:
                self.pacing.maybe_yield()
                continue
            if not self.closed and services.beat():
                continue
            self.idle = True
            if len(backlog) or self.closed:
                self.idle = False
                continue
            if self.pacing.flushers:  # what they wait for is done, or no more is coming
                self._tell_quiet()
            if serving:
                self._sleep_serving()
            else:
                self._bell.acquire(timeout=IDLE_SLEEP)
            self.idle = False
            self.pacing.woke()
        self._stream.show_loss()

    def _sleep_serving(self) -> None:
        """Sleep until woken, with a replay or snapshot socket to serve: first on the
        bell alone, for :data:`SHALLOW_SLEEP` at most; then, unless that sleep was
        cut short because something is due sooner (a heartbeat, a reply waiting:
        the loop sees to it), on the sockets and the services' bell as well."""
        bell, services = self._bell, self.services
        shallow = services.sleep_for(SHALLOW_SLEEP)
        if bell.acquire(timeout=shallow) or shallow < SHALLOW_SLEEP:
            return
        # wake() releases the bell, then reads _deep: either it reads True and
        # rings the services' bell, or its release came first and is seen here.
        self._deep = True
        if not bell.acquire(blocking=False):
            services.sleep(IDLE_SLEEP)
            bell.acquire(blocking=False)  # (a ring that came with the pipe's: spent)
        self._deep = False

    def _step(self, flushing: bool) -> None:
        """One bounded unit of work: take a batch or a window and send it.

        The ladder: backlog at most ``high_watermark`` batches: send 1:1.
        Above it: fold, ``max_events_per_step`` events at a time (up to
        ``widen_up_to`` x as many while the rest of the slice holds them:
        :func:`rules_window`), and apply every rule.  A single batch larger
        than a window is compacted in parts of a window each, or encoded as it
        is (past ``whole_from`` of the budget, with the next batch folded in).
        Flushing (``shutdown()``) is at the fold-only level: windows 4x larger,
        only folded.  Past ``high_watermark`` batches in the hand-off deque,
        the sender first moves them to its staging deque, so that the batch
        budget (vLLM's ``max_queue_size``) is reached only by a sender that
        cannot run; the event budget still counts them.
        """
        backlog = self._backlog
        self.pacing.keep_budget_free()
        if self.resync is not None and self.resync.collapsing:  # past the budget
            self._in_flight = self.resync.collapse(4 * self._settings.max_events_per_step)
            self._finish(self._in_flight[0], [], compacted=False)
            return
        level = self._climb(flushing)
        taken_events = backlog.events_out
        window: Any  # a list of batches, or a loss marker
        if level == Level.ONE_TO_ONE:
            item = backlog.take_one()
            window = item if is_loss(item) else [item[0]]  # type: ignore[index]
            step = 0
        else:
            step = self._settings.max_events_per_step
            step = 4 * step if level == Level.FOLD_ONLY else self.pacing.rules_window(step)
            window = backlog.take(step)
        if is_loss(window):
            self._lost(window)
            return
        self._in_flight = (len(window), backlog.events_out - taken_events)
        self._send(window, self._how(window, level, step))

    def _climb(self, flushing: bool) -> Level:
        """The ladder's level for this step (logged when it rises).  O(1)."""
        settings, waiting = self._settings, self._backlog.waiting
        level = Level.ONE_TO_ONE
        if settings.compaction and (flushing or waiting > settings.high_watermark):
            level = Level.FOLD_ONLY if flushing else Level.RULES
        if level != self._level:
            if level > self._level and not flushing:
                self.limited.log(
                    logging.INFO,
                    f"level{int(level)}",
                    "kv-coalesce: sender behind (%d batches, %d events waiting): compacting",
                    waiting,
                    self._backlog.pending_events,
                )
            self._level = level
        return level

    def _how(self, window: list[Any], level: Level, step: int) -> How:
        """How to send ``window``, taken at ``level`` in a window of ``step`` events.
        O(1), or O(events) in C for a big batch (:func:`compactable`)."""
        if level == Level.ONE_TO_ONE:
            return How.AS_GIVEN
        if len(window) == 1:
            if level == Level.FOLD_ONLY:  # nothing to fold
                return How.AS_GIVEN
            if event_count(window[0]) > step:
                if self.pacing.sends_whole():  # the engine goes at the sender's pace
                    return How.WHOLE
                # not a KV batch: never cut in parts
                return How.PARTS if compactable(window[0]) else How.AS_GIVEN
        return How.RULES if level == Level.RULES else How.FOLD

    # -- the send path ---------------------------------------------------------------

    def _send(self, taken: list[Any], how: How) -> None:
        """Send what a step took, ``how`` it says; the feed sees what went out; then
        finish with it.  O(events + block hashes)."""
        if how is How.AS_GIVEN:
            sent = self._as_given(taken)
        elif how is How.PARTS:
            sent = self._parts(taken[0])
        else:
            if how is How.WHOLE:
                taken = self._with_next(taken)
            if len(taken) == 1 and how is How.WHOLE:  # nothing to fold it with
                sent = self._as_given(taken)
            else:
                sent = self._compacted(taken, fold_only=how is not How.RULES, timed=True)
        self._finish(len(taken), sent, compacted=how is not How.AS_GIVEN)

    def _finish(self, batches: int, sent: list[Any], compacted: bool) -> None:
        """The feed sees ``sent`` (``compacted``: the rules' or the fold's output); once
        nothing waits to be sent, it has seen all of it, before ``done`` counts the
        ``batches`` taken."""
        feed = self.feed
        if feed is not None:
            feed.record(sent, compacted)
            if not len(self._backlog):
                feed.settle()
        self.done += batches
        self._in_flight = (0, 0)

    def _as_given(self, batches: list[Any]) -> list[Any]:
        """Each batch encoded as it is and sent; one the encoder rejects is lost,
        visibly.  With a recorder, each is encoded and recorded in one pass where
        it can be (:meth:`Feed.encode`), else recorded here, in order: the batches
        left for :meth:`_finish` to record are then none."""
        feed = self.feed
        for batch in batches:
            payload = None if feed is None else feed.encode(batch)
            if payload is None:
                if feed is not None:
                    feed.record((batch,))
                try:
                    payload = self._encoder.encode(batch)
                except Exception as exc:
                    self._encode_failed(exc)
                    continue
            self._stream.emit(payload, event_count(batch))
        return batches if feed is None else []

    def _compacted(self, window: list[Any], fold_only: bool, timed: bool = False) -> list[Any]:
        """The rules (or the fold) on the event objects, then every result encoded
        and sent; if the rules cannot handle a value, or a result does not encode,
        the window as given.  Returns the batches sent.  ``timed``: the rules' cost
        per event sizes the next windows (:class:`RulesCost`)."""
        t0 = time.perf_counter()
        try:
            out, rep = self._compact(window, fold_only)
        except Exception as exc:  # a value the rules cannot handle: as given
            self._compaction_failed(exc)
            return self._as_given(window)
        try:
            payloads = [self._encoder.encode(b) for b in out]
        except Exception:  # one would not encode: the originals one by one
            return self._as_given(window)
        if timed and not fold_only:  # compaction and encoding, both holding the GIL
            cost = (time.perf_counter() - t0) / max(self._in_flight[1], 1)
            self.pacing.rules_cost.record(cost)
        for batch, payload in zip(out, payloads, strict=True):
            self._stream.emit(payload, event_count(batch))
        self.totals.add_pass(rep, fold_only=fold_only)
        return out

    def _compact(self, window: list[Any], fold_only: bool) -> tuple[list[Any], Any]:
        """:func:`compact_for_wire` (merged lists written as their encoding, which the
        recorder reads too) unless ``BlockMoved`` events are wanted."""
        move, accel = self._settings.move_events, self.accelerated
        certain = self._settings.parentless_copies
        if not move:
            return compact_for_wire(
                window, fold_only=fold_only, accelerated=accel, parentless_copies=certain
            )
        return compact(
            window,
            move_events=move,
            fold_only=fold_only,
            accelerated=accel,
            parentless_copies=certain,
        )

    def _parts(self, batch: Any) -> list[Any]:
        """The rules on each ``max_events_per_step`` events of ``batch`` in turn (each a
        batch of its own, sent in order, the GIL handed over between them)."""
        step, events, sent = self._settings.max_events_per_step, batch.events, []
        for i in range(0, len(events), step):
            part = msgspec.structs.replace(batch, events=events[i : i + step])
            sent += self._compacted([part], fold_only=False)
            self.pacing.maybe_yield()
            self.pacing.keep_budget_free()  # between parts (as _step)
        return sent

    def _with_next(self, taken: list[Any]) -> list[Any]:
        """``taken`` and the next batch waiting, if one is (no loss between them): one
        encode holds the GIL for both, so while the engine publishes a batch in each
        of its turns the sender drains two in each of its own."""
        backlog = self._backlog
        if not backlog.next_is_batch():
            return taken
        before = backlog.events_out
        nxt = backlog.take(1)  # one batch: the oldest item is not a loss marker
        assert isinstance(nxt, list)
        batches, events = self._in_flight
        self._in_flight = (batches + len(nxt), events + backlog.events_out - before)
        return taken + nxt

    # -- losses and the resync ---------------------------------------------------------

    def _lost(self, marker: Any) -> None:
        """A loss marker of the backlog: the stream shows the loss; the recorder
        still gets what was refused."""
        self._stream.lose()
        if self.resync is not None:
            self.resync.after_loss(marker)

    def _encode_failed(self, exc: BaseException) -> None:
        self.totals.encode_failures += 1
        self._stream.lose()
        what = "a batch could not be encoded and is lost"
        self.limited.failure("encode", what, exc, self.loss_told)

    def _compaction_failed(self, exc: BaseException) -> None:
        self.totals.compaction_failures += 1
        what, then = "a window could not be compacted", "its batches are sent as they are"
        self.limited.failure("compact", what, exc, then)

    def _abandon(self, why: str) -> None:
        batches, events = self._backlog.drain()  # (counted as dropped there)
        self.done += batches
        if batches:
            self._stream.lose()
            log.warning(
                "kv-coalesce: %s: %d batches (%d events) abandoned; %s",
                why,
                batches,
                events,
                self.loss_told,
            )

    def _die(self, exc: BaseException) -> None:
        """The loop failed: refuse all later batches, count what waits, show the loss."""
        self.failed = True
        self._backlog.refuse_all()
        log.error(
            "kv-coalesce: the sender thread failed; publish() now drops every batch (%s)",
            self.loss_told,
            exc_info=exc,
        )
        # The window being handled is counted lost (part of it may have gone out:
        # then it is counted twice, never zero times).
        batches, events = self._in_flight
        self._in_flight = (0, 0)
        self._backlog.abandon(batches, events)
        self.done += batches
        try:
            self._stream.lose()
            self._abandon("sender failed")
            self._stream.show_loss()
        except Exception:  # the socket itself is broken: nothing more can be said on it
            log.exception("kv-coalesce: could not show the final loss")
