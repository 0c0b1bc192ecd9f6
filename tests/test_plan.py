"""The memory planner on full-size configs (shapes only): Kimi-K2.5 int4 + its EAGLE-3 draft fits one
8-GPU node, arguments account for every weight, quantized formats shrink what a step reads."""

from __future__ import annotations

import math
import os

import jax
import pytest

import eagle3_jax as e3
from eagle3_jax.planning.memory import DEVICES, plan_memory
from eagle3_jax.weights.params import flat_specs

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def test_kimi_specs_keep_experts_int4_and_count_every_byte():
    cfg = e3.load_model_config(os.path.join(DATA, "kimi-k2.5.config.json"))
    specs = flat_specs(cfg)
    quantized = {n.split(".")[-1] for n, s in specs.items() if s.quant is not None}
    assert quantized == {"experts_gate", "experts_up", "experts_down"}
    experts = sum(math.prod(s.shape) for s in specs.values() if s.quant is not None)
    assert experts == 60 * 384 * 3 * 7168 * 2048
    expert_bytes = sum(s.nbytes("bfloat16") for s in specs.values() if s.quant is not None)
    assert expert_bytes == experts // 2 + experts // 32 * 2  # 0.5 byte per weight + one bf16 scale per 32
    total = sum(s.nbytes("bfloat16") for s in specs.values())
    assert 560e9 < total < 640e9  # ~0.6 TB, not ~2 TB in bf16


@needs_8
def test_kimi_int4_with_draft_fits_eight_mi325x_at_batch_64():
    mesh = e3.make_mesh(1, 1, 8)
    plan = plan_memory(os.path.join(DATA, "kimi-k2.5.config.json"), os.path.join(DATA, "kimi-k2.5-eagle3.draft.json"),
                       mesh=mesh, batch=64, max_len=2304, spec=e3.SpecConfig(3, 1, 4), programs=("step",))
    assert plan.total_bytes <= 256e9, plan.total_bytes / 2**30
    assert plan.fits(DEVICES["MI325X"])
    # every weight and cache is an argument: XLA's count equals ours up to the small step inputs
    held = plan.weight_bytes + plan.kv_bytes
    assert held <= plan.argument_bytes <= held * 1.01 + 2**20
    target_kv = 61 * 64 * 2304 * (512 + 64) * 2  # latent + rotary key per token and layer, bf16, not split on this mesh
    import json

    from eagle3_jax.models.draft import parse_draft_config

    with open(os.path.join(DATA, "kimi-k2.5-eagle3.draft.json")) as f:
        d = parse_draft_config(json.load(f)).layers
    draft_kv = d.num_layers * 64 * 2304 * 2 * d.num_kv_heads * d.head_dim * 2  # K and V, bf16
    assert plan.kv_bytes == target_kv + draft_kv
    # weights per device: the int4 experts split 8 ways, the rest replicated
    specs = flat_specs(e3.load_model_config(os.path.join(DATA, "kimi-k2.5.config.json")))
    experts = sum(s.nbytes("bfloat16") for s in specs.values() if s.quant is not None)
    rest = sum(s.nbytes("bfloat16") for s in specs.values() if s.quant is None)
    assert experts / 8 + rest <= plan.weight_bytes <= experts / 8 + rest + 8e9  # + the draft (own embedding and full-vocab head)


@pytest.mark.slow  # a second full-size step compile; the default run plans the Llama-layer draft above
@needs_8
def test_kimi_with_mla_draft_plans_the_mla_draft_programs():
    """The published Kimi-K2.5 MLA draft: its cache is one MLA latent + rope key per token (not
    per-head K/V), its weights are the 2H-input MLA layer, and the speculative step compiles."""
    import json

    from eagle3_jax.models.draft import draft_specs, parse_draft_config

    mesh = e3.make_mesh(1, 1, 8)
    draft = os.path.join(DATA, "kimi-k2.5-eagle3-mla.draft.json")
    plan = plan_memory(os.path.join(DATA, "kimi-k2.5.config.json"), draft, mesh=mesh, batch=64, max_len=2304,
                       spec=e3.SpecConfig(3, 1, 4), programs=("step",))
    assert plan.fits(DEVICES["MI325X"])
    target_kv = 61 * 64 * 2304 * (512 + 64) * 2
    assert plan.kv_bytes == target_kv + 1 * 64 * 2304 * (512 + 64) * 2  # one draft layer, same latent layout
    with open(draft) as f:
        dcfg = parse_draft_config(json.load(f))
    draft_bytes = sum(s.nbytes("bfloat16") for s in draft_specs(dcfg, with_embed=True).values())
    specs = flat_specs(e3.load_model_config(os.path.join(DATA, "kimi-k2.5.config.json")))
    experts = sum(s.nbytes("bfloat16") for s in specs.values() if s.quant is not None)
    rest = sum(s.nbytes("bfloat16") for s in specs.values() if s.quant is None)
    assert plan.weight_bytes == experts // 8 + rest + draft_bytes
    held = plan.weight_bytes + plan.kv_bytes
    assert held <= plan.argument_bytes <= held * 1.01 + 2**20


