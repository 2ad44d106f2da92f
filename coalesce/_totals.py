"""The sender's counters, and its rate-limited log.

Written by the sender thread only; ``stats()`` reads them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from typing import Any

from coalesce.compactor import rule_stats
from coalesce.stats import SenderStats

__all__ = ["RateLimited", "Totals"]

log = logging.getLogger("coalesce")


class RateLimited:
    """Log at most one line per ``period`` seconds per key, counting the rest."""

    def __init__(self, period: float = 10.0) -> None:
        self._period = period
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def failure(self, key: str, what: str, exc: BaseException, then: str) -> None:
        """A WARNING that ``what`` happened because of ``exc``, and what ``then``."""
        self.warning(key, "kv-coalesce: %s (%s: %.200s); %s", what, type(exc).__name__, exc, then)

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self._period) < self._period:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        if n:
            msg += " (%d similar messages suppressed)"
            args = (*args, n)
        log.log(level, msg, *args)


@dataclass(slots=True)
class Totals:
    """The sender's counters: written by the sender thread only, read by ``stats()``.

    Named as the :class:`~coalesce.stats.SenderStats` fields they become; the
    compaction counters are added by name from each report
    (:func:`coalesce.compactor.rule_stats`).
    """

    batches_collapsed: int = 0
    batches_folded: int = 0
    blocks_cancelled: int = 0
    blocks_moved: int = 0
    compaction_failures: int = 0
    compaction_passes: int = 0
    encode_failures: int = 0
    events_collapsed: int = 0
    events_merged: int = 0
    events_superseded: int = 0
    fold_only_passes: int = 0
    resync_events: int = 0
    resyncs: int = 0

    def add_pass(self, report: Any, fold_only: bool) -> None:
        self.compaction_passes += 1
        self.fold_only_passes += fold_only
        for field, stat in _RULE_STATS:
            setattr(self, stat, getattr(self, stat) + getattr(report, field))

    def stats(self, *, alive: bool, accelerated: bool, native_send: bool) -> SenderStats:
        """The counters, frozen, with the sender's gauges.  O(fields)."""
        counts = {f.name: getattr(self, f.name) for f in fields(self)}
        return SenderStats(
            sender_alive=alive, compactor_accelerated=accelerated, native_send=native_send, **counts
        )


_RULE_STATS = rule_stats()
