"""The sender's other sockets: replay and snapshot requests, and heartbeats.

The sender thread calls :meth:`Services.step` and :meth:`Services.beat` from
its loop; each is bounded work and never blocks.  Looking at a ROUTER
(``ZMQ_EVENTS``) makes libzmq process its command pipe, a system call of a few
µs taken from the engine, so while no reply is being built the sockets are
looked at every :data:`SERVICE_POLL` seconds, not at every turn.

An idle sender with sockets to serve sleeps on its own bell first, then in
:meth:`Services.sleep`: one ``zmq_poll`` on both ROUTERs and the read end of a
pipe, which :meth:`Services.ring` writes to (``publish()`` and ``shutdown()``
wake it that way).  A request, a ring, the next heartbeat or a reply waiting
to go on (:data:`BUSY_POLL`) ends the sleep; nothing is looked at in between.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time

import zmq

from coalesce._backlog import Backlog
from coalesce._replay import ReplayService
from coalesce._snapshot import HEARTBEAT, SnapshotServer
from coalesce._stream import Stream
from coalesce.stats import ReplayStats, SnapshotStats

__all__ = ["BUSY_POLL", "SERVICE_POLL", "Services"]

SERVICE_POLL = 0.001
"""Seconds between looks at the replay and snapshot sockets while neither is
serving a reply.  A request waits at most this long (or the sender's idle
sleep while it sleeps)."""

_write = ctypes.PyDLL(None).write
"""libc's ``write``, called with the GIL held (as a ``threading.Lock`` release
keeps it): ``os.write`` releases the GIL for the system call, and the sender it
wakes would take it there, inside ``publish()``, and run its step first."""
_write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
_write.restype = ctypes.c_ssize_t

BUSY_POLL = 0.005
"""Seconds an idle sender sleeps while a reply waits on something the sockets
do not signal (a client not reading, a snapshot behind another walk)."""


class Services:
    """The replay ROUTER, the snapshot ROUTER (either may be None) and the heartbeat
    of a stream whose subscribers expect one (snapshots on)."""

    def __init__(
        self,
        replay: ReplayService | None,
        snapshot: SnapshotServer | None,
        stream: Stream,
        backlog: Backlog,
        high_watermark: int,
    ) -> None:
        self.replay = replay
        self.snapshot = snapshot
        self._stream = stream
        self._backlog = backlog
        self._high_watermark = high_watermark
        self._poll_at = 0.0  # when the sockets are next looked at
        self._poller: zmq.Poller | None = None
        self._bell_r = self._bell_w = -1
        self._bell_lock = threading.Lock()  # ring() against close(): no write to a reused fd
        if self.any:
            self._bell_r, self._bell_w = os.pipe()
            os.set_blocking(self._bell_r, False)
            os.set_blocking(self._bell_w, False)
            self._poller = zmq.Poller()
            for service in (replay, snapshot):
                if service is not None:
                    self._poller.register(service.socket, zmq.POLLIN)
            self._poller.register(self._bell_r, zmq.POLLIN)

    @property
    def any(self) -> bool:
        """A ROUTER to serve (else :meth:`step` has nothing to do)."""
        return self.replay is not None or self.snapshot is not None

    def step(self) -> bool:
        """Read requests and send a slice of each reply under way (fewer replay
        messages while the live stream is behind its high-water mark).  True if it
        did anything."""
        replay, snapshot = self.replay, self.snapshot
        now = time.monotonic()
        if now < self._poll_at and not self._busy():
            return False
        self._poll_at = now + SERVICE_POLL
        did = False
        if replay is not None:
            chunk = replay.chunk
            behind = self._backlog.waiting > self._high_watermark
            did = replay.step(chunk // 8 if behind else chunk)
        if snapshot is not None and snapshot.step(self._stream.covered):
            did = True
        return did

    def ring(self) -> None:
        """Wake :meth:`sleep` now, or end the next one at once.  O(1), never blocks
        and keeps the GIL; safe from any thread."""
        with self._bell_lock:
            if self._bell_w < 0:  # closed: the sender has stopped
                return
            _write(self._bell_w, b"!", 1)  # (-1 when the pipe is full: rung already)

    def sleep(self, longest: float) -> None:
        """Sleep (the GIL released) until a request comes, :meth:`ring` is called,
        the stream is due a heartbeat, or ``longest`` seconds pass; while a reply
        waits, :data:`BUSY_POLL` at most.  Only with sockets to serve."""
        assert self._poller is not None
        woken = self._poller.poll(int(self.sleep_for(longest) * 1000) + 1)
        for what, _ in woken:
            if what == self._bell_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._bell_r, 4096)  # (any rings left end the next sleep)
            else:  # a request: read it now
                self._poll_at = 0.0

    def sleep_for(self, longest: float) -> float:
        """Seconds an idle sender may sleep, ``longest`` at most: less if the stream
        is due a heartbeat, :data:`BUSY_POLL` while a reply waits.  O(1)."""
        if self._busy():
            longest = min(longest, BUSY_POLL)
        stream = self._stream
        if stream.beats:
            longest = min(longest, stream.last_sent + HEARTBEAT - time.monotonic())
        return max(longest, 0.0)

    def _busy(self) -> bool:
        replay, snapshot = self.replay, self.snapshot
        return (replay is not None and replay.busy) or (snapshot is not None and snapshot.busy)

    def poll_now(self) -> None:
        """Look at the sockets at the next :meth:`step` (tests)."""
        self._poll_at = 0.0

    def beat(self) -> bool:
        """Send a heartbeat if the stream has been silent for :data:`HEARTBEAT`
        seconds and expects one.  True if it sent one."""
        stream = self._stream
        if stream.beats and time.monotonic() - stream.last_sent >= HEARTBEAT:
            stream.heartbeat()
            return True
        return False

    def replay_stats(self) -> ReplayStats:
        return ReplayStats() if self.replay is None else self.replay.stats()

    def snapshot_stats(self) -> SnapshotStats:
        return SnapshotStats() if self.snapshot is None else self.snapshot.stats()

    def close(self) -> None:
        """Close both ROUTERs and the bell (the sender thread stops)."""
        if self._poller is not None:
            self._poller = None
            with self._bell_lock:
                os.close(self._bell_r)
                os.close(self._bell_w)
                self._bell_r = self._bell_w = -1
        if self.replay is not None:
            self.replay.close()
        if self.snapshot is not None:
            self.snapshot.close()
