"""Attention over the KV cache: GQA (Llama, MiniMax-M2) and MLA (DeepSeek-V3 / Kimi).

Each block projects the new tokens, writes their K/V (or MLA latents) into the stacked cache at
`layer`, then attends over the cache slots each new token sees (`kv_cache.Visible`: a prefix of
committed slots plus a window, e.g. a tree's ancestors). Scores and softmax run in float32; a long
cache is walked a block of slots at a time (blockwise.py), so the XLA path's temporaries stay one
block's whatever the context.

When `cfg.kernels` picks the kernel for attention (see runtime/kernels.py), decode and verify (up
to KERNEL_MAX_TOKENS new tokens) attend in two parts merged by their log-sum-exp: the committed
prefix through the paged Triton kernel (pallas_kernels/triton_attention.py, which reads only the
pages below each row's length) and a small window of slots after it through the tree mask, a [T, W] problem done
here (W = T for the target's verify: the new tokens themselves). Prefill chunks keep the XLA path.

MLA has two mathematically equal forms over the same latent cache:
- expanded (prefill, many queries): per-head K/V = kv_b_proj(c_kv) for every slot;
- absorbed (decode / verify, few queries): W_UK is folded into q, so scores are q_lat . c_kv, and
  W_UV is applied after attention; nothing per-head is materialised per slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import launch, triton_call  # the table and launcher: the kernel loads when its path runs
from pallas_kernels.attention import Fp8Scales, merge_partials

from ..cache import kv_cache
from ..config.model import ModelConfig
from ..runtime import kernels
from ..weights.quant import PRECISION, dequantize, linear
from .blockwise import attend
from .layers import apply_rotary, rms_norm, rotary_cos_sin


def gqa_project(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, H] -> roped q [B, T, heads, d], roped k and v [B, T, kv_heads, d]."""
    b, t, _ = x.shape
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = linear(x, p["q_proj"]), linear(x, p["k_proj"]), linear(x, p["v_proj"])
    if cfg.qk_norm:  # MiniMax-M2: one RMSNorm over the whole projected vector, before rotary
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q, k, v = q.reshape(b, t, nh, d), k.reshape(b, t, nkv, d), v.reshape(b, t, nkv, d)
    cos, sin = rotary_cos_sin(cfg.rope, positions)
    return apply_rotary(q, cos, sin, cfg.rope), apply_rotary(k, cos, sin, cfg.rope), v


KERNEL_MAX_TOKENS = 64  # new tokens per row up to which the kernel path is used (decode, verify)


def _uses_kernel(cfg: ModelConfig, t: int, cache: kv_cache.KVCache) -> bool:
    return (kernels.runs_kernel(cfg.kernels, f"{cfg.attention}_attention")
            and t <= KERNEL_MAX_TOKENS
            and not kernels.splits_attention(jax.sharding.get_abstract_mesh())  # no sharded form yet
            and _kernel_walks(cfg, cache)
            and _kernel_takes(cache.read_dtype))


def _kernel_walks(cfg: ModelConfig, cache: kv_cache.KVCache) -> bool:
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


def _kernel_takes(cache_dtype) -> bool:
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


def _tree_partial(scores: jax.Array, tree_mask: jax.Array, values: jax.Array, spec: str) -> tuple[jax.Array, jax.Array]:
    """Softmax partial of the new tokens among themselves: scores [B, G, T, T] (already scaled,
    float32), tree_mask [B, T, T]; returns (out, lse) with out = einsum(spec, probs, values)."""
    visible = tree_mask[:, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # finite: every node sees itself
    probs = jnp.exp(scores - lse[..., None])
    return jnp.einsum(spec, probs.astype(values.dtype), values, preferred_element_type=jnp.float32, precision=PRECISION), lse


def _as_cached(cache: kv_cache.KVCache, x: jax.Array) -> jax.Array:
    """New tokens' K/V as the cache returns them once written: in its read dtype, and through its
    float8 quantization for FP8 pages (so the kernel path sees what the XLA path reads back)."""
    if not cache.fp8:
        return x.astype(cache.k.dtype)
    return kv_cache.dequantize(kv_cache.quantize(x, cache.k.values.dtype), cache.read_dtype)


def _prefix_partial(cache: kv_cache.KVCache, layer, q, q2, scale: float, value_pool: bool):
    from pallas_kernels.triton_attention import paged_prefix_attention

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
    return paged_prefix_attention(q, k_pool, v_pool if value_pool else None, layer, table, cache.lengths, scale=scale,
                                  q2=q2, k2_pool=None if q2 is None else v_pool, scales=scales)


def _gqa_kernel_attention(cfg: ModelConfig, q, k, v, cache, layer, tree_mask) -> jax.Array:
    """GQA decode / verify through the prefix kernel (slots < cache.lengths) + the tree part (k, v
    [B, W, kv, d]: the W window slots from cache.lengths on, as the cache returns them, tree_mask
    [B, T, W]); [B, T, heads * d]."""

    b, t, nh, d = q.shape
    nkv, g = cfg.num_kv_heads, nh // cfg.num_kv_heads
    scale = d ** -0.5
    qg = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, kv, g, T, d]
    out_a, lse_a = _prefix_partial(cache, layer, qg.reshape(b, nkv, g * t, d).astype(cache.read_dtype), None, scale, True)
    kn, vn = k, v
    scores = jnp.einsum("bkgtd,bjkd->bkgtj", qg, kn, preferred_element_type=jnp.float32, precision=PRECISION) * scale
    out_b, lse_b = _tree_partial(scores.reshape(b, nkv * g, t, kn.shape[1]), tree_mask,
                                 jnp.repeat(vn, g, axis=2), "bhtj,bjhd->bhtd")
    out = merge_partials(out_a.reshape(b, nkv * g, t, d), lse_a.reshape(b, nkv * g, t), out_b, lse_b)
    return out.transpose(0, 2, 1, 3).reshape(b, t, nh * d).astype(q.dtype)


