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

:func:`new_recorder` returns the C state (``coalesce/_crecord.c``, wrapped
by ``_CRecorder``) when it is built, and this pure-Python :class:`Recorder`
otherwise; the Python one is also the tests' oracle for the C one.

Memory: one dict entry and one small list per held key, one per retained
hash, plus the events they reference (an event stays alive while any of its
blocks is held); the C state keeps a fixed-size record per key and per hash
instead.  ``max_blocks`` bounds both counts; past it, or on anything
it cannot interpret, the recorder is *unavailable* (it forgets everything and
a snapshot request gets ``-2``) until the next ``AllBlocksCleared``, after
which it is exact again.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Generator, Iterator
from types import ModuleType
from typing import Any, ClassVar, TypeAlias

from coalesce import _layout
from coalesce.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored

__all__ = ["AnyRecorder", "Recorder", "new_recorder"]

_accel: ModuleType | None = _layout.load_accelerator("_crecord", "the same recorder runs in Python")
"""The optional C state (coalesce/_crecord.c), or None: not built, or disabled
by setting ``COALESCE_NO_ACCEL=1``."""

CHUNK_BLOCKS = 256
"""Blocks per snapshot chunk (one ``KVEventBatch``): bounds the work of one step."""
CHUNK_TOKENS = 65_536
"""Tokens per snapshot chunk: bounds a chunk's bytes whatever the block size."""
RELEASE_AT = 64
"""Block hashes in a batch from which the C recorder updates its tables with
the GIL released (the engine thread runs meanwhile); below it, releasing it
gave the engine nothing measurable (docs/benchmarks.md)."""

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

    def record(self, batch: Any, keep_gil: bool = False) -> None:
        """Apply one batch's events, in order.  O(hashes); never raises.
        (``keep_gil``: as :class:`_CRecorder`'s; this one never releases it.)

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

    def chunks(self) -> Generator[list[Any], None, None]:
        """The state as events, a chunk (one batch's events) per ``next()``.

        Every held key is stored ``count`` times, parents first within its
        medium and group; an ancestor no key holds there is stored before its
        first child and removed again at the end, so a parent-checking
        subscriber accepts every store.  Consecutive blocks of one source
        event are merged back into one chained store.  The state must not
        change until the iterator is exhausted or closed (the caller defers
        :meth:`record` meanwhile).  Each ``next()`` is O(CHUNK_BLOCKS) blocks.
        """
        for items in self._walk():
            yield _events(items)

    def _walk(self) -> Iterator[list[Any]]:
        """The chunks as items (see :func:`_events`), in the C walk's format."""
        live, info = self._live, self._info
        done: set[tuple[Any, Any, Any]] = set()
        ghosts: dict[tuple[Any, Any], list[Any]] = {}
        out: list[Any] = []
        blocks = tokens = 0
        run: list[Any] | None = None  # [medium, group, source event, last index, hashes]
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
                if (
                    count == 1
                    and run is not None
                    and run[2] is src
                    and run[3] == i - 1
                    and run[0] == medium
                    and run[1] == group
                    and run[4][-1] == node[1]
                ):
                    run[4].append(x)
                    run[3] = i
                else:
                    hashes = [x]
                    out.append((src, i, hashes, node[1], medium, group, count))
                    run = [medium, group, src, i, hashes] if count == 1 else None
                blocks += count
                tokens += count * len(_tokens(src, i))
                if blocks >= CHUNK_BLOCKS or tokens >= CHUNK_TOKENS:
                    yield out
                    out, blocks, tokens, run = [], 0, 0, None
        for (medium, group), hashes in ghosts.items():
            start = 0
            while start < len(hashes):
                part = hashes[start : start + CHUNK_BLOCKS - blocks]
                start += len(part)
                out.append((medium, group, part))
                blocks += len(part)
                if blocks >= CHUNK_BLOCKS:
                    yield out
                    out, blocks = [], 0
        if out:
            yield out


def _events(items: list[Any]) -> list[Any]:
    """A chunk's events from its walk items.

    A store item ``(source, first index, hashes, parent, medium, group,
    count)`` is one chained store rebuilt from those blocks of its source
    event, ``count`` times; a removal item ``(medium, group, hashes)`` is a
    ``BlockRemoved``.  O(blocks and tokens of the chunk).
    """
    out: list[Any] = []
    for item in items:
        if len(item) == 3:
            medium, group, hashes = item
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
            continue
        src, i, hashes, parent, medium, group, count = item
        ev = _stored(hashes, parent, medium, group, src, i)
        out.extend([ev] * count)
    return out


def _tokens(src: Any, i: int, n: int = 1) -> list[Any]:
    """The tokens of blocks ``i .. i+n`` of ``src`` (what a store rebuilt from them sends)."""
    toks = src.token_ids
    size = src.block_size
    if not toks or not isinstance(size, int) or size <= 0:
        return []
    part = toks[i * size : (i + n) * size]
    return part if type(part) is list else list(part)


def _extra(src: Any, i: int, n: int) -> list[Any] | None:
    keys = getattr(src, "extra_keys", None)
    if keys is None:
        return None
    return [keys[j] if j < len(keys) else None for j in range(i, i + n)]


_OTHER = (
    "lora_id",
    "lora_name",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
"""The fields a rebuilt store copies from its source event as they are."""
_readers: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def _other_fields(src: Any) -> tuple[Any, ...]:
    """``_OTHER`` of ``src`` (None where its class lacks one).  O(1) once per class."""
    cls = type(src)
    read = _readers.get(cls)
    if read is None:
        fields = getattr(cls, "__struct_fields__", ())
        if all(f in fields for f in _OTHER):
            read = operator.attrgetter(*_OTHER)
        else:

            def read(ev: Any) -> tuple[Any, ...]:
                return tuple(getattr(ev, f, None) for f in _OTHER)

        _readers[cls] = read
    return read(src)


def _stored(
    hashes: list[Any], parent: Any, medium: Any, group: Any, src: Any, i: int
) -> BlockStored:
    """A store of ``hashes`` rebuilt from blocks ``i ..`` of the event that stored them."""
    n = len(hashes)
    lora_id, lora_name, kind, window, locality, ownership, session = _other_fields(src)
    return BlockStored(
        hashes,
        parent,
        _tokens(src, i, n),
        src.block_size,
        lora_id,
        medium,
        lora_name,
        _extra(src, i, n),
        group,
        kind,
        window,
        locality,
        ownership,
        session,
    )


# -- the C state ---------------------------------------------------------------

_KINDS = {"BlockStored": 1, "BlockRemoved": 2, "AllBlocksCleared": 3, "BlockMoved": 4}
"""The C state's kinds, by tag (0: any other tag, ignored as the models do)."""


def _kind(cls: type) -> int:
    """The C state's kind of a class, by its msgspec tag.  O(1)."""
    config = getattr(cls, "__struct_config__", None)
    tag = None if config is None else config.tag
    return _KINDS.get(tag, 0) if isinstance(tag, str) else 0


class _CRecorder:
    """:class:`Recorder`'s interface over the C state (``coalesce._crecord.State``).

    The same state and the same rebuilt stream (tests/test_recorder.py runs
    both); a value outside the C domain (see the C source's header) makes it
    unavailable where the Python recorder might have coped, never wrong.
    :meth:`record` is O(blocks) in C; :meth:`chunks` builds Python objects for
    the stores only, one per chained run.
    """

    def __init__(self, max_blocks: int, accel: ModuleType, release_at: int = RELEASE_AT) -> None:
        self.max_blocks = max_blocks
        self.release_at = release_at
        self._state: Any = accel.State()
        self._register: Any = accel.register
        for cls in (AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored):
            self._register(cls, _kind(cls), cls.__struct_fields__)  # first: always readable
        self._reason = ""
        self.invalidations = 0
        self.batches = 0
        self.events = 0

    @property
    def valid(self) -> bool:
        """False while the recorder is unavailable.  O(1)."""
        return bool(self._state.valid)

    @property
    def reason(self) -> str:
        """Why it is unavailable (empty while valid).  O(1)."""
        return "" if self._state.valid else self._reason

    @property
    def held(self) -> int:
        """Keys held right now.  O(1)."""
        return int(self._state.held)

    @property
    def retained(self) -> int:
        """Hashes kept (held somewhere, or the ancestor of a held one).  O(1)."""
        return int(self._state.retained)

    def record(self, batch: Any, keep_gil: bool = False) -> None:
        """:meth:`Recorder.record`.  O(blocks); never raises.  The table pass
        releases the GIL from ``release_at`` hashes on, unless ``keep_gil``."""
        self.batches += 1
        try:
            events = batch.events
            self.events += len(events)
            if type(events) is not list:
                events = list(events)
            while True:
                r = self._state.record(events, self.max_blocks, 0 if keep_gil else self.release_at)
                if type(r) is int:
                    break
                if self._register(r, _kind(r), tuple(getattr(r, "__struct_fields__", ()))) is None:
                    events = self._without_unregistered(events)
        except Exception as exc:  # a caller's mistake or a class it cannot read
            self.invalidate(f"an event it cannot interpret ({type(exc).__name__}: {exc!s:.200})")
            return
        if r:
            self.invalidations += 1
            self._reason = (
                f"more than snapshot_max_blocks={self.max_blocks} blocks held"
                if r == 2
                else "an event it cannot interpret (a value outside the C recorder's domain)"
            )

    _full: ClassVar[set[type]] = set()
    """Classes the C table had no room for (it holds 64 per process)."""

    def _without_unregistered(self, events: list[Any]) -> list[Any]:
        """The events, where the C class table is full: an unregistered class's
        clear becomes ours, an ignored tag is left out; a store or removal
        cannot be read, so it raises (and the state is forgotten).  O(events)."""
        out = []
        for ev in events:
            cls = type(ev)
            fields = tuple(getattr(cls, "__struct_fields__", ()))
            if cls in self._full or self._register(cls, _kind(cls), fields) is None:
                self._full.add(cls)
                kind = _kind(cls)
                if kind == _KINDS["AllBlocksCleared"]:
                    ev = AllBlocksCleared()
                elif kind == 0:
                    continue
                else:
                    raise TypeError("too many event classes for the C recorder")
            out.append(ev)
        return out

    def invalidate(self, reason: str) -> None:
        """Forget everything: unavailable until the next ``AllBlocksCleared``.  O(held)."""
        if self._state.valid:
            self.invalidations += 1
        self._reason = reason
        self._state.invalidate()

    def state(self) -> dict[tuple[Any, Any, Any], int]:
        """The held keys and their counts (the ``refcount`` model's state).  O(keys)."""
        return dict(self._state.state())

    def check(self) -> None:
        """Assert the invariants (tests call it after each batch).  O(keys + hashes)."""
        self._state.check()

    def chunks(self) -> Generator[list[Any], None, None]:
        """:meth:`Recorder.chunks`; the walk ends when it is exhausted or closed."""
        st = self._state
        st.walk_start()
        try:
            while True:
                items = st.walk_next(CHUNK_BLOCKS, CHUNK_TOKENS)
                if items is None:
                    return
                yield _events(items)
        finally:
            st.walk_end()


AnyRecorder: TypeAlias = "Recorder | _CRecorder"


def new_recorder(
    max_blocks: int, *, accelerated: bool | None = None, release_at: int = RELEASE_AT
) -> AnyRecorder:
    """The C recorder when it is built (and not disabled), else the Python one.

    ``accelerated=True`` requires the C one (ImportError without it);
    ``False`` forces the Python one.  ``release_at``: the C recorder updates
    its tables with the GIL released for a batch of at least that many block
    hashes (0: never); the Python one ignores it.
    """
    if accelerated is False or (accelerated is None and _accel is None):
        return Recorder(max_blocks)
    if _accel is None:
        raise ImportError("coalesce._crecord is not built")
    return _CRecorder(max_blocks, _accel, release_at)
