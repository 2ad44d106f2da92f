"""The reference subscriber: decoding, gaps, replay, resets; against a real publisher."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from coalesce import BlockMoved, BlockRemoved, BlockStored, CoalescingPublisher, KVEventBatch
from coalesce.refmodel import SubscriberModel
from coalesce.subscriber import Subscriber, decode_batch
from tests.conftest import free_port, held, inproc, wait_for


def store(h: int, parent: int | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored([h], parent, [h, h], 2, None, medium, None)


def batch(*events: Any) -> KVEventBatch:
    return KVEventBatch(1.0, list(events))


def chain_batches(n: int) -> list[KVEventBatch]:
    out = []
    for i in range(n):
        evs: list[Any] = [store(i + 1, i or None)]
        if i % 7 == 6:
            evs += [BlockRemoved([i - 2], "GPU"), store(i - 2, (i - 3) or None, "CPU")]
        out.append(batch(*evs))
    return out


def truth(batches: list[KVEventBatch]) -> dict[Any, int]:
    return SubscriberModel("llmd").apply_batches(batches).state()


def drain(sub: Subscriber, pub: CoalescingPublisher, source: int = 0) -> None:
    """Poll until the subscriber has everything the publisher sent (bounded)."""
    assert pub.flush(10)
    target = pub.stats().messages_sent + pub.stats().seq_gaps - 1
    for _ in range(500):
        last = sub.sources[source].last_seq
        if last is not None and last >= target:
            return
        sub.poll(0.02)
    raise AssertionError(f"subscriber stuck at seq {sub.sources[source].last_seq} < {target}")


def test_decodes_maps_legacy_arrays_unknown_tags_and_fields():
    enc = msgspec.msgpack.encode
    legacy = ["BlockStored", [1], None, [7, 7], 2, None, "GPU", None]
    unknown = {"type": "BlockTeleported", "block_hashes": [9]}
    extra_field = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "new": 1}
    moved = msgspec.to_builtins(BlockMoved([3], None, [], 2, None, "GPU", "CPU", None))
    ts, events, rank, n_unknown = decode_batch(enc([2.5, [legacy, unknown, extra_field, moved], 4]))
    assert (ts, rank, n_unknown) == (2.5, 4, 1)
    assert events[0] == BlockStored([1], None, [7, 7], 2, None, "GPU", None)
    assert events[1] == BlockRemoved([1], "GPU")
    assert isinstance(events[2], BlockMoved) and events[2].to_medium == "CPU"
    with pytest.raises(ValueError, match="not an event batch"):
        decode_batch(enc({"ts": 1}))


def test_follows_a_publisher_and_answers_prefix_queries():
    ep = inproc("pub")
    with Subscriber(ep) as sub:
        pub = CoalescingPublisher(endpoint=ep)
        try:
            batches = chain_batches(50)
            for b in batches:
                pub.publish(b)
            drain(sub, pub)
            sent = pub.stats().events_sent
        finally:
            pub.shutdown()
        src = sub.sources[0]
        assert src.index.state() == truth(batches)
        assert (src.gaps, src.resets, src.duplicates) == (0, 0, 0)
        assert sub.longest_prefix([1, 2, 3, 999]) == 3
        assert sub.longest_prefix([4, 5], medium="CPU") == 1  # only 4 was offloaded
        assert sum(sub.summary()["events"].values()) == sent


def publish_until_heard(pub: CoalescingPublisher, sub: Subscriber, sent: list[Any]) -> None:
    """A SUB that joins a bound PUB may miss the first messages (ZeroMQ's slow joiner):
    publish single, recorded batches until it hears one."""
    for i in range(1000):
        b = batch(store(10_000 + i))
        sent.append(b)
        pub.publish(b)
        assert pub.flush(10)
        if sub.poll(0.01):
            return
    raise AssertionError("the subscriber never heard the publisher")


def test_a_subscriber_that_crashes_and_comes_back_recovers_by_replay():
    ep, rep = inproc("pub"), inproc("replay")
    batches = chain_batches(120)
    sent: list[Any] = []
    with Subscriber(ep, rep) as first:  # connected before the bind: hears everything
        pub = CoalescingPublisher(endpoint=ep, replay_endpoint=rep)
        try:
            sent += batches[:40]
            for b in batches[:40]:
                pub.publish(b)
            drain(first, pub)
        except BaseException:
            pub.shutdown()
            raise
    try:
        # it crashed; the stream goes on without it
        sent += batches[40:80]
        for b in batches[40:80]:
            pub.publish(b)
        assert pub.flush(10)
        with Subscriber(ep, rep) as again:  # joins mid-stream
            publish_until_heard(pub, again, sent)
            sent += batches[80:]
            for b in batches[80:]:
                pub.publish(b)
            drain(again, pub)
            src = again.sources[0]
            assert src.replays >= 1 and not src.partial
            assert src.index.state() == truth(sent)
    finally:
        pub.shutdown()


def test_a_subscriber_too_slow_for_the_hwm_sees_the_gap_and_recovers():
    ep, rep = inproc("pub"), inproc("replay")
    batches = chain_batches(400)
    sub = Subscriber(ep, rep, rcvhwm=5)  # connected before the bind: hears everything
    pub = CoalescingPublisher(endpoint=ep, replay_endpoint=rep, hwm=5, compaction=False)
    try:
        with sub:
            pub.publish(batches[0])
            drain(sub, pub)
            for b in batches[1:-1]:  # the subscriber does not read meanwhile
                pub.publish(b)
            assert pub.flush(10)
            while sub.poll(0.05):  # it reads what its socket kept...
                pass
            pub.publish(batches[-1])  # ...and the next message reveals the gap
            drain(sub, pub)
            src = sub.sources[0]
            assert src.gaps >= 1, "the PUB dropped messages at its HWM: a gap must be seen"
            assert src.resets == 0 and src.replayed_messages > 0
            assert src.index.state() == truth(batches)
    finally:
        pub.shutdown()


def test_a_publisher_loss_makes_an_incomplete_replay_and_a_reset():
    ep, rep = inproc("pub"), inproc("replay")
    sub = Subscriber(ep, rep)
    pub = CoalescingPublisher(
        endpoint=ep, replay_endpoint=rep, max_queue_size=3, stall_timeout=0, loss_marker="gap"
    )
    try:
        with sub:
            with held(pub):
                for b in chain_batches(50):
                    pub.publish(b)
            assert pub.flush(10)
            pub.publish(batch(store(1000)))
            drain(sub, pub)
            src = sub.sources[0]
            assert pub.stats().seq_gaps >= 1
            assert src.gaps >= 1 and src.resets >= 1 and src.partial
            assert src.index.state() == truth([batch(store(1000))])
    finally:
        pub.shutdown()


def _bind_when_free(endpoint: str, timeout: float = 10.0) -> CoalescingPublisher:
    """A publisher on ``endpoint`` once the old one's socket has let go of it: ZeroMQ
    closes a socket (and unbinds its port) in its I/O thread, after close() returns."""
    bound: list[CoalescingPublisher] = []

    def bind() -> bool:
        try:
            bound.append(CoalescingPublisher(endpoint=endpoint))
        except OSError:  # EADDRINUSE: not yet
            return False
        return True

    wait_for(bind, timeout, what=f"{endpoint} to be free again")
    return bound[0]


def test_a_publisher_restart_resets_the_source():
    port = free_port()
    with Subscriber(f"tcp://127.0.0.1:{port}") as sub:
        pub = CoalescingPublisher(endpoint=f"tcp://*:{port}")
        sent: list[Any] = []
        try:
            publish_until_heard(pub, sub, sent)
            for i in range(100):  # run the old stream well past what a slow joiner misses
                pub.publish(batch(store(i)))
                assert pub.flush(10)
            drain(sub, pub)
        finally:
            pub.shutdown()
        assert sub.sources[0].last_seq >= 100
        pub = _bind_when_free(f"tcp://*:{port}")  # a new engine: seqs from 0
        after: list[Any] = []
        try:
            publish_until_heard(pub, sub, after)
            drain(sub, pub)
        finally:
            pub.shutdown()
        src = sub.sources[0]
        # the new stream's first seqs are below the old last seq, with other payloads
        assert src.restarts == 1 and src.resets == 1 and src.partial
        # without replay, the index holds what the new publisher sent since it was heard
        assert set(src.index.state()) <= set(truth(after))
        assert src.index.state()  # and it is not empty
