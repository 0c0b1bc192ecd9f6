"""Timing a kernel against its XLA path: the timed loop, the input sets one timed program rotates
over, a row's derived figures (GB/s, fractions of a device's peaks) and its table line, the two
ceilings a device reaches (copy bandwidth, bf16 matmul rate), and the JSON record of
`scripts/bench_kernels.py`.

On a GPU each timed program runs the op over several input sets, enough that together they read
ROTATE_BYTES, so the L2 (50-60 MB on an H100 / H200) does not hold what one call reads and the
launch overhead is spread over them; the median of the repeats, divided by the sets, is the op's
time, taken after untimed calls for WARM_SECONDS so the GPU's clocks are up. On a CPU host the
kernels run under Triton's interpreter: one set, no warming, and figures that only show the code runs.
The rows themselves are made in `attention_timing` and `moe_timing`.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

# Untimed calls before timing a program on a GPU, for this long: on the H200 each run's first row,
# timed right after its compile, read ~10 % slow (benchmarks/notes/2026-11-27-gpu-proof-h200.md).
WARM_SECONDS = 0.1
ROTATE_BYTES = 256 * 2**20  # what one timed program reads over its input sets: several times a GPU's L2
MAX_SETS = 16
INTERPRET_NOTE = " (Triton's interpreter: timings are not meaningful)"


def launcher(interpret: bool) -> str:
    """What launched a row's kernel: jax_triton on a GPU, Triton's interpreter elsewhere."""
    return "triton_interpreter" if interpret else "jax_triton"

Echo = Callable[[str], None]  # where a table's lines go (a script passes print)


def parse_counts(values: Sequence[str], name: str) -> tuple[int, ...]:
    """The positive integers of list flag --`name`'s texts; a ValueError naming the flag otherwise."""
    try:
        out = tuple(int(v) for v in values)
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers; got {','.join(values)!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"--{name} needs positive integers; got {','.join(values)!r}")
    return out


