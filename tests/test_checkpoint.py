"""Checkpoint loading: HF safetensors (plain, int4 pack-quantized Kimi-K2.5, block-fp8 DeepSeek,
save_pretrained'd transformers models) -> our flat layout; Orbax round trip; clear errors."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from eagle3_jax.checkpoint import (
    CheckpointError,
    is_orbax_dir,
    iter_flat_layers,
    orbax_io,
    read_flat_params,
    save_orbax,
)
from eagle3_jax.config.model import load_model_config
from eagle3_jax.weights.params import flat_specs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


# ---- writing checkpoints (with the official safetensors writer; its numpy side takes bfloat16 and float8) ----


def write_checkpoint(folder, config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> str:
    from safetensors.numpy import save_file

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    keys = sorted(tensors)
    if shards == 1:
        save_file({k: np.ascontiguousarray(tensors[k]) for k in keys}, os.path.join(folder, "model.safetensors"))
        return folder
    weight_map = {}
    per = math.ceil(len(keys) / shards)
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = keys[s * per : (s + 1) * per]
        save_file({k: np.ascontiguousarray(tensors[k]) for k in chunk}, os.path.join(folder, name))
        weight_map.update({k: name for k in chunk})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return folder


def assert_flat_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        g, w = got[k], want[k]
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        assert g.shape == w.shape, (k, g.shape, w.shape)
        assert g.tobytes() == np.ascontiguousarray(w).tobytes(), k


# ---- tiny Kimi-K2.5 (int4 routed experts, bf16 rest, language_model. prefix, vision tower) ------


def kimi_config() -> dict:
    with open(os.path.join(DATA, "kimi-k2.5.config.json")) as f:
        raw = json.load(f)
    raw["text_config"].update(
        hidden_size=68, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        vocab_size=128, max_position_embeddings=256,
    )
    return raw


def pack_int4_rows(values: np.ndarray) -> np.ndarray:
    """Independent packer: column c -> word c // 8, nibble c % 8, stored as v + 8."""
    rows, cols = values.shape
    padded = np.zeros((rows, math.ceil(cols / 8) * 8), np.uint64)
    padded[:, :cols] = values + 8
    words = np.zeros((rows, padded.shape[1] // 8), np.uint64)
    for j in range(8):
        words |= padded[:, j::8] << np.uint64(4 * j)
    return words.astype(np.uint32).view(np.int32)


def mla_attention(rng, cfg, t: dict, want: dict, pre: str, i: int, dt=BF16) -> None:
    h, nh = cfg.hidden_size, cfg.num_heads
    shapes = {
        "q_a_proj": ("self_attn.q_a_proj.weight", (cfg.q_lora_rank, h)),
        "q_b_proj": ("self_attn.q_b_proj.weight", (nh * cfg.qk_head_dim, cfg.q_lora_rank)),
        "kv_a_proj": ("self_attn.kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)),
        "kv_b_proj": ("self_attn.kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
        "o_proj": ("self_attn.o_proj.weight", (h, nh * cfg.v_head_dim)),
    }
    for name, (hf, shape) in shapes.items():
        w = (rng.standard_normal(shape) * 0.1).astype(dt)
        t[f"{pre}model.layers.{i}.{hf}"] = w
        want[f"layers.{i}.{name}"] = w.T
    for name, hf, n in (("q_a_norm", "self_attn.q_a_layernorm.weight", cfg.q_lora_rank),
                        ("kv_a_norm", "self_attn.kv_a_layernorm.weight", cfg.kv_lora_rank),
                        ("attn_norm", "input_layernorm.weight", h), ("mlp_norm", "post_attention_layernorm.weight", h)):
        w = rng.standard_normal(n).astype(dt)
        t[f"{pre}model.layers.{i}.{hf}"] = w
        want[f"layers.{i}.{name}"] = w


def kimi_checkpoint(rng):
    raw = kimi_config()
    from eagle3_jax.config.model import parse_model_config

    cfg = parse_model_config(raw)
    pre, h, v, e_n, mi = "language_model.", cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    t, want = {}, {}
    emb = rng.standard_normal((v, h)).astype(BF16)
    head = rng.standard_normal((v, h)).astype(BF16)
    t[pre + "model.embed_tokens.weight"], want["embed"] = emb, emb
    t[pre + "lm_head.weight"], want["lm_head"] = head, head.T
    fn = rng.standard_normal(h).astype(BF16)
    t[pre + "model.norm.weight"], want["final_norm"] = fn, fn
    for i in range(cfg.num_layers):
        mla_attention(rng, cfg, t, want, pre, i)
        lp = f"{pre}model.layers.{i}."
        if i == 0:
            for name, shape in (("gate", (cfg.intermediate_size, h)), ("up", (cfg.intermediate_size, h)), ("down", (h, cfg.intermediate_size))):
                w = rng.standard_normal(shape).astype(BF16)
                t[f"{lp}mlp.{name}_proj.weight"], want[f"layers.{i}.{name}_proj"] = w, w.T
            continue
        g = rng.standard_normal((e_n, h)).astype(BF16)
        t[lp + "mlp.gate.weight"], want[f"layers.{i}.router"] = g, g.T.astype(np.float32)
        b = rng.standard_normal(e_n).astype(np.float32)
        t[lp + "mlp.gate.e_score_correction_bias"], want[f"layers.{i}.router_bias"] = b, b
        for name, shape in (("gate", (mi, h)), ("up", (mi, h)), ("down", (h, mi))):
            w = rng.standard_normal(shape).astype(BF16)
            t[f"{lp}mlp.shared_experts.{name}_proj.weight"], want[f"layers.{i}.shared_{name}"] = w, w.T
        for name, (rows, cols) in (("gate", (mi, h)), ("up", (mi, h)), ("down", (h, mi))):
            stack = np.zeros((e_n, cols, rows), np.float32)
            for e in range(e_n):
                vals = rng.integers(-8, 8, size=(rows, cols))
                scale = (rng.uniform(0.001, 0.05, size=(rows, math.ceil(cols / 32)))).astype(BF16)
                k = f"{lp}mlp.experts.{e}.{name}_proj."
                t[k + "weight_packed"] = pack_int4_rows(vals)
                t[k + "weight_scale"] = scale
                t[k + "weight_shape"] = np.array([rows, cols], np.int32)
                stack[e] = (vals.astype(np.float32) * scale.astype(np.float32)[:, np.arange(cols) // 32]).T
            want[f"layers.{i}.experts_{name}"] = stack
    # The vision stack ships in the same files, outside the language_model. prefix.
    t["vision_tower.encoder.blocks.0.wqkv.weight"] = rng.standard_normal((24, 8)).astype(BF16)
    t["vision_tower.patch_embed.proj.weight"] = rng.standard_normal((8, 3, 2, 2)).astype(BF16)
    t["mm_projector.proj.0.weight"] = rng.standard_normal((68, 32)).astype(BF16)
    t["mm_projector.pre_norm.bias"] = rng.standard_normal(32).astype(np.float32)
    return raw, cfg, t, want


def dequantized(cfg):
    """The config as `load_target(..., dequantize=True)` uses it: quantized weights read as floats."""
    return dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, resident=False))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    raw, cfg, tensors, want = kimi_checkpoint(np.random.default_rng(0))
    folder = write_checkpoint(tmp_path_factory.mktemp("kimi"), raw, tensors, shards=2)
    return folder, dequantized(cfg), want


def test_kimi_int4_sharded_checkpoint(kimi):
    folder, cfg, want = kimi
    assert len(glob.glob(os.path.join(folder, "model-*.safetensors"))) == 2
    assert dequantized(load_model_config(folder)) == cfg and cfg.key_prefix == "language_model."
    got = read_flat_params(folder, cfg)
    assert_flat_equal(got, want)
    assert got["layers.1.experts_down"].dtype == np.float32  # dequantized (exact in float32)
    assert got["layers.1.router"].dtype == np.float32 and got["layers.0.q_a_proj"].dtype == BF16
    for name, spec in flat_specs(cfg).items():
        assert got[name].shape == spec.shape and got[name].flags.c_contiguous


def test_iter_flat_layers_yields_one_layer_at_a_time(kimi):
    folder, cfg, _ = kimi
    seen = []
    for layer, tensors in iter_flat_layers(folder, cfg):
        assert all((layer is None) != n.startswith(f"layers.{layer}.") for n in tensors)
        seen.append(layer)
    assert seen == [None, 0, 1, 2]


def test_dtype_override_casts_all_but_float32_params(kimi):
    folder, cfg, want = kimi
    got = read_flat_params(folder, cfg, dtype="bfloat16")
    for name, spec in flat_specs(cfg).items():
        assert got[name].dtype == (np.float32 if spec.float32 else BF16), name
        assert np.array_equal(got[name], want[name].astype(got[name].dtype)), name
    with pytest.raises(CheckpointError, match="not supported"):
        read_flat_params(folder, cfg, dtype="int8")


# ---- tiny DeepSeek-V3 in block fp8 -------------------------------------------------------------


def deepseek_fp8_checkpoint(rng):
    from eagle3_jax.config.model import parse_model_config

    with open(os.path.join(DATA, "deepseek-v3.config.json")) as f:
        raw = json.load(f)
    raw.update(
        hidden_size=160, intermediate_size=200, moe_intermediate_size=72, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=96, max_position_embeddings=256,
    )
    cfg = parse_model_config(raw)
    t, want = {}, {}

    def fp8(key: str, shape, flat: str | None):
        w = (rng.standard_normal(shape) * 2).astype(FP8)
        s = rng.uniform(1e-3, 1e-1, size=(math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))).astype(np.float32)
        t[key], t[key + "_scale_inv"] = w, s
        deq = w.astype(np.float32) * s[np.arange(shape[0]) // 128][:, np.arange(shape[1]) // 128]
        if flat is not None:
            want[flat] = deq.T
        return deq

    h, nh = cfg.hidden_size, cfg.num_heads
    for k, flat, shape in (("model.embed_tokens.weight", "embed", (96, h)), ("lm_head.weight", "lm_head", (96, h))):
        t[k] = rng.standard_normal(shape).astype(BF16)
        want[flat] = t[k] if flat == "embed" else t[k].T
    t["model.norm.weight"] = want["final_norm"] = rng.standard_normal(h).astype(BF16)
    for i in range(cfg.num_layers):
        lp = f"model.layers.{i}."
        for name, hf, shape in (
            ("q_a_proj", "self_attn.q_a_proj.weight", (48, h)),
            ("q_b_proj", "self_attn.q_b_proj.weight", (nh * 24, 48)),
            ("kv_a_proj", "self_attn.kv_a_proj_with_mqa.weight", (40, h)),
            ("kv_b_proj", "self_attn.kv_b_proj.weight", (nh * 32, 32)),
            ("o_proj", "self_attn.o_proj.weight", (h, nh * 16)),
        ):
            fp8(lp + hf, shape, f"layers.{i}.{name}")
        for name, hf, n in (("q_a_norm", "self_attn.q_a_layernorm.weight", 48), ("kv_a_norm", "self_attn.kv_a_layernorm.weight", 32),
                            ("attn_norm", "input_layernorm.weight", h), ("mlp_norm", "post_attention_layernorm.weight", h)):
            t[lp + hf] = want[f"layers.{i}.{name}"] = rng.standard_normal(n).astype(BF16)
        t[lp + "self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # old exports carry rotary buffers
        if i == 0:
            for name, shape in (("gate", (200, h)), ("up", (200, h)), ("down", (h, 200))):
                fp8(f"{lp}mlp.{name}_proj.weight", shape, f"layers.0.{name}_proj")
            continue
        g = rng.standard_normal((4, h)).astype(BF16)
        t[lp + "mlp.gate.weight"], want[f"layers.{i}.router"] = g, g.T.astype(np.float32)
        t[lp + "mlp.gate.e_score_correction_bias"] = want[f"layers.{i}.router_bias"] = rng.standard_normal(4).astype(np.float32)
        for name, shape in (("gate", (72, h)), ("up", (72, h)), ("down", (h, 72))):
            fp8(f"{lp}mlp.shared_experts.{name}_proj.weight", shape, f"layers.{i}.shared_{name}")
            want[f"layers.{i}.experts_{name}"] = np.stack(
                [fp8(f"{lp}mlp.experts.{e}.{name}_proj.weight", shape, None).T for e in range(4)]
            )
    # DeepSeek-V3's multi-token-prediction layer (index num_hidden_layers) is not served.
    fp8("model.layers.2.eh_proj.weight", (h, 2 * h), None)
    t["model.layers.2.enorm.weight"] = np.ones(h, BF16)
    t["model.layers.2.shared_head.head.weight"] = np.ones((96, h), BF16)
    return raw, cfg, t, want


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    raw, cfg, tensors, want = deepseek_fp8_checkpoint(np.random.default_rng(1))
    return write_checkpoint(tmp_path_factory.mktemp("ds_fp8"), raw, tensors), raw, tensors, dequantized(cfg), want


def test_deepseek_fp8_checkpoint(deepseek_fp8):
    folder, _, _, cfg, want = deepseek_fp8
    assert cfg.quant.method == "fp8_block"
    got = read_flat_params(folder, cfg)
    assert_flat_equal(got, want)
    assert got["layers.1.experts_gate"].dtype == np.float32 and got["layers.1.attn_norm"].dtype == BF16


def test_missing_expert_is_named(deepseek_fp8, tmp_path):
    _, raw, tensors, cfg, _ = deepseek_fp8
    t = dict(tensors)
    del t["model.layers.1.mlp.experts.3.up_proj.weight"], t["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    folder = write_checkpoint(tmp_path, raw, t)
    with pytest.raises(CheckpointError, match=re.escape("'model.layers.1.mlp.experts.3.up_proj.weight'")):
        read_flat_params(folder, cfg)


def test_fp8_without_scale_and_scale_without_config(deepseek_fp8, tmp_path):
    _, raw, tensors, cfg, _ = deepseek_fp8
    t = dict(tensors)
    del t["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight' is float8_e4m3fn but has no"):
        read_flat_params(write_checkpoint(tmp_path / "a", raw, t), cfg)
    plain = {k: v for k, v in raw.items() if k != "quantization_config"}
    folder = write_checkpoint(tmp_path / "b", plain, tensors)
    with pytest.raises(CheckpointError, match="no fp8 quantization_config"):
        read_flat_params(folder, load_model_config(folder))


# ---- transformers models saved with save_pretrained ---------------------------------------------

_HF_RENAME = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj", "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "self_attn.q_a_proj.weight": "q_a_proj", "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b_proj", "self_attn.kv_a_proj_with_mqa.weight": "kv_a_proj",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm", "self_attn.kv_b_proj.weight": "kv_b_proj",
    "mlp.gate_proj.weight": "gate_proj", "mlp.up_proj.weight": "up_proj", "mlp.down_proj.weight": "down_proj",
    "mlp.gate.weight": "router", "mlp.gate.e_score_correction_bias": "router_bias",
    "mlp.e_score_correction_bias": "router_bias",
    "mlp.shared_experts.gate_proj.weight": "shared_gate", "mlp.shared_experts.up_proj.weight": "shared_up",
    "mlp.shared_experts.down_proj.weight": "shared_down",
}


def expected_from_state_dict(sd) -> dict[str, np.ndarray]:
    """Our flat layout from a transformers-5 in-memory state_dict (fused experts)."""
    out = {}
    for k, v in sd.items():
        a = v.detach().numpy()
        if k == "model.embed_tokens.weight":
            out["embed"] = a
        elif k == "model.norm.weight":
            out["final_norm"] = a
        elif k == "lm_head.weight":
            out["lm_head"] = a.T
        else:
            i, sub = re.match(r"model\.layers\.(\d+)\.(.+)", k).groups()
            if sub == "mlp.experts.gate_up_proj":
                n = a.shape[1] // 2
                out[f"layers.{i}.experts_gate"] = a[:, :n].transpose(0, 2, 1)
                out[f"layers.{i}.experts_up"] = a[:, n:].transpose(0, 2, 1)
            elif sub == "mlp.experts.down_proj":
                out[f"layers.{i}.experts_down"] = a.transpose(0, 2, 1)
            else:
                out[f"layers.{i}.{_HF_RENAME[sub]}"] = a.T if a.ndim == 2 else a
    return out


def _tiny_hf_model(family: str):
    import torch
    import transformers as tr

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
    if family == "llama":
        model = tr.LlamaForCausalLM(tr.LlamaConfig(intermediate_size=48, num_key_value_heads=2, **common))
    elif family == "deepseek_v3":
        model = tr.DeepseekV3ForCausalLM(tr.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            bos_token_id=0, eos_token_id=1, **common))
    else:
        model = tr.MiniMaxM2ForCausalLM(tr.MiniMaxM2Config(
            intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            bos_token_id=0, eos_token_id=1, **common))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for v in model.state_dict().values():  # shares storage: re-randomizes buffers like the routing bias too
            if v.is_floating_point():
                v.copy_(torch.randn(v.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
    pytest.importorskip("transformers")
    out = {}
    for family in ("llama", "deepseek_v3", "minimax_m2"):
        model = _tiny_hf_model(family)
        folder = str(tmp_path_factory.mktemp(family))
        model.save_pretrained(folder)
        out[family] = (folder, model.state_dict())
    return out


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "minimax_m2"])
def test_save_pretrained_models_load_transposed(hf_saved, family):
    folder, sd = hf_saved[family]
    cfg = load_model_config(folder)
    assert cfg.family == family
    if family == "deepseek_v3":
        assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0) and cfg.q_lora_rank is None
    assert_flat_equal(read_flat_params(folder, cfg), expected_from_state_dict(sd))


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2"])
def test_fused_in_memory_expert_layout(hf_saved, family, tmp_path):
    from safetensors.torch import save_file

    folder, sd = hf_saved[family]
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    write_checkpoint(tmp_path, raw, {})
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tmp_path, "model.safetensors"))
    cfg = load_model_config(tmp_path)
    assert_flat_equal(read_flat_params(tmp_path, cfg), read_flat_params(folder, cfg))


def test_mixed_fused_and_per_expert_is_rejected(hf_saved, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder, sd = hf_saved["deepseek_v3"]
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = sd["model.layers.1.mlp.experts.gate_up_proj"].contiguous()
    with open(os.path.join(folder, "config.json")) as f:
        write_checkpoint(tmp_path, json.load(f), {})
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="both provide layers.1.experts_gate"):
        read_flat_params(tmp_path, load_model_config(tmp_path))


# ---- Orbax round trip -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_orbax_round_trip_is_bit_identical(kimi, tmp_path, dtype):
    folder, cfg, _ = kimi
    out = str(tmp_path / "orbax")
    marker = save_orbax(folder, out, cfg, progress=False, dtype=dtype)
    assert is_orbax_dir(out) and not is_orbax_dir(folder)
    assert marker["dtype"] == dtype and len(marker["tensors"]) == len(flat_specs(cfg))
    assert dequantized(load_model_config(out)) == cfg
    assert_flat_equal(read_flat_params(out, cfg), read_flat_params(folder, cfg, dtype=dtype))
    assert [layer for layer, _ in iter_flat_layers(out, cfg)] == [None, 0, 1, 2]
    assert not glob.glob(out + ".partial*")


def test_orbax_round_trip_fp8(deepseek_fp8, tmp_path):
    folder, _, _, cfg, want = deepseek_fp8
    save_orbax(folder, tmp_path / "o", cfg, progress=False)
    assert_flat_equal(read_flat_params(tmp_path / "o", cfg), want)


def test_orbax_refuses_existing_out_dir_unless_overwrite(deepseek_fp8, tmp_path):
    folder, _, _, cfg, want = deepseek_fp8
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        save_orbax(folder, out, cfg, progress=False)
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="is the input"):
        save_orbax(folder, folder, cfg, progress=False, overwrite=True)
    with pytest.raises(CheckpointError, match="inside the input"):
        save_orbax(folder, os.path.join(folder, "orbax"), cfg, progress=False, overwrite=True)
    save_orbax(folder, out, cfg, progress=False, overwrite=True)
    assert is_orbax_dir(out)
    assert_flat_equal(read_flat_params(out, cfg), want)
    assert sorted(os.listdir(tmp_path)) == ["o"]


