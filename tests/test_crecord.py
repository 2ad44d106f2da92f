"""The C recorder (coalesce/_crecord.c) against its oracle, the pure-Python recorder.

Streams wider than the model tests': bytes and 64-bit hashes, parents that
point anywhere (cycles, self-parents, parents stored after their children),
moves, and values outside the C domain, where the C recorder must make
itself unavailable (a snapshot request gets -2), never be wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce import _recorder
from coalesce._recorder import new_recorder
from coalesce.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored, KVEventBatch
from coalesce.refmodel import SubscriberModel
from tests.conftest import no_forced_switch
from tests.streams import batch_lists
from tests.test_recorder import (
    _apply,
    _batch,
    _closed,
    _snapshot_events,
    _store,
    chained_streams,
)

if _recorder._accel is None:
    if os.environ.get("COALESCE_REQUIRE_ACCEL"):
        pytest.fail(
            "the C recorder (coalesce/_crecord.c) was not built, and COALESCE_REQUIRE_ACCEL is set",
            pytrace=False,
        )
    pytest.skip("the C recorder is not built (pure-Python recorder only)", allow_module_level=True)

_POOL = [0, 1, 2, 3, 2**63 + 5, 2**64 - 1, b"\x00a", b"\x00b", b"c" * 40]
_ODD = [-1, 2**64, 1.5, "s", True]  # outside the C domain: unavailable there, never wrong
_MEDIA2 = ["GPU", "CPU", None, "CPU_" + "x"]


@st.composite
def wide_streams(draw: Any, odd: bool = True) -> list[Any]:
    """Any hashes (bytes, 64-bit ints, odd values), any parents, moves and clears."""
    pool = _POOL + (_ODD if odd else [])
    values = st.sampled_from(pool)
    batches = []
    for t in range(draw(st.integers(0, 14))):
        events: list[Any] = []
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(("store", "store", "remove", "move", "clear")))
            hs = draw(st.lists(values, min_size=1, max_size=5))
            m, g = draw(st.sampled_from(_MEDIA2)), draw(st.sampled_from((None, 0, 1)))
            if kind == "clear":
                events.append(AllBlocksCleared())
            elif kind == "remove":
                events.append(BlockRemoved(block_hashes=hs, medium=m, group_idx=g))
            else:
                fields = {
                    "block_hashes": hs,
                    "parent_block_hash": draw(st.one_of(st.none(), values)),
                    "token_ids": list(range(len(hs) * 2)) if draw(st.booleans()) else [],
                    "block_size": 2,
                    "lora_id": None,
                    "lora_name": None,
                    "extra_keys": [("k", i) for i in range(len(hs))]
                    if draw(st.booleans())
                    else None,
                    "group_idx": g,
                    "locality": draw(st.sampled_from((None, "a"))),
                }
                if kind == "store":
                    events.append(BlockStored(medium=m, **fields))
                else:
                    to = draw(st.sampled_from(_MEDIA2))
                    events.append(BlockMoved(from_medium=m, to_medium=to, **fields))
        batches.append(KVEventBatch(ts=float(t), events=events, data_parallel_rank=0))
    return batches


def _models(events: list[Any], mode: str) -> tuple[Any, int]:
    model = _apply(SubscriberModel(mode), events)
    return model.state(), model.dropped_stores


def _odd(h: Any) -> bool:
    return type(h) not in (int, bytes, type(None)) or (type(h) is int and not 0 <= h < 2**64)


def _in_domain(batches: list[Any]) -> bool:
    """Every hash and parent is one the C recorder takes."""
    return not any(
        _odd(h)
        for b in batches
        for e in b.events
        for h in [*getattr(e, "block_hashes", ()), getattr(e, "parent_block_hash", None)]
    )


@settings(max_examples=300, deadline=None)
@given(st.one_of(wide_streams(), wide_streams(odd=False), batch_lists(), chained_streams()))
def test_the_c_recorder_is_the_python_one_wherever_it_is_exact(batches):
    """Batch by batch: when C is exact, so is Python, with the same state and snapshot."""
    py = new_recorder(10_000, accelerated=False)
    c = new_recorder(10_000, accelerated=True, release_at=1)  # the tables without the GIL
    for b in batches:
        py.record(b)
        c.record(b)
        py.check()
        c.check()
        if not c.valid:
            assert c.reason and c.held == 0
            continue
        assert py.valid
        assert c.state() == py.state()
        assert (c.held, c.retained) == (py.held, py.retained)
    if c.valid:
        snap_c, snap_py = _snapshot_events(c), _snapshot_events(py)
        assert _models(snap_c, "refcount") == _models(snap_py, "refcount")
        if _closed(batches):  # else the order of the stores decides which a model drops
            for mode in ("llmd", "dynamo"):
                assert _models(snap_c, mode) == _models(snap_py, mode), mode
    if _in_domain(batches):
        assert c.valid == py.valid, "in its domain the C recorder is as exact as Python"


@pytest.mark.parametrize("odd", [*_ODD, [1]])
def test_outside_its_domain_the_c_recorder_is_unavailable_not_wrong(odd):
    rec = new_recorder(100, accelerated=True)
    rec.record(_batch(_store([7], None)))
    rec.record(_batch(_store([odd], None, tokens=[])))
    assert not rec.valid and "cannot interpret" in rec.reason and rec.held == 0
    assert rec.invalidations == 1
    rec.record(_batch(AllBlocksCleared(), _store([8], None)))
    assert rec.valid and rec.state() == {("GPU", None, 8): 1}


def test_past_64_event_classes_it_stays_exact_or_says_it_is_not():
    """The class table is per process, so this runs in a process of its own."""
    script = """
