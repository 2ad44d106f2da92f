"""The sender's policy: when it hands the GIL back, how wide a rules window is, when
it sends a batch whole.  Pure: numbers in, a decision out; the time is
passed in by the caller, so the tests drive it with a fake clock and no thread.

The constants are this project's 2-core VM's measurements (docs/decisions.md says
which were judged where); each function is O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COST_SAMPLES",
    "DEFAULT_POLICY",
    "GilSlice",
    "Policy",
    "RulesCost",
    "pressed",
    "rules_window",
    "sends_whole",
    "yield_slice",
]


@dataclass(frozen=True, slots=True)
class Policy:
    """The sender's tuning, given to it at construction (:data:`DEFAULT_POLICY`, or
    another for an A/B through ``coalesce.testing``)."""

    yield_every: float = 0.0005
    """Seconds of continuous sender work after which it hands the GIL to the engine.
    Yielding after every step makes each step a GIL handoff (two context switches);
    never yielding lets the engine wait for CPython's 5 ms switch interval."""

    pressure_from: float = 0.25
    """Share of the event budget (``max_pending_events``) pending above which a sender
    losing ground holds the GIL for ``pressure_slice`` before handing it back."""

    pressure_slice: float = 0.005
    """Seconds of continuous sender work under pressure: CPython's default switch
    interval, the longest an engine thread waits for the GIL from any other Python
    thread."""

    whole_from: float = 0.5
    """Share of the event budget pending above which the sender sends a batch larger
    than a window as it is, in one encode (:func:`sends_whole`)."""

    widen_up_to: int = 4
    """At most this many times ``max_events_per_step`` in one rules window, when the
    rest of the sender's GIL slice holds them at the rules' measured cost."""

    record_window: int = 0
    """Events of batches sent as they came (not through the rules) that the recorder's
    feed (``coalesce._feed``) gathers, then records as the compactor's output of
    them (the same state for every subscriber model, fewer events).  0 (the
    default): each batch recorded as it was sent, the list in one call: with the
    recorder's state in C, recording costs less than the compactor's pass
    (bench_recorder; docs/decisions.md)."""

    record_from: int = 32
    """Fewest events of a gathered window that the feed compacts; a smaller one (a
    sender that caught up after a small batch) is recorded as it was: the
    compactor's cost per call is more than it saves the recorder on so few."""


DEFAULT_POLICY = Policy()
"""The policy every publisher runs unless a test or benchmark gives another."""


COST_SAMPLES = 7
"""Rules windows whose cost :class:`RulesCost` remembers; their median sizes the next
window (one slow, preempted window does not)."""


