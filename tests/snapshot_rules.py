"""A test consumer that follows llm-d-router's snapshot subscriber (its PR #2946,
the consumer of vLLM PR #57789's snapshots), which is Go and cannot be installed
here.  Small on purpose, and no more than its source:

- ``pkg/kvevents/snapshot.go`` at llm-d/llm-d-router 0854a27 (the PR's first
  revision, the 24-byte seq frame: this project's ``snapshot_identity=seq``):
  ``snapshotSubscriber.consume``: a fresh SUB; the first live message must have
  3 frames, a 24-byte seq frame (8-byte seq, 16-byte publisher id) and a
  ``kv@<address:port>@<model>`` topic; then a REQ sends ``b"snapshot"`` while
  live messages are buffered (at most 4,096); the reply ``[cut, id, chunk...]``
  must carry the first message's id and a cut of -1 or more; the chunks go into
  a fresh index, then every buffered and queued message with a seq from
  ``cut + 1`` on, in order (a lower seq is skipped, a higher one is a "live
  sequence gap"); then the index is installed and each live message advances
  it.  Any failure drops the index (the router matches nothing for the pod)
  and starts over with a fresh SUB and a fresh snapshot (``run``; the 1 s wait
  between tries is not modelled: nothing here depends on it);
- ``pkg/kvevents/pool.go`` at the same commit, ``processEventBatch`` with
  ``strict`` set (a snapshot pool): a store whose parent the index does not
  hold, or a store without tokens of a hash it does not hold
  (``handleDeviceTierUpdate``), fails the bootstrap or the live stream; stores
  and removals are reference-counted per (tier, group) (``eventDedupFilter``);
  ``AllBlocksCleared`` clears the **GPU tier only** (``clearSnapshotGPU``:
  "GPU resets preserve offloaded residency").

Left out: the 5 s heartbeat timeout, the byte limits (64 MiB buffered, 256 MiB
a reply), token-to-request-key hashing (keys are the engine's hashes here) and
the matcher.  Payloads are read as plain msgpack, not with this project's types.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import msgspec
import zmq

MAX_BUFFERED = 4096
"""Live messages buffered while the snapshot reply is awaited (``len(buffered) >= 4096``)."""


class StrictError(Exception):
    """An event a strict (snapshot) pool cannot apply: the bootstrap or stream fails."""


class StrictIndex:
    """A snapshot pool's index: keys ``(tier, group, hash)`` with a count each."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[Any, Any, Any]] = Counter()

    def _held_anywhere(self, h: Any) -> bool:
        return any(k[2] == h for k in self.counts)

    def apply(self, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        if not isinstance(batch, list) or len(batch) != 3:
            raise StrictError("the batch is not a 3-element array")  # ParseMessage
        for ev in batch[1]:
            kind = ev.get("type") if isinstance(ev, dict) else ev[0]
            if kind == "BlockStored":
                self._store(ev)
            elif kind == "BlockRemoved":
                tier = _tier(ev.get("medium"))
                for h in ev["block_hashes"]:
                    key = (tier, ev.get("group_idx"), h)
                    if self.counts.get(key, 0) > 1:
                        self.counts[key] -= 1
                    else:
                        self.counts.pop(key, None)
            elif kind == "AllBlocksCleared":
                for key in [k for k in self.counts if k[0] == "gpu"]:
                    del self.counts[key]

    def _store(self, ev: dict[str, Any]) -> None:
        parent = ev.get("parent_block_hash")
        if parent is not None and parent != 0 and not self._held_anywhere(parent):
            raise StrictError(f"no request key for the parent {parent!r}")
        if not ev.get("token_ids"):
            for h in ev["block_hashes"]:  # handleDeviceTierUpdate: each must resolve
                if not self._held_anywhere(h):
                    raise StrictError(f"no request key for the tokenless store {h!r}")
        tier = _tier(ev.get("medium"))
        for h in ev["block_hashes"]:
            self.counts[(tier, ev.get("group_idx"), h)] += 1

    def state(self) -> dict[tuple[Any, Any, Any], int]:
        return dict(self.counts)


def _tier(medium: Any) -> str:
    """``normalizeDeviceTier``: lower case, empty is the GPU."""
    return str(medium).lower() if medium else "gpu"


class SnapshotRulesConsumer:
    """One publisher's snapshot subscriber and the index it installs."""

    def __init__(self, endpoint: str, snapshot_endpoint: str, timeout: float = 10.0) -> None:
        self._endpoint = endpoint
        self._snapshot_endpoint = snapshot_endpoint
        self._timeout = timeout
        self.index: StrictIndex | None = None  # installed: what the router matches
        self.failures: list[str] = []
        self.bootstraps = 0
        self.last_seq: int | None = None
        self._sub: zmq.Socket[bytes] | None = None
        self._start()

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)

    def _start(self) -> None:
        self.close()
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # the default TopicFilter
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(self._endpoint)
        self._sub = sub
        self._next: int | None = None
        self._pending: StrictIndex | None = None  # built by a bootstrap, not yet installed
        self._epoch: bytes | None = None
        self._topic: bytes | None = None

    def _fail(self, reason: str) -> None:
        self.failures.append(reason)
        self.index = None  # invalidate
        self._start()

    def poll(self, timeout: float) -> int:
        """Handle the live messages that arrive within ``timeout`` s; how many."""
        assert self._sub is not None
        n = 0
        deadline = time.monotonic() + timeout
        while self._sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            frames = self._sub.recv_multipart()
            n += 1
            if self._next is None:
                self._bootstrap(frames)
            elif not self._advance(frames):
                return n
            if time.monotonic() >= deadline:
                break
        return n

    def _live(self, frames: list[bytes]) -> tuple[bytes, int, bytes, bytes]:
        if len(frames) != 3 or len(frames[1]) != 24:
            raise StrictError("expected snapshot-enabled live frames")
        return frames[0], int.from_bytes(frames[1][:8], "big"), frames[1][8:], frames[2]

    def _bootstrap(self, first_frames: list[bytes]) -> None:
        self.bootstraps += 1
        try:
            topic, _, epoch, _ = self._live(first_frames)
        except StrictError as exc:
            self._fail(str(exc))
            return
        text = topic.decode(errors="replace")
        if not text.startswith("kv@") or text.count("@") != 2:
            self._fail("snapshot recovery requires kv@<address:port>@<model> topic")
            return
        buffered = [first_frames]
        req = zmq.Context.instance().socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        assert self._sub is not None
        try:
            req.connect(self._snapshot_endpoint)
            req.send(b"snapshot")
            deadline = time.monotonic() + self._timeout
            poller = zmq.Poller()
            poller.register(req, zmq.POLLIN)
            poller.register(self._sub, zmq.POLLIN)
            reply: list[bytes] | None = None
            while reply is None:
                left = deadline - time.monotonic()
                ready = dict(poller.poll(max(0, int(left * 1000)))) if left > 0 else {}
                if not ready:
                    self._fail("snapshot request timed out")
                    return
                if req in ready:
                    reply = req.recv_multipart()
                elif self._sub in ready:
                    if len(buffered) >= MAX_BUFFERED:
                        self._fail("bootstrap buffer exhausted")
                        return
                    buffered.append(self._sub.recv_multipart())
        finally:
            req.close(linger=0)
        if len(reply) < 2 or len(reply[0]) != 8 or len(reply[1]) != 16:
            self._fail("malformed snapshot reply")
            return
        cut = int.from_bytes(reply[0], "big", signed=True)
        if cut < -1:
            self._fail(f"snapshot unavailable ({cut})")
            return
        if reply[1] != epoch:
            self._fail("publisher changed during bootstrap")
            return
        index = StrictIndex()
        try:
            for chunk in reply[2:]:
                index.apply(chunk)
        except StrictError as exc:
            self._fail(f"snapshot: {exc}")
            return
        self._pending = index
        self._next, self._epoch, self._topic = cut + 1, reply[1], topic
        for frames in buffered:
            if not self._advance(frames, installing=True):
                return
        while self._sub.poll(0):  # a finite cut: what is queued now, then install
            if not self._advance(self._sub.recv_multipart(), installing=True):
                return
        self.index = index

    def _advance(self, frames: list[bytes], installing: bool = False) -> bool:
        index = self._pending if installing else self.index
        assert index is not None and self._next is not None
        try:
            topic, seq, epoch, payload = self._live(frames)
            if topic != self._topic or epoch != self._epoch:
                raise StrictError("publisher identity changed")
            if seq < self._next:
                return True
            if seq != self._next:
                raise StrictError(f"live sequence gap: got {seq}, want {self._next}")
            index.apply(payload)
        except StrictError as exc:
            self._fail(str(exc))
            return False
        self._next += 1
        self.last_seq = seq
        return True

    def state(self) -> dict[tuple[Any, Any, Any], int] | None:
        """The installed index (None: the router matches nothing for this pod)."""
        return None if self.index is None else self.index.state()
