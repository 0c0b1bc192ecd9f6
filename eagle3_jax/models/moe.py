"""Mixture-of-experts: routers, routed-expert compute, and expert parallelism.

Routers run in float32. `noaux_tc` (DeepSeek-V3 / Kimi) and MiniMax-M2 score experts with a
sigmoid; the correction bias shifts *which* experts are chosen but the combine weights are the
unbiased scores of the chosen ones, normalised, times `routed_scaling_factor`. DeepSeek first keeps
the `topk_group` best groups (a group's score is the sum of its two best biased scores).

Expert parallelism is explicit. When the program is traced under a mesh (`jax.set_mesh`, which
the Engine, Scheduler and planner do for a sharded Target) whose axes split the expert weights
(experts over `data` x `expert`, their width over `tensor`), the routed experts run under
`shard_map`: every shard sees all tokens (the rows of the other data shards all-gathered; decode
sizes: no all-to-all, which XLA:CPU lacks), computes only the assignments routed to its own
experts with its own slice of each expert's intermediate width, and the partial outputs are
summed in float32 (`psum`, and `psum_scatter` back to each data shard's rows). No shard ever
holds another shard's expert weights. Without a mesh the same local code runs over all experts.

Local expert compute has three forms, chosen from the static shapes (`expert_form`):
- few assignments (small decode and verify steps): gather each assignment's expert matrices in
  their stored (possibly quantized) bytes and run small batched matmuls, so a step reads only the
  experts it routes to;
- many assignments (verify of large batches, prefill): sort them by expert and run three grouped
  matmuls (`lax.ragged_dot`) over the local experts, dequantized inside the op;
- on XLA:CPU, which has no grouped matmul, many assignments over few experts instead run every
  token through every local expert with plain batched matmuls, each output weighted by the
  token's combine weight for that expert (0 where it did not choose it): nothing is gathered,
  sorted or scattered.
When `cfg.kernels` picks the Triton kernels for the MoE (runtime/kernels.py; under "auto", per step by its shapes:
`runs_kernels`), both sizes instead sort the assignments
and run the grouped kernels of pallas_kernels/moe.py: gate and up fused with SiLU, then down, the
weights dequantized in registers; the kernels launch row tiles per assignment, not per expert, so
a small decode step still reads only its routed experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels.moe import layout_error

from ..config.model import ModelConfig
from ..runtime import kernels
from ..runtime.sharding import expert_axes, leaf_partition_spec
from ..weights.quant import PRECISION, QArray, dequantize, expert_matmul, ragged_linear, take
from .layers import swiglu

EXPERT_AXES = {
    "experts_gate": ("experts", "embed", "expert_mlp"),
    "experts_up": ("experts", "embed", "expert_mlp"),
    "experts_down": ("experts", "expert_mlp", "embed"),
}


def route(logits: jax.Array, bias: jax.Array | None, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] float32 -> (combine weights [N, k] float32, expert ids [N, k] int32)."""
    k = cfg.num_experts_per_tok
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        n, e = choice.shape
        grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, e // cfg.n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids.astype(jnp.int32)


# ---- local expert compute ----------------------------------------------------------------------------


