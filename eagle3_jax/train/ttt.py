"""EAGLE-3 training-time test (TTT): unroll the draft K steps on its own outputs.

Step 0 is the inference-time extend: draft position t pairs the target feature f_t with the token
x_{t+1} and predicts x_{t+2}. Step k >= 1 replays what the draft does k levels deep in a tree:
at origin t its hidden input is its own step-(k-1) output, its token input the teacher-forced
x_{t+k+1}, its rotary position t + k, and it attends to the step-0 pairs at positions <= t plus
its own predecessors (steps 1..k) at the same origin: exactly a depth-k node's ancestors. Llama
(GQA) and MLA drafts unroll alike; MLA attends over keys and values expanded from its latents.

Loss = sum_k 0.8^k * soft cross-entropy against the target's distribution at position t+k+1
restricted to (and renormalised over) the draft vocabulary, on response tokens only, and masked
where the target's argmax falls outside the draft vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config.model import ModelConfig
from ..models.attention import gqa_project, mla_project, mla_up_projections
from ..models.draft import DraftConfig, project_features
from ..models.layers import rms_norm, swiglu
from ..weights.quant import PRECISION

_NEG = -1e30


def _shift(x: jax.Array, k: int, fill=0) -> jax.Array:
    """x[:, t + k] at index t (fill past the end)."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def _heads(p: dict, lc: ModelConfig, x: jax.Array, positions: jax.Array
           ) -> tuple[jax.Array, jax.Array, jax.Array, float]:
    """Roped q [B,T,nh,dq], k [B,T,nkv,dq], v [B,T,nkv,dv] of a layer input, and the softmax scale.

    MLA layers run the target's projections (attention.mla_project) and expand the latent into
    per-head keys and values: training sees every pair at once, so the expanded form is the cheap one."""
    if lc.attention != "mla":
        q, k, v = gqa_project(p, lc, x, positions)
        return q, k, v, lc.head_dim ** -0.5
    q_nope, q_pe, c_kv, k_pe = mla_project(p, lc, x, positions)
    w_uk, w_uv = mla_up_projections(p, lc, x.dtype)
    k_nope = jnp.einsum("btr,rhd->bthd", c_kv, w_uk, precision=PRECISION)
    k_rope = jnp.broadcast_to(k_pe[:, :, None, :], k_nope.shape[:3] + k_pe.shape[-1:])  # shared by all heads
    q = jnp.concatenate([q_nope, q_pe], axis=-1)
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    return q, k, jnp.einsum("btr,rhd->bthd", c_kv, w_uv, precision=PRECISION), lc.softmax_scale


def _ttt_attention(q, k0, v0, diag_k, diag_v, scale: float, window: int | None = None) -> jax.Array:
    """q [B,T,nh,dq]; step-0 keys [B,T,nkv,dq] and values [B,T,nkv,dv] (causal); diag_* lists of
    the same shapes (same origin only). Returns [B,T,nh*dv]. `window`: a sliding-window layer's
    width; the query at origin t of step k (position t + k) sees step-0 pairs from t + k - window + 1
    on (its own steps at that origin are the window's last ones)."""
    b, t, nh, d = q.shape
    nkv, dv = k0.shape[2], v0.shape[-1]
    qg = q.reshape(b, t, nkv, nh // nkv, d)
    s0 = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32, precision=PRECISION) * scale
    causal = jnp.tril(jnp.ones((t, t), bool))
    if window is not None:
        origin, key = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
        causal = causal & (key > origin + len(diag_k) - window)
    s0 = jnp.where(causal, s0, _NEG)
    step = len(diag_k)  # this query's step; diagonal j is its step-j predecessor (position t + j)
    diag = [jnp.einsum("btkgd,btkd->bkgt", qg, kj, preferred_element_type=jnp.float32, precision=PRECISION)[..., None]
            * scale if window is None or j + 1 > step - window else jnp.full(s0.shape[:-1] + (1,), _NEG, jnp.float32)
            for j, kj in enumerate(diag_k)]
    probs = jax.nn.softmax(jnp.concatenate([s0] + diag, axis=-1), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t].astype(v0.dtype), v0, precision=PRECISION)
    for j, vj in enumerate(diag_v):
        out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., t + j].astype(vj.dtype), vj, precision=PRECISION)
    return out.reshape(b, t, nh * dv)


