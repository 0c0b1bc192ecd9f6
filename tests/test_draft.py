"""EAGLE-3 draft: forward vs an independent NumPy reference, checkpoint formats, d2t mapping,
real draft configs, and clear errors for bad drafts.

The reference below is written from the HF `LlamaForCausalLMEagle3` description (SGLang / vLLM
layout), in float64 NumPy, and shares no code with `eagle3_jax`:

    h = aux @ fc.T; e = embed[x]
        (EAGLE 3.1, as vLLM's deepseek_eagle3.py / SpecForge define it: with norm_before_fc,
        aux = input_norm(aux) over the whole concatenation; with fc_norm, each of the three
        target-width chunks of aux through its own fc_norm.{i} first)
    layer 0 ("midlayer"): residual = h (hidden_norm(h) with norm_before_residual)
        a_in = concat(input_layernorm(e), hidden_norm(h))            [2H]
        h1 = residual + o_proj(attn(rope(q(a_in)), rope(k(a_in)), v(a_in)))
        h2 = h1 + down(silu(gate(post_attention_layernorm(h1))) * up(...))
    layers 1..: ordinary Llama decoder layers on the hidden stream
    logits = norm(h_final) @ lm_head.T                                 [draft_vocab]
    handed on to the next draft step: h_final (norm(h_final) with norm_output)

MLA drafts (`Eagle3DeepseekV2ForCausalLM`) have their own reference below (section 1b).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import LLAMA, random_target

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.checkpoint import CheckpointError
from eagle3_jax.config.model import ConfigError, load_model_config
from eagle3_jax.models import draft as draft_lib

TEST_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
B, T = 2, 24  # T > max_position_embeddings (16) of the test drafts: RoPE must not be bounded by it
TARGET_H, VOCAB = 32, 64


# ---- independent NumPy reference ----------------------------------------------------------------


def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    assert kind == "llama3", kind
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:  # high frequency: unchanged
            out.append(f)
        elif wavelen > old / lo:  # low frequency: divided by factor
            out.append(f / factor)
        else:  # in between: interpolate
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def np_rope(x, inv):
    """Llama NeoX rotate-half rotary; x [T, heads, D] at positions 0..T-1."""
    t, d = x.shape[0], x.shape[-1]
    freqs = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * np.cos(emb) + rot * np.sin(emb)


def np_visible(t: int, p: str, c: dict) -> np.ndarray:
    """[T, T] causal mask of the layer at prefix `p`, within its sliding window when layer_types
    makes it a "sliding_attention" layer (a query sees the last sliding_window tokens, itself too)."""
    causal = np.tril(np.ones((t, t), bool))
    kinds = c.get("layer_types")
    if kinds and kinds[0 if p.startswith("midlayer") else int(p.split(".")[1])] == "sliding_attention":
        causal &= np.arange(t)[:, None] - np.arange(t)[None, :] < c["sliding_window"]
    return causal


def np_attention(a_in, w, p, c):
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or c["hidden_size"] // nh
    t = a_in.shape[0]
    inv = np_inv_freq(d, c.get("rope_theta", 10000.0), c.get("rope_scaling"))
    q = np_rope((a_in @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, d), inv)
    k = np_rope((a_in @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, d), inv)
    v = (a_in @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, d)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # GQA: head h uses kv h // group
    scores = np.einsum("thd,shd->hts", q, k) * d ** -0.5
    scores = np.where(np_visible(t, p, c)[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v).reshape(t, nh * d) @ w[p + "self_attn.o_proj.weight"].T


def np_mlp(x, w, p):
    g, u = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    return (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T


def np_features(w: dict, c: dict, aux: np.ndarray) -> np.ndarray:
    """The concatenated target features [T, 3 Ht] as fc reads them: through input_norm
    (norm_before_fc), then each feature through its fc_norm (EAGLE 3.1)."""
    eps = c["rms_norm_eps"]
    aux = np.asarray(aux, np.float64)
    if c.get("norm_before_fc"):
        aux = np_rms(aux, w["input_norm.weight"], eps)
    if c.get("fc_norm"):
        aux = np.concatenate([np_rms(part, w[f"fc_norm.{i}.weight"], eps)
                              for i, part in enumerate(np.split(aux, 3, axis=-1))], axis=-1)
    return aux


def np_draft_logits(w: dict, c: dict, target_embed: np.ndarray, ids: np.ndarray, aux: np.ndarray,
                    attention=None, handed: bool = False) -> np.ndarray:
    """float64 reference of a draft pass; `attention(x, w, prefix, c)` is the layers' attention
    (default: np_attention, the Llama layer). `handed`: return the hidden the pass hands on
    instead of the logits."""
    attention = attention or np_attention
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    eps = c["rms_norm_eps"]
    embed = w.get("embed_tokens.weight", np.asarray(target_embed, np.float64))
    p0 = "midlayer." if any(k.startswith("midlayer.") for k in w) else "layers.0."
    out = []
    for b in range(ids.shape[0]):
        h = np_features(w, c, aux[b]) @ w["fc.weight"].T
        e = embed[ids[b]]
        normed = np_rms(h, w[p0 + "hidden_norm.weight"], eps)
        residual = normed if c.get("norm_before_residual") else h
        a_in = np.concatenate([np_rms(e, w[p0 + "input_layernorm.weight"], eps), normed], axis=-1)
        h1 = residual + attention(a_in, w, p0, c)
        x = h1 + np_mlp(np_rms(h1, w[p0 + "post_attention_layernorm.weight"], eps), w, p0)
        for i in range(1, c["num_hidden_layers"]):
            p = f"layers.{i}."
            h1 = x + attention(np_rms(x, w[p + "input_layernorm.weight"], eps), w, p, c)
            x = h1 + np_mlp(np_rms(h1, w[p + "post_attention_layernorm.weight"], eps), w, p)
        normed = np_rms(x, w["norm.weight"], eps)
        post_norm = c.get("norm_output") or (c.get("eagle_config") or {}).get("return_hidden_post_norm")
        out.append(((normed if post_norm else x) if handed else normed @ w["lm_head.weight"].T))
    return np.stack(out)


def np_llama_hidden_states(target, ids: np.ndarray) -> list[np.ndarray]:
    """HF `hidden_states` of a tiny random Llama target (index j = residual entering layer j)."""
    c = target.config
    seg = {k: np.asarray(v, np.float64) for k, v in target.params["segments"][0].items()}
    hc = dict(num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
              hidden_size=c.hidden_size, rope_theta=c.rope.theta)
    x = np.asarray(target.params["embed"], np.float64)[ids]
    states = [x]
    for i in range(c.num_layers):
        # stacked params are [in, out]; the reference speaks HF [out, in]
        w = {f"self_attn.{n}.weight": seg[n][i].T for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        w.update({f"mlp.{n}.weight": seg[n][i].T for n in ("gate_proj", "up_proj", "down_proj")})
        x = x + np_attention(np_rms(x, seg["attn_norm"][i], c.rms_norm_eps), w, "", hc)
        x = x + np_mlp(np_rms(x, seg["mlp_norm"][i], c.rms_norm_eps), w, "")
        states.append(x)
    return states


# ---- building draft folders ---------------------------------------------------------------------


def draft_cfg(**over) -> dict:
    c = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=TARGET_H,
             num_attention_heads=4, num_key_value_heads=2, intermediate_size=40, num_hidden_layers=1,
             vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=16, rope_theta=10000.0)
    c.update(over)
    return {k: v for k, v in c.items() if v is not None}


def _hf_draft_weights(c: dict, seed: int, with_embed: bool, spelling: str, d2t, attention, target_h: int,
                      with_t2d: bool) -> dict:
    """Random draft weights under HF key names ([out, in] matrices); `attention(prefix, width, mat,
    norm)` gives a layer's attention tensors."""
    rng = np.random.default_rng(seed)
    h, inter = c["hidden_size"], c["intermediate_size"]
    vd = c.get("draft_vocab_size") or c["vocab_size"]

    def mat(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": mat(h, 3 * target_h), "norm.weight": norm(h), "lm_head.weight": mat(vd, h)}
    if c.get("norm_before_fc"):
        w["input_norm.weight"] = norm(3 * target_h)
    if c.get("fc_norm"):
        w.update({f"fc_norm.{i}.weight": norm(target_h) for i in range(3)})
    if with_embed:
        w["embed_tokens.weight"] = rng.standard_normal((c["vocab_size"], h)).astype(np.float32)
    for i in range(c["num_hidden_layers"]):
        p = ("midlayer." if spelling == "midlayer" else "layers.0.") if i == 0 else f"layers.{i}."
        width = 2 * h if i == 0 else h
        w[p + "input_layernorm.weight"] = norm(h)
        if i == 0:
            w[p + "hidden_norm.weight"] = norm(h)
        w.update(attention(p, width, mat, norm))
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = mat(inter, h)
        w[p + "mlp.up_proj.weight"] = mat(inter, h)
        w[p + "mlp.down_proj.weight"] = mat(h, inter)
    if vd != c["vocab_size"]:
        d2t = np.zeros(vd, np.int64) if d2t is None else np.asarray(d2t, np.int64)
        w["d2t"] = d2t
        if with_t2d:
            t2d = np.zeros(c["vocab_size"], bool)
            t2d[np.clip(np.arange(vd) + d2t, 0, c["vocab_size"] - 1)] = True
            w["t2d"] = t2d
    return w


def hf_weights(c: dict, seed: int = 0, with_embed: bool = True, spelling: str = "midlayer", d2t=None) -> dict:
    """Random weights of a Llama-layer draft under HF draft key names ([out, in] matrices)."""
    h, nh, nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // nh

    def gqa(p, width, mat, norm):
        return {p + "self_attn.q_proj.weight": mat(nh * d, width), p + "self_attn.k_proj.weight": mat(nkv * d, width),
                p + "self_attn.v_proj.weight": mat(nkv * d, width), p + "self_attn.o_proj.weight": mat(h, nh * d)}

    return _hf_draft_weights(c, seed, with_embed, spelling, d2t, gqa, c.get("target_hidden_size") or h, with_t2d=True)


def write_draft(folder, c: dict, w: dict, fmt: str = "safetensors") -> str:
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(c, f)
    if fmt == "safetensors":
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in w.items()}, os.path.join(folder, "model.safetensors"))
    else:
        torch = pytest.importorskip("torch")
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in w.items()}, os.path.join(folder, "pytorch_model.bin"))
    return folder