def _sorted_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, num_experts: int, mlp) -> jax.Array:
    """Assignments sorted by expert (those outside [0, E) last, in no group), `mlp(rows, group_sizes)`
    -> float32 outputs per sorted row, combined back per token: float32 [N, H]."""
    n, k = ids.shape
    flat_ids = ids.reshape(-1)
    local = (flat_ids >= 0) & (flat_ids < num_experts)
    order = jnp.argsort(jnp.where(local, flat_ids, num_experts), stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(jnp.where(local, flat_ids, num_experts), length=num_experts + 1)[:num_experts]
    y = mlp(x[token_of], group_sizes.astype(jnp.int32))
    coef = jnp.where(local, weights.reshape(-1), 0.0)[order]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(y * coef[:, None])


def grouped_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """x [N, H]; weights/ids [N, k] (ids outside [0, E) are not computed); expert weights
    [E, H, I], [E, H, I], [E, I, H] -> float32 [N, H]."""
    def mlp(xs, group_sizes):
        h = jax.nn.silu(ragged_linear(xs, w_gate, group_sizes)) * ragged_linear(xs, w_up, group_sizes)
        return ragged_linear(h, w_down, group_sizes).astype(jnp.float32)

    return _sorted_experts(x, weights, ids, w_gate.shape[0], mlp)


def kernel_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """`grouped_experts` through the Triton kernels: fused gate/up + SiLU, then down (jax_triton on a
    GPU, Triton's interpreter on a CPU host: pallas_kernels/triton_call.py)."""
    from pallas_kernels.triton_moe import grouped_matmul, grouped_swiglu

    def mlp(xs, group_sizes):
        h = grouped_swiglu(xs, w_gate, w_up, group_sizes)
        return grouped_matmul(h, w_down, group_sizes)

    return _sorted_experts(x, weights, ids, w_gate.shape[0], mlp)


def kernel_unfit(w_gate, w_up, w_down) -> str | None:
    """Why the Triton expert kernels cannot take these (local) weights, or None if they can."""
    for name, w in (("gate", w_gate), ("up", w_up), ("down", w_down)):
        error = layout_error(w, w.shape[-2])
        if error:
            return f"experts {name}: {error}"
    if type(w_gate) is not type(w_up) or getattr(w_gate, "qformat", None) != getattr(w_up, "qformat", None):
        return "gate and up are stored differently, and the fused kernel takes one format"
    return None


def gathered_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """Same result as `grouped_experts`, per assignment on gathered (still quantized) expert weights."""
    num_experts = w_gate.shape[0]
    local = (ids >= 0) & (ids < num_experts)
    safe = jnp.where(local, ids, 0)
    xk = jnp.broadcast_to(x[:, None, :], ids.shape + x.shape[-1:])
    h = jax.nn.silu(expert_matmul(xk, take(w_gate, safe))) * expert_matmul(xk, take(w_up, safe))
    y = expert_matmul(h, take(w_down, safe)).astype(jnp.float32)
    return jnp.einsum("nkh,nk->nh", y, jnp.where(local, weights, 0.0), precision=PRECISION)


def dense_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """Same result as `grouped_experts`: every token through every local expert, the outputs
    combined with each token's weights for the experts it chose (ids outside [0, E) add nothing)."""
    n, e = x.shape[0], w_gate.shape[0]
    local = (ids >= 0) & (ids < e)
    coef = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], jnp.where(local, ids, 0)].add(
        jnp.where(local, weights, 0.0))
    up = lambda w: jnp.einsum("nh,ehi->eni", x, dequantize(w, x.dtype), precision=PRECISION)  # noqa: E731
    h = jax.nn.silu(up(w_gate)) * up(w_up)
    y = jnp.einsum("eni,eih->enh", h, dequantize(w_down, x.dtype), precision=PRECISION).astype(jnp.float32)
    return jnp.einsum("enh,ne->nh", y, coef, precision=PRECISION)


DENSE_MAX_BYTES = 64 * 2**20  # the dense form's intermediate [E, N, I] (float32) at the most


def expert_form(num_tokens: int, num_experts_per_tok: int, w_gate) -> str:
    """"gathered", "dense" or "grouped": the local expert form for `num_tokens` tokens choosing
    `num_experts_per_tok` experts each over local expert weights `w_gate` [E, H, I].

    Gathered while `gathers_experts` says so. Beyond it, on XLA:CPU (whose `lax.ragged_dot` runs
    every row through every expert, after a sort and before a scatter) every token through every
    expert densely costs less while the experts are few: kimi-mini's MoE layer (8 experts, 2 per
    token) alone at 48 / 96 / 192 tokens took 0.43 / 0.74 / 1.82 ms dense against 0.81 / 1.11 /
    2.54 ms grouped; the dense intermediate is bounded by DENSE_MAX_BYTES, and int8-activation
    (W4A8) experts keep their own matmul in the grouped form. Elsewhere grouped.
    """
    num_experts = w_gate.shape[0]
    if gathers_experts(num_tokens * num_experts_per_tok, num_experts):
        return "gathered"
    w4a8 = isinstance(w_gate, QArray) and w_gate.qformat.act == "int8"
    dense_bytes = 4 * num_experts * num_tokens * w_gate.shape[-1]
    if jax.default_backend() == "cpu" and not w4a8 and dense_bytes <= DENSE_MAX_BYTES:
        return "dense"
    return "grouped"


def gathers_experts(num_assignments: int, num_experts: int) -> bool:
    """Whether `num_assignments` (token, expert) pairs over `num_experts` local experts are cheaper
    gathered than grouped.

    Gathering reads one expert's matrices per assignment. A native grouped matmul (GPU, TPU) reads
    each chosen expert once, so gathering pays while the assignments are at most half the experts.
    XLA:CPU has no grouped matmul: `lax.ragged_dot` there runs every row through every expert, and
    gathering stays cheaper up to twice the experts, the limit the CPU serving benchmarks ran
    with (kimi-mini's 8 experts, one MoE layer: 16 assignments 0.24 ms gathered against 0.35 ms
    grouped). Alone, 32 assignments still favoured gathering (0.42 against 0.48 ms; 64: 0.76
    against 0.64), not measured end to end.
    """
    if jax.default_backend() == "cpu":
        return num_assignments <= 2 * num_experts
    return 2 * num_assignments <= num_experts


