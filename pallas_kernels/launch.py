"""Launch parameters of every kernel, per GPU architecture: the one table the runtime and the
compile gate (`isa.py`, scripts/compile_gate.py) both read.

A kernel asks `launch(form)` at trace time. The architecture is, in order: the one named by an
enclosing `for_arch(name)` (a trace for a GPU this host does not have: the compile gate, the
memory planner), else the first local GPU's (`gfx942` from ROCm's gfx name, `sm_90` from CUDA's compute
capability 9.0), else "default" (a CPU host, where the kernels run interpreted). A GPU the table
does not know gets the default entry and one log line saying so.

Why the numbers differ by architecture (each entry compiled by scripts/compile_gate.py with 0
spills and fitting shared memory at every shape the engine launches, triton 3.9):
- MI300X / MI325X (gfx942) have 64 KB of LDS per workgroup and 512 VGPRs per lane split into 256
  arch VGPRs and AGPRs: past 256 the compiler copies into AGPRs (a spill in all but name) and the
  SIMD runs one wave. MI355X (gfx950) has 160 KB of LDS and the same register file.
- H100 / H200 (sm_90) have 255 registers per thread and 227 KB of shared memory per block.
- Attention keeps a float32 [block_rows, Dv] accumulator in registers for the whole walk over the
  pages (the queries stay in shared memory on sm_90, registers on AMD); MLA's Dv = 512 latent is
  what bounds its rows. Block rows are set for 2-byte operands and values of 512 (MLA) / 128 (GQA)
  lanes; wider values or float32 operands get proportionally fewer rows (attention.block_rows_for).
  MLA tiles are 64 rows at 8 warps over compute-dtype pages, so Kimi-K2.5's 64 heads per device
  at T = 1 (data-parallel attention) read each page once: sm_90 248 registers at two stages (one
  stage spills 276 B), gfx942 216 VGPRs, gfx950 214 at one stage (two put it into AGPRs). 128 rows
  (T = 4 there) do not fit: 128 KB of LDS on gfx942, 75-97 VGPR spills on AMD at 16 warps, and
  more than sm_90's 128 registers a thread at 16 warps. Over FP8 pages 64 rows too (on AMD in two
  row parts: `AttentionLaunch.row_parts`). GQA on AMD runs 8 warps (4 left 14-25 SGPR spills at 64
  rows).
- Pages are walked 16 slots per step (a whole 32- or 64-slot MLA page a step spills on gfx942 and
  gfx950, and a 64-slot page needs 72 KB of LDS on gfx942; at 64 rows 32 slots spill on sm_90).
- The MoE's column tiles are 256 wide: a program re-reads its rows' activations once per column
  tile, and at decode shapes (a few rows per expert) 64-wide tiles read the int4 experts'
  activations as many bytes as half their weights (1.26x the launch's minimum for Kimi-K2.5's
  down projection at 256 tokens; pallas_kernels/traffic.py counts it). Its packed K steps (int4 /
  MXFP4 / W4A8, whole scale groups a step) are 64 on AMD (128 at 256 columns puts gfx942's fused
  MXFP4 gate/up into AGPRs) and 128 on sm_90 at 8 warps and three stages (256 spills the fused
  int4 gate/up); W4A8 cuts its columns by the groups a step (triton_moe._block_n). gfx942's
  float8 K steps are 32 at one stage (64, or two stages, left SGPR spills in the fused float8
  gate/up). Split-K aims at two programs per compute unit.

No entry has been timed on a GPU yet: they are the compile gate's (what compiles without spills
at the engine's shapes), the first thing a GPU run sweeps (scripts/gpu_proof.sh).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging

import jax

log = logging.getLogger("eagle3_jax")


@dataclasses.dataclass(frozen=True)
class Arch:
    """A GPU architecture the kernels are tuned and compiled for."""

    name: str  # "gfx942", "sm_90", ...
    vendor: str  # "amd" or "nvidia"
    platform: str  # JAX lowering platform: "rocm" or "cuda"
    shared_bytes: int  # LDS / shared memory one workgroup may use
    warp_size: int
    max_registers: int  # per lane before spilling (AMD: arch VGPRs; NVIDIA: registers per thread)
    devices: str  # what it is


ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("gfx942", "amd", "rocm", 64 * 1024, 64, 256, "MI300X / MI325X"),
    Arch("gfx950", "amd", "rocm", 160 * 1024, 64, 256, "MI355X"),
    Arch("sm_90", "nvidia", "cuda", 227 * 1024, 32, 255, "H100 / H200"),
    Arch("sm_100", "nvidia", "cuda", 227 * 1024, 32, 255, "B200"),
)}
DEFAULT = "default"
# The architecture a trace for a JAX platform assumes when none is named.
PLATFORM_ARCH = {"rocm": "gfx942", "cuda": "sm_90"}


@dataclasses.dataclass(frozen=True)
class AttentionLaunch:
    """Paged prefix attention: query rows per program (power of two >= 16), KV slots per step of
    the walk (`tile`) and Triton's knobs. `row_parts` (FP8 pages whose lanes fall in several scale
    groups): the kernel's dots are batched over the groups, and Triton spreads a batched dot's warps
    over its batch alone, so with fewer groups than warps the extra warps hold copies; the rows are
    cut into this many parts (of 16 rows or more) that join the batch, one warp each."""

    block_rows: int
    num_warps: int
    num_stages: int
    block_slots: int = 16
    row_parts: int = 1

    def tile(self, page_size: int, itemsize: int = 2) -> int | None:
        """KV slots per step of the walk over pages of `page_size` slots, or None where the compiled
        kernel cannot walk them: the largest power-of-two tile from `block_slots` (set for 2-byte
        pools; 4-byte ones take at most 16, as a 32-slot float32 MLA tile spills on sm_90) down to
        16 that divides the page, else one power-of-two page of at least 16 a step (Triton's shapes
        are powers of two and its smallest dot is 16 wide)."""
        slots = self.block_slots if itemsize <= 2 else min(self.block_slots, 16)
        while slots >= min(self.block_slots, 16):
            if page_size % slots == 0:
                return slots
            slots //= 2
        return page_size if page_size >= 16 and page_size & (page_size - 1) == 0 else None

    def walks(self, page_size: int) -> bool:
        """Whether the compiled kernel can walk pages of `page_size` slots (`tile`; the same for
        every itemsize, as 16 slots is every pool's smallest tile)."""
        return self.tile(page_size) is not None


@dataclasses.dataclass(frozen=True)
class MoeLaunch:
    """Grouped matmul: a row tile (power of two >= 16), the largest column tile and K step tried
    (a smaller one is taken where a weight's shape or scale blocks need it), Triton's knobs."""

    block_m: int
    max_block_n: int
    max_block_k: int
    num_warps: int
    num_stages: int
    # the Triton kernels (triton_moe.py): the K step of packed formats (int4 / MXFP4 / W4A8, whole
    # scale groups a step), and split-K: K splits are added until the launch has about
    # `target_programs` programs (0: never split), each keeping `min_split_steps` K steps or more
    max_packed_k: int = 256
    target_programs: int = 0
    min_split_steps: int = 4


Launch = AttentionLaunch | MoeLaunch
FORMS = ("mla_attention", "gqa_attention", "mla_attention_fp8", "gqa_attention_fp8", "moe")

# (form, architecture) -> launch. "default" is the entry for CPU hosts and unknown GPUs: the most
# conservative one (it compiles without spills on every architecture above: tests/test_compile_gate.py;
# its MoE K step is 32, since 64 at 4 warps spills on sm_90).
TABLE: dict[tuple[str, str], Launch] = {
    ("mla_attention", DEFAULT): AttentionLaunch(block_rows=16, num_warps=4, num_stages=2),
    ("mla_attention", "gfx942"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=2),
    ("mla_attention", "gfx950"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=1),
    ("mla_attention", "sm_90"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=2),
    ("mla_attention", "sm_100"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=2),
    ("gqa_attention", DEFAULT): AttentionLaunch(block_rows=32, num_warps=4, num_stages=2),
    ("gqa_attention", "gfx942"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=2),
    ("gqa_attention", "gfx950"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=2),
    ("gqa_attention", "sm_90"): AttentionLaunch(block_rows=64, num_warps=4, num_stages=2),
    ("gqa_attention", "sm_100"): AttentionLaunch(block_rows=64, num_warps=4, num_stages=2),
    # Over FP8 pages (decoded in registers, the scores and probabilities scaled per lane group:
    # triton_attention.py): 64 rows at two stages on sm_90 / sm_100 (250-251 registers); on AMD 64
    # rows at one stage in two row parts (MLA's 4 groups x 2 parts fill the 8 warps: gfx942 252
    # VGPRs, gfx950 240-244; in one part the 4 groups' warps each hold 64 rows and spill 45-53
    # VGPRs), where two parts spill on sm_90 (200 B).
    ("mla_attention_fp8", DEFAULT): AttentionLaunch(block_rows=16, num_warps=4, num_stages=1),
    ("mla_attention_fp8", "gfx942"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=1, row_parts=2),
    ("mla_attention_fp8", "gfx950"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=1, row_parts=2),
    ("mla_attention_fp8", "sm_90"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=2),
    ("mla_attention_fp8", "sm_100"): AttentionLaunch(block_rows=64, num_warps=8, num_stages=2),
    ("gqa_attention_fp8", DEFAULT): AttentionLaunch(block_rows=16, num_warps=4, num_stages=1),
    ("gqa_attention_fp8", "gfx942"): AttentionLaunch(block_rows=32, num_warps=8, num_stages=1),
    ("gqa_attention_fp8", "gfx950"): AttentionLaunch(block_rows=32, num_warps=8, num_stages=1),
    ("gqa_attention_fp8", "sm_90"): AttentionLaunch(block_rows=32, num_warps=4, num_stages=1),
    ("gqa_attention_fp8", "sm_100"): AttentionLaunch(block_rows=32, num_warps=4, num_stages=1),
    # The MoE (triton_moe.py; see the module docstring). Split-K's target: two programs per compute
    # unit (MI300X / MI325X 304 CUs, MI355X 256, H100 / H200 132 SMs, B200 148).
    ("moe", DEFAULT): MoeLaunch(block_m=16, max_block_n=256, max_block_k=32, num_warps=4, num_stages=2,
                                max_packed_k=64),
    ("moe", "gfx942"): MoeLaunch(block_m=16, max_block_n=256, max_block_k=32, num_warps=4, num_stages=1,
                                 max_packed_k=64, target_programs=608),
    ("moe", "gfx950"): MoeLaunch(block_m=16, max_block_n=256, max_block_k=64, num_warps=4, num_stages=2,
                                 max_packed_k=64, target_programs=512),
    ("moe", "sm_90"): MoeLaunch(block_m=16, max_block_n=256, max_block_k=64, num_warps=8, num_stages=3,
                                max_packed_k=128, target_programs=264),
    ("moe", "sm_100"): MoeLaunch(block_m=16, max_block_n=256, max_block_k=64, num_warps=8, num_stages=3,
                                 max_packed_k=128, target_programs=296),
}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("eagle3_kernel_arch", default=None)


@contextlib.contextmanager
def for_arch(name: str):
    """Trace kernels for architecture `name` (a key of ARCHS) whatever this host has.

    JAX's tracing and lowering caches key on functions and arguments, not on the architecture the
    launch table was read for, so they are cleared on entering and leaving a different one (a
    program traced for gfx942 must not be reused for sm_90, nor an interpreted one for either)."""
    if name not in ARCHS:
        raise ValueError(f"unknown GPU architecture {name!r}; known: {', '.join(ARCHS)}")
    switching = _override.get() != name
    if switching:
        jax.clear_caches()
    token = _override.set(name)
    try:
        yield ARCHS[name]
    finally:
        _override.reset(token)
        if switching:
            jax.clear_caches()


_shape_only: contextvars.ContextVar[bool] = contextvars.ContextVar("eagle3_kernel_shape_only", default=False)


@contextlib.contextmanager
def _set(flag: contextvars.ContextVar[bool]):
    """`flag` on within the block (and back to what it was after)."""
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


@contextlib.contextmanager
def shape_only():
    """Within: kernels stand in as opaque ops of their exact output shapes (`stand_in`). What the
    memory planner compiles to plan a GPU program on a host without the GPU: XLA's memory
    analysis then counts each kernel's outputs and keeps its inputs (packed weights, pools) alive
    to that point, and counts nothing a kernel does not allocate (no dequantized weight copies:
    the kernels dequantize in registers and use no global workspace)."""
    with _set(_shape_only):
        yield


def is_shape_only() -> bool:
    """Whether kernels stand in for themselves now (`shape_only`)."""
    return _shape_only.get()


def stand_in(out_shape, inputs):
    """Buffers of `out_shape` (a ShapeDtypeStruct or a list of them) through an optimization barrier
    that also takes `inputs`: an opaque op that keeps them alive to that point and allocates only
    its outputs."""
    outputs = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), out_shape)
    outputs, _ = jax.lax.optimization_barrier((outputs, list(inputs)))
    return outputs


