"""Settings: vLLM's constructor keywords plus this project's knobs.

vLLM's ``KVEventsConfig`` forbids extra keys, so every extra knob can also
come from a ``COALESCE_*`` environment variable.  Precedence: an explicit
keyword argument, then the environment variable, then the default.

Each knob is declared once, as a field of :class:`Settings` (name, type,
default, parser in its metadata, docstring); the constructor keyword and the
variable name are derived from it, and tests/test_docs.py checks the table in
docs/backpressure.md against it.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

__all__ = [
    "Budgets",
    "Identity",
    "LossMarker",
    "PublisherConfig",
    "Settings",
    "is_bind_endpoint",
    "offset_endpoint",
    "parse_flag",
]


class LossMarker(str, enum.Enum):
    """How a loss is told to subscribers (the ``loss_marker`` knob): the one list of
    its names.  A ``str`` enum, so ``"clear"`` compares equal to ``LossMarker.CLEAR``."""

    CLEAR = "clear"
    """A batch holding one ``AllBlocksCleared`` takes the loss's seq."""
    RESYNC = "resync"
    """That marker, then the recorded state, in-band."""
    GAP = "gap"
    """A skipped seq."""

    @property
    def told(self) -> str:
        """What a loss's log line says subscribers learn."""
        return _TOLD[self]


_TOLD = {
    LossMarker.CLEAR: "subscribers are sent a loss marker (AllBlocksCleared)",
    LossMarker.RESYNC: "subscribers are sent a loss marker (AllBlocksCleared), then the state",
    LossMarker.GAP: "subscribers will see a sequence gap",
}


class Identity(str, enum.Enum):
    """Where a live message carries the 16-byte ``publisher_id`` with snapshots on (the
    ``snapshot_identity`` knob): vLLM PR #57789 has had both."""

    BATCH = "batch"
    """A 4th element of the batch, ``[ts, events, data_parallel_rank, publisher_id]``,
    the seq frame 8 bytes (the PR's newest revision, vllm-project/vllm 2c481a4b:
    ``IdentifiedKVEventBatch``; llm-d-router's reader with PR #2946)."""
    SEQ = "seq"
    """After the 8 seq bytes, a 24-byte seq frame; 3-element batches (the PR's earlier
    revisions, e.g. vMaroon/vllm 08ee3e5; llm-d-router's first ``snapshot.go``)."""


