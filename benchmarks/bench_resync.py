"""What an in-band resync costs the sender (``loss_marker="resync"``), side by side
with encoding the batches that built the same state.

A publisher with ``loss_marker="resync"`` is fed ``--blocks`` blocks as chains of
64 blocks of 16 tokens (one store a batch, the engine's shape for a long
prompt), every batch sent; then one batch is refused (the sender held, the
hand-off full). The clock runs from the sender's release (the backlog collapses
into the recorded state, then the loss marker and the state go out) until the
resync has gone out whole; a SUB in this process is connected
(inproc) but not read, so sends cost what they cost with a subscriber. Per
block: that time; beside it, encoding every batch that built the state once
(msgspec, what sending them 1:1 encodes). The longest step is the longest
chunk: the time between two sends of the resync, the most the sender holds
the GIL for it at once. Medians of ``--rounds`` rounds; one JSON line of
results at the end, with the host.

    .venv/bin/python benchmarks/bench_resync.py [--blocks 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import msgspec
import zmq

from coalesce import BlockStored, CoalescingPublisher, KVEventBatch, PublishOutcome
from coalesce.testing import held, tapped
from coalesce_tools.host import host
from coalesce_tools.results import recording

CHAIN, TOKENS = 64, 16


def chains(blocks: int) -> list[KVEventBatch]:
    out = []
    for start in range(0, blocks, CHAIN):
        hashes = list(range(start + 1, min(start + CHAIN, blocks) + 1))
        ev = BlockStored(hashes, None, [7] * (TOKENS * len(hashes)), TOKENS, None, "GPU", None)
        out.append(KVEventBatch(ts=float(start), events=[ev], data_parallel_rank=0))
    return out


def one_round(blocks: int, name: str) -> dict[str, float]:
    ep = f"inproc://bench-resync-{name}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(ep)
    sends: list[float] = []
    with tapped(lambda topic, seq, payload: sends.append(time.perf_counter())):
        pub = CoalescingPublisher(
            endpoint=ep,
            hwm=0,
            max_queue_size=1,
            stall_timeout=0,
            loss_marker="resync",
            snapshot_max_blocks=max(blocks, 1_000_000),
        )
    try:
        for b in chains(blocks):  # every one sent: nothing lost yet
            assert pub.publish(b) is PublishOutcome.QUEUED
            assert pub.flush(10.0)
        with held(pub):
            assert pub.publish(KVEventBatch(0.0, [])) is PublishOutcome.QUEUED
            assert pub.publish(KVEventBatch(0.0, [])) is PublishOutcome.DROPPED
            sends.clear()
            t0 = time.perf_counter()  # released: the backlog collapses, the marker, the state
        deadline = time.monotonic() + 120.0
        while pub.stats().resyncs == 0:
            assert time.monotonic() < deadline, "the resync did not end"
            time.sleep(0.001)
        st = pub.stats()
        steps = [b - a for a, b in zip([t0, *sends], sends, strict=False)]
        return {
            "ns_per_block": (sends[-1] - t0) / blocks * 1e9,
            "longest_step_ms": max(steps) * 1e3,
            "resync_events": st.resync_events,
            "messages": len(sends),
        }
    finally:
        pub.shutdown()
        sub.close(linger=0)


def encode_ns_per_block(blocks: int) -> float:
    enc = msgspec.msgpack.Encoder()
    batches = chains(blocks)
    t0 = time.perf_counter()
    for b in batches:
        enc.encode(b)
    return (time.perf_counter() - t0) / blocks * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rounds: list[dict[str, float]] = []
    encode: list[float] = []
    for r in range(args.rounds):
        rounds.append(one_round(args.blocks, str(r)))
        encode.append(encode_ns_per_block(args.blocks))

    def med(key: str) -> float:
        return statistics.median(x[key] for x in rounds)

    result: dict[str, Any] = {
        "bench": "resync",
        "host": host(),
        "blocks": args.blocks,
        "rounds": args.rounds,
        "resync_ns_per_block": round(med("ns_per_block")),
        "encode_ns_per_block": round(statistics.median(encode)),
        "longest_step_ms": round(med("longest_step_ms"), 2),
        "resync_events": med("resync_events"),
        "messages": med("messages"),
    }
    print(
        f"| {args.blocks:,} blocks | resync {result['resync_ns_per_block']} ns/block | "
        f"encode {result['encode_ns_per_block']} ns/block | longest step "
        f"{result['longest_step_ms']} ms | {int(result['messages'])} messages |"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    with recording("resync", __doc__ or ""):
        status = main()
    sys.exit(status)
