"""The snapshot recorder alone: its state and its replay program against the reference models.

Every test runs with the recorder's loop in Python (the oracle) and in C
(coalesce/_crecord.c) where it is built; one compares the two states whole.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce import _recorder, compact
from coalesce._env import NO_ACCEL, switched_on
from coalesce._recorder import CHUNK_EVENTS, MAX_ID, NEXT, REMOVED_PER_EVENT, Recorder
from coalesce.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored, KVEventBatch
from coalesce.refmodel import SubscriberModel
from tests.streams import (
    BLOCK,
    CHAINS,
    DEPTH,
    GROUP_CHOICE,
    MEDIA,
    batch_lists,
    hash_values,
    hashes_from,
    parent_of,
)

IMPLS = ["py", "c"] if _recorder._accel is not None else ["py"]


def test_the_c_loop_is_built_where_it_is_required():
    if os.environ.get("COALESCE_REQUIRE_ACCEL") and not switched_on(NO_ACCEL):
        assert _recorder._accel is not None, (
            "coalesce/_crecord.c was not built, and COALESCE_REQUIRE_ACCEL is set"
        )
    assert Recorder(1, accelerated=False).accelerated is False


_current = {"accelerated": False}


@pytest.fixture(params=IMPLS, autouse=True)
def impl(request: Any) -> Any:
    """Run the test with each loop (``_new`` reads it)."""
    _current["accelerated"] = request.param == "c"
    yield request.param
    _current["accelerated"] = False


def _new(max_blocks: int = 10_000) -> Recorder:
    return Recorder(max_blocks, accelerated=_current["accelerated"])


def _model(mode: Any) -> SubscriberModel:
    return SubscriberModel(mode)


def _snapshot_events(rec: Recorder) -> list[Any]:
    return [ev for chunk in rec.chunks() for ev in chunk]


def _apply(model: SubscriberModel, events: list[Any]) -> SubscriberModel:
    for ev in events:
        model.apply_event(ev)
    return model


def _record(batches: list[Any], max_blocks: int = 10_000) -> Recorder:
    rec = _new(max_blocks)
    for b in batches:
        rec.record(b)
        rec.check()
    return rec


def _closed(batches: list[Any]) -> bool:
    """No store in the stream had a parent missing from its medium and group."""
    return _model("dynamo").apply_batches(batches).dropped_stores == 0


def _closed_only(batches: list[Any]) -> list[Any]:
    """The stream without the stores Dynamo's rule would drop: what vLLM emits."""
    model, out = _model("dynamo"), []
    for b in batches:
        kept = []
        for ev in b.events:
            before = model.dropped_stores
            model.apply_event(ev)
            if model.dropped_stores == before:
                kept.append(ev)
        out.append(KVEventBatch(ts=b.ts, events=kept, data_parallel_rank=0))
    return out


@st.composite
def chained_streams(draw: Any) -> list[Any]:
    """Streams as vLLM emits them: every store's parent is held in its medium and group;
    removals (of parents too) and clears at random."""
    model, batches = _model("dynamo"), []
    for t in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(("store", "store", "store", "remove", "remove", "clear")))
        m, g = draw(st.sampled_from(MEDIA)), draw(GROUP_CHOICE)
        if kind == "store":
            c = draw(st.integers(0, CHAINS - 1))
            frontier = 0
            while frontier < DEPTH and model.counts.get((m, g, c * 100 + frontier), 0) > 0:
                frontier += 1
            d = draw(st.integers(0, min(frontier, DEPTH - 1)))
            hs = hashes_from(c, d, draw(st.integers(1, 3)))
            ev: Any = BlockStored(
                block_hashes=hs,
                parent_block_hash=parent_of(hs[0]),
                token_ids=[h * 10 + i for h in hs for i in range(BLOCK)],
                block_size=BLOCK,
                lora_id=None,
                medium=m,
                lora_name=None,
                group_idx=g,
            )
        elif kind == "remove":
            ev = BlockRemoved(
                block_hashes=draw(st.lists(hash_values, min_size=1, max_size=3)),
                medium=m,
                group_idx=g,
            )
        else:
            ev = AllBlocksCleared()
        model.apply_event(ev)
        batches.append(KVEventBatch(ts=float(t), events=[ev], data_parallel_rank=0))
    return batches


