"""Snapshots (opt-in, vLLM PR #57789's protocol) over real ZeroMQ sockets."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CoalescingPublisher,
    KVEventBatch,
    PublishOutcome,
)
from coalesce._recorder import CHUNK_EVENTS
from coalesce.refmodel import SubscriberModel
from coalesce.subscriber import Subscriber, decode_batch, publisher_id
from tests.conftest import held, inproc, wait_for
from tests.streams import batch_lists


def store(hs: list[int], parent: int | None, medium: str = "GPU", tokens: Any = None) -> Any:
    toks = [h * 4 + i for h in hs for i in range(4)] if tokens is None else tokens
    return BlockStored(hs, parent, toks, 4, None, medium, None)


def batch(*events: Any, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts, list(events), 0)


def offload(i: int) -> KVEventBatch:
    evs: list[Any] = [store([i + 1], i or None)]
    if i >= 4:
        evs += [BlockRemoved([i - 3], "GPU"), store([i - 3], (i - 4) or None, "CPU")]
    return batch(*evs, ts=float(i))


def truth(batches: list[Any], mode: Any = "refcount") -> dict[Any, int]:
    return SubscriberModel(mode).apply_batches(batches).state()


@pytest.fixture
def snap_pub():
    made: list[CoalescingPublisher] = []

    def make(ep: str | None = None, **kw: Any) -> tuple[CoalescingPublisher, str, str]:
        ep, snap = ep or inproc("pub"), inproc("snap")
        p = CoalescingPublisher(endpoint=ep, snapshot_endpoint=snap, **kw)
        made.append(p)
        return p, ep, snap

    yield make
    for p in made:
        p.shutdown()


def request(endpoint: str, *, req: bool = False, timeout: float = 10.0) -> list[bytes]:
    sock = zmq.Context.instance().socket(zmq.REQ if req else zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(b"snapshot")
        assert sock.poll(int(timeout * 1000)), "no snapshot reply"
        return sock.recv_multipart()
    finally:
        sock.close()


def reply_state(frames: list[bytes], mode: Any = "refcount") -> tuple[int, SubscriberModel]:
    seq = int.from_bytes(frames[0], "big", signed=True)
    model = SubscriberModel(mode)
    for chunk in frames[2:]:
        raw = msgspec.msgpack.decode(chunk)
        assert len(raw) == 3 and len(raw[1]) <= CHUNK_EVENTS, "chunks are plain batches"
        _, events, _, _ = decode_batch(chunk)
        for ev in events:
            model.apply_event(ev)
    return seq, model


def test_off_by_default_the_wire_is_vllms(make_sub):
    ep = inproc("pub")
    sub = make_sub(ep)  # inproc: connected before the bind, so it hears everything
    with CoalescingPublisher(endpoint=ep) as p:
        p.publish(offload(0))
        (_, _, payload) = sub.recv()
        assert len(msgspec.msgpack.decode(payload)) == 3
        assert len(sub.seq_frames[0]) == 8 and publisher_id(sub.seq_frames[0]) is None
        assert p.publisher_id is None and p.get_publisher_config().snapshot_endpoint is None
        assert p.stats().snapshot_exact  # the recorder runs for loss_marker=resync, the default
    with CoalescingPublisher(endpoint=inproc("pub-clear"), loss_marker="clear") as p:
        assert not p.stats().snapshot_exact  # no recorder at all


def test_live_messages_carry_the_publisher_id_in_a_4th_element_and_an_idle_publisher_beats(
    snap_pub, make_sub
):
    """PR #57789's newest revision (vllm-project/vllm 2c481a4b, ``IdentifiedKVEventBatch``):
    8-byte seq frames, the 16-byte id as a 4th batch element, vLLM's 3 elements before
    it byte for byte; vLLM's own types decode it (the extra element ignored)."""
    ep = inproc("pub")
    sub = make_sub(ep)
    p, _, snap = snap_pub(ep, snapshot_identity="batch")
    assert p.publisher_id is not None and len(p.publisher_id) == 16
    b = offload(5)
    p.publish(b)
    (_, first, payload) = sub.recv()
    plain = msgspec.msgpack.encode(b)
    assert payload == b"\x94" + plain[1:] + b"\xc4\x10" + p.publisher_id
    assert msgspec.msgpack.decode(payload)[3] == p.publisher_id
    assert msgspec.msgpack.decode(payload, type=KVEventBatch) == b
    assert sub.seq_frames[0] == first.to_bytes(8, "big")
    assert publisher_id(sub.seq_frames[0], payload) == p.publisher_id
    # nothing published: within a few seconds an empty batch takes the next seq
    (_, seq, payload) = sub.recv(timeout=5.0)
    assert seq == first + 1 and len(sub.seq_frames[1]) == 8
    assert msgspec.msgpack.decode(payload)[1:] == [[], 0, p.publisher_id]
    config = p.get_publisher_config()
    assert config.snapshot_endpoint == snap and config.snapshot_max_blocks == 1_000_000


