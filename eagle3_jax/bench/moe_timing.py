"""A device's routed-expert compute timed through the Triton kernels against XLA.

For every token count of `MoeShapes` (decode: batch x T; prefill: chunk sizes) it routes the tokens
uniformly at random to `topk` of `experts` experts, of which the device holds the first
`local_experts` (expert parallelism: Kimi-K2.5 on 8 devices holds 48 of 384), and runs
`eagle3_jax.models.moe.local_experts` with the kernels (fused gate/up + SiLU, then down) and
without (gathered matmuls at decode sizes, ragged_dot above). The weights are random bytes in the
shapes' format. A row's bytes are those of the distinct local experts the tokens hit and the
activations (a lower bound on what either path must read); its FLOPs are 2 x the multiply-adds of
gate, up and down over the local assignments. Kernel and XLA agree when their largest difference is
within MOE_TOLERANCE of the largest output.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..models.moe import kernel_unfit, local_experts
from ..planning.memory import Device
from ..weights.quant import QArray, QFormat
from .kernel_timing import INTERPRET_NOTE, Echo, input_sets, launcher, parse_counts, per_set_ms, row_line, timing

MOE_TOLERANCE = 5e-2  # relative to the largest output
FORMATS = ("bfloat16", "int4", "w4a8", "mxfp4", "fp8_block", "fp8_channel")


@dataclasses.dataclass(frozen=True)
class MoeShapes:
    """One device's routed experts and the token counts to time."""

    hidden: int
    inter: int  # expert intermediate width on the device
    experts: int  # routed experts in the model
    local_experts: int  # held by this device: the first ones
    topk: int  # experts per token
    fmt: str  # the experts' weight format, one of FORMATS (int4 in groups of 32, as Kimi-K2.5)
    tokens: tuple[int, ...]  # tokens per step
    dtype: str = "bfloat16"  # activations
    repeats: int = 20


def moe_shapes(values: Any) -> MoeShapes:
    """The shapes `scripts/bench_kernels.py`'s flags name (`values` holds them as attributes); a
    ValueError naming the flags at fault."""
    tokens = parse_counts(values.moe_tokens, "moe_tokens")
    if values.local_experts > values.experts or values.topk > values.experts:
        raise ValueError("--local_experts and --topk must not exceed --experts")
    return MoeShapes(hidden=values.hidden, inter=values.moe_inter, experts=values.experts,
                     local_experts=values.local_experts, topk=values.topk, fmt=values.moe_format, tokens=tokens,
                     dtype=values.dtype, repeats=values.repeats)


