"""Compaction's price: compact + encode against encoding the raw window, per event.

For each workload, the windows the sender's rules level would take (batches in
publish order until ``--window`` events, the default ``max_events_per_step``)
go through five paths, timed in alternation and reported as medians:

- ``raw``: every batch encoded on its own (what vLLM's sender encodes);
- ``fold``: the sender's fold-only level (the shutdown flush):
  ``compact(fold_only=True)``, then encode;
- ``rules C``: ``compact()`` with the C accelerator, then encode;
- ``rules C wire``: ``compact_for_wire()`` (the merged lists written as their
  encoding, in C), then encode: what the sender's rules level runs when no
  snapshot recorder reads the result;
- ``rules py``: ``compact()`` with the pure-Python rules, then encode;

The target (issue 8) is compaction plus encoding at most 1.0x ``raw`` with events at most
0.5x and bytes at most 0.8x of raw.  Output: a markdown table for
docs/benchmarks.md.

    .venv/bin/python benchmarks/bench_compact.py [--seconds 0.4] [--rounds 7]
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
from bench_publish import make_batch

from coalesce import compactor
from coalesce.events import KVEventBatch
from coalesce_tools.results import header, row, run
from coalesce_tools.workload import Engine, WorkloadConfig

Window = list[Any]


def windows_of(batches: list[Any], limit: int) -> list[Window]:
    """Consecutive batches, cut once a window holds ``limit`` events (as Backlog.take)."""
    out: list[Window] = []
    cur: Window = []
    n = 0
    for b in batches:
        cur.append(b)
        n += len(b.events)
        if n >= limit:
            out.append(cur)
            cur, n = [], 0
    return out


def seed_batches(burst: bool, steps: int) -> list[Any]:
    """The demo's workload (one rank): a burst of long prompts, or the steady state."""
    cfg = WorkloadConfig(burst_every=400 if burst else 10**9, burst_length=200)
    eng = Engine(cfg)
    out = []
    for i in range(steps):
        events = eng.step()
        if i >= 300 and events:  # past the warm-up that fills an empty cache
            out.append(KVEventBatch(ts=float(i), events=events, data_parallel_rank=0))
    return out


def workloads(limit: int) -> dict[str, list[Window]]:
    return {
        "seed burst": windows_of(seed_batches(True, 800), limit)[:60],
        "seed steady": windows_of(seed_batches(False, 1500), limit)[:60],
        "offload ~100/batch": windows_of([make_batch(i, 33) for i in range(400)], limit)[:60],
        "offload ~20/batch": windows_of([make_batch(i, 7) for i in range(2000)], limit)[:60],
    }


def _paths(enc: msgspec.msgpack.Encoder) -> dict[str, Callable[[Window], Any]]:
    """The paths, each a function of one window."""
    accel = compactor.accelerated()

    def raw(w: Window) -> Any:
        return [enc.encode(b) for b in w]

    def fold(w: Window) -> Any:
        return [enc.encode(b) for b in compactor.compact(w, fold_only=True)[0]]

    def rules_c(w: Window) -> Any:
        return [enc.encode(b) for b in compactor.compact(w)[0]]

    def rules_wire(w: Window) -> Any:
        return [enc.encode(b) for b in compactor.compact_for_wire(w)[0]]

    def rules_py(w: Window) -> Any:
        return [enc.encode(b) for b in compactor.compact(w, accelerated=False)[0]]

    paths = {
        "raw": raw,
        "fold": fold,
        "rules C": rules_c,
        "rules C wire": rules_wire,
        "rules py": rules_py,
    }
    if not accel:
        for name in ("rules C", "rules C wire"):
            del paths[name]
    return paths


def alternate(
    paths: dict[str, Callable[[], Any]],
    events: int,
    seconds: float,
    rounds: int,
    *,
    slow: dict[str, int] | None = None,
) -> dict[str, float]:
    """Median seconds per event of each zero-argument path.

    Each path is called once to warm up; then, in each round, every path runs
    for about ``seconds`` (the first path's time sets the repetitions; a path
    in ``slow`` runs that many times fewer), in order, then in reverse order
    the next round, so that drift in the machine's speed hits every path alike.
    """
    for fn in paths.values():
        fn()
    first = next(iter(paths))
    t0 = time.perf_counter()
    paths[first]()
    reps = max(1, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    samples: dict[str, list[float]] = {k: [] for k in paths}
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for name in order:
            n = max(1, reps // (slow or {}).get(name, 1))
            t0 = time.perf_counter()
            for _ in range(n):
                paths[name]()
            samples[name].append((time.perf_counter() - t0) / (n * events))
    return {k: statistics.median(v) for k, v in samples.items()}


def measure(windows: list[Window], seconds: float, rounds: int) -> dict[str, float]:
    """Median seconds per event of each path over all the windows (see :func:`alternate`)."""

    def over_windows(fn: Callable[[Window], Any]) -> Callable[[], Any]:
        return lambda: [fn(w) for w in windows]

    paths = {k: over_windows(fn) for k, fn in _paths(msgspec.msgpack.Encoder()).items()}
    events = sum(len(b.events) for w in windows for b in w)
    return alternate(paths, events, seconds, rounds, slow={"rules py": 20})


def volume(windows: list[Window]) -> tuple[float, float]:
    """Events and bytes after the rules, over the raw windows'."""
    enc = msgspec.msgpack.Encoder()
    ev_in = ev_out = b_in = b_out = 0
    for w in windows:
        out, rep = compactor.compact(w)
        ev_in += rep.events_in
        ev_out += rep.events_out
        b_in += sum(len(enc.encode(b)) for b in w)
        sent = [enc.encode(b) for b in out]
        b_out += sum(map(len, sent))
        assert [enc.encode(b) for b in compactor.compact_for_wire(w)[0]] == sent
    return ev_out / ev_in, b_out / b_in


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=512, help="events per window")
    ap.add_argument("--seconds", type=float, default=0.4, help="per path per round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(
        f"# bench_compact: {platform.python_version()}, msgspec {msgspec.__version__}, "
        f"accelerator {'built' if compactor.accelerated() else 'MISSING'}, "
        f"window {args.window} events, {args.rounds} rounds x {args.seconds} s, medians\n"
    )
    header(
        "workload",
        "batches/window",
        "raw encode ns/event",
        "fold+enc",
        "rules C+enc",
        "rules C wire+enc",
        "rules py+enc",
        "events out",
        "bytes out",
    )
    gc.collect()
    for name, windows in workloads(args.window).items():
        per = measure(windows, args.seconds, args.rounds)
        events, nbytes = volume(windows)
        raw = per["raw"]
        c = f"{per['rules C'] / raw:.2f}x" if "rules C" in per else "n/a"
        cw = f"{per['rules C wire'] / raw:.2f}x" if "rules C wire" in per else "n/a"
        bpw = statistics.mean(len(w) for w in windows)
        fold, py = f"{per['fold'] / raw:.2f}x", f"{per['rules py'] / raw:.1f}x"
        row(
            name,
            f"{bpw:.0f}",
            f"{raw * 1e9:.0f}",
            fold,
            c,
            cw,
            py,
            f"{events:.2f}",
            f"{nbytes:.2f}",
        )


if __name__ == "__main__":
    run("compact", __doc__, main)
