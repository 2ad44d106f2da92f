"""A benchmark of this checkout against another checkout's library, in one run.

Run: ``.venv/bin/python benchmarks/bench_against.py DIR bench_engine.py [--runs 5]
[-- ARGS...]``.  ``DIR`` is another checkout (its C extensions built in place,
e.g. from a wheel of it); ``before`` is its library (``coalesce/``) first on
``PYTHONPATH``, with this checkout's tools and benchmarks; ``after`` is this
checkout.  The benchmark (any of ``benchmarks/``, with ``ARGS``) runs in a fresh
process for each, the two alternated ``--runs`` times, its result file written
to a temporary folder (``COALESCE_RESULTS_DIR``) so the committed ones stay.
Every numeric cell of every table row it prints is taken from each run; the
table shows, for the columns named by ``--column`` (all numeric ones if none),
the median of each side and after / before.  A benchmark that compares
against vLLM's publisher in the same run (``engine vs stock``, ``coalesce /
stock``) gives a ratio that the machine's drift between runs does not move.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from coalesce_tools.results import header, row, run

HERE = Path(__file__).resolve().parent
_NUMBER = re.compile(r"^-?[\d,]*\.?\d+(x|%)?$")


def _cells(output: str) -> dict[tuple[str, str], float]:
    """Each numeric cell of each table row: (the row, named by its first cell and its
    text cells, the column's header) -> value."""
    out: dict[tuple[str, str], float] = {}
    columns: list[str] = []
    for line in output.splitlines():
        if not line.startswith("|"):
            columns = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set("".join(cells)) <= set("-: "):
            continue
        if not columns:
            columns = cells
            continue
        text = [c for c in cells[1:] if c and not _NUMBER.match(c.replace(" ", ""))]
        name = ", ".join([cells[0], *text])
        for column, cell in zip(columns[1:], cells[1:], strict=False):
            number = cell.replace(",", "").replace(" ", "").rstrip("x%")
            if _NUMBER.match(cell.replace(" ", "")) and number:
                out[(name, column)] = float(number)
    return out


def _once(script: str, args: list[str], before: str | None) -> dict[tuple[str, str], float]:
    with tempfile.TemporaryDirectory(prefix="bench-against-") as results:
        env = dict(os.environ, COALESCE_RESULTS_DIR=results)
        if before is not None:
            env["PYTHONPATH"] = before
        subprocess.run(
            [sys.executable, str(HERE / script), *args],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (path,) = Path(results).glob("*.json")
        doc: dict[str, Any] = json.loads(path.read_text())
    return _cells(doc["figures"]["output"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("against", metavar="DIR", help="another checkout: 'before'")
    ap.add_argument("script", help="a benchmark of benchmarks/, e.g. bench_engine.py")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--column", action="append", help="only these columns")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.args = argv[cut + 1 :]  # the benchmark's own arguments
    shadow = tempfile.mkdtemp(prefix="bench-against-lib-")  # only its library
    os.symlink(os.path.join(os.path.abspath(args.against), "coalesce"), f"{shadow}/coalesce")
    sides: dict[str, list[dict[tuple[str, str], float]]] = {"before": [], "after": []}
    for _ in range(args.runs):
        sides["before"].append(_once(args.script, args.args, shadow))
        sides["after"].append(_once(args.script, args.args, None))
    print(
        f"# {args.script}: {os.path.abspath(args.against)} (before) against this checkout "
        f"(after)\n\n{args.runs} alternated runs each, {' '.join(args.args) or 'its defaults'};"
        " medians\n"
    )
    header("row", "column", "before", "after", "after / before")
    keys = [k for k in sides["after"][0] if all(k in r for s in sides.values() for r in s)]
    for key in keys:
        if args.column and key[1] not in args.column:
            continue
        b, a = (statistics.median(r[key] for r in sides[s]) for s in ("before", "after"))
        ratio = f"{a / b:.2f}" if b else ""
        row(key[0], key[1], f"{b:g}", f"{a:g}", ratio)


if __name__ == "__main__":
    name = "against." + (sys.argv[2].removesuffix(".py") if len(sys.argv) > 2 else "unknown")
    run(name, __doc__, main)
