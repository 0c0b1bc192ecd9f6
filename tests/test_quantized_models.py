"""Quantized weights resident on device: each format against an independent decoder written here,
quantized models against their dequantized-float twins, W4A8, fnuz, Orbax, expert parallelism on
8 devices, speculative decoding with quantized targets and an FP8 draft, and bad input.

Models are tiny random ones written in the real checkpoint layouts (compressed-tensors int4 words,
block-FP8 with scale_inv, Quark MXFP4 bytes + e8m0, Quark ptpc FP8) by `checkpoint.quantize`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from random_models import DEEPSEEK, MINIMAX, random_draft, random_flat
from safetensors.numpy import save_file

import eagle3_jax as e3
from eagle3_jax.checkpoint import CheckpointError, read_flat_params, save_orbax
from eagle3_jax.checkpoint.hf_writer import save_hf_target
from eagle3_jax.checkpoint.quantize import encode, quantization_config
from eagle3_jax.config.model import ConfigError, QuantConfig, parse_model_config
from eagle3_jax.weights.quant import QArray, dequantize, linear


def load_file(path: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file (float8 included, which safetensors.numpy cannot read)."""
    from eagle3_jax.checkpoint import open_hf_checkpoint

    ckpt = open_hf_checkpoint(os.path.dirname(path))
    return {k: np.array(ckpt.read(k)) for k in ckpt.keys()}


needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

KIMI_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*")
MODELS = {
    # name: (family config, method, ignore list, group size)
    "kimi_int4": (DEEPSEEK, "int4_pack", KIMI_IGNORE, 16),
    "deepseek_fp8": (DEEPSEEK, "fp8_block", (), 32),
    "kimi_mxfp4": (DEEPSEEK, "mxfp4", ("lm_head", "re:.*self_attn.*"), 32),
    "minimax_fp8": (MINIMAX, "fp8_block", ("gate", "e_score_correction_bias", "lm_head"), 32),
}


def write_model(folder, name: str, seed: int = 0) -> str:
    family, method, ignore, group = MODELS[name]
    raw = dict(family, quantization_config=quantization_config(method, ignore, group))
    cfg = parse_model_config(raw)
    save_hf_target(str(folder), random_flat(cfg, seed), cfg, raw)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: write_model(tmp_path_factory.mktemp(name), name) for name in MODELS}


# ---- independent decoders of the checkpoint tensors (HF orientation [out, in]) ---------------------