def fresh_target(layers: int | None = None):
    raw = dict(LLAMA) if layers is None else dict(LLAMA, num_hidden_layers=layers)
    return random_target(raw)


def rand_inputs(th: int = TARGET_H, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (B, T)), rng.standard_normal((B, T, 3 * th)).astype(np.float32)


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


# ---- 1. forward vs the reference ----------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
VARIANTS = {
    # name: (config overrides, with_embed, key spelling, target layers)
    "embed": (dict(), True, "midlayer", None),
    "shared_embed": (dict(), False, "midlayer", None),
    "draft_vocab_d2t": (dict(draft_vocab_size=40), True, "midlayer", None),
    "two_layers_layers_spelling": (dict(num_hidden_layers=2), True, "layers", None),
    "two_layers_midlayer_spelling": (dict(num_hidden_layers=2), False, "midlayer", None),
    "wide_draft_head_dim": (dict(hidden_size=48, target_hidden_size=TARGET_H, head_dim=16), True, "midlayer", None),
    "aux_ids": (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}), True, "layers", 4),
    "norm_before_residual": (dict(norm_before_residual=True), True, "midlayer", None),
    "eagle3.1": (dict(fc_norm=True, norm_output=True), True, "midlayer", None),
    "eagle3.1_norm_before_fc_two_layers": (dict(fc_norm=True, norm_output=True, norm_before_fc=True,
                                                 num_hidden_layers=2), False, "layers", None),
    "post_norm_feedback_trtllm": (dict(eagle_config={"return_hidden_post_norm": True}), True, "midlayer", None),
    "sliding_window": (dict(layer_types=["sliding_attention"], sliding_window=5), True, "midlayer", None),
    "sliding_then_full": (dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                               sliding_window=3, fc_norm=True), False, "layers", None),
    "llama3_rope": (dict(rope_scaling=LLAMA3_ROPE, head_dim=16, rope_theta=10000.0), False, "midlayer", None),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_draft_forward_matches_numpy_reference(name, tmp_path):
    over, with_embed, spelling, layers = VARIANTS[name]
    c = draft_cfg(**over)
    d2t = None
    if c.get("draft_vocab_size"):  # a reduced vocab: draft id i -> target id subset[i]
        subset = np.sort(np.random.default_rng(5).choice(VOCAB, c["draft_vocab_size"], replace=False))
        d2t = subset - np.arange(len(subset))
    w = hf_weights(c, with_embed=with_embed, spelling=spelling, d2t=d2t)
    target = fresh_target(layers)
    draft = e3.load_draft(write_draft(tmp_path / "d", c, w), target=target, dtype="float32")

    assert draft.config.hidden_size == c["hidden_size"]
    assert draft.config.target_hidden_size == TARGET_H
    assert draft.config.draft_vocab_size == c.get("draft_vocab_size", VOCAB)
    assert draft.config.norm_before_residual == bool(c.get("norm_before_residual", False))
    assert draft.config.layers.num_layers == c["num_hidden_layers"]
    if "eagle_aux_hidden_state_layer_ids" in c.get("eagle_config", {}):  # starting at 1: id i = hidden_states[i + 1]
        assert draft.config.aux_layer_ids == (2, 2, 3)
        assert draft.aux_layer_ids == (2, 2, 3) and target.config.aux_layer_ids == (2, 2, 1)  # the target untouched
    else:
        assert draft.config.aux_layer_ids is None
        assert draft.aux_layer_ids == target.config.aux_layer_ids == (1, 1, 0)  # default for 2 layers, clamped

    ids, aux = rand_inputs()
    got = draft.logits(ids, aux)
    want = np_draft_logits(w, c, np.asarray(target.params["embed"]), ids, aux)
    assert got.shape == (B, T, c.get("draft_vocab_size", VOCAB)) and got.dtype == np.float32
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)
    # The draft has no rope table bounded by max_position_embeddings: positions >= 16 differ from
    # a model that clamped them, so a match over all T positions already shows it; check the
    # tail explicitly too.
    assert rel_err(got[:, 16:], want[:, 16:]) <= 1e-5
    # the hidden each pass hands to the next draft step (after the final norm for EAGLE 3.1)
    want_hidden = np_draft_logits(w, c, np.asarray(target.params["embed"]), ids, aux, handed=True)
    assert rel_err(handed_hidden(draft, ids, aux), want_hidden) <= 1e-5
    if c.get("draft_vocab_size"):
        np.testing.assert_array_equal(np.asarray(draft.params["d2t"]), d2t)
    else:  # full vocab: no d2t, draft ids are target ids
        assert "d2t" not in draft.params


