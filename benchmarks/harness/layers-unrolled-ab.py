"""A/B in one process: the target's forward at batch 1 (1 and 4 new tokens, 200 tokens of context,
paged cache donated from call to call) with its layers as they run (stacked weights, one
`lax.scan` per segment) against unrolled (a Python loop over per-layer weight arrays, so no layer
slices its matrices out of a stack), each with the routed experts gathered (as they run) and
dense (every token through every expert, weights read in place). Greedy tokens must agree.

    python benchmarks/results/layers-unrolled-ab.py > benchmarks/results/layers-unrolled-ab.json
"""
import functools, json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
import eagle3_jax as e3
from eagle3_jax import kv_cache, moe, target as T

target = e3.load_target("checkpoints/kimi-mini", dtype="float32")
cfg, params = target.config, target.params
PAGE, PAGES, CONTEXT = 16, 64, 200
table = jnp.arange(1, 17, dtype=jnp.int32)[None, :]
layers = [jax.tree.map(lambda a, j=j: jnp.array(a[j]), seg)
          for (_, start, stop), seg in zip(cfg.segments, params["segments"]) for j in range(stop - start)]
top = {k: v for k, v in params.items() if k != "segments"}
gathered_form = moe.gathers_experts


def unrolled_forward(top, layers, tokens, positions, cache):
    b, t = tokens.shape
    tree_mask = kv_cache.causal_mask(b, t)
    mask = kv_cache.visibility(cache.lengths, tree_mask, cache.max_len)
    x = top["embed"][tokens]
    for kind, start, stop in cfg.segments:
        for layer in range(start, stop):
            x, cache = T._layer(layers[layer], cfg, kind, x, positions, cache, jnp.int32(layer), mask,
                                t <= T.ABSORB_MAX_TOKENS, tree_mask)
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
for dense in (False, True):
    moe.gathers_experts = (lambda n, e: n < e) if dense else gathered_form  # dense from 8 assignments on
    for tokens in (1, 4):
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
        for _ in range(30):  # interleaved, 8 calls back to back, the last waited for
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
moe.gathers_experts = gathered_form
json.dump(rows, sys.stdout, indent=1)
