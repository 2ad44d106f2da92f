"""The engine loop where stock never blocks: what each sender costs the engine.

Engine model (bench_publish's): each step spins ``--cpu-us`` holding the GIL,
calls ``publish()`` once, then waits ``--gpu-us`` on the "GPU" (``time.sleep``,
GIL released: the only time a sender thread runs for free).  Three batch sizes
that every sender drains as they come (about 20, 110 and 440 events), of two
streams (``bench_publish.make_batch``): ``seed``, the seed's shape (a GPU pool
of 64 blocks whose evictions are copied to a CPU pool that never evicts, every
store sharing one token list), and ``vLLM``, the shape of vLLM's own stream on
that point (the CPU pool holds 32 steps of blocks and evicts, each store has
its own token list).  The engine lets go of each batch once ``publish()``
returns, as vLLM's scheduler does, so a sender frees what it sent.  The load
column is the events offered per step over what vLLM's sender encodes and
sends during one GPU wait, measured in this run.  Every publisher binds tcp
loopback with a real SUB reading in a process of its own; publishers
alternate (in reverse order every other round), ``--rounds`` times per size;
medians.  ``coalesce`` runs with the
default settings, so it records every batch for an in-band resync after a loss
(``loss_marker=resync``, no snapshot socket); ``coalesce, clear`` runs without
that recorder (``loss_marker=clear``); ``coalesce+snap`` records for snapshots
too (``snapshot_endpoint``, opt-in); ``coalesce+snap, windows`` too, with what
it sent as it came gathered and recorded as the compactor's output of each 512
events (``RECORD_WINDOW=512``, the recorder's feed before its state was C).
``engine vs stock`` is the loop's wall time over stock's in the same round
(the median over rounds, and a 95% bootstrap interval of that median: on a
shared host single rounds vary by a tenth or more);
``publish()`` percentiles are of every call of the round (medians over rounds).
``sender CPU``: the CPU of the Python threads the publisher started (its
sender, which holds the GIL the engine wants; not zmq's I/O thread) from the
loop's start until everything was sent, per event published (Linux only).
``stock blocked``: the most calls in a round that found vLLM's queue full (its
``publish()`` waited).

``--pin`` gives the engine thread a core of its own (Linux): the publisher's
threads (its sender, ZeroMQ's I/O thread) and the reader process are started
pinned to the last core, then the engine thread moves to the first, so it
never waits for a core (as on a server with cores to spare); a wake then
always crosses cores.  ``--floor`` adds two rows with no sender at all: an
empty ``publish()`` method, and one that only releases a lock a sleeping
thread waits on (what ``CoalescingPublisher.publish()`` does to wake its
idle sender): what the loop, the call and the wake cost on this machine.

    .venv-vllm/bin/python benchmarks/bench_engine.py   # against the real vLLM class
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import socket
import statistics
import sys
import threading
import time
import types
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _reader import start_reader, stop_reader
from _threads import cpu_seconds, started_by
from bench_publish import _spin, drain_rate, effective_sleep, make_batch

from coalesce import CoalescingPublisher
from coalesce.testing import IDLE_SLEEP, policy
from coalesce_tools.baselines import REAL_VLLM, StockPublisher
from coalesce_tools.results import header, median_interval, row, run

KINDS = ("stock", "coalesce", "coalesce, clear", "coalesce+snap", "coalesce+snap, windows")
WINDOWS = "coalesce+snap, windows"
"""Snapshots on, what was sent as it came gathered and compacted in windows of 512 events
before it is recorded (``RECORD_WINDOW=512``): the A/B of the feed's windows."""
FLOORS = ("floor: call", "floor: wake")
# (stream, GPU blocks a step, the CPU pool in steps of blocks: None never evicts)
SHAPES = (
    *(("seed", blocks, None) for blocks in (7, 37, 148)),
    *(("vLLM", blocks, 32) for blocks in (5, 28, 111)),
)


