"""Hooks for measuring the library: what its benchmarks and tests use beyond the public API.

Not for production code.  Each hook is given to a publisher when it is built
(:func:`hooks`, :func:`policy`, :func:`without_accelerator`: blocks that set
what publishers built inside them get), or acts on one publisher
(:func:`held`); nothing here patches a module.  The tools and benchmarks import
this module and the public API only, so a change inside the library breaks
this module's tests, not a benchmark months later.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import fields, replace
from typing import Any

from coalesce import _hooks
from coalesce._feed import Feed
from coalesce._hooks import Hooks, Tap
from coalesce._policy import DEFAULT_POLICY, Policy
from coalesce._recorder import Recorder
from coalesce._sender import IDLE_SLEEP, SHALLOW_SLEEP
from coalesce._settings import env_name
from coalesce._wire import Encoder, native_send
from coalesce.compactor import accelerated

__all__ = [
    "DEFAULT_POLICY",
    "IDLE_SLEEP",
    "POLICY",
    "SHALLOW_SLEEP",
    "Encoder",
    "Feed",
    "Hooks",
    "Policy",
    "Recorder",
    "accelerators",
    "env_name",
    "held",
    "hooks",
    "policy",
    "tapped",
    "without_accelerator",
]

POLICY = frozenset(f.name.upper() for f in fields(Policy))
"""The sender's tuning constants :func:`policy` may set (``coalesce._policy.Policy``'s
fields, named in capitals)."""


@contextmanager
def hooks(**given: Any) -> Iterator[Hooks]:
    """Publishers built while the block runs get these :class:`Hooks` fields (``policy``,
    ``accelerated``, ``tap``), the rest as they are; yields the hooks.  Raises
    ``TypeError`` for a name that is not a field."""
    now = replace(_hooks.current(), **given)
    undo = _hooks.use(now)
    try:
        yield now
    finally:
        undo()


@contextmanager
def policy(**constants: float) -> Iterator[Policy]:
    """Publishers built while the block runs get the sender's tuning changed, for an
    A/B; yields that policy.

    ``constants``: names in :data:`POLICY` and their values.  Raises
    ``ValueError`` for any other name.
    """
    unknown = set(constants) - POLICY
    if unknown:
        raise ValueError(f"not a policy constant: {sorted(unknown)} (known: {sorted(POLICY)})")
    changed = replace(_hooks.current().policy, **{k.lower(): v for k, v in constants.items()})  # type: ignore[arg-type]
    with hooks(policy=changed):
        yield changed


@contextmanager
def without_accelerator() -> Iterator[None]:
    """Publishers built while the block runs use no C path: the pure-Python rules,
    recorder and pyzmq's sends (call ``compact(..., accelerated=False)`` for the rules
    alone)."""
    with hooks(accelerated=False):
        yield


def tapped(tap: Tap) -> AbstractContextManager[Hooks]:
    """A block whose publishers call ``tap(topic, seq, payload)`` after each message they
    send (live messages, loss markers and heartbeats, in the sender thread)."""
    return hooks(tap=tap)


def accelerators() -> dict[str, bool]:
    """Which C accelerators run in this process: ``compactor``, ``recorder``, ``send``."""
    return {
        "compactor": accelerated(),
        "recorder": Recorder(1).accelerated,
        "send": native_send(),
    }


@contextmanager
def held(pub: Any) -> Iterator[None]:
    """Hold ``pub``'s sender thread still (it takes nothing from the backlog) while the
    block runs: a deterministic stand-in for a sender that cannot get the GIL.

    The thread is parked at its gate, not kept off the GIL by the switch interval,
    so this holds on free-threaded CPython too.  Do not call ``shutdown()`` inside:
    it waits for the held thread."""
    gate = pub._gate
    gate.hold(pub._sender.wake)
    try:
        yield
    finally:
        gate.release()
