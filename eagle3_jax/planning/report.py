"""What `scripts/plan.py` prints, as text lines and JSON rows: the memory table (one row per mesh and
batch size, a cell per device), why a mesh replicates tensors (the mesh axis that does not divide
their dimension, the bytes that costs and the nearest meshes that divide), why a device says NO
(what is over and by how much), and the roofline prediction's table per mesh and device.

`PlanSettings` holds what is planned (target, draft, speculation, cache length, quantization,
dtype, program path) and runs `plan_memory` / `abstract_setup` for one mesh; everything else here
turns their results into text.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jax.sharding import Mesh

from ..runtime.sharding import split_choices
from ..spec_decode.settings import SpecConfig
from ..weights.params import ParamSpec
from .memory import AbstractSetup, Device, MemoryPlan, abstract_setup, plan_memory
from .roofline import Hardware, Prediction, StepCosts, mean_accept_length, predict, step_costs

AXES = ("data", "tensor", "expert")  # the mesh axes, in the order a mesh shape lists them
UNITS = {"GiB": 2**30, "MiB": 2**20}  # the byte columns' units

MeshShape = tuple[int, int, int]


def parse_meshes(raw: str) -> list[MeshShape]:
    """The meshes of a `--meshes` value: `data,tensor,expert` (or `dxtxe`) entries separated by ';';
    a ValueError naming the first entry that is not three positive integers."""
    out = []
    for item in raw.split(";"):
        parts = [p for p in item.replace("x", ",").split(",") if p]
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--meshes entry {item!r} is not data,tensor,expert (three positive integers)")
        out.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return out


def mesh_text(shape: Sequence[int]) -> str:
    """A mesh shape as the tables write it: `1,1,8`."""
    return ",".join(map(str, shape))


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What is planned on every mesh: a target (+ draft, run with `spec`) at cache length `max_len`,
    its weights quantized as `quant` says ("auto": as the config stores them), unquantized weights
    and caches in `dtype` (the KV cache in float8 with kv_cache_dtype="fp8"), compiled for the XLA
    path or, with `kernels` other than "xla", for the Triton kernels on GPU `arch`."""

    target: str
    draft: str | None
    spec: SpecConfig | None
    max_len: int
    quant: str = "auto"
    dtype: str = "bfloat16"
    kernels: str = "xla"
    arch: str | None = None
    kv_cache_dtype: str = "auto"

    @property
    def _quant(self) -> str | None:
        return None if self.quant == "auto" else self.quant

    def title(self, tau: float, unit_name: str, memory: bool) -> str:
        """The line above everything: what is planned, and (with the memory table) tau, the unit
        and the program path the table is for."""
        program = ""
        if memory:
            program = (f"; program: Triton kernels ({self.kernels}) on {self.arch}, each as an op of its output shapes"
                       if self.kernels != "xla" else "; program: the XLA path")
        return (f"target {self.target}" + (f", draft {self.draft}, spec {self.spec}" if self.draft else "")
                + f", max_len {self.max_len}, quant {self.quant}"
                + (f", KV cache {self.kv_cache_dtype}" if self.kv_cache_dtype != "auto" else "")
                + (f", tau {tau} ({unit_name} per device)" if memory else "") + program)

    def plan(self, mesh: Mesh, batch: int, programs: Sequence[str] = ("step", "decode", "prefill")) -> MemoryPlan:
        """`plan_memory` of these settings on `mesh` at `batch` sequences (compiles `programs`)."""
        return plan_memory(self.target, self.draft, mesh=mesh, batch=batch, max_len=self.max_len,
                           spec=self.spec if self.draft else None, quant=self._quant, dtype=self.dtype,
                           kernels=self.kernels, arch=self.arch, kv_cache_dtype=self.kv_cache_dtype, programs=programs)

    def setup(self, mesh: Mesh) -> AbstractSetup:
        """The shape-only setup the prediction reads its step costs from: one sequence per data
        shard, and a short cache (the prediction scales the KV by its own context)."""
        return abstract_setup(self.target, self.draft, mesh=mesh, batch=mesh.shape["data"], max_len=16,
                              spec=self.spec, quant=self._quant, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype)


# ---- why a mesh replicates, why a device says NO ------------------------------------------------------------


