"""The C accelerator against its oracle, the pure-Python rules.

For any window, ``_compact_events`` (C when it takes the window) must return
what ``_compact_events_py`` returns: equal events in the same order, the very
same objects where the rules changed nothing, and the same rule counts.  The
windows here are wider than the model tests' (bytes and 64-bit hashes, a
second family of classes with other field orders and an extra field,
unsplittable stores, values the accelerator must decline), and windows built
only from values it accepts must really be taken by it.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coalesce import _rules, compactor
from coalesce.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from coalesce_tools.workload import Engine, WorkloadConfig
from tests.streams import batch_lists, lazy_lists, offload_lists

if compactor._accel is None:
    if os.environ.get("COALESCE_REQUIRE_ACCEL"):
        pytest.fail(
            "the C accelerator (coalesce/_ccompact.c) was not built, and "
            "COALESCE_REQUIRE_ACCEL is set: is a C compiler with Python headers installed?",
            pytrace=False,
        )
    pytest.skip("the C accelerator is not built (pure-Python rules only)", allow_module_level=True)


# A second family, shaped like another library's: other field order, an extra field.
class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class OtherStored(_Event, tag="BlockStored"):
    medium: str | None
    block_hashes: list[Any]
    block_size: int
    parent_block_hash: Any
    token_ids: list[int]
    lora_id: int | None = None
    lora_name: str | None = None
    note: str | None = None


class OtherRemoved(_Event, tag="BlockRemoved"):
    medium: str | None
    block_hashes: list[Any]
    note: str | None = None


class OtherCleared(_Event, tag="AllBlocksCleared"):
    pass


class WithPostInit(_Event, tag="BlockRemoved"):
    """Rebuilt by msgspec.structs.replace, which calls __post_init__: declined."""

    block_hashes: list[Any]
    medium: str | None

    def __post_init__(self) -> None:
        pass


BIG = 2**64 - 1
INT_POOL = [0, 1, 2, 3, 7, 2**31, 2**62 + 5, BIG]  # 1, 2 and 3 digits, and the edge
BYTES_POOL = [b"\x00" * 8, b"\x01" * 8, b"\x02" * 32, b""]

# Mostly a few values, so that keys collide (the rules only act on collisions).
ints = st.one_of(st.sampled_from([1, 2, 3]), st.sampled_from(INT_POOL))
media = st.sampled_from(["GPU", "GPU", "GPU", "CPU", None])
groups = st.sampled_from([None, None, None, None, 0, 1])
BLOCK = 2


@st.composite
def a_store(draw: Any, hashes: Any, other: bool) -> Any:
    hs = draw(st.lists(hashes, min_size=1, max_size=3))
    parent = draw(st.one_of(st.none(), hashes))
    tok = draw(st.sampled_from(["none", "right", "wrong"]))
    tokens = {"none": [], "right": [9] * (BLOCK * len(hs)), "wrong": [9]}[tok]
    medium = draw(media)
    lora = draw(st.sampled_from([None, None, 1]))
    if other:
        return OtherStored(
            medium, hs, BLOCK, parent, tokens, lora, None, draw(st.sampled_from([None, "x"]))
        )
    extra = draw(st.sampled_from(["none", "right", "wrong"]))
    extra_keys = {"none": None, "right": [("k", i) for i in range(len(hs))], "wrong": [("k",)] * 5}[
        extra
    ]
    look = draw(st.sampled_from([None, "right"]))
    locality = draw(st.sampled_from([None, None, "local"]))
    lookahead = None if look is None else [[1]] * len(hs)
    stored = BlockStored(hs, parent, tokens, BLOCK, lora, medium, None, extra_keys, draw(groups))
    return msgspec.structs.replace(stored, locality=locality, lookahead_token_ids=lookahead)


@st.composite
def a_removal(draw: Any, hashes: Any, other: bool) -> Any:
    hs = draw(st.lists(hashes, min_size=0, max_size=3))
    if other:
        return OtherRemoved(draw(media), hs, draw(st.sampled_from([None, "x"])))
    return BlockRemoved(
        block_hashes=hs,
        medium=draw(media),
        group_idx=draw(groups),
        ownership=draw(st.sampled_from([None, None, "mine"])),
    )


def event_lists(hashes: Any) -> Any:
    """Windows of both families mixed, from values the accelerator accepts."""
    one = st.one_of(
        st.booleans().flatmap(lambda o: a_store(hashes, o)),
        st.booleans().flatmap(lambda o: a_store(hashes, o)),
        st.booleans().flatmap(lambda o: a_removal(hashes, o)),
        st.sampled_from([AllBlocksCleared(), OtherCleared()]),
    )
    return st.lists(one, max_size=40)


# Values the accelerator declines (the Python rules decide what they mean).
odd_values = st.sampled_from([-1, 2**64, 2**70, 1.0, True, "h", (1,)])


@st.composite
def declined_windows(draw: Any) -> list[Any]:
    events: list[Any] = draw(event_lists(ints))
    bad = draw(st.sampled_from(["hash", "parent", "tuple hashes", "lora list", "post_init"]))
    odd = draw(odd_values)
    if bad == "hash":
        events.append(BlockRemoved(block_hashes=[odd], medium="GPU"))
    elif bad == "parent":
        events.append(BlockStored([1], odd, [], BLOCK, None, "GPU", None))
    elif bad == "tuple hashes":
        events.append(BlockRemoved(block_hashes=(1, 2), medium="GPU"))  # type: ignore[arg-type]
    elif bad == "lora list":
        events.append(BlockStored([1], None, [], BLOCK, [1], "GPU", None))  # type: ignore[arg-type]
    else:
        events.append(WithPostInit([1], "GPU"))
    return draw(st.permutations(events))


def both(
    events: list[Any], certain: bool = False
) -> tuple[list[Any], Counter[str], list[Any], Counter[str]]:
    c_counts: Counter[str] = Counter()
    py_counts: Counter[str] = Counter()
    out_c = compactor._compact_events(list(events), False, c_counts, parentless_copies=certain)
    out_py = _rules.compact_events(list(events), False, py_counts, certain)
    return out_c, c_counts, out_py, py_counts


def assert_same(events: list[Any], certain: bool = False) -> None:
    before = copy.deepcopy(events)
    out_c, c_counts, out_py, py_counts = both(events, certain)
    assert out_c == out_py
    assert [type(e) for e in out_c] == [type(e) for e in out_py]
    assert +c_counts == +py_counts
    given_ids = {id(e) for e in events}
    for a, b in zip(out_c, out_py, strict=True):
        # the same untouched object, or both rebuilt
        assert a is b or (id(a) not in given_ids and id(b) not in given_ids)
    assert events == before, "the accelerator must never modify its input"


@given(event_lists(ints))
def test_int_hashes_match_the_python_rules(events: list[Any]) -> None:
    assert compactor._accelerated(list(events)) is not None, "an accepted window was declined"
    assert_same(events)


@given(event_lists(st.sampled_from(BYTES_POOL)))
def test_bytes_hashes_match_the_python_rules(events: list[Any]) -> None:
    assert compactor._accelerated(list(events)) is not None
    assert_same(events)


@given(batch_lists())
def test_model_streams_match_the_python_rules(batches: list[KVEventBatch]) -> None:
    events = [e for b in batches for e in b.events]
    assert compactor._accelerated(list(events)) is not None
    assert_same(events)


@given(offload_lists)
def test_offload_streams_match_the_python_rules(events: list[Any]) -> None:
    """vLLM's eager offload shapes, where chains start on a parent certainly held."""
    assert compactor._accelerated(list(events)) is not None
    assert_same(events)