def test_orbax_config_mismatch_is_reported(deepseek_fp8, tmp_path):
    folder, _, _, cfg, _ = deepseek_fp8
    save_orbax(folder, tmp_path / "o", cfg, progress=False)
    with pytest.raises(CheckpointError, match="unexpected tensor layers.1.attn_norm"):
        read_flat_params(tmp_path / "o", dataclasses.replace(cfg, num_layers=1))


def test_interrupted_conversion_leaves_nothing_loadable_and_resumes(kimi, tmp_path, monkeypatch):
    folder, cfg, _ = kimi
    out = str(tmp_path / "orbax")
    real_save = orbax_io._save_item
    calls = []

    def failing_save(ckptr, path, tree):
        calls.append(path)
        if len(calls) == 3:
            raise RuntimeError("disk full")
        real_save(ckptr, path, tree)

    monkeypatch.setattr(orbax_io, "_save_item", failing_save)
    with pytest.raises(RuntimeError, match="disk full"):
        save_orbax(folder, out, cfg, progress=False)
    assert not os.path.exists(out) and not is_orbax_dir(out)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_flat_params(out, cfg)
    # The partial folder is refused clearly...
    partial = out + ".partial"
    assert os.path.isdir(partial) and not is_orbax_dir(partial)
    with pytest.raises(CheckpointError, match="incomplete Orbax conversion"):
        read_flat_params(partial, cfg)
    # ...and the same conversion resumes after the two items already written.
    calls.clear()
    save_orbax(folder, out, cfg, progress=False)
    assert [os.path.relpath(c, partial) for c in calls] == ["layers/1", "layers/2"]
    assert not os.path.exists(partial) and is_orbax_dir(out)
    assert_flat_equal(read_flat_params(out, cfg), read_flat_params(folder, cfg))
    # A different conversion (another dtype) does not reuse an old partial folder.
    os.makedirs(partial)
    orbax_io._write_json(os.path.join(partial, orbax_io.PROGRESS), {"fingerprint": "other", "items": {"globals": {}}})
    monkeypatch.setattr(orbax_io, "_save_item", lambda ckptr, path, tree: (calls.append(path), real_save(ckptr, path, tree)))
    calls.clear()
    save_orbax(folder, partial[: -len(".partial")], cfg, progress=False, dtype="bfloat16", overwrite=True)
    assert len(calls) == 4


