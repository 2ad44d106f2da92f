"""The stream (coalesce/_stream.py): the one place seqs are assigned and losses shown.

Unit tests on a real replay buffer and the real encoder, with a send function that
records frames; the end-to-end behaviour on sockets is in test_loss_markers.py.
"""

from __future__ import annotations

import msgspec
import pytest

from coalesce._stream import ReplayBuffer, Stream
from coalesce._wire import Encoder
from coalesce.stats import StreamStats

RANK = 3


Sent = list[tuple[int, bytes]]


def make(loss_marker: str, fail: list[bool] | None = None) -> tuple[Stream, Sent]:
    sent: list[tuple[int, bytes]] = []

    def send(topic: bytes, seq: int, payload: bytes) -> None:
        assert topic == b"kv"
        if fail and fail[0]:
            raise OSError("the socket is broken")
        sent.append((seq, payload))

    stream = Stream.of_rank(send, b"kv", ReplayBuffer(100), Encoder(), RANK, loss_marker)
    return stream, sent


def events_of(payload: bytes) -> list[object]:
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == RANK
    return list(events)


def test_a_loss_marker_takes_the_losses_seq_and_the_sequence_has_no_hole():
    stream, sent = make("clear")
    stream.emit(b"a", 2)
    stream.lose()
    stream.lose()  # one episode, however many batches it lost
    stream.emit(b"b", 5)
    assert [seq for seq, _ in sent] == [0, 1, 2]
    assert events_of(sent[1][1]) == [{"type": "AllBlocksCleared"}]
    assert sent[2][1] == b"b"
    assert stream.stats() == StreamStats(
        messages_sent=3, events_sent=7, bytes_sent=2 + len(sent[1][1]), loss_markers=1
    )
    buf = stream._buffer
    assert [buf[i] for i in range(len(buf))] == sent, "the marker is kept for replay too"


def test_a_gap_skips_the_losses_seq():
    stream, sent = make("gap")
    stream.emit(b"a", 1)
    stream.lose()
    stream.emit(b"b", 1)
    assert [seq for seq, _ in sent] == [0, 2]
    assert stream.seq_gaps == 1 and stream.loss_markers == 0 and stream.messages_sent == 2


@pytest.mark.parametrize("loss_marker, seqs", [("clear", [0, 1]), ("gap", [0, 2])])
def test_a_loss_at_the_end_is_shown_all_the_same(loss_marker, seqs):
    stream, sent = make(loss_marker)
    stream.emit(b"a", 1)
    stream.lose()
    stream.show_loss()
    stream.show_loss()  # nothing pending: nothing more
    assert [seq for seq, _ in sent] == seqs
    cleared = [{"type": "AllBlocksCleared"}]
    assert events_of(sent[1][1]) == (cleared if loss_marker == "clear" else [])
    assert not stream.loss_pending


@pytest.mark.parametrize("loss_marker", ["clear", "gap"])
def test_a_snapshot_cut_covers_a_pending_loss(loss_marker):
    stream, sent = make(loss_marker)
    assert stream.covered() == -1  # nothing sent yet
    stream.emit(b"a", 1)
    stream.lose()
    assert stream.covered() == 1  # the marker's seq, or the skipped one
    stream.emit(b"b", 1)
    assert sent[-1][0] == 2, "the next live message follows the cut"


def test_a_send_that_raises_consumes_no_seq():
    fail = [False]
    stream, sent = make("clear", fail)
    stream.emit(b"a", 1)
    stream.lose()
    fail[0] = True
    with pytest.raises(OSError):
        stream.emit(b"b", 1)
    assert stream.loss_pending and stream.next_seq == 1 and stream.messages_sent == 1
    fail[0] = False
    stream.emit(b"b", 1)
    assert [seq for seq, _ in sent] == [0, 1, 2] and stream.loss_markers == 1


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="loss_marker"):
        Stream.of_rank(None, b"", ReplayBuffer(1), Encoder(), 0, "drop")


@pytest.mark.parametrize("beats", [True, False])
def test_only_a_beating_stream_stamps_every_message(beats):
    sent: list[tuple[int, bytes]] = []
    stream = Stream.of_rank(
        lambda t, s, p: sent.append((s, p)), b"", ReplayBuffer(4), Encoder(), 0, "clear", beats
    )
    stream.last_sent = 0.0
    stream.emit(b"a", 1)
    assert (stream.last_sent > 0.0) == beats
    stream.heartbeat()  # a heartbeat always stamps
    assert stream.last_sent > 0.0 and [s for s, _ in sent] == [0, 1]


def test_a_stream_without_a_socket_says_so():
    stream = Stream.of_rank(None, b"", ReplayBuffer(4), Encoder(), 0, "clear")
    with pytest.raises(RuntimeError, match="socket"):
        stream.emit(b"a", 1)
    assert stream.next_seq == 0
