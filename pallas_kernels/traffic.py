"""Global-memory traffic of a kernel launch, counted under Triton's interpreter, against the least a
launch of that kernel's contract must read ("read each byte once": DESIGN.md).

`counting()` collects a `LaunchTraffic` for every `triton_call.call` interpreted inside it: for
each `tl.load` executed, the mask-true elements times the element size (a load without a mask:
all its elements), in total and per kernel parameter (whose buffer each address falls in). It
hooks the interpreter's one load primitive (`InterpreterBuilder.create_masked_load`, which
`create_load` and every other load goes through) for the length of the launch, under the lock
that serialises interpreted launches (`triton_call._INTERPRETER_LOCK`), and puts it back after.

    with traffic.counting() as launches:
        out, lse = triton_attention.paged_prefix_attention(q, k_pool, None, 0, table, lengths, scale=0.1,
                                                           q2=q2, k2_pool=k2_pool, interpret=True,
                                                           launch=launch.TABLE[("mla_attention", "sm_90")])
    ratio = launches[-1].bytes_loaded / traffic.attention_minimum(q, k_pool, None, table, lengths, q2=q2,
                                                                  k2_pool=k2_pool)

The minimums (`attention_minimum`, `moe_minimum`) follow the kernels' contracts
(attention.py, moe.py), not their tilings: every byte the result depends on, once.
Counting adds a little work to every interpreted load; outside `counting()` nothing is hooked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass
class LaunchTraffic:
    """What one interpreted launch loaded from global memory."""

    kernel: str  # the launch's name (triton_call.call's `name`, else the kernel's)
    grid: tuple[int, ...]
    bytes_loaded: int = 0
    loads: int = 0  # tl.load executions (every program's)
    by_argument: dict[str, int] = dataclasses.field(default_factory=dict)  # parameter -> bytes loaded from it
    # parameter -> distinct bytes of it loaded at least once (only under counting(distinct=True))
    distinct_by_argument: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def distinct_bytes(self) -> int:
        return sum(self.distinct_by_argument.values())


OUTSIDE = "(outside every argument)"  # by_argument's key for addresses in no argument's buffer
_SINKS: list[tuple[list, bool]] = []  # the open counting() blocks: (their list, distinct?)
_SINKS_LOCK = threading.Lock()


@contextlib.contextmanager
def counting(distinct: bool = False):
    """Within it, every launch `triton_call.call` interprets (on any thread: jax.pure_callback runs
    its host function on one of XLA's) adds a `LaunchTraffic` to the yielded list, in launch order.
    `distinct`: also count the distinct bytes of each parameter loaded (a bitmap the size of each
    buffer: for small shapes)."""
    into: list[LaunchTraffic] = []
    entry = (into, distinct)
    with _SINKS_LOCK:
        _SINKS.append(entry)
    try:
        yield into
    finally:
        with _SINKS_LOCK:
            _SINKS.remove(entry)


def active() -> bool:
    """Whether a `counting()` block is open."""
    return bool(_SINKS)


@contextlib.contextmanager
def recording(name: str, grid: Sequence[int], buffers: Sequence[tuple[str, Any]]):
    """Count the loads of the interpreted launch run within (`triton_call._interpret` opens it
    while it holds the interpreter's lock); `buffers`: (parameter, torch tensor) of every pointer
    argument. A no-op where no `counting()` block is open."""
    with _SINKS_LOCK:
        sinks = list(_SINKS)
    if not sinks:
        yield None
        return
    from triton.runtime import interpreter

    record = LaunchTraffic(name, tuple(grid))
    distinct = any(d for _, d in sinks)
    spans = sorted((int(t.data_ptr()), int(t.data_ptr()) + t.numel() * t.element_size(), param, t.element_size())
                   for param, t in buffers if t.numel())
    starts = np.array([s[0] for s in spans], np.uint64)
    seen = {param: np.zeros(-(-(end - start) // size), bool) for start, end, param, size in spans} if distinct else {}
    builder = interpreter.interpreter_builder
    original = builder.create_masked_load  # the class's, bound: create_load and the others call this name

    def counted(ptrs, mask, other, cache_policy, is_volatile):
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        addresses = np.asarray(ptrs.data).astype(np.uint64, copy=False)
        taken = addresses[np.broadcast_to(np.asarray(mask.data, bool), addresses.shape)] if mask is not None \
            else addresses.reshape(-1)
        record.loads += 1
        record.bytes_loaded += taken.size * size
        if taken.size:
            which = np.searchsorted(starts, taken, side="right").astype(np.int64) - 1  # the span starting at or below
            for i in np.unique(which):
                here = taken[which == i]
                start, end, param, itemsize = spans[i] if i >= 0 else (0, 0, OUTSIDE, size)
                inside = here[here < end] if i >= 0 else here[:0]
                if inside.size:
                    record.by_argument[param] = record.by_argument.get(param, 0) + inside.size * size
                    if distinct:
                        seen[param][((inside - np.uint64(start)) // np.uint64(itemsize)).astype(np.int64)] = True
                if inside.size < here.size:
                    record.by_argument[OUTSIDE] = record.by_argument.get(OUTSIDE, 0) + (here.size - inside.size) * size
        return original(ptrs, mask, other, cache_policy, is_volatile)

    builder.create_masked_load = counted  # an instance attribute over the class's method
    try:
        yield record
    finally:
        del builder.create_masked_load
        record.distinct_by_argument = {param: int(bits.sum()) * size for (_, _, param, size), bits
                                       in ((s, seen[s[2]]) for s in spans)} if distinct else {}
        for into, _ in sinks:
            into.append(record)


# --- the least a launch must read, by the kernels' contracts ---------------------------------------

def _itemsize(a) -> int:
    return np.dtype(a.dtype).itemsize


def _nbytes(a) -> int:
    return int(np.prod(a.shape)) * _itemsize(a)


def attention_minimum(q, k_pool, v_pool, block_table, lengths, *, q2=None, k2_pool=None, scales=None) -> int:
    """The bytes `triton_attention.paged_prefix_attention` (attention.py's contract) must read:
    the queries once (q [B, H, M, D], and q2 where a second key pool is given), every visible KV
    slot once per KV head (the slots below each row's length: the key pool's lanes, the second key
    pool's (MLA's rope key), the value pool's unless the values are the keys (MLA's latent), and
    over FP8 pages the scales of each), the block table's entries that name those slots' pages,
    the lengths and the layer index."""
    lengths = np.minimum(np.asarray(lengths, np.int64), block_table.shape[1] * k_pool.shape[2])
    slots = int(lengths.sum())
    heads = k_pool.shape[3]
    per_slot = k_pool.shape[-1] * _itemsize(k_pool)
    pools = [(k2_pool, None if scales is None else scales.k2)]
    if v_pool is not None:
        pools.append((v_pool, None if scales is None else scales.v))
    per_slot += sum(p.shape[-1] * _itemsize(p) for p, _ in pools if p is not None)
    if scales is not None:
        per_slot += scales.k.shape[-1] * _itemsize(scales.k)
        per_slot += sum(s.shape[-1] * _itemsize(s) for p, s in pools if p is not None and s is not None)
    queries = _nbytes(q) + (_nbytes(q2) if q2 is not None and k2_pool is not None else 0)
    pages = int((-(-lengths // k_pool.shape[2])).sum())
    return slots * heads * per_slot + queries + pages * _itemsize(block_table) + len(lengths) * 4 + 4  # + the layer


def moe_minimum(x, ws: Sequence[Any], group_sizes, *, block_m: int = 16) -> int:
    """The bytes a launch of `triton_moe.grouped_matmul` (one weight) or `grouped_swiglu` (gate and
    up) must read (moe.py's contract): the weights (values and scales, as the device holds them)
    of each expert that receives rows, once; the routed rows of the activations once (x [N, K]
    as the kernel takes it: int8 with a float32 scale per row for W4A8, else x itself); and the
    tile plan's index arrays (`tile_plan` with `block_m`: an expert id per tile, its first and
    end row for each tile that has rows)."""
    from eagle3_jax.weights.quant import QArray

    sizes = np.asarray(group_sizes, np.int64)
    routed = int(sizes.sum())
    hit = sizes > 0
    weights = 0
    for w in ws:
        leaves = (w.values, w.scales) if isinstance(w, QArray) else (w,)
        weights += sum(_nbytes(leaf) // leaf.shape[0] for leaf in leaves) * int(hit.sum())
    k = x.shape[1]
    w4a8 = isinstance(ws[0], QArray) and ws[0].qformat.act == "int8"
    rows = routed * (k + 4 if w4a8 else k * _itemsize(x))
    tiles = max(1, x.shape[0] // block_m + min(len(sizes), x.shape[0]))
    live = int((-(-sizes // block_m)).sum())
    return weights + rows + tiles * 4 + live * 8
