"""The engines' stock publishers and the upstream drop-on-full variant, for comparisons.

Used by ``coalesce demo`` and ``benchmarks/``; not part of the public API.

When ``vllm`` is importable (``make test-vllm`` builds .venv-vllm) the real
``vllm.distributed.kv_events.ZmqEventPublisher`` is used.  Otherwise
``StockPublisher`` below is a small re-implementation of its documented
behaviour (facts sheet section 1): a bounded ``queue.Queue`` with a blocking
``put`` on the caller's thread, and a sender thread that assigns the seq at
send time, encodes with msgspec and calls ``send_multipart``.  The drop
variant (vLLM PR #53883, open) only changes ``put`` to ``put_nowait`` and drops
the new batch when full, leaving no sequence gap.

SGLang's publisher (0.5.23) is a copy of vLLM's with the rank field named
``attn_dp_rank``: :func:`stock_publisher` gives the real one when ``sglang``
is importable, else the same re-implementation speaking SGLang's batch.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any

import msgspec
import zmq


def _real_vllm() -> Any:
    try:  # the real thing, when it is installed
        from vllm.distributed.kv_events import ZmqEventPublisher

        return ZmqEventPublisher
    except ImportError:
        return None


_VllmPublisher = _real_vllm()
REAL_VLLM = _VllmPublisher is not None


class _ReimplementedStock:
    """vLLM 0.33's ZmqEventPublisher behaviour, re-implemented (no replay socket).

    It keeps vLLM's replay buffer (every payload, ``buffer_steps`` of them) even
    though nothing can ask for it: holding those payloads is part of what vLLM's
    sender costs its process (fresh memory for every new payload).
    """

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
        topic: str = "",
        buffer_steps: int = 10_000,
        **_: Any,  # replay_endpoint: not re-implemented (subscribers then cannot replay)
    ) -> None:
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._rank = data_parallel_rank
        self._event_queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue_size)
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self._topic = topic.encode()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    rank_field = "data_parallel_rank"

    def publish(self, events: Any) -> None:
        if getattr(events, self.rank_field) is None:
            setattr(events, self.rank_field, self._rank)
        self._event_queue.put(events)

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        seq = 0
        while self._running or not self._event_queue.empty():
            try:
                item = self._event_queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                break
            payload = enc.encode(item)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def shutdown(self) -> None:
        self._running = False
        self._event_queue.put(None)
        self._thread.join(10)
        self._pub.close(linger=0)


StockPublisher: Any = _VllmPublisher if REAL_VLLM else _ReimplementedStock


class _ReimplementedSGLang(_ReimplementedStock):
    """SGLang 0.5.23's ZmqEventPublisher: vLLM's, with the rank in ``attn_dp_rank``."""

    rank_field = "attn_dp_rank"


class _DropOnFull:
    """Mixed in first: put_nowait, drop the new batch when full, no gap.  The class
    made by :func:`_drop_variant` says where the batch's rank and the publisher's are."""

    dropped = 0
    rank_field = "data_parallel_rank"
    rank_attr = "_rank"
    _event_queue: queue.Queue[Any]

    def publish(self, events: Any) -> None:
        if getattr(events, self.rank_field) is None:
            setattr(events, self.rank_field, getattr(self, self.rank_attr))
        try:
            self._event_queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1


def _drop_variant(base: Any, rank_field: str, rank_attr: str) -> Any:
    """``base`` with the upstream drop-on-full proposal's ``publish()``."""
    attrs = {"rank_field": rank_field, "rank_attr": rank_attr}
    return type(f"DropOnFull{base.__name__}", (_DropOnFull, base), attrs)


DropPublisher: Any = _drop_variant(
    StockPublisher, "data_parallel_rank", "_data_parallel_rank" if REAL_VLLM else "_rank"
)
"""vLLM's publisher with the upstream drop-on-full proposal (vLLM PR #53883)."""


def _real_sglang() -> Any:
    try:
        from sglang.srt.disaggregation.kv_events import ZmqEventPublisher
    except ImportError:
        return None
    return ZmqEventPublisher


def stock_publisher(engine: str, drop: bool = False) -> tuple[Any, bool]:
    """``(class, real)``: ``engine``'s stock publisher (or its drop-on-full variant),
    and whether it is the engine's own class rather than the re-implementation."""
    if engine == "vllm":
        return (DropPublisher if drop else StockPublisher), REAL_VLLM
    real = _real_sglang()
    base = real if real is not None else _ReimplementedSGLang
    if drop:
        rank_attr = "_dp_rank" if real is not None else "_rank"
        return _drop_variant(base, "attn_dp_rank", rank_attr), real is not None
    return base, real is not None
