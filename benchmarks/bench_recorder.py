"""The snapshot recorder's price per event, side by side with encoding the same batches.

Snapshots are opt-in; with them on, the sender thread (the engine's process,
under the GIL) feeds every batch it sends (after compaction) or refuses to the
recorder (coalesce/_recorder.py: the replay-program state of vLLM PR
#57789).  Paths, timed in alternation, medians of rounds:

- ``raw``: each batch encoded on its own (vLLM's sender);
- ``decode``: each encoded payload decoded back into vLLM-shaped events: the
  first step of the PR's own recorder, which folds the payloads it sent (a
  floor under its cost, on another thread of the same process);
- ``record``: the recorder fed each batch (a fresh recorder per pass, so stores
  are new keys as in a live stream);
- ``record compacted``: the recorder fed the rules' output of each window
  (what the sender records under pressure), the compaction not counted;
- ``feed, behind`` and ``feed, caught up``: the batches given one by one to
  the snapshot service's feed, which gathers them and records the compactor's
  output of each ``RECORD_WINDOW`` of events (a sender that is behind), or of
  each batch (a sender that has caught up after every batch), the
  compaction counted.

Then the engine's share: an engine thread runs steps of Python work and a
GIL-free wait (a GPU step's shape), handing one batch per step to a sender
thread that records it, or only decodes its payload (the PR's recorder's
floor), or does nothing with it; the engine loop's time for each.

Then the snapshot itself: building and encoding the chunks of the program the
seed workload leaves, per held block, and the longest chunk (one sender
step); and a snapshot of ``--blocks`` (1M) held blocks, end to end.

    .venv/bin/python benchmarks/bench_recorder.py [--seconds 0.4] [--rounds 7] [--blocks N]
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

sys.path.insert(0, os.path.dirname(__file__))
from bench_compact import alternate, make_batch, seed_batches, workloads

from coalesce import compactor
from coalesce.events import BlockStored, KVEventBatch
from coalesce.testing import Encoder, Feed, Recorder
from coalesce_tools.results import header, row, run

Window = list[Any]
FEEDS = {"feed, behind": False, "feed, caught up": True}
"""The feed's paths: whether the sender caught up (settles) after every batch."""


def _paths(windows: list[Window]) -> dict[str, Callable[[], Any]]:
    enc = Encoder()
    batches = [b for w in windows for b in w]
    compacted = [b for w in windows for b in compactor.compact(w)[0]]
    payloads = [enc.encode(b) for b in batches]
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)

    def raw() -> Any:
        return [enc.encode(b) for b in batches]

    def decode() -> Any:
        return [dec.decode(p) for p in payloads]

    def recorder(stream: list[Any]) -> Callable[[], Any]:
        def record() -> Any:
            rec = Recorder(10_000_000)
            for b in stream:
                rec.record(b)
            return rec

        return record

    def feed(caught_up: bool) -> Callable[[], Any]:
        def record() -> Any:
            svc = Feed(Recorder(10_000_000), max_deferred_events=0)
            for b in batches:
                svc.record((b,))
                if caught_up:
                    svc.settle()
            svc.settle()
            return svc

        return record

    return {
        "raw": raw,
        "decode": decode,
        "record": recorder(batches),
        "record compacted": recorder(compacted),
        **{name: feed(caught_up) for name, caught_up in FEEDS.items()},
    }


def measure(windows: list[Window], seconds: float, rounds: int) -> dict[str, float]:
    """Median seconds per input event of each path (bench_compact's alternation)."""
    events = sum(len(b.events) for w in windows for b in w)
    return alternate(_paths(windows), events, seconds, rounds)


def snapshot_cost(rec: Recorder, rounds: int) -> tuple[float, float]:
    """(seconds per held block, longest chunk in seconds) to build and encode the snapshot."""
    enc = Encoder()
    per_block, longest = [], 0.0
    for _ in range(rounds):
        t0 = last = time.perf_counter()
        for chunk in rec.chunks():
            enc.encode_now(chunk, 0)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now
        per_block.append((last - t0) / max(rec.held, 1))
    return statistics.median(per_block), longest


