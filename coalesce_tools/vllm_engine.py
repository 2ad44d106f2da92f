"""vLLM's own engine code as the event source: its v1 scheduler, stepped with a fake GPU.

:class:`VllmEngine` builds vLLM 0.33's real ``Scheduler``
(``vllm/v1/core/sched/scheduler.py``) with its real ``KVCacheManager`` and
GPU ``BlockPool`` (``vllm/v1/core/kv_cache_manager.py``,
``vllm/v1/core/block_pool.py``) and, optionally, the scheduler side of
``SimpleCPUOffloadConnector``
(``vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py``,
``vllm/v1/simple_kv_offload/manager.py``), eager or lazy.  KV events are on,
and the scheduler creates its publisher through vLLM's own
``EventPublisherFactory`` (``vllm/distributed/kv_events.py``), so whatever
holds the factory's ``"zmq"`` entry (vLLM's ``ZmqEventPublisher``, the
coalesce plugin, the drop-on-full variant: :func:`use_publisher`) is what
the scheduler publishes through, as under ``vllm serve``.

Only what runs on a GPU is fake, each piece written here after the vLLM code
named:

- the model runner (``vllm/v1/worker/gpu_model_runner.py``'s output,
  ``vllm/v1/outputs.py``'s ``ModelRunnerOutput``): one sampled token per
  scheduled request, none for a request still inside a prefill chunk;
- the offload worker (``vllm/v1/simple_kv_offload/worker.py``:
  ``get_finished`` and ``build_connector_worker_meta``): a store event issued
  in a step's connector metadata is reported complete ``store_latency``
  steps later (``SimpleCPUOffloadWorkerMetadata.completed_store_events``), a
  load event's requests ``load_latency`` steps later (``finished_recving``);
  ``need_flush`` (a preemption) completes everything in flight at once, as
  ``handle_preemptions`` does;
- the engine core's loop (``vllm/v1/engine/core.py``, ``EngineCore.step``):
  ``schedule()``, the fake runner, ``update_from_output()``.

The configuration follows vLLM's unit-test helpers
(``tests/v1/core/utils.py``, ``tests/v1/kv_connector/unit/utils.py``: a
``VllmConfig`` on ``DeviceConfig("cpu")``, a one-group ``KVCacheConfig``)
with a tiny local Llama ``config.json`` so that ``ModelConfig`` needs no
network and no weights (facts sheet, section 10).

The truth a subscriber is checked against is :meth:`VllmEngine.truth`: the
block hashes the GPU ``BlockPool`` and the offload manager's CPU pool hold at
that moment, per medium, read from their ``cached_block_hash_to_block`` maps
(with how many blocks hold each hash).

Needs ``vllm==0.33.0`` (``make .venv-vllm/.installed-stamp``); importing this
module without vLLM raises ``ImportError``.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed import kv_events as vk
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadMetadata,
    SimpleCPUOffloadWorkerMetadata,
)
from vllm.v1.structured_output import StructuredOutputManager

__all__ = [
    "OFFLOADS",
    "PUBLISHERS",
    "EngineConfig",
    "Key",
    "VllmEngine",
    "pool_state",
    "seed_like",
    "use_publisher",
]

Offload = Literal["none", "eager", "lazy"]
OFFLOADS: tuple[Offload, ...] = ("none", "eager", "lazy")
PUBLISHERS = ("stock", "drop", "coalesce")
"""What :func:`use_publisher` can put in vLLM's factory (coalesce+snap is coalesce with
``COALESCE_SNAPSHOT_ENDPOINT`` set)."""
Key = tuple[str, int, Any]
"""``(medium, group_idx, block hash)``, as the events name a block (the hash as the
events carry it: an int unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
}
_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@dataclass(frozen=True)
class EngineConfig:
    """One seeded run: the workload and the engine's sizes.

    The workload is the seed's shape scaled to a small host: ``requests`` requests,
    at most ``concurrency`` of them in the scheduler at once (a finished one is
    replaced by the next), each a prompt of one of ``prefixes`` shared prefixes of
    ``prefix_tokens`` tokens (chosen by a seeded RNG) then ``unique_tokens`` of its
    own, generating ``max_tokens``.  The GPU pool (``gpu_blocks``) and the CPU pool
    (``cpu_blocks``) are far smaller than the prefixes, so eviction and offload
    never stop."""

    offload: Offload = "eager"
    seed: int = 0
    requests: int = 96
    concurrency: int = 32
    prefixes: int = 8
    prefix_tokens: int = 1024
    unique_tokens: int = 40
    max_tokens: int = 8
    gpu_blocks: int = 400
    cpu_blocks: int = 500
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    store_latency: int = 1
    """Steps from a store's issue (in a step's connector metadata) to its completion
    reported back (0: in the same step's output)."""
    load_latency: int = 1
    """The same for a load from the CPU pool."""
    gpu_ms: float = 0.0
    """The fake forward pass: each step sleeps this long with the GIL released, between
    ``schedule()`` and ``update_from_output()``, as the engine thread waits on the GPU
    (0: a pure-CPU loop, which leaves a sender thread only the 5 ms switch interval)."""

    def __post_init__(self) -> None:
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {OFFLOADS}, got {self.offload!r}")
        if self.store_latency < 0 or self.load_latency < 0 or self.gpu_ms < 0:
            raise ValueError("latencies are steps >= 0, gpu_ms >= 0")
        if min(self.requests, self.concurrency, self.prefixes, self.max_tokens) < 1:
            raise ValueError("requests, concurrency, prefixes and max_tokens must be >= 1")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def seed_like(offload: Offload = "eager", gpu_ms: float = 0.0) -> EngineConfig:
    """The seed's shape at this host's scale (the demo's and the benchmarks' workload):
    512 requests, 128 in flight, on 16 shared 2,048-token prefixes, a 1,500-block GPU
    pool and a 2,000-block CPU pool, 4,096 tokens a step.  A run takes 2-5 s here."""
    return EngineConfig(
        offload=offload,
        requests=512,
        concurrency=128,
        prefixes=16,
        prefix_tokens=2048,
        unique_tokens=40,
        max_tokens=8,
        gpu_blocks=1500,
        cpu_blocks=2000,
        max_num_seqs=128,
        max_num_batched_tokens=4096,
        gpu_ms=gpu_ms,
    )


