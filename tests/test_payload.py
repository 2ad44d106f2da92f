"""The payload path (``compact_payload``): the rules on encoded bytes, against the oracle.

For a window of events encoded as the sender encodes a folded batch, the C
payload path must return exactly the bytes msgspec writes for what the
pure-Python rules return on the same events, with the same counts, and the
very same payload object when nothing changed.  Windows mixing two classes
with the same tags (which the bytes cannot tell apart) must leave every
reference subscriber model in the raw window's state.  Whatever bytes it is
given, it declines or returns valid msgpack, and never crashes.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coalesce import compactor
from coalesce.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from coalesce.refmodel import MODES, SubscriberModel
from tests.streams import batch_lists
from tests.test_accel import (
    BYTES_POOL,
    OtherCleared,
    OtherRemoved,
    OtherStored,
    a_removal,
    a_store,
    ints,
    offload_run,
)

if compactor._accel is None:  # test_accel fails the run when the accelerator is required
    pytest.skip("the C accelerator is not built", allow_module_level=True)

ENC = msgspec.msgpack.Encoder()
ID = b"\x07" * 16
RELEASE = st.sampled_from([0, 1 << 40])  # released for every payload, or never


def family_lists(hashes: Any, other: bool) -> Any:
    one = st.one_of(
        a_store(hashes, other),
        a_store(hashes, other),
        a_removal(hashes, other),
        st.just(other).map(_clear),
    )
    return st.lists(one, max_size=40)


def _clear(other: bool) -> Any:
    return OtherCleared() if other else AllBlocksCleared()


def encode(events: list[Any], with_id: bool, rank: int | None = 0) -> bytes:
    if with_id:
        return ENC.encode((1.5, events, rank, ID))
    return ENC.encode(KVEventBatch(ts=1.5, events=events, data_parallel_rank=rank))


def assert_matches(events: list[Any], with_id: bool, release_at: int) -> None:
    payload = encode(events, with_id)
    result = compactor.compact_payload(payload, release_at)
    assert result is not None, "a window of accepted values was declined"
    out, n_out, superseded, cancelled, merged = result
    counts: Counter[str] = Counter()
    want = compactor._compact_events_py(list(events), False, counts)
    assert out == encode(want, with_id)
    assert n_out == len(want)
    assert (superseded, cancelled, merged) == (
        counts["superseded"],
        counts["cancelled"],
        counts["merged"],
    )
    unchanged = len(want) == len(events) and all(a is b for a, b in zip(want, events, strict=True))
    assert (out is payload) == unchanged


@given(st.booleans().flatmap(lambda o: family_lists(ints, o)), st.booleans(), RELEASE)
def test_int_hashes_give_the_python_rules_bytes(
    events: list[Any], with_id: bool, release_at: int
) -> None:
    assert_matches(events, with_id, release_at)


@given(st.booleans().flatmap(lambda o: family_lists(st.sampled_from(BYTES_POOL), o)), RELEASE)
def test_bytes_hashes_give_the_python_rules_bytes(events: list[Any], release_at: int) -> None:
    assert_matches(events, False, release_at)


@given(batch_lists(), RELEASE)
def test_model_streams_give_the_python_rules_bytes(
    batches: list[KVEventBatch], release_at: int
) -> None:
    assert_matches([e for b in batches for e in b.events], True, release_at)


class _AnyStored(msgspec.Struct, tag="BlockStored"):
    """Either family's store, as a lenient subscriber decodes it (the models read these)."""

    block_hashes: list[Any]
    parent_block_hash: Any = None
    medium: Any = None
    group_idx: Any = None


class _AnyRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: Any = None
    group_idx: Any = None


class _AnyCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _AnyBatch(msgspec.Struct, array_like=True):
    ts: Any
    events: list[_AnyStored | _AnyRemoved | _AnyCleared]
    rank: Any = None


def _lenient(payload: bytes) -> list[Any]:
    return msgspec.msgpack.decode(payload, type=_AnyBatch).events


def _states(events: list[Any]) -> list[dict[Any, int]]:
    return [
        SubscriberModel(m).apply_batches([KVEventBatch(ts=0.0, events=events)]).state()
        for m in MODES
    ]


def _other(ev: Any) -> Any:
    """The same event in the other family (other field order, an extra field)."""
    if isinstance(ev, BlockStored):
        return OtherStored(
            ev.medium, ev.block_hashes, ev.block_size, ev.parent_block_hash, ev.token_ids
        )
    if isinstance(ev, BlockRemoved):
        return OtherRemoved(ev.medium, ev.block_hashes)
    return OtherCleared()


@given(batch_lists(), st.data())
def test_mixed_classes_leave_every_model_in_the_raw_state(
    batches: list[KVEventBatch], data: Any
) -> None:
    """Two classes with one tag encode alike: the bytes may merge them where the
    object rules do not, and every model must still end where the raw window does.
    (Streams from the hash forest: as in vLLM, a hash always names the same parent,
    which the chain rule relies on; docs/event-semantics.md.)"""
    events = [_other(e) if data.draw(st.booleans()) else e for b in batches for e in b.events]
    raw = encode(events, False)
    result = compactor.compact_payload(raw, 1 << 40)
    assert result is not None
    assert _states(_lenient(result[0])) == _states(_lenient(raw))


def test_a_long_offload_run_shrinks_and_matches() -> None:
    events = offload_run()
    assert_matches(events, False, 0)
    result = compactor.compact_payload(encode(events, False), 0)
    assert result is not None and result[1] < len(events)
    assert len(result[0]) < len(encode(events, False))


