"""A test consumer that follows llm-d-router's KV-event subscriber, which is Go
and cannot be installed here.  Small on purpose, and no more than its source:

- ``pkg/kvevents/zmq_subscriber.go`` at llm-d-router commit ebab687 (main,
  2026-08-21): ``runSubscriber`` (live messages, gaps, restarts, joining
  mid-stream), ``acceptLiveWithoutReplay``, ``requestReplay`` (a DEALER sends
  ``[b"", seq]``; the reply must be contiguous from the seq asked for, else
  "incomplete replay": the pod is reset and replay is off for ``COOLDOWN``,
  during which a message after a gap is dropped) and ``invalidateReplay``;
- ``pkg/kvevents/pool.go`` at the same commit: ``AllBlocksCleared`` clears the
  pod in every tier (``clearPod``); stores and removals are reference-counted,
  and a store whose parent the pod does not hold is dropped (the facts sheet's
  "llmd" model: :class:`coalesce.refmodel.SubscriberModel`);
- ``pkg/kvevents/engineadapter/vllm_adapter.go`` at the same commit:
  ``ParseMessage`` decodes the batch into a 3-field array struct with
  vmihailenco/msgpack v5.4.1, which fails on any other element count (checked
  by running that library: a 4-element batch, vLLM PR #57789's newest
  ``IdentifiedKVEventBatch``, is dropped, and so is a 2-element one).

Left out: the 2-minute overall replay timeout and the per-attempt retries
(a reply here either comes whole within ``timeout`` or counts as failed), the
process-wide replay limiter and tracing.  The clock is injectable, so the
cooldown is tested without waiting 30 s.  Payloads are read as plain msgpack,
not with this project's types.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from coalesce.refmodel import SubscriberModel

COOLDOWN = 30.0
"""``replayCooldown``: seconds replay stays off after a failed one."""


class LlmdRulesConsumer:
    """One pod's subscriber (one publisher, one DP rank) and its index."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        clock: Callable[[], float] = time.monotonic,
        timeout: float = 5.0,
    ) -> None:
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._clock = clock
        self._timeout = timeout
        self.index = SubscriberModel("llmd")
        self.last_seq: int | None = None  # lastSeq / hasLastSeq
        self.last_live_seq: int | None = None  # lastLiveSeq / hasLastLiveSeq
        self._failed_at: float | None = None  # lastReplayFailure
        self.resets = self.incomplete_replays = self.dropped_in_cooldown = 0
        self.skipped = self.applied = self.clears = 0
        self._started = False

    def close(self) -> None:
        self._sub.close(linger=0)

    # -- runSubscriber ----------------------------------------------------------

    def poll(self, timeout: float) -> int:
        """Handle the live messages that arrive within ``timeout`` s; how many."""
        if not self._started:
            self._started = True
            if self._replay_endpoint and self.last_seq is None and self._can_replay():
                self._replay(0)  # "Requesting proactive replay on connect"
        n = 0
        deadline = time.monotonic() + timeout
        while self._sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            self._live(self._sub.recv_multipart())
            n += 1
            if time.monotonic() >= deadline:
                break
        return n

    def _live(self, frames: list[bytes]) -> None:
        parsed = _parse(frames)
        if parsed is None:
            self.skipped += 1  # "Malformed event frame"
            return
        seq, payload = parsed
        if not self._replay_endpoint:
            if self.last_live_seq is not None:
                if seq == self.last_live_seq:
                    return
                if seq != self.last_live_seq + 1:
                    self._reset()
            self.last_live_seq = seq
            self._apply(payload)
            return
        attempted = False
        if self.last_live_seq is not None and seq < self.last_live_seq:  # a restart
            self._reset()
            self.last_seq, self._failed_at = None, None
            attempted = True
            self._replay(0)
        if self.last_live_seq is not None and seq == self.last_live_seq:
            return
        self.last_live_seq = seq
        if self.last_seq is not None and seq <= self.last_seq:
            return
        if self.last_seq is not None and seq > self.last_seq + 1:  # a gap
            if not self._can_replay():
                self.dropped_in_cooldown += 1
                return
            attempted = True
            if not self._replay(self.last_seq + 1):
                return
        if self.last_seq is None and seq > 0:  # joining mid-stream
            if attempted or not self._can_replay():
                return
            if not self._replay(0):
                return
        if self.last_seq is not None and (seq <= self.last_seq or seq > self.last_seq + 1):
            return
        self._apply(payload)
        self.last_seq = seq

    # -- requestReplay ----------------------------------------------------------

    def _can_replay(self) -> bool:
        return self._failed_at is None or self._clock() - self._failed_at >= COOLDOWN

    def _invalidate(self) -> None:
        self._reset()
        self.last_seq = None
        self._failed_at = self._clock()

    def _replay(self, start: int) -> bool:
        assert self._replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            expected, replayed = start, 0
            deadline = time.monotonic() + self._timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000)):
                    self._invalidate()  # no whole reply in time
                    self.incomplete_replays += 1
                    return False
                frames = dealer.recv_multipart()
                if frames and not frames[0]:
                    frames = frames[1:]
                if len(frames) == 3 and not frames[2]:
                    break  # the end marker
                parsed = _parse(frames)
                if parsed is None or parsed[0] != expected:
                    self.incomplete_replays += 1  # "incomplete replay: expected X, got Y"
                    self._invalidate()
                    return False
                self._apply(parsed[1])
                self.last_seq = expected
                expected += 1
                replayed += 1
        finally:
            dealer.close(linger=0)
        if replayed == 0 and start > 0:  # "sequence N was not available"
            self.incomplete_replays += 1
            self._invalidate()
            return False
        self._failed_at = None
        return True

    # -- pool.go ----------------------------------------------------------------

    def _reset(self) -> None:
        self.resets += 1
        self.index.clear()

    def _apply(self, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        if not isinstance(batch, list) or len(batch) != 3:
            # engineadapter/vllm_adapter.go:68 (ParseMessage) decodes the batch into a
            # 3-field array struct with vmihailenco/msgpack v5.4.1, which wants exactly
            # 3 elements ("number of fields in array-encoded struct has changed"): the
            # batch is dropped, its seq already taken
            self.skipped += 1
            return
        for ev in batch[1]:
            kind = ev.get("type") if isinstance(ev, dict) else ev[0]
            if kind == "BlockStored":
                self.index.store(
                    ev["block_hashes"],
                    ev.get("parent_block_hash"),
                    ev.get("medium"),
                    ev.get("group_idx"),
                )
            elif kind == "BlockRemoved":
                self.index.remove(ev["block_hashes"], ev.get("medium"), ev.get("group_idx"))
            elif kind == "AllBlocksCleared":
                self.clears += 1
                self.index.clear()  # clearPod: every tier of the pod
        self.applied += 1

    def held(self) -> set[Any]:
        return self.index.held()


def _parse(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``parseEventFrame``: exactly 3 frames, the seq in the first 8 bytes of the 2nd."""
    if len(frames) != 3 or len(frames[1]) < 8:
        return None
    return int.from_bytes(frames[1][:8], "big"), frames[2]
