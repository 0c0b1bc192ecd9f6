"""A fresh EAGLE-3 draft for a target: its config, initial parameters and the TTT loss closure."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh

from ..config.draft import DraftConfig
from ..config.model import ModelConfig, RopeConfig
from ..models.target import Target
from ..runtime.sharding import to_host
from ..weights.params import ParamSpec, draft_specs
from .data import teacher_head
from .ttt import TTTMemory, ttt_loss
from .vocab import DraftVocab

DRAFT_ARCHS = ("llama", "mla")


def new_draft_config(target_cfg: ModelConfig, vocab: DraftVocab, *, arch: str = "llama", num_layers: int = 1,
                     intermediate_size: int | None = None, num_heads: int | None = None,
                     num_kv_heads: int | None = None, head_dim: int | None = None) -> DraftConfig:
    """An EAGLE-3 draft as wide as the target (it shares the target's embedding).

    arch "llama" (`LlamaForCausalLMEagle3`): attention defaults to the target's head count over
    the draft width; rotary is the plain NeoX form with the target's theta. arch "mla"
    (`Eagle3DeepseekV2ForCausalLM`): see `mla_layers`. Rotary is computed from positions either
    way (no table bounds its length).
    """
    if arch not in DRAFT_ARCHS:
        raise ValueError(f"draft arch {arch!r} is not supported; use one of {', '.join(DRAFT_ARCHS)}")
    h = target_cfg.hidden_size
    inter = intermediate_size or 4 * h
    if arch == "mla":
        if num_kv_heads is not None or head_dim is not None:
            raise ValueError("an MLA draft has no num_kv_heads / head_dim: its heads read one shared latent")
        layers = mla_layers(target_cfg, num_layers, inter, num_heads)
    else:
        heads = num_heads or target_cfg.num_heads
        hd = head_dim or h // heads
        layers = ModelConfig(
            model_type="llama", family="llama", vocab_size=target_cfg.vocab_size, hidden_size=h,
            num_layers=num_layers, num_heads=heads, num_kv_heads=num_kv_heads or heads, head_dim=hd,
            intermediate_size=inter, rms_norm_eps=target_cfg.rms_norm_eps,
            rope=RopeConfig(theta=target_cfg.rope.theta, dim=hd), max_position_embeddings=target_cfg.max_position_embeddings,
            bos_token_id=target_cfg.bos_token_id, eos_token_ids=target_cfg.eos_token_ids,
        )
    return DraftConfig(layers=layers, draft_vocab_size=len(vocab.draft_ids), target_hidden_size=h,
                       aux_layer_ids=tuple(target_cfg.aux_layer_ids))


def mla_layers(target_cfg: ModelConfig, num_layers: int, intermediate_size: int, num_heads: int | None) -> ModelConfig:
    """Dense MLA decoder layers for a draft of `target_cfg`.

    Over an MLA target (DeepSeek-V3, Kimi-K2.5) they copy its attention: heads, q / kv LoRA ranks,
    nope / rope / v head dims and its YaRN rotary, as the published Kimi-K2.5 MLA draft does. Over
    a GQA target they take DeepSeek's proportions from its head size d: nope = v = d, rope = d / 2,
    kv_lora = 4 d, no q LoRA, interleaved rotary with the target's theta.
    """
    h = target_cfg.hidden_size
    if target_cfg.attention == "mla":
        t = target_cfg
        heads = num_heads or t.num_heads
        dims = dict(q_lora_rank=t.q_lora_rank, kv_lora_rank=t.kv_lora_rank, qk_nope_head_dim=t.qk_nope_head_dim,
                    qk_rope_head_dim=t.qk_rope_head_dim, v_head_dim=t.v_head_dim)
        rope = t.rope
    else:
        heads = num_heads or target_cfg.num_heads
        d = target_cfg.head_dim
        rope_dim = max(2, d // 4 * 2)
        dims = dict(q_lora_rank=None, kv_lora_rank=4 * d, qk_nope_head_dim=d, qk_rope_head_dim=rope_dim, v_head_dim=d)
        rope = RopeConfig(theta=target_cfg.rope.theta, dim=rope_dim, interleaved=True)
    return ModelConfig(
        model_type="deepseek_v3", family="deepseek_v3", vocab_size=target_cfg.vocab_size, hidden_size=h,
        num_layers=num_layers, num_heads=heads, num_kv_heads=heads,
        head_dim=dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"], intermediate_size=intermediate_size,
        rms_norm_eps=target_cfg.rms_norm_eps, rope=rope, max_position_embeddings=target_cfg.max_position_embeddings,
        attention="mla", first_k_dense_replace=num_layers, bos_token_id=target_cfg.bos_token_id,
        eos_token_ids=target_cfg.eos_token_ids, **dims,
    )


def trainable_tree(cfg: DraftConfig, leaf: Callable[[str, ParamSpec], Any]) -> dict:
    """The draft's trainable tree (every draft param but the embedding, layers as a list of dicts),
    each leaf `leaf(name, spec)`: initial values, or shapes for the training planner."""
    layers: list[dict] = [{} for _ in range(cfg.layers.num_layers)]
    top: dict = {}
    for name, spec in draft_specs(cfg, with_embed=False).items():
        if name.startswith("layers."):
            _, i, sub = name.split(".", 2)
            layers[int(i)][sub] = leaf(name, spec)
        else:
            top[name] = leaf(name, spec)
    return {**top, "layers": layers}


def init_draft_params(cfg: DraftConfig, target: Target, vocab: DraftVocab, seed: int = 0,
                      std: float = 0.02) -> tuple[dict, dict]:
    """(trainable float32 params, frozen params).

    The embedding is the target's (frozen). The LM head starts from the target's head restricted
    to the draft vocabulary, which gives the draft the target's output geometry from step one; that
    head also stays, frozen, as `teacher_head`: the loss makes the teacher's logits with it.
    """
    rng = np.random.default_rng(seed)
    trainable = trainable_tree(cfg, lambda name, spec: np.ones(spec.shape, np.float32) if len(spec.shape) == 1 else (
        rng.standard_normal(spec.shape) * std).astype(np.float32))
    tp = target.params
    head = teacher_head(target, vocab.draft_ids)
    # the target's arrays may span other processes' devices: read back whole (to_host)
    trainable["lm_head"] = to_host(head).astype(np.float32)
    trainable["final_norm"] = to_host(tp["final_norm"]).astype(np.float32)
    frozen = {"embed": jnp.asarray(tp["embed"]), "teacher_head": head}
    if cfg.has_draft_vocab:
        frozen["d2t"] = jnp.asarray(vocab.d2t, jnp.int32)
    return jax.tree.map(jnp.asarray, trainable), frozen


def make_ttt_loss(cfg: DraftConfig, vocab: DraftVocab, num_steps: int, decay: float = 0.8,
                  sim_steps: int = 3, *, memory: TTTMemory = TTTMemory(),
                  context: tuple[Mesh, str] | None = None) -> Callable:
    """loss_fn(params, frozen, batch) for trainer.Trainer (`memory`, `context`: as ttt.ttt_loss takes them)."""
    t2d = jnp.asarray(vocab.t2d)
    draft_ids = jnp.asarray(vocab.draft_ids, jnp.int32)

    def loss_fn(params, frozen, batch):
        full = {**params, **frozen}
        full["embed"] = full["embed"].astype(params["fc"].dtype)
        return ttt_loss(full, cfg, batch, t2d, draft_ids, num_steps, decay=decay, sim_steps=sim_steps,
                        memory=memory, context=context)

    return loss_fn


def assembled_params(trainable: dict, frozen: dict, dtype=jnp.float32) -> dict:
    """Trainable + frozen -> the param tree eagle3_jax.models.draft uses (for export / inference)."""
    out = jax.tree.map(lambda x: jnp.asarray(x, dtype), dict(trainable))
    out["embed"] = jnp.asarray(frozen["embed"], dtype)
    if "d2t" in frozen:
        out["d2t"] = frozen["d2t"]
    return out
