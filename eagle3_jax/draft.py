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
attention itself is attention.mla_block, the target's code (XLA or the Pallas kernel).

Alignment: draft position t pairs the target feature at t with the embedding of token x_{t+1}
and predicts x_{t+2}. Its output hidden (before the final norm) stands in for the target feature
at t+1 when the draft runs ahead of the target.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import kv_cache
from .attention import gqa_block, mla_block
from .config import ConfigError, ModelConfig, QuantConfig, _parse_quant, parse_model_config
from .layers import rms_norm, swiglu
from .params import ParamSpec, attention_specs
from .quant import PRECISION, QArray, linear
from .target import ABSORB_MAX_TOKENS, Target, resolve_dtype, uses_fnuz

LLAMA_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# vLLM and SGLang register the V3 name as an alias of the V2 class: the same layout.
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
DRAFT_ARCHITECTURES = LLAMA_ARCHITECTURES + MLA_ARCHITECTURES


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """An EAGLE-3 draft: its decoder-layer config (Llama GQA or DeepSeek MLA) plus the EAGLE-specific fields."""

    layers: ModelConfig  # hidden size, attention (GQA or MLA), rope, number of decoder layers
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # target hidden_states indices; None = target's default
    norm_before_residual: bool = False
    quant: QuantConfig | None = None  # AMD Quark ptpc_fp8 drafts: per-channel FP8 layer weights

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layers.vocab_size

    @property
    def has_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @property
    def is_mla(self) -> bool:
        return self.layers.attention == "mla"


def parse_draft_config(raw: dict) -> DraftConfig:
    """Parse an EAGLE-3 draft config.json.

    `eagle_config.eagle_aux_hidden_state_layer_ids` is read in the SpecForge / vLLM convention:
    id i means "output of target layer i", i.e. HF `hidden_states[i + 1]`.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"draft config.json must hold a JSON object; got {type(raw).__name__}")
    arch = (raw.get("architectures") or ["LlamaForCausalLMEagle3"])[0]
    if arch not in DRAFT_ARCHITECTURES:
        raise ConfigError(
            f"draft architecture {arch!r} is not supported; supported: {', '.join(DRAFT_ARCHITECTURES)} "
            "(Llama-layer and MLA-layer EAGLE-3 drafts)"
        )
    mla = arch in MLA_ARCHITECTURES
    for variant in ("fc_norm", "norm_output"):  # vLLM options that change the draft's inputs / outputs
        if raw.get(variant):
            raise ConfigError(f"draft config sets {variant}=true, a variant not supported here; supported: EAGLE-3 drafts "
                              "that feed fc(features) and hand on the hidden state before the final norm")
    body = dict(raw, model_type="deepseek_v3" if mla else "llama")
    quant = _parse_draft_quant(body.pop("quantization_config", None))
    if mla:  # dense MLA decoder layers: no routed experts, whatever MoE fields the config carries
        body.update(n_routed_experts=0, first_k_dense_replace=body.get("num_hidden_layers", 1))
    layers = parse_model_config(body)
    vocab = layers.vocab_size
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise ConfigError(f"draft_vocab_size={draft_vocab} must be in [1, vocab_size={vocab}]")
    eagle = raw.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if len(ids) != 3:
            raise ConfigError(f"eagle_aux_hidden_state_layer_ids must list 3 target layers; got {ids}")
        ids = tuple(int(i) + 1 for i in ids)
    return DraftConfig(
        layers=layers,
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(raw.get("target_hidden_size") or layers.hidden_size),
        aux_layer_ids=ids,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        quant=quant,
    )


def _parse_draft_quant(raw) -> QuantConfig | None:
    """Drafts may ship per-channel FP8 layer weights (AMD Quark ptpc_fp8); fc and lm_head stay float."""
    quant = _parse_quant(raw)
    if quant is not None and quant.method != "fp8_channel":
        raise ConfigError(f"draft quantization {quant.method!r} is not supported; supported: quark ptpc_fp8 "
                          "(per-channel FP8 weights)")
    return quant


def draft_specs(cfg: DraftConfig, with_embed: bool) -> dict[str, ParamSpec]:
    """Flat param layout of a draft; matrices [in, out] like the target's.

    Layer 0's attention projections read the 2H concatenation (embedding, hidden); the rest of
    every layer has the target's layout for its attention kind (params.attention_specs).
    """
    lc = cfg.layers
    h, i = lc.hidden_size, lc.intermediate_size
    s = {
        "fc": ParamSpec((3 * cfg.target_hidden_size, h), (None, "embed")),
        "final_norm": ParamSpec((h,), ("norm",)),
        "lm_head": ParamSpec((h, cfg.draft_vocab_size), ("embed", "vocab")),
    }
    if with_embed:
        s["embed"] = ParamSpec((cfg.vocab_size, h), ("vocab", "embed"))
    for layer in range(lc.num_layers):
        p = f"layers.{layer}."
        s[p + "attn_norm"] = ParamSpec((h,), ("norm",))
        if layer == 0:
            s[p + "hidden_norm"] = ParamSpec((h,), ("norm",))
        for name, spec in attention_specs(lc, input_width=2 * h if layer == 0 else h).items():
            s[p + name] = spec
        s[p + "mlp_norm"] = ParamSpec((h,), ("norm",))
        s[p + "gate_proj"] = ParamSpec((h, i), ("embed", "mlp"))
        s[p + "up_proj"] = ParamSpec((h, i), ("embed", "mlp"))
        s[p + "down_proj"] = ParamSpec((i, h), ("mlp", "embed"))
    return s


# ---- forward ----------------------------------------------------------------------------------------


def draft_forward(params: dict, cfg: DraftConfig, embeds: jax.Array, hidden: jax.Array, positions: jax.Array,
                  cache: kv_cache.KVCache, mask: jax.Array, tree_mask: jax.Array | None = None,
                  prefix_lengths: jax.Array | None = None, absorb: bool | None = None
                  ) -> tuple[jax.Array, jax.Array, kv_cache.KVCache]:
    """One draft pass over T new pairs per row.

    embeds [B, T, H]: embeddings of the tokens x_{t+1}; hidden [B, T, H]: fc(target features) or
    the draft's own previous output hidden; positions [B, T]; mask [B, T, S] cache visibility
    (K/V of the new pairs are written at slots cache.lengths[b] + t); tree_mask / prefix_lengths:
    the same visibility in the form the Pallas attention path takes (see attention.gqa_block).
    absorb: the MLA form (see target.forward; default: absorbed up to ABSORB_MAX_TOKENS new pairs).
    Returns draft-vocab logits [B, T, Vd] (float32), output hidden [B, T, H], cache.
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
        if cfg.is_mla:
            attn, cache = mla_block(p, lc, x, positions, cache, jnp.int32(layer), mask, absorb, tree_mask, prefix_lengths)
        else:
            attn, cache = gqa_block(p, lc, x, positions, cache, jnp.int32(layer), mask, tree_mask, prefix_lengths)
        h = residual + attn
        residual = h + swiglu(rms_norm(h, p["mlp_norm"], lc.rms_norm_eps), p["gate_proj"], p["up_proj"], p["down_proj"])
    logits = draft_head(params, cfg, residual)
    return logits, residual, cache


