"""``coalesce demo --scheduler``: the demo on vLLM's own scheduler as the producer.

Each DP rank is a process running :class:`coalesce_tools.vllm_engine.VllmEngine`
(vLLM 0.33's real ``Scheduler``, ``KVCacheManager`` and, by default, the eager
``SimpleCPUOffloadConnector`` scheduler side; fake model runner and offload
worker), with its publisher built by vLLM's ``EventPublisherFactory``.  The rows,
in turn, on the same seeded workload:

- ``stock``: vLLM's ``ZmqEventPublisher``, unchanged;
- ``drop``: vLLM's publisher with the upstream drop-on-full proposal (PR #53883);
- ``coalesce``: the coalesce plugin, swapped in by vLLM's plugin loader;
- ``coalesce+snap``: the same with ``COALESCE_SNAPSHOT_ENDPOINT`` set.

One :class:`coalesce.subscriber.Subscriber` (refcount index, replay where the
publisher serves it, snapshots for ``coalesce+snap``) follows every rank over
tcp loopback while the engines run.  At the end each rank's index is compared
with what that rank's GPU and CPU pools hold (per medium, with how many blocks
hold each hash).  With ``lockstep`` (several ranks) the ranks wait for each other
once per step, as DP ranks do, and a rank's step time includes that wait.

The rank processes import vLLM once and run every row (a row builds a new
engine and publisher), so a row costs the engine's run, not vLLM's import.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_mod
import random
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ROWS", "RowResult", "run_scheduler_demo"]

ROWS = ("stock", "drop", "coalesce", "coalesce+snap")
_WAIT_S = 60.0


@dataclass
class RowResult:
    """One row: what the engines did and what the subscriber ended with."""

    publisher: str
    ranks: int
    steps: int = 0
    batches: int = 0
    events: int = 0
    run_s: float = 0.0
    step_ms_median: float = 0.0
    step_ms_p99: float = 0.0
    step_ms_max: float = 0.0
    publish_us_p99: float = 0.0
    publish_us_max: float = 0.0
    publish_s_total: float = 0.0
    dropped: int = 0
    found_full: int = 0
    """publish() calls that found the bounded queue full (stock blocks there)."""
    messages: int = 0
    wire_bytes: int = 0
    exact_ranks: int = 0
    missing: int = 0
    stale: int = 0
    count_differs: int = 0
    resets: int = 0
    gaps: int = 0
    per_medium: dict[str, dict[str, int]] = field(default_factory=dict)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def _rank_main(rank: int, tasks: Any, results: Any, barrier: Any, flags: Any) -> None:
    """A DP rank: for each task (a row), build the engine, run it, report, wait, shut down.
    An error is reported to the parent (with its traceback) and breaks the barrier, so
    that the other ranks stop at once instead of waiting it out."""
    try:
        _rank_loop(rank, tasks, results, barrier, flags)
    except BaseException:
        import traceback

        results.put({"rank": rank, "error": traceback.format_exc()})
        if barrier is not None:
            barrier.abort()
        raise


def _rank_loop(rank: int, tasks: Any, results: Any, barrier: Any, flags: Any) -> None:
    from coalesce_tools.vllm_engine import EngineConfig, VllmEngine, use_publisher

    # warm-up: vLLM's first steps in a process run code paths for the first time
    VllmEngine(EngineConfig(requests=16), "inproc://warm", publisher="null").run()
    while True:
        task = tasks.get()
        if task is None:
            return
        kind, cfg_dict, ports, queue = task
        cfg = EngineConfig(**cfg_dict)
        pub_kind = "coalesce" if kind.startswith("coalesce") else kind
        if kind == "coalesce+snap":
            os.environ["COALESCE_SNAPSHOT_ENDPOINT"] = f"tcp://*:{ports['snap'] + rank}"
        else:
            os.environ.pop("COALESCE_SNAPSHOT_ENDPOINT", None)
        with use_publisher(pub_kind):
            eng = VllmEngine(
                cfg,
                f"tcp://*:{ports['pub']}",
                replay_endpoint=f"tcp://*:{ports['replay']}",
                max_queue_size=queue,
                dp_index=rank,
            )
        pub = eng.publisher
        probes = _until_heard(pub, tasks)
        t0 = time.perf_counter()
        step_s: list[float] = []
        busy = True
        while busy:
            t = time.perf_counter()
            if eng.busy():
                eng.step()
            busy = eng.busy()
            if barrier is not None:  # lockstep: every rank steps until every rank is done
                flags[rank] = int(busy)
                barrier.wait(_WAIT_S)
                busy = any(flags[:])
                barrier.wait(_WAIT_S)  # nobody writes the next step's flag before all read
            step_s.append(time.perf_counter() - t)
        run_s = time.perf_counter() - t0
        if pub_kind == "coalesce":
            pub.flush(_WAIT_S)
            st = pub.stats()
            dropped, messages = st.batches_dropped, st.messages_sent
        else:
            deadline = time.monotonic() + _WAIT_S
            while pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.01)
            dropped = int(getattr(pub, "dropped", 0))
            messages = probes + len(eng.publish_seconds) - dropped
        truth = eng.truth()
        results.put(
            {
                "rank": rank,
                "steps": eng.steps,
                "batches": len(eng.publish_seconds),
                "run_s": run_s,
                "step_s": step_s,
                "publish_s": list(eng.publish_seconds),
                "dropped": dropped,
                "found_full": eng.found_full,
                "messages": messages,
                "truth": [[list(k), n] for k, n in truth.items()],
            }
        )
        tasks.get(timeout=_WAIT_S)  # the subscriber is done with replay and snapshots
        eng.shutdown()


def _until_heard(pub: Any, tasks: Any) -> int:
    """Publish empty batches (not timed, not the scheduler's) until the parent says the
    subscriber heard this rank: a PUB drops what is sent before a SUB's subscription
    arrives, and a subscriber that never hears a rank cannot ask it for a replay.  The
    probes are ordinary empty batches, seq 0 onwards; how many were published."""
    from vllm.distributed.kv_events import KVEventBatch

    deadline = time.monotonic() + _WAIT_S
    n = 0
    while time.monotonic() < deadline:
        type(pub).publish(pub, KVEventBatch(ts=time.time(), events=[]))
        n += 1
        try:
            if tasks.get(timeout=0.02) == "go":
                return n
        except queue_mod.Empty:
            pass
    raise RuntimeError("the subscriber never heard this rank")


def _key(k: Any) -> tuple[Any, Any, Any]:
    return (k[0], k[1], k[2])


def run_row(
    kind: str,
    cfg: Any,
    ranks: int,
    queue: int,
    tasks: list[Any],
    results: Any,
    procs: list[Any],
) -> RowResult:
    from coalesce.subscriber import Subscriber

    # each kind's ports: base + rank (vLLM's tcp rule)
    first = _free_span(3 * ranks)
    ports = {"pub": first, "replay": first + ranks, "snap": first + 2 * ranks}
    eps = [f"tcp://127.0.0.1:{ports['pub'] + r}" for r in range(ranks)]
    reps: list[str | None] = [f"tcp://127.0.0.1:{ports['replay'] + r}" for r in range(ranks)]
    snaps: list[str | None] = [
        f"tcp://127.0.0.1:{ports['snap'] + r}" if kind == "coalesce+snap" else None
        for r in range(ranks)
    ]
    sub = Subscriber(eps, reps, mode="refcount", snapshot_endpoints=snaps, rcvhwm=0)
    for q in tasks:
        q.put((kind, cfg.as_dict(), ports, queue))
    heard_by = time.monotonic() + _WAIT_S
    while not all(src.messages for src in sub.sources):
        sub.poll(0.02)
        if time.monotonic() > heard_by or not all(p.is_alive() for p in procs):
            raise RuntimeError("the subscriber did not hear every rank")
    for q in tasks:
        q.put("go")
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 600
    while len(got) < ranks:
        sub.poll(0.02)
        while not results.empty():
            r = results.get()
            if "error" in r:
                raise RuntimeError(f"rank {r['rank']} failed:\n{r['error']}")
            got[r["rank"]] = r
        if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
            raise RuntimeError("a rank process died, or the engines did not finish in 600 s")
    # the subscriber catches up to each rank's last message (bounded)
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        sub.poll(0.05)
        if all(
            (-1 if src.last_seq is None else src.last_seq) >= got[r]["messages"] - 1
            for r, src in enumerate(sub.sources)
        ):
            break
    sub.poll(0.2)
    for q in tasks:
        q.put("finish")
    res = RowResult(kind, ranks)
    for r in range(ranks):
        g = got[r]
        res.steps = max(res.steps, g["steps"])
        res.batches += g["batches"]
        res.run_s = max(res.run_s, g["run_s"])
        res.dropped += g["dropped"]
        res.found_full += g["found_full"]
        res.messages += g["messages"]
    steps = [s for r in range(ranks) for s in got[r]["step_s"]]
    pubs = [s for r in range(ranks) for s in got[r]["publish_s"]]
    res.step_ms_median = round(statistics.median(steps) * 1e3, 3) if steps else 0.0
    res.step_ms_p99 = round(_pct(steps, 0.99) * 1e3, 3)
    res.step_ms_max = round(max(steps, default=0.0) * 1e3, 3)
    res.publish_us_p99 = round(_pct(pubs, 0.99) * 1e6, 1)
    res.publish_us_max = round(max(pubs, default=0.0) * 1e6, 1)
    res.publish_s_total = round(sum(pubs), 4)
    for r, src in enumerate(sub.sources):
        truth = {_key(k): n for k, n in got[r]["truth"]}
        held = src.index.state()
        res.missing += sum(1 for k in truth if k not in held)
        res.stale += sum(1 for k in held if k not in truth)
        res.count_differs += sum(1 for k in held if k in truth and held[k] != truth[k])
        res.exact_ranks += int(held == truth)
        res.resets += src.resets
        res.gaps += src.gaps
        res.wire_bytes += src.bytes
        res.events += sum(src.events.values())
        for medium in sorted({str(k[0]) for k in truth} | {str(k[0]) for k in held}):
            t = {k for k in truth if k[0] == medium}
            h = {k for k in held if k[0] == medium}
            pm = res.per_medium.setdefault(medium, {"pools": 0, "missing": 0, "stale": 0})
            pm["pools"] += len(t)
            pm["missing"] += len(t - h)
            pm["stale"] += len(h - t)
    sub.close()
    return res


def _ephemeral_low() -> int:
    """The first port the OS picks for outgoing connections (Linux's default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_span(width: int, tries: int = 200) -> int:
    """The first of ``width`` consecutive tcp ports, each free now on every interface, below
    the range the OS picks outgoing connections' ports from: the subscriber connects
    before the ranks bind, and an OS-picked port could be one of a rank's."""
    top = min(_ephemeral_low(), 65536) - width
    for _ in range(tries):
        first = random.randrange(10_000, max(top, 10_001))
        socks = []
        try:
            for port in range(first, first + width):
                s = socket.socket()
                socks.append(s)
                s.bind(("", port))  # as the ranks bind: every interface
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {width} consecutive free tcp ports found")


def table(rows: list[RowResult]) -> str:
    head = (
        "| publisher | steps | run s | step ms median / p99 / max | publish() p99 / max µs "
        "| queue full at publish | dropped batches | messages | wire MB | subscriber vs pools |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        verdict = (
            f"exact ({r.ranks}/{r.ranks} ranks)"
            if r.exact_ranks == r.ranks
            else f"missing {r.missing}, stale {r.stale}, count differs {r.count_differs}"
            f" (resets {r.resets}, gaps {r.gaps})"
        )
        lines.append(
            f"| {r.publisher} | {r.steps} | {r.run_s:.2f} | {r.step_ms_median} / {r.step_ms_p99}"
            f" / {r.step_ms_max} | {r.publish_us_p99} / {r.publish_us_max} | {r.found_full} "
            f"| {r.dropped} "
            f"| {r.messages} | {r.wire_bytes / 1e6:.2f} | {verdict} |"
        )
    return head + "\n".join(lines) + "\n"


def run_scheduler_demo(
    cfg: Any = None,
    ranks: int = 1,
    queue: int = 100_000,
    rows: tuple[str, ...] = ROWS,
    lockstep: bool = True,
    outdir: str | None = "results",
) -> list[RowResult]:
    """Run every row on vLLM's scheduler; print the table; write ``demo-vllm.json``."""
    from coalesce_tools.vllm_engine import seed_like

    if cfg is None:
        cfg = seed_like()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(ranks) if lockstep and ranks > 1 else None
    flags = ctx.Array("b", ranks)
    tasks = [ctx.Queue() for _ in range(ranks)]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, tasks[r], results, barrier, flags), daemon=True)
        for r in range(ranks)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    print(
        f"# vLLM's own scheduler as the producer: {ranks} rank(s), offload {cfg.offload}, "
        f"max_queue_size {queue}, lockstep {'on' if barrier is not None else 'off'}\n"
        f"# workload: {cfg.requests} requests, {cfg.concurrency} in flight, {cfg.prefixes} "
        f"shared prefixes of {cfg.prefix_tokens} tokens; GPU {cfg.gpu_blocks} blocks, "
        f"CPU {cfg.cpu_blocks}; store completes {cfg.store_latency} step(s) after issue; "
        f"a {cfg.gpu_ms:g} ms forward pass a step (GIL released)",
        flush=True,
    )
    out: list[RowResult] = []
    try:
        for kind in rows:
            r = run_row(kind, cfg, ranks, queue, tasks, results, procs)
            out.append(r)
            print(f"  {kind}: done ({r.run_s:.1f} s engine run)", flush=True)
    finally:
        for q in tasks:
            q.put(None)
        for p in procs:
            p.join(30)
    took = time.perf_counter() - t0
    print()
    print(table(out))
    stock = next((r for r in out if r.publisher == "stock"), None)
    if stock is not None:
        print(
            f"stock spent {stock.publish_s_total * 1e3:.1f} ms inside publish() in all "
            f"(worst call {stock.publish_us_max:.0f} µs); "
            + (
                "its queue was never full: vLLM's publisher did not block on this host at "
                "this load (a slow call is the GIL held by its sender, not its queue; "
                "docs/vllm-engine.md has the sweep)."
                if stock.found_full == 0
                else f"{stock.found_full} calls found its queue full and blocked the engine."
            )
        )
    print(f"whole demo: {took:.0f} s (vLLM's import in each rank process included)")
    if outdir:
        os.makedirs(outdir, exist_ok=True)
        path = os.path.join(outdir, "demo-vllm.json")
        with open(path, "w") as f:
            json.dump(
                {
                    "config": cfg.as_dict(),
                    "ranks": ranks,
                    "queue": queue,
                    "seconds": round(took, 1),
                    "rows": [asdict(r) for r in out],
                },
                f,
                indent=1,
            )
        print(f"result: {path}")
    return out
