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
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

from coalesce._backlog import Backlog, is_loss
from coalesce._coalescer import AS_IS, COMPACT, GAP, INVALIDATE, RECORD, CoalescerProcess
from coalesce._payoff import Payoff
from coalesce._policy import (
    YIELD_EVERY,
    GilSlice,
    folding_pays,
    rules_window,
    sends_whole,
)
from coalesce._replay import ReplayBuffer, ReplayService
from coalesce._settings import Settings
from coalesce._snapshot import HEARTBEAT, SnapshotService
from coalesce._stream import Stream
from coalesce._wire import Encoder, SendMessage, is_native, message_sender, open_sockets
from coalesce.compactor import (
    PAYLOAD_RELEASE_AT,
    accelerated,
    compact,
    compact_for_wire,
    compact_payload,
    compactable,
    rule_stats,
)

__all__ = ["Level", "PayloadWorker", "Sender"]

log = logging.getLogger("coalesce")

IDLE_POLL = 0.005
"""Seconds an idle sender sleeps before looking again (at replay and snapshot
requests, a coalescer process's health, heartbeats).  ``publish()`` wakes it at
once."""

PIPE_TIMEOUT = 10.0
"""Seconds the sender waits for room in a coalescer process's pipe before it stops
that process and publishes from the engine's process itself."""

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


class RateLimited:
    """Log at most one line per ``period`` seconds per key, counting the rest."""

    def __init__(self, period: float = 10.0) -> None:
        self._period = period
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self._period) < self._period:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        if n:
            msg += " (%d similar messages suppressed)"
            args = (*args, n)
        log.log(level, msg, *args)


@dataclass(slots=True)
class Totals:
    """The sender's counters: written by the sender thread only, read by ``stats()``.

    Named as the ``PublisherStats`` fields they become, so ``stats()`` passes
    them through without a mapping; the compaction counters are added by name
    from each report (:func:`coalesce.compactor.rule_stats`).
    """

    abandoned_batches: int = 0
    abandoned_events: int = 0
    batches_folded: int = 0
    blocks_cancelled: int = 0
    blocks_moved: int = 0
    compaction_failures: int = 0
    compaction_passes: int = 0
    encode_failures: int = 0
    events_merged: int = 0
    events_superseded: int = 0
    fold_only_passes: int = 0
    payload_passes: int = 0
    resync_events: int = 0
    resyncs: int = 0
    rules_skipped: int = 0

    def add_pass(self, report: Any, fold_only: bool) -> None:
        self.compaction_passes += 1
        self.fold_only_passes += fold_only
        for field, stat in _RULE_STATS:
            setattr(self, stat, getattr(self, stat) + getattr(report, field))

    def add_payload(self, superseded: int, cancelled: int, merged: int) -> None:
        self.events_superseded += superseded
        self.blocks_cancelled += cancelled
        self.events_merged += merged

    def add_abandoned(self, batches: int, events: int) -> None:
        self.abandoned_batches += batches
        self.abandoned_events += events

    def published(self) -> dict[str, Any]:
        """The counters that are ``PublisherStats`` fields as they are."""
        return {f.name: getattr(self, f.name) for f in _PUBLISHED}


_RULE_STATS = rule_stats()
_PUBLISHED = [f for f in fields(Totals) if not f.name.startswith("abandoned")]


