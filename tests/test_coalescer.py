"""``coalescer="process"``: the rules, the PUB socket and replay in a process of their own.

Real processes and real sockets: the coalescer is started, stopped, killed
and frozen (SIGSTOP) as a real one would be.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any
from unittest import mock

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce import (
    AllBlocksCleared,
    CoalescingPublisher,
    PublishOutcome,
    _coalescer,
    _sender,
    compactor,
)
from coalesce._settings import Settings
from tests.conftest import Sub, assert_every_model_agrees, decode, free_port, held, inproc, wait_for
from tests.streams import batch_lists
from tests.test_publisher import batch, offload_batch, store


@pytest.fixture
def pubs():
    made: list[CoalescingPublisher] = []

    def make(**kw: Any) -> tuple[CoalescingPublisher, str, str]:
        port, rport = free_port(), free_port()
        p = CoalescingPublisher(
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{rport}",
            coalescer="process",
            **kw,
        )
        made.append(p)
        return p, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"

    yield make
    for p in made:
        p.shutdown()


def joined(p: CoalescingPublisher, sub: Sub) -> int:
    """Publish empty batches until ``sub`` hears one (a tcp subscriber joins late);
    return how many were published.  Empty batches change no subscriber's state."""
    for i in itertools.count(1):
        p.publish(batch())
        if not sub.nothing_within(0.02):
            sub.recv()
            return i
        assert i < 2000, "the subscriber never joined"
    raise AssertionError


def link_of(p: CoalescingPublisher) -> Any:
    return p._sender._link