def input_sets(read_bytes: float, interpret: bool) -> int:
    """Input sets per timed program: enough to read ROTATE_BYTES, at most MAX_SETS (one interpreted)."""
    if interpret:
        return 1
    return int(max(1, min(MAX_SETS, -(-ROTATE_BYTES // max(int(read_bytes), 1)))))


def median_ms(fn: Callable[..., Any], args: tuple, repeats: int) -> float:
    """Median ms of `repeats` calls `fn(*args)`, each waited for, after a compiling call (and, off a
    CPU, untimed calls for WARM_SECONDS)."""
    jax.block_until_ready(fn(*args))  # compile
    if jax.default_backend() != "cpu":  # a GPU idle while compiling runs its first calls at idle clocks
        warm_until = time.perf_counter() + WARM_SECONDS
        while time.perf_counter() < warm_until:
            jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def per_set_ms(fn: Callable[..., Any], sets: Sequence[Mapping[str, Any]], repeats: int) -> float:
    """Median ms per input set of one jitted program running `fn(**set)` over every set."""
    program = jax.jit(lambda all_sets: [fn(**one) for one in all_sets])
    return median_ms(program, (list(sets),), repeats) / len(sets)


def roofline_ms(read: float, flops: float, peak: float, peak_tflops: float) -> tuple[float, str]:
    """The least time a call reading `read` bytes and doing `flops` can take on a device of HBM
    bandwidth `peak` (GB/s) and matrix peak `peak_tflops` (TFLOP/s; 0: unknown, bandwidth only),
    and which limit binds: "bandwidth" or "compute"."""
    bandwidth_ms = read / (peak * 1e6)
    compute_ms = flops / (peak_tflops * 1e9) if peak_tflops else 0.0
    return (compute_ms, "compute") if compute_ms > bandwidth_ms else (bandwidth_ms, "bandwidth")


def timing(k_ms: float, x_ms: float, read: float, flops: float, peak: float, peak_tflops: float) -> dict:
    """A row's timing fields: both paths' ms and GB/s, their fractions of the HBM peak `peak` (GB/s),
    the kernel's of the bf16 peak `peak_tflops` (None without one), and both paths' fraction of the
    roofline (`roofline_ms`: the binding one of the data sheet's bandwidth and matrix peak)."""
    least_ms, bound = roofline_ms(read, flops, peak, peak_tflops)
    return dict(kernel_ms=k_ms, xla_ms=x_ms, bytes_read=read, flops=flops, kernel_gbps=read / (k_ms * 1e6),
                xla_gbps=read / (x_ms * 1e6), peak_fraction=read / (k_ms * 1e6) / peak,
                xla_peak_fraction=read / (x_ms * 1e6) / peak,
                flops_fraction=flops / (k_ms * 1e9) / peak_tflops if peak_tflops else None,
                roofline_ms=least_ms, roofline_bound=bound, roofline_fraction=least_ms / k_ms,
                xla_roofline_fraction=least_ms / x_ms)


def row_line(cells: Sequence[Any], row: Mapping[str, Any], err: float) -> str:
    """A table row: the leading `cells`, then times, speedup, MB, GB/s, % of peak, error (and
    DIFFERS where the row's `equal` is false)."""
    return ("| " + " | ".join(str(c) for c in cells) + f" | {row['kernel_ms']:.4f} | {row['xla_ms']:.4f} | "
            f"{row['xla_ms'] / row['kernel_ms']:.2f}x | {row['bytes_read'] / 1e6:.1f} | {row['kernel_gbps']:.1f} | "
            f"{100 * row['peak_fraction']:.1f} | {err:.2g}" + ("" if row["equal"] else " DIFFERS") + " |")


def max_abs_err(got: Any, want: Any) -> float:
    """The largest absolute difference of two arrays, in float32 (NaN where either holds one)."""
    return float(jnp.max(jnp.abs(jnp.asarray(got, jnp.float32) - jnp.asarray(want, jnp.float32))))


def measure_ceilings(copy_bytes: int = 2**30, n: int = 8192) -> dict:
    """The two ceilings measured on this device: copy GB/s (bytes read + written, of a `copy_bytes`
    bf16 array) and bf16 `n`^3 matmul TFLOP/s, each the median of 10 calls."""
    x = jax.random.normal(jax.random.key(1), (copy_bytes // 2,), jnp.bfloat16)
    copy_ms = median_ms(jax.jit(lambda v: v + 1), (x,), 10)
    a, b = (jax.random.normal(jax.random.key(k), (n, n), jnp.bfloat16) for k in (2, 3))
    matmul_ms = median_ms(jax.jit(jnp.matmul), (a, b), 10)
    return {"copy_gbps": 2 * x.nbytes / (copy_ms * 1e6), "matmul_tflops": 2 * n**3 / (matmul_ms * 1e9)}


def ceilings_line(measured: Mapping[str, float]) -> str:
    return (f"ceilings measured: copy {measured['copy_gbps']:.0f} GB/s (read + written), bf16 matmul "
            f"{measured['matmul_tflops']:.0f} TFLOP/s")


def with_measured_fractions(row: dict, measured: Mapping[str, float] | None) -> dict:
    """`row` with both paths' GB/s as fractions of the measured copy bandwidth and the kernel's
    FLOP/s of the measured matmul rate added (in place; returned). Rows without times (a swept
    launch that did not compile) and runs without measured ceilings are left as they are."""
    if measured and "kernel_ms" in row:
        row["measured_copy_fraction"] = row["kernel_gbps"] / measured["copy_gbps"]
        row["xla_measured_copy_fraction"] = row["xla_gbps"] / measured["copy_gbps"]
        row["measured_flops_fraction"] = row["flops"] / (row["kernel_ms"] * 1e9) / measured["matmul_tflops"]
    return row


def kernel_record(argv: Sequence[str], interpret: bool, rows: list[dict]) -> dict:
    """`scripts/bench_kernels.py`'s JSON: the command line, date, device, JAX, machine and the rows."""
    return {"argv": list(argv), "date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "interpret": interpret, "machine": f"{platform.machine()} x{os.cpu_count()}",
            "rows": rows}
