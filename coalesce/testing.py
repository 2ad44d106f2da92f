"""Hooks for measuring the library: what its benchmarks and tests use beyond the public API.

Not for production code.  Each name here is a way to look inside, or to switch
one mechanism off for an A/B, kept in one place so that ``benchmarks/`` imports
nothing private and a change inside the library breaks this module's tests, not
a benchmark months later.  Nothing here changes what the library does unless
called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from coalesce import _policy, compactor
from coalesce._recorder import Recorder
from coalesce._sender import IDLE_POLL
from coalesce._snapshot import SnapshotService
from coalesce._wire import Encoder

__all__ = [
    "IDLE_POLL",
    "POLICY",
    "Encoder",
    "Recorder",
    "SnapshotService",
    "held",
    "policy",
    "tap_sends",
    "without_accelerator",
]

POLICY = frozenset(
    ["PRESSURE_FROM", "PRESSURE_SLICE", "RECORD_FROM", "RECORD_WINDOW", "WHOLE_FROM", "WIDEN_UP_TO"]
)
"""The sender's tuning constants :func:`policy` may set (coalesce/_policy.py)."""


@contextmanager
def policy(**constants: float) -> Iterator[None]:
    """Run the sender with some of its tuning changed, for an A/B; restored on exit.

    ``constants``: names in :data:`POLICY` and their values, read by every sender
    of this process while the block runs.  Raises ``ValueError`` for any other name.
    """
    unknown = set(constants) - POLICY
    if unknown:
        raise ValueError(f"not a policy constant: {sorted(unknown)} (known: {sorted(POLICY)})")
    saved = {name: getattr(_policy, name) for name in constants}
    try:
        for name, value in constants.items():
            setattr(_policy, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(_policy, name, value)


@contextmanager
def without_accelerator() -> Iterator[None]:
    """:func:`coalesce.compactor.compact` runs the pure-Python rules while the block runs."""
    accel = compactor._accel
    compactor._accel = None
    try:
        yield
    finally:
        compactor._accel = accel


@contextmanager
def held(pub: Any) -> Iterator[None]:
    """Hold ``pub``'s sender thread still (it takes nothing from the backlog) while the
    block runs: a deterministic stand-in for a sender that cannot get the GIL.

    The thread is parked on an event, not kept off the GIL by the switch interval,
    so this holds on free-threaded CPython too.  Do not call ``shutdown()`` inside:
    it waits for the held thread."""
    sender = pub._sender
    sender.hold()
    try:
        yield
    finally:
        sender.release()


def tap_sends(pub: Any, tap: Callable[[bytes, int, bytes], None]) -> None:
    """Call ``tap(topic, seq, payload)`` after each message ``pub`` sends from now on
    (live messages, loss markers and heartbeats, in the sender thread).  O(1)."""
    stream = pub._sender._stream
    send = stream._send

    def tapped(topic: bytes, seq: int, payload: bytes) -> None:
        send(topic, seq, payload)
        tap(topic, seq, payload)

    stream.use(tapped)
