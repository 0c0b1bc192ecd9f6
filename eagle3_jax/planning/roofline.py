"""Speculation's payoff predicted before buying: a per-device roofline of plain and speculative steps
at each concurrency.

A decode step on one device costs at least max(bytes it reads / HBM bandwidth, FLOPs it does /
peak FLOP rate). What a step reads and computes follows from the shapes alone (`StepCosts`, from
the same sharded abstract parameters `plan.py` compiles):

- the target's weights, routed experts aside, once per step (the embedding table is gathered by
  row, so it is left out), and 2 FLOPs per weight element per token of the device's share of
  the batch;
- each routed expert only if one of the step's tokens picks it: with k of E experts per token and
  uniform routing, an expert is read with probability 1 - (1 - k/E)^tokens
  (`expected_distinct_experts`); each token's expert FLOPs land on the devices holding its k;
- the KV cache of every sequence's context, once per target pass and once per draft pass, and
  attention FLOPs per (token, context position);
- for a speculative step: the target verifying `num_draft_tokens` tokens per sequence, then the
  draft's passes: one extend over the accepted tokens (`max_accept` + 1 per sequence), `num_steps`
  - 1 expansions of `topk` tokens per sequence, and its LM head once more for the root's children.

A step emits 1 token per sequence without speculation and tau = 1 + sum of the per-position
acceptance rates with it. The roofline is a floor: kernels reach a fraction of peak bandwidth
(`hbm_efficiency`), and every step pays fixed costs (launches, collectives, host work) that a
byte count cannot see (`step_overhead_ms`); both are parameters, 1.0 and 0 by default.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
from jax.sharding import Mesh

from ..runtime.sharding import param_axes
from ..spec_decode.settings import SpecConfig
from ..weights.quant import QArray
from .memory import _cache_device_bytes, _leaf_bytes, _leaf_device_bytes


def expected_distinct_experts(num_experts: int, per_token: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens route to, in expectation, when each picks `per_token` of
    `num_experts` uniformly without repeats: an expert is missed by one token with probability
    1 - k/E, by all independently."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Per-device bytes and FLOPs that decode steps are made of (see the module doc)."""

    dense_bytes: int  # target weights read every step (routed experts and the embedding aside)
    expert_bytes: int  # routed-expert weights this device holds
    dense_elements: int  # weight elements behind dense_bytes (2 FLOPs each per token)
    expert_elements: int  # weight elements of this device's routed experts
    num_experts: int
    experts_per_token: int
    data_shards: int  # the batch is split this many ways (dense work per device shrinks with it)
    kv_bytes_per_token: int  # target KV of one context token of one sequence, on this device
    attention_flops_per_key: int  # per (query token, context position), on this device
    draft_bytes: int = 0  # draft weights read per draft pass (embedding aside)
    draft_head_bytes: int = 0  # the draft's LM head (read once more for the root's children)
    draft_elements: int = 0
    draft_head_elements: int = 0
    draft_kv_bytes_per_token: int = 0
    draft_attention_flops_per_key: int = 0
    held_bytes: int = 0  # every weight this device holds (target + draft, embeddings included)

    def fits(self, hbm_bytes: int, concurrency: int, context: int) -> bool:
        """Whether the weights and `concurrency` sequences' KV of `context` tokens fit `hbm_bytes`
        (the programs' temporaries aside: plan_memory compiles them)."""
        kv = concurrency * context * (self.kv_bytes_per_token + self.draft_kv_bytes_per_token)
        return self.held_bytes + kv <= hbm_bytes


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device's peaks: HBM bandwidth (GB/s) and dense bf16 FLOP rate (TFLOP/s)."""

    name: str
    hbm_gbps: float
    tflops: float
    hbm_efficiency: float = 1.0  # achieved share of peak bandwidth
    step_overhead_ms: float = 0.0  # fixed cost of every step (launches, collectives, host)

    def pass_ms(self, read_bytes: float, flops: float) -> float:
        """One pass's roofline time: the slower of reading and computing."""
        return max(read_bytes / (self.hbm_gbps * self.hbm_efficiency * 1e6), flops / (self.tflops * 1e9))


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One concurrency: plain and speculative step time, TPOT (ms) and output throughput (tok/s)."""

    concurrency: int
    plain_step_ms: float
    spec_step_ms: float
    tau: float
    verify_ms: float  # the spec step's target pass
    draft_ms: float  # the spec step's draft passes
    verify_bound: str  # "memory" or "compute": what limits the verify pass

    @property
    def plain_tpot_ms(self) -> float:
        return self.plain_step_ms

    @property
    def spec_tpot_ms(self) -> float:
        return self.spec_step_ms / self.tau

    @property
    def plain_throughput(self) -> float:
        return 1e3 * self.concurrency / self.plain_step_ms

    @property
    def spec_throughput(self) -> float:
        return 1e3 * self.concurrency * self.tau / self.spec_step_ms

    @property
    def speedup(self) -> float:
        return self.spec_throughput / self.plain_throughput


def mean_accept_length(acceptance: Sequence[float], spec: SpecConfig) -> float:
    """tau of a step that can accept `spec.max_accept` draft tokens, given per-position
    (unconditional) acceptance rates; positions past the profile accept nothing."""
    return 1.0 + sum(acceptance[: spec.max_accept])


def _target_pass(costs: StepCosts, hw: Hardware, tokens: int, batch: int, context: int) -> tuple[float, float]:
    """(bytes, FLOPs) of a target pass over `tokens` tokens of `batch` sequences of `context`."""
    touched = 0.0
    if costs.num_experts:
        touched = expected_distinct_experts(costs.num_experts, costs.experts_per_token, tokens) / costs.num_experts
    read = costs.dense_bytes + costs.expert_bytes * touched + batch * context * costs.kv_bytes_per_token
    share = tokens / costs.data_shards
    flops = 2 * share * costs.dense_elements + tokens * context * costs.attention_flops_per_key
    if costs.num_experts:  # each token's k experts, of which this device holds expert_elements' share
        flops += 2 * tokens * costs.experts_per_token / costs.num_experts * costs.expert_elements
    return read, flops


def _draft_pass(costs: StepCosts, tokens: int, batch: int, context: int) -> tuple[float, float]:
    read = costs.draft_bytes + batch * context * costs.draft_kv_bytes_per_token
    flops = 2 * tokens * costs.draft_elements + tokens * context * costs.draft_attention_flops_per_key
    return read, flops


def predict(costs: StepCosts, hw: Hardware, spec: SpecConfig, acceptance: Sequence[float], concurrency: int,
            context: int) -> Prediction:
    """Plain and speculative (`spec`, per-position `acceptance`) steps of `concurrency` sequences
    whose mean context is `context` tokens, on `hw`."""
    b = concurrency
    plain = hw.pass_ms(*_target_pass(costs, hw, b, b, context)) + hw.step_overhead_ms
    v_read, v_flops = _target_pass(costs, hw, b * spec.num_draft_tokens, b, context)
    verify = hw.pass_ms(v_read, v_flops)
    bound = "memory" if v_read / (hw.hbm_gbps * hw.hbm_efficiency * 1e6) >= v_flops / (hw.tflops * 1e9) else "compute"
    draft = hw.pass_ms(*_draft_pass(costs, b * (spec.max_accept + 1), b, context))
    draft += (spec.num_steps - 1) * hw.pass_ms(*_draft_pass(costs, b * spec.topk, b, context))
    draft += hw.pass_ms(costs.draft_head_bytes, 2 * b * costs.draft_head_elements)
    return Prediction(concurrency=b, plain_step_ms=plain, spec_step_ms=verify + draft + hw.step_overhead_ms,
                      tau=mean_accept_length(acceptance, spec), verify_ms=verify, draft_ms=draft, verify_bound=bound)


# ---- costs from shapes ----------------------------------------------------------------------------


def _leaf_split(leaf, axes, mesh: Mesh) -> tuple[int, int]:
    """(bytes, weight elements) of `leaf` held by one device."""
    held = _leaf_device_bytes(leaf, axes, mesh)
    return held, math.prod(leaf.shape) * held // max(_leaf_bytes(leaf), 1)


def _named_leaves(tree: dict):
    """(name, leaf) of a param tree, quantized weights whole."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QArray))[0]:
        yield str(getattr(path[-1], "key", "")), leaf


