"""Write a trained draft as an HF EAGLE-3 folder: `LlamaForCausalLMEagle3` (GQA layers) or
`Eagle3DeepseekV2ForCausalLM` (MLA layers).

The folder is what `e3.load_draft` reads and what vLLM (`llama_eagle3.py`, `deepseek_eagle3.py`)
and SGLang load:

- `config.json`: a Llama config, or for an MLA draft a DeepSeek-V3 one (`q_lora_rank`,
  `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, YaRN `rope_scaling`),
  plus `draft_vocab_size`, `target_hidden_size`, the EAGLE 3.1 switches that are on and, when the
  draft names its feature layers, `eagle_config.eagle_aux_hidden_state_layer_ids` in the
  input-to-layer convention (id k = HF `hidden_states[k]`), which vLLM and SGLang both read as
  trained (config/draft.py: `aux_layer_ids_json`);
- `model.safetensors` with HF `[out, in]` weights: `fc.weight`; the decoder layer as `midlayer.*`
  (MLA attention under DeepSeek's names: `self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj` or
  `q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`)
  for single-layer drafts (vLLM renames `midlayer.` to `layers.0.`) or `layers.{i}.*` for deeper
  ones (layer 0 carries `hidden_norm`); `norm.weight`; `lm_head.weight`; `d2t` (int64 offsets,
  target = draft + d2t[draft]) and `t2d` (bool [V], skipped by vLLM) when the vocabulary is
  reduced; `embed_tokens.weight` only on request (without it, loaders share the target's).

The folder is written into a temporary folder beside `out_dir` and renamed into place, so a
crash never leaves a half-written draft where a loader would find it.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import ml_dtypes
import numpy as np

from ..checkpoint.atomic import atomic_dir
from ..config.draft import LLAMA_ARCHITECTURES, MLA_ARCHITECTURES, DraftConfig, aux_layer_ids_json
from ..config.model import ModelConfig, RopeConfig
from ..weights.params import draft_specs
from .vocab import DraftVocab

ARCHITECTURE = LLAMA_ARCHITECTURES[0]
MLA_ARCHITECTURE = MLA_ARCHITECTURES[0]

_OUT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}
_ST_TAGS = {
    np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.bool_): "BOOL",
}
# flat param name (inside a layer) -> HF name (after the layer prefix)
_LAYER_KEYS = {
    "attn_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "q_a_proj": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b_proj": "self_attn.q_b_proj.weight", "kv_a_proj": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight", "kv_b_proj": "self_attn.kv_b_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
}
_TOP_KEYS = {"fc": "fc.weight", "final_norm": "norm.weight", "lm_head": "lm_head.weight", "embed": "embed_tokens.weight"}


# ---- atomic folders ---------------------------------------------------------------------------------


# ---- safetensors writing ----------------------------------------------------------------------------


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file directly (8-byte header length, JSON header, raw little-endian data).

    Independent of the installed `safetensors` release: older ones cannot save bfloat16 from numpy.

    Tensors are laid out widest dtype first so every tensor starts at a multiple of its item size.
    """
    items = []
    for k, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in _ST_TAGS:
            raise ValueError(f"tensor {k!r} has dtype {a.dtype}, which this writer does not store ({', '.join(map(str, _ST_TAGS))})")
        items.append((k, a))
    items.sort(key=lambda kv: (-kv[1].dtype.itemsize, kv[0]))
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for k, a in items:
        header[k] = {"dtype": _ST_TAGS[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, a in items:
            f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


# ---- config.json --------------------------------------------------------------------------------------


def rope_scaling_json(rope: RopeConfig) -> dict | None:
    """The HF `rope_scaling` dict that `config._parse_rope` reads back into `rope` (None = default)."""
    if rope.rope_type == "default":
        return None
    d: dict = {"rope_type": rope.rope_type, "factor": rope.factor}
    if rope.rope_type == "llama3":
        d.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                 original_max_position_embeddings=rope.original_max_position_embeddings)
    elif rope.rope_type == "yarn":
        d.update(original_max_position_embeddings=rope.original_max_position_embeddings,
                 beta_fast=rope.beta_fast, beta_slow=rope.beta_slow)
        if rope.mscale:
            d["mscale"] = rope.mscale
        if rope.mscale_all_dim:
            d["mscale_all_dim"] = rope.mscale_all_dim
        if rope.attention_factor is not None:
            d["attention_factor"] = rope.attention_factor
        if not rope.truncate:
            d["truncate"] = False
    return d


def draft_config_json(cfg: DraftConfig, dtype: str = "bfloat16") -> dict:
    """The HF config.json dict of a `LlamaForCausalLMEagle3` or `Eagle3DeepseekV2ForCausalLM` draft."""
    lc = cfg.layers
    if lc.num_experts:
        raise ValueError("EAGLE-3 draft layers have a dense MLP; a draft with routed experts cannot be exported")
    raw = _mla_config_json(lc) if cfg.is_mla else _llama_config_json(lc)
    raw.update({
        "num_hidden_layers": lc.num_layers,
        "intermediate_size": lc.intermediate_size,
        "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope.theta,
        "rope_scaling": rope_scaling_json(lc.rope),
        "max_position_embeddings": lc.max_position_embeddings,
        "vocab_size": lc.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": dtype,
    })
    if lc.bos_token_id is not None:
        raw["bos_token_id"] = int(lc.bos_token_id)
    if lc.eos_token_ids:
        raw["eos_token_id"] = int(lc.eos_token_ids[0]) if len(lc.eos_token_ids) == 1 else list(lc.eos_token_ids)
    if cfg.layer_windows is not None:  # sliding-window layers, as vLLM reads them (flattened, per layer)
        raw["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in cfg.layer_windows]
        windows = {w for w in cfg.layer_windows if w is not None}
        if len(windows) != 1:
            raise ValueError(f"draft layers have sliding windows {sorted(windows)}: a config holds one sliding_window")
        raw["sliding_window"] = windows.pop()
    for switch in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if getattr(cfg, switch):  # written only when on: a reader that predates a switch then refuses nothing
            raw[switch] = True
    if cfg.aux_layer_ids is not None:
        if len(cfg.aux_layer_ids) != 3 or min(cfg.aux_layer_ids) < 0:
            raise ValueError(f"aux_layer_ids {cfg.aux_layer_ids} cannot be written as eagle_aux_hidden_state_layer_ids: "
                             "they must be 3 HF hidden_states indices >= 0")
        if cfg.aux_layer_ids[0] == 1:
            raise ValueError(
                f"the draft reads hidden_states {list(cfg.aux_layer_ids)}, which no eagle_aux_hidden_state_layer_ids "
                "list names for every reader: one starting at 1 is read as output-of-layer ids (hidden_states[i + 1]) "
                "by SGLang and eagle3-jax and as input-to-layer ids by vLLM; train on feature layers whose first is "
                "not hidden_states[1] (the default starts at 2 for targets of 3 or more layers)")
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids_json(cfg.aux_layer_ids),
                               "use_aux_hidden_state": True}
    return raw


def _llama_config_json(lc: ModelConfig) -> dict:
    if lc.attention != "gqa" or lc.family != "llama":
        raise ValueError("a LlamaForCausalLMEagle3 draft has Llama (GQA) layers")
    if lc.rope.dim != lc.head_dim or lc.rope.interleaved:
        raise ValueError(f"draft rotary covers {lc.rope.dim} of {lc.head_dim} channels (interleaved={lc.rope.interleaved}); "
                         "a Llama config can only express full, half-split rotary")
    return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": lc.hidden_size,
            "num_attention_heads": lc.num_heads, "num_key_value_heads": lc.num_kv_heads, "head_dim": lc.head_dim,
            "mlp_bias": False}


