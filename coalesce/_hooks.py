"""What a test or a benchmark may give a publisher at construction: a policy, the
C paths on or off, a tap on its sends.  Set only through ``coalesce.testing``
(a context variable read once, by the constructor); the library's own default is
:data:`NONE`, which changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from coalesce._policy import DEFAULT_POLICY, Policy

__all__ = ["NONE", "Hooks", "current"]

Tap = Callable[[bytes, int, bytes], None]
"""Called as ``tap(topic, seq, payload)`` after each message a publisher sends."""


@dataclass(frozen=True)
class Hooks:
    """The hooks one publisher is built with."""

    policy: Policy = DEFAULT_POLICY
    """The sender's tuning."""
    accelerated: bool = True
    """False: every C path off (the compaction rules, the recorder, the native send)."""
    tap: Tap | None = None
    """Sees each message sent (live messages, loss markers and heartbeats)."""


NONE = Hooks()
"""The hooks of every publisher not built inside a ``coalesce.testing`` block."""

_CURRENT: ContextVar[Hooks] = ContextVar("coalesce_hooks", default=NONE)


def current() -> Hooks:
    """The hooks a publisher built now gets.  O(1)."""
    return _CURRENT.get()


def use(hooks: Hooks) -> Callable[[], None]:
    """Give publishers built from now on (in this context) ``hooks``; returns the undo."""
    token = _CURRENT.set(hooks)
    return lambda: _CURRENT.reset(token)
