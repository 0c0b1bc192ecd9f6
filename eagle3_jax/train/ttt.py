"""EAGLE-3 training-time test (TTT): unroll the draft K steps on its own outputs.

Step 0 is the inference-time extend: draft position t pairs the target feature f_t with the token
x_{t+1} and predicts x_{t+2}. Step k >= 1 replays what the draft does k levels deep in a tree:
at origin t its hidden input is its own step-(k-1) output, its token input the teacher-forced
x_{t+k+1}, its rotary position t + k, and it attends to the step-0 pairs at positions <= t plus
its own predecessors (steps 1..k) at the same origin: exactly a depth-k node's ancestors. Llama
(GQA) and MLA drafts unroll alike; MLA attends over keys and values expanded from its latents.

A row may hold several sequences (data.pack, `positions` counting from 0 in each): an origin
attends only to its own sequence's pairs, its rotary position counts from its sequence's start,
and no loss reaches across a sequence's end.

Loss = sum_k 0.8^k * soft cross-entropy against the target's distribution at position t+k+1
restricted to (and renormalised over) the draft vocabulary, on response tokens only, and masked
where the target's argmax falls outside the draft vocabulary.

Memory is linear in the sequence: step 0's causal attention runs over blocks of queries (each
block's scores against every key, recomputed in the backward pass), every TTT step is
rematerialised, and the cross-entropy runs over chunks of positions, so neither the T x T scores
nor the draft's logits over the whole sequence ever exist at once (`TTTMemory`). With `context`
the sequence is split over a mesh axis (context parallelism): every position's work stays on its
device except step 0's keys and values, which are all-gathered (only step 0 attends across the
sequence), and the few rows the shifts read from the neighbouring shards.
"""


from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from ..config.model import ModelConfig
from ..models.attention import gqa_project, mla_project, mla_up_projections
from ..models.draft import DraftConfig, project_features
from ..models.layers import rms_norm, swiglu
from ..weights.quant import PRECISION

_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class TTTMemory:
    """How the unroll bounds its memory: step 0's attention over blocks of `query_block` queries and
    `key_block` keys, the cross-entropy over chunks of `loss_chunk` positions (None: all at once),
    each TTT step rematerialised in the backward pass when `remat`. `TTTMemory.whole()` holds everything at once
    (quadratic in the sequence: the reference the bounded form is measured against)."""

    query_block: int | None = 512
    key_block: int | None = 512
    loss_chunk: int | None = 512
    remat: bool = True

    def __post_init__(self) -> None:
        for name in ("query_block", "key_block", "loss_chunk"):
            size = getattr(self, name)
            if size is not None and size < 1:
                raise ValueError(f"TTTMemory.{name} must be a positive number of positions (or None), got {size}")

    @classmethod
    def whole(cls) -> "TTTMemory":
        return cls(query_block=None, key_block=None, loss_chunk=None, remat=False)


@dataclasses.dataclass(frozen=True)
class _Span:
    """The positions this device holds: the whole sequence, or (`axis`) its shard of a sequence split
    in `shards` equal parts over that mesh axis, inside a shard_map."""

    axis: str | None = None
    shards: int = 1

    def offset(self, length: int) -> jax.Array | int:
        """The global position of this shard's first one (each shard holds `length`)."""
        return 0 if self.axis is None else lax.axis_index(self.axis) * length

    def gather(self, x: jax.Array) -> jax.Array:
        """[B, local, ...] -> [B, whole sequence, ...]."""
        return x if self.axis is None else lax.all_gather(x, self.axis, axis=1, tiled=True)

    def following(self, x: jax.Array, n: int) -> jax.Array:
        """The next shard's first n rows [B, n, ...] (zeros past the sequence's end)."""
        if self.axis is None:
            return jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
        return lax.ppermute(x[:, :n], self.axis, [(i + 1, i) for i in range(self.shards - 1)])

    def preceding(self, x: jax.Array, n: int) -> jax.Array:
        """The previous shard's last n rows [B, n, ...] (zeros before the sequence's start)."""
        if self.axis is None:
            return jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
        return lax.ppermute(x[:, x.shape[1] - n:], self.axis, [(i, i + 1) for i in range(self.shards - 1)])

    def total(self, x: jax.Array) -> jax.Array:
        """A sum over the shards."""
        return x if self.axis is None else lax.psum(x, self.axis)


