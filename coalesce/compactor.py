"""The compactor: pure functions that shrink a window of pending batches.

No I/O, no threads, no clocks.  :func:`compact` takes the batches waiting to
be sent, in order, and returns fewer (or equal) batches that leave every
subscriber model in ``docs/event-semantics.md`` in the same final state.

Events are recognised by their msgspec tag and fields, never by class
identity, so vLLM's own ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``
work as well as ours.  Rebuilt events keep their class (``msgspec.structs.replace``)
and every field this module does not understand; two events merge only when
all such fields are equal.  A batch holding any event this module does not
recognise is passed through untouched and is a barrier: nothing is folded
into it or moved across it.

The rules, applied per folded group (one data-parallel rank, one batch class):

1. *fold*: adjacent batches become one batch carrying the newest ``ts``;
2. *supersede*: events before the group's last ``AllBlocksCleared`` are
   dropped (the clear empties the source whatever came before), and a run of
   clears becomes one;
3. *cancel*: a store of key ``k`` and the next op on ``k``, a removal, vanish
   together when the op on ``k`` before the store is a removal, the store is
   certain to be accepted, the hash is the store's last block, and no store in
   between names the hash as parent;
4. *move* (opt-in): an adjacent store and removal of the same hashes in two
   media (either order) become one :class:`~coalesce.events.BlockMoved`, sent
   in a batch of its own;
5a. *gather*: a removal joins the latest earlier removal of the same class and
   fields, a store the latest earlier chain ending in its parent (rule 6's
   conditions), when it commutes with every event in between (no shared key,
   two removals excepted; no parent among the other's hashes);
5. *sink removals*: a removal is delayed (and merged with later removals of the
   same medium, group, locality and ownership, duplicates kept) until a store
   that re-stores one of its keys or names one of its hashes as parent; this
   also turns "remove from GPU, store in CPU" into "store in CPU, remove from
   GPU";
6. *chain*: adjacent stores where the next one's parent is the previous one's
   last hash, all other fields equal, become one store.

Cost: every pass is linear in the events and block hashes of the window
(dict and set operations only); :func:`compact` allocates the output lists
and rebuilt events, nothing proportional to anything but the window.

:func:`compact_for_wire` is :func:`compact` for a caller that only encodes the
result: with the accelerator, merged per-block lists come back as their
encoding (``msgspec.Raw``), never built as lists.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

import msgspec

from coalesce import _layout
from coalesce._kinds import (
    CLEARED,
    OPAQUE,
    REMOVED,
    STORED,
    all_kv_classes,
    event_kind,
    event_kind_of_class,
    is_kv_batch,
)
from coalesce.events import BlockMoved, BlockStored

_accel: ModuleType | None = _layout.load_accelerator("_ccompact", "the same rules run in Python")
"""The optional C accelerator (coalesce/_ccompact.c), or None: not built, or
disabled by setting ``COALESCE_NO_ACCEL=1``.  Either way the results are the same."""

__all__ = [
    "CompactionReport",
    "accelerated",
    "compact",
    "compact_for_wire",
    "compactable",
    "rule_stats",
]

# Fields that hold one entry per block, or describe the chain: they are what a
# chain merge concatenates, so they are not part of the "all other fields equal" test.
_STORED_PER_BLOCK = frozenset(
    {"block_hashes", "parent_block_hash", "token_ids", "extra_keys", "lookahead_token_ids"}
)
_REMOVED_KNOWN = frozenset({"block_hashes", "medium", "group_idx", "locality", "ownership"})
_STORED_KNOWN = frozenset(BlockStored.__struct_fields__)

_attr_getter_cache: dict[tuple[type, frozenset[str]], Callable[[tuple[Any, ...]], Any]] = {}
_REMOVED_PER_BLOCK = frozenset({"block_hashes"})


def _attr_getter(cls: type, per_block: frozenset[str]) -> Callable[[tuple[Any, ...]], Any]:
    key = (cls, per_block)
    getter = _attr_getter_cache.get(key)
    if getter is None:
        names: tuple[str, ...] = cls.__struct_fields__  # type: ignore[attr-defined]
        idx = [i for i, f in enumerate(names) if f not in per_block]
        getter = operator.itemgetter(*idx) if idx else (lambda _row: ())
        _attr_getter_cache[key] = getter
    return getter


def _attrs(ev: Any, per_block: frozenset[str]) -> tuple[Any, ...]:
    """The class and every field except the per-block ones: equal attrs => mergeable."""
    cls = type(ev)
    return (cls, _attr_getter(cls, per_block)(msgspec.structs.astuple(ev)))


def _group(ev: Any) -> Any:
    return getattr(ev, "group_idx", None)


def _splittable(ev: Any) -> bool:
    """A store whose per-block fields line up with its hashes can be cut or joined."""
    n = len(ev.block_hashes)
    ntok = len(ev.token_ids)
    if ntok and ntok != ev.block_size * n:
        return False
    for name in ("extra_keys", "lookahead_token_ids"):
        per = getattr(ev, name, None)
        if per is not None and len(per) != n:
            return False
    return True


def _truncate_store(ev: Any, keep: int) -> Any:
    """The first ``keep`` blocks of a splittable store."""
    changes: dict[str, Any] = {"block_hashes": ev.block_hashes[:keep]}
    if ev.token_ids:
        changes["token_ids"] = ev.token_ids[: keep * ev.block_size]
    for name in ("extra_keys", "lookahead_token_ids"):
        per = getattr(ev, name, None)
        if per is not None:
            changes[name] = per[:keep]
    return msgspec.structs.replace(ev, **changes)


def _rule(stat: str, doc: str) -> Any:
    """A rule's counter: ``stat`` names the ``PublisherStats`` field it adds to."""
    return field(default=0, metadata={"stat": stat, "doc": doc})


