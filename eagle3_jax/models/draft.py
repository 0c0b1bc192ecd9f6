"""EAGLE-3 draft model, in the two published HF layouts SGLang and vLLM load:
`LlamaForCausalLMEagle3` (GQA attention) and `Eagle3DeepseekV2ForCausalLM` (DeepSeek MLA
attention, e.g. the Kimi-K2.5 EAGLE-3 MLA draft).

The draft sees three target feature layers concatenated, `fc` projects them to its width, and one
decoder layer (the "midlayer") whose attention input is
`concat(input_layernorm(embed(token)), hidden_norm(hidden))` (width 2H) predicts the next token
over a reduced draft vocabulary; `target_id = draft_id + d2t[draft_id]`. Extra layers, when a
draft has `num_hidden_layers > 1`, are ordinary decoder layers on the hidden stream. The MLP is
always a dense SwiGLU.

In an MLA draft the 2H input goes through the projections that read the layer input (`q_a_proj`,
or `q_proj` without a q LoRA, and `kv_a_proj_with_mqa`); everything after them is the target's
MLA: q/kv LoRA norms, nope + rope heads, DeepSeek interleaved rotary with YaRN (mscale in the
softmax scale), and a KV cache holding the normalised latent and the roped shared rope key. The
attention itself is attention.mla_block, the target's code (XLA or the Triton kernel).

Alignment: draft position t pairs the target feature at t with the embedding of token x_{t+1}
and predicts x_{t+2}. Its output hidden (before the final norm) stands in for the target feature
at t+1 when the draft runs ahead of the target.

EAGLE 3.1 (vLLM's `fc_norm` / `norm_output`, SpecForge, TensorRT-LLM) and its kin, each a config
switch (config/draft.py):
- `norm_before_fc`: one RMSNorm (`input_norm`) over the concatenated features before fc;
- `fc_norm`: an RMSNorm of its own (`fc_norm.{i}`, the target's width, the draft's eps) on each of
  the three features before they are concatenated (after `input_norm` when both are set);
- `norm_output` (TensorRT-LLM: `eagle_config.return_hidden_post_norm`): the hidden a draft pass
  hands to the next step (and keeps as a tree's root) is the final norm's output rather than the
  residual before it; the logits are the same either way.

Sliding-window drafts (vllm-project/speculators): a layer `layer_types` names "sliding_attention"
lets a query at position p see the draft pairs at positions p - sliding_window + 1 .. p only; the
draft cache's slot index is the pair's position, so the window is a lower bound on the slots
(`kv_cache.Visible.sliding`), and pages wholly below every query's window are not read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import kv_cache
from ..checkpoint.draft_reader import read_draft_checkpoint
from ..checkpoint.errors import CheckpointError
from ..config.draft import DraftConfig, check_fits_target, parse_draft_config  # noqa: F401 (the draft's config, re-exported)
from ..config.model import ConfigError
from ..weights.params import draft_specs, feature_norm_names  # noqa: F401 (draft_specs: the draft's layout, re-exported)
from ..weights.quant import PRECISION, QArray, linear
from .attention import gqa_block, mla_block
from .layers import rms_norm, swiglu
from .target import ABSORB_MAX_TOKENS, Target, resolve_dtype, uses_fnuz

# ---- forward ----------------------------------------------------------------------------------------


def draft_forward(params: dict, cfg: DraftConfig, embeds: jax.Array, hidden: jax.Array, positions: jax.Array,
                  cache: kv_cache.KVCache, visible: kv_cache.Visible, absorb: bool | None = None
                  ) -> tuple[jax.Array, jax.Array, kv_cache.KVCache]:
    """One draft pass over T new pairs per row.

    embeds [B, T, H]: embeddings of the tokens x_{t+1}; hidden [B, T, H]: fc(target features) or
    the draft's own previous output hidden; positions [B, T]; visible: the cache slots each pair
    sees (K/V of the new pairs are written at slots cache.lengths[b] + t; see attention.gqa_block).
    absorb: the MLA form (see target.forward; default: absorbed up to ABSORB_MAX_TOKENS new pairs).
    Returns draft-vocab logits [B, T, Vd] (float32), the hidden handed on [B, T, H] (before the
    final norm; after it for `norm_output` drafts), cache.
    """
    lc = cfg.layers
    if absorb is None:
        absorb = embeds.shape[1] <= ABSORB_MAX_TOKENS
    layers = params["layers"]
    p0 = layers[0]
    normed_hidden = rms_norm(hidden, p0["hidden_norm"], lc.rms_norm_eps)
    residual = normed_hidden if cfg.norm_before_residual else hidden
    x = jnp.concatenate([rms_norm(embeds, p0["attn_norm"], lc.rms_norm_eps), normed_hidden], axis=-1)
    for layer, p in enumerate(layers):
        if layer > 0:
            x = rms_norm(residual, p["attn_norm"], lc.rms_norm_eps)
        seen = visible.sliding(positions, cfg.window(layer))
        if cfg.is_mla:
            attn, cache = mla_block(p, lc, x, positions, cache, jnp.int32(layer), seen, absorb)
        else:
            attn, cache = gqa_block(p, lc, x, positions, cache, jnp.int32(layer), seen)
        h = residual + attn
        residual = h + swiglu(rms_norm(h, p["mlp_norm"], lc.rms_norm_eps), p["gate_proj"], p["up_proj"], p["down_proj"])
    handed = rms_norm(residual, params["final_norm"], lc.rms_norm_eps) if cfg.norm_output else residual
    return draft_head(params, cfg, handed), handed, cache


def draft_head(params: dict, cfg: DraftConfig, hidden: jax.Array) -> jax.Array:
    """Draft-vocab logits (float32) from the hiddens a draft pass hands on: final norm (already
    applied for `norm_output` drafts), then lm_head."""
    if not cfg.norm_output:
        hidden = rms_norm(hidden, params["final_norm"], cfg.layers.rms_norm_eps)
    return linear(hidden, params["lm_head"], out_dtype=jnp.float32)


def project_features(params: dict, cfg: DraftConfig, aux: jax.Array) -> jax.Array:
    """fc: concatenated target features [.., 3 * Ht] -> draft hidden [.., H], after the draft's
    feature norms (`norm_before_fc`'s over the concatenation, then `fc_norm`'s per feature)."""
    aux = aux.astype(params["fc"].dtype)
    eps = cfg.layers.rms_norm_eps
    if cfg.norm_before_fc:
        aux = rms_norm(aux, params["input_norm"], eps)
    if cfg.fc_norm:
        weights = jnp.stack([params[name] for name in feature_norm_names(cfg) if name.startswith("fc_norm.")])
        aux = rms_norm(aux.reshape(aux.shape[:-1] + weights.shape), weights, eps).reshape(aux.shape)
    return jnp.matmul(aux, params["fc"], precision=PRECISION)


def draft_to_target_ids(params: dict, draft_ids: jax.Array) -> jax.Array:
    return draft_ids + params["d2t"][draft_ids] if "d2t" in params else draft_ids


# ---- the public handle ----------------------------------------------------------------------------


def with_target_kernels(draft: "Draft", target: Target) -> "Draft":
    """The draft running its target's kernel choice (its attention; drafts have no MoE)."""
    kernels = target.config.kernels
    if draft.config.layers.kernels == kernels:
        return draft
    layers = dataclasses.replace(draft.config.layers, kernels=kernels)
    return dataclasses.replace(draft, config=dataclasses.replace(draft.config, layers=layers))


