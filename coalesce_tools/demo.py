"""The seed scenario, reproduced: three publishers under the same workload.

For each publisher in turn (vLLM's stock ``ZmqEventPublisher``, the upstream
drop-on-full variant, and ``coalesce``), :func:`run_publisher` starts one
engine process per DP rank (:mod:`coalesce_tools.workload`, publishing over tcp
loopback) and one subscriber process (:class:`coalesce.subscriber.Subscriber`,
with replay where the publisher offers it) that keeps an index of every
rank.  At the end the subscriber's index is compared with each engine's true
state.

Each engine step spends ``step_cpu_us`` holding the GIL (the workload model's
own work, topped up by a spin), calls ``publish()``, then waits
``step_gpu_us`` on the "GPU" with the GIL released: the only time a sender
thread can run, as in vLLM.

The bursts are sized (:func:`size_bursts`) to a fixed number of events,
:data:`BURST_EVENTS` (40% of coalesce's default event budget), and the demo
measures, on the machine it runs on, how many events vLLM's publisher drains
per engine step in this very loop, and says how many times that a burst
offers.  On these 2-core machines
the drain rate itself moves by 2-3x from one minute to the next, so sizing
the bursts to a multiple of one measurement does not keep the regime: sizing
them to the fixed bound does, as long as vLLM's publisher drains less than
a third of a burst step per step (the demo says so when it does not).

The overload is then checked, not assumed: the stock row runs first, and
while it never found its queue full the burst grows (:func:`grow_burst`:
steps twice as big, within coalesce's event budget) and the stock row runs
again; the other rows use the burst it ended with.  A run that still did not
overload it says so plainly.  With ``lockstep`` the ranks wait for each
other once per step, and the table reports the DP group's step time.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing as mp
import os
import resource
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from coalesce_tools.workload import WorkloadConfig

__all__ = [
    "KINDS",
    "PUBLISHERS",
    "PublisherResult",
    "size_bursts",
    "conclusions",
    "events_per_request",
    "run_demo",
    "run_publisher",
    "stock_capacity_per_step",
    "stock_drain_per_step",
]

PUBLISHERS = ("stock", "drop", "coalesce", "coalesce+snap")
"""``coalesce+snap`` is coalesce with opt-in snapshots (``snapshot_endpoint``): its
subscriber heals a gap with a snapshot instead of resetting the rank."""
KINDS = PUBLISHERS
"""What ``--only`` may pick."""
QUEUE = 50
"""The demo's ``max_queue_size`` for every publisher (vLLM's default is 100,000).  Small,
so that one 200-step burst overflows vLLM's queue whenever a burst step offers more than
1.5x what its sender drains per step: the seed measurement used 100, which on these
machines leaves the story to chance (see docs/benchmarks.md)."""
_BARRIER_S = 120.0
"""How long a rank waits for the others at a step boundary before the run fails (a rank
that died must not hang the demo)."""
_REAL = {"vllm": "vLLM 0.33", "sglang": "SGLang 0.5.23"}
_SAMPLE_EVERY = 10
"""The plot's resolution: each point is the worst publish() of that many steps (so no
stall falls between two points) and the backlog at the end of them."""


@dataclass
class PublisherResult:
    """One publisher's run, summed over ranks (the worst rank for latencies)."""

    publisher: str
    real_vllm: bool = False
    """The stock and drop rows ran the engine's own publisher class (vLLM's, or SGLang's
    with ``engine="sglang"``), not the re-implementation."""
    engine: str = "vllm"
    steps: int = 0
    engine_wall_s: float = 0.0
    publish_total_ms: float = 0.0
    publish_p50_us: float = 0.0
    publish_p99_us: float = 0.0
    publish_max_us: float = 0.0
    events_in: int = 0
    events_accepted: int = 0
    """Events in the batches publish() did not drop."""
    bytes_accepted: int = 0
    """Those batches' payload bytes, encoded one by one as vLLM would send them."""
    messages: int = 0
    events_on_wire: int = 0
    bytes_on_wire: int = 0
    dropped: int = 0
    blocked: int = 0
    """publish() calls that found vLLM's queue full, and so waited (stock only)."""
    step_p50_ms: float = 0.0
    """The DP group's step time (lockstep: every rank's; else the slowest rank's)."""
    step_p99_ms: float = 0.0
    step_max_ms: float = 0.0
    gaps_seen: int = 0
    replays: int = 0
    resets: int = 0
    recovered: int = 0
    """Gaps the subscriber healed with a snapshot instead of a reset (coalesce+snap)."""
    markers: int = 0
    """Loss markers the publishers sent (coalesce): each made the subscriber forget a
    rank (coalesce+snap: then heal it from a snapshot)."""
    missing: int = 0
    stale: int = 0
    silent: int = 0
    """Wrong blocks nobody can know about: stale ones on ranks where the subscriber
    saw no gap and no reset, and missing ones there unless a loss marker told it to
    forget (then it knows it may lack blocks, and it never keeps stale ones)."""
    truth_blocks: int = 0
    replayed_messages: int = 0
    """Messages the publishers re-sent to replay clients."""
    publisher_mb: float = 0.0
    """The most memory an engine process held above what it held before the publisher
    existed (the pre-built workload), in MB: the publisher's backlog and buffers."""
    timelines: list[list[tuple[float, int, float]]] = field(default_factory=list)
    """Per rank: (seconds since start, backlog in batches, worst publish() us) per
    ``_SAMPLE_EVERY`` steps."""


