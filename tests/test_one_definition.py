"""Each vocabulary of the library is defined once: a second definition (a copy that
can drift) fails here.  A grep over the library's sources, not an import: it reads
what a newcomer would read."""

from __future__ import annotations

import pathlib
import re

from coalesce._settings import LossMarker

LIBRARY = pathlib.Path(__file__).resolve().parent.parent / "coalesce"
_NAMES = "|".join(m.value for m in LossMarker)
COMPARED = re.compile(rf"""(==|!=|\bin\b|\bis\b|[(\[,{{]\s*)\s*["']({_NAMES})["']""")
"""A loss-marker name compared, or listed, as a string."""


def sources(*suffixes: str) -> dict[str, str]:
    return {p.name: p.read_text() for s in suffixes for p in sorted(LIBRARY.glob(f"*{s}"))}


def test_the_loss_marker_names_are_spelled_only_in_their_enum():
    """Code compares ``LossMarker`` members; a quoted name outside ``_settings.py`` is a
    second list (docstrings and log keys aside: only comparisons and collections)."""
    found = [
        f"{name}:{n}: {line.strip()}"
        for name, text in sources(".py").items()
        if name != "_settings.py"
        for n, line in enumerate(text.splitlines(), 1)
        if COMPARED.search(line) and not line.lstrip().startswith(("#", '"', "'", "``"))
    ]
    assert not found, "loss-marker names outside LossMarker:\n" + "\n".join(found)


def test_the_grep_finds_a_second_list():
    """The pattern above catches the shapes a copy would take."""
    for copy in ('if mode == "resync":', 'MARKERS = ("clear", "resync", "gap")', "x in ['gap']"):
        assert COMPARED.search(copy), copy
