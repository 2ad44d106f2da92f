"""Encode and send: one batch becomes one 3-frame ZMQ message.

Frames: ``[topic, seq (8 bytes big-endian), msgpack payload]``, sent by
:func:`message_sender`'s function: one C call holding the GIL (the optional
``coalesce._csend``), or else three pyzmq ``send()`` calls with a plain-int
``SNDMORE`` flag (``send_multipart`` builds an IntFlag per frame, which costs
more than the send itself; docs/benchmarks.md and the facts sheet have the
figures).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import zmq

from coalesce._env import PYZMQ_SEND
from coalesce._layout import load_accelerator
from coalesce._settings import is_bind_endpoint
from coalesce.events import KVEventBatch

__all__ = [
    "END_SEQ",
    "Encoder",
    "SendMessage",
    "Sockets",
    "loaded_libzmq",
    "is_native",
    "message_sender",
    "native_send",
    "open_sockets",
    "read_requests",
    "send_message",
]

_MORE = int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
END_SEQ = b"\xff" * 8
"""The replay end marker's seq frame (-1 as 8 signed big-endian bytes)."""


class Encoder:
    """msgspec msgpack encoding of any ``EventBatch``-like struct.  O(events), in C."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, batch: Any) -> bytes:
        """Encode one batch.  Raises whatever msgspec raises for an unencodable value."""
        return self._enc.encode(batch)

    def encode_now(self, events: list[Any], rank: int | None) -> bytes:
        """A batch of ``events`` stamped now: a heartbeat (no events), a loss marker,
        a snapshot chunk (the events may be of any classes that encode alike)."""
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank)
        return self._enc.encode(batch)


@dataclass(slots=True)
class Sockets:
    """A publisher's sockets and the endpoints they ended up on (a tcp port 0 resolved)."""

    pub: zmq.Socket[bytes]
    endpoint: str
    router: zmq.Socket[bytes] | None = None
    replay_endpoint: str | None = None
    snapshot: zmq.Socket[bytes] | None = None
    snapshot_endpoint: str | None = None

    def close(self, linger: int = 0) -> None:
        for sock in (self.pub, self.router, self.snapshot):
            if sock is not None:
                sock.close(linger=linger)

    def close_for_shutdown(self, seconds: float) -> None:
        """Close them as the sender thread stops.  What was sent must still reach
        subscribers: the PUB lingers ``seconds`` (0 would discard queued messages: a
        loss with no gap; close() does not wait, ZeroMQ's I/O thread delivers in the
        background); the ROUTERs do not."""
        self.pub.close(linger=int(seconds * 1000))
        for sock in (self.router, self.snapshot):
            if sock is not None:
                sock.close(linger=0)


def open_sockets(
    endpoint: str,
    replay_endpoint: str | None,
    snapshot_endpoint: str | None,
    *,
    hwm: int,
    replay_window: int,
    bind: bool | None = None,
) -> Sockets:
    """Create and bind (or connect) a publisher's PUB, replay ROUTER and snapshot ROUTER.

    vLLM's rules: the PUB binds wildcard, ipc and inproc endpoints and
    connects to the rest (``bind``, when not None, decides instead); the
    ROUTERs always bind.  Raises ``ValueError`` for
    an endpoint ZeroMQ cannot parse and ``OSError`` when one cannot be bound
    or connected (nothing is left open then).
    """
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socks = Sockets(pub=ctx.socket(zmq.PUB), endpoint=endpoint)
    try:
        socks.pub.set_hwm(hwm)
        socks.endpoint = _attach(
            socks.pub, endpoint, bind=is_bind_endpoint(endpoint) if bind is None else bind
        )
        if replay_endpoint is not None:
            socks.router = ctx.socket(zmq.ROUTER)
            socks.router.setsockopt(zmq.SNDHWM, replay_window)
            socks.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            socks.replay_endpoint = _attach(socks.router, replay_endpoint, bind=True)
        if snapshot_endpoint is not None:
            socks.snapshot = ctx.socket(zmq.ROUTER)
            socks.snapshot.setsockopt(zmq.ROUTER_MANDATORY, 1)
            socks.snapshot_endpoint = _attach(socks.snapshot, snapshot_endpoint, bind=True)
    except BaseException:
        socks.close()
        raise
    return socks


def _attach(sock: zmq.Socket[bytes], endpoint: str, *, bind: bool) -> str:
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect"
        if exc.errno in (zmq.EINVAL, zmq.EPROTONOSUPPORT):
            raise ValueError(f"cannot {verb} {endpoint!r}: {exc}") from exc
        raise OSError(exc.errno, f"cannot {verb} {endpoint!r}: {exc}") from exc
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    return endpoint