BURST_EVENTS = 1_600_000
"""Events one burst offers in all, spread over its steps: 40% of coalesce's default
event budget (80% of the budget before it was doubled, kept so that demo runs
compare), several times what vLLM's publisher drains in a burst on these machines."""


GROWTHS = 3
"""Times the demo doubles a burst step whose stock run did not block (the overload is
checked by the stock row itself, not assumed from the drain probe)."""
BURST_CAP = 0.8
"""A grown burst offers at most this share of coalesce's event budget in all: the
burst gets shorter as its steps get bigger (down to :data:`MIN_BURST_STEPS`)."""
MIN_BURST_STEPS = 80
"""Shortest grown burst: long enough to fill the demo's queue of :data:`QUEUE` batches."""


def grow_burst(cfg: WorkloadConfig, budget: int) -> WorkloadConfig | None:
    """The next burst to try when the stock row did not block: steps twice as big, the
    burst shorter so that it offers at most :data:`BURST_CAP` of ``budget`` events in
    all; None when no bigger burst fits."""
    per_request = events_per_request(cfg)
    requests = 2 * cfg.burst_requests
    length = min(cfg.burst_length, int(BURST_CAP * budget) // (requests * per_request))
    if length < MIN_BURST_STEPS:
        return None
    return replace(cfg, burst_requests=requests, burst_length=length)


def _stock_until_it_blocks(
    cfg: WorkloadConfig, queue: int
) -> tuple[PublisherResult, WorkloadConfig]:
    """Run the stock row; while it never blocked, grow the burst and run it again (at
    most :data:`GROWTHS` times).  The rows after it use the burst it ended with."""
    from coalesce import Settings

    stock = run_publisher("stock", cfg, queue)
    for _ in range(GROWTHS):
        if stock.blocked:
            break
        grown = grow_burst(cfg, Settings.resolve().max_pending_events)
        if grown is None:
            break
        offered = grown.burst_requests * events_per_request(grown)
        print(
            f"stock never blocked: growing the burst to {offered:,} events a step for "
            f"{grown.burst_length} steps, and running it again"
        )
        cfg = grown
        stock = run_publisher("stock", cfg, queue)
    return stock, cfg


def events_per_request(cfg: WorkloadConfig) -> int:
    """Events one burst request adds to a step once the pools are full: one chained GPU
    store plus, per block, a GPU eviction, its CPU copy and a CPU eviction."""
    return 3 * cfg.burst_blocks + 1


def _steady_bursts(cfg: WorkloadConfig, steps: int) -> list[list[Any]]:
    """``steps`` burst steps' events, after the first burst has filled the pools."""
    from coalesce_tools.workload import Engine

    engine = Engine(replace(cfg, steps=steps + 1, burst_every=1, burst_length=1), 0)
    engine.step()
    return [engine.step() for _ in range(steps)]


def size_bursts(cfg: WorkloadConfig, load: float | None = None) -> tuple[WorkloadConfig, float]:
    """Size the bursts, and measure what vLLM's publisher drains per step here.

    By default a burst step offers :data:`BURST_EVENTS` spread over the
    burst's steps: a fixed bound (40% of coalesce's default
    ``max_pending_events``).  With ``load``, ``load`` x the measured drain rate
    instead.  Returns the config and the drain rate (events per step), measured
    by :func:`stock_drain_per_step`.
    """
    cap = stock_drain_per_step(cfg)
    per_request = events_per_request(cfg)
    target = BURST_EVENTS / max(1, cfg.burst_length) if load is None else load * cap
    return replace(cfg, burst_requests=max(1, int(target // per_request))), cap


def stock_drain_per_step(cfg: WorkloadConfig, steps: int = 120) -> float:
    """Events vLLM's publisher drains per engine step, measured in the demo's own loop.

    One engine thread runs ``steps`` burst steps (``step_cpu_us`` of Python
    holding the GIL, ``publish()``, a ``step_gpu_us`` GPU wait) far above the
    sender's capacity, into a queue large enough never to block; what left
    the queue meanwhile is the drain rate.  Unlike a rate times the GPU wait,
    this counts the GIL the sender also takes from the engine's Python work at
    CPython's forced switches, which is what the demo's publishers get.
    """
    from coalesce.events import KVEventBatch
    from coalesce_tools.baselines import StockPublisher

    per_step = [cfg.split(events) for events in _steady_bursts(cfg, steps)]
    published = [len(b) for chunks in per_step for b in chunks]
    endpoint = f"inproc://drain-{os.getpid()}-{time.monotonic_ns()}"
    pub = StockPublisher(0, endpoint=endpoint, max_queue_size=len(published) + 10)
    try:
        start = time.perf_counter()
        for chunks in per_step:
            spin_until(time.perf_counter() + cfg.step_cpu_us / 1e6)
            for events in chunks:
                pub.publish(KVEventBatch(ts=0.0, events=events))
            time.sleep(cfg.step_gpu_us / 1e6)
        left = int(pub._event_queue.qsize())  # the newest batches: the queue is FIFO
        elapsed_steps = (time.perf_counter() - start) / ((cfg.step_cpu_us + cfg.step_gpu_us) / 1e6)
    finally:
        while pub._event_queue.qsize():  # vLLM's shutdown() raises on a full queue
            time.sleep(0.001)
        pub.shutdown()
    drained = sum(published[: len(published) - left])
    return drained / max(steps, elapsed_steps)


def stock_capacity_per_step(cfg: WorkloadConfig) -> float:
    """Events the stock sender's per-batch work (encode + send_multipart) covers in one GPU
    wait, measured on this machine with this workload's burst batches."""
    import msgspec
    import zmq

    from coalesce.events import KVEventBatch

    batches = [
        KVEventBatch(0.0, chunk, 0)
        for events in _steady_bursts(cfg, 60)
        for chunk in cfg.split(events)
    ]
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    sock.bind(f"inproc://capacity-{os.getpid()}-{time.monotonic_ns()}")
    enc = msgspec.msgpack.Encoder()
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        sock.send_multipart((b"", i.to_bytes(8, "big"), enc.encode(b)))
    rate = sum(len(b.events) for b in batches) / (time.perf_counter() - t0)
    sock.close(linger=0)
    t0 = time.perf_counter()
    for _ in range(200):
        time.sleep(cfg.step_gpu_us / 1e6)
    gpu_wait = (time.perf_counter() - t0) / 200
    return rate * gpu_wait


def free_ports(n: int) -> list[int]:
    """``n`` tcp ports free on the loopback now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _make_publisher(
    kind: str,
    rank: int,
    port: int,
    replay_port: int,
    queue: int,
    snap_port: int,
    engine: str = "vllm",
) -> Any:
    endpoint, replay = f"tcp://*:{port}", f"tcp://*:{replay_port}"
    if kind.startswith("coalesce"):
        from coalesce.publisher import CoalescingPublisher
        from coalesce.sglang import SGLangPublisher

        snap = f"tcp://*:{snap_port}" if kind == "coalesce+snap" else None
        return (SGLangPublisher if engine == "sglang" else CoalescingPublisher)(
            0,
            endpoint=endpoint,
            replay_endpoint=replay,
            max_queue_size=queue,
            snapshot_endpoint=snap,
        )
    from coalesce_tools.baselines import stock_publisher

    cls, real = stock_publisher(engine, drop=kind == "drop")
    kw: dict[str, Any] = {"endpoint": endpoint, "max_queue_size": queue}
    if real:
        kw["replay_endpoint"] = replay
    return cls(0, **kw)


def _batch_class(engine: str) -> Any:
    """The engine's batch struct: ``[ts, events, rank]`` on the wire for both."""
    if engine == "sglang":
        from coalesce.sglang import KVEventBatch as SGLangBatch

        return SGLangBatch
    from coalesce.events import KVEventBatch

    return KVEventBatch


def _stock_is_real(engine: str) -> bool:
    from coalesce_tools.baselines import stock_publisher

    return bool(stock_publisher(engine)[1])


def _backlog(pub: Any) -> int:
    stats = getattr(pub, "stats", None)
    if stats is not None:
        return int(stats().backlog_batches)
    return int(pub._event_queue.qsize())


def spin_until(t: float) -> None:
    while time.perf_counter() < t:
        pass


def _rss_mb() -> float:
    """This process's resident MB."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux: the peak is all we have
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _engine_main(
    kind: str,
    cfg: WorkloadConfig,
    rank: int,
    port: int,
    replay_port: int,
    snap_port: int,
    queue: int,
    heard: Any,
    progress: Any,
    release: Any,
    out: Any,
    barrier: Any = None,
) -> None:
    """One DP rank: warm up until the subscriber hears it, run the steps, report.

    With ``barrier`` (lockstep), every step starts when all ranks have finished
    the previous one, as DP ranks do; the step times it reports are then the DP
    group's."""
    import msgspec

    from coalesce.publisher import PublishOutcome
    from coalesce_tools.workload import Engine, as_engine_events, as_engine_key

    KVEventBatch = _batch_class(cfg.engine)

    # The table reports every drop; the publishers' own warnings would only land
    # in the middle of the progress line.
    logging.getLogger("coalesce").setLevel(logging.ERROR)
    engine = Engine(cfg, rank)
    # The model runs first, so that a step costs exactly step_cpu_us + step_gpu_us
    # whatever the model's own cost (bursts take it milliseconds of Python).
    steps: list[Any] = [
        cfg.split(as_engine_events(cfg.engine, engine.step())) for _ in range(cfg.steps)
    ]
    # Every publish()'s events and wire bytes, in order: the engine lets go of each
    # batch once published, as vLLM's scheduler does, so the sender frees what it sent.
    enc = msgspec.msgpack.Encoder()
    sizes = [
        (len(events), len(enc.encode(KVEventBatch(0.0, events, rank))))
        for chunks in steps
        for events in chunks
    ]
    events_in = sum(n for n, _ in sizes)
    gc.collect()
    gc.freeze()  # keep cyclic-GC pauses over those objects out of the timings
    base_mb = peak_mb = _rss_mb()
    pub = _make_publisher(kind, rank, port, replay_port, queue, snap_port, cfg.engine)
    while not heard.is_set():  # empty batches until the subscriber hears this rank
        pub.publish(KVEventBatch(ts=time.time(), events=[]))
        time.sleep(0.005)
    lat: list[int] = []
    accepted: list[bool] = []
    vllm_queue = pub._event_queue if kind == "stock" else None  # the blocking one
    blocked = 0
    timeline: list[tuple[float, int, float]] = []
    clock = time.perf_counter_ns
    worst = 0
    step_ns: list[int] = []
    if barrier is not None:
        barrier.wait(_BARRIER_S)  # every rank warmed up and heard: start together
    start = time.perf_counter()
    began = clock()
    for step in range(len(steps)):
        chunks, steps[step] = steps[step], None
        if barrier is not None:
            barrier.wait(_BARRIER_S)  # the DP group's step boundary
        now = clock()
        if step:
            step_ns.append(now - began)
        began = now
        spin_until(time.perf_counter() + cfg.step_cpu_us / 1e6)
        for events in chunks:
            dropped_before = getattr(pub, "dropped", 0)
            if vllm_queue is not None and vllm_queue.full():  # publish() will wait
                blocked += 1
            t0 = clock()
            outcome = pub.publish(KVEventBatch(ts=time.time(), events=events))
            dt = clock() - t0
            lat.append(dt)
            accepted.append(
                outcome is not PublishOutcome.DROPPED
                and getattr(pub, "dropped", 0) == dropped_before
            )
            worst = max(worst, dt)
        chunks = events = None  # (nothing published stays referenced here)
        time.sleep(cfg.step_gpu_us / 1e6)  # the GPU: the GIL is free
        if step % _SAMPLE_EVERY == _SAMPLE_EVERY - 1:
            progress.value = step + 1
            timeline.append((time.perf_counter() - start, _backlog(pub), worst / 1e3))
            peak_mb = max(peak_mb, _rss_mb())
            worst = 0
    if barrier is not None:
        barrier.wait(_BARRIER_S)  # the last step ends when every rank's does
    step_ns.append(clock() - began)
    wall = time.perf_counter() - start
    step_ns.sort()
    progress.value = cfg.steps
    if hasattr(pub, "flush"):
        pub.flush(60)
    else:  # vLLM's shutdown() raises queue.Full on a full queue: let it drain first
        deadline = time.monotonic() + 60
        while pub._event_queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.001)
    peak_mb = max(peak_mb, _rss_mb())
    kept = [size for size, ok in zip(sizes, accepted, strict=True) if ok]
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
            "events_accepted": sum(n for n, _ in kept),
            "bytes_accepted": sum(b for _, b in kept),
            "dropped": accepted.count(False),
            "markers": pub.stats().loss_markers if hasattr(pub, "stats") else 0,
            "blocked": blocked,
            "step_p50": step_ns[len(step_ns) // 2] / 1e6,
            "step_p99": step_ns[int(len(step_ns) * 0.99)] / 1e6,
            "step_max": step_ns[-1] / 1e6,
            "truth": sorted(as_engine_key(cfg.engine, k) for k in engine.truth()),
            "timeline": timeline,
            "publisher_mb": peak_mb - base_mb,
        }
    )
    # Keep the PUB socket open until the subscriber has read everything: a publisher
    # that exits drops what is still queued for a slow reader, and no gap shows it.
    release.wait(300)
    replayed = pub.stats().replay_messages if hasattr(pub, "stats") else 0
    out.put({"rank": rank, "replayed": replayed})
    pub.shutdown()


def _subscriber_main(
    endpoints: list[str],
    replays: list[str | None],
    snapshots: list[str | None],
    heard: list[Any],
    done: Any,
    out: Any,
) -> None:
    """Follow every rank until the engines are done and the stream has gone quiet."""
    from coalesce.subscriber import Subscriber

    wire = {"messages": 0, "events": 0}

    def count(src: Any, seq: int, ts: float, events: list[Any], rank: int | None) -> None:
        wire["messages"] += 1
        wire["events"] += len(events)
        heard[endpoints.index(src.endpoint)].set()

    sub = Subscriber(
        endpoints, replays, mode="refcount", on_batch=count, snapshot_endpoints=snapshots
    )
    quiet_since = time.monotonic()
    seen = 0
    while True:
        sub.poll(0.05)
        if wire["events"] != seen:  # quiet: no events (an idle publisher with snapshots
            seen = wire["events"]  # on sends an empty batch every second)
            quiet_since = time.monotonic()
        elif done.is_set() and time.monotonic() - quiet_since > 1.0:
            break
    out.put(
        {
            "states": [sorted(s.index.held()) for s in sub.sources],
            "gaps": [s.gaps for s in sub.sources],
            "replays": sum(s.replays for s in sub.sources),
            "resets": [s.resets for s in sub.sources],
            "recovered": sum(s.recovered for s in sub.sources),
            "bytes": sum(s.bytes for s in sub.sources),
            **wire,
        }
    )
    sub.close()


def run_publisher(
    kind: str, cfg: WorkloadConfig, queue: int = QUEUE, show_progress: bool = True
) -> PublisherResult:
    """Run one publisher kind under the workload; return what it did and what subscribers saw."""
    from coalesce_tools.baselines import stock_publisher

    _, real_stock = stock_publisher(cfg.engine)
    ctx = mp.get_context("spawn")
    ports = free_ports(3 * cfg.ranks)
    endpoints = [f"tcp://127.0.0.1:{ports[r]}" for r in range(cfg.ranks)]
    snapshots: list[str | None] = [
        f"tcp://127.0.0.1:{ports[2 * cfg.ranks + r]}" if kind == "coalesce+snap" else None
        for r in range(cfg.ranks)
    ]
    has_replay = kind.startswith("coalesce") or real_stock
    replays: list[str | None] = [
        f"tcp://127.0.0.1:{ports[cfg.ranks + r]}" if has_replay else None for r in range(cfg.ranks)
    ]
    heard = [ctx.Event() for _ in range(cfg.ranks)]
    done = ctx.Event()
    release = ctx.Event()
    sub_out: Any = ctx.Queue()
    eng_out: Any = ctx.Queue()
    progress = [ctx.Value("i", 0) for _ in range(cfg.ranks)]
    barrier = ctx.Barrier(cfg.ranks) if cfg.lockstep and cfg.ranks > 1 else None
    sub = ctx.Process(
        target=_subscriber_main, args=(endpoints, replays, snapshots, heard, done, sub_out)
    )
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
                ports[2 * cfg.ranks + r],
                queue,
                heard[r],
                progress[r],
                release,
                eng_out,
                barrier,
            ),
        )
        for r in range(cfg.ranks)
    ]
    for e in engines:
        e.start()
    reports: list[dict[str, Any]] = []
    tty = sys.stderr.isatty()
    started = time.monotonic()
    if show_progress and not tty:
        print(f"  {kind}: running", file=sys.stderr, flush=True)
    while len(reports) < cfg.ranks:  # first report per rank: the run itself
        try:
            reports.append(eng_out.get(timeout=0.2))
        except Exception:  # queue.Empty: show progress, check the processes
            if not any(e.is_alive() for e in engines) and eng_out.empty():
                raise RuntimeError(f"{kind}: an engine process died") from None
        if show_progress and tty:
            frac = sum(p.value for p in progress) / (cfg.steps * cfg.ranks)
            bar = "#" * int(frac * 30)
            print(f"\r  {kind:<9} [{bar:<30}] {frac:4.0%}", end="", file=sys.stderr, flush=True)
    done.set()
    subscriber = sub_out.get(timeout=300)
    release.set()
    replayed = sum(eng_out.get(timeout=60)["replayed"] for _ in range(cfg.ranks))
    for p in [*engines, sub]:
        p.join(30)
    if show_progress:  # on a terminal this ends the bar's line
        took = time.monotonic() - started
        done_line = f" {took:.0f} s" if tty else f"  {kind}: done in {took:.0f} s"
        print(done_line, file=sys.stderr, flush=True)
    reports.sort(key=lambda r: r["rank"])
    res = PublisherResult(
        publisher=kind,
        real_vllm=real_stock and not kind.startswith("coalesce"),
        engine=cfg.engine,
        steps=cfg.steps,
    )
    for r in reports:
        rank = r["rank"]
        truth = {tuple(k) for k in r["truth"]}
        held = {tuple(k) for k in subscriber["states"][rank]}
        res.missing += len(truth - held)
        res.stale += len(held - truth)
        if not subscriber["gaps"][rank] and not subscriber["resets"][rank]:
            res.silent += len(held - truth)  # the subscriber has no reason to doubt it
            if not r["markers"]:  # (after a marker it knows it forgot)
                res.silent += len(truth - held)
        res.markers += r["markers"]
        res.truth_blocks += len(truth)
        res.engine_wall_s = max(res.engine_wall_s, r["wall"])
        res.publish_total_ms += r["lat_total_ms"]
        res.publish_p50_us = max(res.publish_p50_us, r["p50"])
        res.publish_p99_us = max(res.publish_p99_us, r["p99"])
        res.publish_max_us = max(res.publish_max_us, r["max"])
        res.events_in += r["events_in"]
        res.events_accepted += r["events_accepted"]
        res.bytes_accepted += r["bytes_accepted"]
        res.dropped += r["dropped"]
        res.blocked += r["blocked"]
        res.step_p50_ms = max(res.step_p50_ms, r["step_p50"])
        res.step_p99_ms = max(res.step_p99_ms, r["step_p99"])
        res.step_max_ms = max(res.step_max_ms, r["step_max"])
        res.publisher_mb = max(res.publisher_mb, r["publisher_mb"])
        res.timelines.append([(float(t), int(b), float(us)) for t, b, us in r["timeline"]])
    res.messages = subscriber["messages"]
    res.events_on_wire = subscriber["events"]
    res.bytes_on_wire = subscriber["bytes"]
    res.gaps_seen = sum(subscriber["gaps"])
    res.replays = subscriber["replays"]
    res.resets = sum(subscriber["resets"])
    res.recovered = subscriber["recovered"]
    res.replayed_messages = replayed
    return res


