"""The rules level's measured choice: run the rules only while they cost less than folding."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest

from coalesce import BlockRemoved, CoalescingPublisher, KVEventBatch, PublishOutcome
from coalesce._payoff import EXPLORE_FIRST, EXPLORE_MAX, SAMPLES, Payoff
from tests.conftest import assert_every_model_agrees, decode, held, inproc
from tests.test_publisher import offload_batch, store


@pytest.fixture
def pubs():
    made: list[CoalescingPublisher] = []

    def make(**kw: Any) -> CoalescingPublisher:
        made.append(CoalescingPublisher(**kw))
        return made[-1]

    yield make
    for p in made:
        p.shutdown()


def decisions(p: Payoff, n: int, rules_cost: float, fold_cost: float) -> list[bool]:
    """``n`` windows of a stream whose windows cost these (seconds per event)."""
    out = []
    for _ in range(n):
        rules = p.rules_next()
        p.record(rules, rules_cost if rules else fold_cost)
        out.append(rules)
    return out


def test_each_side_is_tried_before_either_is_chosen():
    p = Payoff()
    assert p.rules_next() is True and p.costs() == (None, None)
    p.record(True, 2e-7)
    assert p.rules_next() is False  # folding not measured yet
    p.record(False, 1e-7)
    assert p.costs() == (2e-7, 1e-7)
    assert p.rules_next() is False  # the cheaper side


@pytest.mark.parametrize("rules_cost", [1e-7, 3e-7])
def test_the_cheaper_side_runs_and_the_other_is_tried_ever_more_rarely(rules_cost):
    p = Payoff()
    got = decisions(p, 2000, rules_cost, 2e-7)[2:]  # after one window each way
    chosen = rules_cost < 2e-7
    explored = [i for i, r in enumerate(got) if r is not chosen]
    gaps = [b - a for a, b in itertools.pairwise([-1, *explored])]
    assert gaps[0] in (EXPLORE_FIRST, 2 * EXPLORE_FIRST)  # doubled if the first try lost
    assert all(b == min(2 * a, EXPLORE_MAX) for a, b in itertools.pairwise(gaps))
    assert gaps[-1] == EXPLORE_MAX and len(explored) < 2000 // EXPLORE_MAX + 8


def test_one_slow_window_does_not_decide():
    """A preempted window (a thousand times slower) is outvoted by the median."""
    p = Payoff()
    decisions(p, 50, 1e-7, 2e-7)
    p.record(True, 1e-4)
    assert p.costs()[0] == 1e-7 and p.rules_next() is True


@pytest.mark.parametrize("fold_cost", [0.85e-7, 1.0e-7, 1.2e-7])
def test_at_about_the_same_price_the_rules_are_kept(fold_cost):
    """Within the noise of the timings the smaller stream wins."""
    got = decisions(Payoff(), 2000, 1e-7, fold_cost)
    assert got[2:].count(False) < 2000 // EXPLORE_MAX + 8


def test_folding_takes_over_only_when_clearly_cheaper_and_the_rules_return_soon():
    p = Payoff()
    assert decisions(p, 100, 1e-7, 0.7e-7)[-EXPLORE_FIRST:].count(True) <= 1
    got = decisions(p, 300, 1e-7, 0.99e-7)  # the rules now cost about what folding does
    assert got[-EXPLORE_FIRST:].count(False) <= 1


def test_a_stream_that_changes_changes_the_choice_soon():
    p = Payoff()
    assert decisions(p, 3000, 1e-7, 2e-7)[-1] is True  # explored only every EXPLORE_MAX
    got = decisions(p, EXPLORE_MAX + 6 * EXPLORE_FIRST * SAMPLES, 5e-7, 2e-7)
    assert got[-EXPLORE_FIRST:].count(True) <= 1  # the rules now cost more: folding
    assert got.index(False) <= EXPLORE_MAX


def test_a_machine_that_slows_down_does_not_make_the_chosen_way_look_dearer():
    """Each ratio is of windows timed moments apart: a drift that hits both ways
    alike (here the machine slows threefold) changes no choice."""
    p = Payoff()
    got = []
    for i in range(3000):
        drift = 1 + 2 * i / 3000
        rules = p.rules_next()
        p.record(rules, (1e-7 if rules else 1.3e-7) * drift)
        got.append(rules)
    assert got[2:].count(False) < 3000 // EXPLORE_MAX + 8


class _Forced(Payoff):
    """A stream on which the rules always (``pay``) or never pay, whatever the clock
    says (a slow machine, or a workload with nothing to cancel or merge, would
    measure the second); what the sender recorded is kept."""

    pay = False
    recorded: ClassVar[list[tuple[bool, float]]] = []

    def rules_next(self) -> bool:
        return self.pay

    def record(self, rules: bool, seconds_per_event: float, pressed: bool = False) -> None:
        self.recorded.append((rules, seconds_per_event))


def run_held(
    pubs: Any, make_sub: Any, monkeypatch: Any, pay: bool, batches: list[Any], **kw: Any
) -> tuple[Any, list[Any]]:
    """Publish ``batches`` with the sender held (so it finds them all waiting) and the
    rules forced to pay or not; the publisher's stats and what a subscriber received."""
    import coalesce._sender as sender

    monkeypatch.setattr(_Forced, "pay", pay)
    monkeypatch.setattr(_Forced, "recorded", [])
    monkeypatch.setattr(sender, "Payoff", _Forced)
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
    assert _Forced.recorded and all(r is pay and s > 0 for r, s in _Forced.recorded)
    assert_every_model_agrees(batches, received)
    return st, received