def send_message(
    sock: zmq.Socket[bytes], topic: bytes, seq: int, payload: bytes, tail: bytes = b""
) -> None:
    """Send one 3-frame message on a PUB socket through pyzmq.  Never blocks: PUB
    drops at its HWM.  pyzmq releases the GIL for each frame (see
    :func:`message_sender`).  ``tail`` follows the 8 seq bytes in their frame."""
    sock.send(topic, _MORE)
    sock.send(seq.to_bytes(8, "big") + tail, _MORE)
    sock.send(payload)


SendMessage = Callable[[bytes, int, bytes], None]
"""``send(topic, seq, payload)``: one 3-frame message on one PUB socket."""


def message_sender(sock: zmq.Socket[bytes], tail: bytes = b"", native: bool = True) -> SendMessage:
    """How to send on this PUB socket: without releasing the GIL where possible.  O(1).

    ``tail`` (at most 16 bytes) follows the 8 seq bytes in the seq frame: the
    ``publisher_id`` of a stream with snapshots on (vLLM PR #57789's 24-byte
    seq frame).

    pyzmq releases the GIL around every frame it sends; a waiting engine
    thread takes it each time, and the sender thread then waits for it
    until the engine lets go (its GPU wait, or CPython's forced switch 5 ms
    later), so a sender behind sends a message per 5 ms of engine work
    (docs/backpressure.md, "Sending without handing the GIL over").  With
    the C accelerator (``coalesce._csend``) the three frames go out in one
    call to pyzmq's own libzmq, holding the GIL: a PUB send never blocks,
    so this costs the engine only the copy of the frames.  Without it (not
    built, not Linux, libzmq not found, or the handle not read back as this
    PUB socket) :func:`send_message` is used.  Either raises
    ``zmq.ZMQError`` for a closed socket.  ``native=False``: pyzmq's sends always.
    """
    csend = _native() if native else None
    if csend is not None and isinstance(sock, zmq.Socket):  # (not a test's wrapper)
        handle = int(sock.underlying)
        if csend.socket_type(handle) == int(zmq.PUB) == int(sock.type):
            send = csend.send

            def send_native(topic: bytes, seq: int, payload: bytes) -> None:
                if sock.closed:  # its handle is freed: never pass it on
                    raise zmq.ZMQError(zmq.ENOTSOCK)
                err = send(handle, topic, seq, payload, tail)
                if err:
                    raise zmq.ZMQError(err)

            _NATIVE_SENDS.add(send_native)
            return send_native

    def send_pyzmq(topic: bytes, seq: int, payload: bytes) -> None:
        send_message(sock, topic, seq, payload, tail)

    return send_pyzmq


_NATIVE: list[Any] = []  # [module or None], once looked up

_NATIVE_SENDS: weakref.WeakSet[SendMessage] = weakref.WeakSet()
"""The C sends :func:`message_sender` made (weakly: a socket's send goes with it)."""


def is_native(send: SendMessage) -> bool:
    """Whether ``send`` is a C send made by :func:`message_sender` (not any function
    of that name).  O(1)."""
    return send in _NATIVE_SENDS


def native_send() -> bool:
    """Whether :func:`message_sender` can use the C send in this process.  O(1)."""
    return _native() is not None


def _native() -> Any:
    """``coalesce._csend`` bound to the libzmq pyzmq loaded, or None.  O(1) after the
    first call (which reads /proc/self/maps)."""
    if not _NATIVE:
        _NATIVE.append(_bind_native())
    return _NATIVE[0]


def _bind_native() -> Any:
    # (COALESCE_PYZMQ_SEND: forced off for an A/B; COALESCE_NO_ACCEL: every accelerator)
    _csend = load_accelerator("_csend", "pyzmq's sends are used", check=None, off=PYZMQ_SEND)
    if _csend is None:
        return None
    path = loaded_libzmq()
    if path is None or not _csend.bind(path):
        return None
    return _csend


def loaded_libzmq() -> str | None:
    """The path of the libzmq pyzmq loaded in this process, if there is exactly one
    (else None: the native send is not used).  O(mapped files); Linux only."""
    zmq.zmq_version()  # pyzmq's backend, and its libzmq, are loaded
    paths = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6:
                    path = fields[5].strip()
                    if path.startswith("/") and os.path.basename(path).startswith("libzmq"):
                        paths.add(path)
    except OSError:
        return None
    return paths.pop() if len(paths) == 1 else None


def read_requests(
    sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], None], limit: int = 16
) -> bool:
    """Hand each waiting request (a multipart message) to ``handle``, at most ``limit``.

    Never blocks (it reads only while ``EVENTS`` says one is waiting), so a
    ROUTER service's step stays bounded however many clients ask.  Returns
    True if it read any.  O(limit).
    """
    did = False
    for _ in range(limit):
        if not cast(int, sock.getsockopt(zmq.EVENTS)) & _POLLIN:
            break
        handle(sock.recv_multipart())
        did = True
    return did
