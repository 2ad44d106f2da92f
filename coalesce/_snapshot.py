"""The snapshot service: answers ``b"snapshot"`` on its own ROUTER (vLLM PR #57789's shape).

Request: one frame ``b"snapshot"`` (from a DEALER; a REQ's empty delimiter
is kept and echoed).  Reply: one multipart message ``[seq, publisher_id,
chunk...]`` where ``seq`` is 8 signed big-endian bytes naming the last
message the snapshot covers (-1: nothing sent yet; -2: unavailable) and each
chunk is one encoded batch ``[ts, events, data_parallel_rank]`` of the
recorder's replay program (:class:`coalesce._recorder.Recorder`).

The sender thread owns it, gives it every batch it sent or refused
(:meth:`SnapshotService.record`) and calls :meth:`SnapshotService.step` from
its loop.  Batches sent as they came (not through the rules) are gathered and
recorded as the compactor's output of each window of them: the same state for
every subscriber model, at a fraction of the recorder's per-event work.  What
is gathered is recorded before a reply or a resync starts, and whenever the
sender has caught up.  A reply is built a chunk per step (bounded work), while
live sending goes on between steps; the recorder is frozen meanwhile, and the
batches it should record wait in a deferred list, applied once the reply is
built.  Requests that arrive while a reply is being built wait for the next
one, which starts from the newer state.  Nothing here touches ``publish()``.

With ``loss_marker="resync"`` the same recorder also feeds an *in-band
resync*: after a loss marker, the sender sends the recorder's program on the
live socket, a chunk per step (:meth:`SnapshotService.start_resync`,
:meth:`SnapshotService.resync_chunk`), before any later batch; the recorder
is frozen meanwhile, as for a reply.  Without a snapshot endpoint the service
has no ROUTER and serves only that.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any, ClassVar

import zmq

from coalesce import _policy
from coalesce._kinds import event_count
from coalesce._recorder import Recorder
from coalesce._settings import Settings
from coalesce._wire import Encoder, read_requests
from coalesce.compactor import compact

__all__ = ["HEARTBEAT", "NOTHING_SENT", "SnapshotService", "UNAVAILABLE"]

log = logging.getLogger("coalesce")

HEARTBEAT = 1.0
"""Seconds of silence after which a publisher with snapshots on sends an empty batch
(it takes a seq, so a subscriber sees a lost tail within a second; PR #57789)."""

NOTHING_SENT = -1
UNAVAILABLE = -2
REQUEST = b"snapshot"

_MORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)


class _Round:
    """One reply being built: its seq, who waits for it, its chunks so far."""

    __slots__ = ("chunks", "clients", "frames", "seq", "size")

    def __init__(
        self, seq: int, clients: list[list[bytes]], chunks: Generator[list[Any], None, None]
    ) -> None:
        self.seq = seq
        self.clients = clients
        self.chunks = chunks
        self.frames: list[bytes] = []
        self.size = 0


