"""The import-time check that the C accelerators read msgspec's and CPython's
layouts as they assume (coalesce/_layout.py), and the fall-back when they do not."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from coalesce import _layout
from coalesce._env import NO_ACCEL, switched_on

# where the C build is absent there is nothing to check (tests/test_accel.py fails
# that case when COALESCE_REQUIRE_ACCEL is set)
_ccompact = pytest.importorskip("coalesce._ccompact")


def test_the_built_module_reads_this_msgspec_as_it_assumes():
    assert _layout.layout_problem(_ccompact) is None


def _swapped(obj: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    values = [getattr(obj, n) for n in names]
    return tuple(values[1:] + values[:1])  # every field read from its neighbour's slot


def _low_bits(x: object) -> int | None:
    return x & (2**60 - 1) if isinstance(x, int) and 0 <= x < 2**64 else None


@pytest.mark.parametrize(
    "accel, says",
    [
        (SimpleNamespace(fields_at=_swapped, u64=_ccompact.u64), "is not at the slot"),
        (SimpleNamespace(fields_at=_ccompact.fields_at, u64=_low_bits), "reads as"),
        (SimpleNamespace(), "probe failed"),
    ],
    ids=["fields moved", "digits moved", "no probes"],
)
def test_a_layout_the_c_code_would_misread_is_named(accel, says):
    problem = _layout.layout_problem(accel)
    assert problem is not None and says in problem


@pytest.mark.skipif(switched_on(NO_ACCEL), reason="COALESCE_NO_ACCEL: no accelerator to refuse")
def test_when_the_check_fails_the_python_code_runs_and_says_so_once():
    code = """
import logging, sys, types
logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
fake = types.ModuleType("coalesce._ccompact")  # built, but reading the wrong slots
fake.fields_at = lambda obj, names: tuple(None for _ in names)
fake.u64 = lambda x: None
sys.modules["coalesce._ccompact"] = fake
from coalesce import compactor
print("compactor", compactor.accelerated())
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["compactor", "False"]
    warnings = [line for line in run.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, run.stderr
    assert all("is not at the slot" in w and "msgspec" in w for w in warnings)