def gqa_block(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, cache: kv_cache.KVCache,
              layer: jax.Array, visible: kv_cache.Visible) -> tuple[jax.Array, kv_cache.KVCache]:
    """x [B, T, H] -> attention output [B, T, H]; K/V of the T tokens written to the cache at its
    lengths. `visible`: the slots each new token sees. The target's verify has its window on the
    new tokens themselves; the draft's tree expansion a window of scratch slots written by
    earlier levels (`visible.window_is_new` False)."""
    b, t, _ = x.shape
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = gqa_project(p, cfg, x, positions)

    if _uses_kernel(cfg, t, cache):
        prefix = cache.replace(lengths=visible.prefix)
        if visible.window_is_new:  # the window is the new tokens: use them as computed
            out = _gqa_kernel_attention(cfg, q, _as_cached(cache, k), _as_cached(cache, v), prefix, layer, visible.window)
            return linear(out, p["o_proj"]), kv_cache.write(cache, layer, k, v)
        cache = kv_cache.write(cache, layer, k, v)
        window = visible.prefix[:, None] + jnp.arange(visible.window.shape[-1], dtype=jnp.int32)[None, :]
        kw, vw = kv_cache.read_slots(cache, layer, window)
        out = _gqa_kernel_attention(cfg, q, kw, vw, prefix, layer, visible.window)
        return linear(out, p["o_proj"]), cache
    cache = kv_cache.write(cache, layer, k, v)
    qg = q.reshape(b, t, nkv, nh // nkv, d)

    def scores_of(keys, values):  # keys [B, n, nkv, d]
        return jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32,
                          precision=PRECISION) * (d ** -0.5)

    def mix(probs, keys, values):
        return jnp.einsum("bkgts,bskd->bkgtd", probs.astype(values.dtype), values, precision=PRECISION)

    out = attend(cache, layer, visible, scores_of, mix, nh).transpose(0, 3, 1, 2, 4).astype(q.dtype)
    return linear(out.reshape(b, t, nh * d), p["o_proj"]), cache


