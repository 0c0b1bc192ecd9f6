"""Which implementation each op runs: the XLA path (the reference) or a Triton kernel.

`load_target(..., kernels=...)` takes one choice for every op ("xla", "triton", "auto") or one per
op ("attention=triton,moe=xla"); "pallas", the name from when the kernels went through Pallas'
Triton lowering, is read as "triton" (said once). It is resolved once, on load, into the canonical
per-op form ("attention=triton,moe=xla") that `ModelConfig.kernels` carries into every program:
target prefill / decode / verify, the scheduler's, and the draft's. An op left at "auto" there (on
a GPU a run has measured) decides per traced layer: attention by its form (MLA or GQA,
`runs_kernel`), the MoE by the step's shapes (`moe_kernel_pays`).

- attention: decode and verify over the committed prefix (pallas_kernels/triton_attention.py),
  target and draft, on any mesh: under `shard_map`, each device over its own rows (data), heads
  (tensor) and pages (models/kernel_attention.py).
- moe: the routed experts' grouped matmuls (pallas_kernels/triton_moe.py), also inside each shard
  of expert parallelism. Weights whose shapes the kernel cannot tile keep the XLA path, with a
  warning naming the weight.

The kernels launch through jax_triton on a GPU and run in Triton's interpreter on a CPU host (far
slower than XLA there: for tests). Either needs packages the engine does not: `jax_triton` on a GPU
(the `rocm` / `cuda` extras), `triton` and `torch` on a CPU host (the `test` extra), `triton` to
trace for a GPU this host does not have (the memory planner). `resolve` checks them on load: a
kernel asked for by name without them is one `MissingExtraError` naming what is missing and the
extra; "auto" keeps XLA instead. "auto" = per op, the path measured fastest on the GPU it runs
on (`AUTO_KERNEL`, `AUTO_BY_SHAPE`): the kernel where a run on that architecture showed it equal to
XLA and not slower at the shapes the engine runs, XLA elsewhere, on CPU, and on GPUs no run has
measured. No GPU has timed these kernels yet, so today "auto" is XLA everywhere.
"""

from __future__ import annotations

import functools
import importlib.util
import logging


from pallas_kernels import launch, triton_call

from .extras import MissingExtraError

OPS = ("attention", "moe")
IMPLEMENTATIONS = ("xla", "triton")
ALIASES = {"pallas": "triton"}  # the kernels' name before they moved from Pallas to Triton proper
CHOICES = IMPLEMENTATIONS + ("auto",)
# What "auto" runs, per architecture (pallas_kernels.launch.ARCHS) and kernel form (launch.FORMS),
# from GPU runs recorded in benchmarks/. A form in AUTO_KERNEL runs its kernel at every shape; a form
# in AUTO_BY_SHAPE decides per traced step (`moe_kernel_pays`); any other form, and every form on an
# architecture not listed, runs XLA. Empty: the Triton kernels have not been timed on a GPU. (The
# Pallas kernels they replaced ran on one H200, benchmarks/notes/2026-11-27-gpu-proof-h200.md:
# attention 1.1-3.2x XLA at Kimi-K2.5's and MiniMax's shapes, the routed experts 1.5-13x on int4
# but slower on small or few experts: the crossovers `moe_kernel_pays` encodes.)
AUTO_KERNEL: dict[str, tuple[str, ...]] = {}
AUTO_BY_SHAPE: dict[str, tuple[str, ...]] = {}
# Experts smaller than this (all three matrices, as stored) run XLA under "auto": the kernels' sort
# and launches cost more than such a step's few microseconds of XLA work.
KERNEL_MIN_EXPERT_BYTES = 1 << 20

log = logging.getLogger("eagle3_jax")


def _implementation(name: str) -> str:
    """`name` with an old alias read as what it names now (said once per process)."""
    if name in ALIASES:
        warn_once(f"kernels: {name!r} is read as {ALIASES[name]!r} (the kernels are Triton kernels now); "
                  f"write {ALIASES[name]!r}")
    return ALIASES.get(name, name)


def parse(kernels: str) -> dict[str, str]:
    """{op: "xla" | "triton" | "auto"} from "triton" or "attention=triton,moe=xla"."""
    usage = (f"kernels {kernels!r} is not supported; use one of {', '.join(CHOICES)} for every op, or per op "
             f"like 'attention=triton,moe=xla' (ops: {', '.join(OPS)})")
    if kernels in CHOICES or kernels in ALIASES:
        return dict.fromkeys(OPS, _implementation(kernels))
    choice = dict.fromkeys(OPS, "xla")
    for part in str(kernels).split(","):
        op, sep, impl = part.strip().partition("=")
        impl = _implementation(impl)
        if not sep or op not in OPS or impl not in CHOICES:
            raise ValueError(usage)
        choice[op] = impl
    return choice


def _forms(op: str) -> tuple[str, ...]:
    return ("mla_attention", "gqa_attention") if op == "attention" else (op,)


