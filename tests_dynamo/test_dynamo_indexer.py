"""NVIDIA Dynamo's real KV indexer (ai-dynamo-runtime 1.6.1, Rust) reading this
publisher's stream, under the forced loss of tests/test_loss_markers.py.

Dynamo's indexer has no replay: a skipped seq is logged and nothing else, so
the blocks the lost batches removed stay in its index (stale: it would route
to them). A loss marker is an ``AllBlocksCleared`` it applies: it forgets the
worker, then refills from the stores that follow.  Its state is read from
``GET /dump``.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from coalesce import (
    BlockRemoved,
    BlockStored,
    CoalescingPublisher,
    KVEventBatch,
    PublishOutcome,
)
from coalesce.refmodel import SubscriberModel
from tests.conftest import free_port, held, wait_for
from tests.test_loss_markers import step

PROBE, SENTINEL = 900_001, 900_002  # hashes the workload never uses


@pytest.fixture
def indexer() -> Iterator[tuple[int, int]]:
    with _indexer() as ports:
        yield ports


@contextlib.contextmanager
def _indexer(log: Any = subprocess.DEVNULL, block_size: int = 4) -> Iterator[tuple[int, int]]:
    """A Dynamo indexer following worker 1 on a fresh port: (zmq port, http port);
    its log goes to ``log`` (a file); ``block_size``: the tokens per block it expects."""
    port, http = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo.indexer",
            "--workers",
            f"1=tcp://127.0.0.1:{port}",
            "--block-size",
            str(block_size),
            "--port",
            str(http),
            "--threads",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT if log is not subprocess.DEVNULL else log,
    )
    try:
        wait_for(lambda: _dump(http) is not None, timeout=30, what="the indexer's HTTP port")
        yield port, http
    finally:
        proc.terminate()
        proc.wait(10)


def _dump(http: int) -> set[int] | None:
    """The block hashes Dynamo holds for worker 1 (None: not answering yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/dump", timeout=2) as r:
            state = json.loads(r.read())
    except OSError:
        return None
    held: set[int] = set()
    for model in state.values():
        for entry in model["events"]:
            stored = entry["event"]["data"].get("stored")
            if entry["worker_id"] == 1 and stored is not None:
                held.update(b["block_hash"] for b in stored["blocks"])
    return held


def _store(h: int) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored([h], None, [h] * 4, 4, None, "GPU", None)])


def _join(
    pub: CoalescingPublisher, http: int, store: Callable[[int], KVEventBatch] = _store
) -> None:
    """Dynamo connects to the publisher: wait until it reads, then take the probe back
    (``store(h)``: a batch storing ``h`` in the indexer's block size)."""
    wait_for(
        lambda: (
            pub.publish(store(PROBE)) is PublishOutcome.QUEUED
            and pub.flush(5.0)
            and PROBE in (_dump(http) or set())
        ),
        timeout=30,
        what="Dynamo to read the stream",
    )
    pub.publish(KVEventBatch(0.0, [BlockRemoved([PROBE] * 100, "GPU")]))


def _read_to_the_end(
    pub: CoalescingPublisher, http: int, store: Callable[[int], KVEventBatch] = _store
) -> set[int]:
    """What Dynamo holds once it has read everything ``pub`` sent: a sentinel stored
    last (in order: once Dynamo holds it, it read the rest), then left out."""
    pub.publish(store(SENTINEL))
    assert pub.flush(10.0)
    wait_for(lambda: SENTINEL in (_dump(http) or set()), timeout=30, what="the sentinel")
    return (_dump(http) or set()) - {SENTINEL}


def _truth(batches: list[KVEventBatch]) -> set[int]:
    model = SubscriberModel("dynamo")  # its parent rule: the parent held in the same medium
    for b in batches:
        for ev in b.events:
            model.apply_event(ev)
    return {h for (_, _, h) in model.held()}


def run(
    indexer: tuple[int, int], loss_marker: str, after: int = 31, lossy: bool = True
) -> tuple[set[int], set[int], Any]:
    """31 steps, 23 with the sender held (most refused; all sent if not ``lossy``),
    then ``after`` steps: (what Dynamo holds, the model's truth, the stats)."""
    port, http = indexer
    pub = CoalescingPublisher(
        endpoint=f"tcp://*:{port}",
        max_queue_size=3,
        high_watermark=1,
        stall_timeout=0,
        loss_marker=loss_marker,
    )
    published: list[KVEventBatch] = []
    try:
        _join(pub, http)
        i = 0
        for phase in ("before", "loss", "after"):
            n = {"before": 31, "loss": 23, "after": after}[phase]
            batches = [step(j) for j in range(i, i + n)]
            i += len(batches)
            published += batches
            if phase == "loss" and lossy:
                with held(pub):  # the engine bursts while its sender cannot run
                    outcomes = [pub.publish(b) for b in batches]
                assert PublishOutcome.DROPPED in outcomes
                assert pub.flush(10.0)
            else:
                for b in batches:
                    assert pub.publish(b) is PublishOutcome.QUEUED
                    assert pub.flush(10.0)
        assert pub.flush(10.0)
        got = _read_to_the_end(pub, http)
    finally:
        pub.shutdown()
    return got, _truth(published), pub.stats()


