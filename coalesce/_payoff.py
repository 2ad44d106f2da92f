"""Whether the compaction rules pay for themselves: the sender's measured choice.

At the rules level the sender can either run every rule on a window and
encode what is left, or fold the window and encode it whole.  The rules shrink
the stream, but on the event objects they cost about as much as the encoding
they save on a workload with many cancellations and chains, and far more on
one they barely shrink (docs/benchmarks.md, "Compaction's price").  Which way
is cheaper depends on the stream, so the sender measures both and runs the
rules only while they are: each window's cost (the compaction and the
encoding of its result, both holding the GIL, so wall time is the thread's
CPU time barring preemption) per event of the window goes into the side it
was spent on, and the cheaper side's median decides the next window.  Now
and then a window goes the other way, so that a stream that changes is
noticed: after :data:`EXPLORE_FIRST` windows, then at twice the interval each
time the other way is confirmed dearer (up to :data:`EXPLORE_MAX`), and back
to the first interval when it looked cheaper.  Mixing the two ways costs
more than either (measured: docs/benchmarks.md), hence the back-off; the
switch needs the other side cheaper by :data:`MARGIN`, so that a near tie
does not flip at every window.

Pure bookkeeping: no clock, no I/O; the sender times the windows.
"""

from __future__ import annotations

from collections import deque

__all__ = ["EXPLORE_FIRST", "EXPLORE_MAX", "MARGIN", "SAMPLES", "Payoff"]

SAMPLES = 7
"""Windows remembered per side; their median is the side's cost (one slow,
preempted window does not decide)."""

EXPLORE_FIRST = 8
"""Windows the chosen way before the first one the other way."""

EXPLORE_MAX = 256
"""The longest interval between windows the other way."""

MARGIN = 0.95
"""The other side must cost under this times the chosen side to be chosen."""


def _median(xs: deque[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


class Payoff:
    """Seconds per event of the rules and of folding alone, for the windows of one stream.

    :meth:`rules_next` and :meth:`record` are O(:data:`SAMPLES`).
    """

    __slots__ = ("_every", "_exploring", "_fold", "_rules", "_since", "_use_rules")

    def __init__(self) -> None:
        self._rules: deque[float] = deque(maxlen=SAMPLES)
        self._fold: deque[float] = deque(maxlen=SAMPLES)
        self._use_rules = True
        self._since = 0  # windows the chosen way since the last one the other way
        self._every = EXPLORE_FIRST
        self._exploring = False

    def rules_next(self) -> bool:
        """Whether the next window should run the rules (else: fold only).

        A side not measured yet is tried first (the rules, then folding).
        """
        if not self._rules:
            return True
        if not self._fold:
            return False
        self._since += 1
        self._exploring = self._since >= self._every
        if self._exploring:
            self._since = 0
            return not self._use_rules
        return self._use_rules

    def record(self, rules: bool, seconds_per_event: float) -> None:
        """What one window cost, per event of the window, on the side it went."""
        mine, other = (self._rules, self._fold) if rules else (self._fold, self._rules)
        if self._exploring and other:  # was the other way cheaper this time?
            cheaper = seconds_per_event < MARGIN * _median(other)
            self._every = EXPLORE_FIRST if cheaper else min(2 * self._every, EXPLORE_MAX)
            self._exploring = False
        mine.append(seconds_per_event)
        if self._rules and self._fold:
            r, f = _median(self._rules), _median(self._fold)
            if self._use_rules and f < MARGIN * r:
                self._use_rules = False
            elif not self._use_rules and r < MARGIN * f:
                self._use_rules = True

    def costs(self) -> tuple[float | None, float | None]:
        """The medians (rules, fold), None for a side not measured yet."""
        return (
            _median(self._rules) if self._rules else None,
            _median(self._fold) if self._fold else None,
        )
