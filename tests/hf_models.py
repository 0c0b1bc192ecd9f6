"""Tiny random HF `transformers` models used as the numerical reference for the JAX targets.

Each entry of `CONFIGS` is a small config for one family (Llama, DeepSeek-V3 / Kimi-K2.5 backbone,
MiniMax-M2) chosen so that together they exercise every branch of the target code: tied / untied
embeddings, GQA ratios, explicit head_dim, default / llama3 / YaRN rotary (with and without
`mscale_all_dim`), interleaved vs half-split rotary, partial rotary, q-LoRA on / off, dense-first
layers, shared experts, group-limited routing with a random `e_score_correction_bias`.

`build_hf_model(name, out_dir)` builds the model in float32 with eager attention, re-initialises
every weight with seeded random values large enough that all paths matter (the transformers
default init would leave routing biases at zero and norms at one, hiding bugs), saves it with
`save_pretrained` and returns the in-memory torch model for reference forwards.

What HF `output_hidden_states=True` returns in transformers 5 (checked in
`transformers/utils/output_capturing.py`): a tuple of `num_hidden_layers + 1` tensors;
`hidden_states[0]` is the embedding output (= the residual stream entering layer 0),
`hidden_states[i]` for 1 <= i < L is the output of decoder layer i-1 (= the residual stream
entering layer i, before any norm), and the LAST entry `hidden_states[L]` is overwritten with
`last_hidden_state`, i.e. it is AFTER the final RMSNorm. Aux ids are therefore restricted to
0..L-1, where the meaning is unambiguous.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Configs. `family` picks the transformers class; `kwargs` go to its config class.
# ---------------------------------------------------------------------------------------------

CONFIGS: dict[str, dict[str, Any]] = {
    # Llama: tied embeddings, GQA ratio 2, default rope.
    "llama_tied_gqa2": dict(
        family="llama",
        kwargs=dict(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, max_position_embeddings=128,
        ),
    ),
    # Llama: untied, llama3 rope scaling that bites at short lengths (original max 32), GQA ratio 4,
    # head_dim 16 so the low / smoothed / high frequency bands are all populated.
    "llama_llama3_gqa4": dict(
        family="llama",
        kwargs=dict(
            vocab_size=112, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, max_position_embeddings=128,
        ),
    ),
    # Llama: MHA with an explicit head_dim != hidden / heads.
    "llama_mha_headdim": dict(
        family="llama",
        kwargs=dict(
            vocab_size=100, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, head_dim=8, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, max_position_embeddings=128,
        ),
    ),
    # DeepSeek-V3: q-LoRA, YaRN with mscale / mscale_all_dim (softmax-scale path), 2 groups pick 1,
    # first layer dense, 2 shared experts.
    "dsv3_yarn_qlora": dict(
        family="deepseek_v3",
        kwargs=dict(
            vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=12,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                "beta_fast": 32.0, "beta_slow": 1.0,
            },
            rope_interleave=True, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
            tie_word_embeddings=False, num_mtp_layers=0,
        ),
    ),
    # DeepSeek-V3: no q-LoRA, default rope, one group, half-split (non-interleaved) rotary.
    "dsv3_plain": dict(
        family="deepseek_v3",
        kwargs=dict(
            vocab_size=100, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=0, routed_scaling_factor=1.5, norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rope_interleave=False, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, max_position_embeddings=128,
            tie_word_embeddings=False, num_mtp_layers=0,
        ),
    ),
    # DeepSeek-V3: YaRN without mscale_all_dim (the cos/sin `attention_factor` path), 4 groups pick 2.
    "dsv3_yarn_attnfactor_4groups": dict(
        family="deepseek_v3",
        kwargs=dict(
            vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.0, norm_topk_prob=True,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
            },
            rope_interleave=True, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
            tie_word_embeddings=False, num_mtp_layers=0,
        ),
    ),
    # Kimi-K2.5 text backbone (DeepSeek-V3 with n_group 1 / topk_group 1), saved in the
    # `kimi_k25` wrapper layout: config.json with `text_config`, weights under `language_model.`.
    "kimi_k25_like": dict(
        family="deepseek_v3",
        wrap="kimi_k25",
        kwargs=dict(
            vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                "beta_fast": 32.0, "beta_slow": 1.0,
            },
            rope_interleave=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, max_position_embeddings=128,
            tie_word_embeddings=False, num_mtp_layers=0,
        ),
    ),
    # MiniMax-M2: partial rotary (rotary_dim = head_dim / 2), GQA 2.
    "minimax_partial_rotary": dict(
        family="minimax_m2",
        kwargs=dict(
            vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
            num_local_experts=8, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, max_position_embeddings=128, tie_word_embeddings=False,
        ),
    ),
    # MiniMax-M2: full rotary, other expert count / top-k, GQA 4.
    "minimax_full_rotary": dict(
        family="minimax_m2",
        kwargs=dict(
            vocab_size=104, hidden_size=48, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=8,
            num_local_experts=6, num_experts_per_tok=3,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, max_position_embeddings=128, tie_word_embeddings=False,
        ),
    ),
    # Long context (not in ALL: tests/test_long_context.py only): Kimi-K2.5's YaRN (factor 64 over
    # an original 64 positions, mscale_all_dim) with 4,096 positions, run on prompts far past 64.
    "dsv3_yarn_long": dict(
        family="deepseek_v3",
        long=True,
        kwargs=dict(
            vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=12,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0,
                "beta_fast": 32.0, "beta_slow": 1.0,
            },
            rope_interleave=True, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096,
            tie_word_embeddings=False, num_mtp_layers=0,
        ),
    ),
}

FAMILY_OF = {name: c["family"] for name, c in CONFIGS.items()}
LLAMA = [n for n, c in CONFIGS.items() if c["family"] == "llama" and not c.get("long")]
DEEPSEEK = [n for n, c in CONFIGS.items() if c["family"] == "deepseek_v3" and not c.get("long")]
MINIMAX = [n for n, c in CONFIGS.items() if c["family"] == "minimax_m2" and not c.get("long")]
ALL = [n for n, c in CONFIGS.items() if not c.get("long")]

SEED = 1234
WEIGHT_SCALE = 0.5  # matrices ~ N(0, (WEIGHT_SCALE / sqrt(fan_in))^2)
ATTN_SCALE = 1.0  # q/k/v projections (not o_proj)


def _classes(family: str):
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig, tf.LlamaForCausalLM
    if family == "deepseek_v3":
        return tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM
    if family == "minimax_m2":
        return tf.MiniMaxM2Config, tf.MiniMaxM2ForCausalLM
    raise ValueError(family)


def _check_config_took_effect(name: str, cfg, kwargs: dict) -> None:
    """transformers silently drops / renames some kwargs; make sure ours landed."""
    for k, v in kwargs.items():
        if k in ("rope_parameters", "rotary_dim"):
            continue
        got = getattr(cfg, k)
        assert got == v, f"{name}: config.{k} = {got!r}, wanted {v!r}"
    rp = kwargs.get("rope_parameters")
    if rp:
        for k, v in rp.items():
            assert cfg.rope_parameters.get(k) == v, f"{name}: rope_parameters[{k!r}] = {cfg.rope_parameters.get(k)!r}, wanted {v!r}"
    if "rotary_dim" in kwargs:
        assert cfg.rope_parameters["partial_rotary_factor"] * cfg.head_dim == kwargs["rotary_dim"]


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim >= 2:
                if "embed_tokens" in pname:
                    std = 0.3
                elif "self_attn" in pname and "o_proj" not in pname:
                    # Larger q / k so attention is far from uniform and rotary errors show.
                    std = ATTN_SCALE / math.sqrt(p.shape[-1])
                else:
                    std = WEIGHT_SCALE / math.sqrt(p.shape[-1])  # torch layout [..., out, in]
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
            else:  # RMSNorm weights (no biases in these models)
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float32))
        n_bias = 0
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                # Same order of magnitude as the spread of the sigmoid scores, so selection
                # genuinely depends on the bias (and, for DeepSeek, on the group-limited choice).
                b.copy_(0.1 * torch.randn(b.shape, generator=g, dtype=torch.float32))
                n_bias += 1
    if any(n.endswith("e_score_correction_bias") for n, _ in model.named_buffers()):
        assert n_bias > 0


def make_hf_model(name: str, seed: int = SEED):
    """The randomised float32 eager-attention torch model for config `name` (not saved)."""
    spec = CONFIGS[name]
    cfg_cls, model_cls = _classes(spec["family"])
    kwargs = copy.deepcopy(spec["kwargs"])
    cfg = cfg_cls(**kwargs)
    _check_config_took_effect(name, cfg, spec["kwargs"])
    torch.manual_seed(seed)
    model = model_cls(cfg)
    model.set_attn_implementation("eager")
    model.to(torch.float32)
    model.eval()
    _randomize_(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _wrap_kimi_k25(out_dir: str) -> None:
    """Rewrite a saved DeepseekV3 folder into the Kimi-K2.5 layout (text_config + language_model.)."""
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(out_dir, "config.json")) as f:
        text = json.load(f)
    text["model_type"] = "deepseek_v3"
    wrapped = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"mm_hidden_size": 16, "text_hidden_size": text["hidden_size"]},
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(wrapped, f, indent=2)
    files = [f for f in os.listdir(out_dir) if f.endswith(".safetensors")]
    assert files == ["model.safetensors"], files
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    out = {"language_model." + k: v for k, v in tensors.items()}
    # A vision tensor the text-only loader must skip.
    out["vision_tower.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    save_file(out, path, metadata={"format": "pt"})


def build_hf_model(name: str, out_dir: str, seed: int = SEED):
    """Build, randomise and `save_pretrained` config `name` into `out_dir`; return the torch model."""
    model = make_hf_model(name, seed)
    model.save_pretrained(out_dir)
    if CONFIGS[name].get("wrap") == "kimi_k25":
        _wrap_kimi_k25(out_dir)
    return model


@torch.no_grad()
def hf_forward(model, ids: np.ndarray, attention_mask: np.ndarray | None = None):
    """fp32 logits [B,T,V] and hidden_states (tuple of L+1 arrays [B,T,H]) as numpy."""
    kw = {}
    if attention_mask is not None:
        kw["attention_mask"] = torch.as_tensor(attention_mask, dtype=torch.long)
    out = model(torch.as_tensor(np.asarray(ids), dtype=torch.long), output_hidden_states=True, use_cache=False, **kw)
    return out.logits.float().numpy(), tuple(h.float().numpy() for h in out.hidden_states)
