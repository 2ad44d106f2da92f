# Types of the optional C accelerator (coalesce/_ccompact.c).
# tests/test_stubs.py checks this file against the built module.
from typing import Any, final

@final
class GroupResult(tuple[Any, ...]):
    """compact_events()'s result: the events, then the rule counts by name."""

    events: list[Any]
    superseded: int
    cancelled: int
    merged: int

@final
class WindowResult(tuple[Any, ...]):
    """compact_window()'s result: the batches, then the report's counts by name."""

    batches: list[Any]
    batches_in: int
    batches_out: int
    events_in: int
    events_out: int
    folded: int
    superseded: int
    cancelled: int
    merged: int

def register(cls: type, kind: int, fields: tuple[str, ...], /) -> bool: ...
def all_known(events: list[Any], /) -> bool | None: ...
def compact_events(events: list[Any], certain: bool = ..., /) -> GroupResult | type | None: ...
def register_batch(cls: type, rebuildable: bool, /) -> bool: ...
def compact_window(
    batches: list[Any], fold_only: bool, wire: bool = ..., certain: bool = ..., /
) -> WindowResult | tuple[int, type] | None: ...
def fields_at(obj: object, names: tuple[str, ...], /) -> tuple[Any, ...]: ...
def u64(x: object, /) -> int | None: ...
def gil_releases() -> int: ...
