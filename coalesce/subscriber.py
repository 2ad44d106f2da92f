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
  requested; if it is incomplete (or there is no replay endpoint and the
  first seq is not 0) the index starts from what was available and the source
  is marked ``partial``.
- A gap longer than ``max_replay`` messages (the publisher's ``buffer_steps``)
  is not asked for: replay could not fill it, so the source resets at once.

With a snapshot endpoint (the publisher's ``snapshot_endpoint``, vLLM PR
#57789's protocol), the first message of a source and every gap that replay
cannot fill start a *bootstrap* instead: the subscriber asks for a snapshot,
builds a new index from it, takes its seq as the last one applied, and goes
on with the messages after it (those it covers are ignored; live messages
wait in the SUB socket meanwhile).  Live seq frames then carry the
publisher's 16-byte ``publisher_id`` after the seq (24 bytes in all): a
message with another id is a restart.  If the
snapshot is unavailable (-2), not yet possible (-1) or does not come, the
rules above apply.  A batch holding ``AllBlocksCleared`` (the engine's own
reset, or a publisher's loss marker: ``loss_marker="clear"``) is applied and
then followed by a bootstrap too, so a loss told by a marker heals exactly.
``snapshots`` counts bootstraps, ``recovered`` the gaps a snapshot healed
instead of a reset.

Nothing that arrives on the wire makes :meth:`Subscriber.poll` raise.  A
message that does not decode, or whose known events do not validate (a hash
that is not an int or bytes, a ``ts`` that is not a number...), is counted in
``bad_messages`` and not applied; since its effect on the index is unknown,
the source is reset (and marked ``partial``), and its seq is taken as
consumed so that replaying the same bytes is not attempted.  Gap handling
costs memory in the size of the reply, never of the jump.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from coalesce._wire import END_SEQ
from coalesce.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored
from coalesce.refmodel import Mode, SubscriberModel

__all__ = [
    "IndexCleared",
    "IndexMoved",
    "IndexRemoved",
    "IndexStored",
    "Source",
    "Subscriber",
    "decode_batch",
]

_EVENT_TYPES: dict[str, type[msgspec.Struct]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared, BlockMoved)
}


def _decode_event(raw: Any) -> msgspec.Struct | None:
    """One raw msgpack event (map or legacy array) to a typed event.

    Returns None for an unknown tag; raises ``ValueError`` for anything that
    is not an event, or a known event whose fields do not validate.
    """
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw:
        tag, fields = raw[0], None
    else:
        raise ValueError(f"not an event: {type(raw).__name__}")
    if not isinstance(tag, str):
        raise ValueError(f"an event's type must be a string, got {type(tag).__name__}")
    cls = _EVENT_TYPES.get(tag)
    if cls is None:
        return None
    if fields is None:
        fields = dict(zip(cls.__struct_fields__, raw[1:], strict=False))
    try:
        return msgspec.convert(fields, type=cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid {tag}: {exc}") from None


Hash = int | bytes


class IndexStored(msgspec.Struct, tag="BlockStored", gc=False):
    """What the index uses of a ``BlockStored`` (tokens and the rest are not decoded)."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    medium: str | None
    group_idx: int | None = None


class IndexRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    """What the index uses of a ``BlockRemoved``."""

    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class IndexMoved(msgspec.Struct, tag="BlockMoved", gc=False):
    """What the index uses of the opt-in ``BlockMoved``."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    from_medium: str | None
    to_medium: str | None
    group_idx: int | None = None


class IndexCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    """``AllBlocksCleared``."""


IndexEvent = IndexStored | IndexRemoved | IndexMoved | IndexCleared


class _IndexBatch(msgspec.Struct, array_like=True, gc=False):
    """What the index needs: fields it does not need (tokens...) are skipped, not built."""

    ts: float
    events: list[IndexEvent]
    data_parallel_rank: int | None = None


_for_index = msgspec.msgpack.Decoder(type=_IndexBatch)


def _index_view(ev: msgspec.Struct) -> IndexEvent:
    """The index's view of a fully decoded event (the tolerant path's result)."""
    if isinstance(ev, BlockStored):
        return IndexStored(ev.block_hashes, ev.parent_block_hash, ev.medium, ev.group_idx)
    if isinstance(ev, BlockRemoved):
        return IndexRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    if isinstance(ev, BlockMoved):
        return IndexMoved(
            ev.block_hashes, ev.parent_block_hash, ev.from_medium, ev.to_medium, ev.group_idx
        )
    return IndexCleared()


def _apply_to_index(index: SubscriberModel, events: list[IndexEvent]) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for ev in events:
        if isinstance(ev, IndexStored):
            index.store(ev.block_hashes, ev.parent_block_hash, ev.medium, ev.group_idx)
        elif isinstance(ev, IndexRemoved):
            index.remove(ev.block_hashes, ev.medium, ev.group_idx)
        elif isinstance(ev, IndexMoved):
            index.store(ev.block_hashes, ev.parent_block_hash, ev.to_medium, ev.group_idx)
            index.remove(ev.block_hashes, ev.from_medium, ev.group_idx)
        else:
            index.clear()
        kinds[type(ev).__struct_config__.tag] += 1  # type: ignore[index]
    return kinds


def decode_batch(payload: bytes) -> tuple[float, list[msgspec.Struct], int | None, int]:
    """Decode one payload: ``(ts, known events, data_parallel_rank, unknown count)``.

    Raises ``ValueError`` if the payload is not msgpack, not a 2- to 4-element
    batch array (elements past the 3rd are ignored) with a number
    ``ts`` and an int or nil rank, or if a known event does not validate.  An
    event with an unknown tag is skipped and counted.  The events are full
    :mod:`coalesce.events` structs (every field is built); the subscriber
    itself decodes only what its index needs.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3, 4) or not isinstance(raw[1], list):
        raise ValueError("not an event batch: expected [ts, events, data_parallel_rank]")
    ts, rank = raw[0], raw[2] if len(raw) >= 3 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise ValueError(f"not an event batch: ts is {type(ts).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise ValueError(f"not an event batch: data_parallel_rank is {type(rank).__name__}")
    events: list[msgspec.Struct] = []
    unknown = 0
    for item in raw[1]:
        ev = _decode_event(item)
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    return float(ts), events, rank, unknown


def _decode_for_index(payload: bytes) -> tuple[float, list[IndexEvent], int | None, int]:
    """The fast path (only index fields built), else the tolerant one.  Raises ValueError."""
    try:
        fast = _for_index.decode(payload)
        return fast.ts, fast.events, fast.data_parallel_rank, 0
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass  # legacy arrays, unknown tags (that event only), or invalid: decide below
    ts, events, rank, unknown = decode_batch(payload)
    return ts, [_index_view(ev) for ev in events], rank, unknown


def publisher_id(seq_frame: bytes, payload: bytes = b"") -> bytes | None:
    """The 16-byte ``publisher_id`` a live message carries with snapshots on: after the
    seq in a 24-byte seq frame, or as a 4th batch element (a msgpack bin 8 of 16
    bytes at the payload's end: vLLM PR #57789's ``IdentifiedKVEventBatch``); else
    None.  O(1)."""
    if len(seq_frame) == 24:
        return seq_frame[8:]
    if payload[:1] == b"\x94" and payload[-18:-16] == b"\xc4\x10":
        return payload[-16:]
    return None


@dataclass
class Source:
    """What the subscriber knows of one publisher."""

    endpoint: str
    replay_endpoint: str | None
    index: SubscriberModel
    snapshot_endpoint: str | None = None
    publisher_id: bytes | None = None
    """The id the last message carried (snapshots on); another id is a restart."""
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
    snapshots: int = 0
    """Indexes built from a snapshot (first messages, and gaps replay could not fill)."""
    recovered: int = 0
    """Of those, gaps that a snapshot healed where the index would have been reset."""
    snapshot_failures: int = 0
    """Snapshot requests that gave no usable state (-1, -2, no answer, bad chunks)."""
    unknown_events: int = 0
    """Events skipped because their tag is unknown (the rest of the batch applied)."""
    bad_messages: int = 0
    """Messages not applied: wrong frames, or a payload that does not decode or validate."""
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
    messages).  ``replay_timeout`` is how long a replay may go without a
    frame before it counts as unanswered; ``max_replay`` is the longest gap
    worth asking for (the publisher's ``buffer_steps``; vLLM's default).
    ``on_batch(source, seq, ts, events, rank)`` is called after each batch is
    applied (live or replayed); its events are the index's views
    (:class:`IndexStored`, :class:`IndexRemoved`, :class:`IndexMoved`,
    :class:`IndexCleared`: hashes, parent, medium, group), whatever the
    encoding; use :func:`decode_batch` on a payload for full events.  With
    ``bind``, the SUB sockets bind ``endpoints`` instead of connecting (for a
    publisher whose endpoint names a host, which connects: vLLM's rule).
    ``snapshot_endpoints`` pair with ``endpoints`` like the replay ones (module
    docstring).  Not thread-safe: use it from one thread.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        replay_endpoints: str | Sequence[str | None] | None = None,
        *,
        topic: str = "",
        mode: Mode = "llmd",
        replay_timeout: float = 2.0,
        max_replay: int = 10_000,
        rcvhwm: int | None = None,
        on_batch: Callable[[Source, int, float, list[Any], int | None], None] | None = None,
        context: zmq.Context[Any] | None = None,
        bind: bool = False,
        snapshot_endpoints: str | Sequence[str | None] | None = None,
    ) -> None:
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)

        def paired(given: str | Sequence[str | None] | None, name: str) -> list[str | None]:
            if given is None or isinstance(given, str):
                return [given] * len(eps)
            if len(given) != len(eps):
                raise ValueError(f"{name} must pair one to one with endpoints")
            return list(given)

        reps = paired(replay_endpoints, "replay_endpoints")
        snaps = paired(snapshot_endpoints, "snapshot_endpoints")
        if max_replay < 1:
            raise ValueError(f"max_replay must be >= 1, got {max_replay!r}")
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        self._max_replay = max_replay
        self._on_batch = on_batch
        self.sources: list[Source] = []
        self._socks: list[zmq.Socket[bytes]] = []
        self._poller = zmq.Poller()
        for ep, rep, snap in zip(eps, reps, snaps, strict=True):
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            if rcvhwm is not None:
                sock.setsockopt(zmq.RCVHWM, rcvhwm)
            if bind:
                sock.bind(ep)
            else:
                sock.connect(ep)
            self._poller.register(sock, zmq.POLLIN)
            self._socks.append(sock)
            self.sources.append(Source(ep, rep, SubscriberModel(mode), snapshot_endpoint=snap))

    # -- receiving ---------------------------------------------------------------

    def poll(self, timeout: float = 0.1, max_messages: int = 10_000) -> int:
        """Receive and apply what arrives within ``timeout`` seconds; return messages handled.

        Never raises for what arrives on the wire (see the module docstring).
        Replays requested on a gap are synchronous: each waits at most
        ``replay_timeout`` between frames.
        """
        handled = 0
        deadline = time.monotonic() + timeout
        while handled < max_messages:
            wait = max(0.0, deadline - time.monotonic())
            ready = dict(self._poller.poll(int(wait * 1000)))
            if not ready:
                break
            for i, sock in enumerate(self._socks):
                while sock in ready and handled < max_messages:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    handled += self._on_message(self.sources[i], frames)
        return handled

    def _on_message(self, src: Source, frames: list[bytes]) -> int:
        if len(frames) != 3 or len(frames[1]) not in (8, 24):
            src.bad_messages += 1
            return 0
        seq = int.from_bytes(frames[1][:8], "big")
        payload = frames[2]
        pid = publisher_id(frames[1], payload)
        last = src.last_seq
        if last is not None and pid != src.publisher_id:
            src.restarts += 1  # another publisher_id: the publisher restarted
            self._reset(src)
            src.last_seq = last = None
        elif last is not None and seq <= last:
            if (pid is not None and pid == src.publisher_id) or src.recent.get(seq) == hash(
                payload
            ):
                src.duplicates += 1  # replayed, or covered by a snapshot
                return 0
            src.restarts += 1  # same seq, other content: a new publisher
            self._reset(src)
            src.last_seq = last = None
        if last is None:
            if src.snapshot_endpoint is not None and self._bootstrap(src):
                return self._after_bootstrap(src, seq, payload, pid)
            if seq > 0:
                self._catch_up(src, 0, seq, first=True)
        elif seq > last + 1:
            src.gaps += 1
            if src.snapshot_endpoint is None:
                self._catch_up(src, last + 1, seq, first=False)
            elif not self._catch_up(src, last + 1, seq, first=False, reset=False):
                if self._bootstrap(src):
                    src.recovered += 1
                    return self._after_bootstrap(src, seq, payload, pid)
                self._reset(src)
        src.publisher_id = pid
        self._apply_live(src, seq, payload)
        return 1

    def _apply_live(self, src: Source, seq: int, payload: bytes) -> None:
        """Apply a live message; after a clear, bootstrap where snapshots are served."""
        if self._apply(src, seq, payload) and src.snapshot_endpoint is not None:
            # A clear: a publisher's loss marker, or the engine's own reset. Either
            # way the snapshot, cut at or after it, is what the engine holds now.
            self._bootstrap(src)

    def _after_bootstrap(self, src: Source, seq: int, payload: bytes, pid: bytes | None) -> int:
        """The message that started a bootstrap, against the snapshot's seq."""
        last = src.last_seq
        assert last is not None
        if pid != src.publisher_id:  # the snapshot came from a newer publisher
            return 0
        if seq <= last:
            src.duplicates += 1  # covered by the snapshot
            return 0
        if seq > last + 1 and not self._catch_up(src, last + 1, seq, first=False, reset=False):
            self._reset(src)  # a second loss at once: the old rules
        self._apply_live(src, seq, payload)
        return 1

    def _bootstrap(self, src: Source) -> bool:
        """Ask for a snapshot and make it the source's index.  Returns False if none came.

        Synchronous: waits up to ``replay_timeout`` for the reply.
        """
        assert src.snapshot_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(src.snapshot_endpoint)
            dealer.send(b"snapshot")
            if not dealer.poll(int(self._replay_timeout * 1000)):
                src.snapshot_failures += 1
                return False
            frames = dealer.recv_multipart()
        finally:
            dealer.close()
        if len(frames) < 2 or len(frames[0]) != 8 or len(frames[1]) != 16:
            src.snapshot_failures += 1
            return False
        snap_seq = int.from_bytes(frames[0], "big", signed=True)
        if snap_seq < 0:
            src.snapshot_failures += 1  # -1 nothing sent yet, -2 unavailable
            return False
        index = SubscriberModel(src.index.mode)
        kinds: Counter[str] = Counter()
        try:
            for chunk in frames[2:]:
                _, events, _, _ = _decode_for_index(chunk)
                kinds.update(_apply_to_index(index, events))
        except ValueError:
            src.snapshot_failures += 1
            return False
        src.snapshots += 1
        src.index = index
        src.events.update(kinds)
        src.partial = False
        src.publisher_id = frames[1]
        src.last_seq = snap_seq
        src.recent.clear()
        src.recent_order.clear()
        return True

    def _apply(self, src: Source, seq: int, payload: bytes) -> bool:
        """Apply one message to the source's index; whether it cleared the index."""
        try:
            ts, events, rank, unknown = _decode_for_index(payload)
        except ValueError:
            src.bad_messages += 1  # its effect is unknown: the index cannot be trusted
            self._reset(src)
            events = None
        src.last_seq = seq
        src.messages += 1
        src.bytes += len(payload)
        src.recent[seq] = hash(payload)
        src.recent_order.append(seq)
        if len(src.recent_order) > RECENT:
            src.recent.pop(src.recent_order.popleft(), None)
        if events is None:
            return False
        src.unknown_events += unknown
        kinds = _apply_to_index(src.index, events)
        src.events.update(kinds)
        if self._on_batch is not None:
            self._on_batch(src, seq, ts, events, rank)
        return "AllBlocksCleared" in kinds

    def _reset(self, src: Source) -> None:
        src.resets += 1
        src.partial = True
        src.index = SubscriberModel(src.index.mode)
        src.recent.clear()
        src.recent_order.clear()

    def _catch_up(
        self, src: Source, start: int, until: int, first: bool, reset: bool = True
    ) -> bool:
        """Replay ``[start, until)``; reset (or mark partial) if that is impossible.

        Returns True if the gap was filled.  With ``reset=False`` an incomplete
        reply is not applied and nothing is reset: the caller decides.  O(reply)
        memory, whatever ``until - start`` is: a gap longer than ``max_replay``
        is not asked for at all.
        """
        got: list[tuple[int, bytes]] | None = None
        if src.replay_endpoint is not None and until - start <= self._max_replay:
            got = self._replay(src, start, until)
        complete = bool(got and got[0][0] == start and got[-1][0] == until - 1)
        if not complete:
            if not reset:
                return False
            if first:
                src.partial = True
            else:
                self._reset(src)
        for seq, payload in got or ():
            self._apply(src, seq, payload)
        src.replayed_messages += len(got or ())
        return complete

    def _replay(self, src: Source, start: int, until: int) -> list[tuple[int, bytes]] | None:
        """Ask the source's ROUTER for ``seq >= start``; keep a contiguous run below ``until``.

        Returns None if nothing complete came back in time.  The run starts at
        ``start`` if the reply is complete; after a hole only the messages past
        the hole are kept (the ones before it cannot be trusted once the
        source resets).  A reply that starts late is not read further.
        """
        assert src.replay_endpoint is not None
        src.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(src.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not dealer.poll(int(self._replay_timeout * 1000)):
                    return None  # no answer in time
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    continue
                _, _topic, seq_b, payload = frames
                if seq_b == END_SEQ:
                    return out
                seq = int.from_bytes(seq_b, "big")
                if not start <= seq < until:
                    if seq >= until:
                        return out
                    continue
                if not out and seq != start:
                    return out  # incomplete from the first frame: no need for the rest
                if out and seq != out[-1][0] + 1:
                    out = []  # a hole: only what comes after it can be used
                out.append((seq, payload))
                if seq == until - 1:
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
        keys = (
            "messages",
            "bytes",
            "duplicates",
            "gaps",
            "replays",
            "replayed_messages",
            "resets",
            "restarts",
            "snapshots",
            "recovered",
            "snapshot_failures",
            "unknown_events",
            "bad_messages",
        )
        out: dict[str, Any] = {k: sum(getattr(s, k) for s in self.sources) for k in keys}
        out["partial_sources"] = sum(s.partial for s in self.sources)
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
