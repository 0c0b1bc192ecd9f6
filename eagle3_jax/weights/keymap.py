"""HF tensor keys <-> our flat parameter names, per model family.

`map_hf_key` says where one logical HF weight goes (or that it is skipped on purpose, or that it
is unknown, which the loader reports as an error); `canonical_hf_keys` goes the other way, to
name the HF key a missing parameter should have come from. Keys here are *logical* weights:
quantization companions (`weight_scale_inv`, `weight_packed`, ...) are folded into their weight by
the loader before mapping. Our matrices are `[in, out]`, HF's nn.Linear `[out, in]`, hence the
`transpose` flags; experts are stacked on a leading axis.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from ..config.model import ModelConfig

# Top-level prefixes of the Kimi-K2.5 vision stack: present in the checkpoint, not served here.
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MOE_PREFIXES = ("mlp.", "block_sparse_moe.")
# Per-expert projection names: DeepSeek/Kimi (gate/up/down_proj) and MiniMax (w1/w3/w2).
_EXPERT_NAMES = {
    "gate_proj": "experts_gate",
    "up_proj": "experts_up",
    "down_proj": "experts_down",
    "w1": "experts_gate",
    "w3": "experts_up",
    "w2": "experts_down",
}
_EXPERT_RE = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# transformers-5 in-memory fused layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
_FUSED_RE = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where (part of) one HF tensor lands in the flat layout.

    `expert` is the slot on the stacked expert axis for per-expert tensors; `fused` is "gate",
    "up" or "down" for a slice of a fused [E, ...] expert tensor (whose last two axes transpose).
    """

    flat: str
    transpose: bool
    expert: int | None = None
    fused: str | None = None


SKIP: tuple[Target, ...] = ()