class PayloadWorker:
    """A helper thread that runs :func:`compact_payload` on one payload at a time.

    The C payload rules release the GIL, so while this thread compacts window
    N the sender thread folds and encodes window N+1: the sender's serial work
    stays what folding and encoding cost.  It touches nothing of the sender's
    (it returns the result; the sender thread alone sends, records and counts),
    so a late or dead helper can only make the sender send a window
    uncompacted, never lose or reorder one.
    """

    def __init__(self) -> None:
        self._job: bytes | None = None
        self._result: tuple[bytes, int, int, int, int] | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._stop = False
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="coalesce-compactor", daemon=True)
        self._thread.start()

    def submit(self, payload: bytes) -> None:
        """Start compacting ``payload`` (only when not :attr:`busy`).  O(1)."""
        self._job, self._result, self.busy = payload, None, True
        self._done.clear()
        self._ready.set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (GIL released) for the submitted job."""
        return self._done.wait(timeout)

    def take(self) -> tuple[bytes, int, int, int, int] | None:
        """The finished job's result (None: it declined or failed).  Only after
        :meth:`wait` said True.  O(1)."""
        self.busy = False
        return self._result

    def stop(self) -> None:
        self._stop = True
        self._ready.set()

    def _run(self) -> None:
        while True:
            self._ready.wait()
            self._ready.clear()
            if self._stop:
                return
            try:
                job, self._job = self._job, None
                self._result = None if job is None else compact_payload(job)
            except BaseException:  # MemoryError, say: the sender sends it uncompacted
                self._result = None
            self._done.set()


WORKER_TIMEOUT = 10.0
"""Seconds the sender waits for the helper's result before sending the window
uncompacted (the C work is O(bytes): only a machine starved of CPU gets near it)."""


@dataclass(slots=True)
class _Pending:
    """A window whose payload the helper is compacting: sent and recorded when done."""

    payload: bytes
    n_events: int
    batches: list[Any]  # what the recorder sees, in order
    window: int  # input batches it finishes
    events_in: int


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
        link: CoalescerProcess | None = None,
    ) -> None:
        self._rank = rank
        self._encoder = Encoder(publisher_id)
        self._stream = Stream.of_rank(
            None,
            topic,
            buffer,
            self._encoder,
            rank,
            settings.loss_marker,
            beats=publisher_id is not None and link is None,  # else the process beats
        )
        self._pub: zmq.Socket[bytes] | None = None
        self._send_message: SendMessage | None = None
        self._native_send = False
        if pub is not None:
            self._use_pub(pub)
        self._link = link
        """The coalescer process that sends for this one (``coalescer="process"``), until
        it fails: then this thread binds the endpoints and sends itself."""
        self._router = router
        self._topic = topic
        self._backlog = backlog
        self._buffer = buffer
        self._settings = settings
        self.replay = (
            None if router is None else ReplayService.from_settings(router, buffer, topic, settings)
        )
        self.snapshot = snapshot
        self._record = None if snapshot is None else snapshot.record
        self._publisher_id = publisher_id
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
        self._escalated = False  # this pressure episode is fold-only
        self._payoff = Payoff()  # whether the rules level's rules pay (object path)
        self._payoff_big = Payoff()  # the same, on single batches larger than a window
        # The rules on the encoded window (C, mostly without the GIL), unless the
        # accelerator is not built or BlockMoved events are wanted (object rules only).
        self._payload_rules = (
            settings.compaction
            and settings.payload_rules
            and not settings.move_events
            and accelerated()
            and link is None
        )
        self._worker: PayloadWorker | None = None  # started at the first big payload
        self._pending: _Pending | None = None
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
            if self._worker is not None:
                self._worker.stop()
            if self.replay is not None:
                self.replay.close()
            if self.snapshot is not None:
                self.snapshot.close()
            if self._link is not None:  # it sends what it has, then exits
                self._link.stop(self._settings.shutdown_timeout)
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
            # (a fallback from a coalescer process may start these)
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
            if self._pending is not None:  # nothing else to do: finish the helper's window
                self._finish_pending()
                continue
            if self._link is not None and not self._link.alive():
                self._fall_back()
                continue
            if (
                self._stream.beats  # (snapshots on, and no coalescer process beating)
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
        self._finish_pending()
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
        :func:`rules_window`), and apply every rule.  On the event objects (the
        default) the rules run only while they are not timed clearly dearer
        than folding alone on this stream (:mod:`coalesce._payoff`); otherwise
        the window, 4x larger, is only folded, as at the fold-only level (a
        window of big batches, ``FOLD_GAINS_BELOW``, is sent batch by batch).  A single batch larger
        than a window is compacted in parts of a window each under the same
        test, or encoded as it is (one encode: the longest GIL hold; past
        ``WHOLE_FROM`` of the budget, with the next batch folded in:
        :func:`sends_whole`).  With
        ``payload_rules`` (and the C accelerator, and no ``move_events``) or
        a coalescer process, the rules run on the encoded window, mostly
        without the GIL, so the GIL is held for folding and encoding only;
        there a pass that loses ground (more events pending after it than
        before), or more than ``fold_only_events`` pending, moves to the
        fold-only level, 4x larger windows, until the backlog is back under
        the watermark.  Flushing (``shutdown()``) is at the fold-only level.
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
        on_bytes = self._payload_rules or self._link is not None
        if settings.compaction and (flushing or waiting > settings.high_watermark):
            escalate = flushing or (
                on_bytes and (self._escalated or events_before > settings.fold_only_events)
            )
            level = Level.FOLD_ONLY if escalate else Level.RULES
        else:
            self._escalated = False
        if level != self._level:
            if level > self._level and not flushing:
                self.limited.log(
                    logging.INFO,
                    f"level{int(level)}",
                    "kv-coalesce: sender behind (%d batches, %d events waiting): %s",
                    waiting,
                    events_before,
                    "compacting" if level == Level.RULES else "escalating to fold-only",
                )
            self._level = level
        taken_events = backlog.events_out
        if level == Level.ONE_TO_ONE:
            self._finish_pending()  # sent and recorded before anything taken after it
            item = backlog.take_one()
            if is_loss(item):
                self._lost(item)
                return
            assert isinstance(item, tuple)
            near = self._keeps_gil()  # once taken, as a whole send decides
            self._send_taken(item[0], item[1])
            self._record_sent([item[0]], near)
            return
        step = settings.max_events_per_step * (4 if level == Level.FOLD_ONLY else 1)
        rules = level == Level.RULES and (on_bytes or self._payoff.rules_next())
        if level == Level.RULES and not rules:
            step *= 4  # the fold-only way: the fold-only level's windows
        elif rules and not on_bytes:
            step = self._rules_window(step)
        window = backlog.take(step)
        if is_loss(window):
            self._lost(window)
            return
        assert isinstance(window, list)
        self._in_flight = (len(window), backlog.events_out - taken_events)
        if on_bytes:  # records and finishes it itself
            self._send_payload_window(window, self._in_flight[1], level == Level.FOLD_ONLY)
        else:
            near = self._keeps_gil()  # once taken, as a whole send decides
            self._record_sent(self._send_object_window(window, level, step, rules), near)
            self.done += len(window)
        self._in_flight = (0, 0)
        if level == Level.RULES and on_bytes and backlog.pending_events >= events_before:
            # The rules on the bytes lost ground: fold only.  (On the objects, the
            # rules level measures whether the rules pay, window by window.)
            self._escalated = True

    def _rules_window(self, step: int) -> int:
        """:func:`rules_window` for this moment: the rest of this slice, the rules'
        median cost on this stream.  O(1)."""
        room = self._gil.room(time.perf_counter(), self._pending_for_budget())
        return rules_window(step, self._payoff.costs()[0], room)

    def _stage_if_behind(self) -> None:
        """Under pressure, free the batch budget (O(1) per batch staged)."""
        if self._backlog.pending > self._settings.high_watermark:
            self._backlog.stage()

    def _send_payload_window(self, window: list[Any], events_in: int, fold_level: bool) -> None:
        """Fold the window, encode it once, and run the rules on the encoded bytes.

        The GIL is held for the fold and the encode, what fold-only costs.
        The rules run in C on the payload (the same bytes the object rules
        would send): a big one in the helper thread without the GIL, while
        this thread goes on with the next window; a payload they decline goes
        out as it was folded.  The window's batches reach the recorder when
        its message is sent (the same final state as the compacted events).
        """
        batches, folded = window, 0
        if len(window) > 1:
            try:
                batches, rep = compact(window, fold_only=True)
            except Exception as exc:  # a value the fold cannot handle: send as given
                self._compaction_failed(exc)
                self._send_as_given(window)
                return
            folded = rep.folded
        try:
            payloads = [self._encoder.encode(b) for b in batches]
        except Exception:  # the originals one by one: the bad one is lost, visibly
            self._send_as_given(window)
            return
        self.totals.batches_folded += folded
        self.totals.compaction_passes += 1
        self.totals.fold_only_passes += fold_level
        if self._link is not None:  # the coalescer process runs the rules
            for b, payload in zip(batches, payloads, strict=True):
                self._emit_now(payload, _n_events(b), COMPACT)
            self._finished(batches, len(window))
            return
        self._finish_pending()  # the previous window goes out first
        if len(payloads) == 1 and len(payloads[0]) >= PAYLOAD_RELEASE_AT:
            worker = self._worker
            if worker is None:
                worker = self._worker = PayloadWorker()
            if not worker.busy:
                worker.submit(payloads[0])
                self._pending = _Pending(
                    payloads[0], _n_events(batches[0]), batches, len(window), events_in
                )
                return
        for b, payload in zip(batches, payloads, strict=True):
            self._send_compacted(payload, _n_events(b), compact_payload(payload))
        self._finished(batches, len(window))

    def _send_compacted(
        self, payload: bytes, n: int, result: tuple[bytes, int, int, int, int] | None
    ) -> None:
        """Send a payload as the payload rules left it (or as it was, if they declined)."""
        t = self.totals
        if result is not None:
            payload, n, superseded, cancelled, merged = result
            t.add_payload(superseded, cancelled, merged)
            t.payload_passes += 1
            if n == 0:
                return  # everything cancelled: nothing to send (as compact())
        self._emit_now(payload, n)

    def _send_as_given(self, window: list[Any]) -> None:
        """After the helper's window, send a window batch by batch as it was given
        (each encodes, or is lost visibly), and finish with it."""
        self._finish_pending()  # first, even if nothing of this window encodes
        self._send_each(window)
        self._finished(window, len(window))

    def _finished(self, batches: list[Any], window: int) -> None:
        """A window's message is out: the recorder sees its batches; it is done."""
        self._record_sent(batches, self._keeps_gil())
        self.done += window

    def _keeps_gil(self) -> bool:
        """Whether the recorder keeps the GIL for what is sent (or refused) now:
        snapshots on and :func:`sends_whole`.  Handing it over there let the
        engine publish between the sender's turns faster than they drained.
        O(1)."""
        return self._record is not None and self._sends_whole()

    def _record_sent(self, batches: list[Any], keep_gil: bool) -> None:
        """The recorder (if snapshots are on) sees ``batches``, just sent, with the
        GIL kept throughout if ``keep_gil`` (:meth:`_keeps_gil` when they were
        taken).  O(hashes)."""
        record = self._record
        if record is None:
            return
        for b in batches:
            record(b, keep_gil)

    def _finish_pending(self) -> None:
        """Send the window the helper has been compacting (waiting for it if need be).
        Called before anything else is sent, lost or recorded, so order is kept."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        worker = self._worker
        assert worker is not None
        deadline = time.monotonic() + WORKER_TIMEOUT
        result = None
        while not worker.wait(0.001):
            self._stage_if_behind()  # meanwhile, keep the batch budget free (as _step does)
            if time.monotonic() > deadline:
                break  # abandoned: it stays busy, later windows are compacted inline
        else:
            result = worker.take()
        self._send_compacted(pending.payload, pending.n_events, result)
        self._finished(pending.batches, pending.window)

    def _send_object_window(
        self, window: list[Any], level: Level, step: int, rules: bool
    ) -> list[Any]:
        """The rules on the event objects (C or Python), then encode: the path when
        the payload path is off.  Returns the batches the recorder must see.

        At the rules level the rules run only while they are not clearly dearer
        than folding alone, as timed on this stream's recent windows
        (:mod:`coalesce._payoff`); otherwise the window is only folded
        (``rules_skipped``)."""
        if level == Level.RULES and len(window) == 1 and _n_events(window[0]) > step:
            return self._send_big(window[0], self._settings.max_events_per_step)
        if level == Level.FOLD_ONLY and len(window) == 1:
            # nothing to fold: compact() would only classify every event to return it
            self._send_one(window[0], self._in_flight[1])
            return window
        fold_pays = folding_pays(self._in_flight[1], len(window))
        t0 = time.perf_counter()
        if not rules and not fold_pays:  # big batches: folding them costs more than it saves
            out, rep = window, None
        else:
            try:
                out, rep = self._compact(window, fold_only=not rules)
            except Exception as exc:  # a value the rules cannot handle: send the window as given
                self._compaction_failed(exc)
                self._send_each(window)
                return window
        payloads = self._encode_all(out)
        if payloads is None:  # one would not encode: the originals one by one
            self._send_each(window)
            return window
        if level == Level.RULES:  # compaction and encoding, both holding the GIL
            cost = (time.perf_counter() - t0) / max(self._in_flight[1], 1)
            self._payoff.record(rules, cost, self._pressed())
            self.totals.rules_skipped += not rules
        for b, payload in zip(out, payloads, strict=True):
            self._emit(payload, _n_events(b))
        if rep is not None:
            self.totals.add_pass(rep, fold_only=level == Level.FOLD_ONLY)
        return out

    def _compact(self, window: list[Any], fold_only: bool) -> tuple[list[Any], Any]:
        """The rules (or the fold) on the event objects: :func:`compact_for_wire`
        (merged lists written as their encoding) unless a recorder reads the result
        or ``BlockMoved`` events are wanted.  O(events + block hashes)."""
        if self._record is None and not self._settings.move_events:
            return compact_for_wire(window, fold_only=fold_only)
        return compact(window, move_events=self._settings.move_events, fold_only=fold_only)

    def _send_big(self, batch: Any, step: int) -> list[Any]:
        """One batch larger than a window, at the rules level: the rules on each
        ``step`` events of it in turn (each a batch of its own, sent in order,
        the GIL handed over between them), while they pay on such batches
        (a :class:`Payoff` of their own) and the backlog is not near the event
        budget; else sent as it is, in one encode (near the budget,
        :func:`sends_whole`, with the next batch waiting folded into it).
        Returns the batches the recorder must see."""
        n = self._in_flight[1]
        if self._sends_whole():  # the engine goes at the sender's pace (not timed)
            return self._send_whole(batch, n)
        events = batch.events
        # (not a KV batch: never cut in parts; the check, O(events) in C, only when
        # the rules would run)
        if not (self._payoff_big.rules_next() and compactable(batch)):
            t0 = time.perf_counter()
            encoded = self._encode_all([batch])
            if encoded is None:
                self._send_one(batch, n)  # lost, visibly
                return [batch]
            self._payoff_big.record(False, (time.perf_counter() - t0) / max(n, 1), self._pressed())
            self._emit(encoded[0], n)
            return [batch]
        sent: list[Any] = []
        spent = 0.0
        for i in range(0, len(events), step):
            t0 = time.perf_counter()
            part = msgspec.structs.replace(batch, events=events[i : i + step])
            out, payloads, rep = self._compact_encode([part], fold_only=False)
            spent += time.perf_counter() - t0
            if payloads is None:  # this part as given (encoded, or lost visibly)
                self._send_one(part, len(part.events))
                sent.append(part)
            else:
                self._emit_all(out, payloads, rep, fold_only=False)
                sent += out
            self._maybe_yield()
            self._stage_if_behind()  # between parts, keep the batch budget free (as _step)
        self._payoff_big.record(True, spent / max(n, 1), self._pressed())
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
            self._emit(payload, _n_events(b))
        if rep is not None:
            self.totals.add_pass(rep, fold_only=fold_only)

    def _lost(self, marker: Any) -> None:
        """A loss marker of the backlog: the stream shows the loss; the recorder
        still gets what was refused."""
        self._finish_pending()  # the loss comes after the window before it
        self._stream.lose()
        link = self._link
        if link is not None and self._publisher_id is not None:  # its recorder sees them
            self._record_remotely(link, marker)
            return
        snapshot = self.snapshot
        if snapshot is not None:
            keep_gil = self._keeps_gil()  # as _record_sent: a loss is at the budget
            for b in marker.refused or ():
                snapshot.record(b, keep_gil)
            if marker.overflow:
                snapshot.invalidate("more batches refused than the record bound keeps")
            if (
                self._settings.loss_marker == "resync"
                and snapshot.recorder.held * RESYNC_SHARE <= self._backlog.max_events
            ):
                snapshot.start_resync()  # (not while it is inexact, or a reply is built)

    def _resync_step(self, snapshot: SnapshotService) -> None:
        """Send the next chunk of an in-band resync: the recorder's state after a loss
        marker, a chunk (at most CHUNK_BLOCKS blocks) a step, before any later batch.
        One cut short (shutdown, or a recorded event that does not rebuild) may have
        sent an ancestor the state does not hold: another marker follows it."""
        if self.closed:
            snapshot.abandon_resync()
            self._stream.lose()
            return
        try:
            chunk = snapshot.resync_chunk()
            payload = None if chunk is None else self._encoder.encode_now(chunk, self._rank)
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
        if chunk is None or payload is None:
            self.totals.resyncs += 1
            return
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

    def _slice(self) -> float:
        """:func:`~coalesce._policy.yield_slice` now.  O(1)."""
        return self._gil.length(self._pending_for_budget())

    def _pressed(self) -> bool:
        """:func:`~coalesce._policy.pressed` now.  O(1)."""
        return self._gil.pressed(self._pending_for_budget())

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
        self._send_message = message_sender(pub)
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
            self._send_one(b, _n_events(b))

    def _send_one(self, batch: Any, n_events: int) -> None:
        """Encode and send one batch; a batch the encoder rejects is lost, visibly."""
        try:
            payload = self._encoder.encode(batch)
        except Exception as exc:
            self._encode_failed(exc)
            return
        self._emit(payload, n_events)

    def _emit(self, payload: bytes, n_events: int) -> None:
        """Send one message after the helper's window, if one is waiting."""
        self._finish_pending()
        self._emit_now(payload, n_events)

    def _emit_now(self, payload: bytes, n_events: int, kind: int = AS_IS) -> None:
        """Send one message: here, or through the coalescer process (``kind`` says
        whether it runs the rules on it)."""
        link = self._link
        if link is not None and self._push(link, kind, n_events, payload):
            return
        self._stream.emit(payload, n_events)  # holding the GIL where it can (_wire)

    # -- the coalescer process ---------------------------------------------------

    def _push(self, link: CoalescerProcess, kind: int, n_events: int, payload: bytes) -> bool:
        """Hand a message to the coalescer process (after the loss, if one is
        pending: the process shows it).  While its pipe is full, wait (GIL
        released) in 1 ms slices, keeping the batch budget free; False if the
        process has gone or stays stuck for PIPE_TIMEOUT seconds: then this
        thread sends from now on (after a loss)."""
        if self._stream.loss_pending:
            if not self._push_one(link, GAP, 0, None):
                return False
            self._stream.hand_on_loss()
        return self._push_one(link, kind, n_events, payload)

    def _push_one(
        self, link: CoalescerProcess, kind: int, n_events: int, payload: bytes | None
    ) -> bool:
        deadline = wait = 0.0
        while not link.push(kind, n_events, payload):
            now = time.monotonic()
            if not deadline:  # shutting down: no longer than the flush may take
                wait = PIPE_TIMEOUT
                if self.closed:
                    wait = min(wait, self._settings.shutdown_timeout)
                deadline = now + wait
            if not link.alive():
                self._fall_back()
                return False
            if now > deadline:
                self._fall_back(f"took nothing from its pipe for {wait:g} s: killed")
                return False
            self._stage_if_behind()
            link.wait_writable(0.001)
        return True

    def _record_remotely(self, link: CoalescerProcess, marker: Any) -> None:
        """Hand the coalescer process's recorder the batches refused over budget
        (encoded: the engine pays their encoding, as it would have paid for sending
        them), or tell it it cannot be exact."""
        why = ""
        for b in marker.refused or ():
            try:
                payload = self._encoder.encode(b)
            except Exception as exc:
                why = f"a refused batch could not be encoded ({type(exc).__name__})"
                break
            if not self._push_one(link, RECORD, _n_events(b), payload):
                return  # fell back: that recorder is gone anyway
        if marker.overflow:
            why = "more batches refused than the record bound keeps"
        if why:
            self._invalidate_remotely(link, why)

    def _invalidate_remotely(self, link: CoalescerProcess, why: str) -> None:
        self._push_one(link, INVALIDATE, 0, why.encode())

    def _fall_back(self, why: str = "") -> None:
        """The coalescer process has failed: bind its endpoints here and send on
        after its last seq, with a loss (what was in its pipe, or being compacted,
        is lost; so is its replay buffer)."""
        link = self._link
        assert link is not None
        last = link.dead()
        self._stream.carry_on(last)
        log.error(
            "kv-coalesce: the coalescer process (pid %d) %s; the sender thread publishes "
            "on %s itself from now on, after a loss: %s",
            link.pid,
            why or f"exited with code {link.returncode}",
            link.endpoint,
            self.loss_told,
        )
        self._link = None
        socks = open_sockets(
            link.endpoint,
            link.replay_endpoint,
            link.snapshot_endpoint,
            hwm=link.hwm,
            replay_window=self._settings.replay_window,
        )
        self._use_pub(socks.pub)
        self._router = socks.router
        if socks.snapshot is not None:  # a new recorder, unavailable until a clear
            assert self._publisher_id is not None
            self.snapshot = SnapshotService.from_settings(
                socks.snapshot, self._publisher_id, self._rank, self._settings
            )
            self.snapshot.invalidate("the coalescer process and its recorder are gone")
            self._record = self.snapshot.record
            self._stream.beats = True
        if socks.router is not None:
            self.replay = ReplayService.from_settings(
                socks.router, self._buffer, self._topic, self._settings
            )

    def published(self) -> dict[str, Any]:
        """The counters that are ``PublisherStats`` fields (the coalescer process's for
        what it does, while there is one).  O(1)."""
        out = self.totals.published()
        out.update(self._stream.published())
        out["native_send"] = self._native_send
        replay, snapshot = self.replay, self.snapshot
        out.update(replay.published() if replay is not None else ReplayService.NOTHING)
        out.update(snapshot.published() if snapshot is not None else SnapshotService.NOTHING)
        link = self._link
        if link is not None:
            out.update(link.published())
        return out

    def drained(self) -> bool:
        """Everything handed to a coalescer process has been taken by it."""
        link = self._link
        return link is None or link.drained()

    # -- losses ------------------------------------------------------------------

    def _encode_failed(self, exc: BaseException) -> None:
        self.totals.encode_failures += 1
        self._stream.lose()
        link = self._link
        if link is not None and self._publisher_id is not None:  # its recorder misses it
            self._invalidate_remotely(link, f"a batch could not be encoded ({type(exc).__name__})")
        self.limited.warning(
            "encode",
            "kv-coalesce: a batch could not be encoded and is lost (%s: %.200s); %s",
            type(exc).__name__,
            exc,
            self.loss_told,
        )

    def _show_loss(self) -> None:
        """Show a pending loss now, with no message to follow it (else it would stay
        invisible): here, or through the coalescer process, which shows it before an
        empty batch."""
        if not self._stream.loss_pending:
            return
        if self._link is not None:
            self._emit(self._encoder.encode_now([], self._rank), 0)
        else:
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
        self._finish_pending()
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
        pending, self._pending = self._pending, None
        if pending is not None:  # not sent: the helper's result is ignored
            batches += pending.window
            events += pending.events_in
        self.totals.add_abandoned(batches, events)
        self.done += batches
        try:
            self._stream.lose()
            self._abandon("sender failed")
            self._show_loss()
        except Exception:  # the socket itself is broken: nothing more can be said on it
            log.exception("kv-coalesce: could not show the final loss")


def _n_events(batch: Any) -> int:
    """Events in a batch as it is now (0 if a caller replaced its list by something else)."""
    try:
        return len(batch.events)
    except Exception:
        return 0
