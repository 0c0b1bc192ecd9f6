"""Paired A/B on the long pair (scripts/build_long_pair.sh): one Engine per setting in one process,
every round's prompts (--concurrency of them, generated together) run by each setting in turn, in a
palindrome (A B C C B A; --order=alternate: A B C, then C B A the next round), so a slow spell of the
shared host falls on all of them and a drift across the round cancels. Per round and setting: its
wall time, its requests' mean TTFT, the time per output token after that (TPOT: (wall - TTFT) /
(output_len - 1); a palindrome's two runs averaged) and tau, and the TPOT and end-to-end ratios to
the first setting's: the median over rounds with a 90 % bootstrap interval. `bench.py` interleaves
whole passes of several requests, too coarse to resolve 5-10 % on a host whose speed wanders by 20 %
within a minute.

    python benchmarks/harness/long-pair-ab.py --draft=/tmp/long-pair/draft-sliding --prompts=random \
        --json_out=benchmarks/results/long-pair-ab-sliding-random.json

--prompts=random: token ids drawn uniformly from the vocabulary (bench.py's random workload);
--prompts=PATH.npy: rows of a token corpus cut to --input_len (e.g. the pair's stories-2k.npy,
read from its last row backwards). The greedy outputs of every setting are checked equal.
"""
import argparse
import random
import statistics
import time

from ab_common import add_output_flags, check_output, write_json


