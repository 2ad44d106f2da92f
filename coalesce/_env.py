"""Environment switches that turn the optional accelerators off (A/B runs, debugging).

``COALESCE_NO_ACCEL``: every C accelerator (compactor, recorder, native send);
``COALESCE_PYZMQ_SEND``: the native send only.  A switch is on when its
variable is set to anything but the empty string or ``0``.
"""

from __future__ import annotations

import os

__all__ = ["NO_ACCEL", "PYZMQ_SEND", "switched_on"]

NO_ACCEL = "COALESCE_NO_ACCEL"
PYZMQ_SEND = "COALESCE_PYZMQ_SEND"


def switched_on(name: str) -> bool:
    """Whether the environment variable ``name`` is set to anything but ``""`` or ``0``.
    O(1); read at each call (the modules read it once, at import or first use)."""
    return os.environ.get(name, "") not in ("", "0")
