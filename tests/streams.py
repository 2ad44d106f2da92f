"""Hypothesis strategies for KV-event streams, shared by the test modules.

Hashes come from a fixed forest of chains (hash ``c*100+d`` has parent
``c*100+d-1``), so a hash always names the same parent, as in vLLM.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import strategies as st

from coalesce.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

CHAINS, DEPTH = 2, 4
MEDIA = ("GPU", "CPU")
GROUPS = (None, 1)
GROUP_CHOICE = st.sampled_from((None, None, None, 1))  # mostly one group: keys collide more
BLOCK = 2


def parent_of(h: int) -> int | None:
    return None if h % 100 == 0 else h - 1


def hashes_from(c: int, d: int, n: int) -> list[int]:
    return [c * 100 + x for x in range(d, min(d + n, DEPTH))]


@st.composite
def stores(draw: Any, medium: str | None = None, first: int | None = None) -> BlockStored:
    if first is None:
        c = draw(st.integers(0, CHAINS - 1))
        d = draw(st.integers(0, DEPTH - 1))
    else:
        c, d = divmod(first, 100)
    hs = hashes_from(c, d, draw(st.integers(1, 1 if first is not None else 3)))
    tokens = draw(st.booleans())
    extra = draw(st.booleans())
    return BlockStored(
        block_hashes=hs,
        parent_block_hash=parent_of(hs[0]),
        token_ids=[h * 10 + i for h in hs for i in range(BLOCK)] if tokens else [],
        block_size=BLOCK,
        lora_id=None,
        medium=medium or draw(st.sampled_from(MEDIA)),
        lora_name=None,
        extra_keys=[("salt", h) for h in hs] if extra else None,
        group_idx=draw(GROUP_CHOICE),
    )


hash_values = st.builds(
    lambda c, d: c * 100 + d, st.integers(0, CHAINS - 1), st.integers(0, DEPTH - 1)
)

removals = st.builds(
    lambda hs, m, g: BlockRemoved(block_hashes=hs, medium=m, group_idx=g),
    st.lists(hash_values, min_size=1, max_size=3),
    st.sampled_from(MEDIA),
    GROUP_CHOICE,
)


@st.composite
def tier_moves(draw: Any) -> list[Any]:
    """vLLM's offload pattern: GPU removal, then the CPU store of the same block."""
    h = draw(hash_values)
    g = draw(GROUP_CHOICE)
    store = draw(stores(medium="CPU", first=h))
    store = type(store)(
        **{**{f: getattr(store, f) for f in store.__struct_fields__}, "group_idx": g}
    )
    return [BlockRemoved(block_hashes=[h], medium="GPU", group_idx=g), store]


def _one_block(h: int, medium: str, group: int | None, tokens: bool, extra: bool) -> BlockStored:
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=parent_of(h),
        token_ids=[h * 10 + i for i in range(BLOCK)] if tokens else [],
        block_size=BLOCK,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=[("salt", h)] if extra else None,
        group_idx=group,
    )


@st.composite
def chain_runs(draw: Any) -> list[Any]:
    """One-block stores down one chain, all fields equal (so they can chain), each
    block sometimes removed just before its store, and after it kept, removed,
    or offloaded (removed, then stored in the other medium): what the chain
    and gather rules feed on, and their traps (a store whose parent was
    removed in between, a store jumping a removal of its own key or a store of its child)."""
    c = draw(st.integers(0, CHAINS - 1))
    d = draw(st.integers(0, DEPTH - 1))
    medium = draw(st.sampled_from(MEDIA))
    other = MEDIA[1 - MEDIA.index(medium)]
    group = draw(GROUP_CHOICE)
    tokens, extra = draw(st.booleans()), draw(st.booleans())
    out: list[Any] = []
    for h in hashes_from(c, d, DEPTH):
        early = draw(st.integers(0, 7))
        if early == 0:  # a removal first (of a key perhaps not held)
            out.append(BlockRemoved(block_hashes=[h], medium=medium, group_idx=group))
        elif early == 1 and h % 100 < DEPTH - 1:  # its child first, in the other medium
            out.append(_one_block(h + 1, other, group, tokens, extra))
        out.append(_one_block(h, medium, group, tokens, extra))
        fate = draw(st.sampled_from(("keep", "remove", "offload")))
        if fate != "keep":
            out.append(BlockRemoved(block_hashes=[h], medium=medium, group_idx=group))
        if fate == "offload":
            out.append(_one_block(h, other, group, tokens, extra))
    return out


