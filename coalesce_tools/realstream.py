"""A stream recorded from vLLM's own scheduler, for tiers without vLLM (Dynamo's).

:func:`record` runs :class:`coalesce_tools.vllm_engine.VllmEngine` (needs vLLM)
and writes, gzip-compressed msgpack: the config, every batch as vLLM's
publisher would encode it (the payload frame, in publish order), and the
engine's pools at the end as ``[medium, group, hash, blocks]`` rows.
:func:`load` reads it back with msgspec alone.

    .venv-vllm/bin/python -m coalesce_tools.realstream tests_dynamo/data/vllm-eager.msgpack.gz
"""

from __future__ import annotations

import gzip
import sys
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["RECORDED", "Recorded", "load", "record"]

RECORDED: dict[str, Any] = {
    "requests": 96,
    "concurrency": 24,
    "prefixes": 6,
    "prefix_tokens": 512,
    "unique_tokens": 40,
    "max_tokens": 8,
    "gpu_blocks": 160,
    "cpu_blocks": 200,
    "max_num_seqs": 24,
}
"""The recorded run's workload (eager offload): small enough to keep in the repository."""


@dataclass
class Recorded:
    config: dict[str, Any]
    payloads: list[bytes]
    """Each batch's msgpack payload, as vLLM's ``ZmqEventPublisher`` encodes it."""
    pools: dict[tuple[str, int, Any], int]
    """``(medium, group, hash)`` -> blocks holding it, at the end of the run."""


def record(path: str, offload: str = "eager", **overrides: Any) -> Recorded:
    """Run vLLM's scheduler on :data:`RECORDED` (plus ``overrides``) and write it to ``path``."""
    from coalesce_tools.vllm_engine import EngineConfig, VllmEngine

    cfg = EngineConfig(**{**RECORDED, **overrides, "offload": offload})
    eng = VllmEngine(cfg, "inproc://record", record=True, publisher="null")
    eng.run()
    enc = msgspec.msgpack.Encoder()
    for b in eng.batches or []:
        b.data_parallel_rank = 0 if b.data_parallel_rank is None else b.data_parallel_rank
    doc = {
        "config": cfg.as_dict(),
        "payloads": [enc.encode(b) for b in eng.batches or []],
        "pools": [[m, g, h, n] for (m, g, h), n in sorted(eng.truth().items(), key=str)],
    }
    eng.shutdown()
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(msgspec.msgpack.encode(doc))
    return load(path)


def load(path: str) -> Recorded:
    """Read a recorded stream (msgspec only; no vLLM)."""
    with gzip.open(path, "rb") as f:
        doc = msgspec.msgpack.decode(f.read())
    pools = {(m, g, h): n for m, g, h, n in doc["pools"]}
    return Recorded(doc["config"], list(doc["payloads"]), pools)


if __name__ == "__main__":
    rec = record(sys.argv[1], *(sys.argv[2:3] or ["eager"]))
    size = sum(map(len, rec.payloads))
    print(f"{len(rec.payloads)} batches, {size} bytes, {len(rec.pools)} keys")
