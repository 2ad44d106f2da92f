"""kv-coalesce against the real vllm==0.33.0 package.

Everything here goes through vLLM's own code: its plugin loader, its
``EventPublisherFactory``, its ``KVEventsConfig``, its event classes and its
``ZmqEventPublisher`` as the reference.  Only a GPU is missing, and nothing
here needs one.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed import kv_events as vk

import coalesce.vllm_plugin as plugin
from coalesce import CoalescingPublisher, PublishOutcome
from coalesce.refmodel import MODES, SubscriberModel
from tests.conftest import (
    assert_the_seed_bug,
    decode,
    free_port,
    held,
    inproc,
    publish_both,
    replay_request,
    wait_for,
)

END = b"\xff" * 8


@pytest.fixture
def enabled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plugin loaded through vLLM's own loader, as every vLLM process does."""
    import vllm.plugins

    monkeypatch.setenv("COALESCE_KV_EVENTS", "1")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    yield
    plugin.unregister()


def create(made: list[Any], rank: int = 0, **fields: Any) -> Any:
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **fields)
    pub = vk.EventPublisherFactory.create(cfg, rank)
    made.append(pub)
    return pub


def vstore(h: int, parent: int | None = None, medium: str | None = "GPU") -> vk.BlockStored:
    return vk.BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=[h, h + 1],
        block_size=2,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def vbatch(*events: Any, rank: int | None = None, ts: float = 1.5) -> vk.KVEventBatch:
    return vk.KVEventBatch(ts=ts, events=list(events), data_parallel_rank=rank)


def offload(i: int) -> vk.KVEventBatch:
    evs: list[Any] = [vstore(i + 1, i or None)]
    if i >= 4:
        evs += [
            vk.BlockRemoved(block_hashes=[i - 3], medium="GPU"),
            vstore(i - 3, (i - 4) or None, "CPU"),
        ]
    return vbatch(*evs, ts=float(i))


# -- the plugin --------------------------------------------------------------------


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "coalesce.vllm_plugin:register" in {ep.value for ep in eps if ep.name == "coalesce"}


def test_plugin_swaps_the_zmq_publisher(enabled, made):
    pub = create(made, endpoint=inproc("pub"))
    assert isinstance(pub, CoalescingPublisher)


def test_event_publisher_factory_shape(enabled, made):
    """vLLM's own factory test, through the plugin: null cases, default, DP offsets, classes."""
    assert isinstance(vk.EventPublisherFactory.create(None), vk.NullEventPublisher)
    off = KVEventsConfig(enable_kv_cache_events=False, publisher="zmq")
    assert isinstance(vk.EventPublisherFactory.create(off), vk.NullEventPublisher)
    null = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(vk.EventPublisherFactory.create(null), vk.NullEventPublisher)

    port = free_port()
    pub = create(made, endpoint=f"tcp://*:{port}")
    assert isinstance(pub, vk.ZmqEventPublisher) and isinstance(pub, vk.EventPublisher)
    assert isinstance(pub, CoalescingPublisher)
    assert pub.get_publisher_config().endpoint == f"tcp://*:{port}"
    ranked = create(made, rank=1, endpoint=f"tcp://*:{port}")
    assert isinstance(ranked, vk.ZmqEventPublisher)
    assert ranked.get_publisher_config().endpoint == f"tcp://*:{port + 1}"
    # publishing through the vLLM-typed handle works as vLLM's scheduler uses it
    ranked.publish(vbatch(vstore(1)))
    assert ranked.flush(10)
    assert ranked.stats().messages_sent == 1


def test_plugin_is_idempotent_and_reversible(enabled, made):
    plugin.register()
    plugin.register()
    assert isinstance(create(made, endpoint=inproc("pub")), CoalescingPublisher)
    plugin.unregister()
    assert isinstance(create(made, endpoint=inproc("pub")), vk.ZmqEventPublisher)


def test_plugin_does_nothing_unless_enabled(monkeypatch, made):
    monkeypatch.delenv("COALESCE_KV_EVENTS", raising=False)
    plugin.register()
    assert isinstance(create(made, endpoint=inproc("pub")), vk.ZmqEventPublisher)


def test_get_publisher_config_is_vllms_with_resolved_endpoints(enabled, made):
    port = free_port()
    base = inproc("replay")
    pub = create(made, rank=1, endpoint=f"tcp://*:{port - 1}", replay_endpoint=base, topic="t")
    cfg = pub.get_publisher_config()
    assert isinstance(cfg, KVEventsConfig)
    assert cfg.endpoint == f"tcp://*:{port}" and cfg.replay_endpoint == base + "_dp1"
    assert (cfg.topic, cfg.buffer_steps, cfg.publisher) == ("t", 10_000, "zmq")


