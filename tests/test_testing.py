"""coalesce.testing: the hooks the benchmarks use do what they say, and undo it."""

from __future__ import annotations

import pytest

from coalesce import CoalescingPublisher, PublishOutcome, _policy, compactor
from coalesce.testing import POLICY, held, policy, tap_sends, without_accelerator
from tests.conftest import inproc
from tests.test_publisher import batch, store


def test_policy_sets_the_constants_the_sender_reads_and_restores_them():
    before = {name: getattr(_policy, name) for name in POLICY}
    with policy(WIDEN_UP_TO=1, WHOLE_FROM=2.0):
        assert _policy.WIDEN_UP_TO == 1 and _policy.WHOLE_FROM == 2.0
        assert _policy.rules_window(512, 1e-9, 1.0) == 512  # widening off
    assert {name: getattr(_policy, name) for name in POLICY} == before
    assert _policy.rules_window(512, 1e-9, 1.0) == _policy.WIDEN_UP_TO * 512


def test_policy_refuses_a_name_it_does_not_know():
    with pytest.raises(ValueError, match="not a policy constant"), policy(YIELD_SOON=1):
        pass


def test_without_accelerator_runs_the_python_rules_and_restores_the_c_ones():
    accel = compactor._accel
    with without_accelerator():
        assert not compactor.accelerated()
        out, _ = compactor.compact([batch(store(1)), batch(store(2, 1))])
        assert len(out) == 1
    assert compactor._accel is accel


def test_tap_sends_sees_every_message_and_held_holds_the_sender():
    pub = CoalescingPublisher(endpoint=inproc("pub"), max_queue_size=1, stall_timeout=0)
    try:
        seen: list[int] = []
        tap_sends(pub, lambda topic, seq, payload: seen.append(seq))
        with held(pub):
            assert pub.publish(batch(store(1))) is PublishOutcome.QUEUED
            assert pub.publish(batch(store(2))) is PublishOutcome.DROPPED  # nothing taken
        assert pub.flush(10.0)
        assert pub.publish(batch(store(3))) is PublishOutcome.QUEUED
        assert pub.flush(10.0)
        assert seen == [0, 1, 2]  # the batch, the loss marker, the next batch
    finally:
        pub.shutdown()
