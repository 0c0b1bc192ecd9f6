"""`auto`'s host time per scheduler iteration, per-request acceptance counts in the form of an earlier
commit against the working tree's.

    python benchmarks/harness/auto-host-ab.py 363c411 1 16 48 > benchmarks/results/auto-host-ab.txt

loads `Acceptance` from eagle3_jax/spec_decode/acceptance.py (adaptive.py before it had a module of
its own, eagle3_jax/spec/adaptive.py before the package was renamed) as of BEFORE_COMMIT (via `git
show`) for one scheduler and the working tree's for another; both run `auto` with every request given the draft, on the same random 64-token
prompts, in rounds interleaved with each other (2 warm-up rounds, 3 measured), and print per
concurrency the scheduler's host seconds per iteration (`host_seconds_total`: its step() time not
spent waiting for the device) over the iterations in which nothing compiled, and the output tokens
per second (which include the compiles of the programs `auto` explores). The earlier `Acceptance`
must take the constructor arguments and answer the calls the working tree's scheduler makes.
"""

import argparse
import gc
import importlib.util
import re
import subprocess
import sys
import tempfile
import time

from ab_common import ROOT, load_pair


def acceptance_at(commit: str):
    """The `Acceptance` class of eagle3_jax's adaptive module as of `commit`."""
    for path in ("eagle3_jax/spec_decode/acceptance.py", "eagle3_jax/spec_decode/adaptive.py",
                 "eagle3_jax/spec/adaptive.py"):
        r = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, cwd=ROOT)
        if r.returncode == 0:
            break
    else:
        sys.exit(f"auto-host-ab.py: error: no adaptive module at {commit}: {r.stderr.strip()}")
    # Relative imports name the package, whichever its name was then: spec_decode/'s modules now.
    source = re.sub(r"^from \.(\w+) import", r"from eagle3_jax.spec_decode.\1 import", r.stdout, flags=re.M)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("adaptive_before", f.name)
    module = sys.modules["adaptive_before"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Acceptance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", metavar="BEFORE_COMMIT", help="The commit whose Acceptance is the 'before' form.")
    parser.add_argument("concurrency", type=int, nargs="*", default=[1, 16, 48],
                        help="Concurrencies (default: 1 16 48).")
    parser.add_argument("--requests", type=int, default=None,
                        help="Requests per round (default: max(48, 4 x concurrency)).")
    parser.add_argument("--max_tokens", type=int, default=64, help="Tokens out per request (default: 64).")
    parser.add_argument("--max_num_seqs", type=int, default=48, help="The schedulers' batch size (default: 48).")
    args = parser.parse_args()
    acceptance_before = acceptance_at(args.before)

    import numpy as np

    import eagle3_jax as e3
    from eagle3_jax.bench.runner import drive
    from eagle3_jax.scheduler import Scheduler
    from eagle3_jax.spec_decode import adaptive

    target, draft = load_pair()
    vocab = target.config.vocab_size
    sampling = lambda i: e3.SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens)  # noqa: E731
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, before = {args.before}")
    for concurrency in args.concurrency:
        rng = np.random.default_rng(concurrency)
        n = args.requests or max(48, 4 * concurrency)
        prompts = [[1] + rng.integers(100, vocab - 100, 63).tolist() for _ in range(n * 5)]
        schedulers = {}
        for form, acceptance in (("before", acceptance_before), ("after", adaptive.Acceptance)):
            sched = Scheduler(target, draft, e3.SpecConfig.parse("auto"), max_num_seqs=args.max_num_seqs,
                              max_seq_len=64 + args.max_tokens + 128)
            ctl = sched.policy.adaptive
            ctl.acceptance = acceptance(ctl.acceptance.depth, [], ctl.auto.prior_weight, ctl.auto.request_decay)
            ctl.wants_draft = lambda *a, **k: True
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
            print(f"C={concurrency:<3} {form:6s} host {1e3 * host / max(iterations, 1):6.3f} ms/iteration  "
                  f"{tokens / wall:8.1f} tok/s  ({iterations} iterations without a compile)", flush=True)


if __name__ == "__main__":
    main()
