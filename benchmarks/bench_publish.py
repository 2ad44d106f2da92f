"""publish() latency and engine stall under overload; compactor throughput.

Run: ``make bench`` (or ``.venv-vllm/bin/python benchmarks/bench_publish.py``
to measure against the real vLLM class).  Prints markdown tables; method and
results are in docs/benchmarks.md.

Engine model: each step does ``cpu_us`` of Python work holding the GIL, one
``publish()`` of a batch of offload events, then waits ``gpu_us`` on the
"GPU" (``time.sleep``, GIL released: that is when a sender thread can run).
The overload factor is the offered event rate divided by the stock sender's
drain rate (encode + send_multipart per batch), measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

sys.path.insert(0, os.path.dirname(__file__))
from coalesce import BlockRemoved, BlockStored, CoalescingPublisher, KVEventBatch
from coalesce.compactor import compact
from coalesce_tools.baselines import REAL_VLLM, DropPublisher, StockPublisher
from coalesce_tools.results import header, run

if REAL_VLLM:
    from vllm.distributed import kv_events as vk

    def _store(h: int, p: int | None, medium: str, tokens: list[int] | None = None) -> Any:
        tokens = _TOKENS if tokens is None else tokens
        return vk.BlockStored(
            block_hashes=[h],
            parent_block_hash=p,
            token_ids=tokens,
            block_size=16,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    def _removed(h: int, medium: str = "GPU") -> Any:
        return vk.BlockRemoved(block_hashes=[h], medium=medium)

    def _batch(events: list[Any]) -> Any:
        return vk.KVEventBatch(ts=time.time(), events=events)
else:

    def _store(h: int, p: int | None, medium: str, tokens: list[int] | None = None) -> Any:
        return BlockStored([h], p, _TOKENS if tokens is None else tokens, 16, None, medium, None)

    def _removed(h: int, medium: str = "GPU") -> Any:
        return BlockRemoved([h], medium)

    def _batch(events: list[Any]) -> Any:
        return KVEventBatch(ts=time.time(), events=events)


_TOKENS = list(range(16))  # shared by every store: memory, not meaning


def make_batch(step: int, blocks: int, cpu_steps: int | None = None) -> Any:
    """One engine step of an offload workload: ``blocks`` GPU stores, evictions, CPU copies.

    The GPU pool holds 64 blocks; each block evicted from it is copied to the
    CPU.  ``cpu_steps=None`` (the seed's shape): the CPU pool never evicts and
    every store shares one token list.  ``cpu_steps=n`` (vLLM's shape): the CPU
    pool holds ``n`` steps of blocks and evicts the oldest (a CPU removal before
    each CPU store once it is full), and every store has a token list of its
    own, as vLLM's scheduler makes them.
    """
    events: list[Any] = []
    base = step * blocks
    cpu_pool = None if cpu_steps is None else cpu_steps * blocks
    for j in range(blocks):
        h = base + j + 1
        tokens = None if cpu_pool is None else list(_TOKENS)
        events.append(_store(h, h - 1 if h > 1 else None, "GPU", tokens))
        if h > 64:
            events.append(_removed(h - 64))
            if cpu_pool is not None and h - 64 > cpu_pool:
                events.append(_removed(h - 64 - cpu_pool, "CPU"))
            tokens = None if cpu_pool is None else list(_TOKENS)
            events.append(_store(h - 64, h - 65 if h > 65 else None, "CPU", tokens))
    return _batch(events)


def drain_rate(blocks: int, n: int = 300) -> float:
    """Events/s the stock sender's per-batch work sustains on one thread, no contention."""
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.bind(f"inproc://drain-{os.getpid()}-{blocks}")
    enc = msgspec.msgpack.Encoder()
    batches = [make_batch(i, blocks) for i in range(n)]
    events = sum(len(b.events) for b in batches)
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        sock.send_multipart((b"", i.to_bytes(8, "big"), enc.encode(b)))
    dt = time.perf_counter() - t0
    sock.close(linger=0)
    return events / dt


def _spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def run_engine(
    make_pub: Callable[[], Any], batches: list[Any], cpu_us: float, gpu_us: float
) -> dict[str, Any]:
    """One engine loop over ``batches`` (fresh ones: the loop lets go of each
    batch once ``publish()`` returns, as vLLM's scheduler does)."""
    n = len(batches)
    for b in batches:
        b.data_parallel_rank = None
    del b
    gc.collect()
    gc.freeze()  # many fresh lists: keep cyclic GC pauses out of the timings
    pub = make_pub()
    lat: list[int] = []
    clock = time.perf_counter_ns
    t_start = time.perf_counter()
    for i in range(n):
        _spin(cpu_us)
        t0 = clock()
        pub.publish(batches[i])
        lat.append(clock() - t0)
        batches[i] = None
        time.sleep(gpu_us / 1e6)
    out: dict[str, Any] = {"wall_ms": (time.perf_counter() - t_start) * 1e3}
    if isinstance(pub, CoalescingPublisher):
        pub.shutdown()
        st = pub.stats()
        out.update(
            dropped=st.batches_dropped,
            messages=st.messages_sent,
            gaps=st.seq_gaps,
            bytes=st.bytes_sent,
            level2=st.fold_only_passes,
            passes=st.compaction_passes,
        )
    else:
        dropped = getattr(pub, "dropped", 0)
        deadline = time.monotonic() + 60  # vLLM's shutdown() raises queue.Full on a full queue
        while pub._event_queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.001)
        pub.shutdown()
        out.update(dropped=dropped, messages=n - dropped, gaps=0, bytes=None)
    gc.unfreeze()
    lat.sort()
    out.update(
        p50_us=lat[len(lat) // 2] / 1e3,
        p99_us=lat[int(len(lat) * 0.99)] / 1e3,
        max_us=lat[-1] / 1e3,
        stall_ms=sum(lat) / 1e6,
    )
    return out


def effective_sleep(gpu_us: float, n: int = 200) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        time.sleep(gpu_us / 1e6)
    return (time.perf_counter() - t0) / n


def bench_overload(steps: int, cpu_us: float, gpu_us: float, queue: int, repeats: int) -> None:
    rate = drain_rate(64)
    gpu_eff = effective_sleep(gpu_us)
    print(
        f"\n## publish() under overload ({steps} steps of {cpu_us:.0f} us CPU + a GPU wait of "
        f"{gpu_us:.0f} us ({gpu_eff * 1e6:.0f} us effective); max_queue_size={queue})\n"
    )
    print(
        f"Stock sender drain rate measured: {rate / 1e6:.1f} M events/s. Overload = events "
        "offered per step / events the stock sender can drain during one GPU wait.\n"
    )
    header(
        "overload",
        "blocks/step",
        "publisher",
        "p50 us",
        "p99 us",
        "max us",
        "stall ms",
        "stall vs stock",
        "engine loop ms",
        "dropped",
        "gaps",
        "messages",
        "wire bytes vs uncompacted",
    )
    enc = msgspec.msgpack.Encoder()
    n = 0
    cls = {"stock": StockPublisher, "drop": DropPublisher, "coalesce": CoalescingPublisher}
    for load in (0.5, 1, 2, 5, 10):
        blocks = max(1, round(load * rate * gpu_eff / 3))
        raw = sum(len(enc.encode(make_batch(i, blocks))) for i in range(steps))
        base: dict[str, Any] = {}
        for name in ("stock", "drop", "coalesce"):
            runs = []
            for _ in range(repeats):
                n += 1
                ctor = functools.partial(
                    cls[name],
                    0,
                    endpoint=f"inproc://bench-{os.getpid()}-{n}",
                    max_queue_size=queue,
                )
                batches = [make_batch(i, blocks) for i in range(steps)]
                runs.append(run_engine(ctor, batches, cpu_us, gpu_us))
                del batches
            r = {k: statistics.median(run[k] for run in runs) for k in runs[0] if k != "bytes"}
            r["max_us"] = max(run["max_us"] for run in runs)
            r["bytes"] = runs[0]["bytes"]
            if name == "stock":
                base = r
            wire = (
                f"{r['bytes'] / raw:.2f}" if r["bytes"] else ("1.00" if not r["dropped"] else "n/a")
            )
            print(
                f"| {load}x | {blocks} | {name} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | "
                f"{r['max_us']:.0f} | {r['stall_ms']:.1f} | "
                f"{r['stall_ms'] / base['stall_ms']:.3f} | {r['wall_ms']:.0f} | "
                f"{r['dropped']:.0f} | {r['gaps']:.0f} | {r['messages']:.0f} | {wire} |"
            )


def bench_compactor() -> None:
    print("\n## compactor throughput (offload window, one call)\n")
    header("window events", "every rule: Mev/s", "us/event", "fold only: Mev/s", "encode: Mev/s")
    enc = msgspec.msgpack.Encoder()
    for blocks_total in (128, 512, 2048, 8192, 32768):
        batches = [make_batch(i, 1) for i in range(blocks_total // 3 + 1)]
        events = sum(len(b.events) for b in batches)

        def best(fn: Callable[[], Any], reps: int = 5) -> float:
            return min(_timed(fn) for _ in range(reps))

        full = best(functools.partial(compact, batches))
        fold = best(functools.partial(compact, batches, fold_only=True))
        out, _ = compact(batches, fold_only=True)
        encode = best(functools.partial(_encode_all, enc, out))
        print(
            f"| {events} | {events / full / 1e6:.2f} | {full / events * 1e6:.2f} | "
            f"{events / fold / 1e6:.1f} | {events / encode / 1e6:.1f} |"
        )


def _encode_all(enc: Any, batches: list[Any]) -> list[bytes]:
    return [enc.encode(b) for b in batches]


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--cpu-us", type=float, default=50.0)
    ap.add_argument("--gpu-us", type=float, default=100.0)
    ap.add_argument("--queue", type=int, default=100, help="max_queue_size for all three")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; medians reported")
    args = ap.parse_args()
    print(
        f"# kv-coalesce benchmarks\n\nmachine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, pyzmq {zmq.__version__}, "
        f"msgspec {msgspec.__version__}; stock publisher: "
        f"{'real vllm ' + __import__('vllm').__version__ if REAL_VLLM else 're-implementation'}"
    )
    print(
        f"medians of {args.repeats} runs per cell (max: the worst run); "
        "this 2-core machine is noisy (about ±30%)"
    )
    bench_compactor()
    bench_overload(args.steps, args.cpu_us, args.gpu_us, args.queue, args.repeats)


if __name__ == "__main__":
    run("publish", __doc__, main)
