"""The target's parameter layout: names, shapes, logical axes; flat <-> stacked trees.

Checkpoints (HF and Orbax) speak the *flat* layout, one entry per tensor and layer:
`embed`, `final_norm`, `lm_head`, `layers.{i}.{name}`. The forward pass consumes the *stacked*
layout: `{"embed", "final_norm", "lm_head"?, "segments": ({name: [n, ...]}, ...)}`, where each
segment is a run of same-kind layers (`ModelConfig.segments`) stacked on a leading axis so one
`lax.scan` runs it. Matrices are stored `[in, out]` (HF's transposed) so the forward is `x @ w`.
Router weights and the routing bias stay float32 whatever the model dtype (routing is fp32).

A weight the checkpoint stores quantized (per `config.QuantConfig`: its method and ignore list)
has `spec.quant` set and lives on device as a `quant.QArray` of the same logical shape and axes;
`QuantConfig.resident=False` (dequantize on load) clears it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import numpy as np

from ..config.draft import DraftConfig
from ..config.model import ModelConfig, QuantConfig
from .keymap import canonical_hf_key
from .lazy import LazyArray
from .quant import QArray, QFormat


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, one per dim (see runtime/sharding.py)
    float32: bool = False  # kept in float32 regardless of the model dtype
    quant: QFormat | None = None  # stored quantized on device (a QArray of this logical shape)

    def nbytes(self, dtype) -> int:
        """Bytes on device for a compute dtype (quantized: packed values + scales)."""
        if self.quant is not None:
            return self.quant.nbytes(self.shape)
        return int(np.prod(self.shape)) * np.dtype(np.float32 if self.float32 else dtype).itemsize


def qformat_for(q: QuantConfig) -> QFormat:
    """The on-device format of the weights a QuantConfig quantizes (block in our [in, out] orientation)."""
    if q.method == "fp8_block":
        return QFormat("fp8_block", (q.block_size[1], q.block_size[0]), "float32", fnuz=q.fnuz)
    if q.method == "int4_pack":
        return QFormat("int4", (q.group_size, 1), "bfloat16", act=q.activations)
    if q.method == "mxfp4":
        return QFormat("mxfp4", (32, 1), "uint8")
    if q.method == "fp8_channel":
        return QFormat("fp8_channel", (0, 1), "float32", fnuz=q.fnuz)
    raise ValueError(f"unknown quantization method {q.method!r}")


def _is_linear(name: str, spec: ParamSpec) -> bool:
    short = name.rsplit(".", 1)[-1]
    return len(spec.shape) >= 2 and not spec.float32 and short != "embed"


def with_quant(specs: dict[str, ParamSpec], q: QuantConfig | None, module_of) -> dict[str, ParamSpec]:
    """Mark the linear weights `q` stores quantized; `module_of(name)` gives a flat name's HF module."""
    if q is None or not q.resident:
        return specs
    fmt = qformat_for(q)
    out = {}
    for name, spec in specs.items():
        quantized = _is_linear(name, spec) and q.covers(module_of(name))
        if name == "lm_head" and q.method == "fp8_block":
            quantized = False  # block-fp8 exports keep the LM head in bf16
        out[name] = dataclasses.replace(spec, quant=fmt) if quantized else spec
    return out


def _hf_module(cfg: ModelConfig):
    def module_of(name: str) -> str:
        key = canonical_hf_key(name, cfg)
        return key[: -len(".weight")] if key.endswith(".weight") else key

    return module_of


