"""The snapshot recorder: the index a subscriber that saw every published batch holds.

Pure state, no I/O and no threads: the sender thread feeds it every batch
``publish()`` accepted or refused, in publish order (after compaction: what
was sent, whose final state is the same), and :meth:`Recorder.chunks`
rebuilds that index as ``BlockStored`` events for a snapshot reply.

The state is the ``refcount`` model of docs/event-semantics.md, the engine's
truth: a count per key ``(medium, group_idx, block_hash)``, a removal at zero
a no-op, ``AllBlocksCleared`` empties it.  For each key it keeps the event
that last stored it (and the block's position in it), for the tokens and the
other fields; the event object is shared, not copied.  For each hash it keeps
the parent and a reference count: held keys with that hash plus retained
children.  A hash no key holds any more is kept while it is the ancestor of
a held one, so a snapshot can re-store it for a parent-checking subscriber
(llm-d, Dynamo) and remove it again: every store of the snapshot finds its
parent in its own medium and group.

Memory: one dict entry and one small list per held key, one per retained
hash, plus the events they reference (an event stays alive while any of its
blocks is held).  ``max_blocks`` bounds both counts; past it, or on anything
it cannot interpret, the recorder is *unavailable* (it forgets everything and
a snapshot request gets ``-2``) until the next ``AllBlocksCleared``, after
which it is exact again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from coalesce.events import BlockRemoved, BlockStored

__all__ = ["Recorder"]

CHUNK_BLOCKS = 256
"""Blocks per snapshot chunk (one ``KVEventBatch``): bounds the work of one step."""
CHUNK_TOKENS = 65_536
"""Tokens per snapshot chunk: bounds a chunk's bytes whatever the block size."""

_UNSET: Any = object()


def _tag(ev: Any) -> str | None:
    config = getattr(type(ev), "__struct_config__", None)
    return None if config is None else config.tag