_scatters_in_place: contextvars.ContextVar[bool] = contextvars.ContextVar("eagle3_scatters_in_place", default=False)


@contextlib.contextmanager
def scatters_in_place():
    """Within: `scatter_in_place` updates stand in as the buffer itself (what the memory planner
    compiles on a host without the GPU; see there)."""
    with _set(_scatters_in_place):
        yield


def scatter_in_place(scatter, buffer, *operands):
    """`scatter(buffer, *operands)`: an update of `buffer` that a GPU's XLA emits in place into
    the donated buffer. Under `scatters_in_place()`, `buffer` itself passed through an
    optimization barrier with the operands: XLA:CPU cannot scatter 16-bit floats, and even a
    scatter of their bits (the KV cache's writes) copies the whole buffer (a stacked KV cache)
    through the bitcasts around it, a cache-sized temp per write that the GPU program never holds."""
    if not _scatters_in_place.get():
        return scatter(buffer, *operands)
    buffer, _ = jax.lax.optimization_barrier((buffer, list(operands)))
    return buffer


def is_overridden() -> bool:
    """Whether an enclosing `for_arch` names the architecture traced for."""
    return _override.get() is not None


# Device kinds that name their architecture, for a device that reports no compute capability.
_KIND_ARCH = (("MI300", "gfx942"), ("MI325", "gfx942"), ("MI355", "gfx950"), ("MI350", "gfx950"),
              ("H100", "sm_90"), ("H200", "sm_90"), ("H800", "sm_90"), ("B200", "sm_100"))