def decode_int4(packed, scale, shape, group):
    rows, cols = shape
    out = np.zeros(shape, np.float32)
    words = packed.view(np.uint32)
    for r in range(rows):
        for c in range(cols):
            nibble = (int(words[r, c // 8]) >> (4 * (c % 8))) & 0xF
            out[r, c] = (nibble - 8) * float(scale[r, c // group])
    return out


def e2m1(nibble: int) -> float:
    sign = -1.0 if nibble & 8 else 1.0
    exp, mant = (nibble >> 1) & 3, nibble & 1
    return sign * (mant * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + mant / 2))


def decode_mxfp4(weight, scale):
    rows, cols = weight.shape[0], 2 * weight.shape[1]
    out = np.zeros((rows, cols), np.float32)
    for r in range(rows):
        for c in range(cols):
            byte = int(weight[r, c // 2])
            nibble = byte & 0xF if c % 2 == 0 else byte >> 4
            out[r, c] = e2m1(nibble) * 2.0 ** (int(scale[r, c // 32]) - 127)
    return out


def decode_fp8_block(weight, scale_inv):
    w = weight.astype(np.float32)
    return w * np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]


def independent_decode(tensors: dict, key: str, method: str, group: int) -> np.ndarray:
    base = key[: -len("weight")]
    if method == "int4_pack":
        shape = tuple(int(v) for v in tensors[base + "weight_shape"])
        return decode_int4(tensors[base + "weight_packed"], tensors[base + "weight_scale"], shape, group)
    if method == "mxfp4":
        return decode_mxfp4(tensors[base + "weight"], tensors[base + "weight_scale"])
    if method == "fp8_block":
        return decode_fp8_block(tensors[base + "weight"], tensors[base + "weight_scale_inv"])
    return tensors[base + "weight"].astype(np.float32) * tensors[base + "weight_scale"][:, None]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_resident_weights_decode_like_an_independent_decoder(folders, name):
    _, method, _, group = MODELS[name]
    folder = folders[name]
    cfg = e3.load_model_config(folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    flat = read_flat_params(folder, cfg)
    checked = 0
    for flat_name, q in flat.items():
        if not isinstance(q, QArray):
            continue
        if flat_name.endswith(("experts_gate", "experts_up", "experts_down")):
            layer, proj = int(flat_name.split(".")[1]), flat_name.split(".")[2]
            from eagle3_jax.weights import keymap

            e = 1  # one expert is enough for the loop decoder
            key = keymap.expert_hf_key(cfg, layer, proj, e)
            got = np.asarray(dequantize(q[e]))
        else:
            from eagle3_jax.weights import keymap

            key = keymap.canonical_hf_key(flat_name, cfg)
            got = np.asarray(dequantize(q))
        np.testing.assert_array_equal(got, independent_decode(tensors, key, method, group).T, err_msg=flat_name)
        checked += 1
    assert checked >= 3
    if name == "kimi_int4":  # only the routed experts are int4; attention, shared and dense stay bf16/f32
        assert {n.split(".")[-1] for n, q in flat.items() if isinstance(q, QArray)} == {"experts_gate", "experts_up", "experts_down"}
        assert flat["layers.1.experts_up"].values.dtype == np.uint8
        assert flat["layers.1.experts_up"].scales.dtype == ml_dtypes.bfloat16
    if name == "kimi_mxfp4":  # experts, shared experts and the dense layer-0 MLP are MXFP4
        assert isinstance(flat["layers.0.gate_proj"], QArray) and isinstance(flat["layers.1.shared_down"], QArray)
        assert not isinstance(flat["layers.1.q_a_proj"], QArray) and not isinstance(flat["lm_head"], QArray)


def test_fp8_channel_and_fnuz_round_trip():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 40)).astype(np.float32)
    t = encode(w, "fp8_channel")
    ref = independent_decode({"weight": t["weight"], "weight_scale": t["weight_scale"]}, "weight", "fp8_channel", 0)
    from eagle3_jax.checkpoint.quant import fp8_e4m3fn_to_fnuz
    from eagle3_jax.weights.params import qformat_for

    fmt = qformat_for(QuantConfig("fp8_channel"))
    q = QArray(jnp.asarray(t["weight"].T), jnp.asarray(t["weight_scale"][None]), fmt)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), ref.T)
    # fnuz: same bits worth half, scales doubled -> the same values (0x80 -> 0)
    values, scales = fp8_e4m3fn_to_fnuz(t["weight"].T, t["weight_scale"][None])
    qz = QArray(jnp.asarray(values), jnp.asarray(scales), dataclasses.replace(fmt, fnuz=True))
    np.testing.assert_array_equal(np.asarray(dequantize(qz)), ref.T)


# ---- models: quantized == dequantized twin -----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_quantized_logits_equal_dequantized_twin(folders, name):
    ids = np.random.default_rng(0).integers(0, 64, (2, 9))
    quant = e3.load_target(folders[name], dtype="float32")
    twin = e3.load_target(folders[name], dtype="float32", dequantize=True)
    assert any(isinstance(leaf, QArray) for leaf in jax.tree.leaves(quant.params, is_leaf=lambda x: isinstance(x, QArray)))
    assert not any(isinstance(leaf, QArray) for leaf in jax.tree.leaves(twin.params, is_leaf=lambda x: isinstance(x, QArray)))
    want = twin.logits(ids)
    np.testing.assert_allclose(quant.logits(ids), want, atol=2e-5 * np.abs(want).max())


KERNEL_MODELS = {  # expert widths the kernels tile (>= one 32-wide scale group), and one they cannot
    "kimi_int4_g32": (dict(DEEPSEEK, moe_intermediate_size=32), "int4_pack", KIMI_IGNORE, 32, {}),
    "kimi_w4a8_g32": (dict(DEEPSEEK, moe_intermediate_size=32), "int4_pack", KIMI_IGNORE, 32, {"w4a8": True}),
    "kimi_mxfp4": (dict(DEEPSEEK, moe_intermediate_size=32), "mxfp4", ("lm_head", "re:.*self_attn.*"), 32, {}),
    "deepseek_fp8_fnuz": (DEEPSEEK, "fp8_block", (), 32, {"fp8_format": "e4m3fnuz"}),
    "minimax_fp8": (MINIMAX, "fp8_block", ("gate", "e_score_correction_bias", "lm_head"), 32, {}),
    "kimi_int4_g16": (DEEPSEEK, "int4_pack", KIMI_IGNORE, 16, {}),
}


@pytest.mark.parametrize("name", sorted(KERNEL_MODELS))
def test_expert_kernels_equal_xla(name, tmp_path, caplog, kernel_calls):
    """kernels="moe=triton" (Triton's interpreter): the routed experts run the grouped kernels on the
    resident quantized weights, logits as the XLA path's; a layout the kernels cannot tile (int4
    groups of 16) keeps the XLA path and says so."""
    from eagle3_jax.runtime import kernels

    family, method, ignore, group, options = KERNEL_MODELS[name]
    raw = dict(family, quantization_config=quantization_config(method, ignore, group))
    cfg = parse_model_config(raw)
    save_hf_target(str(tmp_path), random_flat(cfg, 0), cfg, raw)
    kernels.warn_once.cache_clear()
    ids = np.random.default_rng(0).integers(0, 64, (2, 9))
    want = e3.load_target(tmp_path, dtype="float32", **options).logits(ids)
    with caplog.at_level("WARNING"):
        got = e3.load_target(tmp_path, dtype="float32", kernels="moe=triton", **options).logits(ids)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
    if name == "kimi_int4_g16":
        assert not kernel_calls and "routed experts keep the XLA path: experts gate: int4 needs scale groups" in caplog.text
    else:
        assert kernel_calls and "keep the XLA path" not in caplog.text


def test_quantized_weights_take_less_memory(folders):
    for name in ("kimi_int4", "kimi_mxfp4", "deepseek_fp8"):
        q = e3.load_target(folders[name], dtype="bfloat16").params["segments"][1]["experts_up"]
        twin = e3.load_target(folders[name], dtype="bfloat16", dequantize=True).params["segments"][1]["experts_up"]
        assert q.nbytes < twin.nbytes * (0.7 if name != "deepseek_fp8" else 0.8), name


def test_fnuz_loading_gives_the_same_logits(folders):
    ids = np.random.default_rng(1).integers(0, 64, (2, 9))  # (2, 9) as the other logits here: fewer compiles
    fn = e3.load_target(folders["deepseek_fp8"], dtype="float32", fp8_format="e4m3fn")
    fnuz = e3.load_target(folders["deepseek_fp8"], dtype="float32", fp8_format="e4m3fnuz")
    leaf = fnuz.params["segments"][1]["experts_up"]
    assert leaf.values.dtype == jnp.float8_e4m3fnuz and leaf.qformat.fnuz
    np.testing.assert_array_equal(fnuz.logits(ids), fn.logits(ids))


def test_w4a8_matmul_is_exact_int_arithmetic():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((24, 64)).astype(np.float32)  # [out, in], 4 groups of 16
    t = encode(w, "int4_pack", 16)
    from eagle3_jax.checkpoint.quant import int4_words_to_bytes
    from eagle3_jax.weights.quant import QFormat

    q = QArray(jnp.asarray(int4_words_to_bytes(t["weight_packed"]).T), jnp.asarray(t["weight_scale"].T),
               QFormat("int4", (16, 1), "bfloat16", act="int8"))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    got = np.asarray(linear(jnp.asarray(x), q))
    # reference: int8 rows (absmax / 127), integer group dots, then scales
    xs = np.abs(x).max(-1, keepdims=True) / 127.0
    xq = np.clip(np.round(x / xs), -127, 127).astype(np.int64)
    vals = np.round(decode_int4(t["weight_packed"], np.ones_like(t["weight_scale"], np.float32), (24, 64), 16)).astype(np.int64)
    want = np.zeros((3, 24))
    for g in range(4):
        sl = slice(16 * g, 16 * g + 16)
        want += (xq[:, sl] @ vals[:, sl].T) * t["weight_scale"][:, g].astype(np.float32)[None, :]
    np.testing.assert_allclose(got, want * xs, rtol=1e-5, atol=1e-5)
    # and close to the W4A16 result
    w16 = np.asarray(linear(jnp.asarray(x), dataclasses.replace(q, qformat=dataclasses.replace(q.qformat, act="float"))))
    assert np.abs(got - w16).max() < 0.05 * np.abs(w16).max()


def test_w4a8_model_is_close_to_w4a16(folders):
    ids = np.random.default_rng(2).integers(0, 64, (2, 9))
    a16 = e3.load_target(folders["kimi_int4"], dtype="float32").logits(ids)
    a8 = e3.load_target(folders["kimi_int4"], dtype="float32", w4a8=True).logits(ids)
    assert np.abs(a8 - a16).max() < 0.05 * np.abs(a16).max()
    assert not np.array_equal(a8, a16)  # the int8 path really ran


def test_orbax_keeps_quantized_format(folders, tmp_path):
    out = tmp_path / "orbax"
    cfg = e3.load_model_config(folders["kimi_int4"])
    marker = save_orbax(folders["kimi_int4"], out, cfg, progress=False)
    assert marker["quantization"] == "int4_pack"
    assert marker["tensors"]["layers.1.experts_up"]["quant"]["format"] == "int4"
    ids = np.random.default_rng(4).integers(0, 64, (2, 9))
    a = e3.load_target(out, dtype="float32")
    assert isinstance(a.params["segments"][1]["experts_up"], QArray)
    np.testing.assert_array_equal(a.logits(ids), e3.load_target(folders["kimi_int4"], dtype="float32").logits(ids))
    # converted dequantized: loads without asking, as floats
    deq = tmp_path / "deq"
    save_orbax(folders["kimi_int4"], deq, dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, resident=False)),
               progress=False)
    b = e3.load_target(deq, dtype="float32")
    assert not isinstance(b.params["segments"][1]["experts_up"], QArray)
    np.testing.assert_allclose(b.logits(ids), a.logits(ids), atol=1e-5 * np.abs(a.logits(ids)).max())



@needs_8
@pytest.mark.parametrize("name,fp8_format", [("kimi_int4", "e4m3fn"), ("kimi_mxfp4", "e4m3fn"),
                                             ("minimax_fp8", "e4m3fnuz")])
def test_orbax_restores_straight_onto_the_mesh(folders, tmp_path, name, fp8_format):
    """On a mesh, a converted folder is restored shard by shard (orbax_sharded): the same bits and
    the same placement as loading the HF folder on that mesh."""
    out = tmp_path / "orbax"
    save_orbax(folders[name], out, e3.load_model_config(folders[name]), progress=False)
    mesh = e3.make_mesh(1, 2, 4)
    want = e3.load_target(folders[name], dtype="bfloat16", mesh=mesh, fp8_format=fp8_format).params
    got = e3.load_target(out, dtype="bfloat16", mesh=mesh, fp8_format=fp8_format).params
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))

# ---- speculation with quantized targets and an FP8 draft ---------------------------------------------


def fp8_draft_folder(folder, target) -> str:
    """An EAGLE-3 draft folder whose layer weights are per-channel FP8 (Quark ptpc_fp8 layout)."""
    from eagle3_jax.train.export import export_hf_draft

    draft = random_draft(target, seed=7)
    export_hf_draft(folder, draft.config, draft.params, dtype="float32")
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    for key in [k for k in tensors if k.startswith("midlayer.") and k.endswith("_proj.weight")]:
        for suffix, arr in encode(tensors.pop(key), "fp8_channel").items():
            tensors[key[: -len("weight")] + suffix] = arr
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = quantization_config("fp8_channel", ("fc", "lm_head"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f)
    return str(folder)


@pytest.mark.parametrize("name", ["kimi_int4", pytest.param("minimax_fp8", marks=pytest.mark.slow)])
def test_greedy_speculation_with_quantized_target_equals_baseline(folders, name, tmp_path):
    prompts = [[1, 5, 9, 2], [3, 4, 5, 6, 7, 8]]
    sp = e3.SamplingParams(max_tokens=12)
    target = e3.load_target(folders[name], dtype="float32")
    ref = e3.Engine(target, max_batch_size=2, max_seq_len=64).generate(prompts, sp)
    draft = e3.load_draft(fp8_draft_folder(tmp_path / "draft", target), target, dtype="float32")
    assert isinstance(draft.params["layers"][0]["q_proj"], QArray) and not isinstance(draft.params["fc"], QArray)
    for spec in (e3.SpecConfig(3, 1, 4), e3.SpecConfig(3, 2, 6)):
        out = e3.Engine(target, draft=draft, spec=spec, max_batch_size=2, max_seq_len=64).generate(prompts, sp)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref], spec


# ---- expert parallelism on 8 devices -----------------------------------------------------------------


@needs_8
@pytest.mark.parametrize("mesh_shape", [(1, 2, 4), pytest.param((1, 1, 8), marks=pytest.mark.slow),
                                        pytest.param((2, 2, 2), marks=pytest.mark.slow)],
                         ids=lambda s: "x".join(map(str, s)))
def test_expert_parallel_quantized_equals_one_device(folders, mesh_shape):
    ids = np.random.default_rng(6).integers(0, 64, (2, 9))
    ref = e3.load_target(folders["kimi_int4"], dtype="float32")
    sharded = e3.load_target(folders["kimi_int4"], dtype="float32", mesh=e3.make_mesh(*mesh_shape))
    experts = sharded.params["segments"][1]["experts_gate"]
    assert experts.values.sharding.spec[1] == "expert" if mesh_shape[2] > 1 else True
    want = ref.logits(ids)
    np.testing.assert_allclose(sharded.logits(ids), want, atol=1e-5 * np.abs(want).max())
    prompts, sp = [[1, 2, 3], [4, 5, 6, 7]], e3.SamplingParams(max_tokens=8)
    base = e3.Engine(ref, max_batch_size=2, max_seq_len=64).generate(prompts, sp)
    got = e3.Engine(sharded, draft=random_draft(sharded), spec=e3.SpecConfig(3, 1, 4), max_batch_size=2,
                    max_seq_len=64).generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in base]


