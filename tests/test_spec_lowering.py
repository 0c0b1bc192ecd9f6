"""Deviceless lowering of the speculative programs (prefill and one decode step) for ROCm and CUDA.

`jax.jit(f).trace(*args).lower(lowering_platforms=(p,))` lowers to StableHLO for a platform without
its device or plugin (checked on jax 0.10.2), so lowering failures in the whole speculative step
(target verify with MLA + MoE, acceptance and sampling, cache compaction, draft extend and tree
expansion) show up in CPU CI. Every argument is a `jax.ShapeDtypeStruct`: no weights are
materialised, which also lets full-size Llama-3.1-8B and DeepSeek-V3 + EAGLE-3 pairs lower here. Each program is
traced once and lowered for both platforms.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import pytest
from random_models import FAMILIES, random_draft, random_target

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.config.model import load_model_config
from eagle3_jax.models import draft as draft_lib
from eagle3_jax.sampling.sampler import SamplingArrays
from eagle3_jax.scheduler.steps import spec_prefill
from eagle3_jax.spec_decode import step as step_lib
from eagle3_jax.spec_decode.propose import DraftRoot
from eagle3_jax.weights import params as params_lib

PLATFORMS = ("rocm", "cuda")
TEST_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
STATIC = ("tcfg", "dcfg", "spec")
SPEC_STEP = jax.jit(step_lib.spec_step, static_argnames=STATIC)
SPEC_PREFILL = jax.jit(spec_prefill, static_argnames=STATIC[:2])


def sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def abstract(tree):
    return jax.tree.map(sds, tree)


def abstract_sampling(batch: int) -> SamplingArrays:
    f32, i32 = jnp.float32, jnp.int32
    return SamplingArrays(temperature=jax.ShapeDtypeStruct((batch,), f32), top_k=jax.ShapeDtypeStruct((batch,), i32),
                          top_p=jax.ShapeDtypeStruct((batch,), f32), seed=jax.ShapeDtypeStruct((batch,), jnp.uint32))


def program_args(tparams, tcfg, dparams, dcfg, spec, batch: int, max_len: int, prompt_len: int, dtype):
    """Abstract (step args, prefill args) for one target/draft pair."""
    tcache = jax.eval_shape(lambda: kv_cache.init_cache(tcfg, batch, max_len, dtype))
    dcache = jax.eval_shape(lambda: kv_cache.init_cache(dcfg.layers, batch, max_len, dtype))
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    root = DraftRoot(token=vec, hidden=jax.ShapeDtypeStruct((batch, dcfg.hidden_size), dtype))
    sp = abstract_sampling(batch)
    step = (tparams, tcfg, dparams, dcfg, spec, tcache, dcache, root, sp, vec)
    prefill = (tparams, tcfg, dparams, dcfg, tcache, dcache,
               jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32), vec, sp)
    return step, prefill


def lower_all(fn, args) -> dict[str, str]:
    traced = fn.trace(*args)
    out = {}
    for platform in PLATFORMS:
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert isinstance(text, str) and text.strip(), platform
        assert "func.func public @main" in text and "stablehlo." in text, platform
        out[platform] = text
    return out


SPECS = [e3.SpecConfig(3, 1, 4), e3.SpecConfig(3, 2, 6)]


@pytest.fixture(scope="module", params=["deepseek_v3", "minimax_m2"])
def tiny_pair(request):
    target = random_target(FAMILIES[request.param], dtype=jnp.bfloat16)
    draft = random_draft(target)
    return target, draft


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"steps{s.num_steps}_topk{s.topk}_n{s.num_draft_tokens}")
def test_spec_programs_lower_tiny(tiny_pair, spec):
    target, draft = tiny_pair
    step, prefill = program_args(abstract(target.params), target.config, abstract(draft.params), draft.config, spec,
                                 batch=2, max_len=64, prompt_len=16, dtype=jnp.bfloat16)
    texts = lower_all(SPEC_STEP, step)
    lower_all(SPEC_PREFILL, prefill)
    if target.config.attention == "mla":  # the latent cache [L, B, S, kv_lora_rank] is a program argument
        c = target.config
        assert f"tensor<{c.num_layers}x2x64x{c.kv_lora_rank}xbf16>" in texts["rocm"]


# ---- full size: Llama-3.1-8B-Instruct with its published EAGLE-3 draft (shapes only) -------------


def abstract_target_params(cfg, dtype) -> dict:
    def one(spec, lead=()):
        return jax.ShapeDtypeStruct(lead + spec.shape, jnp.float32 if spec.float32 else dtype)

    flat = params_lib.flat_specs(cfg)
    tree = {k: one(flat[k]) for k in ("embed", "final_norm", "lm_head") if k in flat}
    tree["segments"] = tuple(
        {name: one(spec, (stop - start,)) for name, spec in params_lib.layer_specs(cfg, kind).items()}
        for kind, start, stop in cfg.segments
    )
    return tree


def abstract_draft_params(dcfg, dtype) -> dict:
    """The tree `draft._assemble` builds: fc, final_norm, lm_head, embed, layers[i]{...}, d2t."""
    flat = draft_lib.draft_specs(dcfg, with_embed=True)
    tree = {k: jax.ShapeDtypeStruct(flat[k].shape, dtype) for k in ("fc", "final_norm", "lm_head", "embed")}
    tree["layers"] = [
        {name.split(".", 2)[2]: jax.ShapeDtypeStruct(spec.shape, dtype)
         for name, spec in flat.items() if name.startswith(f"layers.{i}.")}
        for i in range(dcfg.layers.num_layers)
    ]
    if dcfg.has_draft_vocab:
        tree["d2t"] = jax.ShapeDtypeStruct((dcfg.draft_vocab_size,), jnp.int32)
    return tree


def test_abstract_draft_tree_matches_assembled():
    """The abstract draft tree used below has the structure, shapes and dtypes `_assemble` gives."""
    target = random_target(FAMILIES["llama"], dtype=jnp.bfloat16)
    raw = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=32, intermediate_size=48,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, draft_vocab_size=40)
    for with_embed in (True, False):
        draft = random_draft(target, raw, with_embed=with_embed)
        got = jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), abstract_draft_params(draft.config, jnp.bfloat16))
        want = jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), draft.params)
        assert got == want


FULL = {
    # target config, its published EAGLE-3 draft
    "llama31_8b": ("llama-3.1-8b-instruct.config.json", "llama3.1-8b-eagle3.draft.json"),
    "deepseek_v3": ("deepseek-v3.config.json", "deepseek-v3-eagle3.draft.json"),
}


@pytest.mark.parametrize("name", sorted(FULL))
def test_spec_programs_lower_full_size(name):
    import json

    tname, dname = FULL[name]
    tcfg = load_model_config(os.path.join(TEST_DATA, tname))
    with open(os.path.join(TEST_DATA, dname)) as f:
        dcfg = draft_lib.parse_draft_config(json.load(f))
    draft_lib.check_fits_target(dcfg, tcfg)
    if dcfg.aux_layer_ids is not None:
        tcfg = tcfg.with_aux_layers(dcfg.aux_layer_ids)
    assert dcfg.has_draft_vocab and dcfg.draft_vocab_size == 32000
    spec = e3.SpecConfig(3, 1, 4)
    t0 = time.perf_counter()
    step, prefill = program_args(abstract_target_params(tcfg, jnp.bfloat16), tcfg,
                                 abstract_draft_params(dcfg, jnp.bfloat16), dcfg, spec,
                                 batch=1, max_len=64, prompt_len=16, dtype=jnp.bfloat16)
    for program, texts in (("step", lower_all(SPEC_STEP, step)), ("prefill", lower_all(SPEC_PREFILL, prefill))):
        for text in texts.values():
            assert f"tensor<{tcfg.vocab_size}x{tcfg.hidden_size}xbf16>" in text  # target embedding (an argument)
            assert f"tensor<{3 * tcfg.hidden_size}x{dcfg.hidden_size}xbf16>" in text  # fc
            if program == "step":  # the step proposes from the draft's root: lm_head over the draft vocab
                assert f"tensor<{dcfg.hidden_size}x{dcfg.draft_vocab_size}xbf16>" in text
    assert time.perf_counter() - t0 < 60
