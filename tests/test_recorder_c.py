"""The recorder's C state against its oracle, the pure-Python recorder.

Random streams with every kind of hash a real stream may carry (64-bit ints,
ints outside [0, 2**64), bytes, str), several scopes (medium, group,
locality), stores with and without tokens and parents, moves, clears and
events of other class families are fed to both; after every batch the two
must hold the same state (source ids renumbered in recorded order), the same
counters, and write the same program.  Then the C state's own promises: the
fall back to Python on a hash it does not take, memory bounded by what is
held, a walk that sees the state change, the GIL released for big batches.
"""

from __future__ import annotations

import gc
import itertools
import sys
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce import _layout, _recorder
from coalesce._recorder import Recorder
from coalesce.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored, KVEventBatch
from tests.test_accel import chains

_crecord = _recorder._accel
pytestmark = pytest.mark.skipif(_crecord is None, reason="the C recorder is not built")


# A second family, shaped like another library's: other field order, an extra field,
# no locality or ownership (read as None).
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
    group_idx: int | None = None


class OtherRemoved(_Event, tag="BlockRemoved"):
    note: str | None
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


HASHES = [0, 1, 2, 7, 2**63 + 5, 2**64 - 1, 2**64 - 3, 2**64, 2**70 + 1, -3, -1, -(2**63)]
HASHES += [-(2**63) - 1, b"\x00ab", b"cd", "s1"]
"""u64 ints; negative ints, which the C state keys by their two's complement, apart
from the u64 of the same bits (-1 and 2**64 - 1, -3 and 2**64 - 3); ints it interns
(past 2**64, below -2**63); bytes and str."""
hashes = st.sampled_from(HASHES)
media = st.sampled_from(("GPU", "CPU"))
groups = st.sampled_from((None, None, 1))
localities = st.sampled_from((None, None, "rack1"))
ownerships = st.sampled_from((None, None, "pool-a"))


ODD = [1.5, (1, 2)]
"""Hashes the C state does not take: the state moves to Python until a clear."""


@st.composite
def events(draw: Any, odd: bool = False) -> Any:
    kind = draw(st.sampled_from(("store", "store", "store", "remove", "remove", "move", "clear")))
    pool = st.sampled_from(HASHES + ODD) if odd and draw(st.integers(0, 9)) == 0 else hashes
    hs = draw(st.lists(pool, min_size=0, max_size=4))
    parent = draw(st.one_of(st.none(), hashes))
    tokens = list(range(2 * len(hs))) if draw(st.booleans()) else []
    other = draw(st.integers(0, 5)) == 0
    if kind == "store":
        if other:
            return OtherStored(
                medium=draw(media),
                block_hashes=hs,
                block_size=2,
                parent_block_hash=parent,
                token_ids=tokens,
                group_idx=draw(groups),
            )
        return BlockStored(
            block_hashes=hs,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=2,
            lora_id=None,
            medium=draw(media),
            lora_name=None,
            group_idx=draw(groups),
            locality=draw(localities),
            ownership=draw(ownerships),
        )
    if kind == "remove":
        if other:
            return OtherRemoved(
                note="x", block_hashes=hs, medium=draw(media), group_idx=draw(groups)
            )
        return BlockRemoved(
            block_hashes=hs,
            medium=draw(media),
            group_idx=draw(groups),
            locality=draw(localities),
            ownership=draw(ownerships),
        )
    if kind == "move":
        return BlockMoved(
            block_hashes=hs,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=2,
            lora_id=None,
            from_medium="GPU",
            to_medium="CPU",
            lora_name=None,
            group_idx=draw(groups),
        )
    return AllBlocksCleared()


@st.composite
def streams(draw: Any, odd: bool = False) -> list[Any]:
    evs = draw(st.lists(events(odd), max_size=40))
    out, i = [], 0
    while i < len(evs):
        n = draw(st.integers(1, 6))
        out.append(KVEventBatch(ts=float(i), events=evs[i : i + n], data_parallel_rank=0))
        i += n
    return out


def _program(rec: Recorder) -> list[Any]:
    return [ev for chunk in rec.chunks() for ev in chunk]


def _same(c: Recorder, py: Recorder, batches: list[Any] = ()) -> None:  # type: ignore[assignment]
    assert c.export() == py.export()
    assert (c.valid, c.held, c.retained) == (py.valid, py.held, py.retained)
    assert c.state() == py.state()
    chunks_c, chunks_py = list(c.chunks()), list(py.chunks())
    assert chunks_c == chunks_py, "the same events in the same chunks"
    recorded = {id(e) for b in batches for e in b.events}
    for a, b in zip(_flat(chunks_c), _flat(chunks_py), strict=True):
        if id(a) in recorded or id(b) in recorded:
            assert a is b, "the very same recorded stores (a move's store is built anew)"