class Recorder:
    """Exact per-key reference counts, and what is needed to re-store each key.

    :meth:`record` is O(hashes in the batch); :meth:`chunks` is O(held keys +
    retained ancestors) in all, a bounded slice per chunk.  Not thread-safe:
    the sender thread owns it.
    """

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        # (medium, group, hash) -> [count, source event, index of the block in it]
        self._live: dict[tuple[Any, Any, Any], list[Any]] = {}
        # hash -> [refs, parent, source event, index, parent_counted]
        self._info: dict[Any, list[Any]] = {}
        self.valid = True
        """False while the recorder is unavailable (see the module docstring)."""
        self.reason = ""
        """Why it is unavailable (empty while valid)."""
        self.invalidations = 0
        self.batches = 0
        self.events = 0

    # -- feeding ---------------------------------------------------------------

    def record(self, batch: Any) -> None:
        """Apply one batch's events, in order.  O(hashes); never raises.

        While unavailable, only an ``AllBlocksCleared`` is looked for; it makes
        the recorder exact again and the events after it are applied.
        """
        self.batches += 1
        try:
            events = batch.events
            self.events += len(events)
            for ev in events:
                tag = _tag(ev)
                if tag == "AllBlocksCleared":
                    self._live.clear()
                    self._info.clear()
                    self.valid, self.reason = True, ""
                elif not self.valid:
                    continue
                elif tag == "BlockStored":
                    self._store(ev, ev.medium)
                elif tag == "BlockRemoved":
                    self._remove(ev.block_hashes, ev.medium, getattr(ev, "group_idx", None))
                elif tag == "BlockMoved":
                    self._store(ev, ev.to_medium)
                    self._remove(ev.block_hashes, ev.from_medium, getattr(ev, "group_idx", None))
                # any other tag: the subscriber models ignore it, and so does the state
        except Exception as exc:  # a value it cannot interpret: its effect is unknown
            self.invalidate(f"an event it cannot interpret ({type(exc).__name__}: {exc!s:.200})")
            return
        if self.valid and (len(self._live) > self.max_blocks or len(self._info) > self.max_blocks):
            self.invalidate(f"more than snapshot_max_blocks={self.max_blocks} blocks held")

    def invalidate(self, reason: str) -> None:
        """Forget everything: unavailable until the next ``AllBlocksCleared``.  O(1)."""
        if self.valid:
            self.invalidations += 1
        self.valid, self.reason = False, reason
        self._live = {}
        self._info = {}

    def _store(self, ev: Any, medium: Any) -> None:
        live, info = self._live, self._info
        group = getattr(ev, "group_idx", None)
        hashes = ev.block_hashes
        prev = ev.parent_block_hash
        for i, h in enumerate(hashes):
            key = (medium, group, h)
            entry = live.get(key)
            if entry is not None:
                entry[0] += 1
                entry[1] = ev
                entry[2] = i
                node = info[h]
                node[2] = ev
                node[3] = i
            else:
                live[key] = [1, ev, i]
                known = info.get(h)
                if known is None:
                    counted = prev is not None and prev != h and prev in info
                    if counted:
                        info[prev][0] += 1
                    info[h] = [1, prev, ev, i, counted]
                else:
                    known[0] += 1
                    known[2] = ev
                    known[3] = i
            prev = h

    def _remove(self, hashes: Any, medium: Any, group: Any) -> None:
        live, info = self._live, self._info
        for h in hashes:
            key = (medium, group, h)
            entry = live.get(key)
            if entry is None:
                continue  # a removal of a key not held is a no-op
            if entry[0] > 1:
                entry[0] -= 1
                continue
            del live[key]
            node = info[h]
            while True:  # release the hash, and ancestors nothing else keeps
                node[0] -= 1
                if node[0]:
                    break
                del info[h]
                if not node[4]:
                    break
                h = node[1]
                node = info[h]

    # -- reading ---------------------------------------------------------------

    @property
    def held(self) -> int:
        """Keys held right now.  O(1)."""
        return len(self._live)

    @property
    def retained(self) -> int:
        """Hashes kept (held somewhere, or the ancestor of a held one).  O(1)."""
        return len(self._info)

    def state(self) -> dict[tuple[Any, Any, Any], int]:
        """The held keys and their counts (the ``refcount`` model's state).  O(keys)."""
        return {k: e[0] for k, e in self._live.items()}

    def check(self) -> None:
        """Assert the invariants (tests call it after each batch).  O(keys + hashes)."""
        refs: dict[Any, int] = {}
        for (_, _, h), entry in self._live.items():
            assert entry[0] >= 1, "a held key has a positive count"
            assert h in self._info, "a held key's hash is retained"
            refs[h] = refs.get(h, 0) + 1
        for node in self._info.values():
            if node[4]:
                assert node[1] in self._info, "a counted parent is retained"
                refs[node[1]] = refs.get(node[1], 0) + 1
        for h, node in self._info.items():
            assert node[0] == refs.get(h, 0) >= 1, "refs = held keys + counted children"

    def chunks(self) -> Iterator[list[Any]]:
        """The state as events, a chunk (one batch's events) per ``next()``.

        Every held key is stored ``count`` times, parents first within its
        medium and group; an ancestor no key holds there is stored before its
        first child and removed again at the end, so a parent-checking
        subscriber accepts every store.  Consecutive blocks of one source
        event are merged back into one chained store.  The state must not
        change until the iterator is exhausted (the caller defers
        :meth:`record` meanwhile).  Each ``next()`` is O(CHUNK_BLOCKS) blocks.
        """
        live, info = self._live, self._info
        done: set[tuple[Any, Any, Any]] = set()
        ghosts: dict[tuple[Any, Any], list[Any]] = {}
        out: list[Any] = []
        blocks = tokens = 0
        run: list[Any] | None = None  # [medium, group, source event, last index, event]
        for key in live:
            if key in done:
                continue
            medium, group, h = key
            path = [h]
            seen = {h}
            p = info[h][1]
            while p is not None and p not in seen and (medium, group, p) not in done:
                node = info.get(p)
                if node is None:
                    break  # a parent the stream never stored: sent as it came
                path.append(p)
                seen.add(p)
                p = node[1]
            for x in reversed(path):
                k = (medium, group, x)
                done.add(k)
                node = info[x]
                held = live.get(k)
                if held is None:
                    ghosts.setdefault((medium, group), []).append(x)
                    count, src, i = 1, node[2], node[3]
                else:
                    count, src, i = held
                for _ in range(count):
                    if (
                        count == 1
                        and run is not None
                        and run[2] is src
                        and run[3] == i - 1
                        and run[0] == medium
                        and run[1] == group
                        and run[4].block_hashes[-1] == node[1]
                    ):
                        ev = run[4]
                        ev.block_hashes.append(x)
                        ev.token_ids.extend(_tokens(src, i))
                        if ev.extra_keys is not None:
                            ev.extra_keys.append(_extra(src, i))
                        run[3] = i
                    else:
                        ev = _stored(x, node[1], medium, group, src, i)
                        out.append(ev)
                        run = [medium, group, src, i, ev] if count == 1 else None
                    blocks += 1
                    tokens += len(ev.token_ids)
                if blocks >= CHUNK_BLOCKS or tokens >= CHUNK_TOKENS:
                    yield out
                    out, blocks, tokens, run = [], 0, 0, None
        for (medium, group), hashes in ghosts.items():
            for start in range(0, len(hashes), CHUNK_BLOCKS):
                out.append(
                    BlockRemoved(
                        block_hashes=hashes[start : start + CHUNK_BLOCKS],
                        medium=medium,
                        group_idx=group,
                    )
                )
                blocks += min(CHUNK_BLOCKS, len(hashes) - start)
                if blocks >= CHUNK_BLOCKS:
                    yield out
                    out, blocks = [], 0
        if out:
            yield out


def _tokens(src: Any, i: int) -> list[Any]:
    toks = src.token_ids
    size = src.block_size
    if not toks or not isinstance(size, int) or size <= 0:
        return []
    part = toks[i * size : (i + 1) * size]
    return part if type(part) is list else list(part)


def _extra(src: Any, i: int) -> Any:
    keys = getattr(src, "extra_keys", None)
    if keys is None or i >= len(keys):
        return None
    return keys[i]


def _stored(h: Any, parent: Any, medium: Any, group: Any, src: Any, i: int) -> BlockStored:
    """A one-block store of ``h`` rebuilt from block ``i`` of the event that stored it."""
    keys = getattr(src, "extra_keys", None)
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=_tokens(src, i),
        block_size=src.block_size,
        lora_id=src.lora_id,
        medium=medium,
        lora_name=src.lora_name,
        extra_keys=None if keys is None else [_extra(src, i)],
        group_idx=group,
        kv_cache_spec_kind=getattr(src, "kv_cache_spec_kind", None),
        kv_cache_spec_sliding_window=getattr(src, "kv_cache_spec_sliding_window", None),
        locality=getattr(src, "locality", None),
        ownership=getattr(src, "ownership", None),
        session_id=getattr(src, "session_id", None),
    )