@dataclass(frozen=True, slots=True)
class CompactionReport:
    """What one :func:`compact` call did.  Counts are of the window it was given.

    The rule counters carry, in their metadata, the ``PublisherStats`` field
    they add to (:func:`rule_stats`), so a new rule is declared here once.
    """

    batches_in: int = 0
    batches_out: int = 0
    events_in: int = 0
    events_out: int = 0
    folded: int = _rule("batches_folded", "Input batches folded into a previous one.")
    merged: int = _rule(
        "events_merged", "Events that disappeared by being merged into a neighbour."
    )
    cancelled: int = _rule(
        "blocks_cancelled", "Block hashes whose store and removal cancelled (pairs)."
    )
    superseded: int = _rule(
        "events_superseded", "Events dropped because a later AllBlocksCleared made them moot."
    )
    moved: int = _rule("blocks_moved", "Block hashes carried by BlockMoved events.")


def rule_stats() -> tuple[tuple[str, str], ...]:
    """``(report field, PublisherStats field)`` for every rule counter.  O(fields)."""
    return tuple((f.name, f.metadata["stat"]) for f in fields(CompactionReport) if f.metadata)


# --- rule 2: supersede --------------------------------------------------------


def _supersede(events: list[Any], counts: Counter[str]) -> list[Any]:
    last_clear = -1
    for i in range(len(events) - 1, -1, -1):
        if event_kind(events[i]) == CLEARED:
            last_clear = i
            break
    if last_clear <= 0:
        return events
    counts["superseded"] += last_clear
    return events[last_clear:]


# --- rule 3: cancel -----------------------------------------------------------


class _StoreOp:
    """The latest op on a key was this store (event ``idx``, block ``pos``)."""

    __slots__ = ("after_removal", "idx", "pos", "prior", "sure")

    def __init__(self, idx: int, pos: int, sure: bool, prior: object) -> None:
        self.idx = idx
        self.pos = pos
        self.sure = sure
        self.prior = prior
        self.after_removal = prior is _REMOVAL


_REMOVAL = object()  # "the latest op on this key was a removal"


