"""Scripted tiny models for end-to-end tests: a target folder (Kimi-K2.5 or Llama layout) whose
greedy continuation of each given prompt is a given token script, and an EAGLE-3 draft folder
(`LlamaForCausalLMEagle3`) that proposes the same scripts, so tests can make the engine emit
reasoning and tool-call markup token by token, plainly or several tokens per speculative step.

    target_dir, draft_dir = write_scripted_pair(out_dir, vocab_size, [prompt_a, prompt_b],
                                                [script_a, script_b], eos_token_id=eos)
    target = e3.load_target(target_dir, dtype="float32")
    draft = e3.load_draft(draft_dir, target=target, dtype="float32")

The weights are constructed, not trained. Both models run the same two-layer program:

1. Layer 0 attention copies the previous tokens: one head per relative offset o = 1 .. k-1 (the
   draft also has o = 0) whose rotary query and key come from a constant channel, so the score is
   a fixed function of the distance, sum_p A_p cos((distance - o) theta_p), with 8 rotary pairs of
   frequencies 3^-p and amplitudes chosen so that the head attends to distance o by at least 30
   nats over every other distance up to MAX_POSITIONS, and, at the first positions where distance o
   does not exist yet, to the first token. So position t holds the k-gram context
   (x_t, x_t-1, ..., x_t-k+1), the missing ones read as x_0, each token as a unit vector (a
   spherical code in `embed_dim` dimensions, low mutual coherence) in its own block of the residual.
2. Layer 0 MLP: one SwiGLU unit per context that occurs in some but not all conversations (the
   full prompt + script sequences); it fires on that exact context and raises, for each
   conversation c the context never occurs in, the flag "this prefix is not conversation c here".
3. Layer 1 attention ("memory"): one head per conversation with a position-independent score
   ANY * flag_c, so its output is ~1 if the flag was raised anywhere in the prefix, else ~0.
4. Layer 1 MLP (Kimi: the MoE layer; every routed expert holds the same weights, the shared expert
   is zero, so routing cannot matter): one unit per entry (context, memory flags) -> next token,
   firing only on an exact match and writing that token's direction, which the LM head reads.

The key of a prediction is therefore the last `context` tokens plus the set of given
conversations the prefix has visibly left, so conversations that share a chat template's
suffix, or whose scripts share a phrase, still continue differently. A script whose key repeats
with two different continuations raises ValueError naming the place (raise `context`, up to
MAX_CONTEXT, or reword). Only predictions inside the scripts are tabulated (the prompt's own
continuations are never asked of the model). The norms are exact where it matters (the inputs to
the decisions are scale-free: thresholds ride on the constant channel), matches and misses are
+-40 before the SiLU, and the right token's logit is ~60 against <= 60 * coherence for the others
(0 for tokens never produced), so float32 greedy decoding follows the script exactly.

The draft is the same program over its own KV cache (its pair t holds token x_t+1): its feature
path is off (`fc` and `hidden_norm` zero with `norm_before_residual`, so neither the target's
features nor its own previous hidden reach it), and it is tabulated on the sequences without
their first token; a key the draft cannot tell apart keeps its first continuation (a draft may
be wrong; `draft_conflicts` in scripted.json counts them).

Limits: vocabulary ids < vocab_size; context k in 2..MAX_CONTEXT; sequences up to MAX_POSITIONS
tokens (the rotary design is checked up to there); hidden size 1 + (k + 1) * embed_dim + 3 * N
(N conversations), rounded up to a multiple of 8 (128 for k=6, embed_dim=16, N<=5); the
intermediate size is about the number of script tokens; embed_dim must keep the spherical code's
coherence of the distinct tokens used below MAX_COHERENCE.
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

import numpy as np

MAX_CONTEXT = 12
MAX_POSITIONS = 8192
MAX_COHERENCE = 0.85
# Rotary amplitudes of the offset heads (8 pairs, frequencies 3^-p), found by a search: every
# distance but the wanted one scores >= 30 nats less up to MAX_POSITIONS, and at the first
# positions the score falls by >= 30 nats per step of distance up to MAX_CONTEXT - 1.
_ROPE_AMPS = 1.2 * np.array([43.87, 93.24, 760.86, 14.02, 14.66, 17.28, 17.86, 20.07])
_ROPE_PAIRS = 8
_ROPE_MARGIN = 30.0  # nats, checked at build time with the library's own frequencies
_ANY_PAIR = 12  # GQA memory heads score on rotary pairs 12.. (frequency <= 3^-12: ~position-free)
_GATE = 40.0  # a unit's gate at an exact match; at most -_GATE * (ratio of norms) elsewhere
_ANY = 40.0  # memory-head score of a flagged position
_LOGIT = 60.0  # the scripted token's logit
_OUT = 4.0  # the size of the output direction in the residual
_C = 1.0  # the constant channel
_EPS = 1e-6  # rms_norm_eps
_EXPERTS, _EXPERTS_PER_TOK, _SCALING = 4, 2, 2.827  # Kimi MoE layer (identical experts)
_MLA_Q_LORA, _MLA_NOPE, _MLA_ROPE = 4, 2, 2 * _ROPE_PAIRS
FAMILIES = ("kimi_k25", "llama")


def _silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


# ---- the tables: what each model must predict where -------------------------------------------------


def _contexts(seq: Sequence[int], k: int) -> list[tuple[int, ...]]:
    """Position t's k-gram (x_t, x_t-1, ..., x_t-k+1), positions before 0 reading x_0 (what the offset
    heads see)."""
    return [tuple(seq[max(t - o, 0)] for o in range(k)) for t in range(len(seq))]


class _Tables:
    """The units of one model over `seqs` (its token sequences, one per conversation): `flag_units`
    (context, conversations it is absent from) and `lookup_units` (context, memory flags, next token)
    for the positions t >= starts[i] of sequence i (predicting seqs[i][t + 1])."""

    def __init__(self, seqs, starts, k: int, strict: bool, describe=None):
        self.k, self.n = k, len(seqs)
        ctxs = [_contexts(s, k) for s in seqs]
        present = [set(c) for c in ctxs]
        flags: dict[tuple, tuple[int, ...]] = {}
        for cs in ctxs:
            for ctx in cs:
                if ctx not in flags:
                    flags[ctx] = tuple(c for c in range(self.n) if ctx not in present[c])
        self.flag_units = [(ctx, f) for ctx, f in flags.items() if f]
        lookup: dict[tuple, tuple[int, int, int]] = {}
        self.conflicts = 0
        for i, (seq, cs) in enumerate(zip(seqs, ctxs)):
            memory = [0] * self.n
            for t in range(len(seq) - 1):
                for c in flags[cs[t]]:
                    memory[c] = 1
                if t < starts[i]:
                    continue
                key, nxt = (cs[t], tuple(memory)), seq[t + 1]
                if key not in lookup:
                    lookup[key] = (nxt, i, t)
                elif lookup[key][0] != nxt:
                    if strict:
                        raise ValueError(describe(key, lookup[key], (nxt, i, t)))
                    self.conflicts += 1
        self.lookup_units = [(ctx, mem, nxt) for (ctx, mem), (nxt, _, _) in lookup.items()]


# ---- token codes and the residual layout ------------------------------------------------------------


def _spherical_code(n: int, dim: int, seed: int) -> tuple[np.ndarray, float]:
    """n unit vectors in `dim` dimensions pushed apart (the largest inner product of two is what a
    mismatched context slot keeps); returns them and that largest inner product."""
    rng = np.random.default_rng(seed)
    e = rng.standard_normal((max(n, 1), dim))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    if n < 2:
        return e[:n], -1.0
    for _ in range(300 if n <= 1000 else 100):
        g = e @ e.T
        np.fill_diagonal(g, -2.0)
        e = e - 0.5 * np.maximum(g - (g.max() - 0.1), 0.0) @ e
        e /= np.linalg.norm(e, axis=1, keepdims=True)
    g = e @ e.T
    np.fill_diagonal(g, -2.0)
    return e, float(g.max())


class _Layout:
    """Residual channels: 0 constant; blocks 0..k-1 the context tokens; m, mbar (= 1 - m) the layer-0
    flags; M the memory; U the output direction. rN: the RMS of the residual entering each norm."""

    def __init__(self, k: int, dim: int, n: int):
        self.k, self.dim, self.n = k, dim, n
        used = 1 + k * dim + 3 * n + dim
        self.H = -(-used // 8) * 8
        self.m = 1 + k * dim + np.arange(n)
        self.mbar = self.m + n
        self.M = self.m + 2 * n
        self.U = 1 + k * dim + 3 * n + np.arange(dim)
        self.r0 = self.rms(_C ** 2 + 1)  # the embedding
        self.r1 = self.rms(_C ** 2 + k)  # after layer-0 attention
        self.r2 = self.rms(_C ** 2 + k + n)  # after layer-0 MLP (m + mbar: one per conversation)

    def block(self, o: int) -> np.ndarray:
        return 1 + o * self.dim + np.arange(self.dim)

    def rms(self, sq: float) -> float:
        return math.sqrt(sq / self.H + _EPS)

    def r3(self, memory_count: int) -> float:  # after layer-1 attention
        return self.rms(_C ** 2 + self.k + self.n + memory_count)


# ---- weights in residual coordinates (matrices [in, out], inputs already RMS-normalised) ------------


def _mlp_flags(L: _Layout, tab: _Tables, code: dict, delta: float, width: int):
    """Layer-0 MLP: unit 0 always writes mbar = 1; a context unit writes m_c = 1, mbar_c = 0."""
    gate, up, down = np.zeros((L.H, width)), np.zeros((L.H, width)), np.zeros((width, L.H))
    s = _silu(_GATE)
    gate[0, 0], up[0, 0] = _GATE * L.r1 / _C, L.r1 / _C
    down[0, L.mbar] = 1 / s
    beta = _GATE / delta
    for u, (ctx, flagged) in enumerate(tab.flag_units, 1):
        for o, tok in enumerate(ctx):
            gate[L.block(o), u] = beta * L.r1 * code[tok]
        gate[0, u] = -beta * L.r1 * (L.k - delta) / _C
        up[0, u] = L.r1 / _C
        down[u, L.m[list(flagged)]] = 1 / s
        down[u, L.mbar[list(flagged)]] = -1 / s
    return gate, up, down


def _mlp_lookup(L: _Layout, tab: _Tables, code: dict, delta: float, width: int, out_scale: float = 1.0):
    """Layer-1 MLP: one unit per (context, memory) key writing its next token's direction."""
    gate, up, down = np.zeros((L.H, width)), np.zeros((L.H, width)), np.zeros((width, L.H))
    s = _silu(_GATE)
    beta = _GATE / delta
    for u, (ctx, memory, nxt) in enumerate(tab.lookup_units):
        r = L.r3(sum(memory))
        for o, tok in enumerate(ctx):
            gate[L.block(o), u] = beta * r * code[tok]
        gate[L.M, u] = beta * r * (2 * np.asarray(memory) - 1)
        gate[0, u] = -beta * r * (L.k + sum(memory) - delta) / _C
        up[0, u] = r / _C
        down[u, L.U] = _OUT * code[nxt] / s * out_scale
    return gate, up, down


