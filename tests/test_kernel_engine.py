"""The engine with kernels="triton" (attention through the paged Triton kernel, routed experts
through the grouped kernels, Triton's interpreter on CPU) against the XLA path: logits of decode and verify steps, and greedy speculation (chain and
tree) equal to greedy plain decoding, for the MLA+MoE and GQA+MoE families, dense cache (Engine)
and paged cache (Scheduler)."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, draft_config_dict, random_draft, random_target

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.models.target import forward
from pallas_kernels import launch, triton_call

# The kernels through the engine run in Triton's interpreter (torch CPU tensors): conftest's HEAVY
# list puts them in CI's heavy leg (JAX 0.10, with torch); the traces for GPU platforms, which
# launch nothing, run in the newest-JAX leg (`newest_jax`), and the choice of kernels by default.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="Triton's interpreter runs on torch CPU tensors; no torch here")


def with_kernels(target):
    return dataclasses.replace(target, config=dataclasses.replace(target.config, kernels="triton"))


@pytest.fixture
def measured_on_sm_90(monkeypatch):
    """The "auto" tables as a GPU run fills them: both attention kernels and the MoE by shape
    measured faster on sm_90 (today's tables are empty: no GPU has timed the Triton kernels)."""
    from eagle3_jax.runtime import kernels as kernels_lib

    monkeypatch.setattr(kernels_lib, "AUTO_KERNEL", {"sm_90": ("mla_attention", "gqa_attention")})
    monkeypatch.setattr(kernels_lib, "AUTO_BY_SHAPE", {"sm_90": ("moe",)})


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2", "llama"])
def test_decode_and_verify_logits_equal_xla(family, kernel_calls):
    xla = random_target(FAMILIES[family])
    ker = with_kernels(xla)
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, 64, (2, 11)), jnp.int32)
    cache = xla.init_cache(2, 64)
    _, _, cache = forward(xla.params, xla.config, prompt, jnp.broadcast_to(jnp.arange(11), (2, 11)), cache)
    cache = kv_cache.advance(cache, jnp.asarray([11, 7], jnp.int32))  # rows of different lengths
    tree = np.tril(np.ones((5, 5), bool))
    tree[3, 1:3] = False  # a branch: node 3 hangs off node 0
    tree = jnp.asarray(np.broadcast_to(tree, (2, 5, 5)))
    toks = jnp.asarray(rng.integers(0, 64, (2, 5)), jnp.int32)
    pos = cache.lengths[:, None] + jnp.asarray([0, 1, 2, 1, 2])[None]
    for t in (1, 5):
        want, _, _ = forward(xla.params, xla.config, toks[:, :t], pos[:, :t], cache, tree[:, :t, :t])
        got, _, _ = forward(ker.params, ker.config, toks[:, :t], pos[:, :t], cache, tree[:, :t, :t])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5 * float(np.abs(want).max()))
    # the kernels really ran (traced once per segment and query length)
    assert set(kernel_calls) == ({"paged_prefix_attention"} | ({"grouped_swiglu"} if FAMILIES[family] is not FAMILIES["llama"] else set()))


