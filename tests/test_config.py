"""HF config.json -> ModelConfig on the real configs of every target family, and clear failures."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest

from eagle3_jax.config.model import (
    ConfigError,
    ModelConfig,
    RopeConfig,
    default_aux_layer_ids,
    load_model_config,
    parse_model_config,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO_ROOT, "tests", "data")
STORIES = os.path.join(REPO_ROOT, "checkpoints", "stories260K")

TARGETS = {
    "kimi": os.path.join(DATA, "kimi-k2.5.config.json"),
    "deepseek": os.path.join(DATA, "deepseek-v3.config.json"),
    "minimax": os.path.join(DATA, "minimax-m2.5.config.json"),
    "llama": os.path.join(DATA, "llama-3.1-8b-instruct.config.json"),
    "stories": os.path.join(STORIES, "config.json"),
}


def raw_config(name: str) -> dict:
    with open(TARGETS[name]) as f:
        return json.load(f)


def text_part(raw: dict) -> dict:
    """The dict holding the language-model fields (Kimi-K2.5 nests them under text_config)."""
    return raw["text_config"] if raw.get("model_type") == "kimi_k25" else raw


def yarn_mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0


# ---- the real configs ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_parses_and_is_hashable(name):
    cfg = load_model_config(TARGETS[name])
    assert isinstance(cfg, ModelConfig)
    hash(cfg)  # static argument of jitted functions
    assert cfg == parse_model_config(raw_config(name))


def test_folder_or_file():
    assert load_model_config(STORIES) == load_model_config(os.path.join(STORIES, "config.json"))


def test_kimi_k25():
    cfg = load_model_config(TARGETS["kimi"])
    assert (cfg.model_type, cfg.family, cfg.attention) == ("kimi_k25", "deepseek_v3", "mla")
    assert cfg.key_prefix == "language_model."
    assert cfg.quant is not None
    assert (cfg.quant.method, cfg.quant.group_size, cfg.quant.num_bits) == ("int4_pack", 32, 4)
    assert "lm_head" in cfg.quant.ignore and "re:.*self_attn.*" in cfg.quant.ignore
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (163840, 7168, 61, 64)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_head_dim) == (128, 64, 128, 192)
    assert cfg.first_k_dense_replace == 1
    assert cfg.segments == (("dense", 0, 1), ("moe", 1, 61))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (384, 8, 2048)
    assert cfg.shared_intermediate_size == 2048
    assert (cfg.n_group, cfg.topk_group) == (1, 1)
    assert cfg.routed_scaling_factor == pytest.approx(2.827)
    assert (cfg.scoring_func, cfg.use_routing_bias, cfg.norm_topk_prob) == ("sigmoid", True, True)
    r = cfg.rope
    assert (r.rope_type, r.factor, r.mscale, r.mscale_all_dim, r.theta) == ("yarn", 64.0, 1.0, 1.0, 50000.0)
    assert (r.dim, r.original_max_position_embeddings, r.beta_fast, r.beta_slow) == (64, 4096, 32.0, 1.0)
    assert r.interleaved
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (163584, (163585,))
    assert cfg.max_position_embeddings == 262144
    assert not cfg.tie_word_embeddings
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * yarn_mscale(64.0, 1.0) ** 2)


def test_deepseek_v3():
    cfg = load_model_config(TARGETS["deepseek"])
    assert (cfg.model_type, cfg.family, cfg.attention, cfg.key_prefix) == ("deepseek_v3", "deepseek_v3", "mla", "")
    assert cfg.quant is not None
    assert (cfg.quant.method, cfg.quant.block_size) == ("fp8_block", (128, 128))
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts, cfg.num_experts_per_tok) == (8, 4, 256, 8)
    assert cfg.routed_scaling_factor == 2.5
    assert cfg.segments == (("dense", 0, 3), ("moe", 3, 61))
    assert not cfg.is_moe_layer(2) and cfg.is_moe_layer(3) and cfg.is_moe_layer(60)
    r = cfg.rope
    assert (r.rope_type, r.factor, r.theta, r.mscale_all_dim, r.interleaved) == ("yarn", 40.0, 10000.0, 1.0, True)
    # (qk_nope + qk_rope)^-0.5 * mscale^2, mscale = 0.1 * ln(factor) + 1
    expected = (128 + 64) ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2
    assert cfg.softmax_scale == pytest.approx(expected, rel=1e-12)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (0, (1,))


def test_minimax_m25():
    cfg = load_model_config(TARGETS["minimax"])
    assert (cfg.model_type, cfg.family, cfg.attention) == ("minimax_m2", "minimax_m2", "gqa")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (48, 8, 128)
    assert cfg.rope.dim == 64 and cfg.rope.rope_type == "default" and not cfg.rope.interleaved
    assert cfg.rope.theta == 5_000_000.0
    assert cfg.qk_norm
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8, 1536)
    assert cfg.shared_intermediate_size == 0
    assert (cfg.scoring_func, cfg.use_routing_bias) == ("sigmoid", True)
    assert cfg.segments == (("moe", 0, 62),)
    assert cfg.quant is not None
    assert (cfg.quant.method, cfg.quant.block_size) == ("fp8_block", (128, 128))
    assert "gate" in cfg.quant.ignore and "lm_head" in cfg.quant.ignore
    assert cfg.softmax_scale == pytest.approx(128 ** -0.5)


def test_llama_31():
    cfg = load_model_config(TARGETS["llama"])
    assert (cfg.model_type, cfg.family, cfg.attention, cfg.quant) == ("llama", "llama", "gqa", None)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 32, 8, 128)
    r = cfg.rope
    assert (r.rope_type, r.factor, r.low_freq_factor, r.high_freq_factor) == ("llama3", 8.0, 1.0, 4.0)
    assert (r.original_max_position_embeddings, r.theta, r.dim) == (8192, 500000.0, 128)
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.bos_token_id == 128000
    assert cfg.segments == (("dense", 0, 32),)
    assert cfg.num_experts == 0 and not cfg.is_moe_layer(0)


def test_stories260k():
    cfg = load_model_config(STORIES)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (512, 64, 5, 172)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 4, 8)
    assert cfg.tie_word_embeddings
    assert cfg.rope == RopeConfig(theta=10000.0, dim=8)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_position_embeddings) == (1, (2,), 512)
    assert cfg.rms_norm_eps == 1e-5


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_default_aux_layers(name):
    cfg = load_model_config(TARGETS[name])
    n = cfg.num_layers
    assert cfg.aux_layer_ids == default_aux_layer_ids(n) == (2, n // 2, n - 3)


def test_aux_layer_values():
    assert default_aux_layer_ids(61) == (2, 30, 58)
    assert default_aux_layer_ids(32) == (2, 16, 29)


def test_with_aux_layers():
    cfg = load_model_config(TARGETS["deepseek"])
    # SpecForge ids (1, 29, 57) mean "output of layer i" = hidden_states[i + 1].
    assert cfg.with_aux_layers((2, 30, 58)).aux_layer_ids == (2, 30, 58)
    with pytest.raises(ConfigError, match="aux hidden-state index 62 is out of range"):
        cfg.with_aux_layers((2, 30, 62))


# ---- both rope spellings ------------------------------------------------------------------------


def to_rope_parameters(raw: dict) -> dict:
    """transformers-5 spelling: everything (theta included) under `rope_parameters`."""
    raw = copy.deepcopy(raw)
    d = text_part(raw)
    rp = d.get("rope_parameters") or {}
    if not rp:
        rp = dict(d.get("rope_scaling") or {})
        rp["rope_type"] = rp.pop("type", None) or rp.get("rope_type") or "default"
    rp = {**rp, "rope_theta": rp.get("rope_theta", d.get("rope_theta", 10000.0))}
    d.pop("rope_scaling", None)
    d.pop("rope_theta", None)
    d["rope_parameters"] = rp
    return raw


def to_rope_scaling(raw: dict) -> dict:
    """transformers-4 / hub spelling: top-level `rope_theta` plus `rope_scaling` with `type`."""
    raw = copy.deepcopy(raw)
    d = text_part(raw)
    rp = dict(d.pop("rope_parameters", None) or {})
    if not rp:
        return raw
    d["rope_theta"] = rp.pop("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
    rp.pop("type", None)
    d["rope_scaling"] = None if rope_type == "default" else {**rp, "type": rope_type}
    return raw


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_rope_spellings_agree(name):
    raw = raw_config(name)
    params_cfg = parse_model_config(to_rope_parameters(raw))
    scaling_cfg = parse_model_config(to_rope_scaling(raw))
    assert "rope_scaling" not in text_part(to_rope_parameters(raw))
    assert "rope_parameters" not in text_part(to_rope_scaling(raw))
    assert params_cfg.rope == scaling_cfg.rope == parse_model_config(raw).rope
    assert params_cfg == scaling_cfg


def test_rope_scaling_rope_type_key():
    raw = raw_config("llama")
    alt = copy.deepcopy(raw)
    alt["rope_scaling"]["type"] = alt["rope_scaling"].pop("rope_type")
    assert parse_model_config(alt).rope == parse_model_config(raw).rope


# ---- clear failures -----------------------------------------------------------------------------


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_model_type():
    raw = raw_config("llama")
    raw["model_type"] = "gpt2"
    with pytest.raises(ConfigError, match=r"unsupported model_type 'gpt2'.*supported: .*llama"):
        parse_model_config(raw)
    del raw["model_type"]
    with pytest.raises(ConfigError, match="unsupported model_type None"):
        parse_model_config(raw)


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_missing_required_field(name, field):
    raw = raw_config(name)
    del text_part(raw)[field]
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        parse_model_config(raw)


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_rope_head_dim", "v_head_dim"])
def test_missing_mla_field(field):
    raw = raw_config("deepseek")
    del raw[field]
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        parse_model_config(raw)


def test_kimi_without_text_config():
    raw = raw_config("kimi")
    del raw["text_config"]
    with pytest.raises(ConfigError, match="text_config"):
        parse_model_config(raw)


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_unsupported_rope_type(spelling):
    raw = raw_config("llama")
    del raw["rope_scaling"]
    raw[spelling] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500000.0}
    with pytest.raises(ConfigError, match=r"rope type 'dynamic'.*not supported.*supported: .*yarn"):
        parse_model_config(raw)


def test_rope_missing_factor():
    raw = raw_config("deepseek")
    del raw["rope_scaling"]["factor"]
    with pytest.raises(ConfigError, match="missing required field 'factor'"):
        parse_model_config(raw)


@pytest.mark.parametrize(
    "quant, match",
    [
        ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq' is not supported"),
        ({"quant_method": "awq"}, "quantization method 'awq' is not supported"),
        ({"quant_method": "fp8"}, "weight_block_size"),
        (
            {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {}}},
            "compressed-tensors format 'float-quantized'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}
                },
            },
            "symmetric int4 group quantization",
        ),
    ],
)
def test_unsupported_quant(quant, match):
    raw = raw_config("deepseek")
    raw["quantization_config"] = quant
    with pytest.raises(ConfigError, match=match):
        parse_model_config(raw)


def test_unsupported_activation_and_routing():
    raw = raw_config("llama")
    raw["hidden_act"] = "gelu"
    with pytest.raises(ConfigError, match="hidden_act 'gelu' is not supported"):
        parse_model_config(raw)
    raw = raw_config("deepseek")
    raw["topk_method"] = "greedy"
    with pytest.raises(ConfigError, match="topk_method='greedy'"):
        parse_model_config(raw)
    raw = raw_config("deepseek")
    raw["n_group"] = 7
    with pytest.raises(ConfigError, match="not divisible by n_group=7"):
        parse_model_config(raw)


def test_non_json_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_model_config(tmp_path)
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_model_config(tmp_path / "config.json")


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json at"):
        load_model_config(tmp_path)
    with pytest.raises(ConfigError, match="no config.json at"):
        load_model_config(tmp_path / "nowhere" / "config.json")


def test_malformed_config_files_give_config_errors(tmp_path):
    import json as _json

    from eagle3_jax.config.model import ConfigError, load_model_config, parse_model_config

    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00\x01garbage")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(_json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="JSON object"):
        load_model_config(tmp_path)
    with pytest.raises(ConfigError, match="wrong type"):
        parse_model_config({"model_type": "llama", "hidden_size": "abc", "num_attention_heads": 4,
                            "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 8})


def test_deepseek_v3_moe_fields_default_as_transformers_does(caplog, monkeypatch):
    """A DeepSeek-V3 config without n_routed_experts is transformers' 256-expert MoE, and the
    warning names the field; n_routed_experts: 0 is a dense model, without a warning."""
    import logging

    from eagle3_jax.config import model as config_lib
    from eagle3_jax.config.model import DEEPSEEK_V3_MOE_DEFAULTS, parse_model_config

    monkeypatch.setattr(config_lib, "_warned", set())  # warned once per process: start afresh
    with open(TARGETS["deepseek"]) as f:
        raw = json.load(f)
    for key in DEEPSEEK_V3_MOE_DEFAULTS:
        raw.pop(key, None)
    with caplog.at_level(logging.WARNING, logger="eagle3_jax.config.model"):
        cfg = parse_model_config(raw)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8, 2048)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.first_k_dense_replace) == (8, 4, 2.5, 3)
    assert "n_routed_experts, num_experts_per_tok, moe_intermediate_size" in caplog.text
    assert "n_routed_experts=256" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3_jax.config.model"):
        dense = parse_model_config(dict(raw, n_routed_experts=0))
    assert dense.num_experts == 0 and dense.segments == (("dense", 0, dense.num_layers),) and not caplog.text
