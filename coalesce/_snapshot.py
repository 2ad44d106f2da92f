"""The snapshot service: answers ``b"snapshot"`` on its own ROUTER (vLLM PR #57789's shape).

Request: one frame ``b"snapshot"`` (from a DEALER; a REQ's empty delimiter
is kept and echoed).  Reply: one multipart message ``[seq, publisher_id,
chunk...]`` where ``seq`` is 8 signed big-endian bytes naming the last
message the snapshot covers (-1: nothing sent yet; -2: unavailable) and each
chunk is one encoded batch ``[ts, events, data_parallel_rank]`` of the
recorder's replay program (:class:`coalesce._recorder.Recorder`).

The sender thread owns it and calls :meth:`SnapshotServer.step` from its
loop (through ``coalesce._services``).  The state comes from the recorder's
feed (``coalesce._feed``): a reply is one walk of the recorder, built a chunk
per step (bounded work) while live sending goes on between steps.  Requests
that arrive while a reply is being built wait for the next one, which starts
from the newer state.  Nothing here touches ``publish()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from coalesce._feed import Feed, Walk
from coalesce._wire import Encoder, read_requests
from coalesce.stats import SnapshotStats

__all__ = ["HEARTBEAT", "NOTHING_SENT", "UNAVAILABLE", "SnapshotServer", "SnapshotStats"]

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

    def __init__(self, seq: int, clients: list[list[bytes]], chunks: Walk) -> None:
        self.seq = seq
        self.clients = clients
        self.chunks = chunks
        self.frames: list[bytes] = []
        self.size = 0


class SnapshotServer:
    """The snapshot ROUTER: answers ``b"snapshot"`` from the feed's recorder."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        feed: Feed,
        publisher_id: bytes,
        rank: int,
        *,
        max_response_bytes: int,
        max_waiting: int = 64,
    ) -> None:
        self._sock = sock
        self._feed = feed
        self._encoder = Encoder()
        self._id = publisher_id
        self._rank = rank
        self._max_bytes = max_response_bytes
        self._max_waiting = max_waiting
        self._waiting: list[list[bytes]] = []
        self._round: _Round | None = None
        self.requests = self.invalid = self.refused = self.abandoned = 0
        self.replies = self.unavailable = self.chunks_sent = 0

    def stats(self) -> SnapshotStats:
        """The counters and the recorder's gauges, frozen.  O(1)."""
        rec = self._feed.recorder
        return SnapshotStats(
            snapshot_requests=self.requests,
            snapshot_invalid=self.invalid + self.refused,
            snapshot_replies=self.replies,
            snapshot_unavailable=self.unavailable,
            snapshot_abandoned=self.abandoned,
            snapshot_blocks=rec.held,
            snapshot_exact=rec.valid,
        )

    # -- the ROUTER ----------------------------------------------------------------

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The ROUTER (the sender waits on it while idle)."""
        return self._sock

    @property
    def busy(self) -> bool:
        """A reply is being built, or requests wait."""
        return self._round is not None or bool(self._waiting)

    def step(self, covered_seq: Callable[[], int]) -> bool:
        """Read requests; start a reply, or build one more chunk of it.  Never blocks.

        ``covered_seq()`` names the last message the recorder's state covers
        (it may show a pending loss first).  Returns True if it did anything.
        """
        did = read_requests(self._sock, self._request)
        rnd = self._round
        if rnd is None:
            if not self._waiting or self._feed.walking:  # (one walk at a time)
                return did
            clients, self._waiting = self._waiting, []
            walk = self._feed.begin_walk(self._abandon)  # the state as of covered_seq()
            if walk is None:
                self._reply(clients, UNAVAILABLE, [])
                return True
            seq = covered_seq()
            if seq < 0:
                self._feed.end_walk()
                self._reply(clients, NOTHING_SENT, [])
                return True
            self._round = _Round(seq, clients, walk)
            return True
        try:
            chunk = next(rnd.chunks, None)
            # (empty: the end, or a step spent walking keys: nothing to send)
            payload = self._encoder.encode_now(chunk, self._rank) if chunk else b""
        except Exception as exc:  # a recorded event msgspec cannot encode
            self._feed.invalid_event(exc)  # (abandons this round)
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

    def _abandon(self, why: str) -> None:
        """The feed stops this round early: its clients get ``-2`` (and ask again)."""
        self._finish(UNAVAILABLE, why)

    def _finish(self, seq: int, why: str) -> None:
        """Send the round's reply (or ``-2``), then let the recorder catch up."""
        rnd, self._round = self._round, None
        assert rnd is not None
        if seq == UNAVAILABLE:
            log.warning("kv-coalesce: a snapshot reply was abandoned: %s", why)
            self._reply(rnd.clients, UNAVAILABLE, [])
        else:
            self._reply(rnd.clients, seq, rnd.frames)
        self._feed.end_walk()  # ends the recorder's walk: it records what waited

    def close(self) -> None:
        """Close the ROUTER (the sender thread calls it when it stops)."""
        self._round = None
        self._sock.close(linger=0)

    def _reply(self, clients: list[list[bytes]], seq: int, frames: list[bytes]) -> None:
        head = seq.to_bytes(8, "big", signed=True)
        sock, pid = self._sock, self._id
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
