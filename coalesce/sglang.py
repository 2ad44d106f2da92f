"""SGLang: its KV-event wire types, and the publisher that stands in for its own.

SGLang (0.5.23) publishes the same three-frame messages as vLLM, with its own
structs: a batch is ``[ts, events, attn_dp_rank]`` (positional, the rank
always present), events are tagged maps, and ``BlockStored`` carries
``cache_salt``, ``session_id`` and ``lora_name`` and omits a ``medium`` left
at None.  The classes here declare exactly that shape, so a batch built from
them encodes byte for byte like one built from
``sglang.srt.disaggregation.kv_events``; the publisher does not need them
(inside SGLang it works on SGLang's own objects).

:class:`SGLangPublisher` is a :class:`~coalesce.CoalescingPublisher` that
takes SGLang's constructor keywords (``attn_dp_rank``, ``bind``) and
batches, and follows SGLang's endpoint rules.  The SGLang plugin
(:mod:`coalesce.sglang_plugin`) makes SGLang's factory build it.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from coalesce._settings import Settings, is_bind_endpoint
from coalesce.events import EventBatch as _RankedBatch
from coalesce.publisher import CoalescingPublisher, PublishOutcome

__all__ = [
    "MEDIA",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEventBatch",
    "SGLangPublisher",
]

MEDIA = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")
"""SGLang's storage tiers, as its ``medium`` strings."""


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One publish call: ``[ts, events, attn_dp_rank]`` (the rank always encoded)."""

    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events: a map with ``"type": <class name>``, None fields left out."""


class BlockStored(KVCacheEvent):
    """Blocks now cached in ``medium``; hashes are already namespaced by ``cache_salt``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer cached in ``medium``."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Everything this source cached is gone."""


class KVEventBatch(EventBatch):
    """A batch of KV-cache events, as SGLang's scheduler publishes it."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _sglang_binds(endpoint: str) -> bool:
    """SGLang's rule for an unset ``bind``: vLLM's, plus the ``0.0.0.0`` wildcard."""
    return is_bind_endpoint(endpoint) or "0.0.0.0" in endpoint


def _unsupported(keywords: dict[str, Any]) -> str | None:
    """Why these settings cannot serve SGLang, or None."""
    knobs = Settings.names()
    st = Settings.resolve(**{k: v for k, v in keywords.items() if k in knobs})
    if st.snapshot_endpoint is not None:
        return (
            "snapshot_endpoint (COALESCE_SNAPSHOT_ENDPOINT) is not available for SGLang: "
            "snapshots speak vLLM PR #57789's dialect, and SGLang's own snapshot protocol "
            "(PR #34407) differs and is not merged"
        )
    if st.move_events:
        return "move_events is not available for SGLang: its consumers do not know BlockMoved"
    return None


class SGLangPublisher(CoalescingPublisher):
    """A drop-in for SGLang's ``ZmqEventPublisher``: never blocks, compacts, tells losses.

    Takes SGLang 0.5.23's keywords with its defaults: ``attn_dp_rank`` (the
    port offset and the rank stamped into batches whose ``attn_dp_rank`` is
    None), ``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``,
    ``max_queue_size``, ``topic`` and ``bind`` (unset: bind ``*``, ``::``,
    ``0.0.0.0``, ``ipc://`` and ``inproc://`` endpoints, connect to the
    rest), plus the ``COALESCE_*`` knobs; unknown keywords are accepted and
    ignored.  ``loss_marker=resync`` (the default) sends SGLang's own recorded
    stores (their ``cache_salt`` and attribution as published).  Raises
    ``ValueError`` for settings SGLang's consumers cannot read (snapshots, moves)
    and, like the base class, for a bad setting or endpoint.
    """

    def __init__(
        self,
        attn_dp_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        bind: bool | None = None,
        **keywords: Any,
    ) -> None:
        why = _unsupported(keywords)
        if why is not None:
            raise ValueError(why)
        if bind is None and isinstance(endpoint, str):  # (the rank offset keeps the host)
            bind = _sglang_binds(endpoint)
        super().__init__(
            attn_dp_rank,
            endpoint,
            replay_endpoint,
            buffer_steps,
            hwm,
            max_queue_size,
            topic,
            bind,
            **keywords,
        )
        self._sglang_types: set[type] = set()

    @property
    def attn_dp_rank(self) -> int:
        """The attention-DP rank this publisher serves (SGLang's name for it)."""
        return self._rank

    def publish(self, events: Any) -> PublishOutcome:
        """Queue one SGLang ``EventBatch``.  O(1); never blocks, never waits.

        Fills ``attn_dp_rank`` when it is None, as SGLang does; otherwise as
        :meth:`CoalescingPublisher.publish` (``TypeError`` for anything that
        is not a batch with ``ts``, ``events`` and ``attn_dp_rank``).
        """
        if self._closed:
            raise RuntimeError("publish() called after shutdown()")
        cls = type(events)
        if cls not in self._sglang_types:
            self._check_sglang_type(cls, events)
        evs, ts, rank = events.events, events.ts, events.attn_dp_rank
        if type(evs) is not list:
            raise TypeError(f"{cls.__name__}.events must be a list, got {type(evs).__name__}")
        if type(ts) is not float and type(ts) is not int:
            raise TypeError(f"{cls.__name__}.ts must be a float, got {type(ts).__name__}")
        if rank is None:
            rank = events.attn_dp_rank = self._rank
        elif type(rank) is not int:
            raise TypeError(f"attn_dp_rank must be an int or None, got {rank!r}")
        # the same three positional fields: it encodes as SGLang's batch does
        return self._queue(_RankedBatch(ts, evs, rank), len(evs))

    def _check_sglang_type(self, cls: type, events: Any) -> None:
        fields = getattr(cls, "__struct_fields__", None)
        if not isinstance(events, msgspec.Struct) or fields is None:
            raise TypeError(f"publish() takes an SGLang EventBatch struct, got {cls.__name__}")
        if tuple(fields) != ("ts", "events", "attn_dp_rank"):
            raise TypeError(
                f"{cls.__name__} is not an SGLang EventBatch: fields {list(fields)}, "
                "expected ['ts', 'events', 'attn_dp_rank']"
            )
        if not getattr(cls.__struct_config__, "array_like", False):  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__name__} is not an SGLang EventBatch: not array_like")
        self._sglang_types.add(cls)

    def describe_local_source(self, block_size: int) -> dict[str, Any] | None:
        """What SGLang's ``/server_info`` advertises for this publisher, as its own does.

        The bound PUB endpoint a local process can reach (a wildcard host
        becomes loopback), its topic and ``block_size``, and the replay
        endpoint; None for a publisher that connects, or for inproc.
        """
        endpoint = _local(self.config.endpoint) if self._binds else None
        if endpoint is None:
            return None
        source: dict[str, Any] = {
            "dp_rank": self._rank,
            "endpoint": endpoint,
            "topic": self.config.topic,
            "block_size": block_size,
        }
        replay = _local(self.config.replay_endpoint)
        if replay is not None:
            source["replay_endpoint"] = replay
        return source

    def get_publisher_config(self) -> Any:
        """The resolved configuration (endpoints offset for this rank)."""
        return self.config


def _local(endpoint: str | None) -> str | None:
    """A bound endpoint as a process on this host reaches it, or None (inproc, no port)."""
    if endpoint is None:
        return None
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        return endpoint if path.startswith("@") else "ipc://" + os.path.abspath(path)
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535 or not host:
        return None
    host = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}.get(
        host, host
    )
    return f"tcp://{host}:{port}"
