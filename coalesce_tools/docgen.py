"""Tables in the docs that are generated from the code: ``make docs`` rewrites them,
and tests/test_docs.py fails when one differs from what this module renders.

A generated table sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``.
"""

from __future__ import annotations

import ast
import enum
import inspect
import pathlib
import re
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from coalesce import PublisherConfig, Settings
from coalesce.testing import env_name

__all__ = ["TABLES", "bench_results", "config_table", "headline", "regenerate", "render_into"]

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass in coalesce/_settings.py."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls) or cls))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    for node, after in zip(body.body, body.body[1:], strict=False):  # (each node and the next)
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            text = " ".join(after.value.value.split())
            docs[node.target.id] = text.replace("``", "`")  # reST literals as Markdown
    return docs


def _first_sentence(text: str) -> str:
    match = re.match(r"(.+?\.)(\s|$)", text)
    return match.group(1) if match else text


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value) if value != "" else '`""`'


_VLLM_FIELDS = {
    "endpoint": "Where the PUB socket binds (`*`, `::`, ipc, inproc) or connects; "
    "tcp ports are offset by the DP rank.",
    "replay_endpoint": "The ROUTER that answers replay requests; none: no replay.",
    "buffer_steps": "Messages kept for replay.",
    "hwm": "The PUB socket's send high-water mark.",
    "max_queue_size": "Batches the hand-off holds (vLLM's queue bound); past it a batch "
    "is refused if the sender takes nothing for `stall_timeout`.",
    "topic": "The first frame of every message.",
}


def config_table() -> str:
    """Every setting: vLLM's fields (from its config), then this project's knobs
    (keyword or ``COALESCE_*`` variable), with defaults from the code."""
    rows = ["| setting | set by | default | what it does |", "|---|---|---|---|"]
    vllm_defaults = PublisherConfig()
    knobs = {f.name for f in fields(Settings)}
    for f in fields(PublisherConfig):
        if f.name in knobs:
            continue  # (snapshot fields: listed with this project's knobs below)
        rows.append(
            f"| `{f.name}` | vLLM's `kv_events_config` | "
            f"{_shown(getattr(vllm_defaults, f.name))} | {_VLLM_FIELDS[f.name]} |"
        )
    docs = _field_docs(Settings)
    defaults = Settings()
    for f in fields(Settings):
        rows.append(
            f"| `{f.name}` | `{env_name(f.name)}` | {_shown(getattr(defaults, f.name))} | "
            f"{_first_sentence(docs[f.name])} |"
        )
    return "\n".join(rows)


BENCHMARKS = (
    "demo",
    "drain",
    "publish",
    "overload",
    "engine",
    "policy",
    "compact",
    "recorder",
    "resync",
    "replay",
    "sglang",
    "realstream",
    "realengine",
    "stock_blocks",
)
"""The benchmarks docs/benchmarks.md shows, in its order (``benchmarks/bench_<name>.py``)."""


def _markdown(output: str) -> str:
    """A benchmark's printed output as Markdown: its tables as they are, a lone line as
    a paragraph, a run of other lines (aligned columns, JSON) as a preformatted block."""
    groups: list[tuple[bool, list[str]]] = []  # (is a table, its lines)
    for line in output.rstrip().splitlines():
        line = line.rstrip()
        if not line or line.startswith("result: "):
            groups.append((False, []))
            continue
        if line.startswith("#"):  # its own headings, under this page's
            groups += [(False, []), (True, ["#### " + line.lstrip("#").strip()]), (False, [])]
            continue
        is_row = line.startswith("|")
        if groups and groups[-1][0] == is_row and groups[-1][1]:
            groups[-1][1].append(line)
        else:
            groups.append((is_row, [line]))
    parts = []
    for is_table, lines in groups:
        if not lines:
            continue
        if is_table or (len(lines) == 1 and not lines[0].startswith(" ")):
            parts.append("\n".join(lines))
        else:
            parts.append("```text\n" + "\n".join(lines) + "\n```")
    return "\n\n".join(parts)


def bench_results() -> str:
    """Every stored benchmark result (benchmarks/results/), per benchmark and host shape."""
    from coalesce_tools.results import read_results

    parts: list[str] = []
    for name in BENCHMARKS:
        docs = read_results(name)
        if not docs:
            continue
        title = docs[-1]["method"].split(". ")[0].rstrip(".").replace("``", "`")
        parts.append(f"## `bench_{name}.py`: {title}")
        for doc in docs:
            h = doc["host"]
            built = [k[2:] for k in ("c_compactor", "c_recorder", "c_send") if h.get(k)]
            parts.append(
                f"### {h['cores']}-core host ({h['cpu']}, {h['python']}; C: "
                f"{', '.join(built) or 'none'}; stock: {h['stock_publisher']}), {doc['when']}"
            )
            parts.append(_markdown(doc["figures"].get("output", "")))
    return "\n\n".join(parts)


def headline() -> str:
    """The README's headline: the table of the newest ``bench_demo.py`` result, of
    whichever host shape ran it last."""
    from coalesce_tools.results import read_results

    docs = read_results("demo")
    if not docs:
        return "(no result yet: run `benchmarks/bench_demo.py`, then `make docs`)"
    doc = max(docs, key=lambda d: str(d["when"]))
    table = [line for line in doc["figures"]["output"].splitlines() if line.startswith("|")]
    return (
        f"One run on a {doc['host']['cores']}-core host ({doc['figures']['caption']}), "
        f"{doc['when'][:10]}:\n\n" + "\n".join(table)
    )


TABLES = {"config-table": config_table, "bench-results": bench_results, "headline": headline}
"""The generated tables, by marker name."""


def _between(table: str) -> Callable[[re.Match[str]], str]:
    """A replacement that puts ``table`` between a matched pair of markers."""
    return lambda m: m.group(1) + table + "\n" + m.group(2)


def render_into(text: str) -> str:
    """``text`` with every generated table replaced by what the code renders now."""
    for name, render in TABLES.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n)(?:.*?\n)?(<!-- {name}:end -->)", re.S)
        text = pattern.sub(_between(render()), text)
    return text


def regenerate(paths: list[pathlib.Path]) -> list[pathlib.Path]:
    """Rewrite the generated tables in ``paths``; the files that changed."""
    changed = []
    for path in paths:
        old = path.read_text()
        new = render_into(old)
        if new != old:
            path.write_text(new)
            changed.append(path)
    return changed


if __name__ == "__main__":
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in regenerate(docs):
        print(f"regenerated {path.relative_to(ROOT)}", file=sys.stderr)
