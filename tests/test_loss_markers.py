"""Forced losses, read by a consumer that follows llm-d-router's rules
(tests/llmd_rules.py): a loss marker keeps its replay contiguous and its index
free of stale blocks; a gap, under the same rules, blacks the pod out.

The losses are forced as a user would hit them: the sender held still while
the engine publishes past ``max_queue_size`` (``stall_timeout=0``), on real tcp
sockets, with a replay endpoint as llm-d is configured.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from coalesce import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CoalescingPublisher,
    KVEventBatch,
    PublishOutcome,
)
from coalesce.refmodel import SubscriberModel
from tests.conftest import Sub, free_port, held, wait_for
from tests.llmd_rules import LlmdRulesConsumer

PROMPT = 5  # blocks per prompt: each chained to the one before
KEEP = 12  # blocks the engine keeps: each batch evicts the block KEEP back


def step(i: int) -> KVEventBatch:
    """One engine step: a prompt's next block stored, the oldest block evicted."""
    parent = None if i % PROMPT == 0 else i - 1
    events: list[Any] = [BlockStored([i], parent, [i] * 4, 4, None, "GPU", None)]
    if i >= KEEP:
        events.append(BlockRemoved([i - KEEP], "GPU"))
    return KVEventBatch(ts=float(i), events=events, data_parallel_rank=0)


def truth(batches: list[KVEventBatch]) -> set[Any]:
    """What a consumer under llm-d's rules holds after every published batch."""
    model = SubscriberModel("llmd")
    for b in batches:
        for ev in b.events:
            model.apply_event(ev)
    return model.held()


class FrozenClock:
    """llm-d's 30 s cooldown, never over within the test."""

    def __call__(self) -> float:
        return 1000.0


def run(loss_marker: str) -> tuple[LlmdRulesConsumer, set[Any], CoalescingPublisher]:
    port, rport = free_port(), free_port()
    pub = CoalescingPublisher(
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{rport}",
        max_queue_size=3,
        high_watermark=1,
        stall_timeout=0,
        loss_marker=loss_marker,
    )
    consumer = LlmdRulesConsumer(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", clock=FrozenClock()
    )
    published: list[KVEventBatch] = []
    try:
        i = 0
        for phase in ("before", "loss", "after"):
            if phase == "loss":
                with held(pub):  # the engine bursts while its sender cannot run
                    outcomes = [pub.publish(step(j)) for j in range(i, i + 23)]
                assert PublishOutcome.DROPPED in outcomes
                published += [step(j) for j in range(i, i + 23)]
                i += 23
                assert pub.flush(10.0)
                continue
            for j in range(i, i + 31):
                assert pub.publish(step(j)) is PublishOutcome.QUEUED
                published.append(step(j))
                assert pub.flush(10.0)
                consumer.poll(0.001)
            i += 31
        last = pub.stats().messages_sent + pub.stats().seq_gaps - 1
        wait_for(
            lambda: consumer.poll(0.01) >= 0 and consumer.last_live_seq == last,
            what="the consumer to see the last message",
        )
        consumer.poll(0.05)
    finally:
        consumer.close()
        pub.shutdown()
    return consumer, truth(published), pub


def test_a_loss_marker_keeps_llmd_contiguous_and_never_stale():
    consumer, want, pub = run("clear")
    st = pub.stats()
    assert st.batches_dropped > 0 and st.loss_markers >= 1 and st.seq_gaps == 0
    assert consumer.incomplete_replays == 0 and consumer.resets == 0
    assert consumer.dropped_in_cooldown == 0 and consumer.clears == st.loss_markers
    held_now = consumer.held()
    assert held_now <= want, f"stale blocks: {sorted(held_now - want)}"
    assert len(held_now) * 2 >= len(want), "it forgot the loss, then refilled"


def test_a_gap_under_llmds_rules_blacks_the_pod_out():
    """Why the marker is the default: llm-d-router (main, ebab687) asks replay
    for the skipped seq, finds it missing ("incomplete replay"), resets the pod
    and turns replay off for 30 s, dropping every message after that gap."""
    consumer, want, pub = run("gap")
    assert pub.stats().seq_gaps >= 1
    assert consumer.incomplete_replays >= 1 and consumer.resets >= 1
    assert consumer.held() == set() and want, "blacked out while the engine holds blocks"


def test_a_marker_is_a_batch_of_one_clear_for_the_rank():
    """What every consumer decodes: vLLM's shape, this rank, nothing else."""
    pub = CoalescingPublisher(
        data_parallel_rank=2, endpoint="tcp://*:0", max_queue_size=1, stall_timeout=0
    )
    try:
        sub = Sub(f"tcp://127.0.0.1:{pub.config.endpoint.rsplit(':', 1)[1]}")
        wait_for(
            lambda: pub.publish(KVEventBatch(0.0, [])) is PublishOutcome.QUEUED
            and pub.flush(5.0)
            and not sub.nothing_within(0.01),
            what="the subscriber to join",
        )
        with held(pub):
            assert pub.publish(KVEventBatch(1.0, [])) is PublishOutcome.QUEUED
            assert pub.publish(KVEventBatch(2.0, [])) is PublishOutcome.DROPPED
        assert pub.flush(5.0)
        assert pub.publish(KVEventBatch(3.0, [])) is PublishOutcome.QUEUED
        assert pub.flush(5.0)
        last = pub.stats().messages_sent - 1
        msgs = sub.recv_until_seq(last)
        seqs = [m[1] for m in msgs]
        assert seqs == list(range(seqs[0], last + 1)), "no hole"
        marker = msgspec.msgpack.decode(msgs[-2][2], type=KVEventBatch)
        assert marker.events == [AllBlocksCleared()] and marker.data_parallel_rank == 2
        assert msgspec.msgpack.decode(msgs[-2][2])[1] == [{"type": "AllBlocksCleared"}]
    finally:
        pub.shutdown()


@pytest.mark.parametrize("value", ["CLEAR", " gap "])
def test_the_policy_comes_from_the_environment_too(monkeypatch, value):
    from coalesce import Settings

    monkeypatch.setenv("COALESCE_LOSS_MARKER", value)
    assert Settings.resolve().loss_marker == value.strip().lower()
