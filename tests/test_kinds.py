"""Event kinds are defined once, for Python and C: coalesce/_kinds.py holds the
numbers, coalesce/_kinds.h the same numbers for the C accelerators, and no other
file of the package defines them again."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from coalesce import _kinds

PACKAGE = Path(_kinds.__file__).parent
KINDS = ("OPAQUE", "STORED", "REMOVED", "CLEARED")
_NAME = re.compile(r"^(K_)?(OPAQUE|STORED|REMOVED|CLEARED)$")
_C_DEF = re.compile(
    r"\b(?:K_)?(?:OPAQUE|STORED|REMOVED|CLEARED)\s*=\s*-?\d"  # an enum member
    r"|#\s*define\s+(?:K_)?(?:OPAQUE|STORED|REMOVED|CLEARED)\s"
)

KNOWN_SECOND_DEFINITIONS = {"_recorder.py", "_crecord.c"}
"""Files that still number the kinds their own way (STORED=0 ...): until the
recorder rewrite lands, which switches them to _kinds; then this set empties."""


def _header_kinds() -> dict[str, int]:
    text = (PACKAGE / "_kinds.h").read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"\bK_([A-Z]+)\s*=\s*(\d+)", text)}


def test_the_header_numbers_the_kinds_as_kinds_py():
    assert _header_kinds() == {name: getattr(_kinds, name) for name in KINDS}


def test_the_compactor_takes_its_kinds_from_the_header():
    for path in (PACKAGE / "_ccompact.c", *PACKAGE.glob("_cc_*.h")):
        text = path.read_text()
        if path.name == "_ccompact.c":
            assert '#include "_kinds.h"' in text
        assert not _C_DEF.search(text), path.name


def _is_number(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int)
    if isinstance(node, ast.Tuple):
        return all(_is_number(e) for e in node.elts)
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
    )


def _py_defines_kinds(source: str) -> bool:
    """An assignment of numbers (an int, a tuple of ints, a range) to a kind's name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if any(_NAME.match(n) for n in names) and _is_number(value):
            return True
    return False


def _defines_kinds(path: Path) -> bool:
    if path.suffix == ".py":
        return _py_defines_kinds(path.read_text())
    return path.suffix in (".c", ".h") and _C_DEF.search(path.read_text()) is not None


def _second_definitions() -> set[str]:
    own = ("_kinds.py", "_kinds.h")
    return {p.name for p in PACKAGE.iterdir() if p.name not in own and _defines_kinds(p)}


def test_no_second_definition_of_the_kind_numbers():
    assert _second_definitions() <= KNOWN_SECOND_DEFINITIONS


def test_the_grep_finds_a_second_definition():
    assert _py_defines_kinds("STORED, REMOVED = range(2)")
    assert _py_defines_kinds("class K:\n    OPAQUE: int = 0")
    assert not _py_defines_kinds("REMOVED = {'knob': 'why'}")  # a name, not a kind
    assert not _py_defines_kinds("from coalesce._kinds import STORED")
    assert _C_DEF.search("enum { STORED = 0, REMOVED = 1 };")
    assert _C_DEF.search("#define K_CLEARED 3\n")
    assert not _C_DEF.search("if (kind == K_STORED) return 1;")
