"""Command line: ``coalesce demo`` and ``coalesce subscribe``.

The demo drives a :class:`~coalesce.CoalescingPublisher` with an offload-like
workload (GPU stores, GPU evictions, CPU copies) in two phases: a steady phase
where the engine waits on a simulated GPU between steps (the GIL is released,
the sender keeps up and sends 1:1), then a burst with no waits at all (the
sender falls behind and compacts).  A real subscriber on another thread
decodes the stream and keeps a reference index; at the end the demo prints
the publisher's stats, the ``publish()`` latency, and whether the
subscriber's index equals what the uncompacted stream would have produced.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from coalesce import BlockRemoved, BlockStored, CoalescingPublisher, KVEventBatch
from coalesce.refmodel import SubscriberModel


def _store(h: int, parent: int | None, medium: str, block: int) -> BlockStored:
    return BlockStored([h], parent, list(range(block)), block, None, medium, None)


def offload_step(i: int, lag: int = 64, block: int = 16) -> KVEventBatch:
    """One engine step: store a new GPU block; evict an old one and copy it to CPU."""
    events: list[Any] = [_store(i + 1, i or None, "GPU", block)]
    if i >= lag:
        old = i - lag + 1
        events.append(BlockRemoved([old], "GPU"))
        events.append(_store(old, (old - 1) or None, "CPU", block))
    return KVEventBatch(ts=time.time(), events=events)


def _percentile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000.0


def demo(steps: int, burst: int, gpu_wait: float) -> int:
    endpoint = f"inproc://coalesce-demo-{os.getpid()}"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)  # inproc: connected before the publisher binds, nothing is missed
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    seen = SubscriberModel("llmd")
    seqs: list[int] = []
    stop = threading.Event()

    def subscriber() -> None:
        while not stop.is_set() or sub.poll(0):
            if sub.poll(20):
                _topic, seq, payload = sub.recv_multipart()
                seqs.append(int.from_bytes(seq, "big"))
                seen.apply_batches([decoder.decode(payload)])

    reader = threading.Thread(target=subscriber, name="demo-subscriber")
    reader.start()
    truth = SubscriberModel("llmd")
    latencies: list[int] = []
    pub = CoalescingPublisher(endpoint=endpoint)
    clock = time.perf_counter_ns
    print(
        f"kv-coalesce demo: {steps} steady steps ({gpu_wait * 1e3:.1f} ms GPU wait), "
        f"then a burst of {burst} steps with no wait"
    )
    for i in range(steps + burst):
        batch = offload_step(i)
        truth.apply_batches([batch])
        t0 = clock()
        pub.publish(batch)
        latencies.append(clock() - t0)
        if i < steps:
            time.sleep(gpu_wait)  # the engine waits on the GPU: the GIL is free
    pub.shutdown()
    stop.set()
    reader.join()
    sub.close()

    st = pub.stats()
    lat = sorted(latencies)
    gaps = sum(1 for a, b in itertools.pairwise(seqs) if b != a + 1)
    rows = [
        ("batches published", f"{st.batches_in:,}"),
        ("events published", f"{st.events_in:,}"),
        ("messages sent", f"{st.messages_sent:,}"),
        ("events sent", f"{st.events_sent:,}"),
        ("payload bytes sent", f"{st.bytes_sent:,}"),
        ("batches folded", f"{st.batches_folded:,}"),
        ("events merged away", f"{st.events_merged:,}"),
        ("compaction passes", f"{st.compaction_passes:,}"),
        ("backlog peak (batches)", f"{st.backlog_peak:,}"),
        ("batches dropped", f"{st.batches_dropped:,}"),
        ("sequence gaps seen", f"{gaps}"),
        (
            "publish() p50 / p99 / max",
            f"{_percentile(lat, 0.5):.1f} / {_percentile(lat, 0.99):.1f} / {lat[-1] / 1000:.1f} us",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    exact = seen.state() == truth.state()
    print(
        f"  {'subscriber index == truth':<{width}}  {'yes' if exact else 'NO'} "
        f"({len(truth.state()):,} blocks held)"
    )
    return 0 if exact or st.batches_dropped else 1


def subscribe(
    endpoints: list[str], replays: list[str], topic: str, as_json: bool, seconds: float | None
) -> int:
    """Follow publishers; print live counters (or JSON lines); a summary on Ctrl-C."""
    from coalesce.subscriber import Source, Subscriber

    if replays and len(replays) != len(endpoints):
        raise SystemExit("--replay must be given once per ENDPOINT, or not at all")
    reps: list[str | None] = list(replays) if replays else [None] * len(endpoints)

    def print_batch(src: Source, seq: int, ts: float, events: list[Any], rank: int | None) -> None:
        line = {
            "source": src.endpoint,
            "seq": seq,
            "ts": ts,
            "rank": rank,
            "events": [msgspec.to_builtins(e) for e in events],
        }
        print(msgspec.json.encode(line).decode(), flush=True)

    sub = Subscriber(endpoints, reps, topic=topic, on_batch=print_batch if as_json else None)
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        while deadline is None or time.monotonic() < deadline:
            sub.poll(0.2)
            if not as_json:
                s = sub.summary()
                kinds = " ".join(f"{k}={v}" for k, v in sorted(s["events"].items()))
                print(
                    f"\rmessages={s['messages']} {kinds} gaps={s['gaps']} "
                    f"replays={s['replays']} resets={s['resets']} "
                    f"index={s['index_size']}   ",
                    end="",
                    flush=True,
                )
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    print("" if as_json else "\n", end="")
    print(msgspec.json.encode({"summary": sub.summary()}).decode(), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coalesce", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="publish an offload workload with a burst; show the stats")
    d.add_argument("--steps", type=int, default=2000, help="steady steps (default 2000)")
    d.add_argument("--burst", type=int, default=20000, help="burst steps (default 20000)")
    d.add_argument("--gpu-wait", type=float, default=0.0005, help="seconds per steady step")
    s = sub.add_parser("subscribe", help="follow publishers: live counters, or JSON lines")
    s.add_argument("endpoint", nargs="+", help="PUB endpoint(s), e.g. tcp://127.0.0.1:5557")
    s.add_argument("--replay", action="append", default=[], help="replay endpoint, per ENDPOINT")
    s.add_argument("--topic", default="", help="topic prefix to subscribe to")
    s.add_argument("--json", action="store_true", help="one JSON line per batch")
    s.add_argument("--seconds", type=float, default=None, help="stop after this long")
    args = parser.parse_args(argv)
    if args.command == "subscribe":
        return subscribe(args.endpoint, args.replay, args.topic, args.json, args.seconds)
    if args.steps < 0 or args.burst < 0 or args.steps + args.burst == 0:
        parser.error("--steps and --burst must be >= 0 and not both 0")
    return demo(args.steps, args.burst, args.gpu_wait)


if __name__ == "__main__":
    sys.exit(main())
