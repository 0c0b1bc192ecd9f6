"""HF `config.json` -> frozen, hashable dataclasses.

Configs are passed to jitted functions as static arguments, so every field is an immutable
scalar, string or tuple. One `ModelConfig` covers the three target families; which branches a
model uses is decided by `family`, `attention` and the MoE fields.

Supported `model_type`s: see `SUPPORTED_MODEL_TYPES`. Both rope spellings found in the wild are
accepted: `rope_scaling` (+ top-level `rope_theta`) and transformers-5 `rope_parameters`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import math
import os
import re
from typing import Any, Mapping

# model_type -> family. kimi_k2 is the DeepSeek-V3 architecture under another name; kimi_k25 wraps
# a DeepSeek-V3 `text_config` plus a vision tower we do not serve.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "minimax_m2": "minimax_m2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

logger = logging.getLogger(__name__)

# transformers' DeepseekV3Config defaults for the MoE fields: a config.json that leaves one out
# means this value to transformers (a full DeepSeek-V3 MoE), so it means the same here. A dense
# DeepSeek-V3-architecture model says so with n_routed_experts = 0.
DEEPSEEK_V3_MOE_DEFAULTS: dict[str, Any] = {
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
}
# The fields that decide which expert tensors a checkpoint must hold: defaulting one is announced.
_MOE_SHAPE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


class ConfigError(ValueError):
    """A config.json this project cannot serve, with the reason and the fix."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `dim` is the number of rotated channels per head."""

    theta: float
    dim: int
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    # DeepSeek rotates interleaved channel pairs (x0, x1), (x2, x3)...; Llama/MiniMax rotate halves.
    interleaved: bool = False


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint's weights are stored, and how they run.

    `method` is the stored format: "fp8_block" (DeepSeek-V3 / MiniMax-M2), "int4_pack"
    (compressed-tensors, Kimi-K2.5 routed experts), "mxfp4" (AMD Quark OCP MXFP4) or
    "fp8_channel" (AMD Quark ptpc_fp8 drafts). `ignore` lists the modules stored unquantized
    (exact module names, dotted suffixes such as "lm_head", "re:" regexes, or "*" globs).
    The run-time fields are set by `load_target` / `load_draft`: `resident` keeps weights packed on
    device (False dequantizes everything on load), `activations` "int8" runs int4 weights as W4A8,
    `fnuz` stores float8 weights as e4m3fnuz (gfx942).
    """

    method: str  # "fp8_block" | "int4_pack" | "mxfp4" | "fp8_channel"
    block_size: tuple[int, int] = (128, 128)  # fp8_block, HF orientation (out, in)
    group_size: int = 32  # int4_pack, mxfp4
    num_bits: int = 4
    ignore: tuple[str, ...] = ()  # module names / "re:" patterns stored unquantized
    resident: bool = True
    activations: str = "float"  # "float" | "int8" (W4A8, int4_pack only)
    fnuz: bool = False

    def covers(self, module: str) -> bool:
        """Whether the linear module `module` (HF name, e.g. "model.layers.3.mlp.experts.0.up_proj")
        is stored quantized, i.e. matches no `ignore` entry."""
        return not any(_module_matches(module, pattern) for pattern in self.ignore)


def _module_matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return module == pattern or module.endswith("." + pattern)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One target model (Llama, DeepSeek-V3/Kimi, MiniMax-M2)."""

    model_type: str
    family: str  # "llama" | "deepseek_v3" | "minimax_m2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention: str = "gqa"  # "gqa" | "mla"
    qk_norm: bool = False  # MiniMax-M2: RMSNorm over the whole projected q / k vector
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # total width of the shared expert(s); 0 = none
    scoring_func: str = "softmax"  # "softmax" | "sigmoid"
    use_routing_bias: bool = False  # e_score_correction_bias, for selection only
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # checkpoint
    key_prefix: str = ""  # "language_model." for Kimi-K2.5
    quant: QuantConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    aux_layer_ids: tuple[int, ...] = ()  # hidden_states indices captured for the draft
    # run time: which ops run Triton kernels, e.g. "attention=triton,moe=xla" (runtime/kernels.py; load_target's `kernels`)
    kernels: str = "xla"
    # run time: batch-invariant numerics (invariant.py; load_target's `batch_invariant`)
    batch_invariant: bool = False

    # ---- derived -----------------------------------------------------------------------------
    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @property
    def segments(self) -> tuple[tuple[str, int, int], ...]:
        """Runs of consecutive same-kind layers, as (kind, start, stop); each run is one scan."""
        runs: list[tuple[str, int, int]] = []
        for i in range(self.num_layers):
            kind = "moe" if self.is_moe_layer(i) else "dense"
            if runs and runs[-1][0] == kind:
                runs[-1] = (kind, runs[-1][1], i + 1)
            else:
                runs.append((kind, i, i + 1))
        return tuple(runs)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if self.attention == "mla" and r.rope_type == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    def with_aux_layers(self, ids: tuple[int, ...]) -> "ModelConfig":
        for i in ids:
            if not 0 <= i < self.num_layers:
                raise ConfigError(
                    f"aux hidden-state index {i} is out of range for a {self.num_layers}-layer "
                    f"target (valid: 0..{self.num_layers - 1}, the residual stream entering that layer)"
                )
        return dataclasses.replace(self, aux_layer_ids=tuple(int(i) for i in ids))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 default: the residual stream entering layers 2, L//2, L-3 (HF hidden_states idx).

    Clamped into 0..L-1 so that tiny (< 3 layer) test models still capture real layers.
    """
    last = max(num_layers - 1, 0)
    return (min(2, last), min(num_layers // 2, last), min(max(num_layers - 3, 0), last))


# ---- parsing ------------------------------------------------------------------------------------


def _require(d: Mapping[str, Any], key: str, model_type: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json for model_type={model_type!r} is missing required field {key!r}")
    return d[key]


def deepseek_moe_fields(d: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of a DeepSeek-V3-family config, transformers' defaults where it has none
    (null counts as none); logs a warning naming each defaulted field that shapes the experts."""
    fields = {k: (default if d.get(k) is None else d[k]) for k, default in DEEPSEEK_V3_MOE_DEFAULTS.items()}
    if not fields["n_routed_experts"]:  # dense: no experts to shape
        return dict(fields, num_experts_per_tok=0, moe_intermediate_size=0, n_shared_experts=0)
    missing = [k for k in _MOE_SHAPE_FIELDS if d.get(k) is None]
    if missing:
        _warn_once(f"config.json (model_type={model_type}) does not set {', '.join(missing)}; using transformers' "
                   f"DeepseekV3Config default{'s' * (len(missing) > 1)} "
                   f"{', '.join(f'{k}={fields[k]}' for k in missing)}. Set {'them' if len(missing) > 1 else 'it'} "
                   "in config.json (n_routed_experts: 0 for a dense model) if the checkpoint was made otherwise")
    return fields


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Log `message` as a warning the first time only (a config is parsed several times per load)."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _parse_rope(d: Mapping[str, Any], dim: int, interleaved: bool, model_type: str) -> RopeConfig:
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if isinstance(params, Mapping) and params:
        rp = dict(params)
    elif isinstance(scaling, Mapping) and scaling:
        rp = dict(scaling)
    else:
        rp = {}
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope type {rope_type!r} in {model_type!r} config is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    kw: dict[str, Any] = {}
    if rope_type in ("linear", "llama3", "yarn"):
        kw["factor"] = float(_require(rp, "factor", model_type))
    if rope_type == "llama3":
        kw["low_freq_factor"] = float(rp.get("low_freq_factor", 1.0))
        kw["high_freq_factor"] = float(rp.get("high_freq_factor", 4.0))
        kw["original_max_position_embeddings"] = int(_require(rp, "original_max_position_embeddings", model_type))
    if rope_type == "yarn":
        kw["original_max_position_embeddings"] = int(_require(rp, "original_max_position_embeddings", model_type))
        kw["beta_fast"] = float(rp.get("beta_fast") or 32.0)
        kw["beta_slow"] = float(rp.get("beta_slow") or 1.0)
        kw["mscale"] = float(rp.get("mscale") or 0.0)
        kw["mscale_all_dim"] = float(rp.get("mscale_all_dim") or 0.0)
        af = rp.get("attention_factor")
        kw["attention_factor"] = None if af is None else float(af)
        kw["truncate"] = bool(rp.get("truncate", True))
    return RopeConfig(theta=float(theta), dim=int(dim), rope_type=rope_type, interleaved=interleaved, **kw)


