"""Frozen snapshots of what a publisher has done: one per component, and
:class:`PublisherStats`, which composes them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

__all__ = [
    "BacklogStats",
    "PublisherStats",
    "ReplayStats",
    "SenderStats",
    "SnapshotStats",
    "StreamStats",
    "field_docs",
    "gauge_names",
]


def _counter(doc: str, default: Any = 0) -> Any:
    return field(default=default, metadata={"doc": doc, "kind": "counter"})


def _gauge(doc: str, default: Any = 0) -> Any:
    return field(default=default, metadata={"doc": doc, "kind": "gauge"})


@dataclass(frozen=True)
class BacklogStats:
    """The hand-off's counters (``coalesce._backlog``)."""

    batches_in: int = _counter("Batches publish() accepted.")
    events_in: int = _counter("Events in those batches.")
    batches_dropped: int = _counter(
        "Batches lost: refused by publish() (over budget, or after the sender failed) "
        "or abandoned at shutdown."
    )
    events_dropped: int = _counter("Events in those batches.")
    backlog_batches: int = _gauge("Batches waiting for the sender right now (staged or not).")
    backlog_events: int = _gauge(
        "Events waiting for the sender right now (what max_pending_events bounds)."
    )
    backlog_peak: int = _gauge(
        "The most batches publish() saw in the hand-off queue (max_queue_size bounds it "
        "against a sender stalled for stall_timeout)."
    )


@dataclass(frozen=True)
class SenderStats:
    """The sender thread's counters (``coalesce._sender``)."""

    encode_failures: int = _counter("Batches the encoder rejected (lost, visible as a gap).")
    compaction_failures: int = _counter(
        "Windows the compactor could not handle (sent batch by batch, uncompacted)."
    )
    resyncs: int = _counter("In-band resyncs sent whole after a loss marker (loss_marker=resync).")
    batches_collapsed: int = _counter(
        "Batches accepted and then given to the recorder instead of sent, when the backlog "
        "collapsed past its budget (loss_marker=resync): the resync after the loss marker "
        "carries their effect."
    )
    events_collapsed: int = _counter("Events in those batches.")
    resync_events: int = _counter("Events those resyncs sent (stores of the recorded state).")
    batches_folded: int = _counter("Input batches folded into another batch.")
    events_merged: int = _counter("Events that disappeared by being merged into a neighbour.")
    blocks_cancelled: int = _counter("Store/remove pairs that cancelled (block hashes).")
    events_superseded: int = _counter("Events made irrelevant by a later AllBlocksCleared.")
    blocks_moved: int = _counter("Block hashes sent inside opt-in BlockMoved events.")
    compaction_passes: int = _counter(
        "Compaction steps whose result was sent (every rule, or fold only)."
    )
    fold_only_passes: int = _counter(
        "Of those, steps at the fold-only level (4x larger windows, while flushing at shutdown)."
    )
    sender_alive: bool = _gauge(
        "1 while the sender thread runs; 0 after shutdown() or after it failed.",
        False,
    )
    compactor_accelerated: bool = _gauge(
        "1 when the compaction rules run in C (the optional accelerator was built); "
        "0 when they run in Python (same results, slower).",
        False,
    )
    native_send: bool = _gauge(
        "1 when this publisher's messages go out through the optional C send that keeps "
        "the GIL; 0 when through pyzmq's "
        "sends, which hand the GIL to the engine at every frame.",
        False,
    )


@dataclass(frozen=True)
class StreamStats:
    """The wire's counters (``coalesce._stream``)."""

    messages_sent: int = _counter("ZMQ messages (batches) sent on the PUB socket.")
    events_sent: int = _counter("Events in those messages.")
    bytes_sent: int = _counter("Payload bytes sent (the third frame only).")
    seq_gaps: int = _counter(
        "Sequence numbers skipped to make losses visible on the wire (loss_marker=gap)."
    )
    loss_markers: int = _counter(
        "Loss markers sent: AllBlocksCleared batches, each in place of a loss (loss_marker=clear)."
    )


