"""vLLM general plugin: swap ``coalesce.CoalescingPublisher`` in for ``"zmq"``.

Installed as the entry point ``coalesce`` in group ``vllm.general_plugins``;
vLLM calls :func:`register` once in every process (API server, each
EngineCore, each worker) before the scheduler builds its publisher.

It does nothing unless ``COALESCE_KV_EVENTS=1``, and nothing (without
importing vLLM) when vLLM is absent.  Once active, publishers it builds pass
``isinstance(pub, ZmqEventPublisher)`` (a virtual subclass of vLLM's ABC).
It is idempotent, logs once per process what it did and with which
settings, and :func:`unregister` puts vLLM's own publisher back.
``KVEventsConfig`` forbids extra keys, so the publisher's own knobs come
from ``COALESCE_*`` variables (see docs/vllm.md).
"""

from __future__ import annotations

from typing import Any

from coalesce._plugin import ENV_ENABLE, Swap, enabled, started

__all__ = ["ENV_ENABLE", "create_publisher", "register", "unregister"]

_swap = Swap("vLLM", "vllm", "vllm.distributed.kv_events")


def create_publisher(**kwargs: Any) -> Any:
    """What vLLM's factory calls for ``publisher="zmq"`` once the plugin is active.

    Builds a :class:`~coalesce.CoalescingPublisher` from vLLM's keywords (plus
    ``COALESCE_*`` variables) and, when ``COALESCE_METRICS_PORT`` is set,
    serves its stats for Prometheus on that port + the DP rank.
    """
    from coalesce.publisher import CoalescingPublisher

    pub = CoalescingPublisher(**kwargs)
    return started(pub, "DP rank", pub.data_parallel_rank)


def register() -> None:
    """The plugin entry point.  Idempotent; cheap when disabled.

    ``isinstance(pub, ZmqEventPublisher)`` (and ``EventPublisher``) then holds:
    vLLM's publisher classes are ABCs, so the publisher becomes a virtual
    subclass; ABCs cannot forget a registration, so after :func:`unregister`
    it stays true in this process.
    """
    if enabled():
        from coalesce.publisher import CoalescingPublisher

        _swap.install(create_publisher, CoalescingPublisher)


def unregister() -> None:
    """Put vLLM's own ``"zmq"`` publisher back (roll back without a restart of Python)."""
    _swap.restore()
