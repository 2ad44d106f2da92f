"""SGLang's shapes through the compactor and the publisher (no SGLang needed).

``coalesce.sglang`` declares SGLang 0.5.23's structs; the conformance tier
(``tests_sglang``, ``make test-sglang``) checks them and the plugin against the
real wheel.  Here: compaction keeps every model's state for SGLang events and
never puts a block under an attribution (``cache_salt``, ``session_id``,
``lora_name``, ``lora_id``), medium, parent or tokens no input store gave it;
the C rules agree with the Python ones; the publisher speaks SGLang's batch and
endpoint rules and refuses settings SGLang's consumers cannot read.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import given

from coalesce import _rules, compactor
from coalesce.events import EventBatch
from coalesce.publisher import PublishOutcome
from coalesce.refmodel import MODES, SubscriberModel
from coalesce.sglang import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SGLangPublisher,
)
from tests.conftest import held, inproc, wait_for
from tests.streams import sglang_batch_lists

ENC = msgspec.msgpack.Encoder()


def stored_blocks(batches: list[Any]) -> Counter[tuple[Any, ...]]:
    """Every block a store carries, with all it says about the block: hash, parent,
    medium, attribution, block size and tokens.  Reads the wire tag, not the classes."""
    rows: Counter[tuple[Any, ...]] = Counter()
    for b in batches:
        for e in b.events:
            if type(e).__struct_config__.tag != "BlockStored":
                continue
            size = e.block_size
            for i, h in enumerate(e.block_hashes):
                parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
                tokens = tuple(e.token_ids[i * size : (i + 1) * size]) if e.token_ids else ()
                attribution = (e.cache_salt, e.session_id, e.lora_name, e.lora_id)
                rows[(h, parent, e.medium, attribution, size, tokens)] += 1
    return rows


@given(sglang_batch_lists())
def test_compaction_keeps_every_models_state(batches: list[Any]) -> None:
    out, _ = compactor.compact(batches)
    for mode in MODES:
        want = SubscriberModel(mode).apply_batches(batches).state()
        assert SubscriberModel(mode).apply_batches(out).state() == want, mode


@given(sglang_batch_lists())
def test_compaction_never_moves_a_block_to_another_attribution(batches: list[Any]) -> None:
    out, _ = compactor.compact(batches)
    given_rows, out_rows = stored_blocks(batches), stored_blocks(out)
    assert set(out_rows) <= set(given_rows), set(out_rows) - set(given_rows)
    for row, n in out_rows.items():
        assert n <= given_rows[row]


def test_stores_with_different_attribution_do_not_chain() -> None:
    def one(h: int, parent: int | None, **attr: Any) -> BlockStored:
        return BlockStored([h], parent, [h, h], 2, None, "GPU", **attr)

    for attr in ({"cache_salt": "b"}, {"session_id": "s2"}, {"lora_name": "x"}):
        batches = [EventBatch(0.0, [one(1, None), one(2, 1, **attr)], 0)]
        out, report = compactor.compact(batches)
        assert [len(e.block_hashes) for e in out[0].events] == [1, 1], attr
    same = [EventBatch(0.0, [one(1, None, cache_salt="a"), one(2, 1, cache_salt="a")], 0)]
    out, report = compactor.compact(same)
    assert [e.block_hashes for e in out[0].events] == [[1, 2]]
    assert out[0].events[0].cache_salt == "a" and report.merged == 1


@pytest.mark.skipif(not compactor.accelerated(), reason="the C accelerator is not built")
@given(sglang_batch_lists())
def test_the_c_rules_give_the_python_result(batches: list[Any]) -> None:
    out_c, rep_c = compactor.compact(list(batches))
    accel, compactor._accel = compactor._accel, None
    try:
        out_py, rep_py = compactor.compact(list(batches))
    finally:
        compactor._accel = accel
    assert out_c == out_py and rep_c == rep_py
    assert [type(e) for b in out_c for e in b.events] == [type(e) for b in out_py for e in b.events]


@pytest.mark.skipif(not compactor.accelerated(), reason="the C accelerator is not built")
def test_the_c_rules_take_sglangs_classes_and_signed_hashes() -> None:
    """In a fresh process (this one's table of classes may be full from other tests)."""
    code = (
        "from coalesce import compactor\n"
        "from coalesce.events import EventBatch\n"
        "from coalesce.sglang import BlockStored as S, BlockRemoved as R, AllBlocksCleared as C\n"
        "evs = [S([-1], None, [], 2, None, 'GPU', cache_salt='a'), R([2**64 - 1], 'GPU'),\n"
        "       S([-(2**63)], -1, [], 2, None, 'CPU_PINNED', session_id='s'), C()]\n"
        "print(compactor._accelerated_window([EventBatch(0.0, evs, 0)], False) is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stderr


@pytest.mark.skipif(not compactor.accelerated(), reason="the C accelerator is not built")
def test_the_c_rules_tell_a_negative_hash_from_its_unsigned_twin() -> None:
    """-1 and 2**64 - 1 share their 64 bits: a store of one is not cancelled by a
    removal of the other, nor chained under it."""
    for a, b in ((-1, 2**64 - 1), (2**64 - 1, -1), (-(2**63), 2**63)):
        events = [
            BlockRemoved([a], "GPU"),
            BlockStored([a], None, [], 2, None, "GPU"),
            BlockRemoved([b], "GPU"),
            BlockStored([7], b, [], 2, None, "GPU"),
        ]
        window = [EventBatch(0.0, events, 0)]
        out, report = compactor.compact(window)
        want = _rules.compact_events(list(events), False, Counter())
        assert out[0].events == want and report.cancelled == 0
        assert [e.block_hashes for e in want if isinstance(e, BlockStored)] == [[a], [7]]


# -- the publisher ---------------------------------------------------------------------------


@pytest.fixture
def sgl_pubs(pubs):
    return lambda **kw: pubs(SGLangPublisher, **kw)


def offload(i: int) -> KVEventBatch:
    """SGLang's CPU offload step: a GPU removal, the CPU store of the same block."""
    h = 1000 + i
    return KVEventBatch(
        ts=float(i),
        events=[
            BlockRemoved(block_hashes=[h], medium="GPU"),
            BlockStored([h], None, [i, i], 2, None, "CPU_PINNED", cache_salt="tenant-a"),
        ],
    )


def test_messages_are_sglangs_bytes_and_the_rank_is_stamped(sgl_pubs, make_sub) -> None:
    ep = inproc("sgl")
    sub = make_sub(ep + "_dp3")
    p = sgl_pubs(attn_dp_rank=3, endpoint=ep)
    b = offload(1)
    assert p.publish(b) is PublishOutcome.QUEUED
    assert b.attn_dp_rank == 3, "the rank is filled in the caller's batch, as SGLang does"
    _, seq, payload = sub.recv()
    assert seq == 0 and payload == ENC.encode(b)
    got = msgspec.msgpack.decode(payload, type=KVEventBatch)
    assert got.attn_dp_rank == 3 and got.events[1].cache_salt == "tenant-a"


def test_a_backlog_compacts_and_every_model_agrees(sgl_pubs, make_sub) -> None:
    ep = inproc("sgl")
    sub = make_sub(ep)
    p = sgl_pubs(endpoint=ep, high_watermark=2)
    batches = [offload(i) for i in range(300)] + [KVEventBatch(300.0, [AllBlocksCleared()])]
    batches += [offload(i) for i in range(301, 400)]
    with held(p):
        for b in batches:
            assert p.publish(b) is PublishOutcome.QUEUED
    assert p.flush(10)
    st = p.stats()
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    assert [m[1] for m in msgs] == list(range(len(msgs)))
    assert st.messages_sent < len(batches) and st.batches_dropped == 0
    received = [msgspec.msgpack.decode(m[2], type=KVEventBatch) for m in msgs]
    for mode in MODES:
        want = SubscriberModel(mode).apply_batches(batches).state()
        assert SubscriberModel(mode).apply_batches(received).state() == want, mode
    assert stored_blocks(received).keys() <= stored_blocks(batches).keys()


def test_a_loss_is_a_clear_in_sglangs_shape(sgl_pubs, make_sub) -> None:
    ep = inproc("sgl")
    sub = make_sub(ep)
    p = sgl_pubs(endpoint=ep, max_queue_size=2, high_watermark=1, stall_timeout=0)
    with held(p):
        outcomes = Counter(p.publish(offload(i)) for i in range(10))
    assert outcomes[PublishOutcome.DROPPED] == 8
    assert p.flush(10)
    assert p.publish(offload(99)) is PublishOutcome.QUEUED
    assert p.flush(10)
    st = p.stats()
    assert st.loss_markers == 1
    msgs = sub.recv_until_seq(st.messages_sent - 1)
    assert [m[1] for m in msgs] == list(range(len(msgs)))
    batches = [msgspec.msgpack.decode(m[2], type=KVEventBatch) for m in msgs]
    markers = [b for b in batches if b.events == [AllBlocksCleared()]]
    assert len(markers) == 1 and markers[0].attn_dp_rank == 0


def test_bad_batches_raise_and_queue_nothing(sgl_pubs) -> None:
    from coalesce.events import KVEventBatch as VllmBatch

    p = sgl_pubs(endpoint=inproc("sgl"))
    with pytest.raises(TypeError, match="attn_dp_rank"):
        p.publish(VllmBatch(ts=1.0, events=[]))
    with pytest.raises(TypeError, match="attn_dp_rank must be an int"):
        p.publish(KVEventBatch(ts=1.0, events=[], attn_dp_rank="0"))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        p.publish({"ts": 1.0, "events": []})
    assert p.stats().batches_in == 0


@pytest.mark.parametrize(
    "knob",
    [
        {"snapshot_endpoint": "tcp://127.0.0.1:0"},
        {"move_events": True},
    ],
)
def test_settings_sglang_consumers_cannot_read_are_refused(knob: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="not available for SGLang"):
        SGLangPublisher(endpoint=inproc("sgl"), **knob)


def test_endpoint_rules_and_local_source(sgl_pubs, make_sub, tmp_path) -> None:
    # 0.0.0.0 binds under SGLang's rule (vLLM's would connect)
    p = sgl_pubs(attn_dp_rank=2, endpoint="tcp://0.0.0.0:0", replay_endpoint="tcp://*:0")
    src = p.describe_local_source(16)
    assert src is not None and src["endpoint"].startswith("tcp://127.0.0.1:")
    assert src["dp_rank"] == 2 and src["block_size"] == 16 and src["topic"] == ""
    assert src["replay_endpoint"].startswith("tcp://127.0.0.1:")
    sub = make_sub(src["endpoint"])
    wait_for(
        lambda: p.publish(offload(0)) is PublishOutcome.QUEUED and not sub.nothing_within(0.05)
    )
    # a concrete host binds when told to; connect-style and inproc publishers advertise nothing
    q = sgl_pubs(endpoint="tcp://127.0.0.1:0", bind=True)
    assert q.describe_local_source(16)["endpoint"] == q.config.endpoint  # type: ignore[index]
    assert sgl_pubs(endpoint=inproc("sgl")).describe_local_source(16) is None
    ipc = f"ipc://{os.path.relpath(tmp_path / 'kv')}"
    r = sgl_pubs(endpoint=ipc)
    assert r.describe_local_source(16)["endpoint"] == f"ipc://{tmp_path / 'kv'}"  # type: ignore[index]
    assert r.get_publisher_config() is r.config and r.attn_dp_rank == 0