def handed_hidden(draft, ids, aux) -> np.ndarray:
    """The hidden a causal draft pass over `ids` / `aux` hands on, as the engine's extend gets it."""
    cfg, params = draft.config, draft.params
    b, t = ids.shape
    cache = kv_cache.init_cache(cfg.layers, b, t, jnp.float32)
    visible = kv_cache.Visible(cache.lengths, kv_cache.causal_mask(b, t))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    features = draft_lib.project_features(params, cfg, jnp.asarray(aux, jnp.float32))
    _, hidden, _ = draft_lib.draft_forward(params, cfg, params["embed"][jnp.asarray(ids)], features, positions, cache,
                                           visible)
    return np.asarray(hidden)


# What the peers' loaders do with eagle_aux_hidden_state_layer_ids, written out as facts: vLLM's
# capture stores the state after layer i as i + 1 and reads id k as hidden_states[k] (#36063,
# #46788); SGLang adds one to every id when the first is 1 (output-of-layer ids) and reads the
# others as they are (#25454).
def vllm_reads(ids):
    return tuple(ids)


def sglang_reads(ids):
    return tuple(i + 1 for i in ids) if ids[0] == 1 else tuple(ids)


@pytest.mark.parametrize("ids,layers", [([1, 1, 2], (2, 2, 3)), ([2, 2, 3], (2, 2, 3)), ([0, 1, 2], (0, 1, 2)),
                                        ([2, 0, 1], (2, 0, 1))])
def test_aux_ids_are_read_in_both_conventions(ids, layers):
    """A list starting at 1 is output-of-layer ids (hidden_states[i + 1]), any other input-to-layer
    ids (hidden_states[k]), as SGLang reads them; the features captured are those hidden states,
    computed here by a NumPy Llama forward on a 4-layer target (indices 0..3)."""
    target = fresh_target(4)
    cfg = draft_lib.parse_draft_config(draft_cfg(eagle_config={"eagle_aux_hidden_state_layer_ids": ids}))
    assert cfg.aux_layer_ids == layers == sglang_reads(ids)
    draft_lib.check_fits_target(cfg, target.config)
    tokens = np.random.default_rng(3).integers(0, VOCAB, (1, 10))
    _, aux = target.logits(tokens, return_aux=True, aux_layer_ids=cfg.aux_layer_ids)
    np.testing.assert_array_equal(aux, target.capturing(cfg.aux_layer_ids).logits(tokens, return_aux=True)[1])
    hs = np_llama_hidden_states(target, tokens[0])
    for j, index in enumerate(layers):
        assert rel_err(aux[0, :, j * TARGET_H:(j + 1) * TARGET_H], hs[index]) <= 1e-5


def test_both_published_kimi_layouts_read_the_same_layers():
    """Kimi-K2.5's MLA draft ships [1, 29, 57] (output of layers), Kimi-K2.6's EAGLE 3.1 draft
    [2, 30, 58] (inputs to layers): both name hidden_states 2, 30, 58 of the 61-layer target."""
    with open(os.path.join(TEST_DATA, "kimi-k2.5-eagle3-mla.draft.json")) as f:
        k25 = json.load(f)
    k26 = dict(k25, fc_norm=True, norm_output=True,
               eagle_config=dict(k25["eagle_config"], eagle_aux_hidden_state_layer_ids=[2, 30, 58]))
    target = load_model_config(os.path.join(TEST_DATA, "kimi-k2.5.config.json"))
    for raw in (k25, k26):
        cfg = draft_lib.parse_draft_config(raw)
        assert cfg.aux_layer_ids == (2, 30, 58)
        draft_lib.check_fits_target(cfg, target)
    assert draft_lib.parse_draft_config(k26).fc_norm


