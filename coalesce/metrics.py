"""Optional Prometheus metrics for a publisher (``pip install kv-coalesce[prometheus]``).

Every :class:`~coalesce.stats.PublisherStats` field is exposed, read at scrape
time (no work on the publish path): counters as ``kv_coalesce_<name>_total``,
byte counts with the ``_bytes`` unit, levels as gauges, all labelled with
``data_parallel_rank``, each described by the field's own doc.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from typing import Any

from coalesce.stats import PublisherStats, field_docs, gauge_names

__all__ = ["StatsCollector", "metric_names", "serve_metrics"]


def metric_names() -> dict[str, str]:
    """Stats field -> metric family name (``_total`` is added to counters on exposition)."""
    names = {}
    for f in fields(PublisherStats):
        name = f"kv_coalesce_{f.name}"
        if f.name == "bytes_sent":
            name = "kv_coalesce_sent_bytes"
        names[f.name] = name
    return names


class StatsCollector:
    """A ``prometheus_client`` collector reading ``publisher.stats()`` at scrape time."""

    def __init__(self, publisher: Any, rank: int | None = None) -> None:
        self._publisher = publisher
        self._rank = str(publisher.data_parallel_rank if rank is None else rank)
        self._names = metric_names()
        self._docs = field_docs()
        self._gauges = gauge_names()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._publisher.stats()
        for f in fields(PublisherStats):
            name, doc = self._names[f.name], self._docs[f.name]
            family: Any
            if f.name in self._gauges:
                family = GaugeMetricFamily(name, doc, labels=["data_parallel_rank"])
            else:
                family = CounterMetricFamily(name, doc, labels=["data_parallel_rank"])
            family.add_metric([self._rank], float(getattr(stats, f.name)))
            yield family


def serve_metrics(publisher: Any, port: int) -> StatsCollector:
    """Register a collector in a registry of its own and serve it over HTTP on ``port``."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    collector = StatsCollector(publisher)
    registry.register(collector)
    start_http_server(port, registry=registry)
    return collector
