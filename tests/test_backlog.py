"""The backlog alone: a seeded stress of every operation, invariants checked after each."""

from __future__ import annotations

import random

import pytest

from coalesce import KVEventBatch
from coalesce._backlog import LOSS, Backlog


@pytest.mark.parametrize("seed", range(20))
def test_seeded_stress_keeps_invariants_and_order(seed):
    rng = random.Random(seed)
    b = Backlog(max_batches=rng.randint(1, 20), max_events=rng.randint(5, 200))
    offered = accepted = 0
    seen: list[object] = []  # what came out, in order, markers included
    for _ in range(2000):
        op = rng.random()
        if op < 0.6:
            batch = KVEventBatch(float(offered), [None] * rng.randint(0, 12))
            accepted += b.offer(batch, len(batch.events))
            offered += 1
        elif len(b) and op < 0.8:
            seen.append(b.take_one())
        elif len(b) and op < 0.97:
            got = b.take(rng.randint(1, 40))
            seen.extend([got] if got is LOSS else got)
        elif op < 0.99:
            b.mark_pending_loss()
        else:
            b.drain()
        b.check()
    assert b.batches_in == accepted and b.batches_in + b.batches_dropped == offered
    ts = [x.ts for x in seen if x is not LOSS]
    assert ts == sorted(ts), "batches come out in publish order"


def test_a_loss_is_marked_exactly_where_it_happened():
    b = Backlog(max_batches=1, max_events=100)
    first, second, third = (KVEventBatch(float(i), []) for i in range(3))
    assert b.offer(first, 0)
    assert not b.offer(second, 0)  # over budget
    assert b.take_one() is first
    assert b.offer(third, 0)
    assert b.take_one() is LOSS and b.take_one() is third
    b.check()
