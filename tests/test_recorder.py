"""The snapshot recorder alone: its state and its rebuilt stream against the reference models.

Every test runs against both recorders: the pure-Python one (the oracle) and
the C one (coalesce/_crecord.c), when it is built; tests/test_crecord.py
checks the two against each other on wider streams.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce import _recorder, compact
from coalesce._recorder import CHUNK_BLOCKS, AnyRecorder, new_recorder
from coalesce.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
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

# "c" updates its tables with the GIL held, "c-nogil" with it released (every batch)
IMPLS = ["py", "c", "c-nogil"] if _recorder._accel is not None else ["py"]
_current: dict[str, Any] = {"accelerated": False, "release_at": 0}


@pytest.fixture(params=IMPLS, autouse=True)
def impl(request: Any) -> Any:
    """Run the test with each recorder (``_record`` and ``_new`` use it)."""
    _current["accelerated"] = request.param != "py"
    _current["release_at"] = 1 if request.param == "c-nogil" else 0
    yield "c" if request.param == "c-nogil" else request.param
    _current["accelerated"] = False
    _current["release_at"] = 0


def _new(max_blocks: int = 10_000) -> AnyRecorder:
    return new_recorder(
        max_blocks, accelerated=_current["accelerated"], release_at=_current["release_at"]
    )


def _snapshot_events(rec: AnyRecorder) -> list[Any]:
    return [ev for chunk in rec.chunks() for ev in chunk]


def _apply(model: SubscriberModel, events: list[Any]) -> SubscriberModel:
    for ev in events:
        model.apply_event(ev)
    return model


def _record(batches: list[Any], max_blocks: int = 10_000) -> AnyRecorder:
    rec = _new(max_blocks)
    for b in batches:
        rec.record(b)
        rec.check()
    return rec


def _closed(batches: list[Any]) -> bool:
    """No store in the stream had a parent missing from its medium and group."""
    return SubscriberModel("dynamo").apply_batches(batches).dropped_stores == 0


def _closed_only(batches: list[Any]) -> list[Any]:
    """The stream without the stores Dynamo's rule would drop: what vLLM emits."""
    model, out = SubscriberModel("dynamo"), []
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
    model, batches = SubscriberModel("dynamo"), []
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
def test_a_parent_checking_subscriber_accepts_the_whole_snapshot(batches, data):
    """Removed ancestors of held blocks are re-stored for it (and removed again)."""
    assert _closed(batches)
    cut = data.draw(st.integers(0, len(batches)))
    snap = _snapshot_events(_record(batches[:cut]))
    for mode in ("llmd", "dynamo"):
        model = _apply(SubscriberModel(mode), snap)
        assert model.dropped_stores == 0, mode
        assert model.state() == SubscriberModel(mode).apply_batches(batches[:cut]).state()
        model.apply_batches(batches[cut:])
        assert model.state() == SubscriberModel(mode).apply_batches(batches).state(), mode


@settings(max_examples=400, deadline=None)
@given(batch_lists(), st.data())
def test_snapshot_plus_suffix_is_the_full_stream(batches, data):
    cut = data.draw(st.integers(0, len(batches)))
    rec = _record(batches[:cut])
    snap = _snapshot_events(rec)
    full = SubscriberModel("refcount").apply_batches(batches)
    assert rec.state() == SubscriberModel("refcount").apply_batches(batches[:cut]).state()
    resumed = _apply(SubscriberModel("refcount"), snap).apply_batches(batches[cut:])
    assert resumed.state() == full.state()
    if _closed(batches[:cut]):
        for mode in ("llmd", "dynamo"):
            model = _apply(SubscriberModel(mode), snap)
            assert model.dropped_stores == 0, "a parent-checking subscriber accepts every store"
            model.apply_batches(batches[cut:])
            assert model.state() == SubscriberModel(mode).apply_batches(batches).state(), mode


@settings(max_examples=200, deadline=None)
@given(batch_lists())
def test_the_compacted_stream_records_the_same_state(batches):
    """The sender records what it sent after compaction: the same refcount state."""
    out, _ = compact(batches)
    assert _record(out).state() == _record(batches).state()


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


