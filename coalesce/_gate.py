"""A gate that holds the sender thread still: given to the sender by its publisher,
closed only by ``coalesce.testing.held`` (a deterministic stand-in for a sender that
cannot get the GIL)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Gate"]


class Gate:
    """Open unless :meth:`hold` closed it.  The sender reads :attr:`closed` once a turn
    (one attribute read) and calls :meth:`wait` when it is set."""

    def __init__(self) -> None:
        self.closed: threading.Event | None = None
        """Set while held: the event the sender waits on."""
        self._parked = threading.Event()

    def wait(self) -> None:
        """The sender's side: say it is parked, then wait until released."""
        closed = self.closed
        if closed is not None:
            self._parked.set()
            closed.wait()

    def hold(self, wake: Callable[[], None], timeout: float = 10.0) -> None:
        """Close the gate and return once the sender is parked at it (``wake`` rouses a
        sleeping sender), so that nothing is taken from the backlog meanwhile."""
        self._parked.clear()
        self.closed = threading.Event()
        wake()
        if not self._parked.wait(timeout):
            raise RuntimeError("the sender thread did not park")

    def release(self) -> None:
        """Open the gate: a held sender goes on."""
        closed, self.closed = self.closed, None
        if closed is not None:
            closed.set()
