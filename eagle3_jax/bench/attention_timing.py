"""Paged prefix attention timed against its XLA reference at one model's per-device shapes.

For every (batch, new tokens T, context) of `AttentionShapes` it builds random page pools and
block tables, runs `pallas_kernels.triton_attention.paged_prefix_attention` and
`paged_prefix_attention_reference` (both jitted; the reference gathers every page of the table),
checks they agree within ATTENTION_TOLERANCE, and times both (`kernel_timing`: each timed program
walks several block tables over distinct pages of one pool). A row counts the bytes the kernel must
read (the prefix's K/V pages) and the multiply-adds x 2 of scores and values. Launches besides the
launch table's (`AttentionShapes.launches`, a sweep) are timed as rows of their own; one that does
not compile is a row with its error and `equal: None`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import default_splits, paged_prefix_attention_reference
from pallas_kernels.launch import AttentionLaunch
from pallas_kernels.triton_attention import paged_prefix_attention

from ..planning.memory import Device
from .kernel_timing import (
    INTERPRET_NOTE,
    Echo,
    input_sets,
    launcher,
    max_abs_err,
    parse_counts,
    per_set_ms,
    row_line,
    timing,
)

ATTENTION_TOLERANCE = 5e-2  # absolute, on outputs of O(1)
SCALE = 0.1  # the softmax scale: small enough that random scores of O(1) leave no row one-hot


@dataclasses.dataclass(frozen=True)
class AttentionShapes:
    """One model's per-device attention shapes and the calls to time: every (batch, T, context)."""

    kind: str  # "mla": one shared latent (+ rope) key per slot; "gqa": K/V per KV head
    heads: int  # query heads on the device
    kv_heads: int  # GQA only
    head_dim: int  # GQA only
    latent: int  # MLA only: kv_lora_rank
    rope: int  # MLA only: qk_rope_head_dim
    page_size: int
    num_splits: int  # 0: the kernel's own choice, as the engine runs it
    dtype: str  # activations, pools and queries
    batches: tuple[int, ...]
    tokens: tuple[int, ...]  # new tokens per row
    contexts: tuple[int, ...]  # committed prefix per row
    # block_rows:num_warps:num_stages:block_slots[:row_parts], timed beside the table's
    launches: tuple[str, ...] = ()
    repeats: int = 20
    # what the per-device shapes stand for: "replicated" (every head, every sequence), "tensor" (the
    # heads split over the devices: Kimi-K2.5 at 8 of 64 heads on 8), "data" (the sequences split)
    layout: str = "replicated"


def parse_launch(text: str) -> AttentionLaunch:
    """An AttentionLaunch from block_rows:num_warps:num_stages:block_slots[:row_parts]; a ValueError
    naming --attention_launches for any other text."""
    try:
        values = [int(part) for part in text.split(":")]
    except ValueError:
        values = []
    if len(values) not in (4, 5):
        raise ValueError(f"--attention_launches: {text!r} is not block_rows:num_warps:num_stages:block_slots "
                         "(four integers, e.g. 32:8:2:32, and optionally :row_parts)")
    rows, warps, stages, slots, parts = values + [1] * (5 - len(values))
    if min(rows, warps, stages, slots, parts) < 1 or rows < 16 or rows & (rows - 1) or slots & (slots - 1) \
            or parts & (parts - 1):
        raise ValueError(f"--attention_launches: {text!r} needs block_rows a power of two >= 16, block_slots and "
                         "row_parts powers of two and positive warps and stages")
    return AttentionLaunch(block_rows=rows, num_warps=warps, num_stages=stages, block_slots=slots,
                           row_parts=parts)


def attention_shapes(values: Any) -> AttentionShapes:
    """The shapes `scripts/bench_kernels.py`'s flags name (`values` holds them as attributes: the
    flags themselves, or a namespace); a ValueError naming the flag whose list is not positive
    integers, or whose launch is not one."""
    batches, tokens = parse_counts(values.batches, "batches"), parse_counts(values.tokens, "tokens")
    contexts = parse_counts(values.contexts, "contexts")
    launches = tuple(values.attention_launches)
    for text in launches:
        parse_launch(text)
    return AttentionShapes(kind=values.kind, heads=values.heads, kv_heads=values.kv_heads, head_dim=values.head_dim,
                           latent=values.latent, rope=values.rope, page_size=values.page_size,
                           num_splits=values.num_splits, dtype=values.dtype, batches=batches, tokens=tokens,
                           contexts=contexts, launches=launches, repeats=values.repeats,
                           layout=getattr(values, "layout", "replicated"))


def attention_bytes(shapes: AttentionShapes, batch: int, context: int) -> int:
    """The prefix's K/V bytes one attention call must read."""
    itemsize = jnp.dtype(shapes.dtype).itemsize
    if shapes.kind == "mla":
        return batch * context * (shapes.latent + shapes.rope) * itemsize
    return 2 * batch * context * shapes.kv_heads * shapes.head_dim * itemsize


def attention_flops(shapes: AttentionShapes, batch: int, t: int, context: int) -> int:
    """Multiply-adds x 2 of scores and values over the prefix (MLA: latent + rope scores, latent values)."""
    if shapes.kind == "mla":
        return 2 * batch * shapes.heads * t * context * (2 * shapes.latent + shapes.rope)
    return 2 * batch * shapes.heads * t * context * 2 * shapes.head_dim