@pytest.mark.parametrize("family,engine_spec,scheduler_spec", [
    ("deepseek_v3", e3.SpecConfig(3, 1, 4), e3.SpecConfig(3, 2, 6)),  # MLA+MoE: chain dense, tree paged
    pytest.param("minimax_m2", e3.SpecConfig(3, 2, 6), e3.SpecConfig(3, 1, 4),  # GQA+MoE: tree dense, chain paged
                 marks=pytest.mark.slow),  # GQA kernel logits: test_decode_and_verify_logits_equal_xla
])
@needs_torch
def test_greedy_speculation_with_kernels_equals_plain(family, engine_spec, scheduler_spec):
    """Target attention, draft attention and the expert kernels all on: greedy speculation emits the
    plain greedy tokens, in the Engine (dense caches) and the Scheduler (paged caches)."""
    target = with_kernels(random_target(FAMILIES[family]))
    draft = random_draft(target)
    prompts, sp = [[1, 5, 9, 2], [3, 4, 5, 6, 7, 8, 9]], e3.SamplingParams(max_tokens=10)
    want = [o.token_ids for o in e3.Engine(target, max_batch_size=2, max_seq_len=64).generate(prompts, sp)]
    got = e3.Engine(target, draft, engine_spec, max_batch_size=2, max_seq_len=64).generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    sched = e3.Scheduler(target, draft, scheduler_spec, max_num_seqs=2, max_seq_len=64, page_size=16)
    assert [o.token_ids for o in sched.generate(prompts, sp)] == want


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2"])
def test_fp8_pages_through_the_kernels_equal_xla(family, kernel_calls):
    """An FP8 cache (kv_cache_dtype="fp8"): the kernel decodes the float8 pages in registers and
    sees the new tokens through the cache's quantization, as the XLA path reads them back: decode
    and verify logits equal XLA's; greedy chain speculation equals plain decoding through the
    kernels on FP8 pages."""
    xla = random_target(FAMILIES[family])
    ker = with_kernels(xla)
    rng = np.random.default_rng(2)
    prompt = jnp.asarray(rng.integers(0, 64, (2, 11)), jnp.int32)
    cache = xla.init_cache(2, 64, "fp8")
    _, _, cache = forward(xla.params, xla.config, prompt, jnp.broadcast_to(jnp.arange(11), (2, 11)), cache)
    cache = kv_cache.advance(cache, jnp.asarray([11, 7], jnp.int32))
    tree = jnp.asarray(np.broadcast_to(np.tril(np.ones((4, 4), bool)), (2, 4, 4)))
    toks = jnp.asarray(rng.integers(0, 64, (2, 4)), jnp.int32)
    pos = cache.lengths[:, None] + jnp.arange(4)[None]
    for t in (1, 4):
        want, _, _ = forward(xla.params, xla.config, toks[:, :t], pos[:, :t], cache, tree[:, :t, :t])
        got, _, _ = forward(ker.params, ker.config, toks[:, :t], pos[:, :t], cache, tree[:, :t, :t])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5 * float(np.abs(want).max()))
    assert "paged_prefix_attention" in kernel_calls
    prompts, sp = [[1, 5, 9, 2], [3, 4, 5, 6, 7, 8, 9]], e3.SamplingParams(max_tokens=8)
    plain = e3.Scheduler(ker, max_num_seqs=2, max_seq_len=64, kv_cache_dtype="fp8")
    chain = e3.Scheduler(ker, random_draft(ker), e3.SpecConfig(3, 1, 4), max_num_seqs=2, max_seq_len=64,
                         kv_cache_dtype="fp8")
    assert [o.token_ids for o in chain.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]


def test_auto_is_xla_until_a_gpu_has_timed_the_kernels():
    from eagle3_jax.runtime.kernels import resolve

    for arch in ("sm_90", "gfx942", "gfx950", "default"):
        assert resolve("auto", on_gpu=True, arch=arch) == "attention=xla,moe=xla"
    assert resolve("auto") == "attention=xla,moe=xla"  # CPU


def test_kernel_choice_is_checked(caplog, measured_on_sm_90):
    from eagle3_jax.runtime.kernels import resolve, runs_kernel, uses, warn_once

    assert resolve("auto") == "attention=xla,moe=xla"  # CPU
    # on a GPU, per op as measured there (kernels.AUTO_KERNEL / AUTO_BY_SHAPE): sm_90 decides each
    # layer (attention by its form, the MoE by the step's shapes); GPUs no run has measured keep XLA
    assert resolve("auto", on_gpu=True, arch="sm_90") == "attention=auto,moe=auto"
    for arch in ("gfx942", "gfx950", "default"):
        assert resolve("auto", on_gpu=True, arch=arch) == "attention=xla,moe=xla"
    assert resolve("attention=xla,moe=auto", on_gpu=True, arch="sm_90") == "attention=xla,moe=auto"
    with launch.for_arch("sm_90"):  # both attention kernels were measured faster there
        assert runs_kernel("attention=auto,moe=auto", "mla_attention")
        assert runs_kernel("attention=auto,moe=auto", "gqa_attention")
        assert not runs_kernel("attention=xla,moe=auto", "gqa_attention")
        assert runs_kernel("attention=triton,moe=xla", "gqa_attention")
    with launch.for_arch("gfx942"):
        assert not runs_kernel("attention=auto,moe=auto", "mla_attention")
    assert resolve("triton") == "attention=triton,moe=triton"
    assert resolve("moe=triton") == "attention=xla,moe=triton"
    assert uses("attention=xla,moe=triton", "moe") and not uses("attention=auto,moe=auto", "moe")
    for bad in ("pallas_triton", "attention=cuda", "mlp=triton", "attention"):
        with pytest.raises(ValueError, match="one of xla, triton, auto"):
            resolve(bad)
    # the kernels' old name is read as the new one, and said
    warn_once.cache_clear()
    with caplog.at_level("WARNING"):
        assert resolve("pallas") == resolve("triton")
        assert resolve("attention=pallas,moe=xla") == "attention=triton,moe=xla"
    assert "'pallas' is read as 'triton'" in caplog.text


