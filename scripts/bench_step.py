"""Where a decode step's time goes, for plain decoding and each speculation setting, at each batch.

For every (batch, setting) it keeps `batch` requests decoding on a scheduler, then times (median
of --runs calls each, eagle3_jax/bench/step_accounting.py):

- each phase of the step compiled alone: propose (draft head + expansion), verify (the target's
  pass), judge (penalties, acceptance / sampling), commit (the accepted path's K/V moved into
  place), extend (the draft over the accepted pairs), state (results into the state slots);
- the scheduler's decode program alone, on the arguments the scheduler gave it;
- the scheduler's step, wall time per iteration in steady decoding over --steps iterations, and its
  host share.

--sampling adds rows per sampling setting (greedy by default; a sampled batch's program also
draws its tokens, and with top-k / top-p sorts each row's vocabulary).

With --engine it also times `Engine.generate` at batch 1 over the prompts (each alone, --max_tokens
new tokens, prefill included): the demo's figure, per decode step.

Prints a table, writes --json_out (command, machine, date, every figure) and --plot (a stacked bar
per row: the phases, the program's extra over them, the step's time around the program). Settings
are interleaved per batch so that slow spells of a shared machine hit them alike.

    python scripts/bench_step.py --target=checkpoints/kimi-mini --draft=checkpoints/kimi-mini-eagle3 \\
        --spec=none,chain:3:1:4,tree:5:4:16 --batches=1,8,48 --engine \\
        --json_out=benchmarks/results/step-accounting.json --plot=benchmarks/results/step-accounting.png
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import (  # noqa: E402
    check_draft_path,
    check_target_path,
    define_kernels_flag,
    define_tcmalloc_flag,
    int_list,
)

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder (HF or Orbax).")
flags.DEFINE_string("draft", "checkpoints/kimi-mini-eagle3", "EAGLE-3 draft folder, for the speculative settings.")
flags.DEFINE_list("spec", ["none", "chain:3:1:4", "tree:5:4:16"], "Settings: none, chain:S:1:N, tree:S:K:N.")
flags.DEFINE_list("batches", ["1", "8", "48"], "Requests decoding together, one row per setting each.")
flags.DEFINE_list("sampling", ["greedy"], "Sampling of every request, a row each per setting and batch: greedy, or "
                  "temperature[:top_p[:top_k]] (e.g. 0.8, or 0.8:0.95:40); each request seeded with its index.")
flags.DEFINE_string("prompts", "checkpoints/demo_prompts.txt", "Prompts, one per line (cycled to fill a batch).")
flags.DEFINE_integer("steps", 40, "Scheduler iterations timed per row.", lower_bound=1)
flags.DEFINE_integer("runs", 30, "Timed calls per phase and per program (the median is kept).", lower_bound=1)
flags.DEFINE_integer("max_tokens", 128, "Tokens per request with --engine.", lower_bound=1)
flags.DEFINE_bool("engine", True, "Also time Engine.generate at batch 1 over the prompts (the demo's figure).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
flags.DEFINE_bool("phases", True, "Also time each phase of the step compiled alone (a program each to compile).")
flags.DEFINE_string("json_out", None, "Write every figure here as JSON.")
flags.DEFINE_string("plot", None, "Write the stacked-bar picture here (PNG).")
cli.define_overwrite_flag("--json_out and --plot")

define_kernels_flag()
define_tcmalloc_flag()


def _sampling(values) -> list[tuple[str, dict]]:
    """--sampling's entries as (label, SamplingParams fields)."""
    import eagle3_jax as e3

    out = []
    for value in values:
        if value == "greedy":
            out.append((value, {}))
            continue
        parts = value.split(":")
        try:
            if len(parts) > 3:
                raise ValueError("at most three fields")
            fields = {name: kind(v) for name, kind, v in zip(("temperature", "top_p", "top_k"), (float, float, int), parts)}
            e3.SamplingParams(**fields)
        except ValueError as e:
            raise app.UsageError(f"--sampling: {value!r} is not greedy or temperature[:top_p[:top_k]] with values "
                                 f"in range ({e})") from None
        out.append((value, fields))
    return out


