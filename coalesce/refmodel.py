"""Reference subscriber models: what a subscriber believes after a stream.

These are the oracles of the test suite and the demo; they are small and
slow on purpose (clarity over speed).  One model instance is one source (one
publisher / DP rank).  A key is ``(medium, group_idx, block_hash)``.

Modes (see ``docs/event-semantics.md``):

``"set"``
    a plain set: a store adds the key, a removal discards it.
``"refcount"``
    a count per key: a store adds one, a removal subtracts one, a removal of a
    key at zero is a no-op; a key is held while its count is positive.
``"llmd"``
    ``refcount``, and a store event whose ``parent_block_hash`` is not held in
    any medium or group is dropped whole (llm-d's rule).
``"dynamo"``
    ``refcount``, and a store event whose parent is not held in the same medium
    and group is dropped whole (Dynamo's indexer, as observed).

Every mode empties on ``AllBlocksCleared`` and applies a ``BlockMoved`` as its
store in ``to_medium`` followed by its removal from ``from_medium``.

Events are told apart by their msgspec wire tag, read here: this module
imports nothing from the code it checks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Literal

__all__ = ["Key", "Mode", "SubscriberModel"]

Mode = Literal["set", "refcount", "llmd", "dynamo"]
Key = tuple[Any, Any, Any]
MODES: tuple[Mode, ...] = ("set", "refcount", "llmd", "dynamo")


class SubscriberModel:
    """The index one subscriber keeps for one source.  O(hashes) per event."""

    def __init__(self, mode: Mode, start: Iterable[Key] | Counter[Key] = ()) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.mode: Mode = mode
        self.counts: Counter[Key] = Counter()
        self._keys_with_hash: Counter[Any] = Counter()  # hash -> held keys with that hash
        self.dropped_stores = 0
        for key, n in Counter(start).items():
            for _ in range(1 if mode == "set" else n):
                self._add(key)

    def _add(self, key: Key) -> None:
        c = self.counts[key]
        if c == 0:
            self._keys_with_hash[key[2]] += 1
        if self.mode != "set" or c == 0:
            self.counts[key] = c + 1

    def _held_hash(self, medium: Any, group: Any, h: Any) -> bool:
        if self.mode == "dynamo":
            return self.counts.get((medium, group, h), 0) > 0
        return self._keys_with_hash.get(h, 0) > 0

    def _store(self, ev: Any, medium: Any) -> None:
        self.store(ev.block_hashes, ev.parent_block_hash, medium, getattr(ev, "group_idx", None))

    def store(self, hashes: Iterable[Any], parent: Any, medium: Any, group: Any) -> None:
        """Apply one store event (a chain of ``hashes`` under ``parent``).  O(hashes)."""
        if (
            self.mode in ("llmd", "dynamo")
            and parent is not None
            and not self._held_hash(medium, group, parent)
        ):
            self.dropped_stores += 1
            return
        for h in hashes:
            self._add((medium, group, h))

    def remove(self, hashes: Iterable[Any], medium: Any, group: Any) -> None:
        """Apply one removal event.  O(hashes)."""
        for h in hashes:
            key = (medium, group, h)
            c = self.counts.get(key, 0)
            if c == 0:
                continue
            if c == 1 or self.mode == "set":
                del self.counts[key]
                left = self._keys_with_hash[h] - 1
                if left:
                    self._keys_with_hash[h] = left
                else:
                    del self._keys_with_hash[h]
            else:
                self.counts[key] = c - 1

    def apply_event(self, ev: Any) -> None:
        """Apply one event, by its wire tag; events with any other tag are ignored."""
        config = getattr(type(ev), "__struct_config__", None)
        tag = None if config is None else config.tag
        if tag == "BlockStored":
            self._store(ev, ev.medium)
        elif tag == "BlockRemoved":
            self.remove(ev.block_hashes, ev.medium, getattr(ev, "group_idx", None))
        elif tag == "AllBlocksCleared":
            self.clear()
        elif tag == "BlockMoved":
            self._store(ev, ev.to_medium)
            self.remove(ev.block_hashes, ev.from_medium, getattr(ev, "group_idx", None))

    def clear(self) -> None:
        """Apply ``AllBlocksCleared``."""
        self.counts.clear()
        self._keys_with_hash.clear()

    def apply_batches(self, batches: Iterable[Any]) -> SubscriberModel:
        """Apply every event of every batch, in order; returns ``self``."""
        for batch in batches:
            for ev in batch.events:
                self.apply_event(ev)
        return self

    def state(self) -> dict[Key, int]:
        """The held keys with their counts (1 in ``set`` mode)."""
        return {k: c for k, c in self.counts.items() if c > 0}

    def held(self) -> set[Key]:
        """The held keys."""
        return set(self.state())
