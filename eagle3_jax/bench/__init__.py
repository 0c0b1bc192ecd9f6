"""Benchmarks and checks. The serving benchmark: plain vs EAGLE-3 decoding under concurrent load,
as `vllm bench serve` measures it:

- `workloads`: fixed-shape random-token prompts (InferenceX 1k1k / 1k8k / 8k1k, scalable) and
  dataset prompts (MT-Bench, GSM8K, ShareGPT, Spec-Bench) with a fixed output length.
- `settings`: `none` / `chain:s:k:n` / `tree:s:k:n` speculation settings.
- `metrics`: per-request records -> throughput, TTFT, TPOT, ITL, E2E latency, tau, speedup.
- `runner`: the in-process driver over `eagle3_jax.scheduler.Scheduler`.
- `http_client`: the same driver against an OpenAI-compatible server (`/v1/completions`, SSE).
- `report`: JSON, a markdown table in the AMD blog's shape, and throughput / TPOT plots.
- `serving_run`: what `scripts/bench.py` decides around a run: the checks of its choices, the
  workload, the outputs' default name, the report's config, the cells in-process or over HTTP.
- `flag_checks`: the benchmark scripts' checks of their flag values, without JAX.
- `stand_in`: a stand-in for a scheduler's device (its programs answered at once with random
  tokens), for `scripts/bench_host.py --stand_in_device`: the scheduler's own host work.
- `host_time`, `host_time_engine`, `launch_cost`, `host_report`: `scripts/bench_host.py`'s
  measurement of the host time per scheduler iteration (on the scheduler, through an AsyncEngine),
  the launch floors, and its tables and JSON record.
- `gsm8k`: GSM8K accuracy scored as lm-evaluation-harness's `gsm8k` task, in-process or against a
  server, with the agreement between runs with and without speculation; `gsm8k_run`: the runs
  `scripts/eval_gsm8k.py` makes of it (inputs, servers, in-process settings, the report's config).
- `step_accounting`: where a decode step's time goes (`scripts/bench_step.py`).
- `kernel_timing`, `attention_timing`, `moe_timing`: the kernels against their XLA references at
  given shapes, with each row's roofline fractions (`scripts/bench_kernels.py`).
- `gpu_check`: the one-shot GPU check (kernels, decode and verify steps, the demo's equality), one
  JSON rewritten after every part (`scripts/gpu_check.py`).

The scripts named are the command-line front ends. The names below load on first use (PEP 562), so that a script's flag checks
(`flag_checks`) run before JAX loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.exports import lazy_exports

# each public name and the module that defines it, imported on first use (runtime/exports.py)
_WHERE = {
    "DATASETS": ".workloads",
    "SHAPES": ".workloads",
    "RequestRecord": ".metrics",
    "RunConfig": ".runner",
    "SpecSetting": ".settings",
    "Workload": ".workloads",
    "dataset_workload": ".workloads",
    "parse_spec": ".settings",
    "parse_specs": ".settings",
    "random_workload": ".workloads",
    "random_workload_for": ".workloads",
    "run_benchmark": ".runner",
    "summarize": ".metrics",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

if TYPE_CHECKING:  # the same names for type checkers and the structure test
    from .metrics import RequestRecord, summarize
    from .runner import RunConfig, run_benchmark
    from .settings import SpecSetting, parse_spec, parse_specs
    from .workloads import DATASETS, SHAPES, Workload, dataset_workload, random_workload, random_workload_for
