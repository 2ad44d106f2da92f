"""Every ```python block in the README and docs/ runs, so the docs stay true.

Blocks that import vLLM run in the conformance tier (tests_vllm), where the
real package is installed; here they are skipped.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _engine(code: str) -> str | None:
    """The engine package a block imports (vllm or sglang), or None."""
    found = re.search(r"^\s*(?:from|import)\s+(vllm|sglang)\b", code, re.M)
    return None if found is None else found.group(1)


def doc_blocks(engine: str | None) -> list[object]:
    """The python blocks of the docs that import ``engine`` (None: neither engine)."""
    out = []
    for path in DOCS:
        for n, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
            if _engine(code) == engine:
                out.append(pytest.param(code, id=f"{path.name}:{n}"))
    return out


def run_block(code: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("code", doc_blocks(None))
def test_doc_example_runs(code: str) -> None:
    run_block(code)


def test_engine_blocks_are_left_to_the_conformance_tiers() -> None:
    assert doc_blocks("vllm"), "docs/vllm.md should show a runnable check"
    assert doc_blocks("sglang"), "docs/sglang.md should show a runnable check"


def test_the_knobs_table_lists_every_knob_with_its_variable_and_default() -> None:
    from dataclasses import fields

    from coalesce._settings import Settings, env_name

    text = (ROOT / "docs" / "backpressure.md").read_text()
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `(\w+)` \| `(\w+)` \| ([^|]+) \|", text, re.M)}
    defaults = Settings()
    for f in fields(Settings):
        value = getattr(defaults, f.name)
        if value is None:
            shown = "none"
        elif isinstance(value, str):
            shown = value
        else:
            shown = str(int(value)) if isinstance(value, bool) else f"{value:,}"
        assert f.name in rows, f"{f.name} is missing from docs/backpressure.md"
        assert rows[f.name] == (env_name(f.name), shown), f.name


def test_the_generated_tables_are_what_the_code_renders_now() -> None:
    """``make docs`` rewrites them; a knob added, renamed or re-defaulted without it
    fails here."""
    from coalesce_tools.docgen import TABLES, render_into

    for path in DOCS:
        text = path.read_text()
        assert render_into(text) == text, f"{path.name} is stale: run make docs"
    where = {
        "config-table": "README.md",
        "bench-results": "docs/benchmarks.md",
        "headline": "README.md",
    }
    assert set(where) == set(TABLES)
    for name, path in where.items():
        assert f"<!-- {name}:start -->" in (ROOT / path).read_text(), name


def test_a_benchmark_result_round_trips_and_renders_per_host_shape(tmp_path, monkeypatch):
    from coalesce_tools import docgen, results

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(docgen, "BENCHMARKS", ("toy",))
    with results.recording("toy", "A toy. More words.") as figures:
        print("# toy title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n  aligned  1\n  aligned  2")
        figures["ratio"] = 1.5
    (doc,) = results.read_results("toy")
    assert doc["figures"]["ratio"] == 1.5 and doc["method"] == "A toy. More words."
    assert doc["host"]["cores"] >= 1 and "| 1 | 2 |" in doc["figures"]["output"]
    text = docgen.bench_results()
    assert text.startswith("## `bench_toy.py`: A toy\n\n### ")
    assert "#### toy title" in text and "| a | b |\n|---|---|\n| 1 | 2 |" in text
    assert "```text\n  aligned  1\n  aligned  2\n```" in text


def test_the_headline_is_the_newest_demo_result_of_any_host_shape(tmp_path, monkeypatch):
    import json

    from coalesce_tools import docgen, results

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    assert "bench_demo.py" in docgen.headline()  # none yet: says how to make one
    for cores, when, cell in (
        (2, "2026-12-05T01:00:00Z", "old"),
        (16, "2026-12-06T01:00:00Z", "new"),
    ):
        doc = {
            "when": when,
            "host": {"cores": cores},
            "figures": {"caption": "c", "output": f"# t\n\n| a |\n|---|\n| {cell} |\n\nwords"},
        }
        (tmp_path / f"demo.{cores}-core.json").write_text(json.dumps(doc))
    assert (
        docgen.headline() == "One run on a 16-core host (c), 2026-12-06:\n\n| a |\n|---|\n| new |"
    )


def test_the_median_interval_holds_the_median_and_narrows_with_agreeing_rounds() -> None:
    from coalesce_tools.results import median_interval

    spread = [0.82, 0.9, 0.97, 1.0, 1.02, 1.05, 1.1, 1.2, 1.25]
    low, high = median_interval(spread)
    assert low <= 1.02 <= high and low < high
    assert median_interval(spread) == (low, high)  # seeded: the same figures, the same interval
    tight = [1.02 + (i % 3 - 1) * 0.001 for i in range(25)]
    t_low, t_high = median_interval(tight)
    assert low < t_low <= 1.02 <= t_high < high
    assert median_interval([1.5]) == (1.5, 1.5)
    with pytest.raises(ValueError):
        median_interval([])
