"""`triton.jit` kernels compiled to GPU machine code on any host, from their source.

`compile_launch` takes a launch `triton_call` captured (the kernel, its argument types, its
constexprs, num_warps and num_stages: `triton_call.capturing`, what the compile gate records while
it traces the engine's programs for an architecture) and runs the `triton` package's own pipeline
for that architecture (ttir -> ttgir -> llir -> amdgcn -> hsaco for AMD, ... -> ptx -> cubin for
NVIDIA; both backends, the AMD linker and ptxas ship in the wheel), reading what the GPU would
run: registers, spills, shared memory, occupancy and the matrix instructions used.

The kernel is compiled as jax_triton compiles it when it launches it (`KernelSpecialization.build`
in jax_triton/triton_lib.py, the same rule in 0.3.1 and in 0.4.0 at jax-ml/jax-triton@2e27199;
`jax_triton_specialization` here), since the specialisation changes the code (vector widths of
loads and stores, folded arithmetic) and so its registers and spills:
- every array argument, inputs and outputs, is taken to be 16-byte aligned: jax_triton runs
  Triton's `native_specialize_impl` on a stand-in whose `data_ptr()` is 16, which gives the key
  "D", `backend.parse_attr` turns into `tt.divisibility = 16` on the pointer;
- a scalar argument equal to 1 (`value == 1`, so also True and 1.0) becomes the constexpr 1 and is
  not passed;
- no other scalar gets an attribute: jax_triton specialises them with `data_ptr()` 0 and alignment
  off, so a scalar divisible by 16 gets no `tt.divisibility` (Triton's own launcher would give it
  one; jax_triton does not), and scalar types are as `triton_call` records them.
A bare `triton.compile(ASTSource(fn, signature, constexprs))` assumes none of this (no alignment
known): the code it reads is not what a GPU runs.

`check` turns a report into the compile gate's verdict: a compile error, any spill (scratch,
VGPR or SGPR spills, AGPRs in use: on gfx942 / gfx950 a kernel past the 256 arch VGPRs copies
into AGPRs, a spill in all but name that also drops it to one wave per SIMD; ptxas spill stores
or loads) or shared memory over the architecture's limit fails it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
import types
from typing import Any

from pallas_kernels import launch as launch_table


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


# ---- compile --------------------------------------------------------------------------------------


def _gpu_target(arch: launch_table.Arch):
    from triton.backends.compiler import GPUTarget

    if arch.vendor == "amd":
        return GPUTarget("hip", arch.name, arch.warp_size)
    return GPUTarget("cuda", int(arch.name.removeprefix("sm_")), arch.warp_size)


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


def folded_scalars(launch) -> tuple[str, ...]:
    """The scalar parameters of a captured launch jax_triton folds into the kernel as the constexpr
    1 (those whose value == 1)."""
    return tuple(name for name, value in launch.scalars if value == 1)


def jax_triton_specialization(launch, arch: str) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], Any]]:
    """The signature, constexprs and argument attributes jax_triton compiles the captured `launch`
    with on `arch` (the module docstring's rule, computed as jax_triton computes it: Triton's
    `native_specialize_impl` and the backend's `parse_attr`)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.compiler import make_backend

    backend = make_backend(_gpu_target(launch_table.ARCHS[arch]))
    signature, constexprs = dict(launch.signature), dict(launch.constexprs)
    attrs: dict[tuple[int, ...], Any] = {}
    # keyed by the parameter's index: jax_triton's is among the non-constexpr parameters, the same
    # one here, as triton_call's kernels take their constexprs last
    for index, (name, kind) in enumerate(launch.signature):
        if kind == "constexpr":
            continue
        alignment = 16 if kind.startswith("*") else 0
        stand_in = types.SimpleNamespace(data_ptr=lambda a=alignment: a, dtype=kind.removeprefix("*"))
        _, key = native_specialize_impl(backend, stand_in, False, True, alignment > 0)
        attrs[(index,)] = backend.parse_attr(key)
    for name in folded_scalars(launch):
        signature[name], constexprs[name] = "constexpr", 1
    return signature, constexprs, attrs


def compile_launch(launch, arch: str) -> CompileReport:
    """Compile one captured `triton.jit` launch (`triton_call.JitLaunch`) for `arch` with the
    `triton` package, from its source, specialised as jax_triton specialises it
    (`jax_triton_specialization`); a failure is reported, not raised."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.compiler import ASTSource

    target = launch_table.ARCHS[arch]
    report = CompileReport(launch.name, arch, launch.num_warps, launch.num_stages)
    try:
        signature, constexprs, attrs = jax_triton_specialization(launch, arch)
        source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
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
