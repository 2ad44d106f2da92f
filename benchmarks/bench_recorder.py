"""The snapshot recorder's price per event, side by side with encoding the same batches.

Snapshots are opt-in; with them on, the sender thread (the engine's process,
under the GIL) also encodes a 4-element payload (the ``publisher_id``) and
feeds every batch to the recorder: the sent batches after compaction, as they
are when it sends 1:1.  Paths, timed in alternation, medians of rounds:

- ``raw``: each batch encoded on its own (vLLM's sender);
- ``raw+id``: the same with the ``publisher_id`` as a 4th element;
- ``record C`` / ``record Python``: the C recorder (coalesce/_crecord.c, the
  one the publisher uses when it is built) and the pure-Python one, recording
  each batch (a fresh recorder per pass, so stores are new keys as in a live
  stream);
- ``record C compacted``: the C recorder fed the C rules' output of each
  window (what the sender records under pressure).

Then the engine's share: an engine thread runs steps of Python work and a
GIL-free wait (a GPU step's shape), handing one batch per step to a sender
thread that only records it; the engine loop's time with no recorder, with
the C recorder holding the GIL throughout, and with its table pass run
without the GIL (what the publisher does from ``RELEASE_AT`` hashes).

Then the snapshot itself, per recorder: building and encoding the chunks of
the state the seed workload leaves, per block, and the longest chunk (one
sender step); and a snapshot of ``--blocks`` (1M) held blocks, end to end.

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
from coalesce.testing import RELEASE_AT, AnyRecorder, Encoder, new_recorder
from coalesce_tools.results import recording

Window = list[Any]


def _paths(windows: list[Window]) -> dict[str, Callable[[], Any]]:
    enc = Encoder()
    enc_id = Encoder(b"\x01" * 16)
    batches = [b for w in windows for b in w]
    compacted = [b for w in windows for b in compactor.compact(w)[0]]

    def raw() -> Any:
        return [enc.encode(b) for b in batches]

    def raw_id() -> Any:
        return [enc_id.encode(b) for b in batches]

    def recorder(accelerated: bool, stream: list[Any]) -> Callable[[], Any]:
        def record() -> Any:
            rec = new_recorder(10_000_000, accelerated=accelerated)
            for b in stream:
                rec.record(b)
            return rec

        return record

    return {
        "raw": raw,
        "raw+id": raw_id,
        "record C": recorder(True, batches),
        "record C compacted": recorder(True, compacted),
        "record Python": recorder(False, batches),
    }


def measure(windows: list[Window], seconds: float, rounds: int) -> dict[str, float]:
    """Median seconds per input event of each path (bench_compact's alternation)."""
    events = sum(len(b.events) for w in windows for b in w)
    return alternate(_paths(windows), events, seconds, rounds, slow={"record Python": 10})


def snapshot_cost(rec: AnyRecorder, rounds: int) -> tuple[float, float]:
    """(seconds per block, longest chunk in seconds) to build and encode the snapshot."""
    enc = Encoder(b"\x01" * 16)
    per_block, longest = [], 0.0
    for _ in range(rounds):
        t0 = last = time.perf_counter()
        for chunk in rec.chunks():
            enc.encode_with_id(0.0, chunk, 0)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now
        per_block.append((last - t0) / max(rec.held, 1))
    return statistics.median(per_block), longest


def engine_loop(batches: list[Any], release_at: int | None) -> float:
    """Seconds of an engine loop of one step per batch (about 50 us of Python and
    a 100 us GIL-free wait), each batch recorded by a sender thread (None: none)."""
    pending: collections.deque[Any] = collections.deque()
    wake = threading.Event()
    rec = (
        None if release_at is None else new_recorder(10**7, accelerated=True, release_at=release_at)
    )

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
    paths = {"no recorder": None, "GIL held": 0, "tables without GIL": RELEASE_AT}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for name, release_at in paths.items():
            gc.collect()
            times[name].append(engine_loop(batches, release_at))
    return {k: statistics.median(v) for k, v in times.items()}


def big_state(blocks: int, accelerated: bool) -> AnyRecorder:
    """``blocks`` held GPU blocks in chains of 64, 16 tokens each (vLLM's default size)."""
    rec = new_recorder(blocks + 1, accelerated=accelerated)
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
    print(
        "| workload | raw encode ns/event | raw+id | record C | record C compacted "
        "| record Python |"
    )
    print("|---|---|---|---|---|---|")
    gc.collect()
    for name, windows in workloads(args.window).items():
        per = measure(windows, args.seconds, args.rounds)
        raw = per["raw"]
        print(
            f"| {name} | {raw * 1e9:.0f} | {per['raw+id'] / raw:.2f}x | "
            f"{per['record C'] / raw:.2f}x | {per['record C compacted'] / raw:.2f}x | "
            f"{per['record Python'] / raw:.1f}x |",
            flush=True,
        )
    print(
        "\n| engine's share | batches | events/batch | no recorder s | GIL held "
        "| tables without GIL |"
    )
    print("|---|---|---|---|---|---|")
    for name, stream in (
        ("seed burst", seed_batches(True, 1100)),
        ("offload ~100/batch", [make_batch(i, 33) for i in range(800)]),
    ):
        loop = engine_share(stream, args.rounds)
        base = loop["no recorder"]
        print(
            f"| {name} | {len(stream)} | {sum(len(b.events) for b in stream) / len(stream):.0f} "
            f"| {base:.3f} | {loop['GIL held'] / base:.2f}x "
            f"| {loop['tables without GIL'] / base:.2f}x |",
            flush=True,
        )
    print("\n| snapshot | blocks | ns per block (build + encode) | longest chunk ms | total s |")
    print("|---|---|---|---|---|")
    seed = seed_batches(True, 1500)
    for accelerated in (True, False):
        label = "C" if accelerated else "Python"
        rec = new_recorder(10_000_000, accelerated=accelerated)
        for b in seed:
            rec.record(b)
        per_block, longest = snapshot_cost(rec, args.rounds)
        print(
            f"| seed workload, {label} | {rec.held:,} | {per_block * 1e9:.0f} | "
            f"{longest * 1e3:.2f} | {per_block * rec.held:.2f} |",
            flush=True,
        )
        big = big_state(args.blocks, accelerated)
        per_block, longest = snapshot_cost(big, 1 if not accelerated else 3)
        print(
            f"| {args.blocks:,} blocks, {label} | {big.held:,} | {per_block * 1e9:.0f} | "
            f"{longest * 1e3:.2f} | {per_block * big.held:.2f} |",
            flush=True,
        )
        del big
        gc.collect()


if __name__ == "__main__":
    with recording("recorder", __doc__ or ""):
        main()