def test_with_the_id_in_the_seq_frame_the_payload_is_vllms_and_replay_has_8_bytes(make_sub):
    """The default, ``snapshot_identity="seq"``, the PR's earlier revisions (vMaroon/vllm
    08ee3e5): the seq frame is the 8-byte seq then the 16-byte id, the payload vLLM's
    byte for byte; as the PR's replay there, the id is on live messages only."""
    ep, replay, snap = inproc("pub"), inproc("replay"), inproc("snap")
    sub = make_sub(ep, replay=replay)
    with CoalescingPublisher(endpoint=ep, replay_endpoint=replay, snapshot_endpoint=snap) as p:
        b = offload(1)
        p.publish(b)
        (_, seq, payload) = sub.recv()
        assert payload == msgspec.msgpack.encode(b), "the payload is vLLM's, byte for byte"
        assert sub.seq_frames[0] == seq.to_bytes(8, "big") + p.publisher_id
        assert publisher_id(sub.seq_frames[0], payload) == p.publisher_id
        assert sub.replay(seq)[0] == (b"", seq, payload)


@pytest.mark.parametrize("req", [False, True], ids=["dealer", "req"])
def test_a_snapshot_is_the_state_of_every_batch_sent(snap_pub, req):
    p, _, snap = snap_pub()
    batches = [offload(i) for i in range(60)] + [batch(BlockRemoved([3, 9], "CPU"))]
    for b in batches:
        p.publish(b)
    assert p.flush(10.0)
    frames = request(snap, req=req)
    seq, model = reply_state(frames)
    assert frames[1] == p.publisher_id
    sent = p.stats().messages_sent
    assert seq <= sent - 1
    assert model.state() == truth(batches)
    for mode in ("llmd", "dynamo"):
        _, strict = reply_state(frames, mode)
        assert strict.dropped_stores == 0 and strict.state() == truth(batches, mode)
    wait_for(lambda: p.stats().snapshot_replies == 1, what="the reply to be counted")
    assert p.stats().snapshot_blocks == len(truth(batches))


@pytest.fixture
def service():
    """A recorder's feed and a snapshot server on an inproc ROUTER, and a DEALER
    connected to it."""
    from coalesce._feed import Feed
    from coalesce._recorder import Recorder
    from coalesce._snapshot import SnapshotServer
    from coalesce.testing import policy

    ctx, ep = zmq.Context.instance(), inproc("snap")
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(ep)
    dealer.connect(ep)
    made: list[Any] = []

    def make(max_deferred_events: int = 10_000, **tuning: Any) -> tuple[Any, Any, Any]:
        with policy(**tuning) as tuned:
            feed = Feed(Recorder(10_000), max_deferred_events=max_deferred_events, policy=tuned)
        server = SnapshotServer(router, feed, b"p", 0, max_response_bytes=1 << 30)
        made.append(server)
        return feed, server, dealer

    yield make
    for server in made:
        server.close()
    dealer.close(linger=0)


def test_a_reply_covers_what_the_feed_had_gathered(service):
    """Batches the feed gathers (not yet a window) are recorded before a reply is
    built: the reply for a seq covers every batch given before it."""

    feed, server, dealer = service(RECORD_WINDOW=10**6)
    batches = [offload(i) for i in range(6)]
    feed.record(batches)
    assert feed.recorder.held == 0, "gathered: a window is not full yet"
    dealer.send(b"snapshot")
    wait_for(lambda: server.step(lambda: 41) and not server.busy, what="the reply")
    assert dealer.poll(10_000), "no snapshot reply"
    seq, model = reply_state(dealer.recv_multipart())
    assert seq == 41 and model.state() == truth(batches)


def test_batches_after_an_abandoned_reply_are_recorded_in_order(service):
    """The deferred list outgrows its bound in the middle of a list of batches: the
    reply is abandoned, and the rest of the list is recorded, in order."""
    feed, server, dealer = service(max_deferred_events=2)
    before = [offload(i) for i in range(4)]
    feed.record(before)
    dealer.send(b"snapshot")
    wait_for(lambda: server.step(lambda: 3) and server.busy, what="a reply to start")
    # the first is past the bound; the last, alone, is not
    after = [offload(i) for i in range(4, 8)] + [batch(store([99], None))]
    feed.record(after)
    feed.settle()
    assert feed.recorder.state() == truth(before + after)
    assert dealer.poll(10_000) and dealer.recv_multipart()[0] == (-2).to_bytes(
        8, "big", signed=True
    )


