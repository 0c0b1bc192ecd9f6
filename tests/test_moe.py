"""The two routed-expert forms agree, and the router follows the noaux_tc rules."""

import jax
import jax.numpy as jnp
import numpy as np
from random_models import DEEPSEEK

from eagle3_jax.config.model import parse_model_config
from eagle3_jax.models import moe
from eagle3_jax.models.moe import gathered_experts, gathers_experts, grouped_experts, route


def test_gathered_and_grouped_expert_forms_agree():
    rng = np.random.default_rng(0)
    n, k, e, h, i = 5, 3, 8, 16, 12
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((e, i, h)), jnp.float32)
    np.testing.assert_allclose(gathered_experts(x, w, ids, wg, wu, wd), grouped_experts(x, w, ids, wg, wu, wd),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(moe.dense_experts(x, w, ids, wg, wu, wd), grouped_experts(x, w, ids, wg, wu, wd),
                               rtol=1e-5, atol=1e-5)
    # an id outside the local experts (another shard's) adds nothing in any form
    far = ids.at[0, 0].set(e + 3)
    np.testing.assert_allclose(moe.dense_experts(x, w, far, wg, wu, wd), grouped_experts(x, w, far, wg, wu, wd),
                               rtol=1e-5, atol=1e-5)


def test_the_gathered_form_is_for_few_assignments(monkeypatch):
    # XLA:CPU runs lax.ragged_dot through every expert: gathering pays up to twice the experts.
    assert gathers_experts(16, 8) and not gathers_experts(17, 8)
    # A native grouped matmul reads each chosen expert once: gather while at most half the experts.
    monkeypatch.setattr(moe.jax, "default_backend", lambda: "gpu")
    assert gathers_experts(4, 8) and not gathers_experts(5, 8)
    assert gathers_experts(192, 384) and not gathers_experts(256, 384)


def test_xla_cpu_runs_many_assignments_over_few_experts_densely(monkeypatch):
    small = jnp.zeros((8, 16, 12), jnp.float32)
    assert [moe.expert_form(n, 2, small) for n in (8, 9, 4096)] == ["gathered", "dense", "dense"]
    huge = jax.ShapeDtypeStruct((256, 7168, 2048), jnp.bfloat16)  # its [E, N, I] would not fit the bound
    assert moe.expert_form(4096, 8, huge) == "grouped"
    monkeypatch.setattr(moe.jax, "default_backend", lambda: "gpu")
    assert moe.expert_form(9, 2, small) == "grouped"


def test_noaux_tc_routing_by_hand():
    cfg = parse_model_config(dict(DEEPSEEK, n_grouped_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                                  routed_scaling_factor=2.0))
    logits = jnp.asarray([[0.0, 1.0, 2.0, -1.0, 3.0, -2.0, 0.5, 0.0]], jnp.float32)
    bias = jnp.asarray([0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0], jnp.float32)
    s = jax.nn.sigmoid(logits[0])
    # group scores (sum of the two best biased scores): group 0 = s2 + s1, group 1 = (s4 - 1) + s6
    assert float(s[2] + s[1]) > float(s[4] - 1 + s[6])
    weights, ids = route(logits, bias, cfg)
    assert sorted(np.asarray(ids[0]).tolist()) == [1, 2]  # expert 4 is best unbiased but its group loses
    want = np.asarray([s[2], s[1]]) / float(s[2] + s[1]) * 2.0
    np.testing.assert_allclose(np.sort(np.asarray(weights[0])), np.sort(want), rtol=1e-6)