def arch_of_device(device) -> str:
    """The table's name for a JAX GPU device: ROCm's gfx name ("gfx942:sramecc+:xnack-" ->
    "gfx942"), CUDA's compute capability ("9.0" -> "sm_90"), else what its device kind names
    ("AMD Instinct MI300X" -> "gfx942"); the raw capability or kind when none of these."""
    capability = str(getattr(device, "compute_capability", "") or "")
    if capability.startswith("gfx"):
        return capability.split(":")[0]
    major, _, minor = capability.partition(".")
    if major.isdigit():
        return f"sm_{major}{minor or '0'}"
    kind = str(getattr(device, "device_kind", "") or "")
    return next((arch for tag, arch in _KIND_ARCH if tag in kind.upper()), capability or kind)


@functools.lru_cache(maxsize=None)
def _local_gpu_arch() -> str:
    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:
        return DEFAULT
    name = arch_of_device(device)
    if name not in ARCHS:
        log.warning("kernels: GPU architecture %r has no tuned launch parameters; using the "
                    "conservative defaults (known: %s)", name, ", ".join(ARCHS))
        return DEFAULT
    return name


def current_arch() -> str:
    """The architecture kernels are traced for now (see the module docstring)."""
    override = _override.get()
    if override is not None:
        return override
    if jax.default_backend() == "cpu":
        return DEFAULT
    return _local_gpu_arch()


def launch(form: str, arch: str | None = None) -> Launch:
    """The launch parameters of kernel `form` (one of FORMS) on `arch` (default: current_arch())."""
    if form not in FORMS:
        raise ValueError(f"unknown kernel form {form!r}; known: {', '.join(FORMS)}")
    arch = current_arch() if arch is None else arch
    return TABLE.get((form, arch), TABLE[(form, DEFAULT)])
