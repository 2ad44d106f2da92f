"""``coalesce demo``: its command line (``coalesce.__main__`` hands the arguments over)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import replace

from coalesce_tools.demo import KINDS, PUBLISHERS, QUEUE, run_demo
from coalesce_tools.workload import ENGINES, WorkloadConfig

__all__ = ["demo_main"]


_WORKLOAD_OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    ("--ranks", "ranks", int, "DP ranks (processes)"),
    ("--steps", "steps", int, "engine steps per rank"),
    ("--cpu-us", "step_cpu_us", float, "engine CPU time per step, GIL held"),
    ("--gpu-us", "step_gpu_us", float, "GPU wait per step, GIL released"),
    ("--burst-every", "burst_every", int, "steps between bursts"),
    ("--burst-length", "burst_length", int, "steps each burst lasts"),
    (
        "--burst-requests",
        "burst_requests",
        int,
        "long unique prompts per burst step (with --no-sizing; else sized)",
    ),
    (
        "--batch-events",
        "batch_events",
        int,
        "publish each step as batches of at most this many events (0: one batch per "
        "step; e.g. 20 for the upstream report's thousands of small batches)",
    ),
)
"""The demo's options that set a :class:`WorkloadConfig` field: (flag, field, type, help)."""


def lockstep_for(choice: str, ranks: int, cores: int | None = None) -> bool:
    """``--lockstep``'s answer: ``auto`` is on where every rank's engine and sender each
    have a core (below that the group is CPU-bound: every publisher keeps up by slowing
    the engine, docs/decisions.md)."""
    if choice != "auto":
        return choice == "on"
    return (cores if cores is not None else os.cpu_count() or 1) >= 2 * ranks


def demo_main(argv: Sequence[str]) -> int:
    """Run the demo with ``argv`` (what follows ``coalesce demo``); 0 when coalesce kept
    its promise (no silent divergence; a wrong index is a known one)."""
    d = argparse.ArgumentParser(
        prog="coalesce demo",
        description="the seed scenario: vLLM's publisher, the drop fix and ours",
    )
    defaults = WorkloadConfig()
    for flag, field, kind, text in _WORKLOAD_OPTIONS:
        d.add_argument(
            flag,
            type=kind,
            default=getattr(defaults, field),
            dest=field,
            metavar=flag[2:].upper().replace("-", "_"),
            help=text,
        )
    d.add_argument(
        "--queue", type=int, default=QUEUE, help=f"max_queue_size for all publishers ({QUEUE})"
    )
    d.add_argument(
        "--load",
        type=float,
        default=None,
        help="size bursts to this multiple of what vLLM's publisher drains per step, "
        "measured at start (default: 1,600,000 events per burst, 40%% of coalesce's event budget)",
    )
    d.add_argument(
        "--no-sizing",
        action="store_true",
        help="use --burst-requests as given (no measurement)",
    )
    d.add_argument(
        "--engine",
        choices=ENGINES,
        default=defaults.engine,
        help="whose structs and stock publisher: vllm, or sglang (its own class when "
        "sglang is installed, else re-implemented)",
    )
    d.add_argument(
        "--lockstep",
        choices=("auto", "on", "off"),
        default="auto",
        help="ranks wait for each other once per step, as DP ranks do, so one rank's stall "
        "delays the whole group; auto: on where the host has a core for each rank's engine "
        "and one for its sender (2 x ranks), off below",
    )
    d.add_argument(
        "--scheduler",
        action="store_true",
        help="vLLM's own scheduler, KV cache manager and CPU offload manager as the producer "
        "(needs vllm==0.33.0: make demo-vllm); uses --ranks, --queue, --lockstep, --only, --out, "
        "and --gpu-us as the fake forward pass of each step (GIL released)",
    )
    d.add_argument(
        "--offload",
        choices=("eager", "lazy", "none"),
        default="eager",
        help="with --scheduler: vLLM's SimpleCPUOffloadConnector mode (default eager)",
    )
    d.add_argument("--out", default="results", help="where demo.json and demo.png go")
    d.add_argument("--only", choices=KINDS, action="append", help="run only these")
    args = d.parse_args(argv)
    if args.scheduler:
        return _scheduler_demo(args)
    try:
        cfg = replace(
            WorkloadConfig(),
            **{field: getattr(args, field) for _, field, _, _ in _WORKLOAD_OPTIONS},
            engine=args.engine,
            lockstep=lockstep_for(args.lockstep, args.ranks),
        )
    except ValueError as exc:
        d.error(str(exc))
    results = run_demo(
        cfg,
        queue=args.queue,
        outdir=args.out,
        publishers=tuple(args.only or PUBLISHERS),
        size=not args.no_sizing,
        load=args.load,
    )
    # coalesce's promise, whatever the machine: no silent divergence, and no stale block
    # the subscriber does not know of (it reset that rank); a loss marker may leave it
    # missing blocks, which it knows it forgot
    ours = [r for r in results if r.publisher == "coalesce"]
    return 0 if all(r.silent == 0 and (r.stale == 0 or r.resets) for r in ours) else 1


def _scheduler_demo(args: argparse.Namespace) -> int:
    """``--scheduler``: the rows on vLLM's own scheduler (coalesce_tools.demo_vllm); 0
    when coalesce's rows end exact against the engine's pools."""
    from coalesce_tools.demo_vllm import run_scheduler_demo
    from coalesce_tools.vllm_engine import seed_like

    cfg = seed_like(args.offload, gpu_ms=args.step_gpu_us / 1e3)  # --gpu-us: the forward
    rows = run_scheduler_demo(
        cfg,
        ranks=args.ranks,
        queue=args.queue,
        rows=tuple(args.only or PUBLISHERS),
        lockstep=args.lockstep != "off",
        outdir=args.out,
    )
    ours = [r for r in rows if r.publisher.startswith("coalesce")]
    return 0 if all(r.exact_ranks == r.ranks for r in ours) else 1