def _flat(chunks: list[list[Any]]) -> list[Any]:
    return [e for ch in chunks for e in ch]


@settings(max_examples=500, deadline=None)
@given(streams(), st.sampled_from([10_000, 6]))
def test_the_c_state_is_the_python_state_for_every_hash_kind(batches, max_blocks):
    c = Recorder(max_blocks, accelerated=True)
    py = Recorder(max_blocks, accelerated=False)
    for b in batches:
        c.record(b)
        py.record(b)
        c.check()
        assert c._cmode, "ints, bytes and str are all read in C"
        _same(c, py, batches)


@settings(max_examples=300, deadline=None)
@given(streams(odd=True), st.sampled_from([10_000, 6]), st.data())
def test_a_list_of_batches_in_one_call_is_each_batch_recorded(batches, max_blocks, data):
    """record_many (one C call for a list), with hashes now and then that send the
    state to Python, and a budget that may be passed: the same as record()."""
    c = Recorder(max_blocks, accelerated=True)
    py = Recorder(max_blocks, accelerated=False)
    i = 0
    while i < len(batches):
        n = data.draw(st.integers(1, 5), label="list")
        c.record_many(batches[i : i + n])
        for b in batches[i : i + n]:
            py.record(b)
        i += n
        c.check()
        _same(c, py, batches)
        assert (c.batches, c.events, c.invalidations) == (py.batches, py.events, py.invalidations)


def test_a_removal_of_a_scope_interned_later_in_the_same_call_is_applied():
    def store(group: Any) -> BlockStored:
        return BlockStored(
            block_hashes=[0],
            parent_block_hash=None,
            token_ids=[],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=group,
        )

    gone = BlockRemoved(block_hashes=[0], medium="GPU", group_idx=1)
    batch = KVEventBatch(ts=0.0, events=[store(None), gone, store(1), gone], data_parallel_rank=0)
    rec = Recorder(100, accelerated=True)
    rec.record(batch)
    assert rec.state() == {("GPU", None, 0): 1}


@pytest.mark.parametrize("odd", [1.5, True, (1, 2), frozenset({3})], ids=repr)
def test_a_hash_the_c_state_does_not_take_moves_the_state_to_python_until_a_clear(odd):
    def store(hs: list[Any], parent: Any = None) -> BlockStored:
        return BlockStored(
            block_hashes=hs,
            parent_block_hash=parent,
            token_ids=[1] * len(hs),
            block_size=1,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )

    first = KVEventBatch(ts=0.0, events=[store([1, b"x"]), store([2], 1)], data_parallel_rank=0)
    odd_batch = KVEventBatch(ts=1.0, events=[store([odd], 2), store([3], 2)], data_parallel_rank=0)
    cleared = KVEventBatch(ts=2.0, events=[AllBlocksCleared(), store([4])], data_parallel_rank=0)
    c, py = Recorder(100, accelerated=True), Recorder(100, accelerated=False)
    for b in (first, odd_batch):
        c.record(b)
        py.record(b)
        c.check()
        _same(c, py, [first, odd_batch])
    assert not c._cmode and c.valid, "the Python loop holds it now, exact"
    for b in (cleared,):
        c.record(b)
        py.record(b)
        _same(c, py, [first, odd_batch, cleared])
    assert c._cmode, "back in C after the clear"


