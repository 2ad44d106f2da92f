"""The seed scenario, reproduced: three publishers under the same workload.

For each publisher in turn (vLLM's stock ``ZmqEventPublisher``, the upstream
drop-on-full variant, and ``coalesce``), :func:`run_publisher` starts one
engine process per DP rank (:mod:`coalesce.workload`, publishing over tcp
loopback) and one subscriber process (:class:`coalesce.subscriber.Subscriber`,
with replay where the publisher offers it) that keeps an index of every
rank.  At the end the subscriber's index is compared with each engine's true
state.

Each engine step spends ``step_cpu_us`` holding the GIL (the workload model's
own work, topped up by a spin), calls ``publish()``, then waits
``step_gpu_us`` on the "GPU" with the GIL released: the only time a sender
thread can run, as in vLLM.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import resource
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from coalesce.workload import WorkloadConfig

__all__ = ["PUBLISHERS", "PublisherResult", "run_demo", "run_publisher"]

PUBLISHERS = ("stock", "drop", "coalesce")
_SAMPLE_EVERY = 10


@dataclass
class PublisherResult:
    """One publisher's run, summed over ranks (lists: per sampled step, rank 0)."""

    publisher: str
    real_vllm: bool = False
    steps: int = 0
    engine_wall_s: float = 0.0
    publish_total_ms: float = 0.0
    publish_p50_us: float = 0.0
    publish_p99_us: float = 0.0
    publish_max_us: float = 0.0
    events_in: int = 0
    messages: int = 0
    events_on_wire: int = 0
    bytes_on_wire: int = 0
    dropped: int = 0
    gaps_seen: int = 0
    replays: int = 0
    resets: int = 0
    missing: int = 0
    stale: int = 0
    silent: int = 0
    """Missing + stale blocks on sources the subscriber believes complete (no reset)."""
    truth_blocks: int = 0
    replayed_messages: int = 0
    """Messages the publishers re-sent to replay clients (coalesce only)."""
    peak_rss_mb: float = 0.0
    timeline: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds since start, backlog in batches, publish() us) for rank 0."""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _make_publisher(kind: str, rank: int, port: int, replay_port: int, queue: int) -> Any:
    endpoint, replay = f"tcp://*:{port}", f"tcp://*:{replay_port}"
    if kind == "coalesce":
        from coalesce.publisher import CoalescingPublisher

        return CoalescingPublisher(
            0, endpoint=endpoint, replay_endpoint=replay, max_queue_size=queue
        )
    from coalesce._baselines import REAL_VLLM, DropPublisher, StockPublisher

    cls = StockPublisher if kind == "stock" else DropPublisher
    kw: dict[str, Any] = {"endpoint": endpoint, "max_queue_size": queue}
    if REAL_VLLM:
        kw["replay_endpoint"] = replay
    return cls(0, **kw)


def _backlog(pub: Any) -> int:
    stats = getattr(pub, "stats", None)
    if stats is not None:
        return int(stats().backlog_batches)
    return int(pub._event_queue.qsize())


def _spin_until(t: float) -> None:
    while time.perf_counter() < t:
        pass


def _engine_main(
    kind: str,
    cfg: WorkloadConfig,
    rank: int,
    port: int,
    replay_port: int,
    queue: int,
    heard: Any,
    progress: Any,
    release: Any,
    out: Any,
) -> None:
    """One DP rank: warm up until the subscriber hears it, run the steps, report."""
    from coalesce.events import KVEventBatch
    from coalesce.workload import Engine

    engine = Engine(cfg, rank)
    # The model runs first, so that a step costs exactly step_cpu_us + step_gpu_us
    # whatever the model's own cost (bursts take it milliseconds of Python).
    steps = [engine.step() for _ in range(cfg.steps)]
    events_in = sum(map(len, steps))
    gc.collect()
    gc.freeze()  # keep cyclic-GC pauses over those objects out of the timings
    pub = _make_publisher(kind, rank, port, replay_port, queue)
    while not heard.is_set():  # empty batches until the subscriber hears this rank
        pub.publish(KVEventBatch(ts=time.time(), events=[]))
        time.sleep(0.005)
    lat: list[int] = []
    timeline: list[tuple[float, int, float]] = []
    clock = time.perf_counter_ns
    start = time.perf_counter()
    for step, events in enumerate(steps):
        _spin_until(time.perf_counter() + cfg.step_cpu_us / 1e6)
        t0 = clock()
        pub.publish(KVEventBatch(ts=time.time(), events=events))
        dt = clock() - t0
        lat.append(dt)
        time.sleep(cfg.step_gpu_us / 1e6)  # the GPU: the GIL is free
        if step % _SAMPLE_EVERY == 0:
            progress.value = step + 1
            if rank == 0:
                timeline.append((time.perf_counter() - start, _backlog(pub), dt / 1e3))
    wall = time.perf_counter() - start
    progress.value = cfg.steps
    dropped = int(getattr(pub, "dropped", 0))
    if hasattr(pub, "flush"):
        pub.flush(60)
        dropped = pub.stats().batches_dropped
    else:  # vLLM's shutdown() raises queue.Full on a full queue: let it drain first
        deadline = time.monotonic() + 60
        while pub._event_queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.001)
    lat.sort()
    out.put(
        {
            "rank": rank,
            "wall": wall,
            "lat_total_ms": sum(lat) / 1e6,
            "p50": lat[len(lat) // 2] / 1e3,
            "p99": lat[int(len(lat) * 0.99)] / 1e3,
            "max": lat[-1] / 1e3,
            "events_in": events_in,
            "dropped": dropped,
            "truth": sorted(engine.truth()),
            "timeline": timeline,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )
    # Keep the PUB socket open until the subscriber has read everything: a publisher
    # that exits drops what is still queued for a slow reader, and no gap shows it.
    release.wait(300)
    replayed = pub.stats().replay_messages if hasattr(pub, "stats") else 0
    out.put({"rank": rank, "replayed": replayed})
    pub.shutdown()


def _subscriber_main(
    endpoints: list[str], replays: list[str | None], heard: list[Any], done: Any, out: Any
) -> None:
    """Follow every rank until the engines are done and the stream has gone quiet."""
    from coalesce.subscriber import Subscriber

    wire = {"messages": 0, "events": 0}

    def count(src: Any, seq: int, ts: float, events: list[Any], rank: int | None) -> None:
        wire["messages"] += 1
        wire["events"] += len(events)
        heard[endpoints.index(src.endpoint)].set()

    sub = Subscriber(endpoints, replays, mode="refcount", on_batch=count)
    quiet_since = time.monotonic()
    while True:
        n = sub.poll(0.05)
        if n:
            quiet_since = time.monotonic()
        elif done.is_set() and time.monotonic() - quiet_since > 1.0:
            break
    out.put(
        {
            "states": [sorted(s.index.held()) for s in sub.sources],
            "gaps": sum(s.gaps for s in sub.sources),
            "replays": sum(s.replays for s in sub.sources),
            "resets": sum(s.resets for s in sub.sources),
            "partial": [s.partial for s in sub.sources],
            "bytes": sum(s.bytes for s in sub.sources),
            **wire,
        }
    )
    sub.close()


def run_publisher(
    kind: str, cfg: WorkloadConfig, queue: int = 100, show_progress: bool = True
) -> PublisherResult:
    """Run one publisher kind under the workload; return what it did and what subscribers saw."""
    from coalesce._baselines import REAL_VLLM

    ctx = mp.get_context("spawn")
    ports = _free_ports(2 * cfg.ranks)
    endpoints = [f"tcp://127.0.0.1:{ports[r]}" for r in range(cfg.ranks)]
    has_replay = kind == "coalesce" or REAL_VLLM
    replays: list[str | None] = [
        f"tcp://127.0.0.1:{ports[cfg.ranks + r]}" if has_replay else None for r in range(cfg.ranks)
    ]
    heard = [ctx.Event() for _ in range(cfg.ranks)]
    done = ctx.Event()
    release = ctx.Event()
    sub_out: Any = ctx.Queue()
    eng_out: Any = ctx.Queue()
    progress = [ctx.Value("i", 0) for _ in range(cfg.ranks)]
    sub = ctx.Process(target=_subscriber_main, args=(endpoints, replays, heard, done, sub_out))
    sub.start()
    engines = [
        ctx.Process(
            target=_engine_main,
            args=(
                kind,
                cfg,
                r,
                ports[r],
                ports[cfg.ranks + r],
                queue,
                heard[r],
                progress[r],
                release,
                eng_out,
            ),
        )
        for r in range(cfg.ranks)
    ]
    for e in engines:
        e.start()
    reports: list[dict[str, Any]] = []
    while len(reports) < cfg.ranks:  # first report per rank: the run itself
        try:
            reports.append(eng_out.get(timeout=0.2))
        except Exception:  # queue.Empty: show progress, check the processes
            if not any(e.is_alive() for e in engines) and eng_out.empty():
                raise RuntimeError(f"{kind}: an engine process died") from None
        if show_progress:
            frac = sum(p.value for p in progress) / (cfg.steps * cfg.ranks)
            bar = "#" * int(frac * 30)
            print(f"\r  {kind:<9} [{bar:<30}] {frac:4.0%}", end="", file=sys.stderr, flush=True)
    done.set()
    subscriber = sub_out.get(timeout=300)
    release.set()
    replayed = sum(eng_out.get(timeout=60)["replayed"] for _ in range(cfg.ranks))
    for p in [*engines, sub]:
        p.join(30)
    if show_progress:
        print(file=sys.stderr)
    reports.sort(key=lambda r: r["rank"])
    res = PublisherResult(
        publisher=kind, real_vllm=REAL_VLLM and kind != "coalesce", steps=cfg.steps
    )
    for r in reports:
        truth = {tuple(k) for k in r["truth"]}
        held = {tuple(k) for k in subscriber["states"][r["rank"]]}
        res.missing += len(truth - held)
        res.stale += len(held - truth)
        if not subscriber["partial"][r["rank"]]:
            res.silent += len(truth ^ held)
        res.truth_blocks += len(truth)
        res.engine_wall_s = max(res.engine_wall_s, r["wall"])
        res.publish_total_ms += r["lat_total_ms"]
        res.publish_p50_us = max(res.publish_p50_us, r["p50"])
        res.publish_p99_us = max(res.publish_p99_us, r["p99"])
        res.publish_max_us = max(res.publish_max_us, r["max"])
        res.events_in += r["events_in"]
        res.dropped += r["dropped"]
        res.peak_rss_mb = max(res.peak_rss_mb, r["rss_mb"])
    res.timeline = [(float(t), int(b), float(us)) for t, b, us in reports[0]["timeline"]]
    res.messages = subscriber["messages"]
    res.events_on_wire = subscriber["events"]
    res.bytes_on_wire = subscriber["bytes"]
    res.gaps_seen = subscriber["gaps"]
    res.replays = subscriber["replays"]
    res.resets = subscriber["resets"]
    res.replayed_messages = replayed
    return res


def _table(results: list[PublisherResult]) -> str:
    head = (
        "publisher",
        "publish total ms",
        "worst publish ms",
        "p50 us",
        "p99 us",
        "messages",
        "events",
        "MB",
        "compaction",
        "dropped",
        "gaps seen",
        "resets",
        "missing",
        "stale",
        "silent",
        "peak RSS MB",
    )
    rows = []
    for r in results:
        ratio = r.events_in / r.events_on_wire if r.events_on_wire else 0.0
        name = r.publisher + (" (vLLM 0.33)" if r.real_vllm else "")
        rows.append(
            (
                name,
                f"{r.publish_total_ms:.1f}",
                f"{r.publish_max_us / 1e3:.2f}",
                f"{r.publish_p50_us:.1f}",
                f"{r.publish_p99_us:.1f}",
                f"{r.messages:,}",
                f"{r.events_on_wire:,}",
                f"{r.bytes_on_wire / 1e6:.1f}",
                f"{ratio:.2f}x",
                f"{r.dropped:,}",
                f"{r.gaps_seen}",
                f"{r.resets}",
                f"{r.missing:,}",
                f"{r.stale:,}",
                f"{r.silent:,}",
                f"{r.peak_rss_mb:.0f}",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _plot(results: list[PublisherResult], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in results:
        t = [x[0] for x in r.timeline]
        ax1.plot(t, [x[1] for x in r.timeline], label=r.publisher)
        ax2.plot(t, [x[2] for x in r.timeline], label=r.publisher)
    ax1.set_ylabel("backlog (batches)")
    ax2.set_ylabel("publish() (us)")
    ax2.set_yscale("log")
    ax2.set_xlabel("seconds (rank 0)")
    ax1.legend()
    ax1.set_title("kv-coalesce demo: same workload, three publishers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_demo(
    cfg: WorkloadConfig,
    queue: int = 100,
    outdir: str = "results",
    publishers: tuple[str, ...] = PUBLISHERS,
) -> list[PublisherResult]:
    """Run every publisher, print the table, write JSON (and a PNG with matplotlib)."""
    print(
        f"kv-coalesce demo: {cfg.ranks} DP ranks x {cfg.steps} steps "
        f"({cfg.step_cpu_us:.0f} us CPU + {cfg.step_gpu_us:.0f} us GPU wait per step), "
        f"bursts of {cfg.burst_requests} x {cfg.burst_blocks}-block prompts every "
        f"{cfg.burst_every} steps, max_queue_size={queue}"
    )
    results = [run_publisher(kind, cfg, queue) for kind in publishers]
    print(_table(results))
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "demo.json")
    with open(path, "w") as f:
        json.dump(
            {
                "config": asdict(cfg),
                "max_queue_size": queue,
                "results": [asdict(r) for r in results],
            },
            f,
            indent=1,
        )
    print(f"raw results: {path}")
    png = os.path.join(outdir, "demo.png")
    if _plot(results, png):
        print(f"plot: {png}")
    else:
        print("plot: skipped (pip install 'kv-coalesce[plot]' for matplotlib)")
    return results
