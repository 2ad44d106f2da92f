"""Event classification: which of the KV events a struct is, by its tag and fields
(and :func:`event_count`, a batch's events, for the sender and the snapshot feed).

The classification is used by the compactor (and nothing else: the reference
models in ``coalesce.refmodel`` read the wire tag themselves, so that a
mistake here cannot hide in the oracle).  Recognition is by the msgspec tag and the
required field names, never by class identity, so vLLM's own
``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` qualify as well as
``coalesce.events``'; anything else is ``OPAQUE``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

__all__ = [
    "CLEARED",
    "MOVED",
    "OPAQUE",
    "REMOVED",
    "STORED",
    "all_kv_classes",
    "event_count",
    "event_kind",
    "event_kind_of_class",
    "is_kv_batch",
]

OPAQUE, STORED, REMOVED, CLEARED, MOVED = 0, 1, 2, 3, 4
"""Event kinds: :func:`event_kind` returns the first four (a ``BlockMoved``, which this
library emits and never compacts, is ``OPAQUE`` to the compactor); the recorder
applies ``MOVED`` too (coalesce/_kinds.h holds the same numbers for C)."""

_STORED_REQUIRED = frozenset(
    {"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"}
)
_REMOVED_REQUIRED = frozenset({"block_hashes", "medium"})
_kind_cache: dict[type, int] = {}


def _classify(cls: type) -> int:
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        return OPAQUE
    tag = cls.__struct_config__.tag
    fields = frozenset(cls.__struct_fields__)
    if tag == "BlockStored" and fields >= _STORED_REQUIRED:
        return STORED
    if tag == "BlockRemoved" and fields >= _REMOVED_REQUIRED:
        return REMOVED
    if tag == "AllBlocksCleared" and not fields:
        return CLEARED
    return OPAQUE


def event_kind_of_class(cls: type) -> int:
    """:func:`event_kind` for a class.  O(1) once the class has been seen."""
    kind = _kind_cache.get(cls)
    if kind is None:
        kind = _classify(cls)
        _kind_cache[cls] = kind
    return kind


def event_kind(event: object) -> int:
    """Return ``STORED``, ``REMOVED``, ``CLEARED`` or ``OPAQUE`` for ``event``.

    O(1): one dict lookup once the class has been seen.
    """
    kind = _kind_cache.get(type(event))  # the hot path: one dict lookup
    return event_kind_of_class(type(event)) if kind is None else kind


def is_kv_batch(batch: Any) -> bool:
    """True when every event of ``batch`` is a recognised KV event.

    O(events), in C (one ``set(map(type, ...))``), then O(distinct classes).
    """
    return all_kv_classes(set(map(type, batch.events)))


def all_kv_classes(classes: Iterable[type]) -> bool:
    """True when every one of ``classes`` is a KV event class.  O(classes)."""
    return all(event_kind_of_class(cls) != OPAQUE for cls in classes)


def event_count(batch: Any) -> int:
    """Events in a batch as it is now (0 if a caller replaced its list by something
    that has no length).  O(1)."""
    try:
        return len(batch.events)
    except Exception:
        return 0
