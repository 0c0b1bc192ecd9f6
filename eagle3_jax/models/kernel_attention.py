"""Decode and verify attention through the paged prefix kernel, on one device or a mesh.

The T new tokens of a step (T <= KERNEL_MAX_TOKENS) attend in two parts merged by their
log-sum-exp: the committed prefix through the Triton kernel (pallas_kernels/triton_attention.py,
which reads only the pages below each row's length) and a small window of slots after it through
the tree mask, a [T, W] problem done in XLA (W = T for the target's verify: the new tokens
themselves).

On a mesh the kernel runs under `shard_map` over every mesh axis, so each device launches it on
what it holds and nothing is gathered for it:
- `data` (data-parallel attention): each shard its own rows, over its own pages (a paged cache
  split over the data shards, `kv_cache.on_data_shards`; a dense cache's rows, viewed as pages, are
  split the same way). A row spread over the shards (context parallelism, cache/spread.py) is
  attended on every shard over the pages that shard holds, the others masked out of its block table
  (-1 entries the kernel never reads), and the partials are merged across the shards by their
  log-sum-exp, as the kernel merges its own KV splits.
- `tensor` (tensor-parallel attention): each shard its own query heads. GQA pools split their KV
  heads the same way (the sharding rules put `kv_heads` on `tensor` where it divides); MLA's latent
  pool is whole on every shard and each shard's rows are its heads x T. Where the heads do not
  divide over `tensor` (GQA with fewer KV heads than tensor shards), every tensor shard computes
  all heads: the same result, without the saving.
- `expert` replicates attention: each shard computes the same rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import launch, triton_call  # the table and launcher: the kernel loads when its path runs
from pallas_kernels.attention import Fp8Scales, merge_partials

from ..cache import kv_cache, spread
from ..config.model import ModelConfig
from ..runtime import kernels
from ..weights.quant import PRECISION

KERNEL_MAX_TOKENS = 64  # new tokens per row up to which the kernel path is used (decode, verify)


def uses_kernel(cfg: ModelConfig, t: int, cache: kv_cache.KVCache) -> bool:
    """Whether attention of `t` new tokens over `cache` runs the prefix kernel."""
    return (kernels.runs_kernel(cfg.kernels, f"{cfg.attention}_attention")
            and t <= KERNEL_MAX_TOKENS
            and kernel_walks(cfg, cache)
            and kernel_takes(cache.read_dtype))


def kernel_walks(cfg: ModelConfig, cache: kv_cache.KVCache) -> bool:
    """Whether the prefix kernel can walk this cache's pages (a dense cache is viewed as pages of
    16 slots when its length allows, else as one page per row, which a GPU kernel cannot tile);
    interpreted, any page size runs (each page a step, masked within its power-of-two block)."""
    page_size = kv_cache.viewed_page_size(cache)
    if triton_call.interpreted() or launch.launch(f"{cfg.attention}_attention").walks(page_size):
        return True
    kernels.warn_once(f"attention keeps its XLA path for a cache of {page_size}-slot pages: the kernel walks "
                      "pages of a multiple of 16 slots or one power-of-two page of at least 16 (a dense cache's length "
                      "must be one)")
    return False


def kernel_takes(cache_dtype) -> bool:
    """Whether the prefix kernel runs at this cache dtype on the architecture traced for. Compiled
    for a GPU, float32 attention (IEEE float32 dots, twice the registers a row) spills at the
    table's launches (MLA's 512-wide latent on gfx942, gfx950 and sm_90, GQA's 32-row tiles on
    sm_90: the compile gate's figures), so float32 caches keep the XLA path on GPUs, with a
    warning; bfloat16, the serving dtype, runs the kernel. Interpreted (a CPU host), any dtype."""
    arch = launch.ARCHS.get(launch.current_arch())
    if arch is None or jnp.dtype(cache_dtype).itemsize < 4:
        return True
    kernels.warn_once(f"attention keeps its XLA path for {jnp.dtype(cache_dtype).name} caches on {arch.name} "
                      "(the Triton kernel spills there); bfloat16 caches run the kernel")
    return False


def as_cached(cache: kv_cache.KVCache, x: jax.Array) -> jax.Array:
    """New tokens' K/V as the cache returns them once written: in its read dtype, and through its
    float8 quantization for FP8 pages (so the kernel path sees what the XLA path reads back)."""
    if not cache.fp8:
        return x.astype(cache.k.dtype)
    return kv_cache.dequantize(kv_cache.quantize(x, cache.k.values.dtype), cache.read_dtype)


# ---- the prefix part ------------------------------------------------------------------------------


def _kernel_pools(cache: kv_cache.KVCache, value_pool: bool):
    """(k pool, v pool or None, second key pool or None, Fp8Scales or None, block table) of a cache
    as the kernel reads them: pools [L, pages, page_size, heads, lanes] (MLA's latent and rope key
    as one shared "head"), FP8 pools as their bits."""
    k_pool, v_pool, table = kv_cache.as_pages(cache)
    scales = None
    if cache.fp8:  # the kernel decodes the float8 bits in registers, beside their scales
        fnuz = k_pool.values.dtype == jnp.float8_e4m3fnuz
        bits = lambda pool: jax.lax.bitcast_convert_type(pool.values, jnp.uint8)  # noqa: E731
        (k_pool, k_scales), (v_pool, v_scales) = (bits(k_pool), k_pool.scales), (bits(v_pool), v_pool.scales)
    if k_pool.ndim == 4:  # MLA pools [L, pages, ps, r]: one shared "head"
        k_pool, v_pool = k_pool[:, :, :, None], v_pool[:, :, :, None]
        if cache.fp8:
            k_scales, v_scales = k_scales[:, :, :, None], v_scales[:, :, :, None]
    if cache.fp8:
        scales = Fp8Scales(k_scales, v_scales if value_pool else None, None if value_pool else v_scales, fnuz)
    if value_pool:
        return k_pool, v_pool, None, scales, table
    return k_pool, None, v_pool, scales, table


def _local_prefix(layer, table, lengths, q, q2, k_pool, v_pool, k2_pool, scales, scale: float, starts=None):
    """The kernel on arrays one device holds: q [b, Hq, T, D] (query heads in KV-head order),
    pools with h KV heads (Hq / h query heads each) -> out [b, Hq, T, Dv], lse [b, Hq, T]."""
    from pallas_kernels.triton_attention import paged_prefix_attention

    b, hq, t, _ = q.shape
    h = k_pool.shape[3]

    def rows(x):  # [b, Hq, T, D] -> [b, h, Hq / h * T, D]: a KV head's query heads x T tokens
        return None if x is None else x.reshape(b, h, (hq // h) * t, x.shape[-1])

    out, lse = paged_prefix_attention(rows(q), k_pool, v_pool, layer, table, lengths, scale=scale, q2=rows(q2),
                                      k2_pool=k2_pool, scales=scales, starts=starts)
    return out.reshape(b, hq, t, out.shape[-1]), lse.reshape(b, hq, t)


def _mesh_axes(mesh, cache: kv_cache.KVCache, q: jax.Array, kv_heads: int) -> tuple[str | None, str | None]:
    """The mesh axes (or None) that split the rows and the heads of the kernel's launch (see the
    module docstring). A paged cache splits rows over `data` exactly when its pages are split over
    the data shards; a dense one when its batch divides over them."""
    data, tensor = mesh.shape.get("data", 1), mesh.shape.get("tensor", 1)
    rows = None
    if cache.paged and cache.data_shards > 1:
        rows = "data"
    elif not cache.paged and data > 1 and q.shape[0] % data == 0:
        rows = "data"
    heads = "tensor" if tensor > 1 and q.shape[1] % tensor == 0 and (kv_heads == 1 or kv_heads % tensor == 0) else None
    return rows, heads


def _held_pages(table: jax.Array, n_local: int) -> jax.Array:
    """Inside the shard_map over `data`: the block table with this shard's pages as local ids and
    every other shard's as -1, which the kernel masks out (a spread row's pages on other shards)."""
    local, here = kv_cache.local_pages(table, n_local)
    return jnp.where(here, local, -1)


def prefix_partial(cache: kv_cache.KVCache, layer, q: jax.Array, q2: jax.Array | None, scale: float,
                   value_pool: bool, starts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of q [B, Hq, T, D] (query heads in KV-head order; q2 the second score term, MLA's
    rope part) over each row's committed prefix (slots < cache.lengths) through the kernel, on this
    device or sharded over the mesh traced under (module docstring): out [B, Hq, T, Dv] float32,
    normalised over the prefix, and lse [B, Hq, T] (-inf where a row's prefix is empty).
    `value_pool`: GQA's separate value pool; else the values are the latent keys (MLA). `starts`
    [B, T]: a sliding window's first slot per token (`kv_cache.Visible.start`)."""
    k_pool, v_pool, k2_pool, scales, table = _kernel_pools(cache, value_pool)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return _local_prefix(layer, table, cache.lengths, q, q2, k_pool, v_pool, k2_pool, scales, scale, starts)
    rows, heads = _mesh_axes(mesh, cache, q, k_pool.shape[3])
    pool_spec = P(None, rows, None, None if k_pool.shape[3] == 1 else heads, None)
    q_spec = P(rows, heads, None, None)
    n_local = k_pool.shape[1] // (mesh.shape["data"] if rows else 1)
    fnuz = scales is not None and scales.fnuz
    arrays = {"q": q, "q2": q2, "k_pool": k_pool, "v_pool": v_pool, "k2_pool": k2_pool,
              "k_scales": None if scales is None else scales.k, "v_scales": None if scales is None else scales.v,
              "k2_scales": None if scales is None else scales.k2, "starts": starts}
    arrays = {name: x for name, x in arrays.items() if x is not None}
    specs = {name: q_spec if name.startswith("q") else P(rows, None) if name == "starts" else pool_spec
             for name in arrays}

    def body(layer, table, lengths, arrays):
        get = arrays.get
        local_scales = None if scales is None else Fp8Scales(get("k_scales"), get("v_scales"), get("k2_scales"), fnuz)
        if rows:
            table = _held_pages(table, n_local)
        return _local_prefix(layer, table, lengths, get("q"), get("q2"), get("k_pool"), get("v_pool"), get("k2_pool"),
                             local_scales, scale, get("starts"))

    out, lse = jax.shard_map(body, mesh=mesh, axis_names=set(mesh.axis_names), check_vma=False,
                             in_specs=(P(), P(rows), P(rows), specs), out_specs=(q_spec, P(rows, heads, None)))(
        jnp.asarray(layer, jnp.int32), table, cache.lengths, arrays)
    if rows and cache.spread is not None:  # spread rows: each shard saw its own pages; merge them
        out, lse = spread.merge_partials(out, jnp.maximum(lse, -1e30), cache.spread, cache.data_shards)
    return out, lse


