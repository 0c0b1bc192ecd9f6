"""MLA EAGLE-3 drafts (`Eagle3DeepseekV2ForCausalLM`) end to end, on a small random MLA+MoE target:
greedy speculation equals plain greedy decoding in the Engine (dense caches) and the Scheduler
(paged caches), chain and tree, on the XLA and the Pallas attention paths; a draft trained in JAX
exports in the published HF layout and loads back with identical logits; the planner compiles the
real MLA draft programs. (The forward itself is checked against a NumPy reference in test_draft.py.)
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from random_models import FAMILIES, mla_draft_config_dict, random_draft, random_target

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from pallas_kernels import triton_call

PROMPTS = [[1, 5, 9, 2], [3, 4, 5, 6, 7, 8, 9]]
SP = e3.SamplingParams(max_tokens=12)
CHAIN, TREE = e3.SpecConfig(3, 1, 4), e3.SpecConfig(3, 2, 6)


@pytest.fixture(scope="module")
def pair():
    target = random_target(FAMILIES["deepseek_v3"])
    draft = random_draft(target, mla_draft_config_dict(target.config, draft_vocab_size=48),
                         d2t=np.random.default_rng(0).integers(0, 16, 48))
    plain = [o.token_ids for o in e3.Engine(target, max_batch_size=2, max_seq_len=64).generate(PROMPTS, SP)]
    return target, draft, plain


def with_kernels(target):
    return dataclasses.replace(target, config=dataclasses.replace(target.config, kernels="triton"))


def speculate(target, draft, engine_spec, scheduler_spec):
    engine = e3.Engine(target, draft, engine_spec, max_batch_size=2, max_seq_len=64).generate(PROMPTS, SP)
    sched = e3.Scheduler(target, draft, scheduler_spec, max_num_seqs=2, max_seq_len=64, page_size=16)
    return [o.token_ids for o in engine], [o.token_ids for o in sched.generate(PROMPTS, SP)], engine


def test_greedy_speculation_with_mla_draft_equals_plain(pair):
    """Engine chain on dense caches, Scheduler tree on paged caches: the draft cache is an MLA
    latent + rope-key cache in both layouts."""
    target, draft, plain = pair
    dense = kv_cache.init_cache(draft.config.layers, 1, 16)
    assert dense.k.shape[-1] == draft.config.layers.kv_lora_rank and dense.v.shape[-1] == draft.config.layers.qk_rope_head_dim
    engine, sched, outs = speculate(target, draft, CHAIN, TREE)
    assert engine == plain and sched == plain
    assert all(1 <= a <= CHAIN.max_accept + 1 for o in outs for a in o.metrics["accept_lengths"])


@pytest.mark.slow
def test_greedy_speculation_with_mla_draft_equals_plain_other_layouts(pair):
    """The other pairing: Engine tree on dense caches, Scheduler chain on paged caches."""
    target, draft, plain = pair
    engine, sched, _ = speculate(target, draft, TREE, CHAIN)
    assert engine == plain and sched == plain


@pytest.mark.slow
def test_greedy_speculation_with_mla_draft_on_kernel_attention(pair, kernel_calls):
    """kernels="triton": the MLA draft's extend and tree expansion attend through the paged kernel
    (interpreted on CPU) and greedy speculation still equals plain decoding."""
    target, draft, plain = pair
    engine, sched, _ = speculate(with_kernels(target), draft, TREE, CHAIN)
    assert engine == plain and sched == plain
    assert "paged_prefix_attention" in kernel_calls


def test_mla_draft_expansion_on_kernel_attention_equals_xla(pair, kernel_calls):
    """The draft's extend and tree expansion over scratch slots (attention.mla_block's window)
    through the attention kernel: the same logits and tree as the XLA path, on a paged cache."""
    import functools

    from eagle3_jax.models.draft import with_target_kernels
    from eagle3_jax.spec_decode.propose import draft_extend, expand

    target, draft, _ = pair
    rng = np.random.default_rng(3)
    feats = rng.standard_normal((2, 5, 3 * target.config.hidden_size)).astype(np.float32)
    toks = rng.integers(0, 64, (2, 5)).astype(np.int32)
    spec = e3.SpecConfig(3, 3, 8)

    @functools.partial(jax.jit, static_argnames=("cfg",))
    def propose(params, cfg):
        k, v = kv_cache.init_pages(cfg.layers, 1 + 2 * 2, 16, np.float32)
        cache = kv_cache.paged_view(k, v, np.array([[2, 1], [4, 3]]), [0, 0])  # pages out of order
        logits, hidden, cache = draft_extend(params, cfg, cache, feats, toks, np.array([5, 3], np.int32))
        tree, _ = expand(params, cfg, cache, logits, hidden, toks[:, -1], spec)
        return logits, tree.tokens, tree.parents

    want = propose(draft.params, draft.config)
    assert not kernel_calls
    fast = with_target_kernels(draft, with_kernels(target))
    got = propose(fast.params, fast.config)
    assert kernel_calls.count("paged_prefix_attention") == spec.num_steps  # the extend, then every expansion level
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-5 * float(np.abs(want[0]).max()))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))


@pytest.mark.parametrize("platform", ["rocm", pytest.param("cuda", marks=pytest.mark.slow)])
def test_speculative_step_with_mla_draft_lowers_with_triton_attention(pair, platform):
    """Lowering of the whole tree step for a GPU platform with kernels="triton" (launches captured,
    not interpreted): the MLA draft's extend and both expansion levels call the Triton kernel too."""
    from eagle3_jax.models.draft import with_target_kernels
    from eagle3_jax.sampling.sampler import SamplingArrays
    from eagle3_jax.spec_decode.propose import DraftRoot
    from eagle3_jax.spec_decode.step import spec_step

    target, draft, _ = pair
    target = with_kernels(target)

    def attention_launches(d) -> int:
        """The attention kernel launches of the step, lowered for `platform` (launches captured)."""
        tcache = target.init_cache(2, 64)
        dcache = kv_cache.init_cache(d.config.layers, 2, 64, d.dtype)
        root = DraftRoot(token=np.zeros((2,), np.int32), hidden=np.zeros((2, d.config.hidden_size), d.dtype))
        sp = SamplingArrays.from_params([e3.SamplingParams()], 2)
        launches = []
        with triton_call.capturing(launches):
            jax.jit(spec_step, static_argnames=("tcfg", "dcfg", "spec")).trace(
                target.params, target.config, d.params, d.config, TREE, tcache, dcache, root, sp,
                np.ones((2,), np.int32)).lower(lowering_platforms=(platform,))
        return sum(one.name.startswith("eagle3_paged_prefix_attention") for one in launches)

    with_draft_kernel = attention_launches(with_target_kernels(draft, target))
    target_only = attention_launches(draft)  # the draft's own kernels="xla"
    assert with_draft_kernel > target_only > 0