@settings(max_examples=400, deadline=None)
@given(st.one_of(chained_streams(), batch_lists().map(_closed_only)), st.data())
def test_a_parent_checking_subscriber_accepts_the_whole_program(batches, data):
    """Every kept store comes after the stores it depends on."""
    assert _closed(batches)
    cut = data.draw(st.integers(0, len(batches)))
    snap = _snapshot_events(_record(batches[:cut]))
    for mode in ("llmd", "dynamo"):
        model = _apply(_model(mode), snap)
        assert model.dropped_stores == 0, mode
        assert model.state() == _model(mode).apply_batches(batches[:cut]).state()
        model.apply_batches(batches[cut:])
        assert model.state() == _model(mode).apply_batches(batches).state(), mode


@settings(max_examples=400, deadline=None)
@given(batch_lists(), st.data())
def test_program_plus_suffix_is_the_full_stream(batches, data):
    cut = data.draw(st.integers(0, len(batches)))
    rec = _record(batches[:cut])
    snap = _snapshot_events(rec)
    full = _model("refcount").apply_batches(batches)
    assert rec.state() == _model("refcount").apply_batches(batches[:cut]).state()
    resumed = _apply(_model("refcount"), snap).apply_batches(batches[cut:])
    assert resumed.state() == full.state()
    stores = [ev for ev in snap if isinstance(ev, BlockStored)]
    recorded = {id(ev) for b in batches[:cut] for ev in b.events}
    assert all(id(ev) in recorded for ev in stores), "every store is one it recorded, whole"
    first = [i for i, ev in enumerate(snap) if isinstance(ev, BlockRemoved)]
    assert not first or all(isinstance(ev, BlockRemoved) for ev in snap[first[0] :])


@settings(max_examples=200, deadline=None)
@given(batch_lists())
def test_the_compacted_stream_records_the_same_state(batches):
    """The sender records what it sent after compaction: the same refcount state."""
    out, _ = compact(batches)
    assert _record(out).state() == _record(batches).state()


def _fed(batches: list[Any], data: Any) -> Recorder:
    """The recorder as the snapshot service's feed leaves it: ``batches`` given in
    groups of random sizes, gathered in windows of a random size and recorded as
    the compactor's output of each window (0, or a window under ``RECORD_FROM``
    events: as given), then settled."""
    from coalesce._feed import Feed
    from coalesce.testing import policy

    window = data.draw(st.sampled_from([0, 1, 5, 64, 512]), label="RECORD_WINDOW")
    least = data.draw(st.sampled_from([0, 32]), label="RECORD_FROM")
    with policy(RECORD_WINDOW=window, RECORD_FROM=least) as tuned:
        svc = Feed(_new(), max_deferred_events=0, policy=tuned)
        i = 0
        while i < len(batches):
            n = data.draw(st.integers(1, 4), label="group")
            svc.record(batches[i : i + n], compacted=data.draw(st.booleans(), label="as given"))
            svc.recorder.check()
            i += n
        svc.settle()
    return svc.recorder


@settings(max_examples=300, deadline=None)
@given(batch_lists(), st.data())
def test_the_feeds_windows_record_the_same_program(batches, data):
    """Gathered and compacted in windows, or recorded as given: the program, with
    the rest of the stream after it, is the full stream."""
    cut = data.draw(st.integers(0, len(batches)))
    rec = _fed(batches[:cut], data)
    assert rec.state() == _model("refcount").apply_batches(batches[:cut]).state()
    resumed = _apply(_model("refcount"), _snapshot_events(rec)).apply_batches(batches[cut:])
    assert resumed.state() == _model("refcount").apply_batches(batches).state()


@settings(max_examples=300, deadline=None)
@given(st.one_of(chained_streams(), batch_lists().map(_closed_only)), st.data())
def test_a_parent_checking_subscriber_accepts_the_feeds_program(batches, data):
    """Recorded from compacted windows, every kept store still follows its parents."""
    snap = _snapshot_events(_fed(batches, data))
    for mode in ("llmd", "dynamo"):
        model = _apply(_model(mode), snap)
        assert model.dropped_stores == 0, mode
        assert model.state() == _model(mode).apply_batches(batches).state(), mode


def _store(hashes, parent, medium="GPU", tokens=None, **kw):
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=tokens if tokens is not None else [h * 10 + i for h in hashes for i in range(2)],
        block_size=2,
        lora_id=None,
        medium=medium,
        lora_name=None,
        **kw,
    )