def test_an_unhashable_hash_in_c_makes_it_unavailable_as_in_python():
    bad = KVEventBatch(
        ts=0.0,
        events=[
            BlockStored(
                block_hashes=[[1]],
                parent_block_hash=None,
                token_ids=[],
                block_size=1,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
        data_parallel_rank=0,
    )
    rec = Recorder(100, accelerated=True)
    rec.record(bad)
    assert not rec.valid and "cannot interpret" in rec.reason
    rec.record(KVEventBatch(ts=1.0, events=[AllBlocksCleared()], data_parallel_rank=0))
    assert rec.valid and rec._cmode


def _cancelling(i: int, n: int, kind: str) -> KVEventBatch:
    hs: list[Any] = [(i * n + j) * 2654435761 % 2**64 for j in range(n)]
    if kind == "bytes":
        hs = [h.to_bytes(8, "big") for h in hs]
    elif kind == "big":
        hs = [h + 2**64 for h in hs]
    store = BlockStored(
        block_hashes=hs,
        parent_block_hash=None,
        token_ids=list(range(n)),
        block_size=1,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return KVEventBatch(
        ts=float(i),
        events=[store, BlockRemoved(block_hashes=list(hs), medium="GPU")],
        data_parallel_rank=0,
    )


@pytest.mark.parametrize("kind", ["u64", "bytes", "big"])
def test_memory_is_bounded_by_what_is_held_not_by_events(kind):
    """Batches that cancel out (as refused batches under overload may) leave the C
    state as small as it was, interned hashes included, and hold no event."""
    rec = Recorder(10**6, accelerated=True)
    held = Recorder(10**6, accelerated=True)
    for i in range(50):  # a state that stays: 50 x 64 blocks
        held.record(_kept(10**6 + i, kind))
    base = held._cs.nbytes
    probe = _cancelling(0, 64, kind)
    first = probe.events[0]
    refs = sys.getrefcount(first)
    for i in range(2_000):
        b = _cancelling(i, 64, kind) if i else probe
        rec.record(b)
        held.record(b)
    gc.collect()
    assert rec.held == rec.retained == 0 and rec.valid
    assert rec._cs.nbytes <= 64 * 1024, "the table shrinks back"
    assert held._cs.nbytes <= 2 * base + 64 * 1024, "only what is held"
    now = sys.getrefcount(first)  # (outside the assert: pytest keeps its operands)
    assert now == refs, "a dropped store's event is released"
    assert held.held == 50 * 64


def _kept(i: int, kind: str) -> KVEventBatch:
    b = _cancelling(i, 64, kind)
    return KVEventBatch(ts=b.ts, events=b.events[:1], data_parallel_rank=0)


def test_a_walk_of_a_state_that_changed_raises():
    rec = Recorder(10**6, accelerated=True)
    for i in range(600):
        rec.record(_kept(i, "u64"))
    chunks = rec.chunks()
    assert next(chunks)
    rec._cs.record(_cancelling(10**5, 1, "u64").events, 0)
    with pytest.raises(RuntimeError, match="changed"):
        next(chunks)


def test_batches_of_128_hashes_or_more_are_applied_with_the_gil_released():
    rec = Recorder(10**6, accelerated=True)
    before = _crecord.gil_releases()
    rec.record(_cancelling(1, 63, "u64"))  # 126 hashes: a store's and a removal's
    assert _crecord.gil_releases() == before
    rec.record(_cancelling(2, 64, "u64"))
    assert _crecord.gil_releases() == before + 1
    rec.record(_cancelling(3, 8192, "u64"))
    assert _crecord.gil_releases() == before + 2
    assert rec.held == 0 and rec.valid


@pytest.mark.parametrize("kind", ["u64", "bytes"])
def test_a_clear_of_a_big_state_releases_it_a_slice_a_call(kind):
    """An AllBlocksCleared forgets the state at once, but its events (and interned
    hashes) go to a graveyard released a bounded slice per later call (the GIL is
    not held for O(state) at once); a call's slice is at least twice its own work,
    so the graveyard drains as the stream goes on, and a dropped recorder releases
    what is left."""
    rec = Recorder(10**7, accelerated=True)
    for i in range(1000):  # 1,000 sources of 64 blocks and 64 tokens: ~130k objects
        rec.record(_kept(10**6 + i, kind))
    moved = 1000 + (64 * 1000 + 1 if kind == "bytes" else 0)  # events, interned hashes, dict
    probe = rec._cs.export()[1][0][0]  # the first kept store event
    refs = sys.getrefcount(probe)
    rec.record(KVEventBatch(ts=0.0, events=[AllBlocksCleared()], data_parallel_rank=0))
    assert rec.held == 0 and rec.valid and rec._cs.sources == 0, "forgotten at once"
    left = [rec._cs.graveyard]
    assert 0 < left[0] < moved, "released a slice, not the whole"
    for i in range(moved):  # small batches: each releases a slice
        if not rec._cs.graveyard:
            break
        rec.record(_cancelling(i, 1, "u64"))
        left.append(rec._cs.graveyard)
    assert left[-1] == 0 and all(a > b for a, b in itertools.pairwise(left))
    gc.collect()
    now = sys.getrefcount(probe)
    assert now == refs - 1, "every forgotten event is released"
    again = Recorder(10**7, accelerated=True)
    for i in range(400):
        again.record(_kept(10**6 + i, kind))
    again._cs.clear()
    assert again._cs.graveyard > 0
    assert again._cs.sweep(-1) == 0
    again._cs.clear()
    del again  # (a graveyard left at the end is released with the state)


def test_the_layout_check_covers_the_recorder():
    assert _layout.layout_problem(_crecord) is None


def test_a_class_with_a_field_that_is_not_a_slot_is_applied_in_python():
    class Plain:  # a BlockStored-tagged class whose fields are properties
        __struct_config__ = BlockStored.__struct_config__
        block_hashes = property(lambda self: [5])
        parent_block_hash = None
        token_ids = property(lambda self: [1])
        medium = "GPU"

    rec = Recorder(100, accelerated=True)
    rec.record(KVEventBatch(ts=0.0, events=[Plain()], data_parallel_rank=0))
    assert rec.valid and rec.state() == {("GPU", None, 5): 1}


# -- compact_for_wire's results: merged lists as msgspec.Raw ------------------------


def _wire_and_objects(batches: list[Any], fold_only: bool = False) -> tuple[list[Any], list[Any]]:
    from coalesce import compactor

    wire, _ = compactor.compact_for_wire(list(batches), fold_only=fold_only)
    out, _ = compactor.compact(list(batches), fold_only=fold_only)
    return wire, out


def _same_encoded(a: Recorder, b: Recorder) -> None:
    enc = msgspec.msgpack.Encoder()
    assert a.export() == b.export()
    assert (a.valid, a.held, a.retained) == (b.valid, b.held, b.retained)
    assert [enc.encode(ch) for ch in a.chunks()] == [enc.encode(ch) for ch in b.chunks()]


RAW_HASHES = st.one_of(
    st.integers(0, 2**64 - 1),
    st.sampled_from([0, 127, 128, 255, 256, 2**16 - 1, 2**16, 2**32 - 1, 2**32, 2**64 - 1]),
    st.sampled_from([-1, -32, -33, -128, -129, -32768, -32769, -(2**31) - 1, -(2**63)]),
    st.binary(max_size=300),
)


@st.composite
def long_chains(draw: Any) -> list[Any]:
    """Chains long enough that compact_for_wire writes their merged hash lists as
    Raw (32 hashes or more), of every msgpack int and bin width, some hashes
    removed again, in a medium or two, cut into batches."""
    events: list[Any] = []
    for medium in draw(st.sampled_from((["GPU"], ["GPU", "CPU"]))):
        hs = draw(st.lists(RAW_HASHES, min_size=32, max_size=80, unique=True))
        tokens = draw(st.booleans())
        parent: Any = draw(st.one_of(st.none(), RAW_HASHES))
        i = 0
        while i < len(hs):
            n = draw(st.integers(1, 8))
            run = hs[i : i + n]
            toks = [j for j in range(2 * len(run))] if tokens else []
            events.append(BlockStored(run, parent, toks, 2, None, medium, None))
            parent, i = run[-1], i + n
        for h in draw(st.lists(st.sampled_from(hs), max_size=4)):
            events.append(BlockRemoved([h], medium))
    cuts = sorted(draw(st.lists(st.integers(0, len(events)), max_size=2)))
    bounds = [0, *cuts, len(events)]
    return [
        KVEventBatch(ts=float(i), events=events[a:b])
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


@settings(max_examples=300, deadline=None)
@given(st.one_of(chains(), long_chains()), st.booleans())
def test_compact_for_wire_results_are_recorded_as_compact_results(batches, fold_only):
    """The sender compacts with compact_for_wire with a recorder too: a merged hash or
    token list is a msgspec.Raw of its encoding (every msgpack int and bin width).
    The C state reads it in C, and the Python loop as a list: both end as recording
    compact()'s results, with the same program on the wire."""
    wire, out = _wire_and_objects(batches, fold_only)
    c = Recorder(10**6, accelerated=True)
    py_wire, py = Recorder(10**6, accelerated=False), Recorder(10**6, accelerated=False)
    for bw, bo in zip(wire, out, strict=True):
        c.record(bw)
        py_wire.record(bw)
        py.record(bo)
        c.check()
        assert c._cmode, "Raw lists are read in C"
        _same_encoded(c, py)
        _same_encoded(py_wire, py)


def test_raw_lists_recorded_in_c_are_lists_once_the_state_moves_to_python():
    chain = [
        BlockStored(
            [2 * i, 2**63 + i],
            2**63 + i - 1 if i else None,
            [i, -i, 2**40, 7],
            2,
            None,
            "GPU",
            None,
        )
        for i in range(40)
    ]
    chain += [
        BlockStored([b"b%d" % i, -5 - i], None, [1] * 4, 2, None, "CPU", None) for i in range(20)
    ]
    for i in range(1, 20):
        chain[40 + i].parent_block_hash = -5 - (i - 1)
    wire, out = _wire_and_objects([KVEventBatch(ts=0.0, events=chain)])
    raw = [
        type(getattr(e, f)) is msgspec.Raw
        for e in wire[0].events
        for f in ("block_hashes", "token_ids")
    ]
    assert sum(raw) >= 4, "both chains' hash and token lists are Raw"
    c, py = Recorder(10**6, accelerated=True), Recorder(10**6, accelerated=False)
    c.record(wire[0])
    py.record(out[0])
    assert c._cmode
    _same_encoded(c, py)
    odd = KVEventBatch(ts=1.0, events=[BlockStored([1.5], 2, [], 2, None, "GPU", None)])
    c.record(odd)
    py.record(odd)
    assert not c._cmode and c.valid, "the Python loop holds it now"
    c.check()
    _same_encoded(c, py)
    lists = [e for ch in c.chunks() for e in ch if isinstance(e, BlockStored)]
    assert all(type(e.block_hashes) is list and type(e.token_ids) is list for e in lists)


def test_a_raw_hash_list_in_any_int_form_is_read_as_its_ints():
    """A Raw list written otherwise than msgspec writes (a non-negative int in a signed
    form, a small one in a wide form) holds the same ints: read as plain keys, as
    the Python loop reads the decoded list."""
    hashes = msgspec.Raw(
        b"\x95\xd0\x05\xd3"
        + (2**40).to_bytes(8, "big")
        + b"\xcf"
        + (7).to_bytes(8, "big")
        + b"\xd0\xfb\xc4\x01z"
    )
    assert msgspec.msgpack.decode(hashes) == [5, 2**40, 7, -5, b"z"]
    store = BlockStored(hashes, None, [], 2, None, "GPU", None)
    removal = BlockRemoved([5, 7, -5, b"z"], "GPU")
    c, py = Recorder(100, accelerated=True), Recorder(100, accelerated=False)
    for b in (
        KVEventBatch(ts=0.0, events=[store]),
        KVEventBatch(ts=1.0, events=[removal]),
    ):
        c.record(b)
        py.record(b)
        assert c._cmode
        c.check()
        assert c.export() == py.export() and c.state() == py.state()
        assert [_decoded(ch) for ch in c.chunks()] == [_decoded(ch) for ch in py.chunks()]
    assert c.state() == {("GPU", None, 2**40): 1}


def _decoded(chunk: list[Any]) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(chunk))


@pytest.mark.parametrize("fused", [False, True, "events"])
def test_a_kept_stores_lists_of_ints_leave_the_cyclic_gc(fused: bool | str) -> None:
    """The C state keeps every store whole, so a million kept blocks would be two
    million lists that each full collection of the engine's process walks: a kept
    store's hash and token lists of exact ints are untracked (no cycle can pass
    through them).  A list holding anything else, and a removal's list, are left
    as they are.  The fused path keeps a store as its bytes, not the event: it
    holds none of them, and leaves the GC's bookkeeping alone; set to keep events
    (``set_encoded_max``: stores past a size), it untracks them as ``record()`` does."""
    rec = Recorder(100, accelerated=True)
    hashes, tokens, odd = [1, 2], [5, 6, 7, 8], [5, 6.0]
    gone = [3]
    events: list[Any] = [
        BlockStored(hashes, None, tokens, 4, None, "GPU", None),
        BlockStored([9], None, odd, 2, None, "GPU", None),
        BlockRemoved(gone, "GPU"),
    ]
    assert all(gc.is_tracked(x) for x in (hashes, tokens, odd, gone))
    batch = KVEventBatch(ts=0.0, events=events)
    before = [sys.getrefcount(x) for x in (*events, hashes, tokens)]
    if fused == "events":
        was = _recorder._accel.set_encoded_max(16)  # (every store here is larger)
        try:
            assert rec.encode(batch) is not None
        finally:
            _recorder._accel.set_encoded_max(was)
    elif fused:
        assert rec.encode(batch) is not None
    else:
        rec.record(batch)
    assert rec.held == 3
    if fused is True:
        assert [sys.getrefcount(x) for x in (*events, hashes, tokens)] == before
        assert all(gc.is_tracked(x) for x in (hashes, tokens, odd, gone))
    else:
        assert not gc.is_tracked(hashes) and not gc.is_tracked(tokens)
        assert gc.is_tracked(odd) and gc.is_tracked(gone)
    assert tokens == [5, 6, 7, 8] and hashes == [1, 2]  # (only the GC's bookkeeping changed)
