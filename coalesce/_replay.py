"""The replay buffer and the ROUTER service that answers replay requests.

Protocol (vLLM's): a client sends one frame, the start seq as 8 bytes
big-endian; the ROUTER sees ``[identity, b"", start]``.  The reply is
``[identity, b"", topic, seq, payload]`` for every buffered message with
``seq >= start``, then ``[identity, b"", b"", ff*8, b""]``.  A start seq that
was evicted (or skipped by a loss) simply gets a reply that starts later.

Unlike vLLM, a long reply is sent in slices of ``chunk`` messages per
:meth:`ReplayService.step`, interleaved with live publishing, so one replay
of 10,000 messages never holds the sender (and the GIL) for tens of ms.  A
reply covers the messages that were buffered when the request arrived.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque

import zmq

from coalesce._wire import END_SEQ

__all__ = ["ReplayBuffer", "ReplayService"]

_MORE = int(zmq.SNDMORE)
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
        identity, next_seq, last_seq = reply
        assert isinstance(identity, bytes) and isinstance(next_seq, int)
        assert isinstance(last_seq, int)
        buf, sock, sent = self._buffer, self._sock, 0
        i = buf.index_of(next_seq)
        while sent < budget and i < len(buf) and buf[i][0] <= last_seq:
            seq, payload = buf[i]
            sock.send(identity, _MORE)
            sock.send(b"", _MORE)
            sock.send(self._topic, _MORE)
            sock.send(seq.to_bytes(8, "big"), _MORE)
            sock.send(payload)
            sent += 1
            i += 1
            reply[1] = seq + 1
        if sent < budget:  # nothing left to send for this client: end marker
            for frame in (identity, b"", b"", END_SEQ):
                sock.send(frame, _MORE)
            sock.send(b"")
            self._active.popleft()
            sent += 1
        self.messages += sent
        return sent