@contextmanager
def use_publisher(kind: str) -> Iterator[None]:
    """vLLM's ``EventPublisherFactory`` builds ``kind`` for ``publisher="zmq"`` while the
    block runs (construct the engine inside it); vLLM's own entry is put back after.

    ``"stock"``: vLLM's ``ZmqEventPublisher``.  ``"coalesce"``: the coalesce plugin,
    loaded by vLLM's own plugin loader with ``COALESCE_KV_EVENTS=1`` (its settings from
    the ``COALESCE_*`` variables).  ``"drop"``: vLLM's publisher with the upstream
    drop-on-full proposal (:data:`coalesce_tools.baselines.DropPublisher`)."""
    import vllm.plugins

    import coalesce.vllm_plugin as plugin
    from coalesce_tools.baselines import DropPublisher

    if kind not in PUBLISHERS:
        raise ValueError(f"publisher must be one of {PUBLISHERS}, got {kind!r}")
    registry: dict[str, Any] = vk.EventPublisherFactory._registry
    plugin.unregister()
    own = registry["zmq"]
    saved_env = os.environ.get("COALESCE_KV_EVENTS")
    try:
        if kind == "coalesce":
            os.environ["COALESCE_KV_EVENTS"] = "1"
            vllm.plugins.plugins_loaded = False  # what a fresh EngineCore process sees
            vllm.plugins.load_general_plugins()
            if registry["zmq"] is own:  # the entry point is not installed: register directly
                plugin.register()
        elif kind == "drop":
            registry["zmq"] = DropPublisher
        yield
    finally:
        plugin.unregister()
        registry["zmq"] = own
        if saved_env is None:
            os.environ.pop("COALESCE_KV_EVENTS", None)
        else:
            os.environ["COALESCE_KV_EVENTS"] = saved_env


_model_dir: str | None = None


def _tiny_model_dir() -> str:
    """A local directory with a tiny Llama ``config.json`` (no weights, no tokenizer)."""
    global _model_dir
    if _model_dir is None:
        path = os.path.join(tempfile.gettempdir(), f"kv-coalesce-tiny-llama-{os.getuid()}")
        os.makedirs(path, exist_ok=True)
        target = os.path.join(path, "config.json")
        if not os.path.exists(target):
            tmp = f"{target}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(_TINY_LLAMA, f)
            os.replace(tmp, target)
        _model_dir = path
    return _model_dir


_hash_ready = False


def _page_bytes(cfg: EngineConfig) -> int:
    spec = _attention_spec(cfg)
    return int(spec.page_size_bytes) * len(_LAYERS)


def _attention_spec(cfg: EngineConfig) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=cfg.block_size,
        num_kv_heads=2,
        head_size=16,
        dtype=importlib.import_module("torch").float16,
    )