# -- wire identity -------------------------------------------------------------------


def test_uncompacted_messages_are_byte_identical_to_vllms(enabled, made, make_sub):
    ep_v, ep_c = inproc("vllm"), inproc("ours")
    # both publishers are rank 3, so both bind "<endpoint>_dp3"
    sub_v, sub_c = make_sub(ep_v + "_dp3", b"kv"), make_sub(ep_c + "_dp3", b"kv")
    theirs = vk.ZmqEventPublisher(data_parallel_rank=3, endpoint=ep_v, topic="kv")
    made.append(theirs)
    ours = create(made, rank=3, endpoint=ep_c, topic="kv")
    batches = [
        vbatch(vstore(1)),
        vbatch(vstore(2, 1), vk.BlockRemoved(block_hashes=[1], medium="GPU", group_idx=2)),
        vbatch(vk.AllBlocksCleared(), rank=5),
        vbatch(
            vk.BlockStored(
                block_hashes=[b"\x01" * 32],
                parent_block_hash=None,
                token_ids=[],
                block_size=16,
                lora_id=7,
                medium=None,
                lora_name="l",
                extra_keys=[("mm", "x", 0)],
                kv_cache_spec_kind="full",
                locality="LOCAL",
                session_id="s",
                lookahead_token_ids=[[1, 2]],
            )
        ),
        vbatch(
            vk.BlockStored(
                block_hashes=[2**64 - 1],
                parent_block_hash=2**63,
                token_ids=[1],
                block_size=1,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            )
        ),
        # larger than a compaction window (max_events_per_step): still one message
        vbatch(
            *[vstore(i, i - 1 if i else None) for i in range(1200)],
            *[vk.BlockRemoved(block_hashes=[i], medium="GPU") for i in range(600)],
        ),
    ]
    publish_both(theirs, ours, batches, sub_v, sub_c)


def test_compacted_stream_decodes_with_vllms_types_and_keeps_state(enabled, made, make_sub):
    ep = inproc("pub")
    sub = make_sub(ep)
    pub = create(made, endpoint=ep)
    assert pub.settings.move_events is False
    pub_kw = pub.settings
    assert pub_kw.compaction is True
    batches = [offload(i) for i in range(600)]
    with held(pub):
        for b in batches:
            pub.publish(b)
    assert pub.flush(20)
    st = pub.stats()
    assert st.compaction_passes > 0 and st.messages_sent < len(batches)
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    dec = msgspec.msgpack.Decoder(type=vk.KVEventBatch)
    received = [dec.decode(m[2]) for m in msgs]
    assert [m[1] for m in msgs] == list(range(len(msgs)))
    for mode in MODES:
        want = SubscriberModel(mode).apply_batches(batches).state()
        assert SubscriberModel(mode).apply_batches(received).state() == want, mode


def test_a_loss_marker_decodes_with_vllms_types_and_leaves_no_hole(
    enabled, made, make_sub, monkeypatch
):
    """A loss forced through vLLM's own factory and config: the stream stays
    contiguous, the marker is vLLM's ``AllBlocksCleared`` for this rank, and
    what follows it is applied as usual."""
    monkeypatch.setenv("COALESCE_STALL_TIMEOUT", "0")  # a held sender is a stalled one
    monkeypatch.setenv("COALESCE_LOSS_MARKER", "clear")  # the marker alone, no resync
    ep = inproc("pub")
    sub = make_sub(f"{ep}_dp1")
    pub = create(made, rank=1, endpoint=ep, max_queue_size=2)
    assert pub.settings.loss_marker == "clear"
    with held(pub):
        outcomes = [pub.publish(offload(i)) for i in range(10)]
    assert PublishOutcome.DROPPED in outcomes
    assert pub.flush(10)
    assert pub.publish(offload(10)) is PublishOutcome.QUEUED
    assert pub.flush(10)
    st = pub.stats()
    assert st.loss_markers == 1 and st.seq_gaps == 0
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    assert [m[1] for m in msgs] == list(range(len(msgs))), "no hole"
    dec = msgspec.msgpack.Decoder(type=vk.KVEventBatch)
    received = [dec.decode(m[2]) for m in msgs]
    markers = [b for b in received if any(isinstance(e, vk.AllBlocksCleared) for e in b.events)]
    assert len(markers) == 1 and len(markers[0].events) == 1
    assert markers[0].data_parallel_rank == 1
    assert received[-1].events == offload(10).events  # after the marker, as it was published