SUPPORTED_QUANT = (
    "fp8 with weight_block_size [128, 128]; compressed-tensors pack-quantized symmetric int4 (group); "
    "quark MXFP4 (fp4 per_group 32, e8m0 scales) or ptpc_fp8 (fp8_e4m3 per_channel weights)"
)


def _parse_quark(q: Mapping[str, Any]) -> QuantConfig:
    """AMD Quark exports: OCP MXFP4 weights (Kimi-K2.5-MXFP4) or per-channel FP8 (ptpc_fp8)."""
    glob = q.get("global_quant_config") or {}
    w = glob.get("weight") if isinstance(glob, Mapping) else None
    if isinstance(w, list):  # some exports list one spec per weight
        w = w[0] if len(w) == 1 else None
    if not isinstance(w, Mapping):
        raise ConfigError(f"quark quantization_config needs global_quant_config.weight; supported: {SUPPORTED_QUANT}")
    if q.get("layer_quant_config") or q.get("layer_type_quant_config"):
        raise ConfigError("quark layer_quant_config / layer_type_quant_config (per-layer schemes) is not supported; "
                          "supported: one global_quant_config for every quantized layer")
    dtype, scheme = w.get("dtype"), w.get("qscheme")
    ignore = tuple(q.get("exclude") or ())
    if dtype == "fp4" and scheme == "per_group":
        group = int(w.get("group_size") or 0)
        fmt = w.get("scale_format", "e8m0")
        if group != 32 or fmt != "e8m0":
            raise ConfigError(f"quark fp4 weights with group_size={group}, scale_format={fmt!r} are not supported; "
                              "supported: OCP MXFP4 (group_size 32, e8m0 scales)")
        return QuantConfig(method="mxfp4", group_size=32, num_bits=4, ignore=ignore)
    if dtype in ("fp8_e4m3", "fp8_e4m3fn") and scheme == "per_channel":
        if int(w.get("ch_axis", 0)) != 0:
            raise ConfigError(f"quark fp8 per_channel weights need ch_axis 0 (one scale per output row); got {w.get('ch_axis')}")
        return QuantConfig(method="fp8_channel", num_bits=8, ignore=ignore)
    raise ConfigError(f"quark weight dtype {dtype!r} with qscheme {scheme!r} is not supported; supported: {SUPPORTED_QUANT}")


