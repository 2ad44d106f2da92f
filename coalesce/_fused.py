"""The layouts the C recorder's fused encoder writes (``State.encode_record``).

``encode_record`` encodes a batch as ``msgspec.msgpack.Encoder().encode`` does
and records its events in the same pass over them (``coalesce/_cr_encode.h``
says which shapes it writes; anything else declines, and the caller encodes
and records the batch apart, as before).  What it needs of a class comes from
msgspec's own struct metadata, read here once per class: for an event class,
the tag pair and each field's encoded name, slot and default; for a batch
class, that it is ``[ts, events, data_parallel_rank]``.  A class msgspec would
encode another way (``array_like`` events, untagged, a default factory other
than ``list``, ``rename`` of the batch's fields) gets no layout.

:func:`checked` compares the first batch of each batch class, and the first
batch with each event class learned at run time, with msgspec's own bytes: a
layout misread sends msgspec's bytes for that batch class from then on (and
says so), never a wrong byte on the wire.  Every function is O(fields), or
O(the batch) for a comparison.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import msgspec

__all__ = ["TRUSTED", "batch_shaped", "checked", "teach"]

log = logging.getLogger("coalesce")

_ENC = msgspec.msgpack.Encoder()
_ALWAYS, _UNLESS_DEFAULT, _UNLESS_EMPTY_LIST = 0, 1, 2
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")

_taught: set[type] = set()
TRUSTED: set[type] = set()
"""Batch classes whose first batch the fused encoder wrote as msgspec does."""
_refused: set[type] = set()
"""Batch classes for which it wrote a batch unlike msgspec (none: never in TRUSTED)."""


def _event_layout(cls: type) -> tuple[bytes, tuple[tuple[bytes, str, Any, int], ...]] | None:
    """(tag pair, fields) for ``set_layout``, or None: msgspec writes ``cls`` in a
    shape the C encoder does not."""
    config = getattr(cls, "__struct_config__", None)
    if config is None or config.array_like or config.tag is None:
        return None
    names: tuple[str, ...] = cls.__struct_fields__  # type: ignore[attr-defined]
    encoded: tuple[str, ...] = cls.__struct_encode_fields__  # type: ignore[attr-defined]
    defaults: tuple[Any, ...] = cls.__struct_defaults__  # type: ignore[attr-defined]
    first_default = len(names) - len(defaults)
    fields = []
    for i, (name, enc_name) in enumerate(zip(names, encoded, strict=True)):
        default, how = None, _ALWAYS
        if i >= first_default and config.omit_defaults:
            default = defaults[i - first_default]
            how = _UNLESS_DEFAULT
            if type(default).__name__ == "Factory":  # msgspec's default_factory wrapper
                if getattr(default, "factory", None) is not list:
                    return None  # (omitted when empty for dict and set too: not written here)
                how = _UNLESS_EMPTY_LIST
        fields.append((_ENC.encode(enc_name), name, default, how))
    return _ENC.encode(config.tag_field) + _ENC.encode(config.tag), tuple(fields)


def batch_shaped(cls: type) -> bool:
    """Whether msgspec writes ``cls`` as ``[ts, events, data_parallel_rank]``."""
    config = getattr(cls, "__struct_config__", None)
    return (
        config is not None
        and config.array_like
        and config.tag is None
        and getattr(cls, "__struct_fields__", None) == _BATCH_FIELDS
    )


def teach(accel: ModuleType, cls: type) -> bool:
    """Give the C encoder ``cls``'s layout: an event class already registered with
    ``accel.register``, or a batch class.  Once per class; whether it was taken."""
    if cls in _taught:
        return False
    _taught.add(cls)
    if batch_shaped(cls):
        return bool(accel.register_batch(cls))
    layout = _event_layout(cls)
    return layout is not None and bool(accel.set_layout(cls, *layout))


def checked(batch: Any, payload: bytes, again: bool = False) -> bytes:
    """``payload`` if the fused encoder writes ``batch``'s class as msgspec does,
    else msgspec's bytes.  The first batch of each batch class is compared with
    msgspec's encoding of it, and so is (``again``) a batch whose encoding
    taught the C encoder an event class.  Alike, the class is in
    :data:`TRUSTED` (the caller's check, one set lookup); unlike, it leaves it
    for good and every later batch of it is encoded by msgspec (its recording
    is not in question: the fused encoder reads the events as the C loop
    does), and a warning says so."""
    cls = type(batch)
    if cls in _refused:
        return _ENC.encode(batch)
    if cls in TRUSTED and not again:
        return payload
    expected = _ENC.encode(batch)
    if payload == expected:
        TRUSTED.add(cls)
        return payload
    TRUSTED.discard(cls)
    _refused.add(cls)
    log.warning(
        "kv-coalesce: the fused encoder wrote a %s unlike msgspec; msgspec encodes it from now on",
        cls.__qualname__,
    )
    return expected
