"""How many times the Triton kernels read what they must: each launch's global-memory loads, counted
under Triton's interpreter (`pallas_kernels.traffic`), over the least its contract reads
(`traffic.attention_minimum` / `traffic.moe_minimum`), at a model's per-device shapes and with each
architecture's launch-table entry. A ratio of 1 reads every byte once; what is above it is re-read
(a KV page once per row tile, an activation row once per column tile) or read and masked away.

Counting needs no GPU and times nothing: the interpreter runs the very kernel a GPU runs, with the
launch parameters the GPU's table entry gives it, and the loads a program issues do not depend on
where it runs. Kernel splits (attention's KV splits, the MoE's split-K) are the ones a GPU launch
would pick at the represented batch. Rows are per row, so a smaller batch than the represented one
gives the same ratio (the interpreter runs one program after another: slow).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import launch as launch_table
from pallas_kernels import traffic
from pallas_kernels.attention import Fp8Scales, default_splits

from .moe_timing import MoeShapes, expert_weights, routing

OnRow = Callable[[dict], None]
ARCHS = (launch_table.DEFAULT, *launch_table.ARCHS)  # every entry of the launch table


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """Per-device attention shapes: MLA (one latent + rope key per slot, values = the latent) or
    GQA (K and V per KV head)."""

    model: str
    kind: str  # "mla" or "gqa"
    layout: str  # "tensor" (heads split over devices), "data" (sequences split), "replicated"
    heads: int  # query heads on the device
    tokens: int  # new tokens per row (T)
    page_size: int
    fp8: bool
    kv_heads: int = 1  # GQA
    head_dim: int = 128  # GQA
    latent: int = 512  # MLA kv_lora_rank
    rope: int = 64  # MLA qk_rope_head_dim
    batch: int = 64  # the batch the shapes stand for (sets the KV splits)

    @property
    def form(self) -> str:
        return ("mla_attention" if self.kind == "mla" else "gqa_attention") + ("_fp8" if self.fp8 else "")


def kimi_attention_cases() -> list[AttentionCase]:
    """Kimi-K2.5's MLA per device: 8 heads (tensor parallel on 8) and 64 (data-parallel attention),
    T 1 and 4, bfloat16 and FP8 pages of 16 and 64 slots."""
    return [AttentionCase("Kimi-K2.5", "mla", layout, heads, t, page, fp8)
            for layout, heads in (("tensor", 8), ("data", 64)) for t in (1, 4) for fp8 in (False, True)
            for page in (16, 64)]


def minimax_attention_cases() -> list[AttentionCase]:
    """MiniMax-M2.5's GQA (48 query heads over 8 KV heads of 128, data-parallel: all heads on the
    device), T 1 and 4, bfloat16 and FP8 pages of 16 slots."""
    return [AttentionCase("MiniMax-M2.5", "gqa", "data", 48, t, 16, fp8, kv_heads=8)
            for t in (1, 4) for fp8 in (False, True)]


def attention_inputs(case: AttentionCase, batch: int, context: int, rng: np.random.Generator) -> dict:
    """paged_prefix_attention's arguments for `batch` rows of `context` committed slots each (the
    last row one page and a few slots shorter, so a partial page is read), pages shuffled in one
    pool (page 0 unused)."""
    ps = case.page_size
    per_row = -(-context // ps)
    table = (1 + rng.permutation(batch * per_row)).reshape(batch, per_row).astype(np.int32)
    lengths = np.full((batch,), context, np.int32)
    lengths[-1] = max(1, context - ps - 3)
    pages = batch * per_row + 1
    heads = 1 if case.kind == "mla" else case.kv_heads
    rows = (case.heads if case.kind == "mla" else case.heads // case.kv_heads) * case.tokens

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)

    def pool(width):  # [L, pages, slots, heads, width], float8 bits and a scale per 128 lanes, or bfloat16
        if not case.fp8:
            return normal(1, pages, ps, heads, width), None
        bits = rng.integers(0, 0x7E, (1, pages, ps, heads, width), np.uint8) | (
            rng.integers(0, 2, (1, pages, ps, heads, width), np.uint8) << 7)
        scales = rng.uniform(0.5, 1.5, (1, pages, ps, heads, max(width // 128, 1))).astype(np.float32) / 64
        return jnp.asarray(bits), jnp.asarray(scales)

    out = dict(block_table=jnp.asarray(table), lengths=jnp.asarray(lengths))
    if case.kind == "mla":
        (k, ks), (k2, k2s) = pool(case.latent), pool(case.rope)
        out.update(q=normal(batch, 1, rows, case.latent), q2=normal(batch, 1, rows, case.rope), k_pool=k,
                   v_pool=None, k2_pool=k2, scales=Fp8Scales(ks, k2=k2s) if case.fp8 else None)
    else:
        (k, ks), (v, vs) = pool(case.head_dim), pool(case.head_dim)
        out.update(q=normal(batch, heads, rows, case.head_dim), k_pool=k, v_pool=v,
                   scales=Fp8Scales(ks, vs) if case.fp8 else None)
    return out


def attention_launch_key(launch) -> tuple:
    """What of an attention launch decides the loads: its row tile and slots a step (not warps or
    stages)."""
    return launch.block_rows, launch.block_slots


def attention_row(case: AttentionCase, archs: Sequence[str], batch: int, context: int, seed: int = 0) -> dict:
    """One interpreted launch of `case` with the launch-table entry of `archs` (entries that tile
    alike): bytes loaded, the contract's minimum, their ratio, and the bytes per kernel parameter."""
    from pallas_kernels.triton_attention import paged_prefix_attention

    launch = launch_table.launch(case.form, archs[0])
    args = attention_inputs(case, batch, context, np.random.default_rng(seed))
    q = args["q"]
    dv = case.latent if case.kind == "mla" else case.head_dim
    splits = default_splits(case.batch, q.shape[1], q.shape[2], args["block_table"].shape[1], dv, 2, launch,
                            case.form.removesuffix("_fp8"), case.page_size, 1 if case.fp8 else 2)
    with traffic.counting() as launches:
        jax.block_until_ready(paged_prefix_attention(layer=0, scale=0.1, num_splits=splits, interpret=True,
                                                     launch=launch, **args))
    [counted] = launches
    minimum = traffic.attention_minimum(args["q"], args["k_pool"], args["v_pool"], args["block_table"],
                                        args["lengths"], q2=args.get("q2"), k2_pool=args.get("k2_pool"),
                                        scales=args["scales"])
    return dict(op="attention", model=case.model, kind=case.kind, layout=case.layout, heads=case.heads,
                kv_heads=case.kv_heads if case.kind == "gqa" else 1, tokens=case.tokens, page_size=case.page_size,
                pages="fp8" if case.fp8 else "bfloat16", archs=list(archs), launch=dataclasses.asdict(launch),
                represented_batch=case.batch, batch=batch, context=context, splits=splits, grid=list(counted.grid),
                bytes_loaded=counted.bytes_loaded, minimum=minimum, ratio=counted.bytes_loaded / minimum,
                by_argument=counted.by_argument)


