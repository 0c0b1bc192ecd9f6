"""Kernels compiled to GPU machine code on any host: Pallas -> Triton IR -> AMDGCN / PTX + cubin,
and `triton.jit` kernels from their source (`compile_launch`, launches `triton_call` captured).

The Triton lowering of `pallas_call` builds a Triton IR (TTIR) module per kernel. `capture`
traces and lowers a function deviceless (`lowering_platforms=("rocm",)` or `("cuda",)`) for an
architecture of the launch table and keeps each kernel's module as text, with the num_warps and
num_stages it was launched with. `compile_kernel` then runs the `triton` package's own pipeline
on it for that architecture (ttir -> ttgir -> llir -> amdgcn -> hsaco for AMD, ... -> ptx -> cubin
for NVIDIA; both backends, the AMD linker and ptxas ship in the wheel), starting with the ttir
passes (Pallas hands over an unoptimised module) and reading what the GPU would run:
registers, spills, shared memory, occupancy and the matrix instructions used.

`check` turns a report into the compile gate's verdict: a compile error, any spill (scratch,
VGPR or SGPR spills, AGPRs in use: on gfx942 / gfx950 a kernel past the 256 arch VGPRs copies
into AGPRs, a spill in all but name that also drops it to one wave per SIMD; ptxas spill stores
or loads) or shared memory over the architecture's limit fails it.

Capturing hooks a private JAX function (`lower_jaxpr_to_triton_module`, the same on JAX 0.10 to
0.12); `capture` fails loudly if it ever stops being called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Callable

import jax

from pallas_kernels import launch as launch_table


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One kernel as the Triton lowering emitted it."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int
    operands: tuple[str, ...] = ()  # the kernel's refs, e.g. "bf16[64,1,32,512]" (per-device shapes)
    grid: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        """Identifies the compiled code: equal keys compile to the same machine code."""
        text = f"{self.num_warps}/{self.num_stages}/{self.ttir}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass
class CompileReport:
    """What one kernel compiled to on one architecture (None: not reported by that backend)."""

    kernel: str
    arch: str
    num_warps: int
    num_stages: int
    error: str | None = None
    registers: int | None = None  # AMD: arch VGPRs; NVIDIA: registers per thread
    agprs: int | None = None
    sgprs: int | None = None
    scratch_bytes: int | None = None  # AMD private segment per lane; NVIDIA stack frame
    vgpr_spills: int | None = None
    sgpr_spills: int | None = None
    agpr_copies: int | None = None  # v_accvgpr_write / read instructions (AMD)
    spill_store_bytes: int | None = None  # ptxas
    spill_load_bytes: int | None = None  # ptxas
    shared_bytes: int | None = None  # LDS / shared memory per workgroup
    occupancy: int | None = None  # AMD: waves per SIMD (of 8); NVIDIA: warps per SM (of 64)
    matrix_instructions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # ptxas' remarks (e.g. serialized wgmma)

    def as_row(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["matrix_instructions"] = list(self.matrix_instructions)
        row["notes"] = list(self.notes)
        return row


# ---- capture --------------------------------------------------------------------------------------


@contextlib.contextmanager
def capturing(into: list):
    """Within: every Triton module the Pallas lowering builds is appended to `into`."""
    from jax._src.pallas.triton import lowering

    original = lowering.lower_jaxpr_to_triton_module

    def hook(*args, **kwargs):
        result = original(*args, **kwargs)
        caller = sys._getframe(1).f_locals  # pallas_call_lowering: the launch knobs it resolved
        jaxpr = args[0] if args else kwargs["jaxpr"]
        into.append(TritonModule(name=str(result.module.operation.attributes["sym_name"]).strip('"'),
                                 ttir=result.module.operation.get_asm(),
                                 num_warps=int(caller["num_warps"]), num_stages=int(caller["num_stages"]),
                                 operands=tuple(v.aval.str_short() for v in jaxpr.invars),
                                 grid=tuple(int(g) for g in result.grid)))
        return result

    lowering.lower_jaxpr_to_triton_module = hook
    try:
        yield into
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def capture(fn: Callable, *args, arch: str) -> list[TritonModule]:
    """The Triton modules of every Pallas kernel in `jax.jit(fn)(*args)` (args may be
    ShapeDtypeStructs), traced and lowered for `arch` (a key of launch.ARCHS) without its device."""
    target = launch_table.ARCHS[arch]
    modules: list[TritonModule] = []
    with launch_table.deviceless(arch), capturing(modules):
        # a fresh wrapper per call: jit's caches key on the function, not on the architecture the
        # launch table was read for
        jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=(target.platform,))
    if not modules:
        raise RuntimeError("no Triton module was captured: either the function launches no Pallas kernel or JAX's "
                           "Triton lowering changed (pallas_kernels/isa.py hooks lower_jaxpr_to_triton_module)")
    return modules


# ---- compile --------------------------------------------------------------------------------------


def _gpu_target(arch: launch_table.Arch):
    from triton.backends.compiler import GPUTarget

    if arch.vendor == "amd":
        return GPUTarget("hip", arch.name, arch.warp_size)
    return GPUTarget("cuda", int(arch.name.removeprefix("sm_")), arch.warp_size)


def _stages(module: TritonModule, arch: launch_table.Arch) -> dict[str, Any]:
    """Every stage of Triton's pipeline for `arch`, from the ttir passes on; {stage: IR}, plus the
    pipeline's metadata under "metadata"."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (it warns otherwise)
    from triton._C.libtriton import ir
    from triton.backends.compiler import Language
    from triton.compiler.compiler import make_backend

    backend = make_backend(_gpu_target(arch))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    with tempfile.NamedTemporaryFile("w", suffix=".ttir") as f:
        f.write(module.ttir)
        f.flush()
        mod = ir.parse_mlir_module(f.name, context)
    mod.context = context
    options = backend.parse_options(dict(num_warps=module.num_warps, num_stages=module.num_stages))
    stages: dict[str, Callable] = {}
    backend.add_stages(stages, options, Language.TRITON)
    metadata = {"target": _gpu_target(arch), **options.__dict__}
    out: dict[str, Any] = {}
    for stage, run in stages.items():
        if stage == "cubin":  # run below with ptxas -v, whose log is what we read
            break
        mod = run(mod, metadata)
        out[stage] = mod
    out["metadata"] = metadata
    return out


