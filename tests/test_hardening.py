"""No input stops the sender; no message crashes the subscriber; no client grows memory.

Each case here was reproduced against the code before it was hardened (issue 9)
and failed there: a sender thread that died on a malformed event, a subscriber
that raised, memory proportional to a sequence jump.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import msgspec
import pytest
import zmq

from coalesce import BlockRemoved, BlockStored, CoalescingPublisher, KVEventBatch, PublishOutcome
from coalesce.subscriber import Subscriber
from tests.conftest import decode, free_port, held, inproc, wait_for


def good(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored([h], parent, [h, h], 2, None, "GPU", None)


def nested(depth: int) -> Any:
    x: Any = "x"
    for _ in range(depth):
        x = [x]
    return x


MALFORMED = {
    "medium is a dict": lambda: BlockStored([50], None, [1, 1], 2, None, {"a": 1}, None),
    "block_size None with tokens": lambda: BlockStored([50], None, [1, 1], None, None, "GPU", None),
    "token_ids None": lambda: BlockStored([50], None, None, 2, None, "GPU", None),
    "hash is a list": lambda: BlockStored([[1, 2]], None, [], 2, None, "GPU", None),
    "hash is a dict": lambda: BlockRemoved([{}], "GPU"),
    "hash too big to encode": lambda: BlockRemoved([1 << 70], "GPU"),
    "deeply nested lora_name": lambda: BlockStored([50], None, [], 2, None, "GPU", nested(5000)),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_event_under_compaction_does_not_stop_the_sender(case, make_sub):
    ep = inproc("pub")
    sub = make_sub(ep)
    pub = CoalescingPublisher(endpoint=ep, high_watermark=1, loss_marker="gap")
    try:
        bad = MALFORMED[case]()
        with held(pub):  # back to back: the sender compacts them together
            for i in range(10):
                assert pub.publish(KVEventBatch(float(i), [good(i + 1, i or None)])) is (
                    PublishOutcome.QUEUED
                )
            pub.publish(KVEventBatch(10.0, [good(20), bad]))
            # a second chained store with the same deep field: the chain rule compares them
            pub.publish(KVEventBatch(11.0, [MALFORMED[case](), good(21)]))
        assert pub.flush(10)
        assert pub.publish(KVEventBatch(12.0, [good(99)])) is PublishOutcome.QUEUED
        assert pub.flush(10)
        st = pub.stats()
        assert st.sender_alive
        msgs = sub.recv_until_seq(st.messages_sent + st.seq_gaps - 1)
        assert [e.block_hashes for e in decode(msgs[-1][2]).events] == [[99]]
        # each of the 13 batches went out (perhaps folded) or was lost with a gap
        seqs = [m[1] for m in msgs]
        assert seqs == sorted(set(seqs)) and len(seqs) == st.messages_sent
        assert seqs[-1] + 1 - len(seqs) == st.seq_gaps
        assert (st.encode_failures > 0) == (st.seq_gaps > 0)
    finally:
        pub.shutdown()


def test_a_batch_mutated_after_publish_is_sent_or_lost_visibly(make_sub):
    ep = inproc("pub")
    sub = make_sub(ep)
    pub = CoalescingPublisher(endpoint=ep, high_watermark=1)
    try:
        with held(pub):
            b = KVEventBatch(0.0, [good(1)])
            pub.publish(b)
            b.events = None  # type: ignore[assignment]  # a careless caller
            for i in range(2, 6):
                pub.publish(KVEventBatch(float(i), [good(i)]))
        assert pub.flush(10)
        pub.publish(KVEventBatch(9.0, [good(9)]))
        assert pub.flush(10)
        st = pub.stats()
        assert st.sender_alive and st.batches_in == 6
        msgs = sub.recv_until_seq(st.messages_sent + st.seq_gaps - 1)
        assert decode(msgs[-1][2]).events[0].block_hashes == [9]
    finally:
        pub.shutdown()


def test_publish_checks_ts_in_constant_time():
    pub = CoalescingPublisher(endpoint=inproc("pub"))
    try:
        for ts in (None, "now", [1.0]):
            with pytest.raises(TypeError, match="ts must be a float"):
                pub.publish(KVEventBatch(ts, []))  # type: ignore[arg-type]
        assert pub.publish(KVEventBatch(3, [])) is PublishOutcome.QUEUED  # an int is a number
        assert pub.stats().batches_in == 1
    finally:
        pub.shutdown()


def test_a_sender_that_dies_anyway_drops_visibly_from_then_on(make_sub, caplog):
    ep = inproc("pub")
    sub = make_sub(ep)
    pub = CoalescingPublisher(endpoint=ep, compaction=False, loss_marker="gap")
    try:
        pub.publish(KVEventBatch(0.0, [good(1)]))
        assert pub.flush(10)
        sender = pub._sender

        def broken(flushing: bool) -> None:  # fault injection: a bug inside the loop
            raise RuntimeError("injected")

        sender._step = broken  # type: ignore[method-assign]
        pub.publish(KVEventBatch(1.0, [good(2)]))
        wait_for(lambda: not pub.stats().sender_alive, what="the sender to stop")
        assert pub.publish(KVEventBatch(2.0, [good(3)])) is PublishOutcome.DROPPED
        assert pub.flush(1.0)  # everything accepted is accounted for: sent or dropped
        st = pub.stats()
        assert st.batches_dropped == 2  # the one in flight, and the one refused
        # subscribers see a gap, then an empty batch: not silence
        msgs = sub.recv_until_seq(2)
        assert [m[1] for m in msgs] == [0, 2]
        assert decode(msgs[-1][2]).events == []
        assert "sender thread failed" in caplog.text
    finally:
        pub.shutdown()


def test_a_sender_that_dies_mid_window_counts_the_window_lost():
    pub = CoalescingPublisher(endpoint=inproc("pub"), high_watermark=1)
    try:
        sender = pub._sender

        def broken(topic: bytes, seq: int, payload: bytes) -> None:  # the socket fails
            raise zmq.ZMQError(zmq.ENOTSOCK)

        with held(pub):
            for i in range(20):
                pub.publish(KVEventBatch(float(i), [good(i + 1)]))
            sender._stream.use(broken)  # every send from now on, the final loss's too
        wait_for(lambda: not pub.stats().sender_alive, what="the sender to stop")
        assert pub.flush(1.0)
        st = pub.stats()
        assert st.messages_sent == 0 and st.batches_dropped == 20 and st.events_dropped == 20
    finally:
        pub.shutdown()


def test_a_publisher_dropped_without_shutdown_stops_its_thread():
    pub = CoalescingPublisher(endpoint=inproc("pub"))
    pub.publish(KVEventBatch(0.0, [good(1)]))
    thread = pub._sender.thread
    with pytest.warns(ResourceWarning, match="without shutdown"):
        del pub
        gc.collect()
    thread.join(10)
    assert not thread.is_alive()


# -- the subscriber ------------------------------------------------------------------


def raw_pub(endpoint: str) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def good_payload(h: int) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(1.0, [good(h)], 0))


def msg(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


def deliver(sub: Subscriber, ep: str, messages: list[list[bytes]], until: int) -> None:
    """Send raw multipart messages on a real PUB at ``ep``; poll until seq ``until`` is in."""
    pub = raw_pub(ep)
    try:
        for frames in messages:
            pub.send_multipart(frames)
        wait_for(
            lambda: sub.poll(0.01) >= 0 and sub.sources[0].last_seq == until,
            what=f"seq {until}",
        )
    finally:
        pub.close()


enc = msgspec.msgpack.encode
store_map = {
    "type": "BlockStored",
    "block_hashes": [1],
    "parent_block_hash": None,
    "token_ids": [],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
BAD_PAYLOADS = {
    "not msgpack": b"\xc1\xc1\xc1",
    "not an array": enc({"ts": 1.0}),
    "ts is None": enc([None, [], 0]),
    "ts is a list": enc([[1], [], 0]),
    "rank is a string": enc([1.0, [], "0"]),
    "event type is a list": enc([1.0, [{"type": [1], "block_hashes": [1]}], 0]),
    "hash is a list": enc([1.0, [{**store_map, "block_hashes": [[1]]}], 0]),
    "parent is a list": enc([1.0, [{**store_map, "parent_block_hash": [1]}], 0]),
    "event is a number": enc([1.0, [7], 0]),
}


@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
def test_a_malformed_payload_is_counted_not_applied(case):
    ep = inproc("pub")
    with Subscriber(ep) as sub:
        messages = [msg(0, good_payload(1)), msg(1, BAD_PAYLOADS[case]), msg(2, good_payload(2))]
        deliver(sub, ep, messages, until=2)
        src = sub.sources[0]
        assert src.bad_messages == 1 and src.messages == 3
        assert src.resets == 1 and src.partial  # what seq 1 did is unknown
        assert set(src.index.state()) == {("GPU", None, 2)}


def test_wrong_frames_are_counted_and_do_not_move_the_sequence():
    ep = inproc("pub")
    with Subscriber(ep) as sub:
        short_seq = [b"", b"\x00\x01", good_payload(2)]
        two_frames = [b"", (1).to_bytes(8, "big")]
        messages = [msg(0, good_payload(1)), short_seq, two_frames, msg(1, good_payload(3))]
        deliver(sub, ep, messages, until=1)
        src = sub.sources[0]
        assert src.bad_messages == 2 and src.resets == 0 and src.gaps == 0


@pytest.mark.parametrize("jump", [1 << 24, 1 << 40, (1 << 64) - 2])
def test_a_far_sequence_jump_resets_at_once_without_asking(jump):
    ep, rep = inproc("pub"), inproc("replay")
    router = zmq.Context.instance().socket(zmq.ROUTER)  # would answer, but is never asked
    router.setsockopt(zmq.LINGER, 0)
    router.bind(rep)
    with Subscriber(ep, rep, max_replay=1000) as sub:
        try:
            deliver(sub, ep, [msg(0, good_payload(1)), msg(jump, good_payload(2))], until=jump)
        finally:
            router.close()
        src = sub.sources[0]
        assert (src.gaps, src.resets, src.replays) == (1, 1, 0)
        assert set(src.index.state()) == {("GPU", None, 2)}


def test_joining_far_into_a_stream_is_partial_without_a_replay_request():
    ep, rep = inproc("pub"), inproc("replay")
    with Subscriber(ep, rep, max_replay=1000) as sub:
        deliver(sub, ep, [msg((1 << 64) - 1, good_payload(1))], until=(1 << 64) - 1)
        src = sub.sources[0]
        assert src.partial and src.replays == 0 and src.resets == 0


def test_joining_mid_stream_without_replay_is_partial():
    ep = inproc("pub")
    with Subscriber(ep) as sub:
        deliver(sub, ep, [msg(500, good_payload(1))], until=500)
        assert sub.sources[0].partial and sub.summary()["partial_sources"] == 1


def test_an_unanswered_replay_waits_replay_timeout_between_frames_only():
    ep, rep = inproc("pub"), inproc("replay")
    router = zmq.Context.instance().socket(zmq.ROUTER)  # bound, never answers
    router.setsockopt(zmq.LINGER, 0)
    router.bind(rep)
    with Subscriber(ep, rep, replay_timeout=0.2) as sub:
        try:
            deliver(sub, ep, [msg(0, good_payload(1)), msg(5, good_payload(2))], until=5)
        finally:
            router.close()
        src = sub.sources[0]
        assert (src.gaps, src.replays, src.resets) == (1, 1, 1)


# -- replay bounds -------------------------------------------------------------------

_CLIENTS = textwrap.dedent(
    """
    import sys, zmq
    endpoint, n = sys.argv[1], int(sys.argv[2])
    ctx = zmq.Context.instance()
    socks = []
    for _ in range(n):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVHWM, 1)      # never reads: what it is sent backs up
        d.setsockopt(zmq.RCVBUF, 4096)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(endpoint)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        socks.append(d)
    print("sent", flush=True)
    sys.stdin.read()                  # until the test closes our stdin
    """
)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_non_reading_replay_clients_pin_a_bounded_amount_of_memory():
    """12 clients each ask for a 2,000-message (20 MB) replay and never read.

    vLLM's ROUTER (send HWM 2 * (buffer_steps + 1)) queues the whole buffer for each
    of them: about 240 MB here.  The bound is replay_max_clients * replay_window
    messages: 12 * 64 * 10 kB = 8 MB.
    """
    port = free_port()
    pub = CoalescingPublisher(
        endpoint=inproc("pub"),
        replay_endpoint=f"tcp://127.0.0.1:{port}",
        buffer_steps=2000,
        compaction=False,
        replay_window=64,
    )
    clients = None
    try:
        payload = list(range(2500))  # ~10 kB per message once encoded
        for i in range(2000):
            pub.publish(
                KVEventBatch(float(i), [BlockStored([i], None, payload, 2500, None, "GPU", None)])
            )
            if i % 200 == 0:
                assert pub.flush(30)
        assert pub.flush(30)
        gc.collect()
        before = rss_mb()
        clients = subprocess.Popen(
            [sys.executable, "-c", _CLIENTS, f"tcp://127.0.0.1:{port}", "12"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert clients.stdout is not None and clients.stdout.readline().strip() == "sent"
        wait_for(lambda: pub.stats().replay_requests == 12, timeout=30, what="12 requests")
        # every reply is now stuck at the clients' window: wait until sending stops
        last = [-1]

        def settled() -> bool:
            n = pub.stats().replay_messages
            moved, last[0] = n != last[0], n
            threading.Event().wait(0.2)
            return not moved

        wait_for(settled, timeout=30, what="replies to stall")
        grown = rss_mb() - before
        st = pub.stats()
        assert st.replay_messages < 12 * 2000 / 4, "replies must wait for their readers"
        assert grown < 8 + 40, f"replay pinned {grown:.0f} MB"
    finally:
        if clients is not None:
            clients.communicate("", timeout=30)
        pub.shutdown()


def test_replay_connections_over_the_cap_are_refused_and_counted():
    port = free_port()
    pub = CoalescingPublisher(
        endpoint=inproc("pub"), replay_endpoint=f"tcp://127.0.0.1:{port}", replay_max_clients=3
    )
    dealers = []
    try:
        pub.publish(KVEventBatch(0.0, [good(1)]))
        assert pub.flush(10)
        for _ in range(5):
            d = zmq.Context.instance().socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://127.0.0.1:{port}")
            dealers.append(d)
        for d in dealers:  # all five connections are open while they ask
            d.send_multipart([b"", (0).to_bytes(8, "big")])
        wait_for(
            lambda: pub.stats().replay_requests + pub.stats().replay_refused == 5,
            what="five requests handled",
        )
        st = pub.stats()
        assert st.replay_refused >= 2, "at most three connections are served"
        answered = sum(bool(d.poll(2000)) for d in dealers)
        assert answered == st.replay_requests
    finally:
        for d in dealers:
            d.close()
        pub.shutdown()


def test_the_connection_cap_frees_up_when_clients_leave():
    port = free_port()
    pub = CoalescingPublisher(
        endpoint=inproc("pub"), replay_endpoint=f"tcp://127.0.0.1:{port}", replay_max_clients=3
    )
    try:
        pub.publish(KVEventBatch(0.0, [good(1)]))
        assert pub.flush(10)
        crowd = []
        for _ in range(10):  # more connections than the cap; none of them asks
            d = zmq.Context.instance().socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://127.0.0.1:{port}")
            crowd.append(d)
        replay = pub._sender.services.replay
        assert replay is not None
        wait_for(lambda: replay.clients == 10, what="the monitor to count the crowd")
        for d in crowd:
            d.close()
        wait_for(lambda: replay.clients == 0, what="the monitor to see them go")
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{port}")
        try:
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            assert d.poll(10_000), "a client under the cap is answered"
            assert pub.stats().replay_refused == 0
        finally:
            d.close()
    finally:
        pub.shutdown()