# ---- the window part and the whole ------------------------------------------------------------------


def _tree_partial(scores: jax.Array, tree_mask: jax.Array, values: jax.Array, spec: str) -> tuple[jax.Array, jax.Array]:
    """Softmax partial of the new tokens among themselves: scores [B, G, T, T] (already scaled,
    float32), tree_mask [B, T, T]; returns (out, lse) with out = einsum(spec, probs, values)."""
    visible = tree_mask[:, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # finite: every node sees itself
    probs = jnp.exp(scores - lse[..., None])
    return jnp.einsum(spec, probs.astype(values.dtype), values, preferred_element_type=jnp.float32, precision=PRECISION), lse


def gqa_attention(cfg: ModelConfig, q, k, v, cache, layer, tree_mask, starts=None) -> jax.Array:
    """GQA decode / verify: q [B, T, heads, d] over the prefix (slots < cache.lengths) through the
    kernel and the window (k, v [B, W, kv, d]: the W slots from cache.lengths on, as the cache
    returns them; tree_mask [B, T, W], a sliding window's bound already in it); [B, T, heads * d].
    `starts` [B, T]: a sliding window's first slot per token."""
    b, t, nh, d = q.shape
    nkv, g = cfg.num_kv_heads, nh // cfg.num_kv_heads
    scale = d ** -0.5
    out_a, lse_a = prefix_partial(cache, layer, q.transpose(0, 2, 1, 3).astype(cache.read_dtype), None, scale, True,
                                  starts)
    qg = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, kv, g, T, d]
    scores = jnp.einsum("bkgtd,bjkd->bkgtj", qg, k, preferred_element_type=jnp.float32, precision=PRECISION) * scale
    out_b, lse_b = _tree_partial(scores.reshape(b, nh, t, k.shape[1]), tree_mask, jnp.repeat(v, g, axis=2),
                                 "bhtj,bjhd->bhtd")
    out = merge_partials(out_a, lse_a, out_b, lse_b)
    return out.transpose(0, 2, 1, 3).reshape(b, t, nh * d).astype(q.dtype)


