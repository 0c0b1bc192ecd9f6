"""Reading an EAGLE-3 draft checkpoint (model.safetensors in any sharding, or pytorch_model.bin
through torch's weights-only loader): HF keys mapped to the draft's flat names, every tensor
checked against the layout its config.json implies, matrices turned to [in, out], per-channel
FP8 weights (AMD Quark ptpc_fp8) folded with their scales into QArrays."""

from __future__ import annotations

import dataclasses
import os
import re

import ml_dtypes
import numpy as np

from ..config.draft import DraftConfig
from ..weights.params import draft_specs, qformat_for
from ..weights.quant import QArray
from .errors import CheckpointError
from .quant import fp8_e4m3fn_to_fnuz
from .safetensors_io import find_pickles, open_hf_checkpoint


def read_draft_checkpoint(path: str, cfg: DraftConfig, fnuz: bool) -> dict:
    """The draft folder `path`'s weights as flat name -> array [in, out] (FP8 layer weights as
    QArrays, float8 values in e4m3fnuz when `fnuz`); raises CheckpointError naming what does not
    match `cfg`."""
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
    return _fold_fp8_scales(flat, scales, cfg, path, fnuz)


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
    if key == "input_norm.weight":  # norm_before_fc
        return "input_norm"
    feature_norm = re.fullmatch(r"fc_norm\.(\d+)\.weight", key)  # EAGLE 3.1's fc_norm
    if feature_norm:
        return f"fc_norm.{feature_norm.group(1)}"
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
    if not any(f.endswith(".safetensors") for f in os.listdir(path)) and find_pickles(path):
        bins = [os.path.join(path, f) for f in find_pickles(path) if f.endswith(".bin")]
        try:
            import torch  # optional and heavy: only pytorch_model.bin drafts need it
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


def _fold_fp8_scales(flat: dict, scales: dict, cfg: DraftConfig, path: str, fnuz: bool) -> dict:
    """Per-channel FP8 weights [in, out] (already transposed) + scales [out] -> QArrays."""
    fp8 = [n for n, a in flat.items() if np.dtype(a.dtype) == np.dtype(ml_dtypes.float8_e4m3fn)]
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
