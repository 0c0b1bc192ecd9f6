"""Next-token training of a target model (used to build the bundled demo target)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import kv_cache
from ..config.model import ModelConfig
from ..models.target import forward
from ..weights.params import flat_specs, stack_flat, unstack_to_flat


def init_target_flat(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """HF-style initialisation: normal(0, std) matrices, unit norms, zero routing bias (float32)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, spec in flat_specs(cfg).items():
        if name.endswith("router_bias"):
            flat[name] = np.zeros(spec.shape, np.float32)
        elif len(spec.shape) == 1:
            flat[name] = np.ones(spec.shape, np.float32)
        else:
            flat[name] = (rng.standard_normal(spec.shape) * std).astype(np.float32)
    return flat


def init_target_params(cfg: ModelConfig, seed: int = 0) -> dict:
    return stack_flat(init_target_flat(cfg, seed), cfg)


def params_to_flat(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    return unstack_to_flat(jax.device_get(params), cfg)


def lm_loss(params: dict, cfg: ModelConfig, batch: dict) -> tuple[jax.Array, dict]:
    """Mean next-token cross-entropy over positions whose *next* token has loss_mask set."""
    tokens = batch["tokens"]
    b, t = tokens.shape
    cache = kv_cache.init_cache(cfg, b, t, params["final_norm"].dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _, _ = forward(params, cfg, tokens, positions, cache, absorb=False)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = batch["loss_mask"][:, 1:]
    n = jnp.maximum(mask.sum(), 1)
    loss = jnp.sum(jnp.where(mask, nll, 0.0)) / n
    acc = jnp.sum(jnp.where(mask, jnp.argmax(logp, -1) == tokens[:, 1:], False)) / n
    return loss, {"loss": loss, "acc": acc}