@st.composite
def offload_runs(draw: Any) -> list[Any]:
    """vLLM's eager CPU offload, the pattern the chain start of rules 5a and 6 is
    about: a GPU chain stored (in this window, or earlier: not here), then its
    blocks' CPU copies stored one by one, each block's GPU copy removed just before
    its CPU store or 1-2 CPU stores after it (vLLM: 1-10 batches after), so a CPU
    store's parent hash is often GPU-removed earlier while its CPU copy was stored
    earlier, later or never.  In between: removals of CPU keys, second stores (of
    either medium) and clears.  In vLLM's order, or shuffled."""
    c = draw(st.integers(0, CHAINS - 1))
    d = draw(st.sampled_from((0, 0, 1, 2)))  # from a root: certain CPU stores
    group = draw(GROUP_CHOICE)
    tokens, extra = draw(st.booleans()), draw(st.booleans())
    hs = hashes_from(c, d, DEPTH)
    ops: list[tuple[str, int]] = [("cpu", h) for h in hs]
    for h in hs:  # (a run keeps at least one event that is not a clear)
        delay = draw(st.integers(-1, 2))
        at = max(0, min(len(ops), ops.index(("cpu", h)) + 1 + delay))
        ops.insert(at, ("gpu-", h))
    for h in hs:
        if draw(st.integers(0, 4)) == 0:  # a CPU copy never stored
            ops.remove(("cpu", h))
    kinds = st.sampled_from(("cpu-", "cpu-", "cpu-", "cpu", "gpu", "gpu-", "clear"))
    for op in draw(st.lists(st.tuples(kinds, st.sampled_from(hs)), max_size=6)):
        ops.insert(draw(st.integers(0, len(ops))), op)
    if draw(st.integers(0, 3)) == 0:
        ops = draw(st.permutations(ops))
    out: list[Any] = []
    gpu = hs[draw(st.integers(0, len(hs) - 1)) :]  # the GPU chain may start mid-run
    how = draw(st.sampled_from(("earlier", "earlier", "blocks", "one store")))
    if how == "blocks":
        out = [_one_block(h, "GPU", group, tokens, extra) for h in gpu]
    elif how == "one store":
        first = _one_block(gpu[0], "GPU", group, tokens, extra)
        out = [
            BlockStored(
                block_hashes=gpu,
                parent_block_hash=first.parent_block_hash,
                token_ids=[h * 10 + i for h in gpu for i in range(BLOCK)] if tokens else [],
                block_size=BLOCK,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[("salt", h) for h in gpu] if extra else None,
                group_idx=group,
            )
        ]
    for op, h in ops:
        if op in ("cpu", "gpu"):
            out.append(_one_block(h, op.upper(), group, tokens, extra))
        elif op == "clear":
            out.append(AllBlocksCleared())
        else:
            out.append(BlockRemoved(block_hashes=[h], medium=op[:3].upper(), group_idx=group))
    return out