class SnapshotService:
    """The recorder's feed and the snapshot ROUTER.  See the module docstring."""

    def __init__(
        self,
        sock: zmq.Socket[bytes] | None,
        recorder: Recorder,
        publisher_id: bytes | None,
        rank: int,
        *,
        max_response_bytes: int,
        max_deferred_events: int,
        max_waiting: int = 64,
    ) -> None:
        self._sock = sock
        self.recorder = recorder
        self._encoder = Encoder()
        self._id = publisher_id
        self._rank = rank
        self._max_bytes = max_response_bytes
        self._max_deferred = max_deferred_events
        self._max_waiting = max_waiting
        self._waiting: list[list[bytes]] = []
        self._round: _Round | None = None
        self._resync: Generator[list[Any], None, None] | None = None
        self._deferred: deque[Any] = deque()
        self._deferred_events = 0
        self._gathered: list[Any] = []
        self._gathered_events = 0
        self.requests = self.invalid = self.refused = self.abandoned = 0
        self.replies = self.unavailable = self.chunks_sent = 0
        self._was_valid = True

    @classmethod
    def from_settings(
        cls,
        sock: zmq.Socket[bytes] | None,
        publisher_id: bytes | None,
        rank: int,
        settings: Settings,
    ) -> SnapshotService:
        """The service, with a new recorder, sized by the publisher's knobs."""
        return cls(
            sock,
            Recorder(settings.snapshot_max_blocks),
            publisher_id,
            rank,
            max_response_bytes=settings.snapshot_max_response_bytes,
            max_deferred_events=settings.max_pending_events,
        )

    def published(self) -> dict[str, Any]:
        """The counters as ``PublisherStats`` fields."""
        rec = self.recorder
        return {
            "snapshot_requests": self.requests,
            "snapshot_invalid": self.invalid + self.refused,
            "snapshot_replies": self.replies,
            "snapshot_unavailable": self.unavailable,
            "snapshot_abandoned": self.abandoned,
            "snapshot_blocks": rec.held,
            "snapshot_exact": rec.valid,
        }

    NOTHING: ClassVar[dict[str, Any]] = {
        "snapshot_requests": 0,
        "snapshot_invalid": 0,
        "snapshot_replies": 0,
        "snapshot_unavailable": 0,
        "snapshot_abandoned": 0,
        "snapshot_blocks": 0,
        "snapshot_exact": False,
    }

    # -- the feed ----------------------------------------------------------------

    def record(self, batches: Iterable[Any], compacted: bool = False) -> None:
        """Give the recorder ``batches`` (sent or refused), in publish order.

        ``compacted``: already the rules' output; recorded at once, after what
        was gathered before them.  Else gathered, up to
        :data:`~coalesce._policy.RECORD_WINDOW` events, then recorded as the
        compactor's output of them (:meth:`settle`).  O(hashes), amortised.

        While a reply or a resync is being built, they wait in a deferred list
        (O(1) a batch) instead.  Past ``max_deferred_events`` waiting the reply
        is abandoned (its clients get ``-2`` and ask again) so that the list
        stays bounded.
        """
        for batch in batches:  # (a reply abandoned on the way unfreezes it)
            if self._round is not None or self._resync is not None:
                self._defer(batch)
            elif compacted:
                self.settle()
                self._record(batch)
            else:
                self._gathered.append(batch)
                self._gathered_events += event_count(batch)
        if self._gathered_events >= _policy.RECORD_WINDOW:
            self.settle()

    def settle(self) -> None:
        """Record what was gathered, in windows of about ``RECORD_WINDOW`` events,
        each as the compactor's output of it (as it was, where the rules cannot
        handle it, or under ``RECORD_FROM`` events).  O(events and hashes gathered)."""
        if not self._gathered:
            return
        gathered, self._gathered = self._gathered, []
        total, self._gathered_events = self._gathered_events, 0
        if total < _policy.RECORD_FROM or _policy.RECORD_WINDOW <= 0:
            for batch in gathered:
                self._record(batch)
            return
        start = events = 0
        for i, batch in enumerate(gathered):
            events += event_count(batch)
            if events >= _policy.RECORD_WINDOW or i + 1 == len(gathered):
                self._record_window(gathered[start : i + 1], events)
                start, events = i + 1, 0

    def _record_window(self, window: list[Any], events: int) -> None:
        if events >= _policy.RECORD_FROM:
            with contextlib.suppress(Exception):  # as it was: the recorder says what it cannot read
                window = compact(window)[0]
        for batch in window:
            self._record(batch)

    def _defer(self, batch: Any) -> None:
        self._deferred.append(batch)
        self._deferred_events += event_count(batch)
        if self._deferred_events > self._max_deferred:
            if self._round is not None:
                self._finish(UNAVAILABLE, "the live stream outran it")
            else:
                self.abandon_resync()

    def invalidate(self, reason: str) -> None:
        """Batches were lost before reaching the recorder: it cannot be exact."""
        self.settle()
        if self._round is not None:
            self._finish(UNAVAILABLE, reason)
        self.recorder.invalidate(reason)
        self._say()

    def _record(self, batch: Any) -> None:
        self.recorder.record(batch)
        if self.recorder.valid != self._was_valid:
            self._say()

    def _say(self) -> None:
        rec = self.recorder
        self._was_valid = rec.valid
        if rec.valid:
            log.info("kv-coalesce: the snapshot recorder is exact again (after a clear)")
        else:
            log.warning(
                "kv-coalesce: snapshots unavailable (%s) until the next AllBlocksCleared",
                rec.reason,
            )

    # -- the ROUTER ----------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A reply is being built, or requests wait."""
        return self._round is not None or bool(self._waiting)

    # -- the in-band resync -----------------------------------------------------------

    @property
    def resyncing(self) -> bool:
        """A resync is under way: its chunks go out before any later batch."""
        return self._resync is not None

    def start_resync(self) -> bool:
        """Begin a resync of the recorder's state (after a loss marker).  False, and
        nothing begun, while the recorder is not exact or a reply is being built."""
        if self._resync is not None or self._round is not None:
            return False
        self.settle()
        if not self.recorder.valid:
            return False
        self._resync = self.recorder.chunks()
        return True

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
        walk, self._resync = self._resync, None
        if walk is not None:
            walk.close()
        self._catch_up()

    def step(self, covered_seq: Callable[[], int]) -> bool:
        """Read requests; start a reply, or build one more chunk of it.  Never blocks.

        ``covered_seq()`` names the last message the recorder's state covers
        (it may show a pending loss first).  Returns True if it did anything.
        """
        if self._sock is None:
            return False  # no ROUTER: this service only feeds resyncs
        did = read_requests(self._sock, self._request)
        rnd = self._round
        if rnd is None:
            if not self._waiting or self._resync is not None:  # (one walk at a time)
                return did
            clients, self._waiting = self._waiting, []
            self.settle()  # the state as of covered_seq()
            if not self.recorder.valid:
                self._reply(clients, UNAVAILABLE, [])
                return True
            seq = covered_seq()
            if seq < 0:
                self._reply(clients, NOTHING_SENT, [])
                return True
            self._round = _Round(seq, clients, self.recorder.chunks())
            return True
        try:
            chunk = next(rnd.chunks, None)
            # (empty: the end, or a step spent walking keys: nothing to send)
            payload = self._encoder.encode_now(chunk, self._rank) if chunk else b""
        except Exception as exc:  # a recorded event msgspec cannot encode
            why = f"a recorded event does not encode ({type(exc).__name__})"
            self._finish(UNAVAILABLE, why)
            self.recorder.invalidate(f"{why}: {exc!s:.200}")
            self._say()
            return True
        if chunk is None:
            self._finish(rnd.seq, "")
            return True
        if not payload:
            return True
        rnd.frames.append(payload)
        rnd.size += len(payload)
        if rnd.size > self._max_bytes:
            self._finish(UNAVAILABLE, "larger than snapshot_max_response_bytes")
        return True

    def _request(self, frames: list[bytes]) -> None:
        if frames[-1] != REQUEST or len(frames) not in (2, 3) or frames[1:-1] not in ([], [b""]):
            self.invalid += 1
            log.debug("ignored a malformed snapshot request of %d frames", len(frames))
        elif len(self._waiting) >= self._max_waiting:
            self.refused += 1
        else:
            self.requests += 1
            self._waiting.append(frames[:-1])  # identity (and a REQ's delimiter)

    def _finish(self, seq: int, why: str) -> None:
        """Send the round's reply (or ``-2``), then let the recorder catch up."""
        rnd, self._round = self._round, None
        assert rnd is not None
        rnd.chunks.close()  # ends the recorder's walk: it may record again
        if seq == UNAVAILABLE:
            log.warning("kv-coalesce: a snapshot reply was abandoned: %s", why)
            self._reply(rnd.clients, UNAVAILABLE, [])
        else:
            self._reply(rnd.clients, seq, rnd.frames)
        self._catch_up()

    def _catch_up(self) -> None:
        """Record what waited while the recorder was frozen."""
        deferred, self._deferred, self._deferred_events = self._deferred, deque(), 0
        self.record(deferred)

    def close(self) -> None:
        """Close the ROUTER (the sender thread calls it when it stops)."""
        if self._round is not None:
            self._round.chunks.close()
            self._round = None
        if self._resync is not None:
            self._resync.close()
            self._resync = None
        self._deferred.clear()
        if self._sock is not None:
            self._sock.close(linger=0)

    def _reply(self, clients: list[list[bytes]], seq: int, frames: list[bytes]) -> None:
        head = seq.to_bytes(8, "big", signed=True)
        sock, pid = self._sock, self._id
        assert sock is not None and pid is not None  # only a ROUTER's requests get replies
        for envelope in clients:
            try:
                sock.send(envelope[0], _MORE | _NOBLOCK)  # routing and the HWM: this frame
                for part in envelope[1:]:
                    sock.send(part, _MORE)
                sock.send(head, _MORE)
                sock.send(pid, _MORE if frames else 0)
                for i, frame in enumerate(frames):
                    sock.send(frame, _MORE if i + 1 < len(frames) else 0, copy=False)
            except zmq.ZMQError:
                self.abandoned += 1  # gone (EHOSTUNREACH) or not reading (EAGAIN)
                continue
            if seq == UNAVAILABLE:
                self.unavailable += 1
            else:
                self.replies += 1
                self.chunks_sent += len(frames)