def attention_flops_per_key(cfg, heads: int) -> int:
    """FLOPs one query token spends per context position over all layers, with `heads` heads:
    scores and the weighted sum. MLA decodes in the absorbed form (scores over the latent and the
    rotary part, values in the latent)."""
    if cfg.attention == "mla":
        per_head = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    else:
        per_head = 2 * cfg.head_dim
    return 2 * cfg.num_layers * heads * per_head


def step_costs(setup) -> StepCosts:
    """`StepCosts` of a `plan.AbstractSetup` (batch = the mesh's data size is enough)."""
    cfg, mesh = setup.cfg, setup.mesh
    dense_b = dense_e = expert_b = expert_e = held = 0
    treedef = jax.tree.structure(setup.tparams, is_leaf=lambda x: isinstance(x, QArray))
    axes = treedef.flatten_up_to(param_axes(setup.tparams, cfg, mesh))
    for (name, leaf), ax in zip(_named_leaves(setup.tparams), axes):
        b, e = _leaf_split(leaf, ax, mesh)
        held += b
        if name == "embed":
            continue
        if name.startswith("experts_"):
            expert_b, expert_e = expert_b + b, expert_e + e
        else:
            dense_b, dense_e = dense_b + b, dense_e + e
    tensor, data = mesh.shape.get("tensor", 1), mesh.shape.get("data", 1)
    heads = cfg.num_heads // tensor if cfg.num_heads % tensor == 0 else cfg.num_heads
    slots = setup.batch * setup.tcache.k.shape[2]
    kv = _cache_device_bytes(setup.tcache, mesh) // slots
    costs = dict(dense_bytes=dense_b, expert_bytes=expert_b, dense_elements=dense_e, expert_elements=expert_e,
                 num_experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok, data_shards=data,
                 kv_bytes_per_token=kv, attention_flops_per_key=attention_flops_per_key(cfg, heads) // data)
    if setup.dcfg is not None:
        draft_b = draft_e = head_b = head_e = 0
        for name, leaf in _named_leaves(setup.dparams):
            b = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(leaf))
            held += b
            if name in ("embed", "d2t"):
                continue
            e = math.prod(leaf.shape)
            draft_b, draft_e = draft_b + b, draft_e + e
            if name == "lm_head":
                head_b, head_e = b, e
        layers = setup.dcfg.layers
        costs.update(draft_bytes=draft_b, draft_elements=draft_e, draft_head_bytes=head_b, draft_head_elements=head_e,
                     draft_kv_bytes_per_token=_cache_device_bytes(setup.dcache, mesh) // slots,
                     draft_attention_flops_per_key=attention_flops_per_key(layers, layers.num_heads))
    return StepCosts(**costs, held_bytes=held)