def _cancel(events: list[Any], counts: Counter[str]) -> list[Any]:
    """Rule 3, one forward pass over stores and removals (no clears).  O(events + hashes)."""
    last_op: dict[tuple[Any, Any, Any], object] = {}
    last_child: dict[Any, int] = {}  # hash -> latest store event naming it as parent
    alive: dict[int, int] = {}  # store idx -> blocks kept (a prefix)
    splittable: dict[int, bool] = {}
    dead: dict[int, set[int]] = {}  # removal idx -> cancelled positions
    for i, ev in enumerate(events):
        kind = event_kind(ev)
        if kind == STORED:
            medium, group, parent = ev.medium, _group(ev), ev.parent_block_hash
            parent_op = last_op.get((medium, group, parent))
            sure = parent is None or (isinstance(parent_op, _StoreOp) and parent_op.sure)
            if parent is not None:
                last_child[parent] = i
            hashes = ev.block_hashes
            for pos, h in enumerate(hashes):
                key = (medium, group, h)
                last_op[key] = _StoreOp(i, pos, sure, last_op.get(key))
            alive[i] = len(hashes)
            splittable[i] = _splittable(ev)
        elif kind == REMOVED:
            medium, group = ev.medium, _group(ev)
            for pos, h in enumerate(ev.block_hashes):
                key = (medium, group, h)
                op = last_op.get(key)
                if (
                    isinstance(op, _StoreOp)
                    and op.after_removal
                    and op.sure
                    and splittable[op.idx]
                    and alive[op.idx] == op.pos + 1
                    and last_child.get(h, -1) < op.idx
                ):
                    alive[op.idx] = op.pos
                    dead.setdefault(i, set()).add(pos)
                    last_op[key] = op.prior
                    counts["cancelled"] += 1
                else:
                    last_op[key] = _REMOVAL
    if not dead:
        return events
    out: list[Any] = []
    for i, ev in enumerate(events):
        if i in alive:
            keep = alive[i]
            if keep == len(ev.block_hashes):
                out.append(ev)
            elif keep:
                out.append(_truncate_store(ev, keep))
        elif i in dead:
            gone = dead[i]
            rest = [h for p, h in enumerate(ev.block_hashes) if p not in gone]
            if rest:
                out.append(msgspec.structs.replace(ev, block_hashes=rest))
        else:
            out.append(ev)
    return out


# --- rule 5: sink removals ----------------------------------------------------


def _removal_key(ev: Any) -> Hashable:
    """What two removals that may merge share: class and every field but the
    hashes.  A removal with an unhashable field this module does not know gets
    a key of its own (never merged).  O(fields)."""
    key: Hashable = _attrs(ev, _REMOVED_PER_BLOCK)
    try:
        hash(key)
    except TypeError:
        return ("id", id(ev))
    return key


def _sink_removals(events: list[Any], counts: Counter[str]) -> list[Any]:
    """Rule 5, one forward pass over stores, removals and moves (no clears).

    O(events + hashes).  A held removal is flushed whole (all the hashes merged
    into it) before the first store that conflicts with any of them.
    """
    out: list[Any] = []
    # group key -> [first removal, hashes, number of removals merged]
    held: dict[Hashable, list[Any]] = {}
    by_hash: dict[Any, set[Hashable]] = {}
    by_key: dict[tuple[Any, Any, Any], set[Hashable]] = {}

    def flush(which: Iterable[Hashable]) -> None:
        for gkey in which:
            first, hashes, n = held.pop(gkey)
            medium, group = first.medium, _group(first)
            for h in hashes:
                by_hash[h].discard(gkey)
                by_key[(medium, group, h)].discard(gkey)
            if n == 1:
                out.append(first)
            else:
                counts["merged"] += n - 1
                out.append(msgspec.structs.replace(first, block_hashes=hashes))

    for ev in events:
        kind = event_kind(ev)
        if kind == REMOVED:
            gkey = _removal_key(ev)
            entry = held.get(gkey)
            if entry is None:
                held[gkey] = [ev, list(ev.block_hashes), 1]
            else:
                entry[1].extend(ev.block_hashes)
                entry[2] += 1
            medium, group = ev.medium, _group(ev)
            for h in ev.block_hashes:
                by_hash.setdefault(h, set()).add(gkey)
                by_key.setdefault((medium, group, h), set()).add(gkey)
        else:  # a store, or a BlockMoved (a store in to_medium, then a removal)
            conflict: set[Hashable] = set()
            parent = ev.parent_block_hash
            if parent is not None and by_hash.get(parent):
                conflict |= by_hash[parent]
            medium = ev.medium if kind == STORED else ev.to_medium
            group = _group(ev)
            for h in ev.block_hashes:
                hit = by_key.get((medium, group, h))
                if hit:
                    conflict |= hit
            if conflict:
                flush([g for g in held if g in conflict])
            out.append(ev)
    flush(list(held))
    return out