# ---- training: train -> export -> load ------------------------------------------------------------

PUBLISHED_LAYER_KEYS = {  # the HF names vLLM's / SGLang's Eagle3DeepseekV2ForCausalLM loaders read
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}


def test_trained_mla_draft_exports_in_the_hf_layout_and_loads_back(tmp_path):
    """A few TTT steps on an MLA draft of an MLA target, export, load: the same logits, and a
    config.json / safetensors in the published Eagle3DeepseekV2ForCausalLM layout."""
    from safetensors import safe_open

    from eagle3_jax.models.draft import Draft
    from eagle3_jax.train import data as data_lib
    from eagle3_jax.train.draft_model import assembled_params, init_draft_params, make_ttt_loss, new_draft_config
    from eagle3_jax.train.export import export_hf_draft
    from eagle3_jax.train.trainer import TrainConfig, Trainer
    from eagle3_jax.train.vocab import count_tokens, select_draft_vocab

    target = random_target(dict(FAMILIES["deepseek_v3"], num_hidden_layers=4))  # aux ids (2, 2, 1): all exportable
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (8, 12)).astype(np.int32)  # "responses": the teacher signals come from the target
    mask = np.broadcast_to(np.arange(12) >= 3, tokens.shape).copy()
    vocab = select_draft_vocab(count_tokens(list(tokens), list(mask), vocab_size=64), 48)
    cfg = new_draft_config(target.config, vocab, arch="mla", intermediate_size=40)
    lc = cfg.layers
    assert cfg.is_mla and lc.rope == target.config.rope  # the target's YaRN, interleaved
    assert (lc.q_lora_rank, lc.kv_lora_rank, lc.qk_rope_head_dim) == (16, 16, 4)
    params, frozen = init_draft_params(cfg, target, vocab, seed=0)
    tc = TrainConfig(epochs=1, learning_rate=3e-3, warmup_steps=1, compute_dtype="float32")
    trainer = Trainer(make_ttt_loss(cfg, vocab, num_steps=2), params, frozen, tc, total_steps=2)
    batches = lambda epoch: data_lib.online_batches(target, tokens, mask, 4, seed=0, epoch=epoch)  # noqa: E731
    losses = []
    trainer.fit(batches, 2, progress=False, log=lambda s: None, on_step=lambda s, m: losses.append(m["loss"]))
    assert len(losses) == 2 and all(np.isfinite(losses))

    final = assembled_params(trainer.state.params, frozen)
    out = export_hf_draft(tmp_path / "draft", cfg, final, vocab, dtype="float32")
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert {k: config[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                   "num_attention_heads", "draft_vocab_size")} == dict(
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_attention_heads=4,
        draft_vocab_size=48)
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["factor"] == 4.0
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]  # input-to-layer: hidden_states[k]
    with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert keys == {"midlayer." + k for k in PUBLISHED_LAYER_KEYS} | {"fc.weight", "norm.weight", "lm_head.weight",
                                                                      "d2t", "t2d"}

    loaded = e3.load_draft(out, target=target, dtype="float32")
    trained = Draft(config=cfg, params=final, dtype=np.dtype(np.float32), target=target)
    ids = rng.integers(0, 64, (2, 20))
    aux = rng.standard_normal((2, 20, 3 * target.config.hidden_size)).astype(np.float32)
    np.testing.assert_array_equal(loaded.logits(ids, aux), trained.logits(ids, aux))
    np.testing.assert_array_equal(loaded.logits(ids[:, :8], aux[:, :8]), trained.logits(ids[:, :8], aux[:, :8]))