def _vllm_config(cfg: EngineConfig, kv_events: KVEventsConfig, dp_index: int) -> VllmConfig:
    max_len = cfg.prefix_tokens + cfg.unique_tokens + cfg.max_tokens + cfg.block_size
    model = ModelConfig(
        model=_tiny_model_dir(),
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=max_len,
        seed=cfg.seed,
    )
    sched = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=True)
    transfer = None
    if cfg.offload != "none":
        transfer = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": _page_bytes(cfg) * cfg.cpu_blocks,
                "num_cpu_blocks": cfg.cpu_blocks,
                "lazy_offload": cfg.offload == "lazy",
            },
        )
    vcfg = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=transfer,
        kv_events_config=kv_events,
        device_config=DeviceConfig("cpu"),
    )
    vcfg.parallel_config.data_parallel_index = dp_index
    vcfg.parallel_config.data_parallel_rank = dp_index
    return vcfg


@dataclass
class _Transfer:
    due: int  # the step whose output reports it
    store: int | None = None  # store event index
    reqs: list[str] = field(default_factory=list)  # a load's requests


class VllmEngine:
    """One engine core (one DP rank): vLLM's scheduler and its pools, a fake GPU.

    ``endpoint``, ``replay_endpoint``, ``max_queue_size``, ``buffer_steps``, ``hwm`` and
    ``topic`` go into vLLM's ``KVEventsConfig`` (``publisher="zmq"``): build the engine
    inside :func:`use_publisher` to choose whose publisher that is (``publisher="null"``:
    vLLM's ``NullEventPublisher``, for a run that only records).  ``dp_index`` is
    the scheduler's ``data_parallel_index`` (the publisher's rank and endpoint offset).
    """

    def __init__(
        self,
        cfg: EngineConfig,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        max_queue_size: int = 100_000,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        topic: str = "",
        dp_index: int = 0,
        record: bool = False,
        publisher: str = "zmq",
    ) -> None:
        global _hash_ready
        if not _hash_ready:
            init_none_hash(sha256)
            _hash_ready = True
        self.cfg = cfg
        kv_events = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher=publisher,
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            max_queue_size=max_queue_size,
            buffer_steps=buffer_steps,
            hwm=hwm,
            topic=topic,
        )
        vcfg = _vllm_config(cfg, kv_events, dp_index)
        page = int(_attention_spec(cfg).page_size_bytes)  # one layer's page
        tensor = KVCacheTensor(  # layer-outermost: each layer a contiguous region
            size=page * cfg.gpu_blocks * len(_LAYERS),
            layers=list(_LAYERS),
            layer_stride=page * cfg.gpu_blocks,
            block_stride=page,
        )
        kv_cache = KVCacheConfig(
            num_blocks=cfg.gpu_blocks,
            kv_cache_tensors=[tensor],
            kv_cache_groups=[KVCacheGroupSpec(list(_LAYERS), _attention_spec(cfg))],
        )
        vcfg.cache_config.num_gpu_blocks = cfg.gpu_blocks
        self.scheduler = Scheduler(
            vllm_config=vcfg,
            kv_cache_config=kv_cache,
            structured_output_manager=StructuredOutputManager(vcfg),
            block_size=cfg.block_size,
            log_stats=False,
        )
        self.publisher: Any = self.scheduler.kv_event_publisher
        self.steps = 0
        self.step_seconds: list[float] = []
        self.publish_seconds: list[float] = []
        self.found_full = 0
        """``publish()`` calls that found a bounded ``queue.Queue`` publisher's queue full
        (vLLM's own publisher then blocks until its sender takes one: the seed's hang)."""
        self.batches: list[Any] | None = [] if record else None
        """With ``record``: every batch the scheduler published, in order (the objects
        themselves: the publisher may have set their rank)."""
        self._in_flight: deque[_Transfer] = deque()
        self._rng = random.Random(cfg.seed)
        vocab = int(_TINY_LLAMA["vocab_size"])  # type: ignore[call-overload]
        self._prefixes = [
            [self._rng.randrange(1, vocab) for _ in range(cfg.prefix_tokens)]
            for _ in range(cfg.prefixes)
        ]
        self._vocab = vocab
        self._added = 0
        self._hasher = get_request_block_hasher(cfg.block_size, sha256)
        self._time_publish()

    # -- the workload ---------------------------------------------------------------

    def _new_request(self) -> Request:
        cfg, rng = self.cfg, self._rng
        prompt = list(self._prefixes[rng.randrange(cfg.prefixes)])
        prompt += [rng.randrange(1, self._vocab) for _ in range(cfg.unique_tokens)]
        params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
        req = Request(f"r{self._added}", prompt, params, None, block_hasher=self._hasher)
        self._added += 1
        return req

    def _top_up(self) -> None:
        while (
            self._added < self.cfg.requests
            and self.scheduler.get_num_unfinished_requests() < self.cfg.concurrency
        ):
            self.scheduler.add_request(self._new_request())

    # -- the step -------------------------------------------------------------------

    def _time_publish(self) -> None:
        """Time every ``publish()`` the scheduler makes (a wrapper on this instance)."""
        pub = self.publisher
        inner = pub.publish
        times = self.publish_seconds
        kept = self.batches
        bounded = getattr(pub, "_event_queue", None)  # vLLM's publisher and its drop variant

        def publish(batch: Any) -> Any:
            if kept is not None:
                kept.append(batch)
            if bounded is not None and bounded.full():
                self.found_full += 1
            t0 = time.perf_counter()
            try:
                return inner(batch)
            finally:
                times.append(time.perf_counter() - t0)

        pub.publish = publish

    def _runner_output(self, out: Any) -> ModelRunnerOutput:
        """What a model runner reports for ``out``: a token per request past its prompt."""
        reqs = self.scheduler.requests
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = reqs[rid]
            done_prefill = req.num_computed_tokens >= req.num_tokens
            sampled.append([self._rng.randrange(1, self._vocab)] if done_prefill else [])
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=self._worker_output(out),
        )

    def _worker_output(self, out: Any) -> KVConnectorOutput | None:
        """The fake offload worker: take this step's transfers, report those now due."""
        meta = out.kv_connector_metadata
        if not isinstance(meta, SimpleCPUOffloadMetadata):
            return None
        step = self.steps
        if meta.store_event >= 0:
            self._in_flight.append(_Transfer(step + self.cfg.store_latency, store=meta.store_event))
        if meta.load_event >= 0:
            reqs = list(meta.load_event_to_reqs.get(meta.load_event, ()))
            self._in_flight.append(_Transfer(step + self.cfg.load_latency, reqs=reqs))
        stores: dict[int, int] = {}
        loads: set[str] = set()
        keep: deque[_Transfer] = deque()
        for t in self._in_flight:
            if t.due <= step or meta.need_flush:
                if t.store is not None:
                    stores[t.store] = 1
                loads.update(t.reqs)
            else:
                keep.append(t)
        self._in_flight = keep
        if not stores and not loads:
            return None
        return KVConnectorOutput(
            finished_recving=loads or None,
            kv_connector_worker_meta=(
                SimpleCPUOffloadWorkerMetadata(completed_store_events=stores) if stores else None
            ),
        )

    @property
    def added(self) -> int:
        """Requests added to the scheduler so far."""
        return self._added

    def busy(self) -> bool:
        """Requests left to add or to finish, or transfers in flight."""
        return (
            self._added < self.cfg.requests
            or self.scheduler.has_requests()
            or bool(self._in_flight)
        )

    def step(self) -> float:
        """One engine step (``EngineCore.step``): schedule, the fake GPU, update; the
        step's duration in seconds (the publish inside it included)."""
        t0 = time.perf_counter()
        self._top_up()
        out = self.scheduler.schedule()
        if self.cfg.gpu_ms:
            time.sleep(self.cfg.gpu_ms / 1e3)  # the forward pass: the GIL released
        self.scheduler.update_from_output(out, self._runner_output(out))
        self.steps += 1
        dt = time.perf_counter() - t0
        self.step_seconds.append(dt)
        return dt

    def run(self, max_steps: int = 1_000_000) -> int:
        """Step until the workload is done and every transfer completed; steps taken."""
        start = self.steps
        while self.busy() and self.steps - start < max_steps:
            self.step()
        if self.busy():
            raise RuntimeError(f"the engine is still busy after {max_steps} steps")
        return self.steps - start

    # -- the truth ------------------------------------------------------------------

    def pools(self) -> dict[str, Any]:
        """The engine's block pools by medium: ``GPU``, and ``CPU`` with offload."""
        pools = {"GPU": self.scheduler.kv_cache_manager.block_pool}
        conn = self.scheduler.connector
        manager = getattr(conn, "scheduler_manager", None) if conn is not None else None
        if manager is not None:
            pools[str(manager.kv_event_medium)] = manager.cpu_block_pool
        return pools

    def truth(self) -> Counter[Key]:
        """What the pools hold now: ``(medium, group, hash)`` -> how many blocks."""
        return pool_state(self.pools())

    def shutdown(self) -> None:
        """The scheduler's own shutdown (it shuts its publisher down)."""
        self.scheduler.shutdown()


def pool_state(pools: dict[str, Any]) -> Counter[Key]:
    """``(medium, group, hash)`` -> blocks holding it, over ``pools`` (medium -> vLLM
    ``BlockPool``), read from each pool's ``cached_block_hash_to_block`` map."""
    held: Counter[Key] = Counter()
    for medium, pool in pools.items():
        for key, blocks in pool.cached_block_hash_to_block._cache.items():
            h = maybe_convert_block_hash(get_block_hash(key))
            held[(medium, get_group_id(key), h)] += len(blocks) if isinstance(blocks, dict) else 1
    return held
