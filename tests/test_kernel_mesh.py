"""The attention kernel on meshes that split attention (models/kernel_attention.py): under
shard_map each device launches it over its own rows (data), heads (tensor) and pages, a row spread
over the data shards merged across them, and the logits equal one device's XLA path; greedy
speculation through it equals plain decoding. Triton's interpreter runs the kernel here."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, random_draft, random_target
from test_context_parallel import spread_tables
from test_data_parallel import needs_8

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.models.target import forward
from eagle3_jax.runtime.sharding import mesh_context, shard_pages

# (family, mesh, query heads, KV heads): MLA over data / tensor / both / data x expert; GQA with its
# KV heads split over `tensor`, and with fewer KV heads than tensor shards (every head on each)
CASES = [("deepseek_v3", (8, 1, 1), 8, 8), ("deepseek_v3", (1, 8, 1), 8, 8), ("deepseek_v3", (2, 2, 2), 8, 8),
         ("deepseek_v3", (2, 1, 4), 4, 4), ("minimax_m2", (2, 2, 2), 8, 4), ("minimax_m2", (1, 4, 2), 4, 2)]


def with_kernels(target):
    return dataclasses.replace(target, config=dataclasses.replace(target.config, kernels="triton"))


@needs_8
@pytest.mark.parametrize("family,mesh_shape,heads,kv_heads", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}:{c[3]}" for c in CASES])
def test_kernel_attention_on_a_mesh_equals_one_device(family, mesh_shape, heads, kv_heads, kernel_calls):
    """Paged caches split over the data shards, with a spread row beside rows of one shard: decode
    and tree verify logits through the kernel on the mesh equal one device's XLA logits."""
    mesh = e3.make_mesh(*mesh_shape)
    shards, batch, page_size, per_row, spread_pages = mesh_shape[0], 8, 4, 4, 10
    rows = batch // shards
    per_shard = rows * per_row + spread_pages // shards + 2
    raw = {**FAMILIES[family], "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    ref = random_target(raw)
    sharded = with_kernels(random_target(raw, mesh=mesh))
    table = spread_tables(batch, shards, per_shard, per_row, spread_pages) if shards > 1 else None
    if table is None:  # one data shard: every row its own pages
        table = 1 + np.arange(batch * per_row, dtype=np.int32).reshape(batch, per_row)
        per_shard = batch * per_row + 1
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 64, (batch, 12))
    prompt[::rows] = prompt[0]  # a spread row's replicas: the same inputs
    lengths = rng.integers(1, 13, batch)
    lengths[::rows] = 11
    draft = rng.integers(0, 64, (batch, 4))
    draft[::rows] = draft[0]
    tree = np.tril(np.ones((4, 4), bool))
    tree[3, 1:3] = False  # a branch
    tree = jnp.asarray(np.broadcast_to(tree, (batch, 4, 4)))
    step = jax.jit(forward, static_argnums=1)
    prompt, draft, lengths = (jnp.asarray(a, jnp.int32) for a in (prompt, draft, lengths))
    positions = jnp.broadcast_to(jnp.arange(12), (batch, 12))

    def run(target, data_shards):
        k, v = kv_cache.init_pages(target.config, shards * per_shard, page_size, jnp.float32)
        if target.mesh is not None:
            k, v = shard_pages(k, v, target.config, target.mesh)
        cache = kv_cache.paged_view(k, v, table, jnp.zeros(batch, jnp.int32), data_shards=data_shards)
        with mesh_context(target.mesh):
            _, _, cache = step(target.params, target.config, prompt, positions, cache)
            cache = cache.replace(lengths=lengths)
            decode, _, _ = step(target.params, target.config, draft[:, :1], lengths[:, None], cache)
            verify, _, _ = step(target.params, target.config, draft, lengths[:, None] + jnp.asarray([0, 1, 2, 1]), cache,
                                tree)
        return np.asarray(decode), np.asarray(verify)

    want = run(ref, 1)
    got = run(sharded, shards)
    assert "paged_prefix_attention" in kernel_calls
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5 * np.abs(w).max(), rtol=0)