@pytest.fixture
def uninstalled(monkeypatch):
    """`uninstalled(*modules)`: the kernels' package check (kernels.installed) reports them missing."""
    from eagle3_jax.runtime import kernels as kernels_lib

    def missing(*modules):
        monkeypatch.setattr(kernels_lib, "installed", lambda module: module not in modules)

    return missing


def test_kernels_without_their_packages_are_one_clear_error_on_load(uninstalled, monkeypatch, caplog, measured_on_sm_90):
    """kernels="triton" where what runs the kernels is not installed: one MissingExtraError from
    resolve (on load) naming the missing packages and the extra, not a ModuleNotFoundError from
    inside the first step. On a CPU host Triton's interpreter needs triton and torch (the test
    extra); on a GPU jax_triton (the rocm / cuda extra of the GPU's platform); tracing for a GPU
    this host lacks (the memory planner) only triton. "auto" keeps XLA instead."""
    from eagle3_jax.runtime import kernels as kernels_lib
    from eagle3_jax.runtime.extras import MissingExtraError
    from eagle3_jax.runtime.kernels import resolve, warn_once

    uninstalled("torch")
    with pytest.raises(MissingExtraError, match=r"^kernels='triton': running the Triton kernels on a CPU host \(in "
                       r"Triton's interpreter\) needs torch, which is not installed: pip install 'eagle3-jax\[test\]'$"):
        resolve("triton")
    uninstalled("triton", "torch")
    with pytest.raises(MissingExtraError, match=r"needs triton and torch, which are not installed: .*\[test\]"):
        resolve("moe=triton")
    assert resolve("xla") == "attention=xla,moe=xla"  # nothing to check
    uninstalled("torch", "jax_triton")  # planning for a GPU: the kernels are traced here, not run
    assert resolve("triton", on_gpu=True, arch="gfx942") == "attention=triton,moe=triton"
    uninstalled("triton")
    with pytest.raises(MissingExtraError, match=r"tracing the Triton kernels for gfx942 needs triton"):
        resolve("triton", on_gpu=True, arch="gfx942")
    uninstalled("jax_triton")  # on this host's GPU
    monkeypatch.setattr(kernels_lib.triton_call, "on_gpu", lambda backend=None: True)
    for arch, extra in (("gfx942", "rocm"), ("sm_90", "cuda")):
        with pytest.raises(MissingExtraError, match=rf"on a GPU \(through jax_triton\) needs jax_triton, which is not "
                           rf"installed: pip install 'eagle3-jax\[{extra}\]'$"):
            resolve("attention=triton", arch=arch)
    warn_once.cache_clear()
    with caplog.at_level("WARNING"):  # "auto" where a run measured the kernels: XLA without jax_triton
        assert resolve("auto", arch="sm_90") == "attention=xla,moe=xla"
    assert "'auto' keeps XLA" in caplog.text and "jax_triton" in caplog.text
    uninstalled()
    assert resolve("auto", arch="sm_90") == "attention=auto,moe=auto"


