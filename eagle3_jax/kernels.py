"""Which implementation each op runs: the XLA path (the reference) or a Pallas kernel.

`load_target(..., kernels=...)` takes one choice for every op ("xla", "pallas", "auto") or one per
op ("attention=pallas,moe=xla"). It is resolved once, on load, into the canonical per-op form
("attention=pallas,moe=pallas") that `ModelConfig.kernels` carries into every program: target
prefill / decode / verify, the scheduler's, and the draft's. The ops ask `uses(cfg.kernels, op)`.

- attention: decode and verify over the committed prefix (pallas_kernels/attention.py), target
  and draft. On a mesh that splits the batch or the heads (data or tensor > 1) it keeps the XLA
  path (the kernel has no sharded form yet: the partitioner would gather its operands); asking for
  it there is warned about. An expert-only mesh replicates attention, so the kernel runs there.
- moe: the routed experts' grouped matmuls (pallas_kernels/moe.py), also inside each shard of
  expert parallelism. Weights whose shapes the kernel cannot tile keep the XLA path, with a
  warning naming the weight.

"auto" = per op, the path measured fastest on the GPU it runs on (`AUTO_PALLAS`): Pallas where a
run on that architecture showed the kernel equal to XLA and not slower at the shapes the engine
runs, XLA elsewhere, and XLA on CPU (where kernels only run interpreted, far slower than XLA) and
on GPUs no run has measured (AMD's are proven by ISA compile only).
"""

from __future__ import annotations

import functools
import logging

import jax
from pallas_kernels import launch

OPS = ("attention", "moe")
IMPLEMENTATIONS = ("xla", "pallas")
CHOICES = IMPLEMENTATIONS + ("auto",)
# The ops "auto" runs as Pallas kernels, per architecture (pallas_kernels.launch.ARCHS), from the
# runs recorded in benchmarks/ (benchmarks/notes/2026-11-27-gpu-proof-h200.md, one H200): the
# routed experts' kernels ran 1.5-13x faster than XLA at Kimi-K2.5's per-device shapes;
# attention's kernel ran at 0.93-0.95x XLA's speed at batch 1 (after its KV-split fix; 1.15x at
# batch 64 decode, 0.80x verify at batch 64 before the fix), so attention stays on XLA.
AUTO_PALLAS: dict[str, tuple[str, ...]] = {"sm_90": ("moe",)}

log = logging.getLogger("eagle3_jax")


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def parse(kernels: str) -> dict[str, str]:
    """{op: "xla" | "pallas" | "auto"} from "pallas" or "attention=pallas,moe=xla"."""
    usage = (f"kernels {kernels!r} is not supported; use one of {', '.join(CHOICES)} for every op, or per op "
             f"like 'attention=pallas,moe=xla' (ops: {', '.join(OPS)})")
    if kernels in CHOICES:
        return dict.fromkeys(OPS, kernels)
    choice = dict.fromkeys(OPS, "xla")
    for part in str(kernels).split(","):
        op, sep, impl = part.strip().partition("=")
        if not sep or op not in OPS or impl not in CHOICES:
            raise ValueError(usage)
        choice[op] = impl
    return choice


def splits_attention(mesh) -> bool:
    """Whether a (concrete or abstract) mesh splits attention's operands: batch or heads."""
    return mesh is not None and not mesh.empty and any(mesh.shape.get(a, 1) > 1 for a in ("data", "tensor"))


def auto_choice(op: str, arch: str) -> str:
    """What "auto" runs for `op` on architecture `arch` ("default": a CPU host or an unknown GPU)."""
    return "pallas" if op in AUTO_PALLAS.get(arch, ()) else "xla"


def resolve(kernels: str, mesh: jax.sharding.Mesh | None, on_gpu: bool | None = None, arch: str | None = None) -> str:
    """The canonical per-op form ("attention=xla,moe=pallas") of a `kernels` choice on this host
    (`on_gpu` True and `arch`: as on that GPU, for programs planned for one on a host without it)."""
    requested = parse(kernels)
    gpu = _on_gpu() if on_gpu is None else on_gpu
    arch = launch.current_arch() if arch is None else arch
    choice = {op: (auto_choice(op, arch) if gpu else "xla") if impl == "auto" else impl
              for op, impl in requested.items()}
    if splits_attention(mesh) and choice["attention"] == "pallas":
        if requested["attention"] == "pallas":  # asked for by name: say why it is not used
            log.warning("attention keeps its XLA path on mesh %s (the Pallas attention kernel does not split the "
                        "batch or the heads yet); the MoE kernels still run in every shard", dict(mesh.shape))
        choice["attention"] = "xla"
    return ",".join(f"{op}={choice[op]}" for op in OPS)


def uses(kernels: str, op: str) -> bool:
    """Whether `op` runs its Pallas kernel under a config's `kernels` (canonical or plain)."""
    return parse(kernels)[op] == "pallas"


def interpret() -> bool:
    """Pallas kernels run interpreted on a CPU host, unless the trace is for a named GPU
    architecture (`pallas_kernels.launch.for_arch`: deviceless lowering, the compile gate)."""
    return jax.default_backend() == "cpu" and not launch.is_overridden()


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    """Log a fallback once per process, not once per traced layer."""
    log.warning(message)