import msgspec
from coalesce._recorder import new_recorder
from coalesce.events import BlockStored, KVEventBatch

def store(h):
    return BlockStored([h], None, [], 2, None, "GPU", None)

def batch(*evs):
    return KVEventBatch(0.0, list(evs), 0)

rec = new_recorder(1000, accelerated=True)
for i in range(80):  # ignored tags: past the table's 64 they are left out
    rec.record(batch(store(i), msgspec.defstruct(f"Other{i}", [], tag=f"Other{i}")()))
assert rec.valid and len(rec.state()) == 80, rec.reason
Clear = msgspec.defstruct("AllBlocksCleared", [], tag="AllBlocksCleared")  # not registered
rec.record(batch(Clear(), store(1)))
assert rec.valid and rec.state() == {("GPU", None, 1): 1}, "a clear of any class is seen"
Stored = msgspec.defstruct(
    "BlockStored", [("block_hashes", list), ("parent_block_hash", object), ("medium", object)],
    tag="BlockStored",
)
rec.record(batch(Stored([5], None, "GPU")))
assert not rec.valid and "too many event classes" in rec.reason, "unreadable: not exact"
rec.record(batch(Clear(), store(2)))
assert rec.valid and rec.state() == {("GPU", None, 2): 1}
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _big_batch(n: int, base: int = 1 << 40) -> Any:
    """One store of ``n`` chained blocks, half of them removed again, bytes hashes too."""
    hashes: list[Any] = [base + i for i in range(n)]
    hashes[1::7] = [b"h%d" % i for i in range(len(hashes[1::7]))]
    events = [
        _store(hashes, None, tokens=[0] * (2 * n)),
        BlockRemoved(block_hashes=hashes[::2], medium="GPU"),
    ]
    return KVEventBatch(ts=0.0, events=events)


def _spinner(rec: Any) -> tuple[list[int], list[Any], Any, Any]:
    """A thread counting in Python, handing the GIL back after each count, and
    asking the recorder's state for its invariants each time.

    With a huge switch interval it can count only while the main thread has
    released the GIL of its own accord."""
    import threading

    count, seen, stop = [0], [], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1
            try:
                rec._state.check()
            except RuntimeError as exc:  # busy: the tables are being updated
                seen.append(exc)
            except BaseException as exc:  # anything else: it read a table mid-update
                seen.append(exc)
                return
            time.sleep(0)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    for _ in range(10_000):  # until it runs (bounded); waiting releases the GIL
        if count[0]:
            break
        stop.wait(0.001)
    assert count[0], "the counting thread never ran"
    return count, seen, stop, thread


@pytest.mark.parametrize(("release_at", "keep_gil"), [(0, False), (1, False), (1, True)])
def test_the_tables_are_updated_without_the_gil_from_release_at(release_at, keep_gil):
    """With the GIL held (``release_at`` 0, or ``keep_gil``) nothing else runs
    during record(); released, another thread does, and what it asks of the
    state meanwhile is refused, never half-read."""
    from coalesce import _crecord

    batch = _big_batch(200_000)
    rec = new_recorder(10**6, accelerated=True, release_at=release_at)
    count, seen, stop, thread = _spinner(rec)
    try:
        with no_forced_switch():  # only a release lets it count
            before, released = count[0], _crecord.gil_releases()
            rec.record(batch, keep_gil)
            during, released = count[0] - before, _crecord.gil_releases() - released
    finally:
        stop.set()
        thread.join(10)
    assert all(isinstance(e, RuntimeError) and "busy" in str(e) for e in seen), seen
    rec.check()
    assert rec.valid and rec.held == 100_000
    # the module counts its releases: no assertion rests on when the other thread ran
    assert released == (1 if release_at and not keep_gil else 0)
    if not released:  # held throughout: the other thread cannot have run
        assert during == 0 and not seen


def _fresh(h: Any) -> Any:
    """An equal hash in a new object (the old one can then be freed)."""
    return int(str(h)) if type(h) is int else h[:1] + h[1:]


def test_a_caller_changing_the_events_while_the_tables_update_cannot_break_it():
    """The events are read before the GIL is released.  Another thread replaces every
    hash of the batch being recorded with an equal new object meanwhile (freeing the
    old ones): the state stays consistent, and equal to the Python recorder's."""
    import threading

    batches = [_big_batch(50_000, base=(i + 1) << 32) for i in range(6)]
    rec = new_recorder(10**6, accelerated=True, release_at=1)
    py = new_recorder(10**6, accelerated=False)
    stop = threading.Event()
    rewrites = [0]

    def vandal() -> None:
        while not stop.is_set():
            for b in batches:
                for ev in b.events:
                    ev.block_hashes[:] = [_fresh(h) for h in ev.block_hashes]
                    rewrites[0] += 1
            stop.wait(0)

    thread = threading.Thread(target=vandal, daemon=True)
    thread.start()
    try:
        for b in batches:
            rec.record(b)
            py.record(b)
    finally:
        stop.set()
        thread.join(10)
    assert rewrites[0] > 0
    rec.check()
    assert rec.valid and rec.state() == py.state()