def test_auto_runs_the_expert_kernels_where_they_were_measured_faster(measured_on_sm_90):
    """kernels.moe_kernel_pays, the H200's crossovers: small experts never (kimi-mini's 74 KB ran
    0.2-0.4x), int4 always (1.5x at one token), other experts once a step routes one assignment
    per expert of the model (2048 x 768 bfloat16: 0.6-0.7x below, 1.4-4.9x above)."""
    from eagle3_jax.models.moe import runs_kernels
    from eagle3_jax.runtime.kernels import moe_kernel_pays

    mini = 3 * 128 * 96 * 2
    mid = 3 * 2048 * 768 * 2
    assert not any(moe_kernel_pays(n, 8, mini, False) for n in (2, 16, 64, 384))
    assert not moe_kernel_pays(8, 128, mid, False) and not moe_kernel_pays(64, 128, mid, False)
    assert moe_kernel_pays(512, 128, mid, False) and moe_kernel_pays(128, 128, mid, False)
    assert moe_kernel_pays(8, 384, 3 * 7168 * 2048 // 2, True)
    # the rule reads each expert's stored bytes from the weights, on the GPU that measured it
    small, large = jnp.zeros((4, 64, 32), jnp.bfloat16), jnp.zeros((4, 512, 512), jnp.bfloat16)
    with launch.for_arch("sm_90"):
        assert runs_kernels("attention=xla,moe=auto", 4, large, large, large)
        assert not runs_kernels("attention=xla,moe=auto", 3, large, large, large)
        assert not runs_kernels("attention=xla,moe=auto", 64, small, small, small)
        assert runs_kernels("attention=xla,moe=triton", 1, small, small, small)
        assert not runs_kernels("xla", 64, large, large, large)
    with launch.for_arch("gfx942"):
        assert not runs_kernels("attention=xla,moe=auto", 4, large, large, large)


@pytest.mark.newest_jax
@pytest.mark.parametrize("min_bytes, kernel", [(1 << 20, False), (0, True)])
def test_auto_experts_are_decided_in_the_traced_step(min_bytes, kernel, monkeypatch, measured_on_sm_90):
    """A config resolved to moe=auto (sm_90) runs the expert kernels in a step as its shapes
    decide: the test family's tiny experts keep XLA's path, unless the size floor is lowered."""
    from eagle3_jax.runtime import kernels as kernels_lib

    monkeypatch.setattr(kernels_lib, "KERNEL_MIN_EXPERT_BYTES", min_bytes)
    jax.clear_caches()  # the traces are cached by config, which the size floor is not part of
    target = random_target(FAMILIES["deepseek_v3"])
    target = dataclasses.replace(target, config=dataclasses.replace(target.config, kernels="attention=xla,moe=auto"))
    tokens = jnp.zeros((4, 16), jnp.int32)  # 64 tokens: more assignments than the family has experts
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (4, 16))
    launches = []
    with launch.for_arch("sm_90"), triton_call.capturing(launches):
        jax.jit(forward, static_argnames=("cfg",)).trace(
            target.params, target.config, tokens, positions, target.init_cache(4, 32)).lower(
            lowering_platforms=("cuda",))
    assert any(one.name.startswith("eagle3_grouped_swiglu") for one in launches) == kernel


@pytest.mark.newest_jax
@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_speculative_step_lowers_with_triton_attention(platform):
    """Deviceless lowering of the whole speculative step with kernels="triton" for a GPU (compiled,
    not interpreted): it lowers, launching the attention kernel and both expert kernels."""
    from eagle3_jax.sampling.sampler import SamplingArrays
    from eagle3_jax.spec_decode.propose import DraftRoot
    from eagle3_jax.spec_decode.step import spec_step

    target = with_kernels(random_target(FAMILIES["deepseek_v3"], dtype=jnp.bfloat16))  # float32 keeps XLA on GPUs
    draft = random_draft(target)
    spec = e3.SpecConfig(3, 1, 4)
    tcache = target.init_cache(2, 64)
    dcache = kv_cache.init_cache(draft.config.layers, 2, 64, draft.dtype)
    root = DraftRoot(token=jnp.zeros((2,), jnp.int32), hidden=jnp.zeros((2, draft.config.hidden_size), draft.dtype))
    sp = SamplingArrays.from_params([e3.SamplingParams()], 2)
    launches = []
    with launch.for_arch(launch.PLATFORM_ARCH[platform]), triton_call.capturing(launches):
        jax.jit(spec_step, static_argnames=("tcfg", "dcfg", "spec")).trace(
            target.params, target.config, draft.params, draft.config, spec, tcache, dcache, root, sp,
            jnp.ones((2,), jnp.int32)).lower(lowering_platforms=(platform,))
    names = {one.name for one in launches}
    for kernel in ("eagle3_paged_prefix_attention", "eagle3_grouped_swiglu", "eagle3_grouped_matmul"):
        assert any(name.startswith(kernel) for name in names), (kernel, names)
    assert not any(dict(one.constexprs)["INTERPRETED"] for one in launches if "INTERPRETED" in dict(one.constexprs))


