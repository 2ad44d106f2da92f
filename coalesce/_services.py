"""The sender's other sockets: replay and snapshot requests, and heartbeats.

The sender thread calls :meth:`Services.step` and :meth:`Services.beat` from
its loop; each is bounded work and never blocks.  Looking at a ROUTER
(``ZMQ_EVENTS``) makes libzmq process its command pipe, a system call of a few
µs taken from the engine, so while no reply is being built the sockets are
looked at every :data:`SERVICE_POLL` seconds, not at every turn.
"""

from __future__ import annotations

import time

from coalesce._backlog import Backlog
from coalesce._replay import ReplayService
from coalesce._snapshot import HEARTBEAT, SnapshotServer
from coalesce._stream import Stream
from coalesce.stats import ReplayStats, SnapshotStats

__all__ = ["SERVICE_POLL", "Services"]

SERVICE_POLL = 0.001
"""Seconds between looks at the replay and snapshot sockets while neither is
serving a reply.  A request waits at most this long (or the sender's idle
sleep while it sleeps)."""


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
        if not (
            now >= self._poll_at
            or (replay is not None and replay.busy)
            or (snapshot is not None and snapshot.busy)
        ):
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
        """Close both ROUTERs (the sender thread stops)."""
        if self.replay is not None:
            self.replay.close()
        if self.snapshot is not None:
            self.snapshot.close()