@dataclass(frozen=True)
class ReplayStats:
    """The replay ROUTER's counters (``coalesce._replay``); zero without one."""

    replay_requests: int = _counter("Well-formed replay requests accepted.")
    replay_invalid: int = _counter("Replay requests ignored (wrong frame count or seq length).")
    replay_refused: int = _counter(
        "Replay requests refused (too many replay connections or waiting requests)."
    )
    replay_messages: int = _counter("Buffered messages re-sent to replay clients.")
    replay_abandoned: int = _counter(
        "Replies cut short: their client had gone, or stopped reading for too long."
    )


@dataclass(frozen=True)
class SnapshotStats:
    """The snapshot ROUTER's and the recorder's counters (``coalesce._snapshot``); the
    recorder runs with snapshots on or ``loss_marker=resync`` (the default), and without
    it they are zero and not exact."""

    snapshot_requests: int = _counter("Well-formed snapshot requests accepted.")
    snapshot_invalid: int = _counter("Snapshot requests ignored (malformed, or too many waiting).")
    snapshot_replies: int = _counter("Snapshots sent (a seq and the state's chunks).")
    snapshot_unavailable: int = _counter(
        "Snapshot requests answered -2: the recorder was not exact, or a reply was abandoned."
    )
    snapshot_abandoned: int = _counter("Snapshot replies that could not be sent (client gone).")
    snapshot_blocks: int = _gauge(
        "Keys the snapshot recorder holds right now (while the sender is behind, as of "
        "at most one window of batches ago)."
    )
    snapshot_exact: bool = _gauge(
        "1 while the recorder runs (snapshots, or loss_marker=resync) and is exact; 0 "
        "while it is unavailable (until the next AllBlocksCleared) or does not run.",
        False,
    )


@dataclass(frozen=True)
class PublisherStats(SnapshotStats, ReplayStats, StreamStats, SenderStats, BacklogStats):
    """Counters since construction, composed of each component's stats; ``backlog_*``
    are batches waiting for the sender.

    Counts are of batches, events and bytes, which cost nothing to keep; block
    hashes are not _counted on the way in or out (docs/benchmarks.md has the cost).

    Every loss is _counted in ``batches_dropped`` (refused by ``publish()``
    over budget or after the sender failed, or abandoned by ``shutdown()``)
    or ``encode_failures``, and each loss episode is shown on the wire once: a
    loss marker (``loss_markers``) or a skipped sequence number (``seq_gaps``),
    as ``loss_marker`` says.  Each field's description is in its metadata
    (:func:`field_docs`), and the Prometheus collector uses it.
    """

    @classmethod
    def compose(
        cls,
        backlog: BacklogStats,
        sender: SenderStats,
        stream: StreamStats,
        replay: ReplayStats,
        snapshot: SnapshotStats,
    ) -> PublisherStats:
        """The publisher's stats from its components' (each field taken from the part
        that declares it).  O(fields)."""
        values: dict[str, Any] = {}
        for part in (backlog, sender, stream, replay, snapshot):
            values.update((f.name, getattr(part, f.name)) for f in fields(part))
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as a plain dict (for JSON or metrics)."""
        return asdict(self)


_Stats = TypeVar("_Stats")


def _counted(cls: type[_Stats], counters: object, prefix: str = "") -> _Stats:
    """A component's stats: each field of ``cls`` is the attribute of ``counters`` of
    its name, less ``prefix`` (``replay_requests``: ``requests``).  O(fields)."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    return cls(**{n: getattr(counters, n.removeprefix(prefix)) for n in names})


def field_docs() -> dict[str, str]:
    """Each ``PublisherStats`` field's description.  O(fields)."""
    return {f.name: f.metadata["doc"] for f in fields(PublisherStats)}


def gauge_names() -> frozenset[str]:
    """The fields that are levels (gauges), not monotonic counters."""
    return frozenset(f.name for f in fields(PublisherStats) if f.metadata["kind"] == "gauge")