def draft_head(params: dict, cfg: DraftConfig, hidden: jax.Array) -> jax.Array:
    """Draft-vocab logits (float32) from draft output hiddens (final norm, then lm_head)."""
    return linear(rms_norm(hidden, params["final_norm"], cfg.layers.rms_norm_eps), params["lm_head"],
                  out_dtype=jnp.float32)


def project_features(params: dict, aux: jax.Array) -> jax.Array:
    """fc: concatenated target features [.., 3 * Ht] -> draft hidden [.., H]."""
    return jnp.matmul(aux.astype(params["fc"].dtype), params["fc"], precision=PRECISION)


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
        return self.config.aux_layer_ids or self.target.config.aux_layer_ids

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
    mask = kv_cache.visibility(cache.lengths, kv_cache.causal_mask(b, t), t)
    logits, _, _ = draft_forward(params, cfg, params["embed"][ids], project_features(params, aux), positions, cache, mask)
    return logits


def _map_draft_key(key: str) -> str | None:
    """HF draft key -> flat name (None = not a weight we use)."""
    for prefix in ("model.",):
        if key.startswith(prefix):
            key = key[len(prefix):]
    if key.startswith("midlayer."):
        key = "layers.0." + key[len("midlayer."):]
    renames = {
        "embed_tokens.weight": "embed", "fc.weight": "fc", "norm.weight": "final_norm", "lm_head.weight": "lm_head",
        "d2t": "d2t", "t2d": "t2d",
    }
    if key in renames:
        return renames[key]
    if key.startswith("layers."):
        _, idx, rest = key.split(".", 2)
        sub = {
            "input_layernorm.weight": "attn_norm", "hidden_norm.weight": "hidden_norm",
            "post_attention_layernorm.weight": "mlp_norm",
            "self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj",
            "self_attn.v_proj.weight": "v_proj", "self_attn.o_proj.weight": "o_proj",
            # MLA layers (Eagle3DeepseekV2ForCausalLM)
            "self_attn.q_a_proj.weight": "q_a_proj", "self_attn.q_a_layernorm.weight": "q_a_norm",
            "self_attn.q_b_proj.weight": "q_b_proj", "self_attn.kv_a_proj_with_mqa.weight": "kv_a_proj",
            "self_attn.kv_a_layernorm.weight": "kv_a_norm", "self_attn.kv_b_proj.weight": "kv_b_proj",
            "mlp.gate_proj.weight": "gate_proj", "mlp.up_proj.weight": "up_proj", "mlp.down_proj.weight": "down_proj",
        }.get(rest)
        return f"layers.{idx}.{sub}" if sub else None
    return None


