"""The training-time test unrolls exactly what inference does k levels deep in a chain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from random_models import (
    FAMILIES,
    causal_draft_pass,
    draft_config_dict,
    mla_draft_config_dict,
    random_draft,
    random_target,
)

from eagle3_jax.models.draft import project_features
from eagle3_jax.train.ttt import TTTMemory, ttt_loss, ttt_unroll


EAGLE31 = dict(fc_norm=True, norm_output=True, norm_before_fc=True)
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)


@pytest.mark.parametrize("arch,switches", [("llama", {}), ("mla", {}), ("llama", EAGLE31), ("mla", EAGLE31),
                                           ("llama", SLIDING), ("mla", SLIDING)],
                         ids=["llama", "mla", "llama-eagle3.1", "mla-eagle3.1", "llama-sliding3", "mla-sliding3"])
def test_ttt_steps_equal_chain_inference_unroll(arch, switches):
    """Every step k at every origin equals a plain causal draft pass over the chain (with EAGLE
    3.1's switches, the feature norms and the post-norm hidden handed on, as serving runs them; with
    a sliding-window layer, the window as serving bounds it, as deep as the window)."""
    target = random_target(FAMILIES["llama"])
    make_config = mla_draft_config_dict if arch == "mla" else draft_config_dict
    draft = random_draft(target, make_config(target.config, num_layers=2, **switches))
    rng = np.random.default_rng(0)
    t, steps = 9, 3
    aux = rng.standard_normal((1, t, 3 * target.config.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, 64, (1, t)).astype(np.int32)
    got = [np.asarray(x[0]) for x in ttt_unroll(draft.params, draft.config, jnp.asarray(aux), jnp.asarray(tokens), steps)]
    feats = list(project_features(draft.params, draft.config, jnp.asarray(aux[0])))
    for origin in range(t - steps):
        hs = feats[: origin + 1]
        ts = [int(x) for x in tokens[0, 1: origin + 2]]
        logits, hidden = causal_draft_pass(draft, hs, ts)
        np.testing.assert_allclose(got[0][origin], np.asarray(logits[-1]), rtol=1e-5, atol=1e-5)
        for k in range(1, steps):
            hs = hs + [hidden[-1]]  # the draft's own output stands in for the next feature
            ts = ts + [int(tokens[0, origin + k + 1])]  # teacher-forced next token
            logits, hidden = causal_draft_pass(draft, hs, ts)
            np.testing.assert_allclose(got[k][origin], np.asarray(logits[-1]), rtol=1e-5, atol=1e-5)


def test_ttt_loss_masks_and_metrics():
    target = random_target(FAMILIES["llama"])
    draft = random_draft(target, draft_config_dict(target.config, draft_vocab_size=32),
                         d2t=np.full(32, 32, np.int64))  # draft ids 0..31 -> target ids 32..63
    rng = np.random.default_rng(1)
    b, t = 2, 10
    draft_ids = jnp.arange(32, 64)
    t2d = jnp.zeros(64, bool).at[draft_ids].set(True)
    argmax = jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32)
    batch = dict(
        tokens=jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32),
        loss_mask=jnp.asarray(np.arange(t)[None] >= 4).repeat(b, 0),
        aux=jnp.asarray(rng.standard_normal((b, t, 96)), jnp.float32),
        teacher_logits=jnp.asarray(rng.standard_normal((b, t, 32)), jnp.float32),
        teacher_argmax=argmax,
    )
    loss, m = ttt_loss(draft.params, draft.config, batch, t2d, draft_ids, num_steps=3)
    assert np.isfinite(loss) and set(m) >= {"loss_0", "acc_0", "loss_2", "sim_tau"}
    assert 1.0 <= float(m["sim_tau"]) <= 4.0
    # the loss only looks at response positions whose teacher argmax is in the draft vocabulary
    batch2 = dict(batch, teacher_argmax=jnp.zeros_like(argmax))  # every argmax outside -> nothing to learn
    loss2, _ = ttt_loss(draft.params, draft.config, batch2, t2d, draft_ids, num_steps=3)
    assert float(loss2) == 0.0
    frozen = {k: draft.params[k] for k in ("embed", "d2t")}
    trainable = {k: v for k, v in draft.params.items() if k not in frozen}
    grads = jax.grad(lambda p: ttt_loss({**p, **frozen}, draft.config, batch, t2d, draft_ids, 3)[0])(trainable)
    assert float(jnp.abs(grads["fc"]).sum()) > 0


def _loss_case(arch: str, switches: dict, length: int, seed: int = 1):
    """A 2-layer draft with its own 32-id vocabulary and a batch of 2 x `length` positions."""
    target = random_target(FAMILIES["llama"])
    make_config = mla_draft_config_dict if arch == "mla" else draft_config_dict
    draft = random_draft(target, make_config(target.config, num_layers=2, draft_vocab_size=32, **switches),
                         d2t=np.full(32, 32, np.int64))
    rng = np.random.default_rng(seed)
    b = 2
    in_vocab = rng.integers(32, 64, (b, length))
    batch = dict(
        tokens=jnp.asarray(rng.integers(0, 64, (b, length)), jnp.int32),
        loss_mask=jnp.asarray(rng.random((b, length)) < 0.8),
        aux=jnp.asarray(rng.standard_normal((b, length, 3 * target.config.hidden_size)), jnp.float32),
        teacher_logits=jnp.asarray(rng.standard_normal((b, length, 32)) * 3, jnp.float32),
        teacher_argmax=jnp.asarray(np.where(rng.random((b, length)) < 0.8, in_vocab, rng.integers(0, 64, (b, length))),
                                   jnp.int32))
    draft_ids = jnp.arange(32, 64)
    frozen = {k: draft.params[k] for k in ("embed", "d2t")}
    trainable = {k: v for k, v in draft.params.items() if k not in frozen}

    def loss_and_grads(**options):
        def loss(p):
            return ttt_loss({**p, **frozen}, draft.config, batch, jnp.zeros(64, bool).at[draft_ids].set(True),
                            draft_ids, 3, **options)
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable)

    return loss_and_grads


def _assert_same_training(got, want):
    (loss, metrics), grads = got
    (want_loss, want_metrics), want_grads = want
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert set(metrics) == set(want_metrics)
    for name in metrics:
        np.testing.assert_allclose(float(metrics[name]), float(want_metrics[name]), rtol=1e-5, atol=1e-6, err_msg=name)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch,switches", [("llama", {}), ("mla", SLIDING)], ids=["llama", "mla-sliding3"])
def test_blocks_chunks_and_remat_change_no_loss_or_gradient(arch, switches):
    """Step 0's attention over query and key blocks that divide nothing evenly, the cross-entropy over
    chunks and per-step rematerialisation: the same loss, metrics and gradients as holding it all."""
    run = _loss_case(arch, switches, length=23)
    _assert_same_training(run(memory=TTTMemory(query_block=5, key_block=3, loss_chunk=7)),
                          run(memory=TTTMemory.whole()))


@pytest.mark.parametrize("arch,switches", [("llama", SLIDING), ("mla", {})], ids=["llama-sliding3", "mla"])
def test_context_parallel_training_equals_one_device(arch, switches):
    """Each sequence split over 4 devices (keys all-gathered for step 0, the shifts' rows from the
    neighbours): the one-device loss, metrics and gradients; a split the TTT depth does not fit is
    refused by name."""
    run = _loss_case(arch, switches, length=24)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    want = run(memory=TTTMemory.whole())
    _assert_same_training(run(context=(mesh, "data")), want)
    _assert_same_training(run(context=(mesh, "data"), memory=TTTMemory(query_block=4, key_block=5, loss_chunk=5)), want)
    with pytest.raises(ValueError, match="equal shards of at least 4"):
        _loss_case(arch, switches, length=12)(context=(mesh, "data"))  # 3 positions a shard, depth 3


@pytest.mark.parametrize("arch,switches", [("llama", {}), ("mla", SLIDING)], ids=["llama", "mla-sliding3"])
def test_sequences_packed_in_a_row_train_as_if_alone(arch, switches):
    """Three sequences packed in one row (data.pack, positions from 0 in each): every step's draft
    logits at each sequence's origins equal that sequence's alone in a row of its own (with step 0's
    attention over blocks that straddle the sequences too), and the loss, its per-step metrics and
    the gradients equal the three in separate rows; split over 4 devices, the one-device ones."""
    from eagle3_jax.train.data import Example, pack

    target = random_target(FAMILIES["llama"])
    make_config = mla_draft_config_dict if arch == "mla" else draft_config_dict
    draft = random_draft(target, make_config(target.config, num_layers=2, draft_vocab_size=32, **switches),
                         d2t=np.full(32, 32, np.int64))
    rng = np.random.default_rng(3)
    h3, steps = 3 * target.config.hidden_size, 3
    lengths = (10, 7, 7)
    seqs = [dict(tokens=rng.integers(0, 64, n), loss_mask=np.arange(n) >= 2, aux=rng.standard_normal((n, h3)),
                 teacher_logits=rng.standard_normal((n, 32)) * 3, teacher_argmax=rng.integers(32, 64, n)) for n in lengths]
    tokens, mask, positions = pack([Example(s["tokens"].astype(np.int32), s["loss_mask"]) for s in seqs], 24)
    assert tokens.shape == (1, 24) and list(np.flatnonzero(positions[0] == 0)) == [0, 10, 17]
    starts = (0, 10, 17)

    def laid_out(rows: list[tuple[int, int]], length: int) -> dict:  # (row, start) of each sequence
        out = {k: np.zeros((max(r for r, _ in rows) + 1, length) + np.shape(seqs[0][k])[1:], np.float32)
               for k in ("aux", "teacher_logits")}
        out.update({k: np.zeros(out["aux"].shape[:2], np.int32) for k in ("tokens", "teacher_argmax")})
        out["loss_mask"] = np.zeros(out["aux"].shape[:2], bool)
        for s, (r, at) in zip(seqs, rows):
            for k in out:
                out[k][r, at:at + len(s["tokens"])] = s[k]
        return {k: jnp.asarray(v) for k, v in out.items()}

    packed = dict(laid_out([(0, a) for a in starts], 24), positions=jnp.asarray(positions))
    alone = laid_out([(i, 0) for i in range(3)], 24)
    for memory in (TTTMemory.whole(), TTTMemory(query_block=4, key_block=3, loss_chunk=5)):
        got = ttt_unroll(draft.params, draft.config, packed["aux"], packed["tokens"], steps,
                         positions=packed["positions"], memory=memory)
        want = ttt_unroll(draft.params, draft.config, alone["aux"], alone["tokens"], steps, memory=memory)
        for i, (n, at) in enumerate(zip(lengths, starts)):
            for k in range(steps):
                np.testing.assert_allclose(np.asarray(got[k][0, at:at + n - steps]), np.asarray(want[k][i, :n - steps]),
                                           rtol=1e-5, atol=1e-5, err_msg=f"sequence {i} step {k}")

    draft_ids = jnp.arange(32, 64)
    t2d = jnp.zeros(64, bool).at[draft_ids].set(True)
    frozen = {k: draft.params[k] for k in ("embed", "d2t")}
    trainable = {k: v for k, v in draft.params.items() if k not in frozen}

    def run(batch, **options):
        def loss(p):
            return ttt_loss({**p, **frozen}, draft.config, batch, t2d, draft_ids, steps, **options)
        (total, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable)
        return (total, {k: v for k, v in metrics.items() if k != "sim_tau"}), grads  # the chain walk differs

    want = run(alone)
    _assert_same_training(run(packed), want)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    _assert_same_training(run(packed, context=(mesh, "data")), want)


def test_the_teacher_as_its_hidden_state_and_head_trains_as_its_logits():
    """A batch of the teacher's hidden state with its head at the draft ids (the loss makes the logits
    chunk by chunk) trains exactly as the logits they make; without the head it is refused."""
    target = random_target(FAMILIES["llama"])
    draft = random_draft(target, draft_config_dict(target.config, draft_vocab_size=32), d2t=np.full(32, 32, np.int64))
    rng = np.random.default_rng(4)
    b, t, h = 2, 13, target.config.hidden_size
    draft_ids = jnp.arange(32, 64)
    hidden = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((h, 32)), jnp.float32)
    batch = dict(tokens=jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32), loss_mask=jnp.ones((b, t), bool),
                 aux=jnp.asarray(rng.standard_normal((b, t, 3 * h)), jnp.float32),
                 teacher_argmax=jnp.asarray(rng.integers(32, 64, (b, t)), jnp.int32))
    t2d = jnp.zeros(64, bool).at[draft_ids].set(True)
    memory = TTTMemory(loss_chunk=5)
    got, _ = ttt_loss(dict(draft.params, teacher_head=head), draft.config, dict(batch, teacher_hidden=hidden), t2d,
                      draft_ids, 3, memory=memory)
    want, _ = ttt_loss(draft.params, draft.config, dict(batch, teacher_logits=hidden @ head), t2d, draft_ids, 3,
                       memory=memory)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    with pytest.raises(ValueError, match="teacher_head"):
        ttt_loss(draft.params, draft.config, dict(batch, teacher_hidden=hidden), t2d, draft_ids, 3)


def test_training_memory_is_linear_in_the_sequence():
    """XLA's plan for a training step's gradient at 2x the sequence: at most 2.2x the bytes bounded,
    against about 4x holding the T x T scores whole."""
    target = random_target(FAMILIES["llama"])
    draft = random_draft(target, draft_config_dict(target.config))

    def planned_bytes(length: int, memory: TTTMemory) -> int:
        h = target.config.hidden_size
        batch = dict(tokens=jax.ShapeDtypeStruct((1, length), jnp.int32),
                     loss_mask=jax.ShapeDtypeStruct((1, length), bool),
                     aux=jax.ShapeDtypeStruct((1, length, 3 * h), jnp.float32),
                     teacher_logits=jax.ShapeDtypeStruct((1, length, 64), jnp.float32),
                     teacher_argmax=jax.ShapeDtypeStruct((1, length), jnp.int32))
        loss = jax.grad(lambda p, b: ttt_loss(p, draft.config, b, jnp.ones(64, bool), jnp.arange(64), 3,
                                              memory=memory)[0])
        stats = jax.jit(loss).lower(draft.params, batch).compile().memory_analysis()
        return stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes

    bounded = TTTMemory(query_block=256, key_block=256, loss_chunk=256)
    assert planned_bytes(4096, bounded) <= 2.2 * planned_bytes(2048, bounded)
    assert planned_bytes(4096, TTTMemory.whole()) >= 3 * planned_bytes(2048, TTTMemory.whole())
