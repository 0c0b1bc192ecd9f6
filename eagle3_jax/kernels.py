"""Which implementation each op runs: the XLA path (the reference) or a Pallas kernel.

`load_target(..., kernels=...)` takes one choice for every op ("xla", "pallas", "auto") or one per
op ("attention=pallas,moe=xla"). It is resolved once, on load, into the canonical per-op form
("attention=pallas,moe=pallas") that `ModelConfig.kernels` carries into every program: target
prefill / decode / verify, the scheduler's, and the draft's. The ops ask `uses(cfg.kernels, op)`.

- attention: decode and verify over the committed prefix (pallas_kernels/attention.py). On a mesh
  it keeps the XLA path (the kernel has no sharded form yet); asking for it there is warned about.
- moe: the routed experts' grouped matmuls (pallas_kernels/moe.py), also inside each shard of
  expert parallelism. Weights whose shapes the kernel cannot tile keep the XLA path, with a
  warning naming the weight.

"auto" = Pallas on GPUs for every op that can run there, XLA on CPU (where kernels only run
interpreted, far slower than XLA).
"""

from __future__ import annotations

import logging

import jax

OPS = ("attention", "moe")
IMPLEMENTATIONS = ("xla", "pallas")
CHOICES = IMPLEMENTATIONS + ("auto",)

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


def resolve(kernels: str, mesh: jax.sharding.Mesh | None) -> str:
    """The canonical per-op form ("attention=xla,moe=pallas") of a `kernels` choice on this host."""
    choice = parse(kernels)
    sharded = mesh is not None and mesh.size > 1
    for op, impl in choice.items():
        if impl == "auto":
            choice[op] = "pallas" if _on_gpu() and not (op == "attention" and sharded) else "xla"
    if sharded and choice["attention"] == "pallas":
        log.warning("attention keeps its XLA path on a mesh of %d devices (the Pallas attention kernel runs on one "
                    "device); the MoE kernels still run in every shard", mesh.size)
        choice["attention"] = "xla"
    return ",".join(f"{op}={choice[op]}" for op in OPS)


def uses(kernels: str, op: str) -> bool:
    """Whether `op` runs its Pallas kernel under a config's `kernels` (canonical or plain)."""
    return parse(kernels)[op] == "pallas"


def interpret() -> bool:
    """Pallas kernels run interpreted on a CPU host (tests monkeypatch this to lower for GPUs)."""
    return jax.default_backend() == "cpu"