# --- rule 4: moves ------------------------------------------------------------


def _movable(store: Any, removal: Any) -> bool:
    return (
        event_kind(store) == STORED
        and event_kind(removal) == REMOVED
        and store.medium != removal.medium
        and list(store.block_hashes) == list(removal.block_hashes)
        and _group(store) == _group(removal)
        and getattr(store, "locality", None) == getattr(removal, "locality", None)
        and getattr(store, "ownership", None) == getattr(removal, "ownership", None)
        and frozenset(type(store).__struct_fields__) <= _STORED_KNOWN
        and frozenset(type(removal).__struct_fields__) <= _REMOVED_KNOWN
    )


def _make_moves(events: list[Any], counts: Counter[str]) -> list[Any]:
    """Rule 4, one pass over adjacent pairs.  O(events + hashes).

    A store followed by the removal of the same hashes from another medium is
    the move itself.  A removal followed by such a store (vLLM's own order) is
    the same move once the removal is delayed past the store, which is exact
    when the store's parent is not one of the removed hashes (rule 5).
    """
    out: list[Any] = []
    i = 0
    n = len(events)
    while i < n:
        ev = events[i]
        nxt = events[i + 1] if i + 1 < n else None
        if nxt is not None and _movable(ev, nxt):
            store, removal = ev, nxt
        elif nxt is not None and _movable(nxt, ev) and nxt.parent_block_hash not in ev.block_hashes:
            store, removal = nxt, ev
        else:
            out.append(ev)
            i += 1
            continue
        fields = {f: getattr(store, f) for f in type(store).__struct_fields__}
        fields["to_medium"] = fields.pop("medium")
        fields["from_medium"] = removal.medium
        out.append(BlockMoved(**fields))
        counts["moved"] += len(store.block_hashes)
        counts["merged"] += 1
        i += 2
    return out


# --- rule 5a: gather -----------------------------------------------------------


class _Gathered:
    """One event of :func:`_gather`'s output: a removal and the removals merged
    into it (``removals``), or a chain of stores (``chain``), or an event kept
    as it is (a ``BlockMoved``: a barrier)."""

    __slots__ = ("chain", "chain_ok", "ev", "removals")

    def __init__(self, ev: Any) -> None:
        self.ev = ev
        self.removals: list[Any] | None = None
        self.chain: _Chain | None = None
        self.chain_ok = False

    def build(self, counts: Counter[str]) -> Any:
        if self.chain is not None:
            counts["merged"] += self.chain.n - 1
            return self.chain.build()
        if self.removals is not None and len(self.removals) > 1:
            counts["merged"] += len(self.removals) - 1
            hashes: list[Any] = []
            for r in self.removals:
                hashes.extend(r.block_hashes)
            return msgspec.structs.replace(self.ev, block_hashes=hashes)
        return self.ev


def _latest(positions: dict[Any, int], keys: Iterable[Any]) -> int:
    """The latest of ``keys``' positions, -1 for none.  O(keys)."""
    return max([positions.get(k, -1) for k in keys], default=-1)