def attention_case(shapes: AttentionShapes, batch: int, t: int, context: int, rng: np.random.Generator,
                   sets: int = 1) -> tuple[tuple, int]:
    """Arguments (q, k_pool, v_pool, tables, lengths, q2, k2_pool) and the bytes one call reads: one
    pool holding `sets` disjoint copies' worth of pages (page 0 unused), and `sets` block tables
    over them (tables [sets, batch, pages per row])."""
    dt = jnp.dtype(shapes.dtype)
    ps = shapes.page_size
    pages_per_row = -(-context // ps)
    num_pages = sets * batch * pages_per_row + 1
    tables = (1 + rng.permutation(sets * batch * pages_per_row)).reshape(sets, batch, pages_per_row).astype(np.int32)
    lengths = np.full((batch,), context, np.int32)
    read = attention_bytes(shapes, batch, context)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dt)

    if shapes.kind == "mla":
        rows = shapes.heads * t
        q, q2 = normal(batch, 1, rows, shapes.latent), normal(batch, 1, rows, shapes.rope)
        k, k2 = normal(1, num_pages, ps, 1, shapes.latent), normal(1, num_pages, ps, 1, shapes.rope)
        return (q, k, None, tables, lengths, q2, k2), read
    g = shapes.heads // shapes.kv_heads
    q = normal(batch, shapes.kv_heads, g * t, shapes.head_dim)
    k, v = (normal(1, num_pages, ps, shapes.kv_heads, shapes.head_dim) for _ in range(2))
    return (q, k, v, tables, lengths, None, None), read


def attention_header(shapes: AttentionShapes, device_kind: str, device_name: str, interpret: bool) -> list[str]:
    """The table's title (after a blank line), column names and rule."""
    swept = " launch |" if shapes.launches else ""
    return [f"\n{shapes.kind} paged prefix attention, {shapes.dtype}, page {shapes.page_size}, {device_kind}"
            + (INTERPRET_NOTE if interpret else ""),
            f"| batch | T | context | splits | sets |{swept} kernel ms | XLA ms | speedup | MB read | kernel GB/s | "
            f"% of {device_name} peak | max err |",
            "|---" * (12 + bool(swept)) + "|"]


def attention_line(row: dict, swept: bool) -> str:
    """A row's table line (a launch that did not compile: its error's first 80 characters)."""
    if "error" in row:
        return f"| {row['batch']} | {row['tokens']} | {row['context']} | {row['launch']}: does not compile " \
               f"({row['error'][:80]}) |"
    cells = [row["batch"], row["tokens"], row["context"], row["splits"], row["input_sets"]]
    return row_line(cells + ([row["launch"]] if swept else []), row, row["max_abs_err"])


def error_text(error: BaseException) -> str:
    """A compile error as one line: its first line, the next one, and how many more there were."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or ["(no message)"]
    more = f" [{len(lines) - 2} more lines]" if len(lines) > 2 else ""
    return " ".join(lines[:1] + [line.lstrip("- ") for line in lines[1:2]]) + more


def attention_rows(shapes: AttentionShapes, device: Device, interpret: bool,
                   on_row: Callable[[dict], None] = lambda row: None, echo: Echo = lambda line: None) -> list[dict]:
    """One row per (batch, T, context) and launch, each passed to `on_row` once measured; the table
    (fractions of `device`'s peaks) goes line by line to `echo`. A launch of the sweep that does not
    compile is a row with its error; the launch table's failing is raised."""
    launches = [("table", None)] + [(text, parse_launch(text)) for text in shapes.launches]
    for line in attention_header(shapes, jax.devices()[0].device_kind, device.name, interpret):
        echo(line)
    form = "mla_attention" if shapes.kind == "mla" else "gqa_attention"
    dv = shapes.latent if shapes.kind == "mla" else shapes.head_dim
    ref = functools.partial(paged_prefix_attention_reference, layer=0, scale=SCALE)
    rows, rng = [], np.random.default_rng(0)
    for batch in shapes.batches:
        for t in shapes.tokens:
            for context in shapes.contexts:
                sets = input_sets(attention_bytes(shapes, batch, context), interpret)
                (q, k, v, tables, lengths, q2, k2), read = attention_case(shapes, batch, t, context, rng, sets)
                heads = 1 if shapes.kind == "mla" else shapes.kv_heads
                arg_sets = [dict(q=q, k_pool=k, v_pool=v, block_table=table, lengths=lengths, q2=q2, k2_pool=k2)
                            for table in tables]
                want = jax.jit(ref)(**arg_sets[0])
                x_ms = per_set_ms(ref, arg_sets, shapes.repeats)
                for name, launch in launches:
                    splits = shapes.num_splits or default_splits(batch, heads, q.shape[2], tables.shape[2], dv,
                                                                 q.dtype.itemsize, launch, form, k.shape[2],
                                                                 k.dtype.itemsize)
                    kernel = functools.partial(paged_prefix_attention, layer=0, scale=SCALE, num_splits=splits,
                                               interpret=interpret, launch=launch)
                    row = dict(op="attention", kind=shapes.kind, layout=shapes.layout, launch=name,
                               launcher=launcher(interpret), batch=batch,
                               tokens=t, context=context, splits=splits, input_sets=sets)
                    try:
                        got = jax.jit(kernel)(**arg_sets[0])
                    except Exception as error:  # a candidate launch Triton refuses: recorded, the sweep goes on
                        if launch is None:
                            raise
                        rows.append(dict(row, error=error_text(error), equal=None))
                    else:
                        err = max_abs_err(got[0], want[0])
                        k_ms = per_set_ms(kernel, arg_sets, shapes.repeats)
                        flops = attention_flops(shapes, batch, t, context)
                        rows.append(dict(row, **timing(k_ms, x_ms, read, flops, device.hbm_gbps, device.bf16_tflops),
                                         max_abs_err=err, equal=bool(err <= ATTENTION_TOLERANCE)))  # NaN fails
                    on_row(rows[-1])
                    echo(attention_line(rows[-1], bool(shapes.launches)))
    return rows
