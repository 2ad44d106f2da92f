"""A deterministic model of the seed scenario: prefix caching with CPU offload.

One :class:`Engine` is one data-parallel rank.  Each step, a few requests
arrive; each request is a long shared prefix (one of ``prefixes``) plus a few
unique blocks.  Blocks already on the GPU are hits; others are allocated on
the GPU, evicting the least recently used block when the pool is full.  An
evicted block is offloaded to the CPU pool (unless already there), which
evicts its own least recently used block when full.  Every ``burst_every``
steps a burst of long unique prompts arrives (for ``burst_length`` steps in a
row) and evicts by the thousand: the traffic that hangs vLLM's publisher.
Every ``clear_every`` steps (if set) the prefix cache is reset.

Events follow vLLM's shape and order (facts sheet section 5): per step the GPU
block pool's events come first (a request's new blocks as one chained
``BlockStored``, evictions as ``BlockRemoved``), then the offload connector's
(``BlockStored(medium="CPU")`` with tokens and parent, CPU evictions).
:meth:`Engine.truth` is the engine's true final state as subscriber keys.

Deterministic: the same config and rank give the same events, in any process.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from coalesce.events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["ENGINES", "Engine", "WorkloadConfig", "as_engine_events", "as_engine_key"]

ENGINES = ("vllm", "sglang")
"""Whose structs the engine publishes (and whose stock publisher it is compared with)."""
_SGLANG_MEDIUM = {"GPU": "GPU", "CPU": "CPU_PINNED"}

_MASK = (1 << 64) - 1
_Block = tuple[int, "int | None", tuple[int, ...]]  # (hash, parent, tokens)


@dataclass(frozen=True)
class WorkloadConfig:
    """Scale knobs.  The defaults are the demo's (``coalesce demo`` sizes burst_requests)."""

    ranks: int = 2
    steps: int = 1500
    prefixes: int = 8
    prefix_blocks: int = 48
    suffix_blocks: int = 2
    requests_per_step: int = 4
    block_size: int = 16
    gpu_blocks: int = 1024
    cpu_blocks: int = 4096
    burst_every: int = 1500
    burst_length: int = 200
    burst_requests: int = 16
    burst_blocks: int = 96
    clear_every: int = 0
    step_cpu_us: float = 300.0
    step_gpu_us: float = 300.0
    batch_events: int = 0
    """Publish each step's events as batches of at most this many (0: one batch per
    step): the upstream report's "thousands of EventBatch objects in one shot"."""
    seed: int = 0
    engine: str = "vllm"
    """``sglang``: the same events in SGLang's structs (signed hashes, ``CPU_PINNED``)."""
    lockstep: bool = True
    """DP ranks wait for each other once per step (the DP all-reduce and step
    coordination), so the slowest rank's ``publish()`` sets every rank's pace."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        largest = max(self.prefix_blocks + self.suffix_blocks, self.burst_blocks)
        if self.gpu_blocks < 2 * largest:
            raise ValueError("gpu_blocks must hold at least two of the largest requests")
        if min(self.ranks, self.steps, self.block_size, self.cpu_blocks) < 1:
            raise ValueError("ranks, steps, block_size and cpu_blocks must be >= 1")
        if self.batch_events < 0:
            raise ValueError("batch_events must be >= 0 (0: one batch per step)")

    def split(self, events: list[Any]) -> list[list[Any]]:
        """One step's events as the batches it publishes (``batch_events`` each).  O(events)."""
        n = self.batch_events
        if n <= 0 or len(events) <= n:
            return [events]
        return [events[i : i + n] for i in range(0, len(events), n)]


