"""kv-coalesce against the real sglang==0.5.23 package.

Everything here goes through SGLang's own code: its plugin loader
(``sglang.srt.plugins.load_plugins``), its ``EventPublisherFactory`` and
pydantic ``KVEventsConfig``, its event classes, its rank choice
(``select_kv_publisher_dp_rank``), and its ``ZmqEventPublisher`` as the
reference.  Only a GPU is missing, and nothing here needs one.  (The wheel
ships no tests of its own to run.)
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from sglang.srt.disaggregation import kv_events as sk

import coalesce.sglang_plugin as plugin
from coalesce import sglang as ours_types
from coalesce._settings import offset_endpoint
from coalesce.publisher import PublishOutcome
from coalesce.refmodel import MODES, SubscriberModel
from coalesce.sglang import SGLangPublisher
from tests.conftest import (
    assert_the_seed_bug,
    free_port,
    held,
    inproc,
    publish_both,
    replay_request,
)

END = b"\xff" * 8
DEC = msgspec.msgpack.Decoder(sk.KVEventBatch)


@pytest.fixture
def enabled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plugin loaded through SGLang's own loader, as every SGLang process does."""
    import sglang.srt.plugins as sp

    monkeypatch.setenv("COALESCE_KV_EVENTS", "1")
    monkeypatch.setattr(sp, "_plugins_loaded", False)
    sp.load_plugins()
    yield
    plugin.unregister()


def create(made: list[Any], rank: int = 0, **fields: Any) -> Any:
    pub = sk.EventPublisherFactory.create(json.dumps({"publisher": "zmq", **fields}), rank)
    made.append(pub)
    return pub


def sstore(h: int, parent: int | None = None, **kw: Any) -> sk.BlockStored:
    return sk.BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=[h, h + 1],
        block_size=2,
        lora_id=kw.pop("lora_id", None),
        medium=kw.pop("medium", "GPU"),
        **kw,
    )


def sbatch(*events: Any, rank: int | None = None, ts: float = 1.0) -> sk.KVEventBatch:
    return sk.KVEventBatch(ts=ts, events=list(events), attn_dp_rank=rank)


def test_entry_point_is_installed() -> None:
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert "coalesce.sglang_plugin:register" in {ep.value for ep in eps if ep.name == "coalesce"}


def test_the_factory_builds_ours_and_it_passes_sglangs_isinstance(enabled, made) -> None:
    pub = create(made, 2, endpoint=inproc("sgl"), max_queue_size=7, buffer_steps=3)
    assert isinstance(pub, SGLangPublisher)
    assert isinstance(pub, sk.ZmqEventPublisher) and isinstance(pub, sk.EventPublisher)
    assert pub.attn_dp_rank == 2 and pub.config.max_queue_size == 7
    assert pub.config.buffer_steps == 3


def test_every_config_field_is_accepted_and_unknown_ones_ignored(enabled, made) -> None:
    fields = sk.KVEventsConfig().model_dump()
    fields.update(publisher="zmq", endpoint=inproc("sgl"), bind=True, format="dynamo")
    pub = create(made, **fields)  # format is popped by SGLang; bind is taken
    assert isinstance(pub, SGLangPublisher)
    made.append(plugin.create_publisher(endpoint=inproc("sgl"), a_field_from_sglang_0_6=1))


def test_the_plugin_is_idempotent_reversible_and_off_unless_enabled(
    enabled, made, monkeypatch
) -> None:
    plugin.register()
    assert sk.EventPublisherFactory._registry["zmq"] is plugin.create_publisher
    plugin.unregister()
    assert sk.EventPublisherFactory._registry["zmq"] is sk.ZmqEventPublisher
    monkeypatch.setenv("COALESCE_KV_EVENTS", "0")
    plugin.register()
    assert not isinstance(create(made, endpoint=inproc("sgl")), SGLangPublisher)