def test_nothing_sent_yet_is_minus_one(snap_pub):
    p, _, snap = snap_pub()
    frames = request(snap)
    if p.stats().messages_sent == 0:  # no heartbeat yet (it comes after a second)
        assert frames[:2] == [(-1).to_bytes(8, "big", signed=True), p.publisher_id]
        assert len(frames) == 2


def test_bad_requests_are_ignored_and_counted_and_two_clients_get_the_same_state(snap_pub):
    p, _, snap = snap_pub()
    for i in range(30):
        p.publish(offload(i))
    assert p.flush(10.0)
    ctx = zmq.Context.instance()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(snap)
    bad.send(b"nope")
    bad.send_multipart([b"snapshot", b"extra"])
    wait_for(lambda: p.stats().snapshot_invalid == 2, what="both bad requests counted")
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(snap)
        s.send(b"snapshot")
    got = []
    for s in (a, b):
        assert s.poll(10_000)
        got.append(s.recv_multipart())
        s.close()
    assert not bad.poll(100), "a bad request gets no answer"
    bad.close()
    assert (
        reply_state(got[0])[1].state()
        == reply_state(got[1])[1].state()
        == truth([offload(i) for i in range(30)])
    )


def test_batches_refused_over_budget_still_reach_the_snapshot(snap_pub):
    p, _, snap = snap_pub(max_queue_size=3, high_watermark=1, stall_timeout=0)
    batches = [offload(i) for i in range(40)]
    with held(p):
        outcomes = [p.publish(b) for b in batches[:30]]
    assert PublishOutcome.DROPPED in outcomes
    assert p.flush(10.0)
    for b in batches[30:]:
        assert p.publish(b) is PublishOutcome.QUEUED
        assert p.flush(10.0)
    s = p.stats()
    assert s.batches_dropped > 0 and s.loss_markers > 0 and s.snapshot_exact
    _, model = reply_state(request(snap))
    assert model.state() == truth(batches), "the refused batches are in the state"


def test_an_unencodable_batch_makes_snapshots_unavailable_until_a_clear(snap_pub):
    p, _, snap = snap_pub()
    p.publish(batch(store([1], None)))
    p.publish(batch(store([2], 1, tokens=[object()])))  # lost at encode: a gap
    assert p.flush(10.0)
    assert p.stats().encode_failures == 1
    frames = request(snap)
    assert int.from_bytes(frames[0], "big", signed=True) == -2
    wait_for(lambda: p.stats().snapshot_unavailable == 1, what="the -2 to be counted")
    assert not p.stats().snapshot_exact
    p.publish(batch(AllBlocksCleared(), store([7], None)))
    assert p.flush(10.0)
    assert p.stats().snapshot_exact
    seq, model = reply_state(request(snap))
    assert seq >= 0 and model.state() == {("GPU", None, 7): 1}


class _BareStore(msgspec.Struct, tag="BlockStored"):
    """A caller's store with only some of the fields."""

    block_hashes: list[int]
    parent_block_hash: int | None
    medium: str | None


def test_a_callers_store_is_served_as_it_was_published(snap_pub):
    p, _, snap = snap_pub()
    p.publish(batch(store([1], None), _BareStore([2], 1, "GPU")))
    assert p.flush(10.0)
    frames = request(snap)
    assert int.from_bytes(frames[0], "big", signed=True) >= 0
    (chunk,) = frames[2:]
    _, events, _ = msgspec.msgpack.decode(chunk)
    assert events[1] == {
        "type": "BlockStored",
        "block_hashes": [2],
        "parent_block_hash": 1,
        "medium": "GPU",
    }


