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

Rule 1 and the choice of C or Python are here; rules 2 to 6 in Python, the
specification, are in :mod:`coalesce._rules`.

:func:`compact_for_wire` is :func:`compact` for a caller that only encodes the
result: with the accelerator, merged per-block lists come back as their
encoding (``msgspec.Raw``), never built as lists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from operator import itemgetter
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgspec

from coalesce import _layout
from coalesce._kinds import (
    OPAQUE,
    all_kv_classes,
    event_kind_of_class,
    is_kv_batch,
)
from coalesce._rules import compact_events, split_moves

if TYPE_CHECKING:
    from coalesce._ccompact import GroupResult, WindowResult

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


def _counts_picker(c_fields: Sequence[str]) -> Callable[[Any], tuple[int, ...]]:
    """A function of the C window's result (fields named ``c_fields``) that returns
    :class:`CompactionReport`'s positional arguments: the counts of the fields the
    C fills (the first ones; ``moved`` keeps its default), each picked here once
    by its name.  A reorder on either side changes where a count is read, never
    which report field it fills, and the window path builds the report
    positionally, at the cost it always had."""
    names = [f.name for f in fields(CompactionReport)]
    picked = [n for n in names if n in c_fields]
    if not picked or names[: len(picked)] != picked:
        raise RuntimeError("the report fields the C fills must be its first ones")
    return itemgetter(*(list(c_fields).index(n) for n in picked))


_pickers: dict[type, Callable[[Any], tuple[int, ...]]] = {}
"""The report's arguments from the C window's result, per result class (one)."""


def _picker_of(result_type: Any) -> Callable[[Any], tuple[int, ...]]:
    pick = _pickers[result_type] = _counts_picker(result_type.__match_args__)
    return pick


# --- the pipeline -------------------------------------------------------------


def _compact_events(
    events: list[Any],
    move_events: bool,
    counts: Counter[str],
    accel: Any = _accel,
    parentless_copies: bool = False,
) -> list[Any]:
    """Rules 2 to 6 on one folded group: in C when ``accel`` (the accelerator, or None)
    takes the window."""
    if accel is not None and not move_events:
        result = _accelerated(events, parentless_copies)
        if result is not None:  # (the C result's counts are named as the report's fields)
            counts["superseded"] += result.superseded
            counts["cancelled"] += result.cancelled
            counts["merged"] += result.merged
            return result.events
    return compact_events(events, move_events, counts, parentless_copies)


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


def _is_kv_batch(batch: Any, accel: Any = _accel) -> bool:
    """:func:`coalesce._kinds.is_kv_batch`, answered in C for classes the accelerator knows.

    O(events) in C.  A batch of a class not offered to the accelerator yet
    offers it (once per class, so the fold-only level, which never runs the
    rules, is answered in C too); classes it refuses are answered in Python.
    """
    events = batch.events
    if accel is None or type(events) is not list:
        return is_kv_batch(batch)
    if accel.all_known(events):
        return True
    classes = set(map(type, events))
    new = classes - _offered
    if new and len(_offered) + len(new) <= _OFFER_LIMIT:
        for cls in new:
            _register(cls)
        if accel.all_known(events):
            return True
    return all_kv_classes(classes)


def compactable(batch: Any) -> bool:
    """Whether :func:`compact` would fold and compact ``batch`` (every event a KV
    event it knows), rather than return it untouched.  O(events): one type
    lookup per event, in C with the accelerator."""
    return _is_kv_batch(batch)


def _accelerated(events: list[Any], parentless_copies: bool = False) -> GroupResult | None:
    """The C rules' result, or None for a window they decline.  O(events + hashes).

    The first window holding a class unknown to the accelerator registers it
    (once per class; at most one extra call per distinct class).  A class it
    cannot register (its table of classes is full) makes it decline.
    """
    assert _accel is not None
    tried: set[type] = set()
    while True:
        result = _accel.compact_events(events, parentless_copies)
        if not isinstance(result, type):
            return result  # type: ignore[no-any-return]
        if result in tried:
            return None
        tried.add(result)
        _register(result)


def _accelerated_window(
    batches: list[Any], fold_only: bool, wire: bool = False, parentless_copies: bool = False
) -> WindowResult | None:
    """The C driver's result for a whole window (fold, then each group's rules),
    or None for a window it declines.  O(batches + events + hashes).

    As :func:`_accelerated`, the first window holding a class the accelerator
    does not know offers it (once per class), then calls again.
    """
    assert _accel is not None
    tried: set[type] = set()
    while True:
        result = _accel.compact_window(batches, fold_only, wire, parentless_copies)
        if type(result) is not tuple:  # a WindowResult (a named tuple), or None
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


def compact(
    batches: Sequence[Any],
    *,
    move_events: bool = False,
    fold_only: bool = False,
    accelerated: bool = True,
    parentless_copies: bool = False,
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
    docs/benchmarks.md has both measured against encoding.  ``accelerated=False``:
    the pure-Python rules even where the C ones are built (an A/B, or an oracle).

    ``parentless_copies``: the engine may store a copy of a block without naming
    its parent while another store of the same hash names one (vLLM's CPU
    offload with ``lazy_offload``).  Chains then start only on a parent
    certainly held, which keeps a subscriber that starts or resets mid-stream
    exact too, at a cost in compaction ("chain" in docs/event-semantics.md).
    """
    return _compact(batches, move_events, fold_only, False, _use(accelerated), parentless_copies)


def compact_for_wire(
    batches: Sequence[Any],
    *,
    fold_only: bool = False,
    accelerated: bool = True,
    parentless_copies: bool = False,
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
    bytes, once.  ``parentless_copies``: as :func:`compact`.
    """
    return _compact(batches, False, fold_only, True, _use(accelerated), parentless_copies)


def _use(accelerated: bool) -> ModuleType | None:
    """The accelerator, if built and wanted."""
    return _accel if accelerated else None


def _compact(
    batches: Sequence[Any],
    move_events: bool,
    fold_only: bool,
    wire: bool,
    accel: Any,
    parentless_copies: bool,
) -> tuple[list[Any], CompactionReport]:
    if accel is not None and not move_events and type(batches) is list:
        r = _accelerated_window(batches, fold_only, wire, parentless_copies)
        if r is not None:  # its counts picked by name (_c_counts)
            pick = _pickers.get(type(r)) or _picker_of(type(r))
            return r.batches, CompactionReport(*pick(r))
    return _compact_py(batches, move_events, fold_only, accel, parentless_copies)


def _compact_py(
    batches: Sequence[Any],
    move_events: bool,
    fold_only: bool,
    accel: Any = None,
    parentless_copies: bool = False,
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
        if not _is_kv_batch(first, accel):
            out.append(first)
            i += 1
            continue
        j = i + 1
        while (
            j < n
            and type(batches[j]) is type(first)
            and batches[j].data_parallel_rank == first.data_parallel_rank
            and _is_kv_batch(batches[j], accel)
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
        new = (
            events
            if fold_only
            else _compact_events(events, move_events, counts, accel, parentless_copies)
        )
        if (
            j == i + 1
            and len(new) == len(first.events)
            and all(a is b for a, b in zip(new, first.events, strict=True))
        ):
            out.append(first)
        else:
            parts = split_moves(new) if move_events and not fold_only else [new]
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
