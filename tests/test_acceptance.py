"""Tree acceptance on hand-built trees: greedy and sampled (fixed coins), worked out by hand.

Two requests (B=2) share nothing but the shapes. Vocabulary V=8. Every expected value below is
derived in the comments from the acceptance rules, not from running the code:

  greedy:  node i is accepted iff every node on its path (root excluded) carries the token that is
           the target argmax at its parent; the walk ends at the deepest such node; the bonus is
           the argmax at that node.
  sampled: at the current node with target distribution p, the children are tried in index
           order; child x is accepted iff coin * sum(r) < r(x) (i.e. with probability
           r(x) / sum(r)), where r is p with the already-rejected siblings zeroed; on acceptance
           the walk moves to it (r := its p); the bonus is drawn from the final r / sum(r).

Tree A (row 0), 9 nodes:                Tree B (row 1), 9 nodes:

    0 (tok 7)                              0 (tok 0)
    |- 1 (tok 1)                           |- 1 (tok 2)
    |  |- 4 (tok 4)                        |  |- 3 (tok 1)
    |  |  `- 7 (tok 0)                     |  |  `- 6 (tok 4)
    |  `- 5 (tok 5)                        |  |     `- 8 (tok 7)
    |     `- 8 (tok 3)                     |  `- 4 (tok 6)
    |- 2 (tok 2)                           `- 2 (tok 5)
    |  `- 6 (tok 6)                           `- 5 (tok 1)
    `- 3 (tok 3)                                 `- 7 (tok 3)
"""

import jax.numpy as jnp
import numpy as np
import pytest
from random_models import LLAMA

from eagle3_jax.cache import kv_cache
from eagle3_jax.config.model import parse_model_config
from eagle3_jax.sampling.sampler import SamplingArrays
from eagle3_jax.spec_decode.tree import ancestor_mask, depths, path_to
from eagle3_jax.spec_decode.verify import accept, commit_path, emitted_tokens, greedy_accept, sampled_accept

V = 8
PARENTS = np.array([[0, 0, 0, 0, 1, 1, 2, 4, 5],
                    [0, 0, 0, 1, 1, 2, 3, 5, 6]], np.int32)
TOKENS = np.array([[7, 1, 2, 3, 4, 5, 6, 0, 3],
                   [0, 2, 5, 1, 6, 1, 4, 3, 7]], np.int32)
N = PARENTS.shape[1]
# Ancestor sets (node itself included), read off the drawings above.
ANCESTORS = [
    [{0}, {0, 1}, {0, 2}, {0, 3}, {0, 1, 4}, {0, 1, 5}, {0, 2, 6}, {0, 1, 4, 7}, {0, 1, 5, 8}],
    [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 1, 3, 6}, {0, 2, 5, 7}, {0, 1, 3, 6, 8}],
]
DEPTHS = [[0, 1, 1, 1, 2, 2, 2, 3, 3],
          [0, 1, 1, 2, 2, 2, 3, 3, 4]]
MAX_DEPTH = 4  # tree B's node 8; paths and emitted rows have MAX_DEPTH + 1 entries


def _topology():
    parents = jnp.asarray(PARENTS)
    anc = ancestor_mask(parents)
    return parents, anc, depths(anc)


def _finish(node, bonus):
    """(node, bonus) -> numpy (node, n_accept, path, emitted), through tree.path_to and emitted_tokens."""
    _, anc, depth = _topology()
    node = jnp.asarray(node, jnp.int32)
    n_accept = jnp.take_along_axis(depth, node[:, None], axis=1)[:, 0]
    path = path_to(anc, depth, node, MAX_DEPTH + 1)
    out = emitted_tokens(jnp.asarray(TOKENS), path, n_accept, jnp.asarray(bonus, jnp.int32))
    return np.asarray(node), np.asarray(n_accept), np.asarray(path), np.asarray(out)


# ---- topology ---------------------------------------------------------------------------------