def auto_choice(op: str, arch: str) -> str:
    """What "auto" resolves to for `op` on architecture `arch` ("default": a CPU host or an unknown
    GPU): "auto" (each traced layer asks `runs_kernel`) where a run there measured one of the op's
    kernel forms, else "xla"."""
    measured = AUTO_KERNEL.get(arch, ()) + AUTO_BY_SHAPE.get(arch, ())
    return "auto" if any(form in measured for form in _forms(op)) else "xla"


def runs_kernel(kernels: str, form: str) -> bool:
    """Whether an attention layer of kernel `form` ("mla_attention", "gqa_attention") runs its
    Triton kernel under a config's `kernels`: as chosen, or under "auto" where AUTO_KERNEL lists
    the form for the architecture traced for (the MoE's rule: moe.runs_kernels)."""
    impl = parse(kernels)["attention"]
    return impl == "triton" or (impl == "auto" and form in AUTO_KERNEL.get(launch.current_arch(), ()))


def decided_by_shape(form: str) -> bool:
    """Whether "auto" decides kernel `form` per step on the architecture traced for (AUTO_BY_SHAPE)."""
    return form in AUTO_BY_SHAPE.get(launch.current_arch(), ())


def moe_kernel_pays(assignments: int, experts: int, expert_bytes: int, int4: bool) -> bool:
    """Whether the routed experts' kernels beat XLA's path for one step, as measured (AUTO_BY_SHAPE):
    never for experts under KERNEL_MIN_EXPERT_BYTES each; always for int4 experts, which XLA's path
    reads through a dequantization; otherwise once the step routes at least one assignment per
    expert of the model (`assignments` = tokens x top-k, `experts` the model's routed experts, so
    the rule reads the same in every shard of expert parallelism)."""
    if expert_bytes < KERNEL_MIN_EXPERT_BYTES:
        return False
    return int4 or assignments >= experts


def installed(module: str) -> bool:
    """Whether `module` is installed (found, not imported: importing torch takes seconds)."""
    return importlib.util.find_spec(module) is not None


def kernel_requirements(launched_here: bool, gpu: bool, arch: str) -> tuple[tuple[str, ...], str, str]:
    """(modules, extra, what needs them) for the Triton kernels: launched on this host's GPU
    (`jax_triton`, the `rocm` or `cuda` extra by `arch`'s platform), interpreted on this CPU host
    (`triton` and `torch`, the `test` extra), or only traced for a GPU this host does not have
    (`triton`)."""
    if not launched_here:
        return ("triton",), "test", f"tracing the Triton kernels for {arch}"
    if not gpu:
        return ("triton", "torch"), "test", "running the Triton kernels on a CPU host (in Triton's interpreter)"
    platform = launch.ARCHS[arch].platform if arch in launch.ARCHS else "cuda' or 'eagle3-jax[rocm]"
    return ("triton", "jax_triton"), platform, "running the Triton kernels on a GPU (through jax_triton)"


def missing_kernel_modules(launched_here: bool, gpu: bool, arch: str) -> MissingExtraError | None:
    """What running the Triton kernels here lacks (`kernel_requirements`), as the error that says
    so; None when nothing is missing."""
    modules, extra, purpose = kernel_requirements(launched_here, gpu, arch)
    missing = [m for m in modules if not installed(m)]
    if not missing:
        return None
    names = " and ".join(missing)
    return MissingExtraError(f"{purpose} needs {names}, which "
                             f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'eagle3-jax[{extra}]'")


def resolve(kernels: str, on_gpu: bool | None = None, arch: str | None = None) -> str:
    """The canonical per-op form ("attention=xla,moe=triton") of a `kernels` choice on this host
    (`on_gpu` True and `arch`: as on that GPU, for programs planned for one on a host without it).

    A kernel the choice runs needs its packages (`kernel_requirements`): where one is missing, a
    kernel asked for by name raises `MissingExtraError` (the one line a script prints), and "auto"
    keeps XLA, said once."""
    requested = parse(kernels)
    gpu = triton_call.on_gpu() if on_gpu is None else on_gpu
    arch = launch.current_arch() if arch is None else arch
    choice = {op: (auto_choice(op, arch) if gpu else "xla") if impl == "auto" else impl
              for op, impl in requested.items()}
    if any(impl != "xla" for impl in choice.values()):
        # on_gpu=True names a GPU the programs are planned for: traced here, launched there
        missing = missing_kernel_modules(launched_here=not on_gpu, gpu=gpu, arch=arch)
        if missing is not None:
            if "triton" in choice.values():
                raise MissingExtraError(f"kernels={kernels!r}: {missing}")
            warn_once(f"kernels: 'auto' keeps XLA: {missing}")
            choice = dict.fromkeys(OPS, "xla")
    return ",".join(f"{op}={choice[op]}" for op in OPS)


def uses(kernels: str, op: str) -> bool:
    """Whether `op` runs its Triton kernel at every shape under a config's `kernels` (canonical or
    plain); an op resolved to "auto" decides per traced layer (`runs_kernel`, moe.runs_kernels)."""
    return parse(kernels)[op] == "triton"


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    """Log a fallback once per process, not once per traced layer."""
    log.warning(message)