_COLUMNS = (
    ("publisher", ""),
    ("engine s", "the slowest rank's engine loop, seconds (lower is better)"),
    ("stall ms", "time spent inside publish(), all ranks (vLLM's blocks on its full queue)"),
    ("worst ms", "the slowest single publish() call"),
    ("step p50", "the DP group's step time, ms (lockstep: the slowest rank sets it)"),
    ("step p99", "its 99th percentile, ms"),
    ("step max", "its worst step, ms"),
    ("p99 us", "99th percentile of publish(), worst rank"),
    ("messages", "messages the subscriber received"),
    ("MB", "payload MB the subscriber received"),
    ("events", "events received / events in the batches publish() accepted (compaction)"),
    ("bytes", "bytes received / the same accepted batches encoded one by one (compaction)"),
    ("dropped", "batches publish() dropped"),
    ("blocked", "publish() calls that found vLLM's queue full and waited (stock only)"),
    ("gaps", "sequence gaps the subscriber saw"),
    ("resets", "times the subscriber reset a rank's index (it knew it was wrong)"),
    ("recovered", "gaps the subscriber healed with a snapshot instead (coalesce+snap)"),
    ("markers", "loss markers sent (coalesce): by default each is followed by the rank's state"),
    ("missing", "blocks an engine holds that the subscriber lacks, at the end"),
    ("stale", "blocks the subscriber holds that no engine holds, at the end"),
    ("silent", "stale, and missing with no marker, on ranks with no gap or reset: unknown"),
    ("pub MB", "memory an engine process added once its publisher existed, replay buffer included"),
)