@pytest.mark.parametrize("layers", [(2, 16, 29), (0, 1, 2), (3, 3, 5)])
def test_exported_ids_read_by_vllm_and_sglang_pick_the_trained_layers(layers):
    """An exported draft's ids name its trained feature layers under vLLM's reading and SGLang's;
    a first feature of hidden_states[1], which no list names for both, is refused at export."""
    from eagle3_jax.train.export import draft_config_json

    cfg = dataclasses.replace(draft_lib.parse_draft_config(draft_cfg()), aux_layer_ids=layers)
    ids = draft_config_json(cfg, "float32")["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert vllm_reads(ids) == sglang_reads(ids) == layers == draft_lib.parse_draft_config(
        draft_cfg(eagle_config={"eagle_aux_hidden_state_layer_ids": ids})).aux_layer_ids
    with pytest.raises(ValueError, match="no eagle_aux_hidden_state_layer_ids list names for every reader"):
        draft_config_json(dataclasses.replace(cfg, aux_layer_ids=(1, 2, 3)), "float32")


def test_safetensors_and_pytorch_bin_load_identically(tmp_path):
    pytest.importorskip("torch")
    c = draft_cfg(draft_vocab_size=40)
    d2t = np.arange(40) % 7  # target id = i + i % 7 < 64
    w = hf_weights(c, seed=2, d2t=d2t)
    target = fresh_target()
    a = e3.load_draft(write_draft(tmp_path / "st", c, w, "safetensors"), target=target, dtype="float32")
    b = e3.load_draft(write_draft(tmp_path / "bin", c, w, "bin"), target=target, dtype="float32")
    assert not os.path.exists(tmp_path / "bin" / "model.safetensors")
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ids, aux = rand_inputs(seed=4)
    np.testing.assert_array_equal(a.logits(ids, aux), b.logits(ids, aux))


class _Boom:
    """Unpickling this would call os.mkdir(marker): it must never happen."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("payload", ["datetime", "custom_class", "ordered_dict_object"])
def test_unsafe_pickle_is_refused_without_running_code(payload, tmp_path):
    torch = pytest.importorskip("torch")
    c = draft_cfg()
    folder = tmp_path / "d"
    os.makedirs(folder)
    with open(folder / "config.json", "w") as f:
        json.dump(c, f)
    sd = {k: torch.from_numpy(v) for k, v in hf_weights(c).items()}
    marker = str(tmp_path / "pwned")
    sd["extra"] = {
        "datetime": datetime.datetime(2024, 1, 1),
        "custom_class": _Boom(marker),
        "ordered_dict_object": collections.OrderedDict(x=object()),
    }[payload]
    torch.save(sd, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safely"):
        e3.load_draft(folder, target=fresh_target(), dtype="float32")
    assert not os.path.exists(marker)


# ---- 2. d2t mapping -----------------------------------------------------------------------------

DV = 40
SUBSET = np.sort(np.random.default_rng(11).choice(VOCAB, DV, replace=False))
D2T = SUBSET - np.arange(DV)


@pytest.fixture(scope="module")
def reduced_pair(tmp_path_factory):
    c = draft_cfg(draft_vocab_size=DV)
    folder = write_draft(tmp_path_factory.mktemp("reduced") / "d", c, hf_weights(c, seed=7, d2t=D2T))
    target = fresh_target()
    return target, e3.load_draft(folder, target=target, dtype="float32")


def test_draft_to_target_ids(reduced_pair):
    _, draft = reduced_pair
    ids = jnp.asarray([[0, 1, 39], [5, 17, 23]], jnp.int32)
    got = np.asarray(draft_lib.draft_to_target_ids(draft.params, ids))
    np.testing.assert_array_equal(got, SUBSET[np.asarray(ids)])
    assert got.min() >= 0 and got.max() < VOCAB
    # no d2t (full vocab): identity
    np.testing.assert_array_equal(np.asarray(draft_lib.draft_to_target_ids({}, ids)), np.asarray(ids))


def test_expand_proposes_mapped_target_ids(reduced_pair):
    """Level-1 proposals are the top-k of the root's *draft* logits, mapped through d2t."""
    from eagle3_jax.cache import kv_cache
    from eagle3_jax.spec_decode import propose

    _, draft = reduced_pair
    spec = e3.SpecConfig(3, 2, 6)
    rng = np.random.default_rng(0)
    root_logits = jnp.asarray(rng.standard_normal((B, DV)), jnp.float32)
    root_hidden = jnp.asarray(rng.standard_normal((B, TARGET_H)), jnp.float32)
    cache = kv_cache.init_cache(draft.config.layers, B, 32, jnp.float32)
    cache = kv_cache.advance(cache, jnp.asarray([3, 5], jnp.int32))
    tree, _ = jax.jit(propose.expand, static_argnames=("cfg", "spec"))(
        draft.params, draft.config, cache, root_logits, root_hidden, jnp.asarray([1, 2], jnp.int32), spec=spec)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    assert set(tokens[:, 1:].ravel()) <= set(SUBSET.tolist())
    top2 = np.argsort(-np.asarray(root_logits), axis=1, kind="stable")[:, :2]
    for b in range(B):
        depth1 = tokens[b, 1:][parents[b, 1:] == 0]
        assert sorted(depth1.tolist()) == sorted(SUBSET[top2[b]].tolist())


def test_engine_with_reduced_vocab_draft_is_lossless(reduced_pair):
    target, draft = reduced_pair
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    sp = e3.SamplingParams(max_tokens=12)
    base = e3.Engine(target, max_batch_size=2, max_seq_len=48).generate(prompts, sp)
    spec = e3.Engine(target, draft=draft, spec=e3.SpecConfig(3, 1, 4), max_batch_size=2, max_seq_len=48).generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert all(len(o.token_ids) == 12 for o in spec)


def test_sliding_window_draft_speculates_losslessly(tmp_path):
    """A draft whose layer attends over a 5-token window: chain and tree speculation emit plain
    decoding's greedy tokens in the Engine (dense cache) and the Scheduler (paged); a speculation
    as deep as the window is refused (a node must see all its ancestors)."""
    target = fresh_target(4)
    c = draft_cfg(layer_types=["sliding_attention"], sliding_window=5)
    draft = e3.load_draft(write_draft(tmp_path / "d", c, hf_weights(c)), target=target, dtype="float32")
    assert draft.config.layer_windows == (5,)
    prompts, sp = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7]], e3.SamplingParams(max_tokens=16)
    base = [o.token_ids for o in e3.Engine(target, max_batch_size=2, max_seq_len=48).generate(prompts, sp)]
    chain = e3.Engine(target, draft=draft, spec=e3.SpecConfig(3, 1, 4), max_batch_size=2, max_seq_len=48)
    assert [o.token_ids for o in chain.generate(prompts, sp)] == base
    tree = e3.Scheduler(target, draft, e3.SpecConfig(4, 2, 6), max_num_seqs=2, max_seq_len=48, page_size=4)
    assert [o.token_ids for o in tree.generate(prompts, sp)] == base
    with pytest.raises(ValueError, match="num_steps=5 is not below the draft's sliding_window=5"):
        e3.Engine(target, draft=draft, spec=e3.SpecConfig(5, 1, 6), max_batch_size=2, max_seq_len=48)


