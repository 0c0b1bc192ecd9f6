"""What `auto`'s per-step choices are worth, free of this host's drift.

    python benchmarks/harness/auto-steps-costed.py CONCURRENCY SEED SETTINGS

with SETTINGS a comma list of none, chain:K:1:K+1, auto, auto+prior_weight=W, auto+request_decay=D,
or auto+FIELD=V for an `AutoSpec` field (refresh_every, hysteresis, ...); for example
`... 1 2 none,chain:1:1:2,chain:2:1:3,chain:3:1:4,auto,auto+probe_steps=1 >
benchmarks/results/auto-steps-costed-c1-seed2-probe4.txt`. Every `auto` setting gives every request
the draft (its admission verdict is bypassed), so only its per-step choice is judged.

Each setting's scheduler serves the same random 64-token prompts (64 tokens out) after 48 warm-ups,
in rounds interleaved with the others. Every decode step of every setting is then costed from one
table: the median step time of each (program, shape, batch bucket, block-table width) over the
fixed settings' steps (read-to-read, as the scheduler times them). A setting's figure is its
tokens over its costed steps (plus 0.25 ms x C/4 per draft catch-up), so two settings compare by
what they chose and what their steps emitted, not by when the host ran fast. Prefill is left out.
"""

import argparse
import collections
import dataclasses
import gc
import os
import statistics

from ab_common import load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("concurrency", type=int, help="Requests in flight.")
    parser.add_argument("seed", type=int, help="Seed of the random prompts.")
    parser.add_argument("settings", help="Comma-separated settings (see above).")
    parser.add_argument("--measured", type=int, default=int(os.environ.get("N", "48")),
                        help="Measured requests per setting, split over the rounds (default: 48, or $N).")
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("ROUNDS", "4")),
                        help="Interleaved rounds (default: 4, or $ROUNDS).")
    parser.add_argument("--warmups", type=int, default=48, help="Warm-up requests per setting (default: 48).")
    parser.add_argument("--max_tokens", type=int, default=64, help="Tokens out per request (default: 64).")
    args = parser.parse_args()

    import numpy as np

    import eagle3_jax as e3
    from eagle3_jax.bench.runner import drive
    from eagle3_jax.scheduler import Scheduler, core
    from eagle3_jax.spec_decode.adaptive import shape_name

    concurrency, settings, warm = args.concurrency, args.settings.split(","), args.warmups
    target, draft = load_pair()
    rng = np.random.default_rng(args.seed)
    vocab = target.config.vocab_size
    prompts = [[1] + rng.integers(100, vocab - 100, 63).tolist() for _ in range(warm + args.measured)]
    sampling = lambda i: e3.SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens)  # noqa: E731

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
            adaptive.wants_draft = lambda *a, **k: True
            for option in options:
                name, value = option.split("=")
                if name == "prior_weight":
                    adaptive.acceptance.prior_weight = float(value)
                elif name == "request_decay":
                    adaptive.acceptance.decay = float(value)
                else:
                    kind = type(getattr(adaptive.auto, name))
                    adaptive.auto = dataclasses.replace(adaptive.auto, **{name: kind(float(value))})
        drive(sched, prompts[:warm], sampling, concurrency, tag="warm-up")
        schedulers[setting] = sched

    order, chunk = list(schedulers.items()), args.measured // args.rounds
    for r in range(args.rounds):
        for setting, sched in order[r % len(order):] + order[: r % len(order)]:
            sched.measuring = True
            gc.collect()
            drive(sched, prompts[warm + r * chunk: warm + (r + 1) * chunk], sampling, concurrency, tag=f"round{r}")

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


if __name__ == "__main__":
    main()