def attention_specs(cfg: ModelConfig, input_width: int | None = None) -> dict[str, ParamSpec]:
    """Specs of one attention block. `input_width` is the width the projections read (default
    hidden_size; an EAGLE-3 draft's first layer reads 2 x hidden); the output is hidden_size wide."""
    h = cfg.hidden_size
    w = input_width or h
    if cfg.attention == "mla":
        nh, qk, r = cfg.num_heads, cfg.qk_head_dim, cfg.kv_lora_rank
        s: dict[str, ParamSpec] = {}
        if cfg.q_lora_rank is None:
            s["q_proj"] = ParamSpec((w, nh * qk), ("embed", "q_heads"))
        else:
            s["q_a_proj"] = ParamSpec((w, cfg.q_lora_rank), ("embed", "q_lora"))
            s["q_a_norm"] = ParamSpec((cfg.q_lora_rank,), ("q_lora",))
            s["q_b_proj"] = ParamSpec((cfg.q_lora_rank, nh * qk), ("q_lora", "q_heads"))
        s["kv_a_proj"] = ParamSpec((w, r + cfg.qk_rope_head_dim), ("embed", "kv_lora"))
        s["kv_a_norm"] = ParamSpec((r,), ("kv_lora",))
        s["kv_b_proj"] = ParamSpec((r, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)), ("kv_lora", "q_heads"))
        s["o_proj"] = ParamSpec((nh * cfg.v_head_dim, h), ("q_heads", "embed"))
        return s
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    s = {
        "q_proj": ParamSpec((w, qd), ("embed", "q_heads")),
        "k_proj": ParamSpec((w, kd), ("embed", "kv_heads")),
        "v_proj": ParamSpec((w, kd), ("embed", "kv_heads")),
        "o_proj": ParamSpec((qd, h), ("q_heads", "embed")),
    }
    if cfg.qk_norm:
        # Whole-vector norms: their weights are sharded like the projection columns they scale.
        s["q_norm"] = ParamSpec((qd,), ("q_heads",))
        s["k_norm"] = ParamSpec((kd,), ("kv_heads",))
    return s


def _dense_mlp_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "gate_proj": ParamSpec((h, i), ("embed", "mlp")),
        "up_proj": ParamSpec((h, i), ("embed", "mlp")),
        "down_proj": ParamSpec((i, h), ("mlp", "embed")),
    }


def _moe_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    s = {
        "router": ParamSpec((h, e), ("embed", None), float32=True),
        "experts_gate": ParamSpec((e, h, i), ("experts", "embed", "expert_mlp")),
        "experts_up": ParamSpec((e, h, i), ("experts", "embed", "expert_mlp")),
        "experts_down": ParamSpec((e, i, h), ("experts", "expert_mlp", "embed")),
    }
    if cfg.use_routing_bias:
        s["router_bias"] = ParamSpec((e,), (None,), float32=True)
    if cfg.shared_intermediate_size:
        si = cfg.shared_intermediate_size
        s["shared_gate"] = ParamSpec((h, si), ("embed", "mlp"))
        s["shared_up"] = ParamSpec((h, si), ("embed", "mlp"))
        s["shared_down"] = ParamSpec((si, h), ("mlp", "embed"))
    return s


def layer_specs(cfg: ModelConfig, kind: str) -> dict[str, ParamSpec]:
    """Specs of one layer of `kind` ("dense" | "moe")."""
    h = cfg.hidden_size
    s = {"attn_norm": ParamSpec((h,), ("norm",)), "mlp_norm": ParamSpec((h,), ("norm",))}
    s.update(attention_specs(cfg))
    s.update(_moe_specs(cfg) if kind == "moe" else _dense_mlp_specs(cfg))
    return s


def flat_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every tensor of the model in the flat (checkpoint) layout."""
    s = {
        "embed": ParamSpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed")),
        "final_norm": ParamSpec((cfg.hidden_size,), ("norm",)),
    }
    if not cfg.tie_word_embeddings:
        s["lm_head"] = ParamSpec((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
    for i in range(cfg.num_layers):
        kind = "moe" if cfg.is_moe_layer(i) else "dense"
        for name, spec in layer_specs(cfg, kind).items():
            s[f"layers.{i}.{name}"] = spec
    return with_quant(s, cfg.quant, _hf_module(cfg))


def segment_specs(cfg: ModelConfig) -> tuple[dict[str, ParamSpec], ...]:
    """Per segment, the spec of each stacked leaf (with the leading `layers` axis); a segment's
    leaf is quantized when its layers are (the ignore rules never split a run of same-kind layers
    here; `stack_flat` checks)."""
    flat = flat_specs(cfg)
    out = []
    for kind, start, stop in cfg.segments:
        seg = {}
        for name in layer_specs(cfg, kind):
            spec = flat[f"layers.{start}.{name}"]
            seg[name] = dataclasses.replace(spec, shape=(stop - start,) + spec.shape, axes=("layers",) + spec.axes)
        out.append(seg)
    return tuple(out)


def stacked_specs(cfg: ModelConfig) -> dict:
    """The stacked tree's specs: {embed, final_norm, lm_head?, segments: ({name: ParamSpec}, ...)}."""
    flat = flat_specs(cfg)
    tree: dict = {k: flat[k] for k in ("embed", "final_norm", "lm_head") if k in flat}
    tree["segments"] = segment_specs(cfg)
    return tree


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def stacked_axes(cfg: ModelConfig) -> dict:
    """Logical axes of the stacked tree (a leading `layers` axis on segment leaves); a quantized
    leaf's values and scales share the axes of the weight they stand for."""
    return jax.tree.map(lambda s: s.axes, stacked_specs(cfg), is_leaf=is_spec)