def test_drafts_reading_other_layers_share_one_untouched_target(tmp_path):
    """load_draft leaves the target as it was; each draft's scheduler runs a view of it that
    captures that draft's layers, and both stay lossless."""
    target = fresh_target(4)
    before = target.config
    drafts = []
    for name, ids in (("a", [1, 1, 2]), ("b", [3, 1, 2])):
        c = draft_cfg(eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
        drafts.append(e3.load_draft(write_draft(tmp_path / name, c, hf_weights(c, seed=len(drafts))), target=target,
                                    dtype="float32"))
    assert target.config is before and [d.aux_layer_ids for d in drafts] == [(2, 2, 3), (3, 1, 2)]
    prompts, sp = [[1, 2, 3], [9, 8, 7, 6, 5]], e3.SamplingParams(max_tokens=10)
    base = [o.token_ids for o in e3.Engine(target, max_batch_size=2, max_seq_len=48).generate(prompts, sp)]
    for draft in drafts:
        sched = e3.Scheduler(target, draft, e3.SpecConfig(3, 1, 4), max_num_seqs=2, max_seq_len=48)
        assert sched._executor.target.config.aux_layer_ids == draft.aux_layer_ids
        assert [o.token_ids for o in sched.generate(prompts, sp)] == base
    assert target.config is before


# ---- 1b. MLA drafts (Eagle3DeepseekV2ForCausalLM) vs their own NumPy reference ------------------
#
# Written from the vLLM / SGLang DeepSeek formulation with naive (non-absorbed) attention over
# full per-head K/V, in float64, sharing no code with eagle3_jax:
#     q = q_b_proj(q_a_layernorm(q_a_proj(a_in)))  (q_proj(a_in) without q_lora_rank)   [heads, nope + rope]
#     c, k_pe = split(kv_a_proj_with_mqa(a_in), [kv_lora, rope]); c = kv_a_layernorm(c)
#     k_nope, v = split(kv_b_proj(c), [nope, v]) per head
#     k = [k_nope, rope(k_pe)] (k_pe shared by every head), q = [q_nope, rope(q_pe)]
#     rotary: interleaved pairs (x0, x1), (x2, x3), ...; DeepSeek YaRN inverse frequencies (ramp
#     bounds floor / ceil); cos and sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim)
#     softmax scale (nope + rope)^-0.5 * mscale(factor, mscale_all_dim)^2
# Layer 0 reads a_in = concat(input_layernorm(e), hidden_norm(h)) [2H] through q_a_proj (q_proj)
# and kv_a_proj_with_mqa; the rest of the layer is as in the Llama draft.

MLA_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.9, "mscale_all_dim": 1.0}
KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_draft_cfg(**over) -> dict:
    c = dict(architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="deepseek_v3", hidden_size=TARGET_H,
             intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, vocab_size=VOCAB,
             rms_norm_eps=1e-5, max_position_embeddings=16, rope_theta=10000.0, rope_scaling=MLA_YARN)
    c.update(over)
    return {k: v for k, v in c.items() if v is not None}


def mla_hf_weights(c: dict, seed: int = 0, with_embed: bool = True, spelling: str = "midlayer", d2t=None) -> dict:
    """Random weights of an MLA draft under the published HF names ([out, in] matrices)."""
    h, nh = c["hidden_size"], c["num_attention_heads"]
    dn, dr, dv, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    ql = c.get("q_lora_rank")

    def mla(p, width, mat, norm):
        w = {}
        if ql:
            w[p + "self_attn.q_a_proj.weight"] = mat(ql, width)
            w[p + "self_attn.q_a_layernorm.weight"] = norm(ql)
            w[p + "self_attn.q_b_proj.weight"] = mat(nh * (dn + dr), ql)
        else:
            w[p + "self_attn.q_proj.weight"] = mat(nh * (dn + dr), width)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = mat(r + dr, width)
        w[p + "self_attn.kv_a_layernorm.weight"] = norm(r)
        w[p + "self_attn.kv_b_proj.weight"] = mat(nh * (dn + dv), r)
        w[p + "self_attn.o_proj.weight"] = mat(h, nh * dv)
        return w

    return _hf_draft_weights(c, seed, with_embed, spelling, d2t, mla, TARGET_H, with_t2d=False)


