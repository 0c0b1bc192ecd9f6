"""The verify cost per accepted token against the context, on CPU: AMD's metric for why EAGLE-3's
gain shrinks from 1K/1K to 8K/1K (target verification 0.30 -> 2.56 ms per accepted token on
MI355X). The demo pair with the target's YaRN extended to --positions (ab_common.extended_target);
for each context length, `batch` requests of that many prompt tokens (GSM8K text, a different
start per request) decode in steady state on a Scheduler per setting, and the step is taken apart
(eagle3_jax/bench/step_accounting.py): the target's verify pass alone, the whole step, and the
tokens each step commits (tau). Cost per accepted token = time / tau.

    python benchmarks/harness/long-context.py --json_out=benchmarks/results/verify-cost-vs-context.json

    # a pair trained at length (scripts/build_long_pair.sh): its target and draft, the contexts the
    # target's own greedy text after held-out GSM8K questions (what such a draft trained on)
    python benchmarks/harness/long-context.py --target=/tmp/long-pair/kimi-mini-8k \
        --draft=/tmp/long-pair/draft-plain --text=own --spec=chain:3:1:4 --json_out=...

    # the extended pair as a folder, for scripts/bench.py's serving scenarios:
    python benchmarks/harness/long-context.py --pair_dir=/tmp/kimi-mini-8k
"""
import argparse
import gc
import os
import sys
import time

from ab_common import DRAFT, ROOT, TARGET, add_output_flags, check_output, extended_target, prompt_ids, write_json


def own_text(target, folder: str, length: int, batch: int, first_question: int) -> list[list[int]]:
    """`batch` sequences of `length` tokens: GSM8K test questions from `first_question` on (rendered as
    scripts/train_draft.py renders prompts), each followed by the target's own greedy continuation,
    end-of-sequence tokens ignored."""
    import json

    import eagle3_jax as e3
    from eagle3_jax.sampling.sampler import SamplingParams
    from eagle3_jax.text.chat_template import render_prompts
    from eagle3_jax.text.tokenizer import load_tokenizer

    with open(os.path.join(ROOT, "data", "gsm8k", "test_full.jsonl")) as f:
        questions = [json.loads(line)["question"] for line in f][first_question: first_question + batch]
    tok = load_tokenizer(folder, bos_id=target.config.bos_token_id)
    prompts = [tok.encode(r, add_bos=True) for r in render_prompts(questions, folder)]
    engine = e3.Engine(target, draft=None, max_batch_size=batch, max_seq_len=length + 1)
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=length - len(p)) for p in prompts])
    return [p + list(o.token_ids) for p, o in zip(prompts, outs)]


def verify_cost(args) -> list[dict]:
    import tempfile

    import eagle3_jax as e3
    from eagle3_jax.bench.step_accounting import account
    from eagle3_jax.text.tokenizer import load_tokenizer

    folder = args.target or extended_target(tempfile.mkdtemp(), args.positions)
    target = e3.load_target(folder, dtype="float32")
    draft = e3.load_draft(args.draft, target=target, dtype="float32")
    tok = load_tokenizer(TARGET)
    contexts = [int(c) for c in args.contexts.split(",")]
    texts = own_text(target, folder, max(contexts), args.batch, args.first_question) if args.text == "own" else None
    rows = []
    for context in contexts:
        prompts = ([t[:context] for t in texts] if texts is not None
                   else [prompt_ids(tok, context, start=40 * i) for i in range(args.batch)])
        for name in args.spec.split(","):
            spec = e3.SpecConfig.parse(name)
            max_len = context + args.steps * 8 + 96
            sched = e3.Scheduler(target, draft if spec is not None else None, spec, max_num_seqs=args.batch,
                                 max_seq_len=max_len, prefill_chunk=512)
            gc.collect()
            a = account(sched, name, prompts, batch=args.batch, steps=args.steps, runs=args.runs,
                        max_tokens=max_len - context - 1)
            tau = a.tokens_per_step
            row = {"context": context, "setting": name, "batch": args.batch, "tau": tau, "verify_ms": a.phases["verify"],
                   "step_ms": a.step_ms, "verify_ms_per_token": a.phases["verify"] / tau,
                   "step_ms_per_token": a.step_ms / tau, "phases_ms": a.phases}
            rows.append(row)
            print(f"context {context:6d} {name:14s} tau {tau:.2f}  verify {row['verify_ms']:.2f} ms "
                  f"({row['verify_ms_per_token']:.2f} per token)  step {a.step_ms:.2f} ms "
                  f"({row['step_ms_per_token']:.2f} per token)", flush=True)
            del sched
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=8192, help="The target's positions (default: %(default)s).")
    parser.add_argument("--contexts", default="256,1024,2048,4096", help="Prompt tokens per request (default: "
                        "%(default)s).")
    parser.add_argument("--spec", default="none,chain:3:1:4,tree:5:4:16", help="Settings (default: %(default)s).")
    parser.add_argument("--batch", type=int, default=4, help="Requests decoding together (default: %(default)s).")
    parser.add_argument("--steps", type=int, default=20, help="Scheduler steps timed (default: %(default)s).")
    parser.add_argument("--runs", type=int, default=10, help="Timed calls per phase (default: %(default)s).")
    parser.add_argument("--target", help="A target folder (default: kimi-mini with its YaRN extended to --positions).")
    parser.add_argument("--draft", default=DRAFT, help="The draft folder (default: the bundled kimi-mini draft).")
    parser.add_argument("--text", choices=("gsm8k", "own"), default="gsm8k", help="Contexts of GSM8K question text "
                        "(a different start per request), or the target's own greedy text after GSM8K questions "
                        "from --first_question on (default: %(default)s).")
    parser.add_argument("--first_question", type=int, default=1000, help="--text=own: the first GSM8K test question "
                        "(default: %(default)s, past those a long-pair draft trains on).")
    parser.add_argument("--pair_dir", help="Only write the extended target's folder here (an empty or new folder) "
                        "and print the bench command for it.")
    add_output_flags(parser, "verify-cost-vs-context.json")
    args = parser.parse_args()
    if args.pair_dir:
        os.makedirs(args.pair_dir, exist_ok=True)
        if os.listdir(args.pair_dir):
            raise SystemExit(f"--pair_dir {args.pair_dir} is not empty; give a new folder")
        extended_target(args.pair_dir, args.positions)
        print(f"wrote {args.pair_dir}: kimi-mini with {args.positions} YaRN positions; e.g.\n  python "
              f"{os.path.join(ROOT, 'scripts', 'bench.py')} --target={args.pair_dir} --draft={DRAFT} "
              "--workload=random --shape=8k1k --scale=0.25")
        return
    check_output(args)
    rows = verify_cost(args)
    write_json(args.json_out, {"argv": sys.argv, "positions": args.positions, "target": args.target,
                               "draft": args.draft, "text": args.text, "rows": rows,
                               "date": time.strftime("%Y-%m-%d"), "machine": f"{os.uname().machine} x{os.cpu_count()}"})


if __name__ == "__main__":
    main()