def test_folder_without_marker_is_incomplete(deepseek_fp8, tmp_path):
    folder, _, _, cfg, _ = deepseek_fp8
    out = tmp_path / "o"
    save_orbax(folder, out, cfg, progress=False)
    os.remove(out / orbax_io.MARKER)
    assert not is_orbax_dir(out)
    with pytest.raises(CheckpointError, match="incomplete Orbax conversion"):
        read_flat_params(out, cfg)


# ---- bad inputs -------------------------------------------------------------------------------


def llama_checkpoint(rng, tie: bool = False):
    from eagle3_jax.config.model import parse_model_config

    with open(os.path.join(DATA, "llama-3.1-8b-instruct.config.json")) as f:
        raw = json.load(f)
    raw.update(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=64, tie_word_embeddings=tie)
    raw.pop("head_dim", None)
    cfg = parse_model_config(raw)
    t = {}
    for name, spec in flat_specs(cfg).items():
        key = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}.get(name)
        if key is None:
            i, n = re.match(r"layers\.(\d+)\.(.+)", name).groups()
            sub = {v: k for k, v in _HF_RENAME.items() if not k.startswith("mlp.gate.")}[n]
            key = f"model.layers.{i}.{sub}"
        shape = spec.shape if name == "embed" or len(spec.shape) == 1 else spec.shape[::-1]
        t[key] = rng.standard_normal(shape).astype(np.float32)
    return raw, cfg, t