def _gather(events: list[Any], counts: Counter[str]) -> list[Any]:
    """Rule 5a, one forward pass over stores, removals and moves (no clears).

    O(events + hashes): each event looks up its keys, hashes and parent in
    four position maps, then joins one earlier output event or is appended.

    Each event moves back to the latest output event it can join (a removal
    of the same class and fields; a chain whose last hash is its parent, all
    other fields equal) when it commutes with every event placed after that
    one: no shared key (two removals always commute), and neither one's
    parent is a hash of the other in any medium.  A ``BlockMoved`` is a
    barrier.  The maps hold, per key or hash, the latest output position
    that holds it, so "commutes with everything after position j" is
    "every conflicting position is below j".
    """
    out: list[_Gathered] = []
    key_any: dict[tuple[Any, Any, Any], int] = {}  # key -> latest position touching it
    key_store: dict[tuple[Any, Any, Any], int] = {}  # key -> latest store touching it
    hash_any: dict[Any, int] = {}  # hash -> latest position holding it (any medium)
    parent_of: dict[Any, int] = {}  # hash -> latest store naming it as a parent
    removed: set[Any] = set()  # hashes removed so far (a chain start's condition)
    last_removal: dict[Hashable, int] = {}  # removal class and fields -> latest position
    chain_end: dict[tuple[Any, Any, Any], int] = {}  # key of a chain's last block -> position
    floor = -1  # the latest barrier
    for ev in events:
        kind = event_kind(ev)
        if kind == REMOVED:
            medium, group = ev.medium, _group(ev)
            keys = [(medium, group, h) for h in ev.block_hashes]
            barrier = max(floor, _latest(key_store, keys), _latest(parent_of, ev.block_hashes))
            gkey = _removal_key(ev)
            j = last_removal.get(gkey, -1)
            if j > barrier:
                removals = out[j].removals
                assert removals is not None
                removals.append(ev)
            else:
                j = len(out)
                g = _Gathered(ev)
                g.removals = [ev]
                out.append(g)
                last_removal[gkey] = j
            for k in keys:
                key_any[k] = max(key_any.get(k, -1), j)
            for h in ev.block_hashes:
                hash_any[h] = max(hash_any.get(h, -1), j)
            removed.update(ev.block_hashes)
        elif kind == STORED:
            medium, group, parent = ev.medium, _group(ev), ev.parent_block_hash
            keys = [(medium, group, h) for h in ev.block_hashes]
            barrier = max(floor, _latest(key_any, keys), _latest(parent_of, ev.block_hashes))
            holder = -1 if parent is None else hash_any.get(parent, -1)
            j = -1 if parent is None else chain_end.get((medium, group, parent), -1)
            chain = out[j].chain if j > barrier else None
            if (
                chain is not None
                and out[j].chain_ok
                and holder <= j  # the parent's holder after j would be jumped over
                and chain.accepts(ev)
            ):
                chain.add(ev)
            else:
                j = len(out)
                g = _Gathered(ev)
                g.chain = _Chain(ev)
                g.chain_ok = _splittable(ev) and parent not in removed
                out.append(g)
            for k in keys:
                key_any[k] = max(key_any.get(k, -1), j)
                key_store[k] = max(key_store.get(k, -1), j)
            for h in ev.block_hashes:
                hash_any[h] = max(hash_any.get(h, -1), j)
            if parent is not None:
                parent_of[parent] = max(parent_of.get(parent, -1), j)
            chain_end[(medium, group, ev.block_hashes[-1])] = j
        else:  # a BlockMoved: nothing moves across it
            floor = len(out)
            out.append(_Gathered(ev))
            removed.update(ev.block_hashes)
    return [g.build(counts) for g in out]


# --- rule 6: chains -----------------------------------------------------------