@given(lazy_lists, st.booleans())
def test_lazy_streams_match_the_python_rules(events: list[Any], certain: bool) -> None:
    """vLLM's lazy offload shapes (parentless CPU copies, GPU stores under parents
    that may be missing, loads back), with ``parentless_copies`` and without."""
    assert compactor._accelerated(list(events), certain) is not None
    assert_same(events, certain)


@given(batch_lists(), st.booleans())
def test_windows_with_parentless_copies_match_the_python_driver(
    batches: list[Any], certain: bool
) -> None:
    """The C driver (one call per window) against the Python one, with the flag."""
    c = compactor.compact(batches, parentless_copies=certain)
    py = compactor.compact(batches, accelerated=False, parentless_copies=certain)
    assert [b.events for b in c[0]] == [b.events for b in py[0]]
    assert c[1] == py[1]


@given(declined_windows())
def test_declined_windows_give_the_python_result(events: list[Any]) -> None:
    """Whatever the accelerator declines, the caller's result is still the oracle's."""
    try:
        expected: Any = _rules.compact_events(list(events), False, Counter())
    except Exception as exc:  # the Python rules reject it: so must the caller
        with pytest.raises(type(exc)):
            compactor._compact_events(list(events), False, Counter())
        return
    assert compactor._compact_events(list(events), False, Counter()) == expected