def median_interval(ratios: list[float], level: float = 0.90, resamples: int = 2000) -> tuple[float, float]:
    """The `level` bootstrap interval of the median of `ratios` (rounds resampled with replacement,
    a fixed seed: the same record gives the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(int((1 - tail) * resamples), resamples - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="/tmp/long-pair/kimi-mini-8k", help="Target folder (default: %(default)s).")
    parser.add_argument("--draft", default="/tmp/long-pair/draft-plain", help="Draft folder (default: %(default)s).")
    parser.add_argument("--specs", default="none,chain:3:1:4", help="Settings, the first the baseline (default: "
                        "%(default)s).")
    parser.add_argument("--prompts", default="random", help="random, or a .npy token corpus (default: %(default)s).")
    parser.add_argument("--input_len", type=int, default=2048, help="Prompt tokens (default: %(default)s).")
    parser.add_argument("--output_len", type=int, default=256, help="Output tokens (default: %(default)s).")
    parser.add_argument("--rounds", type=int, default=6, help="Rounds, each run by every setting (default: 6).")
    parser.add_argument("--order", choices=("palindrome", "alternate"), default="palindrome",
                        help="Each round A B C C B A, or A B C and C B A in turn (default: %(default)s).")
    parser.add_argument("--concurrency", type=int, default=1, help="Prompts per round, generated together "
                        "(default: 1).")
    parser.add_argument("--dtype", default="float32", help="Compute dtype (default: %(default)s).")
    parser.add_argument("--batch_invariant", action="store_true", help="Batch-invariant numerics.")
    add_output_flags(parser, "long-pair-ab.json")
    args = parser.parse_args()
    check_output(args)

    import numpy as np

    import eagle3_jax as e3

    target = e3.load_target(args.target, dtype=args.dtype, batch_invariant=args.batch_invariant)
    draft = e3.load_draft(args.draft, target=target, dtype=args.dtype)
    specs = args.specs.split(",")
    engines = {}
    for name in specs:
        spec = None if name == "none" else e3.SpecConfig.parse(name)
        engines[name] = e3.Engine(target, draft=None if spec is None else draft, spec=spec, max_batch_size=args.concurrency,
                                  max_seq_len=args.input_len + args.output_len + 64)
    rng = np.random.default_rng(0)
    corpus = None if args.prompts == "random" else np.load(args.prompts, mmap_mode="r")
    vocab = target.config.vocab_size

    def prompts(i: int) -> list[list[int]]:
        if corpus is None:
            return [rng.integers(3, vocab, args.input_len).tolist() for _ in range(args.concurrency)]
        rows = range(len(corpus) - 1 - i * args.concurrency, len(corpus) - 1 - (i + 1) * args.concurrency, -1)
        return [np.asarray(corpus[row, :args.input_len]).tolist() for row in rows]

    sampling = e3.SamplingParams(temperature=0.0, max_tokens=args.output_len)
    for engine in engines.values():  # compile
        engine.generate(prompts(args.rounds), sampling)
    rows = []
    for r in range(args.rounds):
        ids, outputs = prompts(r), []
        if args.order == "palindrome":
            order = specs + specs[::-1]
        else:
            order = specs if r % 2 == 0 else specs[::-1]
        runs = {name: [] for name in specs}
        for name in order:
            programs = engines[name].scheduler.programs
            compiles, start = programs.num_compiles, time.perf_counter()
            outs = engines[name].generate(ids, sampling)
            e2e = time.perf_counter() - start  # the run's wall time: its requests ran together
            outputs.append([list(o.token_ids) for o in outs])
            runs[name].append({"e2e_s": e2e, "ttft_s": statistics.fmean(o.metrics["ttft_s"] for o in outs),
                               "compiles": programs.num_compiles - compiles,
                               "tau": statistics.fmean(o.metrics.get("mean_accept_length") or 1.0 for o in outs)})
        for name in specs:  # a palindrome's two runs averaged
            e2e, ttft, tau = (statistics.fmean(run[key] for run in runs[name]) for key in ("e2e_s", "ttft_s", "tau"))
            rows.append({"round": r, "setting": name, "e2e_s": e2e, "ttft_s": ttft, "tau": tau,
                         "compiles": sum(run["compiles"] for run in runs[name]),
                         "tpot_ms": 1e3 * (e2e - ttft) / (args.output_len - 1)})
        if any(o != outputs[0] for o in outputs):
            raise SystemExit(f"round {r}: greedy outputs differ between settings")
    # A round in which any setting compiled a program (auto times its shapes at a block-table
    # width when first running them there) is left out: it times the compiler, as bench.py's
    # passes that compiled are measured again.
    compiled = sorted({row["round"] for row in rows if row["compiles"]})
    kept = [row for row in rows if row["round"] not in compiled]
    if not kept:
        raise SystemExit(f"every round compiled a program (rounds {compiled}); give more --rounds")
    print(f"rounds left out (a program compiled): {compiled or 'none'}", flush=True)
    summary = {}
    for name in specs:
        mine = [row for row in kept if row["setting"] == name]
        base = [row for row in kept if row["setting"] == specs[0]]
        summary[name] = {key: statistics.median(row[key] for row in mine) for key in ("e2e_s", "ttft_s", "tpot_ms", "tau")}
        summary[name]["tpot_speedup_by_round"] = [b["tpot_ms"] / m["tpot_ms"] for b, m in zip(base, mine)]
        summary[name]["e2e_speedup_by_round"] = [b["e2e_s"] / m["e2e_s"] for b, m in zip(base, mine)]
        for key in ("tpot", "e2e"):
            ratios = summary[name][f"{key}_speedup_by_round"]
            summary[name][f"{key}_speedup_median"] = statistics.median(ratios)
            summary[name][f"{key}_speedup_interval90"] = median_interval(ratios)
        s = summary[name]
        low, high = s["e2e_speedup_interval90"]
        print(f"{name:14s} TTFT {1e3 * s['ttft_s']:.0f} ms  TPOT {s['tpot_ms']:.3f} ms  tau {s['tau']:.2f}  "
              f"speedup TPOT {s['tpot_speedup_median']:.2f}x  end to end {s['e2e_speedup_median']:.2f}x "
              f"[{low:.2f}-{high:.2f}] (per round {', '.join(f'{x:.2f}' for x in s['e2e_speedup_by_round'])})",
              flush=True)
    write_json(args.json_out, {"args": vars(args), "greedy_outputs_equal": True, "rounds_left_out": compiled,
                               "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