class _Chain:
    """Stores being joined: the first event, then (once a second joins) the
    concatenated per-block fields.  Nothing is copied for a store that stays alone."""

    __slots__ = ("attrs", "extra", "first", "hashes", "lookahead", "n", "tokens")

    def __init__(self, ev: Any) -> None:
        self.first = ev
        self.n = 1
        self.attrs: tuple[Any, ...] | None = None
        self.hashes: list[Any] = ev.block_hashes
        self.tokens: list[int] = ev.token_ids
        self.extra: list[Any] | None = getattr(ev, "extra_keys", None)
        self.lookahead: list[Any] | None = getattr(ev, "lookahead_token_ids", None)

    def accepts(self, ev: Any) -> bool:
        if type(ev) is not type(self.first) or ev.parent_block_hash != self.hashes[-1]:
            return False
        if bool(self.tokens) != bool(ev.token_ids) or not _splittable(ev):
            return False
        if (self.extra is None) != (getattr(ev, "extra_keys", None) is None):
            return False
        if (self.lookahead is None) != (getattr(ev, "lookahead_token_ids", None) is None):
            return False
        if self.attrs is None:
            self.attrs = _attrs(self.first, _STORED_PER_BLOCK)
        return _attrs(ev, _STORED_PER_BLOCK) == self.attrs

    def add(self, ev: Any) -> None:
        if self.n == 1:  # copy on first join: never mutate an input event's lists
            self.hashes = list(self.hashes)
            self.tokens = list(self.tokens)
            self.extra = None if self.extra is None else list(self.extra)
            self.lookahead = None if self.lookahead is None else list(self.lookahead)
        self.n += 1
        self.hashes.extend(ev.block_hashes)
        self.tokens.extend(ev.token_ids)
        if self.extra is not None:
            self.extra.extend(ev.extra_keys)
        if self.lookahead is not None:
            self.lookahead.extend(ev.lookahead_token_ids)

    def build(self) -> Any:
        if self.n == 1:
            return self.first
        changes: dict[str, Any] = {"block_hashes": self.hashes, "token_ids": self.tokens}
        if self.extra is not None:
            changes["extra_keys"] = self.extra
        if self.lookahead is not None:
            changes["lookahead_token_ids"] = self.lookahead
        return msgspec.structs.replace(self.first, **changes)


def _merge_chains(events: list[Any], counts: Counter[str]) -> list[Any]:
    """Rule 6, one forward pass.  O(events + hashes).

    A chain is only started when its parent's hash was not removed earlier in
    the window: see "chain" in docs/event-semantics.md for why that is the one
    condition a parent-checking subscriber needs.
    """
    out: list[Any] = []
    removed: set[Any] = set()
    chain: _Chain | None = None
    chain_ok = False
    for ev in events:
        if event_kind(ev) == STORED:
            if chain is not None and chain_ok and chain.accepts(ev):
                chain.add(ev)
                counts["merged"] += 1
                continue
            if chain is not None:
                out.append(chain.build())
            chain = _Chain(ev)
            chain_ok = _splittable(ev) and ev.parent_block_hash not in removed
            continue
        if chain is not None:
            out.append(chain.build())
            chain = None
        out.append(ev)
        removed.update(ev.block_hashes)  # a removal or a BlockMoved
    if chain is not None:
        out.append(chain.build())
    return out


# --- the pipeline -------------------------------------------------------------


def _compact_events(events: list[Any], move_events: bool, counts: Counter[str]) -> list[Any]:
    """Rules 2 to 6 on one folded group: in C when the accelerator takes the window."""
    if _accel is not None and not move_events:
        result = _accelerated(events)
        if result is not None:
            out, superseded, cancelled, merged = result
            counts["superseded"] += superseded
            counts["cancelled"] += cancelled
            counts["merged"] += merged
            return out
    return _compact_events_py(events, move_events, counts)


def accelerated() -> bool:
    """True when :func:`compact` runs its rules in C (the optional accelerator).  O(1)."""
    return _accel is not None


_offered: set[type] = set()
"""Classes offered to the accelerator's table (registered, or refused: once each)."""
_OFFER_LIMIT = 64
"""At most this many classes are remembered as offered (the C table holds 32); past
it :func:`_is_kv_batch` offers no more: a stream of ever-new classes is answered in
Python, in bounded memory."""


def _register(cls: type) -> None:
    """Offer ``cls`` to the accelerator's table, under the kind it may treat it as."""
    assert _accel is not None
    if len(_offered) < _OFFER_LIMIT:  # (the rules' path offers past it: not remembered)
        _offered.add(cls)
    names: tuple[str, ...] = getattr(cls, "__struct_fields__", ())
    _accel.register(cls, _accel_kind(cls), tuple(names))


def _is_kv_batch(batch: Any) -> bool:
    """:func:`coalesce._kinds.is_kv_batch`, answered in C for classes the accelerator knows.

    O(events) in C.  A batch of a class not offered to the accelerator yet
    offers it (once per class, so the fold-only level, which never runs the
    rules, is answered in C too); classes it refuses are answered in Python.
    """
    events = batch.events
    if _accel is None or type(events) is not list:
        return is_kv_batch(batch)
    if _accel.all_known(events):
        return True
    classes = set(map(type, events))
    new = classes - _offered
    if new and len(_offered) + len(new) <= _OFFER_LIMIT:
        for cls in new:
            _register(cls)
        if _accel.all_known(events):
            return True
    return all_kv_classes(classes)