def test_sglang_plugins_must_name_it_when_set(made, monkeypatch) -> None:
    import sglang.srt.plugins as sp

    monkeypatch.setenv("COALESCE_KV_EVENTS", "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    monkeypatch.setattr(sp, "_plugins_loaded", False)
    sp.load_plugins()
    assert not isinstance(create(made, endpoint=inproc("sgl")), SGLangPublisher)
    monkeypatch.setenv("SGLANG_PLUGINS", "coalesce")
    monkeypatch.setattr(sp, "_plugins_loaded", False)
    sp.load_plugins()
    try:
        assert isinstance(create(made, endpoint=inproc("sgl")), SGLangPublisher)
    finally:
        plugin.unregister()


def test_our_wire_types_are_sglangs() -> None:
    """coalesce.sglang's classes (used where SGLang is absent) encode as SGLang's."""
    for ours, theirs in (
        (ours_types.EventBatch, sk.EventBatch),
        (ours_types.BlockStored, sk.BlockStored),
        (ours_types.BlockRemoved, sk.BlockRemoved),
        (ours_types.AllBlocksCleared, sk.AllBlocksCleared),
    ):
        assert ours.__struct_fields__ == theirs.__struct_fields__, theirs
        assert ours.__struct_defaults__ == theirs.__struct_defaults__, theirs
        for opt in ("array_like", "omit_defaults", "tag", "tag_field"):
            assert getattr(ours.__struct_config__, opt) == getattr(theirs.__struct_config__, opt)
    assert set(ours_types.MEDIA) == {m.value for m in sk.StorageMedium}


def wire_batches() -> list[sk.KVEventBatch]:
    big = [sstore(i, i - 1 if i else None, cache_salt="t") for i in range(1200)]
    return [
        sbatch(sstore(1)),
        sbatch(sstore(2, 1, session_id="s", lora_name="l", lora_id=3), sk.BlockRemoved([1])),
        sbatch(sk.AllBlocksCleared(), rank=5),
        sbatch(sstore(-(2**63), None, medium=None, cache_salt="salt")),
        sbatch(sstore(2**63 - 1, -7, medium=sk.StorageMedium.CPU.value)),
        sbatch(*big, *[sk.BlockRemoved([i], medium="GPU") for i in range(600)]),
    ]


def test_uncompacted_messages_and_replays_are_byte_identical_to_sglangs(
    enabled, made, make_sub
) -> None:
    ep_s, ep_c, rep_s, rep_c = inproc("s"), inproc("c"), inproc("rs"), inproc("rc")
    # both are rank 3: both bind "<endpoint>_dp3"
    sub_s = make_sub(ep_s + "_dp3", b"kv", replay=rep_s + "_dp3")
    sub_c = make_sub(ep_c + "_dp3", b"kv", replay=rep_c + "_dp3")
    theirs = sk.ZmqEventPublisher(attn_dp_rank=3, endpoint=ep_s, replay_endpoint=rep_s, topic="kv")
    made.append(theirs)
    ours = create(made, 3, endpoint=ep_c, replay_endpoint=rep_c, topic="kv")
    batches = wire_batches()
    publish_both(theirs, ours, batches, sub_s, sub_c)
    assert DEC.decode(sub_c.messages[1][2]).events[0].session_id == "s"
    for start in (0, 2, len(batches)):
        assert sub_c.replay(start) == sub_s.replay(start)


def test_a_req_client_gets_the_same_first_reply(enabled, made, make_sub) -> None:
    """SGLang's replay to a REQ client: one reply per request, the first message."""
    replies = []
    for name, make in (
        ("s", lambda ep, rep: sk.ZmqEventPublisher(0, endpoint=ep, replay_endpoint=rep)),
        ("c", lambda ep, rep: create(made, endpoint=ep, replay_endpoint=rep)),
    ):
        ep, rep = inproc(name), inproc(name + "r")
        sub = make_sub(ep)
        pub = make(ep, rep)
        if name == "s":
            made.append(pub)
        for i in range(3):
            pub.publish(sbatch(sstore(i), ts=float(i)))
        sub.recv_until_seq(2)
        replies.append(replay_request(rep, 1))
    assert replies[0] == replies[1] and int.from_bytes(replies[0][1], "big") == 1


@pytest.mark.parametrize(
    ("attn_dp_size", "attn_dp_rank", "dp_rank"), [(1, 0, None), (1, 0, 3), (4, 2, 0), (4, 3, 1)]
)
def test_dp_rank_offsets_as_sglang_computes_them(
    enabled, made, make_sub, attn_dp_size, attn_dp_rank, dp_rank
) -> None:
    rank = sk.select_kv_publisher_dp_rank(attn_dp_size, attn_dp_rank, dp_rank)
    for ep in ("tcp://*:5557", "tcp://10.0.0.1:6000", "inproc://kv", None):
        assert offset_endpoint(ep, rank) == sk.ZmqEventPublisher.offset_endpoint_port(ep, rank)
    port = free_port()
    pub = create(made, rank, endpoint=f"tcp://*:{port - rank}")
    sub = make_sub(f"tcp://127.0.0.1:{port}")
    msg = sub.publish_until_heard(lambda i: pub.publish(sbatch(sstore(i))))
    assert DEC.decode(msg[2]).attn_dp_rank == rank


def test_describe_local_source_is_sglangs(enabled, made, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cases = [
        lambda p, r: {"endpoint": f"tcp://*:{p}", "replay_endpoint": f"tcp://*:{r}", "topic": "k"},
        lambda p, r: {"endpoint": f"tcp://0.0.0.0:{p}"},
        lambda p, r: {"endpoint": f"tcp://127.0.0.1:{p}", "bind": True},
        lambda p, r: {"endpoint": f"tcp://127.0.0.1:{p}"},  # connects: nothing to advertise
        lambda p, r: {"endpoint": f"ipc://kv-events-{p}"},
        lambda p, r: {"endpoint": f"inproc://kv-{p}"},
    ]
    for fields in cases:
        # each its own ports: a closed socket's port may not be free again at once
        p1, r1, p2, r2 = (free_port() for _ in range(4))
        rank = 0 if "ipc" in fields(0, 0)["endpoint"] else 1  # ipc takes no rank offset
        theirs = sk.ZmqEventPublisher(attn_dp_rank=rank, **fields(p1 - rank, r1 - rank))
        want = json.dumps(theirs.describe_local_source(32))
        theirs.shutdown()
        ours = create(made, rank, **fields(p2 - rank, r2 - rank))
        got = json.dumps(ours.describe_local_source(32))
        assert got == want.replace(str(p1), str(p2)).replace(str(r1), str(r2)), fields(0, 0)


def test_compacted_stream_decodes_with_sglangs_types_and_keeps_state(
    enabled, made, make_sub
) -> None:
    ep = inproc("pub")
    sub = make_sub(ep)
    pub = create(made, endpoint=ep, max_queue_size=100)
    batches = []
    for i in range(2000):  # CPU offload: a GPU removal, a CPU store, with a tenant's salt
        h = -(10**6) - i
        batches.append(
            sbatch(
                sk.BlockRemoved([h], medium="GPU"),
                sstore(h, h + 1 if i % 8 else None, medium="CPU_PINNED", cache_salt="tenant"),
                ts=float(i),
            )
        )
    with held(pub):  # the sender cannot run: 2,000 batches over a queue of 100, no wait
        outcomes = [pub.publish(msgspec.structs.replace(b)) for b in batches]
    assert set(outcomes) == {PublishOutcome.QUEUED}
    assert pub.flush(30)
    st = pub.stats()
    assert st.batches_dropped == 0 and st.messages_sent < len(batches)
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    assert [m[1] for m in msgs] == list(range(len(msgs)))
    received = [DEC.decode(m[2]) for m in msgs]
    assert {b.attn_dp_rank for b in received} == {0}
    assert {e.cache_salt for b in received for e in b.events if isinstance(e, sk.BlockStored)} == {
        "tenant"
    }
    for mode in MODES:
        want = SubscriberModel(mode).apply_batches(batches).state()
        assert SubscriberModel(mode).apply_batches(received).state() == want, mode


def test_a_loss_marker_decodes_with_sglangs_types_and_leaves_no_hole(
    enabled, made, make_sub, monkeypatch
) -> None:
    monkeypatch.setenv("COALESCE_STALL_TIMEOUT", "0")  # a sender that cannot run is stalled
    ep = inproc("pub")
    sub = make_sub(ep)
    pub = create(made, endpoint=ep, max_queue_size=2)
    with held(pub):
        outcomes = [pub.publish(sbatch(sstore(i))) for i in range(10)]
    assert outcomes.count(PublishOutcome.DROPPED) == 8
    assert pub.flush(10)
    assert pub.publish(sbatch(sstore(99))) is PublishOutcome.QUEUED
    assert pub.flush(10)
    st = pub.stats()
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    assert [m[1] for m in msgs] == list(range(len(msgs)))
    decoded = [DEC.decode(m[2]) for m in msgs]
    assert sum(b.events == [sk.AllBlocksCleared()] for b in decoded) == st.loss_markers == 1


def test_a_resync_decodes_with_sglangs_types_and_keeps_cache_salt(
    enabled, made, make_sub, monkeypatch
) -> None:
    """``loss_marker=resync`` for SGLang: past the budget the backlog collapses into the
    recorder, then the marker and the state, decoded with SGLang's own types: every
    model ends with the state of every batch published, and each store of the
    resync is one SGLang's publisher carried, ``cache_salt`` included."""
    monkeypatch.setenv("COALESCE_STALL_TIMEOUT", "0")
    monkeypatch.setenv("COALESCE_LOSS_MARKER", "resync")
    ep = inproc("pub")
    sub = make_sub(ep)
    pub = create(made, endpoint=ep, max_queue_size=2)
    batches = [
        sbatch(sstore(i, i - 1 if i % 4 else None, medium="CPU_PINNED", cache_salt=f"t{i % 3}"))
        for i in range(12)
    ] + [sbatch(sk.BlockRemoved(block_hashes=[1, 2], medium="CPU_PINNED"))]
    with held(pub):
        outcomes = [pub.publish(b) for b in batches]
    assert outcomes.count(PublishOutcome.DROPPED) == len(batches) - 2
    assert pub.flush(10)
    st = pub.stats()
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    decoded = [DEC.decode(m[2]) for m in msgs]
    assert decoded[0].events == [sk.AllBlocksCleared()] and st.resyncs == 1
    stores = [e for b in batches for e in b.events if isinstance(e, sk.BlockStored)]
    for ev in (e for b in decoded for e in b.events if isinstance(e, sk.BlockStored)):
        assert ev in stores, "a resync store is one the publisher was given, whole"
    for mode in MODES:
        want = SubscriberModel(mode).apply_batches(batches).state()
        assert SubscriberModel(mode).apply_batches(decoded).state() == want, mode


def test_the_seed_bug_sglang_blocks_and_coalesce_does_not(made) -> None:
    theirs = sk.ZmqEventPublisher(attn_dp_rank=0, endpoint=inproc("s"), max_queue_size=2)
    ours = SGLangPublisher(endpoint=inproc("c"), max_queue_size=2, stall_timeout=0.2)
    stall = assert_the_seed_bug(made, theirs, ours, lambda i: sbatch(sstore(i)))
    stall.release.set()
    assert ours.flush(10)


def test_the_knobs_come_from_coalesce_variables(enabled, made, monkeypatch) -> None:
    monkeypatch.setenv("COALESCE_HIGH_WATERMARK", "3")
    pub = create(made, endpoint=inproc("sgl"))
    assert pub.settings.high_watermark == 3
    monkeypatch.setenv("COALESCE_MOVE_EVENTS", "1")
    with pytest.raises(ValueError, match="not available for SGLang"):
        create(made, endpoint=inproc("sgl"))
    assert os.environ["COALESCE_KV_EVENTS"] == "1"
