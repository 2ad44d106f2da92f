"""The real producer: vLLM 0.33's own scheduler, KV cache manager and CPU offload
manager as the event source (``coalesce_tools.vllm_engine``), its publisher built by
vLLM's own ``EventPublisherFactory``.

Each seeded run (eager, lazy and no offload) is made twice, in the same process:
once through vLLM's ``ZmqEventPublisher`` (stock), once through coalesce swapped in
by the plugin, with its sender held for most of the run (the backlog forced, then
released) so that compaction works on windows spanning many batches, with the C
rules and with the pure-Python ones.  Three consumers read each stream as it goes:

- vLLM's own typed msgspec decoder feeding a refcount model;
- the llm-d-rules consumer (``tests/llmd_rules.py``), with replay;
- ``coalesce.subscriber.Subscriber``, with replay.

Each ends equal to its own result on stock's stream, and to what the engine's GPU
and CPU pools hold at the end (per medium, with how many blocks hold each hash).
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from vllm.distributed import kv_events as vk

from coalesce.refmodel import SubscriberModel
from coalesce.subscriber import Subscriber
from coalesce.testing import held, without_accelerator
from coalesce_tools.vllm_engine import EngineConfig, VllmEngine, seed_like, use_publisher
from tests.conftest import Sub, inproc, wait_for
from tests.llmd_rules import LlmdRulesConsumer

CONFIG = EngineConfig(
    requests=160,
    concurrency=40,
    prefixes=8,
    prefix_tokens=1024,
    unique_tokens=40,
    max_tokens=8,
    gpu_blocks=400,
    cpu_blocks=500,
    max_num_seqs=40,
)
"""Sized to run in well under a second a run here: ~8-10k events in ~100-200 batches
with eager offload; pools far smaller than the prefixes (eviction never stops)."""
HOLD_FOR = 0.8
"""The sender is held for this fraction of the steps, then released (coalesce runs)."""


@dataclass
class Run:
    """One engine run through one publisher: what its consumers ended with."""

    truth: Counter[Any]
    published: list[list[bytes]]  # each batch's events as the scheduler published them
    messages: int
    vllm_decoder: dict[Any, int]
    dynamo_rule: dict[Any, int]
    llmd: dict[Any, int]
    subscriber: dict[Any, int]
    stats: Any = None
    notes: dict[str, Any] = field(default_factory=dict)


def _drain(raw: Sub, llmd: LlmdRulesConsumer, sub: Subscriber, last: int) -> None:
    """Poll every consumer until each has applied seq ``last`` (bounded waits)."""

    def raw_done() -> bool:
        while raw.sock.poll(0):
            raw.recv(0)
        return bool(raw.messages) and raw.messages[-1][1] >= last

    wait_for(raw_done, timeout=20, what=f"the vLLM-decoder consumer to reach seq {last}")
    wait_for(
        lambda: llmd.poll(0.01) >= 0 and llmd.last_seq == last,
        timeout=20,
        what=f"the llm-d-rules consumer to reach seq {last}",
    )
    wait_for(
        lambda: sub.poll(0.01) >= 0 and sub.sources[0].last_seq == last,
        timeout=20,
        what=f"the subscriber to reach seq {last}",
    )


def run_engine(publisher: str, offload: str, python_rules: bool = False) -> Run:
    """One seeded run of vLLM's scheduler through ``publisher`` ("stock"/"coalesce")."""
    cfg = EngineConfig(**{**CONFIG.as_dict(), "offload": offload})
    ep, rep = inproc("engine"), inproc("engine-replay")
    raw = Sub(ep)
    llmd = LlmdRulesConsumer(ep, rep)
    sub = Subscriber(ep, rep, mode="llmd", rcvhwm=0)
    with use_publisher(publisher), without_accelerator() if python_rules else nullcontext():
        eng = VllmEngine(cfg, ep, replay_endpoint=rep)  # a publisher built without C
    if python_rules:
        assert not eng.publisher.stats().compactor_accelerated, "the pure-Python rules"
    published: list[list[bytes]] = []
    inner = eng.publisher.publish

    def recording(batch: Any) -> Any:
        published.append([msgspec.msgpack.encode(e) for e in batch.events])
        return inner(batch)

    eng.publisher.publish = recording
    try:
        if publisher == "coalesce":
            with held(eng.publisher):  # the backlog builds up, then is released
                while eng.busy() and eng.added < cfg.requests * HOLD_FOR:
                    eng.step()
            eng.run()
            assert eng.publisher.flush(30)
            stats = eng.publisher.stats()
            last = stats.messages_sent - 1
        else:
            eng.run()
            stats = None
            last = len(published) - 1
        llmd.poll(0)  # its proactive replay from 0, as llm-d does on connect
        _drain(raw, llmd, sub, last)
        dec = msgspec.msgpack.Decoder(type=vk.KVEventBatch)
        assert [m[1] for m in raw.messages] == list(range(last + 1)), "a contiguous stream"
        received = [dec.decode(m[2]) for m in raw.messages]
        model = SubscriberModel("refcount").apply_batches(received)
        src = sub.sources[0]
        assert (src.resets, src.gaps, src.bad_messages, src.unknown_events) == (0, 0, 0, 0)
        assert (llmd.resets, llmd.incomplete_replays, llmd.skipped) == (0, 0, 0)
        return Run(
            truth=eng.truth(),
            published=published,
            messages=last + 1,
            vllm_decoder=model.state(),
            dynamo_rule=SubscriberModel("dynamo").apply_batches(received).state(),
            llmd=llmd.index.state(),
            subscriber=src.index.state(),
            stats=stats,
        )
    finally:
        eng.shutdown()
        raw.close()
        llmd.close()
        sub.close()


