"""The seed scenario as ``make demo`` runs it: the README's headline table.

Run: ``.venv/bin/python benchmarks/bench_demo.py``.  One run of ``coalesce demo``
at its defaults (the bursts sized to a fixed bound, two DP ranks, DP lockstep
where the host has a core for each rank's engine and sender), each publisher
with a real subscriber in another process; the demo's own output is not
kept.  The table is what ``make docs`` writes into the README: per publisher,
the engine loop's wall time, the publish() calls that found vLLM's queue full,
the p99 of ``publish()`` (worst rank), the batches dropped, the gaps the
subscriber saw, and the blocks its index had wrong at the end (``silent``: on
ranks it had no reason to doubt).
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from dataclasses import replace
from typing import Any

from coalesce_tools.cli import lockstep_for
from coalesce_tools.demo import conclusions, run_demo
from coalesce_tools.results import header, recording, row
from coalesce_tools.workload import WorkloadConfig

LABELS = {
    "stock": "vLLM 0.33 (`stock`)",
    "drop": "drop on full (vLLM PR #53883)",
    "coalesce": "`coalesce`",
    "coalesce+snap": "`coalesce`, snapshots on",
}


def wrong(r: Any) -> str:
    """The blocks the subscriber had wrong at the end, and whether it knew."""
    n = r.missing + r.stale
    return f"{n:,} (silent)" if r.silent else f"{n:,}"


def main(figures: dict[str, Any]) -> None:
    defaults = WorkloadConfig()
    cfg = replace(defaults, lockstep=lockstep_for("auto", defaults.ranks))
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        results = run_demo(cfg, outdir=out)
    stock = next(r for r in results if r.publisher == "stock")
    figures["caption"] = (
        f"vLLM's publisher {'the real class' if stock.real_vllm else 're-implemented'}; "
        f"ranks {'in DP lockstep' if cfg.lockstep else 'independent'}"
    )
    print(f"# make demo ({figures['caption']})\n")
    header(
        "publisher",
        "engine loop",
        "blocked calls",
        "p99 `publish()`",
        "dropped",
        "gaps",
        "wrong blocks at the end",
    )
    for r in results:
        row(
            LABELS.get(r.publisher, r.publisher),
            f"{r.engine_wall_s:.2f} s",
            f"{r.blocked:,}",
            f"{r.publish_p99_us:,.0f} µs",
            f"{r.dropped:,}",
            f"{r.gaps_seen:,}",
            wrong(r),
        )
    print()
    for line in conclusions(results):
        print(line)


if __name__ == "__main__":
    with recording("demo", __doc__ or "") as figures:
        main(figures)
