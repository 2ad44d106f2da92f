"""The stream: the one place a seq is assigned and a message goes on the wire.

Every message, whether a batch's payload, a loss's marker or a heartbeat, is
sent here, kept for replay here and _counted here, once; the sender thread owns
one :class:`Stream` and sends through nothing else.

A loss (a batch refused, abandoned or unencodable) is noted with
:meth:`Stream.lose` and shown before the next message, in one of two forms
(:class:`~coalesce._settings.LossMarker`):

- a marker (``"resync"``, the default, and ``"clear"``): the loss takes a seq
  of its own, carried by a *loss marker*, a batch holding one
  ``AllBlocksCleared`` for this rank. The sequence never has a hole, so a
  replay is always contiguous; every consumer that applies the batch forgets
  that rank's blocks (llm-d: every tier of the pod; Dynamo: the worker; vLLM's
  decoder: an ordinary event), and from there it can only be missing blocks,
  never hold stale ones.  With ``"resync"`` the recorded state follows it
  (``coalesce._resync``), sent through here like any batch.
- ``"gap"``: the loss skips a seq. A consumer with replay finds that seq
  missing and resets the rank on its own terms (llm-d blacks it out for a
  cooldown); one without replay (Dynamo) keeps whatever the lost batch would
  have removed.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from coalesce._settings import LossMarker
from coalesce._wire import Encoder, SendMessage
from coalesce.events import AllBlocksCleared
from coalesce.stats import StreamStats, _counted

__all__ = ["ReplayBuffer", "Stream"]


class ReplayBuffer:
    """The last ``capacity`` sent messages as ``(seq, payload)``, seqs increasing:
    written by the :class:`Stream` as it sends, read by ``coalesce._replay``."""

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


class Stream:
    """A publisher's sequence: seqs, the replay buffer and the wire counters.

    ``empty()`` encodes an empty batch of this rank (a heartbeat, or the message
    that shows a final gap), ``marker()`` a loss marker; both are called only
    when such a message is sent.  Every method is O(1) but for the send itself.
    """

    __slots__ = (
        "_buffer",
        "_empty",
        "_lost",
        "_marker",
        "_send",
        "_suffix",
        "_topic",
        "beats",
        "bytes_sent",
        "events_sent",
        "last_sent",
        "loss_markers",
        "messages_sent",
        "next_seq",
        "seq_gaps",
    )

    def __init__(
        self,
        send: SendMessage | None,
        topic: bytes,
        buffer: ReplayBuffer,
        empty: Callable[[], bytes],
        marker: Callable[[], bytes] | None,
        beats: bool = False,
        identity: bytes | None = None,
    ) -> None:
        self._send: SendMessage = send if send is not None else _no_socket
        self.beats = beats
        """Whether :attr:`last_sent` is kept for every message (the owner sends
        heartbeats); else only markers and heartbeats set it."""
        self._suffix = None if identity is None else b"\xc4\x10" + identity
        """With ``identity``, every payload gets it as one more batch element (a msgpack
        bin 8 of 16 bytes): vLLM PR #57789's ``IdentifiedKVEventBatch``."""
        self._topic = topic
        self._buffer = buffer
        self._empty = empty
        self._marker = marker
        self._lost = False
        self.next_seq = 0
        self.messages_sent = self.events_sent = self.bytes_sent = 0
        self.seq_gaps = self.loss_markers = 0
        self.last_sent = time.monotonic()

    @classmethod
    def of_rank(
        cls,
        send: SendMessage | None,
        topic: bytes,
        buffer: ReplayBuffer,
        encoder: Encoder,
        rank: int,
        loss_marker: LossMarker,
        beats: bool = False,
        identity: bytes | None = None,
    ) -> Stream:
        """The stream of one DP rank's publisher: its empty batches and loss markers
        are that rank's, encoded by ``encoder``; ``loss_marker`` is the setting;
        ``beats``: it sends heartbeats (keep :attr:`last_sent`); ``identity``: each
        payload carries it as a 4th batch element."""
        if loss_marker not in tuple(LossMarker):
            names = [m.value for m in LossMarker]
            raise ValueError(f"loss_marker must be one of {names}, not {loss_marker!r}")
        loss_marker = LossMarker(loss_marker)
        cleared = [AllBlocksCleared()]
        return cls(
            send,
            topic,
            buffer,
            empty=lambda: encoder.encode_now([], rank),
            marker=(lambda: encoder.encode_now(cleared, rank))
            if loss_marker is not LossMarker.GAP
            else None,
            beats=beats,
            identity=identity,
        )

    def use(self, send: SendMessage) -> None:
        """Send with ``send`` from now on (a socket of this process's own)."""
        self._send = send

    @property
    def loss_pending(self) -> bool:
        """A loss noted and not yet shown on the wire."""
        return self._lost

    def lose(self) -> None:
        """Note a loss: it is shown before the next message (or by :meth:`show_loss`)."""
        self._lost = True

    def emit(self, payload: bytes, n_events: int) -> int:
        """Send ``payload`` (after showing a pending loss); its seq.  The hot path:
        :meth:`_put`'s lines, inline."""
        if self._lost:
            self._show()
        if self.beats:  # (snapshots on: the identity, the time)
            return self._put(payload, n_events)
        seq = self.next_seq
        self._send(self._topic, seq, payload)  # if it raises, the seq is still free
        self.next_seq = seq + 1
        self._buffer.append(seq, payload)
        self.messages_sent += 1
        self.events_sent += n_events
        self.bytes_sent += len(payload)
        return seq

    def heartbeat(self) -> None:
        """Send an empty batch (the idle publisher's heartbeat)."""
        if self._lost:
            self._show()
        self._put(self._empty(), 0)

    def covered(self) -> int:
        """The last seq taken, a pending loss shown first (so a snapshot cut at this
        seq covers it).  -1 before the first message."""
        if self._lost:
            self._show()
        return self.next_seq - 1

    def show_loss(self) -> None:
        """Show a pending loss now, even with no message to follow: a marker, or an
        empty batch after the gap (a loss at the end is otherwise invisible)."""
        if not self._lost:
            return
        if self._marker is not None:
            self._show()
        else:
            self.heartbeat()

    def stats(self) -> StreamStats:
        """The counters, frozen.  O(1)."""
        return _counted(StreamStats, self)

    def _show(self) -> None:
        if self._marker is None:
            self.next_seq += 1
            self.seq_gaps += 1
        else:
            self._put(self._marker(), 0)  # (if the send raises, the loss stays pending)
            self.loss_markers += 1
        self._lost = False

    def _put(self, payload: bytes, n_events: int) -> int:
        """Send a marker, a heartbeat, or (snapshots on) any message, with its identity
        (:meth:`emit` holds the same lines for the rest)."""
        suffix = self._suffix
        if suffix is not None and 0x90 <= payload[0] < 0x9F:  # a fixarray: one element more
            payload = b"".join((bytes((payload[0] + 1,)), memoryview(payload)[1:], suffix))
        seq = self.next_seq
        self._send(self._topic, seq, payload)
        self.next_seq = seq + 1
        self._buffer.append(seq, payload)
        self.last_sent = time.monotonic()
        self.messages_sent += 1
        self.events_sent += n_events
        self.bytes_sent += len(payload)
        return seq


def _no_socket(topic: bytes, seq: int, payload: bytes) -> None:
    raise RuntimeError("a stream is given its socket (use()) before its first message")
