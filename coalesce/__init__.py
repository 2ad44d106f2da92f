"""kv-coalesce: a KV-cache event publisher that never blocks the engine.

A drop-in for vLLM's ``ZmqEventPublisher``: same wire format, same
constructor, same replay protocol.  When the sender falls behind, pending
events are compacted (folded, merged, cancelled) so that every subscriber
ends up believing the same thing; only past its budget does it drop, and then
the loss is counted and told on the wire: by default a loss marker (a batch of
one ``AllBlocksCleared``) in the loss's own seq, so every consumer forgets the
rank instead of keeping stale blocks.

The public surface is this module; ``coalesce.events`` (wire types),
``coalesce.compactor`` (pure compaction functions) and ``coalesce.refmodel``
(reference subscriber models) are public modules too.
"""

from coalesce._settings import PublisherConfig, Settings
from coalesce.compactor import CompactionReport, compact
from coalesce.events import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
)
from coalesce.publisher import CoalescingPublisher, PublishOutcome
from coalesce.stats import PublisherStats

__all__ = [
    "AllBlocksCleared",
    "BlockMoved",
    "BlockRemoved",
    "BlockStored",
    "CoalescingPublisher",
    "CompactionReport",
    "EventBatch",
    "KVEventBatch",
    "PublishOutcome",
    "PublisherConfig",
    "PublisherStats",
    "Settings",
    "compact",
]

__version__ = "0.1.0"
