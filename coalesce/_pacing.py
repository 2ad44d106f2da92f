"""The sender's pace: when it hands the GIL to the engine, how wide its next rules
window is, when it sends a big batch whole.  The decisions are ``coalesce._policy``'s
(pure, the clock passed in); this room reads the clock and the backlog for them, and
sleeps.  Every method is O(1) but :meth:`Pacing.keep_budget_free`, O(batches staged).
"""

from __future__ import annotations

import time

from coalesce._backlog import Backlog
from coalesce._policy import GilSlice, Policy, RulesCost, rules_window, sends_whole

__all__ = ["Pacing"]


class Pacing:
    """One sender's turns with the GIL and its rules' measured cost."""

    def __init__(self, backlog: Backlog, policy: Policy, high_watermark: int) -> None:
        self._backlog = backlog
        self._policy = policy
        self._high_watermark = high_watermark
        self.gil = GilSlice(backlog.max_events, policy)
        self.rules_cost = RulesCost()  # sizes the rules windows
        self.flushers = 0
        """Callers blocked in ``flush()`` (kept by :meth:`Sender.flushing
        <coalesce._sender.Sender.flushing>`).  While one is, the sender keeps the
        GIL between steps: the caller waits for the sender, and a hand-over costs
        the sender a real sleep (``time.sleep(0)``: 50-100 us on Linux since
        CPython 3.11).  Any other thread still gets the GIL at CPython's
        switch interval, as it does from vLLM's own sender."""

    def pending(self) -> int:
        """Events or batches pending, whichever is more: both count to the event budget."""
        backlog = self._backlog
        return max(backlog.pending_events, backlog.waiting)

    def maybe_yield(self) -> None:
        """Hand the GIL to the engine if the sender has held it for its turn
        (:class:`~coalesce._policy.GilSlice`), unless a caller waits in ``flush()``
        (:attr:`flushers`)."""
        gil, now = self.gil, time.perf_counter()
        if now - gil.began < self._policy.yield_every or not gil.due(now, self.pending()):
            return
        if self.flushers:
            gil.handed_over(now, self.pending())  # a new turn, not taken from anyone
            return
        time.sleep(0)
        # what the engine published while it had the GIL is in: a new turn
        gil.handed_over(time.perf_counter(), self.pending())

    def woke(self) -> None:
        """The sender woke from its idle sleep: a new turn begins (else the first
        step after a sleep would hand the GIL over at once, a sleep of its own)."""
        self.gil.woke(time.perf_counter(), self.pending())

    def rules_window(self, step: int) -> int:
        """:func:`~coalesce._policy.rules_window` now: the rest of this turn at the
        rules' median cost on this stream."""
        room = self.gil.room(time.perf_counter(), self.pending())
        return rules_window(step, self.rules_cost.median(), room, self._policy)

    def sends_whole(self) -> bool:
        """:func:`~coalesce._policy.sends_whole` now."""
        return sends_whole(self.pending(), self._backlog.max_events, self._policy)

    def keep_budget_free(self) -> None:
        """Under pressure, move the hand-off deque's batches to the staging deque, so
        that the batch budget (vLLM's ``max_queue_size``) is reached only by a sender
        that cannot run; the event budget still counts them."""
        if self._backlog.pending > self._high_watermark:
            self._backlog.stage()
