"""The replay buffer and the ROUTER service that answers replay requests.

Protocol (vLLM's): a client sends one frame, the start seq as 8 bytes
big-endian; the ROUTER sees ``[identity, b"", start]``.  The reply is
``[identity, b"", topic, seq, payload]`` for every buffered message with
``seq >= start``, then ``[identity, b"", b"", ff*8, b""]``.  A start seq that
was evicted (or skipped by a loss) simply gets a reply that starts later.

Unlike vLLM, replies are paced and bounded, so that replay clients can cost
the engine neither time nor unbounded memory:

- A reply is sent in slices interleaved with live publishing: each
  :meth:`ReplayService.step` sends at most ``budget`` messages, shared
  round-robin by the replies in progress, so one replay of 10,000 messages
  never holds the sender (and the GIL) for long, and one client cannot starve
  the others.
- The ROUTER's send high-water mark is ``window`` messages per client, and it
  is ``ROUTER_MANDATORY``: a client that is not reading makes its reply wait
  (``EAGAIN``, retried at a later step) instead of queueing the whole buffer
  in ZeroMQ; a reply that makes no progress for ``stall_timeout`` seconds is
  abandoned, and one to a client that has gone (``EHOSTUNREACH``) stops at once.
- At most ``max_active`` replies are in progress; up to ``max_waiting``
  further requests wait their turn; and requests are refused (not answered,
  _counted in ``refused``) while more than ``max_clients`` connections are
  open (_counted by a ZeroMQ socket monitor; tcp and ipc only, inproc peers are
  in-process).  So what ZeroMQ holds for all replay clients together is at
  most ``max_clients * window`` messages.

A reply covers the messages that were buffered when the request arrived.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from coalesce._settings import Settings
from coalesce._stream import ReplayBuffer
from coalesce._wire import END_SEQ, read_requests
from coalesce.stats import ReplayStats, _counted

__all__ = ["ReplayService"]

_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_EVENTS = zmq.EVENTS
_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
log = logging.getLogger("coalesce")


class _Reply:
    """One reply in progress: who, the next seq to send, the last one, when it last moved."""

    __slots__ = ("identity", "last_seq", "next_seq", "progress_at")

    def __init__(self, identity: bytes, start: int, last_seq: int, now: float) -> None:
        self.identity = identity
        self.next_seq = start
        self.last_seq = last_seq
        self.progress_at = now


class ReplayService:
    """Answers replay requests on a bound ROUTER socket, a bounded slice per step.

    The sender thread owns it: :meth:`step` from the sender loop, :meth:`close`
    when the sender stops.  The counters are read by ``stats()``.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        buffer: ReplayBuffer,
        topic: bytes,
        *,
        chunk: int = 256,
        max_active: int = 8,
        max_waiting: int = 1024,
        max_clients: int = 32,
        stall_timeout: float = 5.0,
    ) -> None:
        self._sock = sock
        self._buffer = buffer
        self._topic = topic
        self.chunk = chunk
        self._max_active = max_active
        self._max_waiting = max_waiting
        self._max_clients = max_clients
        self._stall_timeout = stall_timeout
        self._active: deque[_Reply] = deque()
        self._waiting: deque[tuple[bytes, int]] = deque()
        self._monitor: zmq.Socket[bytes] | None = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        self._steps = 0
        self.clients = 0
        """Open tcp/ipc connections to the ROUTER, as its monitor last reported."""
        self.requests = self.invalid = self.refused = self.abandoned = 0
        self.messages = 0

    @classmethod
    def from_settings(
        cls, sock: zmq.Socket[bytes], buffer: ReplayBuffer, topic: bytes, settings: Settings
    ) -> ReplayService:
        """The service with the publisher's ``replay_*`` knobs."""
        return cls(
            sock,
            buffer,
            topic,
            max_active=settings.replay_max_active,
            max_clients=settings.replay_max_clients,
        )

    def stats(self) -> ReplayStats:
        """The counters, frozen.  O(1)."""
        return _counted(ReplayStats, self, "replay_")

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The ROUTER (the sender waits on it while idle)."""
        return self._sock

    @property
    def busy(self) -> bool:
        """A reply is in progress or waiting."""
        return bool(self._active or self._waiting)

    def step(self, budget: int | None = None) -> bool:
        """Read waiting requests and send up to ``budget`` (default ``chunk``) messages.

        Returns True if it did anything.  O(budget + requests read); never
        blocks.  The budget is shared round-robin by the replies in progress.
        """
        sock = self._sock
        self._steps += 1
        if not self._steps & 63:  # keep the monitor's pipe drained, requests or not
            self._count_clients()
        did = read_requests(sock, self._request)
        if not self._active and not self._waiting:
            return did
        now = time.monotonic()
        while self._waiting and len(self._active) < self._max_active:
            identity, start = self._waiting.popleft()
            self._active.append(_Reply(identity, start, self._buffer.last_seq, now))
        left = self.chunk if budget is None else budget
        for _ in range(len(self._active)):
            if left <= 0:
                break
            share = max(1, left // len(self._active))
            reply = self._active.popleft()
            sent, keep = self._send_slice(reply, share, now)
            left -= max(sent, 1)
            if keep:
                self._active.append(reply)  # round-robin: to the back of the line
        return True

    def _request(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.invalid += 1
            log.debug("ignored a malformed replay request of %d frames", len(frames))
            return
        self._count_clients()
        if self.clients > self._max_clients or len(self._waiting) >= self._max_waiting:
            self.refused += 1
            log.debug(
                "refused a replay request (%d clients, %d waiting)",
                self.clients,
                len(self._waiting),
            )
            return
        self.requests += 1
        self._waiting.append((frames[0], int.from_bytes(frames[2], "big")))

    def _count_clients(self) -> None:
        """Apply the monitor's connection events: before each request, and every 64 steps."""
        mon = self._monitor
        if mon is None:
            return
        while mon.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
            frames = mon.recv_multipart()
            event = int.from_bytes(frames[0][:2], "little")
            if event == _ACCEPTED:
                self.clients += 1
            elif event == _DISCONNECTED:
                self.clients = max(0, self.clients - 1)

    def _send_slice(self, reply: _Reply, budget: int, now: float) -> tuple[int, bool]:
        """Send up to ``budget`` messages of ``reply``; return (sent, still in progress).

        ``EAGAIN`` (the client's queue is at ``window``: it is not reading)
        keeps the reply for a later step, until ``stall_timeout`` passes with no
        progress; ``EHOSTUNREACH`` (the client has gone) ends it at once.
        """
        buf, sent = self._buffer, 0
        i = buf.index_of(reply.next_seq)
        try:
            while sent < budget and i < len(buf) and buf[i][0] <= reply.last_seq:
                seq, payload = buf[i]
                self._send(reply.identity, self._topic, seq.to_bytes(8, "big"), payload)
                sent += 1
                i += 1
                reply.next_seq = seq + 1
                self.messages += 1
            if sent:
                reply.progress_at = now
            if sent < budget:  # nothing left to send for this client: end marker
                self._send(reply.identity, b"", END_SEQ, b"")
                return sent + 1, False
        except zmq.ZMQError as exc:
            if sent:
                reply.progress_at = now
            if exc.errno == zmq.EAGAIN and now - reply.progress_at < self._stall_timeout:
                return sent, True  # its queue is full: try again at a later step
            self.abandoned += 1  # gone (EHOSTUNREACH), stalled too long, or broken
            return sent, False
        return sent, True

    def _send(self, identity: bytes, topic: bytes, seq: bytes, payload: bytes) -> None:
        sock = self._sock
        sock.send(identity, _MORE | _NOBLOCK)  # routing (and the HWM) is decided on this frame
        sock.send(b"", _MORE)
        sock.send(topic, _MORE)
        sock.send(seq, _MORE)
        sock.send(payload)

    def close(self) -> None:
        """Stop the monitor (the sender closes the ROUTER itself)."""
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            finally:
                self._monitor.close(linger=0)
                self._monitor = None