@dataclasses.dataclass
class Draft:
    """A loaded EAGLE-3 draft bound to its target (shares the target's embedding if it has none)."""

    config: DraftConfig
    params: dict
    dtype: jnp.dtype
    target: Target | None = None

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target hidden states it reads: its config's, else its target's."""
        return tuple(self.config.aux_layer_ids or self.target.config.aux_layer_ids)

    def logits(self, token_ids, aux) -> np.ndarray:
        """Causal draft forward: position t uses embed(token_ids[t]) and fc(aux[t]) (caller aligns).

        token_ids int [B, T], aux [B, T, 3 * target_hidden] -> float32 [B, T, draft_vocab].
        """
        ids = np.asarray(token_ids)
        aux = np.asarray(aux)
        if ids.ndim != 2 or aux.shape[:2] != ids.shape or aux.shape[-1] != 3 * self.config.target_hidden_size:
            raise ValueError(
                f"draft.logits needs token_ids [B, T] and aux [B, T, {3 * self.config.target_hidden_size}]; "
                f"got {ids.shape} and {aux.shape}"
            )
        return np.asarray(_causal_draft_logits(self.params, self.config, jnp.asarray(ids, jnp.int32),
                                               jnp.asarray(aux, self.dtype), self.dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _causal_draft_logits(params, cfg: DraftConfig, ids, aux, dtype):
    b, t = ids.shape
    cache = kv_cache.init_cache(cfg.layers, b, t, dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    visible = kv_cache.Visible(cache.lengths, kv_cache.causal_mask(b, t))
    logits, _, _ = draft_forward(params, cfg, params["embed"][ids], project_features(params, cfg, aux), positions,
                                 cache, visible)
    return logits


def load_draft(path: str | os.PathLike, target: Target, dtype="bfloat16", *, fp8_format: str = "auto") -> Draft:
    """Load an EAGLE-3 draft folder (config.json + safetensors or pytorch_model.bin) for `target`:
    a `LlamaForCausalLMEagle3` or an `Eagle3DeepseekV2ForCausalLM` (MLA) draft.

    The draft reads the target's hidden states `Draft.aux_layer_ids`: those the draft config names
    (`eagle_aux_hidden_state_layer_ids`), else the target's own (by default 2, L//2, L-3). The
    target is left as it is: the scheduler runs a view of it that captures them
    (`Target.capturing`), so one target serves drafts that read different layers. Per-channel FP8 layer weights
    (AMD Quark ptpc_fp8: float8 `weight` + float32 `weight_scale` per output row) stay FP8 on
    device; `fp8_format` as in `load_target` ("auto": e4m3fnuz on gfx942).
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"no config.json in draft folder {path}")
    with open(cfg_path) as f:
        try:
            cfg = parse_draft_config(json.load(f))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from e
    check_fits_target(cfg, target.config)

    flat = read_draft_checkpoint(path, cfg, uses_fnuz(fp8_format))
    dt = resolve_dtype(dtype)
    params = _assemble(flat, cfg, dt, target)
    if target.mesh is not None:  # the draft is small: replicate it on the target's mesh
        params = jax.device_put(params, jax.sharding.NamedSharding(target.mesh, jax.sharding.PartitionSpec()))
    return Draft(config=cfg, params=params, dtype=dt, target=target)