def _table(results: list[PublisherResult]) -> str:
    """The results as an aligned table with a legend under it."""
    rows = []
    for r in results:
        events = r.events_on_wire / r.events_accepted if r.events_accepted else 0.0
        size = r.bytes_on_wire / r.bytes_accepted if r.bytes_accepted else 0.0
        rows.append(
            (
                r.publisher + (f" ({_REAL[r.engine]})" if r.real_vllm else ""),
                f"{r.engine_wall_s:.2f}",
                f"{r.publish_total_ms:.1f}",
                f"{r.publish_max_us / 1e3:.2f}",
                f"{r.step_p50_ms:.2f}",
                f"{r.step_p99_ms:.2f}",
                f"{r.step_max_ms:.1f}",
                f"{r.publish_p99_us:.1f}",
                f"{r.messages:,}",
                f"{r.bytes_on_wire / 1e6:.1f}",
                f"{events:.2f}",
                f"{size:.2f}",
                f"{r.dropped:,}",
                f"{r.blocked:,}",
                f"{r.gaps_seen}",
                f"{r.resets}",
                f"{r.recovered}",
                f"{r.markers}",
                f"{r.missing:,}",
                f"{r.stale:,}",
                f"{r.silent:,}",
                f"{r.publisher_mb:.0f}",
            )
        )
    head = [name for name, _ in _COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.append("")
    lines += [f"  {name:<9} {doc}" for name, doc in _COLUMNS if doc]
    return "\n".join(lines)


def conclusions(results: list[PublisherResult]) -> list[str]:
    """What the run shows, one line per publisher, in words: which publisher blocks the
    engine, which loses data silently, which loses nothing.  Blocking is told by its
    cause (vLLM's queue was full when publish() was called), not by latency: on a
    loaded 2-core machine any publisher's call can wait for the GIL or the OS."""
    out = []
    for r in results:
        p99 = f"p99 publish() {r.publish_p99_us:,.0f} us"
        if r.blocked:
            what = (
                f"blocked the engine: {r.blocked:,} publish() calls found its queue full "
                f"({r.publish_total_ms:.0f} ms inside publish() in all, worst call "
                f"{r.publish_max_us / 1e3:.1f} ms)"
            )
        elif r.publisher == "stock":
            what = f"its queue never filled, so it did not block ({p99})"
        else:
            what = f"never waits on a full queue ({p99})"
        if r.silent:
            loss = (
                f"lost {r.dropped:,} batches with no gap: the subscriber ended with "
                f"{r.silent:,} wrong blocks it cannot know about"
            )
        elif r.dropped and not (r.missing or r.stale):
            how = (
                "healed from snapshots"
                if r.recovered or r.publisher.endswith("+snap")
                else "forgot the rank and refilled"
            )
            loss = (
                f"dropped {r.dropped:,} batches, every loss told ({r.markers} loss markers, "
                f"{r.gaps_seen} gaps), and its subscriber {how}: it ended with every "
                "engine's true state"
            )
        elif r.dropped and r.markers and not r.stale:
            loss = (
                f"dropped {r.dropped:,} batches, each loss told by a loss marker: the "
                f"subscriber forgot that rank and refilled ({r.missing:,} blocks missing at "
                "the end, none stale)"
            )
        elif r.dropped or r.missing or r.stale:
            loss = (
                f"lost {r.dropped:,} batches, every loss visible "
                f"({r.gaps_seen} gaps, {r.resets} resets, no silent divergence)"
            )
        else:
            loss = "lost nothing: the subscriber ended with every engine's true state"
        out.append(f"{r.publisher}: {what}; {loss}.")
    stock = next((r for r in results if r.publisher == "stock"), None)
    ours = next((r for r in results if r.publisher == "coalesce"), None)
    if stock is not None and not stock.blocked:
        out.append(
            "NOTE: this run did not overload the stock publisher (it never blocked), so it "
            "is not the seed scenario: raise --load (or --burst-requests with --no-sizing)."
        )
    elif stock is not None and ours is not None:
        out.append(
            f"DP group step time, p99: stock {stock.step_p99_ms:.2f} ms, coalesce "
            f"{ours.step_p99_ms:.2f} ms (worst step {stock.step_max_ms:.1f} ms and "
            f"{ours.step_max_ms:.1f} ms)"
        )
    return out


def _plot(results: list[PublisherResult], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    styles = ("-", "--", ":", "-.")
    for n, r in enumerate(results):
        color = f"C{n}"
        for rank, timeline in enumerate(r.timelines):
            t = [x[0] for x in timeline]
            worst = max((x[2] for x in timeline), default=0.0)
            ls = styles[rank % len(styles)]
            ax1.plot(
                t, [x[1] for x in timeline], ls, color=color, label=f"{r.publisher} rank {rank}"
            )
            ax2.plot(
                t,
                [x[2] for x in timeline],
                ls,
                color=color,
                label=f"{r.publisher} rank {rank}: worst {worst / 1e3:.1f} ms",
            )
    ax1.set_ylabel("backlog (batches)")
    ax2.set_ylabel(f"worst publish() of {_SAMPLE_EVERY} steps (us)")
    ax2.set_yscale("log")
    ax2.set_xlabel("seconds since the run started (every rank)")
    ax1.legend(fontsize=7, ncol=len(results))
    ax2.legend(fontsize=7, ncol=len(results))
    ax1.set_title(
        "kv-coalesce demo: the same workload, three publishers\n"
        f"each point: the worst publish() of {_SAMPLE_EVERY} steps, the backlog after them",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_demo(
    cfg: WorkloadConfig,
    queue: int = QUEUE,
    outdir: str = "results",
    publishers: tuple[str, ...] = PUBLISHERS,
    size: bool = True,
    load: float | None = None,
) -> list[PublisherResult]:
    """Size the bursts (:func:`size_bursts`, unless ``size`` is False), run every
    publisher, print the table and what it shows, write JSON (and a PNG)."""
    from coalesce_tools.host import describe, host

    machine = host(cfg.engine)
    print(describe(machine))
    cap = None
    if size:
        cfg, cap = size_bursts(cfg, load)
    print(
        f"kv-coalesce demo: {cfg.ranks} DP ranks x {cfg.steps} steps "
        f"({cfg.step_cpu_us:.0f} us CPU + {cfg.step_gpu_us:.0f} us GPU wait per step), "
        f"bursts of {cfg.burst_requests} x {cfg.burst_blocks}-block prompts for "
        f"{cfg.burst_length} steps every {cfg.burst_every}, max_queue_size={queue}"
    )
    if cfg.ranks > 1:
        print(
            "DP lockstep: "
            + (
                "on (ranks wait for each other every step, as DP ranks do)"
                if cfg.lockstep
                else f"off (independent ranks; {os.cpu_count()} cores run {cfg.ranks} ranks' "
                "engines and senders and the subscriber only by turns, and in lockstep every "
                "publisher then keeps up by slowing the group: --lockstep on to see it)"
            )
        )
    if cap is not None:
        offered = cfg.burst_requests * events_per_request(cfg)
        print(
            f"a burst step offers {offered:,} events: {offered / cap:.1f}x what vLLM's "
            f"publisher drains per step on this machine now ({cap:,.0f}, measured)"
        )
        if offered < 3 * cap:
            print(
                "note: vLLM's publisher drains more than a third of a burst step per step "
                "here; its queue may not fill, so the stock and drop rows may show no stall "
                "or loss"
            )
    if cfg.engine == "sglang":
        print(
            "engine: SGLang's structs and its stock publisher "
            + ("(the real class)" if _stock_is_real(cfg.engine) else "(re-implemented)")
            + "; the burst sizing probe uses vLLM's, the same queue-and-thread design"
        )
        if "coalesce+snap" in publishers:
            print("coalesce+snap: skipped (snapshots are not available for SGLang)")
            publishers = tuple(p for p in publishers if p != "coalesce+snap")
    results: list[PublisherResult] = []
    if size and publishers and publishers[0] == "stock":
        stock, cfg = _stock_until_it_blocks(cfg, queue)
        results.append(stock)
        publishers = publishers[1:]
    results += [run_publisher(kind, cfg, queue) for kind in publishers]
    print(_table(results))
    print()
    for line in conclusions(results):
        print(line)
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "demo.json")
    with open(path, "w") as f:
        json.dump(
            {
                "host": machine,
                "config": asdict(cfg),
                "burst_events_per_step": cfg.burst_requests * events_per_request(cfg),
                "max_queue_size": queue,
                "load": load,
                "lockstep": cfg.lockstep and cfg.ranks > 1,
                "engine": cfg.engine,
                "stock_drain_events_per_step": cap,
                "results": [asdict(r) for r in results],
                "conclusions": conclusions(results),
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
