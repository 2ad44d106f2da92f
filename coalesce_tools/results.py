"""Benchmark results as files: one JSON document per benchmark and host shape.

Each benchmark calls :func:`write_result` with its name, its method (its
docstring) and its figures; the file lands in ``benchmarks/results/`` as
``<name>.<shape>.json``, where the shape is the host's core count
(``2-core``, ``16-core``), so a many-core run sits beside this VM's instead of
replacing it.  docs/benchmarks.md's generated section is built from these
files (``make docs``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from coalesce_tools.host import host

__all__ = ["RESULTS", "read_results", "write_result"]

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def write_result(name: str, method: str, figures: dict[str, Any], engine: str = "vllm") -> str:
    """Write one benchmark's result for this host shape; returns the file's path."""
    h = host(engine)
    doc = {
        "benchmark": name,
        "method": " ".join(method.split()),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": h,
        "figures": figures,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.{h['cores']}-core.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return str(path)


def read_results(name: str) -> list[dict[str, Any]]:
    """Every stored result of benchmark ``name``, fewest cores first."""
    docs = [json.loads(p.read_text()) for p in RESULTS.glob(f"{name}.*-core.json")]
    return sorted(docs, key=lambda d: int(d["host"]["cores"]))