def test_what_it_cannot_read_it_declines() -> None:
    good = encode([BlockRemoved([1], "GPU"), BlockRemoved([2], "GPU")], False)
    assert compactor.compact_payload(good) is not None
    for bad in [
        b"",
        b"\xc1",
        good[:-1],
        good + b"\x00",
        ENC.encode([1.0, [], 0, ID, 5]),  # five elements
        ENC.encode((1.0, [{"type": "Other"}], 0)),  # an unknown tag
        ENC.encode((1.0, [{"kind": "BlockRemoved", "block_hashes": [1], "medium": None}], 0)),
        ENC.encode((1.0, [{"type": "BlockRemoved", "block_hashes": [-1], "medium": None}], 0)),
        ENC.encode((1.0, [{"type": "BlockRemoved", "block_hashes": [1.0], "medium": None}], 0)),
        ENC.encode((1.0, [{"type": "BlockRemoved", "block_hashes": [1]}], 0)),  # no medium
        ENC.encode((1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}], 0)),
        ENC.encode(
            (
                1.0,
                [{"type": "BlockRemoved", "block_hashes": [1], "medium": None, "group_idx": True}],
                0,
            )
        ),
        ENC.encode((1.0, [{"type": "AllBlocksCleared", "x": 1}], 0)),
        ENC.encode(
            (
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [],
                        "parent_block_hash": None,
                        "token_ids": [],
                        "block_size": 2,
                        "medium": None,
                    }
                ],
                0,
            )
        ),  # an empty store
    ]:
        assert compactor.compact_payload(bad) is None, bad


@given(st.binary(max_size=200))
def test_random_bytes_never_crash_it(data: bytes) -> None:
    result = compactor.compact_payload(data, 0)
    try:
        msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return
    if result is not None:
        msgspec.msgpack.decode(result[0])


@given(batch_lists(), st.data())
def test_damaged_payloads_are_declined_or_still_msgpack(
    batches: list[KVEventBatch], data: Any
) -> None:
    payload = bytearray(encode([e for b in batches for e in b.events], True))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    result = compactor.compact_payload(bytes(payload), 0)
    try:
        msgspec.msgpack.decode(bytes(payload))
    except msgspec.DecodeError:
        return  # not msgpack (a str's bytes are not UTF-8, say): it only must not crash
    if result is not None:
        msgspec.msgpack.decode(result[0])  # what it accepted was msgpack, so is its result


def _offload(n: int) -> bytes:
    events: list[Any] = []
    for h in range(1, n):
        events.append(BlockStored([h], h - 1 if h > 1 else None, [h] * 16, 16, None, "GPU", None))
        events.append(BlockRemoved([h], "GPU"))
    return encode(events, False)


@pytest.mark.parametrize("release_at", [0, 1 << 40])
def test_the_gil_is_released_from_release_at(release_at: int) -> None:
    """The call releases the GIL exactly when the payload has ``release_at`` bytes or
    more: the C module counts its releases, so no thread scheduling is observed."""
    from coalesce import _ccompact

    payload = _offload(100_000)
    before = _ccompact.gil_releases()
    result = compactor.compact_payload(payload, release_at)
    assert result is not None
    assert _ccompact.gil_releases() - before == (1 if release_at == 0 else 0)


def test_two_threads_at_once_each_get_a_whole_answer() -> None:
    """One state per entry point: a call that finds it busy declines, never mixes."""
    payload = _offload(20_000)
    want = compactor.compact_payload(payload, 1 << 40)
    answers: list[Any] = []

    def run() -> None:
        for _ in range(20):
            answers.append(compactor.compact_payload(payload, 0))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == 40
    assert all(a is None or a == want for a in answers)
    assert any(a is not None for a in answers)


@pytest.mark.parametrize("tail", ["in a window", "taken 1:1"])
def test_the_helpers_window_goes_out_before_a_later_loss(make_sub: Any, tail: str) -> None:
    """A window in the helper thread is sent before the gap of a batch taken after
    it that cannot be encoded: the gap follows the window on the wire, as in
    publish order (and the recorder sees them in that order)."""
    from unittest import mock

    from coalesce import CoalescingPublisher, PublishOutcome, _sender
    from tests.conftest import decode, held, inproc

    ep = inproc("pub")
    sub = make_sub(ep)
    good = [KVEventBatch(float(i), [BlockRemoved([i], "GPU")]) for i in range(4)]
    bad = KVEventBatch(9.0, [BlockStored([9], None, [object()], 1, None, "GPU", None)])  # type: ignore[list-item]
    after = KVEventBatch(10.0, [BlockRemoved([10], "GPU")])
    with (
        mock.patch.object(_sender, "PAYLOAD_RELEASE_AT", 0),  # every window to the helper
        CoalescingPublisher(
            endpoint=ep,
            high_watermark=1,
            max_events_per_step=4,
            payload_rules=True,
            loss_marker="gap",
        ) as p,
    ):
        with held(p):  # the 4 good ones are one window; then the bad one
            for b in [*good, bad, *([after] if tail == "in a window" else [])]:
                assert p.publish(b) is PublishOutcome.QUEUED
        assert p.flush(10)
        if tail == "taken 1:1":
            assert p.publish(after) is PublishOutcome.QUEUED
            assert p.flush(10)
        st_ = p.stats()
        assert st_.payload_passes >= 1 and st_.encode_failures == 1 and st_.seq_gaps == 1
    msgs = sub.recv_until_seq(2)
    got = [([h for e in decode(m[2]).events for h in e.block_hashes], m[1]) for m in msgs]
    assert got == [([0, 1, 2, 3], 0), ([10], 2)], "the window, then the gap, then the rest"