def _lm_head(L: _Layout, code: dict, vocab_size: int) -> np.ndarray:
    head = np.zeros((L.H, vocab_size))
    kappa = _LOGIT * L.rms(_C ** 2 + L.k + L.n + _OUT ** 2) / _OUT
    for tok, vec in code.items():
        head[L.U, tok] = kappa * vec
    return head


def _embedding(L: _Layout, code: dict, vocab_size: int) -> np.ndarray:
    embed = np.zeros((vocab_size, L.H))
    embed[:, 0] = _C
    for tok, vec in code.items():
        embed[tok, L.block(0)] = vec
    return embed


def _offset_query(offset: int, freqs: np.ndarray, scale: float) -> np.ndarray:
    """Complex rotary query per pair for a head attending to distance `offset` (key = 1 per pair)."""
    return _ROPE_AMPS * np.exp(-1j * offset * freqs[:_ROPE_PAIRS]) / scale


def _check_rope(freqs: np.ndarray, k: int, max_positions: int) -> None:
    """The offset heads are sharp with the frequencies the library computes: every other distance
    scores >= _ROPE_MARGIN nats less, and at the first positions the nearest distance wins by as much."""
    f = freqs[:_ROPE_PAIRS].astype(np.float64)
    score = lambda d: (_ROPE_AMPS * np.cos(np.asarray(d, np.float64)[:, None] * f)).sum(-1)
    gap = score([0])[0] - score(np.arange(1, max_positions + 1))
    steps = -np.diff(score(np.arange(1, k)))
    worst = min(gap.min(), steps.min() if len(steps) else np.inf)
    if worst < _ROPE_MARGIN:
        raise ValueError(f"scripted model: the offset heads' rotary margin is {worst:.1f} nats (< {_ROPE_MARGIN}) for "
                         f"context={k}, max_positions={max_positions}; use smaller values")