@needs_8
def test_expert_width_stays_whole_when_down_scale_groups_cannot_split(tmp_path):
    """Intermediate width 48 in int4 groups of 16 over 2 tensor shards: down's 24 rows per shard
    would cut a scale group, so no expert weight splits that width (gate/up follow down)."""
    raw = dict(DEEPSEEK, moe_intermediate_size=48, quantization_config=quantization_config("int4_pack", KIMI_IGNORE, 16))
    cfg = parse_model_config(raw)
    save_hf_target(str(tmp_path), random_flat(cfg, 3), cfg, raw)
    ids = np.random.default_rng(8).integers(0, 64, (2, 7))
    want = e3.load_target(tmp_path, dtype="float32").logits(ids)
    sharded = e3.load_target(tmp_path, dtype="float32", mesh=e3.make_mesh(1, 2, 4))
    seg = sharded.params["segments"][1]
    assert [seg[n].values.sharding.spec for n in ("experts_gate", "experts_down")] == [
        jax.sharding.PartitionSpec(None, "expert", None, None), jax.sharding.PartitionSpec(None, "expert", None, None)]
    np.testing.assert_allclose(sharded.logits(ids), want, atol=1e-5 * np.abs(want).max())

@needs_8
def test_expert_parallel_program_never_gathers_expert_weights(folders):
    """Under the mesh the MoE is a shard_map: no all-gather of the [E, ...] expert values."""
    from eagle3_jax.models import target as tgt
    from eagle3_jax.runtime.sharding import mesh_context

    mesh = e3.make_mesh(1, 1, 8)
    t = e3.load_target(folders["kimi_int4"], dtype="float32", mesh=mesh)
    cache = t.init_cache(2, 32)
    fwd = jax.jit(tgt.forward, static_argnames=("cfg", "absorb"))
    tokens = jnp.zeros((2, 4), jnp.int32)
    with mesh_context(mesh):
        hlo = fwd.lower(t.params, t.config, tokens, tokens, cache).compile().as_text()
    e = t.config.num_experts
    assert "all-reduce" in hlo
    gathers = [line for line in hlo.splitlines() if "all-gather" in line and f"u8[{e}," in line.replace(" ", "")]
    assert not gathers, gathers[:2]


