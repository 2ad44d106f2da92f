"""The snapshot recorder: the state a snapshot serves, as a replay program.

Pure state, no I/O and no threads: the sender thread feeds it every batch
``publish()`` accepted or refused, in publish order (what it sent after the
rules, the compactor's output of what it sent as it came, or what it refused:
coalesce/_snapshot.py), and :meth:`Recorder.chunks` writes the state
out as vLLM PR #57789's *replay program*: the recorded ``BlockStored`` events
that are still needed, whole and in the order they were recorded, then the
``BlockRemoved`` events that bring every key back to its count.  A fresh
index that applies the program holds what an index that applied every
recorded batch holds; since no recorded store is split or rebuilt, every
field a consumer reads (tokens, extra keys, locality...) is as recorded.

The state:

- a *key* is ``(medium, group_idx, locality, ownership, block_hash)`` (the
  PR's scope plus the hash); each held key has a count (the ``refcount``
  model of docs/event-semantics.md: a store adds one, a removal takes one
  away, a removal at zero is a no-op) and the *source*, the store event that
  last stored it;
- a source is kept while a held key names it or a kept source depends on it:
  a store depends on the source of its parent (the key holding the parent in
  the store's own scope, else in another scope) and, when it carries no
  tokens, on a held key's source with tokens for each of its hashes.
  A dependency is always recorded earlier, so the program, in recorded order,
  stores every parent before its children (a parent-checking subscriber,
  llm-d or Dynamo, accepts every store) and ends by removing what no key
  holds any more;
- ``AllBlocksCleared`` empties it, every tier, as llm-d and Dynamo apply it
  to the live stream and as the compactor folds it (the PR's recorder keeps
  the offload tiers; a snapshot here must agree with the live stream it
  continues: docs/subscribers.md).

Unavailable: past ``max_blocks`` references held, or blocks in the sources
kept, or on an event it cannot interpret, the recorder forgets everything and
a snapshot request gets ``-2`` until the next ``AllBlocksCleared``, after
which it is exact again.

Memory, in the C state: per held key one 24-byte slot of a table at most
half full; per kept source one 96-byte slot, its event (the bytes the sender
wrote for it when it went through :meth:`Recorder.encode`, else a strong
reference to the event, shared, not copied) and its hashes as 64-bit keys (8
bytes each, for the program); non-u64 hashes and scopes interned while a kept
source stores them.
Batches that cancel out leave it as it was (the table shrinks back once
under 1/8 full).  In the Python dicts: per held key one dict entry, its count
and source packed in one int (not tracked by the cyclic garbage collector,
whose passes over a large state would otherwise cost the engine's thread);
per kept source a tuple of its event and its dependencies.

:meth:`Recorder.record` keeps the state in C (``coalesce/_crecord.c``) where
that is built: the same state, its keys in an open-addressing table of
(scope id, 64-bit hash) -> count and source, its sources in a C array holding
the recorded events, read at their msgspec slot offsets (checked at import by
``coalesce/_layout.py``), the table updated with the GIL released for calls
of 128 hashes or more, and for ones that grow or shrink it; the program is
written from it by a C walk, a chunk per ``next()``, in the same chunks.  The
Python code here is its fallback (not built, ``COALESCE_NO_ACCEL=1``, or a
layout the C code would misread) and the tests' oracle (tests/test_recorder.py and
tests/test_recorder_c.py run both and compare them).  :meth:`Recorder.encode`
is the sender's path for a batch it sends as it came: the C state writes the
batch's msgpack (msgspec's bytes: ``coalesce._fused``) and reads its events for
the recorder in the same pass, so that recording costs the sender less than
reading the events a second time (docs/benchmarks.md, ``bench_recorder``);
it keeps each store as the bytes it wrote for it, not the event, so that
dropping a store once the engine has evicted its blocks is a ``free`` and not
the release of its Python objects, long out of the caches (the program hands
those bytes out as a ``msgspec.Raw``: the same wire).
An event the C loop cannot read (a hash that is neither an int, bytes nor
str, a field of a type it does not take, a class whose fields are not slots)
moves the state into
the Python dicts (:meth:`Recorder._to_python`, O(state), once), where it
stays until the next ``AllBlocksCleared``.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator
from types import ModuleType
from typing import Any

import msgspec

from coalesce._fused import TRUSTED, batch_shaped, checked, teach
from coalesce._kinds import CLEARED, MOVED, OPAQUE, REMOVED, STORED
from coalesce._layout import load_accelerator
from coalesce.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored, KVEventBatch

__all__ = ["CHUNK_EVENTS", "Recorder"]

CHUNK_EVENTS = 256
"""Events per snapshot chunk (one batch), as in the PR: bounds one step's work."""
CHUNK_TOKENS = 65_536
"""Tokens per snapshot chunk (a chunk still holds one whole store, however long)."""
CHUNK_WORK = 2048
"""Hashes looked at per chunk while writing the program (a chunk may be empty then)."""
REMOVED_PER_EVENT = 1024
"""Hashes per corrective ``BlockRemoved`` (only removals are ever split)."""