def mla_attention(cfg: ModelConfig, q_lat, q_pe, c_kv, k_pe, cache, layer, tree_mask, starts=None) -> jax.Array:
    """Absorbed MLA decode / verify: q_lat [B, T, heads, r], q_pe [B, T, heads, dr] over the prefix
    through the kernel and the window (c_kv, k_pe: its slots' latents and rope keys as the cache
    returns them; tree_mask and `starts` as in gqa_attention); out_lat [B, T, heads, r]."""
    dt = cache.read_dtype
    heads_first = lambda a: a.transpose(0, 2, 1, 3).astype(dt)  # noqa: E731
    out_a, lse_a = prefix_partial(cache, layer, heads_first(q_lat), heads_first(q_pe), cfg.softmax_scale, False, starts)
    f32 = dict(preferred_element_type=jnp.float32, precision=PRECISION)
    scores = (jnp.einsum("bthr,bjr->bhtj", q_lat.astype(dt), c_kv, **f32)
              + jnp.einsum("bthd,bjd->bhtj", q_pe.astype(dt), k_pe, **f32))
    out_b, lse_b = _tree_partial(scores * cfg.softmax_scale, tree_mask, c_kv, "bhtj,bjr->bhtr")
    out = merge_partials(out_a, lse_a, out_b, lse_b)
    return out.transpose(0, 2, 1, 3).astype(q_lat.dtype)
