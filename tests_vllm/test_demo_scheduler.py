"""``coalesce demo --scheduler`` end to end, small: two DP ranks in lockstep, each a
process running vLLM's own scheduler, stock and coalesce+snap rows, one subscriber
checked against each rank's pools (the full run is ``make demo-vllm``)."""

from __future__ import annotations

import json

from coalesce_tools.demo_vllm import run_scheduler_demo
from coalesce_tools.vllm_engine import EngineConfig


def test_the_scheduler_demo_runs_and_every_row_ends_exact(tmp_path):
    cfg = EngineConfig(
        requests=48,
        concurrency=16,
        prefixes=4,
        prefix_tokens=256,
        gpu_blocks=80,
        cpu_blocks=100,
        max_num_seqs=16,
    )
    rows = run_scheduler_demo(
        cfg, ranks=2, queue=50, rows=("stock", "coalesce+snap"), outdir=str(tmp_path)
    )
    assert [r.publisher for r in rows] == ["stock", "coalesce+snap"]
    for r in rows:
        assert r.exact_ranks == 2, (r.publisher, r.missing, r.stale, r.count_differs)
        assert r.steps > 0 and r.batches > 0 and r.dropped == 0
        assert set(r.per_medium) == {"GPU", "CPU"}
    saved = json.loads((tmp_path / "demo-vllm.json").read_text())
    assert saved["ranks"] == 2 and len(saved["rows"]) == 2