@pytest.mark.parametrize("loss_marker", ["gap", "clear"])
def test_a_subscriber_heals_a_loss_with_a_snapshot_instead_of_a_reset(snap_pub, loss_marker):
    """A gap replay cannot fill, or a loss marker: either way the subscriber asks
    for a snapshot and ends with the truth, never resetting the source."""
    tight = {"high_watermark": 1, "stall_timeout": 0}
    p, ep, snap = snap_pub(max_queue_size=3, loss_marker=loss_marker, **tight)
    batches: list[Any] = []
    with Subscriber(ep, mode="refcount", snapshot_endpoints=snap) as sub:
        wait_for(lambda: _heard(p, sub), what="the subscriber to hear the publisher")
        batches += [offload(i) for i in range(8)]
        for b in batches:
            p.publish(b)
        with held(p):
            more = [offload(i) for i in range(8, 40)]
            outcomes = [p.publish(b) for b in more]
        batches += more
        assert PublishOutcome.DROPPED in outcomes
        assert p.flush(10.0)
        tail = [offload(i) for i in range(40, 50)]
        batches += tail
        for b in tail:
            assert p.publish(b) is PublishOutcome.QUEUED
            assert p.flush(10.0)
        last = p.stats().messages_sent + p.stats().seq_gaps - 1
        wait_for(lambda: _caught_up(sub, last), what="the subscriber to reach the last seq")
        p.shutdown()
        src = sub.sources[0]
        if loss_marker == "gap":
            assert src.gaps >= 1 and src.recovered >= 1
        else:  # no hole in the sequence: the marker's clear starts the bootstrap
            assert src.gaps == 0 and src.events["AllBlocksCleared"] >= 1 and src.snapshots >= 2
        assert src.resets == 0
        assert src.index.state() == truth(batches)


def test_messages_the_subscribers_queue_dropped_are_healed_by_a_snapshot(snap_pub):
    """A loss the publisher never sees: a subscriber that stopped reading, at its HWM."""
    p, ep, snap = snap_pub(hwm=1)
    batches: list[Any] = []
    with Subscriber(ep, mode="refcount", snapshot_endpoints=snap, rcvhwm=1) as sub:
        wait_for(lambda: _heard(p, sub), what="the subscriber to hear the publisher")
        burst = [offload(i) for i in range(200)]  # 1:1 messages, with nobody reading
        for b in burst:
            assert p.publish(b) is PublishOutcome.QUEUED
            assert p.flush(10.0)
        batches += burst
        st_ = p.stats()
        assert st_.batches_dropped == 0 and st_.seq_gaps == 0, "the publisher lost nothing"
        tail = [offload(i) for i in range(200, 210)]
        batches += tail
        for b in tail:
            assert p.publish(b) is PublishOutcome.QUEUED
            assert p.flush(10.0)
        last = p.stats().messages_sent - 1
        wait_for(lambda: _caught_up(sub, last), what="the subscriber to reach the last seq")
        src = sub.sources[0]
        assert src.gaps >= 1, "the subscriber's queue dropped messages: a gap"
        assert src.recovered >= 1 and src.resets == 0
        assert src.index.state() == truth(batches)


def _heard(p: CoalescingPublisher, sub: Subscriber) -> bool:
    """Publish a no-op until the subscriber has applied one (the SUB slow-joiner)."""
    if sub.sources[0].last_seq is None:
        p.publish(batch())
        sub.poll(0.05)
    return sub.sources[0].last_seq is not None


def _caught_up(sub: Subscriber, last: int) -> bool:
    sub.poll(0.05)
    seq = sub.sources[0].last_seq
    return seq is not None and seq >= last


def test_a_large_snapshot_is_served_while_live_traffic_flows(snap_pub):
    p, ep, snap = snap_pub()
    batches = [
        batch(store(list(range(c * 1000 + 1, c * 1000 + 101)), None), ts=float(c))
        for c in range(300)
    ]  # 30,000 blocks held
    for b in batches:
        p.publish(b)
    assert p.flush(20.0)
    stop = threading.Event()
    live: list[Any] = []

    def engine() -> None:  # keeps publishing while the snapshot is built and sent
        i = 0
        while not stop.is_set() and i < 5000:
            b = offload(400_000 + i)
            live.append(b)
            p.publish(b)
            i += 1
            stop.wait(0.0005)

    with Subscriber(ep, mode="refcount", snapshot_endpoints=snap) as sub:
        t = threading.Thread(target=engine)
        t.start()
        try:
            wait_for(lambda: sub.poll(0.05) >= 0 and sub.sources[0].snapshots == 1, 30.0)
        finally:
            stop.set()
            t.join()
        assert p.flush(20.0)
        last = p.stats().messages_sent - 1
        wait_for(lambda: _caught_up(sub, last), 30.0, "the subscriber to catch up")
        src = sub.sources[0]
        assert src.resets == 0 and src.snapshots == 1
        assert src.index.state() == truth(batches + live)
        assert len(src.index.state()) > 30_000