def attention_rows(cases: Sequence[AttentionCase], archs: Sequence[str] = ARCHS, batch: int = 2,
                   context: int = 1024, on_row: OnRow = lambda row: None) -> list[dict]:
    """A row per case and distinct launch among `archs`' entries for its form, each passed to
    `on_row` once counted."""
    rows = []
    for case in cases:
        groups: dict[tuple, list[str]] = {}
        for arch in archs:
            groups.setdefault(attention_launch_key(launch_table.launch(case.form, arch)), []).append(arch)
        for named in groups.values():
            rows.append(attention_row(case, named, batch, context))
            on_row(rows[-1])
    return rows


def kimi_moe_shapes(hidden: int = 7168, inter: int = 2048, tokens: Sequence[int] = (64, 256)) -> MoeShapes:
    """Kimi-K2.5's routed experts on one device of eight: 48 of 384, top-8, int4 in groups of 32."""
    return MoeShapes(hidden=hidden, inter=inter, experts=384, local_experts=48, topk=8, fmt="int4",
                     tokens=tuple(tokens))


def sorted_rows(x: np.ndarray, ids: np.ndarray, local: int) -> tuple[jax.Array, jax.Array]:
    """The rows the expert kernels take, as `models.moe._sorted_experts` makes them: every
    (token, expert) assignment, those to a local expert sorted by expert first, and the local
    experts' group sizes."""
    flat = np.asarray(ids).reshape(-1)
    keyed = np.where((flat >= 0) & (flat < local), flat, local)
    order = np.argsort(keyed, kind="stable")
    sizes = np.bincount(keyed, minlength=local + 1)[:local].astype(np.int32)
    return jnp.asarray(np.asarray(x)[order // ids.shape[1]]), jnp.asarray(sizes)


def moe_launch_key(launch, fmt: str) -> tuple:
    """What of a MoE launch decides the loads of `fmt` weights: the row tile, the column tile and
    the format's K step (not warps, stages or split-K)."""
    packed = fmt in ("int4", "w4a8", "mxfp4")
    return launch.block_m, launch.max_block_n, launch.max_packed_k if packed else launch.max_block_k


def moe_rows(shapes: MoeShapes, archs: Sequence[str] = ARCHS, seed: int = 1,
             on_row: OnRow = lambda row: None) -> list[dict]:
    """Per token count and per distinct MoE launch (architectures whose entries tile alike share a
    row): the fused gate/up launch and the down launch, interpreted on the same routing, each row
    passed to `on_row` once counted."""
    from pallas_kernels.triton_moe import grouped_matmul, grouped_swiglu

    w_gate, w_up, w_down = expert_weights(shapes)
    rng, rows = np.random.default_rng(seed), []
    groups: dict[tuple, list[str]] = {}
    for arch in archs:
        groups.setdefault(moe_launch_key(launch_table.launch("moe", arch), shapes.fmt), []).append(arch)
    for n in shapes.tokens:
        x = jnp.asarray(rng.standard_normal((n, shapes.hidden), np.float32), shapes.dtype)
        ids = np.asarray(routing(shapes, rng, n)["ids"])
        xs, sizes = sorted_rows(x, ids, shapes.local_experts)
        for key, named in groups.items():
            launch = launch_table.launch("moe", named[0])
            with traffic.counting() as launches:
                h = jax.block_until_ready(grouped_swiglu(xs, w_gate, w_up, sizes, interpret=True, launch=launch))
                jax.block_until_ready(grouped_matmul(h, w_down, sizes, interpret=True, launch=launch))
            minimums = (traffic.moe_minimum(xs, (w_gate, w_up), sizes, block_m=launch.block_m),
                        traffic.moe_minimum(h, (w_down,), sizes, block_m=launch.block_m))
            for part, counted, minimum in zip(("gate/up", "down"), launches, minimums):
                rows.append(dict(op="moe", part=part, kernel=counted.kernel, format=shapes.fmt, tokens=n,
                                 routed_rows=int(sizes.sum()), experts_hit=int((sizes > 0).sum()),
                                 hidden=shapes.hidden, inter=shapes.inter, local_experts=shapes.local_experts,
                                 experts=shapes.experts, topk=shapes.topk, archs=named,
                                 launch=dict(zip(("block_m", "max_block_n", "k_step"), key)),
                                 grid=list(counted.grid), bytes_loaded=counted.bytes_loaded, minimum=minimum,
                                 ratio=counted.bytes_loaded / minimum, by_argument=counted.by_argument))
                on_row(rows[-1])
    return rows


MOE_HEADER = ["| tokens | routed rows | experts hit | kernel | archs (block_m / max_block_n / K step) | grid | "
              "MB loaded | MB minimum | ratio |", "|---|---|---|---|---|---|---|---|---|"]
ATTENTION_HEADER = ["| model | layout | heads | T | pages | page | archs | block rows / slots | splits | grid | "
                    "MB loaded | MB minimum | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def moe_line(row: dict) -> str:
    launch = row["launch"]
    return (f"| {row['tokens']} | {row['routed_rows']} | {row['experts_hit']} | {row['part']} | "
            f"{', '.join(row['archs'])} ({launch['block_m']} / {launch['max_block_n']} / {launch['k_step']}) | "
            f"{'x'.join(map(str, row['grid']))} | {row['bytes_loaded'] / 1e6:.2f} | {row['minimum'] / 1e6:.2f} | "
            f"{row['ratio']:.3f} |")


def attention_line(row: dict) -> str:
    launch = row["launch"]
    return (f"| {row['model']} {row['kind']} | {row['layout']} | {row['heads']} | {row['tokens']} | {row['pages']} | "
            f"{row['page_size']} | {', '.join(row['archs'])} | {launch['block_rows']} / {launch['block_slots']} | "
            f"{row['splits']} | {'x'.join(map(str, row['grid']))} | {row['bytes_loaded'] / 1e6:.2f} | "
            f"{row['minimum'] / 1e6:.2f} | {row['ratio']:.3f} |")


def record(argv: Sequence[str], rows: list[dict], notes: Sequence[str] = ()) -> dict:
    """The JSON record: the command, date, machine, versions, notes and the rows."""
    import triton

    return {"argv": list(argv), "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} x{os.cpu_count()}",
            "jax": jax.__version__, "triton": triton.__version__, "launcher": "triton_interpreter",
            "notes": list(notes), "rows": rows}


def markdown(record_: dict) -> list[str]:
    """The record as Markdown: how it was made, then the MoE and attention tables."""
    lines = ["# Kernel loads over the contract's minimum (Triton's interpreter)", "",
             f"`{' '.join(record_['argv'])}` on {record_['machine']}, {record_['date']}, JAX {record_['jax']}, "
             f"triton {record_['triton']}.", ""]
    lines += [f"- {note}" for note in record_["notes"]]
    moe = [r for r in record_["rows"] if r["op"] == "moe"]
    attention = [r for r in record_["rows"] if r["op"] == "attention"]
    if moe:
        first = moe[0]
        lines += ["", f"## MoE: {first['local_experts']} of {first['experts']} experts, top-{first['topk']}, "
                  f"{first['hidden']} -> {first['inter']} -> {first['hidden']}, {first['format']}", ""]
        lines += MOE_HEADER + [moe_line(r) for r in moe]
    if attention:
        lines += ["", "## Paged prefix attention", ""] + ATTENTION_HEADER + [attention_line(r) for r in attention]
    return lines + [""]
