"""The target's parameter layout: names, shapes, logical axes; flat <-> stacked trees.

Checkpoints (HF and Orbax) speak the *flat* layout, one entry per tensor and layer:
`embed`, `final_norm`, `lm_head`, `layers.{i}.{name}`. The forward pass consumes the *stacked*
layout: `{"embed", "final_norm", "lm_head"?, "segments": ({name: [n, ...]}, ...)}`, where each
segment is a run of same-kind layers (`ModelConfig.segments`) stacked on a leading axis so one
`lax.scan` runs it. Matrices are stored `[in, out]` (HF's transposed) so the forward is `x @ w`.
Router weights and the routing bias stay float32 whatever the model dtype (routing is fp32).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from .config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, one per dim (see sharding.py)
    float32: bool = False  # kept in float32 regardless of the model dtype


def _attention_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    h = cfg.hidden_size
    if cfg.attention == "mla":
        nh, qk, r = cfg.num_heads, cfg.qk_head_dim, cfg.kv_lora_rank
        s: dict[str, ParamSpec] = {}
        if cfg.q_lora_rank is None:
            s["q_proj"] = ParamSpec((h, nh * qk), ("embed", "q_heads"))
        else:
            s["q_a_proj"] = ParamSpec((h, cfg.q_lora_rank), ("embed", "q_lora"))
            s["q_a_norm"] = ParamSpec((cfg.q_lora_rank,), ("q_lora",))
            s["q_b_proj"] = ParamSpec((cfg.q_lora_rank, nh * qk), ("q_lora", "q_heads"))
        s["kv_a_proj"] = ParamSpec((h, r + cfg.qk_rope_head_dim), ("embed", "kv_lora"))
        s["kv_a_norm"] = ParamSpec((r,), ("kv_lora",))
        s["kv_b_proj"] = ParamSpec((r, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)), ("kv_lora", "q_heads"))
        s["o_proj"] = ParamSpec((nh * cfg.v_head_dim, h), ("q_heads", "embed"))
        return s
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    s = {
        "q_proj": ParamSpec((h, qd), ("embed", "q_heads")),
        "k_proj": ParamSpec((h, kd), ("embed", "kv_heads")),
        "v_proj": ParamSpec((h, kd), ("embed", "kv_heads")),
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
    s.update(_attention_specs(cfg))
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
    return s


def stacked_axes(cfg: ModelConfig) -> dict:
    """Logical axes of the stacked tree (a leading `layers` axis on segment leaves)."""
    tree: dict = {"embed": ("vocab", "embed"), "final_norm": ("norm",)}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = ("embed", "vocab")
    tree["segments"] = tuple(
        {name: ("layers",) + spec.axes for name, spec in layer_specs(cfg, kind).items()}
        for kind, _, _ in cfg.segments
    )
    return tree


def stack_flat(flat: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Flat -> stacked layout (host arrays; no validation beyond what stacking needs)."""
    tree: dict = {k: flat[k] for k in ("embed", "final_norm", "lm_head") if k in flat}
    segs = []
    for kind, start, stop in cfg.segments:
        names = layer_specs(cfg, kind)
        segs.append({n: np.stack([np.asarray(flat[f"layers.{i}.{n}"]) for i in range(start, stop)]) for n in names})
    tree["segments"] = tuple(segs)
    return tree


def unstack_to_flat(tree: Mapping, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Stacked -> flat layout (inverse of `stack_flat`)."""
    flat = {k: np.asarray(tree[k]) for k in ("embed", "final_norm", "lm_head") if k in tree}
    for (kind, start, stop), seg in zip(cfg.segments, tree["segments"]):
        for name, arr in seg.items():
            a = np.asarray(arr)
            for j, i in enumerate(range(start, stop)):
                flat[f"layers.{i}.{name}"] = a[j]
    return flat