def _read_draft_tensors(path: str) -> dict[str, np.ndarray]:
    """HF key -> array from model.safetensors (any sharding) or, with torch, pytorch_model.bin."""
    from .checkpoint import CheckpointError
    from .checkpoint.safetensors_io import find_pickles, open_hf_checkpoint

    if not any(f.endswith(".safetensors") for f in os.listdir(path)) and find_pickles(path):
        bins = [os.path.join(path, f) for f in find_pickles(path) if f.endswith(".bin")]
        try:
            import torch
        except ImportError:
            raise CheckpointError(
                f"{path} holds only pytorch_model.bin; reading it safely needs torch (torch.load with "
                "weights_only=True). Install torch, or convert the draft to model.safetensors"
            ) from None
        out = {}
        for b in bins:
            try:
                sd = torch.load(b, map_location="cpu", weights_only=True)  # never executes pickled code
            except Exception as e:  # noqa: BLE001 - torch raises many types for unsafe/corrupt pickles
                raise CheckpointError(f"could not read {b} safely (weights_only=True): {e}") from e
            if isinstance(sd, dict) and len(sd) == 1 and next(iter(sd)) in ("state_dict", "model"):
                sd = next(iter(sd.values()))  # a state dict saved inside a wrapper dict
            if not isinstance(sd, dict):
                raise CheckpointError(f"{b} does not hold a state dict (got {type(sd).__name__})")
            for k, v in sd.items():
                if not isinstance(v, torch.Tensor):
                    raise CheckpointError(f"{b} entry {k!r} is a {type(v).__name__}, not a tensor; save only the state dict")
                out[k] = v.float().numpy() if v.is_floating_point() else v.numpy()
        return out
    ckpt = open_hf_checkpoint(path)
    return {k: np.array(ckpt.read(k)) for k in ckpt.keys()}


def load_draft(path: str | os.PathLike, target: Target, dtype="bfloat16", *, fp8_format: str = "auto") -> Draft:
    """Load an EAGLE-3 draft folder (config.json + safetensors or pytorch_model.bin) for `target`:
    a `LlamaForCausalLMEagle3` or an `Eagle3DeepseekV2ForCausalLM` (MLA) draft.

    The target is switched to capture the draft's feature layers (`eagle_aux_hidden_state_layer_ids`
    when the draft config names them, else the default 2, L//2, L-3). Per-channel FP8 layer weights
    (AMD Quark ptpc_fp8: float8 `weight` + float32 `weight_scale` per output row) stay FP8 on
    device; `fp8_format` as in `load_target` ("auto": e4m3fnuz on gfx942).
    """
    from .checkpoint import CheckpointError

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
    if cfg.aux_layer_ids is not None:
        target.config = target.config.with_aux_layers(cfg.aux_layer_ids)

    raw = _read_draft_tensors(path)
    flat: dict[str, np.ndarray] = {}
    unknown, source, scales = [], {}, {}
    for key, arr in raw.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a derived buffer some exports include; rotary is recomputed from the config
        if key.endswith(".weight_scale"):
            name = _map_draft_key(key[: -len("_scale")])
            if name is None:
                unknown.append(key)
            else:
                scales[name] = (key, arr)
            continue
        name = _map_draft_key(key)
        if name is None:
            unknown.append(key)
        elif name in source:
            raise CheckpointError(f"draft {path} has both {source[name]!r} and {key!r} for the same weight; keep one")
        else:
            flat[name], source[name] = arr, key
    specs = draft_specs(cfg, with_embed="embed" in flat)
    unknown += [source[n] for n in flat if n not in specs and n not in ("d2t", "t2d")]
    if unknown:
        raise CheckpointError(
            f"draft {path} has tensors its config.json does not use (num_hidden_layers={cfg.layers.num_layers}): "
            f"{sorted(unknown)[:8]}"
        )
    for name, spec in specs.items():
        if name not in flat:
            raise CheckpointError(f"draft {path} is missing tensor {name!r} (expected shape {spec.shape})")
        arr = flat[name]
        if name not in ("embed",) and arr.ndim == 2:
            arr = arr.T  # HF [out, in] -> [in, out]
        if tuple(arr.shape) != spec.shape:
            raise CheckpointError(f"draft tensor {name!r} has shape {tuple(arr.shape)}, expected {spec.shape} from config.json")
        flat[name] = arr
    flat = _fold_fp8_scales(flat, scales, cfg, path, uses_fnuz(fp8_format))
    dt = resolve_dtype(dtype)
    params = _assemble(flat, cfg, dt, target)
    if target.mesh is not None:  # the draft is small: replicate it on the target's mesh
        params = jax.device_put(params, jax.sharding.NamedSharding(target.mesh, jax.sharding.PartitionSpec()))
    return Draft(config=cfg, params=params, dtype=dt, target=target)


