"""The .pyi stubs of the C accelerators match the built modules.

For each module: the same public names; for each function, the stub's
parameters (names, kinds, which have defaults) equal the signature the C states
in its docstring (``__text_signature__``), where it states one; and, for every
function, the arities the stub allows are the ones the C accepts: a call with
one argument too few or too many raises TypeError for its arity, a call within
them does not.  For the result classes, the stub's properties are the fields, in
order.  A module that is not built is skipped.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "coalesce"
MODULES = ("_ccompact", "_csend", "_crecord")

ARITY = re.compile(r"takes|given\)")
"""How the C words a wrong number of arguments (PyArg_ParseTuple, METH_O,
METH_NOARGS and the modules' own FASTCALL checks)."""

ARITY_UNWORDED = {("_crecord", "collect")}
"""Functions whose wrong arity raises a TypeError that names the types instead:
only a TypeError is asked of them (_crecord.c, until the recorder rewrite lands)."""

_KINDS = {
    "posonlyargs": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
}


def _module(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"coalesce.{name}")
    except ImportError:
        pytest.skip(f"coalesce.{name} is not built")


def _stub(name: str) -> dict[str, ast.stmt]:
    """The stub's public top-level definitions, by name."""
    tree = ast.parse((PACKAGE / f"{name}.pyi").read_text())
    out: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            out.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
    return {k: v for k, v in out.items() if not k.startswith("_")}


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, Any, bool]]:
    """(name, inspect kind, has a default) for each positional parameter."""
    a = fn.args
    assert a.vararg is None and not a.kwonlyargs and a.kwarg is None, fn.name
    positional = [(p, _KINDS["posonlyargs"]) for p in a.posonlyargs]
    positional += [(p, _KINDS["args"]) for p in a.args]
    first_default = len(positional) - len(a.defaults)
    return [(p.arg, kind, i >= first_default) for i, (p, kind) in enumerate(positional)]


def _functions(name: str) -> list[tuple[str, ast.FunctionDef]]:
    return [(k, v) for k, v in _stub(name).items() if isinstance(v, ast.FunctionDef)]


def _cases() -> list[tuple[str, str]]:
    return [(m, f) for m in MODULES for f, _ in _functions(m)]


@pytest.mark.parametrize("name", MODULES)
def test_the_stub_names_what_the_module_has(name: str) -> None:
    mod = _module(name)
    public = {k for k in vars(mod) if not k.startswith("_")}
    assert set(_stub(name)) == public


@pytest.mark.parametrize("name, fn_name", _cases())
def test_the_stub_signature_is_the_c_signature(name: str, fn_name: str) -> None:
    fn = getattr(_module(name), fn_name)
    stub = _stub_params(dict(_functions(name))[fn_name])
    try:
        sig = inspect.signature(fn)
    except ValueError:  # the C states none: the arity test alone
        assert fn.__text_signature__ is None
        return
    c = [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values()]
    assert stub == c


def _call(fn: Any, n: int) -> BaseException | None:
    try:
        fn(*[None] * n)
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("name, fn_name", _cases())
def test_the_stub_arity_is_what_the_c_accepts(name: str, fn_name: str) -> None:
    fn = getattr(_module(name), fn_name)
    params = _stub_params(dict(_functions(name))[fn_name])
    least = sum(1 for *_, has_default in params if not has_default)
    for n in (least - 1, len(params) + 1):
        if n < 0:
            continue
        exc = _call(fn, n)
        assert isinstance(exc, TypeError), f"{fn_name} with {n} arguments: {exc!r}"
        if (name, fn_name) not in ARITY_UNWORDED:
            assert ARITY.search(str(exc)), f"{fn_name} with {n} arguments: {exc!r}"
    for n in range(least, len(params) + 1):
        exc = _call(fn, n)
        assert not (isinstance(exc, TypeError) and ARITY.search(str(exc))), (fn_name, n, exc)


@pytest.mark.parametrize("name", MODULES)
def test_the_stub_result_classes_have_the_fields(name: str) -> None:
    mod = _module(name)
    for cls_name, node in _stub(name).items():
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(mod, cls_name)
        props = [
            f.name
            for f in node.body
            if isinstance(f, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
        ]
        if hasattr(cls, "__match_args__"):  # a result class (structseq): its fields, in order
            assert props == list(cls.__match_args__), cls_name
            continue
        members = [  # a class of objects: each method and attribute the stub names
            f.target.id
            if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
            else f.name
            for f in node.body
            if isinstance(f, ast.FunctionDef | ast.AnnAssign)
        ]
        assert members and all(hasattr(cls, m) for m in members), (cls_name, members)


def test_the_checks_catch_drift() -> None:
    """The parsing the tests rely on sees what it must (a stub without `tail`)."""
    tree = ast.parse("def send(handle: int, topic: bytes, tail: bytes = ..., /) -> int: ...")
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    params = _stub_params(fn)
    assert [p[0] for p in params] == ["handle", "topic", "tail"]
    assert [p[2] for p in params] == [False, False, True]
    assert ARITY.search("send() takes 4 or 5 arguments")
    assert ARITY.search("register() takes exactly 3 arguments (4 given)")
    assert not ARITY.search("register() argument 1 must be type, not None")