def expert_weight(rng: np.random.Generator, fmt: str, e: int, k: int, n: int) -> Any:
    """Random expert weights [e, k, n] in `fmt`, as the device holds them (random bytes, scales that
    keep the outputs of O(1), float8 bytes all finite)."""
    if fmt == "bfloat16":
        return jnp.asarray(rng.standard_normal((e, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)
    if fmt in ("int4", "w4a8", "mxfp4"):
        values = jnp.asarray(rng.integers(0, 256, (e, k // 2, n), np.uint8))
        if fmt == "mxfp4":
            scales = jnp.asarray(rng.integers(118, 122, (e, k // 32, n), np.uint8))  # E8M0: 2^-9 .. 2^-6
            return QArray(values, scales, QFormat("mxfp4", (32, 1), "uint8"))
        scales = jnp.asarray(np.full((e, k // 32, n), 0.25 / np.sqrt(k), np.float32), jnp.bfloat16)
        return QArray(values, scales, QFormat("int4", (32, 1), "bfloat16", act="int8" if fmt == "w4a8" else "float"))
    # magnitudes below 0x7E: never 0x7F or 0xFF, the only NaN bytes of e4m3fn
    bits = rng.integers(0, 0x7E, (e, k, n), np.uint8) | (rng.integers(0, 2, (e, k, n), np.uint8) << 7)
    values = jnp.asarray(bits.view(ml_dtypes.float8_e4m3fn))
    if fmt == "fp8_block":
        scales = np.full((e, -(-k // 128), -(-n // 128)), 0.01 / np.sqrt(k), np.float32)
        return QArray(values, jnp.asarray(scales), QFormat("fp8_block", (128, 128)))
    scales = np.full((e, 1, n), 0.01 / np.sqrt(k), np.float32)
    return QArray(values, jnp.asarray(scales), QFormat("fp8_channel", (0, 1)))


def expert_weights(shapes: MoeShapes, seed: int = 0) -> tuple:
    """The device's random (gate, up, down) weights; a ValueError when the kernels cannot take them."""
    rng = np.random.default_rng(seed)
    e, h, inter = shapes.local_experts, shapes.hidden, shapes.inter
    ws = tuple(expert_weight(rng, shapes.fmt, e, *shape) for shape in ((h, inter), (h, inter), (inter, h)))
    unfit = kernel_unfit(*ws)
    if unfit:
        raise ValueError(f"the MoE kernels cannot take these shapes ({unfit}); pick --hidden / --moe_inter "
                         "multiples of 32")
    return ws


def routing(shapes: MoeShapes, rng: np.random.Generator, n: int) -> dict:
    """Random routing of `n` tokens: `topk` distinct experts each, weights in [0.1, 1)."""
    ids = np.stack([rng.choice(shapes.experts, shapes.topk, replace=False) for _ in range(n)]).astype(np.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, ids.shape), jnp.float32)
    return dict(weights=weights, ids=jnp.asarray(ids))


def experts_hit(ids: Any, local: int) -> int:
    """The distinct local experts (ids below `local`) that `ids` name."""
    ids = np.asarray(ids)
    return len(set(ids[ids < local].tolist()))


def local_assignments(ids: Any, local: int) -> int:
    """The (token, expert) assignments that go to a local expert."""
    return int((np.asarray(ids) < local).sum())


def max_rel_err(got: jax.Array, want: jax.Array) -> float:
    """The largest absolute difference over the largest output (NaN where either holds one)."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-30))


def moe_header(shapes: MoeShapes, device_name: str, interpret: bool) -> list[str]:
    """The table's title (after a blank line), column names and rule."""
    return [f"\nrouted experts: {shapes.local_experts} of {shapes.experts} on the device, top-{shapes.topk}, "
            f"{shapes.hidden} -> {shapes.inter} -> {shapes.hidden}, {shapes.fmt} weights, {shapes.dtype} activations"
            + (INTERPRET_NOTE if interpret else ""),
            "| tokens | local assignments | experts hit | sets | kernel ms | XLA ms | speedup | MB read | "
            f"kernel GB/s | % of {device_name} peak | max rel err |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]


def moe_line(row: dict) -> str:
    cells = [row["tokens"], row["local_assignments"], row["experts_hit"], row["input_sets"]]
    return row_line(cells, row, row["max_rel_err"])


def _kernel(x, weights, ids, ws):  # the weights are arguments: a closure would bake them into the program
    return local_experts(x, weights, ids, *ws, use_kernels=True)


def _xla(x, weights, ids, ws):
    return local_experts(x, weights, ids, *ws, use_kernels=False)


def moe_rows(shapes: MoeShapes, ws: tuple, device: Device, interpret: bool,
             on_row: Callable[[dict], None] = lambda row: None, echo: Echo = lambda line: None) -> list[dict]:
    """One row per token count over the weights `ws` (`expert_weights`), each passed to `on_row`
    once measured; the table (fractions of `device`'s peaks) goes line by line to `echo`."""
    for line in moe_header(shapes, device.name, interpret):
        echo(line)
    e, h, inter = shapes.local_experts, shapes.hidden, shapes.inter
    expert_bytes = sum(leaf.nbytes for w in ws for leaf in jax.tree.leaves(w)) / e
    rng, rows = np.random.default_rng(1), []

    def bytes_read(one: dict) -> float:  # the distinct local experts hit, and the activations
        return experts_hit(one["ids"], e) * expert_bytes + one["x"].nbytes

    for n in shapes.tokens:
        x = jnp.asarray(rng.standard_normal((n, h), np.float32), shapes.dtype)
        first = dict(x=x, ws=ws, **routing(shapes, rng, n))
        sets = input_sets(bytes_read(first), interpret)
        arg_sets = [first] + [dict(x=x, ws=ws, **routing(shapes, rng, n)) for _ in range(sets - 1)]
        err = max_rel_err(jax.jit(_kernel)(**first), jax.jit(_xla)(**first))
        read = sum(bytes_read(one) for one in arg_sets) / sets
        assignments = sum(local_assignments(one["ids"], e) for one in arg_sets) / sets
        flops = 6 * h * inter * assignments  # gate, up and down: 2 flops per multiply-add
        k_ms, x_ms = per_set_ms(_kernel, arg_sets, shapes.repeats), per_set_ms(_xla, arg_sets, shapes.repeats)
        rows.append(dict(op="moe", format=shapes.fmt, launcher=launcher(interpret), tokens=n,
                         layout="expert" if e < shapes.experts else "replicated",
                         local_assignments=local_assignments(first["ids"], e),
                         experts_hit=experts_hit(first["ids"], e), input_sets=sets,
                         **timing(k_ms, x_ms, read, flops, device.hbm_gbps, device.bf16_tflops),
                         max_rel_err=err, equal=bool(err <= MOE_TOLERANCE)))  # NaN fails
        on_row(rows[-1])
        echo(moe_line(rows[-1]))
    return rows
