"""The fault suite: what a production cluster throws at the publisher."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import zmq

from coalesce import BlockStored, CoalescingPublisher, KVEventBatch, PublishOutcome
from tests.conftest import END, free_port, held, inproc, wait_for


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockStored([i], None, [i], 1, None, "GPU", None)])


def dealer(endpoint: str) -> zmq.Socket[bytes]:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    return d


def read_replies(d: zmq.Socket[bytes], ends: int, timeout: float = 10.0) -> list[int]:
    """Read until ``ends`` end markers arrived; return the seqs seen."""
    seqs: list[int] = []
    deadline = time.monotonic() + timeout
    while ends:
        assert d.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), "reply timed out"
        _, _topic, seq, _payload = d.recv_multipart()
        if seq == END:
            ends -= 1
        else:
            seqs.append(int.from_bytes(seq, "big"))
    return seqs


def test_a_flood_of_replay_requests_is_answered_while_publishing_goes_on():
    rep = inproc("replay")
    pub = CoalescingPublisher(endpoint=inproc("pub"), replay_endpoint=rep, compaction=False)
    d = dealer(rep)
    try:
        for i in range(20):
            pub.publish(batch(i))
        assert pub.flush(10)
        for _ in range(200):
            d.send_multipart([b"", (15).to_bytes(8, "big")])
        for i in range(20, 40):  # publishing goes on meanwhile
            assert pub.publish(batch(i)) is PublishOutcome.QUEUED
        seqs = read_replies(d, ends=200)
        assert pub.flush(10)
        assert pub.stats().replay_requests == 200
        assert all(s >= 15 for s in seqs) and seqs.count(15) == 200
        assert pub.stats().messages_sent == 40
    finally:
        d.close()
        pub.shutdown()


def test_a_huge_start_seq_gets_just_the_end_marker():
    rep = inproc("replay")
    pub = CoalescingPublisher(endpoint=inproc("pub"), replay_endpoint=rep)
    d = dealer(rep)
    try:
        pub.publish(batch(1))
        assert pub.flush(10)
        d.send_multipart([b"", b"\xff" * 8])
        assert read_replies(d, ends=1) == []
    finally:
        d.close()
        pub.shutdown()


def test_a_client_that_disappears_mid_reply_costs_nothing():
    rep = inproc("replay")
    pub = CoalescingPublisher(endpoint=inproc("pub"), replay_endpoint=rep, compaction=False)
    try:
        for i in range(3000):
            pub.publish(batch(i))
        assert pub.flush(30)
        gone = dealer(rep)
        gone.send_multipart([b"", (0).to_bytes(8, "big")])
        gone.close()  # before reading a single frame of a 3000-message reply
        pub.publish(batch(9999))
        assert pub.flush(10)
        other = dealer(rep)
        try:
            other.send_multipart([b"", (2999).to_bytes(8, "big")])
            assert read_replies(other, ends=1) == [2999, 3000]
        finally:
            other.close()
    finally:
        pub.shutdown()


def test_shutdown_twice_and_concurrently_with_publish():
    pub = CoalescingPublisher(endpoint=inproc("pub"), shutdown_timeout=0.5)
    errors: list[BaseException] = []
    outcomes: list[Any] = []
    stop = threading.Event()

    def engine() -> None:
        i = 0
        while not stop.is_set():
            try:
                outcomes.append(pub.publish(batch(i)))
            except RuntimeError:
                return  # the documented answer after shutdown()
            except BaseException as exc:  # anything else is a bug
                errors.append(exc)
                return
            i += 1

    t = threading.Thread(target=engine)
    t.start()
    wait_for(lambda: len(outcomes) >= 1000 or not t.is_alive(), what="the engine publishing")
    closers = [threading.Thread(target=pub.shutdown) for _ in range(2)]
    for c in closers:
        c.start()
    for c in closers:
        c.join(10)
    stop.set()
    t.join(10)
    pub.shutdown()
    assert not errors
    assert not any(c.is_alive() for c in closers) and not t.is_alive()
    st = pub.stats()
    accepted = outcomes.count(PublishOutcome.QUEUED)
    assert st.batches_in == accepted
    # every accepted batch (one event each, nothing to merge) was sent or counted dropped
    assert st.events_sent + st.events_dropped == accepted


def test_a_publish_that_passed_its_check_before_shutdown_ended_is_counted():
    """The interleaving the test above can only hit by chance, made certain: a
    publish() that checked ``_closed`` before shutdown() set it, and offered its
    batch after shutdown() had stopped the sender and emptied the backlog."""
    pub = CoalescingPublisher(endpoint=inproc("pub"), shutdown_timeout=0.5)
    assert pub.publish(batch(0)) is PublishOutcome.QUEUED
    pub.shutdown()
    pub._closed = False  # as that publish() saw it
    assert pub.publish(batch(1)) is PublishOutcome.QUEUED
    st = pub.stats()
    assert st.batches_in == 2
    assert st.events_sent + st.events_dropped == 2 and st.events_dropped == 1


def test_what_was_sent_before_shutdown_is_delivered():
    """Within the linger (shutdown_timeout): generous here, so a busy CI machine is not a
    race against it; with linger=0 (vLLM's choice) this fails at any speed."""
    port = free_port()
    pub = CoalescingPublisher(endpoint=f"tcp://*:{port}", compaction=False, shutdown_timeout=30)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 1)  # a slow reader: what is sent backs up at the publisher
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        i = 0
        while not sub.poll(10):  # tcp: wait until it hears (slow joiner)
            pub.publish(batch(i))
            i += 1
            assert i < 3000, "the subscriber never heard the publisher"
        first = int.from_bytes(sub.recv_multipart()[1], "big")
        big = KVEventBatch(
            0.0,
            [BlockStored([j], None, list(range(64)), 64, None, "GPU", None) for j in range(200)],
        )
        for _ in range(300):  # ~8 MB queued in ZeroMQ when shutdown() closes the socket
            pub.publish(big)
        pub.shutdown()
        last = pub.stats().messages_sent - 1
        seqs = [first]
        while seqs[-1] < last:
            assert sub.poll(10_000), f"lost after shutdown: got up to {seqs[-1]} of {last}"
            seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert seqs == list(range(first, last + 1))
    finally:
        sub.close(linger=0)


