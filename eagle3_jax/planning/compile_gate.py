"""The compile gate: every Triton kernel the engine launches, compiled to GPU machine code.

For each bundled full-size configuration (`tests/data`: Kimi-K2.5 int4 and MXFP4, DeepSeek-V3 FP8,
MiniMax-M2.5 FP8, Llama-3.1-8B, each with its EAGLE-3 draft) on its documented meshes (Kimi-K2.5's
include data-parallel attention, data=8 and data=2 x expert=4, where attention runs under
shard_map on each device's rows), in the
formats its checkpoints come in plus bfloat16 (and W4A8 for int4), the engine's own programs are
built from shapes alone (`plan.abstract_setup` / `plan.trace_programs`: the plain decode step,
the speculative step of a chain (T = 4) and of trees (T = 16 and T = KERNEL_MAX_TOKENS = 64), and a
prefill chunk, which runs the MoE kernels' prefill form) at batch 1 and 64 with an 8K cache, and
traced for each architecture of the launch table (tracing only: nothing is lowered). Every kernel
launch they make (attention in each form the target and the draft use; fused gate/up and down of
the experts, per device under expert parallelism) is captured with its shapes, constexprs and the
launch parameters the table gave it (`triton_call.capturing`) and compiled from the kernel's source
with the `triton` package (pallas_kernels/isa.py). Identical launches compile once.

Float8 weights are e4m3fnuz on gfx942 (what the engine converts to there) and OCP e4m3fn
elsewhere. Beside the configurations, `EXTRA` adds kernel forms no bundled config reaches: float8
per-channel experts at Kimi-K2.5's per-device expert shapes, MLA and GQA attention over 32- and
64-slot pages (the server's `--page_size`) in bfloat16 and over FP8 KV pages of 16, 32 and 64
slots, and both in a sliding-window draft layer's form.

`representative_cases` is the subset the default test run compiles: each configuration at its
largest launched shape (T = 64, batch 64) on its first mesh, in each of its formats; and the extras.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Callable, Iterator

import jax
import jax.numpy as jnp

from pallas_kernels import launch, triton_call
from pallas_kernels.attention import Fp8Scales
from pallas_kernels.triton_attention import paged_prefix_attention
from pallas_kernels.triton_moe import grouped_matmul, grouped_swiglu

from ..models import attention
from ..runtime.sharding import make_mesh, mesh_context
from ..spec_decode.settings import SpecConfig
from ..weights.quant import QArray, QFormat
from . import memory as plan

if TYPE_CHECKING:
    from pallas_kernels import isa

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "data")
KERNELS = "attention=triton,moe=triton"
TOKENS = (1, 4, 16, attention.KERNEL_MAX_TOKENS)
BATCHES = (1, 64)
CONTEXT = 8192
PREFILL_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """A bundled configuration and the meshes and weight formats it is served with."""

    name: str
    target: str  # file in tests/data
    draft: str | None
    meshes: tuple[tuple[int, int, int], ...]  # (data, tensor, expert)
    quants: tuple[str | None, ...]  # plan.abstract_setup's quant: None = as the checkpoint, "dequantize", "w4a8"


CONFIGS: tuple[GateConfig, ...] = (
    GateConfig("kimi-k2.5-int4", "kimi-k2.5.config.json", "kimi-k2.5-eagle3.draft.json",
               ((1, 1, 8), (1, 2, 4), (1, 8, 1), (8, 1, 1), (2, 1, 4)), (None, "w4a8", "dequantize")),
    GateConfig("kimi-k2.5-int4-mla-draft", "kimi-k2.5.config.json", "kimi-k2.5-eagle3-mla.draft.json",
               ((1, 1, 8), (8, 1, 1)), (None,)),
    GateConfig("kimi-k2.5-mxfp4", "kimi-k2.5-mxfp4.config.json", "kimi-k2.5-eagle3.draft.json",
               ((1, 1, 4), (1, 2, 2), (1, 4, 1)), (None,)),
    GateConfig("deepseek-v3-fp8", "deepseek-v3.config.json", "deepseek-v3-eagle3.draft.json",
               ((1, 1, 8),), (None, "dequantize")),
    GateConfig("minimax-m2.5-fp8", "minimax-m2.5.config.json", "minimax-m2.5-eagle3.draft.json",
               ((1, 1, 4), (1, 2, 2), (1, 4, 1)), (None, "dequantize")),
    GateConfig("llama-3.1-8b", "llama-3.1-8b-instruct.config.json", "llama3.1-8b-eagle3.draft.json",
               ((1, 1, 1),), (None,)),
)


def spec_for(tokens: int) -> SpecConfig | None:
    """The speculation shape that verifies `tokens` per row (1: plain decoding)."""
    return {1: None, 4: SpecConfig(3, 1, 4), 16: SpecConfig(5, 4, 16),
            attention.KERNEL_MAX_TOKENS: SpecConfig(6, 8, attention.KERNEL_MAX_TOKENS)}[tokens]


@dataclasses.dataclass(frozen=True)
class Case:
    """One program of one configuration: what the gate lowers."""

    config: GateConfig
    mesh: tuple[int, int, int]
    quant: str | None
    batch: int
    tokens: int  # new tokens per row; 0 = the prefill chunk program
    program: str  # "decode", "spec_step" or "prefill"

    @property
    def label(self) -> str:
        mesh = ",".join(map(str, self.mesh))
        shape = f"prefill {PREFILL_CHUNK}" if self.program == "prefill" else f"T={self.tokens}"
        return f"{self.config.name} [{mesh}] {self.quant or 'as stored'} B={self.batch} {shape}"


def cases(configs=CONFIGS, tokens=TOKENS, batches=BATCHES) -> Iterator[Case]:
    """The full sweep: every configuration x mesh x format x batch x tokens, plus a prefill chunk."""
    for config in configs:
        for mesh in config.meshes:
            for quant in config.quants:
                for batch in batches:
                    for t in tokens:
                        yield Case(config, mesh, quant, batch, t, "decode" if t == 1 else "spec_step")
                    yield Case(config, mesh, quant, batch, 0, "prefill")


def representative_cases(configs=CONFIGS) -> Iterator[Case]:
    """Each configuration's largest launched shape (T = 64, batch 64) on its first mesh, in each of
    its weight formats."""
    for config in configs:
        for quant in config.quants:
            yield Case(config, config.meshes[0], quant, max(BATCHES), max(TOKENS), "spec_step")


def _fp8_format(arch: str) -> str:
    return "e4m3fnuz" if arch == "gfx942" else "e4m3fn"


def _mesh(shape: tuple[int, int, int]):
    need = shape[0] * shape[1] * shape[2]
    if len(jax.devices()) < need:
        raise RuntimeError(f"mesh {shape} needs {need} devices; on a CPU host set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX starts")
    return make_mesh(*shape, devices=jax.devices()[:need])


def trace_case(case: Case, arch: str) -> None:
    """Trace `case`'s program for `arch` (under `launch.for_arch(arch)` and a capture of its launches)."""
    mesh = _mesh(case.mesh)
    spec = spec_for(case.tokens) if case.program == "spec_step" else None
    draft = os.path.join(DATA, case.config.draft) if case.config.draft and case.program != "decode" else None
    setup = plan.abstract_setup(os.path.join(DATA, case.config.target), draft, mesh, case.batch,
                                CONTEXT, spec, case.quant, kernels=KERNELS, fp8_format=_fp8_format(arch))
    programs = {"decode": ("decode",), "spec_step": ("step",), "prefill": ("prefill",)}[case.program]
    with mesh_context(mesh):
        plan.trace_programs(setup, PREFILL_CHUNK, programs)