def engine_ms_per_step(target, draft, spec, prompts: list[list[int]]) -> dict:
    """Engine.generate of each prompt alone (after one untimed pass): wall ms per decode step and
    tokens per step, the whole requests (prefill included)."""
    import eagle3_jax as e3

    engine = e3.Engine(target, draft if spec is not None else None, spec, max_batch_size=1,
                       max_seq_len=max(len(p) for p in prompts) + FLAGS.max_tokens + 8)
    sp = e3.SamplingParams(max_tokens=FLAGS.max_tokens)
    for p in prompts:
        engine.generate([p], sp)
    gc.collect()
    gc.disable()
    try:
        start, steps, tokens = time.perf_counter(), 0, 0
        for p in prompts:
            out = engine.generate([p], sp)[0]
            steps += len(out.metrics["accept_lengths"])
            tokens += len(out.token_ids)
        wall = time.perf_counter() - start
    finally:
        gc.enable()
    return {"ms_per_step": 1e3 * wall / steps, "tokens_per_step": (tokens - len(prompts)) / steps,
            "ms_per_token": 1e3 * wall / tokens}


def plot(rows: list[dict], path: str) -> None:
    """One bar per row, stacked to 100 % of its step: the phases alone, the program's extra over
    them, the step's time around the program; each bar labelled with its step's ms."""
    from eagle3_jax.bench.report import pyplot
    from eagle3_jax.bench.step_accounting import SPEC_PHASES
    from eagle3_jax.checkpoint.atomic import atomic_output

    plt = pyplot()

    labels = [f"{r['mode']}\nB={r['batch']}" for r in rows]
    parts = [(f"{name} (alone)", lambda r, n=name: r["phases"].get(n, 0.0), color)
             for name, color in zip(SPEC_PHASES, plt.cm.tab10.colors)]
    parts += [("program beyond its phases", lambda r: max(r["in_program_extra_ms"], 0.0), "0.45"),
              ("step beyond the program (host, dispatch)", lambda r: max(r["around_program_ms"], 0.0), "0.8")]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(rows)) + 3.0, 4.8))
    try:
        bottom = [0.0] * len(rows)
        for label, value, color in parts:
            shares = [100 * value(r) / sum(v(r) for _, v, _ in parts) for r in rows]
            ax.bar(labels, shares, bottom=bottom, label=label, color=color)
            bottom = [b + x for b, x in zip(bottom, shares)]
        for i, r in enumerate(rows):
            ax.text(i, 101, f"{r['step_ms']:.2f} ms", ha="center", fontsize=7)
        ax.set_ylim(0, 112)
        ax.set_ylabel("share of the scheduler's step (%)")
        ax.set_title("Where a decode step's time goes (scheduler, steady decoding)", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        with atomic_output(path, name="--plot", overwrite=FLAGS.overwrite, is_file=True) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
    finally:
        plt.close(fig)


def main(argv) -> None:
    cli.reject_positional(argv)
    check_target_path("--target", FLAGS.target)
    batches = int_list(FLAGS.batches, "batches", positive=True)
    samplings = _sampling(FLAGS.sampling)
    for flag, path in (("--json_out", FLAGS.json_out), ("--plot", FLAGS.plot)):
        cli.check_output(flag, path, {"--target": FLAGS.target, "--draft": FLAGS.draft}, is_file=True)
    import eagle3_jax as e3
    from eagle3_jax.bench.report import machine_info, pyplot
    from eagle3_jax.bench.step_accounting import account
    from eagle3_jax.text.tokenizer import load_tokenizer

    if FLAGS.plot:
        pyplot()  # the bench extra's matplotlib: missing, say so before the run rather than after it

    with cli.usage_errors("--spec"):
        specs = [(name, e3.SpecConfig.parse(name)) for name in FLAGS.spec]
    if any(not isinstance(s, (e3.SpecConfig, type(None))) for _, s in specs):
        raise app.UsageError("--spec takes fixed settings (none, chain:..., tree:...): auto changes shape per step")
    with cli.usage_errors("--prompts"):
        with open(FLAGS.prompts) as f:
            texts = [line.strip() for line in f if line.strip()]
    if not texts:
        raise app.UsageError(f"--prompts: {FLAGS.prompts} holds no prompt")
    target = e3.load_target(FLAGS.target, dtype=FLAGS.dtype, kernels=FLAGS.kernels)
    draft = None
    if any(s is not None for _, s in specs):
        check_draft_path("--draft", FLAGS.draft)
        draft = e3.load_draft(FLAGS.draft, target=target, dtype=FLAGS.dtype)
    tok = load_tokenizer(FLAGS.target, bos_id=target.config.bos_token_id)
    prompts = [tok.encode(t) for t in texts]
    longest = max(len(p) for p in prompts)
    max_len = longest + FLAGS.steps * 8 + 64
    scheds = {name: e3.Scheduler(target, draft if spec is not None else None, spec, max_num_seqs=max(batches),
                                 max_seq_len=max_len) for name, spec in specs}
    rows = []
    record = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": machine_info(), "dtype": FLAGS.dtype, "kernels": target.config.kernels, "steps": FLAGS.steps,
              "runs": FLAGS.runs, "rows": rows, "engine_batch_1": {}}
    write_json = cli.rewritten_output("--json_out", FLAGS.json_out)

    def write() -> None:  # after every row: a run cut short keeps the rows it measured
        write_json(json.dumps(record, indent=1))

    head = ("| setting | batch | step ms | host ms | program ms | phases ms | program / phases | " +
            " | ".join(f"{p} ms" for p in ("propose", "verify", "judge", "commit", "extend", "state")) +
            " | tokens / step | step ms / token |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1), flush=True)
    for batch in batches:
        for (name, spec), (how, sampling) in itertools.product(specs, samplings):
            gc.collect()
            label = name if how == "greedy" and len(samplings) == 1 else f"{name} {how}"
            a = account(scheds[name], label, prompts, batch=batch, steps=FLAGS.steps, runs=FLAGS.runs,
                        max_tokens=max_len - longest - 1, phases=FLAGS.phases, sampling=sampling)
            rows.append({**a.as_dict(), "sampling": how})
            write()
            cells = [f"{a.phases[p]:.3f}" if p in a.phases else "-" for p in
                     ("propose", "verify", "judge", "commit", "extend", "state")]
            over = f"{a.program_ms / a.phases_ms:.2f}" if a.phases else "-"
            print(f"| {label} | {batch} | {a.step_ms:.3f} | {a.host_ms:.3f} | {a.program_ms:.3f} | {a.phases_ms:.3f} | "
                  f"{over} | " + " | ".join(cells) +
                  f" | {a.tokens_per_step:.2f} | {a.step_ms / a.tokens_per_step:.3f} |", flush=True)
    engine = record["engine_batch_1"]
    if FLAGS.engine:
        print("\nEngine.generate at batch 1, each prompt alone, prefill included:")
        for name, spec in specs:
            engine[name] = engine_ms_per_step(target, draft, spec, prompts)
            e = engine[name]
            print(f"  {name}: {e['ms_per_step']:.3f} ms per step, {e['tokens_per_step']:.2f} tokens per step, "
                  f"{e['ms_per_token']:.3f} ms per token", flush=True)
            write()
    if FLAGS.plot:
        plot(rows, FLAGS.plot)
        print(f"wrote {FLAGS.plot}")


if __name__ == "__main__":
    cli.run(main)