Scope = tuple[Any, Any, Any, Any]
"""``(medium, group_idx, locality, ownership)``: a key is a scope and a hash."""
SHIFT = 32
"""A held key's value is ``source id << SHIFT | count``."""
_COUNT = (1 << SHIFT) - 1
MAX_ID = 1 << 31
"""Source ids are renumbered from 0 (O(state), once per ``MAX_ID`` stores) before
they reach it, so that a value fits the C loop's 64-bit integer."""

# A source is a tuple (the C loop builds and reads the same; with a struct event of
# gc=False, as vLLM's and this project's are, the collector stops tracking it):
EVENT, SCOPE, DEPS, TOKENS, SIZE = range(5)
"""Its store event, scope, the ids of the sources it depends on (a tuple), whether
it has tokens, and its number of hashes.  What keeps it (keys naming it, and
dependants) is counted apart, in an int-to-int dict."""
# The counters, a list too:
NEXT, HELD, COUNTS, KEPT = range(4)
"""The next source id, keys held, the counts' sum, the kept sources' hashes."""

OTHER = OPAQUE
"""An event the recorder ignores, as the subscriber models do (kinds: coalesce/_kinds)."""
STOP_UNKNOWN, STOP_MOVE, STOP_PYTHON = 1, 2, 3
"""Why the C loop stopped before the end of a list (``State.stopped``): a class it
has not been told about, a move, an event it cannot read."""

_accel: ModuleType | None = load_accelerator("_crecord", "the pure-Python recorder runs")
"""The optional C state (coalesce/_crecord.c), or None: not built, disabled by
setting ``COALESCE_NO_ACCEL=1``, or failing the layout check."""