def _batch(*events):
    return KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=0)


def test_the_program_is_the_recorded_stores_whole_then_removals():
    s1 = _store([1, 2, 3], None, extra_keys=[None, ("s", 2), None], locality="rack1")
    gone = BlockRemoved(block_hashes=[1, 2], medium="GPU", locality="rack1")
    rec = _record([_batch(s1), _batch(BlockRemoved(block_hashes=[3], medium="GPU")), _batch(gone)])
    assert rec.state() == {("GPU", None, 3): 1}, "a removal in another scope is a no-op"
    stored, removed = _snapshot_events(rec)
    assert stored is s1, "the event as published, never split or rebuilt"
    assert removed.block_hashes == [1, 2] and removed.medium == "GPU"
    assert removed.locality == "rack1", "removals are per scope"
    rec.record(_batch(BlockRemoved(block_hashes=[3], medium="GPU", locality="rack1")))
    rec.check()
    assert rec.held == rec.retained == 0, "the source goes with its last key"


def test_a_removed_parent_stays_for_its_child_and_is_removed_at_the_end():
    s1, s2 = _store([1], None), _store([2], 1)
    rec = _record([_batch(s1), _batch(s2), _batch(BlockRemoved(block_hashes=[1], medium="GPU"))])
    snap = _snapshot_events(rec)
    assert snap[:2] == [s1, s2] and snap[0] is s1
    assert snap[2].block_hashes == [1]
    rec.record(_batch(BlockRemoved(block_hashes=[2], medium="GPU")))
    rec.check()
    assert rec.retained == 0


def test_a_parent_is_taken_from_the_stores_own_medium():
    """Dynamo checks the parent in the store's medium: the GPU store of the parent is
    kept for the GPU child even though a CPU store of that hash came later."""
    gpu1, cpu1, gpu2 = _store([1], None), _store([1], None, "CPU"), _store([2], 1)
    rec = _record(
        [
            _batch(gpu1),
            _batch(cpu1),
            _batch(gpu2),
            _batch(BlockRemoved(block_hashes=[1], medium="GPU")),
        ]
    )
    snap = _snapshot_events(rec)
    assert snap[:3] == [gpu1, cpu1, gpu2]
    model = _apply(_model("dynamo"), snap)
    assert model.dropped_stores == 0
    assert model.state() == {("CPU", None, 1): 1, ("GPU", None, 2): 1}


def test_a_store_without_tokens_keeps_the_store_that_had_them():
    gpu, cpu = _store([1], None), _store([1], None, "CPU", tokens=[])
    rec = _record([_batch(gpu), _batch(cpu), _batch(BlockRemoved(block_hashes=[1], medium="GPU"))])
    snap = _snapshot_events(rec)
    assert snap[:2] == [gpu, cpu] and snap[0] is gpu
    assert _apply(_model("refcount"), snap).state() == {("CPU", None, 1): 1}


def test_a_key_held_twice_replays_its_latest_source_twice():
    s1, s2 = _store([1], None, session_id="a"), _store([1], None, session_id="b")
    rec = _record([_batch(s1), _batch(s2)])
    assert rec.retained == 1, "the earlier store no longer names any key"
    snap = _snapshot_events(rec)
    assert len(snap) == 2 and all(ev is s2 for ev in snap)


def test_a_clear_empties_it_and_makes_an_unavailable_recorder_exact_again():
    rec = _record([_batch(_store([1], None), _store([2], None, "CPU"))], max_blocks=2)
    rec.record(_batch(_store([3], 2)))
    assert not rec.valid and "snapshot_max_blocks" in rec.reason and rec.held == 0
    rec.record(_batch(_store([4], None)))
    assert not rec.valid, "still unavailable: what it missed is unknown"
    rec.record(_batch(_store([4], None), AllBlocksCleared(), _store([5], None)))
    assert rec.valid and rec.state() == {("GPU", None, 5): 1}
    assert rec.retained == 1 and rec.invalidations == 1


@pytest.mark.parametrize(
    "bad",
    [
        _store([[1]], None, tokens=[]),  # an unhashable hash
        msgspec.structs.replace(_store([1], None), block_hashes=None),  # not a list
    ],
)
def test_an_event_it_cannot_interpret_makes_it_unavailable(bad):
    rec = _record([_batch(_store([7], None))])
    rec.record(_batch(bad))
    assert not rec.valid and "cannot interpret" in rec.reason
    rec.check()