def test_a_removed_ancestor_is_stored_for_its_child_and_removed_again():
    rec = _record(
        [
            _batch(_store([1, 2, 3], None, extra_keys=[None, ("s", 2), None])),
            _batch(BlockRemoved(block_hashes=[1, 2], medium="GPU")),
        ]
    )
    assert rec.state() == {("GPU", None, 3): 1}
    assert rec.retained == 3  # 1 and 2 are kept as 3's ancestors
    snap = _snapshot_events(rec)
    assert [type(e).__name__ for e in snap] == ["BlockStored", "BlockRemoved"]
    stored, removed = snap
    assert stored.block_hashes == [1, 2, 3] and stored.parent_block_hash is None
    assert stored.token_ids == [10, 11, 20, 21, 30, 31]
    assert stored.extra_keys == [None, ("s", 2), None]
    assert removed.block_hashes == [1, 2]
    rec.record(_batch(BlockRemoved(block_hashes=[3], medium="GPU")))
    rec.check()
    assert rec.held == rec.retained == 0, "the ancestors go with their last child"


def test_counts_and_fields_of_the_latest_store_are_kept():
    rec = _record(
        [
            _batch(_store([1], None, locality="a")),
            _batch(_store([1], None, locality="b", group_idx=None)),
            _batch(_store([1], None, medium="CPU", tokens=[])),
        ]
    )
    snap = _snapshot_events(rec)
    gpu = [e for e in snap if e.medium == "GPU"]
    assert len(gpu) == 2 and {e.locality for e in gpu} == {"b"}
    (cpu,) = [e for e in snap if e.medium == "CPU"]
    assert cpu.token_ids == []


def test_a_clear_empties_it_and_makes_an_unavailable_recorder_exact_again():
    rec = _record([_batch(_store([1], None))], max_blocks=1)
    assert rec.valid
    rec.record(_batch(_store([2], 1)))
    assert not rec.valid and "snapshot_max_blocks" in rec.reason and rec.held == 0
    rec.record(_batch(_store([3], None)))
    assert not rec.valid, "still unavailable: what it missed is unknown"
    rec.record(_batch(_store([4], None), AllBlocksCleared(), _store([5], None)))
    assert rec.valid and rec.state() == {("GPU", None, 5): 1}
    assert rec.invalidations == 1


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


def test_chunks_are_bounded():
    n = CHUNK_BLOCKS * 3 + 5
    rec = _record([_batch(_store(range(1, n + 1), None))])
    chunks = list(rec.chunks())
    assert len(chunks) == 4
    assert all(sum(len(e.block_hashes) for e in c) <= CHUNK_BLOCKS for c in chunks)
    model = SubscriberModel("dynamo")
    for c in chunks:
        _apply(model, c)
    assert model.dropped_stores == 0 and len(model.state()) == n


def test_a_parent_cycle_from_a_caller_terminates():
    rec = _record([_batch(_store([1], 2)), _batch(_store([2], 1)), _batch(_store([3], 3))])
    snap = _snapshot_events(rec)
    assert sorted(h for e in snap for h in e.block_hashes) == [1, 2, 3]


def test_more_medium_and_group_pairs_than_the_c_tables_hold(impl):
    rec = _new()
    rec.record(_batch(*[_store([1], None, medium=f"M{i}") for i in range(70)]))
    rec.check()
    if impl == "c":
        assert not rec.valid and "cannot interpret" in rec.reason
    else:
        assert rec.valid and rec.held == 70


def test_a_walk_closed_early_leaves_it_recording(impl):
    rec = _record([_batch(_store(range(1, 3 * CHUNK_BLOCKS), None))])
    chunks = rec.chunks()
    assert next(chunks)
    chunks.close()  # the snapshot service does this when it abandons a reply
    rec.record(_batch(BlockRemoved(block_hashes=[1], medium="GPU")))
    rec.check()
    assert rec.valid and rec.held == 3 * CHUNK_BLOCKS - 2
    assert len(_snapshot_events(rec)) >= 1