@st.composite
def lazy_runs(draw: Any) -> list[Any]:
    """vLLM's lazy CPU offload: a GPU chain stored block by block under its parents
    (from a root, or from a parent stored before the window), CPU copies stored with
    no parent and no tokens (one or two blocks each, so a CPU key is held whatever
    its parent's state: the parentless copy behind the lazy window), GPU and CPU
    removals, GPU stores again under their parent (a block loaded back, perhaps while
    its parent is missing), clears.  In vLLM's order, or shuffled."""
    c = draw(st.integers(0, CHAINS - 1))
    d = draw(st.sampled_from((0, 1, 1, 2)))
    group = draw(GROUP_CHOICE)
    tokens, extra = draw(st.booleans()), draw(st.booleans())
    hs = hashes_from(c, d, DEPTH)
    ops: list[tuple[str, int]] = [("gpu", h) for h in hs]
    kinds = st.sampled_from(("cpu", "cpu", "cpu", "gpu", "gpu-", "gpu-", "cpu-", "clear"))
    for op in draw(st.lists(st.tuples(kinds, st.sampled_from(hs)), max_size=8)):
        ops.insert(draw(st.integers(0, len(ops))), op)
    if draw(st.integers(0, 3)) == 0:
        ops = draw(st.permutations(ops))
    out: list[Any] = []
    for op, h in ops:
        if op == "gpu":
            out.append(_one_block(h, "GPU", group, tokens, extra))
        elif op == "cpu":
            run = hashes_from(c, h % 100, draw(st.integers(1, 2)))
            out.append(
                BlockStored(
                    block_hashes=run,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=BLOCK,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                    extra_keys=[("salt", x) for x in run] if extra else None,
                    group_idx=group,
                )
            )
        elif op == "clear":
            out.append(AllBlocksCleared())
        else:
            out.append(BlockRemoved(block_hashes=[h], medium=op[:3].upper(), group_idx=group))
    return out


lazy_lists = st.lists(
    st.one_of(
        lazy_runs(),
        lazy_runs(),
        stores().map(lambda e: [e]),
        removals.map(lambda e: [e]),
    ),
    min_size=1,
    max_size=4,
).map(lambda chunks: [e for c in chunks for e in c])


offload_lists = st.lists(
    st.one_of(
        offload_runs(),
        offload_runs(),
        stores().map(lambda e: [e]),
        removals.map(lambda e: [e]),
        st.just([AllBlocksCleared()]),
    ),
    min_size=1,
    max_size=4,
).map(lambda chunks: [e for c in chunks for e in c])


event_lists = st.lists(
    st.one_of(
        stores().map(lambda e: [e]),
        stores().map(lambda e: [e]),
        removals.map(lambda e: [e]),
        tier_moves(),
        chain_runs(),
        st.just([AllBlocksCleared()]),
    ),
    max_size=24,
).map(lambda chunks: [e for c in chunks for e in c])


def cut_into_batches(draw: Any, evs: list[Any], batch: Any = KVEventBatch) -> list[Any]:
    """``evs`` in order, cut into batches of 1 to 4 events (rank 0)."""
    batches: list[Any] = []
    i = 0
    while i < len(evs):
        n = draw(st.integers(1, 4))
        batches.append(batch(ts=float(len(batches)), events=evs[i : i + n], data_parallel_rank=0))
        i += n
    return batches


@st.composite
def batch_lists(draw: Any, events: Any = event_lists) -> list[KVEventBatch]:
    return cut_into_batches(draw, draw(events))


ALL_KEYS = [
    (m, g, c * 100 + d) for m in MEDIA for g in GROUPS for c in range(CHAINS) for d in range(DEPTH)
]

any_state = st.dictionaries(st.sampled_from(ALL_KEYS), st.integers(1, 2), max_size=12).map(Counter)


@st.composite
def closed_state(draw: Any) -> Counter[Any]:
    """A start state where every held block's parent is held in its medium and group."""
    base = draw(any_state)
    out: Counter[Any] = Counter(base)
    for (m, g, h), _ in base.items():
        p = parent_of(h)
        while p is not None:
            out[(m, g, p)] = max(out[(m, g, p)], 1)
            p = parent_of(p)
    return out


