"""coalesce.testing: the hooks the benchmarks use do what they say, and only to the
publishers built inside their blocks."""

from __future__ import annotations

import pytest

from coalesce import CoalescingPublisher, PublishOutcome, compactor
from coalesce._policy import DEFAULT_POLICY, rules_window
from coalesce.testing import POLICY, held, hooks, policy, tapped, without_accelerator
from tests.conftest import inproc
from tests.test_publisher import batch, store


def test_policy_gives_a_changed_policy_to_publishers_built_inside_only():
    with policy(WIDEN_UP_TO=1, WHOLE_FROM=2.0) as tuned:
        assert tuned.widen_up_to == 1 and tuned.whole_from == 2.0
        assert rules_window(512, 1e-9, 1.0, tuned) == 512  # widening off
        pub = CoalescingPublisher(endpoint=inproc("pub"))
    try:
        assert pub._sender.pacing._policy is tuned
    finally:
        pub.shutdown()
    after = CoalescingPublisher(endpoint=inproc("pub"))
    try:
        assert after._sender.pacing._policy is DEFAULT_POLICY, "restored at the block's end"
    finally:
        after.shutdown()
    assert rules_window(512, 1e-9, 1.0) == DEFAULT_POLICY.widen_up_to * 512
    assert {"WIDEN_UP_TO", "WHOLE_FROM", "RECORD_WINDOW"} <= POLICY


def test_policy_refuses_a_name_it_does_not_know():
    with pytest.raises(ValueError, match="not a policy constant"), policy(YIELD_SOON=1):
        pass
    with pytest.raises(TypeError), hooks(nonsense=1):
        pass


def test_without_accelerator_turns_every_c_path_off_for_publishers_built_inside():
    with without_accelerator():
        pub = CoalescingPublisher(endpoint=inproc("pub"), loss_marker="resync")
    try:
        st = pub.stats()
        assert not st.compactor_accelerated and not st.native_send
        assert pub._feed is not None and not pub._feed.recorder.accelerated
    finally:
        pub.shutdown()
    out, _ = compactor.compact([batch(store(1)), batch(store(2, 1))], accelerated=False)
    assert len(out) == 1


def test_a_tap_sees_every_message_and_held_holds_the_sender():
    seen: list[int] = []
    with tapped(lambda topic, seq, payload: seen.append(seq)):
        pub = CoalescingPublisher(endpoint=inproc("pub"), max_queue_size=1, stall_timeout=0)
    try:
        with held(pub):
            assert pub.publish(batch(store(1))) is PublishOutcome.QUEUED
            assert pub.publish(batch(store(2))) is PublishOutcome.DROPPED  # nothing taken
        assert pub.flush(10.0)
        assert pub.publish(batch(store(3))) is PublishOutcome.QUEUED
        assert pub.flush(10.0)
        assert seen == [0, 1, 2]  # the batch, the loss marker, the next batch
    finally:
        pub.shutdown()