def _parse_quant(q: Mapping[str, Any] | None) -> QuantConfig | None:
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not block or len(block) != 2:
            raise ConfigError("fp8 quantization_config needs weight_block_size [128, 128]; per-tensor fp8 is not supported")
        ignore = tuple(q.get("modules_to_not_convert") or ())
        return QuantConfig(method="fp8_block", block_size=(int(block[0]), int(block[1])), num_bits=8, ignore=ignore)
    if method == "compressed-tensors":
        fmt = q.get("format")
        groups = q.get("config_groups") or {}
        if fmt != "pack-quantized" or len(groups) != 1:
            raise ConfigError(
                f"compressed-tensors format {fmt!r} with {len(groups)} groups is not supported; "
                "supported: pack-quantized int4, one config group"
            )
        w = next(iter(groups.values()))["weights"]
        if w.get("num_bits") != 4 or w.get("type") != "int" or not w.get("symmetric") or w.get("strategy") != "group":
            raise ConfigError(f"compressed-tensors weights {w} not supported; supported: symmetric int4 group quantization")
        group = int(w["group_size"])
        if group < 2 or group % 2:
            raise ConfigError(f"compressed-tensors int4 group_size={group} is not supported; use an even group size (32 in Kimi-K2.5)")
        return QuantConfig(method="int4_pack", group_size=group, num_bits=4, ignore=tuple(q.get("ignore") or ()))
    if method == "quark":
        return _parse_quark(q)
    raise ConfigError(f"quantization method {method!r} is not supported; supported: {SUPPORTED_QUANT}")


def _eos_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in v) if isinstance(v, (list, tuple)) else (int(v),)


