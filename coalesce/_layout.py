"""The check, at import, that the C compactor reads objects as it assumes.

``_ccompact`` reads a msgspec struct's fields straight from
its slots, at the offsets its member descriptors name, and (on CPython before
3.12) a block hash's digits straight from the int.  Both are layouts of other
projects: :func:`layout_problem` runs the module's own readers (``fields_at``,
``u64``) on objects whose values it knows, and the caller uses the pure-Python
code instead when they disagree.  O(fields of the probe objects).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgspec

from coalesce._env import NO_ACCEL, switched_on
from coalesce.events import BlockMoved, BlockRemoved, BlockStored, KVEventBatch

__all__ = ["layout_problem", "load_accelerator"]

log = logging.getLogger("coalesce")

_HASHES = (0, 1, 2**30 - 1, 2**30, 2**60 + 3, 2**63, 2**64 - 1, 2**64, 2**90, -1)
"""Block hashes across CPython's digit boundaries, and three that are not u64."""


def _probes() -> list[Any]:
    """One object of each struct the C code reads, every field a distinct object (a
    fresh list: a field read from a neighbour's slot cannot pass for it)."""
    classes: tuple[type[Any], ...] = (BlockStored, BlockRemoved, BlockMoved, KVEventBatch)
    return [cls(*([i] for i in range(len(cls.__struct_fields__)))) for cls in classes]


def layout_problem(accel: ModuleType) -> str | None:
    """Why ``accel`` would misread these objects, or None when it reads them right."""
    try:
        for obj in _probes():
            names: tuple[str, ...] = type(obj).__struct_fields__
            for name, got in zip(names, accel.fields_at(obj, names), strict=True):
                if got is not getattr(obj, name):
                    return f"{type(obj).__name__}.{name} is not at the slot its descriptor names"
        for h in _HASHES:
            want = h if 0 <= h < 2**64 else None
            if accel.u64(h) != want:
                return f"the block hash {h} reads as {accel.u64(h)}"
    except Exception as exc:  # a module without the probes, or one that fails them
        return f"the layout probe failed ({type(exc).__name__}: {exc})"
    return None


def load_accelerator(
    name: str,
    instead: str,
    check: Callable[[ModuleType], str | None] | None = layout_problem,
    off: str | None = None,
) -> ModuleType | None:
    """``coalesce.<name>``, a C accelerator, where it is built, not switched off
    (``COALESCE_NO_ACCEL``, or the variable ``off`` names) and passes ``check`` (by
    default, it reads objects as it assumes: :func:`layout_problem`); else None, with
    one WARNING when it was built but fails the check (``instead``: what runs then).
    The one loader of every C accelerator."""
    if switched_on(NO_ACCEL) or (off is not None and switched_on(off)):
        return None
    try:
        accel = importlib.import_module(f"coalesce.{name}")
    except ImportError:
        return None
    why = None if check is None else check(accel)
    if why is not None:
        log.warning(
            "kv-coalesce: coalesce.%s is not used; %s (msgspec %s): %s",
            name,
            instead,
            msgspec.__version__,
            why,
        )
        return None
    return accel
