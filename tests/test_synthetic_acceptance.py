"""Synthetic (forced) acceptance for benchmarking: verification accepts a given per-position profile
whatever the target says, and a request without a profile returns exactly what it would alone."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.sampling.sampler import SamplingArrays
from eagle3_jax.scheduler import Scheduler
from eagle3_jax.scheduler.slot_table import SlotTable
from eagle3_jax.spec_decode.verify import synthetic_accept

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[1, 403, 407, 286, 261], [1, 291, 276, 286, 261, 370, 298], [1, 90]]


def _rows(b: int, profile, temperature=0.0, seed0: int = 0) -> SamplingArrays:
    sp = SamplingArrays.from_params([e3.SamplingParams(temperature=temperature, seed=seed0 + i,
                                                       synthetic_acceptance=profile) for i in range(b)], b)
    return jax.tree.map(jnp.asarray, sp)


def test_accepted_depth_follows_the_profile():
    """Over many rows the share that accepts at least d + 1 draft tokens is profile[d], along each
    node's first child; the bonus is the target's argmax at the node reached."""
    b, v = 4000, 8
    # a tree: root 0; children of 0: 1, 2; of 1: 3, 4; of 3: 5; of 2: 6 -> first-child path 0-1-3-5
    parents = jnp.broadcast_to(jnp.asarray([0, 0, 0, 1, 1, 3, 2], jnp.int32), (b, 7))
    tokens = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (b, 7))
    logits = jnp.broadcast_to(jax.nn.one_hot(jnp.arange(7) % v, v) * 5.0, (b, 7, v))
    profile = (0.8, 0.5, 0.2)
    node, bonus = jax.jit(synthetic_accept)(logits, tokens, parents, _rows(b, profile), jnp.zeros((b,), jnp.int32))
    node, bonus = np.asarray(node), np.asarray(bonus)
    assert set(np.unique(node)) <= {0, 1, 3, 5}
    depth = np.select([node == 1, node == 3, node == 5], [1, 2, 3], 0)
    for d, rate in enumerate(profile):
        assert abs((depth > d).mean() - rate) < 0.03, (d, (depth > d).mean())
    np.testing.assert_array_equal(bonus, node % v)  # argmax at the node reached
    # all accepted: the deepest first-child node, even where the profile is longer than the path
    node, _ = synthetic_accept(logits[:4], tokens[:4], parents[:4], _rows(4, (1.0,) * 5), jnp.zeros((4,), jnp.int32))
    assert list(np.asarray(node)) == [5] * 4
    node, _ = synthetic_accept(logits[:4], tokens[:4], parents[:4], _rows(4, (0.0,)), jnp.zeros((4,), jnp.int32))
    assert list(np.asarray(node)) == [0] * 4


def test_profiles_are_checked():
    for bad, words in (((0.5, 0.7), "cannot increase"), ((1.2,), r"\[0, 1\]"), ((), "1 to"), ("x", "numbers")):
        with pytest.raises(ValueError, match=words):
            e3.SamplingParams(synthetic_acceptance=bad)
    assert e3.SamplingParams(synthetic_acceptance=[1, 0.5]).synthetic_acceptance == (1.0, 0.5)


def test_table_leaves_the_profile_out_unless_a_row_has_one():
    table = SlotTable(4, max_pages_per_seq=4)
    table.admit(1, 3, e3.SamplingParams())
    assert table.rows(np.arange(4), 4).sampling.accept_profile is None
    table.admit(2, 3, e3.SamplingParams(synthetic_acceptance=(0.5,)))
    assert table.rows(np.asarray([0, 1]), 4).sampling.accept_profile is None
    got = table.rows(np.asarray([1, 2]), 4).sampling.accept_profile
    assert got[0, 0] == -1 and got[1, 0] == 0.5 and got[1, 1] == 0
    table.clear(2)
    assert table.rows(np.asarray([1, 2]), 4).sampling.accept_profile is None


@pytest.fixture(scope="module")
def pair():
    target = e3.load_target(os.path.join(ROOT, "checkpoints", "stories260K"), dtype="float32")
    draft = e3.load_draft(os.path.join(ROOT, "checkpoints", "stories260K-eagle3"), target=target, dtype="float32")
    return target, draft


def test_scheduler_forces_the_profile_and_leaves_other_requests_alone(pair):
    target, draft = pair
    # pages of 64: every request (up to 160 tokens) steps at one block-table width, fewer programs
    engine = Scheduler(target, draft, e3.SpecConfig.parse("chain:3:1:4"), max_num_seqs=4, max_seq_len=160,
                       page_size=64)
    normal = e3.SamplingParams(max_tokens=64)
    alone = engine.generate(PROMPTS, normal)
    forced = e3.SamplingParams(max_tokens=64, synthetic_acceptance=(1.0, 1.0, 1.0))
    mixed = engine.generate(PROMPTS, [normal, forced, normal])
    assert mixed[0].token_ids == alone[0].token_ids and mixed[2].token_ids == alone[2].token_ids
    lengths = mixed[1].metrics["accept_lengths"]
    assert all(n == 4 for n in lengths[:-1]) and len(lengths) == 16  # every step accepts all 3 + bonus
    none = engine.generate(PROMPTS[:1], e3.SamplingParams(max_tokens=32, synthetic_acceptance=(0.0,)))
    assert set(none[0].metrics["accept_lengths"]) == {1}
    # a sampled request with a profile: its mean acceptance follows the profile (tau = 1 + sum)
    profile = (0.9, 0.6, 0.3)
    outs = engine.generate([[1]] * 4, [e3.SamplingParams(max_tokens=120, temperature=1.0, seed=s,
                                                         synthetic_acceptance=profile) for s in range(4)])
    steps = [n for o in outs for n in o.metrics["accept_lengths"][:-1]]
    assert abs(np.mean(steps) - (1 + sum(profile))) < 0.25, np.mean(steps)