class Recorder:
    """Exact per-key counts, and the recorded stores that rebuild them.

    :meth:`record` is O(hashes in the batch) (amortised: a source is
    collected once; a parent or token lookup outside the store's scope is
    O(scopes), a handful); :meth:`chunks` is O(kept sources and their hashes)
    in all, a bounded slice per chunk.  Not thread-safe: the sender thread
    owns it.  ``accelerated``: None, the C state where built; False, never.
    """

    def __init__(self, max_blocks: int, *, accelerated: bool | None = None) -> None:
        if accelerated and _accel is None:
            raise ImportError("coalesce._crecord is not built")
        self.max_blocks = max_blocks
        self._c = None if accelerated is False else _accel
        self._cs: Any = None if self._c is None else self._c.State()
        self._cmode = self._cs is not None
        """The state is in C (else in the dicts below: no C, or since an event the C
        loop could not read, until the next clear)."""
        self._live: dict[Scope, dict[Any, int]] = {}  # scope -> hash -> source << SHIFT | count
        self._sources: dict[int, tuple[Any, ...]] = {}  # in recorded order
        self._refs: dict[int, int] = {}  # source id -> keys naming it + dependants
        self._unused: list[int] = []
        self._n: list[int] = [0, 0, 0, 0]  # NEXT, HELD, COUNTS, KEPT
        self.valid = True
        """False while the recorder is unavailable (see the module docstring)."""
        self.reason = ""
        """Why it is unavailable (empty while valid)."""
        self.invalidations = 0
        self._batches = 0  # (and the C state's, counted there on its fast path)
        self._events = 0
        self._fast: Any = None
        """The C state's ``record_batch`` while it holds the state and is exact."""
        self._fused: Any = None
        """Its ``encode_record`` then."""
        self._sync()

    def _sync(self) -> None:
        on = self._cmode and self.valid
        self._fast = self._cs.record_batch if on else None
        self._fused = self._cs.encode_record if on else None

    @property
    def batches(self) -> int:
        """Batches given to :meth:`record`.  O(1)."""
        return self._batches + (0 if self._cs is None else int(self._cs.batches))

    @property
    def events(self) -> int:
        """Their events.  O(1)."""
        return self._events + (0 if self._cs is None else int(self._cs.events))

    @property
    def accelerated(self) -> bool:
        """Whether the state is kept, and :meth:`record` runs, in C.  O(1)."""
        return self._c is not None

    # -- feeding ---------------------------------------------------------------

    def record(self, batch: Any) -> None:
        """Apply one batch's events, in order.  O(hashes); never raises.

        While unavailable, only an ``AllBlocksCleared`` is looked for; it
        makes the recorder exact again and the events after it are applied.
        """
        fast = self._fast
        if fast is not None:  # the usual case: one call into C, which counts the batch
            try:
                i = fast(batch, self.max_blocks)
            except Exception as exc:  # (as below)
                self._uninterpretable(exc)
                return
            if i == -2:
                return
            if i == -1:
                self._over_budget()
                return
            if i >= 0:
                self._record_list(batch.events, i)
                return
        self._batches += 1
        self._record_list(None, 0, batch)

    def encode(self, batch: Any) -> bytes | None:
        """``batch`` encoded as ``msgspec.msgpack.Encoder().encode(batch)`` encodes
        it, and recorded as :meth:`record` records it, in one pass over its events
        (the C state's ``encode_record``: the sender's encode and the recorder's
        read share their reads).  None when not taken, nothing recorded: no C
        state, the recorder unavailable, or a shape or value the fused encoder
        does not write (``coalesce._fused``); then encode and :meth:`record` it
        apart.  O(events + hashes); never raises.
        """
        fused = self._fused
        if fused is None:
            return None
        try:
            out = fused(batch, self.max_blocks)
        except Exception as exc:  # (as in record)
            self._uninterpretable(exc)
            return None
        if type(out) is bytes and type(batch) in TRUSTED:
            return out  # the usual case
        return self._encode_rest(batch, out)

    def _encode_rest(self, batch: Any, out: Any) -> bytes | None:
        """:meth:`encode` past its usual case: a class the C encoder is told about
        first (the result then checked against msgspec), a batch past the budget,
        the first batch of its class."""
        cs, taught = self._cs, False
        try:
            while out is None and cs.declined is not None and self._teach(cs.declined):
                taught = True
                out = cs.encode_record(batch, self.max_blocks)  # (a class it knows now)
        except Exception as exc:  # (as in record)
            self._uninterpretable(exc)
            return None
        if out is None:
            return None
        if type(out) is tuple:
            out = out[0]
            self._over_budget()
        return checked(batch, out, again=taught)

    def _teach(self, cls: type) -> bool:
        """Tell the C state's encoder about ``cls`` (registering an event class with
        the C loop first).  Once per class; whether it took it."""
        assert self._c is not None
        if not batch_shaped(cls):
            self._c.register(cls, _kind_of(cls))
        return teach(self._c, cls)

    def _record_list(self, events: list[Any] | None, i: int, batch: Any = None) -> None:
        """:meth:`record` from ``events[i]`` on (``batch``'s events when None)."""
        try:
            if events is None:
                events = batch.events
                if type(events) is not list:
                    events = list(events)
                self._events += len(events)
            end = len(events)
            while i < end:
                if self._cmode and self.valid:
                    i = self._record_c(events, i)
                else:
                    if self._n[NEXT] >= MAX_ID:
                        self._renumber()
                    i = self._record_from(events, i)
            self._collect()
        except Exception as exc:  # a value it cannot interpret: its effect is unknown
            self._uninterpretable(exc)
            return
        if self._cmode:
            counts, kept = self._cs.counts, self._cs.kept
        else:
            counts, kept = self._n[COUNTS], self._n[KEPT]
        if self.valid and (counts > self.max_blocks or kept > self.max_blocks):
            self._over_budget()

    def record_many(self, batches: Iterable[Any]) -> None:
        """:meth:`record` each of ``batches``, in order: with the C state, one call
        for the list (each batch still checked against the budget).  Never raises."""
        if type(batches) is not list:
            batches = list(batches)
        j, end = 0, len(batches)
        while j < end:
            if self._fast is None:
                self.record(batches[j])
                j += 1
                continue
            try:
                j, r = self._cs.record_batches(batches, j, self.max_blocks)
            except Exception as exc:  # (as in record)
                j = self._cs.at + 1
                self._uninterpretable(exc)
                continue
            if j == end:
                return
            batch = batches[j]
            j += 1
            if r == -1:
                self._over_budget()
            elif r >= 0:
                self._record_list(batch.events, r)
            else:  # (its events are not a list)
                self._batches += 1
                self._record_list(None, 0, batch)

    def _record_c(self, events: list[Any], i: int) -> int:
        """The C loop from ``events[i]``; the index after what it (or this) applied."""
        cs = self._cs
        i = cs.record(events, i)
        if i == len(events):
            return i
        stopped, ev = cs.stopped, events[i]
        if stopped == STOP_UNKNOWN:
            kind = _kind_of(type(ev))
            assert self._c is not None
            if self._c.register(type(ev), kind):
                return i  # (known now: the C loop goes on from it)
            if kind == OTHER:
                return i + 1
        elif stopped == STOP_MOVE:
            return self._move_c(ev, i)
        self._to_python()  # an event the C loop cannot read: the Python loop applies it
        return i

    def _move_c(self, ev: Any, i: int) -> int:
        """A ``BlockMoved``, applied to the C state as its store and its removal."""
        store = _moved_store(ev)
        scope = (ev.from_medium, *_scope_of(ev)[1:])
        medium, group, locality, ownership = scope
        removal = BlockRemoved(
            block_hashes=ev.block_hashes,
            medium=medium,
            group_idx=group,
            locality=locality,
            ownership=ownership,
        )
        if self._cs.record([store], 0) != 1:
            self._to_python()
            self._store(ev, store)
            self._remove(ev, scope)
        elif self._cs.record([removal], 0) != 1:
            self._to_python()
            self._remove(ev, scope)
        return i + 1

    def _to_python(self) -> None:
        """Move the state from C into the dicts (O(state)): until the next clear,
        the Python loop applies everything."""
        live, sources, refs, n = self._exported()
        self._live, self._sources, self._refs, self._n = live, sources, refs, n
        self._unused = []
        self._cs.clear()
        self._cmode = False
        self._sync()

    def _exported(
        self,
    ) -> tuple[dict[Scope, dict[Any, int]], dict[int, tuple[Any, ...]], dict[int, int], list[int]]:
        """The C state's :meth:`export`, every source's event an event with its lists
        as lists (:func:`_readable`).  O(keys + sources)."""
        live, sources, refs, n = self._cs.export()
        for sid, source in sources.items():
            event = _readable(source[EVENT])
            if event is not source[EVENT]:
                sources[sid] = (event, *source[SCOPE:])
        return live, sources, refs, n

    def _record_from(self, events: list[Any], i: int) -> int:
        """Apply ``events[i:]`` in Python; the index after the last applied (the
        one after a clear that gives the state back to C)."""
        for j in range(i, len(events)):
            ev = events[j]
            kind = _kind_of(type(ev))
            if kind == CLEARED:
                self._forget()
                self.valid, self.reason = True, ""
                self._sync()
                if self._cmode:
                    return j + 1
            elif not self.valid:
                pass
            elif kind == REMOVED:
                self._remove(_listed(ev), _scope_of(ev))
            elif kind == STORED:
                ev = _listed(ev)
                self._store(ev, ev)
            elif kind == MOVED:
                self._store(ev, _moved_store(ev))
                self._remove(ev, (ev.from_medium, *_scope_of(ev)[1:]))
            # OTHER: the subscriber models ignore it, and so does the state
        return len(events)

    def _renumber(self) -> None:
        """Give the kept sources the ids 0.. in their order.  O(state)."""
        self._collect()
        ids = {old: new for new, old in enumerate(self._sources)}
        self._sources = {
            ids[old]: (s[EVENT], s[SCOPE], tuple(ids[d] for d in s[DEPS]), s[TOKENS], s[SIZE])
            for old, s in self._sources.items()
        }
        self._refs = {ids[old]: refs for old, refs in self._refs.items()}
        for table in self._live.values():
            for h, value in table.items():
                table[h] = ids[value >> SHIFT] << SHIFT | value & _COUNT
        self._n[NEXT] = len(ids)

    def _uninterpretable(self, exc: BaseException) -> None:
        """:meth:`invalidate` for an event whose effect is unknown (``exc`` raised
        reading or applying it)."""
        self.invalidate(f"an event it cannot interpret ({type(exc).__name__}: {exc!s:.200})")

    def _over_budget(self) -> None:
        """:meth:`invalidate` for a state past ``max_blocks``."""
        self.invalidate(f"more than snapshot_max_blocks={self.max_blocks} blocks kept")

    def invalidate(self, reason: str) -> None:
        """Forget everything: unavailable until the next ``AllBlocksCleared``.  O(1)."""
        if self.valid:
            self.invalidations += 1
        self.valid, self.reason = False, reason
        self._forget()

    def _forget(self) -> None:
        self._live, self._sources, self._refs, self._unused = {}, {}, {}, []
        self._n[HELD] = self._n[COUNTS] = self._n[KEPT] = 0
        if self._cs is not None:
            self._cs.clear()
            self._cmode = True
        self._sync()

    def _store(self, ev: Any, src: Any) -> None:
        hashes = ev.block_hashes
        size = len(hashes)  # (None raises: an event it cannot interpret)
        if size == 0:
            return
        scope = _scope_of(src)
        live, sources, n = self._live, self._sources, self._n
        table = live.get(scope)
        if table is None:
            table = live[scope] = {}
        deps: list[int] = []
        parent = src.parent_block_hash
        if parent is not None:
            held = table.get(parent)
            if held is None:
                for other in live.values():
                    held = other.get(parent)
                    if held is not None:
                        break
            if held is not None:
                deps.append(held >> SHIFT)
        tokens = bool(getattr(src, "token_ids", None))
        if not tokens:
            for h in hashes:
                for other in live.values():
                    held = other.get(h)
                    if held is not None and sources[held >> SHIFT][TOKENS]:
                        if held >> SHIFT not in deps:
                            deps.append(held >> SHIFT)
                        break
        sid = n[NEXT]
        n[NEXT] = sid + 1
        sources[sid] = (src, scope, tuple(deps), tokens, size)
        refs = self._refs
        refs[sid] = 0
        n[KEPT] += size
        for dep in deps:
            refs[dep] += 1
        new = names = 0  # keys created; keys that name it now
        mine = sid << SHIFT
        for h in hashes:
            value = table.get(h)
            if value is None:
                table[h] = mine | 1
                new += 1
            else:
                table[h] = mine | ((value & _COUNT) + 1)
                old = value >> SHIFT
                if old != sid:  # (else: a hash repeated in this event)
                    names += 1
                    self._release(old)
        refs[sid] += new + names
        n[HELD] += new
        n[COUNTS] += size

    def _remove(self, ev: Any, scope: Scope) -> None:
        table = self._live.get(scope)
        if table is None:
            return
        n = self._n
        for h in ev.block_hashes:
            value = table.get(h)
            if value is None:
                continue  # a removal of a key not held is a no-op
            n[COUNTS] -= 1
            if value & _COUNT > 1:
                table[h] = value - 1
            else:
                del table[h]
                n[HELD] -= 1
                self._release(value >> SHIFT)

    def _release(self, sid: int) -> None:
        left = self._refs[sid] - 1
        self._refs[sid] = left
        if not left:
            self._unused.append(sid)

    def _collect(self) -> None:
        """Drop the sources nothing keeps (at the end of a batch, and before ids are
        renumbered).  O(sources dropped).  (The C state drops a source at once.)"""
        unused, sources, refs = self._unused, self._sources, self._refs
        while unused:
            sid = unused.pop()
            source = sources.get(sid)
            if source is None or refs[sid] > 0:
                continue
            del sources[sid]
            del refs[sid]
            self._n[KEPT] -= source[SIZE]
            for dep in source[DEPS]:
                self._release(dep)

    # -- reading ---------------------------------------------------------------

    @property
    def held(self) -> int:
        """Keys held right now.  O(1), no walk."""
        return int(self._cs.held) if self._cmode else self._n[HELD]

    @property
    def retained(self) -> int:
        """Store events kept for the program.  O(1)."""
        return int(self._cs.sources) if self._cmode else len(self._sources)

    def export(
        self,
    ) -> tuple[dict[Scope, dict[Any, int]], dict[int, tuple[Any, ...]], dict[int, int], list[int]]:
        """The state as ``(live, sources, refs, n)`` in the Python loop's form, source
        ids renumbered 0.. in recorded order (so that two recorders' states compare
        equal when they are the same).  O(keys + sources)."""
        if self._cmode:
            return self._exported()
        ids = {old: new for new, old in enumerate(self._sources)}
        sources = {
            ids[old]: (s[EVENT], s[SCOPE], tuple(ids[d] for d in s[DEPS]), s[TOKENS], s[SIZE])
            for old, s in self._sources.items()
        }
        refs = {ids[old]: r for old, r in self._refs.items()}
        live = {
            scope: {h: ids[v >> SHIFT] << SHIFT | v & _COUNT for h, v in table.items()}
            for scope, table in self._live.items()
        }
        return live, sources, refs, [len(ids), *self._n[HELD:]]

    def state(self) -> dict[tuple[Any, Any, Any], int]:
        """The held counts per ``(medium, group_idx, hash)`` (the reference models'
        key: locality and ownership summed).  O(keys)."""
        live = self._cs.export()[0] if self._cmode else self._live
        out: dict[tuple[Any, Any, Any], int] = {}
        for (medium, group, _, _), table in live.items():
            for h, value in table.items():
                k = (medium, group, h)
                out[k] = out.get(k, 0) + (value & _COUNT)
        return out

    def check(self) -> None:
        """Assert the invariants (tests call it after each batch).  O(keys + sources)."""
        if self._cmode:
            live, sources, refs_kept, n = self._exported()
            unused: list[int] = []
        else:
            live, sources, refs_kept, n, unused = (
                self._live,
                self._sources,
                self._refs,
                self._n,
                self._unused,
            )
        refs: Counter[int] = Counter()
        total = held = 0
        for scope, table in live.items():
            for h, value in table.items():
                count, sid = value & _COUNT, value >> SHIFT
                source = sources[sid]
                assert count >= 1, "a held key has a positive count"
                assert source[SCOPE] == scope and h in source[EVENT].block_hashes, "its source"
                refs[sid] += 1
                total += count
                held += 1
        assert total == n[COUNTS] and held == n[HELD], "the totals are kept"
        for sid, source in sources.items():
            for dep in source[DEPS]:
                assert dep < sid, "a dependency was recorded earlier"
                refs[dep] += 1
        for sid in sources:
            assert refs_kept[sid] == refs[sid] >= 1, "refs = keys naming it + dependants"
        assert refs_kept.keys() == sources.keys()
        assert n[KEPT] == sum(s[SIZE] for s in sources.values())
        assert not unused, "collected at the end of every batch"

    def chunks(self) -> Generator[list[Any], None, None]:
        """The program, a chunk (one batch's events) per ``next()``.

        The kept sources in recorded order; then, for a key held more times
        than they store it, its source again; then ``BlockRemoved`` events
        (per scope, at most :data:`REMOVED_PER_EVENT` hashes each) for every
        store too many.  Each ``next()`` looks at a bounded number of hashes
        (:data:`CHUNK_WORK`), so a chunk may be empty (the caller skips it).
        The state must not change until the iterator is exhausted or closed
        (the caller defers :meth:`record` meanwhile).  O(kept hashes) in all;
        its memory is O(the stores too many), not O(keys).  With the C state,
        its walk writes each chunk (the same chunks).
        """
        if self._cmode:
            return self._chunks_c()
        return self._chunks_py()

    def _chunks_c(self) -> Generator[list[Any], None, None]:
        walk = self._cs.walk(CHUNK_EVENTS, CHUNK_TOKENS, CHUNK_WORK, REMOVED_PER_EVENT, _removal)
        try:
            while True:
                chunk = walk.next()
                if chunk is None:
                    return
                yield chunk
        finally:
            walk.close()

    def _chunks_py(self) -> Generator[list[Any], None, None]:
        out: list[Any] = []
        tokens = work = 0
        for ev in self._program():
            if type(ev) is int:
                work += ev
                if work < CHUNK_WORK:
                    continue
            else:
                out.append(ev)
                tokens += len(getattr(ev, "token_ids", None) or ())
                if len(out) < CHUNK_EVENTS and tokens < CHUNK_TOKENS:
                    continue
            yield out
            out, tokens, work = [], 0, 0
        if out:
            yield out

    def _program(self) -> Iterator[Any]:
        """The program's events, and (ints) the hashes looked at in between.

        A key's stores in the program are its own source's (the one naming it)
        times that source is sent, plus *foreign* ones: other kept sources
        that store its hash in its scope (counted sparsely here).  Only a key
        held more than once can need its source again: those are noted while
        the sources go out, so no step walks every key.
        """
        live, sources = self._live, self._sources
        foreign: dict[Scope, Counter[Any]] = {}
        repeats: dict[int, Counter[Any]] = {}  # a source with a hash twice: its counts
        multi: list[tuple[Scope, Any]] = []  # keys held more than once
        for sid, source in sources.items():
            yield source[EVENT]
            yield _foreign(live, foreign, sid, source, repeats, multi)
        again: Counter[int] = Counter()  # sources sent again
        for looked, (scope, h) in enumerate(multi, 1):
            if not looked % 256:
                yield 256
            value = live[scope][h]
            count, sid = value & _COUNT, value >> SHIFT
            per = repeats[sid][h] if sid in repeats else 1
            mine = foreign.get(scope)
            while per * (1 + again[sid]) + (mine[h] if mine else 0) < count:
                source = sources[sid]
                yield source[EVENT]
                again[sid] += 1
                yield _foreign(live, foreign, sid, source, None, None)
                mine = foreign.get(scope)
        for scope, keys in _excess(live, sources, foreign, again, repeats).items():
            medium, group, locality, ownership = scope
            for i in range(0, len(keys), REMOVED_PER_EVENT):
                yield BlockRemoved(
                    block_hashes=keys[i : i + REMOVED_PER_EVENT],
                    medium=medium,
                    group_idx=group,
                    locality=locality,
                    ownership=ownership,
                )


