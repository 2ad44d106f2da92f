"""The plugins' behaviour without their engine installed, and the Prometheus collector."""

from __future__ import annotations

import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import coalesce.sglang_plugin
import coalesce.vllm_plugin
from coalesce import BlockStored, CoalescingPublisher, KVEventBatch
from coalesce.compactor import rule_stats
from coalesce.metrics import StatsCollector, metric_names
from coalesce.stats import PublisherStats, field_docs
from tests.conftest import inproc

PLUGINS = [
    pytest.param((coalesce.vllm_plugin, "vllm"), id="vllm"),
    pytest.param((coalesce.sglang_plugin, "sglang"), id="sglang"),
]


@pytest.fixture(params=PLUGINS)
def plugin(request, monkeypatch):
    """Each plugin, with its engine's package made unimportable."""
    module, engine = request.param
    for sub in ("", ".distributed", ".distributed.kv_events", ".srt"):
        monkeypatch.setitem(sys.modules, engine + sub, None)  # importing it would raise
    return module


def test_plugin_is_inert_without_the_variable(plugin, monkeypatch, caplog):
    monkeypatch.delenv("COALESCE_KV_EVENTS", raising=False)
    plugin.register()  # returns before touching the engine
    assert plugin._swap.original is None and not caplog.records


def test_plugin_without_its_engine_warns_and_does_nothing(plugin, monkeypatch, caplog):
    monkeypatch.setenv("COALESCE_KV_EVENTS", "1")
    plugin.register()
    assert "cannot be imported" in caplog.text and plugin._swap.original is None


def test_every_stat_is_documented_and_exported():
    fields = set(PublisherStats.__dataclass_fields__)
    assert set(field_docs()) == fields and all(field_docs().values())
    assert set(metric_names()) == fields
    # every compaction rule's counter reaches a stats field of its own
    stats = [stat for _, stat in rule_stats()]
    assert len(set(stats)) == len(stats) and set(stats) <= fields


def test_collector_exposes_stats_with_conventional_names():
    pub = CoalescingPublisher(data_parallel_rank=0, endpoint=inproc("pub"))
    try:
        pub.publish(KVEventBatch(1.0, [BlockStored([1], None, [], 4, None, "GPU", None)]))
        assert pub.flush(10)
        registry = CollectorRegistry()
        registry.register(StatsCollector(pub))
        text = generate_latest(registry).decode()
    finally:
        pub.shutdown()
    assert 'kv_coalesce_messages_sent_total{data_parallel_rank="0"} 1.0' in text
    assert "kv_coalesce_sent_bytes_total" in text
    assert 'kv_coalesce_backlog_batches{data_parallel_rank="0"} 0.0' in text
    assert "# HELP kv_coalesce_batches_dropped_total Batches lost" in text


@pytest.mark.parametrize("value", ["0", "", "off", "no", "false"])
def test_plugin_disabled_values(plugin, monkeypatch, caplog, value):
    monkeypatch.setenv("COALESCE_KV_EVENTS", value)
    plugin.register()
    # enabled, it would have tried to import its engine and said so
    assert plugin._swap.original is None and "cannot be imported" not in caplog.text


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", " ON "])
def test_plugin_enabled_values_try_the_engine(plugin, monkeypatch, caplog, value):
    monkeypatch.setenv("COALESCE_KV_EVENTS", value)
    plugin.register()
    assert "cannot be imported" in caplog.text


def test_plugin_rejects_a_value_that_is_not_a_flag(plugin, monkeypatch, caplog):
    monkeypatch.setenv("COALESCE_KV_EVENTS", "maybe")
    plugin.register()
    assert "is not a flag" in caplog.text and "cannot be imported" not in caplog.text
