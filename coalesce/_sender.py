"""The sender thread: backlog -> compact -> encode -> send -> replay buffer.

:class:`Sender` owns the sockets, the sequence counter, the ladder level and
its counters; the publisher facade only reads them (``stats()``) and sets
:attr:`Sender.closed`.  The thread holds no reference to the facade, so a
publisher dropped without ``shutdown()`` can be collected, and its finaliser
stops the thread.

Nothing a caller can put in a batch stops this thread.  A window the
compactor rejects (it raises on a value of a type it cannot handle) is sent
batch by batch as it was given; a batch the encoder rejects is lost visibly
(a skipped seq).  If the loop itself ever fails, the thread marks itself dead,
the backlog refuses every later batch (``publish()`` returns ``DROPPED``),
what was waiting is counted as dropped, and one empty batch after a skipped
seq tells subscribers that the stream lost data.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import zmq

from coalesce._backlog import Backlog, is_loss
from coalesce._replay import ReplayBuffer, ReplayService
from coalesce._settings import Settings
from coalesce._snapshot import SnapshotService
from coalesce._wire import Encoder, send_message
from coalesce.compactor import compact, rule_stats

__all__ = ["Level", "Sender"]

log = logging.getLogger("coalesce")

IDLE_POLL = 0.005
"""Seconds an idle sender sleeps before looking again.  ``publish()`` wakes it only
under load (past ``high_watermark`` batches or ``max_events_per_step`` events),
because each wake-up is a GIL acquisition taken from the engine; so a lone small
batch may wait up to this long (CPython's own switch interval) before it is sent."""

HEARTBEAT = 1.0
"""Seconds of silence after which a publisher with snapshots on sends an empty batch
(it takes a seq, so a subscriber sees a lost tail within a second; PR #57789)."""

YIELD_EVERY = 0.0005
"""Seconds of continuous sender work after which it hands the GIL to the engine.
Yielding after every step makes each step a GIL handoff (two context switches);
never yielding lets the engine wait for CPython's 5 ms switch interval."""


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
    bytes_sent: int = 0
    compaction_failures: int = 0
    compaction_passes: int = 0
    encode_failures: int = 0
    events_merged: int = 0
    events_sent: int = 0
    events_superseded: int = 0
    fold_only_passes: int = 0
    messages_sent: int = 0
    seq_gaps: int = 0

    def add_pass(self, report: Any, fold_only: bool) -> None:
        self.compaction_passes += 1
        self.fold_only_passes += fold_only
        for field, stat in _RULE_STATS:
            setattr(self, stat, getattr(self, stat) + getattr(report, field))

    def add_abandoned(self, batches: int, events: int) -> None:
        self.abandoned_batches += batches
        self.abandoned_events += events

    def published(self) -> dict[str, Any]:
        """The counters that are ``PublisherStats`` fields as they are."""
        return {f.name: getattr(self, f.name) for f in _PUBLISHED}


_RULE_STATS = rule_stats()
_PUBLISHED = [f for f in fields(Totals) if not f.name.startswith("abandoned")]


class Sender:
    """The sender thread and everything it owns.  See the module docstring."""

    def __init__(
        self,
        *,
        pub: zmq.Socket[bytes],
        router: zmq.Socket[bytes] | None,
        topic: bytes,
        rank: int,
        backlog: Backlog,
        buffer: ReplayBuffer,
        settings: Settings,
        snapshot: SnapshotService | None = None,
        publisher_id: bytes | None = None,
    ) -> None:
        self._pub = pub
        self._router = router
        self._topic = topic
        self._rank = rank
        self._backlog = backlog
        self._buffer = buffer
        self._settings = settings
        self.replay = (
            None
            if router is None
            else ReplayService(
                router,
                buffer,
                topic,
                max_active=settings.replay_max_active,
                max_clients=settings.replay_max_clients,
            )
        )
        self.snapshot = snapshot
        self._record = None if snapshot is None else snapshot.record
        self._heartbeat = publisher_id is not None
        self._last_sent = time.monotonic()
        self._encoder = Encoder(publisher_id)
        self.limited = RateLimited()
        self.totals = Totals()
        self._seq = 0
        self._skip_pending = False
        self._level = Level.ONE_TO_ONE
        self._escalated = False  # this pressure episode is fold-only
        self._last_yield = 0.0
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
        self.wake_event = threading.Event()
        self._gate: threading.Event | None = None
        self._parked = threading.Event()
        self.thread = threading.Thread(target=self._run, name="coalesce-sender", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def request_stop(self) -> None:
        """Ask the thread to flush and stop; returns at once.  Safe from any thread."""
        self.closed = True
        self.wake_event.set()

    # -- a test hook: hold the thread still --------------------------------------------

    def hold(self, timeout: float = 10.0) -> None:
        """Park the thread at the top of its loop until :meth:`release` (tests only).

        Returns once it is parked, so that nothing is taken from the backlog
        meanwhile: a deterministic stand-in for a sender that cannot get the GIL.
        """
        self._parked.clear()
        self._gate = threading.Event()
        self.wake_event.set()
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
            self._pub.close(linger=int(self._settings.shutdown_timeout * 1000))
            if self._router is not None:
                self._router.close(linger=0)

    def _loop(self) -> None:
        backlog, replay, snapshot = self._backlog, self.replay, self.snapshot
        deadline: float | None = None
        while True:
            gate = self._gate
            if gate is not None:  # held by a test (hold()); one read otherwise
                self._parked.set()
                gate.wait()
            did = replay.step(self._replay_budget()) if replay is not None else False
            if snapshot is not None and snapshot.step(self._covered_seq):
                did = True
            if self.closed and deadline is None:
                deadline = time.monotonic() + self._settings.shutdown_timeout
            if len(backlog):
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
                self._heartbeat
                and not self.closed
                and time.monotonic() - self._last_sent >= HEARTBEAT
            ):
                self._send_empty()
                continue
            self.idle = True
            if len(backlog) or self.closed:
                self.idle = False
                continue
            self.wake_event.wait(IDLE_POLL)
            self.wake_event.clear()
            self.idle = False
        self._finish_loss()

    def _replay_budget(self) -> int:
        """Replay messages this step may send: fewer while the live stream is behind."""
        assert self.replay is not None
        chunk = self.replay.chunk
        return chunk if self._backlog.waiting <= self._settings.high_watermark else chunk // 8

    def _step(self, flushing: bool) -> None:
        """One bounded unit of work: a 1:1 send, or one compaction window.

        The ladder: backlog at most ``high_watermark`` batches: send 1:1.
        Above it: fold and apply every rule, ``max_events_per_step`` events at
        a time; a single batch larger than that is never run through the
        rules, only sent (one encode: the longest GIL hold).  If a pass of
        the rules loses ground (more events pending after it than before), or
        more than ``fold_only_events`` are pending: fold only, in 4x larger
        windows, which drains at encoding speed, until the backlog is back
        under the watermark.  Past ``high_watermark`` batches in the hand-off
        deque, the sender first moves them to its staging deque, so that the
        batch budget (vLLM's ``max_queue_size``) is reached only by a sender
        that cannot run; the event budget still counts them.  Past a budget,
        ``publish()`` drops.
        """
        backlog, settings = self._backlog, self._settings
        if backlog.pending > settings.high_watermark:
            backlog.stage()  # under pressure: free the batch budget (O(1) per batch)
        waiting, events_before = backlog.waiting, backlog.pending_events
        level = Level.ONE_TO_ONE
        if settings.compaction and (flushing or waiting > settings.high_watermark):
            escalate = flushing or self._escalated or events_before > settings.fold_only_events
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
        record = self._record
        if level == Level.ONE_TO_ONE:
            item = backlog.take_one()
            if is_loss(item):
                self._lost(item)
                return
            assert isinstance(item, tuple)
            self._send_taken(item[0], item[1])
            if record is not None:
                record(item[0])
            return
        step = settings.max_events_per_step * (4 if level == Level.FOLD_ONLY else 1)
        window = backlog.take(step)
        if is_loss(window):
            self._lost(window)
            return
        assert isinstance(window, list)
        self._in_flight = (len(window), backlog.events_out - taken_events)
        if level == Level.RULES and len(window) == 1 and _n_events(window[0]) > step:
            level = Level.FOLD_ONLY  # one oversized batch: the rules alone would hold the GIL
        if level == Level.FOLD_ONLY and len(window) == 1:
            # nothing to fold: compact() would only classify every event to return it
            self._send_taken(window[0], self._in_flight[1])
            if record is not None:
                record(window[0])
            return
        sent = window
        try:
            out, rep = compact(
                window, move_events=settings.move_events, fold_only=level == Level.FOLD_ONLY
            )
        except Exception as exc:  # a value the rules cannot handle: send the window as given
            self._compaction_failed(exc)
            self._send_each(window)
        else:
            if self._send_all(out, window):
                self.totals.add_pass(rep, fold_only=level == Level.FOLD_ONLY)
                sent = out  # the same final state as the window's, in fewer events
        if record is not None:
            for b in sent:
                record(b)
        self.done += len(window)
        self._in_flight = (0, 0)
        if level == Level.RULES and backlog.pending_events >= events_before:
            self._escalated = True  # the rules cost more than they save: fold only

    def _lost(self, marker: Any) -> None:
        """A loss marker: skip a seq; the recorder still gets what was refused."""
        self._skip_pending = True
        snapshot = self.snapshot
        if snapshot is not None:
            for b in marker.refused or ():
                snapshot.record(b)
            if marker.overflow:
                snapshot.invalidate("more batches refused than the record bound keeps")

    def _covered_seq(self) -> int:
        """The last seq the recorder's state covers: a pending loss takes its seq now."""
        if self._skip_pending:
            self._skip_pending = False
            self._seq += 1
            self.totals.seq_gaps += 1
        return self._seq - 1

    def _send_empty(self) -> None:
        """Send one empty batch: a heartbeat, or the message that shows a final loss."""
        from coalesce.events import KVEventBatch

        empty = KVEventBatch(ts=time.time(), events=[], data_parallel_rank=self._rank)
        self._emit(self._encoder.encode(empty), 0)

    def _maybe_yield(self) -> None:
        """Hand the GIL to the engine if the sender has held it for YIELD_EVERY."""
        now = time.perf_counter()
        if now - self._last_yield >= YIELD_EVERY:
            time.sleep(0)
            self._last_yield = time.perf_counter()

    # -- encode and send ---------------------------------------------------------

    def _send_all(self, batches: list[Any], originals: list[Any]) -> bool:
        """Encode every compacted batch first and send them; if one fails to encode,
        send the originals one by one instead.  Returns True if the compacted ones went."""
        try:
            payloads = [self._encoder.encode(b) for b in batches]
        except Exception:
            self._send_each(originals)
            return False
        for b, payload in zip(batches, payloads, strict=True):
            self._emit(payload, _n_events(b))
        return True

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
        t = self.totals
        if self._skip_pending:
            self._skip_pending = False
            self._seq += 1
            t.seq_gaps += 1
        seq = self._seq
        self._seq += 1
        send_message(self._pub, self._topic, seq, payload)
        self._buffer.append(seq, payload)
        if self._heartbeat:
            self._last_sent = time.monotonic()
        t.messages_sent += 1
        t.events_sent += n_events
        t.bytes_sent += len(payload)

    # -- losses ------------------------------------------------------------------

    def _encode_failed(self, exc: BaseException) -> None:
        self.totals.encode_failures += 1
        self._skip_pending = True
        self.limited.warning(
            "encode",
            "kv-coalesce: a batch could not be encoded and is lost (%s: %.200s); "
            "subscribers will see a sequence gap",
            type(exc).__name__,
            exc,
        )

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
            self._skip_pending = True
            log.warning(
                "kv-coalesce: %s: %d batches (%d events) abandoned; "
                "subscribers will see a sequence gap",
                why,
                batches,
                events,
            )

    def _finish_loss(self) -> None:
        """A loss with no message after it is invisible: send one empty batch after the gap."""
        if self._skip_pending:
            self._send_empty()

    def _die(self, exc: BaseException) -> None:
        """The loop failed: refuse all later batches, count what waits, show a gap."""
        self.failed = True
        self._backlog.refuse_all()
        log.error(
            "kv-coalesce: the sender thread failed; publish() now drops every batch "
            "(subscribers will see a sequence gap)",
            exc_info=exc,
        )
        # The window being handled is counted lost (part of it may have gone out:
        # then it is counted twice, never zero times).
        batches, events = self._in_flight
        self._in_flight = (0, 0)
        self.totals.add_abandoned(batches, events)
        self.done += batches
        try:
            self._skip_pending = True
            self._abandon("sender failed")
            self._finish_loss()
        except Exception:  # the socket itself is broken: nothing more can be said on it
            log.exception("kv-coalesce: could not send the final gap marker")


def _n_events(batch: Any) -> int:
    """Events in a batch as it is now (0 if a caller replaced its list by something else)."""
    try:
        return len(batch.events)
    except Exception:
        return 0