class _Floor:
    """A stand-in publisher for the floor rows (``--floor``): ``publish()`` is an
    empty method call, or (``wake``) one lock release that wakes a thread asleep
    on it, as ``CoalescingPublisher.publish()`` wakes its idle sender.  Nothing
    is sent: the rows show what the loop and a call cost on this machine."""

    def __init__(self, wake: bool) -> None:
        self._bell = threading.Lock()
        self._bell.acquire()
        self._stop = False
        self._thread = threading.Thread(target=self._sleeper, daemon=True) if wake else None
        if self._thread is not None:
            self._thread.start()
            self.publish = self._ring  # type: ignore[method-assign]

    def _sleeper(self) -> None:
        while not self._stop:
            self._bell.acquire(timeout=IDLE_SLEEP)  # as the idle sender sleeps

    def _ring(self, batch: Any) -> None:
        try:  # noqa: SIM105 - the same code as the sender's wake()
            self._bell.release()
        except RuntimeError:  # already rung
            pass

    def publish(self, batch: Any) -> None:
        pass

    def flush(self, timeout: float) -> bool:
        return True

    def stats(self) -> Any:
        return types.SimpleNamespace(batches_dropped=0)

    def shutdown(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._ring(None)
            self._thread.join()


def _pin(cpu: int | None) -> None:
    """Pin the calling thread (threads and processes it starts inherit it)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # pid 0: the calling thread, on Linux


def one_run(
    kind: str,
    blocks: int,
    steps: int,
    cpu_us: float,
    gpu_us: float,
    pin: bool = False,
    cpu_steps: int | None = None,
) -> tuple[float, float, float, int, float]:
    """(loop seconds, p50 us, p99 us, calls that found vLLM's queue full, CPU
    seconds of the publisher's own threads until everything was sent) of one
    engine loop with ``kind``'s publisher."""
    everyone = os.sched_getaffinity(0) if pin else set()  # (Linux only)
    engine_cpu, rest_cpu = (min(everyone), max(everyone)) if pin else (None, None)
    _pin(rest_cpu)  # the publisher's threads and the reader start here
    batches: list[Any] = [make_batch(i, blocks, cpu_steps) for i in range(steps)]
    for b in batches:
        b.data_parallel_rank = None
    del b
    gc.collect()
    gc.freeze()  # fresh lists by the thousand: keep cyclic-GC pauses out of the loop
    with socket.socket() as s, socket.socket() as s2:
        s.bind(("127.0.0.1", 0))
        s2.bind(("127.0.0.1", 0))
        port, snap_port = s.getsockname()[1], s2.getsockname()[1]
    endpoint = f"tcp://*:{port}"
    pub: Any
    if kind == "stock":
        pub, threads = started_by(lambda: StockPublisher(0, endpoint=endpoint, max_queue_size=100))
    elif kind in FLOORS:
        pub, threads = started_by(lambda: _Floor(wake=kind == "floor: wake"))
    else:
        pub, threads = started_by(
            lambda: CoalescingPublisher(
                0,
                endpoint=endpoint,
                max_queue_size=100,
                snapshot_endpoint=f"tcp://*:{snap_port}" if "snap" in kind else None,
                loss_marker="clear" if "clear" in kind else None,
            )
        )
    reader = start_reader(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # (not timed) the reader's subscription reaches the PUB
    _pin(engine_cpu)
    lat: list[int] = []
    clock = time.perf_counter_ns
    gpu = gpu_us / 1e6
    vllm_queue = pub._event_queue if kind == "stock" else None
    blocked = 0
    sender0 = cpu_seconds(threads)
    t0 = time.perf_counter()
    for i in range(steps):
        _spin(cpu_us)
        if vllm_queue is not None and vllm_queue.full():  # publish() will wait
            blocked += 1
        a = clock()
        pub.publish(batches[i])
        lat.append(clock() - a)
        batches[i] = None  # the engine keeps no batch it published
        time.sleep(gpu)
    wall = time.perf_counter() - t0
    if kind == "stock":
        deadline = time.monotonic() + 60  # vLLM's shutdown() raises queue.Full on a full queue
        while pub._event_queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.001)
    else:
        assert pub.flush(60) and pub.stats().batches_dropped == 0
    sender = cpu_seconds(threads) - sender0
    pub.shutdown()
    stop_reader(reader)
    gc.unfreeze()
    if pin:
        os.sched_setaffinity(0, everyone)
    lat.sort()
    return wall, lat[len(lat) // 2] / 1e3, lat[len(lat) * 99 // 100] / 1e3, blocked, sender


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--cpu-us", type=float, default=50.0)
    ap.add_argument("--gpu-us", type=float, default=100.0)
    ap.add_argument("--only", action="append", choices=KINDS[1:], help="coalesce kinds to run")
    ap.add_argument(
        "--pin", action="store_true", help="the engine thread on a core of its own (Linux)"
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="add rows for an empty publish() and for a bare wake (this machine's floor)",
    )
    args = ap.parse_args()
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        ap.error("--pin needs at least two cores")
    kinds = ("stock", *(args.only or KINDS[1:]), *(FLOORS if args.floor else ()))
    rate = drain_rate(37)
    gpu_eff = effective_sleep(args.gpu_us)
    print(
        f"# the engine loop where stock never blocks\n\nmachine: {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; stock publisher: "
        f"{'real vLLM' if REAL_VLLM else 're-implementation'}; {args.steps} steps of "
        f"{args.cpu_us:.0f} us CPU + a {args.gpu_us:.0f} us GPU wait ({gpu_eff * 1e6:.0f} us "
        f"effective); medians of {args.rounds} alternated rounds"
        f"{'; engine thread pinned to a core of its own' if args.pin else ''}\n"
    )
    header(
        "stream",
        "events/step",
        "load",
        "publisher",
        "loop ms",
        "engine vs stock",
        "95% interval",
        "p50 us",
        "p99 us",
        "stock blocked",
        "sender CPU ns/event",
    )
    for shape, blocks, cpu_steps in SHAPES:
        events = len(make_batch(args.steps // 2, blocks, cpu_steps).events)
        runs: dict[str, list[tuple[float, float, float, int, float]]] = {k: [] for k in kinds}
        ratios: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                with policy(RECORD_WINDOW=512) if kind == WINDOWS else contextlib.nullcontext():
                    run_ = one_run(
                        kind, blocks, args.steps, args.cpu_us, args.gpu_us, args.pin, cpu_steps
                    )
                runs[kind].append(run_)
            for kind in kinds:
                ratios[kind].append(runs[kind][-1][0] / runs["stock"][-1][0])
        for kind in kinds:
            wall, p50, p99 = (statistics.median(r[i] for r in runs[kind]) for i in range(3))
            blocked = max(r[3] for r in runs["stock"]) if kind == "stock" else ""
            load = f"{events / (rate * gpu_eff):.2f}x"
            vs = f"{statistics.median(ratios[kind]):.2f}x"
            low, high = median_interval(ratios[kind])
            interval = "" if kind == "stock" else f"{low:.2f}x-{high:.2f}x"
            sender = statistics.median(r[4] for r in runs[kind]) / (events * args.steps) * 1e9
            row(
                shape,
                events,
                load,
                kind,
                f"{wall * 1e3:.0f}",
                vs,
                interval,
                f"{p50:.1f}",
                f"{p99:.1f}",
                blocked,
                f"{sender:.0f}",
            )


if __name__ == "__main__":
    run("engine", __doc__, main)
