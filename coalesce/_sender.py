"""The sender thread: backlog -> compact -> encode -> send -> replay buffer.

:class:`Sender` owns the sockets, the sequence counter, the ladder level and
its counters; the publisher facade only reads them (``stats()``) and sets
:attr:`Sender.closed`.  The thread holds no reference to the facade, so a
publisher dropped without ``shutdown()`` can be collected, and its finaliser
stops the thread.

Every message goes out through its :class:`coalesce._stream.Stream`, the one
place that assigns seqs, shows losses (a loss marker or a skipped seq) and
keeps messages for replay.

Nothing a caller can put in a batch stops this thread.  A window the
compactor rejects (it raises on a value of a type it cannot handle) is sent
batch by batch as it was given; a batch the encoder rejects is lost visibly.
If the loop itself ever fails, the thread marks itself dead, the backlog
refuses every later batch (``publish()`` returns ``DROPPED``), what was
waiting is counted as dropped, and the stream shows that loss at once.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Any

import msgspec
import zmq

from coalesce._backlog import Backlog, is_loss
from coalesce._kinds import event_count
from coalesce._policy import (
    YIELD_EVERY,
    GilSlice,
    RulesCost,
    rules_window,
    sends_whole,
)
from coalesce._replay import ReplayBuffer, ReplayService
from coalesce._settings import Settings
from coalesce._snapshot import HEARTBEAT, SnapshotService
from coalesce._stream import Stream
from coalesce._totals import RateLimited, Totals
from coalesce._wire import Encoder, SendMessage, is_native, message_sender
from coalesce.compactor import (
    compact,
    compact_for_wire,
    compactable,
)

__all__ = ["Level", "Sender"]

log = logging.getLogger("coalesce")

IDLE_POLL = 0.005
"""Seconds an idle sender sleeps before looking again (at replay and snapshot
requests, heartbeats).  ``publish()`` wakes it at
once."""

RESYNC_SHARE = 4
"""A resync starts only while the recorder holds at most 1/RESYNC_SHARE of the event
budget in blocks: what it sends after a loss is bounded by what the budget absorbs."""

SERVICE_POLL = 0.001
"""Seconds between looks at the replay and snapshot sockets while neither is
serving a reply.  A look (``ZMQ_EVENTS``) makes libzmq process its command
pipe, a system call: a few µs of the sender's CPU, which at every loop turn
(two or more per engine step) was taken from the engine for requests that come
once in minutes.  A request waits at most this long, or ``IDLE_POLL`` while
the sender sleeps."""


class Level(enum.IntEnum):
    """The ladder: what the sender does with the backlog (docs/backpressure.md)."""

    ONE_TO_ONE = 0
    """Each batch sent as it is: byte-identical to vLLM."""
    RULES = 1
    """Windows folded and run through every compaction rule."""
    FOLD_ONLY = 2
    """Windows (4x larger) only folded: drains at encoding speed."""


class Sender:
    """The sender thread and everything it owns.  See the module docstring."""

    def __init__(
        self,
        *,
        pub: zmq.Socket[bytes] | None,
        router: zmq.Socket[bytes] | None,
        topic: bytes,
        rank: int,
        backlog: Backlog,
        buffer: ReplayBuffer,
        settings: Settings,
        snapshot: SnapshotService | None = None,
        publisher_id: bytes | None = None,
    ) -> None:
        self._rank = rank
        self._encoder = Encoder()
        self._seq_tail = publisher_id or b""
        self._stream = Stream.of_rank(
            None,
            topic,
            buffer,
            self._encoder,
            rank,
            settings.loss_marker,
            beats=publisher_id is not None,
        )
        self._pub: zmq.Socket[bytes] | None = None
        self._send_message: SendMessage | None = None
        self._native_send = False
        if pub is not None:
            self._use_pub(pub)
        self._router = router
        self._backlog = backlog
        self._settings = settings
        self.replay = (
            None if router is None else ReplayService.from_settings(router, buffer, topic, settings)
        )
        self.snapshot = snapshot
        self.limited = RateLimited()
        self.totals = Totals()
        self.loss_told = {
            "clear": "subscribers are sent a loss marker (AllBlocksCleared)",
            "resync": "subscribers are sent a loss marker (AllBlocksCleared), then the state",
            "gap": "subscribers will see a sequence gap",
        }[settings.loss_marker]
        """What a loss's log line says subscribers learn (``loss_marker``; the facade's
        drop warning says it too)."""
        self._level = Level.ONE_TO_ONE
        self._rules_cost = RulesCost()  # sizes the rules windows
        self._gil = GilSlice(backlog.max_events)
        self._poll_at = 0.0  # when the replay and snapshot sockets are next looked at
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
        self._bell = threading.Lock()
        """Released = rung: the idle thread's ``acquire`` takes the ring (one lock
        release wakes it; an ``Event.set()`` costs about three times as much in the
        engine's thread: a ``Condition`` and its waiter list)."""
        self._bell.acquire()
        self._gate: threading.Event | None = None
        self._parked = threading.Event()
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

    def request_stop(self) -> None:
        """Ask the thread to flush and stop; returns at once.  Safe from any thread."""
        self.closed = True
        self.wake()

    # -- a test hook: hold the thread still --------------------------------------------

    def hold(self, timeout: float = 10.0) -> None:
        """Park the thread at the top of its loop until :meth:`release` (tests only).

        Returns once it is parked, so that nothing is taken from the backlog
        meanwhile: a deterministic stand-in for a sender that cannot get the GIL.
        """
        self._parked.clear()
        self._gate = threading.Event()
        self.wake()
        if not self._parked.wait(timeout):
            raise RuntimeError("the sender thread did not park")

    def release(self) -> None:
        """Let a held thread go on."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    # -- the loop ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug, or a broken socket: never a silent stop
            self._die(exc)
        finally:
            self.alive = False
            if self.replay is not None:
                self.replay.close()
            if self.snapshot is not None:
                self.snapshot.close()
            # What was sent must still reach subscribers: a linger, not 0 (which would
            # discard queued messages: a loss with no gap).  close() does not wait for
            # it; ZeroMQ's I/O thread delivers in the background.
            if self._pub is not None:
                self._pub.close(linger=int(self._settings.shutdown_timeout * 1000))
            if self._router is not None:
                self._router.close(linger=0)

    def _loop(self) -> None:
        backlog = self._backlog
        deadline: float | None = None
        while True:
            gate = self._gate
            if gate is not None:  # held by a test (hold()); one read otherwise
                self._parked.set()
                gate.wait()
            replay, snapshot = self.replay, self.snapshot
            did = False
            if replay is not None or snapshot is not None:
                now = time.monotonic()
                if (
                    now >= self._poll_at
                    or (replay is not None and replay.busy)
                    or (snapshot is not None and snapshot.busy)
                ):
                    self._poll_at = now + SERVICE_POLL
                    did = replay.step(self._replay_budget()) if replay is not None else False
                    if snapshot is not None and snapshot.step(self._stream.covered):
                        did = True
            if self.closed and deadline is None:
                deadline = time.monotonic() + self._settings.shutdown_timeout
            if snapshot is not None and snapshot.resyncing:  # before any later batch
                self._resync_step(snapshot)
                did = True
            elif len(backlog):
                if deadline is not None and time.monotonic() > deadline:
                    self._abandon("shutdown timeout")
                    break
                self._step(flushing=deadline is not None)
                did = True
            elif self.closed:
                backlog.mark_pending_loss()
                if not len(backlog):
                    break
            if did:
                self._maybe_yield()
                continue
            if (
                self._stream.beats  # (snapshots on)
                and not self.closed
                and time.monotonic() - self._stream.last_sent >= HEARTBEAT
            ):
                self._stream.heartbeat()
                continue
            self.idle = True
            if len(backlog) or self.closed:
                self.idle = False
                continue
            self._bell.acquire(timeout=IDLE_POLL)
            self.idle = False
        self._show_loss()

    def _replay_budget(self) -> int:
        """Replay messages this step may send: fewer while the live stream is behind."""
        assert self.replay is not None
        chunk = self.replay.chunk
        return chunk if self._backlog.waiting <= self._settings.high_watermark else chunk // 8

    def _step(self, flushing: bool) -> None:
        """One bounded unit of work: a 1:1 send, or one compaction window.

        The ladder: backlog at most ``high_watermark`` batches: send 1:1.
        Above it: fold, ``max_events_per_step`` events at a time (up to
        ``WIDEN_UP_TO`` x as many while the rest of the slice holds them:
        :func:`rules_window`), and apply every rule.  A single batch larger
        than a window is compacted in parts of a window each, or encoded as it
        is (one encode: the longest GIL hold; past ``WHOLE_FROM`` of the
        budget, with the next batch folded in: :func:`sends_whole`).  Flushing
        (``shutdown()``) is at the fold-only level: windows 4x larger, only
        folded.
        Past ``high_watermark`` batches in the hand-off deque, the sender
        first moves them to its staging deque, so that the
        batch budget (vLLM's ``max_queue_size``) is reached only by a sender
        that cannot run; the event budget still counts them.  Past a budget,
        ``publish()`` drops.
        """
        backlog, settings = self._backlog, self._settings
        self._stage_if_behind()
        waiting, events_before = backlog.waiting, backlog.pending_events
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
                    events_before,
                )
            self._level = level
        taken_events = backlog.events_out
        if level == Level.ONE_TO_ONE:
            item = backlog.take_one()
            if is_loss(item):
                self._lost(item)
                return
            assert isinstance(item, tuple)
            self._send_taken(item[0], item[1])
            self._record_sent([item[0]], compacted=False)
            return
        step = settings.max_events_per_step
        step = 4 * step if level == Level.FOLD_ONLY else self._rules_window(step)
        window = backlog.take(step)
        if is_loss(window):
            self._lost(window)
            return
        assert isinstance(window, list)
        self._in_flight = (len(window), backlog.events_out - taken_events)
        self._record_sent(self._send_window(window, level, step), level == Level.RULES)
        self.done += len(window)
        self._in_flight = (0, 0)

    def _rules_window(self, step: int) -> int:
        """:func:`rules_window` for this moment: the rest of this slice, the rules'
        median cost on this stream.  O(1)."""
        room = self._gil.room(time.perf_counter(), self._pending_for_budget())
        return rules_window(step, self._rules_cost.median(), room)

    def _stage_if_behind(self) -> None:
        """Under pressure, free the batch budget (O(1) per batch staged)."""
        if self._backlog.pending > self._settings.high_watermark:
            self._backlog.stage()

    def _record_sent(self, batches: list[Any], compacted: bool) -> None:
        """The recorder (if snapshots are on) sees ``batches``, just sent (``compacted``:
        by the rules); once nothing waits to be sent, it has seen all of it, before
        ``done`` counts them.  O(hashes), amortised."""
        snapshot = self.snapshot
        if snapshot is None:
            return
        snapshot.record(batches, compacted)
        if not len(self._backlog):
            snapshot.settle()

    def _send_window(self, window: list[Any], level: Level, step: int) -> list[Any]:
        """The rules (or, at the fold-only level, the fold) on the event objects (C
        or Python), then encode.  Returns the batches the recorder must see."""
        rules = level == Level.RULES
        if rules and len(window) == 1 and event_count(window[0]) > step:
            return self._send_big(window[0], self._settings.max_events_per_step)
        if not rules and len(window) == 1:
            # nothing to fold: compact() would only classify every event to return it
            self._send_one(window[0], self._in_flight[1])
            return window
        t0 = time.perf_counter()
        out, payloads, rep = self._compact_encode(window, fold_only=not rules)
        if payloads is None:  # one would not encode: the originals one by one
            self._send_each(window)
            return window
        if rules and rep is not None:  # compaction and encoding, both holding the GIL
            self._rules_cost.record((time.perf_counter() - t0) / max(self._in_flight[1], 1))
        self._emit_all(out, payloads, rep, fold_only=not rules)
        return out

    def _compact(self, window: list[Any], fold_only: bool) -> tuple[list[Any], Any]:
        """The rules (or the fold) on the event objects: :func:`compact_for_wire`
        (merged lists written as their encoding) unless a recorder reads the result
        or ``BlockMoved`` events are wanted.  O(events + block hashes)."""
        if self.snapshot is None and not self._settings.move_events:
            return compact_for_wire(window, fold_only=fold_only)
        return compact(window, move_events=self._settings.move_events, fold_only=fold_only)

    def _send_big(self, batch: Any, step: int) -> list[Any]:
        """One batch larger than a window, at the rules level: the rules on each
        ``step`` events of it in turn (each a batch of its own, sent in order,
        the GIL handed over between them) while the backlog is not near the
        event budget; else sent as it is, in one encode (near the budget,
        :func:`sends_whole`, with the next batch waiting folded into it).
        Returns the batches the recorder must see."""
        n = self._in_flight[1]
        if self._sends_whole():  # the engine goes at the sender's pace
            return self._send_whole(batch, n)
        if not compactable(batch):  # not a KV batch (O(events) in C): never cut in parts
            self._send_one(batch, n)
            return [batch]
        events = batch.events
        sent: list[Any] = []
        for i in range(0, len(events), step):
            part = msgspec.structs.replace(batch, events=events[i : i + step])
            out, payloads, rep = self._compact_encode([part], fold_only=False)
            if payloads is None:  # this part as given (encoded, or lost visibly)
                self._send_one(part, len(part.events))
                sent.append(part)
            else:
                self._emit_all(out, payloads, rep, fold_only=False)
                sent += out
            self._maybe_yield()
            self._stage_if_behind()  # between parts, keep the batch budget free (as _step)
        return sent

    def _send_whole(self, batch: Any, n: int) -> list[Any]:
        """Past ``WHOLE_FROM`` (:func:`sends_whole`): ``batch`` and the next batch
        waiting, if one is (no loss between them), folded into one message and
        encoded in one call; else ``batch`` as it is.  O(events of the two).

        One encode holds the GIL for both: the engine publishes a batch in each
        of its turns, and the sender drains two in each of its own, so a backlog
        this deep shrinks instead of holding.  Returns the batches the recorder
        must see."""
        backlog = self._backlog
        if not backlog.next_is_batch():
            self._send_one(batch, n)
            return [batch]
        taken = backlog.events_out
        nxt = backlog.take(1)  # one batch: the oldest item is not a loss marker
        assert isinstance(nxt, list)
        batches, events = self._in_flight
        self._in_flight = (batches + len(nxt), events + backlog.events_out - taken)
        pair = [batch, *nxt]
        out, payloads, rep = self._compact_encode(pair, fold_only=True)
        if payloads is None:  # one would not encode: each as given (or lost, visibly)
            out = pair
            self._send_each(pair)
        else:
            self._emit_all(out, payloads, rep, fold_only=True)
        self.done += len(nxt)  # (the caller counts ``batch``)
        return out

    def _compact_encode(
        self, given: list[Any], fold_only: bool
    ) -> tuple[list[Any], list[bytes] | None, Any]:
        """The rules (or the fold) on ``given``, then every result encoded:
        (batches, their payloads or None if one would not encode, the report or
        None).  A value the rules cannot handle leaves ``given`` as it was."""
        try:
            out, rep = self._compact(given, fold_only=fold_only)
        except Exception as exc:  # a value the rules cannot handle: as given
            self._compaction_failed(exc)
            out, rep = given, None
        return out, self._encode_all(out), rep

    def _emit_all(self, out: list[Any], payloads: list[bytes], rep: Any, fold_only: bool) -> None:
        """Send each batch of :meth:`_compact_encode`'s result, and count its pass."""
        for b, payload in zip(out, payloads, strict=True):
            self._emit(payload, event_count(b))
        if rep is not None:
            self.totals.add_pass(rep, fold_only=fold_only)

    def _lost(self, marker: Any) -> None:
        """A loss marker of the backlog: the stream shows the loss; the recorder
        still gets what was refused."""
        self._stream.lose()
        snapshot = self.snapshot
        if snapshot is not None:
            snapshot.record(marker.refused or ())
            if marker.overflow:
                snapshot.invalidate("more batches refused than the record bound keeps")
            if self._settings.loss_marker == "resync":
                snapshot.settle()
                if snapshot.recorder.held * RESYNC_SHARE <= self._backlog.max_events:
                    snapshot.start_resync()  # (not while it is inexact, or a reply is built)

    def _resync_step(self, snapshot: SnapshotService) -> None:
        """Send the next chunk of an in-band resync: the recorder's program after a
        loss marker, a chunk a step, before any later batch.  One cut short
        (shutdown, or an event that does not encode) may have sent stores the
        state does not hold: another marker follows it."""
        if self.closed:
            snapshot.abandon_resync()
            self._stream.lose()
            return
        try:
            chunk = snapshot.resync_chunk()
            payload = self._encoder.encode_now(chunk, self._rank) if chunk else None
        except Exception as exc:
            snapshot.abandon_resync()
            self._stream.lose()
            self.limited.warning(
                "resync",
                "kv-coalesce: a resync was cut short (%s: %.200s); %s",
                type(exc).__name__,
                exc,
                self.loss_told,
            )
            return
        if chunk is None:
            self.totals.resyncs += 1
            return
        if payload is None:
            return  # a step spent walking the recorder's keys
        self._emit(payload, len(chunk))
        self.totals.resync_events += len(chunk)

    def _maybe_yield(self) -> None:
        """Hand the GIL to the engine if the sender has held it for its turn
        (:class:`~coalesce._policy.GilSlice`).  O(1)."""
        gil, now = self._gil, time.perf_counter()
        if now - gil.began < YIELD_EVERY or not gil.due(now, self._pending_for_budget()):
            return
        time.sleep(0)
        # what the engine published while it had the GIL is in: a new turn
        gil.handed_over(time.perf_counter(), self._pending_for_budget())

    def _sends_whole(self) -> bool:
        """:func:`sends_whole` now.  O(1)."""
        return sends_whole(self._pending_for_budget(), self._backlog.max_events)

    def _pending_for_budget(self) -> int:
        """Events or batches pending, whichever is more: both count to the event budget."""
        backlog = self._backlog
        return max(backlog.pending_events, backlog.waiting)

    def _use_pub(self, pub: zmq.Socket[bytes]) -> None:
        """Send on ``pub`` from now on (the native send where it can: _wire)."""
        self._pub = pub
        self._send_message = message_sender(pub, self._seq_tail)
        self._native_send = is_native(self._send_message)
        self._stream.use(self._send_message)

    # -- encode and send ---------------------------------------------------------

    def _encode_all(self, batches: list[Any]) -> list[bytes] | None:
        """Every batch encoded, or None if one fails to (nothing is sent here)."""
        try:
            return [self._encoder.encode(b) for b in batches]
        except Exception:
            return None

    def _send_taken(self, batch: Any, n_events: int) -> None:
        """Send one batch taken from the backlog on its own, and finish with it."""
        self._in_flight = (1, n_events)
        self._send_one(batch, n_events)
        self.done += 1
        self._in_flight = (0, 0)

    def _send_each(self, batches: list[Any]) -> None:
        """Send batches one by one as they were given (each encodes, or is lost visibly)."""
        for b in batches:
            self._send_one(b, event_count(b))

    def _send_one(self, batch: Any, n_events: int) -> None:
        """Encode and send one batch; a batch the encoder rejects is lost, visibly."""
        try:
            payload = self._encoder.encode(batch)
        except Exception as exc:
            self._encode_failed(exc)
            return
        self._emit(payload, n_events)

    def _emit(self, payload: bytes, n_events: int) -> None:
        """Send one message (holding the GIL where it can: _wire)."""
        self._stream.emit(payload, n_events)

    def published(self) -> dict[str, Any]:
        """The counters that are ``PublisherStats`` fields.  O(1)."""
        out = self.totals.published()
        out.update(self._stream.published())
        out["native_send"] = self._native_send
        replay, snapshot = self.replay, self.snapshot
        out.update(replay.published() if replay is not None else ReplayService.NOTHING)
        out.update(snapshot.published() if snapshot is not None else SnapshotService.NOTHING)
        return out

    # -- losses ------------------------------------------------------------------

    def _encode_failed(self, exc: BaseException) -> None:
        self.totals.encode_failures += 1
        self._stream.lose()
        self.limited.warning(
            "encode",
            "kv-coalesce: a batch could not be encoded and is lost (%s: %.200s); %s",
            type(exc).__name__,
            exc,
            self.loss_told,
        )

    def _show_loss(self) -> None:
        """Show a pending loss now, with no message to follow it (else it would stay
        invisible)."""
        self._stream.show_loss()

    def _compaction_failed(self, exc: BaseException) -> None:
        self.totals.compaction_failures += 1
        self.limited.warning(
            "compact",
            "kv-coalesce: a window could not be compacted (%s: %.200s); "
            "its batches are sent as they are",
            type(exc).__name__,
            exc,
        )

    def _abandon(self, why: str) -> None:
        batches, events = self._backlog.drain()
        self.totals.add_abandoned(batches, events)
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
        self.totals.add_abandoned(batches, events)
        self.done += batches
        try:
            self._stream.lose()
            self._abandon("sender failed")
            self._show_loss()
        except Exception:  # the socket itself is broken: nothing more can be said on it
            log.exception("kv-coalesce: could not show the final loss")
