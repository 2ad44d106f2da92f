"""SGLang: publish() cost and drain time, SGLang 0.5.23's own publisher against coalesce's.

Needs the real sglang wheel (``make test-sglang`` builds ``.venv-sglang``)::

    .venv-sglang/bin/python benchmarks/bench_sglang.py

Workload: SGLang's CPU offload as its structs carry it, each batch a step's
worth of GPU removals and CPU_PINNED stores down a chain, with a tenant's
``cache_salt`` and signed 64-bit hashes (SGLang's are).  Two measures, with
the engine idle and a SUB reading everything in a process of its own
(benchmarks/_reader.py):

* *publish*: the engine's time inside ``publish()`` per call, the whole window
  published at once (queues large enough never to block);
* *drain*: from the first ``publish()`` until the last message has left the
  sender (``flush()`` for coalesce; SGLang's queue empty and its last seq sent).

``coalesce`` runs with the default settings (the recorder on, for
``loss_marker=resync``); ``coalesce, clear`` without the recorder.
Publishers alternate, ``--repeats`` times; medians.  "encode" is msgspec
encoding every batch once, the floor of any sender that sends them all.
Results: printed, and written to ``benchmarks/results/sglang.<cores>-core.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import msgspec
from sglang.srt.disaggregation import kv_events as sk

sys.path.insert(0, os.path.dirname(__file__))
from _reader import start_reader, stop_reader

from coalesce.sglang import SGLangPublisher
from coalesce_tools.results import header, recording

TOKENS = list(range(16))


def window(batches: int, per_batch: int) -> list[sk.KVEventBatch]:
    out = []
    h = -(2**62)
    for step in range(batches):
        events: list[Any] = []
        for i in range(per_batch // 2):
            events.append(sk.BlockRemoved(block_hashes=[h], medium="GPU"))
            events.append(
                sk.BlockStored(
                    block_hashes=[h],
                    parent_block_hash=h - 1 if i else None,
                    token_ids=TOKENS,
                    block_size=16,
                    lora_id=None,
                    medium="CPU_PINNED",
                    cache_salt="tenant-a",
                )
            )
            h += 1
        out.append(sk.KVEventBatch(ts=float(step), events=events))
    return out


def _sglang_sent(pub: Any, n: int) -> bool:
    return pub._event_queue.unfinished_tasks == 0 and pub._buffer and pub._buffer[-1][0] == n - 1


def run_once(kind: str, batches: list[Any], port: int) -> tuple[float, float]:
    """(seconds inside publish(), seconds until all sent) for one publisher."""
    ep = f"tcp://127.0.0.1:{port}"
    if kind == "sglang":
        pub: Any = sk.ZmqEventPublisher(
            attn_dp_rank=0, endpoint=ep, bind=True, max_queue_size=len(batches) + 1
        )
    else:
        pub = SGLangPublisher(
            endpoint=ep,
            bind=True,
            max_queue_size=len(batches) + 1,
            loss_marker="clear" if kind == "coalesce, clear" else None,
        )
    reader = start_reader(ep)
    try:
        batches = [msgspec.structs.replace(b) for b in batches]
        gc.collect()
        inside = 0.0
        start = time.perf_counter()
        for b in batches:
            t = time.perf_counter()
            pub.publish(b)
            inside += time.perf_counter() - t
        if kind == "sglang":
            while not _sglang_sent(pub, len(batches)):
                time.sleep(0.0005)
        else:
            assert pub.flush(120)
        return inside, time.perf_counter() - start
    finally:
        pub.shutdown()
        stop_reader(reader)


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, default=4000)
    ap.add_argument("--events", type=int, default=120, help="events per batch")
    args = ap.parse_args()
    from importlib.metadata import version

    batches = window(args.batches, args.events)
    n_events = sum(len(b.events) for b in batches)
    enc = msgspec.msgpack.Encoder()
    t = time.perf_counter()
    for b in batches:
        enc.encode(b)
    encode_s = time.perf_counter() - t
    kinds = ("sglang", "coalesce", "coalesce, clear")
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    port = 27000 + os.getpid() % 2000
    for r in range(args.repeats):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            port += 1
            runs[kind].append(run_once(kind, batches, port))

    def med(kind: str, i: int) -> float:
        return statistics.median(x[i] for x in runs[kind])

    rows = {
        kind: {
            "publish_us_per_call": 1e6 * med(kind, 0) / len(batches),
            "drain_s": med(kind, 1),
            "drain_events_per_s": n_events / med(kind, 1),
        }
        for kind in runs
    }
    figures = {
        "sglang": version("sglang"),
        "batches": len(batches),
        "events": n_events,
        "repeats": args.repeats,
        "encode_s": encode_s,
        "publishers": rows,
        "drain_ratio": rows["sglang"]["drain_s"] / rows["coalesce"]["drain_s"],
        "drain_ratio_clear": rows["sglang"]["drain_s"] / rows["coalesce, clear"]["drain_s"],
    }
    print(f"SGLang {figures['sglang']}: {len(batches)} batches, {n_events} events; medians")
    header("publisher", "publish() µs/call", "drain s", "events/s")
    for kind, row in rows.items():
        print(
            f"| {kind} | {row['publish_us_per_call']:.2f} | {row['drain_s']:.3f} | "
            f"{row['drain_events_per_s']:,.0f} |"
        )
    print(
        f"encode every batch once: {encode_s:.3f} s; drain: {figures['drain_ratio']:.2f}x "
        f"(coalesce, clear: {figures['drain_ratio_clear']:.2f}x)"
    )
    return figures


if __name__ == "__main__":
    with recording("sglang", __doc__ or "", engine="sglang") as result:
        result.update(main())