@settings(max_examples=25, deadline=None)
@given(batch_lists(), st.data())
def test_snapshot_plus_suffix_is_the_truth_whatever_is_lost(batches, data):
    """Losses at random points (refused over budget, lost at encode, dropped by the
    subscriber's full queue): the subscriber heals with snapshots and ends with the
    refcount state of everything published."""
    ep, snap = inproc("pub"), inproc("snap")
    published: list[Any] = []
    hwm = 32  # each side's queue: messages past both are dropped (the publisher never knows)
    overflowed = lost_at_encode = False
    with (
        CoalescingPublisher(
            endpoint=ep,
            snapshot_endpoint=snap,
            max_queue_size=2,
            high_watermark=1,
            stall_timeout=0,
            hwm=hwm,
        ) as p,
        Subscriber(ep, mode="refcount", snapshot_endpoints=snap, rcvhwm=hwm) as sub,
    ):
        wait_for(lambda: _heard(p, sub), what="the subscriber to hear the publisher")
        for b in batches:
            how = data.draw(st.sampled_from(("send", "send", "refuse", "bad", "hwm")))
            if how != "hwm" and data.draw(st.booleans()):
                assert p.flush(10.0)
                sub.poll(0)  # read what has arrived (and heal what was lost)
            if how == "refuse":
                with held(p):
                    for extra in (batch(), batch()):
                        p.publish(extra)
                    p.publish(b)  # refused: the hand-off is full
            elif how == "bad":
                lost_at_encode = True  # its effect is unknown: -2 until a clear
                p.publish(batch(store([999], None, tokens=[object()])))  # lost at encode
                p.publish(batch(BlockRemoved([999], "GPU")))
                published.extend([batch(store([999], None)), batch(BlockRemoved([999], "GPU"))])
                p.publish(b)
            elif how == "hwm":  # sent, then lost in the queues while nobody reads
                assert p.flush(10.0)
                sub.poll(0)
                p.publish(b)
                assert p.flush(10.0)
                for _ in range(3 * hwm):
                    assert p.publish(batch()) is PublishOutcome.QUEUED
                    assert p.flush(10.0)
                overflowed = True
            else:
                p.publish(b)
            published.append(b)
        assert p.flush(10.0)  # a loss shows at the next accepted batch: make sure there is one
        assert p.publish(batch(store([12345], None))) is PublishOutcome.QUEUED
        published.append(batch(store([12345], None)))
        assert p.flush(10.0)
        s = p.stats()
        last = s.messages_sent + s.seq_gaps - 1
        wait_for(lambda: _caught_up(sub, last), what="the subscriber to reach the last seq")
        src = sub.sources[0]
        if overflowed:  # a gap, unless a later bootstrap (after a clear) was cut past them
            assert src.gaps >= 1 or src.snapshots > 1, "the subscriber's queue dropped messages"
        if not lost_at_encode:  # nothing made the recorder unavailable
            assert s.snapshot_exact and s.snapshot_unavailable == 0
        if s.snapshot_unavailable == 0:  # every snapshot asked for was given
            assert src.resets == 0
        if s.snapshot_exact:  # (a clear since any -2 made the state exact again)
            assert src.index.state() == truth(published)


@pytest.mark.parametrize("loss_marker", ["clear", "resync", "gap"])
def test_snapshots_with_a_marker_that_is_no_gap_warn_of_llmd_routers_snapshot_reader(
    caplog, loss_marker
):
    """llm-d-router's snapshot subscriber (its PR #2946) heals only on a seq gap and
    clears only the GPU tier on an AllBlocksCleared (tests_vllm: the case run)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="coalesce"):
        p = CoalescingPublisher(
            endpoint=inproc("pub"), snapshot_endpoint=inproc("snap"), loss_marker=loss_marker
        )
        p.shutdown()
    said = [m for r in caplog.records if "PR #2946" in (m := r.getMessage()) and "seq gap" in m]
    assert len(said) == (0 if loss_marker == "gap" else 1)
    if said:
        assert f"loss_marker={loss_marker}" in said[0] and "loss_marker=gap heals" in said[0]


@pytest.mark.parametrize("snapshots", [False, "batch", "seq"])
def test_turning_snapshots_on_warns_once_of_the_consumers_that_cannot_read_them(caplog, snapshots):
    import logging

    with caplog.at_level(logging.WARNING, logger="coalesce"):
        p = CoalescingPublisher(
            endpoint=inproc("pub"),
            snapshot_endpoint=inproc("snap") if snapshots else None,
            snapshot_identity=snapshots or "seq",
        )
        p.shutdown()
    named = [r for r in caplog.records if "Dynamo" in r.getMessage()]
    assert len(named) == (1 if snapshots else 0)
    if snapshots:
        said = named[0].getMessage()
        assert named[0].levelno == logging.WARNING
        if snapshots == "seq":
            assert "24 bytes" in said and "example subscriber" in said
        else:
            assert "4 elements" in said and "llm-d-router without its PR #2946" in said
