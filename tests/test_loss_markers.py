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


def run(
    loss_marker: str, after: int = 31, snapshots: bool = False
) -> tuple[LlmdRulesConsumer, set[Any], CoalescingPublisher]:
    """31 steps, 23 with the sender held (most refused), then ``after`` steps;
    ``snapshots``: with a snapshot endpoint (24-byte live seq frames, heartbeats)."""
    port, rport = free_port(), free_port()
    pub = CoalescingPublisher(
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{rport}",
        snapshot_endpoint=f"tcp://*:{free_port()}" if snapshots else None,
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
            n = 31 if phase == "before" else after
            for j in range(i, i + n):
                assert pub.publish(step(j)) is PublishOutcome.QUEUED
                published.append(step(j))
                assert pub.flush(10.0)
                consumer.poll(0.001)
            i += n
        last = pub.stats().messages_sent + pub.stats().seq_gaps - 1

        def reached() -> bool:
            seen = consumer.last_live_seq
            if snapshots:  # (an idle second adds a heartbeat after it)
                return seen is not None and seen >= last
            return seen == last

        wait_for(
            lambda: consumer.poll(0.01) >= 0 and reached(),
            what="the consumer to see the last message",
        )
        consumer.poll(0.05)
    finally:
        consumer.close()
        pub.shutdown()
    return consumer, truth(published), pub


@pytest.mark.parametrize("snapshots", [False, True])
def test_a_loss_marker_keeps_llmd_contiguous_and_never_stale(snapshots):
    """With snapshots on, live seq frames are 24 bytes: llm-d-router (main, ebab687,
    pkg/kvevents/zmq_subscriber.go) takes the seq from their first 8 bytes, so the
    marker keeps it contiguous and never stale as with snapshots off."""
    consumer, want, pub = run("clear", snapshots=snapshots)
    st = pub.stats()
    assert st.batches_dropped > 0 and st.loss_markers >= 1 and st.seq_gaps == 0
    assert (pub.publisher_id is not None) is snapshots
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
            lambda: (
                pub.publish(KVEventBatch(0.0, [])) is PublishOutcome.QUEUED
                and pub.flush(5.0)
                and not sub.nothing_within(0.01)
            ),
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


@pytest.mark.parametrize("loss_marker", ["clear", "resync"])
def test_an_in_band_resync_leaves_llmd_with_the_whole_truth(loss_marker):
    """``loss_marker="resync"``: after the marker the publisher sends the state its
    recorder holds, before any later batch, so the consumer ends exact at once
    (with the marker alone, two steps after the loss it holds what they stored)."""
    consumer, want, pub = run(loss_marker, after=2)
    if loss_marker == "clear":
        assert consumer.held() < want and pub.stats().resyncs == 0
        return
    st = pub.stats()
    assert st.batches_dropped > 0 and st.loss_markers >= 1 and st.resyncs == st.loss_markers
    assert st.resync_events > 0 and st.snapshot_exact
    assert consumer.incomplete_replays == 0 and consumer.resets == 0
    assert consumer.held() == want


def test_a_resync_is_the_recorded_state_between_the_marker_and_the_next_batch(make_sub):
    """On the wire, once ``publish()`` refused a batch: the backlog collapses into the
    recorder (the 3 batches accepted are recorded, not sent), then the marker, the
    state of every batch published (every store of it; ancestors it no longer holds
    stored, then removed), then the batch accepted after the loss; nothing else."""
    from tests.conftest import decode, inproc

    ep = inproc("pub")
    sub = make_sub(ep)
    pub = CoalescingPublisher(
        endpoint=ep, max_queue_size=3, high_watermark=100, stall_timeout=0, loss_marker="resync"
    )
    try:
        published = [step(i) for i in range(20)]
        with held(pub):
            outcomes = [pub.publish(b) for b in published]
        assert outcomes.count(PublishOutcome.QUEUED) == 3
        assert pub.flush(10.0)
        after = step(20)
        assert pub.publish(after) is PublishOutcome.QUEUED
        assert pub.flush(10.0)
        st = pub.stats()
        msgs = sub.recv_until_seq(st.messages_sent - 1)
    finally:
        pub.shutdown()
    batches = [decode(m[2]) for m in msgs]
    assert [m[1] for m in msgs] == list(range(len(msgs)))
    assert batches[0].events == [AllBlocksCleared()], "the marker, where the first was"
    resync = [e for b in batches[1:-1] for e in b.events]
    assert len(resync) == st.resync_events
    assert batches[-1].events == after.events, "the next batch comes after the state"
    state = SubscriberModel("llmd")
    state.apply_batches([KVEventBatch(0.0, resync)])
    assert state.held() == truth(published), "the state of every published batch"
    assert st.resyncs == st.loss_markers == 1
    assert (st.batches_collapsed, st.batches_dropped) == (3, 17)


def test_past_snapshot_max_blocks_a_resync_falls_back_to_the_marker_alone_and_says_so(
    make_sub, caplog
):
    """With the default ``loss_marker=resync`` and a recorder that cannot hold the
    engine's blocks (``snapshot_max_blocks=4``, the engine keeps 12): the log says
    that a loss is told by its marker alone, and one is, with no resync after it:
    the stream stays contiguous and a consumer keeps nothing stale."""
    import logging

    from tests.conftest import decode, inproc

    ep = inproc("pub")
    sub = make_sub(ep)
    pub = CoalescingPublisher(
        endpoint=ep, max_queue_size=3, high_watermark=100, stall_timeout=0, snapshot_max_blocks=4
    )
    assert pub.settings.loss_marker == "resync"
    published = [step(i) for i in range(40)]
    with caplog.at_level(logging.WARNING, logger="coalesce"):
        try:
            for b in published[:20]:
                assert pub.publish(b) is PublishOutcome.QUEUED
                assert pub.flush(10.0)
            with held(pub):
                outcomes = [pub.publish(b) for b in published[20:-1]]
            assert PublishOutcome.DROPPED in outcomes
            assert pub.flush(10.0)
            assert pub.publish(published[-1]) is PublishOutcome.QUEUED  # the marker first
            assert pub.flush(10.0)
            st = pub.stats()
            msgs = sub.recv_until_seq(st.messages_sent - 1)
        finally:
            pub.shutdown()
    said = [r.getMessage() for r in caplog.records if "not exact" in r.getMessage()]
    assert said and "snapshot_max_blocks=4" in said[0] and "its marker alone" in said[0], said
    assert st.loss_markers == 1 and st.resyncs == 0 and st.resync_events == 0
    assert not st.snapshot_exact
    assert [m[1] for m in msgs] == list(range(len(msgs)))
    model = SubscriberModel("llmd")
    model.apply_batches([decode(m[2]) for m in msgs])
    assert model.held() <= truth(published), "nothing stale"


def overloaded(pub: CoalescingPublisher, rounds: int, burst: int) -> list[KVEventBatch]:
    """``rounds`` bursts of ``burst`` steps each published while the sender is held
    (most refused), each released before the next: an overload that persists and
    repeats.  Returns every batch published, refused or not."""
    published: list[KVEventBatch] = []
    for r in range(rounds):
        with held(pub):
            for i in range(r * burst, (r + 1) * burst):
                published.append(step(i))
                pub.publish(published[-1])
        assert pub.flush(10.0)
    return published


def test_a_backlog_past_its_budget_collapses_into_state_however_often(make_sub):
    """The state is three times the event budget, and the overload comes back five
    times: each time the backlog collapses into the recorder and a resync follows
    the marker; the recorder stays exact (no refused batch waits past its bound),
    and a consumer ends with the engine's state."""
    from tests.conftest import decode, inproc

    ep = inproc("pub")
    sub = make_sub(ep)
    pub = CoalescingPublisher(
        endpoint=ep,
        max_queue_size=3,
        stall_timeout=0,
        max_pending_events=4,  # the state below holds 12 blocks
        loss_marker="resync",
    )
    try:
        published = overloaded(pub, rounds=5, burst=40)
        st = pub.stats()
        msgs = sub.recv_until_seq(st.messages_sent - 1)
    finally:
        pub.shutdown()
    consumer = SubscriberModel("llmd")
    consumer.apply_batches([decode(m[2]) for m in msgs])
    assert consumer.held() == truth(published)
    assert st.batches_dropped > 100 and st.loss_markers >= 5 and st.resyncs >= 5
    assert st.snapshot_exact and st.snapshot_blocks == KEEP


def test_the_seed_workload_under_a_small_budget_ends_exact_for_every_consumer():
    """The overload a new user forces: an event budget of 3,000 and a seed-like engine
    whose sender is held for 150 steps out of every 200 (each hold refuses most of
    what comes), four times, the engine never waiting for it, every other setting
    left at its default.  llm-d's rules (with replay), vLLM's decoder on a refcount
    model, and ``coalesce.subscriber`` each end with the engine's state."""
    from coalesce.subscriber import Subscriber
    from coalesce_tools.workload import Engine, WorkloadConfig
    from tests.conftest import Sub, decode

    engine = Engine(
        WorkloadConfig(ranks=1, steps=800, burst_every=200, burst_length=20, burst_requests=4)
    )
    port, rport = free_port(), free_port()
    pub = CoalescingPublisher(
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{rport}",
        max_pending_events=3000,
        stall_timeout=0,
    )
    assert pub.settings.loss_marker == "resync"  # the default
    ep, rep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    llmd = LlmdRulesConsumer(ep, rep, clock=FrozenClock())
    ours = Subscriber(ep, rep)
    raw = Sub(ep, replay=rep)
    try:

        def steps(n: int) -> None:
            for _ in range(n):
                pub.publish(KVEventBatch(ts=0.0, events=engine.step(), data_parallel_rank=0))
                llmd.poll(0)
                ours.poll(0)

        steps(1)  # both consumers join: llm-d's proactive replay finds this batch
        assert pub.flush(10.0)
        wait_for(
            lambda: llmd.poll(0.01) >= 0 and ours.poll(0.01) >= 0 and llmd.last_seq == 0,
            what="llm-d's consumer to join",
        )
        for _ in range(4):
            with held(pub):
                steps(150)
            steps(50)
        assert pub.flush(30.0)
        st = pub.stats()
        last = st.messages_sent - 1

        def caught_up() -> bool:
            llmd.poll(0.01)
            ours.poll(0.01)
            return llmd.last_seq == last and ours.sources[0].last_seq == last

        wait_for(caught_up, timeout=30, what="the consumers to reach the last message")
        decoded = [decode(m[2]) for m in raw.replay(0)]
    finally:
        llmd.close()
        ours.close()
        raw.close()
        pub.shutdown()
    want = engine.truth()
    assert st.batches_dropped > 100 and st.resyncs == st.loss_markers >= 1 and st.snapshot_exact
    assert len(decoded) == st.messages_sent, "every message is in the replay buffer"
    assert SubscriberModel("refcount").apply_batches(decoded).held() == want
    assert llmd.held() == want
    assert llmd.incomplete_replays == 0 and llmd.resets == 0
    assert ours.sources[0].index.held() == want and not ours.sources[0].partial


@pytest.mark.parametrize("identity", ["seq", "batch"])
def test_where_the_publisher_id_goes_decides_whether_llmd_main_reads_the_stream(identity):
    """Snapshots on.  ``seq`` (the default): the id after the seq, which llm-d-router
    main reads from the first 8 bytes, so it applies every batch.  ``batch`` (PR
    #57789's newest revision): a 4th batch element, and llm-d-router main's decoder
    (3 elements exactly) drops every batch: the pod's index stays empty."""
    port = free_port()
    pub = CoalescingPublisher(
        endpoint=f"tcp://*:{port}",
        snapshot_endpoint=f"tcp://*:{free_port()}",
        snapshot_identity=identity,
    )
    consumer = LlmdRulesConsumer(f"tcp://127.0.0.1:{port}", None, clock=FrozenClock())
    try:
        wait_for(
            lambda: (
                pub.publish(step(0)) is PublishOutcome.QUEUED
                and pub.flush(5.0)
                and consumer.poll(0.01) > 0
            ),
            what="the consumer to join",
        )
        for i in range(1, 20):
            pub.publish(step(i))
        assert pub.flush(5.0)
        last = pub.stats().messages_sent - 1
        wait_for(
            lambda: consumer.poll(0.01) >= 0 and (consumer.last_live_seq or 0) >= last,
            what="the last message",
        )
    finally:
        consumer.close()
        pub.shutdown()
    if identity == "seq":
        assert consumer.skipped == 0 and consumer.applied > 1 and consumer.held()
    else:
        assert consumer.applied == 0 and consumer.skipped > 1 and not consumer.held()
