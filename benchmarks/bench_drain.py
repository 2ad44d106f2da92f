"""Drain capacity: events per second each sender sends with the engine idle.

The engine publishes a whole window of batches at once (into a queue large
enough never to block) and then waits; the time until the last one has left
the sender is the drain time.  The workloads: big offload batches (about 110
events, as bench_publish builds them), many small ones (about 20 events:
"thousands of EventBatch objects in one shot" in the upstream report), and
8,000 seed-like batches (the workload model's bursts of long prompts, cut into
batches of at most 120 events, about 117 on average: the run issue 39 reported
as a user would make it), and, with vLLM installed, the stream of vLLM's own
scheduler (bench_realstream's eager run, repeated to about 1.2 M events).
With vLLM installed every batch is vLLM's own class.  A real SUB socket is
connected and read by a process of its own (benchmarks/_reader.py), so sends
cost what they cost with a subscriber.
Publishers alternate; medians of ``--repeats`` runs, each about 1.3 M events
(shorter runs, a fraction of a second, vary by 2x on this machine).  Wire
bytes are over what encoding every batch gives; CPU is the engine's
process's (every thread; the reader is a process of its own); "raw encode"
is the CPU of encoding every batch once, in the same run.  Every publisher
binds tcp loopback, and the reader is connected before the clock starts.
``coalesce`` runs with the default settings, so it records every batch for an
in-band resync after a loss (``loss_marker="resync"``); ``coalesce, clear``
runs without that recorder (``loss_marker="clear"``): what the recorder costs
the drain.  ``coalesce, 1:1`` runs with ``compaction=False`` (every batch
encoded and sent as published, the recorder still on): the last two columns
say whether compaction pays for itself, its drain rate and the engine's CPU
with compaction over those without.  The last column is the CPU of the Python
threads each publisher started (its sender: what holds the GIL the engine
wants), per event published (``benchmarks/_threads.py``, Linux only); zmq's I/O
thread, which sends the bytes without the GIL, is not in it.

    .venv-vllm/bin/python benchmarks/bench_drain.py   # against the real vLLM class
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec

sys.path.insert(0, os.path.dirname(__file__))
from _reader import start_reader, stop_reader
from _threads import cpu_seconds, started_by
from bench_compact import seed_batches
from bench_publish import make_batch

from coalesce import CoalescingPublisher
from coalesce_tools.baselines import REAL_VLLM, StockPublisher
from coalesce_tools.results import header, row, run

_ENC = msgspec.msgpack.Encoder()


def seed_like(n: int, most: int = 120) -> list[Any]:
    """``n`` batches of the workload model's seed bursts, each step cut into batches
    of at most ``most`` events; vLLM's own classes when it is installed (decoded
    from the encoding, which is the same bytes)."""
    steps = seed_batches(True, 1000)
    cut = [b.events[i : i + most] for b in steps for i in range(0, len(b.events), most)]
    assert len(cut) >= n, f"the model made {len(cut)} batches, not {n}"
    batches = [msgspec.structs.replace(steps[0], events=evs) for evs in cut[:n]]
    if not REAL_VLLM:
        return batches
    from vllm.distributed import kv_events as vk

    decode = msgspec.msgpack.Decoder(vk.KVEventBatch).decode
    return [decode(_ENC.encode(b)) for b in batches]


def vllm_stream(events: int = 1_200_000) -> list[Any]:
    """vLLM's own stream (``bench_realstream``: its scheduler, KV cache manager and
    CPU offload manager, eager offload, one seeded run, its batches as published),
    repeated until it holds ``events``.  Only with vLLM installed."""
    from bench_realstream import record

    batches, _ = record("eager")
    per = sum(len(b.events) for b in batches)
    return batches * max(1, events // per)


@dataclass
class Drain:
    seconds: float
    wire_bytes: float
    cpu: float  # the engine's process, every thread
    sender_cpu: float  # the Python threads the publisher started (its sender)


def drain_once(kind: str, batches: list[Any]) -> Drain:
    """Seconds from the first publish() until every batch has left the sender, the
    payload bytes sent (stock: those of encoding every batch), and the CPU spent."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://*:{port}"
    big = 10 * len(batches)
    pub: Any
    if kind == "stock":
        pub, senders = started_by(
            lambda: StockPublisher(0, endpoint=endpoint, max_queue_size=big, hwm=0)
        )
    else:
        pub, senders = started_by(
            lambda: CoalescingPublisher(
                0,
                endpoint=endpoint,
                max_queue_size=big,
                hwm=0,
                max_pending_events=100 * big,  # everything is published at once
                loss_marker="clear" if kind == "coalesce, clear" else None,
                compaction=kind != "coalesce, 1:1",
            )
        )
    reader = start_reader(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # (not timed) the reader's subscription reaches the PUB
    for b in batches:
        b.data_parallel_rank = None
    scpu0 = cpu_seconds(senders)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for b in batches:
        pub.publish(b)
    if kind == "stock":  # the queue is empty once the sender took the last batch;
        while pub._event_queue.qsize():  # its send follows within one encode
            time.sleep(0.0005)
    else:
        assert pub.flush(120)
    dt = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    sender_cpu = cpu_seconds(senders) - scpu0
    if kind != "stock":
        st = pub.stats()
        assert st.batches_dropped == 0
        nbytes = float(st.bytes_sent)
    else:
        nbytes = float(sum(len(_ENC.encode(b)) for b in batches))
    pub.shutdown()
    stop_reader(reader)
    return Drain(dt, nbytes, cpu, sender_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(
        f"# drain capacity\n\nmachine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; stock publisher: "
        f"{'real vLLM' if REAL_VLLM else 're-implementation'}; engine idle; medians of "
        f"{args.repeats} alternating runs\n"
    )
    header(
        "workload",
        "batches",
        "events",
        "stock Mev/s",
        "coalesce / stock",
        "coalesce, clear / stock",
        "wire bytes vs stock",
        "engine CPU vs stock",
        "engine CPU vs raw encode",
        "compaction on / 1:1: rate",
        "compaction on / 1:1: CPU",
        "sender thread ns/event: stock / coalesce / 1:1",
    )
    kinds = ("stock", "coalesce", "coalesce, clear", "coalesce, 1:1")
    workloads = (
        ("big (~110 events)", lambda: [make_batch(i, 37) for i in range(12_000)]),
        ("small (~20 events)", lambda: [make_batch(i, 7) for i in range(60_000)]),
        ("seed-like (~117 events)", lambda: seed_like(8_000)),
    )
    if REAL_VLLM:  # the stream of vLLM's own scheduler
        workloads += (("vLLM's scheduler, eager offload", vllm_stream),)
    for name, make in workloads:
        batches = make()
        n = len(batches)
        events = sum(len(b.events) for b in batches)
        runs: dict[str, list[Drain]] = {k: [] for k in kinds}
        encode: list[float] = []  # CPU seconds to encode every batch once, as it is
        for _ in range(args.repeats):
            for kind in kinds:
                runs[kind].append(drain_once(kind, batches))
            t0 = time.process_time()
            for b in batches:
                _ENC.encode(b)
            encode.append(time.process_time() - t0)

        def med(kind: str, what: str, runs: dict[str, list[Drain]] = runs) -> float:
            return statistics.median(getattr(d, what) for d in runs[kind])

        rate = {k: events / med(k, "seconds") / 1e6 for k in kinds}
        cpu = {k: med(k, "cpu") / med("stock", "cpu") for k in kinds}
        wire = {k: runs[k][-1].wire_bytes / runs["stock"][-1].wire_bytes for k in kinds}
        over_encode = med("coalesce", "cpu") / statistics.median(encode)
        ratio = rate["coalesce"] / rate["stock"]
        row(
            name,
            f"{n:,}",
            f"{events:,}",
            f"{rate['stock']:.2f}",
            f"{ratio:.2f}",
            f"{rate['coalesce, clear'] / rate['stock']:.2f}",
            f"{wire['coalesce']:.2f}",
            f"{cpu['coalesce']:.2f}",
            f"{over_encode:.2f}",
            f"{ratio / (rate['coalesce, 1:1'] / rate['stock']):.2f}",
            f"{med('coalesce', 'cpu') / med('coalesce, 1:1', 'cpu'):.2f}",
            " / ".join(
                f"{med(k, 'sender_cpu') / events * 1e9:.0f}"
                for k in ("stock", "coalesce", "coalesce, 1:1")
            ),
        )


if __name__ == "__main__":
    run("drain", __doc__, main)