# ---- kernel forms no bundled configuration reaches -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Extra:
    """A kernel called directly at given per-device shapes."""

    label: str
    build: Callable[[str], tuple[Callable, tuple]]  # arch -> (function, abstract args)


def _fp8_channel_experts(fnuz: bool, swiglu: bool) -> Callable[[str], tuple[Callable, tuple]]:
    """Float8 per-output-channel experts at Kimi-K2.5's expert-parallel shapes (48 local experts,
    hidden 7168, intermediate 2048, batch 64 x T 64 x top-8 assignments)."""
    def build(arch: str):
        sds = jax.ShapeDtypeStruct
        experts, hidden, inter, rows = 48, 7168, 2048, 64 * 64 * 8
        k, n = (hidden, inter) if swiglu else (inter, hidden)
        fmt = QFormat("fp8_channel", (0, 1), "float32", fnuz=fnuz)

        def weight():
            return QArray(sds((experts, k, n), fmt.values_dtype), sds((experts, 1, n), jnp.float32), fmt)

        x, groups = sds((rows, k), jnp.bfloat16), sds((experts,), jnp.int32)
        if swiglu:
            return (lambda x, wg, wu, g: grouped_swiglu(x, wg, wu, g)), (x, weight(), weight(), groups)
        return (lambda x, w, g: grouped_matmul(x, w, g)), (x, weight(), groups)

    return build


