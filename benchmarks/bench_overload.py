"""Overload sweep: loss, divergence, stall, engine loop and wire volume per publisher, 1x-20x.

Run: ``.venv-vllm/bin/python benchmarks/bench_overload.py`` (real vLLM
publisher) or ``.venv/bin/python benchmarks/bench_overload.py`` (its
re-implementation).  Each cell is a run of ``coalesce_tools.demo.run_publisher``
(one engine process, one subscriber process with replay) on the seeded
offload workload; the overload factor sets the burst size.  ``--only`` picks
publishers; ``--runs N`` alternates them N times per load (medians; counts
are the worst run's).

Overload = events offered in one burst step / events the stock sender can
encode and send during one GPU wait, both measured in this run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from dataclasses import replace
from typing import Any

from coalesce_tools.demo import (
    KINDS,
    PUBLISHERS,
    events_per_request,
    run_publisher,
    stock_capacity_per_step,
)
from coalesce_tools.results import header, row, run
from coalesce_tools.workload import WorkloadConfig


def sweep_config(**overrides: Any) -> WorkloadConfig:
    """The sweep's engine: one rank, 500 steps, one burst of 120 steps (bench_policy
    runs the same loop)."""
    return replace(
        WorkloadConfig(), ranks=1, steps=500, burst_every=500, burst_length=120, **overrides
    )


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
    ap.add_argument(
        "--only", action="append", choices=KINDS, help="run only these publishers (repeat)"
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="rounds per load, publishers alternated; cells show medians (counts: the worst)",
    )
    args = ap.parse_args()
    kinds = [k for k in KINDS if (k in PUBLISHERS and not args.only) or k in (args.only or ())]
    base = sweep_config(batch_events=args.batch_events)
    per_request = events_per_request(base)
    cap = stock_capacity_per_step(base)
    n = base.batch_events
    shape = f"batches of at most {n} events" if n else "one batch per step"
    from coalesce_tools.baselines import REAL_VLLM

    print(
        f"# overload sweep\n\nmachine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; stock publisher: "
        f"{'real vLLM' if REAL_VLLM else 're-implementation'}; one rank, {base.steps} steps, "
        f"a burst of {base.burst_length} steps; "
        f"{shape}; "
        f"max_queue_size={args.queue}; stock sender "
        f"capacity {cap:,.0f} events per GPU wait\n"
    )
    header(
        "overload",
        "events/burst step",
        "publisher",
        "stall ms",
        "worst publish ms",
        "p99 us",
        "engine vs stock",
        "dropped",
        "gaps seen",
        "resets",
        "recovered",
        "silent divergence",
        "final divergence",
        "wire MB",
        "wire vs stock",
    )
    for load in (float(x) for x in args.loads.split(",")):
        requests = max(1, round(load * cap / per_request))
        cfg = replace(base, burst_requests=requests)
        rounds = []
        for _ in range(args.runs):
            rounds.append(
                {k: run_publisher(k, cfg, queue=args.queue, show_progress=False) for k in kinds}
            )
        for kind in kinds:
            rs = [rnd[kind] for rnd in rounds]
            r = rs[-1]
            engine = vs = "n/a"
            if "stock" in kinds:
                ratios = [rnd[kind].engine_wall_s / rnd["stock"].engine_wall_s for rnd in rounds]
                engine = f"{statistics.median(ratios):.2f}x"
                vs = f"{r.bytes_on_wire / rounds[-1]['stock'].bytes_on_wire:.2f}"
            row(
                f"{load:g}x",
                f"{requests * per_request:,}",
                kind,
                f"{statistics.median(x.publish_total_ms for x in rs):.1f}",
                f"{max(x.publish_max_us for x in rs) / 1e3:.2f}",
                f"{statistics.median(x.publish_p99_us for x in rs):.1f}",
                engine,
                max(x.dropped for x in rs),
                max(x.gaps_seen for x in rs),
                max(x.resets for x in rs),
                max(x.recovered for x in rs),
                f"{max(x.silent for x in rs):,}",
                f"{max(x.missing + x.stale for x in rs):,}",
                f"{r.bytes_on_wire / 1e6:.1f}",
                vs,
            )


if __name__ == "__main__":
    run("overload", __doc__, main)
