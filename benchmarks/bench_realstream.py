"""Compaction on vLLM's own stream: what it saves, what it costs, by window size.

The stream is recorded from vLLM 0.33's real scheduler, KV cache manager and
CPU offload manager (``coalesce_tools.vllm_engine``; fake model runner and
offload worker, a store completing one step after it was issued), one seeded
run per offload mode, with vLLM's ``NullEventPublisher`` (the batches are kept
as the scheduler published them, in vLLM's own classes).  The workload is the
seed's shape at this host's scale: 512 requests, 128 in flight, on 16 shared
2,048-token prefixes, a 1,500-block GPU pool and a 2,000-block CPU pool.

For each window size W (consecutive published batches, as a sender holding a
backlog of W batches would take them), the whole stream is cut into windows
of W batches and each window goes through ``coalesce.compactor.compact``:

- volume: events, payload bytes (msgspec) and messages after compaction, over
  the same batches sent one by one;
- cost: ``compact_for_wire`` + encoding its output (what the sender's rules
  level runs), and ``compact`` + encode with the C rules and with the
  pure-Python rules, each per input event, against encoding the same batches
  one by one (``raw``); timed in alternation, medians.  Then where the time
  goes: encoding only the windows' hash lists, and only their token lists
  (what is left of ``raw`` is the events' other fields); and the C wire path
  in its two parts, the rules alone (the merged lists written as bytes
  included) and encoding what they return.  Last, a floor under any
  compaction of the window: a C loop that reads what the rules read of every
  event and nothing more (``benchmarks/_floor.c``: each hash's and the parent's
  value, medium, group, the token list's length, the class of every other
  field; built when the benchmark runs, the column left out where it cannot
  be), plus msgspec's encode of the rules' output.

The volume table's fifth column counts CPU stores of one hash left in the
output: the cause of larger windows keeping more events (docs/vllm-engine.md).
The last two are events and bytes out with ``parentless_copies`` (chains start
only on a parent certainly held: the setting for lazy offload).

    .venv-vllm/bin/python benchmarks/bench_realstream.py [--seconds 0.2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

sys.path.insert(0, os.path.dirname(__file__))
from bench_compact import alternate

from coalesce import compactor
from coalesce_tools.results import header, recording, row
from coalesce_tools.vllm_engine import VllmEngine, seed_like

WINDOWS = (1, 2, 4, 8, 16, 32, 64)
COST_WINDOWS = (1, 4, 16, 64)
Window = list[Any]


def record(offload: str) -> tuple[list[Any], dict[str, Any]]:
    """One seeded run of vLLM's scheduler: its published batches, and the run's shape."""
    cfg = seed_like(offload)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    eng = VllmEngine(cfg, "inproc://bench-realstream", record=True, publisher="null")
    eng.run()
    took = time.perf_counter() - t0
    batches = eng.batches or []
    eng.shutdown()
    sizes = sorted(len(b.events) for b in batches)
    shape = {
        "steps": eng.steps,
        "batches": len(batches),
        "events": sum(sizes),
        "events_per_batch_median": sizes[len(sizes) // 2] if sizes else 0,
        "events_per_batch_max": sizes[-1] if sizes else 0,
        "engine_seconds": round(took, 2),
    }
    return batches, shape


def floor_reader(batches: list[Any]) -> Any | None:
    """``benchmarks/_floor.c`` built (as setup.py builds the accelerators: -O2, with
    their ``_cstruct.h``) and imported, every event class of ``batches``
    registered; None where it cannot be built."""
    here = os.path.dirname(os.path.abspath(__file__))
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    include = sysconfig.get_paths()["include"]
    library = os.path.join(here, "..", "coalesce")  # (_cstruct.h)
    with tempfile.TemporaryDirectory() as tmp:  # (a loaded module outlives its file)
        out = os.path.join(tmp, "_floor" + sysconfig.get_config_var("EXT_SUFFIX"))
        source = os.path.join(here, "_floor.c")
        built = subprocess.run(
            [*cc, "-O2", "-shared", "-fPIC", f"-I{include}", f"-I{library}", source, "-o", out],
            capture_output=True,
        )
        spec = importlib.util.spec_from_file_location("_floor", out)
        if built.returncode != 0 or spec is None or spec.loader is None:
            return None
        floor = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(floor)
    for cls in {type(e) for b in batches for e in b.events}:
        floor.register(cls, tuple(getattr(cls, "__struct_fields__", ())))
    return floor


def windows_of(batches: list[Any], w: int) -> list[Window]:
    return [batches[i : i + w] for i in range(0, len(batches), w)]


def volume(batches: list[Any], w: int, parentless_copies: bool = False) -> dict[str, Any]:
    """Events, bytes and messages after compacting windows of ``w`` batches, over 1:1."""
    enc = msgspec.msgpack.Encoder()
    ev_in = ev_out = b_in = b_out = m_out = singles = 0
    for win in windows_of(batches, w):
        out, rep = compactor.compact(win, parentless_copies=parentless_copies)
        ev_in += rep.events_in
        ev_out += rep.events_out
        m_out += len(out)
        b_in += sum(len(enc.encode(b)) for b in win)
        b_out += sum(len(enc.encode(b)) for b in out)
        singles += sum(
            1
            for b in out
            for e in b.events
            if type(e).__name__ == "BlockStored" and e.medium == "CPU" and len(e.block_hashes) == 1
        )
    return {
        "window": w,
        "events": round(ev_out / ev_in, 4),
        "bytes": round(b_out / b_in, 3),
        "messages": round(m_out / len(batches), 4),
        "events_out": ev_out,
        "cpu_single_stores_out": singles,
    }


def _has(ev: Any, name: str) -> bool:
    """``ev`` has the list field ``name`` (not None, not absent)."""
    return isinstance(getattr(ev, name, None), list)


def cost(
    batches: list[Any], w: int, seconds: float, rounds: int, floor: Any | None = None
) -> dict[str, float]:
    """ns per input event of each path over every window of ``w`` batches (medians);
    ``floor``: :func:`floor_reader`'s module, for the floor's read."""
    enc = msgspec.msgpack.Encoder()
    wins = windows_of(batches, w)
    events = sum(len(b.events) for b in batches)

    def over(fn: Callable[[Window], Any]) -> Callable[[], Any]:
        return lambda: [fn(win) for win in wins]

    def raw(win: Window) -> Any:
        return [enc.encode(b) for b in win]

    def wire(win: Window) -> Any:
        return [enc.encode(b) for b in compactor.compact_for_wire(win)[0]]

    def rules_c(win: Window) -> Any:
        return [enc.encode(b) for b in compactor.compact(win)[0]]

    def rules_py(win: Window) -> Any:
        return [enc.encode(b) for b in compactor.compact(win, accelerated=False)[0]]

    # where the time goes: the raw encode's hash and token lists alone, and the
    # C wire path cut in two (the rules alone, then encoding what they return)
    hashes = [
        [e.block_hashes for b in win for e in b.events if _has(e, "block_hashes")] for win in wins
    ]
    tokens = [[e.token_ids for b in win for e in b.events if _has(e, "token_ids")] for win in wins]
    outs = [compactor.compact_for_wire(win)[0] for win in wins] if compactor.accelerated() else []
    # the floor: reading what the rules read, then encoding what they return
    plain = [compactor.compact(win)[0] for win in wins]

    paths = {
        "raw": over(raw),
        "rules C wire": over(wire),
        "rules C": over(rules_c),
        "rules py": over(rules_py),
        "raw: hash lists": lambda: [enc.encode(h) for h in hashes],
        "raw: token lists": lambda: [enc.encode(t) for t in tokens],
        "C wire: rules alone": over(compactor.compact_for_wire),
        "C wire: encode out": lambda: [enc.encode(b) for out in outs for b in out],
        "floor: encode out": lambda: [enc.encode(b) for out in plain for b in out],
    }
    if floor is not None:
        paths["floor: read"] = lambda: [floor.read(win) for win in wins]
    if not compactor.accelerated():
        for k in ("rules C wire", "rules C", "C wire: rules alone", "C wire: encode out"):
            del paths[k]
    per = alternate(paths, events, seconds, rounds, slow={"rules py": 10})
    return {k: round(v * 1e9, 1) for k, v in per.items()}


def main(figures: dict[str, Any]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=0.2, help="per path per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--offload", action="append", choices=("eager", "lazy", "none"))
    args = ap.parse_args()
    print(
        f"# bench_realstream: {platform.python_version()}, msgspec {msgspec.__version__}, "
        f"accelerator {'built' if compactor.accelerated() else 'MISSING'}, "
        f"{args.rounds} rounds x {args.seconds} s, medians\n"
    )
    for offload in args.offload or ["eager", "lazy"]:
        batches, shape = record(offload)
        gc.collect()
        print(f"\n## {offload} offload: {shape}\n")
        vol = [volume(batches, w) for w in WINDOWS]
        strict = [volume(batches, w, parentless_copies=True) for w in WINDOWS]
        header(
            "window (batches)",
            "events out",
            "bytes out",
            "messages out",
            "CPU 1-hash stores",
            "events out, parentless_copies",
            "bytes out, parentless_copies",
        )
        for v, s in zip(vol, strict, strict=True):
            row(
                v["window"],
                v["events"],
                v["bytes"],
                v["messages"],
                v["cpu_single_stores_out"],
                s["events"],
                s["bytes"],
            )
        print()
        costs = {}
        header(
            "window (batches)",
            "raw encode ns/event",
            "C wire+enc",
            "C+enc",
            "py+enc",
            "C wire / raw",
            "raw: hash lists / token lists",
            "C wire: rules alone / encode out",
            "floor: read / encode out",
            "C wire / floor",
        )
        gc.freeze()
        floor = floor_reader(batches)
        for w in COST_WINDOWS:
            c = cost(batches, w, args.seconds, args.rounds, floor)
            costs[w] = c
            raw = c["raw"]
            wire = c.get("rules C wire")
            ratio = f"{wire / raw:.2f}x" if wire else "n/a"
            lists = f"{c['raw: hash lists'] / raw:.2f}x / {c['raw: token lists'] / raw:.2f}x"
            alone, out = c.get("C wire: rules alone"), c.get("C wire: encode out")
            split = f"{alone / raw:.2f}x / {out / raw:.2f}x" if alone and out else "n/a"
            read, enc_out = c.get("floor: read"), c["floor: encode out"]
            least = f"{read / raw:.2f}x / {enc_out / raw:.2f}x" if read else "n/a"
            over = f"{wire / (read + enc_out):.2f}x" if wire and read else "n/a"
            row(w, raw, wire, c.get("rules C"), c["rules py"], ratio, lists, split, least, over)
        gc.unfreeze()
        figures[offload] = {
            "stream": shape,
            "volume": vol,
            "volume_parentless_copies": strict,
            "cost_ns_per_event": costs,
        }


if __name__ == "__main__":
    with recording("realstream", __doc__ or "") as fig:
        main(fig)