def _foreign(
    live: dict[Scope, dict[Any, int]],
    foreign: dict[Scope, Counter[Any]],
    sid: int,
    source: tuple[Any, ...],
    repeats: dict[int, Counter[Any]] | None,
    multi: list[tuple[Scope, Any]] | None,
) -> int:
    """Count one sending of ``source``: its stores of keys it does not name go to
    ``foreign``; the first time, a repeated hash to ``repeats`` and a key it names
    held more than once to ``multi``.  Returns the hashes seen."""
    scope, hashes = source[SCOPE], source[EVENT].block_hashes
    table = live.get(scope, {})
    counts = foreign.get(scope)
    for h in hashes:
        value = table.get(h)
        if value is None or value >> SHIFT != sid:
            if counts is None:
                counts = foreign[scope] = Counter()
            counts[h] += 1
        elif multi is not None and value & _COUNT > 1:
            multi.append((scope, h))
    if repeats is not None and len(hashes) > 1 and len(set(hashes)) < len(hashes):
        repeats[sid] = Counter(hashes)
    return len(hashes)


def _excess(
    live: dict[Scope, dict[Any, int]],
    sources: dict[int, tuple[Any, ...]],
    foreign: dict[Scope, Counter[Any]],
    again: Counter[int],
    repeats: dict[int, Counter[Any]],
) -> dict[Scope, list[Any]]:
    """The stores too many, per scope, as hashes to remove (a hash once per store too
    many).  Only keys with foreign stores, or whose own source was sent again or
    repeats a hash, can have any.  O(those keys)."""
    keys: dict[Scope, dict[Any, None]] = {}
    for scope, counts in foreign.items():
        keys.setdefault(scope, {}).update(dict.fromkeys(counts))
    for sid in [*again, *repeats]:
        source = sources[sid]
        keys.setdefault(source[SCOPE], {}).update(dict.fromkeys(source[EVENT].block_hashes))
    out: dict[Scope, list[Any]] = {}
    for scope, hs in keys.items():
        table, mine = live.get(scope, {}), foreign.get(scope, Counter())
        removals: list[Any] = []
        for h in hs:
            value = table.get(h)
            stored = mine[h]
            if value is not None:
                sid = value >> SHIFT
                per = repeats[sid][h] if sid in repeats else 1
                stored += per * (1 + again[sid]) - (value & _COUNT)
            if stored > 0:
                removals.extend([h] * stored)
        if removals:
            out[scope] = removals
    return out


