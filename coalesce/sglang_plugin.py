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

from typing import Any

from coalesce._plugin import ENV_ENABLE, Swap, enabled, started

__all__ = ["ENV_ENABLE", "create_publisher", "register", "unregister"]

_swap = Swap("SGLang", "sglang", "sglang.srt.disaggregation.kv_events")


def create_publisher(**kwargs: Any) -> Any:
    """What SGLang's factory calls for ``publisher="zmq"`` once the plugin is active.

    Builds a :class:`~coalesce.sglang.SGLangPublisher` from SGLang's keywords
    (plus ``COALESCE_*`` variables) and, when ``COALESCE_METRICS_PORT`` is
    set, serves its stats for Prometheus on that port + the rank.
    """
    from coalesce.sglang import SGLangPublisher

    pub = SGLangPublisher(**kwargs)
    return started(pub, "attn_dp_rank", pub.attn_dp_rank)


def register() -> None:
    """The plugin entry point.  Idempotent; cheap when disabled."""
    if enabled():
        from coalesce.sglang import SGLangPublisher

        _swap.install(create_publisher, SGLangPublisher)


def unregister() -> None:
    """Put SGLang's own ``"zmq"`` publisher back (roll back without restarting Python)."""
    _swap.restore()
