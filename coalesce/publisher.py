"""``CoalescingPublisher``: a drop-in for vLLM's ``ZmqEventPublisher``.

The data path is a straight line::

    publish() -> backlog -> compact -> encode -> send -> replay buffer
    (caller)     _backlog   compactor  _wire     _wire   _replay
                 \\---------------- coalesce._sender thread ----------------/

This module is the caller's side: configuration, ``publish()``, ``stats()``,
``flush()`` and ``shutdown()``.  ``publish()`` does O(1) work on the caller's
thread and never waits for the sender.  The sender sends each batch as it is
(byte-identical to vLLM) while the backlog is at most ``high_watermark``
batches; above it, it compacts.  Only when a budget (``max_queue_size``
batches in the hand-off, ``max_pending_events`` events not yet sent) is spent
does ``publish()`` drop, and the next message sent after a loss skips a
sequence number.
"""

from __future__ import annotations

import enum
import logging
import sys
import threading
import time
import uuid
import warnings
import weakref
from dataclasses import asdict, fields
from typing import Any

import msgspec

from coalesce import _hooks
from coalesce._backlog import Backlog
from coalesce._feed import SNAPSHOTS_REFUSED, Feed
from coalesce._gate import Gate
from coalesce._recorder import Recorder
from coalesce._replay import ReplayService
from coalesce._sender import Sender
from coalesce._services import Services
from coalesce._settings import (
    Identity,
    LossMarker,
    PublisherConfig,
    Settings,
    is_bind_endpoint,
    offset_endpoint,
)
from coalesce._snapshot import SnapshotServer
from coalesce._stream import ReplayBuffer, Stream
from coalesce._wire import Encoder, is_native, message_sender, native_send, open_sockets
from coalesce.compactor import accelerated
from coalesce.stats import PublisherStats

__all__ = ["CoalescingPublisher", "PublishOutcome"]

log = logging.getLogger("coalesce")
_VLLM = PublisherConfig()  # vLLM 0.33's defaults

_FLUSH_CHECK = 0.01
"""Seconds ``flush()`` waits at most between looks, besides being woken as the sender
goes idle (a sender kept busy by another thread's batches may never go idle)."""


class PublishOutcome(enum.Enum):
    """What ``publish()`` did with a batch.  vLLM ignores it; tests and callers need not."""

    QUEUED = "queued"
    """Accepted: it will be sent, as it is or compacted with its neighbours."""
    DROPPED = "dropped"
    """Refused (over budget, or the sender has stopped): counted, and told to
    subscribers by a loss marker (or a sequence gap: ``loss_marker``)."""


def _without_recorder(snapshots: bool, loss_marker: LossMarker) -> str:
    """What goes while the recorder is not exact, as the log says it."""
    told = []
    if snapshots:
        told.append(SNAPSHOTS_REFUSED)
    if loss_marker is LossMarker.RESYNC:
        told.append("a loss is told by its marker alone, as with loss_marker=clear")
    return " and ".join(told)


