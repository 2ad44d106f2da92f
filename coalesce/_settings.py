"""Settings: vLLM's constructor keywords plus this project's knobs.

vLLM's ``KVEventsConfig`` forbids extra keys, so every extra knob can also
come from a ``COALESCE_*`` environment variable.  Precedence: an explicit
keyword argument, then the environment variable, then the default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

__all__ = ["PublisherConfig", "Settings", "is_bind_endpoint", "offset_endpoint"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """vLLM's publisher fields, with endpoints resolved for this DP rank."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


@dataclass(frozen=True, slots=True)
class Settings:
    """This project's knobs.  Each has a ``COALESCE_<NAME>`` environment variable."""

    high_watermark: int = 8
    """Batches waiting before the sender compacts instead of sending 1:1."""
    compaction: bool = True
    """Fold and compact under backpressure; off: always 1:1 (still never blocks)."""
    move_events: bool = False
    """Emit the opt-in ``BlockMoved`` event (only for subscribers that know it)."""
    max_pending_events: int = 1_000_000
    """Memory budget: events published but not yet sent, beyond which publish() drops."""
    max_events_per_step: int = 512
    """Events one compaction step takes (bounds each GIL hold of the sender)."""
    fold_only_events: int = 2048
    """Pending events beyond which the sender only folds (the rules cost ~2 us/event);
    it also folds only once a pass of the rules has lost ground."""
    shutdown_timeout: float = 1.0
    """Seconds shutdown() spends flushing before it abandons what is left."""

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> Settings:
        """Build settings from explicit values, then ``COALESCE_*`` variables, then defaults.

        Raises ``ValueError`` naming the variable or keyword for a bad value.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            parse = _PARSERS[f.name]
            if explicit.get(f.name) is not None:
                raw: Any = explicit[f.name]
                where = f"keyword {f.name}"
            else:
                var = "COALESCE_" + f.name.upper()
                if var not in env:
                    continue
                raw, where = env[var], f"environment variable {var}"
            try:
                values[f.name] = parse(raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"invalid {where}={raw!r}: {exc}") from None
        return cls(**values)


def _positive_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise TypeError("expected an integer")
    value = int(raw)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _flag(raw: Any) -> bool:
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


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "high_watermark": _positive_int,
    "compaction": _flag,
    "move_events": _flag,
    "max_pending_events": _positive_int,
    "max_events_per_step": _positive_int,
    "fold_only_events": _positive_int,
    "shutdown_timeout": _seconds,
}


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