_KINDS: dict[type, int] = {}
"""Each event class's kind, by its wire tag, looked up once per class."""


def _listed(ev: Any) -> Any:
    """``ev``, or a copy of it whose hash and token lists are lists where they were
    ``msgspec.Raw`` (their encoding: :func:`coalesce.compactor.compact_for_wire`
    writes a merged event's so); the same wire either way.  O(1) when neither
    is a Raw, else O(the lists)."""
    lists = {
        name: msgspec.msgpack.decode(value)
        for name in ("block_hashes", "token_ids")
        if type(value := getattr(ev, name, None)) is msgspec.Raw
    }
    return msgspec.structs.replace(ev, **lists) if lists else ev


_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}
"""A decoder per event class, for the stores the C state keeps as their encoding."""


def _readable(kept: Any) -> Any:
    """A C source's event as the Python recorder reads it: the event (its lists as
    lists, :func:`_listed`), or, for a store the C state keeps as its encoding (a
    ``(cls, msgspec.Raw)`` pair), that encoding decoded as ``cls``.  O(the event).
    Raises where the bytes do not decode as the class's annotations say."""
    if type(kept) is not tuple:
        return _listed(kept)
    cls, raw = kept
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    return decoder.decode(raw)


def _kind_of(cls: type) -> int:
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = _kind(cls)
    return kind


