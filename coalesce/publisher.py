"""``CoalescingPublisher``: a drop-in for vLLM's ``ZmqEventPublisher``.

The data path is a straight line::

    publish() -> backlog -> compact -> encode -> send -> replay buffer
    (caller)     _backlog   compactor  _wire     _wire   _replay
                 \\------------------ sender thread ------------------/

``publish()`` does O(1) work on the caller's thread and never waits for the
sender.  The sender sends each batch as it is (byte-identical to vLLM) while
the backlog is at most ``high_watermark`` batches; above it, it takes up to
``max_events_per_step`` events at a time, compacts them and sends the result.
Only when the budget (``max_queue_size`` batches, ``max_pending_events``
events) is spent does ``publish()`` drop, and the next message sent after a
loss skips a sequence number.
"""

from __future__ import annotations

import enum
import logging
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

import msgspec
import zmq

from coalesce._backlog import LOSS, Backlog
from coalesce._replay import ReplayBuffer, ReplayService
from coalesce._settings import PublisherConfig, Settings, is_bind_endpoint, offset_endpoint
from coalesce._wire import Encoder, send_message
from coalesce.compactor import compact
from coalesce.stats import PublisherStats

__all__ = ["CoalescingPublisher", "PublishOutcome"]

log = logging.getLogger("coalesce")

IDLE_POLL = 0.005
"""Seconds an idle sender sleeps before looking again; publish() wakes it only under
load (past ``high_watermark`` batches or ``max_events_per_step`` events).  Each idle
wake-up is a GIL acquisition taken from the engine: measured in the demo, polling
every 1 ms made the engine loop ~40% slower than with vLLM's publisher.  So a lone
small batch may wait up to 5 ms (CPython's own switch interval) before it is sent."""

YIELD_EVERY = 0.0005
"""Seconds of continuous sender work after which it hands the GIL to the engine.

Yielding after every step made each step a GIL handoff (two context switches)
whenever the engine was waiting, which slowed both threads; never yielding
lets the engine wait for CPython's 5 ms switch interval."""


class PublishOutcome(enum.Enum):
    """What ``publish()`` did with a batch.  vLLM ignores it; tests and callers need not."""

    QUEUED = "queued"
    """Accepted: it will be sent, as it is or compacted with its neighbours."""
    DROPPED = "dropped"
    """Refused over budget: counted, and visible to subscribers as a sequence gap."""


class _RateLimited:
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


class _Totals:
    """The sender's counters (written by the sender thread only; read by stats())."""

    __slots__ = (
        "abandoned_batches",
        "abandoned_events",
        "bytes",
        "cancelled",
        "events",
        "fold_only_passes",
        "folded",
        "merged",
        "messages",
        "moved",
        "passes",
        "superseded",
    )

    def __init__(self) -> None:
        self.messages = self.events = self.bytes = 0
        self.passes = self.fold_only_passes = self.folded = self.merged = 0
        self.cancelled = self.superseded = self.moved = 0
        self.abandoned_batches = self.abandoned_events = 0

    def add_pass(self, report: Any, fold_only: bool) -> None:
        self.passes += 1
        self.fold_only_passes += fold_only
        self.folded += report.folded
        self.merged += report.merged
        self.cancelled += report.cancelled
        self.superseded += report.superseded
        self.moved += report.moved

    def add_abandoned(self, batches: int, events: int) -> None:
        self.abandoned_batches += batches
        self.abandoned_events += events


