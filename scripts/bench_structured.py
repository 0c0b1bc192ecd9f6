"""Structured output under speculation: validity, acceptance and speed, against plain decoding.

Runs one workload of constrained requests (JSON schemas of several shapes, regexes, choices; the
prompts of --prompts, greedy) with each --spec (none = plain decoding), once constrained and once
unconstrained (the same prompts and lengths), and reports per setting: the share of constrained
outputs that are valid (json + jsonschema, re.fullmatch, membership; outputs cut at max_tokens
count as invalid), whether each speculative setting's tokens equal plain decoding's, the mean
accept length, output tokens per second (the median of --repeats timed passes, after two untimed
ones), the programs compiled during the timed passes, the speedup over plain decoding under the same
constraints and over its own unconstrained run, and the host ms per scheduler iteration
(`host_seconds_total`: with constraints, the mask work). Prints a table and writes --json_out
(command, machine, date, figures).

    python scripts/bench_structured.py --target=checkpoints/kimi-mini --draft=checkpoints/kimi-mini-eagle3 \\
        --json_out=benchmarks/results/structured-kimi-mini.json
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder (HF or Orbax).")
flags.DEFINE_string("draft", "checkpoints/kimi-mini-eagle3", "EAGLE-3 draft folder, for the speculative settings.")
flags.DEFINE_string("prompts", "checkpoints/demo_prompts.txt", "Prompts, one per line.")
flags.DEFINE_list("spec", ["none", "chain:3:1:4", "tree:3:2:6", "auto"],
                  "Speculation settings: none, chain:S:K:N, tree:S:K:N, auto[:K].")
flags.DEFINE_integer("max_tokens", 64, "Most tokens per request.", lower_bound=1)
flags.DEFINE_integer("batch", 8, "Requests decoded together (max_num_seqs).", lower_bound=1)
flags.DEFINE_string("dtype", "float32", "Parameter dtype.")
flags.DEFINE_integer("repeats", 3, "Timed passes per run; the median is reported.", lower_bound=1)
flags.DEFINE_string("json_out", None, "Write the figures here as JSON.")
cli.define_overwrite_flag("--json_out")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "reason": {"type": "string",
                                                                                               "maxLength": 40}},
     "required": ["answer", "reason"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                "minItems": 1, "maxItems": 4}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"event": {"type": "object", "properties": {
        "day": {"type": "integer", "minimum": 1, "maximum": 31}, "place": {"type": "string", "maxLength": 16}},
        "required": ["day", "place"], "additionalProperties": False}}, "required": ["event"], "additionalProperties": False},
]
REGEXES = [r"(yes|no), [a-z ]{3,30}\.", r"[A-Z][a-z]+ (went|saw|had) [a-z ]{3,30}\."]
CHOICES = [["happy", "sad", "angry"], ["Once upon a time", "The end"]]


def constraints():
    from eagle3_jax.structured import Constraint

    return ([("json_schema", Constraint.json_schema(s)) for s in SCHEMAS]
            + [("regex", Constraint.regex(r)) for r in REGEXES] + [("choice", Constraint.choice(c)) for c in CHOICES])


def valid(constraint, text: str, finish: str) -> bool:
    if finish != "stop":
        return False
    try:
        if constraint.kind == "json_schema":
            import jsonschema

            jsonschema.validate(json.loads(text), json.loads(constraint.text))
            return True
        if constraint.kind == "regex":
            return re.fullmatch(constraint.text, text) is not None
        return text in json.loads(constraint.text)
    except (ValueError, jsonschema.ValidationError):
        return False


def run(engine, prompts, sampling) -> tuple[list, float, dict]:
    """(outputs, median seconds, scheduler counters over every pass, programs compiled) of
    --repeats timed passes."""
    before, compiles, times = dict(engine.scheduler.stats()), engine.scheduler.programs.num_compiles, []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        outs = engine.generate(prompts, sampling)
        times.append(time.perf_counter() - start)
    after = engine.scheduler.stats()
    counters = {k: after[k] - before[k] for k in ("host_seconds_total", "num_iterations_total")}
    counters["compiles"] = engine.scheduler.programs.num_compiles - compiles
    return outs, sorted(times)[len(times) // 2], counters


def main(argv):
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    import eagle3_jax as e3

    tok = e3.load_tokenizer(FLAGS.target)
    target = e3.load_target(FLAGS.target, dtype=FLAGS.dtype)
    with open(FLAGS.prompts) as f:
        texts = [line.strip() for line in f if line.strip()]
    work = constraints()
    prompts = [tok.encode(texts[i % len(texts)]) for i in range(len(work))]
    rows, plain = [], {}
    for name in FLAGS.spec:
        spec = None if name == "none" else e3.SpecConfig.parse(name)
        draft = None if spec is None else e3.load_draft(FLAGS.draft, target=target, dtype=FLAGS.dtype)
        engine = e3.Engine(target, draft, spec, max_batch_size=FLAGS.batch, max_seq_len=512, tokenizer=tok)
        with_constraints = [e3.SamplingParams(max_tokens=FLAGS.max_tokens, constraint=c) for _, c in work]
        # unconstrained: the same prompts, each generating as many tokens as its constrained run does
        lengths = [len(o.token_ids) for o in engine.generate(prompts, with_constraints)]
        without = [e3.SamplingParams(max_tokens=n) for n in lengths]
        for _ in range(2):  # untimed passes: every program compiled (auto explores its settings)
            engine.generate(prompts, without)
            engine.generate(prompts, with_constraints)
        constrained, t_c, host_c = run(engine, prompts, with_constraints)
        free, t_f, host_f = run(engine, prompts, without)
        tokens_c, tokens_f = sum(len(o.token_ids) for o in constrained), sum(len(o.token_ids) for o in free)
        row = {"spec": name, "valid": sum(valid(c, o.text, o.finish_reason) for (_, c), o in zip(work, constrained)),
               "requests": len(work),
               "by_kind": {kind: sum(valid(c, o.text, o.finish_reason) for (k, c), o in zip(work, constrained)
                                     if k == kind) for kind in ("json_schema", "regex", "choice")},
               "accept_length": sum(o.metrics["mean_accept_length"] * len(o.metrics["accept_lengths"])
                                    for o in constrained) / max(1, sum(len(o.metrics["accept_lengths"])
                                                                       for o in constrained)),
               "accept_length_free": sum(o.metrics["mean_accept_length"] * len(o.metrics["accept_lengths"])
                                         for o in free) / max(1, sum(len(o.metrics["accept_lengths"]) for o in free)),
               "tok_s": tokens_c / t_c, "tok_s_free": tokens_f / t_f,
               "host_ms_per_iteration": 1000 * host_c["host_seconds_total"] / max(1, host_c["num_iterations_total"]),
               "host_ms_per_iteration_free": 1000 * host_f["host_seconds_total"]
               / max(1, host_f["num_iterations_total"]),
               "compiles_timed": host_c["compiles"], "compiles_timed_free": host_f["compiles"]}
        if name == "none":
            plain = {"tokens": [o.token_ids for o in constrained], "tok_s": row["tok_s"]}
        row["equals_plain"] = [o.token_ids for o in constrained] == plain.get("tokens")
        row["speedup_vs_plain"] = row["tok_s"] / plain["tok_s"] if plain else None
        row["vs_unconstrained"] = row["tok_s"] / row["tok_s_free"]
        rows.append(row)
    print(f"{'spec':<14}{'valid':>8}{'==plain':>9}{'accept':>8}{'free acc':>9}{'tok/s':>8}{'x plain':>9}"
          f"{'x free':>8}{'host ms':>9}{'free ms':>9}{'compiles':>10}")
    for r in rows:
        print(f"{r['spec']:<14}{r['valid']:>4}/{r['requests']:<3}{str(r['equals_plain']):>9}{r['accept_length']:>8.2f}"
              f"{r['accept_length_free']:>9.2f}{r['tok_s']:>8.1f}{r['speedup_vs_plain']:>9.2f}"
              f"{r['vs_unconstrained']:>8.2f}{r['host_ms_per_iteration']:>9.2f}{r['host_ms_per_iteration_free']:>9.2f}"
              f"{r['compiles_timed']:>6}/{r['compiles_timed_free']}")
    if FLAGS.json_out:
        cli.write_output("--json_out", FLAGS.json_out, json.dumps({
            "command": " ".join(["python"] + sys.argv), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "max_tokens": FLAGS.max_tokens, "batch": FLAGS.batch, "dtype": FLAGS.dtype, "repeats": FLAGS.repeats, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    cli.run(main)
