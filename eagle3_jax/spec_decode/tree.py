"""Draft-tree topology.

A step verifies a tree of `num_draft_tokens` nodes per sequence. Node 0 is the root: the last
emitted token, not yet in the target cache. Nodes are ordered parents-before-children, so
`parents[i] < i`. A chain is the tree with `topk=1`.

Every node attends to exactly its true ancestors (itself included) among the tree nodes, plus the
committed prefix; `ancestor_mask` builds that relation and is used by the draft and the target.

The speculation settings (SpecConfig, AutoSpec, their written form) are in settings.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp




def ancestor_mask(parents: jax.Array) -> jax.Array:
    """parents [B, N] (parents[:, 0] ignored, parents[i] < i) -> bool [B, N, N], [b, i, j] = j is i or an ancestor."""
    b, n = parents.shape
    eye = jnp.eye(n, dtype=bool)
    anc = jnp.broadcast_to(eye, (b, n, n))
    for i in range(1, n):  # parents precede children, so row parents[i] is final when row i is built
        par_row = jnp.take_along_axis(anc, parents[:, i][:, None, None], axis=1)[:, 0]
        anc = anc.at[:, i].set(par_row | eye[i])
    return anc


def depths(anc: jax.Array) -> jax.Array:
    """Depth of each node (root 0) from the ancestor mask."""
    return anc.sum(-1).astype(jnp.int32) - 1


def path_to(anc: jax.Array, depth: jax.Array, node: jax.Array, length: int) -> jax.Array:
    """Tree indices of the root-to-`node` path, [B, length]; entries past node's depth repeat `node`."""
    on_path = jnp.take_along_axis(anc, node[:, None, None], axis=1)[:, 0]  # [B, N]
    d = jnp.arange(length, dtype=jnp.int32)
    hit = on_path[:, None, :] & (depth[:, None, :] == d[None, :, None])  # [B, length, N]
    idx = jnp.argmax(hit, axis=-1).astype(jnp.int32)
    return jnp.where(hit.any(-1), idx, node[:, None])
