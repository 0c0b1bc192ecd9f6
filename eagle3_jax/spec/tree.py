"""Speculation shapes and draft-tree topology.

A step verifies a tree of `num_draft_tokens` nodes per sequence. Node 0 is the root: the last
emitted token, not yet in the target cache. Nodes are ordered parents-before-children, so
`parents[i] < i`. A chain is the tree with `topk=1`.

Every node attends to exactly its true ancestors (itself included) among the tree nodes, plus the
committed prefix; `ancestor_mask` builds that relation and is used by the draft and the target.

Speculation settings have one written form everywhere (scripts, tables, logs): `none`,
`chain:num_steps:topk:num_draft_tokens` (e.g. `chain:3:1:4`) or
`tree:num_steps:topk:num_draft_tokens` (e.g. `tree:5:4:16`); `SpecConfig.parse` reads it and
`SpecConfig.name` writes it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


NO_SPEC = "none"
AUTO = "auto"  # adaptive speculation: `auto` or `auto:max_chain_steps` (spec/adaptive.py)
DEFAULT_AUTO_STEPS = 3
# The grammar of a written setting, in one place: a keyword, then its integer fields.
SPEC_KINDS: dict[str, tuple[str, ...]] = {
    "chain": ("num_steps", "topk", "num_draft_tokens"),
    "tree": ("num_steps", "topk", "num_draft_tokens"),
}
SPEC_SYNTAX = ("none, chain:num_steps:topk:num_draft_tokens (e.g. chain:3:1:4), "
               "tree:num_steps:topk:num_draft_tokens (e.g. tree:5:4:16) or auto[:max_chain_steps] (adaptive)")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """EAGLE speculation shape.

    num_steps: draft levels per step (the tree's maximum depth).
    topk: children expanded per node (1 = chain).
    num_draft_tokens: tree nodes verified per step, root included (a chain has num_steps + 1).
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        for name in ("num_steps", "topk", "num_draft_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SpecConfig.{name} must be an integer >= 1; got {v!r}")
        if self.num_draft_tokens < 2:
            raise ValueError("SpecConfig.num_draft_tokens must be >= 2 (the root plus at least one draft token)")
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"a chain (topk=1) verifies num_steps + 1 tokens: use num_draft_tokens={self.num_steps + 1} "
                f"for num_steps={self.num_steps} (got {self.num_draft_tokens})"
            )
        if self.num_draft_tokens - 1 > self.pool_size:
            raise ValueError(
                f"num_draft_tokens={self.num_draft_tokens} exceeds the {self.pool_size} candidates that "
                f"num_steps={self.num_steps}, topk={self.topk} produce (+1 root); lower it or raise topk/num_steps"
            )

    @classmethod
    def auto(cls, num_steps: int = DEFAULT_AUTO_STEPS, trees: "tuple[SpecConfig, ...]" = (), **options):
        """Adaptive speculation (an `AutoSpec`, run by the Scheduler): each decode step picks no
        speculation, a chain of 1..num_steps draft tokens or one of `trees`, whichever promises the
        most output tokens per second (see spec/adaptive.py; `options` tune it)."""
        from .adaptive import AutoSpec

        return AutoSpec.chains(num_steps, trees, **options)

    @property
    def name(self) -> str:
        """The canonical written form, `chain:3:1:4` or `tree:5:4:16` (a tree with topk=1 is a chain)."""
        kind = "chain" if self.topk == 1 else "tree"
        return f"{kind}:{self.num_steps}:{self.topk}:{self.num_draft_tokens}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str):
        """A written setting -> its SpecConfig, an AutoSpec for `auto` / `auto:K` (no speculation
        or chains of up to K draft tokens, chosen per step), or None for `none` (plain decoding).

        Raises ValueError naming the expected syntax (SPEC_SYNTAX) on bad input.
        """
        keyword, *fields = text.strip().lower().split(":")
        if keyword == NO_SPEC and not fields:
            return None
        if keyword == AUTO and len(fields) <= 1:
            try:
                return cls.auto(int(fields[0]) if fields else DEFAULT_AUTO_STEPS)
            except ValueError:
                raise ValueError(f"speculation setting {text!r}: auto takes the longest chain to try, an "
                                 f"integer >= 1 (e.g. auto:3); expected {SPEC_SYNTAX}") from None
        if keyword not in SPEC_KINDS:
            raise ValueError(f"unknown speculation setting {text!r}; expected {SPEC_SYNTAX}")
        names = SPEC_KINDS[keyword]
        if len(fields) != len(names):
            raise ValueError(f"speculation setting {text!r} needs {len(names)} numbers after '{keyword}:' "
                             f"({':'.join(names)}); expected {SPEC_SYNTAX}")
        try:
            values = dict(zip(names, (int(f) for f in fields)))
        except ValueError:
            raise ValueError(f"speculation setting {text!r} has a non-integer field; expected {SPEC_SYNTAX}") from None
        if keyword == "chain" and values["topk"] != 1:
            raise ValueError(f"a chain has topk=1; got {text!r}. Use tree:{':'.join(fields)} for a tree")
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"speculation setting {text!r}: {e}") from None

    @property
    def pool_size(self) -> int:
        """Candidates the draft proposes: topk at depth 1, topk * topk at each later depth."""
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def max_accept(self) -> int:
        """Most draft tokens one step can accept (the tree depth, at most num_steps)."""
        return min(self.num_steps, self.num_draft_tokens - 1)


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
