"""The coalescer process: compact -> send -> replay buffer, outside the engine's process.

With ``coalescer="process"`` the engine's process keeps only what vLLM's
own publisher does there, and less: ``publish()`` -> backlog -> encode (each
batch as it is, or a folded window under pressure) -> one push over a
ZeroMQ ``ipc`` pipe.  This process owns the PUB socket, the sequence
counter, the replay buffer and its ROUTER (and, with snapshots, the
recorder, its ROUTER and the heartbeat), and runs the payload rules
(:func:`coalesce.compactor.compact_payload`) on every folded window it is
handed, on its own core and under its own GIL, so the rules cost the
engine nothing.

The pipe (a PAIR socket, the engine side binds it) carries messages of one
or two frames: a 5-byte head (a kind byte, then the event count as 4
little-endian bytes), then a payload for every kind but :data:`GAP` ("a loss
before the next message", shown by this process's stream as ``loss_marker``
says) and :data:`STOP` ("send what you have, then exit").  With snapshots, :data:`RECORD` carries a
batch refused over budget (recorded, not sent) and :data:`INVALIDATE` the
reason the recorder cannot be exact (a batch it will never see).  The pipe holds at most
:data:`PIPE_HWM` messages each side, so what sits in it is bounded; a full
pipe makes the engine's sender wait (off the engine thread) while its
backlog, with its budgets, absorbs the burst.

This process reports over the pipe once, at start (the endpoints it bound,
or why it could not), and otherwise through a small shared file of int64
counters (:data:`COUNTERS`) that it rewrites after each message: the
engine's ``stats()`` reads them, and if this process dies the engine's
sender reads the next seq there, binds the endpoints itself and goes on
after a loss.  It exits on :data:`STOP`, or when its parent has gone.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, cast

import msgspec
import zmq

from coalesce._replay import ReplayBuffer, ReplayService
from coalesce._settings import Settings
from coalesce._snapshot import HEARTBEAT, SnapshotService
from coalesce._stream import Stream
from coalesce._wire import Encoder, is_native, message_sender, open_sockets
from coalesce.compactor import compact_payload
from coalesce.events import KVEventBatch

__all__ = ["AS_IS", "COMPACT", "COUNTERS", "GAP", "STOP", "CoalescerProcess", "main"]

log = logging.getLogger("coalesce")

AS_IS, COMPACT, GAP, STOP, RECORD, INVALIDATE = 0, 1, 2, 3, 4, 5
"""Pipe message kinds: send as it is; run the payload rules first; a loss; stop;
(snapshots) give the recorder a batch that was refused, not sent; tell the recorder
it cannot be exact (the payload says why)."""

PIPE_HWM = 16
"""Messages the pipe queues on each side (so at most twice this many are in flight,
plus what the kernel's socket buffer holds)."""

START_TIMEOUT = 30.0
"""Seconds the constructor waits for the process to bind its endpoints."""

COUNTERS = (
    "next_seq",
    "received",
    "messages_sent",
    "events_sent",
    "bytes_sent",
    "seq_gaps",
    "loss_markers",
    "events_superseded",
    "blocks_cancelled",
    "events_merged",
    "payload_passes",
    "replay_requests",
    "replay_invalid",
    "replay_refused",
    "replay_messages",
    "replay_abandoned",
    "snapshot_requests",
    "snapshot_invalid",
    "snapshot_replies",
    "snapshot_unavailable",
    "snapshot_abandoned",
    "snapshot_blocks",
    "snapshot_exact",
    "native_send",
)
"""The shared counters, in file order (int64 each); all but the first two are
``PublisherStats`` fields."""

_PUBLISHED = COUNTERS[2:]
_LAYOUT = struct.Struct(f"<{len(COUNTERS)}q")
_HEAD = struct.Struct("<BI")
_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_NO_RELEASE = 1 << 62  # nothing else here needs the GIL: the rules keep it
_IDLE_MS = 100
_PASS = 64  # pipe messages per pass, between replay slices
_BOOT = "import sys; from coalesce._coalescer import main; sys.exit(main(sys.argv[1:]))"


class CoalescerProcess:
    """The engine side's handle on a coalescer process: start, push, counters, stop.

    Owned by the sender thread (``push``, ``alive``, ``stop``); ``counters``
    is safe from any thread.  Raises ``ValueError`` or ``OSError`` from the
    constructor as the publisher's own binding would, and ``RuntimeError``
    if the process does not start within :data:`START_TIMEOUT`.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None,
        snapshot_endpoint: str | None,
        topic: bytes,
        hwm: int,
        buffer_steps: int,
        rank: int,
        publisher_id: bytes | None,
        settings: Settings,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="coalesce-")
        self._last = dict.fromkeys(COUNTERS, 0)
        self._proc: subprocess.Popen[bytes] | None = None
        self._pipe: zmq.Socket[bytes] | None = None
        try:
            path = os.path.join(self._dir, "counters")
            with open(path, "wb") as f:
                f.write(bytes(_LAYOUT.size))
            with open(path, "r+b") as f:
                self._counters = mmap.mmap(f.fileno(), _LAYOUT.size)
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            self._pipe = ctx.socket(zmq.PAIR)
            self._pipe.set_hwm(PIPE_HWM)
            pipe_ep = f"ipc://{self._dir}/pipe"
            self._pipe.bind(pipe_ep)
            spec = {
                "pipe": pipe_ep,
                "counters": path,
                "endpoint": endpoint,
                "replay_endpoint": replay_endpoint,
                "snapshot_endpoint": snapshot_endpoint,
                "topic": topic.hex(),
                "hwm": hwm,
                "buffer_steps": buffer_steps,
                "rank": rank,
                "publisher_id": (publisher_id or b"").hex(),
                "settings": asdict(settings),
            }
            env = dict(os.environ)
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                env=env,
            )
            ready = self._wait_ready()
        except BaseException:
            self._cleanup(kill=True)
            raise
        self.hwm = hwm
        self.endpoint: str = ready["endpoint"]
        self.replay_endpoint: str | None = ready["replay_endpoint"]
        self.snapshot_endpoint: str | None = ready["snapshot_endpoint"]
        self.pushed = 0
        """Messages pushed (heads counted once), compared with ``received`` by ``flush()``."""

    def _wait_ready(self) -> dict[str, Any]:
        assert self._pipe is not None and self._proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while not self._pipe.poll(50, zmq.POLLIN):
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(f"the coalescer process exited at start (code {code})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the coalescer process did not start in {START_TIMEOUT} s")
        reply = json.loads(self._pipe.recv())
        if "error" in reply:
            if reply["error"] == "ValueError":
                raise ValueError(reply["message"])
            raise OSError(reply.get("errno") or 0, reply["message"])
        return cast(dict[str, Any], reply)

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def push(self, kind: int, n_events: int = 0, payload: bytes | None = None) -> bool:
        """Queue one message on the pipe; False (nothing queued) if it is full.  O(1)."""
        pipe = self._pipe
        assert pipe is not None
        head = _HEAD.pack(kind, n_events)
        try:
            if payload is None:
                pipe.send(head, _NOBLOCK)
            else:
                pipe.send(head, _NOBLOCK | _MORE)
        except zmq.Again:
            return False
        if payload is not None:
            # A message's later frames never meet the HWM once its first is in.
            pipe.send(payload)
        self.pushed += 1
        return True

    def wait_writable(self, timeout: float) -> None:
        """Wait (without the GIL) up to ``timeout`` seconds for room in the pipe."""
        assert self._pipe is not None
        self._pipe.poll(int(timeout * 1000) or 1, zmq.POLLOUT)

    def alive(self) -> bool:
        """The process runs.  O(1): one ``waitpid`` without waiting."""
        return self._proc is not None and self._proc.poll() is None

    def counters(self) -> dict[str, int]:
        """The process's counters as it last wrote them (kept once it has stopped).  O(1)."""
        if self._counters.closed:
            return self._last
        return dict(zip(COUNTERS, _LAYOUT.unpack_from(self._counters), strict=True))

    def published(self) -> dict[str, Any]:
        """The counters that are ``PublisherStats`` fields."""
        c = self.counters()
        out: dict[str, Any] = {name: c[name] for name in _PUBLISHED}
        out["snapshot_exact"] = bool(c["snapshot_exact"])
        out["native_send"] = bool(c["native_send"])
        return out

    def drained(self) -> bool:
        """The process has taken every message pushed so far."""
        return self.counters()["received"] >= self.pushed

    def stop(self, timeout: float) -> None:
        """Ask the process to send what it has and exit (its PUB lingers ``timeout``
        seconds for slow subscribers, as the sender's does); kill it if it has not
        exited ``timeout + 1`` seconds from now.  Idempotent."""
        proc = self._proc
        if proc is None:
            return
        deadline = time.monotonic() + timeout + 1.0
        while proc.poll() is None and not self.push(STOP):
            if time.monotonic() > deadline:
                break
            self.wait_writable(0.01)
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("kv-coalesce: the coalescer process did not stop in time; killed")
        self._cleanup(kill=True)

    def dead(self) -> dict[str, int]:
        """After a failure: make sure the process is gone, and return its last counters."""
        self._cleanup(kill=True)
        return self._last

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    def _cleanup(self, kill: bool) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None and kill:
            proc.kill()
            proc.wait()
        if self._pipe is not None:
            self._pipe.close(linger=0)
            self._pipe = None
        if hasattr(self, "_counters") and not self._counters.closed:
            self._last = self.counters()
            self._counters.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class Coalescer:
    """The process's loop: take from the pipe, compact what is marked, send, replay.

    Each pass takes at most 64 messages, then serves one replay
    slice, so replay clients and the live stream share the process fairly.
    Single-threaded; O(payload bytes) per message.
    """

    def __init__(self, spec: dict[str, Any], pipe: zmq.Socket[bytes]) -> None:
        self._pipe = pipe
        settings = Settings(**spec["settings"])  # the engine side's, as resolved there
        self._socks = open_sockets(
            spec["endpoint"],
            spec["replay_endpoint"],
            spec["snapshot_endpoint"],
            hwm=spec["hwm"],
            replay_window=settings.replay_window,
        )
        send = message_sender(self._socks.pub)
        self._topic = bytes.fromhex(spec["topic"])
        self._linger = int(settings.shutdown_timeout * 1000)
        self._buffer = ReplayBuffer(spec["buffer_steps"])
        router = self._socks.router
        self._replay = (
            None
            if router is None
            else ReplayService.from_settings(router, self._buffer, self._topic, settings)
        )
        self._snapshot: SnapshotService | None = None
        rank = spec["rank"]
        pid = None
        if self._socks.snapshot is not None:
            pid = bytes.fromhex(spec["publisher_id"])
            self._snapshot = SnapshotService.from_settings(
                self._socks.snapshot, pid, rank, settings
            )
            self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._stream = Stream.of_rank(
            send,
            self._topic,
            self._buffer,
            Encoder(pid),
            rank,
            settings.loss_marker,
            beats=self._snapshot is not None,
        )
        with open(spec["counters"], "r+b") as f:
            self._file = mmap.mmap(f.fileno(), _LAYOUT.size)
        self._c = dict.fromkeys(COUNTERS, 0)
        self._c["native_send"] = int(is_native(send))
        self._write()  # (before the ready message: stats() read it from the start)

    @property
    def endpoints(self) -> dict[str, str | None]:
        return {
            "endpoint": self._socks.endpoint,
            "replay_endpoint": self._socks.replay_endpoint,
            "snapshot_endpoint": self._socks.snapshot_endpoint,
        }

    def run(self) -> None:
        pipe, replay = self._pipe, self._replay
        poller = zmq.Poller()
        poller.register(pipe, zmq.POLLIN)
        for sock in (self._socks.router, self._socks.snapshot):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        snapshot = self._snapshot
        parent = os.getppid()
        try:
            while True:
                did = False
                for _ in range(_PASS):
                    if not cast(int, pipe.getsockopt(zmq.EVENTS)) & _POLLIN:
                        break
                    if not self._take():
                        return
                    did = True
                if replay is not None and replay.step():
                    did = True
                if snapshot is not None and snapshot.step(self._stream.covered):
                    did = True
                if did:
                    self._write()
                    continue
                if os.getppid() != parent:
                    log.warning("kv-coalesce: the engine's process has gone: stopping")
                    return
                if (
                    snapshot is not None
                    and time.monotonic() - self._stream.last_sent >= HEARTBEAT
                ):
                    self._stream.heartbeat()  # PR #57789: an idle publisher beats
                    self._write()
                    continue
                busy = (replay is not None and replay.busy) or (
                    snapshot is not None and snapshot.busy
                )
                poller.poll(1 if busy else _IDLE_MS)
        finally:
            self._write()
            if replay is not None:
                replay.close()
            if snapshot is not None:
                snapshot.close()
            self._socks.pub.close(linger=self._linger)
            if self._socks.router is not None:
                self._socks.router.close(linger=0)

    def _take(self) -> bool:
        """Handle one pipe message; False on STOP."""
        pipe, c = self._pipe, self._c
        kind, n = _HEAD.unpack(pipe.recv())
        c["received"] += 1
        if kind == STOP:
            self._stream.show_loss()  # a loss at the end is shown all the same
            return False
        if kind == GAP:
            self._stream.lose()
            return True
        payload = pipe.recv()
        if kind == INVALIDATE:
            if self._snapshot is not None:
                self._snapshot.invalidate(payload.decode("utf-8", "replace"))
            return True
        if kind == RECORD:
            self._record(payload)
            return True
        if kind == COMPACT:
            result = compact_payload(payload, _NO_RELEASE)
            if result is not None:
                payload, n, superseded, cancelled, merged = result
                c["events_superseded"] += superseded
                c["blocks_cancelled"] += cancelled
                c["events_merged"] += merged
                c["payload_passes"] += 1
                if n == 0:
                    return True  # everything cancelled: nothing to send, or to record
        self._stream.emit(payload, n)
        if self._snapshot is not None:
            self._record(payload)  # sent: the recorder's state covers it
        return True

    def _record(self, payload: bytes) -> None:
        """Decode a batch (what a subscriber would) and give it to the recorder."""
        snapshot = self._snapshot
        if snapshot is None:
            return
        try:
            batch = self._decode(payload)
        except Exception as exc:  # not the KV batch shape: it cannot be recorded
            snapshot.invalidate(f"a batch it cannot read ({type(exc).__name__})")
            return
        snapshot.record(batch)

    def _write(self) -> None:
        c = self._c
        c.update(self._stream.published())
        c["next_seq"] = self._stream.next_seq
        if self._replay is not None:
            c.update(self._replay.published())
        if self._snapshot is not None:
            c.update(self._snapshot.published())
        _LAYOUT.pack_into(self._file, 0, *(c[name] for name in COUNTERS))


def main(argv: Sequence[str] | None = None) -> int:
    """The process's entry point, started by :class:`CoalescerProcess` with its spec."""
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")
    # Ctrl-C reaches the whole process group: the engine's process decides when this
    # one stops (STOP, or its exit), so that nothing it has handed over is lost first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(args[0])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pipe = ctx.socket(zmq.PAIR)
    pipe.set_hwm(PIPE_HWM)
    pipe.connect(spec["pipe"])
    try:
        coalescer = Coalescer(spec, pipe)
    except (ValueError, OSError) as exc:
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        error = {"error": type(exc).__name__, "errno": getattr(exc, "errno", 0), "message": message}
        pipe.send(json.dumps(error).encode())
        pipe.close(linger=2000)
        return 1
    pipe.send(json.dumps(coalescer.endpoints).encode())
    coalescer.run()
    pipe.close(linger=0)
    return 0