def compactable(batch: Any) -> bool:
    """Whether :func:`compact` would fold and compact ``batch`` (every event a KV
    event it knows), rather than return it untouched.  O(events): one type
    lookup per event, in C with the accelerator."""
    return _is_kv_batch(batch)


def _accelerated(events: list[Any]) -> tuple[list[Any], int, int, int] | None:
    """The C rules' result, or None for a window they decline.  O(events + hashes).

    The first window holding a class unknown to the accelerator registers it
    (once per class; at most one extra call per distinct class).  A class it
    cannot register (its table of classes is full) makes it decline.
    """
    assert _accel is not None
    tried: set[type] = set()
    while True:
        result = _accel.compact_events(events)
        if not isinstance(result, type):
            return result  # type: ignore[no-any-return]
        if result in tried:
            return None
        tried.add(result)
        _register(result)


def _accelerated_window(
    batches: list[Any], fold_only: bool, wire: bool = False
) -> tuple[Any, ...] | None:
    """The C driver's result for a whole window (fold, then each group's rules),
    or None for a window it declines.  O(batches + events + hashes).

    As :func:`_accelerated`, the first window holding a class the accelerator
    does not know offers it (once per class), then calls again.
    """
    assert _accel is not None
    tried: set[type] = set()
    while True:
        result = _accel.compact_window(batches, fold_only, wire)
        if result is None or len(result) != 2:
            return result  # type: ignore[no-any-return]
        code, cls = result
        if cls in tried:
            return None
        tried.add(cls)
        if code == 0:
            _register(cls)
        else:
            _accel.register_batch(cls, _rebuildable(cls))


def _rebuildable(cls: type) -> bool:
    """Whether ``__copy__`` and a field write rebuild an instance of ``cls`` exactly
    as ``msgspec.structs.replace`` would (no ``__post_init__``, no cached hash)."""
    config = getattr(cls, "__struct_config__", None)
    return not (
        hasattr(cls, "__post_init__")
        or getattr(config, "cache_hash", False)
        or getattr(cls, "__copy__", None) is not msgspec.Struct.__copy__  # type: ignore[attr-defined]
    )


def _accel_kind(cls: type) -> int:
    """The kind the accelerator may treat ``cls`` as: OPAQUE (decline) unless its
    instances can be rebuilt by ``__copy__`` and a field write exactly as
    ``msgspec.structs.replace`` would (no ``__post_init__``, no cached hash)."""
    return event_kind_of_class(cls) if _rebuildable(cls) else OPAQUE


def _compact_events_py(events: list[Any], move_events: bool, counts: Counter[str]) -> list[Any]:
    """Rules 2 to 6 in Python: the specification, and the accelerator's oracle."""
    events = _supersede(events, counts)
    if events and event_kind(events[0]) == CLEARED:
        # A run of clears is one clear; only the last one survived _supersede.
        head, body = [events[0]], events[1:]
    else:
        head, body = [], events
    body = _cancel(body, counts)
    if move_events:
        body = _make_moves(body, counts)
    body = _gather(body, counts)
    body = _sink_removals(body, counts)
    body = _merge_chains(body, counts)
    return head + body


def _split_moves(events: list[Any]) -> list[list[Any]]:
    """Runs of ``BlockMoved`` each get a batch of their own."""
    parts: list[list[Any]] = []
    for ev in events:
        is_move = isinstance(ev, BlockMoved)
        if parts and isinstance(parts[-1][0], BlockMoved) == is_move:
            parts[-1].append(ev)
        else:
            parts.append([ev])
    return parts