class CoalescingPublisher:
    """Publish ``EventBatch`` structs over ZeroMQ without ever blocking the caller.

    Takes vLLM's ``ZmqEventPublisher`` keywords, with its defaults and its
    endpoint rules (tcp port + DP rank, inproc ``_dp<rank>`` suffix; bind on
    ``*``, ``::``, ``ipc://``, ``inproc://``, connect otherwise), plus the
    knobs of :class:`~coalesce._settings.Settings` as keywords or
    ``COALESCE_*`` variables.  Unknown keywords (from a newer vLLM) are
    accepted and ignored.

    ``max_queue_size`` is the hard cap in *batches* published but not yet taken
    by the sender, as vLLM's queue counts batches; ``max_pending_events`` caps
    events the same way.  Raises ``ValueError`` for a bad setting or endpoint
    and ``OSError`` when an endpoint cannot be bound or connected.
    """

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        high_watermark: int | None = None,
        compaction: bool | None = None,
        move_events: bool | None = None,
        max_pending_events: int | None = None,
        max_events_per_step: int | None = None,
        fold_only_events: int | None = None,
        shutdown_timeout: float | None = None,
        **_future_vllm_keywords: Any,
    ) -> None:
        for name, value in (
            ("buffer_steps", buffer_steps),
            ("hwm", hwm),
            ("max_queue_size", max_queue_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if not isinstance(data_parallel_rank, int) or data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
        self.settings = Settings.resolve(
            high_watermark=high_watermark,
            compaction=compaction,
            move_events=move_events,
            max_pending_events=max_pending_events,
            max_events_per_step=max_events_per_step,
            fold_only_events=fold_only_events,
            shutdown_timeout=shutdown_timeout,
        )
        self._rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        pub_ep = offset_endpoint(endpoint, data_parallel_rank)
        replay_ep = offset_endpoint(replay_endpoint, data_parallel_rank)
        assert pub_ep is not None

        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._router: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            pub_ep = self._attach(self._pub, pub_ep, bind=is_bind_endpoint(pub_ep))
            if replay_ep is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                replay_ep = self._attach(self._router, replay_ep, bind=True)
        except BaseException:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            raise

        self.config = PublisherConfig(
            endpoint=pub_ep,
            replay_endpoint=replay_ep,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
        )
        self._backlog = Backlog(max_queue_size, self.settings.max_pending_events)
        self._buffer = ReplayBuffer(buffer_steps)
        self._replay = (
            None if self._router is None else ReplayService(self._router, self._buffer, self._topic)
        )
        self._encoder = Encoder()
        self._limited = _RateLimited()
        self._batch_types: set[type] = set()

        # sender-owned state
        self._seq = 0
        self._skip_pending = False
        self._totals = _Totals()
        self._encode_failures = 0
        self._seq_gaps = 0
        self._level = 0  # 0: 1:1, 1: every rule, 2: fold only
        self._escalated = False  # this pressure episode is fold-only
        self._last_yield = 0.0
        self._done = 0  # input batches the sender has finished with (sent or lost)

        # shared flags (each written by one side)
        self._closed = False  # written by shutdown()
        self._idle = False  # written by both, read-then-set races are benign
        self._wake_at = self.settings.high_watermark  # publish() wakes the sender past this
        self._wake_events = self.settings.max_events_per_step  # ... or past this
        self._wake = threading.Event()
        self._shutdown_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="coalesce-sender", daemon=True)
        self._thread.start()

    # -- setup -----------------------------------------------------------------

    @staticmethod
    def _attach(sock: zmq.Socket[bytes], endpoint: str, *, bind: bool) -> str:
        try:
            if not bind:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            verb = "bind" if bind else "connect"
            if exc.errno in (zmq.EINVAL, zmq.EPROTONOSUPPORT):
                raise ValueError(f"cannot {verb} {endpoint!r}: {exc}") from exc
            raise OSError(exc.errno, f"cannot {verb} {endpoint!r}: {exc}") from exc
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        return endpoint

    # -- the caller's side -------------------------------------------------------

    def publish(self, events: Any) -> PublishOutcome:
        """Queue one ``EventBatch`` for sending.  O(1); never blocks, never waits.

        Fills ``data_parallel_rank`` when it is None, as vLLM does.  Over
        budget the batch is dropped, counted, and the loss becomes a sequence
        gap on the wire.  Raises ``TypeError`` (nothing queued) for anything
        that is not an ``EventBatch``-like struct with a list of events, and
        ``RuntimeError`` after :meth:`shutdown`.
        """
        if self._closed:
            raise RuntimeError("publish() called after shutdown()")
        cls = type(events)
        if cls not in self._batch_types:
            self._check_batch_type(cls, events)
        evs = events.events
        if type(evs) is not list:
            raise TypeError(f"{cls.__name__}.events must be a list, got {type(evs).__name__}")
        rank = events.data_parallel_rank
        if rank is None:
            events.data_parallel_rank = self._rank
        elif type(rank) is not int:
            raise TypeError(f"data_parallel_rank must be an int or None, got {rank!r}")
        if not self._backlog.offer(events, len(evs)):
            self._limited.warning(
                "drop",
                "kv-coalesce: backlog over budget (%d batches / %d events): dropped a batch; "
                "subscribers will see a sequence gap",
                self._backlog.max_batches,
                self._backlog.max_events,
            )
            return PublishOutcome.DROPPED
        # Waking a sleeping thread is a futex syscall (~5 us): only worth it when work
        # piles up (in batches, or in events: a burst must not wait for IDLE_POLL, or
        # the sender misses the engine's GPU wait, the only time it can run).
        # Otherwise the idle sender finds the batch within IDLE_POLL.
        if self._idle and (
            self._backlog.pending > self._wake_at
            or self._backlog.pending_events > self._wake_events
        ):
            self._idle = False
            self._wake.set()
        return PublishOutcome.QUEUED

    def _check_batch_type(self, cls: type, events: Any) -> None:
        fields = getattr(cls, "__struct_fields__", None)
        if not isinstance(events, msgspec.Struct) or fields is None:
            raise TypeError(f"publish() takes an EventBatch struct, got {cls.__name__}")
        missing = {"ts", "events", "data_parallel_rank"} - set(fields)
        if missing:
            raise TypeError(f"{cls.__name__} is not an EventBatch: missing {sorted(missing)}")
        self._batch_types.add(cls)

    def stats(self) -> PublisherStats:
        """A frozen snapshot of the counters.  O(1); safe from any thread."""
        b, t, r = self._backlog, self._totals, self._replay
        return PublisherStats(
            batches_in=b.batches_in,
            events_in=b.events_in,
            batches_dropped=b.batches_dropped + t.abandoned_batches,
            events_dropped=b.events_dropped + t.abandoned_events,
            encode_failures=self._encode_failures,
            seq_gaps=self._seq_gaps,
            messages_sent=t.messages,
            events_sent=t.events,
            bytes_sent=t.bytes,
            batches_folded=t.folded,
            events_merged=t.merged,
            blocks_cancelled=t.cancelled,
            events_superseded=t.superseded,
            blocks_moved=t.moved,
            compaction_passes=t.passes,
            fold_only_passes=t.fold_only_passes,
            backlog_batches=b.pending,
            backlog_peak=b.peak,
            replay_requests=0 if r is None else r.requests,
            replay_invalid=0 if r is None else r.invalid,
            replay_messages=0 if r is None else r.messages,
            replay_abandoned=0 if r is None else r.abandoned,
        )

    def get_publisher_config(self) -> Any:
        """The resolved configuration (endpoints offset for this rank).

        Inside vLLM (``vllm`` already imported) this is vLLM's
        ``KVEventsConfig``, as its scheduler expects; otherwise :attr:`config`.
        """
        if "vllm" in sys.modules:
            try:
                from vllm.config.kv_events import KVEventsConfig
            except ImportError:
                return self.config
            return KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", **asdict(self.config)
            )
        return self.config

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every batch accepted so far is sent (or counted lost).

        Returns False if that took longer than ``timeout`` seconds.  This one
        *does* block the caller (polling every millisecond): it is for tests
        and orderly hand-offs, never for the engine's step loop.
        """
        target = self._backlog.batches_in
        deadline = time.monotonic() + timeout
        while self._done < target:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def shutdown(self) -> None:
        """Flush for up to ``shutdown_timeout`` seconds, then stop and close the sockets.

        Idempotent, safe from any thread and concurrently with ``publish()``
        (which then raises ``RuntimeError``); never raises for a full backlog.
        What cannot be sent in time is counted as dropped, and a final empty
        batch after a skipped seq makes that loss visible.
        """
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        self._thread.join(self.settings.shutdown_timeout + 1.0)
        if self._thread.is_alive():  # pragma: no cover - the sender checks its deadline
            log.error("kv-coalesce: sender thread did not stop; sockets left to it")
            return
        # A publish() that passed its closed check while the sender was exiting.
        batches, events = self._backlog.drain()
        if batches:
            self._totals.add_abandoned(batches, events)
            log.warning("kv-coalesce: %d batches published during shutdown were not sent", batches)

    def __enter__(self) -> CoalescingPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the sender thread ---------------------------------------------------------

    def _run(self) -> None:
        deadline: float | None = None
        try:
            while True:
                did = self._replay.step() if self._replay is not None else False
                if self._closed and deadline is None:
                    deadline = time.monotonic() + self.settings.shutdown_timeout
                if len(self._backlog):
                    if deadline is not None and time.monotonic() > deadline:
                        self._abandon()
                        break
                    self._step(flushing=deadline is not None)
                    did = True
                elif self._closed:
                    self._backlog.mark_pending_loss()
                    if not len(self._backlog):
                        break
                if did:
                    self._maybe_yield()
                    continue
                self._idle = True
                if len(self._backlog) or self._closed:
                    self._idle = False
                    continue
                self._wake.wait(IDLE_POLL)
                self._wake.clear()
                self._idle = False
            self._finish_loss()
        except Exception:  # pragma: no cover - a bug; never let it pass silently
            log.exception("kv-coalesce: sender thread failed")
        finally:
            # What was sent must still reach subscribers: a linger, not 0 (which would
            # discard queued messages: a loss with no gap).  close() does not wait for
            # it; ZeroMQ's I/O thread delivers in the background (the shared context
            # is never terminated).
            self._pub.close(linger=int(self.settings.shutdown_timeout * 1000))
            if self._router is not None:
                self._router.close(linger=0)

    def _step(self, flushing: bool) -> None:
        """One bounded unit of work: a 1:1 send, or one compaction window.

        The ladder: backlog at most ``high_watermark`` batches: send 1:1.
        Above it: fold and apply every rule, ``max_events_per_step`` events at
        a time; a single batch larger than that is never run through the
        rules, only sent (one encode: the longest GIL hold).  If a pass of
        the rules (~2 us/event, against ~0.1 us/event to encode and send)
        loses ground (more events pending after it than before), or more
        than ``fold_only_events`` are pending: fold only, in 4x larger
        windows, which drains at encoding speed, until the backlog is back
        under the watermark.  Past the budget, ``publish()`` drops.
        """
        backlog, settings = self._backlog, self.settings
        waiting, events_before = backlog.pending, backlog.pending_events
        level = 0
        if settings.compaction and (flushing or waiting > settings.high_watermark):
            escalate = flushing or self._escalated or events_before > settings.fold_only_events
            level = 2 if escalate else 1
        else:
            self._escalated = False
        if level != self._level:
            if level > self._level and not flushing:
                self._limited.log(
                    logging.INFO,
                    f"level{level}",
                    "kv-coalesce: sender behind (%d batches, %d events waiting): %s",
                    waiting,
                    events_before,
                    "compacting" if level == 1 else "escalating to fold-only",
                )
            self._level = level
        step = settings.max_events_per_step * (4 if level == 2 else 1)
        window = backlog.take_one() if level == 0 else backlog.take(step)
        if window is LOSS:
            self._skip_pending = True
            return
        if level == 0:
            self._send_one(window)
            self._done += 1
            return
        assert isinstance(window, list)
        if level == 1 and len(window) == 1 and len(window[0].events) > step:
            level = 2  # one oversized batch: the rules on it alone would hold the GIL for long
        out, rep = compact(window, move_events=settings.move_events, fold_only=level == 2)
        self._totals.add_pass(rep, fold_only=level == 2)
        self._send_all(out, window)
        self._done += len(window)
        if level == 1 and backlog.pending_events >= events_before:
            self._escalated = True  # the rules cost more than they save: fold only

    def _maybe_yield(self) -> None:
        """Hand the GIL to the engine if the sender has held it for YIELD_EVERY."""
        now = time.perf_counter()
        if now - self._last_yield >= YIELD_EVERY:
            time.sleep(0)
            self._last_yield = time.perf_counter()

    def _send_all(self, batches: list[Any], originals: list[Any]) -> None:
        """Encode every compacted batch first; if one fails, send the originals one by one."""
        try:
            payloads = [self._encoder.encode(b) for b in batches]
        except Exception:
            for b in originals:
                self._send_one(b)
            return
        for b, payload in zip(batches, payloads, strict=True):
            self._emit(payload, b.events)

    def _send_one(self, batch: Any) -> None:
        """Encode and send one batch; a batch the encoder rejects is lost, visibly."""
        try:
            payload = self._encoder.encode(batch)
        except Exception as exc:
            self._encode_failed(exc)
            return
        self._emit(payload, batch.events)

    def _encode_failed(self, exc: Exception) -> None:
        self._encode_failures += 1
        self._skip_pending = True
        self._limited.warning(
            "encode",
            "kv-coalesce: a batch could not be encoded and is lost (%s: %s); "
            "subscribers will see a sequence gap",
            type(exc).__name__,
            exc,
        )

    def _emit(self, payload: bytes, events: list[Any]) -> None:
        if self._skip_pending:
            self._skip_pending = False
            self._seq += 1
            self._seq_gaps += 1
        seq = self._seq
        self._seq += 1
        send_message(self._pub, self._topic, seq, payload)
        self._buffer.append(seq, payload)
        t = self._totals
        t.messages += 1
        t.events += len(events)
        t.bytes += len(payload)

    def _abandon(self) -> None:
        batches, events = self._backlog.drain()
        self._totals.add_abandoned(batches, events)
        self._done += batches
        self._skip_pending = True
        log.warning(
            "kv-coalesce: shutdown timeout: %d batches (%d events) abandoned; "
            "subscribers will see a sequence gap",
            batches,
            events,
        )

    def _finish_loss(self) -> None:
        """A loss with no message after it is invisible: send one empty batch after the gap."""
        if self._skip_pending:
            from coalesce.events import KVEventBatch

            empty = KVEventBatch(ts=time.time(), events=[], data_parallel_rank=self._rank)
            self._emit(self._encoder.encode(empty), [])