def test_ancestor_mask_and_depths_of_hand_trees():
    _, anc, depth = _topology()
    want = np.zeros((2, N, N), bool)
    for b in range(2):
        for i, s in enumerate(ANCESTORS[b]):
            want[b, i, sorted(s)] = True
    np.testing.assert_array_equal(np.asarray(anc), want)
    np.testing.assert_array_equal(np.asarray(depth), np.asarray(DEPTHS))


@pytest.mark.parametrize(
    "nodes, want",
    [
        # A: 8 = leaf via 1 -> 5 -> 8; B: 8 = deepest leaf via 1 -> 3 -> 6 -> 8.
        ((8, 8), ([0, 1, 5, 8, 8], [0, 1, 3, 6, 8])),
        # A: 6 via the second root child; B: 7 via the second root child. Past the depth: repeat.
        ((6, 7), ([0, 2, 6, 6, 6], [0, 2, 5, 7, 7])),
        # the root itself; B: node 3 at depth 2.
        ((0, 3), ([0, 0, 0, 0, 0], [0, 1, 3, 3, 3])),
        ((3, 4), ([0, 3, 3, 3, 3], [0, 1, 4, 4, 4])),
    ],
)
def test_path_to_on_hand_trees(nodes, want):
    _, anc, depth = _topology()
    got = path_to(anc, depth, jnp.asarray(nodes, jnp.int32), MAX_DEPTH + 1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- greedy -----------------------------------------------------------------------------------

def _greedy_logits(argmaxes):
    """argmaxes [2][N] -> one-hot-ish logits [2, N, V] (10 at the argmax, a runner-up at 4)."""
    logits = np.zeros((2, N, V), np.float32)
    for b in range(2):
        for i, a in enumerate(argmaxes[b]):
            logits[b, i, a] = 10.0
            logits[b, i, (a + 1) % V] = 4.0
    return jnp.asarray(logits)


def _greedy(argmaxes):
    parents, anc, depth = _topology()
    node, bonus = greedy_accept(_greedy_logits(argmaxes), jnp.asarray(TOKENS), parents, anc, depth)
    np.testing.assert_array_equal(np.asarray(bonus), np.asarray(argmaxes)[[0, 1], np.asarray(node)])
    return _finish(node, bonus)


GREEDY_CASES = {
    # Row 0 (A), full path to a leaf, through the SECOND child at depth 2:
    #   argmax@0 = 1 -> node 1 (tok 1) matches; nodes 2, 3 (tok 2, 3) do not.
    #   argmax@1 = 5 -> node 5 (tok 5) matches, node 4 (tok 4) does not.
    #   argmax@5 = 3 -> node 8 (tok 3) matches: a leaf at depth 3.  Bonus = argmax@8 = 6.
    #   Decoys that must not count: argmax@2 = 6 matches node 6, argmax@4 = 0 matches node 7, but
    #   nodes 2 and 4 themselves were not accepted.
    #   -> node 8, path 0-1-5-8, emitted [1, 5, 3, 6].
    # Row 1 (B), partial accept at depth 2 while a sibling branch matches deeper:
    #   argmax@0 = 2 -> node 1 (tok 2) matches; node 2 (tok 5) does not.
    #   argmax@1 = 1 -> node 3 (tok 1) matches; node 4 (tok 6) does not.
    #   argmax@3 = 0 -> node 6 (tok 4) does not match: stop at node 3, depth 2. Bonus = 0.
    #   Branch 2 -> 5 -> 7 would match to depth 3 (argmax@2 = 1 = tok of 5, argmax@5 = 3 = tok of
    #   7) and argmax@6 = 7 = tok of node 8 (depth 4), but the walk never takes them.
    #   -> node 3, path 0-1-3, emitted [2, 1, 0].
    "full_leaf_and_partial_depth2": (
        [[1, 5, 6, 0, 0, 3, 0, 0, 6],
         [2, 1, 1, 0, 0, 3, 7, 0, 0]],
        dict(node=[8, 3], n_accept=[3, 2], path=[[0, 1, 5, 8, 8], [0, 1, 3, 3, 3]],
             emitted=[[1, 5, 3, 6, -1], [2, 1, 0, -1, -1]]),
    ),
    # Row 0 (A), reject at depth 1: argmax@0 = 4, and the root's children carry 1, 2, 3.
    #   Decoys: argmax@1 = 4 = tok of node 4, argmax@4 = 0 = tok of node 7, argmax@2 = 6 = node 6.
    #   -> node 0, only the bonus 4 is emitted.
    # Row 1 (B), full path to the deepest leaf: argmax@0 = 2 (node 1), @1 = 1 (node 3),
    #   @3 = 4 (node 6), @6 = 7 (node 8, depth 4), bonus = argmax@8 = 5.
    #   -> node 8, path 0-1-3-6-8, emitted [2, 1, 4, 7, 5].
    "reject_depth1_and_full_depth4": (
        [[4, 4, 6, 0, 0, 3, 0, 0, 0],
         [2, 1, 0, 4, 0, 0, 7, 0, 5]],
        dict(node=[0, 8], n_accept=[0, 4], path=[[0, 0, 0, 0, 0], [0, 1, 3, 6, 8]],
             emitted=[[4, -1, -1, -1, -1], [2, 1, 4, 7, 5]]),
    ),
    # Row 0 (A): the THIRD root child: argmax@0 = 3 -> node 3 (a leaf at depth 1), bonus argmax@3 = 5.
    #   (argmax@1 = 5 would match node 5, but node 1 was rejected.)  -> emitted [3, 5].
    # Row 1 (B): the SECOND root child and down: argmax@0 = 5 -> node 2, @2 = 1 -> node 5,
    #   @5 = 3 -> node 7 (leaf, depth 3), bonus argmax@7 = 2. argmax@1 = 1 would match node 3 and
    #   argmax@3 = 4 node 6, all under the rejected node 1.  -> emitted [5, 1, 3, 2].
    "later_siblings": (
        [[3, 5, 0, 5, 0, 0, 0, 0, 0],
         [5, 1, 1, 4, 0, 3, 0, 2, 0]],
        dict(node=[3, 7], n_accept=[1, 3], path=[[0, 3, 3, 3, 3], [0, 2, 5, 7, 7]],
             emitted=[[3, 5, -1, -1, -1], [5, 1, 3, 2, -1]]),
    ),
}


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
def test_greedy_accept_hand_cases(case):
    argmaxes, want = GREEDY_CASES[case]
    node, n_accept, path, out = _greedy(argmaxes)
    np.testing.assert_array_equal(node, want["node"])
    np.testing.assert_array_equal(n_accept, want["n_accept"])
    np.testing.assert_array_equal(path, want["path"])
    np.testing.assert_array_equal(out, want["emitted"])


# ---- sampled (fixed coins) --------------------------------------------------------------------

def _prob_logits(tables, temperature=(1.0, 1.0)):
    """tables [2][N] of {token: prob} (None = uniform) -> logits [2, N, V] with softmax(logits / T) = prob.

    Zero-probability tokens get -inf. Logits are T * log(p) so the sampler's temperature scaling
    brings them back to exactly p.
    """
    logits = np.zeros((2, N, V), np.float32)
    for b in range(2):
        for i, table in enumerate(tables[b]):
            if table is None:
                continue
            p = np.zeros(V)
            for tok, pr in table.items():
                p[tok] = pr
            assert abs(p.sum() - 1) < 1e-12
            with np.errstate(divide="ignore"):
                logits[b, i] = temperature[b] * np.log(p)
    return jnp.asarray(logits)


def _sampling(temperature=(1.0, 1.0), top_k=(0, 0), top_p=(1.0, 1.0)):
    return SamplingArrays(temperature=jnp.asarray(temperature, jnp.float32), top_k=jnp.asarray(top_k, jnp.int32),
                          top_p=jnp.asarray(top_p, jnp.float32), seed=jnp.asarray([11, 12], jnp.uint32))


def _sampled(tables, coins, **sp):
    parents, _, _ = _topology()
    temperature = sp.get("temperature", (1.0, 1.0))
    node, bonus = sampled_accept(_prob_logits(tables, temperature), jnp.asarray(TOKENS), parents, _sampling(**sp),
                                 jnp.asarray([1, 1], jnp.int32), coins=jnp.asarray(coins, jnp.float32))
    return _finish(node, bonus)


SAMPLED_CASES = {
    # Row 0 (A):  p@0 = {1: .5, 2: .25, 3: .25}.
    #   node 1 (tok 1): r = p@0, sum 1; coin .6: .6 * 1 < .5? no -> rejected; r = {2: .25, 3: .25}.
    #   node 2 (tok 2): accept iff coin < r(2)/sum(r) = .25/.5 = .5; coin .4 -> ACCEPTED (the
    #                   unrenormalised rule coin < p(2) = .25 would have rejected it). r = p@2.
    #   node 3 (tok 3): sibling of the accepted node: skipped (coin 0 would have accepted it).
    #   node 6 (tok 6): p@2 = {6: .5, 0: .5}; coin .9 >= .5 -> rejected; r = {0: .5}.
    #   bonus ~ r/sum(r) = {0: 1} -> 0.                     -> node 2, emitted [2, 0].
    # Row 1 (B):  p@0 = {2: .25, 5: .5, 0: .25}.
    #   node 1 (tok 2): coin .1 * 1 < .25 -> ACCEPTED; r = p@1. node 2: skipped.
    #   node 3 (tok 1): p@1 = {1: .5, 6: .25, 7: .25}; coin .75 >= .5 -> rejected; r = {6: .25, 7: .25}.
    #   node 4 (tok 6): accept iff coin < .25/.5 = .5; coin .45 -> ACCEPTED (unrenormalised: rejected).
    #   node 4 is a leaf; bonus ~ p@4 = {3: 1} -> 3.        -> node 4, emitted [2, 6, 3].
    "renormalised_second_sibling": (
        [[{1: .5, 2: .25, 3: .25}, None, {6: .5, 0: .5}, None, None, None, None, None, None],
         [{2: .25, 5: .5, 0: .25}, {1: .5, 6: .25, 7: .25}, None, None, {3: 1.0}, None, None, None, None]],
        [[0.0, 0.6, 0.4, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0],
         [0.0, 0.1, 0.0, 0.75, 0.45, 0.0, 0.0, 0.0, 0.0]],
        {},
        dict(node=[2, 4], n_accept=[1, 2], path=[[0, 2, 2, 2, 2], [0, 1, 4, 4, 4]],
             emitted=[[2, 0, -1, -1, -1], [2, 6, 3, -1, -1]]),
    ),
    # Row 0 (A):  p@0 = {1: .5, 2: .25, 3: .125, 5: .125}; all three root children rejected:
    #   node 1: .99 * 1 >= .5;  r = {2: .25, 3: .125, 5: .125}, sum .5
    #   node 2: .99 * .5 = .495 >= .25;  r = {3: .125, 5: .125}, sum .25
    #   node 3: .99 * .25 = .2475 >= .125;  r = {5: .125}
    #   bonus ~ {5: 1} -> 5 (a token no draft node proposed).   -> node 0, emitted [5].
    # Row 1 (B):  p@0 = {5: 1}.
    #   node 1 (tok 2): r(2) = 0, so even coin 0 rejects it (0 < 0 is false); r unchanged.
    #   node 2 (tok 5): .999 * 1 < 1 -> ACCEPTED; r = p@2 = {1: .5, 0: .5}.
    #   nodes 3, 4 (children of the rejected node 1): skipped.
    #   node 5 (tok 1): .3 < .5 -> ACCEPTED; r = p@5 = {3: .25, 4: .75}.
    #   node 7 (tok 3): .2 < .25 -> ACCEPTED; leaf at depth 3; bonus ~ p@7 = {6: 1} -> 6.
    #                                                        -> node 7, emitted [5, 1, 3, 6].
    "all_rejected_and_zero_prob_draft": (
        [[{1: .5, 2: .25, 3: .125, 5: .125}] + [None] * 8,
         [{5: 1.0}, None, {1: .5, 0: .5}, None, None, {3: .25, 4: .75}, None, {6: 1.0}, None]],
        [[0.0, 0.99, 0.99, 0.99, 0.0, 0.0, 0.0, 0.0, 0.0],
         [0.0, 0.0, 0.999, 0.0, 0.0, 0.3, 0.0, 0.2, 0.0]],
        {},
        dict(node=[0, 7], n_accept=[0, 3], path=[[0, 0, 0, 0, 0], [0, 2, 5, 7, 7]],
             emitted=[[5, -1, -1, -1, -1], [5, 1, 3, 6, -1]]),
    ),
    # The filters shape the acceptance distribution.
    # Row 0 (A), temperature 0.5: logits are .5 * log(p), so the sampler sees exactly p (at T=1 it
    #   would see p ∝ sqrt(p), e.g. {1: .414, 2: .293, 3: .293} at the root).
    #   p@0 = {1: .5, 2: .25, 3: .25}; node 1: coin .45 < .5 -> ACCEPTED (at T=1: .45 >= .414).
    #   p@1 = {4: .25, 5: .75}; node 4: coin .3 >= .25 -> rejected (at T=1, .3 < .366 accepts);
    #     r = {5: .75}; node 5: .99 * .75 = .7425 < .75 -> ACCEPTED.
    #   p@5 = {3: 1}; node 8 (tok 3): coin .5 -> ACCEPTED; leaf; bonus ~ p@8 = {2: 1} -> 2.
    #                                                        -> node 8, emitted [1, 5, 3, 2].
    # Row 1 (B), top_p = .6 (keep the sorted prefix whose mass before the token is < .6):
    #   p@0 = {2: .5, 5: .3, 0: .2} -> mass before: 0, .5, .8 -> keep {2, 5} -> {2: .625, 5: .375}.
    #   node 1 (tok 2): coin .7 >= .625 -> rejected; r = {5: .375}.
    #   node 2 (tok 5): .99 * .375 < .375 -> ACCEPTED.
    #   p@2 = {1: .7, 0: .3} -> mass before 0, .7 -> {1: 1}; node 5 (tok 1): coin .99 -> ACCEPTED.
    #   p@5 = {4: .55, 3: .45} -> mass before 0, .55 -> both kept; node 7 (tok 3): coin .5 >= .45
    #     -> rejected; r = {4: .55}; bonus -> 4.             -> node 5, emitted [5, 1, 4].
    "temperature_and_top_p": (
        [[{1: .5, 2: .25, 3: .25}, {4: .25, 5: .75}, None, None, None, {3: 1.0}, None, None, {2: 1.0}],
         [{2: .5, 5: .3, 0: .2}, None, {1: .7, 0: .3}, None, None, {4: .55, 3: .45}, None, None, None]],
        [[0.0, 0.45, 0.0, 0.0, 0.3, 0.99, 0.0, 0.0, 0.5],
         [0.0, 0.7, 0.99, 0.0, 0.0, 0.99, 0.0, 0.5, 0.0]],
        dict(temperature=(0.5, 1.0), top_p=(1.0, 0.6)),
        dict(node=[8, 5], n_accept=[3, 2], path=[[0, 1, 5, 8, 8], [0, 2, 5, 5, 5]],
             emitted=[[1, 5, 3, 2, -1], [5, 1, 4, -1, -1]]),
    ),
    # top-k = 1 turns row 0 into "only the mode survives"; row 1 top-k = 2 drops a draft token.
    # Row 0 (A): p@0 = {1: .3, 2: .45, 3: .25} -> top-1 = {2: 1}. node 1 (tok 1): p = 0 -> rejected
    #   even with coin 0; node 2 (tok 2): coin .99 < 1 -> ACCEPTED. p@2 = {6: .4, 0: .6} -> {0: 1};
    #   node 6 (tok 6): rejected with coin 0; bonus -> 0.    -> node 2, emitted [2, 0].
    # Row 1 (B): p@0 = {2: .2, 5: .3, 0: .5} -> top-2 = {0: .625, 5: .375}. node 1 (tok 2): dropped
    #   by top-k, rejected with coin 0; node 2 (tok 5): coin .5: .5 * 1 < .375? no -> rejected;
    #   r = {0: .625}; bonus -> 0.                           -> node 0, emitted [0].
    "top_k": (
        [[{1: .3, 2: .45, 3: .25}, None, {6: .4, 0: .6}] + [None] * 6,
         [{2: .2, 5: .3, 0: .5}] + [None] * 8],
        [[0.0, 0.0, 0.99, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
         [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
        dict(top_k=(1, 2)),
        dict(node=[2, 0], n_accept=[1, 0], path=[[0, 2, 2, 2, 2], [0, 0, 0, 0, 0]],
             emitted=[[2, 0, -1, -1, -1], [0, -1, -1, -1, -1]]),
    ),
}


@pytest.mark.parametrize("case", sorted(SAMPLED_CASES))
def test_sampled_accept_hand_cases(case):
    tables, coins, sp, want = SAMPLED_CASES[case]
    node, n_accept, path, out = _sampled(tables, coins, **sp)
    np.testing.assert_array_equal(node, want["node"])
    np.testing.assert_array_equal(n_accept, want["n_accept"])
    np.testing.assert_array_equal(path, want["path"])
    np.testing.assert_array_equal(out, want["emitted"])


def test_sampled_bonus_lies_in_the_final_residual():
    """With random (seeded) bonus keys, the bonus is never a rejected sibling nor outside p's support.

    Row 0 (A): p@0 = {1: .4, 2: .3, 3: .2, 6: .1}, coins reject all three root children
    (.99 each), so r = {6: .1}: the bonus must be 6 for every seed. Row 1 (B): p@0 = {2: .5, 5: .25,
    4: .25}; node 1 (tok 2) rejected with coin .99 (r = {5: .25, 4: .25}), node 2 (tok 5) rejected
    with coin .99 (.99 * .5 >= .25), r = {4: .25}: the bonus must be 4.
    """
    tables = [[{1: .4, 2: .3, 3: .2, 6: .1}] + [None] * 8, [{2: .5, 5: .25, 4: .25}] + [None] * 8]
    coins = jnp.asarray([[0.0, 0.99, 0.99, 0.99, 0, 0, 0, 0, 0], [0.0, 0.99, 0.99, 0, 0, 0, 0, 0, 0]], jnp.float32)
    parents, _, _ = _topology()
    logits = _prob_logits(tables)
    for seed in range(20):
        sp = _sampling()
        sp.seed = jnp.asarray([seed, 1000 + seed], jnp.uint32)
        node, bonus = sampled_accept(logits, jnp.asarray(TOKENS), parents, sp, jnp.asarray([seed, 3], jnp.int32),
                                     coins=coins)
        assert np.asarray(node).tolist() == [0, 0]
        assert np.asarray(bonus).tolist() == [6, 4]


def test_accept_mixes_greedy_and_sampled_rows():
    """Row 0 greedy (T=0) takes the greedy walk; row 1 samples (T=1) from one-hot targets, which
    forces the same walk as greedy, whatever the coins: the 'full_leaf_and_partial_depth2' case."""
    argmaxes, want = GREEDY_CASES["full_leaf_and_partial_depth2"]
    one_hot = np.full((2, N, V), -np.inf, np.float32)
    for b in range(2):
        for i, a in enumerate(argmaxes[b]):
            one_hot[b, i, a] = 0.0
    logits = np.where(np.arange(2)[:, None, None] == 0, np.asarray(_greedy_logits(argmaxes)), one_hot)
    parents, anc, depth = _topology()
    for seed in range(5):
        sp = _sampling(temperature=(0.0, 1.0))
        sp.seed = jnp.asarray([seed, seed], jnp.uint32)
        node, bonus = accept(jnp.asarray(logits), jnp.asarray(TOKENS), parents, anc, depth, sp,
                             jnp.asarray([1, 1], jnp.int32))
        node, n_accept, path, out = _finish(node, bonus)
        np.testing.assert_array_equal(node, want["node"])
        np.testing.assert_array_equal(out, want["emitted"])
    # All rows greedy: the sampled branch is skipped and the result is still the greedy walk.
    node, bonus = accept(_greedy_logits(argmaxes), jnp.asarray(TOKENS), parents, anc, depth,
                         _sampling(temperature=(0.0, 0.0)), jnp.asarray([1, 1], jnp.int32))
    np.testing.assert_array_equal(_finish(node, bonus)[3], want["emitted"])


# ---- commit_path ------------------------------------------------------------------------------

def test_commit_path_moves_path_kv_into_place():
    cfg = parse_model_config(LLAMA)
    cache = kv_cache.init_cache(cfg, 2, 24, jnp.float32)
    L, B, S = cache.k.shape[:3]
    # k[l, b, s, h, d] = 1000 l + 100 b + s + .001 (h * head_dim + d), v = -k: every entry is distinct.
    val = (1000 * np.arange(L)[:, None, None] + 100 * np.arange(B)[None, :, None] + np.arange(S)[None, None, :])
    extra = 0.001 * np.arange(np.prod(cache.k.shape[3:])).reshape(cache.k.shape[3:])
    k = (val[..., None, None] + extra).astype(np.float32)
    lengths = np.array([3, 6], np.int32)
    cache = cache.replace(k=jnp.asarray(k), v=jnp.asarray(-k), lengths=jnp.asarray(lengths))
    # The greedy 'full_leaf_and_partial_depth2' outcome: row 0 keeps path 0-1-5-8 (n_keep 4),
    # row 1 keeps 0-1-3 (n_keep 3). Tree node j's K/V sits at slot lengths + j.
    path = np.array([[0, 1, 5, 8, 8], [0, 1, 3, 3, 3]], np.int32)
    n_keep = np.array([4, 3], np.int32)
    new = commit_path(cache, jnp.asarray(path), jnp.asarray(n_keep))
    np.testing.assert_array_equal(np.asarray(new.lengths), lengths + n_keep)  # [7, 9]
    nk, nv = np.asarray(new.k), np.asarray(new.v)
    for b in range(B):
        ln = lengths[b]
        # Committed prefix untouched.
        np.testing.assert_array_equal(nk[:, b, :ln], k[:, b, :ln])
        np.testing.assert_array_equal(nv[:, b, :ln], -k[:, b, :ln])
        # Slot lengths + i now holds path node i (every layer, K and V).
        for i in range(n_keep[b]):
            np.testing.assert_array_equal(nk[:, b, ln + i], k[:, b, ln + path[b, i]])
            np.testing.assert_array_equal(nv[:, b, ln + i], -k[:, b, ln + path[b, i]])
        # Past the path's slots nothing moved.
        np.testing.assert_array_equal(nk[:, b, ln + path.shape[1]:], k[:, b, ln + path.shape[1]:])
    # Concretely: row 0 slots 3..6 <- old slots 3, 4, 8, 11; row 1 slots 6..8 <- old 6, 7, 9.
    assert nk[1, 0, 3:7, 0, 0].tolist() == [1003, 1004, 1008, 1011]
    assert nk[0, 1, 6:9, 0, 0].tolist() == [106, 107, 109]
