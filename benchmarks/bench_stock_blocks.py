"""Where vLLM's own publisher blocks inside vLLM's own scheduler, on this host.

One rank of vLLM 0.33's real scheduler, KV cache manager and eager CPU offload
manager (``coalesce_tools.vllm_engine``), publishing through vLLM's unchanged
``ZmqEventPublisher`` (built by its ``EventPublisherFactory``) over tcp
loopback to a SUB in another process that reads everything (RCVHWM 0).  Swept:
requests in flight (``concurrency``), shared prefix length, and
``max_queue_size`` (the seed's 100,000, and smaller).  For each run:
``publish()`` calls that found the queue full (the engine thread then blocks
in ``Queue.put`` until the sender takes a batch: the seed's hang), the time
spent inside ``publish()`` (p99, max, total), and the engine's run time.
Nothing is tuned to make it block: the grid is fixed before the run.

    .venv-vllm/bin/python benchmarks/bench_stock_blocks.py
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

from coalesce_tools.results import header, recording, row

GRID_CONCURRENCY = (64, 256)
GRID_PREFIX = (2048, 8192)
GRID_QUEUE = (100_000, 100, 10)


def _reader(port: int, stop: Any, got: Any) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    n = 0
    while not stop.is_set():
        if sock.poll(50):
            while True:
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                n += 1
    got.value = n
    sock.close(0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one(concurrency: int, prefix: int, queue: int) -> dict[str, Any]:
    from coalesce_tools.vllm_engine import EngineConfig, VllmEngine, use_publisher

    cfg = EngineConfig(
        requests=2 * concurrency,
        concurrency=concurrency,
        prefixes=16,
        prefix_tokens=prefix,
        unique_tokens=40,
        max_tokens=8,
        gpu_blocks=1500 if prefix <= 2048 else 4000,
        cpu_blocks=2000 if prefix <= 2048 else 5000,
        max_num_seqs=concurrency,
        max_num_batched_tokens=4096,
    )
    port = _port()
    ctx = mp.get_context("spawn")
    stop, got = ctx.Event(), ctx.Value("q", 0)
    reader = ctx.Process(target=_reader, args=(port, stop, got), daemon=True)
    reader.start()
    with use_publisher("stock"):
        eng = VllmEngine(cfg, f"tcp://*:{port}", max_queue_size=queue)
    time.sleep(0.5)  # the reader's connection (a PUB drops what no one reads yet)
    t0 = time.perf_counter()
    eng.run()
    run_s = time.perf_counter() - t0
    pub = eng.publisher
    deadline = time.monotonic() + 60
    while pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    drained_s = time.perf_counter() - t0
    eng.shutdown()
    stop.set()
    reader.join(30)
    p = sorted(eng.publish_seconds)
    return {
        "concurrency": concurrency,
        "prefix_tokens": prefix,
        "max_queue_size": queue,
        "steps": eng.steps,
        "batches": len(p),
        "found_full": eng.found_full,
        "publish_p99_us": round(p[int(0.99 * len(p))] * 1e6, 1) if p else 0,
        "publish_max_us": round(p[-1] * 1e6, 1) if p else 0,
        "publish_total_ms": round(sum(p) * 1e3, 1),
        "run_s": round(run_s, 2),
        "drained_s": round(drained_s, 2),
        "received": got.value,
    }


def main(figures: dict[str, Any]) -> None:
    from coalesce_tools.vllm_engine import EngineConfig, VllmEngine

    VllmEngine(EngineConfig(requests=16), "inproc://warm", publisher="null").run()
    print("# vLLM's ZmqEventPublisher inside vLLM's scheduler (eager offload), one rank\n")
    header(
        "in flight",
        "prefix tokens",
        "max_queue_size",
        "steps",
        "batches",
        "queue full at publish()",
        "publish() p99 / max µs",
        "in publish() ms",
        "run s",
        "received",
    )
    runs = []
    for conc in GRID_CONCURRENCY:
        for prefix in GRID_PREFIX:
            for queue in GRID_QUEUE:
                r = one(conc, prefix, queue)
                runs.append(r)
                row(
                    conc,
                    prefix,
                    queue,
                    r["steps"],
                    r["batches"],
                    r["found_full"],
                    f"{r['publish_p99_us']} / {r['publish_max_us']}",
                    r["publish_total_ms"],
                    r["run_s"],
                    r["received"],
                )
    figures["runs"] = runs


if __name__ == "__main__":
    with recording("stock_blocks", __doc__ or "") as fig:
        main(fig)
