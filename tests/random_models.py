"""Tiny random targets built straight from the parameter spec (no torch, no files)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.config.model import parse_model_config
from eagle3_jax.models.target import Target, cast_flat
from eagle3_jax.weights import params as params_lib

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
DEEPSEEK = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                max_position_embeddings=256,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
MINIMAX = dict(model_type="minimax_m2", vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, rotary_dim=4, num_local_experts=8,
               num_experts_per_tok=2, max_position_embeddings=256)
FAMILIES = {"llama": LLAMA, "deepseek_v3": DEEPSEEK, "minimax_m2": MINIMAX}


def random_flat(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    flat = {}
    for name, spec in params_lib.flat_specs(cfg).items():
        if len(spec.shape) == 1:
            flat[name] = (1 + 0.1 * rng.standard_normal(spec.shape)).astype(np.float32)
            if name.endswith("router_bias"):
                flat[name] = (0.3 * rng.standard_normal(spec.shape)).astype(np.float32)
        else:
            fan_in = spec.shape[-2] if name != "embed" else spec.shape[-1]
            flat[name] = (rng.standard_normal(spec.shape) * (1.0 / np.sqrt(fan_in))).astype(np.float32)
    return flat


def random_target(raw: dict, dtype=jnp.float32, seed: int = 0, mesh=None) -> Target:
    from eagle3_jax.runtime.sharding import shard_params

    cfg = parse_model_config(raw)
    tree = params_lib.stack_flat(cast_flat(random_flat(cfg, seed), cfg, jnp.dtype(dtype)), cfg)
    params = shard_params(tree, cfg, mesh) if mesh is not None else jax.tree.map(jnp.asarray, tree)
    return Target(config=cfg, params=params, dtype=jnp.dtype(dtype), mesh=mesh)


def draft_config_dict(target_cfg, draft_vocab_size=None, num_layers=1, **extra) -> dict:
    """An EAGLE-3 draft config.json dict sized for `target_cfg`."""
    raw = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=target_cfg.hidden_size,
               intermediate_size=48, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=target_cfg.vocab_size, max_position_embeddings=64, rms_norm_eps=1e-6)
    if draft_vocab_size:
        raw["draft_vocab_size"] = draft_vocab_size
    raw.update(extra)
    return raw


def mla_draft_config_dict(target_cfg, draft_vocab_size=None, num_layers=1, **extra) -> dict:
    """An MLA EAGLE-3 draft config.json dict (`Eagle3DeepseekV2ForCausalLM`) sized for `target_cfg`,
    with the DeepSeek YaRN rotary of random_models.DEEPSEEK."""
    raw = dict(architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="deepseek_v3",
               hidden_size=target_cfg.hidden_size, intermediate_size=48, num_hidden_layers=num_layers,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=4, v_head_dim=8, vocab_size=target_cfg.vocab_size, max_position_embeddings=64,
               rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=dict(DEEPSEEK["rope_scaling"]))
    if draft_vocab_size:
        raw["draft_vocab_size"] = draft_vocab_size
    raw.update(extra)
    return {k: v for k, v in raw.items() if v is not None or k == "q_lora_rank"}


def random_draft(target: Target, raw: dict | None = None, seed: int = 1, with_embed: bool = True, d2t=None):
    """A random EAGLE-3 draft bound to `target` (d2t: offsets when the draft vocab is reduced)."""
    from eagle3_jax.models.draft import Draft, _assemble, draft_specs, parse_draft_config

    cfg = parse_draft_config(raw or draft_config_dict(target.config))
    rng = np.random.default_rng(seed)
    flat = {}
    for name, spec in draft_specs(cfg, with_embed).items():
        if len(spec.shape) == 1:
            flat[name] = (1 + 0.1 * rng.standard_normal(spec.shape)).astype(np.float32)
        else:
            fan_in = spec.shape[-2] if name != "embed" else spec.shape[-1]
            flat[name] = (rng.standard_normal(spec.shape) / np.sqrt(fan_in)).astype(np.float32)
    if cfg.has_draft_vocab:
        flat["d2t"] = np.asarray(d2t if d2t is not None else np.zeros(cfg.draft_vocab_size), np.int64)
    return Draft(config=cfg, params=_assemble(flat, cfg, target.dtype, target), dtype=target.dtype, target=target)


def causal_draft_pass(draft, hidden_in, tokens, pad_to: int = 16):
    """Plain causal draft pass over one sequence of (hidden, next-token) pairs -> (logits, hidden) at every
    position: no scratch slots, no tree masks (the reference that tree expansion and TTT must match).

    The pairs are padded to `pad_to` (a causal pass: padding after a position never changes it), so
    one compiled program serves every length."""
    t = len(tokens)
    pad = max(pad_to, t)
    hidden = jnp.zeros((pad, draft.config.hidden_size), jnp.float32).at[:t].set(jnp.stack(hidden_in))
    ids = jnp.zeros((pad,), jnp.int32).at[:t].set(jnp.asarray(tokens, jnp.int32))
    logits, out = _jitted_causal_pass(draft.params, draft.config, hidden[None], ids[None])
    return logits[0, :t], out[0, :t]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _jitted_causal_pass(params, cfg, hidden, ids):
    from eagle3_jax.cache import kv_cache
    from eagle3_jax.models.draft import draft_forward

    t = ids.shape[1]
    cache = kv_cache.init_cache(cfg.layers, 1, t, jnp.float32)
    visible = kv_cache.Visible(cache.lengths, kv_cache.causal_mask(1, t))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    logits, out, _ = draft_forward(params, cfg, params["embed"][ids], hidden.astype(params["embed"].dtype), pos, cache,
                                   visible)
    return logits, out
