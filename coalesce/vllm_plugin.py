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

import logging
from typing import Any

from coalesce._plugin import ENV_ENABLE, Swap, enabled, serve_metrics_once

__all__ = ["ENV_ENABLE", "create_publisher", "register", "unregister"]

log = logging.getLogger("coalesce")
_swap = Swap("vLLM", "vllm")


def create_publisher(**kwargs: Any) -> Any:
    """What vLLM's factory calls for ``publisher="zmq"`` once the plugin is active.

    Builds a :class:`~coalesce.CoalescingPublisher` from vLLM's keywords (plus
    ``COALESCE_*`` variables) and, when ``COALESCE_METRICS_PORT`` is set,
    serves its stats for Prometheus on that port + the DP rank.
    """
    from coalesce.publisher import CoalescingPublisher

    pub = CoalescingPublisher(**kwargs)
    serve_metrics_once(pub, pub.data_parallel_rank)
    log.info(
        "kv-coalesce: publisher for DP rank %s on %s (replay %s); settings %s",
        pub.data_parallel_rank,
        pub.config.endpoint,
        pub.config.replay_endpoint,
        pub.settings,
    )
    return pub


def register() -> None:
    """The plugin entry point.  Idempotent; cheap when disabled.

    ``isinstance(pub, ZmqEventPublisher)`` (and ``EventPublisher``) then holds:
    vLLM's publisher classes are ABCs, so the publisher becomes a virtual
    subclass; ABCs cannot forget a registration, so after :func:`unregister`
    it stays true in this process.
    """
    if not enabled():
        return
    try:
        from vllm.distributed.kv_events import EventPublisherFactory, ZmqEventPublisher
    except ImportError:
        log.warning("kv-coalesce: %s is set but vLLM cannot be imported; nothing done", ENV_ENABLE)
        return
    from coalesce.publisher import CoalescingPublisher

    _swap.install(
        EventPublisherFactory._registry, create_publisher, ZmqEventPublisher, CoalescingPublisher
    )


def unregister() -> None:
    """Put vLLM's own ``"zmq"`` publisher back (roll back without a restart of Python)."""
    if _swap.original is None:
        return
    from vllm.distributed.kv_events import EventPublisherFactory

    _swap.restore(EventPublisherFactory._registry)