def _amd_report(report: CompileReport, amdgcn: str) -> None:
    def comment(key: str) -> int | None:  # the "; Key: N" kernel summary the AMD backend prints
        found = re.search(rf"^; {key}: (\d+)", amdgcn, re.MULTILINE)
        return int(found.group(1)) if found else None

    def metadata(key: str) -> int:  # the ".key: N" fields of the code object's metadata
        found = re.search(rf"\.{key}:\s+(\d+)", amdgcn)
        return int(found.group(1)) if found else 0

    report.registers, report.agprs, report.sgprs = comment("NumVgprs"), comment("NumAgprs"), comment("TotalNumSgprs")
    report.scratch_bytes, report.occupancy = comment("ScratchSize"), comment("Occupancy")
    report.vgpr_spills, report.sgpr_spills = metadata("vgpr_spill_count"), metadata("sgpr_spill_count")
    report.agpr_copies = len(re.findall(r"\bv_accvgpr_(?:write|read)", amdgcn))
    report.matrix_instructions = tuple(sorted(set(re.findall(r"\b(v_mfma\w+|v_smfmac\w+)", amdgcn))))


def _nvidia_occupancy(registers: int, shared: int, num_warps: int, arch: launch_table.Arch) -> int:
    """Resident warps per SM (of 64) on Hopper-class SMs: 64K registers allocated per warp in
    units of 256, 228 KB of shared memory (1 KB reserved per block), 32 blocks."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = 65536 // (per_warp * num_warps)
    by_shared = (228 * 1024) // (shared + 1024) if shared else 32
    return max(0, min(64, min(32, by_registers, by_shared) * num_warps))


def _nvidia_report(report: CompileReport, ptx: str, arch: launch_table.Arch) -> None:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    report.matrix_instructions = tuple(sorted(set(re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx))))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        capability = int(arch.name.removeprefix("sm_"))
        run = subprocess.run([get_ptxas(capability).path, "-v", "--regAllocOptLevel=2",  # as Triton runs it
                              f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o",
                              os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode:
        report.error = f"ptxas failed: {log.strip()[-2000:]}"
        return
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    report.registers = int(used.group(1)) if used else None
    report.spill_store_bytes, report.spill_load_bytes = (int(spills.group(1)), int(spills.group(2))) if spills else (0, 0)
    report.scratch_bytes = int(stack.group(1)) if stack else 0
    report.notes = tuple(sorted({line.split("info    :")[-1].strip() for line in log.splitlines()
                                 if "warning" in line.lower() or "serializ" in line.lower()}))
    report.occupancy = _nvidia_occupancy(report.registers or 0, report.shared_bytes or 0, report.num_warps, arch)


def compile_kernel(module: TritonModule, arch: str) -> CompileReport:
    """Compile one captured kernel for `arch` with the `triton` package; a failure is reported,
    not raised."""
    target = launch_table.ARCHS[arch]
    report = CompileReport(module.name, arch, module.num_warps, module.num_stages)
    try:
        stages = _stages(module, target)
    except Exception as e:  # noqa: BLE001  (the compiler's own message is the finding)
        report.error = f"{type(e).__name__}: {str(e).strip()[-2000:]}"
        return report
    report.shared_bytes = int(stages["metadata"].get("shared", 0))
    if target.vendor == "amd":
        _amd_report(report, stages["amdgcn"])
    else:
        _nvidia_report(report, stages["ptx"], target)
    return report


def compile_launch(launch, arch: str) -> CompileReport:
    """Compile one captured `triton.jit` launch (`triton_call.JitLaunch`) for `arch` with the
    `triton` package, from its source; a failure is reported, not raised."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.compiler import ASTSource

    target = launch_table.ARCHS[arch]
    report = CompileReport(launch.name, arch, launch.num_warps, launch.num_stages)
    try:
        source = ASTSource(fn=launch.kernel, signature=dict(launch.signature), constexprs=dict(launch.constexprs))
        compiled = triton.compile(source, target=_gpu_target(target),
                                  options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    except Exception as e:  # noqa: BLE001  (the compiler's own message is the finding)
        report.error = f"{type(e).__name__}: {str(e).strip()[-2000:]}"
        return report
    report.shared_bytes = int(compiled.metadata.shared)
    if target.vendor == "amd":
        _amd_report(report, compiled.asm["amdgcn"])
    else:
        _nvidia_report(report, compiled.asm["ptx"], target)
    return report


def check(report: CompileReport) -> list[str]:
    """Why a compiled kernel fails the gate (empty: it passes)."""
    if report.error:
        return [f"does not compile: {report.error.splitlines()[0][:300]}"]
    target = launch_table.ARCHS[report.arch]
    problems = []
    if report.scratch_bytes:
        problems.append(f"{report.scratch_bytes} B of scratch (spilled to memory)")
    if report.vgpr_spills or report.sgpr_spills:
        problems.append(f"{report.vgpr_spills} VGPR / {report.sgpr_spills} SGPR spills")
    if report.agprs:
        problems.append(f"{report.agprs} AGPRs in use ({report.agpr_copies} AGPR copies): past the 256 arch VGPRs")
    if report.spill_store_bytes or report.spill_load_bytes:
        problems.append(f"ptxas spills: {report.spill_store_bytes} B stores, {report.spill_load_bytes} B loads")
    if report.shared_bytes is not None and report.shared_bytes > target.shared_bytes:
        problems.append(f"{report.shared_bytes} B of shared memory > {target.shared_bytes} B on {target.name}")
    return problems


def triton_version() -> str | None:
    """The installed `triton` package's version, or None when it is absent."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
