"""NVIDIA Dynamo's real KV indexer on vLLM's own stream.

The stream was recorded from vLLM 0.33's real scheduler, KV cache manager and
eager CPU offload manager (``coalesce_tools.realstream``; this tier has no vLLM):
every batch's payload as vLLM encodes it, and the engine's GPU and CPU pools at
the end.  Two of Dynamo's indexers read it through coalesce: one batch per
message, as vLLM's own publisher sends it, and with the sender held through
the whole stream then released, so that compaction folds it into a few
messages.  Both must end with the same index: the block hashes the engine's
pools hold, GPU and CPU together (its dump names hashes, not media).

It holds more than ``SubscriberModel("dynamo")`` (a parent checked in the same
medium) predicts on this stream: a CPU store whose parent is held only on the GPU
is indexed, so Dynamo 1.6.1's parent check is not per medium here.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from coalesce import CoalescingPublisher, KVEventBatch, PublishOutcome
from coalesce.refmodel import SubscriberModel
from coalesce_tools.realstream import load
from tests.conftest import held
from tests_dynamo.test_dynamo_indexer import _indexer, _join, _read_to_the_end

DATA = os.path.join(os.path.dirname(__file__), "data", "vllm-eager.msgpack.gz")
BLOCK = 16


def _store(h: int) -> KVEventBatch:
    from coalesce import BlockStored

    return KVEventBatch(0.0, [BlockStored([h], None, [h] * BLOCK, BLOCK, None, "GPU", None)])


def _through_coalesce(batches: list[Any], compacted: bool) -> tuple[set[int], Any]:
    """What Dynamo's indexer holds after ``batches`` through coalesce, and the stats."""
    with _indexer(block_size=BLOCK) as (port, http):
        pub = CoalescingPublisher(endpoint=f"tcp://*:{port}")
        try:
            _join(pub, http, _store)
            assert pub.flush(10.0)
            before = pub.stats().messages_sent
            if compacted:
                with held(pub):
                    for b in batches:
                        assert pub.publish(b) is PublishOutcome.QUEUED
            else:
                for b in batches:
                    assert pub.publish(b) is PublishOutcome.QUEUED
                    assert pub.flush(10.0)  # one batch, one message: vLLM's stream
            assert pub.flush(30.0)
            sent = pub.stats().messages_sent - before
            got = _read_to_the_end(pub, http, _store)
        finally:
            pub.shutdown()
    return got, sent


def test_dynamo_on_vllms_stream_ends_the_same_through_coalesce():
    rec = load(DATA)
    batches = [msgspec.msgpack.decode(p, type=KVEventBatch) for p in rec.payloads]
    plain, sent_plain = _through_coalesce(batches, compacted=False)
    compacted, sent_compacted = _through_coalesce(batches, compacted=True)
    assert sent_plain == len(batches) and sent_compacted < len(batches) / 4
    assert compacted == plain, (len(compacted - plain), len(plain - compacted))
    pools = {h for (_, _, h) in rec.pools}
    assert plain == pools, (len(pools - plain), len(plain - pools))
    gpu = {h for (m, _, h) in rec.pools if m == "GPU"}
    model = {h for (_, _, h) in SubscriberModel("dynamo").apply_batches(batches).held()}
    print(
        f"Dynamo on vLLM's stream: {len(plain)} hashes; pools {len(pools)} "
        f"(GPU {len(gpu)}); the dynamo reference model {len(model)}; "
        f"messages {sent_plain} one by one, {sent_compacted} compacted"
    )