def offload_run(n: int = 400) -> list[Any]:
    """The demo's pattern: a GPU chain, each block past 64 evicted and offloaded to CPU."""
    events: list[Any] = []
    for h in range(1, n):
        events.append(BlockStored([h], h - 1 if h > 1 else None, [h] * 16, 16, None, "GPU", None))
        if h > 64:
            events.append(BlockRemoved([h - 64], "GPU"))
            events.append(
                BlockStored([h - 64], h - 65 if h > 65 else None, [0] * 16, 16, None, "CPU", None)
            )
    return events


def test_a_long_offload_run_is_taken_and_matches() -> None:
    """The demo's pattern at the window size the sender uses: chains, tier moves, evictions."""
    events = offload_run()
    assert compactor._accelerated(list(events)) is not None
    assert_same(events)
    out, _ = compactor.compact([KVEventBatch(ts=1.0, events=events)])
    # the GPU chain, the CPU chain, the GPU removals (rule 5a gathers them)
    assert sum(len(b.events) for b in out) == 3


def test_the_demo_workload_is_taken_and_matches() -> None:
    """The demo's engine model (bursts, evictions, offload, clears), cut as the sender cuts it."""
    cfg = WorkloadConfig(
        steps=160, gpu_blocks=256, cpu_blocks=512, prefix_blocks=16, burst_every=40,
        burst_length=20, burst_blocks=32, clear_every=70,
    )  # fmt: skip
    engine = Engine(cfg)
    window: list[Any] = []
    windows = 0
    for _ in range(cfg.steps):
        window += engine.step()
        if len(window) >= 512:
            assert compactor._accelerated(list(window)) is not None
            assert_same(window)
            window, windows = [], windows + 1
    assert windows >= 3


def test_a_cancel_that_would_orphan_a_child_is_not_made() -> None:
    events = [
        BlockRemoved([5], "GPU"),
        BlockStored([5], None, [], BLOCK, None, "GPU", None),
        BlockStored([6], 5, [], BLOCK, None, "GPU", None),
        BlockRemoved([5], "GPU"),
    ]
    assert_same(events)
    counts: Counter[str] = Counter()
    compactor._compact_events(list(events), False, counts)
    assert counts["cancelled"] == 0


def test_no_references_leak() -> None:
    """Every object the accelerator touches has the same reference count after 200 calls."""
    events = [
        BlockStored([10, 11], None, [1, 2, 3, 4], BLOCK, None, "GPU", None),
        BlockStored([12], 11, [5, 6], BLOCK, None, "GPU", None),
        BlockRemoved([10], "GPU"),
        BlockRemoved([12], "GPU"),
        BlockStored([12], 11, [5, 6], BLOCK, None, "GPU", None),
    ]
    watched = [*events, *(e.block_hashes for e in events), events[0].token_ids]
    counts = [sys.getrefcount(o) for o in watched]
    for _ in range(200):
        result = compactor._accelerated(list(events))
        assert result is not None
        del result
    assert [sys.getrefcount(o) for o in watched] == counts