def undivided(specs: dict[str, ParamSpec], mesh_shape: MeshShape, dtype: str) -> dict[tuple[str, str, int], list]:
    """{(mesh axis, logical axis, dimension): [(tensor, bytes replicated per device), ...]} for every
    tensor dimension a mesh axis would split but does not divide (sharding.partition_spec then
    replicates it along that axis, as it does here)."""
    sizes = dict(zip(AXES, mesh_shape))
    out: dict[tuple[str, str, int], list] = {}
    for name, spec in specs.items():
        used: set[str] = set()
        for logical, dim in zip(spec.axes, spec.shape):
            choices = [axes for axes in split_choices(logical, sizes) if not used.intersection(axes)]
            if not choices:
                continue
            split = next((axes for axes in choices if dim % math.prod(sizes[a] for a in axes) == 0), ())
            used.update(split)
            for mesh_axis in choices[0]:
                if mesh_axis not in split and sizes[mesh_axis] > 1:
                    nbytes = spec.nbytes(dtype)
                    out.setdefault((mesh_axis, logical, dim), []).append((name, nbytes - nbytes // sizes[mesh_axis]))
    return out


def dividing_sizes(size: int, dims: Sequence[int]) -> list[int]:
    """The axis sizes nearest `size` (one below, one above, up to 4 x `size`) that divide every one
    of `dims`; 1 is never offered (it splits nothing)."""
    def fits(s: int) -> bool:
        return all(d % s == 0 for d in dims)

    below = next((s for s in range(size - 1, 1, -1) if fits(s)), None)
    above = next((s for s in range(size + 1, 4 * size + 1) if fits(s)), None)
    return [s for s in (below, above) if s is not None]


def replication_notes(specs: dict[str, ParamSpec], mesh_shape: MeshShape, dtype: str, unit: int,
                      unit_name: str) -> list[str]:
    """One line per mesh axis that leaves tensors whole on every device: which tensors, how many bytes,
    and the nearest meshes whose axis divides them."""
    by_axis: dict[str, list] = {}
    for (mesh_axis, logical, dim), tensors in undivided(specs, mesh_shape, dtype).items():
        by_axis.setdefault(mesh_axis, []).append((logical, dim, tensors))
    notes = []
    for mesh_axis, groups in by_axis.items():
        i = AXES.index(mesh_axis)
        size = mesh_shape[i]
        what = ", ".join(f"{logical}={dim} ({len(t)} tensors, e.g. {t[0][0]})" for logical, dim, t in groups)
        replicated = sum(b for _, _, t in groups for _, b in t)
        options = [mesh_text(mesh_shape[:i] + (s,) + mesh_shape[i + 1:])
                   for s in dividing_sizes(size, [dim for _, dim, _ in groups])]
        notes.append(f"mesh {mesh_text(mesh_shape)}: the {mesh_axis} axis ({size}) does not divide {what}; they are "
                     f"replicated on every device instead of split {size} ways, {replicated / unit:.1f} {unit_name} "
                     "more per device" + (f". Meshes that divide: {'; '.join(options)}" if options else ""))
    return notes


def over_note(plan: MemoryPlan, device: Device, unit: int, unit_name: str) -> str | None:
    """Why `plan` does not fit `device`: what is over by how much, and what makes up the need
    (None when it fits)."""
    if plan.fits(device):
        return None
    other = plan.argument_bytes - plan.weight_bytes - plan.kv_bytes
    parts = [f"weights {plan.weight_bytes / unit:.1f}", f"KV {plan.kv_bytes / unit:.2f}"]
    if other > 0:
        parts.append(f"other arguments {other / unit:.2f}")
    parts.append(f"temps {plan.temp_bytes / unit:.1f}")
    return (f"mesh {mesh_text(plan.mesh_shape.values())}, batch {plan.batch}, {device.name}: NO, needs "
            f"{plan.total_bytes / unit:.1f} {unit_name} of {device.hbm_bytes / unit:.1f}, "
            f"{(plan.total_bytes - device.hbm_bytes) / unit:.1f} over (" + ", ".join(parts) + ")")


# ---- the memory table -------------------------------------------------------------------------------------


def memory_head(devices: Sequence[Device]) -> list[str]:
    """The memory table's header and separator lines, a column per device."""
    head = ("| mesh d,t,e | batch | arguments | temps | args+temps | weights | KV | read/step | "
            + " | ".join(f"{d.name} fits / KV tok left / TPOT ms" for d in devices) + " |")
    return [head, "|" + "---|" * (8 + len(devices))]


def memory_row(shape: Sequence[int], plan: MemoryPlan, devices: Sequence[Device], unit: int, tau: float) -> str:
    """One table row: the plan's per-device bytes in `unit`, then per device whether it fits, the KV
    tokens its HBM has left and the roofline TPOT at mean acceptance length `tau`."""
    cells = [f"{'yes' if plan.fits(d) else 'NO'} / {plan.kv_tokens_left(d):,} / {plan.tpot_ms(d, tau):.2f}"
             for d in devices]
    return (f"| {mesh_text(shape)} | {plan.batch} | {plan.argument_bytes / unit:.1f} | {plan.temp_bytes / unit:.1f} | "
            f"{plan.total_bytes / unit:.1f} | {plan.weight_bytes / unit:.1f} | {plan.kv_bytes / unit:.2f} | "
            f"{plan.step_read_bytes / unit:.2f} | " + " | ".join(cells) + " |")


# ---- the prediction ---------------------------------------------------------------------------------------

PREDICTION_HEAD = (("| concurrency | plain step = TPOT ms | plain tok/s | spec step ms (verify + draft) | spec TPOT ms | "
                    "spec tok/s | speedup | verify bound by | weights + KV fit |"),
                   "|---|---|---|---|---|---|---|---|---|")  # the prediction table's header and separator


def format_ms(x: float) -> str:
    """Milliseconds: two decimals, or three significant digits below 1 ms (small models' steps)."""
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def prediction_title(shape: Sequence[int], hw: Hardware, spec: SpecConfig, acceptance: Sequence[float], tau: float,
                     context: int) -> str:
    """The line above one device's prediction table: the device's peaks and the assumptions."""
    return (f"prediction (roofline): mesh {mesh_text(shape)}, {hw.name} ({hw.hbm_gbps:g} GB/s x "
            f"{hw.hbm_efficiency:g}, {hw.tflops:g} bf16 TFLOP/s, step overhead {hw.step_overhead_ms:g} ms), "
            f"{spec}, acceptance {','.join(f'{a:g}' for a in acceptance)} (tau {tau:.2f}), mean context "
            f"{context} tokens")


def prediction_line(p: Prediction, fits: bool) -> str:
    """One concurrency's row of the prediction table."""
    return (f"| {p.concurrency} | {format_ms(p.plain_tpot_ms)} | {p.plain_throughput:,.0f} | "
            f"{format_ms(p.spec_step_ms)} ({format_ms(p.verify_ms)} + {format_ms(p.draft_ms)}) | "
            f"{format_ms(p.spec_tpot_ms)} | {p.spec_throughput:,.0f} | {p.speedup:.2f}x | {p.verify_bound} | "
            f"{'yes' if fits else 'NO'} |")


def prediction_record(shape: Sequence[int], hw: Hardware, spec: SpecConfig, acceptance: Sequence[float], tau: float,
                      context: int, p: Prediction, fits: bool) -> dict:
    """One concurrency's prediction as the JSON output holds it."""
    return {"mesh": list(shape), "device": hw.name, "concurrency": p.concurrency, "context": context,
            "acceptance": list(acceptance), "tau": tau, "spec": str(spec),
            "hbm_efficiency": hw.hbm_efficiency, "step_overhead_ms": hw.step_overhead_ms,
            "plain_tpot_ms": p.plain_tpot_ms, "plain_tok_s": p.plain_throughput,
            "spec_step_ms": p.spec_step_ms, "verify_ms": p.verify_ms, "draft_ms": p.draft_ms,
            "spec_tpot_ms": p.spec_tpot_ms, "spec_tok_s": p.spec_throughput, "speedup": p.speedup,
            "verify_bound": p.verify_bound, "fits": fits}


def prediction_tables(costs: StepCosts, spec: SpecConfig, shape: Sequence[int], devices: Sequence[Device],
                      concurrencies: Sequence[int], acceptance: Sequence[float], context: int,
                      hbm_efficiency: float = 1.0, step_overhead_ms: float = 0.0) -> tuple[list[str], list[dict]]:
    """Per device, plain and speculative decoding predicted at each concurrency from one mesh's
    step costs: the tables' lines (each table after a blank line and its title) and their rows
    as dicts."""
    tau = mean_accept_length(acceptance, spec)
    lines: list[str] = []
    rows: list[dict] = []
    for d in devices:
        hw = Hardware(d.name, d.hbm_gbps, d.bf16_tflops, hbm_efficiency, step_overhead_ms)
        lines += ["", prediction_title(shape, hw, spec, acceptance, tau, context), *PREDICTION_HEAD]
        for c in concurrencies:
            p = predict(costs, hw, spec, acceptance, c, context)
            fits = costs.fits(d.hbm_bytes, c, context)
            lines.append(prediction_line(p, fits))
            rows.append(prediction_record(shape, hw, spec, acceptance, tau, context, p, fits))
    return lines, rows


def predict_mesh(setup: AbstractSetup, shape: Sequence[int], devices: Sequence[Device],
                 concurrencies: Sequence[int], acceptance: Sequence[float], context: int,
                 hbm_efficiency: float = 1.0, step_overhead_ms: float = 0.0) -> tuple[list[str], list[dict]]:
    """`prediction_tables` of the step costs of `setup` (a speculative setup: it needs a draft)."""
    return prediction_tables(step_costs(setup), setup.spec, shape, devices, concurrencies, acceptance, context,
                             hbm_efficiency, step_overhead_ms)
