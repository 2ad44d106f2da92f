"""The workload model: deterministic, and its truth is what a perfect subscriber ends with."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coalesce import KVEventBatch
from coalesce.compactor import compact
from coalesce.refmodel import SubscriberModel
from coalesce_tools.workload import Engine, WorkloadConfig

SMALL = replace(
    WorkloadConfig(),
    steps=300,
    gpu_blocks=256,
    cpu_blocks=512,
    prefix_blocks=24,
    burst_every=100,
    burst_length=5,
    burst_requests=4,
    burst_blocks=48,
    clear_every=170,
)


def run(cfg: WorkloadConfig, rank: int = 0) -> tuple[Engine, list[KVEventBatch]]:
    engine = Engine(cfg, rank)
    return engine, [KVEventBatch(float(i), engine.step(), rank) for i in range(cfg.steps)]


def test_same_config_same_events_in_any_run():
    _, a = run(SMALL)
    _, b = run(SMALL)
    assert a == b
    _, other_rank = run(SMALL, rank=1)
    assert other_rank != a


@pytest.mark.parametrize("mode", ["set", "refcount"])
def test_truth_is_what_a_subscriber_of_every_event_ends_with(mode):
    engine, batches = run(SMALL)
    assert SubscriberModel(mode).apply_batches(batches).held() == engine.truth()


def test_truth_survives_compaction():
    engine, batches = run(SMALL)
    for size in (1, 7, 64):
        out = []
        for i in range(0, len(batches), size):
            out += compact(batches[i : i + size])[0]
        assert SubscriberModel("refcount").apply_batches(out).held() == engine.truth()


def test_pools_respect_their_sizes_and_bursts_evict_by_the_hundred():
    engine, batches = run(SMALL)
    assert len(engine.gpu) <= SMALL.gpu_blocks and len(engine.cpu) <= SMALL.cpu_blocks
    sizes = [len(b.events) for b in batches]
    assert max(sizes) > 10 * sorted(sizes)[len(sizes) // 2]  # bursts stand out
    assert any(type(e).__name__ == "AllBlocksCleared" for b in batches for e in b.events)
    cpu_stores = [
        e
        for b in batches
        for e in b.events
        if type(e).__name__ == "BlockStored" and e.medium == "CPU"
    ]
    assert cpu_stores and all(len(e.token_ids) == SMALL.block_size for e in cpu_stores)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="gpu_blocks"):
        replace(WorkloadConfig(), gpu_blocks=10)


def test_steps_split_into_batches_of_at_most_batch_events():
    events = list(range(45))
    assert WorkloadConfig().split(events) == [events]
    parts = replace(WorkloadConfig(), batch_events=20).split(events)
    assert [len(p) for p in parts] == [20, 20, 5] and [e for p in parts for e in p] == events
    with pytest.raises(ValueError, match="batch_events"):
        replace(WorkloadConfig(), batch_events=-1)


def test_sglang_events_are_the_same_events_in_sglangs_structs():
    from coalesce import sglang
    from coalesce.refmodel import SubscriberModel
    from coalesce_tools.workload import Engine, WorkloadConfig, as_engine_events, as_engine_key

    cfg = WorkloadConfig(steps=60, burst_every=20, burst_length=5, engine="sglang")
    engine = Engine(cfg, 0)
    model = SubscriberModel("refcount")
    for _ in range(cfg.steps):
        events = as_engine_events("sglang", engine.step())
        assert {type(e) for e in events} <= {sglang.BlockStored, sglang.BlockRemoved}
        assert all(-(2**63) <= h < 2**63 for e in events for h in e.block_hashes)
        model.apply_batches([sglang.KVEventBatch(0.0, events, 0)])
    assert model.held() == {as_engine_key("sglang", k) for k in engine.truth()}
    assert any(h < 0 for _, _, h in model.held()), "signed hashes: some are negative"
    assert {m for m, _, _ in model.held()} == {"GPU", "CPU_PINNED"}
