"""Wire types: the KV-cache events and batches, as vLLM 0.33 declares them.

The msgspec options (``array_like`` batches, ``omit_defaults``, tagged events
encoded as maps, field order and defaults) are the wire format, so an
uncompacted batch built from these classes encodes byte-for-byte like one built
from ``vllm.distributed.kv_events``.  The publisher does not require these
classes: it recognises any msgspec struct with the same tag and fields (see
``coalesce.compactor``), so inside vLLM it works on vLLM's own objects.

:class:`BlockMoved` is this project's own event.  It is opt-in (known
subscribers drop a whole batch on an unknown tag) and the publisher always
sends it in a batch of its own.  Its meaning is exactly "a ``BlockStored`` of
these blocks in ``to_medium`` followed by a ``BlockRemoved`` of the same
hashes from ``from_medium``".
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

ExternalBlockHash: TypeAlias = bytes | int
"""A block hash: an unsigned 64-bit ``int`` by default, raw ``bytes`` when
vLLM runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``."""

__all__ = [
    "AllBlocksCleared",
    "BlockMoved",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One publish call: encoded as ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events: encoded as a map with ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    """Blocks now cached in ``medium``; ``token_ids`` concatenates every block's tokens."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer cached in ``medium`` (one removal per hash, duplicates count)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Everything this source cached, in every medium, is gone."""


class BlockMoved(KVCacheEvent):
    """Opt-in: ``BlockStored(medium=to_medium, ...)`` then ``BlockRemoved(from_medium)``.

    Carries every ``BlockStored`` field (``medium`` renamed ``to_medium``) plus
    ``from_medium``; the removal has the same hashes, group, locality and
    ownership as the store.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    from_medium: str | None
    to_medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class KVEventBatch(EventBatch):
    """A batch of KV-cache events, as vLLM's scheduler publishes it."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