def _blockwise(fn: Callable[[jax.Array], object], total: int, size: int | None):
    """fn(start) over windows of `size` positions covering [0, total) (the last pulled back to end at
    `total`), each returning [B, size, ...] arrays, assembled to [B, total, ...]. Each window is
    recomputed in the backward pass, so one window's intermediates are live at a time. One window
    (size None or >= total): fn(0) as it is."""
    if size is None or size >= total:
        return fn(0)
    n = -(-total // size)
    starts = jnp.asarray([min(i * size, total - size) for i in range(n)], jnp.int32)
    repeated = n * size - total  # the last window's leading positions, the window before already has them

    def assemble(x):  # [n, B, size, ...] -> [B, total, ...]
        x = jnp.moveaxis(x, 0, 1)
        x = x.reshape((x.shape[0], n * size) + x.shape[3:])
        return x if not repeated else jnp.concatenate([x[:, :(n - 1) * size], x[:, (n - 1) * size + repeated:]], axis=1)

    return jax.tree.map(assemble, lax.map(jax.checkpoint(fn), starts))


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


def _step0_attention(qg: jax.Array, k0: jax.Array, v0: jax.Array, origin: jax.Array, seq_start: jax.Array, step: int,
                     window: int | None, scale: float, key_block: int | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A query block's attention to the step-0 pairs it sees, unnormalised, over blocks of `key_block`
    keys (online softmax; blocks no query sees are skipped): (row max m [B,nkv,g,t], row sum l
    [B,nkv,g,t], output sum [B,t,nkv,g,dv] float32). qg [B,t,nkv,g,dq] at global origins `origin` [t],
    each seeing no key below its sequence's first, `seq_start` [B,t]."""
    b, t, nkv, g, _ = qg.shape
    length, dv = k0.shape[1], v0.shape[-1]
    size = min(key_block or length, length)
    n = -(-length // size)

    def visible_keys(first: jax.Array, keys: jax.Array) -> jax.Array:  # [B, t, size]
        seen = (keys[None, :] <= origin[:, None]) & (keys[None, :] >= first)  # `first`: the last block's fresh keys
        if window is not None:
            seen &= keys[None, :] > origin[:, None] + step - window
        return seen[None] & (keys[None, None, :] >= seq_start[:, :, None])

    def attend(carry, starts):
        first, start = starts[0], starts[1]
        keys = start + jnp.arange(size)
        visible = visible_keys(first, keys)[:, None, None]  # [B, 1, 1, t, size], as the scores

        def update(carry):
            m, l, acc = carry
            kb, vb = (lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in (k0, v0))
            s = jnp.einsum("btkgd,bskd->bkgts", qg, kb, preferred_element_type=jnp.float32, precision=PRECISION) * scale
            m_new = jnp.maximum(m, jnp.max(jnp.where(visible, s, _NEG), axis=-1))
            # a row that sees none of this block has m_new = _NEG: exp only of what it sees (else inf * 0 in the grads)
            p = jnp.where(visible, jnp.exp(jnp.where(visible, s - m_new[..., None], 0.0)), 0.0)
            fade = jnp.exp(m - m_new)
            acc = acc * jnp.moveaxis(fade, -1, 1)[..., None] + jnp.einsum(
                "bkgts,bskd->btkgd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32, precision=PRECISION)
            return m_new, l * fade + jnp.sum(p, axis=-1), acc

        return lax.cond(jnp.any(visible), update, lambda c: c, carry), None

    rows = jnp.zeros_like(jnp.moveaxis(qg[..., 0], 1, -1), jnp.float32)  # as the queries vary over a shard_map's axes
    carry = (rows + _NEG, rows, jnp.zeros_like(qg[..., :1], jnp.float32) * jnp.zeros((dv,), jnp.float32))
    starts = jnp.asarray([(i * size, min(i * size, length - size)) for i in range(n)], jnp.int32)
    (m, l, acc), _ = lax.scan(jax.checkpoint(attend), carry, starts)
    return m, l, acc


def _ttt_attention(q, k0, v0, diag_k, diag_v, scale: float, window: int | None, *, offset, seq_start,
                   query_block: int | None = None, key_block: int | None = None) -> jax.Array:
    """q [B,T,nh,dq] of the origins at global positions offset.. offset+T; step-0 keys [B,S,nkv,dq] and
    values [B,S,nkv,dv] of the whole row (causal, each origin seeing none below its sequence's first
    key, `seq_start` [B,T]); diag_* lists of q's length (same origin only). Returns
    [B,T,nh*dv], over blocks of `query_block` queries and `key_block` keys.
    `window`: a sliding-window layer's width; the query at origin t of step k (position t + k) sees
    step-0 pairs from t + k - window + 1 on (its own steps at that origin are the window's last ones)."""
    b, t, nh, d = q.shape
    nkv = k0.shape[2]
    step = len(diag_k)  # this query's step; diagonal j is its step-(j+1) predecessor (position t + j + 1)
    diag_seen = [window is None or j + 1 > step - window for j in range(step)]

    def block(start):
        size = min(query_block or t, t)
        rows = lambda x: lax.dynamic_slice_in_dim(x, start, size, axis=1)  # noqa: E731
        qg = rows(q).reshape(b, size, nkv, nh // nkv, d)
        m, l, acc = _step0_attention(qg, k0, v0, offset + start + jnp.arange(size), rows(seq_start), step, window, scale,
                                     key_block)
        diag = [jnp.einsum("btkgd,btkd->bkgt", qg, rows(kj), preferred_element_type=jnp.float32, precision=PRECISION)
                * scale for kj, seen in zip(diag_k, diag_seen) if seen]
        top = functools.reduce(jnp.maximum, diag, m)
        fade = jnp.exp(m - top)
        total = l * fade + sum(jnp.exp(s - top) for s in diag)
        out = acc * jnp.moveaxis(fade, -1, 1)[..., None]
        for s, vj in zip(diag, (vj for vj, seen in zip(diag_v, diag_seen) if seen)):
            out = out + jnp.moveaxis(jnp.exp(s - top), -1, 1)[..., None] * rows(vj).astype(jnp.float32)[:, :, :, None]
        out = out / jnp.moveaxis(total, -1, 1)[..., None]
        return out.astype(v0.dtype).reshape(b, size, -1)

    return _blockwise(block, t, query_block)


def _ttt_step(params: dict, hidden: jax.Array, embeds: jax.Array, offset, positions: jax.Array, keys: list,
              values: list, *, cfg: DraftConfig, step: int, span: _Span, memory: TTTMemory):
    """One TTT step through every draft layer: (final-norm output, the hidden the next step reads, this
    step's keys and values per layer). positions [B, T]: each origin's in its own sequence. keys /
    values: per layer, the earlier steps' (step 0's over the whole row, the later ones this shard's)."""
    lc = cfg.layers
    b, t = embeds.shape[:2]
    seq_start = offset + jnp.arange(t, dtype=jnp.int32)[None, :] - positions  # each origin's sequence's first key
    positions = positions + step
    p0 = params["layers"][0]
    normed = rms_norm(hidden, p0["hidden_norm"], lc.rms_norm_eps)
    residual = normed if cfg.norm_before_residual else hidden
    x = jnp.concatenate([rms_norm(embeds, p0["attn_norm"], lc.rms_norm_eps), normed], axis=-1)
    new_k, new_v = [], []
    for layer, p in enumerate(params["layers"]):
        if layer > 0:
            x = rms_norm(residual, p["attn_norm"], lc.rms_norm_eps)
        q, k, v, scale = _heads(p, lc, x, positions)
        if step == 0:  # the one attention across the sequence: every shard needs every key
            k, v = span.gather(k), span.gather(v)
        new_k.append(k)
        new_v.append(v)
        k_all, v_all = keys[layer] + [k], values[layer] + [v]
        attn = _ttt_attention(q, k_all[0], v_all[0], k_all[1:], v_all[1:], scale, cfg.window(layer), offset=offset,
                              seq_start=seq_start, query_block=memory.query_block, key_block=memory.key_block)
        h = residual + jnp.matmul(attn, p["o_proj"], precision=PRECISION)
        residual = h + swiglu(rms_norm(h, p["mlp_norm"], lc.rms_norm_eps), p["gate_proj"], p["up_proj"], p["down_proj"])
    normed_out = rms_norm(residual, params["final_norm"], lc.rms_norm_eps)
    return normed_out, (normed_out if cfg.norm_output else residual), new_k, new_v  # as draft_forward hands on


def _positions(tokens: jax.Array, positions: jax.Array | None, span: _Span) -> jax.Array:
    """Each token's position in its own sequence [B, T]: `positions` of packed rows, else (one
    sequence per row) its global index."""
    if positions is not None:
        return positions.astype(jnp.int32)
    t = tokens.shape[1]
    return jnp.broadcast_to(span.offset(t) + jnp.arange(t, dtype=jnp.int32), tokens.shape)


def ttt_states(params: dict, cfg: DraftConfig, aux: jax.Array, tokens: jax.Array, num_steps: int, *,
               positions: jax.Array | None = None, memory: TTTMemory = TTTMemory(),
               span: _Span = _Span()) -> list[jax.Array]:
    """The final-norm output [B, T, H] of steps 0..num_steps-1 at every origin (their logits: @ lm_head).
    positions [B, T]: of sequences packed in rows (data.pack; None: one per row); an origin attends
    only to its own sequence."""
    b, t = tokens.shape
    offset = span.offset(t)
    positions = _positions(tokens, positions, span)
    tokens_ahead = jnp.concatenate([tokens, span.following(tokens, num_steps)], axis=1)
    hidden = project_features(params, cfg, aux)
    keys: list[list[jax.Array]] = [[] for _ in params["layers"]]  # per layer: step 0, then diagonal steps
    values: list[list[jax.Array]] = [[] for _ in params["layers"]]
    states = []
    for step in range(num_steps):
        run = functools.partial(_ttt_step, cfg=cfg, step=step, span=span, memory=memory)
        if memory.remat:
            run = jax.checkpoint(run)
        embeds = params["embed"][tokens_ahead[:, step + 1: step + 1 + t]]
        normed, hidden, new_k, new_v = run(params, hidden, embeds, offset, positions, keys, values)
        for layer in range(len(keys)):
            keys[layer].append(new_k[layer])
            values[layer].append(new_v[layer])
        states.append(normed)
    return states


def ttt_unroll(params: dict, cfg: DraftConfig, aux: jax.Array, tokens: jax.Array, num_steps: int, *,
               positions: jax.Array | None = None, memory: TTTMemory = TTTMemory()) -> list[jax.Array]:
    """Draft logits [B, T, Vd] (float32) for steps 0..num_steps-1 at every origin t."""
    return [jnp.dot(s, params["lm_head"], preferred_element_type=jnp.float32, precision=PRECISION)
            for s in ttt_states(params, cfg, aux, tokens, num_steps, positions=positions, memory=memory)]


def _soft_cross_entropy(states: jax.Array, teacher: jax.Array, lm_head: jax.Array, chunk: int | None,
                        teacher_head: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per position: the cross-entropy [B, T] of the draft's distribution (states @ lm_head) against the
    teacher's softmax, and the draft's argmax [B, T] (a draft-vocabulary id); over chunks of `chunk`
    positions, so neither side's logits are ever whole. `teacher`: its logits [B, T, Vd], or with
    `teacher_head` [H, Vd] its hidden state [B, T, H], the logits made per chunk as the target makes them."""
    def chunk_of(start):
        size = min(chunk or states.shape[1], states.shape[1])
        h = lax.dynamic_slice_in_dim(states, start, size, axis=1)
        logits = jnp.dot(h, lm_head, preferred_element_type=jnp.float32, precision=PRECISION)
        seen = lax.dynamic_slice_in_dim(teacher, start, size, axis=1)
        if teacher_head is not None:
            seen = jnp.dot(seen, teacher_head, preferred_element_type=jnp.float32, precision=PRECISION)
        target_p = jax.nn.softmax(seen.astype(jnp.float32), axis=-1)
        return -jnp.sum(target_p * jax.nn.log_softmax(logits, axis=-1), axis=-1), jnp.argmax(logits, axis=-1)

    return _blockwise(chunk_of, states.shape[1], chunk)


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


def check_context_split(length: int, shards: int, num_steps: int) -> None:
    """A ValueError naming the fix unless a sequence of `length` positions splits in `shards` equal
    shards of at least num_steps + 1 (the rows a shard's shifts read from the next shard)."""
    if length % shards or length // shards < num_steps + 1:
        raise ValueError(f"sequences of {length} positions do not split in {shards} equal shards of at least "
                         f"{num_steps + 1} (the TTT depth + 1): pad them to a multiple of {shards} or use fewer shards")


def ttt_loss(params: dict, cfg: DraftConfig, batch: dict, t2d: jax.Array, draft_ids: jax.Array, num_steps: int,
             decay: float = 0.8, sim_steps: int = 3, *, memory: TTTMemory = TTTMemory(),
             context: tuple[Mesh, str] | None = None) -> tuple[jax.Array, dict]:
    """Weighted TTT loss and metrics for a batch.

    batch: tokens [B,T] int, loss_mask [B,T] bool (True where the token is a response token to
    predict), optionally positions [B,T] (sequences packed in rows: data.pack), aux [B,T,3Ht], teacher_hidden
    [B,T,Ht] (the target's final-norm output; `params["teacher_head"]` [Ht,Vd] makes the logits) or
    teacher_logits [B,T,Vd] (target logits restricted to the draft
    vocabulary), teacher_argmax [B,T] (target-vocab argmax). t2d [V] bool, draft_ids [Vd].
    Metrics: per-step loss and top-1 accuracy, and `sim_tau`: the acceptance length (bonus
    included) a greedy `sim_steps`-step chain would get walking these sequences.
    context (mesh, axis): the sequence split over that mesh axis (each shard at least num_steps + 1
    positions); the batch arrays' second axis is sharded over it.
    """
    local = functools.partial(_local_loss, cfg=cfg, num_steps=num_steps, decay=decay, memory=memory)
    if context is None:
        total, metrics, correct, valid = local(params, batch, t2d, draft_ids, span=_Span())
    else:
        mesh, axis = context
        shards = mesh.shape[axis]
        check_context_split(batch["tokens"].shape[1], shards, num_steps)
        whole, split = PartitionSpec(), PartitionSpec(None, axis)
        total, metrics, correct, valid = jax.shard_map(
            functools.partial(local, span=_Span(axis, shards)), mesh=mesh,
            in_specs=(whole, {k: split for k in batch}, whole, whole),
            out_specs=(whole, whole, split, split))(params, batch, t2d, draft_ids)
    # per step, back to origins t (the proposal at t is scored at u = t + k + 1)
    correct = [_shift(c, k + 1, False) for k, c in enumerate(correct)]
    valid = [_shift(v, k + 1, False) for k, v in enumerate(valid)]
    metrics = dict(metrics, sim_tau=simulated_chain_tau(correct, valid, min(sim_steps, num_steps)), loss=total)
    return total, metrics


def _teacher(params: dict, batch: dict) -> tuple[jax.Array, jax.Array | None]:
    """The teacher as the batch gives it: its hidden state with the params' `teacher_head`
    (data.teacher_batch), or its logits over the draft vocabulary."""
    if "teacher_hidden" in batch:
        if "teacher_head" not in params:
            raise ValueError("a batch of teacher_hidden needs the target's head at the draft ids as params['teacher_head'] "
                             "(data.teacher_head)")
        return batch["teacher_hidden"], params["teacher_head"]
    return batch["teacher_logits"], None


def _local_loss(params: dict, batch: dict, t2d: jax.Array, draft_ids: jax.Array, *, cfg: DraftConfig, num_steps: int,
                decay: float, memory: TTTMemory, span: _Span) -> tuple[jax.Array, dict, list, list]:
    """ttt_loss over the positions `span` holds, summed over the shards: (loss, per-step metrics, and
    per step whether the proposal scored at each u was right and counts).

    Step k's proposal at origin t is scored against the teacher at u = t + k + 1; the loss runs in u's
    coordinates (the draft states delayed by k + 1, cheap) so the teacher's [T, Vd] logits are never
    shifted or copied."""
    tokens, argmax = batch["tokens"], batch["teacher_argmax"]
    t = tokens.shape[1]
    teacher, teacher_head = _teacher(params, batch)
    position = _positions(tokens, batch.get("positions"), span)
    states = ttt_states(params, cfg, batch["aux"], tokens, num_steps, positions=position, memory=memory, span=span)
    ahead = lambda x: jnp.concatenate([x[:, 1:], span.following(x, 1)], axis=1)  # noqa: E731 (x at u + 1)
    # u's next token is a response token of u's own sequence, u's argmax is in the draft vocabulary
    to_learn = ahead(batch["loss_mask"]) & (ahead(position) == position + 1) & t2d[argmax]
    total = jnp.float32(0.0)
    metrics: dict = {}
    correct_steps, valid_steps = [], []
    for k, state in enumerate(states):
        delayed = jnp.concatenate([span.preceding(state, k + 1), state], axis=1)[:, :t]  # origin u - k - 1's at u
        ce, pred = _soft_cross_entropy(delayed, teacher, params["lm_head"], memory.loss_chunk, teacher_head)
        mask = to_learn & (position >= k + 1)  # the origin u - k - 1 is in u's sequence
        correct = draft_ids[pred] == argmax
        count = jnp.maximum(span.total(mask.sum()), 1)
        loss_k = span.total(jnp.sum(jnp.where(mask, ce, 0.0))) / count
        total = total + (decay ** k) * loss_k
        metrics[f"loss_{k}"] = loss_k
        metrics[f"acc_{k}"] = span.total(jnp.sum(correct & mask)) / count
        correct_steps.append(correct)
        valid_steps.append(mask)
    return total, metrics, correct_steps, valid_steps