def _attention_entries(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    if cfg.attention == "mla":
        e = []
        if cfg.q_lora_rank is None:
            e.append(("self_attn.q_proj.weight", "q_proj", True))
        else:
            e += [
                ("self_attn.q_a_proj.weight", "q_a_proj", True),
                ("self_attn.q_a_layernorm.weight", "q_a_norm", False),
                ("self_attn.q_b_proj.weight", "q_b_proj", True),
            ]
        return e + [
            ("self_attn.kv_a_proj_with_mqa.weight", "kv_a_proj", True),
            ("self_attn.kv_a_layernorm.weight", "kv_a_norm", False),
            ("self_attn.kv_b_proj.weight", "kv_b_proj", True),
            ("self_attn.o_proj.weight", "o_proj", True),
        ]
    e = [(f"self_attn.{p}_proj.weight", f"{p}_proj", True) for p in ("q", "k", "v", "o")]
    if cfg.qk_norm:
        e += [("self_attn.q_norm.weight", "q_norm", False), ("self_attn.k_norm.weight", "k_norm", False)]
    return e


def _moe_entries(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """Non-expert MoE tensors. The family's own spelling comes first (it is the canonical name in
    error messages); the other prefix is accepted too, which also covers transformers-5 names."""
    prefixes = _MOE_PREFIXES[::-1] if cfg.family == "minimax_m2" else _MOE_PREFIXES
    e: list[tuple[str, str, bool]] = []
    for p in prefixes:
        e.append((f"{p}gate.weight", "router", True))
    if cfg.use_routing_bias:
        biases = ("gate.e_score_correction_bias", "e_score_correction_bias")
        if cfg.family == "minimax_m2":
            biases = biases[::-1]
        for p in prefixes:
            e += [(p + b, "router_bias", False) for b in biases]
    if cfg.shared_intermediate_size:
        for p in prefixes:
            e += [(f"{p}shared_experts.{x}_proj.weight", f"shared_{x}", True) for x in ("gate", "up", "down")]
    return e


@functools.lru_cache(maxsize=64)
def _layer_table(cfg: ModelConfig, moe: bool) -> dict[str, tuple[str, bool]]:
    """HF key (relative to `model.layers.{i}.`) -> (our name, transpose) for non-expert tensors."""
    entries = [
        ("input_layernorm.weight", "attn_norm", False),
        ("post_attention_layernorm.weight", "mlp_norm", False),
        *_attention_entries(cfg),
    ]
    if moe:
        entries += _moe_entries(cfg)
    else:
        entries += [(f"mlp.{x}_proj.weight", f"{x}_proj", True) for x in ("gate", "up", "down")]
    return {k: (n, t) for k, n, t in entries}


def strip_prefix(key: str, cfg: ModelConfig) -> str | None:
    """The key without `cfg.key_prefix`, or None when it lacks the prefix."""
    if not cfg.key_prefix:
        return key
    return key[len(cfg.key_prefix) :] if key.startswith(cfg.key_prefix) else None


def map_hf_key(key: str, cfg: ModelConfig) -> tuple[Target, ...] | None:
    """Targets of one logical HF weight: a tuple of Targets, `SKIP` (empty) when the tensor is
    deliberately not loaded, or None when it is not part of this model (an error upstream)."""
    if key.startswith(SKIPPED_PREFIXES) or key.endswith(".inv_freq"):
        return SKIP
    rel = strip_prefix(key, cfg)
    if rel is None:
        return None
    if rel.startswith(SKIPPED_PREFIXES):
        return SKIP
    if rel == "model.embed_tokens.weight":
        return (Target("embed", False),)
    if rel == "model.norm.weight":
        return (Target("final_norm", False),)
    if rel == "lm_head.weight":
        return SKIP if cfg.tie_word_embeddings else (Target("lm_head", True),)
    m = _LAYER_RE.match(rel)
    if m is None:
        return None
    i, sub = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers:  # DeepSeek-V3 / MiniMax MTP layers ship after the decoder stack
        return SKIP
    moe = cfg.is_moe_layer(i)
    hit = _layer_table(cfg, moe).get(sub)
    if hit is not None:
        return (Target(f"layers.{i}.{hit[0]}", hit[1]),)
    if not moe:
        return None
    m = _EXPERT_RE.match(sub)
    if m is not None:
        e = int(m.group(1))
        if e >= cfg.num_experts:
            return None
        return (Target(f"layers.{i}.{_EXPERT_NAMES[m.group(2)]}", True, expert=e),)
    m = _FUSED_RE.match(sub)
    if m is not None:
        if m.group(1) == "down_proj":
            return (Target(f"layers.{i}.experts_down", True, fused="down"),)
        return (
            Target(f"layers.{i}.experts_gate", True, fused="gate"),
            Target(f"layers.{i}.experts_up", True, fused="up"),
        )
    return None


@functools.lru_cache(maxsize=64)
def _canonical(cfg: ModelConfig) -> dict[str, str]:
    out = {
        "embed": "model.embed_tokens.weight",
        "final_norm": "model.norm.weight",
        "lm_head": "lm_head.weight",
    }
    for i in range(cfg.num_layers):
        for sub, (name, _) in _layer_table(cfg, cfg.is_moe_layer(i)).items():
            out.setdefault(f"layers.{i}.{name}", f"model.layers.{i}.{sub}")
    return {k: cfg.key_prefix + v for k, v in out.items()}


def expert_hf_key(cfg: ModelConfig, layer: int, name: str, expert: int) -> str:
    """Canonical per-expert HF key (DeepSeek: mlp.experts.E.gate_proj; MiniMax: block_sparse_moe.experts.E.w1)."""
    if cfg.family == "minimax_m2":
        proj = {"experts_gate": "w1", "experts_up": "w3", "experts_down": "w2"}[name]
        sub = f"block_sparse_moe.experts.{expert}.{proj}.weight"
    else:
        proj = {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}[name]
        sub = f"mlp.experts.{expert}.{proj}.weight"
    return f"{cfg.key_prefix}model.layers.{layer}.{sub}"


def canonical_hf_key(flat: str, cfg: ModelConfig) -> str:
    """The HF key a flat parameter normally comes from (experts: expert 0's key)."""
    table = _canonical(cfg)
    if flat in table:
        return table[flat]
    parts = flat.split(".")
    if len(parts) == 3 and parts[2].startswith("experts_"):
        return expert_hf_key(cfg, int(parts[1]), parts[2], 0)
    return flat
