"""Sending: the native send (coalesce/_csend.c) against pyzmq's, on real sockets.

The native send must put the same three frames on the wire as pyzmq's
``send()`` calls, refuse what is not a PUB socket it can read back, raise for
a closed socket, and, its reason to exist, never release the GIL.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import zmq

from coalesce import _wire
from coalesce._env import NO_ACCEL, PYZMQ_SEND, switched_on
from tests.conftest import inproc, no_forced_switch, wait_for

try:
    from coalesce import _csend
except ImportError:
    _csend = None  # type: ignore[assignment]

needs_native = pytest.mark.skipif(
    _csend is None or _wire._native() is None,
    reason="the native send is not built or not bound (pyzmq's send only)",
)


@pytest.fixture
def pub_sub() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    ep = inproc("wire")
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # no drops at a high water mark: every frame counts
    sub.setsockopt(zmq.RCVHWM, 0)
    pub.bind(ep)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    # a PUB drops until the subscription arrives: send probes until one is heard
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)

    def heard() -> bool:
        pub.send(b"probe")
        return bool(poller.poll(10))

    wait_for(heard, what="the subscription")
    while poller.poll(50):
        sub.recv_multipart()
    yield pub, sub
    pub.close(linger=0)
    sub.close(linger=0)


def test_ci_machines_bind_the_native_send() -> None:
    forced_off = switched_on(NO_ACCEL) or switched_on(PYZMQ_SEND)
    if os.environ.get("COALESCE_REQUIRE_ACCEL") and not forced_off:
        assert _csend is not None, "coalesce/_csend.c was not built"
        assert _wire.loaded_libzmq() is not None, "pyzmq's libzmq not found in /proc/self/maps"
        assert _wire._native() is not None


@needs_native
def test_native_and_pyzmq_sends_put_the_same_frames_on_the_wire(pub_sub) -> None:
    pub, sub = pub_sub
    native = _wire.message_sender(pub)
    assert native.__name__ == "send_native"
    cases = [(b"", 0, b""), (b"kv@0", 1, b"\x93\xcb"), (b"t", 2**64 - 1, bytes(range(256)) * 4000)]
    for topic, seq, payload in cases:
        native(topic, seq, payload)
        got_native = sub.recv_multipart()
        _wire.send_message(pub, topic, seq, payload)
        got_pyzmq = sub.recv_multipart()
        assert got_native == got_pyzmq == [topic, seq.to_bytes(8, "big"), payload]


@needs_native
def test_native_send_rejects_bad_arguments(pub_sub) -> None:
    pub, _ = pub_sub
    send = _wire.message_sender(pub)
    with pytest.raises(OverflowError):
        send(b"t", 2**64, b"x")
    with pytest.raises(OverflowError):
        send(b"t", -1, b"x")
    with pytest.raises(TypeError):
        send(b"t", 0, bytearray(b"x"))  # type: ignore[arg-type]


@needs_native
def test_native_send_on_a_closed_socket_raises() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(inproc("closed"))
    send = _wire.message_sender(pub)
    pub.close(linger=0)
    with pytest.raises(zmq.ZMQError):
        send(b"t", 0, b"x")


def test_sockets_other_than_pub_and_a_forced_fallback_use_pyzmq(monkeypatch) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    try:
        assert _wire.message_sender(router).__name__ == "send_pyzmq"
    finally:
        router.close(linger=0)

    class Wrapper:  # a test's stand-in around a real socket: its send() must be called
        def __init__(self) -> None:
            self.frames: list[bytes] = []
            self.underlying, self.type = 0, zmq.PUB

        def send(self, data: bytes, flags: int = 0) -> None:
            self.frames.append(data)

    w = Wrapper()
    _wire.message_sender(w)(b"t", 3, b"p")  # type: ignore[arg-type]
    assert w.frames == [b"t", (3).to_bytes(8, "big"), b"p"]
    monkeypatch.setattr(_wire, "_NATIVE", [None])
    pub = ctx.socket(zmq.PUB)
    try:
        assert _wire.message_sender(pub).__name__ == "send_pyzmq"
    finally:
        pub.close(linger=0)


def test_forcing_pyzmq_by_environment(monkeypatch) -> None:
    monkeypatch.delenv("COALESCE_NO_ACCEL", raising=False)
    monkeypatch.setenv("COALESCE_PYZMQ_SEND", "1")
    assert _wire._bind_native() is None
    monkeypatch.setenv("COALESCE_PYZMQ_SEND", "0")  # 0: not forced
    monkeypatch.setattr(_wire, "_NATIVE", [])  # decided anew, in this environment
    assert (_wire._bind_native() is None) == (_wire._native() is None)
    monkeypatch.delenv("COALESCE_PYZMQ_SEND")
    monkeypatch.setenv("COALESCE_NO_ACCEL", "1")
    assert _wire._bind_native() is None


@pytest.mark.parametrize(
    ("value", "on"), [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)]
)
def test_a_switch_is_on_when_set_to_anything_but_empty_or_zero(monkeypatch, value, on) -> None:
    if value is None:
        monkeypatch.delenv(NO_ACCEL, raising=False)
    else:
        monkeypatch.setenv(NO_ACCEL, value)
    assert switched_on(NO_ACCEL) is on


def test_stats_say_which_send_is_used() -> None:
    from coalesce import CoalescingPublisher

    pub = CoalescingPublisher(0, endpoint=inproc("which-send"))
    try:
        assert pub.stats().native_send == _wire.native_send() == (_wire._native() is not None)
    finally:
        pub.shutdown()


def test_is_native_tells_the_two_sends_apart(pub_sub) -> None:
    pub, _ = pub_sub
    assert _wire.is_native(_wire.message_sender(pub)) is _wire.native_send()
    assert not _wire.is_native(lambda topic, seq, payload: None)

    def send_native(topic: bytes, seq: int, payload: bytes) -> None:  # the name alone
        pass

    assert not _wire.is_native(send_native)


@needs_native
def test_native_send_never_releases_the_gil(pub_sub) -> None:
    """A thread ready to run gets no bytecode in while the native sends go out
    (and, with no forced switch, would get in at pyzmq's first send if it won the
    GIL there: not asserted, a race)."""
    pub, sub = pub_sub
    send = _wire.message_sender(pub)
    gate = threading.Lock()
    gate.acquire()
    ran = threading.Event()

    def other() -> None:
        with gate:  # waits with the GIL released, then needs it back
            ran.set()

    t = threading.Thread(target=other)
    t.start()
    with no_forced_switch():
        gate.release()  # the other thread is now runnable, but needs the GIL
        for seq in range(2000):
            send(b"t", seq, b"payload" * 100)
        assert not ran.is_set()
    t.join(10)
    assert ran.is_set()
    got = 0
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while poller.poll(1000) and got < 2000:
        sub.recv_multipart()
        got += 1
    assert got == 2000
