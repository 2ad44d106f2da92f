"""What the vLLM and SGLang plugins share: the switch, metrics, and logging.

Both plugins are off unless ``COALESCE_KV_EVENTS=1``; both serve a
publisher's stats for Prometheus on ``COALESCE_METRICS_PORT`` + its rank
when that variable is set; both send coalesce's log lines through the
engine's handlers unless the user configured coalesce's logger.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "ENV_ENABLE",
    "ENV_METRICS_PORT",
    "Swap",
    "adopt_logging",
    "enabled",
    "serve_metrics_once",
    "started",
]

ENV_ENABLE = "COALESCE_KV_EVENTS"
ENV_METRICS_PORT = "COALESCE_METRICS_PORT"

log = logging.getLogger("coalesce")
_metrics_started: set[int] = set()


def enabled() -> bool:
    """Whether ``COALESCE_KV_EVENTS`` is on; a value that is not a flag is off, with a warning."""
    from coalesce._settings import parse_flag

    try:
        return parse_flag(os.environ.get(ENV_ENABLE, ""))
    except ValueError:
        log.warning(
            "kv-coalesce: %s=%r is not a flag (1/0); plugin left off",
            ENV_ENABLE,
            os.environ.get(ENV_ENABLE),
        )
        return False


def serve_metrics_once(publisher: Any, rank: int) -> None:
    """Serve ``publisher``'s stats on ``COALESCE_METRICS_PORT`` + ``rank``, once per rank
    and process; nothing when the variable is unset."""
    port = os.environ.get(ENV_METRICS_PORT)
    if not port or rank in _metrics_started:
        return
    from coalesce.metrics import serve_metrics

    serve_metrics(publisher, int(port) + rank)
    _metrics_started.add(rank)


def adopt_logging(engine_logger: str) -> None:
    """Send coalesce's log lines through ``engine_logger``'s handlers, unless the user
    configured coalesce's logger (or the engine has none)."""
    ours, theirs = logging.getLogger("coalesce"), logging.getLogger(engine_logger)
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


def started(pub: Any, rank_name: str, rank: int) -> Any:
    """A plugin's publisher, just built: its stats served for Prometheus when
    ``COALESCE_METRICS_PORT`` is set (on that port + ``rank``), and one log line."""
    serve_metrics_once(pub, rank)
    log.info(
        "kv-coalesce: publisher for %s %s on %s (replay %s); settings %s",
        rank_name,
        rank,
        pub.config.endpoint,
        pub.config.replay_endpoint,
        pub.settings,
    )
    return pub


class Swap:
    """An engine's ``"zmq"`` entry in its publisher factory's registry, swapped for
    ours and back.  ``engine`` names it in log lines; its logger is adopted;
    ``module`` holds its ``EventPublisherFactory`` and ``ZmqEventPublisher``."""

    def __init__(self, engine: str, logger: str, module: str) -> None:
        self.engine, self.logger, self.module = engine, logger, module
        self.original: Any = None  # the engine's own "zmq" constructor, while swapped

    def install(self, create: Callable[..., Any], cls: type) -> None:
        """Put ``create`` in for ``"zmq"`` and make ``cls`` a virtual subclass of the
        engine's ``ZmqEventPublisher`` ABC.  Idempotent; logs once what it did and with
        which settings, or why it did nothing (the engine cannot be imported)."""
        try:
            kv_events = importlib.import_module(self.module)
        except ImportError:
            log.warning(
                "kv-coalesce: %s is set but %s cannot be imported; nothing done",
                ENV_ENABLE,
                self.module,
            )
            return
        registry: dict[str, Any] = kv_events.EventPublisherFactory._registry
        if registry.get("zmq") is create:
            return
        adopt_logging(self.logger)
        from coalesce._settings import Settings

        self.original = registry.get("zmq")
        registry["zmq"] = create
        # isinstance holds; nothing of the engine's is inherited or run
        kv_events.ZmqEventPublisher.register(cls)
        log.info(
            "kv-coalesce: %s's 'zmq' KV-event publisher is now %s.%s (pid %d); settings "
            "from COALESCE_*: %s",
            self.engine,
            cls.__module__.replace(".publisher", ""),
            cls.__name__,
            os.getpid(),
            Settings.resolve(),
        )

    def restore(self) -> None:
        """Put the engine's own ``"zmq"`` publisher back (nothing if not swapped)."""
        if self.original is None:
            return
        registry = importlib.import_module(self.module).EventPublisherFactory._registry
        registry["zmq"] = self.original
        self.original = None
        log.info("kv-coalesce: %s's own 'zmq' publisher restored", self.engine)