@st.composite
def closed_any_medium_state(draw: Any) -> Counter[Any]:
    """A start state where every held block's parent is held in some medium and group:
    llm-d's closure, weaker than :func:`closed_state`'s (a CPU block may have its
    parent on the GPU only)."""
    base = draw(any_state)
    out: Counter[Any] = Counter(base)
    for _, _, h in base:
        p = parent_of(h)
        while p is not None:
            if not any(k[2] == p for k in out):
                out[(draw(st.sampled_from(MEDIA)), draw(st.sampled_from(GROUPS)), p)] = 1
            p = parent_of(p)
    return out


@st.composite
def lazy_closed_state(draw: Any) -> Counter[Any]:
    """A start state a stream with vLLM's lazy offload leaves: every held block with a
    recorded parent has that parent held (a GPU block's in the GPU, its group), while
    a CPU block may be a parentless copy, held with its parent missing in every
    medium (its CPU store named no parent).  Closed in that weaker sense, for llm-d
    and Dynamo alike; not :func:`closed_state`'s."""
    gpu_keys = st.sampled_from([k for k in ALL_KEYS if k[0] == "GPU"])
    gpu = draw(st.dictionaries(gpu_keys, st.integers(1, 2), max_size=6))
    out: Counter[Any] = Counter(gpu)
    for (m, g, h), _ in gpu.items():
        p = parent_of(h)
        while p is not None:
            out[(m, g, p)] = max(out[(m, g, p)], 1)
            p = parent_of(p)
    cpu_keys = st.sampled_from([k for k in ALL_KEYS if k[0] == "CPU"])
    out.update(draw(st.dictionaries(cpu_keys, st.integers(1, 2), min_size=1, max_size=6)))
    return out


# SGLang's shapes: its media, no group_idx, and attribution fields that must never be merged
# across (cache_salt, session_id, lora_name, lora_id).
SGLANG_MEDIA = {"GPU": "GPU", "CPU": "CPU_PINNED"}
attributions = st.tuples(
    st.sampled_from((None, None, "salt-a")),
    st.sampled_from((None, "s1", "s2")),
    st.sampled_from(((None, None), (None, None), ("adapter", 7))),
)


@st.composite
def sglang_event_lists(draw: Any) -> list[Any]:
    """:data:`event_lists` in SGLang's classes, each store with an attribution drawn from
    a small set (so neighbours often share it and can merge, and often do not)."""
    from coalesce import sglang

    # SGLang's hashes are signed 64-bit (namespaced ones are often negative)
    sign = draw(st.sampled_from((1, -1)))

    def h(x: int | None) -> int | None:
        return None if x is None else sign * x - (sign < 0)

    out: list[Any] = []
    for ev in draw(event_lists):
        if isinstance(ev, BlockStored):
            salt, session, (lora_name, lora_id) = draw(attributions)
            out.append(
                sglang.BlockStored(
                    block_hashes=[h(x) for x in ev.block_hashes],
                    parent_block_hash=h(ev.parent_block_hash),
                    token_ids=ev.token_ids,
                    block_size=ev.block_size,
                    lora_id=lora_id,
                    medium=SGLANG_MEDIA[ev.medium or "GPU"],
                    cache_salt=salt,
                    session_id=session,
                    lora_name=lora_name,
                )
            )
        elif isinstance(ev, BlockRemoved):
            out.append(
                sglang.BlockRemoved(
                    block_hashes=[h(x) for x in ev.block_hashes],
                    medium=SGLANG_MEDIA[ev.medium or "GPU"],
                )
            )
        else:
            out.append(sglang.AllBlocksCleared())
    return out


@st.composite
def sglang_batch_lists(draw: Any) -> list[Any]:
    """Batches of :func:`sglang_event_lists`, as the publisher holds them (the rank set)."""
    from coalesce.events import EventBatch

    return cut_into_batches(draw, draw(sglang_event_lists()), EventBatch)