def test_vllms_classes_take_the_c_rules_and_match_the_python_ones():
    """vLLM's own event classes are read by the accelerator (field slots found from
    vLLM's declarations, not ours), with the pure-Python rules as the oracle."""
    from collections import Counter

    from coalesce import _rules, compactor

    if compactor._accel is None:
        pytest.skip("the C accelerator is not built")
    events = [e for i in range(300) for e in offload(i).events]
    events += [vk.AllBlocksCleared(), *offload(301).events, vk.BlockRemoved([302], "GPU")]
    taken = compactor._accelerated(list(events))
    assert taken is not None, "vLLM's classes were declined"
    counts: Counter[str] = Counter()
    expected = _rules.compact_events(list(events), False, counts)
    assert taken[0] == expected
    assert {type(e) for e in taken[0]} <= {vk.BlockStored, vk.BlockRemoved, vk.AllBlocksCleared}
    assert taken[1:] == (counts["superseded"], counts["cancelled"], counts["merged"])


def test_vllms_batches_take_the_c_window_driver_and_match_the_python_one():
    """vLLM's KVEventBatch is read by the C window driver (its ts, events and rank
    slots), ranks and folds as the Python driver does, for both levels."""
    from coalesce import compactor

    if compactor._accel is None:
        pytest.skip("the C accelerator is not built")
    batches = [offload(i) for i in range(40)]
    batches[10] = vk.KVEventBatch(ts=10.0, events=batches[10].events, data_parallel_rank=1)
    for fold_only in (False, True):
        assert compactor._accelerated_window(list(batches), fold_only) is not None
        out_c, rep_c = compactor.compact(list(batches), fold_only=fold_only)
        out_py, rep_py = compactor._compact_py(list(batches), False, fold_only)
        assert out_c == out_py and rep_c == rep_py
        assert {type(b) for b in out_c} == {vk.KVEventBatch}
        assert rep_c.batches_out == 3  # the rank-1 batch splits the window in three


# -- vLLM's own publisher scenarios, in our words, through vLLM's factory ---------------


def test_first_seq_zero_contiguous_and_replay(enabled, made, make_sub):
    ep, rep = inproc("pub"), inproc("replay")
    sub = make_sub(ep, replay=rep)
    pub = create(made, endpoint=ep, replay_endpoint=rep, buffer_steps=8)
    for i in range(20):
        pub.publish(vbatch(vstore(i)))
        assert pub.flush(10)
    assert [m[1] for m in sub.recv_until_seq(19)] == list(range(20))
    assert [m[1] for m in sub.replay(15)] == [15, 16, 17, 18, 19]
    assert [m[1] for m in sub.replay(0)] == list(range(12, 20))  # buffer limit


def test_replay_to_a_req_client(enabled, made, make_sub):
    """A REQ client gets the first message of the reply (REQ takes one reply per request)."""
    ep, rep = inproc("pub"), inproc("replay")
    sub = make_sub(ep)
    pub = create(made, endpoint=ep, replay_endpoint=rep)
    for i in range(3):
        pub.publish(vbatch(vstore(i)))
    assert pub.flush(10)
    msgs = sub.recv_until_seq(2)
    topic, seq, payload = replay_request(rep, 1)
    assert (topic, int.from_bytes(seq, "big"), payload) == msgs[1]


def test_topic_filtering(enabled, made, make_sub):
    ep = inproc("pub")
    mine, other = make_sub(ep, b"kv"), make_sub(ep, b"other")
    pub = create(made, endpoint=ep, topic="kv")
    pub.publish(vbatch(vstore(1)))
    assert pub.flush(10)
    assert mine.recv_until_seq(0)[0][0] == b"kv"
    assert other.nothing_within(0.2)


@pytest.mark.parametrize("scheme", ["inproc", "tcp"])
def test_dp_rank_offset_and_tagging(enabled, made, make_sub, scheme):
    if scheme == "inproc":
        base = inproc("pub")
        sub = make_sub(base + "_dp2")
        pub = create(made, rank=2, endpoint=base)
    else:
        port = free_port()
        pub = create(made, rank=2, endpoint=f"tcp://*:{port - 2}")
        sub = make_sub(f"tcp://127.0.0.1:{port}")
    msg = sub.publish_until_heard(lambda i: pub.publish(vbatch(vstore(i))))
    assert decode(msg[2]).data_parallel_rank == 2


class SampleEvent(msgspec.Struct, tag=True):
    name: str
    value: int


class SampleBatch(vk.EventBatch):
    events: list[SampleEvent]


