"""The snapshot recorder's price per event, side by side with encoding the same batches.

Snapshots are opt-in; with them on, the sender thread (the engine's process,
under the GIL) also encodes a 4-element payload (the ``publisher_id``) and
feeds every batch to the recorder: the sent batches after compaction, as they
are when it sends 1:1.  Paths, timed in alternation, medians of rounds:

- ``raw``: each batch encoded on its own (vLLM's sender);
- ``raw+id``: the same with the ``publisher_id`` as a 4th element;
- ``record``: ``Recorder.record`` of each batch (a fresh recorder per pass,
  so stores are new keys as in a live stream);
- ``record compacted``: the same for the C rules' output of each window (what
  the sender records under pressure).

Then the snapshot itself: building and encoding the chunks of the state the
seed workload leaves, per block.

    .venv/bin/python benchmarks/bench_recorder.py [--seconds 0.4] [--rounds 7]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

sys.path.insert(0, os.path.dirname(__file__))
from bench_compact import seed_batches, workloads

from coalesce import compactor
from coalesce._recorder import Recorder
from coalesce._wire import Encoder

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

    def record() -> Any:
        rec = Recorder(10_000_000)
        for b in batches:
            rec.record(b)
        return rec

    def record_compacted() -> Any:
        rec = Recorder(10_000_000)
        for b in compacted:
            rec.record(b)
        return rec

    return {
        "raw": raw,
        "raw+id": raw_id,
        "record": record,
        "record compacted": record_compacted,
    }


def measure(windows: list[Window], seconds: float, rounds: int) -> dict[str, float]:
    """Median seconds per input event of each path; paths alternate within each round."""
    paths = _paths(windows)
    events = sum(len(b.events) for w in windows for b in w)
    for fn in paths.values():
        fn()
    t0 = time.perf_counter()
    paths["raw"]()
    reps = max(1, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    samples: dict[str, list[float]] = {k: [] for k in paths}
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for name in order:
            n = max(1, reps // 10) if name.startswith("record") else reps
            t0 = time.perf_counter()
            for _ in range(n):
                paths[name]()
            samples[name].append((time.perf_counter() - t0) / (n * events))
    return {k: statistics.median(v) for k, v in samples.items()}


def snapshot_cost(rounds: int) -> tuple[int, float]:
    """(blocks held, seconds per block to build and encode the snapshot's chunks)."""
    rec = Recorder(10_000_000)
    for b in seed_batches(True, 1500):
        rec.record(b)
    enc = Encoder()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for chunk in rec.chunks():
            enc.encode_raw((0.0, chunk, 0, b"\x01" * 16))
        samples.append(time.perf_counter() - t0)
    return rec.held, statistics.median(samples) / max(rec.held, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=512, help="events per window")
    ap.add_argument("--seconds", type=float, default=0.4, help="per path per round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(
        f"# bench_recorder: {platform.python_version()}, msgspec {msgspec.__version__}, "
        f"{args.rounds} rounds x {args.seconds} s, medians\n"
    )
    print("| workload | raw encode ns/event | raw+id | record | record compacted |")
    print("|---|---|---|---|---|")
    gc.collect()
    for name, windows in workloads(args.window).items():
        per = measure(windows, args.seconds, args.rounds)
        raw = per["raw"]
        print(
            f"| {name} | {raw * 1e9:.0f} | {per['raw+id'] / raw:.2f}x | "
            f"{per['record'] / raw:.1f}x | {per['record compacted'] / raw:.1f}x |",
            flush=True,
        )
    held, per_block = snapshot_cost(args.rounds)
    print(
        f"\nsnapshot of the seed workload's state: {held:,} blocks, "
        f"{per_block * 1e9:.0f} ns per block to build and encode"
    )


if __name__ == "__main__":
    main()