@pytest.fixture()
def llama(tmp_path):
    raw, cfg, t = llama_checkpoint(np.random.default_rng(2))
    return raw, cfg, t


def _load_modified(tmp_path, raw, cfg, t):
    return read_flat_params(write_checkpoint(tmp_path / "ckpt", raw, t), cfg)


def test_llama_plain_and_tied(tmp_path):
    raw, cfg, t = llama_checkpoint(np.random.default_rng(3), tie=True)
    assert "lm_head" not in flat_specs(cfg)
    got = _load_modified(tmp_path, raw, cfg, t)
    assert "lm_head" not in got and np.array_equal(got["layers.1.o_proj"], t["model.layers.1.self_attn.o_proj.weight"].T)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()  # a tied model may still ship it: ignored
    assert sorted(read_flat_params(write_checkpoint(tmp_path / "b", raw, t), cfg)) == sorted(got)


@pytest.mark.parametrize(
    "edit,pattern",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
        (lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": np.ones((2, 2), np.float32)}),
         r"unexpected tensor 'model\.layers\.0\.mlp\.extra_proj\.weight'"),
        (lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(32, np.float32)}),
         r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"),
        (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.ones((32, 31), np.float32)}),
         r"'model\.layers\.0\.self_attn\.q_proj\.weight' has shape \[32, 31\] but config\.json implies \[32, 32\]"),
        (lambda t: t.update({"model.layers.0.input_layernorm.weight": np.ones(32, np.int32)}),
         r"'model\.layers\.0\.input_layernorm\.weight' has dtype int32, but a float tensor"),
        (lambda t: t.update({"model.norm.weight": np.ones(32, np.float32).astype(FP8)}),
         r"'model\.norm\.weight' is float8_e4m3fn but has no model\.norm\.weight_scale_inv"),
    ],
    ids=["missing", "extra", "extra_qk_norm", "shape", "dtype", "fp8_no_scale"],
)
def test_bad_checkpoints_name_the_tensor(tmp_path, llama, edit, pattern):
    raw, cfg, t = llama
    edit(t)
    with pytest.raises(CheckpointError, match=pattern):
        _load_modified(tmp_path, raw, cfg, t)