# ---- families -----------------------------------------------------------------------------------------


def _gqa_sizes(L: _Layout, num_offsets: int) -> tuple[int, int, float]:
    pairs = max(_ANY_PAIR + L.n, _ROPE_PAIRS, -(-(L.dim + 1) // 2))
    num_heads = max(num_offsets, L.n, 1)
    return num_heads, 2 * pairs, float(3.0 ** pairs)  # inv_freq[p] = theta^(-2p/d) = 3^-p


def _gqa_attention(L: _Layout, num_heads: int, head_dim: int, freqs: np.ndarray, offsets, in_width: int,
                   write_const: bool) -> dict:
    """Layer-0 GQA (one KV head): head h attends to distance offsets[h] and copies that token's code
    into block offsets[h]; with write_const, head 0 also writes the constant channel."""
    d, pairs, dim = head_dim, head_dim // 2, L.dim
    scale = d ** -0.5
    q, k = np.zeros((in_width, num_heads * d)), np.zeros((in_width, d))
    v, o = np.zeros((in_width, d)), np.zeros((num_heads * d, L.H))
    k[0, :_ROPE_PAIRS] = L.r0 / _C
    for h, off in enumerate(offsets):
        z = _offset_query(off, freqs, scale) * L.r0 / _C
        q[0, h * d + np.arange(_ROPE_PAIRS)] = z.real
        q[0, h * d + pairs + np.arange(_ROPE_PAIRS)] = z.imag
        o[h * d + np.arange(dim), L.block(off)] = 1.0
    v[L.block(0), np.arange(dim)] = L.r0
    if write_const:
        v[0, dim] = L.r0
        o[dim, 0] = 1.0
    return dict(q_proj=q, k_proj=k, v_proj=v, o_proj=o)


def _gqa_memory(L: _Layout, num_heads: int, head_dim: int) -> dict:
    """Layer-1 GQA: head c scores _ANY * m_c on a near-zero-frequency rotary pair, reads m_c into M_c."""
    d = head_dim
    scale = d ** -0.5
    q, k = np.zeros((L.H, num_heads * d)), np.zeros((L.H, d))
    v, o = np.zeros((L.H, d)), np.zeros((num_heads * d, L.H))
    for c in range(L.n):
        q[0, c * d + _ANY_PAIR + c] = _ANY / scale * L.r2 / _C
        k[L.m[c], _ANY_PAIR + c] = L.r2
        v[L.m[c], c] = L.r2
        o[c * d + c, L.M[c]] = 1.0
    return dict(q_proj=q, k_proj=k, v_proj=v, o_proj=o)


def _mla_sizes(L: _Layout, k: int) -> dict:
    return dict(num_heads=max(k - 1, L.n, 1), rank=max(L.dim, 2 * L.n), v_dim=L.dim)


def _mla_attention(L: _Layout, s: dict, freqs: np.ndarray, memory: bool) -> dict:
    """MLA layer: offset heads on the rope part (layer 0) or memory heads on the nope part (layer 1).
    The query comes through the q LoRA from the constant channel (normalised to exactly 1); the
    latent (kv_a_layernorm normalises it) is the current token's code (layer 0) or [m, mbar] (layer 1),
    both of constant norm, so the cached latent is exact."""
    nh, r, dv = s["num_heads"], s["rank"], s["v_dim"]
    dn, dr, rq = _MLA_NOPE, _MLA_ROPE, _MLA_Q_LORA
    scale = (dn + dr) ** -0.5
    q_a, q_a_norm = np.zeros((L.H, rq)), np.full((rq,), 1 / math.sqrt(rq))
    q_a[0, 0] = 1.0
    q_b = np.zeros((rq, nh * (dn + dr)))
    kv_a, kv_b = np.zeros((L.H, r + dr)), np.zeros((r, nh * (dn + dv)))
    o = np.zeros((nh * dv, L.H))
    if not memory:
        kv_a[L.block(0), np.arange(L.dim)] = 1.0
        kv_a_norm = np.full((r,), 1 / math.sqrt(r))  # |code| = 1
        kv_a[0, r + 2 * np.arange(_ROPE_PAIRS)] = L.r0 / _C  # shared rope key 1 + 0i per pair
        for h, off in enumerate(range(1, L.k)):
            z = _offset_query(off, freqs, scale)
            q_b[0, h * (dn + dr) + dn + 2 * np.arange(_ROPE_PAIRS)] = z.real
            q_b[0, h * (dn + dr) + dn + 2 * np.arange(_ROPE_PAIRS) + 1] = z.imag
            kv_b[np.arange(L.dim), h * (dn + dv) + dn + np.arange(L.dim)] = 1.0
            o[h * dv + np.arange(L.dim), L.block(off)] = 1.0
    else:
        kv_a[L.m, np.arange(L.n)] = 1.0
        kv_a[L.mbar, L.n + np.arange(L.n)] = 1.0
        kv_a_norm = np.full((r,), math.sqrt(L.n / r))  # |[m, mbar]| = sqrt(n)
        for c in range(L.n):
            q_b[0, c * (dn + dr)] = _ANY / scale
            kv_b[c, c * (dn + dv)] = 1.0  # W_UK: m_c -> nope key
            kv_b[c, c * (dn + dv) + dn] = 1.0  # W_UV: m_c -> value
            o[c * dv, L.M[c]] = 1.0
    return dict(q_a_proj=q_a, q_a_norm=q_a_norm, q_b_proj=q_b, kv_a_proj=kv_a, kv_a_norm=kv_a_norm, kv_b_proj=kv_b,
                o_proj=o)


def _pad_cols(a: np.ndarray, width: int) -> np.ndarray:
    return np.pad(a, ((0, 0), (0, width - a.shape[1])))


def _target(family: str, L: _Layout, tab: _Tables, code: dict, delta: float, vocab_size: int, max_positions: int,
            bos, eos, seed: int) -> tuple[dict, dict]:
    """(config.json dict, flat params [in, out]) of the target."""
    from eagle3_jax.config.model import parse_model_config
    from eagle3_jax.models.layers import inv_freq

    u0, u1 = 1 + len(tab.flag_units), max(len(tab.lookup_units), 1)
    ones = np.ones((L.H,))
    flat = {"embed": _embedding(L, code, vocab_size), "final_norm": ones, "lm_head": _lm_head(L, code, vocab_size)}
    common = dict(vocab_size=vocab_size, hidden_size=L.H, num_hidden_layers=2, max_position_embeddings=max_positions,
                  rms_norm_eps=_EPS, hidden_act="silu", tie_word_embeddings=False, bos_token_id=bos,
                  eos_token_id=eos, torch_dtype="float32")
    if family == "llama":
        nh, d, theta = _gqa_sizes(L, L.k - 1)
        width = max(u0, u1)
        raw = dict(architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=width,
                   num_attention_heads=nh, num_key_value_heads=1, head_dim=d, rope_theta=theta, **common)
        freqs = inv_freq(parse_model_config(raw).rope)
        _check_rope(freqs, L.k, max_positions)
        layers = [_gqa_attention(L, nh, d, freqs, range(1, L.k), L.H, False), _gqa_memory(L, nh, d)]
        mlps = [_mlp_flags(L, tab, code, delta, width), _mlp_lookup(L, tab, code, delta, width)]
        for i, (attn, (g, u, dn)) in enumerate(zip(layers, mlps)):
            flat.update({f"layers.{i}.{n}": w for n, w in attn.items()})
            flat.update({f"layers.{i}.attn_norm": ones, f"layers.{i}.mlp_norm": ones, f"layers.{i}.gate_proj": g,
                         f"layers.{i}.up_proj": u, f"layers.{i}.down_proj": dn})
        return raw, flat
    s = _mla_sizes(L, L.k)
    text = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", intermediate_size=u0,
                moe_intermediate_size=u1, num_attention_heads=s["num_heads"], num_key_value_heads=s["num_heads"],
                n_routed_experts=_EXPERTS, num_experts_per_tok=_EXPERTS_PER_TOK, n_group=1, topk_group=1,
                n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=_SCALING, norm_topk_prob=True,
                topk_method="noaux_tc", scoring_func="sigmoid", q_lora_rank=_MLA_Q_LORA, kv_lora_rank=s["rank"],
                qk_nope_head_dim=_MLA_NOPE, qk_rope_head_dim=_MLA_ROPE, v_head_dim=s["v_dim"],
                rope_theta=float(3.0 ** _ROPE_PAIRS), rope_scaling=None, rope_interleave=True,
                num_nextn_predict_layers=0, **common)
    raw = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "bos_token_id": bos,
           "eos_token_id": eos, "tie_word_embeddings": False, "text_config": text,
           "vision_config": {"mm_hidden_size": 16, "text_hidden_size": L.H}}
    freqs = inv_freq(parse_model_config(raw).rope)
    _check_rope(freqs, L.k, max_positions)
    for i in range(2):
        flat.update({f"layers.{i}.{n}": w for n, w in _mla_attention(L, s, freqs, memory=i == 1).items()})
        flat.update({f"layers.{i}.attn_norm": ones, f"layers.{i}.mlp_norm": ones})
    g, u, dn = _mlp_flags(L, tab, code, delta, u0)
    flat.update({"layers.0.gate_proj": g, "layers.0.up_proj": u, "layers.0.down_proj": dn})
    g, u, dn = _mlp_lookup(L, tab, code, delta, u1, out_scale=1 / _SCALING)  # weights sum to the scaling factor
    rng = np.random.default_rng(seed)
    e = _EXPERTS
    flat.update({
        "layers.1.router": 0.1 * rng.standard_normal((L.H, e)), "layers.1.router_bias": 0.1 * rng.standard_normal(e),
        "layers.1.experts_gate": np.repeat(g[None], e, 0), "layers.1.experts_up": np.repeat(u[None], e, 0),
        "layers.1.experts_down": np.repeat(dn[None], e, 0),
        "layers.1.shared_gate": np.zeros((L.H, u1)), "layers.1.shared_up": np.zeros((L.H, u1)),
        "layers.1.shared_down": np.zeros((u1, L.H)),
    })
    return raw, flat


