"""The host a run was made on, as every result the tools write records it."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

__all__ = ["describe", "host"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host(engine: str = "vllm") -> dict[str, Any]:
    """Cores, CPU, Python, which C accelerators run, and which of ``engine``'s
    publishers is the stock one (the real class, or the re-implementation)."""
    from importlib.metadata import version

    from coalesce import testing
    from coalesce_tools.baselines import stock_publisher

    # (an older checkout's library, in a before/after run, has no accelerators())
    accelerators: Callable[[], dict[str, bool]] = getattr(testing, "accelerators", dict)

    stock = f"re-implemented ({engine} not installed)"
    if stock_publisher(engine)[1]:
        stock = f"real {engine} {version(engine)}"
    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "machine": platform.machine(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        **{f"c_{name}": on for name, on in accelerators().items()},
        "stock_publisher": stock,
    }


def describe(h: dict[str, Any]) -> str:
    """One line for the top of a run's output."""
    built = [name for name in ("c_compactor", "c_recorder", "c_send") if h.get(name)]
    return (
        f"host: {h['cores']} cores, {h['cpu']}, {h['python']}; C accelerators: "
        f"{', '.join(built) if built else 'none'}; stock publisher: {h['stock_publisher']}"
    )