def test_with_loss_markers_dynamo_forgets_and_keeps_nothing_stale(indexer):
    got, want, st = run(indexer, "clear")
    assert st.batches_dropped > 0 and st.loss_markers >= 1
    assert got <= want, f"stale blocks in Dynamo's index: {sorted(got - want)}"
    assert len(got) * 2 >= len(want), "it forgot the loss, then refilled"


def test_with_gaps_dynamo_keeps_what_the_lost_batches_removed(indexer):
    """Why the marker is the default: Dynamo has no replay and cannot know."""
    got, want, st = run(indexer, "gap")
    assert st.batches_dropped > 0 and st.seq_gaps >= 1
    assert got - want, "the lost removals leave stale blocks"


def test_with_an_in_band_resync_dynamo_ends_as_with_the_plain_stream(indexer):
    """Two steps after the loss: the marker alone has left it only what they stored;
    the resync sent after it restored the rest, as Dynamo holds it from a stream
    that lost nothing (a second indexer, the same batches, all sent)."""
    got, _, st = run(indexer, "resync", after=2)
    assert st.batches_dropped > 0 and st.resyncs >= 1 and st.resync_events > 0
    with _indexer() as other:
        plain, _, st_plain = run(other, "resync", after=2, lossy=False)
    assert st_plain.batches_dropped == 0
    assert got == plain
    cleared, _, _ = run(indexer, "clear", after=2)  # the same indexer: marker alone
    assert cleared < plain


@pytest.mark.parametrize(
    ("identity", "said"),
    [
        ("seq", b"Invalid sequence number length: 24"),
        ("batch", b"array had incorrect length, expected 3"),
    ],
)
def test_with_snapshots_on_dynamo_rejects_every_message(tmp_path, identity, said):
    """Snapshots on, PR #57789's id in a 24-byte seq frame or as a 4th batch element:
    Dynamo 1.6.1 says so in its log and indexes nothing; the publisher's start-up
    WARNING names it."""
    log_path = tmp_path / "indexer.log"
    with open(log_path, "wb") as log, _indexer(log) as (port, http):
        pub = CoalescingPublisher(
            endpoint=f"tcp://*:{port}",
            snapshot_endpoint=f"tcp://127.0.0.1:{free_port()}",
            snapshot_identity=identity,
        )
        try:
            wait_for(
                lambda: (
                    pub.publish(_store(PROBE)) is PublishOutcome.QUEUED
                    and pub.flush(5.0)
                    and said in log_path.read_bytes()
                ),
                timeout=30,
                what="Dynamo to reject the message",
            )
            assert PROBE not in (_dump(http) or set())
            assert _dump(http) == set()
        finally:
            pub.shutdown()


def _overloaded_into_dynamo(indexer: tuple[int, int], lossy: bool) -> tuple[set[int], Any]:
    """Five bursts of 40 steps with an event budget a third of the state, every other
    setting at its default (``loss_marker=resync``), each past the budget (or, not
    ``lossy``, each sent whole): what Dynamo holds, and the stats."""
    from tests.test_loss_markers import overloaded

    port, http = indexer
    pub = CoalescingPublisher(
        endpoint=f"tcp://*:{port}",
        max_queue_size=3 if lossy else 100_000,
        stall_timeout=0,
        max_pending_events=4 if lossy else 100_000,
    )
    assert pub.settings.loss_marker == "resync"  # the default
    try:
        _join(pub, http)
        overloaded(pub, rounds=5, burst=40)
        return _read_to_the_end(pub, http), pub.stats()
    finally:
        pub.shutdown()


def test_under_an_overload_that_comes_back_dynamo_ends_as_with_the_plain_stream(indexer):
    """Each burst collapses the backlog into the recorder, then the marker and the
    state: Dynamo, which has no replay, ends holding what it holds from the same
    batches all sent (a second indexer).  (Not the refcount model's set: Dynamo's
    tree drops a block's descendants with it, on the plain stream too.)"""
    got, st = _overloaded_into_dynamo(indexer, lossy=True)
    assert st.batches_dropped > 100 and st.resyncs == st.loss_markers >= 5
    with _indexer() as other:
        plain, st_plain = _overloaded_into_dynamo(other, lossy=False)
    assert st_plain.batches_dropped == 0
    assert got == plain