class RulesCost:
    """The rules' cost per event on this stream: the median of the last
    :data:`COST_SAMPLES` rules windows (compaction and encoding, timed by the
    caller).  :meth:`record` and :meth:`median` are O(:data:`COST_SAMPLES`)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: list[float] = []

    def record(self, seconds_per_event: float) -> None:
        last = self._last
        last.append(seconds_per_event)
        if len(last) > COST_SAMPLES:
            del last[0]

    def median(self) -> float | None:
        """None until a window was timed."""
        last = self._last
        return sorted(last)[len(last) // 2] if last else None


def rules_window(
    step: int, cost: float | None, room: float, policy: Policy = DEFAULT_POLICY
) -> int:
    """Events the next rules window takes, O(1): as many as ``room`` seconds (the
    rest of the sender's GIL slice) hold at ``cost`` seconds per event (the rules'
    measured median), from ``step`` (``max_events_per_step``) up to
    ``widen_up_to`` x ``step``; ``step`` while the rules are not timed yet.

    Each window costs a pass of Python around the C rules (take, encode, send,
    count): a larger window pays it once for more events, and lets the rules
    see more pairs to cancel.  Bounding it by the slice keeps the engine's wait
    at a hand-over what the slice makes it.
    """
    if cost is None or cost <= 0.0:
        return step
    return min(policy.widen_up_to * step, max(step, int(room / cost)))


def yield_slice(
    pending_events: int, budget: int, losing: bool, policy: Policy = DEFAULT_POLICY
) -> float:
    """Seconds of continuous work after which the sender yields the GIL, O(1).

    ``yield_every``, or ``pressure_slice`` while the sender is losing ground
    (more was pending when its slice began than when the one before it did)
    with more than ``pressure_from`` of the event budget pending (events, or
    batches if more: both count to it).  A sender losing ground there will
    reach the budget, and then the next batches would be refused, each a gap
    (and a resync) for every subscriber: it takes the largest share of the GIL
    a Python thread can hold next to a waiting engine, a bounded wait at the
    engine's GIL hand-offs (never in ``publish()``'s own work) instead of a
    loss.  A backlog that is deep but shrinking keeps the short slice.
    """
    if pressed(pending_events, budget, losing, policy):
        return policy.pressure_slice
    return policy.yield_every


def pressed(
    pending_events: int, budget: int, losing: bool, policy: Policy = DEFAULT_POLICY
) -> bool:
    """Whether the sender is pressed, O(1): losing ground with more than
    ``pressure_from`` of the event budget pending.  Then it takes the longer GIL
    slice (:func:`yield_slice`): the next batches would be refused."""
    return losing and pending_events > policy.pressure_from * budget


def sends_whole(pending_events: int, budget: int, policy: Policy = DEFAULT_POLICY) -> bool:
    """Whether a batch larger than a window goes out as it is, in one encode, O(1):
    while more than ``whole_from`` of the event budget is pending (events, or
    batches if more), whatever the rules in parts would save.

    The rules in parts hand the GIL back between parts, and at a load that
    fills the budget the engine publishes more in its turns than the sender's
    slices drain (a slice ends at CPython's switch interval at the latest).
    One encode holds the GIL for the whole batch, as vLLM's sender holds it
    for each of its batches: the engine cannot publish its next batch before
    this one is encoded, so it goes at the sender's pace instead of outrunning
    it into a loss; the next batch waiting is folded into the same encode, so
    that the sender drains two batches while the engine publishes one.
    Whether the backlog is still growing does not matter here: a sender that
    went back to parts whenever the backlog held steady would let it climb
    again.
    """
    return pending_events > policy.whole_from * budget


class GilSlice:
    """The sender's current turn with the GIL: when it began, and whether the sender is
    losing ground (more was pending when it began than when the turn before it did).

    The caller passes the time (``time.perf_counter()`` in the sender, a fake clock in
    the tests) and what is pending for the event budget; nothing here reads a clock.
    """

    def __init__(self, budget: int, policy: Policy = DEFAULT_POLICY) -> None:
        self.budget = budget
        self.policy = policy
        self.began = 0.0
        """When the current turn began (the last hand-over)."""
        self.pending_at_start = 0
        """What was pending for the budget when it began."""
        self.losing = False
        """More was pending then than when the turn before began."""

    def length(self, pending: int) -> float:
        """:func:`yield_slice` for this turn."""
        return yield_slice(pending, self.budget, self.losing, self.policy)

    def room(self, now: float, pending: int) -> float:
        """Seconds left in this turn at ``now`` (negative once it is over)."""
        return self.length(pending) - (now - self.began)

    def due(self, now: float, pending: int) -> bool:
        """Whether the sender hands the GIL back at ``now``."""
        held = now - self.began
        return held >= self.policy.yield_every and held >= self.length(pending)

    def woke(self, now: float, pending: int) -> None:
        """The sender woke at ``now`` from an idle sleep, with ``pending`` for the
        budget: the engine had the GIL meanwhile, so a new turn begins (nothing was
        pending as it went to sleep: losing ground if anything is now)."""
        self.pending_at_start = 0
        self.handed_over(now, pending)

    def handed_over(self, now: float, pending: int) -> None:
        """The GIL went to the engine and came back at ``now``, with ``pending`` for the
        budget (what the engine published meanwhile included): a new turn begins."""
        self.began = now
        self.losing = pending > self.pending_at_start
        self.pending_at_start = pending