def _fold_fp8_scales(flat: dict, scales: dict, cfg: DraftConfig, path: str, fnuz: bool) -> dict:
    """Per-channel FP8 weights [in, out] (already transposed) + scales [out] -> QArrays."""
    from .checkpoint import CheckpointError
    from .checkpoint.quant import fp8_e4m3fn_to_fnuz
    from .params import qformat_for

    fp8 = [n for n, a in flat.items() if np.dtype(a.dtype) == np.dtype(jnp.float8_e4m3fn)]
    if (fp8 or scales) and (cfg.quant is None or cfg.quant.method != "fp8_channel"):
        raise CheckpointError(f"draft {path} holds FP8 weights or weight scales but its config.json has no quark ptpc_fp8 "
                              "quantization_config; use the config.json shipped with these weights")
    for name in fp8:
        if name not in scales:
            raise CheckpointError(f"draft tensor {name!r} is float8 but has no weight_scale companion; re-download the draft")
    out = dict(flat)
    fmt = None if cfg.quant is None else dataclasses.replace(qformat_for(cfg.quant), fnuz=fnuz)
    for name, (key, scale) in scales.items():
        weight = flat.get(name)
        if weight is None or name not in fp8:
            raise CheckpointError(f"draft tensor {key!r} scales {name!r}, which is not a float8 weight in this draft")
        if name in ("fc", "lm_head", "embed"):
            raise CheckpointError(f"draft tensor {name!r} is FP8-quantized; fc, lm_head and embed must stay unquantized "
                                  "(exclude them when quantizing)")
        s = np.asarray(scale, np.float32).reshape(-1)
        if s.shape != (weight.shape[1],):
            raise CheckpointError(f"draft tensor {key!r} has {s.size} scales for {weight.shape[1]} output rows of {name!r}")
        values, s = np.ascontiguousarray(weight), s.reshape(1, -1)
        if fnuz:
            values, s = fp8_e4m3fn_to_fnuz(values, s)
        out[name] = QArray(values, s, fmt)
    return out


def check_fits_target(cfg: DraftConfig, tcfg: ModelConfig) -> None:
    """A draft must share the target's vocabulary and read features of the target's width."""
    if cfg.vocab_size != tcfg.vocab_size:
        raise ConfigError(f"draft vocab_size={cfg.vocab_size} does not match the target's vocab_size={tcfg.vocab_size}")
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise ConfigError(
            f"draft expects target features of width {cfg.target_hidden_size} (target_hidden_size) but the target's "
            f"hidden_size is {tcfg.hidden_size}; this draft was trained for another target"
        )
    if cfg.aux_layer_ids is not None:
        tcfg.with_aux_layers(cfg.aux_layer_ids)  # raises with the valid range


def _assemble(flat: dict[str, np.ndarray], cfg: DraftConfig, dt, target: Target) -> dict:
    from .checkpoint import CheckpointError

    def cast(a):
        if isinstance(a, QArray):
            return jax.tree.map(jnp.asarray, a)
        return jnp.asarray(np.asarray(a, np.float32), dt)

    params = {"fc": cast(flat["fc"]), "final_norm": cast(flat["final_norm"]), "lm_head": cast(flat["lm_head"])}
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