def _removal(hashes: list[Any], medium: Any, group: Any, locality: Any, ownership: Any) -> Any:
    """A corrective removal of the program (the C walk builds them with this)."""
    return BlockRemoved(
        block_hashes=hashes, medium=medium, group_idx=group, locality=locality, ownership=ownership
    )


def _kind(cls: type) -> int:
    config = getattr(cls, "__struct_config__", None)
    tag = None if config is None else config.tag
    kinds = {
        "BlockStored": STORED,
        "BlockRemoved": REMOVED,
        "AllBlocksCleared": CLEARED,
        "BlockMoved": MOVED,
    }
    return kinds.get(tag, OTHER) if isinstance(tag, str) else OTHER


_SCOPE_FIELDS = ("medium", "group_idx", "locality", "ownership")
_scope_getters: dict[type, Callable[[Any], Scope]] = {}


def _scope_of(ev: Any) -> Scope:
    """``(medium, group_idx, locality, ownership)`` of a store or removal (None where its
    class lacks a field).  O(1); the reader is made once per class."""
    cls = type(ev)
    read = _scope_getters.get(cls)
    if read is None:
        fields = getattr(cls, "__struct_fields__", ())
        if all(f in fields for f in _SCOPE_FIELDS):
            read = operator.attrgetter(*_SCOPE_FIELDS)
        else:

            def read(ev: Any) -> Scope:
                return (
                    getattr(ev, "medium", None),
                    getattr(ev, "group_idx", None),
                    getattr(ev, "locality", None),
                    getattr(ev, "ownership", None),
                )

        _scope_getters[cls] = read
    return read(ev)


def _moved_store(ev: Any) -> BlockStored:
    """The store a ``BlockMoved`` makes in ``to_medium`` (what its program replays):
    every ``BlockStored`` field it carries, ``medium`` being its ``to_medium``."""
    carried = {f: getattr(ev, f) for f in BlockStored.__struct_fields__ if f != "medium"}
    return BlockStored(medium=ev.to_medium, **carried)


if _accel is not None:  # this package's own classes, known to the C loop from the start
    _accel.set_raw_type(msgspec.Raw)
    for _cls in (BlockStored, BlockRemoved, AllBlocksCleared, BlockMoved):
        _accel.register(_cls, _kind_of(_cls))
        teach(_accel, _cls)
    teach(_accel, KVEventBatch)