class Engine:
    """One DP rank's KV cache.  :meth:`step` returns that step's events.  O(blocks touched)."""

    def __init__(self, config: WorkloadConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self._rng = random.Random(config.seed * 7919 + rank)
        # hash -> (parent, tokens), in LRU order (oldest first)
        self.gpu: OrderedDict[int, tuple[int | None, tuple[int, ...]]] = OrderedDict()
        self.cpu: OrderedDict[int, tuple[int | None, tuple[int, ...]]] = OrderedDict()
        self._step = 0
        self._prefix_tokens = [
            [self._tokens(p, i) for i in range(config.prefix_blocks)]
            for p in range(config.prefixes)
        ]
        self._gpu_events: list[Any] = []
        self._cpu_events: list[Any] = []

    # -- the model -------------------------------------------------------------------

    def _tokens(self, *key: int) -> tuple[int, ...]:
        base = hash(key) & 0xFFFFFFFF
        return tuple((base + i * 2654435761) % 32_000 for i in range(self.config.block_size))

    def _store_event(
        self, chain: list[tuple[int, int | None, tuple[int, ...]]], medium: str
    ) -> Any:
        return BlockStored(
            block_hashes=[h for h, _, _ in chain],
            parent_block_hash=chain[0][1],
            token_ids=[t for _, _, toks in chain for t in toks],
            block_size=self.config.block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    def _evict_gpu(self) -> None:
        victim, (parent, tokens) = self.gpu.popitem(last=False)
        self._gpu_events.append(BlockRemoved(block_hashes=[victim], medium="GPU"))
        if victim in self.cpu:
            self.cpu.move_to_end(victim)
            return
        self.cpu[victim] = (parent, tokens)
        self._cpu_events.append(self._store_event([(victim, parent, tokens)], "CPU"))
        if len(self.cpu) > self.config.cpu_blocks:
            old, _ = self.cpu.popitem(last=False)
            self._cpu_events.append(BlockRemoved(block_hashes=[old], medium="CPU"))

    def _request(self, blocks: list[tuple[int, ...]]) -> None:
        parent: int | None = None
        new: list[tuple[int, int | None, tuple[int, ...]]] = []
        for tokens in blocks:
            h = hash((parent, tokens)) & _MASK
            if h in self.gpu:
                self.gpu.move_to_end(h)
            else:
                while len(self.gpu) >= self.config.gpu_blocks:
                    self._evict_gpu()
                self.gpu[h] = (parent, tokens)
                if new and new[-1][0] != parent:  # a hit in between: a new chain
                    self._gpu_events.append(self._store_event(new, "GPU"))
                    new = []
                new.append((h, parent, tokens))
            parent = h
        if new:
            self._gpu_events.append(self._store_event(new, "GPU"))

    def step(self) -> list[Any]:
        """Advance one engine step; return its KV events, GPU first then CPU."""
        c = self.config
        self._step += 1
        if c.clear_every and self._step % c.clear_every == 0:
            self.gpu.clear()
            self.cpu.clear()
            return [AllBlocksCleared()]
        self._gpu_events, self._cpu_events = [], []
        rng = self._rng
        for r in range(c.requests_per_step):
            p = rng.randrange(c.prefixes)
            blocks = list(self._prefix_tokens[p])
            blocks += [self._tokens(-1, self._step, r, i) for i in range(c.suffix_blocks)]
            self._request(blocks)
        if c.burst_every and self._step % c.burst_every < c.burst_length:
            for r in range(c.burst_requests):
                self._request([self._tokens(-2, self._step, r, i) for i in range(c.burst_blocks)])
        return self._gpu_events + self._cpu_events

    def truth(self) -> set[tuple[str, None, int]]:
        """The blocks the engine holds now, as subscriber keys ``(medium, group, hash)``."""
        return {("GPU", None, h) for h in self.gpu} | {("CPU", None, h) for h in self.cpu}


def _signed(h: Any) -> Any:
    """An unsigned 64-bit hash as SGLang's signed one (None stays None)."""
    return h if h is None or h < 1 << 63 else h - (1 << 64)


def as_engine_events(engine: str, events: list[Any]) -> list[Any]:
    """The model's events in ``engine``'s structs: as they are for vLLM; for SGLang its
    classes, its tier names and its signed 64-bit hashes.  O(events)."""
    if engine == "vllm":
        return events
    from coalesce import sglang

    out: list[Any] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(
                sglang.BlockStored(
                    [_signed(h) for h in ev.block_hashes],
                    _signed(ev.parent_block_hash),
                    ev.token_ids,
                    ev.block_size,
                    None,
                    _SGLANG_MEDIUM[ev.medium or "GPU"],
                )
            )
        elif isinstance(ev, BlockRemoved):
            out.append(
                sglang.BlockRemoved(
                    [_signed(h) for h in ev.block_hashes], _SGLANG_MEDIUM[ev.medium or "GPU"]
                )
            )
        else:
            out.append(sglang.AllBlocksCleared())
    return out


def as_engine_key(engine: str, key: tuple[str, None, int]) -> tuple[str, None, int]:
    """:meth:`Engine.truth`'s key as a subscriber of ``engine``'s stream holds it."""
    if engine == "vllm":
        return key
    medium, group, h = key
    return (_SGLANG_MEDIUM[medium], group, _signed(h))