def _log_start(
    endpoint: str,
    bind: bool,
    replay: str | None,
    snapshot: str | None,
    pid: bytes | None,
    identity: Identity,
    loss_marker: LossMarker,
) -> None:
    """Say once where this publisher is and which compaction rules it runs, and warn
    about vLLM's connect rule (``bind``: as the endpoint was given; a bound
    ``tcp://*:0`` is reported as the ``tcp://0.0.0.0:<port>`` it resolved to)."""
    log.info(
        "kv-coalesce: publishing on %s (%s)%s",
        endpoint,
        "bound: subscribers connect here" if bind else "connecting to a subscriber bound there",
        "" if replay is None else f"; replay on {replay} (bound)",
    )
    if snapshot is not None and pid is not None:
        in_batch = identity is Identity.BATCH
        log.info(
            "kv-coalesce: snapshots on %s (bound), publisher_id %s: every live message "
            "carries it (%s), and an idle publisher sends an empty batch every second",
            snapshot,
            pid.hex(),
            "a 4th batch element" if in_batch else "after the seq: 24-byte seq frames",
        )
        log.warning(
            "kv-coalesce: with snapshots on, %s (vLLM PR #57789%s): NVIDIA Dynamo's indexer "
            "(1.6.1 and earlier) rejects every message; %s; vLLM's decoder and "
            "coalesce.subscriber read them (docs/subscribers.md)",
            "live batches have 4 elements" if in_batch else "live seq frames are 24 bytes",
            ", its newest revision" if in_batch else ", its earlier revisions",
            "llm-d-router without its PR #2946 rejects batches of 4 elements "
            "(snapshot_identity=seq puts the id in the seq frame instead)"
            if in_batch
            else "llm-d-router reads the first 8 bytes, and the PR's newest example "
            "subscriber, which wants 8, rejects every message (snapshot_identity=batch)",
        )
        if loss_marker is not LossMarker.GAP:
            log.warning(
                "kv-coalesce: with snapshots on and loss_marker=%s, a loss leaves the CPU "
                "tier of llm-d-router's snapshot subscriber (its PR #2946) wrong: it starts "
                "over from a snapshot only on a seq gap, and applies an AllBlocksCleared to "
                "the GPU tier only; loss_marker=gap heals it and coalesce.subscriber, and "
                "blacks llm-d-router main out for its 30 s replay cooldown (docs/subscribers.md)",
                loss_marker.value,
            )
    log.info(
        "kv-coalesce: compaction rules run in %s",
        "C (the optional accelerator)"
        if accelerated()
        else "Python: the C accelerator is not built (or COALESCE_NO_ACCEL is set)",
    )
    log.info(
        "kv-coalesce: messages are sent %s",
        "by the optional C send, keeping the GIL"
        if native_send()
        else "by pyzmq, which releases the GIL at every frame: coalesce._csend is not "
        "built, pyzmq's libzmq was not found, or COALESCE_PYZMQ_SEND/COALESCE_NO_ACCEL is set",
    )
    if not bind and endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        log.warning(
            "kv-coalesce: endpoint %s names a host, so (vLLM's rule) the publisher connects "
            "to it instead of binding: a subscriber must bind there (coalesce subscribe "
            "--bind %s), or use tcp://*:%s to let subscribers connect to the publisher",
            endpoint,
            endpoint,
            port,
        )


def _tapped(send: Any, tap: _hooks.Tap) -> Any:
    """``send``, then ``tap`` on what it sent."""

    def tapped(topic: bytes, seq: int, payload: bytes) -> None:
        send(topic, seq, payload)
        tap(topic, seq, payload)

    return tapped


def _collected(sender: Sender) -> None:
    """The finaliser of a publisher dropped without ``shutdown()``: stop its thread."""
    if sender.alive and not sender.closed:
        warnings.warn(
            "a CoalescingPublisher was garbage-collected without shutdown(); "
            "its sender thread is stopped and its sockets closed",
            ResourceWarning,
            stacklevel=1,
        )
        sender.request_stop()


