"""Shared fixtures: real ZeroMQ sockets and a small subscriber helper."""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import settings

from coalesce._wire import message_sender
from coalesce.events import KVEventBatch
from coalesce.publisher import CoalescingPublisher, PublishOutcome
from coalesce.testing import held as held  # (the tests import it from here)

# Hypothesis profiles, one for every test module: "dev" (quick) for a local run, "ci"
# (thorough) where CI is set, as CI runners do; HYPOTHESIS_PROFILE chooses either.
# Tests that set max_examples themselves keep their own.
IN_CI = os.environ.get("CI", "") not in ("", "0", "false")
settings.register_profile("ci", max_examples=1000, deadline=None)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if IN_CI else "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked slow (whole demo runs) run in CI, or locally with ``--slow``."""
    if IN_CI or config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: runs in CI, or with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


END = b"\xff" * 8
_names = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def inproc(name: str) -> str:
    return f"inproc://{name}-{os.getpid()}-{next(_names)}"


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.002)


class Sub:
    """A SUB socket (and optional DEALER replay client) that decodes what it gets."""

    def __init__(self, endpoint: str, topic: bytes = b"", replay: str | None = None) -> None:
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.replay_endpoint = replay
        self.messages: list[tuple[bytes, int, bytes]] = []
        self.seq_frames: list[bytes] = []
        """Each live message's seq frame as it came (24 bytes with snapshots on)."""

    def recv(self, timeout: float = 10.0) -> tuple[bytes, int, bytes]:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no message within {timeout}s")
        frames = self.sock.recv_multipart()
        assert len(frames) == 3 and len(frames[1]) in (8, 24), frames
        msg = (frames[0], int.from_bytes(frames[1][:8], "big"), frames[2])
        self.seq_frames.append(frames[1])
        self.messages.append(msg)
        return msg

    def recv_until_seq(self, seq: int, timeout: float = 10.0) -> list[tuple[bytes, int, bytes]]:
        deadline = time.monotonic() + timeout
        while not self.messages or self.messages[-1][1] < seq:
            self.recv(max(0.01, deadline - time.monotonic()))
        return self.messages

    def nothing_within(self, timeout: float) -> bool:
        return not self.sock.poll(int(timeout * 1000))

    def publish_until_heard(self, publish: Callable[[int], Any]) -> tuple[bytes, int, bytes]:
        """A tcp subscriber joins late: ``publish(i)`` for i = 0, 1, ... until a
        message arrives (at most 10,000 calls); that message."""
        for i in range(10_000):
            if not self.nothing_within(0.01):
                return self.recv()
            publish(i)
        raise AssertionError("no message after 10,000 publishes")

    def replay(self, start: int, timeout: float = 10.0) -> list[tuple[bytes, int, bytes]]:
        """Ask for replay from ``start``; return the 5-frame replies' (topic, seq, payload)."""
        assert self.replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                if not dealer.poll(int(timeout * 1000)):
                    raise AssertionError("replay reply timed out")
                frames = dealer.recv_multipart()
                assert len(frames) == 4 and frames[0] == b"", frames
                _, topic, seq, payload = frames
                if seq == END:
                    assert topic == b"" and payload == b""
                    return out
                out.append((topic, int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def make_sub() -> Iterator[Callable[..., Sub]]:
    subs: list[Sub] = []

    def make(*args: Any, **kw: Any) -> Sub:
        s = Sub(*args, **kw)
        subs.append(s)
        return s

    yield make
    for s in subs:
        s.close()


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Publishers a test made (any engine's): shut down at its end."""
    pubs: list[Any] = []
    yield pubs
    for p in pubs:
        p.shutdown()


@pytest.fixture
def pubs(made: list[Any]) -> Callable[..., Any]:
    """``pubs(**kw)``: a ``CoalescingPublisher(**kw)`` (``cls=`` another class),
    shut down at the test's end."""

    def make(cls: Any = CoalescingPublisher, **kw: Any) -> Any:
        made.append(cls(**kw))
        return made[-1]

    return make


@contextmanager
def no_forced_switch() -> Iterator[None]:
    """No forced GIL switch inside: another thread runs only if this one releases.

    A GIL wait another thread began under the old switch interval can still time
    out and force one switch, so the old interval is waited out first (with the
    GIL released: nothing is measured yet).
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        time.sleep(2 * interval)
        yield
    finally:
        sys.setswitchinterval(interval)


def assert_every_model_agrees(batches: list[Any], received: list[Any]) -> None:
    """What a subscriber applying ``received`` holds is what ``batches`` would leave,
    under every model of docs/event-semantics.md."""
    from coalesce.refmodel import MODES, SubscriberModel

    for mode in MODES:
        want = SubscriberModel(mode).apply_batches(batches).state()
        assert SubscriberModel(mode).apply_batches(received).state() == want, mode


def decode(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


class StalledSocket:
    """Fault injection on a real PUB socket: every send waits until released.

    Stands in for a sender thread that has fallen behind (a long encode, GIL
    starvation); it wraps the real socket rather than replacing ZeroMQ.
    """

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def send(self, *a: Any, **kw: Any) -> Any:
        self.release.wait(30)
        return self._sock.send(*a, **kw)

    def send_multipart(self, *a: Any, **kw: Any) -> Any:
        self.release.wait(30)
        return self._sock.send_multipart(*a, **kw)


def publish_in_thread(pub: Any, batches: list[Any]) -> threading.Thread:
    t = threading.Thread(target=lambda: [pub.publish(b) for b in batches], daemon=True)
    t.start()
    return t


def assert_the_engines_publisher_blocks(theirs: Any, batches: list[Any]) -> None:
    """The seed bug: with its sender stalled, the engine's own ``publish()`` blocks on
    its full queue (and returns once the sender moves again)."""
    stall = StalledSocket(theirs._pub)
    theirs._pub = stall
    t = publish_in_thread(theirs, batches)
    wait_for(theirs._event_queue.full, what="the engine's queue to fill")
    t.join(0.5)
    assert t.is_alive(), "the engine's publish() is blocked on its full queue"
    stall.release.set()
    t.join(10)
    assert not t.is_alive()


def assert_ours_never_blocks(ours: Any, batches: list[Any]) -> StalledSocket:
    """The same stalled sender under coalesce: every ``publish()`` returns and nothing is
    lost (the engine's publisher only waits).  Returns the stall, still held."""
    stall = StalledSocket(ours._socks.pub)
    ours._stream.use(message_sender(stall))
    t = publish_in_thread(ours, batches)
    t.join(10)
    assert not t.is_alive(), "publish() must never block"
    assert ours.stats().batches_dropped == 0, "a late sender loses nothing"
    return stall


def assert_the_seed_bug(
    made: list[Any], theirs: Any, ours: Any, batch: Callable[[int], Any]
) -> StalledSocket:
    """The seed bug, both ways, with 10 batches ``batch(i)``: the engine's publisher
    blocks with its sender stalled, ours does not (both kept in ``made`` to be
    shut down).  Returns our stall, still held."""
    made += [theirs, ours]
    assert_the_engines_publisher_blocks(theirs, [batch(i) for i in range(10)])
    return assert_ours_never_blocks(ours, [batch(i) for i in range(10)])


def replay_request(endpoint: str, start_seq: int) -> list[bytes]:
    """The first reply of the replay ROUTER at ``endpoint`` to a request from
    ``start_seq`` (vLLM's protocol: a REQ sends the 8-byte seq)."""
    req = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    try:
        req.send(start_seq.to_bytes(8, "big"))
        assert req.poll(5000), "no replay reply within 5 s"
        return req.recv_multipart()
    finally:
        req.close()


def publish_both(
    theirs: Any, ours: Any, batches: list[Any], sub_theirs: Sub, sub_ours: Sub
) -> None:
    """Publish each batch (a copy to each) through the engine's own publisher and ours,
    ours flushed after each (one message a batch); then wait until both subscribers
    have every message and require them equal, all three frames of each."""
    for b in batches:
        theirs.publish(msgspec.structs.replace(b))
        assert ours.publish(msgspec.structs.replace(b)) is PublishOutcome.QUEUED
        assert ours.flush(10)
    sub_theirs.recv_until_seq(len(batches) - 1)
    sub_ours.recv_until_seq(len(batches) - 1)
    assert sub_ours.messages == sub_theirs.messages