def parse_model_config(raw: Mapping[str, Any]) -> ModelConfig:
    """Build a `ModelConfig` from a parsed HF config.json dict."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config.json must hold a JSON object; got {type(raw).__name__}")
    try:
        return _parse_model_config(raw)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config.json for model_type={raw.get('model_type')!r} has a field of the wrong type: {e}") from e


def _parse_model_config(raw: Mapping[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    family = SUPPORTED_MODEL_TYPES[model_type]
    d = dict(raw)
    key_prefix = ""
    quant_raw = d.get("quantization_config")
    if model_type == "kimi_k25":
        text = d.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError("kimi_k25 config.json is missing required field 'text_config'")
        d = dict(text)
        quant_raw = quant_raw or d.get("quantization_config")
        key_prefix = "language_model."
        inner = d.get("model_type", "deepseek_v3")
        if SUPPORTED_MODEL_TYPES.get(inner) != "deepseek_v3":
            raise ConfigError(f"kimi_k25 text_config has model_type {inner!r}; expected deepseek_v3 or kimi_k2")

    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported; supported: silu")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ConfigError("attention_bias / mlp_bias = true is not supported by the target models here")

    req = lambda k: _require(d, k, model_type)  # noqa: E731
    hidden = int(req("hidden_size"))
    heads = int(req("num_attention_heads"))
    num_layers = int(req("num_hidden_layers"))
    common = dict(
        model_type=model_type,
        family=family,
        vocab_size=int(req("vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", d.get("tie_word_embeddings", False)))
        if model_type != "kimi_k25"
        else bool(d.get("tie_word_embeddings", False)),
        key_prefix=key_prefix,
        quant=_parse_quant(quant_raw),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_ids(d.get("eos_token_id")),
        aux_layer_ids=default_aux_layer_ids(num_layers),
    )

    if family == "llama":
        head_dim = int(d.get("head_dim") or hidden // heads)
        return ModelConfig(
            **common,
            head_dim=head_dim,
            intermediate_size=int(req("intermediate_size")),
            rope=_parse_rope(d, head_dim, interleaved=False, model_type=model_type),
        )

    if family == "deepseek_v3":
        topk_method = d.get("topk_method", "noaux_tc")
        scoring = d.get("scoring_func", "sigmoid")
        if topk_method != "noaux_tc" or scoring != "sigmoid":
            raise ConfigError(
                f"DeepSeek routing topk_method={topk_method!r}, scoring_func={scoring!r} is not supported; "
                "supported: noaux_tc with sigmoid (DeepSeek-V3, Kimi-K2/K2.5)"
            )
        nope, rope_dim = int(req("qk_nope_head_dim")), int(req("qk_rope_head_dim"))
        moe = deepseek_moe_fields(d, model_type)
        n_experts = int(moe["n_routed_experts"])
        n_group = int(moe["n_group"]) or 1
        if n_experts and n_experts % n_group:
            raise ConfigError(f"n_routed_experts={n_experts} is not divisible by n_group={n_group}")
        moe_inter = int(moe["moe_intermediate_size"])
        q_lora = d.get("q_lora_rank")
        return ModelConfig(
            **common,
            head_dim=nope + rope_dim,
            intermediate_size=int(req("intermediate_size")),
            rope=_parse_rope(d, rope_dim, interleaved=bool(d.get("rope_interleave", True)), model_type=model_type),
            attention="mla",
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(req("kv_lora_rank")),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(req("v_head_dim")),
            num_experts=n_experts,
            num_experts_per_tok=int(moe["num_experts_per_tok"]),
            moe_intermediate_size=moe_inter,
            shared_intermediate_size=moe_inter * int(moe["n_shared_experts"]),
            scoring_func="sigmoid",
            use_routing_bias=True,
            n_group=n_group,
            topk_group=int(moe["topk_group"]) or 1,
            norm_topk_prob=bool(moe["norm_topk_prob"]),
            routed_scaling_factor=float(moe["routed_scaling_factor"]),
            first_k_dense_replace=int(moe["first_k_dense_replace"]),
            moe_layer_freq=int(d.get("moe_layer_freq", 1)),
        )

    # minimax_m2
    head_dim = int(d.get("head_dim") or hidden // heads)
    rp = d.get("rope_parameters") or {}
    rotary_dim = d.get("rotary_dim")
    if rotary_dim is None:
        rotary_dim = int(head_dim * float(rp.get("partial_rotary_factor", 1.0)))
    if d.get("shared_intermediate_size"):
        raise ConfigError("minimax_m2 with shared_intermediate_size > 0 is not supported (no shared expert in MiniMax-M2)")
    scoring = d.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"minimax_m2 scoring_func {scoring!r} is not supported; supported: sigmoid")
    inter = int(req("intermediate_size"))
    return ModelConfig(
        **common,
        head_dim=head_dim,
        intermediate_size=inter,
        rope=_parse_rope(d, int(rotary_dim), interleaved=False, model_type=model_type),
        qk_norm=bool(d.get("use_qk_norm", True)),
        num_experts=int(req("num_local_experts")),
        num_experts_per_tok=int(req("num_experts_per_tok")),
        moe_intermediate_size=inter,
        scoring_func="sigmoid",
        use_routing_bias=bool(d.get("use_routing_bias", True)),
        norm_topk_prob=True,
    )


def one_moe_layer(raw: dict) -> dict:
    """A config (a whole HF config.json, or its text_config) cut to its dense layers plus one MoE
    layer; changed in place and returned."""
    text = raw.get("text_config", raw)
    text["num_hidden_layers"] = int(text.get("first_k_dense_replace", 0)) + 1
    return raw


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """Parse `path` (a config.json file or a folder holding one)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.isfile(p):
        raise ConfigError(f"no config.json at {p}; pass an HF model folder or an Orbax folder made by scripts/convert.py")
    try:
        with open(p) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e
    return parse_model_config(raw)
