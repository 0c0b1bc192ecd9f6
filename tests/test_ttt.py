"""The training-time test unrolls exactly what inference does k levels deep in a chain."""

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

from eagle3_jax.models.draft import project_features
from eagle3_jax.train.ttt import ttt_loss, ttt_unroll


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
