"""Whether the compaction rules pay for themselves: the sender's measured choice.

At the rules level the sender can either run every rule on a window and
encode what is left, or fold the window and encode it whole.  The rules shrink
the stream, but on the event objects they cost about as much as the encoding
they save on a workload with many cancellations and chains, and far more on
one they barely shrink (docs/benchmarks.md, "Compaction's price").  Which way
is cheaper depends on the stream, so the sender measures both and runs the
rules only while they are.  Each window's cost (the compaction and the
encoding of its result, both holding the GIL, so wall time is the thread's
CPU time barring preemption) per event of the window is timed.  Most windows
go the chosen way; now and then one goes the other way, and its cost over
the median of the chosen way's last windows is one ratio.  The other way
takes over when the median of the last ratios is under its threshold:
folding when it costs under :data:`FOLD_TAKES_OVER` times the rules, the
rules when they cost under :data:`RULES_TAKE_OVER` times folding.  The band
between is the noise of a median of such timings here (about 15%), and in
it the rules are kept: at an even price, a smaller stream is worth having.
Except while the sender is pressed (losing ground near its event budget,
where the next batches would be refused): there the cheaper way takes over
at any margin (:data:`PRESSED_TAKES_OVER`), since a loss costs every
subscriber a resync, more than the bytes the rules save.
Ratios, not costs, are compared because this machine's speed drifts by tens
of per cent within seconds, and each ratio is of windows timed moments
apart.  The other way is tried after :data:`EXPLORE_FIRST` windows, then at
twice the interval each time it is confirmed dearer (up to
:data:`EXPLORE_MAX`), and again after :data:`EXPLORE_FIRST` once it looked
cheaper: mixing the two ways costs more than either (docs/benchmarks.md),
hence the back-off.

Pure bookkeeping: no clock, no I/O; the sender times the windows.
"""

from __future__ import annotations

from collections import deque

__all__ = [
    "EXPLORE_FIRST",
    "EXPLORE_MAX",
    "FOLD_TAKES_OVER",
    "PRESSED_TAKES_OVER",
    "RULES_TAKE_OVER",
    "SAMPLES",
    "Payoff",
]

SAMPLES = 7
"""Windows remembered per way, and ratios remembered; medians of them decide
(one slow, preempted window does not)."""

EXPLORE_FIRST = 8
"""Windows the chosen way before one the other way (after a cheaper-looking one)."""

EXPLORE_MAX = 256
"""The longest interval between windows the other way."""

FOLD_TAKES_OVER = 0.8
"""Folding alone replaces the rules when it costs under this times the rules."""

RULES_TAKE_OVER = 1.05
"""The rules replace folding alone when they cost under this times folding."""

PRESSED_TAKES_OVER = 1.0
"""Either way replaces the other when it costs under this times the other, while
the sender is pressed (``record(..., pressed=True)``)."""


def _median(xs: deque[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


class Payoff:
    """Which way the rules level sends the windows of one stream: rules, or fold only.

    :meth:`rules_next` and :meth:`record` are O(:data:`SAMPLES`).
    """

    __slots__ = ("_costs", "_every", "_ratios", "_rules", "_since")

    def __init__(self) -> None:
        self._rules = True  # the chosen way
        self._costs: dict[bool, deque[float]] = {
            True: deque(maxlen=SAMPLES),
            False: deque(maxlen=SAMPLES),
        }
        self._ratios: deque[float] = deque(maxlen=SAMPLES)  # other way / chosen way
        self._since = 0  # windows the chosen way since the last one the other way
        self._every = EXPLORE_FIRST

    def rules_next(self) -> bool:
        """Whether the next window should run the rules (else: fold only).

        The rules are tried first, folding second.
        """
        chosen = self._rules
        if not self._costs[chosen]:
            return chosen
        if not self._costs[not chosen]:
            return not chosen
        self._since += 1
        if self._since >= self._every:
            self._since = 0
            return not chosen
        return chosen

    def record(self, rules: bool, seconds_per_event: float, pressed: bool = False) -> None:
        """What one window cost, per event of the window, on the way it went;
        ``pressed``: the sender is losing ground near its event budget (the
        cheaper way then takes over at any margin)."""
        chosen = self._costs[self._rules]
        if rules != self._rules and chosen:  # the other way, beside the chosen way's
            ratio = seconds_per_event / max(_median(chosen), 1e-12)
            self._ratios.append(ratio)
            bar = RULES_TAKE_OVER if rules else FOLD_TAKES_OVER
            bar = PRESSED_TAKES_OVER if pressed else bar
            self._every = EXPLORE_FIRST if ratio < bar else min(2 * self._every, EXPLORE_MAX)
            if _median(self._ratios) < bar:  # the other way is cheaper: it takes over
                self._rules = rules
                self._ratios = deque((1 / r for r in self._ratios), maxlen=SAMPLES)
                self._every = EXPLORE_FIRST
                self._since = 0
        self._costs[rules].append(seconds_per_event)

    def costs(self) -> tuple[float | None, float | None]:
        """The medians of the last windows each way (rules, fold); None for a way
        not timed yet."""
        r, f = self._costs[True], self._costs[False]
        return (_median(r) if r else None, _median(f) if f else None)
