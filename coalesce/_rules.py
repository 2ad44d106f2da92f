"""The compaction rules 2 to 6 on one folded group of events, in Python.

This module is the rules' specification (``docs/event-semantics.md`` says what
each must preserve) and the oracle of the C accelerator, ``coalesce/_ccompact.c``;
:mod:`coalesce.compactor` folds the batches (rule 1), picks C or Python, and
counts.  Pure: no I/O, no threads, no clocks.

Each rule takes the group's events in order and a counter of its statistics
(by ``CompactionReport`` field name), and returns the events to send instead.
Every rule is linear in the events and block hashes it is given.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import msgspec

from coalesce._kinds import CLEARED, REMOVED, STORED, event_kind
from coalesce.events import BlockMoved, BlockStored

__all__ = ["compact_events", "split_moves"]

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

    __slots__ = ("chain", "chain_ok", "ev", "removals", "sure")

    def __init__(self, ev: Any) -> None:
        self.ev = ev
        self.removals: list[Any] | None = None
        self.chain: _Chain | None = None
        self.chain_ok = False
        self.sure = False  # a chain every model accepts (its first parent is certainly held)

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


def _sure_parent(
    parent: Any, key: tuple[Any, Any, Any], sure_at: dict[Any, int], removed_at: dict[Any, int]
) -> bool:
    """True when a store under ``parent`` (``key``: the parent in the store's own
    medium and group) is accepted by every model from every state: no parent, or
    a certain store of ``key`` later than every removal of it.  O(1)."""
    return parent is None or sure_at.get(key, -1) > removed_at.get(key, -1)


def _chain_may_start(ev: Any, sure: bool, removed: set[Any], certain: bool) -> bool:
    """Whether a chain may start on the store ``ev`` (rules 5a and 6 alike): it can be
    split, and its parent is certainly held (``sure``) or, unless ``certain`` (the
    engine stores parentless copies), its parent's hash was not removed earlier in
    the window (``removed``).  O(1)."""
    return _splittable(ev) and (sure or (not certain and ev.parent_block_hash not in removed))


def _latest(positions: dict[Any, int], keys: Iterable[Any]) -> int:
    """The latest of ``keys``' positions, -1 for none.  O(keys)."""
    return max([positions.get(k, -1) for k in keys], default=-1)


def _gather(events: list[Any], counts: Counter[str], certain: bool = False) -> list[Any]:
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
    removed_at: dict[tuple[Any, Any, Any], int] = {}  # key -> latest position removing it
    sure_at: dict[tuple[Any, Any, Any], int] = {}  # key -> latest certain store of it
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
                removed_at[k] = max(removed_at.get(k, -1), j)
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
                sure = out[j].sure  # stored when the chain is, under its first parent
            else:
                j = len(out)
                g = _Gathered(ev)
                g.chain = _Chain(ev)
                sure = g.sure = _sure_parent(parent, (medium, group, parent), sure_at, removed_at)
                g.chain_ok = _chain_may_start(ev, sure, removed, certain)
                out.append(g)
            for k in keys:
                key_any[k] = max(key_any.get(k, -1), j)
                key_store[k] = max(key_store.get(k, -1), j)
                if sure:
                    sure_at[k] = j  # j > key_any[k]: later than every position touching k
            for h in ev.block_hashes:
                hash_any[h] = max(hash_any.get(h, -1), j)
            if parent is not None:
                parent_of[parent] = max(parent_of.get(parent, -1), j)
            chain_end[(medium, group, ev.block_hashes[-1])] = j
        else:  # a BlockMoved: nothing moves across it
            floor = len(out)
            out.append(_Gathered(ev))
            removed.update(ev.block_hashes)
            group = _group(ev)
            for h in ev.block_hashes:  # its removal half (its store is never counted certain)
                removed_at[(ev.from_medium, group, h)] = floor
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


def _merge_chains(events: list[Any], counts: Counter[str], certain: bool = False) -> list[Any]:
    """Rule 6, one forward pass.  O(events + hashes).

    A chain is only started when its parent's hash was not removed earlier in
    the window, or when its parent is certainly held in the chain's own medium
    and group (a certain store of it later than every removal of it): see
    "chain" in docs/event-semantics.md for why a parent-checking subscriber
    needs one or the other.  With ``certain`` (the engine stores parentless
    copies), only the second.
    """
    out: list[Any] = []
    removed: set[Any] = set()
    removed_at: dict[tuple[Any, Any, Any], int] = {}  # key -> latest removal of it
    sure_at: dict[tuple[Any, Any, Any], int] = {}  # key -> latest certain store of it
    chain: _Chain | None = None
    chain_ok = chain_sure = False
    for i, ev in enumerate(events):
        kind = event_kind(ev)
        if kind == STORED:
            medium, group = ev.medium, _group(ev)
            if chain is not None and chain_ok and chain.accepts(ev):
                chain.add(ev)
                counts["merged"] += 1
            else:
                if chain is not None:
                    out.append(chain.build())
                chain = _Chain(ev)
                parent = ev.parent_block_hash
                chain_sure = _sure_parent(parent, (medium, group, parent), sure_at, removed_at)
                chain_ok = _chain_may_start(ev, chain_sure, removed, certain)
            if chain_sure:  # a chain's blocks are stored iff its first parent is held
                for h in ev.block_hashes:
                    sure_at[(medium, group, h)] = i
            continue
        if chain is not None:
            out.append(chain.build())
            chain = None
        out.append(ev)
        removed.update(ev.block_hashes)  # a removal or a BlockMoved
        medium = ev.medium if kind == REMOVED else ev.from_medium
        group = _group(ev)
        for h in ev.block_hashes:
            removed_at[(medium, group, h)] = i
    if chain is not None:
        out.append(chain.build())
    return out


def compact_events(
    events: list[Any], move_events: bool, counts: Counter[str], certain: bool = False
) -> list[Any]:
    """Rules 2 to 6 in Python: the specification, and the accelerator's oracle.
    ``certain``: chains (rules 5a and 6) start only on a certainly held parent."""
    events = _supersede(events, counts)
    if events and event_kind(events[0]) == CLEARED:
        # A run of clears is one clear; only the last one survived _supersede.
        head, body = [events[0]], events[1:]
    else:
        head, body = [], events
    body = _cancel(body, counts)
    if move_events:
        body = _make_moves(body, counts)
    body = _gather(body, counts, certain)
    body = _sink_removals(body, counts)
    body = _merge_chains(body, counts, certain)
    return head + body


def split_moves(events: list[Any]) -> list[list[Any]]:
    """Runs of ``BlockMoved`` each get a batch of their own."""
    parts: list[list[Any]] = []
    for ev in events:
        is_move = isinstance(ev, BlockMoved)
        if parts and isinstance(parts[-1][0], BlockMoved) == is_move:
            parts[-1].append(ev)
        else:
            parts.append([ev])
    return parts