# --- the window driver (compact_window): rule 1 and each group's rules in one call ---


class OtherBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """A second batch class: other field order, an extra field."""

    events: list[Any]
    ts: float
    data_parallel_rank: int | None = None
    note: str | None = None


class BatchWithPostInit(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        pass


class NotKV(msgspec.Struct, tag="SomethingElse"):
    x: int = 0


@st.composite
def windows(draw: Any, accepted: bool) -> list[Any]:
    """Batches of both batch classes and ranks, each with a slice of one event list;
    unless ``accepted``, with now and then a batch the C driver declines."""
    events: list[Any] = draw(event_lists(ints))
    out: list[Any] = []
    i = 0
    while i < len(events) or (not out and draw(st.booleans())):
        n = draw(st.integers(0, 5))
        part, i = events[i : i + n], i + n
        rank = draw(st.sampled_from([0, 0, 0, 1, None, 2**70]))
        kind = draw(st.sampled_from(["kv", "kv", "kv", "other"] + ([] if accepted else ["odd"])))
        ts = float(len(out))
        if kind == "kv":
            out.append(KVEventBatch(ts=ts, events=part, data_parallel_rank=rank))
        elif kind == "other":
            out.append(OtherBatch(part, ts, rank))
        else:
            odd = draw(st.sampled_from(["not kv", "post_init", "tuple", "rank"]))
            if odd == "not kv":
                out.append(KVEventBatch(ts=ts, events=[*part, NotKV()], data_parallel_rank=rank))
            elif odd == "post_init":
                out.append(BatchWithPostInit(ts, part, rank))
            elif odd == "tuple":
                out.append(KVEventBatch(ts=ts, events=tuple(part)))  # type: ignore[arg-type]
            else:
                out.append(KVEventBatch(ts=ts, events=part, data_parallel_rank="0"))  # type: ignore[arg-type]
    return out


def assert_window_same(batches: list[Any], fold_only: bool) -> None:
    before = copy.deepcopy(batches)
    out_c, rep_c = compactor.compact(list(batches), fold_only=fold_only)
    accel, compactor._accel = compactor._accel, None
    try:
        out_py, rep_py = compactor.compact(list(batches), fold_only=fold_only)
    finally:
        compactor._accel = accel
    assert out_c == out_py
    assert [type(b) for b in out_c] == [type(b) for b in out_py]
    for a, b in zip(out_c, out_py, strict=True):
        assert [type(e) for e in a.events] == [type(e) for e in b.events]
        assert (a is b) == any(a is x for x in batches), "the same batch where nothing changed"
    assert rep_c == rep_py
    assert batches == before, "the accelerator must never modify its input"


@given(windows(accepted=True), st.booleans())
def test_windows_match_the_python_driver(batches: list[Any], fold_only: bool) -> None:
    assert compactor._accelerated_window(list(batches), fold_only) is not None
    assert_window_same(batches, fold_only)


@given(windows(accepted=False), st.booleans())
def test_declined_windows_match_the_python_driver(batches: list[Any], fold_only: bool) -> None:
    assert_window_same(batches, fold_only)


def test_windows_of_declined_batches_are_declined() -> None:
    ok = KVEventBatch(ts=0.0, events=[BlockRemoved([1], "GPU")])
    compactor.compact([ok, ok])
    for odd in (
        KVEventBatch(ts=1.0, events=[NotKV()]),
        BatchWithPostInit(1.0, [BlockRemoved([2], "GPU")]),
        KVEventBatch(ts=1.0, events=(BlockRemoved([2], "GPU"),)),  # type: ignore[arg-type]
        KVEventBatch(ts=1.0, events=[], data_parallel_rank=1.5),  # type: ignore[arg-type]
    ):
        for fold_only in (False, True):
            assert compactor._accelerated_window([ok, odd, ok], fold_only) is None
            assert_window_same([ok, odd, ok], fold_only)


def test_the_window_driver_leaks_no_references() -> None:
    events = [
        BlockStored([10, 11], None, [1, 2, 3, 4], BLOCK, None, "GPU", None),
        BlockRemoved([10], "GPU"),
        BlockStored([12], 11, [5, 6], BLOCK, None, "GPU", None),
    ]
    batches = [KVEventBatch(ts=float(i), events=[e]) for i, e in enumerate(events)]
    batches.append(KVEventBatch(ts=9.0, events=[BlockRemoved([99], "CPU")], data_parallel_rank=1))
    watched = [*events, *batches, *(b.events for b in batches), *(b.ts for b in batches)]
    counts = [sys.getrefcount(o) for o in watched]
    for fold_only in (False, True) * 100:
        result = compactor._accelerated_window(list(batches), fold_only)
        assert result is not None and len(result) == 9
        del result
    assert [sys.getrefcount(o) for o in watched] == counts


def test_is_kv_batch_answered_in_c_only_for_known_classes() -> None:
    batch = KVEventBatch(ts=0.0, events=[BlockRemoved([1], "GPU")])
    compactor.compact([batch, batch])  # registers the class
    assert compactor._accel is not None
    assert compactor._accel.all_known(batch.events) is True

    class Unknown(msgspec.Struct, tag="SomethingElse"):
        x: int = 0

    assert compactor._accel.all_known([Unknown()]) is None
    assert not compactor._is_kv_batch(KVEventBatch(ts=0.0, events=[Unknown()]))


def test_fold_only_offers_new_classes_to_the_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fold-only level never runs the rules, which used to be what registered a
    class: its batches were then classified in Python, batch after batch."""
    monkeypatch.setattr(compactor, "_offered", set())
    cls = msgspec.defstruct(
        "FoldOnlyRemoved", [("block_hashes", list), ("medium", Any)], tag="BlockRemoved"
    )
    batch = KVEventBatch(ts=0.0, events=[cls([1], "GPU"), cls([2], "GPU")])
    assert compactor._accel is not None
    assert compactor._accel.all_known(batch.events) is None  # not seen yet
    out, report = compactor.compact([batch, batch], fold_only=True)
    assert report.folded == 1 and len(out[0].events) == 4
    assert compactor._accel.all_known(batch.events) is True
    assert cls in compactor._offered

    class Unknown(msgspec.Struct, tag="SomethingElse"):
        x: int = 0

    odd = KVEventBatch(ts=0.0, events=[Unknown()])
    assert not compactor._is_kv_batch(odd) and not compactor._is_kv_batch(odd)
    assert Unknown in compactor._offered  # offered once, refused, answered in Python


def test_offers_stop_at_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream of ever-new classes does not grow the set of offered classes."""
    monkeypatch.setattr(compactor, "_offered", set())
    monkeypatch.setattr(compactor, "_OFFER_LIMIT", 3)
    for i in range(10):
        cls = msgspec.defstruct(f"Fresh{i}", [("x", int)], tag=f"Fresh{i}")
        assert not compactor._is_kv_batch(KVEventBatch(ts=0.0, events=[cls(1)]))
    assert len(compactor._offered) == 3


def test_more_classes_than_the_accelerator_holds_still_compact() -> None:
    """Its table of classes is bounded; past it, windows go to the Python rules
    (this test runs last in the file: the table stays full for the session)."""
    for i in range(40):
        cls = msgspec.defstruct(
            f"Removed{i}", [("block_hashes", list), ("medium", Any)], tag="BlockRemoved"
        )
        events = [cls([1], "GPU"), cls([2], "GPU")]
        want = _rules.compact_events(list(events), False, Counter())
        assert compactor._compact_events(list(events), False, Counter()) == want
        assert len(want) == 1  # the two removals merged


# -- compact_for_wire: merged lists written as their encoding ------------------------

TOKEN_VALUES = st.one_of(
    st.integers(0, 300),
    st.sampled_from([-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1]),
    st.sampled_from([-(2**63), 2**16 - 1, 2**16, 2**32 - 1, 2**32, 2**63, BIG]),
)
WIRE_HASHES = st.one_of(
    st.integers(0, BIG),
    st.binary(min_size=0, max_size=40),
    st.sampled_from([b"\x07" * 255, b"\x08" * 256, b"\x09" * 70_000]),
)


@st.composite
def chains(draw: Any) -> list[Any]:
    """Windows of stores chained parent to child (long merged lists, of every msgpack
    int and bin width), some removed again, in one or more batches."""
    events: list[Any] = []
    parent: Any = None
    used: list[Any] = []
    for _ in range(draw(st.integers(1, 12))):
        hs = draw(st.lists(WIRE_HASHES, min_size=1, max_size=40, unique=True))
        if any(h in used for h in hs):
            continue
        used += hs
        tokens = draw(st.lists(TOKEN_VALUES, min_size=BLOCK * len(hs), max_size=BLOCK * len(hs)))
        if draw(st.booleans()):
            tokens = []
        events.append(BlockStored(hs, parent, tokens, BLOCK, None, "GPU", None))
        parent = hs[-1]
        if draw(st.integers(0, 4)) == 0:
            events.append(BlockRemoved([draw(st.sampled_from(used))], "GPU"))
    cuts = sorted(draw(st.lists(st.integers(0, len(events)), max_size=3)))
    bounds = [0, *cuts, len(events)]
    return [
        KVEventBatch(ts=float(i), events=events[a:b])
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


def assert_wire_same(batches: list[Any], fold_only: bool = False) -> int:
    """compact_for_wire encodes as compact does; returns how many Raw lists it made."""
    enc = msgspec.msgpack.Encoder()
    before = copy.deepcopy(batches)
    out, rep = compactor.compact(list(batches), fold_only=fold_only)
    wire, rep_w = compactor.compact_for_wire(list(batches), fold_only=fold_only)
    assert rep_w == rep
    assert [type(b) for b in wire] == [type(b) for b in out]

    def encoded(b: Any) -> bytes | type:
        try:
            return enc.encode(b)
        except Exception as exc:  # a rank of 2**70, say: refused either way
            return type(exc)

    assert [encoded(b) for b in wire] == [encoded(b) for b in out]
    assert batches == before, "the accelerator must never modify its input"
    return sum(
        isinstance(getattr(e, f, None), msgspec.Raw)
        for b in wire
        for e in b.events
        for f in ("block_hashes", "token_ids")
    )


@given(chains(), st.booleans())
def test_wire_windows_encode_as_compact_does(batches: list[Any], fold_only: bool) -> None:
    assert_wire_same(batches, fold_only)


@given(windows(accepted=False), st.booleans())
def test_wire_windows_of_every_kind_encode_as_compact_does(
    batches: list[Any], fold_only: bool
) -> None:
    assert_wire_same(batches, fold_only)


def test_wire_writes_long_merged_lists_as_raw_and_short_ones_as_lists() -> None:
    long_chain = [
        BlockStored([2 * i, 2 * i + 1], 2 * i - 1 if i else None, [i] * 4, BLOCK, None, "GPU", None)
        for i in range(40)
    ]
    assert assert_wire_same([KVEventBatch(ts=0.0, events=long_chain)]) == 2  # hashes and tokens
    short = long_chain[:3]  # 6 hashes, 12 tokens: below the Raw threshold
    assert assert_wire_same([KVEventBatch(ts=0.0, events=short)]) == 0
    assert assert_wire_same([KVEventBatch(ts=0.0, events=offload_run(200))]) > 0


def test_wire_leaves_what_msgspec_refuses_to_msgspec() -> None:
    chain = [
        BlockStored([i], i - 1 if i else None, [2**64, 1], BLOCK, None, "GPU", None)
        for i in range(40)
    ]
    out, _ = compactor.compact([KVEventBatch(ts=0.0, events=chain)])
    wire, _ = compactor.compact_for_wire([KVEventBatch(ts=0.0, events=chain)])
    assert isinstance(wire[0].events[0].token_ids, list)  # built as a list: msgspec decides
    enc = msgspec.msgpack.Encoder()
    for b in (out[0], wire[0]):
        with pytest.raises(OverflowError):
            enc.encode(b)


def test_wire_leaks_no_references() -> None:
    # (ints past the small-int cache, whose counts other code moves)
    chain = [
        BlockStored(
            [1000 + 2 * i, 1001 + 2 * i],
            999 + 2 * i if i else None,
            [5000 + i, -5000 - i, 2**40 + i, 2**63 + i],
            BLOCK,
            None,
            "GPU",
            None,
        )
        for i in range(40)
    ]
    batches = [KVEventBatch(ts=0.0, events=chain[:20]), KVEventBatch(ts=1.0, events=chain[20:])]
    watched = [*chain, *(e.block_hashes for e in chain), *(e.token_ids for e in chain)]
    watched += [x for e in chain for x in (*e.block_hashes, *e.token_ids)]
    counts = [sys.getrefcount(o) for o in watched]
    for _ in range(100):
        wire, _ = compactor.compact_for_wire(list(batches))
        del wire
    assert [sys.getrefcount(o) for o in watched] == counts


# --- the C results, by name -------------------------------------------------------


def test_the_c_results_name_report_fields() -> None:
    """Every count the C returns is named as the CompactionReport field it fills."""
    import dataclasses

    from coalesce import _ccompact

    report = {f.name for f in dataclasses.fields(compactor.CompactionReport)}
    window = _ccompact.WindowResult.__match_args__  # type: ignore[attr-defined]
    group = _ccompact.GroupResult.__match_args__  # type: ignore[attr-defined]
    assert window[0] == "batches" and set(window[1:]) <= report
    assert group[0] == "events" and set(group[1:]) <= report
    assert set(group[1:]) <= set(window[1:])


def test_each_count_lands_in_its_own_field() -> None:
    """A window whose counts all differ: a swap of two would show."""

    def store(h: int, parent: int | None, medium: str = "GPU") -> BlockStored:
        return BlockStored([h], parent, [h] * BLOCK, BLOCK, None, medium, None)

    events: list[Any] = [store(1, None), store(2, 1), BlockRemoved([2], "GPU"), AllBlocksCleared()]
    events += [store(10 + i, 9 + i if i else None) for i in range(6)]  # a chain
    events += [BlockRemoved([20], "GPU"), store(20, None), BlockRemoved([20], "GPU")]
    events += [BlockRemoved([30 + i], "GPU") for i in range(7)]
    batches = [KVEventBatch(ts=float(i), events=[e]) for i, e in enumerate(events)]
    batches[-1].events.append(store(40, None, "CPU"))  # (events_in > batches_in)
    assert compactor._accelerated_window(list(batches), False) is not None
    report = compactor.compact(list(batches))[1]
    assert_window_same(batches, False)  # the same report as the pure-Python rules'
    counts = [getattr(report, f) for f in ("events_in", "events_out", "folded", "merged")]
    counts += [report.cancelled, report.superseded, report.batches_in]
    assert 0 not in counts and len(set(counts)) == len(counts), report


def test_the_counts_are_picked_by_name() -> None:
    """Whatever order the C's fields come in, each count fills the field of its name."""
    names = ("merged", "batches", "superseded", "folded", "batches_out", "events_out")
    names += ("cancelled", "batches_in", "events_in")
    result = tuple(range(len(names)))  # each field holds its own index
    report = compactor.CompactionReport(*compactor._counts_picker(names)(result))
    for i, name in enumerate(names):
        if name != "batches":
            assert getattr(report, name) == i, name
    assert report.moved == 0
    with pytest.raises(RuntimeError):
        compactor._counts_picker(("batches", "batches_in", "moved"))  # not the first fields