@pytest.mark.newest_jax
@pytest.mark.parametrize("slots, kernel", [(64, True), (72, False)])
def test_a_cache_the_kernel_cannot_tile_keeps_xla_attention(slots, kernel, monkeypatch, caplog):
    """Compiled for a GPU, the attention kernel walks pages of a multiple of 16 slots (Triton's
    shapes are powers of two): a dense cache of 72 slots keeps XLA's attention and says so, one
    of 64 runs the kernel."""
    from eagle3_jax.models.target import forward
    from eagle3_jax.runtime import kernels as kernels_lib

    kernels_lib.warn_once.cache_clear()
    target = with_kernels(random_target(FAMILIES["deepseek_v3"], dtype=jnp.bfloat16))  # float32 keeps XLA on GPUs
    cache = kv_cache.advance(target.init_cache(2, slots), jnp.full((2,), 10, jnp.int32))
    tokens, positions = jnp.zeros((2, 1), jnp.int32), jnp.full((2, 1), 10, jnp.int32)
    launches = []
    with launch.for_arch("sm_90"), triton_call.capturing(launches), caplog.at_level("WARNING", logger="eagle3_jax"):
        jax.jit(forward, static_argnames=("cfg",)).trace(
            target.params, target.config, tokens, positions, cache, jnp.ones((2, 1, 1), bool)).lower(
            lowering_platforms=("cuda",))
    assert any(one.name.startswith("eagle3_paged_prefix_attention") for one in launches) == kernel
    assert ("keeps its XLA path for a cache of 72-slot pages" in caplog.text) == (not kernel)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding5"])
def test_draft_propose_with_kernel_attention_equals_xla(window, monkeypatch, kernel_calls):
    """The draft's extend (causal window) and tree expansion (scratch-slot window) through the
    attention kernel on a paged cache: every pass's logits as the XLA path's, the same draft tree;
    also a sliding-window draft (each query's first slot bounds the kernel's walk). (Dense draft
    caches run the same code through kv_cache.as_pages; the Engine test above covers them end to
    end.)"""
    from eagle3_jax.models.draft import with_target_kernels
    from eagle3_jax.spec_decode import propose
    from eagle3_jax.spec_decode.propose import draft_extend, expand

    passes = []
    real_forward = propose.draft_forward

    def recording_forward(*args, **kwargs):  # every draft pass's logits, to compare pass by pass
        out = real_forward(*args, **kwargs)
        passes.append(out[0])
        return out

    monkeypatch.setattr(propose, "draft_forward", recording_forward)
    target = random_target(FAMILIES["minimax_m2"])
    sliding = {} if window is None else dict(layer_types=["sliding_attention"], sliding_window=window)
    draft = random_draft(target, draft_config_dict(target.config, **sliding))
    rng = np.random.default_rng(3)
    h3 = 3 * target.config.hidden_size
    prompt_feats = jnp.asarray(rng.standard_normal((2, 9, h3)), jnp.float32)
    prompt_toks = jnp.asarray(rng.integers(0, 64, (2, 9)), jnp.int32)
    step_feats = jnp.asarray(rng.standard_normal((2, 3, h3)), jnp.float32)
    step_toks = jnp.asarray(rng.integers(0, 64, (2, 3)), jnp.int32)
    spec = e3.SpecConfig(4, 3, 10)

    def run(d):
        k, v = kv_cache.init_pages(d.config.layers, 1 + 2 * 4, 16, jnp.float32)
        cache = kv_cache.paged_view(k, v, np.arange(1, 9).reshape(2, 4)[:, ::-1], [0, 0])  # pages out of order
        _, _, cache = draft_extend(d.params, d.config, cache, prompt_feats, prompt_toks, jnp.asarray([9, 6]))
        logits, hidden, cache = draft_extend(d.params, d.config, cache, step_feats, step_toks, jnp.asarray([3, 2]))
        tree, _ = expand(d.params, d.config, cache, logits, hidden, step_toks[:, -1], spec)
        return logits, tree

    want_logits, want_tree = run(draft)
    want_passes, passes[:] = list(passes), []
    got_logits, got_tree = run(with_target_kernels(draft, with_kernels(target)))
    assert len(passes) == len(want_passes) == 2 + spec.num_steps - 1
    for got, want in zip(passes, want_passes):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5 * float(np.abs(want).max()))
    np.testing.assert_array_equal(np.asarray(got_tree.tokens), np.asarray(want_tree.tokens))
    np.testing.assert_array_equal(np.asarray(got_tree.parents), np.asarray(want_tree.parents))
    assert len(kernel_calls) >= 3  # extend twice, then every expansion level
