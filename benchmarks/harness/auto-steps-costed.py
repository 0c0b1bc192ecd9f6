"""What `auto`'s per-step choices are worth, free of this host's drift (run from the repository root).

`python benchmarks/results/auto-steps-costed.py CONCURRENCY SEED SETTINGS` with SETTINGS a comma list
of none, chain:K:1:K+1, auto, auto+prior_weight=W, auto+request_decay=D, or auto+FIELD=V for an
`AutoSpec` field (refresh_every, hysteresis, ...). Every `auto` setting gives every request the draft
(its admission verdict is bypassed), so only its per-step choice is judged.

Each setting's scheduler serves the same random 64-token prompts (64 tokens out) after 48 warm-ups,
in rounds interleaved with the others. Every decode step of every setting is then costed from one
table: the median step time of each (program, shape, batch bucket, block-table width) over the
fixed settings' steps (read-to-read, as the scheduler times them). A setting's figure is its
tokens over its costed steps (plus 0.25 ms x C/4 per draft catch-up), so two settings compare by
what they chose and what their steps emitted, not by when the host ran fast. Prefill is left out.
"""

import collections
import dataclasses
import gc
import os
import statistics
import sys

import numpy as np

import eagle3_jax as e3
from eagle3_jax.bench.runner import drive
from eagle3_jax.scheduler import Scheduler, core
from eagle3_jax.spec_decode.adaptive import shape_name

concurrency, seed, settings = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
measured, rounds = int(os.environ.get("N", "48")), int(os.environ.get("ROUNDS", "4"))
target = e3.load_target("checkpoints/kimi-mini", dtype="float32")
draft = e3.load_draft("checkpoints/kimi-mini-eagle3", target=target, dtype="float32")
rng = np.random.default_rng(seed)
vocab = target.config.vocab_size
prompts = [[1] + rng.integers(100, vocab - 100, 63).tolist() for _ in range(48 + measured)]
sampling = lambda i: e3.SamplingParams(max_tokens=64, min_tokens=64)  # noqa: E731

steps = collections.defaultdict(list)  # setting -> [(cost key, catch-up, tokens)]
samples = collections.defaultdict(list)  # cost key -> seconds, fixed settings only
collect = core.Scheduler._collect_decode


def recording_collect(self, launch, rows, outputs, now):
    seconds = self._step_seconds(launch, now)
    program = launch.plan.program.replace("store_", "").replace("plain_", "")
    key = (program, shape_name(launch.plan.shape), launch.key)
    if getattr(self, "measuring", False):
        if seconds is not None and not self.setting.startswith("auto"):
            samples[key].append(seconds)
        tokens = int(outputs[1][[i for i, _ in rows]].sum()) if rows else 0
        steps[self.setting].append((key, launch.plan.catch_up, tokens))
    return collect(self, launch, rows, outputs, now)


core.Scheduler._collect_decode = recording_collect
schedulers = {}
for setting in settings:
    base, *options = setting.split("+")
    spec = None if base == "none" else e3.SpecConfig.parse(base)
    sched = Scheduler(target, draft if spec else None, spec, max_num_seqs=48, max_seq_len=1024)
    sched.setting = setting
    if base == "auto":
        adaptive = sched.policy.adaptive
        adaptive.wants_draft = lambda *args, **kwargs: True
        for option in options:
            name, value = option.split("=")
            if name == "prior_weight":
                adaptive.acceptance.prior_weight = float(value)
            elif name == "request_decay":
                adaptive.acceptance.decay = float(value)
            else:
                kind = type(getattr(adaptive.auto, name))
                adaptive.auto = dataclasses.replace(adaptive.auto, **{name: kind(float(value))})
    drive(sched, prompts[:48], sampling, concurrency, tag="warm-up")
    schedulers[setting] = sched

order, chunk = list(schedulers.items()), measured // rounds
for r in range(rounds):
    for setting, sched in order[r % len(order):] + order[: r % len(order)]:
        sched.measuring = True
        gc.collect()
        drive(sched, prompts[48 + r * chunk: 48 + (r + 1) * chunk], sampling, concurrency, tag=f"round{r}")

table = {key: statistics.median(v) for key, v in samples.items() if len(v) >= 5}
catch_up = 0.25e-3 * max(1, concurrency / 4)
rates = {}
for setting, recorded in steps.items():
    seconds = tokens = 0.0
    for key, caught_up, emitted in recorded:
        cost = table.get(key)
        if cost is None:  # a width the fixed settings did not time: their median at the same batch
            near = [v for k, v in table.items() if k[:2] == key[:2] and k[2][0] == key[2][0]]
            cost = statistics.median(near) if near else float("nan")
        seconds += cost + (catch_up if caught_up else 0.0)
        tokens += emitted
    rates[setting] = tokens / seconds
    mix = collections.Counter(key[1] for key, _, _ in recorded)
    print(f"{setting:32s} {tokens / seconds:8.1f} tok/s costed  steps {len(recorded)}  mix {dict(mix)}")
best = max(v for k, v in rates.items() if not k.startswith("auto"))
for setting, rate in rates.items():
    print(f"{setting:32s} {rate / best:.3f} of the best fixed setting")
print("table (ms):", {f"{k[1]}@{k[2]}": round(1e3 * v, 3) for k, v in sorted(table.items(), key=str)})