def _mla_config_json(lc: ModelConfig) -> dict:
    if lc.rope.dim != lc.qk_rope_head_dim or not lc.rope.interleaved:
        raise ValueError(f"MLA draft rotary covers {lc.rope.dim} channels (interleaved={lc.rope.interleaved}); a DeepSeek "
                         f"config expresses interleaved rotary over all {lc.qk_rope_head_dim} rope channels")
    return {"architectures": [MLA_ARCHITECTURE], "model_type": "deepseek_v3", "hidden_size": lc.hidden_size,
            "num_attention_heads": lc.num_heads, "num_key_value_heads": lc.num_heads, "q_lora_rank": lc.q_lora_rank,
            "kv_lora_rank": lc.kv_lora_rank, "qk_nope_head_dim": lc.qk_nope_head_dim,
            "qk_rope_head_dim": lc.qk_rope_head_dim, "v_head_dim": lc.v_head_dim, "rope_interleave": True}


# ---- weights ----------------------------------------------------------------------------------------------


def _flat_params(params: dict) -> dict[str, object]:
    flat = {k: v for k, v in params.items() if k not in ("layers", "d2t", "t2d")}
    for i, layer in enumerate(params.get("layers", [])):
        for n, v in layer.items():
            flat[f"layers.{i}.{n}"] = v
    return flat