def np_yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def np_deepseek_rotary(c: dict) -> tuple[np.ndarray, float, float]:
    """(inverse frequencies [rope / 2], cos/sin factor, softmax scale) of an MLA config."""
    dim, base = c["qk_rope_head_dim"], c.get("rope_theta", 10000.0)
    scale = (c["qk_nope_head_dim"] + dim) ** -0.5
    rs = c.get("rope_scaling")
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if not rs:
        return 1.0 / pos_freqs, 1.0, scale
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(rs["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # high-frequency channels keep their frequency, low ones are interpolated
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    m, m_all = rs.get("mscale", 1.0), rs.get("mscale_all_dim", 0.0)
    cos_sin_factor = np_yarn_mscale(factor, m) / np_yarn_mscale(factor, m_all)
    if m_all:
        scale *= np_yarn_mscale(factor, m_all) ** 2
    return inv, cos_sin_factor, scale


def np_rope_interleaved(x, inv, factor):
    """Rotate channel pairs (x0, x1), (x2, x3), ... of x [T, heads, rope] at positions 0..T-1."""
    ang = np.arange(x.shape[0], dtype=np.float64)[:, None, None] * inv[None, None, :]
    cos, sin = np.cos(ang) * factor, np.sin(ang) * factor
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def np_mla_attention(a_in, w, p, c):
    t = a_in.shape[0]
    nh, dn, dr, dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    r, eps = c["kv_lora_rank"], c["rms_norm_eps"]
    inv, factor, scale = np_deepseek_rotary(c)
    if p + "self_attn.q_a_proj.weight" in w:
        q_lat = np_rms(a_in @ w[p + "self_attn.q_a_proj.weight"].T, w[p + "self_attn.q_a_layernorm.weight"], eps)
        q = q_lat @ w[p + "self_attn.q_b_proj.weight"].T
    else:
        q = a_in @ w[p + "self_attn.q_proj.weight"].T
    q = q.reshape(t, nh, dn + dr)
    kv = a_in @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
    latent = np_rms(kv[:, :r], w[p + "self_attn.kv_a_layernorm.weight"], eps)
    k_pe = np_rope_interleaved(kv[:, None, r:], inv, factor)
    kv_b = (latent @ w[p + "self_attn.kv_b_proj.weight"].T).reshape(t, nh, dn + dv)
    k = np.concatenate([kv_b[..., :dn], np.repeat(k_pe, nh, axis=1)], axis=-1)
    v = kv_b[..., dn:]
    q = np.concatenate([q[..., :dn], np_rope_interleaved(q[..., dn:], inv, factor)], axis=-1)
    scores = np.einsum("thd,shd->hts", q, k) * scale
    scores = np.where(np_visible(t, p, c)[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v).reshape(t, nh * dv) @ w[p + "self_attn.o_proj.weight"].T


def np_mla_draft_logits(w: dict, c: dict, target_embed: np.ndarray, ids: np.ndarray, aux: np.ndarray,
                        handed: bool = False) -> np.ndarray:
    return np_draft_logits(w, c, target_embed, ids, aux, attention=np_mla_attention, handed=handed)


MLA_VARIANTS = {
    # name: (config overrides, with_embed, key spelling, target layers)
    "q_lora_yarn_shared_embed": (dict(), False, "midlayer", None),
    "no_q_lora_two_layers_d2t": (dict(q_lora_rank=None, num_hidden_layers=2, draft_vocab_size=40, rope_scaling=None,
                                      norm_before_residual=True), True, "layers", None),
    "kimi_k2_layout": (dict(model_type="kimi_k2", architectures=["Eagle3DeepseekV3ForCausalLM"], rope_scaling=KIMI_YARN,
                            rope_theta=50000.0, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}),
                       True, "midlayer", 4),
    "sliding_window": (dict(layer_types=["sliding_attention"], sliding_window=6), True, "midlayer", None),
    # lightseekorg/kimi-k2.6-eagle3.1-mla's layout: one MLA layer, both EAGLE 3.1 switches on, the
    # aux ids in the input-to-layer convention
    "kimi_k26_eagle31": (dict(model_type="kimi_k2", architectures=["Eagle3DeepseekV3ForCausalLM"], rope_scaling=KIMI_YARN,
                              rope_theta=50000.0, fc_norm=True, norm_output=True), True, "midlayer", None),
}


@pytest.mark.parametrize("name", sorted(MLA_VARIANTS))
def test_mla_draft_forward_matches_numpy_reference(name, tmp_path):
    over, with_embed, spelling, layers = MLA_VARIANTS[name]
    c = mla_draft_cfg(**over)
    d2t = (np.arange(40) % 7) if c.get("draft_vocab_size") else None
    w = mla_hf_weights(c, with_embed=with_embed, spelling=spelling, d2t=d2t)
    target = fresh_target(layers)
    draft = e3.load_draft(write_draft(tmp_path / "d", c, w), target=target, dtype="float32")
    lc = draft.config.layers
    assert draft.config.is_mla and lc.attention == "mla" and lc.num_experts == 0
    assert lc.rope.interleaved and lc.q_lora_rank == c.get("q_lora_rank")
    assert draft.config.norm_before_residual == bool(c.get("norm_before_residual"))
    if "eagle_config" in c:
        assert draft.aux_layer_ids == (2, 2, 3) and target.config.aux_layer_ids == (2, 2, 1)  # the target untouched
    # the draft cache is the MLA latent + rope key, like the target's MLA cache
    cache = kv_cache.init_cache(lc, 1, 8)
    assert cache.k.shape[-1] == c["kv_lora_rank"] and cache.v.shape[-1] == c["qk_rope_head_dim"]

    ids, aux = rand_inputs()
    want = np_mla_draft_logits(w, c, np.asarray(target.params["embed"]), ids, aux)
    got = draft.logits(ids, aux)  # 24 pairs: the expanded MLA form
    assert got.shape == (B, T, c.get("draft_vocab_size", VOCAB))
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)
    short = draft.logits(ids[:, :12], aux[:, :12])  # 12 pairs: the absorbed form (decode / verify sizes)
    assert rel_err(short, want[:, :12]) <= 1e-5, rel_err(short, want[:, :12])
    want_hidden = np_mla_draft_logits(w, c, np.asarray(target.params["embed"]), ids, aux, handed=True)
    assert rel_err(handed_hidden(draft, ids, aux), want_hidden) <= 1e-5


def test_mla_draft_with_llama_attention_weights_is_refused(tmp_path):
    """An MLA config.json over Llama-layer weights names the tensors it does not use."""
    c = mla_draft_cfg()
    w = hf_weights(draft_cfg())
    with pytest.raises(CheckpointError, match="does not use"):
        e3.load_draft(write_draft(tmp_path / "d", c, w), target=fresh_target(), dtype="float32")


# ---- 3. real draft configs ----------------------------------------------------------------------

REAL = {
    # draft file: (target config, hidden, draft vocab, vocab, aux ids (HF hidden_states indices))
    "llama3.1-8b-eagle3.draft.json": ("llama-3.1-8b-instruct.config.json", 4096, 32000, 128256, None),
    "deepseek-v3-eagle3.draft.json": ("deepseek-v3.config.json", 7168, 32000, 129280, (2, 30, 58)),
    "kimi-k2.5-eagle3.draft.json": ("kimi-k2.5.config.json", 7168, 163840, 163840, None),
    "minimax-m2.5-eagle3.draft.json": ("minimax-m2.5.config.json", 3072, 200064, 200064, None),
    "kimi-k2.5-eagle3-mla.draft.json": ("kimi-k2.5.config.json", 7168, 163840, 163840, (2, 30, 58)),
}


def read_json(name):
    with open(os.path.join(TEST_DATA, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("fname", sorted(REAL))
def test_real_draft_configs_parse(fname):
    tname, hidden, dv, vocab, aux = REAL[fname]
    cfg = draft_lib.parse_draft_config(read_json(fname))
    assert cfg.hidden_size == hidden and cfg.target_hidden_size == hidden  # default: the draft's own width
    assert cfg.draft_vocab_size == dv and cfg.vocab_size == vocab
    assert cfg.has_draft_vocab == (dv != vocab)
    assert cfg.aux_layer_ids == aux
    assert cfg.layers.num_layers == 1 and cfg.norm_before_residual is False
    tcfg = load_model_config(os.path.join(TEST_DATA, tname))
    draft_lib.check_fits_target(cfg, tcfg)  # each published draft fits its target
    if aux is not None:
        assert tcfg.with_aux_layers(aux).aux_layer_ids == aux
    if "mla" in fname:
        assert cfg.layers.attention == "mla" and cfg.is_mla
        assert (cfg.layers.kv_lora_rank, cfg.layers.q_lora_rank, cfg.layers.qk_rope_head_dim) == (512, 1536, 64)
        assert cfg.layers.num_experts == 0 and cfg.layers.segments == (("dense", 0, 1),)
        assert cfg.layers.rope.interleaved and cfg.layers.rope.rope_type == "yarn" and cfg.layers.rope.factor == 64.0
        specs = draft_lib.draft_specs(cfg, with_embed=False)
        # the first layer's q and kv down-projections read the 2H concatenation; the rest is Kimi's MLA
        assert specs["layers.0.q_a_proj"].shape == (2 * hidden, 1536)
        assert specs["layers.0.kv_a_proj"].shape == (2 * hidden, 512 + 64)
        assert specs["layers.0.q_b_proj"].shape == (1536, 64 * (128 + 64))
        assert specs["layers.0.kv_b_proj"].shape == (512, 64 * (128 + 128))
        assert specs["layers.0.o_proj"].shape == (64 * 128, hidden)
    else:
        assert cfg.layers.attention == "gqa"
        specs = draft_lib.draft_specs(cfg, with_embed=False)
        assert specs["fc"].shape == (3 * hidden, hidden) and specs["lm_head"].shape == (hidden, dv)
        assert specs["layers.0.q_proj"].shape[0] == 2 * hidden


def test_real_draft_config_details():
    llama = draft_lib.parse_draft_config(read_json("llama3.1-8b-eagle3.draft.json"))
    assert (llama.layers.num_heads, llama.layers.num_kv_heads, llama.layers.head_dim) == (32, 8, 128)
    assert llama.layers.rms_norm_eps == 1e-5
    kimi = draft_lib.parse_draft_config(read_json("kimi-k2.5-eagle3.draft.json"))
    assert kimi.layers.rope.rope_type == "yarn" and kimi.layers.rope.factor == 64.0
    assert kimi.layers.rope.theta == 50000.0 and not kimi.layers.rope.interleaved
    minimax = draft_lib.parse_draft_config(read_json("minimax-m2.5-eagle3.draft.json"))
    assert minimax.layers.rope.rope_type == "default" and minimax.layers.rope.theta == 5e6
    assert (minimax.layers.num_heads, minimax.layers.head_dim) == (48, 128)


# ---- 4. bad input -------------------------------------------------------------------------------


def _drop(key):
    return lambda c, w: w.pop(key)


def _reshape(key, shape):
    def f(c, w):
        w[key] = np.zeros(shape, np.float32)
    return f


def _add(key, arr):
    def f(c, w):
        w[key] = arr
    return f


BAD = {
    # name: (config overrides, with_embed, weight edit, exception, match)
    "vocab_mismatch": (dict(vocab_size=96), True, None, ConfigError, "vocab_size=96 does not match"),
    "target_hidden_mismatch": (dict(target_hidden_size=40), True, None, ConfigError, "target_hidden_size"),
    "aux_out_of_range": (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}), True, None,
                         ConfigError, "out of range"),
    "aux_wrong_count": (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]}), True, None,
                        ConfigError, "3 target layers"),
    "missing_tensor": (dict(), True, _drop("midlayer.self_attn.k_proj.weight"), CheckpointError,
                       "missing tensor 'layers.0.k_proj'"),
    "missing_hidden_norm": (dict(), True, _drop("midlayer.hidden_norm.weight"), CheckpointError, "hidden_norm"),
    "wrong_shape": (dict(), True, _reshape("fc.weight", (TARGET_H, 3 * TARGET_H + 1)), CheckpointError,
                    "'fc' has shape"),
    "wrong_shape_lm_head": (dict(draft_vocab_size=40), True, _reshape("lm_head.weight", (VOCAB, TARGET_H)),
                            CheckpointError, "'lm_head' has shape"),
    "unknown_tensor": (dict(), True, _add("midlayer.self_attn.extra_proj.weight", np.ones((4, 4), np.float32)),
                       CheckpointError, "does not use.*extra_proj"),
    "d2t_outside_vocab": (dict(draft_vocab_size=40), True, _add("d2t", np.full(40, 30, np.int64)),
                          CheckpointError, "d2t"),
    "d2t_negative": (dict(draft_vocab_size=40), True, _add("d2t", np.full(40, -1, np.int64)), CheckpointError, "d2t"),
    "missing_d2t": (dict(draft_vocab_size=40), True, _drop("d2t"), CheckpointError, "no d2t"),
    "architecture": (dict(architectures=["MedusaModel"]), True, None, ConfigError, "architecture 'MedusaModel'"),
    "draft_vocab_too_big": (dict(draft_vocab_size=80), True, None, ConfigError, "draft_vocab_size=80"),
    "fc_norm_without_its_weights": (dict(fc_norm=True), True, _drop("fc_norm.1.weight"), CheckpointError,
                                    "missing tensor 'fc_norm.1'"),
    "fc_norm_weights_without_the_switch": (dict(), True, _add("fc_norm.0.weight", np.ones(TARGET_H, np.float32)),
                                           CheckpointError, "does not use.*fc_norm"),
    "switch_not_a_boolean": (dict(norm_output="yes"), True, None, ConfigError, "norm_output must be true or false"),
    "four_feature_layers": (dict(num_aux_hidden_states=4), True, None, ConfigError, "num_aux_hidden_states=4"),
    "no_embed_and_other_hidden": (dict(hidden_size=48, target_hidden_size=TARGET_H), False, None, CheckpointError,
                                  "no embed_tokens"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_draft(name, tmp_path):
    over, with_embed, edit, exc, match = BAD[name]
    c = draft_cfg(**over)
    wc = dict(c, vocab_size=VOCAB, draft_vocab_size=min(c.get("draft_vocab_size") or VOCAB, VOCAB))
    w = hf_weights(wc, with_embed=with_embed)
    if c.get("vocab_size") != VOCAB and with_embed:
        w["embed_tokens.weight"] = np.zeros((c["vocab_size"], c["hidden_size"]), np.float32)
    if edit:
        edit(c, w)
    target = fresh_target()
    before = target.config
    with pytest.raises(exc, match=match):
        e3.load_draft(write_draft(tmp_path / "d", c, w), target=target, dtype="float32")
    assert target.config == before  # a failed load leaves the target's aux capture alone


@pytest.mark.parametrize("text, match", [("{not json", "not valid JSON"), ("[1, 2, 3]", "JSON object")])
def test_bad_config_json(text, match, tmp_path):
    folder = write_draft(tmp_path / "d", draft_cfg(), hf_weights(draft_cfg()))
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(text)
    with pytest.raises(ConfigError, match=match):
        e3.load_draft(folder, target=fresh_target(), dtype="float32")


def test_missing_config_and_weights(tmp_path):
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no config.json"):
        e3.load_draft(tmp_path / "empty", target=fresh_target())
    with open(tmp_path / "empty" / "config.json", "w") as f:
        json.dump(draft_cfg(), f)
    with pytest.raises(CheckpointError, match="safetensors"):
        e3.load_draft(tmp_path / "empty", target=fresh_target())


def test_logits_rejects_misaligned_inputs(reduced_pair):
    _, draft = reduced_pair
    ids, aux = rand_inputs()
    with pytest.raises(ValueError, match="aux"):
        draft.logits(ids, aux[..., :-1])
    with pytest.raises(ValueError, match="token_ids"):
        draft.logits(ids[0], aux)


# ---- malformed draft checkpoints ---------------------------------------------------------------


def test_d2t_of_wrong_length_is_a_checkpoint_error(tmp_path):
    c = draft_cfg(draft_vocab_size=40)
    w = hf_weights(c)
    w["d2t"] = np.zeros(41, np.int64)
    with pytest.raises(CheckpointError, match="d2t"):
        e3.load_draft(write_draft(tmp_path / "d", c, w), target=fresh_target(), dtype="float32")


@pytest.mark.parametrize("extra", ["layer_beyond_config", "duplicate_spelling"])
def test_tensors_the_config_does_not_use_are_reported(extra, tmp_path):
    c = draft_cfg()
    w = hf_weights(c)
    if extra == "layer_beyond_config":  # a 2-layer checkpoint with a 1-layer config.json
        w.update({k: v for k, v in hf_weights(draft_cfg(num_hidden_layers=2)).items() if k.startswith("layers.1.")})
    else:
        w["layers.0.self_attn.q_proj.weight"] = np.zeros_like(w["midlayer.self_attn.q_proj.weight"])
    with pytest.raises(CheckpointError):
        e3.load_draft(write_draft(tmp_path / "d", c, w), target=fresh_target(), dtype="float32")


@pytest.mark.parametrize("layout", ["nested_state_dict", "non_tensor_value"])
def test_bin_wrappers_and_non_tensor_entries(layout, tmp_path):
    """A state dict wrapped in {"state_dict": ...} loads; a non-tensor entry is a clear error."""
    torch = pytest.importorskip("torch")
    c = draft_cfg()
    folder = tmp_path / "d"
    os.makedirs(folder)
    with open(folder / "config.json", "w") as f:
        json.dump(c, f)
    sd = {k: torch.from_numpy(v) for k, v in hf_weights(c).items()}
    torch.save({"state_dict": sd} if layout == "nested_state_dict" else dict(sd, step=5), folder / "pytorch_model.bin")
    if layout == "nested_state_dict":
        assert e3.load_draft(folder, target=fresh_target(), dtype="float32").config.draft_vocab_size
    else:
        with pytest.raises(CheckpointError, match="'step' is a int"):
            e3.load_draft(folder, target=fresh_target(), dtype="float32")


# Every key vLLM's and SGLang's EAGLE-3 loaders read that changes what a draft computes (their
# llama_eagle3.py / deepseek_eagle3.py and the layer classes they build, plus TensorRT-LLM's
# eagle_config names), with a value that asks for something other than the default draft. Each is
# either implemented (the parsed config changes) or refused by name; none is read and ignored.
PEER_KEYS_IMPLEMENTED = {
    "norm_before_residual": True, "fc_norm": True, "norm_output": True, "norm_before_fc": True,
    "eagle_config.norm_before_fc": True, "eagle_config.return_hidden_post_norm": True,
    "draft_vocab_size": 40, "target_hidden_size": 48, "num_hidden_layers": 2, "rms_norm_eps": 1e-3,
    "rope_theta": 500.0, "rope_scaling": LLAMA3_ROPE, "head_dim": 16, "intermediate_size": 24,
    "eagle_config.eagle_aux_hidden_state_layer_ids": [2, 2, 1], "layer_types": ["sliding_attention"],
}
PEER_KEYS_REFUSED = {
    "qkv_bias": True, "bias": True, "attention_bias": True, "mlp_bias": True, "is_causal": False,
    "logit_scale": 2.0, "use_sliding_window": True, "hidden_act": "gelu", "num_aux_hidden_states": 4,
    "layer_types": ["chunked_attention"], "eagle_config.use_aux_hidden_state": False,
    "eagle_config.use_input_layernorm_in_first_layer": False, "eagle_config.use_last_layernorm": False,
    "eagle_config.use_mtp_layernorm": True,
}


def with_key(key: str, value) -> dict:
    if key.startswith("eagle_config."):
        return draft_cfg(eagle_config={key.split(".", 1)[1]: value})
    return draft_cfg(**{key: value}, sliding_window=8)  # the window a sliding_attention layer takes


@pytest.mark.parametrize("key", sorted(PEER_KEYS_IMPLEMENTED))
def test_peer_draft_keys_are_implemented(key):
    assert draft_lib.parse_draft_config(with_key(key, PEER_KEYS_IMPLEMENTED[key])) != \
        draft_lib.parse_draft_config(draft_cfg(sliding_window=8))  # alone, sliding_window changes nothing (vLLM)


@pytest.mark.parametrize("key", sorted(PEER_KEYS_REFUSED))
def test_peer_draft_keys_not_implemented_are_refused_by_name(key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        draft_lib.parse_draft_config(with_key(key, PEER_KEYS_REFUSED[key]))
