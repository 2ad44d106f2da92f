"""SGLang general plugin: swap ``coalesce.sglang.SGLangPublisher`` in for ``"zmq"``.

Installed as the entry point ``coalesce`` in group ``sglang.srt.plugins``;
SGLang's ``sglang.srt.plugins.load_plugins()`` calls :func:`register` early
in every process (``SGLANG_PLUGINS``, when set, must name ``coalesce``).

It does nothing unless ``COALESCE_KV_EVENTS=1``, the same switch as the vLLM
plugin, and imports SGLang only then.  Once active, SGLang's
``EventPublisherFactory.create(config, attn_dp_rank)`` builds an
:class:`~coalesce.sglang.SGLangPublisher` for ``publisher="zmq"``, which
passes ``isinstance(pub, ZmqEventPublisher)`` (a virtual subclass of SGLang's
ABC).  Idempotent; :func:`unregister` puts SGLang's own publisher back.  The
publisher's own knobs come from ``COALESCE_*`` variables (docs/sglang.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from coalesce._plugin import ENV_ENABLE, adopt_logging, enabled, serve_metrics_once

__all__ = ["ENV_ENABLE", "create_publisher", "register", "unregister"]

log = logging.getLogger("coalesce")
_original: Any = None  # SGLang's "zmq" constructor, kept for unregister()


def create_publisher(**kwargs: Any) -> Any:
    """What SGLang's factory calls for ``publisher="zmq"`` once the plugin is active.

    Builds a :class:`~coalesce.sglang.SGLangPublisher` from SGLang's keywords
    (plus ``COALESCE_*`` variables) and, when ``COALESCE_METRICS_PORT`` is
    set, serves its stats for Prometheus on that port + the rank.
    """
    from coalesce.sglang import SGLangPublisher

    pub = SGLangPublisher(**kwargs)
    serve_metrics_once(pub, pub.attn_dp_rank)
    log.info(
        "kv-coalesce: SGLang publisher for attn_dp_rank %s on %s (replay %s); settings %s",
        pub.attn_dp_rank,
        pub.config.endpoint,
        pub.config.replay_endpoint,
        pub.settings,
    )
    return pub


def register() -> None:
    """The plugin entry point.  Idempotent; cheap when disabled."""
    global _original
    if not enabled():
        return
    try:
        from sglang.srt.disaggregation.kv_events import EventPublisherFactory, ZmqEventPublisher
    except ImportError:
        log.warning(
            "kv-coalesce: %s is set but SGLang's kv_events cannot be imported; nothing done",
            ENV_ENABLE,
        )
        return
    registry = EventPublisherFactory._registry
    if registry.get("zmq") is create_publisher:
        return
    adopt_logging("sglang")
    from coalesce._settings import Settings
    from coalesce.sglang import SGLangPublisher

    _original = registry.get("zmq")
    registry["zmq"] = create_publisher
    # isinstance(pub, ZmqEventPublisher) true; nothing of SGLang's is inherited or run
    ZmqEventPublisher.register(SGLangPublisher)
    log.info(
        "kv-coalesce: SGLang's 'zmq' KV-event publisher is now coalesce.sglang.SGLangPublisher "
        "(pid %d); settings from COALESCE_*: %s",
        os.getpid(),
        Settings.resolve(),
    )


def unregister() -> None:
    """Put SGLang's own ``"zmq"`` publisher back (roll back without restarting Python)."""
    global _original
    if _original is None:
        return
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory

    EventPublisherFactory._registry["zmq"] = _original
    _original = None
    log.info("kv-coalesce: SGLang's own 'zmq' publisher restored")