def test_bounded_soak_at_sustained_overload():
    """Seconds in CI; COALESCE_SOAK_SECONDS=600 for a long one."""
    seconds = float(os.environ.get("COALESCE_SOAK_SECONDS", "3"))
    pub = CoalescingPublisher(
        endpoint=inproc("pub"),
        replay_endpoint=inproc("replay"),
        buffer_steps=100,
        max_queue_size=50,
        max_pending_events=5000,
        stall_timeout=0,  # a held sender is a stalled one: the batch budget applies at once
    )
    published = 0
    outcomes: dict[PublishOutcome, int] = {PublishOutcome.QUEUED: 0, PublishOutcome.DROPPED: 0}
    big = KVEventBatch(0.0, [BlockStored([j], None, [j], 1, None, "GPU", None) for j in range(40)])
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with held(pub):  # bursts the sender cannot follow
                for _ in range(500):
                    outcomes[pub.publish(KVEventBatch(0.0, list(big.events)))] += 1
                    published += 1
            time.sleep(0.001)  # then a short "GPU wait"
        assert pub.flush(30)
    finally:
        pub.shutdown()
    st = pub.stats()
    assert outcomes[PublishOutcome.QUEUED] + outcomes[PublishOutcome.DROPPED] == published
    assert st.batches_in == outcomes[PublishOutcome.QUEUED]
    assert st.batches_dropped == outcomes[PublishOutcome.DROPPED] > 0
    assert st.backlog_peak <= 50, "the backlog never exceeds its budget"
    assert st.loss_markers >= 1 and st.seq_gaps == 0  # every loss told, none a hole