def abstract_leaf(spec: ParamSpec, dtype):
    """A ShapeDtypeStruct (or a QArray of them) for one parameter."""
    if spec.quant is None:
        return jax.ShapeDtypeStruct(spec.shape, np.float32 if spec.float32 else dtype)
    q = spec.quant
    return QArray(jax.ShapeDtypeStruct(q.values_shape(spec.shape), q.values_dtype),
                  jax.ShapeDtypeStruct(q.scales_shape(spec.shape), np.dtype(q.scale_dtype)), q)


def abstract_params(cfg: ModelConfig, dtype) -> dict:
    """The stacked parameter tree as shapes only (nothing allocated), quantized leaves included."""
    return jax.tree.map(lambda s: abstract_leaf(s, dtype), stacked_specs(cfg), is_leaf=is_spec)


def _stack(leaves: list, name: str):
    """np.stack over layers for plain arrays and QArrays (which must share a format)."""
    if isinstance(leaves[0], QArray):
        if any(not isinstance(q, QArray) or q.qformat != leaves[0].qformat for q in leaves):
            raise ValueError(f"layers of {name} mix quantized formats; every layer of a run must share one")
        return QArray(_stack_arrays([q.values for q in leaves]), _stack_arrays([q.scales for q in leaves]),
                      leaves[0].qformat)
    return _stack_arrays(leaves)


def _stack_arrays(arrays: list):
    """np.stack, kept lazy for lazily read checkpoint tensors."""
    if any(isinstance(a, LazyArray) for a in arrays):
        return LazyArray.stack(arrays)
    return np.stack([np.asarray(a) for a in arrays])


def stack_flat(flat: Mapping, cfg: ModelConfig) -> dict:
    """Flat -> stacked layout (host arrays or QArrays; no validation beyond what stacking needs)."""
    tree: dict = {k: flat[k] for k in ("embed", "final_norm", "lm_head") if k in flat}
    segs = []
    for kind, start, stop in cfg.segments:
        names = layer_specs(cfg, kind)
        segs.append({n: _stack([flat[f"layers.{i}.{n}"] for i in range(start, stop)], n) for n in names})
    tree["segments"] = tuple(segs)
    return tree


def unstack_to_flat(tree: Mapping, cfg: ModelConfig) -> dict:
    """Stacked -> flat layout (inverse of `stack_flat`)."""
    host = lambda a: a if isinstance(a, QArray) else np.asarray(a)  # noqa: E731
    flat = {k: host(tree[k]) for k in ("embed", "final_norm", "lm_head") if k in tree}
    for (kind, start, stop), seg in zip(cfg.segments, tree["segments"]):
        for name, arr in seg.items():
            a = host(arr)
            for j, i in enumerate(range(start, stop)):
                flat[f"layers.{i}.{name}"] = a[j]
    return flat


FEATURE_LAYERS = 3  # target feature layers an EAGLE-3 draft reads


def feature_norm_names(cfg: DraftConfig) -> list[str]:
    """The draft's norms over the target features before fc: `input_norm` (norm_before_fc) and
    `fc_norm.{i}`, one per feature layer (fc_norm, EAGLE 3.1), in the order they apply."""
    return (["input_norm"] if cfg.norm_before_fc else []) + (
        [f"fc_norm.{i}" for i in range(FEATURE_LAYERS)] if cfg.fc_norm else [])


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
    for name in feature_norm_names(cfg):  # norm_before_fc: over the concatenation; fc_norm: per feature
        width = 3 * cfg.target_hidden_size if name == "input_norm" else cfg.target_hidden_size
        s[name] = ParamSpec((width,), ("norm",))
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