def _mla_query(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    if cfg.q_lora_rank is None:
        return linear(x, p["q_proj"])
    return linear(rms_norm(linear(x, p["q_a_proj"]), p["q_a_norm"], cfg.rms_norm_eps), p["q_b_proj"])


def _mla_kernel_attention(cfg: ModelConfig, q_lat, q_pe, c_kv, k_pe, cache, layer, tree_mask) -> jax.Array:
    """Absorbed MLA decode / verify through the prefix kernel + the tree part (c_kv, k_pe: the window
    slots' latents and rope keys as the cache returns them): out_lat [B, T, heads, r]."""

    b, t, nh, r = q_lat.shape
    dt = cache.read_dtype
    rows = lambda a: a.transpose(0, 2, 1, 3).reshape(b, 1, nh * t, a.shape[-1]).astype(dt)  # noqa: E731
    out_a, lse_a = _prefix_partial(cache, layer, rows(q_lat), rows(q_pe), cfg.softmax_scale, False)
    lat_new, rope_new = c_kv, k_pe
    f32 = dict(preferred_element_type=jnp.float32, precision=PRECISION)
    scores = (jnp.einsum("bthr,bjr->bhtj", q_lat.astype(dt), lat_new, **f32)
              + jnp.einsum("bthd,bjd->bhtj", q_pe.astype(dt), rope_new, **f32))
    out_b, lse_b = _tree_partial(scores * cfg.softmax_scale, tree_mask, lat_new, "bhtj,bjr->bhtr")
    out = merge_partials(out_a.reshape(b, nh, t, r), lse_a.reshape(b, nh, t), out_b, lse_b)
    return out.transpose(0, 2, 1, 3).astype(q_lat.dtype)


def mla_project(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [B, T, W] -> q_nope [B, T, heads, nope], roped q_pe [B, T, heads, rope], the normalised
    latent c_kv [B, T, kv_lora] and the roped shared key k_pe [B, T, rope] (what the cache holds).

    W is whatever width the projections read: hidden_size in the target, 2 x hidden_size in an
    EAGLE-3 draft's first layer."""
    b, t, _ = x.shape
    nh, dn, dr, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q = _mla_query(p, cfg, x).reshape(b, t, nh, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kv_a = linear(x, p["kv_a_proj"])
    c_kv = rms_norm(kv_a[..., :r], p["kv_a_norm"], cfg.rms_norm_eps)
    k_pe = kv_a[..., r:][:, :, None, :]  # one rope key shared by all heads
    cos, sin = rotary_cos_sin(cfg.rope, positions)
    q_pe, k_pe = apply_rotary(q_pe, cos, sin, cfg.rope), apply_rotary(k_pe, cos, sin, cfg.rope)[:, :, 0]
    return q_nope, q_pe, c_kv, k_pe


def mla_up_projections(p: dict, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """kv_b_proj split per head: W_UK [kv_lora, heads, nope] (latent -> nope keys) and W_UV
    [kv_lora, heads, v] (latent -> values)."""
    dn = cfg.qk_nope_head_dim
    kv_b = dequantize(p["kv_b_proj"], dtype).reshape(cfg.kv_lora_rank, cfg.num_heads, dn + cfg.v_head_dim)
    return kv_b[..., :dn], kv_b[..., dn:]


def mla_block(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, cache: kv_cache.KVCache,
              layer: jax.Array, visible: kv_cache.Visible, absorb: bool) -> tuple[jax.Array, kv_cache.KVCache]:
    """Multi-head latent attention; caches kv_a_layernorm(c_kv) and the roped k_pe only.

    `visible` as in gqa_block (the kernel path needs the absorbed form)."""
    b, t, _ = x.shape
    nh, dv = cfg.num_heads, cfg.v_head_dim
    q_nope, q_pe, c_kv, k_pe = mla_project(p, cfg, x, positions)
    w_uk, w_uv = mla_up_projections(p, cfg, x.dtype)  # [r, nh, dn], [r, nh, dv]
    if absorb and _uses_kernel(cfg, t, cache):
        q_lat = jnp.einsum("bthd,rhd->bthr", q_nope, w_uk, precision=PRECISION)
        prefix = cache.replace(lengths=visible.prefix)
        if visible.window_is_new:  # the window is the new tokens: use them as computed
            out_lat = _mla_kernel_attention(cfg, q_lat, q_pe, _as_cached(cache, c_kv), _as_cached(cache, k_pe), prefix,
                                            layer, visible.window)
            cache = kv_cache.write(cache, layer, c_kv, k_pe)
        else:  # the draft's tree expansion: the window is scratch slots written by earlier levels and this one
            cache = kv_cache.write(cache, layer, c_kv, k_pe)
            window = visible.prefix[:, None] + jnp.arange(visible.window.shape[-1], dtype=jnp.int32)[None, :]
            lat_w, pe_w = kv_cache.read_slots(cache, layer, window)
            out_lat = _mla_kernel_attention(cfg, q_lat, q_pe, lat_w, pe_w, prefix, layer, visible.window)
        out = jnp.einsum("bthr,rhd->bthd", out_lat, w_uv, precision=PRECISION)
        return linear(out.reshape(b, t, nh * dv), p["o_proj"]), cache

    cache = kv_cache.write(cache, layer, c_kv, k_pe)
    f32 = dict(preferred_element_type=jnp.float32, precision=PRECISION)

    def rope_scores(rope_keys):  # [B, n, dr]
        return jnp.einsum("bthd,bsd->bhts", q_pe, rope_keys, **f32)

    if absorb:
        q_lat = jnp.einsum("bthd,rhd->bthr", q_nope, w_uk, precision=PRECISION)

        def scores_of(latents, rope_keys):  # latents [B, n, r]
            return (jnp.einsum("bthr,bsr->bhts", q_lat, latents, **f32) + rope_scores(rope_keys)) * cfg.softmax_scale

        def mix(probs, latents, rope_keys):
            return jnp.einsum("bhts,bsr->bhtr", probs.astype(latents.dtype), latents, precision=PRECISION)

        out_lat = attend(cache, layer, visible, scores_of, mix, nh).transpose(0, 2, 1, 3).astype(q_lat.dtype)
        out = jnp.einsum("bthr,rhd->bthd", out_lat, w_uv, precision=PRECISION)
    else:
        def scores_of(latents, rope_keys):
            k_nope = jnp.einsum("bsr,rhd->bshd", latents, w_uk, precision=PRECISION)
            return (jnp.einsum("bthd,bshd->bhts", q_nope, k_nope, **f32) + rope_scores(rope_keys)) * cfg.softmax_scale

        def mix(probs, latents, rope_keys):
            values = jnp.einsum("bsr,rhd->bshd", latents, w_uv, precision=PRECISION)
            return jnp.einsum("bhts,bshd->bhtd", probs.astype(values.dtype), values, precision=PRECISION)

        out = attend(cache, layer, visible, scores_of, mix, nh).transpose(0, 2, 1, 3).astype(q_nope.dtype)
    return linear(out.reshape(b, t, nh * dv), p["o_proj"]), cache
