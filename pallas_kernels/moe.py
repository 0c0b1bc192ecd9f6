"""Grouped matmuls for routed experts: the contract the Triton kernels (triton_moe.py) implement,
the tile plan and layout checks they share with the engine, and their XLA twins.

`grouped_matmul(x, w, group_sizes)` computes, for rows x [N, K] sorted by expert (group e owns the
next group_sizes[e] rows), y[rows of e] = x[rows of e] @ w[e] in float32; rows past the groups give
zeros. `grouped_swiglu(x, w_gate, w_up, group_sizes)` is the fused first half of an expert MLP:
silu(x @ w_gate[e]) * (x @ w_up[e]) with both accumulators in one kernel, so x is read once and
the [N, I] gate and up products never reach memory.

Weights: a float array [E, K, Nout] or a `QArray` in any of the project's formats (weights/quant.py):
- int4 / mxfp4: uint8 [E, K/2, Nout], byte b holds elements 2b (low nibble) and 2b + 1 (high);
  int4 is nibble - 8 times a float scale per `g` input rows, mxfp4 an OCP e2m1 nibble times an
  e8m0 byte scale per 32. The activations' columns are pre-split into even and odd halves per K
  step outside the kernel (`split_even_odd`), so the low and high nibbles each meet their own
  half in a plain 2-D dot (no interleaving in registers).
- fp8_block / fp8_channel: float8 [E, K, Nout] (OCP e4m3fn or gfx942's e4m3fnuz) with float32
  scales per 128 x 128 block or per output column, decoded in registers with integer ops (ROCm's
  Triton has no e4m3fnuz conversion).
- W4A8 (int4 with `act="int8"`): activations quantized per row to int8 outside the kernel (as
  weights/quant.py does), int8 x int4 group dots computed exactly, then scaled.

Tiling: which expert and rows a row tile covers is worked out in XLA beforehand (`tile_plan`: each
expert's rows are cut into tiles of `block_m`, so a tile never mixes experts, and empty experts get
no tile). The number of row tiles is N // block_m + min(E, N), so a decode step with a few routed
assignments launches a few tiles, each reading one routed expert's weights, with no dependence on
how many experts the layer has. Tiles are powers of two (`TILES`); `layout_error` says which
weights no tiling takes (the engine keeps XLA for those). `grouped_matmul_reference` and
`grouped_swiglu_reference` are the XLA twins (`quant.ragged_linear`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.weights.quant import QArray, ragged_linear

TILES = (256, 128, 64, 32, 16)  # power-of-two tiles, largest first; Triton's smallest dot is 16


def tiles_up_to(largest: int) -> tuple[int, ...]:
    return tuple(t for t in TILES if t <= largest)


def largest_dividing(choices: tuple[int, ...], *sizes: int) -> int | None:
    """The first of `choices` dividing every one of `sizes`, or None."""
    return next((c for c in choices if all(s % c == 0 for s in sizes)), None)


def layout_error(w, k: int) -> str | None:
    """Why the kernels cannot take weight `w` [E, K, Nout] against K-wide rows, or None if they can."""
    if k != w.shape[-2]:
        return f"rows have {k} columns but the weight's input dimension is {w.shape[-2]}"
    n_out = w.shape[-1]
    bi, bo = w.qformat.scale_block(w.shape) if isinstance(w, QArray) else (k, 1)
    if isinstance(w, QArray) and w.qformat.fmt in ("int4", "mxfp4"):
        if bi < 32 or bi & (bi - 1) or k % bi or bo != 1:
            return (f"{w.qformat.fmt} needs scale groups along K of a power of two >= 32 dividing K={k}, one per "
                    f"column (got {bi} x {bo})")
    elif largest_dividing(TILES, k, bi) is None:  # a K step stays inside one scale block
        return f"K={k} and the K scale block ({bi}) need a common power-of-two step >= 16"
    if largest_dividing(TILES, n_out, *([bo] if bo > 1 else [])) is None:
        return f"Nout={n_out} and the column scale block ({bo}) need a common power-of-two tile >= 16"
    return None


def tile_plan(group_sizes: jax.Array, num_rows: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """Per row tile: (expert, first row, end row of its expert) for a static number of tiles
    (num_rows // block_m + min(E, num_rows), an upper bound: an expert with s rows needs at most
    s // block_m + 1 tiles, and at most min(E, num_rows) experts have rows); unused tiles get
    expert = E."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    count = max(1, num_rows // block_m + min(e, num_rows))
    i = jnp.arange(count, dtype=jnp.int32)
    expert = jnp.searchsorted(tile_end, i, side="right").astype(jnp.int32)
    safe = jnp.minimum(expert, e - 1)
    first = starts[safe] + (i - (tile_end[safe] - tiles[safe])) * block_m
    return expert, first, ends[safe], count


def split_even_odd(x: jax.Array, group: int) -> jax.Array:
    """Columns of each K group reordered as [even columns | odd columns]."""
    n, k = x.shape
    return x.reshape(n, k // group, group // 2, 2).swapaxes(-1, -2).reshape(n, k)


def grouped_matmul_reference(x: jax.Array, w, group_sizes: jax.Array, **_) -> jax.Array:
    """`triton_moe.grouped_matmul` through XLA (`quant.ragged_linear`: dequantize, then ragged_dot)."""
    return ragged_linear(x, w, group_sizes).astype(jnp.float32)


def grouped_swiglu_reference(x: jax.Array, w_gate, w_up, group_sizes: jax.Array, **_) -> jax.Array:
    """`triton_moe.grouped_swiglu` through XLA, exactly as the MoE layer's XLA path computes it."""
    return jax.nn.silu(ragged_linear(x, w_gate, group_sizes)) * ragged_linear(x, w_up, group_sizes)