def hf_draft_tensors(cfg: DraftConfig, params: dict, vocab: DraftVocab | None, *, dtype="bfloat16",
                     include_embed: bool = False) -> dict[str, np.ndarray]:
    """HF key -> array ([out, in] matrices in `dtype`; d2t int64, t2d bool) for a draft param tree."""
    out_dt = _OUT_DTYPES.get(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    if out_dt is None or out_dt not in _OUT_DTYPES.values():
        raise ValueError(f"export dtype {dtype!r} is not supported; use one of {', '.join(_OUT_DTYPES)}")
    if "layers" not in params or len(params["layers"]) != cfg.layers.num_layers:
        raise ValueError(f"params must hold 'layers', a list of {cfg.layers.num_layers} layer dicts (num_hidden_layers)")
    specs = draft_specs(cfg, with_embed=include_embed)
    flat = _flat_params(params)
    if include_embed and "embed" not in flat:
        raise ValueError("include_embed=True but params has no 'embed'")
    if not include_embed and cfg.hidden_size != cfg.target_hidden_size:
        raise ValueError(
            f"the draft's hidden_size ({cfg.hidden_size}) differs from the target's ({cfg.target_hidden_size}), so "
            "loaders cannot share the target embedding; export with include_embed=True"
        )
    if not include_embed:
        flat.pop("embed", None)
    extra = sorted(set(flat) - set(specs))
    missing = sorted(set(specs) - set(flat))
    if extra or missing:
        raise ValueError(f"draft params do not match the config: missing {missing[:8]}, unexpected {extra[:8]}")
    single = cfg.layers.num_layers == 1
    tensors: dict[str, np.ndarray] = {}
    for name, spec in specs.items():
        arr = np.asarray(jax.device_get(flat[name]))
        if tuple(arr.shape) != spec.shape:
            raise ValueError(f"draft param {name!r} has shape {tuple(arr.shape)}, expected {spec.shape} from the config")
        arr = arr.astype(np.float32)
        if arr.ndim == 2 and name != "embed":
            arr = arr.T  # [in, out] -> HF [out, in]
        if name.startswith("layers."):
            _, idx, sub = name.split(".", 2)
            key = ("midlayer." if single else f"layers.{idx}.") + _LAYER_KEYS[sub]
        else:
            key = _TOP_KEYS.get(name) or f"{name}.weight"  # input_norm, fc_norm.{i}: their HF names
        tensors[key] = np.ascontiguousarray(arr.astype(out_dt))

    v, vd = cfg.vocab_size, cfg.draft_vocab_size
    if vocab is None and "d2t" in params:
        vocab = DraftVocab.from_d2t(np.asarray(jax.device_get(params["d2t"])), v)
    if cfg.has_draft_vocab:
        if vocab is None:
            raise ValueError(f"draft_vocab_size={vd} < vocab_size={v}: pass the DraftVocab (or params with 'd2t')")
        if vocab.vocab_size != v or vocab.draft_vocab_size != vd:
            raise ValueError(f"DraftVocab is [{vocab.draft_vocab_size} of {vocab.vocab_size}] but the config says "
                             f"draft_vocab_size={vd}, vocab_size={v}")
        if "d2t" in params and not np.array_equal(np.asarray(jax.device_get(params["d2t"]), np.int64), vocab.d2t):
            raise ValueError("params['d2t'] disagrees with the DraftVocab passed; export the vocabulary the draft was trained with")
        tensors["d2t"] = np.asarray(vocab.d2t, np.int64)
        tensors["t2d"] = np.asarray(vocab.t2d, np.bool_)
    elif vocab is not None and vocab.draft_vocab_size != v:
        raise ValueError(f"the config has the full vocabulary ({v}) but the DraftVocab has {vocab.draft_vocab_size} ids")
    return tensors



def export_hf_draft(out_dir: str | os.PathLike, cfg: DraftConfig, params: dict, vocab: DraftVocab | None = None, *,
                    dtype: str = "bfloat16", include_embed: bool = False, overwrite: bool = False,
                    extra_files: dict[str, str] | None = None) -> str:
    """Write `params` (the tree `draft._assemble` builds) as an HF EAGLE-3 draft folder; returns its path.

    `vocab` supplies d2t / t2d when the draft vocabulary is reduced (else taken from params['d2t']).
    An existing `out_dir` (not empty) is replaced only with `overwrite`, and only once the new
    folder is complete (`checkpoint.atomic`). `extra_files` (name -> text) are written beside the
    weights, inside the same swap (a training log).
    """
    if not isinstance(cfg, DraftConfig):
        raise TypeError(f"cfg must be an eagle3_jax.models.draft.DraftConfig; got {type(cfg).__name__}")
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    tensors = hf_draft_tensors(cfg, params, vocab, dtype=name, include_embed=include_embed)
    config = draft_config_json(cfg, name)
    out = os.path.abspath(os.fspath(out_dir))
    with atomic_dir(out, "EAGLE-3 draft export", overwrite=overwrite) as tmp:
        write_safetensors(os.path.join(tmp, "model.safetensors"), tensors)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        for name, text in (extra_files or {}).items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
    return out
