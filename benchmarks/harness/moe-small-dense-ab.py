"""A/B in one process: small steps' routed experts gathered (per-assignment weight copies) against
dense (every token through every local expert, weights read in place), through the step accounting
(eagle3_jax/bench/step_accounting.py) of the demo pair's schedulers.

    python benchmarks/harness/moe-small-dense-ab.py --json_out=benchmarks/results/moe-small-dense-ab.json --overwrite

Dense: `moe.expert_form` returning "dense" wherever it returns "gathered" and the step has at
least half as many (token, expert) assignments as experts. For each repetition (the second in the
opposite order), batch and setting, both forms' schedulers are accounted one after the other; each
row gives the steady scheduler step, the decode program alone and the verify phase alone (ms).
"""
import argparse

from ab_common import add_output_flags, check_output, demo_pair, swapped, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8", help="Batch sizes, comma-separated (default: %(default)s).")
    parser.add_argument("--specs", default="none,chain:3:1:4", help="Settings (default: %(default)s).")
    parser.add_argument("--reps", type=int, default=2, help="Repetitions, alternating the order (default: 2).")
    parser.add_argument("--steps", type=int, default=40, help="Steady scheduler steps timed (default: 40).")
    parser.add_argument("--runs", type=int, default=30, help="Timed runs of the program and phases (default: 30).")
    parser.add_argument("--max_tokens", type=int, default=300, help="Each request's budget (default: 300).")
    add_output_flags(parser, "moe-small-dense-ab.json")
    args = parser.parse_args()
    check_output(args)

    import eagle3_jax as e3
    from eagle3_jax.models import moe
    from eagle3_jax.bench.step_accounting import account

    target, draft, prompts = demo_pair()
    real_form = moe.expert_form
    batches, names = [int(b) for b in args.batches.split(",")], args.specs.split(",")

    def dense_small(n, k, w):
        f = real_form(n, k, w)
        return "dense" if f == "gathered" and 2 * n * k >= w.shape[0] else f

    def form(dense: bool):
        return swapped(moe, "expert_form", dense_small if dense else real_form)

    scheds = {}
    for name in names:
        spec = e3.SpecConfig.parse(name)
        for dense in (False, True):
            scheds[(name, dense)] = e3.Scheduler(target, draft if spec else None, spec, max_num_seqs=max(batches),
                                                 max_seq_len=424)
    rows = []
    for rep in range(args.reps):
        for batch in batches:
            for name in names:
                for dense in ((False, True) if rep % 2 == 0 else (True, False)):
                    with form(dense):
                        a = account(scheds[(name, dense)], name, prompts, batch=batch, steps=args.steps,
                                    runs=args.runs, max_tokens=args.max_tokens)
                    rows.append(dict(rep=rep, batch=batch, mode=name, dense=dense, step_ms=round(a.step_ms, 3),
                                     program_ms=round(a.program_ms, 3), verify_ms=round(a.phases["verify"], 3),
                                     tokens=a.tokens_per_step))
                    print(rows[-1], flush=True)
    write_json(args.json_out, rows)


if __name__ == "__main__":
    main()