def compact(
    batches: Sequence[Any], *, move_events: bool = False, fold_only: bool = False
) -> tuple[list[Any], CompactionReport]:
    """Compact a window of pending batches; return the batches to send instead.

    ``batches`` are ``EventBatch``-like msgspec structs (``ts``, ``events``,
    ``data_parallel_rank``) in publish order.  Adjacent batches of the same
    class and rank whose events are all recognised are folded and compacted;
    any other batch is returned as it is, in place.  The result leaves every
    model of ``docs/event-semantics.md`` in the state the input would have.

    A group that compacts to nothing sends nothing.  A group that nothing
    changed is returned as the very same batch object (so it encodes exactly
    as it would have).  With ``move_events``, ``BlockMoved`` events are sent in
    batches of their own.  With ``fold_only``, rule 1 alone is applied.

    Cost: O(batches + events + block hashes) time and memory; no I/O.  With
    the accelerator built, a window without moves is folded and compacted in
    one C call (the Python driver, :func:`_compact_py`, takes the windows it
    declines); with ``fold_only`` it is one list concatenation per group.
    docs/benchmarks.md has both measured against encoding.
    """
    return _compact(batches, move_events, fold_only, wire=False)


def compact_for_wire(
    batches: Sequence[Any], *, fold_only: bool = False
) -> tuple[list[Any], CompactionReport]:
    """:func:`compact` without moves, for a caller that only encodes the result.

    The batches encode (msgspec) byte for byte as :func:`compact`'s would, but
    a changed event's ``block_hashes`` and ``token_ids`` may be a
    ``msgspec.Raw`` holding that list's encoding, written by the C accelerator
    straight from the input events: no list is built, referenced, encoded and
    freed again.  So the result is for encoding only, never for reading (the
    snapshot recorder reads :func:`compact`'s).  Without the accelerator, or
    for a window it declines, the result is :func:`compact`'s.

    Cost: as :func:`compact`; the concatenated lists' elements are written as
    bytes, once.
    """
    return _compact(batches, False, fold_only, wire=True)


def _compact(
    batches: Sequence[Any], move_events: bool, fold_only: bool, wire: bool
) -> tuple[list[Any], CompactionReport]:
    if _accel is not None and not move_events and type(batches) is list:
        result = _accelerated_window(batches, fold_only, wire)
        if result is not None:
            out, events_in, events_out, folded, superseded, cancelled, merged = result
            return out, CompactionReport(
                batches_in=len(batches),
                batches_out=len(out),
                events_in=events_in,
                events_out=events_out,
                folded=folded,
                superseded=superseded,
                cancelled=cancelled,
                merged=merged,
            )
    return _compact_py(batches, move_events, fold_only)


def _compact_py(
    batches: Sequence[Any], move_events: bool, fold_only: bool
) -> tuple[list[Any], CompactionReport]:
    """:func:`compact`'s driver in Python: the fallback for windows the C one
    declines (and for moves), and its oracle.  Each group's rules still run in C
    when the accelerator takes them (:func:`_compact_events`)."""
    counts: Counter[str] = Counter()  # rule counters, by CompactionReport field name
    out: list[Any] = []
    events_in = 0
    groups = 0
    i = 0
    n = len(batches)
    while i < n:
        first = batches[i]
        events_in += len(first.events)
        groups += 1
        if not _is_kv_batch(first):
            out.append(first)
            i += 1
            continue
        j = i + 1
        while (
            j < n
            and type(batches[j]) is type(first)
            and batches[j].data_parallel_rank == first.data_parallel_rank
            and _is_kv_batch(batches[j])
        ):
            events_in += len(batches[j].events)
            j += 1
        last = batches[j - 1]
        if fold_only and j == i + 1:  # nothing to fold: not even an identity check
            out.append(first)
            i = j
            continue
        events: list[Any] = []
        for b in batches[i:j]:
            events.extend(b.events)
        new = events if fold_only else _compact_events(events, move_events, counts)
        if (
            j == i + 1
            and len(new) == len(first.events)
            and all(a is b for a, b in zip(new, first.events, strict=True))
        ):
            out.append(first)
        else:
            parts = _split_moves(new) if move_events and not fold_only else [new]
            for part in parts:
                if part:
                    out.append(msgspec.structs.replace(first, ts=last.ts, events=part))
        i = j
    report = CompactionReport(
        batches_in=n,
        batches_out=len(out),
        events_in=events_in,
        events_out=sum(len(b.events) for b in out),
        folded=n - groups,
        **counts,
    )
    return out, report
