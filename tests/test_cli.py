"""The command line, run as a user would: a real process on a real socket."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

from coalesce import BlockStored, CoalescingPublisher, KVEventBatch
from tests.conftest import free_port


def cli(*args: str) -> list[str]:
    """The command line a user types: ``coalesce ARGS...``, with this interpreter."""
    return [sys.executable, "-m", "coalesce", *args]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``coalesce ARGS...`` run to its end, which must be a success."""
    run = subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr
    return run


def popen_as_from_a_terminal(args: list[str]) -> subprocess.Popen[str]:
    """Start ``args`` with SIGINT at its default, as a shell in a terminal would.

    A background job of a non-interactive shell (``cmd &``, how some CI
    runners start their scripts) ignores SIGINT, and an ignored signal stays
    ignored across exec: Python then installs no KeyboardInterrupt handler and
    Ctrl-C never reaches the CLI.  A handler, unlike an ignore, is reset to
    the default by exec, so the child is started while this (main) thread has
    one.
    """
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_subscribe_json_lines_then_a_summary_when_stopped(stop):
    port = free_port()
    pub = CoalescingPublisher(endpoint=f"tcp://*:{port}", compaction=False)
    proc = popen_as_from_a_terminal(
        cli("subscribe", f"tcp://127.0.0.1:{port}", "--json", "--seconds", "60")
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        first = None
        i = 0
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while first is None:  # publish until the subscriber (a slow joiner) hears one
            assert time.monotonic() < deadline, "the CLI never printed a batch"
            pub.publish(KVEventBatch(float(i), [BlockStored([i], None, [], 4, None, "GPU", None)]))
            i += 1
            if sel.select(0.05):
                first = json.loads(proc.stdout.readline())
        assert first["events"][0]["type"] == "BlockStored"
        assert first["source"] == f"tcp://127.0.0.1:{port}"
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        pub.shutdown()
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert summary["messages"] >= 1 and summary["index_size"] >= 1
    assert proc.returncode == 0, err


@pytest.mark.slow
@pytest.mark.parametrize("batch_events", [0, 20])
def test_demo_runs_end_to_end_on_a_tiny_configuration(tmp_path, batch_events):
    run = run_cli(
        *("demo", "--batch-events", str(batch_events), "--ranks", "1", "--steps", "120"),
        *("--burst-every", "40", "--burst-requests", "8", "--burst-length", "5"),
        *("--no-sizing", "--out", str(tmp_path)),
        timeout=300,
    )
    lines = run.stdout.splitlines()
    assert any(line.startswith("stock") for line in lines)
    assert any(line.startswith("drop") for line in lines)
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["host"]["cores"] >= 1 and data["host"]["python"].split()[1] in run.stdout
    assert lines[0].startswith("host: ")
    ours = {r["publisher"]: r for r in data["results"]}["coalesce"]
    assert ours["steps"] == 120 and ours["events_in"] > 0
    # the demo's timing varies with the machine; what may not vary: no silent divergence,
    # and a subscriber whose index is wrong knows it (it reset that source)
    assert ours["silent"] == 0
    assert ours["stale"] == 0 or ours["resets"] > 0
    assert ours["missing"] == 0 or ours["resets"] > 0 or ours["markers"] > 0
    assert ours["events_on_wire"] <= ours["events_in"]
    snap = {r["publisher"]: r for r in data["results"]}["coalesce+snap"]
    assert snap["silent"] == 0 and snap["steps"] == 120
    assert snap["missing"] + snap["stale"] == 0 or snap["resets"] > 0
    stock = {r["publisher"]: r for r in data["results"]}["stock"]
    if batch_events:  # many small batches per step: one publish() each
        assert stock["messages"] > 120 * 2


@pytest.mark.slow
def test_demo_in_lockstep_with_sglangs_structs(tmp_path):
    run = run_cli(
        *("demo", "--engine", "sglang", "--lockstep", "on", "--ranks", "2", "--steps", "120"),
        *("--burst-every", "40", "--burst-requests", "8", "--burst-length", "5"),
        *("--no-sizing", "--out", str(tmp_path)),
        timeout=300,
    )
    assert "DP lockstep: on" in run.stdout and "engine: SGLang's structs" in run.stdout
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["lockstep"] is True and data["engine"] == "sglang"
    rows = {r["publisher"]: r for r in data["results"]}
    assert set(rows) == {"stock", "drop", "coalesce"}  # snapshots are refused for SGLang
    for r in rows.values():
        assert 0 < r["step_p50_ms"] <= r["step_p99_ms"] <= r["step_max_ms"]
    assert rows["coalesce"]["silent"] == 0 and rows["coalesce"]["events_in"] > 0


def test_lockstep_auto_needs_a_core_per_engine_and_one_per_sender():
    from coalesce_tools.cli import lockstep_for

    assert lockstep_for("auto", 2, cores=4) and not lockstep_for("auto", 2, cores=3)
    assert lockstep_for("auto", 8, cores=16) and not lockstep_for("auto", 2, cores=2)
    assert lockstep_for("on", 8, cores=2) and not lockstep_for("off", 1, cores=64)


def test_subscribe_says_why_nothing_arrives():
    port = free_port()
    run = run_cli(
        "subscribe", f"tcp://127.0.0.1:{port}", "--json", "--seconds", "3", "--warn-after", "0.5"
    )
    assert "nothing received" in run.stderr and "--bind" in run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["summary"]["messages"] == 0


def test_the_endpoint_trap_is_named_and_bind_gets_the_stream(caplog):
    """A publisher given tcp://127.0.0.1:PORT connects (vLLM's rule): say so; --bind works."""
    from coalesce.subscriber import Subscriber

    port = free_port()
    with Subscriber(f"tcp://127.0.0.1:{port}", bind=True) as sub:
        with caplog.at_level("INFO", logger="coalesce"):
            pub = CoalescingPublisher(endpoint=f"tcp://127.0.0.1:{port}")
        try:
            assert f"publishing on tcp://127.0.0.1:{port} (connecting" in caplog.text
            assert f"use tcp://*:{port}" in caplog.text and "--bind" in caplog.text
            i = 0
            while sub.sources[0].last_seq is None:  # tcp: publish until it hears one
                pub.publish(
                    KVEventBatch(float(i), [BlockStored([i], None, [], 4, None, "GPU", None)])
                )
                sub.poll(0.02)
                i += 1
                assert i < 2000, "a bound subscriber never heard a connecting publisher"
        finally:
            pub.shutdown()


def test_a_bound_publisher_says_where_without_a_warning(caplog):
    with caplog.at_level("INFO", logger="coalesce"):
        pub = CoalescingPublisher(endpoint=f"tcp://*:{free_port()}")
    pub.shutdown()
    assert "(bound: subscribers connect here)" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_bursts_are_sized_to_a_fixed_bound_and_the_drain_rate_is_measured():
    from dataclasses import replace

    from coalesce._settings import Settings
    from coalesce_tools.demo import BURST_EVENTS, size_bursts
    from tests.test_workload import SMALL

    small = replace(SMALL, burst_requests=2, burst_length=50)
    cfg, drain = size_bursts(small)
    per_step = cfg.burst_requests * (3 * small.burst_blocks + 1)
    bound = BURST_EVENTS / small.burst_length
    assert Settings().max_pending_events >= 2 * BURST_EVENTS  # well within the default budget
    assert bound - (3 * small.burst_blocks + 1) < per_step <= bound
    assert drain > 0
    loaded, drain2 = size_bursts(small, load=2.0)
    assert loaded.burst_requests == max(1, int(2.0 * drain2 // (3 * small.burst_blocks + 1)))


def test_subscribe_with_a_snapshot_gets_what_was_cached_before_it_started():
    port, snap = free_port(), free_port()
    pub = CoalescingPublisher(endpoint=f"tcp://*:{port}", snapshot_endpoint=f"tcp://*:{snap}")
    try:
        for i in range(100):
            pub.publish(KVEventBatch(float(i), [BlockStored([i], None, [], 4, None, "GPU", None)]))
        assert pub.flush(10.0)
        # it hears the idle publisher's heartbeat, then asks
        run = run_cli(
            *("subscribe", f"tcp://127.0.0.1:{port}", "--snapshot", f"tcp://127.0.0.1:{snap}"),
            *("--seconds", "4"),
        )
    finally:
        pub.shutdown()
    summary = json.loads(run.stdout.strip().splitlines()[-1])["summary"]
    assert summary["snapshots"] == 1 and summary["resets"] == 0
    assert summary["index_size"] == 100


@pytest.mark.parametrize(
    "entry",
    [
        "coalesce.__main__",
        "coalesce.subscriber",
        "coalesce.vllm_plugin",
        "coalesce.sglang_plugin",
        "coalesce.sglang",
        "coalesce",
    ],
)
def test_the_production_entry_points_load_none_of_the_tools(entry):
    """``coalesce subscribe`` and the plugins run in production: the demo, its engine
    model and the baselines (``coalesce_tools``) stay out of their processes, and
    neither engine's package is imported by the other's plugin (or by loading one)."""
    code = (
        f"import sys, {entry}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('coalesce_tools', 'vllm', 'sglang')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_demo_help_comes_from_the_tools_package():
    run = run_cli("demo", "--help")
    assert run.stdout.startswith("usage: coalesce demo") and "--ranks" in run.stdout


def test_the_host_is_recorded_with_what_runs_on_it():
    from coalesce.compactor import accelerated
    from coalesce_tools.host import describe, host

    h = host()
    assert h["cores"] == os.cpu_count() and h["c_compactor"] is accelerated()
    assert h["stock_publisher"].startswith(("real vllm", "re-implemented"))
    line = describe(h)
    assert line.startswith(f"host: {h['cores']} cores") and h["cpu"] in line


def test_a_burst_that_did_not_overload_stock_grows_within_coalesces_budget():
    from coalesce_tools.demo import BURST_CAP, MIN_BURST_STEPS, events_per_request, grow_burst
    from coalesce_tools.workload import WorkloadConfig

    cfg, budget, seen = WorkloadConfig(burst_requests=27), 4_000_000, []
    while (grown := grow_burst(cfg, budget)) is not None:
        per_step = grown.burst_requests * events_per_request(grown)
        assert per_step == 2 * cfg.burst_requests * events_per_request(cfg)
        assert per_step * grown.burst_length <= BURST_CAP * budget
        assert MIN_BURST_STEPS <= grown.burst_length <= cfg.burst_length
        seen.append(grown.burst_length)
        cfg = grown
    assert seen == [200, 102], "two doublings fit the default budget, the second shorter"
