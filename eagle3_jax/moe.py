"""Mixture-of-experts: routers and routed-expert compute.

Routers run in float32. `noaux_tc` (DeepSeek-V3 / Kimi) and MiniMax-M2 score experts with a
sigmoid; the correction bias shifts *which* experts are chosen but the combine weights are the
unbiased scores of the chosen ones, normalised, times `routed_scaling_factor`. DeepSeek first keeps
the `topk_group` best groups (a group's score is the sum of its two best biased scores).

Expert compute has two forms, chosen from the static shapes:
- few assignments (2 x tokens x top-k <= experts: small decode steps): gather each assignment's
  expert matrices and run small batched matmuls, reading only the experts actually chosen;
- many assignments (prefill): sort them by expert and run three grouped matmuls
  (`lax.ragged_dot`), so each token only pays for its own top-k experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers import swiglu


def route(logits: jax.Array, bias: jax.Array | None, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] float32 -> (combine weights [N, k] float32, expert ids [N, k] int32)."""
    k = cfg.num_experts_per_tok
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        n, e = choice.shape
        grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, e // cfg.n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids.astype(jnp.int32)


def routed_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array) -> jax.Array:
    """x [N, H]; weights/ids [N, k]; expert weights [E, H, I], [E, H, I], [E, I, H] -> [N, H]."""
    n, k = ids.shape
    num_experts = w_gate.shape[0]
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k
    xs = x[token_of]
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, group_sizes)) * jax.lax.ragged_dot(xs, w_up, group_sizes)
    y = jax.lax.ragged_dot(h, w_down, group_sizes)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(y).astype(x.dtype)


def gathered_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                     w_down: jax.Array) -> jax.Array:
    """Same result as `routed_experts`, computed per assignment on gathered expert weights."""
    h = jax.nn.silu(jnp.einsum("nh,nkhi->nki", x, w_gate[ids])) * jnp.einsum("nh,nkhi->nki", x, w_up[ids])
    y = jnp.einsum("nki,nkih->nkh", h, w_down[ids]).astype(jnp.float32)
    return jnp.einsum("nkh,nk->nh", y, weights).astype(x.dtype)


def moe_block(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Routed experts (+ shared experts when the model has them) for x [B, T, H]."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    logits = jnp.dot(flat.astype(jnp.float32), p["router"], preferred_element_type=jnp.float32)
    weights, ids = route(logits, p.get("router_bias"), cfg)
    experts = gathered_experts if 2 * ids.size <= cfg.num_experts else routed_experts
    out = experts(flat, weights, ids, p["experts_gate"], p["experts_up"], p["experts_down"])
    if "shared_gate" in p:
        out = out + swiglu(flat, p["shared_gate"], p["shared_up"], p["shared_down"])
    return out.reshape(shape)