def _draft(L: _Layout, tab: _Tables, code: dict, delta: float, vocab_size: int, max_positions: int, bos, eos):
    """(DraftConfig, params tree [in, out]) of the draft."""
    from eagle3_jax.config.draft import parse_draft_config
    from eagle3_jax.models.layers import inv_freq

    nh, d, theta = _gqa_sizes(L, L.k)
    width = max(1 + len(tab.flag_units), len(tab.lookup_units), 1)
    raw = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=L.H, intermediate_size=width,
               num_hidden_layers=2, num_attention_heads=nh, num_key_value_heads=1, head_dim=d, rope_theta=theta,
               vocab_size=vocab_size, draft_vocab_size=vocab_size, target_hidden_size=L.H,
               max_position_embeddings=max_positions, rms_norm_eps=_EPS, norm_before_residual=True,
               bos_token_id=bos, eos_token_id=eos)
    cfg = parse_draft_config(raw)
    freqs = inv_freq(cfg.layers.rope)
    _check_rope(freqs, L.k, max_positions)
    ones = np.ones((L.H,))
    attn0 = _gqa_attention(L, nh, d, freqs, range(L.k), 2 * L.H, True)
    g0, u0, d0 = _mlp_flags(L, tab, code, delta, width)
    g1, u1, d1 = _mlp_lookup(L, tab, code, delta, width)
    layer0 = dict(attn0, attn_norm=ones, hidden_norm=np.zeros((L.H,)), mlp_norm=ones, gate_proj=g0, up_proj=u0,
                  down_proj=d0)
    layer1 = dict(_gqa_memory(L, nh, d), attn_norm=ones, mlp_norm=ones, gate_proj=g1, up_proj=u1, down_proj=d1)
    params = {"fc": np.zeros((3 * L.H, L.H)), "final_norm": ones, "lm_head": _lm_head(L, code, vocab_size),
              "embed": _embedding(L, code, vocab_size), "layers": [layer0, layer1]}
    return cfg, params