# ---- bad input ---------------------------------------------------------------------------------------


def test_unsupported_schemes_are_named():
    q = quantization_config("int4_pack", (), 32)
    q["config_groups"]["group_0"]["weights"]["group_size"] = 3
    with pytest.raises(ConfigError, match="group_size=3"):
        parse_model_config(dict(DEEPSEEK, quantization_config=q))
    q = quantization_config("mxfp4")
    q["global_quant_config"]["weight"]["group_size"] = 16
    with pytest.raises(ConfigError, match="group_size=16"):
        parse_model_config(dict(DEEPSEEK, quantization_config=q))
    with pytest.raises(ConfigError, match="not supported"):
        parse_model_config(dict(DEEPSEEK, quantization_config={"quant_method": "gptq", "bits": 4}))


def test_bad_scales_and_unquantized_covered_tensors_are_named(folders, tmp_path):
    tensors = load_file(os.path.join(folders["kimi_int4"], "model.safetensors"))
    key = "model.layers.1.mlp.experts.2.up_proj.weight_scale"
    bad = dict(tensors, **{key: tensors[key][:, :1].copy()})
    with open(os.path.join(folders["kimi_int4"], "config.json")) as f:
        raw = json.load(f)
    (tmp_path / "a").mkdir()
    save_file(bad, str(tmp_path / "a" / "model.safetensors"))
    (tmp_path / "a" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        e3.load_target(tmp_path / "a")
    # a covered module stored unquantized: named, with the fix
    raw["quantization_config"]["ignore"] = ["lm_head", "re:.*self_attn.*"]  # shared experts now covered
    (tmp_path / "b").mkdir()
    save_file(tensors, str(tmp_path / "b" / "model.safetensors"))
    (tmp_path / "b" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"shared_experts\.down_proj.*stored unquantized.*ignore list"):
        e3.load_target(tmp_path / "b")
    e3.load_target(tmp_path / "b", dequantize=True)  # the old behaviour still loads it
    with pytest.raises(ValueError, match="w4a8"):
        e3.load_target(folders["deepseek_fp8"], w4a8=True)
