"""Serving benchmark: plain vs EAGLE-3 decoding under concurrent load, as `vllm bench serve` measures it.

- `workloads`: fixed-shape random-token prompts (InferenceX 1k1k / 1k8k / 8k1k, scalable) and
  dataset prompts (MT-Bench, GSM8K, ShareGPT, Spec-Bench) with a fixed output length.
- `settings`: `none` / `chain:s:k:n` / `tree:s:k:n` speculation settings.
- `metrics`: per-request records -> throughput, TTFT, TPOT, ITL, E2E latency, tau, speedup.
- `runner`: the in-process driver over `eagle3_jax.scheduler.Scheduler`.
- `http_client`: the same driver against an OpenAI-compatible server (`/v1/completions`, SSE).
- `report`: JSON, a markdown table in the AMD blog's shape, and throughput / TPOT plots.
- `stand_in`: a stand-in for a scheduler's device (its programs answered at once with random
  tokens), for `scripts/bench_host.py --stand_in_device`: the scheduler's own host work.
- `gsm8k`: GSM8K accuracy scored as lm-evaluation-harness's `gsm8k` task, in-process or against a
  server, with the agreement between runs with and without speculation.

`scripts/bench.py` and `scripts/eval_gsm8k.py` are the command-line front ends.
"""

from .metrics import RequestRecord, summarize
from .runner import RunConfig, run_benchmark
from .settings import SpecSetting, parse_spec, parse_specs
from .workloads import DATASETS, SHAPES, Workload, dataset_workload, random_workload, random_workload_for

__all__ = [
    "DATASETS",
    "SHAPES",
    "RequestRecord",
    "RunConfig",
    "SpecSetting",
    "Workload",
    "dataset_workload",
    "parse_spec",
    "parse_specs",
    "random_workload",
    "random_workload_for",
    "run_benchmark",
    "summarize",
]