def test_generic_event_batches(enabled, made, make_sub):
    ep = inproc("pub")
    sub = make_sub(ep)
    pub = create(made, endpoint=ep)
    with held(pub):
        for i in range(30):
            pub.publish(SampleBatch(ts=float(i), events=[SampleEvent("e", i)]))
    assert pub.flush(10)
    msgs = sub.recv_until_seq(29)
    vals = [msgspec.msgpack.decode(m[2], type=SampleBatch).events[0].value for m in msgs]
    assert vals == list(range(30))


def test_high_volume_from_another_thread(enabled, made, make_sub):
    ep = inproc("pub")
    sub = make_sub(ep)
    pub = create(made, endpoint=ep)
    batches = [offload(i) for i in range(5000)]
    t = threading.Thread(target=lambda: [pub.publish(b) for b in batches])
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert pub.flush(30)
    st = pub.stats()
    assert st.batches_dropped == 0
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    received = [decode(m[2]) for m in msgs]
    want = SubscriberModel("llmd").apply_batches(batches).state()
    assert SubscriberModel("llmd").apply_batches(received).state() == want


# -- the seed bug, as a regression ---------------------------------------------------


def test_seed_bug_vllm_blocks_and_coalesce_does_not(made):
    theirs = vk.ZmqEventPublisher(data_parallel_rank=0, endpoint=inproc("v"), max_queue_size=2)
    ours = CoalescingPublisher(endpoint=inproc("c"), max_queue_size=2, stall_timeout=0.2)
    stall_c = assert_the_seed_bug(made, theirs, ours, lambda i: vbatch(vstore(i)))
    # stalled for stall_timeout: now the batch budget refuses, visibly
    wait_for(
        lambda: ours.publish(vbatch(vstore(99))) is PublishOutcome.DROPPED,
        what="the batch budget to apply to a stalled sender",
    )
    stall_c.release.set()
    assert ours.flush(10)
    st = ours.stats()
    assert st.batches_dropped > 0 and st.batches_in >= 10


@pytest.mark.parametrize("identity", ["seq", "batch"])
def test_snapshots_through_vllms_config_decode_with_vllms_types(
    enabled, made, make_sub, monkeypatch, identity
):
    """vLLM 0.33's config forbids unknown keys: the variables turn snapshots on.  Live
    payloads (``seq``: 3 elements, the id in the 24-byte seq frame; ``batch``: the id
    as a 4th element, which vLLM's types ignore) and snapshot chunks decode with
    vLLM's own types, and the chunks' stores are ones the stream sent."""
    ep, snap = inproc("pub"), inproc("snap")
    monkeypatch.setenv("COALESCE_SNAPSHOT_ENDPOINT", snap)
    monkeypatch.setenv("COALESCE_SNAPSHOT_IDENTITY", identity)
    sub = make_sub(ep)
    pub = create(made, endpoint=ep)
    assert pub.snapshot_endpoint == snap and pub.publisher_id is not None
    batches = [offload(i) for i in range(40)]
    for b in batches:
        pub.publish(b)
    assert pub.flush(20)
    msgs = sub.recv_until_seq(pub.stats().messages_sent - 1)
    dec = msgspec.msgpack.Decoder(type=vk.KVEventBatch)
    if identity == "seq":
        assert all(len(msgspec.msgpack.decode(m[2])) == 3 for m in msgs)
        assert all(f[8:] == pub.publisher_id and len(f) == 24 for f in sub.seq_frames)
    else:
        assert all(msgspec.msgpack.decode(m[2])[3:] == [pub.publisher_id] for m in msgs)
        assert all(len(f) == 8 for f in sub.seq_frames)
    config = pub.get_publisher_config()  # vLLM 0.33's KVEventsConfig has no snapshot field
    assert type(config).__name__ == "KVEventsConfig" and config.endpoint == ep
    live = [dec.decode(m[2]) for m in msgs]
    want = SubscriberModel("refcount").apply_batches(batches).state()
    assert SubscriberModel("refcount").apply_batches(live).state() == want
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(snap)
    try:
        dealer.send(b"snapshot")
        assert dealer.poll(10_000)
        frames = dealer.recv_multipart()
    finally:
        dealer.close()
    assert int.from_bytes(frames[0], "big", signed=True) >= 0
    assert frames[1] == pub.publisher_id
    chunks = [dec.decode(f) for f in frames[2:]]
    sent = [ev for b in live for ev in b.events if isinstance(ev, vk.BlockStored)]
    for ev in (ev for c in chunks for ev in c.events if isinstance(ev, vk.BlockStored)):
        assert ev in sent, "a snapshot store is a store the live stream carried, whole"
    for mode in ("refcount", "llmd", "dynamo"):
        model = SubscriberModel(mode).apply_batches(chunks)
        assert model.dropped_stores == 0
        assert model.state() == SubscriberModel(mode).apply_batches(batches).state(), mode
