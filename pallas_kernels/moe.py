"""Grouped matmul for routed experts (Pallas, Triton-shaped): rows sorted by expert times each
expert's weight, with int4 weights dequantized in registers, never materialised.

`grouped_matmul(x, w, group_sizes)` computes, for rows x [N, K] sorted by expert (group e owns the
next group_sizes[e] rows), y[rows of e] = x[rows of e] @ w[e], in float32; rows past the groups
give zeros. Weights: a float array [E, K, Nout], or an int4 `QArray` (values uint8 [E, K/2, Nout],
byte b holding elements 2b (low nibble) and 2b + 1 (high nibble), stored as value + 8; one scale per
`g` input rows). The grid walks (row tile, column tile) pairs; which expert and rows a row tile
covers is worked out in XLA beforehand (each expert's rows are cut into tiles of `block_m`, so a
tile never mixes experts; empty experts get no tile) and read in kernel. For int4 the K loop steps
one scale group at a time: the activations' columns are pre-split into even and odd halves per
group outside the kernel, so the low and high nibbles each meet their own half in a plain 2-D dot
(no interleaving in registers). `grouped_matmul_reference` is the XLA twin (ragged_dot).

Not wired into the MoE op yet; FP8, MXFP4, fused gate/up and W4A8 forms are still to come.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from eagle3_jax.quant import QArray, ragged_linear


def tile_plan(group_sizes: jax.Array, num_rows: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """Per row tile: (expert, first row, end row of its expert) for a static number of tiles
    (cdiv(num_rows, block_m) + experts, an upper bound); unused tiles get expert = E."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    count = pl.cdiv(num_rows, block_m) + e
    i = jnp.arange(count, dtype=jnp.int32)
    expert = jnp.searchsorted(tile_end, i, side="right").astype(jnp.int32)
    safe = jnp.minimum(expert, e - 1)
    first = starts[safe] + (i - (tile_end[safe] - tiles[safe])) * block_m
    return expert, first, ends[safe], count


def _kernel(expert_ref, first_ref, end_ref, x_ref, w_ref, *refs, num_experts: int, block_m: int, block_n: int,
            block_k: int, k_steps: int, quantized: bool):
    from jax.experimental.pallas import triton as plt

    s_ref, o_ref = refs if quantized else (None, refs[0])
    i, j = pl.program_id(0), pl.program_id(1)
    expert, first, end = expert_ref[i], first_ref[i], end_ref[i]
    cols = pl.ds(j * block_n, block_n)
    rows = pl.ds(first, block_m)

    @pl.when(expert < num_experts)
    def _():
        def body(k, acc):
            if quantized:
                half = block_k // 2
                even = x_ref[rows, pl.ds(k * block_k, half)]
                odd = x_ref[rows, pl.ds(k * block_k + half, half)]
                packed = w_ref[expert, pl.ds(k * half, half), cols].astype(jnp.int32)
                scale = s_ref[expert, pl.ds(k, 1), cols].astype(jnp.float32)  # [1, bn]
                low = (((packed & 15) - 8).astype(jnp.float32) * scale).astype(even.dtype)
                high = (((packed >> 4) - 8).astype(jnp.float32) * scale).astype(even.dtype)
                return (acc + jnp.dot(even, low, preferred_element_type=jnp.float32)
                        + jnp.dot(odd, high, preferred_element_type=jnp.float32))
            xk = x_ref[rows, pl.ds(k * block_k, block_k)]
            wk = w_ref[expert, pl.ds(k * block_k, block_k), cols].astype(xk.dtype)
            return acc + jnp.dot(xk, wk, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((block_m, block_n), jnp.float32))
        keep = (first + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)) < end
        # masked: the window's rows past this expert's end belong to the next expert's tile
        plt.store(o_ref.at[rows, cols], acc, mask=keep)


def _split_even_odd(x: jax.Array, group: int) -> jax.Array:
    """Columns of each K group reordered as [even columns | odd columns]."""
    n, k = x.shape
    return x.reshape(n, k // group, group // 2, 2).swapaxes(-1, -2).reshape(n, k)


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *, block_m: int = 16, block_n: int = 32,
                   block_k: int = 32, interpret: bool = False, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Rows x [N, K] sorted by expert @ w[expert] -> float32 [N, Nout] (see the module docstring)."""
    from jax.experimental.pallas import triton as plt

    n, k = x.shape
    quantized = isinstance(w, QArray)
    if quantized:
        if w.qformat.fmt != "int4":
            raise ValueError(f"grouped_matmul takes float or int4 weights for now, not {w.qformat.fmt}")
        block_k = w.qformat.block[0]  # one scale group per K step
        values, scales = w.values, w.scales
        x = _split_even_odd(x, block_k)
    else:
        values, scales = w, None
    e, _, n_out = w.shape if quantized else values.shape
    if k % block_k or n_out % block_n:
        raise ValueError(f"K={k} and Nout={n_out} must be multiples of block_k={block_k} and block_n={block_n}")
    expert, first, end, tiles = tile_plan(group_sizes, n, block_m)
    x = jnp.pad(x, ((0, block_m), (0, 0)))  # a tile's row window never runs off the end
    whole = pl.no_block_spec
    inputs = [expert, first, end, x, values] + ([scales] if quantized else [])
    kernel = functools.partial(_kernel, num_experts=e, block_m=block_m, block_n=block_n, block_k=block_k,
                               k_steps=k // block_k, quantized=quantized)
    out = pl.pallas_call(
        kernel,
        grid=(tiles, n_out // block_n),
        in_specs=[whole] * len(inputs),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((n + block_m, n_out), jnp.float32),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="eagle3_grouped_matmul",
    )(*inputs)
    rows = jnp.arange(n + block_m)[:, None] < jnp.sum(group_sizes)
    return jnp.where(rows, out, 0.0)[:n]


def grouped_matmul_reference(x: jax.Array, w, group_sizes: jax.Array, **_) -> jax.Array:
    """`grouped_matmul` through XLA (`quant.ragged_linear`: dequantize, then ragged_dot)."""
    return ragged_linear(x, w, group_sizes).astype(jnp.float32)
