"""A fresh EAGLE-3 draft for a target: its config, initial parameters and the TTT loss closure."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig, RopeConfig
from ..draft import DraftConfig, draft_specs
from ..target import Target
from .ttt import ttt_loss
from .vocab import DraftVocab


def new_draft_config(target_cfg: ModelConfig, vocab: DraftVocab, *, num_layers: int = 1,
                     intermediate_size: int | None = None, num_heads: int | None = None,
                     num_kv_heads: int | None = None, head_dim: int | None = None) -> DraftConfig:
    """A Llama-layer EAGLE-3 draft as wide as the target (it shares the target's embedding).

    Attention defaults to the target's head count over the draft width; rotary is the plain NeoX
    form with the target's theta, computed from positions (no table bounds its length).
    """
    h = target_cfg.hidden_size
    heads = num_heads or target_cfg.num_heads
    hd = head_dim or h // heads
    layers = ModelConfig(
        model_type="llama", family="llama", vocab_size=target_cfg.vocab_size, hidden_size=h,
        num_layers=num_layers, num_heads=heads, num_kv_heads=num_kv_heads or heads, head_dim=hd,
        intermediate_size=intermediate_size or 4 * h, rms_norm_eps=target_cfg.rms_norm_eps,
        rope=RopeConfig(theta=target_cfg.rope.theta, dim=hd), max_position_embeddings=target_cfg.max_position_embeddings,
        bos_token_id=target_cfg.bos_token_id, eos_token_ids=target_cfg.eos_token_ids,
    )
    return DraftConfig(layers=layers, draft_vocab_size=len(vocab.draft_ids), target_hidden_size=h,
                       aux_layer_ids=tuple(target_cfg.aux_layer_ids))


def init_draft_params(cfg: DraftConfig, target: Target, vocab: DraftVocab, seed: int = 0,
                      std: float = 0.02) -> tuple[dict, dict]:
    """(trainable float32 params, frozen params).

    The embedding is the target's (frozen). The LM head starts from the target's head restricted
    to the draft vocabulary, which gives the draft the target's output geometry from step one.
    """
    rng = np.random.default_rng(seed)
    specs = draft_specs(cfg, with_embed=False)
    layers: list[dict] = [{} for _ in range(cfg.layers.num_layers)]
    top: dict = {}
    for name, spec in specs.items():
        value = np.ones(spec.shape, np.float32) if len(spec.shape) == 1 else (
            rng.standard_normal(spec.shape) * std).astype(np.float32)
        if name.startswith("layers."):
            _, i, sub = name.split(".", 2)
            layers[int(i)][sub] = value
        else:
            top[name] = value
    tcfg, tp = target.config, target.params
    head = tp["embed"].T if tcfg.tie_word_embeddings else tp["lm_head"]
    top["lm_head"] = np.asarray(jnp.asarray(head, jnp.float32)[:, jnp.asarray(vocab.draft_ids)])
    top["final_norm"] = np.asarray(tp["final_norm"], np.float32)
    trainable = {**top, "layers": layers}
    frozen = {"embed": jnp.asarray(tp["embed"])}
    if cfg.has_draft_vocab:
        frozen["d2t"] = jnp.asarray(vocab.d2t, jnp.int32)
    return jax.tree.map(jnp.asarray, trainable), frozen


def make_ttt_loss(cfg: DraftConfig, vocab: DraftVocab, num_steps: int, decay: float = 0.8,
                  sim_steps: int = 3) -> Callable:
    """loss_fn(params, frozen, batch) for trainer.Trainer."""
    t2d = jnp.asarray(vocab.t2d)
    draft_ids = jnp.asarray(vocab.draft_ids, jnp.int32)

    def loss_fn(params, frozen, batch):
        full = {**params, **frozen}
        full["embed"] = full["embed"].astype(params["fc"].dtype)
        return ttt_loss(full, cfg, batch, t2d, draft_ids, num_steps, decay=decay, sim_steps=sim_steps)

    return loss_fn


def assembled_params(trainable: dict, frozen: dict, dtype=jnp.float32) -> dict:
    """Trainable + frozen -> the param tree eagle3_jax.draft uses (for export / inference)."""
    out = jax.tree.map(lambda x: jnp.asarray(x, dtype), dict(trainable))
    out["embed"] = jnp.asarray(frozen["embed"], dtype)
    if "d2t" in frozen:
        out["d2t"] = frozen["d2t"]
    return out