def local_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate, w_up, w_down,
                  use_kernels: bool = False) -> jax.Array:
    """Routed experts over the experts present in w_*; float32 [N, H]."""
    if use_kernels:
        unfit = kernel_unfit(w_gate, w_up, w_down)
        if unfit is None:
            return kernel_experts(x, weights, ids, w_gate, w_up, w_down)
        kernels.warn_once(f"routed experts keep the XLA path: {unfit}")
    form = expert_form(ids.shape[0], ids.shape[1], w_gate)
    experts = {"gathered": gathered_experts, "dense": dense_experts, "grouped": grouped_experts}[form]
    return experts(x, weights, ids, w_gate, w_up, w_down)


# ---- expert parallelism ------------------------------------------------------------------------------


def _weight_specs(w: dict, mesh) -> dict:
    """PartitionSpecs of the routed-expert weights, as sharding.shard_params placed them."""
    axes = expert_axes(w, EXPERT_AXES, mesh)
    return {name: leaf_partition_spec(axes[name], arr, mesh) for name, arr in w.items()}


def _names(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def expert_parallel(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate, w_up, w_down, mesh,
                    use_kernels: bool = False) -> jax.Array:
    """`local_experts` under shard_map on `mesh`: each shard runs its own experts (and its slice of
    their intermediate width) and the partial outputs are summed in float32.

    Tokens split over `data` (data-parallel attention: each data shard holds its own rows) are
    all-gathered first when the experts are split over `data` too, so every shard sees every
    token; the summed outputs are then psum-scattered back, each data shard keeping its rows. A
    mesh whose `data` axis does not split the experts runs each data shard's rows through its
    replica of them, with no gather."""
    w = {"experts_gate": w_gate, "experts_up": w_up, "experts_down": w_down}
    specs = _weight_specs(w, mesh)
    values_specs = [s.values if isinstance(s, QArray) else s for s in specs.values()]  # scales split alike or not at all
    expert_axes_ = _names(values_specs[0][0])  # the mesh axes splitting the experts, in order
    reduce_axes = tuple(sorted({a for s in values_specs for entry in s for a in _names(entry)}))
    data = mesh.shape.get("data", 1)
    rows = "data" if data > 1 and x.shape[0] % data == 0 else None
    gathers = rows is not None and "data" in reduce_axes
    local_count = w_gate.shape[0] // int(np.prod([mesh.shape[a] for a in expert_axes_]))

    def body(x, weights, ids, wg, wu, wd):
        if gathers:
            x, weights, ids = (jax.lax.all_gather(a, "data", axis=0, tiled=True) for a in (x, weights, ids))
        first = jax.lax.axis_index(expert_axes_) * local_count if expert_axes_ else 0
        y = local_experts(x, weights, ids - first, wg, wu, wd, use_kernels)
        others = tuple(a for a in reduce_axes if not (gathers and a == "data"))
        if others:
            y = jax.lax.psum(y, others)
        return jax.lax.psum_scatter(y, "data", scatter_dimension=0, tiled=True) if gathers else y

    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(P(rows, None), P(rows, None), P(rows, None),
                  specs["experts_gate"], specs["experts_up"], specs["experts_down"]),
        out_specs=P(rows, None), check_vma=False,
    )(x, weights, ids, w_gate, w_up, w_down)


def _expert_mesh():
    """The mesh the program is traced under, when it splits anything; else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(mesh.shape.get(a, 1) == 1 for a in ("expert", "tensor", "data")):
        return None
    return mesh


def runs_kernels(choice: str, assignments: int, w_gate, w_up, w_down) -> bool:
    """Whether a step of `assignments` (tokens x top-k) runs the Triton expert kernels under the
    config's `kernels`: as chosen, or under "auto", on a GPU that measured them, by
    `kernels.moe_kernel_pays` (the full weights: each expert's bytes as stored, int4 or not)."""
    impl = kernels.parse(choice)["moe"]
    if impl != "auto" or not kernels.decided_by_shape("moe"):
        return impl == "triton"
    experts = w_gate.shape[0]
    stored = sum(leaf.size * leaf.dtype.itemsize for w in (w_gate, w_up, w_down) for leaf in jax.tree.leaves(w))
    int4 = isinstance(w_gate, QArray) and w_gate.qformat.fmt == "int4"
    return kernels.moe_kernel_pays(assignments, experts, stored // experts, int4)


def moe_block(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Routed experts (+ shared experts when the model has them) for x [B, T, H]."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    logits = jnp.dot(flat.astype(jnp.float32), p["router"], preferred_element_type=jnp.float32, precision=PRECISION)
    weights, ids = route(logits, p.get("router_bias"), cfg)
    mesh = _expert_mesh()
    experts = (p["experts_gate"], p["experts_up"], p["experts_down"])
    use_kernels = runs_kernels(cfg.kernels, ids.size, *experts)
    if mesh is None:
        out = local_experts(flat, weights, ids, *experts, use_kernels)
    else:
        out = expert_parallel(flat, weights, ids, *experts, mesh, use_kernels)
    out = out.astype(x.dtype)
    if "shared_gate" in p:
        out = out + swiglu(flat, p["shared_gate"], p["shared_up"], p["shared_down"])
    return out.reshape(shape)