def _assemble(flat: dict[str, np.ndarray], cfg: DraftConfig, dt, target: Target) -> dict:
    def cast(a):
        if isinstance(a, QArray):
            return jax.tree.map(jnp.asarray, a)
        return jnp.asarray(np.asarray(a, np.float32), dt)

    params = {name: cast(flat[name]) for name in ("fc", "final_norm", "lm_head", *feature_norm_names(cfg))}
    if "embed" in flat:
        params["embed"] = cast(flat["embed"])
    else:
        if cfg.hidden_size != target.config.hidden_size:
            raise CheckpointError("draft has no embed_tokens and its hidden_size differs from the target's; cannot share the target embedding")
        params["embed"] = target.params["embed"].astype(dt)
    layer_names = {n.split(".", 2)[2] for n in flat if n.startswith("layers.")}
    params["layers"] = [
        {n: cast(flat[f"layers.{i}.{n}"]) for n in layer_names if f"layers.{i}.{n}" in flat}
        for i in range(cfg.layers.num_layers)
    ]
    if cfg.has_draft_vocab:
        if "d2t" not in flat:
            raise CheckpointError(f"draft has draft_vocab_size={cfg.draft_vocab_size} < vocab_size but no d2t tensor")
        d2t = np.asarray(flat["d2t"]).astype(np.int64).reshape(-1)
        if d2t.shape != (cfg.draft_vocab_size,):
            raise CheckpointError(f"draft d2t has {d2t.shape[0]} entries; expected draft_vocab_size={cfg.draft_vocab_size}")
        mapped = np.arange(cfg.draft_vocab_size) + d2t
        if mapped.min() < 0 or mapped.max() >= cfg.vocab_size:
            raise CheckpointError("draft d2t does not map draft ids into the target vocabulary")
        params["d2t"] = jnp.asarray(d2t, jnp.int32)
    return params