def ttt_unroll(params: dict, cfg: DraftConfig, aux: jax.Array, tokens: jax.Array, num_steps: int) -> list[jax.Array]:
    """Draft logits [B, T, Vd] (float32) for steps 0..num_steps-1 at every origin t."""
    lc = cfg.layers
    b, t = tokens.shape
    hidden = project_features(params, cfg, aux)
    cache_k: list[list[jax.Array]] = [[] for _ in params["layers"]]  # per layer: step 0, then diagonal steps
    cache_v: list[list[jax.Array]] = [[] for _ in params["layers"]]
    outs = []
    for step in range(num_steps):
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + step, (b, t))
        embeds = params["embed"][_shift(tokens, step + 1)]
        p0 = params["layers"][0]
        normed = rms_norm(hidden, p0["hidden_norm"], lc.rms_norm_eps)
        residual = normed if cfg.norm_before_residual else hidden
        x = jnp.concatenate([rms_norm(embeds, p0["attn_norm"], lc.rms_norm_eps), normed], axis=-1)
        for layer, p in enumerate(params["layers"]):
            if layer > 0:
                x = rms_norm(residual, p["attn_norm"], lc.rms_norm_eps)
            q, k, v, scale = _heads(p, lc, x, positions)
            cache_k[layer].append(k)
            cache_v[layer].append(v)
            attn = _ttt_attention(q, cache_k[layer][0], cache_v[layer][0], cache_k[layer][1:], cache_v[layer][1:], scale,
                                  cfg.window(layer))
            h = residual + jnp.matmul(attn, p["o_proj"], precision=PRECISION)
            residual = h + swiglu(rms_norm(h, p["mlp_norm"], lc.rms_norm_eps), p["gate_proj"], p["up_proj"], p["down_proj"])
        normed_out = rms_norm(residual, params["final_norm"], lc.rms_norm_eps)
        hidden = normed_out if cfg.norm_output else residual  # what the next step reads, as in draft_forward
        outs.append(jnp.dot(normed_out, params["lm_head"], preferred_element_type=jnp.float32, precision=PRECISION))
    return outs


def simulated_chain_tau(correct: list[jax.Array], valid: list[jax.Array], depth: int) -> jax.Array:
    """Mean acceptance length of a greedy `depth`-step chain walked along each sequence.

    correct[k][b, t]: the step-k proposal at origin t is the target's argmax; valid likewise.
    Like the engine, a verify at origin t accepts the leading correct steps (run), emits run + 1
    tokens and continues at origin t + run + 1; origins without a full valid chain are skipped.
    """
    run = jnp.zeros(correct[0].shape, jnp.int32)
    alive = jnp.ones(correct[0].shape, bool)
    for k in range(depth):
        alive &= correct[k]
        run += alive
    ok = valid[depth - 1]

    def visit(carry, xs):
        nxt, total, count = carry
        t, run_t, ok_t = xs
        here = t == nxt
        take = here & ok_t
        nxt = jnp.where(take, t + run_t + 1, jnp.where(here, t + 1, nxt))
        return (nxt, total + jnp.where(take, run_t + 1, 0), count + take), None

    b, t = run.shape
    zeros = jnp.zeros((b,), jnp.int32)
    (_, total, count), _ = jax.lax.scan(visit, (zeros, zeros, zeros),
                                        (jnp.arange(t, dtype=jnp.int32), run.T, ok.T))
    return jnp.sum(total) / jnp.maximum(jnp.sum(count), 1)


def ttt_loss(params: dict, cfg: DraftConfig, batch: dict, t2d: jax.Array, draft_ids: jax.Array, num_steps: int,
             decay: float = 0.8, sim_steps: int = 3) -> tuple[jax.Array, dict]:
    """Weighted TTT loss and metrics for a batch.

    batch: tokens [B,T] int, loss_mask [B,T] bool (True where the token is a response token to
    predict), aux [B,T,3Ht], teacher_logits [B,T,Vd] (target logits restricted to the draft
    vocabulary), teacher_argmax [B,T] (target-vocab argmax). t2d [V] bool, draft_ids [Vd].
    Metrics: per-step loss and top-1 accuracy, and `sim_tau`: the acceptance length (bonus
    included) a greedy `sim_steps`-step chain would get walking these sequences.
    """
    logits = ttt_unroll(params, cfg, batch["aux"], batch["tokens"], num_steps)
    in_vocab = t2d[batch["teacher_argmax"]]
    total = jnp.float32(0.0)
    metrics: dict = {}
    correct_steps, valid_steps = [], []
    for k, lg in enumerate(logits):
        teacher = _shift(batch["teacher_logits"], k + 1)
        mask = _shift(batch["loss_mask"], k + 2, False) & _shift(in_vocab, k + 1, False)
        target_p = jax.nn.softmax(teacher.astype(jnp.float32), axis=-1)
        ce = -jnp.sum(target_p * jax.nn.log_softmax(lg, axis=-1), axis=-1)
        count = jnp.maximum(mask.sum(), 1)
        loss_k = jnp.sum(jnp.where(mask, ce, 0.0)) / count
        total = total + (decay ** k) * loss_k
        pred = draft_ids[jnp.argmax(lg, axis=-1)]
        correct = pred == _shift(batch["teacher_argmax"], k + 1)
        metrics[f"loss_{k}"] = loss_k
        metrics[f"acc_{k}"] = jnp.sum(correct & mask) / count
        correct_steps.append(correct)
        valid_steps.append(mask)
    metrics["sim_tau"] = simulated_chain_tau(correct_steps, valid_steps, min(sim_steps, num_steps))
    metrics["loss"] = total
    return total, metrics
