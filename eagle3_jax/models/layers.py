"""Small building blocks shared by every model: RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..config.model import RopeConfig, yarn_mscale
from ..weights.quant import linear


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to the input dtype before the weight (as HF does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    return linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)


# ---- rotary ---------------------------------------------------------------------------------------


def _default_inv_freq(rope: RopeConfig) -> np.ndarray:
    exponents = np.arange(0, rope.dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rope.dim)
    return (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)


def _llama3_inv_freq(rope: RopeConfig) -> np.ndarray:
    inv = _default_inv_freq(rope)
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(rope: RopeConfig) -> np.ndarray:
    dim, base = rope.dim, rope.theta

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:  # DeepSeek/HF bound the ramp with floor/ceil, not round
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32)


def rope_attention_factor(rope: RopeConfig) -> float:
    """Scale applied to cos/sin (YaRN only; DeepSeek's mscale_all_dim makes it 1)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


@functools.lru_cache(maxsize=None)
def inv_freq(rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies [dim // 2] for `rope` (matches transformers' ROPE_INIT_FUNCTIONS)."""
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope)
    inv = _default_inv_freq(rope)
    return (inv / rope.factor).astype(np.float32) if rope.rope_type == "linear" else inv


def rotary_cos_sin(rope: RopeConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., dim // 2] in float32 for integer `positions` of any shape.

    Computed from positions on the fly, so no table bounds the usable length.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(rope))
    scale = rope_attention_factor(rope)
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array, rope: RopeConfig) -> jax.Array:
    """Rotate the first `rope.dim` channels of x [..., T, heads, d]; cos/sin [..., T, dim // 2].

    Interleaved (DeepSeek): pairs (x0, x1), (x2, x3)...; the output lists the rotated evens then
    odds (the layout transformers uses; q and k share it, so dot products are unchanged).
    NeoX (Llama, MiniMax): pairs (x_i, x_{i + dim/2}).
    """
    d = rope.dim
    rot, rest = x[..., :d], x[..., d:]
    if rope.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
    c = cos[..., None, :]
    s = sin[..., None, :]
    x1f, x2f = x1.astype(jnp.float32), x2.astype(jnp.float32)
    out = jnp.concatenate([x1f * c - x2f * s, x2f * c + x1f * s], axis=-1).astype(x.dtype)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def final_hidden(params: dict, cfg, x: jax.Array) -> jax.Array:
    """The final norm of a target's last residual `x`: what its LM head reads."""
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def lm_head(params: dict, cfg):
    """A target's LM head [H, V] (the embedding's transpose when they are tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def final_logits(params: dict, cfg, x: jax.Array) -> jax.Array:
    """Final norm + LM head of a target (`params` its tree, `cfg` its ModelConfig): float32 logits."""
    return linear(final_hidden(params, cfg, x), lm_head(params, cfg), out_dtype=jnp.float32)
