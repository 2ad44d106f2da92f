"""Encode and send: one batch becomes one 3-frame ZMQ message.

Frames: ``[topic, seq (8 bytes big-endian), msgpack payload]``, sent as
three ``send()`` calls with a plain-int ``SNDMORE`` flag: ``send_multipart``
builds an IntFlag per frame, which costs more than the send itself
(docs/benchmarks.md and the facts sheet have the figures).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import msgspec
import zmq

__all__ = ["END_SEQ", "Encoder", "read_requests", "send_message"]

_MORE = int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
END_SEQ = b"\xff" * 8
"""The replay end marker's seq frame (-1 as 8 signed big-endian bytes)."""


class Encoder:
    """msgspec msgpack encoding of any ``EventBatch``-like struct.  O(events), in C.

    With a ``publisher_id`` (snapshots on), each payload is
    ``[ts, events, data_parallel_rank, publisher_id]``: the batch's fields,
    encoded exactly as the struct encodes them, and the id as msgpack bin.
    """

    def __init__(self, publisher_id: bytes | None = None) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._id = publisher_id

    def encode(self, batch: Any) -> bytes:
        """Encode one batch.  Raises whatever msgspec raises for an unencodable value."""
        if self._id is None:
            return self._enc.encode(batch)
        return self.encode_with_id(batch.ts, batch.events, batch.data_parallel_rank)

    def encode_with_id(self, ts: float, events: list[Any], rank: int | None) -> bytes:
        """``[ts, events, rank, publisher_id]`` without building a batch (a snapshot
        chunk).  Only with a ``publisher_id``."""
        if self._id is None:
            raise ValueError("encode_with_id needs an Encoder with a publisher_id")
        return self._enc.encode((ts, events, rank, self._id))


def send_message(sock: zmq.Socket[bytes], topic: bytes, seq: int, payload: bytes) -> None:
    """Send one 3-frame message on a PUB socket.  Never blocks: PUB drops at its HWM."""
    sock.send(topic, _MORE)
    sock.send(seq.to_bytes(8, "big"), _MORE)
    sock.send(payload)


def read_requests(
    sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], None], limit: int = 16
) -> bool:
    """Hand each waiting request (a multipart message) to ``handle``, at most ``limit``.

    Never blocks (it reads only while ``EVENTS`` says one is waiting), so a
    ROUTER service's step stays bounded however many clients ask.  Returns
    True if it read any.  O(limit).
    """
    did = False
    for _ in range(limit):
        if not cast(int, sock.getsockopt(zmq.EVENTS)) & _POLLIN:
            break
        handle(sock.recv_multipart())
        did = True
    return did
