"""A/B in one process: the XLA:CPU dense expert form against the grouped form it replaces, through the
step accounting (eagle3_jax/bench/step_accounting.py) of the demo pair's schedulers.

    python benchmarks/harness/moe-dense-ab.py --json_out=benchmarks/results/moe-dense-ab.json --overwrite

For each repetition (the second in the opposite order), batch and setting, both forms' schedulers
are accounted one after the other; each row gives the steady scheduler step, the decode program
alone and the verify phase alone (ms) and the tokens per step. Grouped: the form the dense one
replaced (`moe.expert_form` returning "grouped" wherever it now returns "dense").
"""
import argparse

from ab_common import add_output_flags, check_output, demo_pair, swapped, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,48", help="Batch sizes, comma-separated (default: %(default)s).")
    parser.add_argument("--specs", default="none,chain:3:1:4", help="Settings (default: %(default)s).")
    parser.add_argument("--reps", type=int, default=2, help="Repetitions, alternating the order (default: 2).")
    parser.add_argument("--steps", type=int, default=30, help="Steady scheduler steps timed (default: 30).")
    parser.add_argument("--runs", type=int, default=20, help="Timed runs of the program and phases (default: 20).")
    parser.add_argument("--max_tokens", type=int, default=300, help="Each request's budget (default: 300).")
    add_output_flags(parser, "moe-dense-ab.json")
    args = parser.parse_args()
    check_output(args)

    import eagle3_jax as e3
    from eagle3_jax.models import moe
    from eagle3_jax.bench.step_accounting import account

    target, draft, prompts = demo_pair()
    real_form = moe.expert_form
    batches, names = [int(b) for b in args.batches.split(",")], args.specs.split(",")

    def grouped_not_dense(n, k, w):
        f = real_form(n, k, w)
        return "grouped" if f == "dense" else f

    def form(dense: bool):
        return swapped(moe, "expert_form", real_form if dense else grouped_not_dense)

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
                    rows.append(dict(rep=rep, batch=batch, mode=name, dense=dense, step_ms=a.step_ms,
                                     program_ms=a.program_ms, verify_ms=a.phases["verify"], tokens=a.tokens_per_step))
                    print(rows[-1], flush=True)
    write_json(args.json_out, rows)


if __name__ == "__main__":
    main()