@needs_8
def test_int4_reads_fewer_bytes_per_decode_step_than_bf16():
    mesh = e3.make_mesh(1, 1, 8)
    cfg = os.path.join(DATA, "kimi-k2.5.config.json")
    int4 = plan_memory(cfg, mesh=mesh, batch=1, max_len=1024, programs=("decode",))
    bf16 = plan_memory(cfg, mesh=mesh, batch=1, max_len=1024, quant="dequantize", programs=("decode",))
    assert int4.weight_bytes < 0.35 * bf16.weight_bytes
    assert int4.step_read_bytes < bf16.step_read_bytes
    assert int4.argument_bytes < 0.35 * bf16.argument_bytes


def test_device_memory_is_in_decimal_gigabytes():
    """Vendors state HBM in GB (10^9): a step needing 287.8 GiB does not fit a 288 GB MI355X."""
    from eagle3_jax.planning.memory import MemoryPlan

    assert DEVICES["MI325X"].hbm_bytes == 256 * 10**9 and DEVICES["H100"].hbm_bytes == 80 * 10**9
    plan = MemoryPlan(mesh_shape={}, batch=1, max_len=1, spec=None, argument_bytes=int(200 * 2**30),
                      temp_bytes=int(87.8 * 2**30), output_bytes=0, alias_bytes=0, weight_bytes=0, kv_bytes=0,
                      kv_bytes_per_token=1, step_read_bytes=0, programs={})
    assert not plan.fits(DEVICES["MI355X"]) and plan.kv_tokens_left(DEVICES["MI355X"]) == 0


@needs_8
def test_kernel_path_plans_without_dequantized_expert_copies():
    """DeepSeek-V3 FP8 on 8 devices at batch 32, planned as a GPU holds the programs. The XLA path
    dequantizes each layer's local experts to bf16 before the dot; the program a GPU runs with the
    Triton kernels (planned for gfx942, each kernel as an op of its exact output shapes) holds no
    such copy, and its temps stay under a quarter of its arguments."""
    mesh = e3.make_mesh(1, 1, 8)
    cfg, draft = os.path.join(DATA, "deepseek-v3.config.json"), os.path.join(DATA, "deepseek-v3-eagle3.draft.json")
    kw = dict(mesh=mesh, batch=32, max_len=2304, programs=("step",))
    xla = plan_memory(cfg, draft, **kw)
    kernels = plan_memory(cfg, draft, kernels="triton", arch="gfx942", **kw)
    assert xla.path == "xla" and "gfx942" in kernels.path and "attention=triton,moe=triton" in kernels.path
    assert kernels.argument_bytes == xla.argument_bytes
    mc = e3.load_model_config(cfg)
    one_layer_dequantized = mc.num_experts // 8 * 3 * mc.hidden_size * mc.moe_intermediate_size * 2  # bf16
    assert xla.temp_bytes - kernels.temp_bytes > one_layer_dequantized
    assert kernels.temp_bytes < 0.25 * kernels.argument_bytes and kernels.fits(DEVICES["MI325X"])
    with pytest.raises(ValueError, match="needs the GPU they run on"):
        plan_memory(cfg, draft, kernels="triton", **kw)


# ---- the speedup prediction (roofline per concurrency) -------------------------------------------------


def test_distinct_experts_match_a_sampled_simulation():
    """E (1 - (1 - k/E)^n): the distinct experts n tokens route to, each picking k of E uniformly
    without repeats, checked against sampled routings."""
    import numpy as np

    from eagle3_jax.planning.roofline import expected_distinct_experts

    rng = np.random.default_rng(0)
    for experts, k, tokens in ((384, 8, 1), (384, 8, 40), (384, 8, 160), (256, 8, 64), (8, 2, 3)):
        trials = 400
        counts = [len(np.unique(np.concatenate([rng.choice(experts, k, replace=False) for _ in range(tokens)])))
                  for _ in range(trials)]
        want = expected_distinct_experts(experts, k, tokens)
        assert abs(np.mean(counts) - want) < 4 * np.std(counts) / np.sqrt(trials) + 1e-9, (experts, k, tokens)


