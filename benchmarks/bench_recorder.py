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
  are new keys as in a live stream): its state in C where built;
- ``record, steady``: the recorder of a live engine, whose table has grown
  to the size the stream keeps: a fresh recorder first fed the stream's
  earlier batches (not timed: as many windows again as the measured ones, or
  the first half of vLLM's stream by events), then timed on the batches that follow, against
  a raw encode of those same batches (the ``record`` column counts the
  table's growth from empty, paid once in a recorder's life);
- ``record, fused with the encode``: what the sender with a recorder pays on top
  of the encode it makes anyway, in the same steady state: each batch encoded
  and recorded in one pass over its events (``Recorder.encode``, C), its time
  minus a raw encode's, over a raw encode's;
- ``record py``: the same as ``record`` with the pure-Python recorder (the fall back);
- ``record compacted``: the recorder fed the rules' output of each window
  (what the sender records under pressure), the compaction not counted;
- ``feed, behind`` and ``feed, caught up``: the batches given one by one to
  the snapshot service's feed, which gathers them and records the compactor's
  output of each ``RECORD_WINDOW`` of events (a sender that is behind), or of
  each batch (a sender that has caught up after every batch), the
  compaction counted.

Then the engine's share: an engine thread runs steps of Python work and a
GIL-free wait (a GPU step's shape), handing one batch per step to a sender
thread that records it (the table updated with the GIL held, as below 4096
hashes a call, or released for every batch), or only decodes its payload
(the PR's recorder's floor), or does nothing with it; the engine loop's time
for each, and the longest single ``record()`` call (one GIL hold).

Then the snapshot itself: building and encoding the chunks of the program the
seed workload leaves, per held block, and the longest chunk (one sender
step); and snapshots of 100,000 and ``--blocks`` (1M) held blocks, end to
end, with the size of the recorder's C state; then, in a fresh process each,
the RSS a recorder of ``--blocks`` held blocks adds (the recorded events
included: 16 tokens a block), and the RSS growth over 100,000 batches that
cancel out (store and remove of fresh blocks, as refused batches may be)
with those blocks held, for the C state and for the Python dicts.  And an
``AllBlocksCleared`` over 100,000 and ``--blocks`` held blocks: its wall time
and the longest hold of the GIL it makes (a ticker thread's longest gap; the
forgotten events are released a slice per later call, not at once).  Last, in
a fresh process each, the longest of three full collections of the cyclic GC
with ``--blocks`` one-block stores (vLLM's CPU stores, 16 tokens each) kept by
the recorder, against the same stores made and dropped: what the kept events
cost every full collection of the engine's process.

The workloads: the seed-like ones of bench_compact, and vLLM's own
scheduler's stream (eager offload) as recorded in
``tests_dynamo/data/vllm-eager.msgpack.gz``.

    .venv/bin/python benchmarks/bench_recorder.py [--seconds 0.4] [--rounds 7] [--blocks N]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

sys.path.insert(0, os.path.dirname(__file__))
from bench_compact import alternate, make_batch, seed_batches, windows_of, workloads

from coalesce import _recorder, compactor
from coalesce.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from coalesce.testing import Encoder, Feed, Recorder
from coalesce_tools.realstream import load
from coalesce_tools.results import header, row, run

REAL_STREAM = os.path.join(
    os.path.dirname(__file__), "..", "tests_dynamo", "data", "vllm-eager.msgpack.gz"
)
"""vLLM's own scheduler's stream (eager offload), recorded (coalesce_tools.realstream)."""


def real_stream() -> list[Any]:
    """The recorded stream's batches, decoded into this library's event classes."""
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    return [dec.decode(p) for p in load(REAL_STREAM).payloads]


def clear_hold(blocks: int) -> tuple[float, float]:
    """(wall seconds, longest GIL hold in seconds) of an ``AllBlocksCleared`` recorded
    over ``blocks`` held blocks: a ticker thread's longest gap while it runs (the
    cyclic GC off, so that only the clear is seen)."""
    rec = big_state(blocks)
    clear = KVEventBatch(ts=0.0, events=[AllBlocksCleared()], data_parallel_rank=0)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    gc.disable()
    stop, longest = threading.Event(), [0.0]

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            longest[0] = max(longest[0], now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.02)
        longest[0] = 0.0
        t0 = time.perf_counter()
        rec.record(clear)
        wall = time.perf_counter() - t0
        time.sleep(0.02)
    finally:
        stop.set()
        ticker.join()
        gc.enable()
        sys.setswitchinterval(switch)
    assert rec.held == 0 and rec.valid
    return wall, longest[0]


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

    def recorder(stream: list[Any], accelerated: bool | None = None) -> Callable[[], Any]:
        def record() -> Any:
            rec = Recorder(10_000_000, accelerated=accelerated)
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
        "record py": recorder(batches, accelerated=False),
        "record compacted": recorder(compacted),
        **{name: feed(caught_up) for name, caught_up in FEEDS.items()},
    }


def steady(warm: list[Any], batches: list[Any], seconds: float, rounds: int) -> dict[str, float]:
    """Per event, over a raw encode of ``batches``: recording them into a recorder
    already fed ``warm`` (``record``), and what encoding and recording them in one
    pass (``Recorder.encode``, the sender's path with a recorder) adds to the raw
    encode (``fused``).  Paired: each pass warms two recorders (not timed), then
    times the three paths back to back (in turn first and last), and takes the
    ratios within the pass; medians over every pass of ``rounds`` x ``seconds``."""
    enc = Encoder()
    ratios: dict[str, list[float]] = {"record": [], "fused": []}
    paths = ("raw", "record", "fused")
    n = 0
    for _ in range(rounds):
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            recording, fused = Recorder(10_000_000), Recorder(10_000_000)
            recording.record_many(warm)
            fused.record_many(warm)
            took: dict[str, float] = {}
            for path in paths if n % 2 == 0 else paths[::-1]:
                t0 = time.perf_counter()
                if path == "raw":
                    for b in batches:
                        enc.encode(b)
                elif path == "record":
                    for b in batches:
                        recording.record(b)
                else:
                    for b in batches:
                        assert fused.encode(b) is not None, "every batch here is taken"
                took[path] = time.perf_counter() - t0
            assert recording.valid and fused.valid
            ratios["record"].append(took["record"] / took["raw"])
            ratios["fused"].append(took["fused"] / took["raw"] - 1.0)
            n += 1
    return {k: statistics.median(v) for k, v in ratios.items()}


def steady_streams(limit: int) -> dict[str, tuple[list[Any], list[Any]]]:
    """(warm-up batches, measured batches) of each workload: the measured ones
    as many windows as :func:`workloads` times, after as many again."""

    def split(batches: list[Any]) -> tuple[list[Any], list[Any]]:
        windows = windows_of(batches, limit)[:120]
        half = len(windows) // 2
        return [b for w in windows[:half] for b in w], [b for w in windows[half:] for b in w]

    real, events, half = real_stream(), 0, 0
    total = sum(len(b.events) for b in real)
    while events * 2 < total:  # its first half by events (its batches are uneven)
        events += len(real[half].events)
        half += 1
    return {
        "seed burst": split(seed_batches(True, 1300)),
        "seed steady": split(seed_batches(False, 2700)),
        "offload ~100/batch": split([make_batch(i, 33) for i in range(800)]),
        "offload ~20/batch": split([make_batch(i, 7) for i in range(4000)]),
        "vLLM's scheduler (eager)": (real[:half], real[half:]),
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
    rec = Recorder(10**7) if how.startswith("record") else None
    accel = _recorder._accel
    was = accel.set_nogil_from(0) if accel is not None and how == "record nogil" else None
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
    if was is not None and accel is not None:
        accel.set_nogil_from(was)
    return elapsed


def engine_share(batches: list[Any], rounds: int) -> dict[str, float]:
    """Median engine-loop seconds per path, paths alternated in each round."""
    paths = {
        "no recorder": "none",
        "recorder": "record",
        "recorder, GIL released": "record nogil",
        "decode": "decode",
    }
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for name, how in paths.items():
            gc.collect()
            times[name].append(engine_loop(batches, how))
    return {k: statistics.median(v) for k, v in times.items()}


def longest_record(batches: list[Any]) -> float:
    """The longest single ``record()`` call, in seconds (one hold of the GIL)."""
    rec, longest = Recorder(10**7), 0.0
    for b in batches:
        t0 = time.perf_counter()
        rec.record(b)
        longest = max(longest, time.perf_counter() - t0)
    return longest


def rss() -> int:
    """The process's resident set, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def root_store(hashes: list[int], medium: str = "GPU") -> BlockStored:
    """A store of ``hashes`` with no parent, 16 tokens a block (vLLM's default size)."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def cancelling(i: int) -> KVEventBatch:
    """A batch that stores 4 fresh blocks and removes them: the state is unchanged."""
    hashes = [(2**50 + 4 * i + j) * 2654435761 % 2**64 for j in range(4)]
    store = root_store(hashes)
    gone = BlockRemoved(block_hashes=hashes, medium="GPU")
    return KVEventBatch(ts=0.0, events=[store, gone], data_parallel_rank=0)


def big_state(blocks: int, accelerated: bool | None = None, fused: bool = False) -> Recorder:
    """``blocks`` held GPU blocks in chains of 64, 16 tokens each (vLLM's default size),
    recorded (``fused``: encoded and recorded in one pass, the sender's path for a
    batch it sends, which keeps each store as the bytes it wrote)."""
    rec = Recorder(blocks + 1, accelerated=accelerated)
    for start in range(0, blocks, 64):
        hashes = [(2**40 + h) * 2654435761 % 2**64 for h in range(start, min(start + 64, blocks))]
        batch = KVEventBatch(ts=0.0, events=[root_store(hashes)], data_parallel_rank=0)
        if not fused or rec.encode(batch) is None:
            rec.record(batch)
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
    header(
        "workload",
        "raw encode ns/event",
        "decode",
        "record",
        "record, steady",
        "record, fused with the encode",
        "record py",
        "record compacted",
        *FEEDS,
    )
    gc.collect()
    streams = {**workloads(args.window), "vLLM's scheduler (eager)": [real_stream()]}
    warmed = steady_streams(args.window)
    for name, windows in streams.items():
        per = measure(windows, args.seconds, args.rounds)
        raw = per["raw"]
        live = steady(*warmed[name], args.seconds, args.rounds)
        print(
            f"| {name} | {raw * 1e9:.0f} | {per['decode'] / raw:.2f}x | "
            f"{per['record'] / raw:.2f}x | {live['record']:.2f}x | {live['fused']:.2f}x | "
            f"{per['record py'] / raw:.2f}x | "
            f"{per['record compacted'] / raw:.2f}x | "
            + " | ".join(f"{per[feed] / raw:.2f}x" for feed in FEEDS)
            + " |",
            flush=True,
        )
    print()
    header(
        "engine's share",
        "batches",
        "events/batch",
        "no recorder s",
        "recorder",
        "recorder, GIL released",
        "decode",
        "longest record() ms",
    )
    for name, stream in (
        ("seed burst", seed_batches(True, 1100)),
        ("offload ~100/batch", [make_batch(i, 33) for i in range(800)]),
    ):
        loop = engine_share(stream, args.rounds)
        base = loop["no recorder"]
        longest = statistics.median(longest_record(stream) for _ in range(3))
        print(
            f"| {name} | {len(stream)} | {sum(len(b.events) for b in stream) / len(stream):.0f} "
            f"| {base:.3f} | {loop['recorder'] / base:.2f}x "
            f"| {loop['recorder, GIL released'] / base:.2f}x | {loop['decode'] / base:.2f}x "
            f"| {longest * 1e3:.2f} |",
            flush=True,
        )
    print()
    header(
        "snapshot",
        "blocks",
        "ns per block (build + encode)",
        "longest chunk ms",
        "total s",
        "C state MB",
    )
    rec = Recorder(10_000_000)
    for b in seed_batches(True, 1500):
        rec.record(b)
    per_block, longest = snapshot_cost(rec, args.rounds)
    row(
        "seed workload",
        f"{rec.held:,}",
        f"{per_block * 1e9:.0f}",
        f"{longest * 1e3:.2f}",
        f"{per_block * rec.held:.2f}",
        _c_mb(rec),
    )
    del rec
    for blocks, fused in ((100_000, False), (args.blocks, False), (args.blocks, True)):
        big = big_state(blocks, fused=fused)
        per_block, longest = snapshot_cost(big, 3)
        row(
            f"{blocks:,} blocks" + (", sent (kept as bytes)" if fused else ""),
            f"{big.held:,}",
            f"{per_block * 1e9:.0f}",
            f"{longest * 1e3:.2f}",
            f"{per_block * big.held:.2f}",
            _c_mb(big),
        )
        del big
    print()
    header("AllBlocksCleared over", "blocks", "wall ms", "longest GIL hold ms")
    for blocks in (100_000, args.blocks):
        holds = [clear_hold(blocks) for _ in range(3)]
        wall, hold = (statistics.median(h[i] for h in holds) for i in range(2))
        row(f"{blocks:,} blocks", f"{blocks:,}", f"{wall * 1e3:.2f}", f"{hold * 1e3:.2f}")
    print()
    header(
        "memory (a fresh process)",
        "blocks held",
        "C state MB",
        "RSS growth MB, events included",
        "then 100,000 cancelling batches: RSS growth MB",
    )
    for accelerated in ("1", "fused", "0"):
        out = subprocess.run(
            [sys.executable, __file__, "--rss-child", str(args.blocks), accelerated],
            capture_output=True,
            text=True,
            check=True,
        )
        c_mb, grown, refused = json.loads(out.stdout.splitlines()[-1])
        row(
            {"1": "C state", "fused": "C state, sent (kept as bytes)", "0": "Python dicts"}[
                accelerated
            ],
            f"{args.blocks:,}",
            f"{c_mb:.1f}" if c_mb else "",
            f"{grown:.0f}",
            f"{refused:.1f}",
        )
    print()
    header("full GC collection (a fresh process)", "one-block stores", "longest ms", "GC objects")
    for how, name in (
        ("none", "made and dropped"),
        ("1", "kept: C state"),
        ("fused", "kept: C state, sent (as bytes)"),
        ("0", "kept: Python"),
    ):
        out = subprocess.run(
            [sys.executable, __file__, "--gc-child", str(args.blocks), how],
            capture_output=True,
            text=True,
            check=True,
        )
        pause, objects = json.loads(out.stdout.splitlines()[-1])
        row(name, f"{args.blocks:,}", f"{pause:.1f}", f"{objects:,}")


def rss_child(blocks: int, how: str) -> None:
    """In a fresh process: the RSS a recorder of ``blocks`` held blocks adds (its
    recorded events included), then what 100,000 batches that cancel out add
    (``how``: "1" the C state, "fused" the C state fed by the sender's fused path,
    "0" the Python dicts)."""
    gc.collect()
    before = rss()
    big = big_state(blocks, how != "0", fused=how == "fused")
    gc.collect()
    grown = rss() - before
    before = rss()
    for i in range(100_000):
        big.record(cancelling(i))
    gc.collect()
    cs = big._cs
    nbytes = 0 if cs is None else cs.nbytes / 2**20
    print(json.dumps([nbytes, grown / 2**20, (rss() - before) / 2**20]))


def gc_child(blocks: int, how: str) -> None:
    """In a fresh process: the longest of three full collections of the cyclic GC with
    ``blocks`` one-block stores (vLLM's CPU stores: a hash list and 16 tokens each)
    kept by the recorder (``how``: "1" the C state, "fused" the C state fed by the
    sender's fused path, "0" the Python dicts), or made and dropped ("none")."""
    rec = None if how == "none" else Recorder(blocks + 1, accelerated=how != "0")
    for start in range(0, blocks, 100):
        events: list[Any] = [
            root_store([h + 1], "CPU") for h in range(start, min(start + 100, blocks))
        ]
        batch = KVEventBatch(ts=0.0, events=events, data_parallel_rank=0)
        if rec is not None and (how != "fused" or rec.encode(batch) is None):
            rec.record(batch)
    gc.collect()
    pauses = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - t0)
    print(json.dumps([max(pauses) * 1e3, len(gc.get_objects())]))


def _c_mb(rec: Recorder) -> str:
    """The recorder's C state (table, sources, their hashes), in MB; "" without one."""
    cs = rec._cs
    return "" if cs is None else f"{cs.nbytes / 2**20:.1f}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--gc-child"]:
        gc_child(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    if sys.argv[1:2] == ["--rss-child"]:
        rss_child(int(sys.argv[2]), sys.argv[3])
    else:
        run("recorder", __doc__, main)
