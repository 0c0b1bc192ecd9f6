"""Draft tree expansion: every node sees exactly its ancestors, in the draft's own forward.

The reference re-runs a plain causal draft pass over committed pairs + the node's root-to-node
path for every expanded node, with no scratch slots or tree masks, and rebuilds the EAGLE-2 tree
from those logits in Python.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import (
    FAMILIES,
    causal_draft_pass,
    draft_config_dict,
    mla_draft_config_dict,
    random_draft,
    random_target,
)

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.models.draft import draft_to_target_ids, project_features
from eagle3_jax.spec_decode.propose import draft_extend, expand


def causal_draft(draft, hidden_in, tokens):
    """(logits, hidden) of the last pair of a plain causal draft pass."""
    logits, hidden = causal_draft_pass(draft, hidden_in, tokens)
    return np.asarray(logits[-1]), hidden[-1]


def reference_tree(draft, feats, next_tokens, root_token, spec):
    """EAGLE-2 expansion by brute force for one row."""
    base_h = list(project_features(draft.params, draft.config, jnp.asarray(feats)))
    base_t = [int(x) for x in next_tokens]
    logits, g = causal_draft(draft, base_h, base_t)
    k = spec.topk
    logp = np.asarray(jax.nn.log_softmax(logits))
    order = np.argsort(-logp, kind="stable")[:k]
    pool = [dict(score=float(logp[i]), tok=int(i), parent=-1, h_in=g, path=[]) for i in order]
    frontier = list(range(k))
    for _ in range(1, spec.num_steps):
        cands = []
        for j in frontier:
            node = pool[j]
            path = node["path"] + [j]
            hs = base_h + [pool[p]["h_in"] for p in path]
            ts = base_t + [int(draft_to_target_ids(draft.params, jnp.int32(pool[p]["tok"]))) for p in path]
            lg, hout = causal_draft(draft, hs, ts)
            lp = np.asarray(jax.nn.log_softmax(lg))
            for c in np.argsort(-lp, kind="stable")[:k]:
                cands.append(dict(score=node["score"] + float(lp[c]), tok=int(c), parent=j, h_in=hout, path=path))
        scores = np.asarray([c["score"] for c in cands], np.float32)
        offset = len(pool)
        pool.extend(cands)
        frontier = [offset + int(i) for i in np.argsort(-scores, kind="stable")[:k]]
    scores = np.asarray([p["score"] for p in pool], np.float32)
    chosen = sorted(np.argsort(-scores, kind="stable")[: spec.num_draft_tokens - 1].tolist())
    index = {p: i + 1 for i, p in enumerate(chosen)}
    tokens = [int(root_token)] + [int(draft_to_target_ids(draft.params, jnp.int32(pool[p]["tok"]))) for p in chosen]
    parents = [0] + [0 if pool[p]["parent"] < 0 else index[pool[p]["parent"]] for p in chosen]
    return tokens, parents


@pytest.mark.parametrize("arch, spec", [("llama", e3.SpecConfig(3, 1, 4)), ("llama", e3.SpecConfig(3, 2, 6)),
                                        ("llama", e3.SpecConfig(3, 3, 9)), ("sliding", e3.SpecConfig(4, 2, 8)),
                                        pytest.param("mla", e3.SpecConfig(3, 3, 9), marks=pytest.mark.slow)],
                         ids=lambda x: x if isinstance(x, str) else f"topk{x.topk}")
def test_expand_matches_brute_force_per_path_forwards(arch, spec):
    target = random_target(FAMILIES["llama"])
    make_config = mla_draft_config_dict if arch == "mla" else draft_config_dict
    # sliding: a window shorter than the committed pairs, so that levels see only its end of the prefix
    extra = dict(layer_types=["sliding_attention"], sliding_window=4) if arch == "sliding" else {}
    draft = random_draft(target, make_config(target.config, draft_vocab_size=48, **extra),
                         d2t=np.random.default_rng(0).integers(0, 16, 48))
    b, t, n_valid = 2, 6, np.array([6, 4])
    rng = np.random.default_rng(3)
    feats = rng.standard_normal((b, t, 3 * target.config.hidden_size)).astype(np.float32)
    nxt = rng.integers(0, 64, (b, t)).astype(np.int32)
    root = nxt[np.arange(b), n_valid - 1]
    cache = kv_cache.init_cache(draft.config.layers, b, 32, jnp.float32)
    root_logits, root_hidden, cache = draft_extend(draft.params, draft.config, cache, jnp.asarray(feats),
                                                   jnp.asarray(nxt), jnp.asarray(n_valid, jnp.int32))
    tree, after = expand(draft.params, draft.config, cache, root_logits, root_hidden, jnp.asarray(root), spec)
    for row in range(b):
        n = n_valid[row]
        want_tokens, want_parents = reference_tree(draft, feats[row, :n], nxt[row, :n], root[row], spec)
        assert np.asarray(tree.tokens[row]).tolist() == want_tokens
        assert np.asarray(tree.parents[row]).tolist() == want_parents
    # The cache carried on keeps its lengths and committed entries (the frontier's K/V lie past them).
    np.testing.assert_array_equal(after.lengths, cache.lengths)
    for row in range(b):
        n = n_valid[row]
        for old, new in zip(jax.tree.leaves((cache.k, cache.v)), jax.tree.leaves((after.k, after.v))):
            np.testing.assert_array_equal(np.asarray(new)[:, row, :n], np.asarray(old)[:, row, :n])