def test_where_the_rules_do_not_pay_the_rules_level_only_folds(pubs, make_sub, monkeypatch):
    batches: list[Any] = [offload_batch(i) for i in range(600)]
    st, received = run_held(pubs, make_sub, monkeypatch, False, batches)
    assert st.rules_skipped > 0 and st.batches_folded > 0 and len(received) < len(batches)
    assert st.events_merged == st.blocks_cancelled == 0  # no rule ran
    assert st.events_sent == st.events_in


def test_where_the_rules_pay_they_run_and_their_cost_is_recorded(pubs, make_sub, monkeypatch):
    batches: list[Any] = [offload_batch(i) for i in range(600)]
    st, _ = run_held(pubs, make_sub, monkeypatch, True, batches)
    assert st.rules_skipped == 0 and st.events_merged > 0 and st.events_sent < st.events_in


def chain(first: int, n: int) -> KVEventBatch:
    """One batch of ``n`` chained single-block stores (vLLM's long prompt), the last
    half of them removed again: the rules merge and cancel most of it."""
    evs: list[Any] = [store(first + j, (first + j - 1) if j else None) for j in range(n)]
    evs += [BlockRemoved([first + j], "GPU") for j in range(n // 2, n)]
    return KVEventBatch(1.0, evs, None)


@pytest.mark.parametrize("pay", [True, False])
def test_a_batch_larger_than_a_window_is_compacted_in_parts_while_that_pays(
    pubs, make_sub, monkeypatch, pay
):
    batches = [chain(1000, 600)] + [offload_batch(i) for i in range(4)]
    st, received = run_held(pubs, make_sub, monkeypatch, pay, batches, max_events_per_step=64)
    if pay:  # in parts of 64 events (900 events: 15 parts), each compacted
        assert len(received) >= 15 and st.events_sent < st.events_in // 2
    else:  # as it was published, in one message
        assert received[0] == batches[0] and st.events_sent == st.events_in


def run_at_the_edge(
    pubs: Any, make_sub: Any, monkeypatch: Any, near_budget: bool, **kw: Any
) -> tuple[list[Any], Any, list[Any]]:
    """:func:`run_held` (the rules forced to pay) on two big batches and four small
    ones, the budget set so that once the first is taken, just more
    (``near_budget``) or just less than ``WHOLE_FROM`` of it is pending."""
    from coalesce._policy import WHOLE_FROM

    batches = [chain(1000, 600), chain(5000, 600)] + [offload_batch(i) for i in range(4)]
    behind = sum(len(b.events) for b in batches[1:])  # pending once the first is taken
    budget = int(behind / WHOLE_FROM) + (-1 if near_budget else 1)
    st, received = run_held(
        pubs,
        make_sub,
        monkeypatch,
        True,
        batches,
        max_events_per_step=64,
        max_pending_events=budget,
        **kw,
    )
    return batches, st, received


@pytest.mark.parametrize("near_budget", [True, False])
def test_a_sender_near_its_budget_sends_a_big_batch_whole(pubs, make_sub, monkeypatch, near_budget):
    """The rules pay, but more than ``WHOLE_FROM`` of the budget is pending: one
    encode of the batch and the next one waiting paces the engine."""
    batches, st, received = run_at_the_edge(pubs, make_sub, monkeypatch, near_budget)
    if near_budget:  # the first two folded, as they were; the rest under WHOLE_FROM
        assert received[0].events == batches[0].events + batches[1].events
        assert sum(len(r.events) for r in received[1:]) <= len(batches[2:])
    else:  # under WHOLE_FROM: in parts, each compacted
        assert received[0] != batches[0] and len(received) >= 2 * 15
    assert st.events_sent < st.events_in


def test_a_refused_batch_is_recorded_in_its_place(pubs, monkeypatch):
    """The recorder is given what the budget refused, at its loss marker, between
    what was sent before it and after it."""
    import coalesce._recorder as recorder

    seen: list[int] = []
    real = recorder.Recorder.record

    def spy(self: Any, batch: Any) -> None:
        seen.append(len(batch.events))
        real(self, batch)

    monkeypatch.setattr(recorder.Recorder, "record", spy)
    first, refused, after = chain(1000, 60), chain(2000, 640), chain(5000, 200)
    p = pubs(endpoint=inproc("pub"), max_pending_events=1000, snapshot_endpoint=inproc("snap"))
    with held(p):
        assert p.publish(first) is PublishOutcome.QUEUED
        assert p.publish(refused) is PublishOutcome.DROPPED
        assert p.publish(after) is PublishOutcome.QUEUED
    assert p.flush(10)
    assert p.stats().batches_dropped == 1
    assert seen[: seen.index(len(refused.events))] == [len(first.events)]
    assert sum(seen) == len(first.events) + len(refused.events) + len(after.events)
    assert p.stats().snapshot_exact


def test_sends_whole_past_its_share_of_the_budget_growing_or_not():
    from coalesce._policy import PRESSURE_FROM, WHOLE_FROM, sends_whole

    budget = 1000
    floor = int(WHOLE_FROM * budget)
    assert PRESSURE_FROM < WHOLE_FROM < 1  # the longer slice first, whole sends later
    assert sends_whole(floor + 1, budget) and sends_whole(3 * budget, budget)
    assert not sends_whole(floor, budget) and not sends_whole(0, budget)


@pytest.mark.parametrize("fold_cost", [0.85e-7, 0.95e-7])
def test_a_pressed_sender_takes_the_cheaper_way_at_any_margin(fold_cost):
    """Within the band the rules are kept (above), but not while the sender is
    losing ground near its budget: there the cheaper way drains more per second."""
    p = Payoff()
    for _ in range(400):
        rules = p.rules_next()
        p.record(rules, 1e-7 if rules else fold_cost, pressed=True)
    assert decisions(p, EXPLORE_FIRST, 1e-7, fold_cost).count(True) <= 1


def test_a_pressed_sender_keeps_the_rules_where_they_are_cheaper():
    p = Payoff()
    for _ in range(400):
        rules = p.rules_next()
        p.record(rules, 1e-7 if rules else 1.05e-7, pressed=True)
    assert p.rules_next() is True
    assert decisions(p, EXPLORE_FIRST, 1e-7, 1.05e-7).count(False) <= 1