def _paged(kind: str, page_size: int, fp8: bool, sliding: bool = False) -> Callable[[str], tuple[Callable, tuple]]:
    """Prefix attention over pages of `page_size` slots (the scheduler's `page_size`; the bundled
    configurations run the default 16) in bfloat16 or FP8 (`kv_cache_dtype="fp8"`: float8 bits and a
    float32 scale per slot per 128 lanes, in the architecture's flavour), an 8K context: Kimi-K2.5's
    MLA (64 heads x T 4) or MiniMax-M2.5's GQA (8 KV heads, 6 x T 64 rows; T 16 over FP8 pages).
    `sliding` (bfloat16 pages): a sliding-window draft layer's form, each token's first slot an input."""
    def build(arch: str):
        sds = jax.ShapeDtypeStruct
        batch, pages, fnuz = 4, CONTEXT // page_size, _fp8_format(arch) == "e4m3fnuz"
        table, lengths = sds((batch, pages), jnp.int32), sds((batch,), jnp.int32)
        heads = 1 if kind == "mla" else 8
        if sliding:
            starts = sds((batch, 4 if kind == "mla" else 64), jnp.int32)
            if kind == "mla":
                return (lambda q, q2, lat, rope, t, n, s: paged_prefix_attention(
                    q, lat, None, 1, t, n, scale=0.1, q2=q2, k2_pool=rope, starts=s)), (
                    sds((batch, 1, 256, 512), jnp.bfloat16), sds((batch, 1, 256, 64), jnp.bfloat16),
                    sds((2, batch * pages, page_size, 1, 512), jnp.bfloat16),
                    sds((2, batch * pages, page_size, 1, 64), jnp.bfloat16), table, lengths, starts)
            kv = sds((2, batch * pages, page_size, 8, 128), jnp.bfloat16)
            return (lambda q, k, v, t, n, s: paged_prefix_attention(q, k, v, 1, t, n, scale=0.1, starts=s)), (
                sds((batch, 8, 6 * 64, 128), jnp.bfloat16), kv, kv, table, lengths, starts)

        def pool(width):
            return sds((2, batch * pages, page_size, heads, width), jnp.uint8 if fp8 else jnp.bfloat16)

        def scales(width):
            return sds((2, batch * pages, page_size, heads, max(width // 128, 1)), jnp.float32)

        if kind == "mla":
            q, q2 = sds((batch, 1, 256, 512), jnp.bfloat16), sds((batch, 1, 256, 64), jnp.bfloat16)
            if not fp8:
                return (lambda q, q2, lat, rope, t, n: paged_prefix_attention(
                    q, lat, None, 1, t, n, scale=0.1, q2=q2, k2_pool=rope)), (q, q2, pool(512), pool(64), table, lengths)
            return (lambda q, q2, lat, rope, ls, rs, t, n: paged_prefix_attention(
                q, lat, None, 1, t, n, scale=0.1, q2=q2, k2_pool=rope, scales=Fp8Scales(ls, k2=rs, fnuz=fnuz))), (
                q, q2, pool(512), pool(64), scales(512), scales(64), table, lengths)
        q = sds((batch, 8, 6 * (16 if fp8 else 64), 128), jnp.bfloat16)
        if not fp8:
            return (lambda q, k, v, t, n: paged_prefix_attention(q, k, v, 1, t, n, scale=0.1)), (
                q, pool(128), pool(128), table, lengths)
        return (lambda q, k, v, ks, vs, t, n: paged_prefix_attention(
            q, k, v, 1, t, n, scale=0.1, scales=Fp8Scales(ks, vs, fnuz=fnuz))), (
            q, pool(128), pool(128), scales(128), scales(128), table, lengths)

    return build


EXTRA: tuple[Extra, ...] = tuple(
    Extra(f"fp8_channel{'_fnuz' if fnuz else ''} experts {'gate/up' if swiglu else 'down'} (Kimi-K2.5 shapes)",
          _fp8_channel_experts(fnuz, swiglu))
    for fnuz in (False, True) for swiglu in (True, False)) + tuple(
    Extra(f"{kind} attention over {page_size}-slot {'FP8' if fp8 else 'bfloat16'} pages", _paged(kind, page_size, fp8))
    for kind in ("mla", "gqa") for fp8 in (False, True) for page_size in ((16, 32, 64) if fp8 else (32, 64))) + tuple(
    Extra(f"{kind} attention of a sliding-window draft layer over 16-slot bfloat16 pages", _paged(kind, 16, False, True))
    for kind in ("mla", "gqa"))


def trace_extra(extra: Extra, arch: str) -> None:
    """Trace `extra` for `arch` (under `launch.for_arch(arch)` and a capture of its launches)."""
    fn, args = extra.build(arch)
    jax.eval_shape(fn, *args)


# ---- the sweep ------------------------------------------------------------------------------------


@dataclasses.dataclass
class GateRow:
    """One distinct kernel launch compiled for one architecture, and every program that makes it."""

    arch: str
    launch: triton_call.JitLaunch
    report: "isa.CompileReport"
    problems: list[str]
    launches: list[str]

    @property
    def kernel(self) -> str:
        return self.launch.name

    @property
    def shape(self) -> str:
        """What sets the compiled code's shape: the launch's constexprs (blocks, widths, flags)."""
        return " ".join(f"{k}={v}" for k, v in self.launch.constexprs if k != "INTERPRETED")

    def as_dict(self) -> dict:
        return {"arch": self.arch, "kernel": self.kernel, "constexprs": {k: v for k, v in self.launch.constexprs},
                "grid": list(self.launch.grid), **self.report.as_row(), "problems": self.problems,
                "passes": not self.problems, "launches": self.launches}


def run_gate(items, archs, progress: Callable[[str], None] = lambda _: None) -> list[GateRow]:
    """Trace every case / extra in `items` for every architecture in `archs`, compile each distinct
    kernel launch once per architecture, and return one row per (architecture, launch)."""
    rows: list[GateRow] = []
    for arch in archs:
        with launch.for_arch(arch):  # JAX's caches cleared once per architecture, not per program
            rows.extend(_gate_arch(items, arch, progress))
    return rows


def _launch_key(captured: triton_call.JitLaunch) -> tuple:
    """What the compiled code depends on: scalars' values only through which of them jax_triton
    folds as the constant 1 (`isa.folded_scalars`)."""
    from pallas_kernels import isa

    return (captured.name, captured.signature, captured.constexprs, captured.num_warps, captured.num_stages,
            isa.folded_scalars(captured))


def _gate_arch(items, arch: str, progress: Callable[[str], None]) -> list[GateRow]:
    """`run_gate` for one architecture (called under its `for_arch`)."""
    from pallas_kernels import isa

    by_key: dict[tuple, GateRow] = {}
    for item in items:
        captured: list[triton_call.JitLaunch] = []
        with triton_call.capturing(captured):
            (trace_case if isinstance(item, Case) else trace_extra)(item, arch)
        for one in captured:
            row = by_key.get(_launch_key(one))
            if row is None:
                report = isa.compile_launch(one, arch)
                row = by_key[_launch_key(one)] = GateRow(arch, one, report, isa.check(report), [])
                progress(f"{arch} {row.kernel} {row.shape}: " + ("ok" if not row.problems else "; ".join(row.problems)))
            if item.label not in row.launches:
                row.launches.append(item.label)
    return list(by_key.values())