@needs_8
def test_read_slots_of_a_spread_row_come_from_the_shard_holding_them():
    """The draft's tree expansion reads its window slots back (kv_cache.read_slots): a spread row's
    slots on another shard's pages come from that shard, as one device reads them."""
    mesh = e3.make_mesh(4, 1, 2)
    cfg = random_target(FAMILIES["minimax_m2"]).config
    shards, batch, page_size, per_row, spread_pages = 4, 8, 4, 3, 8
    per_shard = batch // shards * per_row + spread_pages // shards + 2
    table = spread_tables(batch, shards, per_shard, per_row, spread_pages)
    rng = np.random.default_rng(0)
    k, v = kv_cache.init_pages(cfg, shards * per_shard, page_size, jnp.float32)
    k = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    slots = jnp.asarray(np.broadcast_to([[13, 14, 15, 16, 17]], (batch, 5)), jnp.int32)
    one = kv_cache.paged_view(k, v, table, jnp.full(batch, 13, jnp.int32))
    want = kv_cache.read_slots(one, 1, slots)
    sk, sv = shard_pages(k, v, cfg, mesh)
    split = kv_cache.paged_view(sk, sv, table, jnp.full(batch, 13, jnp.int32), data_shards=shards)
    with mesh_context(mesh):
        got = jax.jit(kv_cache.read_slots)(split, 1, slots)
    spread = np.asarray(split.spread)
    assert spread.any()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g)[spread], np.asarray(w)[spread])


@needs_8
@pytest.mark.parametrize("family,mesh_shape", [("deepseek_v3", (8, 1, 1)),
                                               pytest.param("minimax_m2", (2, 2, 2), marks=pytest.mark.slow)])
def test_greedy_speculation_through_the_kernel_on_a_mesh_equals_plain(family, mesh_shape, kernel_calls):
    """Target and draft attention through the kernel on a data-parallel mesh (and, slow, a mixed
    one): greedy tree speculation in the Scheduler emits plain decoding's tokens. (The logits on
    every mesh form are compared above.)"""
    mesh = e3.make_mesh(*mesh_shape)
    target = with_kernels(random_target(FAMILIES[family], mesh=mesh))
    draft = random_draft(target)
    prompts = [[1, 5, 9, 2], [3, 4, 5, 6, 7, 8, 9], [7, 7, 1], [2, 4, 6, 8, 10]]
    sp = e3.SamplingParams(max_tokens=8)
    plain = e3.Scheduler(target, max_num_seqs=8, max_seq_len=64, page_size=16)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    spec = e3.Scheduler(target, draft, e3.SpecConfig(3, 2, 6), max_num_seqs=8, max_seq_len=64, page_size=16)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert "paged_prefix_attention" in kernel_calls


@needs_8
def test_engine_programs_on_split_meshes_launch_the_kernel_per_device():
    """Traced for sm_90 (as the compile gate traces them), Kimi-K2.5's speculative step (batch 64,
    T = 4) launches the MLA kernel on each device's own share: data=8 its 8 rows of 64 heads x 4
    tokens (4 row tiles), tensor=8 all 64 rows of its 8 heads x 4 tokens (one tile), data=2 x
    expert=4 its 32 rows."""
    from eagle3_jax.planning import compile_gate as gate
    from pallas_kernels import launch, triton_call

    for mesh, row_tiles, rows in (((8, 1, 1), 4, 8), ((1, 8, 1), 1, 64), ((2, 1, 4), 4, 32)):
        launches = []
        with launch.for_arch("sm_90"), triton_call.capturing(launches):
            gate.trace_case(gate.Case(gate.CONFIGS[0], mesh, None, 64, 4, "spec_step"), "sm_90")
        mla = {l.grid for l in launches if l.name == "eagle3_paged_prefix_attention_mla"}
        assert {grid[:2] for grid in mla} == {(row_tiles, rows)}, (mesh, mla)
