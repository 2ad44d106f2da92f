"""Overload sweep: loss, divergence, stall, engine loop and wire volume per publisher, 1x-20x.

Run: ``.venv-vllm/bin/python benchmarks/bench_overload.py`` (real vLLM
publisher) or ``.venv/bin/python benchmarks/bench_overload.py`` (its
re-implementation).  Each cell is one run of ``coalesce.demo.run_publisher``
(one engine process, one subscriber process with replay) on the seeded
offload workload; the overload factor sets the burst size.

Overload = events offered in one burst step / events the stock sender can
encode and send during one GPU wait, both measured in this run.
"""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import replace

from coalesce.demo import (
    PUBLISHERS,
    events_per_request,
    run_publisher,
    stock_capacity_per_step,
)
from coalesce.workload import WorkloadConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="1,2,5,10,20")
    ap.add_argument("--queue", type=int, default=100)
    ap.add_argument(
        "--batch-events",
        type=int,
        default=0,
        help="publish each step as batches of at most this many events (0: one per step)",
    )
    args = ap.parse_args()
    base = replace(
        WorkloadConfig(),
        ranks=1,
        steps=500,
        burst_every=500,
        burst_length=120,
        batch_events=args.batch_events,
    )
    per_request = events_per_request(base)
    cap = stock_capacity_per_step(base)
    n = base.batch_events
    shape = f"batches of at most {n} events" if n else "one batch per step"
    from coalesce._baselines import REAL_VLLM

    print(
        f"# overload sweep\n\nmachine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; stock publisher: "
        f"{'real vLLM' if REAL_VLLM else 're-implementation'}; one rank, {base.steps} steps, "
        f"a burst of {base.burst_length} steps; "
        f"{shape}; "
        f"max_queue_size={args.queue}; stock sender "
        f"capacity {cap:,.0f} events per GPU wait\n"
    )
    print(
        "| overload | events/burst step | publisher | stall ms | worst publish ms | p99 us "
        "| engine vs stock | dropped | gaps seen | resets | recovered | silent divergence "
        "| final divergence | wire MB | wire vs stock |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for load in (float(x) for x in args.loads.split(",")):
        requests = max(1, round(load * cap / per_request))
        cfg = replace(base, burst_requests=requests)
        stock_bytes = stock_wall = None
        for kind in PUBLISHERS:
            r = run_publisher(kind, cfg, queue=args.queue, show_progress=False)
            if kind == "stock":
                stock_bytes, stock_wall = r.bytes_on_wire, r.engine_wall_s
            vs = f"{r.bytes_on_wire / stock_bytes:.2f}" if stock_bytes else "n/a"
            engine = f"{r.engine_wall_s / stock_wall:.2f}x" if stock_wall else "n/a"
            print(
                f"| {load:g}x | {requests * per_request:,} | {kind} | {r.publish_total_ms:.1f} "
                f"| {r.publish_max_us / 1e3:.2f} | {r.publish_p99_us:.1f} | {engine} "
                f"| {r.dropped} | {r.gaps_seen} | {r.resets} | {r.recovered} "
                f"| {r.silent:,} | {r.missing + r.stale:,} "
                f"| {r.bytes_on_wire / 1e6:.1f} | {vs} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
