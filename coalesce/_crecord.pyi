# Types of the optional C loop of the snapshot recorder (coalesce/_crecord.c).
# tests/test_stubs.py checks this file against the built module.
from typing import Any

def record(
    events: list[Any],
    i: int,
    kinds: dict[type, int],
    live: dict[Any, dict[Any, int]],
    sources: dict[int, tuple[Any, ...]],
    refs: dict[int, int],
    unused: list[int],
    n: list[int],
    /,
) -> int: ...
def collect(
    sources: dict[int, tuple[Any, ...]], refs: dict[int, int], unused: list[int], n: list[int], /
) -> None: ...
