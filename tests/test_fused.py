"""The fused encoder: a batch encoded as msgspec encodes it and recorded, in one pass.

``Recorder.encode`` (the C state's ``encode_record``) must write exactly the
bytes ``msgspec.msgpack.Encoder().encode`` writes, and leave exactly the state
``Recorder.record`` leaves; where it cannot (a value or a class it does not
write), it must decline with nothing recorded, so that the caller's encode and
record give the same.  The oracle is msgspec itself and the C state's own
record path (whose oracle in turn is the pure-Python recorder:
tests/test_recorder_c.py).
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce import CoalescingPublisher, _fused, _recorder
from coalesce._recorder import Recorder
from coalesce.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored, KVEventBatch
from tests.conftest import Sub, free_port

pytestmark = pytest.mark.skipif(_recorder._accel is None, reason="the C recorder is not built")

ENC = msgspec.msgpack.Encoder()
U64 = st.integers(0, 2**64 - 1)
INTS = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(-40, 300))
TEXT = st.one_of(
    st.sampled_from(("GPU", "CPU", "")), st.text(max_size=40), st.text(min_size=256, max_size=300)
)
ATOMS = st.one_of(st.none(), st.booleans(), INTS, st.floats(), TEXT, st.binary(max_size=300))
NESTED = st.recursive(
    ATOMS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner)),
    max_leaves=8,
)


class Odd(enum.Enum):
    A = "GPU"


class Small(enum.IntEnum):
    ONE = 1


@st.composite
def stores(draw: Any) -> BlockStored:
    hs = draw(st.lists(st.one_of(U64, st.binary(min_size=1, max_size=40)), min_size=0, max_size=20))
    n = len(hs)
    return BlockStored(
        block_hashes=hs,
        parent_block_hash=draw(st.one_of(st.none(), U64)),
        token_ids=draw(st.lists(INTS, max_size=40)),
        block_size=draw(st.integers(0, 2**20)),
        lora_id=draw(st.one_of(st.none(), INTS)),
        medium=draw(st.one_of(st.none(), TEXT)),
        lora_name=draw(st.one_of(st.none(), TEXT)),
        extra_keys=draw(
            st.one_of(
                st.none(), st.lists(st.one_of(st.none(), st.tuples(NESTED)), min_size=n, max_size=n)
            )
        ),
        group_idx=draw(st.sampled_from((None, None, 0, 1, 2**40))),
        kv_cache_spec_kind=draw(st.one_of(st.none(), TEXT)),
        kv_cache_spec_sliding_window=draw(st.one_of(st.none(), INTS)),
        locality=draw(st.sampled_from((None, None, "LOCAL", "rack-é"))),
        ownership=draw(st.sampled_from((None, None, "owned"))),
        session_id=draw(st.one_of(st.none(), TEXT)),
        lookahead_token_ids=draw(
            st.one_of(st.none(), st.lists(st.lists(INTS, max_size=3), max_size=3))
        ),
    )


@st.composite
def removals(draw: Any) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=draw(st.lists(st.one_of(U64, st.binary(min_size=1, max_size=8)), max_size=6)),
        medium=draw(st.one_of(st.none(), st.sampled_from(("GPU", "CPU")))),
        group_idx=draw(st.sampled_from((None, 0, 1))),
        locality=draw(st.sampled_from((None, "LOCAL"))),
    )


@st.composite
def batches(draw: Any) -> list[KVEventBatch]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        evs = draw(st.lists(st.one_of(stores(), removals(), stores()), max_size=8))
        ts = draw(st.one_of(st.floats(), st.just(float(i))))
        rank = draw(st.one_of(st.none(), st.integers(-5, 2**40)))
        out.append(KVEventBatch(ts=ts, events=evs, data_parallel_rank=rank))
    return out


def on_the_wire(rec: Recorder) -> tuple[Any, ...]:
    """``rec``'s state with each kept event as its encoding, and its program's
    events as theirs: the fused path keeps a store as the bytes it wrote (a walk
    hands it out as a ``msgspec.Raw``), the apart path keeps the event itself; a
    subscriber reads the same either way."""
    live, sources, refs, n = rec.export()
    sources = {sid: (ENC.encode(s[0]), *s[1:]) for sid, s in sources.items()}
    program = [ENC.encode(ev) for ch in rec.chunks() for ev in ch]
    return live, sources, refs, n, program


def fused_then_apart(rec: Recorder, batch: Any) -> bytes:
    """What the sender does: the fused path, or else encode and record apart."""
    payload = rec.encode(batch)
    if payload is None:
        payload = ENC.encode(batch)
        rec.record(batch)
    return payload


@settings(max_examples=300, deadline=None)
@given(batches())
def test_the_fused_bytes_are_msgspecs_and_the_state_is_records(given_batches):
    fused, apart = Recorder(10**9), Recorder(10**9)
    taken = 0
    for b in given_batches:
        before = fused._cs.encoded
        assert fused_then_apart(fused, b) == ENC.encode(b)
        taken += fused._cs.encoded - before
        apart.record(b)
        assert on_the_wire(fused) == on_the_wire(apart)
        assert (fused.held, fused.batches, fused.events) == (
            apart.held,
            apart.batches,
            apart.events,
        )
    assert fused.state() == apart.state()
    assert on_the_wire(fused) == on_the_wire(apart)
    assert taken == len(given_batches), "every value here is one the fused encoder writes"


def _store(h: int, **kw: Any) -> BlockStored:
    fields = dict(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    fields.update(kw)
    return BlockStored(**fields)


@pytest.mark.parametrize(
    "odd",
    [
        _store(1, extra_keys=[({"a": 1},)]),  # a dict: msgspec writes maps, this encoder does not
        _store(1, medium=Odd.A),  # an enum
        _store(1, lora_id=Small.ONE),  # an int subclass
        _store(1, token_ids=[2**64]),  # past 64 bits: msgspec raises
        _store(1, token_ids=[5, 2**64]),  # the same, after a run of ints
        _store(1, token_ids=[5, 6, Small.ONE]),  # an int subclass after a run of ints
        _store(1, extra_keys=[((((((((((1,),),),),),),),),),)]),  # nested deeper than it writes
        _store(1, medium=msgspec.UNSET),
    ],
    ids=[
        "dict",
        "enum",
        "int subclass",
        "int past 64 bits",
        "past 64 bits after ints",
        "int subclass after ints",
        "deep nesting",
        "unset",
    ],
)
def test_a_value_it_does_not_write_declines_with_nothing_recorded(odd):
    rec = Recorder(10**9)
    rec.record(KVEventBatch(ts=0.0, events=[_store(7)]))
    before = rec.export(), rec.batches, rec._cs.encoded
    batch = KVEventBatch(ts=1.0, events=[_store(8), _store(9, medium="NEW"), odd])
    assert rec.encode(batch) is None
    assert (rec.export(), rec.batches, rec._cs.encoded) == before
    assert rec.valid


def test_clears_and_moves_are_recorded_apart():
    rec = Recorder(10**9)
    for ev in (AllBlocksCleared(), BlockMoved([1], None, [], 2, None, "GPU", "CPU", None)):
        batch = KVEventBatch(ts=0.0, events=[_store(3), ev])
        assert rec.encode(batch) is None
        rec.record(batch)
    assert rec._cs.encoded == 0 and rec.valid


def test_a_store_taken_is_kept_as_its_bytes_and_read_back_where_python_takes_over():
    """The fused path keeps a store as the bytes it wrote for it (so dropping it is
    a free, not the release of a score of Python objects long out of the caches):
    the program hands them out as a Raw, the wire unchanged; moving the state to
    the Python recorder decodes them as their class."""
    rec = Recorder(10**9)
    tokens = list(range(1000, 1000 + 32))
    store = _store(5, token_ids=tokens, block_size=32)
    batch = KVEventBatch(ts=1.0, events=[store, _store(6, parent_block_hash=5)])
    assert rec.encode(batch) == ENC.encode(batch)
    kept = rec._cs.export()[1][0][0]
    assert type(kept) is tuple and kept[0] is BlockStored and type(kept[1]) is msgspec.Raw
    assert bytes(kept[1]) == ENC.encode(store)
    program = [ev for ch in rec.chunks() for ev in ch]
    assert [type(ev) for ev in program] == [msgspec.Raw, msgspec.Raw]
    assert [bytes(ev) for ev in program] == [ENC.encode(ev) for ev in batch.events]
    assert rec.export()[1][0][0] == store  # (read back: decoded as its class)
    # an event the C loop cannot read (a float hash) moves the state to Python
    rec.record(KVEventBatch(ts=2.0, events=[_store(7), BlockRemoved([1.5], medium="GPU")]))
    assert not rec._cmode and rec.valid
    assert rec.state() == {("GPU", None, 5): 1, ("GPU", None, 6): 1, ("GPU", None, 7): 1}
    program = [ENC.encode(ev) for ch in rec.chunks() for ev in ch]
    assert program == [ENC.encode(ev) for ev in (*batch.events, _store(7))]


def test_a_dropped_store_kept_as_bytes_frees_them():
    rec = Recorder(10**9)
    rec.encode(KVEventBatch(ts=0.0, events=[_store(h, token_ids=[h] * 16) for h in range(100)]))
    full = rec._cs.nbytes
    rec.encode(KVEventBatch(ts=1.0, events=[BlockRemoved(list(range(100)), medium="GPU")]))
    assert rec.held == 0 and rec._cs.sources == 0
    assert rec._cs.nbytes < full - 100 * len(ENC.encode(_store(0, token_ids=[0] * 16)))


class _Tagged(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class ListFactory(_Tagged, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] = msgspec.field(default_factory=list)
    medium: str | None = "GPU"


class DictFactory(_Tagged, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    meta: dict[str, int] = msgspec.field(default_factory=dict)


class Renamed(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    tag="BlockRemoved",
    tag_field="kind",
    rename="camel",
):
    block_hashes: list[int]
    medium: str | None = None


class OtherBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class NotABatch(msgspec.Struct, array_like=True, gc=False):
    events: list[Any]
    ts: float
    data_parallel_rank: int | None = None


def test_other_classes_are_learned_from_msgspecs_metadata():
    """A list factory (an empty list left out, like msgspec), a renamed tag field
    and renamed fields, another batch class: taken on first sight."""
    rec = Recorder(10**9)
    evs = [
        ListFactory([1], None),
        ListFactory([2], 1, [5, 6], None),
        Renamed([1, 2], "CPU"),
        Renamed([3]),
    ]
    batch = OtherBatch(ts=2.0, events=evs, data_parallel_rank=3)
    apart = Recorder(10**9)
    assert rec.encode(batch) == ENC.encode(batch)
    apart.record(batch)
    assert rec.export() == apart.export() and rec._cs.encoded == 1


def test_a_default_factory_it_does_not_write_and_another_batch_shape_decline():
    rec = Recorder(10**9)
    assert rec.encode(OtherBatch(ts=0.0, events=[DictFactory([1], None)])) is None
    assert rec.encode(NotABatch(events=[_store(1)], ts=0.0)) is None
    assert rec._cs.encoded == 0 and rec.held == 0


def test_past_the_budget_the_batch_is_sent_and_the_recorder_says_unavailable():
    rec = Recorder(2)
    batch = KVEventBatch(ts=0.0, events=[_store(1), _store(2), _store(3)])
    assert rec.encode(batch) == ENC.encode(batch)
    assert not rec.valid and "snapshot_max_blocks=2" in rec.reason
    assert rec.encode(batch) is None  # unavailable: the caller records it (a clear is looked for)


def test_a_batch_class_written_unlike_msgspec_is_encoded_apart_from_then_on(caplog):
    class Probe(msgspec.Struct, array_like=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    batch = Probe(ts=0.0, events=[_store(1)])
    with caplog.at_level(logging.WARNING, logger="coalesce"):
        assert _fused.checked(batch, b"\x90") == ENC.encode(batch)  # a wrong payload: msgspec's
    assert "unlike msgspec" in caplog.text and Probe not in _fused.TRUSTED
    rec, apart = Recorder(10**9), Recorder(10**9)
    assert rec.encode(batch) == ENC.encode(batch), "msgspec's bytes from then on"
    apart.record(batch)
    assert rec.export() == apart.export(), "and the batch recorded all the same"


def test_an_event_class_learned_later_is_checked_against_msgspec_too(caplog, monkeypatch):
    """A batch class already trusted meets an event class first seen now: that
    batch is compared with msgspec's bytes again, and a misread (simulated: the
    taught layout names the tag wrongly) sends msgspec's bytes from then on."""

    class Batch(msgspec.Struct, array_like=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class Late(_Tagged, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None = None

    rec, apart = Recorder(10**9), Recorder(10**9)
    first = Batch(ts=0.0, events=[_store(1)])
    assert rec.encode(first) == ENC.encode(first) and Batch in _fused.TRUSTED
    real_layout = _fused._event_layout

    def misread(cls: type) -> Any:
        tagkv, fields = real_layout(cls)
        return tagkv.replace(b"BlockRemoved", b"BlockRemovex"), fields

    monkeypatch.setattr(_fused, "_event_layout", misread)
    later = Batch(ts=1.0, events=[Late([1], "GPU")])
    with caplog.at_level(logging.WARNING, logger="coalesce"):
        assert rec.encode(later) == ENC.encode(later), "msgspec's bytes, not the misread ones"
    assert "unlike msgspec" in caplog.text and Batch not in _fused.TRUSTED
    again = Batch(ts=2.0, events=[Late([2], "GPU")])
    assert rec.encode(again) == ENC.encode(again)
    for b in (first, later, again):
        apart.record(b)
    assert rec.export() == apart.export(), "recorded all the same"


def test_a_resync_publisher_encodes_and_records_in_one_pass_on_the_wire_msgspec_writes():
    port = free_port()
    pub = CoalescingPublisher(0, endpoint=f"tcp://*:{port}", loss_marker="resync")
    sub = Sub(f"tcp://127.0.0.1:{port}")
    try:
        sub.publish_until_heard(lambda i: pub.publish(KVEventBatch(ts=-1.0, events=[])))
        sent = []
        for i in range(30):
            batch = KVEventBatch(
                ts=float(i),
                events=[_store(i + 1, parent_block_hash=i or None), BlockRemoved([i], "GPU")],
            )
            pub.publish(batch)
            assert pub.flush(10)  # one at a time: the 1:1 level, where the fused path runs
            sent.append(ENC.encode(batch))  # (as published: publish() stamps the rank)
        got: list[bytes] = []
        while len(got) < 30:  # (the probes and any heartbeat carry no events)
            payload = sub.recv()[2]
            if msgspec.msgpack.decode(payload)[1]:
                got.append(payload)
        assert got == sent, "the bytes msgspec writes, in order"
        rec = pub._sender.feed.recorder
        assert rec._cs.encoded >= 30 and rec.held == 1 and rec.valid
    finally:
        sub.close()
        pub.shutdown()
