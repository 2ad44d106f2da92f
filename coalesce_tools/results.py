"""Benchmark results as files: one JSON document per benchmark and host shape.

Each benchmark calls :func:`write_result` with its name, its method (its
docstring) and its figures; the file lands in ``benchmarks/results/`` as
``<name>.<shape>.json``, where the shape is the host's core count
(``2-core``, ``16-core``), so a many-core run sits beside this VM's instead of
replacing it.  docs/benchmarks.md's generated section is built from these
files (``make docs``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from coalesce_tools.host import host

__all__ = [
    "RESULTS",
    "header",
    "median_interval",
    "read_results",
    "recording",
    "row",
    "run",
    "write_result",
]

RESULTS = Path(
    os.environ.get("COALESCE_RESULTS_DIR")
    or Path(__file__).resolve().parent.parent / "benchmarks" / "results"
)
"""Where result files go: ``benchmarks/results/``, or ``COALESCE_RESULTS_DIR`` (a
before/after run's temporary folder: benchmarks/bench_against.py)."""


class _Tee(io.TextIOBase):
    """Writes go to the terminal and are kept."""

    def __init__(self, out: Any) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return int(self.out.write(text))

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def recording(name: str, method: str, engine: str = "vllm") -> Iterator[dict[str, Any]]:
    """Run a benchmark's ``main()`` inside: what it prints (its markdown tables) is
    shown and kept, with whatever it puts in the yielded dict, as its result file.
    Nothing is written if it raises."""
    figures: dict[str, Any] = {}
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield figures
    figures.setdefault("output", tee.kept.getvalue())
    path = write_result(name, method, figures, engine)
    print(f"result: {os.path.relpath(path)}")


def run(name: str, doc: str | None, main: Callable[[], None], engine: str = "vllm") -> None:
    """A benchmark's entry point: ``main()`` under :func:`recording`, its docstring as
    the method."""
    with recording(name, doc or "", engine):
        main()


def median_interval(
    xs: list[float], level: float = 0.95, draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A bootstrap interval for the median of ``xs`` (percentile method, ``draws``
    resamples, seeded: the same figures give the same interval).  Alternated
    rounds on a shared host vary by a tenth or more; the interval says how far
    their median may be trusted.  O(draws * len(xs) log len(xs))."""
    if not xs:
        raise ValueError("no figures")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return medians[cut], medians[draws - 1 - cut]


def header(*columns: str) -> None:
    """Print a markdown table's header row and its rule."""
    row(*columns)
    print("|" + "---|" * len(columns), flush=True)


def row(*cells: object) -> None:
    """Print one markdown table row of ``cells`` (each as ``str()`` gives it), at once."""
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


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
