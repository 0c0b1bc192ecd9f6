"""Attention over the KV cache: GQA (Llama, MiniMax-M2) and MLA (DeepSeek-V3 / Kimi).

Each block projects the new tokens, writes their K/V (or MLA latents) into the stacked cache at
`layer`, then attends over the cache slots each new token sees (`kv_cache.Visible`: a prefix of
committed slots plus a window, e.g. a tree's ancestors). Scores and softmax run in float32; a long
cache is walked a block of slots at a time (blockwise.py), so the XLA path's temporaries stay one
block's whatever the context.

When `cfg.kernels` picks the kernel for attention (see runtime/kernels.py), decode and verify (up
to KERNEL_MAX_TOKENS new tokens) attend through the paged Triton kernel over the committed prefix
and XLA over the new tokens' window (kernel_attention.py, on one device or sharded over a mesh).
Prefill chunks keep the XLA path.

MLA has two mathematically equal forms over the same latent cache:
- expanded (prefill, many queries): per-head K/V = kv_b_proj(c_kv) for every slot;
- absorbed (decode / verify, few queries): W_UK is folded into q, so scores are q_lat . c_kv, and
  W_UV is applied after attention; nothing per-head is materialised per slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..cache import kv_cache
from ..config.model import ModelConfig
from ..weights.quant import PRECISION, dequantize, linear
from .blockwise import attend
from .kernel_attention import KERNEL_MAX_TOKENS, as_cached, gqa_attention, mla_attention, uses_kernel  # noqa: F401 (re-exported)
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


def gqa_block(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, cache: kv_cache.KVCache,
              layer: jax.Array, visible: kv_cache.Visible) -> tuple[jax.Array, kv_cache.KVCache]:
    """x [B, T, H] -> attention output [B, T, H]; K/V of the T tokens written to the cache at its
    lengths. `visible`: the slots each new token sees. The target's verify has its window on the
    new tokens themselves; the draft's tree expansion a window of scratch slots written by
    earlier levels (`visible.window_is_new` False)."""
    b, t, _ = x.shape
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = gqa_project(p, cfg, x, positions)

    if uses_kernel(cfg, t, cache):
        prefix = cache.replace(lengths=visible.prefix)
        if visible.window_is_new:  # the window is the new tokens: use them as computed
            out = gqa_attention(cfg, q, as_cached(cache, k), as_cached(cache, v), prefix, layer, visible.window_seen(),
                                visible.start)
            return linear(out, p["o_proj"]), kv_cache.write(cache, layer, k, v)
        cache = kv_cache.write(cache, layer, k, v)
        window = visible.prefix[:, None] + jnp.arange(visible.window.shape[-1], dtype=jnp.int32)[None, :]
        kw, vw = kv_cache.read_slots(cache, layer, window)
        out = gqa_attention(cfg, q, kw, vw, prefix, layer, visible.window_seen(), visible.start)
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
    if absorb and uses_kernel(cfg, t, cache):
        q_lat = jnp.einsum("bthd,rhd->bthr", q_nope, w_uk, precision=PRECISION)
        prefix = cache.replace(lengths=visible.prefix)
        if visible.window_is_new:  # the window is the new tokens: use them as computed
            out_lat = mla_attention(cfg, q_lat, q_pe, as_cached(cache, c_kv), as_cached(cache, k_pe), prefix,
                                    layer, visible.window_seen(), visible.start)
            cache = kv_cache.write(cache, layer, c_kv, k_pe)
        else:  # the draft's tree expansion: the window is scratch slots written by earlier levels and this one
            cache = kv_cache.write(cache, layer, c_kv, k_pe)
            window = visible.prefix[:, None] + jnp.arange(visible.window.shape[-1], dtype=jnp.int32)[None, :]
            lat_w, pe_w = kv_cache.read_slots(cache, layer, window)
            out_lat = mla_attention(cfg, q_lat, q_pe, lat_w, pe_w, prefix, layer, visible.window_seen(), visible.start)
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
