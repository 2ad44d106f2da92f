"""The rules level on big batches: in parts of a window, or whole near the event budget;
and a batch the budget refused is recorded in its place."""

from __future__ import annotations

from typing import Any

import pytest

from coalesce import BlockRemoved, KVEventBatch, PublishOutcome
from tests.conftest import assert_every_model_agrees, decode, held, inproc
from tests.test_publisher import offload_batch, store


def run_held(pubs: Any, make_sub: Any, batches: list[Any], **kw: Any) -> tuple[Any, list[Any]]:
    """Publish ``batches`` with the sender held (so it finds them all waiting); the
    publisher's stats and what a subscriber received."""
    ep = inproc("pub")
    sub = make_sub(ep)
    p = pubs(endpoint=ep, high_watermark=2, **kw)
    with held(p):
        for b in batches:
            assert p.publish(b) is PublishOutcome.QUEUED
    assert p.flush(10)
    st = p.stats()
    received = [decode(m[2]) for m in sub.recv_until_seq(st.messages_sent - 1)]
    assert st.batches_dropped == st.seq_gaps == 0
    assert_every_model_agrees(batches, received)
    return st, received


def test_the_rules_level_runs_the_rules_on_every_window(pubs, make_sub):
    batches: list[Any] = [offload_batch(i) for i in range(600)]
    st, received = run_held(pubs, make_sub, batches)
    assert st.compaction_passes > 0 and st.fold_only_passes == 0
    assert st.events_merged > 0 and st.events_sent < st.events_in
    assert len(received) < len(batches)


def chain(first: int, n: int) -> KVEventBatch:
    """One batch of ``n`` chained single-block stores (vLLM's long prompt), the last
    half of them removed again: the rules merge and cancel most of it."""
    evs: list[Any] = [store(first + j, (first + j - 1) if j else None) for j in range(n)]
    evs += [BlockRemoved([first + j], "GPU") for j in range(n // 2, n)]
    return KVEventBatch(1.0, evs, None)


def test_a_batch_larger_than_a_window_is_compacted_in_parts(pubs, make_sub):
    batches = [chain(1000, 600)] + [offload_batch(i) for i in range(4)]
    st, received = run_held(pubs, make_sub, batches, max_events_per_step=64)
    # in parts of 64 events (900 events: 15 parts), each compacted
    assert len(received) >= 15 and st.events_sent < st.events_in // 2


def run_at_the_edge(
    pubs: Any, make_sub: Any, near_budget: bool, **kw: Any
) -> tuple[list[Any], Any, list[Any]]:
    """:func:`run_held` on two big batches and four small
    ones, the budget set so that once the first is taken, just more
    (``near_budget``) or just less than ``WHOLE_FROM`` of it is pending."""
    from coalesce._policy import DEFAULT_POLICY

    WHOLE_FROM = DEFAULT_POLICY.whole_from
    batches = [chain(1000, 600), chain(5000, 600)] + [offload_batch(i) for i in range(4)]
    behind = sum(len(b.events) for b in batches[1:])  # pending once the first is taken
    budget = int(behind / WHOLE_FROM) + (-1 if near_budget else 1)
    st, received = run_held(
        pubs,
        make_sub,
        batches,
        max_events_per_step=64,
        max_pending_events=budget,
        **kw,
    )
    return batches, st, received


@pytest.mark.parametrize("near_budget", [True, False])
def test_a_sender_near_its_budget_sends_a_big_batch_whole(pubs, make_sub, near_budget):
    """More than ``WHOLE_FROM`` of the budget is pending: one encode of the batch
    and the next one waiting paces the engine."""
    batches, st, received = run_at_the_edge(pubs, make_sub, near_budget)
    if near_budget:  # the first two folded, as they were; the rest under WHOLE_FROM
        assert received[0].events == batches[0].events + batches[1].events
        assert sum(len(r.events) for r in received[1:]) <= len(batches[2:])
    else:  # under WHOLE_FROM: in parts, each compacted
        assert received[0] != batches[0] and len(received) >= 2 * 15
    assert st.events_sent < st.events_in


def test_a_refused_batch_is_recorded_in_its_place(pubs, monkeypatch):
    """The recorder's feed is given what the budget refused, at its loss marker,
    between what was sent before it and after it, and ends holding all three."""
    from coalesce._feed import Feed

    seen: list[int] = []
    real, real_encode = Feed.record, Feed.encode

    def spy(self: Any, batches: Any, compacted: bool = False) -> None:
        batches = list(batches)
        seen.extend(len(b.events) for b in batches)
        real(self, batches, compacted)

    def spy_encode(self: Any, batch: Any) -> bytes | None:  # (encoded and recorded at once)
        payload = real_encode(self, batch)
        if payload is not None:
            seen.append(len(batch.events))
        return payload

    monkeypatch.setattr(Feed, "record", spy)
    monkeypatch.setattr(Feed, "encode", spy_encode)
    first, refused, after = chain(1000, 60), chain(2000, 640), chain(5000, 200)
    p = pubs(endpoint=inproc("pub"), max_pending_events=1000, snapshot_endpoint=inproc("snap"))
    with held(p):
        assert p.publish(first) is PublishOutcome.QUEUED
        assert p.publish(refused) is PublishOutcome.DROPPED
        assert p.publish(after) is PublishOutcome.QUEUED
    assert p.flush(10)
    st = p.stats()
    assert st.batches_dropped == 1
    assert seen[: seen.index(len(refused.events))] == [len(first.events)]
    assert sum(seen) == len(first.events) + len(refused.events) + len(after.events)
    assert st.snapshot_exact and st.snapshot_blocks == (60 + 640 + 200) // 2


def test_sends_whole_past_its_share_of_the_budget_growing_or_not():
    from coalesce._policy import DEFAULT_POLICY, sends_whole

    PRESSURE_FROM, WHOLE_FROM = DEFAULT_POLICY.pressure_from, DEFAULT_POLICY.whole_from

    budget = 1000
    floor = int(WHOLE_FROM * budget)
    assert PRESSURE_FROM < WHOLE_FROM < 1  # the longer slice first, whole sends later
    assert sends_whole(floor + 1, budget) and sends_whole(3 * budget, budget)
    assert not sends_whole(floor, budget) and not sends_whole(0, budget)
