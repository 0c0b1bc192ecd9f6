"""Baseline generation: batching, greedy exactness, seeded sampling, stops, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, random_target

import eagle3_jax as e3
from eagle3_jax.sampling.sampler import SamplingArrays, filtered_logits, sample


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def target(request):
    return random_target(FAMILIES[request.param])


def naive_greedy(target, prompt, n):
    """Greedy continuation by re-running the full causal forward (no cache) for every token."""
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, 32), np.int64)  # one shape -> one compile; right padding is causal-safe
        padded[0, : len(seq)] = seq
        seq.append(int(target.logits(padded)[0, len(seq) - 1].argmax()))
    return seq[len(prompt):]


def test_greedy_batch_of_mixed_lengths_equals_naive_reference(target):
    prompts = [[1, 2, 3], [7] * 11, [5, 9, 11, 13, 17, 19, 23]]
    outs = e3.Engine(target, max_batch_size=4, max_seq_len=64).generate(prompts, e3.SamplingParams(max_tokens=6))
    for p, o in zip(prompts, outs):
        assert o.token_ids == naive_greedy(target, p, 6)
        assert o.finish_reason == "length"
        assert o.metrics["mean_accept_length"] == 1.0 and o.metrics["num_draft_passes"] == 0
        assert o.metrics["num_target_passes"] == 6 and len(o.metrics["itl_s"]) == 5 and o.metrics["ttft_s"] > 0


def test_waves_larger_than_max_batch_size():
    target = random_target(FAMILIES["llama"])
    prompts = [[i + 1, i + 2] for i in range(5)]
    sp = e3.SamplingParams(max_tokens=4)
    batched = e3.Engine(target, max_batch_size=2, max_seq_len=32).generate(prompts, sp)
    one = e3.Engine(target, max_batch_size=1, max_seq_len=32)
    single = [one.generate([p], sp)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]


def test_seeded_sampling_is_reproducible_and_batch_independent():
    target = random_target(FAMILIES["minimax_m2"])
    engine = e3.Engine(target, max_batch_size=4, max_seq_len=64)
    sp = [e3.SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=10, seed=s) for s in (1, 2, 3)]
    a = engine.generate([[1, 2], [3, 4, 5], [6]], sp)
    b = engine.generate([[3, 4, 5]], sp[1])  # alone, in a smaller batch bucket
    c = engine.generate([[1, 2], [3, 4, 5], [6]], sp)
    assert a[1].token_ids == b[0].token_ids
    assert [o.token_ids for o in a] == [o.token_ids for o in c]
    other = engine.generate([[3, 4, 5]], e3.SamplingParams(temperature=1.0, max_tokens=10, seed=99))
    assert other[0].token_ids != a[1].token_ids
    # Temperature alone: alone its batch sorts no vocabulary; beside top-k / top-p rows it is
    # filtered with them, keeping every token. The same draws either way.
    plain = e3.SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    beside = engine.generate([[1, 2], [3, 4, 5], [6]], [sp[0], plain, sp[2]])
    assert beside[1].token_ids == engine.generate([[3, 4, 5]], plain)[0].token_ids


def test_stop_tokens_and_length_limits():
    target = random_target(FAMILIES["llama"])
    engine = e3.Engine(target, max_batch_size=2, max_seq_len=24)
    free = engine.generate([[1, 2, 3]], e3.SamplingParams(max_tokens=12))[0].token_ids
    stop = free[4]
    out = engine.generate([[1, 2, 3]], e3.SamplingParams(max_tokens=12, stop_token_ids=(stop,)))[0]
    assert out.token_ids == free[: free.index(stop) + 1] and out.finish_reason == "stop"
    capped = engine.generate([[1] * 20], e3.SamplingParams(max_tokens=50))[0]
    assert len(capped.token_ids) == 4 and capped.finish_reason == "length"  # 20 + 4 = max_seq_len


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed=-3), "seed"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        e3.SamplingParams(**kwargs)


def test_bad_requests_are_rejected_before_any_work():
    target = random_target(FAMILIES["llama"])
    engine = e3.Engine(target, max_batch_size=2, max_seq_len=16)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1], []])
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 64]])
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([list(range(1, 17))])
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([[1], [2]], [e3.SamplingParams()] * 3)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate([[1]], [dict(temperature=0.0)])
    with pytest.raises(ValueError, match="token_ids"):
        target.logits(np.zeros((3,), np.int32))
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1"):
        e3.Engine(target, max_batch_size=2, max_seq_len=16, prefill_chunk=0)


def _reference_filter(logits, temperature, top_k, top_p):
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros_like(z, bool)
    kept = order[:top_k] if top_k else order
    p = np.exp(z[kept] - z[kept].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep[kept[before < top_p]] = True
    out = np.where(keep, z, -np.inf)
    return out


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.5), (1, 1.0)])
def test_filtered_logits_match_numpy_reference(top_k, top_p):
    logits = np.random.default_rng(0).standard_normal((2, 10)).astype(np.float32) * 2
    got = filtered_logits(jnp.asarray(logits), jnp.full((2,), 0.8), jnp.full((2,), top_k), jnp.full((2,), top_p))
    for row in range(2):
        np.testing.assert_allclose(np.asarray(got[row]), _reference_filter(logits[row], 0.8, top_k, top_p), rtol=1e-6)


def test_rows_that_keep_every_token_are_filtered_to_the_same_bits_without_a_sort():
    """A batch where no sampled row truncates skips the vocabulary sort (top_k / top_p None); a row
    with top-k 0 and top-p 1 in a truncating batch must get the same logits, even where the
    rounded mass before its tail tokens reaches 1, and a greedy row its logits whole."""
    logits = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    logits[1, 5] = 60.0  # one token holds all the float32 mass: the mass before every other is 1.0
    temperature = jnp.asarray([0.7, 1.0, 0.0])
    whole = filtered_logits(jnp.asarray(logits), temperature, None, None)
    np.testing.assert_allclose(np.asarray(whole), logits / np.asarray([0.7, 1.0, 1.0], np.float32)[:, None], rtol=1e-6)
    truncating = filtered_logits(jnp.asarray(logits), temperature, jnp.asarray([0, 0, 3]), jnp.asarray([1.0, 1.0, 0.5]))
    np.testing.assert_array_equal(np.asarray(truncating), np.asarray(whole))  # row 2 is greedy: whole too
    assert np.isfinite(np.asarray(truncating)).all()


def test_sampling_follows_the_filtered_distribution():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((1, 6)).astype(np.float32))
    n = 20000
    sp = SamplingArrays(temperature=jnp.full((n,), 0.7), top_k=jnp.full((n,), 4), top_p=jnp.full((n,), 0.9),
                        seed=jnp.arange(n, dtype=jnp.uint32))
    draws = np.asarray(jax.jit(sample)(jnp.broadcast_to(logits, (n, 6)), sp, jnp.zeros((n,), jnp.int32)))
    probs = np.asarray(jax.nn.softmax(filtered_logits(logits, jnp.full((1,), 0.7), jnp.full((1,), 4), jnp.full((1,), 0.9)))[0])
    counts = np.bincount(draws, minlength=6)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    expected = probs[support] * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    assert chi2 < 25.0, (counts, expected)  # df <= 3; p(chi2 > 25) < 1e-4
