"""The backlog alone: a seeded stress of every operation, invariants checked after each."""

from __future__ import annotations

import random

import pytest

from coalesce import KVEventBatch
from coalesce._backlog import LOSS, Backlog, is_loss


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("record", [0, 30])
def test_seeded_stress_keeps_invariants_and_order(seed, record):
    """``record``: refused batches queued in their place for the recorder (at most 30
    events of them waiting): every batch offered comes out once, in publish order."""
    rng = random.Random(seed)
    b = Backlog(
        max_batches=rng.randint(1, 20), max_events=rng.randint(5, 200), record_events=record
    )
    offered = accepted = 0
    seen: list[object] = []  # what came out, in order, markers included
    for _ in range(2000):
        op = rng.random()
        if op < 0.6:
            batch = KVEventBatch(float(offered), [None] * rng.randint(0, 12))
            accepted += b.offer(batch, len(batch.events))
            offered += 1
        elif len(b) and op < 0.8:
            item = b.take_one()
            if not is_loss(item):
                assert isinstance(item, tuple) and item[1] == len(item[0].events)
                item = item[0]
            seen.append(item)
        elif len(b) and op < 0.97:
            got = b.take(rng.randint(1, 40))
            seen.extend([got] if is_loss(got) else got)
        elif op < 0.985:
            b.stage()
        elif op < 0.99:
            b.mark_pending_loss()
        else:
            b.drain()
        b.check()
    assert b.batches_in == accepted and b.batches_in + b.batches_dropped == offered
    out = [x for x in seen if not is_loss(x)]
    if record:  # the refused ones too, where they were refused
        out = [y for x in seen for y in ((x.refused or []) if is_loss(x) else [x])]
    ts = [x.ts for x in out]
    assert ts == sorted(ts), "batches come out in publish order"
    assert b.refused_out <= b.refused_in <= b.refused_out + record


def test_a_loss_is_marked_exactly_where_it_happened():
    b = Backlog(max_batches=1, max_events=100)
    first, second, third = (KVEventBatch(float(i), []) for i in range(3))
    assert b.offer(first, 0)
    assert not b.offer(second, 0)  # over budget
    assert b.take_one() == (first, 0)
    assert b.offer(third, 0)
    assert b.take_one() is LOSS and b.take_one() == (third, 0)
    b.check()


def test_with_a_recorder_each_refused_batch_takes_its_place_and_a_run_is_one_loss():
    b = Backlog(max_batches=1, max_events=100, record_events=5)
    first, *refused, last = (KVEventBatch(float(i), [None] * 2) for i in range(5))
    assert b.offer(first, 2)
    assert [b.offer(r, 2) for r in refused] == [False] * 3  # the third passes the bound
    assert b.take_one() == (first, 2)
    loss = b.take_one()
    assert is_loss(loss) and loss.refused == refused[:2] and loss.overflow
    assert (b.refused_in, b.refused_out) == (4, 4)
    assert b.offer(last, 2) and b.take_one() == (last, 2)
    b.check()


def test_next_is_batch_sees_the_oldest_item_staged_or_not():
    b = Backlog(max_batches=1, max_events=100)
    assert not b.next_is_batch()  # empty
    first, second = KVEventBatch(0.0, []), KVEventBatch(1.0, [])
    assert b.offer(first, 0) and b.stage() == 1 and b.next_is_batch()
    assert b.offer(second, 0) and not b.offer(KVEventBatch(2.0, []), 0)  # then a loss
    assert b.take_one() == (first, 0) and b.next_is_batch()  # second, in the hand-off
    assert b.offer(KVEventBatch(3.0, []), 0) is False  # the deque is full
    assert b.take_one() == (second, 0)
    assert b.offer(KVEventBatch(4.0, []), 0) and not b.next_is_batch()  # LOSS first
    assert b.take_one() is LOSS and b.next_is_batch()
    b.check()


def test_counts_survive_a_batch_mutated_after_it_was_offered():
    b = Backlog(max_batches=10, max_events=100)
    batch = KVEventBatch(0.0, [None] * 5)
    assert b.offer(batch, 5)
    batch.events = None  # type: ignore[assignment]  # a careless caller
    assert b.pending_events == 5
    assert b.take(100) == [batch]
    assert b.pending_events == 0 and b.pending == 0
    b.check()


def test_refuse_all_refuses_every_later_batch():
    b = Backlog(max_batches=10, max_events=100)
    assert b.offer(KVEventBatch(0.0, []), 0)
    b.refuse_all()
    assert not b.offer(KVEventBatch(1.0, [None]), 1)
    assert (b.batches_dropped, b.events_dropped, b.pending) == (1, 1, 1)
    b.check()


def test_staging_frees_the_batch_budget_not_the_event_budget():
    b = Backlog(max_batches=2, max_events=10)
    batches = [KVEventBatch(float(i), [None] * 2) for i in range(6)]
    assert b.offer(batches[0], 2) and b.offer(batches[1], 2)
    assert not b.offer(batches[2], 2)  # two batches in the hand-off: full
    assert b.stage() == 2 and b.pending == 0 and b.waiting == 2
    assert b.offer(batches[3], 2) and b.offer(batches[4], 2)
    assert not b.offer(batches[5], 4)  # 8 + 4 events > 10: the memory bound holds
    b.check()
    # order is kept across the two deques, the loss marker included
    got = [b.take_one() for _ in range(len(b))]
    assert got == [(batches[0], 2), (batches[1], 2), LOSS, (batches[3], 2), (batches[4], 2)]
    b.check()
