"""vLLM's own scheduler loop with each publisher: what the publisher costs the engine.

One rank of vLLM 0.33's real scheduler, KV cache manager and eager CPU offload
manager (``coalesce_tools.vllm_engine``, the seed-like workload of the demo)
steps to the end of its workload with, in turn: vLLM's ``NullEventPublisher``
(the engine alone), vLLM's ``ZmqEventPublisher`` (stock), coalesce (the plugin,
default settings: ``loss_marker=resync``, the recorder on every batch),
coalesce without the recorder (``loss_marker=clear``) and coalesce with
snapshots on, first with a pure-CPU loop, then with a fake forward pass of 10 ms
a step that releases the GIL (``EngineConfig.gpu_ms``: what the engine thread
does on a GPU, and the time vLLM's sender thread runs in).  Each publisher
sends over tcp loopback to a SUB in another process that reads everything
(RCVHWM 0).  The rows run in
alternated order for ``--rounds`` rounds, in one process (vLLM imported once,
warmed up); the table gives medians of the engine loop's wall time (to the
last step, not to the last message sent), of the median and p99 step time, and
of the time spent inside ``publish()``, and each publisher's loop time over
stock's (median, and fastest run: on a shared 2-core VM the fastest is the
least disturbed), and the median of the loop's time over stock's in the same
round with a 95% bootstrap interval of that median (how far this host lets
the figure be trusted).  ``sender CPU``: the CPU of the Python threads the engine's
construction started (the publisher's sender, which holds the GIL the engine
wants; not zmq's I/O thread), from the loop's start until everything was sent
(``benchmarks/_threads.py``, Linux only).  On this stream stock never finds its queue full
(``bench_stock_blocks``), so the question is only what the publisher's own work
costs the engine thread under the GIL.

    .venv-vllm/bin/python benchmarks/bench_realengine.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _threads import cpu_seconds, started_by
from bench_stock_blocks import _port, _reader

from coalesce_tools.results import header, median_interval, recording, row

ROWS = ("null", "stock", "coalesce", "coalesce, clear", "coalesce+snap")
SETTINGS = {
    "coalesce, clear": "COALESCE_LOSS_MARKER",
    "coalesce+snap": "COALESCE_SNAPSHOT_ENDPOINT",
}
"""The variable each coalesce row sets while its publisher is built."""


def one(kind: str, gpu_ms: float) -> dict[str, float]:
    from coalesce_tools.vllm_engine import VllmEngine, seed_like, use_publisher

    cfg = seed_like("eager", gpu_ms)
    port = _port()
    reader = None
    threads: list[int] = []
    if kind == "null":
        eng = VllmEngine(cfg, "inproc://null", publisher="null")
    else:
        ctx = mp.get_context("spawn")
        stop, got = ctx.Event(), ctx.Value("q", 0)
        reader = ctx.Process(target=_reader, args=(port, stop, got), daemon=True)
        reader.start()
        variable = SETTINGS.get(kind)
        if variable is not None:
            os.environ[variable] = (
                "clear" if kind == "coalesce, clear" else f"tcp://127.0.0.1:{_port()}"
            )
        try:
            with use_publisher("stock" if kind == "stock" else "coalesce"):
                eng, threads = started_by(lambda: VllmEngine(cfg, f"tcp://*:{port}"))
        finally:
            if variable is not None:
                os.environ.pop(variable, None)
    gc.collect()
    sender0 = cpu_seconds(threads)
    t0 = time.perf_counter()
    eng.run()
    loop_s = time.perf_counter() - t0
    pub = eng.publisher
    if kind.startswith("coalesce"):
        pub.flush(60)
    elif kind == "stock":
        deadline = time.monotonic() + 60
        while pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
    sender_ms = (cpu_seconds(threads) - sender0) * 1e3
    eng.shutdown()
    if reader is not None:
        stop.set()
        reader.join(30)
    steps = sorted(eng.step_seconds)
    return {
        "loop_s": loop_s,
        "step_ms_median": statistics.median(steps) * 1e3,
        "step_ms_p99": steps[int(0.99 * len(steps))] * 1e3,
        "publish_ms": sum(eng.publish_seconds) * 1e3,
        "found_full": eng.found_full,
        "sender_cpu_ms": sender_ms,
    }


def main(figures: dict[str, Any]) -> None:
    from coalesce_tools.vllm_engine import EngineConfig, VllmEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--gpu-ms",
        type=float,
        action="append",
        help="the fake forward pass per step, GIL released (default: 0 and 10)",
    )
    args = ap.parse_args()
    VllmEngine(EngineConfig(requests=16), "inproc://warm", publisher="null").run()
    for gpu_ms in args.gpu_ms or [0.0, 10.0]:
        figures[f"gpu_ms={gpu_ms:g}"] = table(args.rounds, gpu_ms)


def table(rounds: int, gpu_ms: float) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in ROWS}
    for r in range(rounds):
        for kind in ROWS if r % 2 == 0 else tuple(reversed(ROWS)):
            samples[kind].append(one(kind, gpu_ms))
    print(
        f"\n# vLLM's scheduler, eager offload, one rank, a {gpu_ms:g} ms forward pass a "
        f"step; medians of {rounds} rounds\n"
    )
    header(
        "publisher",
        "engine loop s",
        "over stock",
        "fastest loop s",
        "fastest over stock",
        "round by round: median (95% interval)",
        "step ms median",
        "step ms p99",
        "in publish() ms",
        "queue full at publish()",
        "sender CPU ms",
    )
    med: dict[str, dict[str, float]] = {
        k: {f: statistics.median(s[f] for s in v) for f in v[0]} for k, v in samples.items()
    }
    best = {k: min(s["loop_s"] for s in v) for k, v in samples.items()}
    for kind in ROWS:
        m = med[kind]
        ratios = [
            a["loop_s"] / b["loop_s"] for a, b in zip(samples[kind], samples["stock"], strict=True)
        ]
        low, high = median_interval(ratios)
        by_round = f"{statistics.median(ratios):.3f}x ({low:.3f}x-{high:.3f}x)"
        row(
            kind,
            f"{m['loop_s']:.2f}",
            f"{m['loop_s'] / med['stock']['loop_s']:.3f}x",
            f"{best[kind]:.2f}",
            f"{best[kind] / best['stock']:.3f}x",
            "" if kind == "stock" else by_round,
            f"{m['step_ms_median']:.2f}",
            f"{m['step_ms_p99']:.1f}",
            f"{m['publish_ms']:.1f}",
            int(m["found_full"]),
            f"{m['sender_cpu_ms']:.0f}",
        )
    figures["medians"] = med
    figures["fastest_loop_s"] = best
    figures["samples"] = samples
    return figures


if __name__ == "__main__":
    with recording("realengine", __doc__ or "") as fig:
        main(fig)