def gone(pid: int) -> bool:
    """The process has exited (a zombie no one has reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_the_knob_parses_and_rejects():
    assert Settings.resolve(coalescer="Process").coalescer == "process"
    assert Settings.resolve(env={"COALESCE_COALESCER": "thread"}).coalescer == "thread"
    with pytest.raises(ValueError, match="COALESCE_COALESCER"):
        Settings.resolve(env={"COALESCE_COALESCER": "fork"})


def test_idle_messages_are_vllms_bytes_from_the_coalescer_process(pubs, make_sub):
    p, ep, rep = pubs()
    assert link_of(p) is not None and p._sender._pub is None  # nothing bound here
    sub = make_sub(ep, replay=rep)
    probes = joined(p, sub)
    sent = [batch(store(i), ts=float(i)) for i in range(20)]
    for b in sent:
        assert p.publish(b) is PublishOutcome.QUEUED
        assert p.flush(10)
    msgs = sub.recv_until_seq(probes + 19)
    assert [m[1] for m in msgs] == list(range(probes - 1, probes + 20))
    assert [m[2] for m in msgs[1:]] == [msgspec.msgpack.encode(b) for b in sent]
    st = p.stats()
    assert st.messages_sent == probes + 20 and st.events_sent == 20 and st.seq_gaps == 0
    replayed = sub.replay(0)  # served by the coalescer process's buffer
    assert [m[1] for m in replayed] == list(range(probes + 20))
    assert [m[2] for m in replayed[probes:]] == [m[2] for m in msgs[1:]]
    assert p.stats().replay_requests == 1


def test_a_burst_is_compacted_there_and_every_model_ends_right(pubs, make_sub):
    p, ep, _ = pubs(high_watermark=2)
    sub = make_sub(ep)
    probes = joined(p, sub)
    batches = [offload_batch(i) for i in range(300)] + [batch(AllBlocksCleared())]
    batches += [offload_batch(i) for i in range(300, 400)]
    with held(p):
        for b in batches:
            assert p.publish(b) is PublishOutcome.QUEUED
    assert p.flush(20)
    st = p.stats()
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    assert [m[1] for m in msgs] == list(range(probes - 1, st.messages_sent))
    assert st.batches_folded > 0 and st.batches_dropped == 0 and st.seq_gaps == 0
    received = [decode(m[2]) for m in msgs]
    assert st.events_sent == sum(len(b.events) for b in received)
    if compactor.accelerated():  # the payload rules ran in the coalescer process
        assert st.payload_passes > 0 and st.events_sent < st.events_in
        assert st.events_superseded > 0
    assert_every_model_agrees(batches, received)


@pytest.mark.parametrize("pyzmq_send", [False, True])
def test_stats_say_which_send_the_process_uses(pubs, monkeypatch, pyzmq_send) -> None:
    # The process reads COALESCE_PYZMQ_SEND when it starts; this process bound its
    # own send long before, so only the process's report can tell the two apart.
    from coalesce import _wire
    from coalesce._env import PYZMQ_SEND

    if pyzmq_send:
        monkeypatch.setenv(PYZMQ_SEND, "1")
    else:
        monkeypatch.delenv(PYZMQ_SEND, raising=False)
    p, _, _ = pubs()
    expected = not pyzmq_send and _wire.native_send()
    assert p.stats().native_send is expected


def test_shutdown_sends_everything_and_stops_the_process(make_sub):
    port = free_port()
    p = CoalescingPublisher(endpoint=f"tcp://*:{port}", coalescer="process")
    sub = make_sub(f"tcp://127.0.0.1:{port}")
    joined(p, sub)
    pid = link_of(p).pid
    with held(p):
        for i in range(200):
            p.publish(offload_batch(i))
    p.shutdown()  # no flush first: shutdown's own
    st = p.stats()
    assert st.batches_dropped == 0
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    assert sum(len(decode(m[2]).events) for m in msgs) == st.events_sent
    wait_for(lambda: gone(pid), what="the coalescer process to exit")


def test_a_killed_coalescer_is_replaced_by_the_sender_after_a_gap(pubs, make_sub, caplog):
    p, ep, _ = pubs(loss_marker="gap")
    sub = make_sub(ep)
    joined(p, sub)
    for i in range(5):
        p.publish(batch(store(i)))
    assert p.flush(10)
    before = p.stats()
    last = sub.recv_until_seq(before.messages_sent - 1)[-1][1]
    link = link_of(p)
    with caplog.at_level(logging.ERROR, logger="coalesce"):
        os.kill(link.pid, signal.SIGKILL)
        wait_for(lambda: link_of(p) is None, what="the sender to take over")
        wait_for(lambda: link.returncode is not None, what="the old process to be reaped")
    assert "coalescer process" in caplog.text and "sequence gap" in caplog.text
    assert gone(link.pid)
    assert p.stats().messages_sent == before.messages_sent  # carried over
    # the sender now binds the same endpoint: the subscriber reconnects by itself
    joined(p, sub)
    after = sub.messages[-1][1]
    assert after >= last + 2, "what was in flight is lost, visibly"
    b = batch(store(99))
    assert p.publish(b) is PublishOutcome.QUEUED
    assert p.flush(10)
    st = p.stats()
    assert st.seq_gaps == 1 and st.sender_alive
    assert sub.recv_until_seq(st.messages_sent)[-1][2] == msgspec.msgpack.encode(b)


def test_a_frozen_coalescer_is_stopped_after_the_pipe_timeout(pubs, make_sub):
    p, ep, _ = pubs(max_queue_size=0, loss_marker="gap")
    sub = make_sub(ep)
    joined(p, sub)
    link = link_of(p)
    with mock.patch.object(_sender, "PIPE_TIMEOUT", 0.3):
        os.kill(link.pid, signal.SIGSTOP)
        try:
            big = batch(*[store(i) for i in range(2000)])
            # until the pipe (and the kernel's socket buffer) is full and the wait times out
            wait_for(
                lambda: p.publish(big) is PublishOutcome.QUEUED and link_of(p) is None,
                timeout=30,
                what="the sender to give up on a frozen coalescer",
            )
        finally:
            if link.returncode is None:  # (not killed: let it go on)
                os.kill(link.pid, signal.SIGCONT)
    wait_for(lambda: link.returncode is not None, what="the frozen process to be killed")
    assert link.returncode == -signal.SIGKILL
    assert p.flush(30)
    st = p.stats()
    assert st.seq_gaps == 1 and st.batches_dropped == 0
    joined(p, sub)  # it publishes again, from the engine's process


def test_endpoints_it_cannot_bind_fail_the_constructor():
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = free_port()
    taken.bind(f"tcp://*:{port}")
    try:
        with pytest.raises(OSError, match="cannot bind"):
            CoalescingPublisher(endpoint=f"tcp://*:{port}", coalescer="process")
    finally:
        taken.close(linger=0)
    with pytest.raises(ValueError, match="cannot bind"):
        CoalescingPublisher(endpoint="tcp://*:notaport", coalescer="process")


@pytest.mark.parametrize(
    "endpoints",
    [
        {"endpoint": "inproc"},
        {"replay_endpoint": "inproc"},
        {"snapshot_endpoint": "inproc"},
        {"move_events": True},
    ],
)
def test_what_it_cannot_serve_runs_in_a_thread_and_says_why(caplog, endpoints):
    kw = {k: inproc(k) if v == "inproc" else v for k, v in endpoints.items()}
    kw.setdefault("endpoint", f"tcp://*:{free_port()}")
    with caplog.at_level(logging.WARNING, logger="coalesce"):
        p = CoalescingPublisher(coalescer="process", **kw)
    try:
        assert link_of(p) is None and "using a thread" in caplog.text
    finally:
        p.shutdown()


def test_the_coalescer_exits_when_the_engine_process_dies():
    script = textwrap.dedent(
        f"""
        import os, sys
        from coalesce import CoalescingPublisher
        p = CoalescingPublisher(endpoint="tcp://*:{free_port()}", coalescer="process")
        print(p._sender._link.pid, flush=True)
        os._exit(0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    pid = int(out.stdout.split()[0])
    wait_for(lambda: gone(pid), what="the orphaned coalescer process to exit")


def test_a_coalescer_that_cannot_start_leaves_a_thread_publishing(caplog, make_sub):
    port = free_port()
    with (
        mock.patch.object(_coalescer, "_BOOT", "import sys; sys.exit(3)"),
        caplog.at_level(logging.ERROR, logger="coalesce"),
    ):
        p = CoalescingPublisher(endpoint=f"tcp://*:{port}", coalescer="process")
    try:
        assert link_of(p) is None and "code 3" in caplog.text
        sub = make_sub(f"tcp://127.0.0.1:{port}")
        joined(p, sub)  # published from this process
    finally:
        p.shutdown()


def test_ctrl_c_in_the_terminal_does_not_stop_the_coalescer(pubs, make_sub):
    p, ep, _ = pubs()
    sub = make_sub(ep)
    joined(p, sub)
    os.kill(link_of(p).pid, signal.SIGINT)  # what the process group gets from Ctrl-C
    b = batch(store(7))
    p.publish(b)
    assert p.flush(10)  # taken by the same process, after the signal
    assert link_of(p) is not None and link_of(p).alive()
    assert sub.recv_until_seq(p.stats().messages_sent - 1)[-1][2] == msgspec.msgpack.encode(b)


@pytest.fixture(scope="module")
def shared():
    """One publisher with its coalescer process, and a subscriber that has joined."""
    port = free_port()
    p = CoalescingPublisher(endpoint=f"tcp://*:{port}", coalescer="process", high_watermark=2)
    sub = Sub(f"tcp://127.0.0.1:{port}")
    joined(p, sub)
    yield p, sub
    p.shutdown()
    sub.close()


@settings(max_examples=150)
@given(batches=batch_lists(), burst=st.booleans())
def test_every_model_ends_as_the_stream_would_leave_it(shared, batches, burst):
    """Held bursts go through the fold and the coalescer's rules; the rest 1:1."""
    p, sub = shared
    before = p.stats().messages_sent
    if burst:
        with held(p):
            for b in batches:
                assert p.publish(b) is PublishOutcome.QUEUED
    else:
        for b in batches:
            assert p.publish(b) is PublishOutcome.QUEUED
    assert p.flush(10)
    st_ = p.stats()
    assert st_.seq_gaps == 0 and st_.batches_dropped == 0
    got = []
    while st_.messages_sent > before and (not got or got[-1][1] < st_.messages_sent - 1):
        got.append(sub.recv())
    assert [m[1] for m in got] == list(range(before, st_.messages_sent))
    received = [decode(m[2]) for m in got]
    assert_every_model_agrees(batches, received)


def snapshot_of(endpoint: str) -> tuple[int, list[bytes]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(b"snapshot")
        assert sock.poll(10_000), "no snapshot reply"
        frames = sock.recv_multipart()
    finally:
        sock.close()
    return int.from_bytes(frames[0], "big", signed=True), frames


def test_with_snapshots_the_process_beats_and_a_killed_one_leaves_them_unavailable(pubs, make_sub):
    sport = free_port()
    p, ep, _ = pubs(snapshot_endpoint=f"tcp://*:{sport}")
    snap = f"tcp://127.0.0.1:{sport}"
    sub = make_sub(ep)
    joined(p, sub)
    last = sub.messages[-1][1]
    (_, seq, payload) = sub.recv(timeout=5.0)  # nothing published: the process beats
    raw = msgspec.msgpack.decode(payload)
    assert seq == last + 1 and raw[1] == [] and raw[3] == p.publisher_id
    p.publish(batch(store(1)))
    assert p.flush(10)
    seq, frames = snapshot_of(snap)
    assert seq >= 0 and frames[1] == p.publisher_id and len(frames) == 3  # one chunk
    link = link_of(p)
    os.kill(link.pid, signal.SIGKILL)
    wait_for(lambda: link_of(p) is None, what="the sender to take over")
    assert snapshot_of(snap)[0] == -2, "the recorder died with its process"
    p.publish(batch(AllBlocksCleared(), store(7)))
    assert p.flush(10)
    seq, frames = snapshot_of(snap)
    assert seq >= 0 and len(frames) == 3
    assert [e.block_hashes for e in decode(frames[2]).events] == [[7]]