@dataclass(frozen=True, slots=True)
class Budgets:
    """Every bound derived from ``max_pending_events``, named once
    (docs/backpressure.md, "Budgets").  O(1)."""

    events: int
    """Events published and not yet sent past which ``publish()`` refuses a batch
    (and batches: a batch counts at least one)."""
    refused_recorded: int
    """Events of refused batches one loss marker carries to the recorder (2x, and at
    least ``snapshot_max_blocks``): with ``loss_marker=resync`` the sender collapses
    the backlog at the first refusal, so that few wait for it."""
    deferred: int
    """Events the recorder's feed holds back while a walk runs (1x), past which the
    walk is abandoned."""

    @classmethod
    def of(cls, max_pending_events: int, snapshot_max_blocks: int) -> Budgets:
        return cls(
            events=max_pending_events,
            refused_recorded=max(2 * max_pending_events, snapshot_max_blocks),
            deferred=max_pending_events,
        )


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """vLLM's publisher fields, with endpoints resolved for this DP rank.

    Its defaults are vLLM 0.33's, and the publisher's constructor takes them from here.
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    snapshot_endpoint: str | None = None
    """The bound snapshot ROUTER (vLLM PR #57789's field), None with snapshots off."""
    snapshot_max_blocks: int = 1_000_000
    snapshot_max_response_bytes: int = 256 * 1024 * 1024


def _positive_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise TypeError("expected an integer")
    value = int(raw)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def parse_flag(raw: Any) -> bool:
    """A boolean from a keyword or an environment variable (1/0, true/false, yes/no, on/off)."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _seconds(raw: Any) -> float:
    value = float(raw)
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


def _endpoint(raw: Any) -> str | None:
    if not isinstance(raw, str):
        raise TypeError("expected a ZeroMQ endpoint string")
    return raw.strip() or None


_Choice = TypeVar("_Choice", bound=enum.Enum)


def _one_of(choices: type[_Choice]) -> Callable[[Any], _Choice]:
    """The parser of a knob that names one of ``choices`` (any case, spaces ignored)."""

    def parse(raw: Any) -> _Choice:
        text = str(raw.value if isinstance(raw, choices) else raw).strip().lower()
        try:
            return choices(text)
        except ValueError:
            raise ValueError("expected " + ", ".join(m.value for m in choices)) from None

    return parse


def _knob(default: Any, parse: Callable[[Any], Any]) -> Any:
    return field(default=default, metadata={"parse": parse})


@dataclass(frozen=True, slots=True)
class Settings:
    """This project's knobs.  Each has a ``COALESCE_<NAME>`` environment variable."""

    high_watermark: int = _knob(8, _positive_int)
    """Batches waiting before the sender compacts instead of sending 1:1."""
    compaction: bool = _knob(True, parse_flag)
    """Fold and compact under backpressure; off: always 1:1 (still never blocks)."""
    move_events: bool = _knob(False, parse_flag)
    """Emit the opt-in ``BlockMoved`` event (only for subscribers that know it)."""
    parentless_copies: bool = _knob(False, parse_flag)
    """The engine may store a copy of a block without naming its parent (vLLM's CPU
    offload with ``lazy_offload``): compaction then merges a chain only under a parent
    certainly held, so that a subscriber that starts or resets mid-stream stays exact
    too; next to no cost on the lazy stream, but off by default since other streams
    lose the chains that start on a block stored earlier (docs/event-semantics.md)."""
    max_pending_events: int = _knob(4_000_000, _positive_int)
    """Memory budget: events published but not yet sent, beyond which publish() drops.
    At the default, a backlog near it held about half the memory vLLM's own queue
    held at ``max_queue_size=100`` in the same runs (docs/backpressure.md)."""
    max_events_per_step: int = _knob(512, _positive_int)
    """Events one compaction step takes (bounds each GIL hold of the sender); a rules
    window takes up to 4x as many while the rest of the sender's GIL slice holds them
    at the rules' measured cost."""
    loss_marker: LossMarker = _knob(LossMarker.RESYNC, _one_of(LossMarker))  # noqa: RUF009
    """How a loss (a batch refused past the budget, or one that cannot be encoded) is
    told to subscribers.  ``resync``: a batch holding one ``AllBlocksCleared`` takes
    the loss's seq, then the state the publisher's recorder holds is sent in-band
    before any later batch, so every consumer ends exact (the recorder runs with or
    without ``snapshot_endpoint``; while it cannot be exact, past
    ``snapshot_max_blocks``, a loss is told as ``clear`` and the log says so);
    ``clear``: that marker alone, so the sequence has no hole and every consumer
    forgets this rank's blocks (never keeps stale ones), with no recorder running;
    ``gap``: it skips a seq, which consumers with replay treat as they each do, and
    which makes llm-d-router's snapshot reader (its PR #2946) start over from a
    snapshot: with snapshots on, the marker for that reader (docs/subscribers.md)."""
    stall_timeout: float = _knob(1.0, _seconds)
    """Seconds the hand-off deque may stay full (``max_queue_size`` batches) while the
    sender takes nothing from it before publish() refuses batches on that count; 0
    refuses at once.  A running sender always takes within this time."""
    shutdown_timeout: float = _knob(1.0, _seconds)
    """Seconds shutdown() spends flushing before it abandons what is left."""
    replay_window: int = _knob(256, _positive_int)
    """Replay messages ZeroMQ may queue for one client (the ROUTER's send HWM);
    a client that does not read makes its reply wait, then be abandoned."""
    replay_max_clients: int = _knob(32, _positive_int)
    """Open replay connections beyond which requests are refused (counted)."""
    replay_max_active: int = _knob(8, _positive_int)
    """Replies sent at once (round-robin); later requests wait their turn."""
    snapshot_endpoint: str | None = _knob(None, _endpoint)
    """Opt-in state snapshots (vLLM PR #57789's protocol): the ROUTER endpoint that
    answers ``b"snapshot"`` (bound; offset per DP rank like the others).  When set,
    every live message carries a 16-byte ``publisher_id`` (``snapshot_identity``) and
    an idle publisher sends an empty batch every second; unset, the wire is vLLM
    0.33's."""
    snapshot_identity: Identity = _knob(Identity.SEQ, _one_of(Identity))  # noqa: RUF009
    """Where a live message carries the ``publisher_id`` with snapshots on: ``seq``,
    after the seq in a 24-byte seq frame (PR #57789's earlier revisions; every
    llm-d-router build reads the seq from the first 8 bytes); ``batch``, a 4th batch
    element after an 8-byte seq frame (its newest revision; llm-d-router without its
    PR #2946 drops every such batch) (docs/subscribers.md)."""
    snapshot_max_blocks: int = _knob(1_000_000, _positive_int)
    """References the snapshot recorder holds, and blocks in the store events it keeps
    for the replay program, before it declares itself unavailable."""
    snapshot_max_response_bytes: int = _knob(256 * 1024 * 1024, _positive_int)
    """Bytes of chunks one snapshot reply may hold; a larger one is answered -2."""

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> Settings:
        """Build settings from explicit values, then ``COALESCE_*`` variables, then defaults.

        Raises ``ValueError`` naming the variable or keyword for a bad value,
        and ``TypeError`` for a keyword that is not a knob.
        """
        env = os.environ if env is None else env
        known = {f.name: f for f in fields(cls)}
        unknown = set(explicit) - set(known)
        if unknown:
            raise TypeError(f"unknown settings: {sorted(unknown)}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            if explicit.get(name) is not None:
                raw: Any = explicit[name]
                where = f"keyword {name}"
            else:
                var = env_name(name)
                if var not in env:
                    continue
                raw, where = env[var], f"environment variable {var}"
            try:
                values[name] = f.metadata["parse"](raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"invalid {where}={raw!r}: {exc}") from None
        return cls(**values)

    @property
    def budgets(self) -> Budgets:
        """The bounds derived from ``max_pending_events``."""
        return Budgets.of(self.max_pending_events, self.snapshot_max_blocks)

    @classmethod
    def names(cls) -> frozenset[str]:
        """The knobs' names (the publisher's extra keywords)."""
        return frozenset(f.name for f in fields(cls))


def env_name(knob: str) -> str:
    """The environment variable of a knob: ``COALESCE_<NAME>``."""
    return "COALESCE_" + knob.upper()


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule: tcp port + rank (port 0 stays 0), inproc gets ``_dp<rank>``.

    Any other scheme is an error for rank > 0.
    """
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            return endpoint
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise ValueError(
        f"invalid endpoint {endpoint!r} for data_parallel_rank {rank}: "
        "must contain 'inproc' or 'tcp'"
    )


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcards and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
