"""The sender's share of the GIL next to a busy engine thread: an A/B in one process.

Run: ``.venv/bin/python benchmarks/bench_gil.py [--requests 34,90] [--runs 2]``.

One engine thread runs the overload sweep's loop (``step_cpu_us`` of Python
holding the GIL, ``publish()``, a ``step_gpu_us`` GPU wait; 500 steps with a
burst of 120) on the seeded offload workload, publishing to a
``CoalescingPublisher`` on tcp loopback with a subscriber process draining it.
Each variant runs in a fresh child process, variants alternated, and reports
the engine loop's wall time and the batches ``publish()`` refused:

- ``pyzmq sends``: ``COALESCE_PYZMQ_SEND=1`` (pyzmq releases the GIL per frame);
- ``native, no slice``: the native send, the pressure slice off
  (``PRESSURE_FROM`` set past the budget: the sender yields every
  ``YIELD_EVERY``);
- ``native``: the defaults.

``--requests`` sets burst requests per step (each adds about 289 events).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

VARIANTS = {
    "pyzmq sends": {"COALESCE_PYZMQ_SEND": "1"},
    "native, no slice": {"BENCH_GIL_NO_SLICE": "1"},
    "native": {},
}


_DRAIN = """
import sys, zmq
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(f"tcp://127.0.0.1:{sys.argv[1]}")
sub.recv_multipart()
print("heard", flush=True)
while True:
    sub.recv_multipart()
"""
"""The subscriber: another process (as a router is), reading everything."""


def child(requests: int) -> None:
    import gc
    import select
    import socket
    import time

    import coalesce._sender as sender_module
    from coalesce.events import KVEventBatch
    from coalesce.publisher import CoalescingPublisher, PublishOutcome
    from coalesce_tools.demo import spin_until
    from coalesce_tools.workload import Engine

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_overload import sweep_config

    if os.environ.get("BENCH_GIL_NO_SLICE"):
        sender_module.PRESSURE_FROM = 10.0  # never reached: always YIELD_EVERY
    cfg = sweep_config(burst_requests=requests)
    engine = Engine(cfg, 0)
    steps = [engine.step() for _ in range(cfg.steps)]
    gc.collect()
    gc.freeze()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pub = CoalescingPublisher(0, endpoint=f"tcp://*:{port}", max_queue_size=100)
    drainer = subprocess.Popen(
        [sys.executable, "-c", _DRAIN, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert drainer.stdout is not None
    deadline = time.monotonic() + 30
    while not select.select([drainer.stdout], [], [], 0.05)[0]:  # until it hears one
        pub.publish(KVEventBatch(ts=0.0, events=[]))
        if time.monotonic() > deadline:
            raise RuntimeError("the subscriber process heard nothing")
    drainer.stdout.readline()
    dropped = 0
    start = time.perf_counter()
    for events in steps:
        spin_until(time.perf_counter() + cfg.step_cpu_us / 1e6)
        if pub.publish(KVEventBatch(ts=0.0, events=events)) is PublishOutcome.DROPPED:
            dropped += 1
        time.sleep(cfg.step_gpu_us / 1e6)
    wall = time.perf_counter() - start
    pub.flush(60)
    pub.shutdown()
    drainer.kill()
    drainer.wait()
    print(f"{wall} {dropped} {max(map(len, steps))} {int(pub.stats().native_send)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="34,90")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    print(
        "# the sender's GIL share (bench_gil.py)\n\n"
        f"{os.cpu_count()} cores; engine loop 500 steps (300 us Python + 300 us GPU wait), "
        f"a burst of 120 steps; medians of {args.runs} alternated runs, dropped: the worst\n"
    )
    print("| events/burst step | variant | engine loop s | dropped | native send |")
    print("|---|---|---|---|---|")
    for requests in (int(r) for r in args.requests.split(",")):
        rows: dict[str, list[tuple[float, int, int, int]]] = {k: [] for k in VARIANTS}
        for _ in range(args.runs):
            for name, env in VARIANTS.items():
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(requests)],
                    env={**os.environ, **env},
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()
                rows[name].append((float(out[0]), int(out[1]), int(out[2]), int(out[3])))
        for name, runs in rows.items():
            wall = statistics.median(r[0] for r in runs)
            print(
                f"| {runs[0][2]:,} | {name} | {wall:.2f} | {max(r[1] for r in runs)} "
                f"| {'yes' if runs[0][3] else 'no'} |"
            )


if __name__ == "__main__":
    from coalesce_tools.results import recording

    with recording("gil", __doc__ or ""):
        main()
