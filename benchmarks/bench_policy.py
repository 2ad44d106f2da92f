"""Does each of the sender's mechanisms earn its place?  An A/B per mechanism.

Run: ``.venv/bin/python benchmarks/bench_policy.py [--runs 3]``.

Four scenarios (``SCENARIOS``), each with a ``CoalescingPublisher`` on tcp
loopback and a subscriber process reading everything:

- ``burst, ...``: one engine thread runs the overload sweep's loop
  (``step_cpu_us`` of Python holding the GIL, ``publish()``, a ``step_gpu_us``
  GPU wait; 500 steps with a burst of 120) on the seeded offload workload,
  ``max_queue_size=100``; each step published as batches of at most 120
  events (as the seed report's thousands of batches), or as one batch; at
  the budget, one batch of about 43,000 events a step, where the sender
  falls behind for good and only its drain keeps batches from being refused;
- ``drain, ...``: bench_drain's windows (12,000 offload batches of about 110
  events, or 60,000 of about 20) published at once, the engine idle.

Each variant runs in a fresh child process, the variants alternated,
``--runs`` times; the table shows medians, and the most batches refused in
any run:

- ``defaults``: the library as shipped;
- ``compaction off``: ``compaction=False`` (every batch sent 1:1);
- ``pyzmq sends``: ``COALESCE_PYZMQ_SEND=1``, pyzmq's sends instead of the
  native send that keeps the GIL;
- ``no widening``: ``WIDEN_UP_TO=1``, rules windows of ``max_events_per_step``;
- ``no pressure slice``: ``PRESSURE_FROM`` past the budget, so the sender
  never takes the longer GIL slice;
- ``no whole sends``: ``WHOLE_FROM`` past the budget, so a big batch is always
  compacted in parts;
- with ``--against DIR``, ``before``: the library (``coalesce/``) of another
  checkout, first on ``PYTHONPATH``, with this checkout's tools and benchmarks
  (its C extensions built in place, e.g. copied from this one when no C source
  differs), for a before/after in one run.

Columns, for a burst: the engine loop's wall time (what the sender took from
the engine), the time ``flush()`` then took to send what was left, the p99 of
``publish()``, the batches refused, the messages sent.  For a drain: the
seconds until the last batch was sent, and the rate (million events a second).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "compaction off": {"env": {"COALESCE_COMPACTION": "0"}},
    "pyzmq sends": {"env": {"COALESCE_PYZMQ_SEND": "1"}},
    "no widening": {"policy": {"WIDEN_UP_TO": 1}},
    "no pressure slice": {"policy": {"PRESSURE_FROM": 1e9}},
    "no whole sends": {"policy": {"WHOLE_FROM": 1e9}},
}

SCENARIOS: dict[str, tuple[str, int, int]] = {
    "burst, seed-sized batches": ("loop", 34, 120),
    "burst, one batch a step": ("loop", 90, 10**9),
    "burst at the budget": ("loop", 150, 10**9),
    "drain, big batches": ("drain", 37, 12_000),
    "drain, small batches": ("drain", 7, 60_000),
}
"""``loop``: the overload loop at (burst requests per step, events per batch at most);
``drain``: (blocks per batch, batches) published at once with the engine idle."""


def _publisher(port: int, **kw: Any) -> Any:
    from coalesce import CoalescingPublisher

    return CoalescingPublisher(0, endpoint=f"tcp://*:{port}", **kw)


def _loop(pub: Any, requests: int, batch_events: int) -> list[float]:
    """The overload loop, each step published as batches of at most ``batch_events``."""
    import time

    from coalesce import KVEventBatch, PublishOutcome
    from coalesce_tools.demo import spin_until
    from coalesce_tools.workload import Engine

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_overload import sweep_config

    cfg = sweep_config(burst_requests=requests)
    engine = Engine(cfg, 0)
    steps = []
    for _ in range(cfg.steps):
        events = engine.step()
        steps.append([events[i : i + batch_events] for i in range(0, len(events), batch_events)])
    peak = max(sum(map(len, parts)) for parts in steps)
    sent0 = pub.stats().messages_sent
    dropped = 0
    lat: list[int] = []
    clock = time.perf_counter_ns
    start = time.perf_counter()
    for parts in steps:
        spin_until(time.perf_counter() + cfg.step_cpu_us / 1e6)
        for events in parts:
            t0 = clock()
            outcome = pub.publish(KVEventBatch(ts=0.0, events=events))
            lat.append(clock() - t0)
            dropped += outcome is PublishOutcome.DROPPED
        time.sleep(cfg.step_gpu_us / 1e6)
    wall = time.perf_counter() - start
    t0f = time.perf_counter()
    assert pub.flush(120)
    drain = time.perf_counter() - t0f
    lat.sort()
    p99 = lat[int(0.99 * (len(lat) - 1))] / 1e3
    return [wall, drain, p99, dropped, pub.stats().messages_sent - sent0, peak]


def _drain(pub: Any, blocks: int, n: int) -> list[float]:
    """``n`` offload batches of ``blocks`` blocks published at once, the engine idle."""
    import time

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_publish import make_batch

    batches = [make_batch(i, blocks) for i in range(n)]
    events = sum(len(b.events) for b in batches)
    sent0 = pub.stats().messages_sent
    t0 = time.perf_counter()
    for b in batches:
        pub.publish(b)
    assert pub.flush(120)
    wall = time.perf_counter() - t0
    st = pub.stats()
    return [wall, events / wall / 1e6, 0.0, st.batches_dropped, st.messages_sent - sent0, n]


def child(variant: str, scenario: str) -> None:
    import gc
    import socket

    from coalesce.testing import policy

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _reader import start_reader, stop_reader

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kind, a, b = SCENARIOS[scenario]
    with policy(**VARIANTS[variant].get("policy", {})):
        if kind == "loop":
            pub = _publisher(port, max_queue_size=100)
        else:
            pub = _publisher(port, max_queue_size=10 * b, hwm=0, max_pending_events=10**9)
        reader = start_reader(f"tcp://127.0.0.1:{port}")
        try:
            from coalesce import KVEventBatch

            pub.publish(KVEventBatch(ts=0.0, events=[]))
            assert pub.flush(10)
            gc.collect()
            gc.freeze()
            out = _loop(pub, a, b) if kind == "loop" else _drain(pub, a, b)
        finally:
            pub.shutdown()
            stop_reader(reader)
    print(" ".join(map(str, out)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", action="append", choices=list(VARIANTS), help="these variants")
    ap.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="these only")
    ap.add_argument("--against", metavar="DIR", help="another checkout, as variant 'before'")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(*args.child)
        return
    from coalesce_tools.results import header

    variants = ["defaults", *(v for v in (args.only or VARIANTS) if v != "defaults")]
    if args.against:  # only its library: the tools and these benchmarks stay this checkout's
        import tempfile

        shadow = tempfile.mkdtemp(prefix="bench-policy-")
        os.symlink(os.path.join(os.path.abspath(args.against), "coalesce"), f"{shadow}/coalesce")
        VARIANTS["before"] = {"env": {"PYTHONPATH": shadow}}
        variants.append("before")
    print(
        "# does each mechanism earn its place? (bench_policy.py)\n\n"
        f"{os.cpu_count()} cores; loops: 500 steps (300 us Python + 300 us GPU wait) with a "
        f"burst of 120 steps; medians of {args.runs} alternated runs, refused: the most "
        "in a run\n"
    )
    header(
        "scenario",
        "variant",
        "engine loop s (drain: s)",
        "vs defaults",
        "drain after s (drain: Mev/s)",
        "p99 publish us",
        "refused",
        "messages",
    )
    for scenario in args.scenario or SCENARIOS:
        rows: dict[str, list[list[float]]] = {k: [] for k in variants}
        for run in range(args.runs):
            order = variants if run % 2 == 0 else variants[::-1]
            for name in order:
                env = {**os.environ, **VARIANTS[name].get("env", {})}
                run_as = "defaults" if name == "before" else name
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--child", run_as, scenario],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()
                rows[name].append([float(x) for x in out])
        base = statistics.median(r[0] for r in rows["defaults"])
        for name in variants:
            runs = rows[name]

            def med(i: int, runs: list[list[float]] = runs) -> float:
                return statistics.median(r[i] for r in runs)

            p99 = f"{med(2):.0f}" if SCENARIOS[scenario][0] == "loop" else ""
            print(
                f"| {scenario} | {name} | {med(0):.2f} | {med(0) / base:.2f}x "
                f"| {med(1):.2f} | {p99} | {int(max(r[3] for r in runs))} "
                f"| {int(med(4)):,} |",
                flush=True,
            )


if __name__ == "__main__":
    if "--child" in sys.argv:  # one run, its figures on stdout: no result file
        main()
    else:
        from coalesce_tools.results import recording

        with recording("policy", __doc__ or ""):
            main()