class CoalescingPublisher:
    """Publish ``EventBatch`` structs over ZeroMQ without ever blocking the caller.

    Takes vLLM's ``ZmqEventPublisher`` keywords, with its defaults and its
    endpoint rules (tcp port + DP rank, inproc ``_dp<rank>`` suffix; bind on
    ``*``, ``::``, ``ipc://``, ``inproc://``, connect otherwise; ``bind``
    True or False decides instead, as SGLang's keyword does), plus the
    knobs of :class:`~coalesce._settings.Settings` as keywords or
    ``COALESCE_*`` variables.  Unknown keywords (from a newer vLLM) are
    accepted and ignored.

    ``max_queue_size`` is the hard cap in *batches* waiting in the hand-off to
    the sender, as vLLM's queue counts batches; under pressure the sender
    moves them out of it (O(1) each), so only a sender that cannot run at all
    reaches it.  ``max_pending_events`` caps the events not yet sent: the
    memory bound.  Raises ``ValueError`` for a bad setting or endpoint
    and ``OSError`` when an endpoint cannot be bound or connected.

    A publisher that is garbage-collected without :meth:`shutdown` stops its
    sender thread and closes its sockets, with a ``ResourceWarning``.
    """

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = _VLLM.endpoint,
        replay_endpoint: str | None = _VLLM.replay_endpoint,
        buffer_steps: int = _VLLM.buffer_steps,
        hwm: int = _VLLM.hwm,
        max_queue_size: int = _VLLM.max_queue_size,
        topic: str = _VLLM.topic,
        bind: bool | None = None,
        **keywords: Any,
    ) -> None:
        for name, value in (
            ("buffer_steps", buffer_steps),
            ("hwm", hwm),
            ("max_queue_size", max_queue_size),
        ):  # 0 is allowed, with vLLM's meaning: no replay buffer, no HWM, no queue limit
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if bind is not None and not isinstance(bind, bool):
            raise TypeError(f"bind must be a bool or None, got {type(bind).__name__}")
        if (
            isinstance(data_parallel_rank, bool)
            or not isinstance(data_parallel_rank, int)
            or data_parallel_rank < 0
        ):
            raise ValueError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
        knobs = Settings.names()
        # keywords that are not knobs come from a newer vLLM: accepted and ignored
        self.settings = Settings.resolve(**{k: v for k, v in keywords.items() if k in knobs})
        ignored = sorted(set(keywords) - knobs)
        if ignored:
            log.info("kv-coalesce: ignoring keywords this version does not know: %s", ignored)
        self._rank = data_parallel_rank
        topic_b = topic.encode("utf-8")
        pub_ep = offset_endpoint(endpoint, data_parallel_rank)
        replay_ep = offset_endpoint(replay_endpoint, data_parallel_rank)
        snap_ep = offset_endpoint(self.settings.snapshot_endpoint, data_parallel_rank)
        if not pub_ep:
            raise ValueError(f"endpoint must be a ZeroMQ endpoint, got {endpoint!r}")

        binds = is_bind_endpoint(pub_ep) if bind is None else bind
        self._binds = binds
        # 16 bytes that change only when the publisher restarts (PR #57789)
        self.publisher_id: bytes | None = None if snap_ep is None else uuid.uuid4().bytes
        st = self.settings
        socks = open_sockets(
            pub_ep,
            replay_ep,
            snap_ep,
            hwm=hwm,
            replay_window=st.replay_window,
            bind=binds,
        )
        pub_ep, replay_ep = socks.endpoint, socks.replay_endpoint
        snap_ep = socks.snapshot_endpoint
        snap_sock = socks.snapshot
        self._socks = socks
        self.snapshot_endpoint = snap_ep
        _log_start(
            pub_ep,
            binds,
            replay_ep,
            snap_ep,
            self.publisher_id,
            st.snapshot_identity,
            st.loss_marker,
        )
        self.config = PublisherConfig(
            endpoint=pub_ep,
            replay_endpoint=replay_ep,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
            snapshot_endpoint=snap_ep,
            snapshot_max_blocks=st.snapshot_max_blocks,
            snapshot_max_response_bytes=st.snapshot_max_response_bytes,
        )
        hooks = _hooks.current()
        # max_queue_size=0 is vLLM's unbounded queue: the event budget still bounds memory
        budgets = st.budgets
        # with a recorder (snapshots, or resyncs), batches refused over budget still
        # reach it, up to budgets.refused_recorded events per loss (then it is
        # unavailable until a clear)
        records = snap_ep is not None or st.loss_marker is LossMarker.RESYNC
        self._backlog = Backlog(
            max_queue_size or sys.maxsize,
            budgets.events,
            st.stall_timeout,
            record_events=budgets.refused_recorded if records else 0,
        )
        encoder = Encoder()
        buffer = ReplayBuffer(buffer_steps)
        pid, in_batch = self.publisher_id, st.snapshot_identity is Identity.BATCH
        self._stream = stream = Stream.of_rank(
            None, topic_b, buffer, encoder, data_parallel_rank, st.loss_marker,
            beats=pid is not None, identity=pid if in_batch else None,
        )  # fmt: skip
        tail = b"" if pid is None or in_batch else pid
        send = message_sender(socks.pub, tail, native=hooks.accelerated)
        stream.use(send if hooks.tap is None else _tapped(send, hooks.tap))
        self._feed = feed = None
        if records:
            recorder = Recorder(
                st.snapshot_max_blocks, accelerated=None if hooks.accelerated else False
            )
            feed = Feed(
                recorder,
                max_deferred_events=budgets.deferred,
                policy=hooks.policy,
                accelerated=hooks.accelerated,
                uses=_without_recorder(snap_ep is not None, st.loss_marker),
            )
            self._feed = feed
        snapshot = None
        if snap_sock is not None and feed is not None and self.publisher_id is not None:
            snapshot = SnapshotServer(
                snap_sock, feed, self.publisher_id, data_parallel_rank,
                max_response_bytes=st.snapshot_max_response_bytes,
            )  # fmt: skip
        replay = None
        if socks.router is not None:
            replay = ReplayService.from_settings(socks.router, buffer, topic_b, st)
        self._batch_types: set[type] = set()
        self._gate = Gate()
        self._sender = Sender(
            stream=stream,
            encoder=encoder,
            services=Services(replay, snapshot, stream, self._backlog, st.high_watermark),
            backlog=self._backlog,
            settings=st,
            policy=hooks.policy,
            gate=self._gate,
            rank=data_parallel_rank,
            feed=feed,
            accelerated=hooks.accelerated,
            native_send=is_native(send),
            close_sockets=lambda: socks.close_for_shutdown(st.shutdown_timeout),
        )
        self._closed = False
        self._sender_gone = False  # shutdown() has stopped the sender (under the lock)
        self._shutdown_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _collected, self._sender)
        self._finalizer.atexit = False
        self._sender.start()

    # -- setup -----------------------------------------------------------------

    @property
    def data_parallel_rank(self) -> int:
        """The DP rank this publisher serves (it fills batches whose rank is None)."""
        return self._rank

    # -- the caller's side -------------------------------------------------------

    def publish(self, events: Any) -> PublishOutcome:
        """Queue one ``EventBatch`` for sending.  O(1); never blocks, never waits.

        Fills ``data_parallel_rank`` when it is None, as vLLM does.  Over
        budget, or once the sender thread has stopped because of an error, the
        batch is dropped, counted, and the loss becomes a sequence gap on the
        wire.  Raises ``TypeError`` (nothing queued) for anything that is not
        an ``EventBatch``-like struct with a float ``ts``, a list of events and
        an int or None rank, and ``RuntimeError`` after :meth:`shutdown`.
        Events are not inspected here: one the sender cannot handle is sent as
        it is, or lost visibly.
        """
        if self._closed:
            raise RuntimeError("publish() called after shutdown()")
        cls = type(events)
        if cls not in self._batch_types:
            self._check_batch_type(cls, events)
        evs = events.events
        if type(evs) is not list:
            raise TypeError(f"{cls.__name__}.events must be a list, got {type(evs).__name__}")
        ts = events.ts
        if type(ts) is not float and (type(ts) is not int):
            raise TypeError(f"{cls.__name__}.ts must be a float, got {type(ts).__name__}")
        rank = events.data_parallel_rank
        if rank is None:
            events.data_parallel_rank = self._rank
        elif type(rank) is not int:
            raise TypeError(f"data_parallel_rank must be an int or None, got {rank!r}")
        return self._queue(events, len(evs))

    def _queue(self, batch: Any, n_events: int) -> PublishOutcome:
        """Offer a checked batch (its rank set) to the backlog and wake the sender.  O(1)."""
        backlog, sender = self._backlog, self._sender
        queued = backlog.offer(batch, n_events)
        if not queued:
            self._dropped()
        elif self._sender_gone:  # shutdown() ended between this call's checks and its offer
            self._abandon_leftovers()
        # Wake a sleeping sender (one lock release, a futex syscall; also a pipe
        # write once a sender with sockets sleeps on them) at the first batch, or a
        # refused one (it may wait in the backlog for the recorder): it then waits
        # for the GIL, and takes it at the engine's next GPU wait, when running
        # costs the engine nothing.  Left asleep, its work would pile up until its
        # idle timeout and then run in long GIL holds.
        if sender.idle:
            sender.idle = False
            sender.wake()
        return PublishOutcome.QUEUED if queued else PublishOutcome.DROPPED

    def _dropped(self) -> None:
        if self._sender.failed:
            self._sender.limited.warning(
                "dead", "kv-coalesce: the sender thread has failed: dropped a batch"
            )
            return
        self._sender.limited.warning(
            "drop",
            "kv-coalesce: backlog over budget (%d batches / %d events): dropped a batch; %s",
            self._backlog.max_batches,
            self._backlog.max_events,
            self._sender.loss_told,
        )

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
        sender, services, feed = self._sender, self._sender.services, self._feed
        snapshot = services.snapshot_stats()
        if services.snapshot is None and feed is not None:  # a recorder for resyncs only
            snapshot = feed.stats()
        return PublisherStats.compose(
            self._backlog.stats(),
            sender.stats(accelerated=accelerated() and sender.accelerated),
            self._stream.stats(),
            services.replay_stats(),
            snapshot,
        )

    def get_publisher_config(self) -> Any:
        """The resolved configuration (endpoints offset for this rank).

        Inside vLLM (``vllm`` already imported) this is vLLM's
        ``KVEventsConfig``, as its scheduler expects, with the fields that vLLM
        version declares (``snapshot_endpoint`` where it has PR #57789's);
        otherwise :attr:`config`, which always has the snapshot fields.
        """
        if "vllm" in sys.modules:
            try:
                from vllm.config.kv_events import KVEventsConfig
            except ImportError:
                return self.config
            known = {f.name for f in fields(KVEventsConfig)}
            mine = {k: v for k, v in asdict(self.config).items() if k in known}
            return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **mine)
        return self.config

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every batch accepted so far is sent (or counted lost), and what
        waits behind them (refused batches for the recorder, a resync) is done with.

        Returns False if that took longer than ``timeout`` seconds, or if the
        sender stopped before it was done.  This one *does* block the caller
        (asleep until the sender goes idle, looking again every 10 ms at the
        latest): it is for tests and orderly hand-offs, never for the engine's
        step loop.  While a caller waits here, the sender keeps the GIL between
        its steps instead of handing it back every half millisecond: another
        thread (an engine publishing meanwhile) gets it at CPython's switch
        interval, as it does from vLLM's own sender.
        """
        target = self._backlog.batches_in
        deadline = time.monotonic() + timeout
        sender = self._sender
        backlog = self._backlog

        def done() -> bool:
            # (in this order: the sender is in a step before it takes from the backlog,
            # and a resync it begins there is under way before the step ends)
            return not (
                sender.done < target or len(backlog) or sender.stepping or sender.resyncing
            )

        with sender.flushing():
            while not done():
                left = deadline - time.monotonic()
                if left <= 0 or not sender.thread.is_alive():
                    return False
                sender.wait_quiet(done, min(left, _FLUSH_CHECK))
        return True

    def shutdown(self) -> None:
        """Flush for up to ``shutdown_timeout`` seconds, then stop and close the sockets.

        Idempotent, safe from any thread and concurrently with ``publish()``
        (which then raises ``RuntimeError``); never raises for a full backlog.
        What cannot be sent in time is counted as dropped, and a final empty
        batch after a skipped seq makes that loss visible.
        """
        sender = self._sender
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        sender.request_stop()
        with sender.flushing():  # (as in flush(): this caller waits for it)
            sender.thread.join(2 * self.settings.shutdown_timeout + 2.0)
        if sender.thread.is_alive():  # pragma: no cover - the sender checks its deadline
            log.error("kv-coalesce: sender thread did not stop; sockets left to it")
            return
        self._abandon_leftovers(stopped=True)

    def _abandon_leftovers(self, stopped: bool = False) -> None:
        """Count as abandoned what a publish() that passed its closed check while the
        sender was exiting left in the backlog (the sender no longer writes totals).
        Called by shutdown() once the sender has stopped, and by such a publish()
        itself if its batch came later; one lock orders the two."""
        with self._shutdown_lock:
            if stopped:
                self._sender_gone = True
            batches, _ = self._backlog.drain()  # (counted as dropped there)
        if batches:
            log.warning("kv-coalesce: %d batches published during shutdown were not sent", batches)

    def __enter__(self) -> CoalescingPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