_stock: dict[str, Run] = {}


def stock(offload: str) -> Run:
    """Stock's run of this case (made once per offload mode and process)."""
    if offload not in _stock:
        _stock[offload] = run_engine("stock", offload)
    return _stock[offload]


def by_medium(state: dict[Any, int] | Counter[Any]) -> dict[str, dict[Any, int]]:
    out: dict[str, dict[Any, int]] = {}
    for key, n in state.items():
        out.setdefault(str(key[0]), {})[key] = n
    return out


def disagreement(got: dict[Any, int], want: dict[Any, int]) -> str:
    missing = sum(1 for k in want if k not in got)
    stale = sum(1 for k in got if k not in want)
    miscount = sum(1 for k in got if k in want and got[k] != want[k])
    return f"missing {missing}, stale {stale}, count differs {miscount}"


CONSUMERS = ("vllm_decoder", "llmd", "subscriber")


@pytest.mark.parametrize("offload", ["eager", "lazy", "none"])
def test_vllms_own_stream_matches_its_pools(offload):
    """The reference itself: every consumer of vLLM's own publisher's stream ends with
    what the engine's pools hold, per medium (a difference would be vLLM's finding)."""
    run = stock(offload)
    truth = dict(run.truth)
    assert set(by_medium(truth)) == ({"GPU"} if offload == "none" else {"GPU", "CPU"})
    events = Counter(len(b) for b in run.published)
    assert sum(n * k for k, n in events.items()) > 1_000, "a stream worth testing on"
    for name in CONSUMERS:
        got = getattr(run, name)
        for medium, want in by_medium(truth).items():
            have = by_medium(got).get(medium, {})
            assert have == want, f"{name}, {medium}: {disagreement(have, want)}"


@pytest.mark.parametrize("rules", ["C", "python"])
@pytest.mark.parametrize("offload", ["eager", "lazy", "none"])
def test_coalesce_on_vllms_scheduler_ends_as_stock_and_as_the_pools(offload, rules):
    from coalesce import compactor

    if rules == "C" and not compactor.accelerated():
        pytest.skip("the C accelerator is not built")
    ref = stock(offload)
    run = run_engine("coalesce", offload, python_rules=rules == "python")
    assert run.published == ref.published, "the same seeded run: the same events"
    st = run.stats
    assert st.compactor_accelerated == (rules == "C"), "the rules asked for"
    assert st.batches_dropped == 0 and st.loss_markers == 0 and st.seq_gaps == 0
    assert st.batches_in == len(run.published)
    assert st.compaction_passes > 0, "the held backlog was compacted"
    assert run.messages < ref.messages, (run.messages, ref.messages)
    assert st.events_sent < st.events_in
    for name in CONSUMERS:
        got, want = getattr(run, name), getattr(ref, name)
        assert got == want, f"{name} vs its result on stock's stream: {disagreement(got, want)}"
        assert got == dict(run.truth), f"{name} vs the pools: {disagreement(got, run.truth)}"


