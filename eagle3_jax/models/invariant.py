"""Batch-invariant numerics: a token's logits do not depend on the pass it runs in.

In the default numerics XLA picks each op's kernel, and so its order of floating-point additions,
from the op's whole shape. A matmul over the 1 row of a decode step and over the 4 or 16 rows of
a verify pass round differently in the last bit, and in bfloat16 that is enough to flip the
argmax where the two best logits nearly tie: greedy speculative output then drifts from greedy
plain decoding. With `load_target(..., batch_invariant=True)` the target computes every token the
same way, whatever shares its pass:

- Row-local work (norms, projections, rotary, MLP or MoE, the LM head) runs one fixed block of
  ROW_BLOCK rows at a time (`map_rows`, rows padded to a whole block): every block is the same
  program on the same shapes, and nothing in it mixes rows, so a row's result depends on the row
  alone. Routed experts run per assignment on gathered weights (sorting by expert would make a
  row's grouping depend on its neighbours).
- Attention runs per block of ROW_BLOCK queries, each over its own sequence's keys in *logical
  position order* (a tree's ancestors are gathered from their scratch slots to the positions they
  will have once accepted), in chunks of KEY_CHUNK positions folded by an online softmax. A chunk a
  query cannot see leaves its running max, sum and output bit-for-bit unchanged, so neither the
  cache's length, nor the block table's width, nor whether the keys were committed or are still in
  the verify window changes a result.

Activations and all arithmetic are float32 here, whatever the load dtype (weights and the KV
cache keep it): XLA computes bfloat16 elementwise ops in float32 and may keep or drop the rounding
to bfloat16 between two fused ops (excess precision), and which it does depends on how the rest
of the program fused, so a bfloat16 intermediate is not a fixed function of its inputs. The only
roundings left are the K/V written to the cache, which go through memory in every program alike.
MLA always uses its absorbed form here (prefill too), so prefill, decode and verify share one path.
The guarantee is per compiled backend and device: a token's logits are bitwise equal across batch
sizes, tokens per row, dense or paged caches and cache lengths, hence greedy speculation (chain or
tree) emits exactly greedy plain decoding's tokens. It does not make two different backends, or a
different mesh, agree. The cost is speed: blocks run one after another (see benchmarks/README.md).
The draft keeps the default numerics: it only proposes, and the target alone decides every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..cache import kv_cache
from ..config.model import ModelConfig
from ..weights.quant import PRECISION, linear
from .attention import gqa_project, mla_project, mla_up_projections
from .layers import final_logits as head_logits
from .layers import rms_norm, swiglu
from .moe import gathered_experts, route

ROW_BLOCK = 8  # rows per fixed-shape block of row-local work, and queries per attention block
KEY_CHUNK = 128  # logical positions per online-softmax chunk
_NEG = -1e30  # finite: a fully hidden chunk gives exp(_NEG - max) == 0 and a max that does not move


def map_rows(fn, *rows: jax.Array):
    """fn over fixed blocks of ROW_BLOCK rows of `rows` (each [M, ...]); returns fn's pytree [M, ...].

    Rows are padded with zeros to a whole number of blocks; the blocks run one after another as
    the same program, so the result of a row never depends on M or on the other rows."""
    m = rows[0].shape[0]
    nb = -(-m // ROW_BLOCK)

    def blocks(a):
        a = jnp.pad(a, [(0, nb * ROW_BLOCK - m)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape((nb, ROW_BLOCK) + a.shape[1:])

    out = jax.lax.map(lambda block: fn(*block), tuple(blocks(a) for a in rows))
    return jax.tree.map(lambda a: a.reshape((nb * ROW_BLOCK,) + a.shape[2:])[:m], out)


# ---- attention in logical position order ------------------------------------------------------------


def ancestor_slots(lengths: jax.Array, tree_mask: jax.Array) -> jax.Array:
    """Cache slot of each new query's j-th visible new token: int [B, T, T].

    New token u of row b sits at slot lengths[b] + u; query t sees the new tokens u with
    tree_mask[b, t, u] (its ancestors and itself, listed root first), and the j-th of them will
    hold logical position lengths[b] + j once the path is accepted. Entries past the last visible
    one are never read."""
    order = jnp.argsort(~tree_mask, axis=-1, stable=True).astype(jnp.int32)  # visible ones first, by index
    return lengths[:, None, None] + order


def _logical_slots(pos: jax.Array, length: jax.Array, anc: jax.Array) -> jax.Array:
    """Slots [bm, c] holding logical positions pos [c] for queries with committed `length` [bm]
    and ancestor slots anc [bm, T]: the prefix is where it is, the rest comes from anc."""
    rel = pos[None, :] - length[:, None]
    from_window = jnp.take_along_axis(anc, jnp.clip(rel, 0, anc.shape[-1] - 1), axis=1)
    return jnp.where(rel < 0, pos[None, :], from_window)


def attend(queries: tuple[jax.Array, ...], keys: tuple[jax.Array, ...], values: jax.Array, row: jax.Array,
           position: jax.Array, length: jax.Array, anc: jax.Array, scale: float) -> jax.Array:
    """Attention of M queries, each over logical positions 0..position[i] of its own row.

    queries: parts [M, K, G, D_i] whose scores add (GQA: one part; MLA: latent and rope parts);
    keys: matching parts [B, S, K, D_i] and values [B, S, K, Dv], indexed by cache slot;
    row, position, length [M] and anc [M, T] (see ancestor_slots) per query. Returns float32
    [M, K, G, Dv]."""
    s = values.shape[1]
    num_chunks = -(-s // KEY_CHUNK)

    def block(q_parts, row, position, length, anc):
        bm, kh, g = q_parts[0].shape[:3]

        def chunk(carry, j):
            m_run, l_run, acc = carry
            pos = j * KEY_CHUNK + jnp.arange(KEY_CHUNK, dtype=jnp.int32)
            slots = jnp.clip(_logical_slots(pos, length, anc), 0, s - 1)
            visible = (pos[None, :] <= position[:, None]) & (pos[None, :] < s)
            rows = row[:, None]
            scores = sum(jnp.einsum("ikgd,ickd->ikgc", q, k[rows, slots], preferred_element_type=jnp.float32,
                                    precision=PRECISION)
                         for q, k in zip(q_parts, keys)) * scale
            scores = jnp.where(visible[:, None, None, :], scores, _NEG)
            m_new = jnp.maximum(m_run, scores.max(-1))
            alpha = jnp.exp(m_run - m_new)
            p = jnp.exp(scores - m_new[..., None])
            v = values[rows, slots]
            pv = jnp.einsum("ikgc,ickd->ikgd", p, v.astype(jnp.float32), preferred_element_type=jnp.float32,
                            precision=PRECISION)
            return (m_new, l_run * alpha + p.sum(-1), acc * alpha[..., None] + pv), None

        init = (jnp.full((bm, kh, g), _NEG, jnp.float32), jnp.zeros((bm, kh, g), jnp.float32),
                jnp.zeros((bm, kh, g, values.shape[-1]), jnp.float32))
        (_, l_run, acc), _ = jax.lax.scan(chunk, init, jnp.arange(num_chunks, dtype=jnp.int32))
        return acc / l_run[..., None]

    def per_block(*arrays):  # the query parts, then row, position, length, anc of ROW_BLOCK queries
        return block(arrays[:-4], *arrays[-4:])

    return map_rows(per_block, *queries, row, position, length, anc)


# ---- one decoder layer ---------------------------------------------------------------------------


def _query_rows(b: int, t: int, cache: kv_cache.KVCache, positions: jax.Array, anc: jax.Array):
    """Per-query row index, position, committed length and ancestor slots, flattened to [B * T]."""
    row = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    return row, positions.reshape(-1), cache.lengths[row], anc.reshape(b * t, -1)


def _mlp(p: dict, cfg: ModelConfig, kind: str, h: jax.Array) -> jax.Array:
    """MLP or routed experts (+ shared experts) of rows h [bm, H]."""
    if kind != "moe":
        return swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"])
    logits = jnp.dot(h.astype(jnp.float32), p["router"], preferred_element_type=jnp.float32, precision=PRECISION)
    weights, ids = route(logits, p.get("router_bias"), cfg)
    out = gathered_experts(h, weights, ids, p["experts_gate"], p["experts_up"], p["experts_down"]).astype(h.dtype)
    if "shared_gate" in p:
        out = out + swiglu(h, p["shared_gate"], p["shared_up"], p["shared_down"])
    return out


def layer(p: dict, cfg: ModelConfig, kind: str, x: jax.Array, positions: jax.Array, cache: kv_cache.KVCache,
          layer_index: jax.Array, anc: jax.Array) -> tuple[jax.Array, kv_cache.KVCache]:
    """One decoder layer over x [B, T, H] with batch-invariant numerics; K/V written as usual."""
    b, t, hidden = x.shape
    rows = x.reshape(b * t, hidden)
    row, position, length, anc_rows = _query_rows(b, t, cache, positions, anc)
    if cfg.attention == "mla":
        w_uk, w_uv = mla_up_projections(p, cfg, jnp.float32)  # once per layer, shared by every block

    def project(xr, pos):
        h = rms_norm(xr, p["attn_norm"], cfg.rms_norm_eps)[None]
        if cfg.attention == "mla":
            q_nope, q_pe, c_kv, k_pe = mla_project(p, cfg, h, pos[None])
            q_lat = jnp.einsum("bthd,rhd->bthr", q_nope, w_uk, precision=PRECISION)
            return q_lat[0][:, None], q_pe[0][:, None], c_kv[0], k_pe[0]
        q, k, v = gqa_project(p, cfg, h, pos[None])
        g = cfg.num_heads // cfg.num_kv_heads
        return q[0].reshape(xr.shape[0], cfg.num_kv_heads, g, cfg.head_dim), k[0], v[0]

    if cfg.attention == "mla":
        q_lat, q_pe, c_kv, k_pe = map_rows(project, rows, position)
        cache = kv_cache.write(cache, layer_index, c_kv.reshape(b, t, -1), k_pe.reshape(b, t, -1))
        latents, rope_keys = kv_cache.read(cache, layer_index)
        out = attend((q_lat, q_pe), (latents[:, :, None], rope_keys[:, :, None]), latents[:, :, None],
                     row, position, length, anc_rows, cfg.softmax_scale)[:, 0]  # [M, heads, r]
    else:
        q, k, v = map_rows(project, rows, position)
        cache = kv_cache.write(cache, layer_index, k.reshape((b, t) + k.shape[1:]), v.reshape((b, t) + v.shape[1:]))
        keys, vals = kv_cache.read(cache, layer_index)
        out = attend((q,), (keys,), vals, row, position, length, anc_rows, cfg.head_dim ** -0.5)

    def finish(xr, attn):
        if cfg.attention == "mla":
            attn = jnp.einsum("thr,rhd->thd", attn, w_uv, precision=PRECISION)
        xr = xr + linear(attn.reshape(xr.shape[0], -1), p["o_proj"])
        return xr + _mlp(p, cfg, kind, rms_norm(xr, p["mlp_norm"], cfg.rms_norm_eps))

    return map_rows(finish, rows, out).reshape(b, t, hidden), cache


def final_logits(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm + LM head per fixed row block: float32 [B, T, V]."""
    b, t, hidden = x.shape
    return map_rows(lambda xr: head_logits(params, cfg, xr), x.reshape(b * t, hidden)).reshape(b, t, -1)
