# Types of the optional C state of the snapshot recorder (coalesce/_crecord.c).
from collections.abc import Callable
from typing import Any

class Walk:
    def next(self) -> list[Any] | None: ...
    def close(self) -> None: ...

class State:
    stopped: int
    held: int
    counts: int
    kept: int
    sources: int
    nbytes: int
    batches: int
    events: int
    def record_batch(self, batch: Any, max_blocks: int, /) -> int: ...
    def record(self, events: list[Any], i: int, max_blocks: int = ..., /) -> int: ...
    def clear(self) -> None: ...
    def export(
        self,
    ) -> tuple[
        dict[Any, dict[Any, int]], dict[int, tuple[Any, ...]], dict[int, int], list[int]
    ]: ...
    def walk(
        self,
        max_events: int,
        max_tokens: int,
        max_work: int,
        per_event: int,
        make_removed: Callable[[list[Any], Any, Any, Any, Any], Any],
        /,
    ) -> Walk: ...

def register(cls: type, kind: int, /) -> bool: ...
def set_nogil_from(n: int, /) -> int: ...
def fields_at(obj: Any, names: tuple[str, ...], /) -> tuple[Any, ...]: ...
def u64(x: object, /) -> int | None: ...
def gil_releases() -> int: ...