@pytest.mark.parametrize("rules", ["C", "python"])
@pytest.mark.parametrize("offload", ["eager", "lazy"])
def test_a_forced_loss_on_vllms_scheduler_collapses_into_the_pools_truth(
    offload, rules, monkeypatch
):
    """Issue 49's overload on the real producer: an event budget of 1,500 (a tenth of
    what the held sender lets pile up) and no wait in ``publish()``, every other
    setting at its default (``loss_marker=resync``). The refused batches and the
    backlog collapse into the recorder's state, sent as one loss marker and a
    resync; every consumer (vLLM's decoder on a refcount model, the llm-d rules
    with replay, ``coalesce.subscriber``) ends with exactly what the engine's
    GPU and CPU pools hold, as on stock's stream."""
    from coalesce import compactor

    if rules == "C" and not compactor.accelerated():
        pytest.skip("the C accelerator is not built")
    for knob, value in (
        ("MAX_PENDING_EVENTS", "1500"),
        ("STALL_TIMEOUT", "0"),
    ):
        monkeypatch.setenv(f"COALESCE_{knob}", value)
    monkeypatch.delenv("COALESCE_LOSS_MARKER", raising=False)
    ref = stock(offload)
    run = run_engine("coalesce", offload, python_rules=rules == "python")
    assert run.published == ref.published
    st = run.stats
    assert st.batches_dropped > 0 and st.loss_markers >= 1, "the budget was passed"
    assert st.resyncs == st.loss_markers and st.snapshot_exact, "every loss resynced"
    for name in CONSUMERS:
        got = getattr(run, name)
        assert got == dict(run.truth), f"{name} vs the pools: {disagreement(got, run.truth)}"
        assert got == getattr(ref, name), f"{name} vs stock's stream"


@pytest.mark.parametrize("loss_marker", ["gap", "resync"])
def test_a_forced_loss_with_snapshots_on_and_llmd_routers_snapshot_subscriber(
    loss_marker, monkeypatch
):
    """The same overload with snapshots on (vLLM PR #57789's protocol), read by
    ``coalesce.subscriber`` and by a consumer following llm-d-router's snapshot
    subscriber (its PR #2946: ``tests/snapshot_rules.py``), which fails on a store
    whose parent it does not hold and starts over from a snapshot on any failure or
    seq gap, and applies an ``AllBlocksCleared`` to the GPU tier only.

    vLLM's own stream suits that strict reader (every store's parent is held, tier
    by tier as the pools say); so do the snapshots.  With ``loss_marker=gap`` both
    consumers end with exactly what the pools hold.  With ``resync`` (no gap)
    ``coalesce.subscriber`` does, and the PR's consumer, which never starts over,
    keeps the GPU exact but not the CPU tier: the marker's clear does not reach it,
    so it keeps CPU blocks evicted during the loss and counts twice the ones the
    resync stores again (use ``gap`` for that consumer)."""
    from tests.snapshot_rules import SnapshotRulesConsumer

    snap = inproc("snapshot")
    for knob, value in (
        ("MAX_PENDING_EVENTS", "1500"),
        ("STALL_TIMEOUT", "0"),
        ("LOSS_MARKER", loss_marker),
        ("SNAPSHOT_ENDPOINT", snap),
    ):
        monkeypatch.setenv(f"COALESCE_{knob}", value)
    cfg = EngineConfig(**{**CONFIG.as_dict(), "offload": "eager"})
    ep = inproc("snap-engine")
    with use_publisher("coalesce"):
        eng = VllmEngine(cfg, ep, topic="kv@127.0.0.1:5557@model")
    pr = SnapshotRulesConsumer(ep, snap)
    sub = Subscriber(ep, mode="refcount", snapshot_endpoints=snap, rcvhwm=0)
    try:

        def joined() -> bool:
            eng.step()
            pr.poll(0.01)
            sub.poll(0.01)
            return pr.index is not None and sub.sources[0].last_seq is not None

        wait_for(joined, what="both consumers to bootstrap from a snapshot")
        while eng.busy() and eng.added < cfg.requests * 0.4:  # both tiers fill up
            eng.step()
        assert eng.publisher.flush(30)
        with held(eng.publisher):  # then the overload
            while eng.busy() and eng.added < cfg.requests * HOLD_FOR:
                eng.step()
        eng.run()
        assert eng.publisher.flush(30)
        st = eng.publisher.stats()
        last = st.messages_sent + st.seq_gaps - 1

        def caught_up() -> bool:  # (>=: an idle heartbeat may take a seq after the flush)
            pr.poll(0.01)
            sub.poll(0.01)
            seq = sub.sources[0].last_seq
            return (pr.last_seq or -1) >= last and seq is not None and seq >= last

        wait_for(caught_up, timeout=30, what="the consumers to reach the last message")
        truth = dict(eng.truth())
    finally:
        eng.shutdown()
        pr.close()
        sub.close()
    assert st.batches_dropped > 0
    assert st.seq_gaps >= 1 if loss_marker == "gap" else st.loss_markers == st.resyncs >= 1
    src = sub.sources[0]
    assert src.index.state() == truth, disagreement(src.index.state(), truth)
    assert src.resets == 0
    want = {(str(m).lower(), g, h): n for (m, g, h), n in truth.items()}
    got = pr.state()
    assert got is not None, "the PR's consumer has an installed index"
    if loss_marker == "gap":
        assert pr.failures and all("live sequence gap" in f for f in pr.failures), pr.failures
        assert got == want, disagreement(got, want)
        return
    assert pr.failures == [], "no gap: it never starts over"
    by_tier = {t: {k: n for k, n in got.items() if k[0] == t} for t in ("gpu", "cpu")}
    assert by_tier["gpu"] == {k: n for k, n in want.items() if k[0] == "gpu"}
    cpu_want = {k: n for k, n in want.items() if k[0] == "cpu"}
    assert set(cpu_want) <= set(by_tier["cpu"]), "it misses no CPU block"
    assert by_tier["cpu"] != cpu_want, "but the CPU tier is not the pool's"


