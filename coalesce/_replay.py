"""The replay buffer and the ROUTER service that answers replay requests.

Protocol (vLLM's): a client sends one frame, the start seq as 8 bytes
big-endian; the ROUTER sees ``[identity, b"", start]``.  The reply is
``[identity, b"", topic, seq, payload]`` for every buffered message with
``seq >= start``, then ``[identity, b"", b"", ff*8, b""]``.  A start seq that
was evicted (or skipped by a loss) simply gets a reply that starts later.

Unlike vLLM, a long reply is sent in slices of ``chunk`` messages per
:meth:`ReplayService.step`, interleaved with live publishing, so one replay
of 10,000 messages never holds the sender (and the GIL) for tens of ms.  A
reply covers the messages that were buffered when the request arrived.  The
ROUTER is ``ROUTER_MANDATORY`` and sends without blocking: a reply to a client
that has gone stops at once, and one to a client at its high-water mark waits
for a later step instead of losing frames silently.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque

import zmq

from coalesce._wire import END_SEQ

__all__ = ["ReplayBuffer", "ReplayService"]

_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
log = logging.getLogger("coalesce")


class ReplayBuffer:
    """The last ``capacity`` sent messages as ``(seq, payload)``, seqs increasing."""

    def __init__(self, capacity: int) -> None:
        self._buf: deque[tuple[int, bytes]] = deque(maxlen=capacity)

    def append(self, seq: int, payload: bytes) -> None:
        """Remember a sent message, evicting the oldest at capacity.  O(1)."""
        self._buf.append((seq, payload))

    def index_of(self, seq: int) -> int:
        """Position of the first message with ``seq >= seq``.  O(log n) probes."""
        return bisect.bisect_left(self._buf, (seq,))

    def __getitem__(self, i: int) -> tuple[int, bytes]:
        return self._buf[i]

    def __len__(self) -> int:
        return len(self._buf)

    @property
    def last_seq(self) -> int:
        """The newest buffered seq, or -1."""
        return self._buf[-1][0] if self._buf else -1


class ReplayService:
    """Answers replay requests on a bound ROUTER socket, a bounded slice per step."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        buffer: ReplayBuffer,
        topic: bytes,
        chunk: int = 256,
        max_requests: int = 16,
    ) -> None:
        self._sock = sock
        self._buffer = buffer
        self._topic = topic
        self._chunk = chunk
        self._max_requests = max_requests
        # active replies: [identity, next seq to send, last seq to send]
        self._active: deque[list[object]] = deque()
        self.requests = 0
        self.invalid = 0
        self.messages = 0
        self.abandoned = 0

    @property
    def busy(self) -> bool:
        """A reply is still being sent."""
        return bool(self._active)

    def step(self) -> bool:
        """Read waiting requests and send up to ``chunk`` reply messages.

        Returns True if it did anything.  O(chunk + requests); never blocks
        (the ROUTER drops a reply to a peer that is gone or over its HWM).
        """
        did = False
        sock = self._sock
        for _ in range(self._max_requests):
            if not sock.poll(0, zmq.POLLIN):
                break
            frames = sock.recv_multipart()
            did = True
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.invalid += 1
                log.debug("ignored a malformed replay request of %d frames", len(frames))
                continue
            self.requests += 1
            start = int.from_bytes(frames[2], "big")
            self._active.append([frames[0], start, self._buffer.last_seq])
        budget = self._chunk
        while self._active and budget > 0:
            budget -= self._send_slice(self._active[0], budget)
            did = True
        return did

    def _send_slice(self, reply: list[object], budget: int) -> int:
        """Send up to ``budget`` messages of the oldest reply; return how many were sent.

        The ROUTER is ``ROUTER_MANDATORY``: a client that has gone away
        (``EHOSTUNREACH``) ends its reply at once instead of costing a send per
        buffered message; a client at its HWM (``EAGAIN``) is retried later
        instead of silently losing frames.
        """
        identity, next_seq, last_seq = reply
        assert isinstance(identity, bytes) and isinstance(next_seq, int)
        assert isinstance(last_seq, int)
        buf, sent = self._buffer, 0
        i = buf.index_of(next_seq)
        try:
            while sent < budget and i < len(buf) and buf[i][0] <= last_seq:
                seq, payload = buf[i]
                self._send(identity, self._topic, seq.to_bytes(8, "big"), payload)
                sent += 1
                i += 1
                reply[1] = seq + 1
                self.messages += 1
            if sent < budget:  # nothing left to send for this client: end marker
                self._send(identity, b"", END_SEQ, b"")
                self._active.popleft()
                sent += 1
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN:  # its queue is full: try again next step
                self._active.rotate(-1)
                return max(sent, 1)
            self._active.popleft()  # gone (EHOSTUNREACH) or broken: drop the reply
            self.abandoned += 1
            return max(sent, 1)
        return sent

    def _send(self, identity: bytes, topic: bytes, seq: bytes, payload: bytes) -> None:
        sock = self._sock
        sock.send(identity, _MORE | _NOBLOCK)  # routing is decided on this frame
        sock.send(b"", _MORE)
        sock.send(topic, _MORE)
        sock.send(seq, _MORE)
        sock.send(payload)
