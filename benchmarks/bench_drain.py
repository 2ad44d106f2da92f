"""Drain capacity: events per second each sender sends with the engine idle.

The engine publishes a whole window of batches at once (into a queue large
enough never to block) and then waits; the time until the last one has left
the sender is the drain time.  Two workloads: big offload batches (about 110
events, as bench_publish builds them) and many small ones (about 20 events:
"thousands of EventBatch objects in one shot" in the upstream report).  A
real SUB socket is connected and read by a thread, so sends cost what they
cost with a subscriber.  Publishers alternate; medians of ``--repeats`` runs.
``coalesce, payload rules`` is coalesce with the opt-in ``payload_rules``;
wire bytes are over what encoding every batch gives.

    .venv-vllm/bin/python benchmarks/bench_drain.py   # against the real vLLM class
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

sys.path.insert(0, os.path.dirname(__file__))
from bench_publish import make_batch

from coalesce import CoalescingPublisher
from coalesce._baselines import REAL_VLLM, StockPublisher

_n = [0]
PAYLOAD = "coalesce, payload rules"
_ENC = msgspec.msgpack.Encoder()


def _reader(endpoint: str, stop: threading.Event) -> threading.Thread:
    """A SUB that reads and discards, so the PUB has a real peer."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)

    def run() -> None:
        while not stop.is_set():
            if sub.poll(20):
                while True:
                    try:
                        sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
        sub.close(linger=0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def drain_once(kind: str, batches: list[Any]) -> tuple[float, float]:
    """Seconds from the first publish() until every batch has left the sender, and
    the payload bytes sent (stock: those of encoding every batch)."""
    _n[0] += 1
    endpoint = f"inproc://drain-{os.getpid()}-{_n[0]}"
    stop = threading.Event()
    big = 10 * len(batches)
    pub: Any
    if kind == "stock":
        pub = StockPublisher(0, endpoint=endpoint, max_queue_size=big, hwm=0)
    else:
        pub = CoalescingPublisher(
            0, endpoint=endpoint, max_queue_size=big, hwm=0, payload_rules=kind == PAYLOAD
        )
    reader = _reader(endpoint, stop)
    for b in batches:
        b.data_parallel_rank = None
    t0 = time.perf_counter()
    for b in batches:
        pub.publish(b)
    if kind == "stock":  # the queue is empty once the sender took the last batch;
        while pub._event_queue.qsize():  # its send follows within one encode
            time.sleep(0.0005)
    else:
        assert pub.flush(120)
    dt = time.perf_counter() - t0
    if kind != "stock":
        st = pub.stats()
        assert st.batches_dropped == 0
        nbytes = float(st.bytes_sent)
    else:
        nbytes = float(sum(len(_ENC.encode(b)) for b in batches))
    pub.shutdown()
    stop.set()
    reader.join(5)
    return dt, nbytes


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
    print(
        "| workload | batches | events | stock Mev/s | coalesce Mev/s | coalesce / stock "
        "| payload rules / stock | wire bytes | payload rules' wire bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, blocks, n in (("big (~110 events)", 37, 4000), ("small (~20 events)", 7, 20000)):
        batches = [make_batch(i, blocks) for i in range(n)]
        events = sum(len(b.events) for b in batches)
        kinds = ("stock", "coalesce", PAYLOAD)
        runs: dict[str, list[float]] = {k: [] for k in kinds}
        wire: dict[str, float] = {}
        for _ in range(args.repeats):
            for kind in runs:
                dt, nbytes = drain_once(kind, batches)
                runs[kind].append(dt)
                wire[kind] = nbytes
        rate = {k: events / statistics.median(v) / 1e6 for k, v in runs.items()}
        stock, ours, pay = rate["stock"], rate["coalesce"], rate[PAYLOAD]
        print(
            f"| {name} | {n:,} | {events:,} | {stock:.2f} | {ours:.2f} | {ours / stock:.2f} "
            f"| {pay / stock:.2f} | {wire['coalesce'] / wire['stock']:.2f} "
            f"| {wire[PAYLOAD] / wire['stock']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