# ---- the public functions -----------------------------------------------------------------------------


def _as_pairs(prompt_ids, script_ids) -> list[tuple[list[int], list[int]]]:
    def is_ids(x):
        return len(x) > 0 and all(isinstance(t, (int, np.integer)) for t in x)

    if script_ids is None:  # a list of (prompt, script) pairs
        pairs = [(list(p), list(s)) for p, s in prompt_ids]
    elif is_ids(prompt_ids) and is_ids(script_ids):
        pairs = [(list(prompt_ids), list(script_ids))]
    else:
        if len(prompt_ids) != len(script_ids):
            raise ValueError(f"scripted model: {len(prompt_ids)} prompts but {len(script_ids)} scripts; pass one script "
                             "per prompt")
        pairs = [(list(p), list(s)) for p, s in zip(prompt_ids, script_ids)]
    if not pairs:
        raise ValueError("scripted model: no (prompt, script) pair given")
    for i, (p, s) in enumerate(pairs):
        if not p or not s:
            raise ValueError(f"scripted model: pair {i} has an empty {'prompt' if not p else 'script'}; both need >= 1 token")
    return [([int(t) for t in p], [int(t) for t in s]) for p, s in pairs]


def write_scripted_pair(out_dir: str | os.PathLike, vocab_size: int, prompt_ids, script_ids=None, *,
                        family: str = "kimi_k25", eos_token_id: int | Sequence[int] | None = None,
                        bos_token_id: int | None = None,
                        context: int = 6, embed_dim: int = 16, max_positions: int = MAX_POSITIONS,
                        with_draft: bool = True, tokenizer_dir: str | os.PathLike | None = None,
                        overwrite: bool = False, seed: int = 0) -> tuple[str, str | None]:
    """Write a scripted target (and draft) under `out_dir`; returns (target_dir, draft_dir).

    prompt_ids / script_ids: one prompt and its script (lists of ints), parallel lists of them, or
    (script_ids=None) a list of (prompt, script) pairs. Greedy decoding of each prompt generates its
    script exactly (the script normally ends with an EOS id the caller stops on; what comes after
    the script is unspecified). The target folder `out_dir/target` has config.json (`kimi_k25`
    wrapping a DeepSeek-V3 `text_config`, weights under `language_model.`; or `llama`) and
    model.safetensors (float32) plus the files of `tokenizer_dir` if given; `out_dir/draft` is a
    `LlamaForCausalLMEagle3` folder (None without `with_draft`). `out_dir/scripted.json` records
    the construction (sizes, margin, draft conflicts).

    eos_token_id (an id or a list) and bos_token_id go into both config.json files.
    context: tokens of local context each prediction sees (2..MAX_CONTEXT); embed_dim: the width of
    one token's code. Raises ValueError for an ambiguous script (the same last `context` tokens and
    the same set of conversations already left, followed by two different tokens), ids outside the
    vocabulary, sequences over `max_positions` or too many distinct tokens for `embed_dim`.
    """
    from eagle3_jax.checkpoint.hf_writer import save_hf_target
    from eagle3_jax.config.model import parse_model_config
    from eagle3_jax.train.export import export_hf_draft

    if family not in FAMILIES:
        raise ValueError(f"scripted model: family {family!r} is not supported; use one of {', '.join(FAMILIES)}")
    if not (isinstance(context, int) and 2 <= context <= MAX_CONTEXT):
        raise ValueError(f"scripted model: context must be an integer in 2..{MAX_CONTEXT}; got {context!r}")
    if not 1 <= max_positions <= MAX_POSITIONS:
        raise ValueError(f"scripted model: max_positions must be in 1..{MAX_POSITIONS}; got {max_positions}")
    pairs = _as_pairs(prompt_ids, script_ids)
    seqs = [p + s for p, s in pairs]
    vocab_size = int(vocab_size)
    if isinstance(eos_token_id, (list, tuple)):
        eos_token_id = [int(t) for t in eos_token_id]
    elif eos_token_id is not None:
        eos_token_id = int(eos_token_id)
    bos_token_id = None if bos_token_id is None else int(bos_token_id)
    for name, ids in (("eos_token_id", eos_token_id), ("bos_token_id", bos_token_id)):
        for tok in ids if isinstance(ids, list) else [ids]:
            if tok is not None and not 0 <= tok < vocab_size:
                raise ValueError(f"scripted model: {name}={tok} is outside the vocabulary [0, {vocab_size})")
    for i, seq in enumerate(seqs):
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"scripted model: pair {i} has token ids outside [0, {vocab_size}): {bad[:5]}; raise vocab_size")
        if len(seq) > max_positions:
            raise ValueError(f"scripted model: pair {i} is {len(seq)} tokens (prompt + script), over max_positions="
                             f"{max_positions}")

    def describe(key, first, second):
        (nxt_a, ia, ta), (nxt_b, ib, tb) = first, second
        pa, pb = len(pairs[ia][0]), len(pairs[ib][0])
        where = lambda i, t, p: f"pair {i} script token {t + 1 - p}"
        left = [c for c, f in enumerate(key[1]) if f]
        return (f"scripted model: ambiguous script: {where(ia, ta, pa)} and {where(ib, tb, pb)} follow the same last "
                f"{context} tokens {list(reversed(key[0]))} with the same conversations left behind ({left or 'none'}) "
                f"but continue with {nxt_a} vs {nxt_b}. The model predicts from the last `context` tokens plus which of "
                f"the given conversations the prefix has already departed from: raise context (now {context}, at most "
                f"{MAX_CONTEXT}) or change the scripts so that the tokens before this point differ")

    tab = _Tables(seqs, [len(p) - 1 for p, _ in pairs], context, strict=True, describe=describe)
    dtab = _Tables([s[1:] for s in seqs], [len(p) - 1 for p, _ in pairs], context, strict=False)
    tokens = sorted({t for s in seqs for t in s})
    vecs, coherence = _spherical_code(len(tokens), embed_dim, seed)
    if coherence > MAX_COHERENCE:
        raise ValueError(f"scripted model: {len(tokens)} distinct tokens do not fit embed_dim={embed_dim} (code "
                         f"coherence {coherence:.2f} > {MAX_COHERENCE}); raise embed_dim")
    code = dict(zip(tokens, vecs))
    delta = min(1.0 - coherence, 1.0) / 2  # half the smallest score drop of a mismatch
    layout = _Layout(context, embed_dim, len(pairs))

    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    target_dir = os.path.join(out_dir, "target")
    raw, flat = _target(family, layout, tab, code, delta, vocab_size, max_positions, bos_token_id, eos_token_id, seed)
    extra = {}
    if tokenizer_dir is not None:
        for name in sorted(os.listdir(tokenizer_dir)):
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src) and name != "config.json" and not name.endswith((".safetensors", ".safetensors.index.json")):
                extra[name] = src
    cfg = parse_model_config(raw)
    save_hf_target(target_dir, {k: np.asarray(v, np.float32) for k, v in flat.items()}, cfg, raw, extra_files=extra,
                   overwrite=overwrite)
    draft_dir = None
    if with_draft:
        dcfg, params = _draft(layout, dtab, code, delta, vocab_size, max_positions, bos_token_id, eos_token_id)
        draft_dir = export_hf_draft(os.path.join(out_dir, "draft"), dcfg, params, dtype="float32", include_embed=True,
                                    overwrite=overwrite)
    info = dict(family=family, vocab_size=vocab_size, context=context, embed_dim=embed_dim, hidden_size=layout.H,
                conversations=len(pairs), distinct_tokens=len(tokens), code_coherence=round(coherence, 4),
                flag_units=len(tab.flag_units), lookup_units=len(tab.lookup_units),
                draft_flag_units=len(dtab.flag_units), draft_lookup_units=len(dtab.lookup_units),
                draft_conflicts=dtab.conflicts, max_positions=max_positions)
    with open(os.path.join(out_dir, "scripted.json"), "w") as f:
        json.dump(info, f, indent=2)
    return target_dir, draft_dir


