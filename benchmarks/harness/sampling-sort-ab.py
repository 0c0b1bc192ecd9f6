"""A/B in one process: one sampled draw per row and position (`sampling.sample`, jitted) over
random logits, for a batch whose rows sample with temperature alone (no vocabulary sort: the
program form `sampling.BatchFeatures(truncated=False)` compiles) against the same batch with top-p
0.95 (the sort, softmax, cumulative sum and scatter back that top-k / top-p need, which every
sampled batch ran before the temperature-alone form). Run it on the device to be measured.

    python benchmarks/harness/sampling-sort-ab.py --json_out=benchmarks/results/sampling-sort-ab-cpu.json --overwrite

Each row: rows (batch x positions judged: 1 per plain step, every node of a speculative one),
vocabulary, and the median over --repeats of one call's time (ms; 4 calls back to back, the last
waited for, the two forms interleaved).
"""
import argparse
import statistics
import sys
import time

from ab_common import add_output_flags, check_output, write_json


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if min(values) < 1:
        raise ValueError(text)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=_ints, default=[48, 240, 768],
                        help="Rows per call, comma-separated (default: 48,240,768: batch 48 at 1, 5 and 16 positions).")
    parser.add_argument("--vocab", type=_ints, default=[512, 32000, 163840],
                        help="Vocabulary sizes, comma-separated (default: the demo pair's, Llama-2's, Kimi's).")
    parser.add_argument("--repeats", type=int, default=10, help="Timed rounds per form (default: 10).")
    add_output_flags(parser, "sampling-sort-ab.json")
    args = parser.parse_args()
    check_output(args)

    import jax
    import jax.numpy as jnp

    from eagle3_jax.bench.report import machine_info
    from eagle3_jax.sampling.sampler import SamplingArrays, SamplingParams, sample

    draw = jax.jit(sample)
    forms = {"temperature alone": SamplingParams(temperature=0.8), "top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95)}
    rows_out = []
    print(f"device: {jax.devices()[0].device_kind}")
    print("| rows | vocabulary | temperature alone ms | top-p 0.95 ms | ratio |\n|---|---|---|---|---|")
    for vocab in args.vocab:
        for rows in args.rows:
            logits = jax.random.normal(jax.random.PRNGKey(rows), (rows, vocab), jnp.float32) * 3
            counter = jnp.zeros((rows,), jnp.int32)
            calls = {name: (lambda sp=jax.tree.map(jnp.asarray, SamplingArrays.from_params([p] * rows, rows)):
                            draw(logits, sp, counter)) for name, p in forms.items()}
            times = {name: [] for name in forms}
            for name, call in calls.items():  # compile, and a first run
                jax.block_until_ready(call())
            for _ in range(args.repeats):
                for name, call in calls.items():
                    start = time.perf_counter()
                    for _ in range(4):
                        out = call()
                    jax.block_until_ready(out)
                    times[name].append((time.perf_counter() - start) / 4)
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            row = {"rows": rows, "vocab": vocab, **{f"{name} ms": v for name, v in ms.items()},
                   "ratio": ms["temperature alone"] / ms["top-p 0.95"]}
            rows_out.append(row)
            print(f"| {rows} | {vocab} | {ms['temperature alone']:.3f} | {ms['top-p 0.95']:.3f} | {row['ratio']:.2f}x |",
                  flush=True)
    write_json(args.json_out, {"command": " ".join(["python"] + sys.argv), "machine": machine_info(),
                               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows_out})


if __name__ == "__main__":
    main()