@pytest.mark.parametrize("rules", ["C", "python"])
def test_dynamos_parent_rule_ends_as_on_stock_and_loses_only_cpu_blocks(rules):
    """The reference model's Dynamo rule (``SubscriberModel("dynamo")``: a store is
    dropped unless its parent is held in the same medium).  On vLLM's eager stream a
    CPU store's parent is sometimes held only on the GPU, so the model, even on
    stock's stream, ends without a few CPU blocks the pools hold.  Dynamo 1.6.1's
    real indexer does index them (tests_dynamo/test_dynamo_realstream.py): the model
    is stricter than Dynamo here.  Through coalesce it ends exactly as on stock's
    stream, exact on the GPU, never stale."""
    from coalesce import compactor

    if rules == "C" and not compactor.accelerated():
        pytest.skip("the C accelerator is not built")
    ref = stock("eager")
    run = run_engine("coalesce", "eager", python_rules=rules == "python")
    assert run.published == ref.published
    assert run.dynamo_rule == ref.dynamo_rule, disagreement(run.dynamo_rule, ref.dynamo_rule)
    gpu = by_medium(run.truth)["GPU"]
    assert by_medium(run.dynamo_rule)["GPU"] == gpu
    lost = set(by_medium(run.truth)["CPU"]) - set(by_medium(run.dynamo_rule).get("CPU", {}))
    stale = set(run.dynamo_rule) - set(run.truth)
    assert not stale, "never a block the pools do not hold"
    print(f"Dynamo's rule on vLLM's eager stream: {len(lost)} CPU blocks never indexed")


@pytest.mark.parametrize("reset_connector", [False, True])
def test_vllms_reset_prefix_cache_and_the_cpu_tier(reset_connector):
    """vLLM's finding, kept as a test so that a change upstream shows: after a run with
    eager offload, ``Scheduler.reset_prefix_cache()`` with ``reset_connector=False``
    (the default of ``LLM.reset_prefix_cache()`` and of ``POST /reset_prefix_cache``
    without ``reset_external=true``) empties the GPU pool only, but publishes an
    ``AllBlocksCleared`` with no medium, which every consumer applies to every tier
    (llm-d clears the pod, Dynamo the worker): the CPU pool keeps its blocks and the
    consumers forget them.  With ``reset_connector=True`` both pools empty and both
    agree.  Compacted, the stream ends the same in every model."""
    from coalesce import compactor

    eng = VllmEngine(
        EngineConfig(**{**CONFIG.as_dict(), "requests": 60}),
        inproc("reset"),
        record=True,
        publisher="null",
    )
    try:
        eng.run()
        assert eng.scheduler.reset_prefix_cache(reset_connector=reset_connector)
        eng.step()  # the step that publishes what the reset emitted
        pools = by_medium(eng.truth())
        batches = list(eng.batches or [])
    finally:
        eng.shutdown()
    assert isinstance(batches[-1].events[0], vk.AllBlocksCleared)
    assert "GPU" not in pools
    held = SubscriberModel("llmd").apply_batches(batches).state()
    assert held == {}, "every tier forgotten"
    if reset_connector:
        assert pools == {}, "both pools empty: stream and pools agree"
    else:
        assert len(pools["CPU"]) > 100, "the CPU pool kept its blocks: the consumers do not"
    for mode in ("refcount", "llmd", "dynamo"):
        out, _ = compactor.compact(batches[-40:])
        want = SubscriberModel(mode).apply_batches(batches).state()
        got = SubscriberModel(mode).apply_batches(batches[:-40] + out).state()
        assert got == want, mode


