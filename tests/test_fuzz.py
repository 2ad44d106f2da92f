"""Fuzz (hypothesis): whatever a caller constructs, whatever arrives on the wire.

Through the real path: ``publish()`` -> compaction -> encode -> inproc PUB ->
:class:`~coalesce.subscriber.Subscriber`.  Events get wrong types in every
field (None, unhashables, huge ints, deep nesting, floats, strings), unknown
tags, and non-struct values, published back to back so that the sender
compacts them.  The assertions are the hardening contract:

- the sender is alive afterwards and a later good batch arrives;
- every loss is visible: a marker store in each accepted batch is held by
  the subscriber unless the subscriber knows its index may be wrong (it saw a
  gap, reset, or joined after a loss);
- the subscriber never raises, and its counters add up.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coalesce import (
    AllBlocksCleared,
    BlockStored,
    CoalescingPublisher,
    KVEventBatch,
    PublishOutcome,
)
from coalesce.subscriber import Subscriber
from tests.conftest import held, inproc, wait_for
from tests.streams import removals, stores


class Teleported(msgspec.Struct, tag="BlockTeleported"):
    """An event kind nobody knows."""

    block_hashes: list[Any]


class Deep(list):  # type: ignore[type-arg]
    """A list nested 3,000 deep, with a short repr (hypothesis prints failing examples)."""

    def __repr__(self) -> str:
        return "Deep(3000)"


def _deep(n: int) -> Deep:
    x: Any = 0
    for _ in range(n):
        x = [x]
    return Deep([x])


_DEEP = _deep(3000)
weird = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.just({"a": 1}),
    st.just(_DEEP),
    st.lists(st.one_of(st.integers(-3, 3), st.none(), st.just([1]), st.just({})), max_size=3),
    st.builds(object),
)


@st.composite
def mangled(draw: Any) -> Any:
    """A valid store or removal with one to three fields replaced by anything."""
    ev = draw(st.one_of(stores(), removals))
    names = list(type(ev).__struct_fields__)
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
        setattr(ev, name, draw(weird))
    return ev


events = st.one_of(
    stores(),
    removals,
    st.just(AllBlocksCleared()),
    mangled(),
    mangled(),
    st.builds(Teleported, st.lists(weird, max_size=2)),
    weird,
)

MARK = 1 << 40


def marker(i: int) -> BlockStored:
    """A store nothing else names: it survives every compaction rule except a clear."""
    return BlockStored([MARK + i], None, [], 2, None, "MARK", None)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    st.lists(st.lists(events, max_size=6), min_size=1, max_size=12),
    st.sampled_from(("clear", "gap")),
)
def test_whatever_is_published_goes_out_or_is_lost_visibly(batches, loss_marker):
    ep = inproc("pub")
    with Subscriber(ep, mode="refcount") as sub:  # connected before the bind
        pub = CoalescingPublisher(
            endpoint=ep,
            high_watermark=1,
            loss_marker=loss_marker,
        )
        try:
            accepted: list[int] = []
            with held(pub):  # back to back: the sender compacts them
                for i, evs in enumerate(batches):
                    outcome = pub.publish(KVEventBatch(float(i), [*evs, marker(i)]))
                    if outcome is PublishOutcome.QUEUED:
                        accepted.append(i)
            assert pub.flush(30)
            sentinel = len(batches)
            assert pub.publish(KVEventBatch(0.0, [marker(sentinel)])) is PublishOutcome.QUEUED
            assert pub.flush(30)
            st_ = pub.stats()
            assert st_.sender_alive, "no input stops the sender"
            last = st_.messages_sent + st_.seq_gaps - 1
            wait_for(
                lambda: sub.poll(0.01) >= 0 and sub.sources[0].last_seq == last,
                what="the sentinel",
            )
        finally:
            pub.shutdown()
        src = sub.sources[0]
        assert src.messages == st_.messages_sent, "every message sent was handled"
        assert src.gaps <= st_.seq_gaps, "inproc drops nothing: every gap is a loss"
        lost = st_.encode_failures + st_.batches_dropped
        shown = st_.seq_gaps if loss_marker == "gap" else st_.loss_markers
        assert (lost > 0) == (shown > 0), "a loss, and only a loss, is shown on the wire"
        assert (st_.seq_gaps, st_.loss_markers)[loss_marker == "gap"] == 0, "in one form only"
        have = {h for (m, _, h) in src.index.state() if m == "MARK"}
        # it knows its index may be wrong: a reset or a gap; or a marker made it forget
        knows = src.resets or src.gaps or src.partial or st_.loss_markers
        assert MARK + sentinel in have or knows
        if loss_marker == "clear":  # every loss shown before the sentinel: it is held
            assert MARK + sentinel in have or src.resets
        if not knows:  # the subscriber believes it is right: it must be
            cleared_after = [
                i for i in accepted if any(isinstance(e, AllBlocksCleared) for e in batches[i])
            ]
            start = max(cleared_after, default=-1)
            expect = {MARK + i for i in accepted if i >= start} | {MARK + sentinel}
            assert expect <= have, "an accepted batch vanished with no gap"


raw = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=4),
        st.binary(max_size=4),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
raw_events = st.one_of(
    raw,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
        optional={
            "block_hashes": raw,
            "parent_block_hash": raw,
            "medium": raw,
            "group_idx": raw,
            "token_ids": raw,
            "block_size": raw,
        },
    ),
)
payloads = st.one_of(
    st.binary(max_size=40),
    st.builds(msgspec.msgpack.encode, raw),
    st.builds(
        lambda ts, evs, rank: msgspec.msgpack.encode([ts, evs, rank]),
        raw,
        st.lists(raw_events, max_size=4),
        raw,
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), payloads), min_size=1, max_size=10))
def test_the_subscriber_never_raises_on_what_arrives(messages):
    ep = inproc("pub")
    with Subscriber(ep) as sub:
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(ep)
        try:
            seq = 0
            for step, payload in messages:  # seqs move forward by 0..3: duplicates and gaps
                seq += step
                pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            good = msgspec.msgpack.encode(KVEventBatch(0.0, [], 0))
            pub.send_multipart([b"", (seq + 1).to_bytes(8, "big"), good])
            wait_for(
                lambda: sub.poll(0.01) >= 0 and sub.sources[0].last_seq == seq + 1,
                what="the last message",
            )
        finally:
            pub.close()
        src = sub.sources[0]
        s = sub.summary()
        assert s["messages"] == src.messages >= 1
        assert src.bad_messages <= src.messages
        assert src.resets >= src.bad_messages, "an unapplied message resets the source"
        assert all(isinstance(k[2], (int, bytes)) for k in src.index.state())
