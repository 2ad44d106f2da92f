"""The CPU a publisher's own Python threads spend: its sender holds the GIL the
engine wants, so this is what the engine's CPU pays for it (zmq's I/O threads,
which send without the GIL, are not Python threads and are not counted).

Linux only (``/proc/self/task/<tid>/schedstat``); NaN elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def started_by(make: Callable[[], Any]) -> tuple[Any, list[int]]:
    """``make()``'s result and the native ids of the Python threads it started."""
    before = {t.ident for t in threading.enumerate()}
    made = make()
    ids = [t.native_id for t in threading.enumerate() if t.ident not in before]
    return made, [n for n in ids if n is not None]


def cpu_seconds(native_ids: list[int]) -> float:
    """CPU seconds the threads ``native_ids`` of this process have run so far."""
    total = 0.0
    for tid in native_ids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            return float("nan")
    return total