@needs_8
def test_prediction_counts_what_a_step_reads_and_computes():
    """Kimi-K2.5 int4 on 8 MI325X: one token reads the dense weights and 8 of 384 experts per layer,
    a 4-token verify more experts; at high concurrency the verify turns compute-bound; tau and
    the speedup follow the acceptance profile."""
    from eagle3_jax.planning.memory import abstract_setup
    from eagle3_jax.planning.roofline import Hardware, StepCosts, predict, step_costs

    setup = abstract_setup(os.path.join(DATA, "kimi-k2.5.config.json"), os.path.join(DATA, "kimi-k2.5-eagle3.draft.json"),
                           mesh=e3.make_mesh(1, 8, 1), batch=1, max_len=16)
    costs = step_costs(setup)
    experts_total = 60 * 384 * 3 * 7168 * 2048
    assert costs.expert_elements == experts_total // 8 and costs.num_experts == 384
    assert costs.kv_bytes_per_token == 61 * (512 + 64) * 2  # MLA latent + rope, bf16, replicated over tensor
    assert 3.5e9 < costs.draft_bytes < 4.5e9  # the draft is replicated: fc, one layer, its LM head
    d = DEVICES["MI325X"]
    hw = Hardware(d.name, d.hbm_gbps, d.bf16_tflops)
    spec = e3.SpecConfig(3, 1, 4)
    one = predict(costs, hw, spec, (0.9, 0.8, 0.7), 1, 1024)
    assert math.isclose(one.tau, 1 + 0.9 + 0.8 + 0.7, rel_tol=1e-12)  # sum() of floats is compensated from Python 3.12
    expected_plain_read = (costs.dense_bytes + costs.expert_bytes * (1 - (1 - 8 / 384)) + 1024 * costs.kv_bytes_per_token)
    assert math.isclose(one.plain_step_ms, expected_plain_read / (d.hbm_gbps * 1e6), rel_tol=1e-9)
    assert one.verify_ms > one.plain_step_ms  # four tokens touch more experts than one
    assert predict(costs, hw, spec, (0.0,), 64, 1024).speedup < 1 < predict(costs, hw, spec, (0.9, 0.8, 0.7), 64,
                                                                            1024).speedup
    assert predict(costs, hw, spec, (0.9, 0.8, 0.7), 4096, 1024).verify_bound == "compute"
    slower = predict(costs, Hardware(d.name, d.hbm_gbps, d.bf16_tflops, 0.5, 2.0), spec, (0.9,), 1, 1024)
    assert math.isclose(slower.plain_step_ms, 2 * one.plain_step_ms + 2.0, rel_tol=1e-9)
    assert isinstance(costs, StepCosts) and costs.fits(d.hbm_bytes, 64, 2048) and not costs.fits(d.hbm_bytes, 10**6, 2048)


@needs_8
def test_kimi_long_context_on_a_data_mesh():
    """Data-parallel attention at long context, the default (XLA) path: each device holds its 8
    sequences' KV and 1/8 of the experts. 64 x 32K fits a 256 GB device in bfloat16, 64 x 128K
    with an FP8 cache; weights as on mesh 1,1,8; the step's temporaries do not grow with the context."""
    target, draft = os.path.join(DATA, "kimi-k2.5.config.json"), os.path.join(DATA, "kimi-k2.5-eagle3.draft.json")

    def plan(mesh, max_len, kv_cache_dtype="auto"):
        return plan_memory(target, draft, mesh=mesh, batch=64, max_len=max_len, spec=e3.SpecConfig(3, 1, 4),
                           programs=("step",), kv_cache_dtype=kv_cache_dtype)

    data8, expert8 = e3.make_mesh(8, 1, 1), e3.make_mesh(1, 1, 8)
    at_32k, fp8_128k = plan(data8, 32768), plan(data8, 131072, "fp8")
    assert at_32k.total_bytes <= 256e9 and fp8_128k.total_bytes <= 256e9, (at_32k.total_bytes, fp8_128k.total_bytes)
    short = plan(expert8, 8192)
    assert at_32k.weight_bytes == short.weight_bytes  # experts split over data x expert, as over expert alone
    target_kv = 61 * 8 * 32768 * (512 + 64) * 2  # this device's 8 sequences
    assert target_kv < at_32k.kv_bytes < target_kv * 1.6  # + the draft's share
    # FP8: a byte per lane plus a float32 scale per 128 lanes (per 64-lane rope key)
    fp8_target = 61 * 8 * 131072 * (512 + 64 + 4 * 5)
    assert fp8_target < fp8_128k.kv_bytes < fp8_128k.kv_bytes_per_token * 64 * 131072 * 1.01
    assert plan(expert8, 32768).temp_bytes <= 1.25 * short.temp_bytes
