"""A/B in one process: the target's forward at batch 1 (1 and 4 new tokens, 200 tokens of context,
paged cache donated from call to call) with its layers as they run (stacked weights, one
`lax.scan` per segment) against unrolled (a Python loop over per-layer weight arrays, so no layer
slices its matrices out of a stack), each with the routed experts gathered (as they run) and
dense (every token through every expert, weights read in place). Greedy tokens must agree.

    python benchmarks/harness/layers-unrolled-ab.py --json_out=benchmarks/results/layers-unrolled-ab.json --overwrite

Each row: experts, tokens, layers (stacked or unrolled) and the median over --repeats of one
forward's time (ms; 8 calls back to back, the last waited for, the two forms interleaved).
"""
import argparse
import functools
import statistics
import sys
import time

from ab_common import add_output_flags, check_output, load_pair, write_json

PAGE, PAGES, CONTEXT = 16, 64, 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,4", help="New tokens per call, comma-separated (default: %(default)s).")
    parser.add_argument("--repeats", type=int, default=30, help="Timed rounds per form (default: 30).")
    add_output_flags(parser, "layers-unrolled-ab.json")
    args = parser.parse_args()
    check_output(args)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from eagle3_jax.cache import kv_cache
    from eagle3_jax.models import moe
    from eagle3_jax.models import target as T

    target, _ = load_pair()
    cfg, params = target.config, target.params
    table = jnp.arange(1, 17, dtype=jnp.int32)[None, :]
    layers = [jax.tree.map(lambda a, j=j: jnp.array(a[j]), seg)
              for (_, start, stop), seg in zip(cfg.segments, params["segments"]) for j in range(stop - start)]
    top = {k: v for k, v in params.items() if k != "segments"}
    gathered_form = moe.gathers_experts

    def unrolled_forward(top, layers, tokens, positions, cache):
        b, t = tokens.shape
        visible = kv_cache.Visible(cache.lengths, kv_cache.causal_mask(b, t))
        x = top["embed"][tokens]
        for kind, start, stop in cfg.segments:
            for layer in range(start, stop):
                x, cache = T._layer(layers[layer], cfg, kind, x, positions, cache, jnp.int32(layer), visible,
                                    t <= T.ABSORB_MAX_TOKENS)
        return T.final_logits(top, cfg, x), cache

    def program(unrolled: bool):
        @functools.partial(jax.jit, donate_argnums=(2, 3))
        def run(top, layers, tk, tv, tokens):
            t = tokens.shape[1]
            cache = kv_cache.paged_view(tk, tv, table, jnp.full((1,), CONTEXT, jnp.int32))
            positions = CONTEXT + jnp.arange(t)[None]
            if unrolled:
                logits, cache = unrolled_forward(top, layers, tokens, positions, cache)
            else:
                logits, _, cache = T.forward(params, cfg, tokens, positions, cache)
            return logits.argmax(-1), cache.k, cache.v
        return run

    rows = []
    try:
        for dense in (False, True):
            moe.gathers_experts = (lambda n, e: n < e) if dense else gathered_form  # dense from 8 assignments on
            for tokens in (int(t) for t in args.tokens.split(",")):
                ids = jnp.full((1, tokens), 5, jnp.int32)
                runs = {name: program(name == "unrolled") for name in ("stacked", "unrolled")}
                pools, outs = {}, {}
                for name, run in runs.items():
                    tk, tv = kv_cache.init_pages(cfg, PAGES, PAGE, jnp.float32)
                    for _ in range(5):
                        out, tk, tv = run(top, layers, tk, tv, ids)
                    outs[name], pools[name] = np.asarray(out), (tk, tv)
                assert (outs["stacked"] == outs["unrolled"]).all(), outs
                times = {name: [] for name in runs}
                for _ in range(args.repeats):  # interleaved, 8 calls back to back, the last waited for
                    for name, run in runs.items():
                        tk, tv = pools[name]
                        start = time.perf_counter()
                        for _ in range(8):
                            out, tk, tv = run(top, layers, tk, tv, ids)
                        out.block_until_ready()
                        times[name].append((time.perf_counter() - start) / 8 * 1e3)
                        pools[name] = (tk, tv)
                for name in runs:
                    rows.append({"experts": "dense" if dense else "gathered", "tokens": tokens, "layers": name,
                                 "forward_ms": round(statistics.median(times[name]), 3)})
                    print(rows[-1], file=sys.stderr, flush=True)
    finally:
        moe.gathers_experts = gathered_form
    write_json(args.json_out, rows)


if __name__ == "__main__":
    main()