_lazy: list[Any] = []


def lazy_stream() -> list[Any]:
    """vLLM's scheduler's published batches with lazy offload, the seed's shape at this
    host's scale (recorded once per process, vLLM's own classes)."""
    if not _lazy:
        eng = VllmEngine(seed_like("lazy"), inproc("lazy-windows"), record=True, publisher="null")
        try:
            eng.run()
            _lazy.extend(eng.batches or [])
        finally:
            eng.shutdown()
    return _lazy


@pytest.mark.parametrize("c_rules", [True, False])
@pytest.mark.parametrize("w", [4, 16, 64])
def test_with_parentless_copies_every_lazy_window_is_exact_from_a_reset(w, c_rules):
    """vLLM's lazy offload stores CPU copies under no parent. With ``parentless_copies``
    each window of its stream, compacted, leaves every model as the window itself
    would, from an index that reset before it (empty) and from one holding only the
    CPU copies the stream held then (a block held only as a parentless copy): the
    subscriber that resets mid-stream, which the default rules may leave a block
    short (docs/event-semantics.md, rule 6)."""
    from coalesce import compactor

    batches = lazy_stream()
    before = SubscriberModel("refcount")
    windows = [batches[i : i + w] for i in range(0, len(batches), w)]
    assert (
        sum(
            1
            for b in batches
            for e in b.events
            if isinstance(e, vk.BlockStored) and e.medium == "CPU" and e.parent_block_hash is None
        )
        > 100
    )
    with nullcontext() if c_rules else without_accelerator():
        for window in windows:
            cpu_only = Counter({k: n for k, n in before.state().items() if k[0] == "CPU"})
            out, _ = compactor.compact(window, parentless_copies=True)
            for start in (Counter(), cpu_only):
                for mode in ("refcount", "llmd", "dynamo"):
                    want = SubscriberModel(mode, start).apply_batches(window).state()
                    got = SubscriberModel(mode, start).apply_batches(out).state()
                    assert got == want, (mode, len(start), disagreement(got, want))
            before.apply_batches(window)


def test_the_fused_encoder_writes_vllms_batches_as_msgspec_and_records_them_as_record():
    """The sender's encode and the recorder's read in one pass (``Recorder.encode``),
    on vLLM's own classes and stream: every batch taken, its bytes msgspec's, and
    the recorder's state after each batch the one :meth:`Recorder.record` leaves."""
    from coalesce._recorder import Recorder, _accel

    if _accel is None:
        pytest.skip("the C recorder is not built")
    enc = msgspec.msgpack.Encoder()
    fused, apart = Recorder(10**9), Recorder(10**9)
    batches = lazy_stream()
    for b in batches:
        assert fused.encode(b) == enc.encode(b)
        apart.record(b)
        assert fused.export() == apart.export()
    assert fused._cs.encoded == len(batches) and fused.valid


def test_the_recorded_stream_is_vllms():
    """The stream the Dynamo tier replays (no vLLM there) decodes with vLLM's types,
    and its refcount and llm-d models end with the pools recorded with it."""
    import os

    from coalesce_tools.realstream import RECORDED, load

    here = os.path.dirname(__file__)
    rec = load(os.path.join(here, "..", "tests_dynamo", "data", "vllm-eager.msgpack.gz"))
    assert {k: rec.config[k] for k in RECORDED} == RECORDED and rec.config["offload"] == "eager"
    dec = msgspec.msgpack.Decoder(type=vk.KVEventBatch)
    batches = [dec.decode(p) for p in rec.payloads]
    assert {"GPU", "CPU"} <= {e.medium for b in batches for e in b.events}
    for mode in ("refcount", "llmd"):
        assert SubscriberModel(mode).apply_batches(batches).state() == rec.pools, mode


def test_the_driver_is_seeded():
    """The same config gives the same stream in one process (the equality above rests
    on it)."""
    a = stock("none")
    b = run_engine("stock", "none")
    assert a.published == b.published