def engine_loop(batches: list[Any], how: str) -> float:
    """Seconds of an engine loop of one step per batch (about 50 us of Python and
    a 100 us GIL-free wait), each batch handed to a sender thread that records it
    (``how="record"``), decodes its payload (``"decode"``: the PR's recorder's
    first step), or does nothing with it (``"none"``)."""
    pending: collections.deque[Any] = collections.deque()
    wake = threading.Event()
    rec = Recorder(10**7) if how == "record" else None
    dec = msgspec.msgpack.Decoder(type=KVEventBatch) if how == "decode" else None
    if dec is not None:
        enc = Encoder()
        batches = [enc.encode(b) for b in batches]  # (the bytes it sent: encoded beforehand)

    def sender() -> None:
        while True:
            wake.wait()
            wake.clear()
            while pending:
                b = pending.popleft()
                if b is None:
                    return
                if rec is not None:
                    rec.record(b)
                elif dec is not None:
                    dec.decode(b)

    thread = threading.Thread(target=sender)
    thread.start()
    t0 = time.perf_counter()
    for b in batches:
        x = 0
        for i in range(600):  # the engine's Python work
            x += i
        pending.append(b)
        wake.set()
        time.sleep(0.0001)  # the GPU: the GIL is free
    elapsed = time.perf_counter() - t0
    pending.append(None)
    wake.set()
    thread.join()
    return elapsed


def engine_share(batches: list[Any], rounds: int) -> dict[str, float]:
    """Median engine-loop seconds per path, paths alternated in each round."""
    paths = {"no recorder": "none", "recorder": "record", "decode": "decode"}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for name, how in paths.items():
            gc.collect()
            times[name].append(engine_loop(batches, how))
    return {k: statistics.median(v) for k, v in times.items()}


def big_state(blocks: int) -> Recorder:
    """``blocks`` held GPU blocks in chains of 64, 16 tokens each (vLLM's default size)."""
    rec = Recorder(blocks + 1)
    for start in range(0, blocks, 64):
        hashes = [(2**40 + h) * 2654435761 % 2**64 for h in range(start, min(start + 64, blocks))]
        ev = BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=list(range(16 * len(hashes))),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        rec.record(KVEventBatch(ts=0.0, events=[ev], data_parallel_rank=0))
    assert rec.valid and rec.held == blocks
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=512, help="events per window")
    ap.add_argument("--seconds", type=float, default=0.4, help="per path per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=1_000_000, help="held blocks of the big snapshot")
    args = ap.parse_args()
    print(
        f"# bench_recorder: {platform.python_version()}, msgspec {msgspec.__version__}, "
        f"{args.rounds} rounds x {args.seconds} s, medians\n"
    )
    header("workload", "raw encode ns/event", "decode", "record", "record compacted", *FEEDS)
    gc.collect()
    for name, windows in workloads(args.window).items():
        per = measure(windows, args.seconds, args.rounds)
        raw = per["raw"]
        print(
            f"| {name} | {raw * 1e9:.0f} | {per['decode'] / raw:.2f}x | "
            f"{per['record'] / raw:.2f}x | {per['record compacted'] / raw:.2f}x | "
            + " | ".join(f"{per[feed] / raw:.2f}x" for feed in FEEDS)
            + " |",
            flush=True,
        )
    print()
    header("engine's share", "batches", "events/batch", "no recorder s", "recorder", "decode")
    for name, stream in (
        ("seed burst", seed_batches(True, 1100)),
        ("offload ~100/batch", [make_batch(i, 33) for i in range(800)]),
    ):
        loop = engine_share(stream, args.rounds)
        base = loop["no recorder"]
        print(
            f"| {name} | {len(stream)} | {sum(len(b.events) for b in stream) / len(stream):.0f} "
            f"| {base:.3f} | {loop['recorder'] / base:.2f}x | {loop['decode'] / base:.2f}x |",
            flush=True,
        )
    print()
    header("snapshot", "blocks", "ns per block (build + encode)", "longest chunk ms", "total s")
    rec = Recorder(10_000_000)
    for b in seed_batches(True, 1500):
        rec.record(b)
    per_block, longest = snapshot_cost(rec, args.rounds)
    print(
        f"| seed workload | {rec.held:,} | {per_block * 1e9:.0f} | "
        f"{longest * 1e3:.2f} | {per_block * rec.held:.2f} |",
        flush=True,
    )
    big = big_state(args.blocks)
    per_block, longest = snapshot_cost(big, 3)
    total = f"{per_block * big.held:.2f}"
    row(
        f"{args.blocks:,} blocks",
        f"{big.held:,}",
        f"{per_block * 1e9:.0f}",
        f"{longest * 1e3:.2f}",
        total,
    )


if __name__ == "__main__":
    run("recorder", __doc__, main)
