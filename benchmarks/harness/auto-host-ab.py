"""`auto`'s host time per scheduler iteration, per-request acceptance counts kept as one object per
request (the form before) against rows of one table (run from the repository root).

`python benchmarks/results/auto-host-ab.py BEFORE_COMMIT [CONCURRENCY ...]` loads `Acceptance` from
eagle3_jax/spec_decode/adaptive.py as of BEFORE_COMMIT (via `git show`) for one scheduler and the working
tree's for another; both run `auto` with every request given the draft, on the same random
64-token prompts (64 out), in rounds interleaved with each other, and print per concurrency the
scheduler's host seconds per iteration (`host_seconds_total`: its step() time not spent waiting for
the device) over the iterations in which nothing compiled, and the output tokens per second.
"""

import gc
import importlib.util
import subprocess
import sys
import tempfile
import time

import numpy as np

import eagle3_jax as e3
from eagle3_jax.bench.runner import drive
from eagle3_jax.scheduler import Scheduler
from eagle3_jax.spec_decode import adaptive

before, concurrencies = sys.argv[1], [int(c) for c in sys.argv[2:]] or [1, 16, 48]
source = subprocess.run(["git", "show", f"{before}:eagle3_jax/spec_decode/adaptive.py"], check=True, capture_output=True,
                        text=True).stdout.replace("from .settings import", "from eagle3_jax.spec_decode.settings import")
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(source)
spec = importlib.util.spec_from_file_location("adaptive_before", f.name)
adaptive_before = sys.modules["adaptive_before"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(adaptive_before)

target = e3.load_target("checkpoints/kimi-mini", dtype="float32")
draft = e3.load_draft("checkpoints/kimi-mini-eagle3", target=target, dtype="float32")
vocab = target.config.vocab_size
sampling = lambda i: e3.SamplingParams(max_tokens=64, min_tokens=64)  # noqa: E731
print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, before = {before}")
for concurrency in concurrencies:
    rng = np.random.default_rng(concurrency)
    n = max(48, 4 * concurrency)
    prompts = [[1] + rng.integers(100, vocab - 100, 63).tolist() for _ in range(n * 5)]
    schedulers = {}
    for form, acceptance in (("before", adaptive_before.Acceptance), ("after", adaptive.Acceptance)):
        sched = Scheduler(target, draft, e3.SpecConfig.parse("auto"), max_num_seqs=48, max_seq_len=256)
        ctl = sched.policy.adaptive
        ctl.acceptance = acceptance(ctl.acceptance.depth, [], ctl.auto.prior_weight, ctl.auto.request_decay)
        ctl.wants_draft = lambda *args, **kwargs: True
        for r in range(2):
            drive(sched, prompts[r * n: (r + 1) * n], sampling, concurrency, tag=f"warm-up{r}")
        schedulers[form] = sched
    totals = {form: [0.0, 0, 0, 0.0] for form in schedulers}  # host s, iterations, tokens, wall s

    def timed_step(sched, t, step):
        """sched.step, adding its host time to t unless a program compiled meanwhile."""
        compiles, host = sched.programs.num_compiles, sched.counters.totals["host_seconds_total"]
        deltas = step()
        if sched.programs.num_compiles == compiles:
            t[0] += sched.counters.totals["host_seconds_total"] - host
            t[1] += 1
        return deltas

    for form, sched in schedulers.items():
        sched.step = lambda sched=sched, t=totals[form], step=sched.step: timed_step(sched, t, step)
    for r in range(2, 5):
        for form in (("before", "after") if r % 2 == 0 else ("after", "before")):
            sched, t = schedulers[form], totals[form]
            gc.collect()
            records, wall = drive(sched, prompts[r * n: (r + 1) * n], sampling, concurrency, tag=f"r{r}")
            t[2] += sum(rec.num_output_tokens for rec in records)
            t[3] += wall
    for form, (host, iterations, tokens, wall) in totals.items():
        print(f"C={concurrency:<3} {form:6s} host {1e3 * host / iterations:6.3f} ms/iteration  "
              f"{tokens / wall:8.1f} tok/s  ({iterations} iterations without a compile)", flush=True)
