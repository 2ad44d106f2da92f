"""A reference subscriber: SUB + replay client for one or many publishers.

Each *source* is one publisher (one DP rank): its own SUB socket, its own
sequence, its own index, and optionally its own replay endpoint.

Decoding is tolerant by design: events encoded as maps (vLLM >= PR #42892)
and as legacy positional arrays (tag first) are both accepted, unknown fields
are ignored, and an event whose tag is unknown costs **only that event** (it
is counted in ``unknown_events``), never the batch.  llm-d's and Dynamo's
subscribers drop the whole batch instead; see docs/subscribers.md.

Sequence handling, per source:

- ``seq == last + 1``: applied.
- ``seq <= last``: a duplicate (a live message already replayed) if its payload
  is the one applied for that seq: ignored, counted.  A different payload
  means the publisher restarted (seqs begin again at 0): the source's index is
  reset and the message handled as a source's first one.
- ``seq > last + 1``: a gap.  With a replay endpoint, the missing messages are
  requested from ``last + 1``; if the reply is complete they are applied in
  order.  If it is not (the publisher skipped that seq because it lost
  batches, or evicted it from its buffer), or there is no replay endpoint, the
  source's index is reset (it is no longer trustworthy) and counted in
  ``resets``; then the new message is applied.
- The first message of a source: with a replay endpoint, history from seq 0 is
  requested; if it is incomplete the index starts from what was available and
  the source is marked ``partial``.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from coalesce.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored
from coalesce.refmodel import Mode, SubscriberModel

__all__ = ["Source", "Subscriber", "decode_batch"]

END_SEQ = b"\xff" * 8
_EVENT_TYPES: dict[str, type[msgspec.Struct]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared, BlockMoved)
}


def _decode_event(raw: Any) -> msgspec.Struct | None:
    """One raw msgpack event (map or legacy array) to a typed event; None if unknown."""
    if isinstance(raw, dict):
        cls = _EVENT_TYPES.get(raw.get("type"))  # type: ignore[arg-type]
        fields = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        cls = _EVENT_TYPES.get(raw[0])
        fields = {} if cls is None else dict(zip(cls.__struct_fields__, raw[1:], strict=False))
    else:
        return None
    if cls is None:
        return None
    try:
        return msgspec.convert(fields, type=cls, strict=False)
    except msgspec.ValidationError:
        return None


class _Stored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[Any]
    parent_block_hash: Any
    medium: str | None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class _Moved(msgspec.Struct, tag="BlockMoved", gc=False):
    block_hashes: list[Any]
    parent_block_hash: Any
    from_medium: str | None
    to_medium: str | None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _IndexBatch(msgspec.Struct, array_like=True, gc=False):
    """What the index needs: fields it does not need (tokens...) are skipped, not built."""

    ts: float
    events: list[_Stored | _Removed | _Moved | _Cleared]
    data_parallel_rank: int | None = None


_for_index = msgspec.msgpack.Decoder(type=_IndexBatch)


def _apply_to_index(index: SubscriberModel, events: list[Any]) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for ev in events:
        cls = type(ev)
        if cls is _Stored:
            index.store(ev.block_hashes, ev.parent_block_hash, ev.medium, ev.group_idx)
        elif cls is _Removed:
            index.remove(ev.block_hashes, ev.medium, ev.group_idx)
        elif cls is _Moved:
            index.store(ev.block_hashes, ev.parent_block_hash, ev.to_medium, ev.group_idx)
            index.remove(ev.block_hashes, ev.from_medium, ev.group_idx)
        elif cls is _Cleared:
            index.clear()
        else:
            index.apply_event(ev)
        kinds[cls.__struct_config__.tag or cls.__name__] += 1
    return kinds


def decode_batch(payload: bytes) -> tuple[float, list[msgspec.Struct], int | None, int]:
    """Decode one payload: ``(ts, known events, data_parallel_rank, unknown count)``.

    Raises ``ValueError`` if the payload is not a 2- or 3-element batch array.
    The events are full :mod:`coalesce.events` structs (a few us/event: every
    field is built); the subscriber itself decodes only what its index needs.
    """
    raw = msgspec.msgpack.decode(payload)
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise ValueError("not an event batch: expected [ts, events, data_parallel_rank]")
    events: list[msgspec.Struct] = []
    unknown = 0
    for item in raw[1]:
        ev = _decode_event(item)
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    rank = raw[2] if len(raw) == 3 else None
    return float(raw[0]), events, rank, unknown


@dataclass
class Source:
    """What the subscriber knows of one publisher."""

    endpoint: str
    replay_endpoint: str | None
    index: SubscriberModel
    last_seq: int | None = None
    partial: bool = False
    """The index started from an incomplete history (joined late or reset)."""
    messages: int = 0
    bytes: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_messages: int = 0
    resets: int = 0
    restarts: int = 0
    unknown_events: int = 0
    bad_messages: int = 0
    events: Counter[str] = field(default_factory=Counter)
    # seq -> hash of the payload applied, for the last RECENT seqs (duplicate vs restart)
    recent: dict[int, int] = field(default_factory=dict)
    recent_order: deque[int] = field(default_factory=deque)


RECENT = 4096


class Subscriber:
    """Subscribe to one or many publishers and keep a reference index per source.

    ``endpoints[i]`` pairs with ``replay_endpoints[i]`` (None: no replay for
    that source).  ``mode`` is the index model (see ``coalesce.refmodel``):
    ``"llmd"`` by default, a refcount with llm-d's parent rule.  ``rcvhwm``
    sets the SUB sockets' receive high-water mark (ZeroMQ's default: 1000
    messages).  ``on_batch(source, seq, ts, events, rank)`` is called after
    each batch is applied (live or replayed); its events carry what the index
    uses (hashes, parent, medium, group), not tokens: use :func:`decode_batch`
    on the payload for full events.  Not thread-safe: use it from
    one thread.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        replay_endpoints: str | Sequence[str | None] | None = None,
        *,
        topic: str = "",
        mode: Mode = "llmd",
        replay_timeout: float = 5.0,
        rcvhwm: int | None = None,
        on_batch: Callable[[Source, int, float, list[Any], int | None], None] | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if replay_endpoints is None or isinstance(replay_endpoints, str):
            reps: list[str | None] = [replay_endpoints] * len(eps)
        else:
            reps = list(replay_endpoints)
        if len(reps) != len(eps):
            raise ValueError("replay_endpoints must pair one to one with endpoints")
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        self._on_batch = on_batch
        self.sources: list[Source] = []
        self._socks: list[zmq.Socket[bytes]] = []
        self._poller = zmq.Poller()
        for ep, rep in zip(eps, reps, strict=True):
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            if rcvhwm is not None:
                sock.setsockopt(zmq.RCVHWM, rcvhwm)
            sock.connect(ep)
            self._poller.register(sock, zmq.POLLIN)
            self._socks.append(sock)
            self.sources.append(Source(ep, rep, SubscriberModel(mode)))

    # -- receiving ---------------------------------------------------------------

    def poll(self, timeout: float = 0.1, max_messages: int = 10_000) -> int:
        """Receive and apply what arrives within ``timeout`` seconds; return messages applied.

        Replays requested on a gap are synchronous (bounded by ``replay_timeout``).
        """
        applied = 0
        deadline = time.monotonic() + timeout
        while applied < max_messages:
            wait = max(0.0, deadline - time.monotonic())
            ready = dict(self._poller.poll(int(wait * 1000)))
            if not ready:
                break
            for i, sock in enumerate(self._socks):
                while sock in ready and applied < max_messages:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    applied += self._on_message(self.sources[i], frames)
        return applied

    def _on_message(self, src: Source, frames: list[bytes]) -> int:
        if len(frames) != 3 or len(frames[1]) != 8:
            src.bad_messages += 1
            return 0
        seq = int.from_bytes(frames[1], "big")
        last = src.last_seq
        if last is not None and seq <= last:
            if src.recent.get(seq) == hash(frames[2]):
                src.duplicates += 1
                return 0
            src.restarts += 1  # same seq, other content: a new publisher
            self._reset(src)
            src.last_seq = last = None
        if last is None:
            if src.replay_endpoint is not None and seq > 0:
                self._catch_up(src, 0, seq, first=True)
        elif seq > last + 1:
            src.gaps += 1
            self._catch_up(src, last + 1, seq, first=False)
        self._apply(src, seq, frames[2])
        return 1

    def _apply(self, src: Source, seq: int, payload: bytes) -> None:
        src.last_seq = seq
        src.messages += 1
        src.bytes += len(payload)
        src.recent[seq] = hash(payload)
        src.recent_order.append(seq)
        if len(src.recent_order) > RECENT:
            src.recent.pop(src.recent_order.popleft(), None)
        events: list[Any]
        try:  # the fast path: every event known and map-encoded, only index fields built
            fast = _for_index.decode(payload)
            ts, events, rank, unknown = fast.ts, list(fast.events), fast.data_parallel_rank, 0
        except (msgspec.ValidationError, msgspec.DecodeError):
            try:  # the tolerant path: legacy arrays, unknown tags (that event only)
                ts, events, rank, unknown = decode_batch(payload)
            except (ValueError, msgspec.DecodeError):
                src.bad_messages += 1
                return
        src.unknown_events += unknown
        src.events.update(_apply_to_index(src.index, events))
        if self._on_batch is not None:
            self._on_batch(src, seq, ts, events, rank)

    def _reset(self, src: Source) -> None:
        src.resets += 1
        src.partial = True
        src.index = SubscriberModel(src.index.mode)
        src.recent.clear()
        src.recent_order.clear()

    def _catch_up(self, src: Source, start: int, until: int, first: bool) -> None:
        """Replay ``[start, until)``; reset (or mark partial) if that is impossible."""
        got = self._replay(src, start, until) if src.replay_endpoint is not None else None
        complete = got is not None and [s for s, _ in got] == list(range(start, until))
        if not complete:
            if first:
                src.partial = True
            else:
                self._reset(src)
            # only what comes after the missing part can be trusted
            got = [(s, p) for s, p in (got or []) if s > _last_missing(got or [], start, until)]
        for seq, payload in got or []:
            self._apply(src, seq, payload)
        src.replayed_messages += len(got or [])

    def _replay(self, src: Source, start: int, until: int) -> list[tuple[int, bytes]] | None:
        """Ask the source's ROUTER for ``seq >= start``; keep those below ``until``."""
        assert src.replay_endpoint is not None
        src.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(src.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self._replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000)):
                    return None  # no complete answer in time
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _topic, seq_b, payload = frames
                if seq_b == END_SEQ:
                    return out
                seq = int.from_bytes(seq_b, "big")
                if start <= seq < until:
                    if not out and seq != start:
                        return out  # incomplete from the first frame: no need for the rest
                    out.append((seq, payload))
                if seq >= until - 1:
                    return out  # all we need; closing the DEALER ends the reply
        finally:
            dealer.close()

    # -- queries -----------------------------------------------------------------

    def longest_prefix(
        self, block_hashes: Iterable[Any], source: int = 0, medium: Any = "GPU", group: Any = None
    ) -> int:
        """How many leading ``block_hashes`` ``source`` holds in ``medium``.  O(prefix)."""
        counts = self.sources[source].index.counts
        n = 0
        for h in block_hashes:
            if counts.get((medium, group, h), 0) <= 0:
                break
            n += 1
        return n

    def summary(self) -> dict[str, Any]:
        """Counters over every source, for logs and the CLI."""
        total: Counter[str] = Counter()
        for s in self.sources:
            total.update(s.events)
        keys = ("messages", "duplicates", "gaps", "replays", "resets", "restarts")
        out: dict[str, Any] = {k: sum(getattr(s, k) for s in self.sources) for k in keys}
        out["unknown_events"] = sum(s.unknown_events for s in self.sources)
        out["events"] = dict(total)
        out["index_size"] = sum(len(s.index.state()) for s in self.sources)
        return out

    def close(self) -> None:
        """Close the sockets."""
        for sock in self._socks:
            sock.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _last_missing(got: list[tuple[int, bytes]], start: int, until: int) -> int:
    """The highest seq in ``[start, until)`` that the reply lacks (``start - 1`` if none)."""
    have = {s for s, _ in got}
    for seq in range(until - 1, start - 1, -1):
        if seq not in have:
            return seq
    return start - 1