def test_all_problems_reported_together(tmp_path, llama):
    raw, cfg, t = llama
    t.pop("model.layers.0.self_attn.k_proj.weight")
    t["model.layers.7.mlp.gate_proj.weight"] = np.ones((2, 2), np.float32)  # layer beyond num_layers: skipped
    t["model.visual.proj.weight"] = np.ones((2, 2), np.float32)
    with pytest.raises(CheckpointError) as err:
        _load_modified(tmp_path, raw, cfg, t)
    msg = str(err.value)
    assert "2 problem(s)" in msg and "k_proj" in msg and "model.visual.proj.weight" in msg and "layers.7" not in msg


def test_missing_shard_file_is_named(tmp_path, llama):
    raw, cfg, t = llama
    folder = write_checkpoint(tmp_path / "c", raw, t, shards=2)
    os.remove(os.path.join(folder, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*missing"):
        read_flat_params(folder, cfg)


def test_pickle_only_folder_is_refused(tmp_path, llama):
    raw, cfg, _ = llama
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=r"pickle.*pytorch_model\.bin.*safetensors"):
        read_flat_params(tmp_path, cfg)


def test_missing_or_empty_folder(tmp_path, llama):
    _, cfg, _ = llama
    with pytest.raises(CheckpointError, match="does not exist"):
        read_flat_params(tmp_path / "nope", cfg)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        read_flat_params(tmp_path, cfg)


def test_truncated_file_is_reported(tmp_path, llama):
    raw, cfg, t = llama
    folder = write_checkpoint(tmp_path / "c", raw, t)
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        read_flat_params(folder, cfg)


# ---- scripts/convert.py -------------------------------------------------------------------------


def _convert(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "convert.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_convert_script(tmp_path, llama):
    raw, cfg, t = llama
    r = _convert("--help")
    assert r.returncode == 0 and "--hf_dir" in r.stdout and "--out_dir" in r.stdout and "Traceback" not in r.stderr
    r = _convert("--out_dir", str(tmp_path / "x"))
    assert r.returncode == 2 and "--hf_dir is required" in r.stderr
    r = _convert("--hf_dir", str(tmp_path / "missing"), "--out_dir", str(tmp_path / "x"))
    assert r.returncode == 2 and "no config.json" in r.stderr and len(r.stderr.splitlines()) == 1
    folder = write_checkpoint(tmp_path / "hf", raw, t)
    r = _convert("--hf_dir", folder, "--out_dir", str(tmp_path / "out"), "--dtype", "bfloat16", "--noprogress")
    assert r.returncode == 0, r.stderr
    assert not re.search(r"^I\d{4} ", r.stderr, re.M), r.stderr[:500]  # Orbax's INFO lines only with --verbose
    assert "converted llama" in r.stdout and "bfloat16" in r.stdout
    assert_flat_equal(read_flat_params(tmp_path / "out", cfg), read_flat_params(folder, cfg, dtype="bfloat16"))


def test_random_target_script_writes_a_sharded_folder_that_loads(tmp_path):
    """A random int4 Kimi-shaped MoE (kimi-mini's config with Kimi-K2.5's quantization) cut to one MoE
    layer: shards and index agree, the experts load quantized, each expert distinct."""
    from eagle3_jax.weights.quant import QArray

    with open(os.path.join(REPO, "checkpoints", "kimi-mini", "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(DATA, "kimi-k2.5.config.json")) as f:
        raw["quantization_config"] = json.load(f)["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "random"
    args = [sys.executable, os.path.join(REPO, "scripts", "random_target.py"), f"--config={tmp_path / 'config.json'}",
            f"--out={out}", "--one_moe_layer", f"--tokenizer_from={REPO}/checkpoints/kimi-mini"]
    r = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    cfg = load_model_config(out)
    assert cfg.num_layers == raw["first_k_dense_replace"] + 1 and cfg.quant.method == "int4_pack"
    assert "(random weights)" in r.stdout and os.path.isfile(out / "tokenizer.json")
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert sorted(set(index["weight_map"].values())) == sorted(glob.glob("model-*.safetensors", root_dir=out))
    flat = read_flat_params(out, cfg)
    experts = {n: a for n, a in flat.items() if "experts_" in n}
    assert experts and all(isinstance(a, QArray) for a in experts.values())
    gate = np.asarray(next(a for n, a in experts.items() if n.endswith("experts_gate")).values)
    assert not np.array_equal(gate[0], gate[1])
    norms = [np.asarray(a) for n, a in flat.items() if n.endswith("norm")]
    assert norms and all(np.all(a == 1) for a in norms)
    r = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and "--overwrite" in r.stderr and len(r.stderr.strip().splitlines()) == 1