def test_unknown_events_are_ignored_like_the_models_do():
    class Other(msgspec.Struct, tag="SomethingNew"):
        x: int = 0

    rec = _record([_batch(_store([1], None), Other(), object())])
    assert rec.valid and rec.state() == {("GPU", None, 1): 1}


def test_a_move_is_replayed_as_its_store():
    moved = BlockMoved(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        from_medium="GPU",
        to_medium="CPU",
        lora_name=None,
    )
    rec = _record([_batch(_store([1], None)), _batch(moved)])
    assert rec.state() == {("CPU", None, 1): 1}
    (stored,) = _snapshot_events(rec)
    assert isinstance(stored, BlockStored) and stored.medium == "CPU"
    assert stored.token_ids == [1, 2]


def test_chunks_are_bounded_and_only_removals_are_split():
    n = CHUNK_EVENTS * 3 + 5
    rec = _record([_batch(_store([i], None)) for i in range(1, n + 1)])
    chunks = list(rec.chunks())
    assert [len(c) for c in chunks] == [CHUNK_EVENTS] * 3 + [5]
    big = _store(range(1, REMOVED_PER_EVENT * 2 + 2), None)
    rec = _record([_batch(big, _store([0], REMOVED_PER_EVENT * 2 + 1))])
    rec.record(
        _batch(BlockRemoved(block_hashes=list(range(1, REMOVED_PER_EVENT * 2 + 2)), medium="GPU"))
    )
    snap = _snapshot_events(rec)
    assert snap[0] is big, "a store is never split"
    assert [len(e.block_hashes) for e in snap[2:]] == [REMOVED_PER_EVENT, REMOVED_PER_EVENT, 1]
    assert _apply(_model("dynamo"), snap).state() == {("GPU", None, 0): 1}


def test_a_parent_cycle_from_a_caller_terminates():
    rec = _record([_batch(_store([1], 2)), _batch(_store([2], 1)), _batch(_store([3], 3))])
    snap = _snapshot_events(rec)
    assert sorted(h for e in snap for h in e.block_hashes) == [1, 2, 3]


def test_a_walk_closed_early_leaves_it_recording():
    rec = _record([_batch(_store([i], None)) for i in range(1, 3 * CHUNK_EVENTS)])
    chunks = rec.chunks()
    assert next(chunks)
    chunks.close()  # the snapshot service does this when it abandons a reply
    rec.record(_batch(BlockRemoved(block_hashes=[1], medium="GPU")))
    rec.check()
    assert rec.valid and rec.held == 3 * CHUNK_EVENTS - 2
    assert len(_snapshot_events(rec)) == 3 * CHUNK_EVENTS - 2


def _internals(rec: Recorder) -> Any:
    """The whole state, source ids renumbered in recorded order, and its counters."""
    return (*rec.export(), rec.valid, rec.held, rec.retained)


@settings(max_examples=300, deadline=None)
@given(st.one_of(batch_lists(), chained_streams()))
def test_the_c_loop_builds_the_python_loops_state(batches):
    if _recorder._accel is None:
        pytest.skip("the C recorder is not built")
    py, c = Recorder(10_000, accelerated=False), Recorder(10_000, accelerated=True)
    for b in batches:
        py.record(b)
        c.record(b)
        assert _internals(c) == _internals(py)
        assert [e for ch in c.chunks() for e in ch] == [e for ch in py.chunks() for e in ch]


def test_source_ids_are_renumbered_before_they_outgrow_64_bits(impl):
    if impl == "c":
        pytest.skip("the C state reuses source slots: its ids never grow")
    rec = _new()
    rec._n[NEXT] = MAX_ID - 2
    batches = [_batch(_store([i], i - 1 if i > 1 else None)) for i in range(1, 6)]
    batches.append(_batch(BlockRemoved(block_hashes=[1, 2], medium="GPU")))
    for b in batches:
        rec.record(b)
        rec.check()
    assert rec.valid and rec._n[NEXT] < MAX_ID
    assert rec.state() == {("GPU", None, h): 1 for h in (3, 4, 5)}
    snap = _snapshot_events(rec)
    assert [e.block_hashes for e in snap] == [[1], [2], [3], [4], [5], [1, 2]]