def check_scripted_pair(target, draft, prompt_ids, script_ids=None) -> dict:
    """Teacher-forced check of loaded models (e3.Target, e3.Draft or None) against the scripts:
    the target's argmax at every script position, and the share of script positions where the
    draft (pair t = token t + 1, features zero) proposes the next token. Returns
    {"target_errors": [(pair, script index, want, got)], "target_margin": the smallest logit lead of
    the scripted token over the best other (nats: ~25 or more, so sampling at temperature <= 1
    follows the script too), "draft_accuracy": float or None}."""
    pairs = _as_pairs(prompt_ids, script_ids)
    seqs = [p + s for p, s in pairs]
    width = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    logits = target.logits(ids)
    errors, margin = [], np.inf
    for i, (p, s) in enumerate(pairs):
        seq = seqs[i]
        for t in range(len(p) - 1, len(seq) - 1):
            row = np.array(logits[i, t], np.float64)
            got, want = int(np.argmax(row)), seq[t + 1]
            if got != want:
                errors.append((i, t + 1 - len(p), want, got))
            lead = row[want]
            row[want] = -np.inf
            margin = min(margin, lead - row.max())
    out = {"target_errors": errors, "target_margin": float(margin), "draft_accuracy": None}
    if draft is not None:
        dl = draft.logits(ids[:, 1:], np.zeros((len(seqs), width - 1, 3 * target.config.hidden_size), np.float32))
        hits = total = 0
        for i, (p, s) in enumerate(pairs):
            seq = seqs[i]
            for t in range(len(p) - 1, len(seq) - 2):  # draft pair t holds seq[t + 1], predicts seq[t + 2]
                total += 1
                hits += int(np.argmax(dl[i, t])) == seq[t + 2]
        out["draft_accuracy"] = hits / total if total else 1.0
    return out
