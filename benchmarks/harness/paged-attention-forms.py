"""One GQA layer's paged attention on XLA:CPU in the engine's form against the forms that might
replace it, timed in one process, interleaved (each round runs the forms in turn, the next round in
the opposite order); medians in ms. On tcmalloc where installed, as the engine's scripts run (--notcmalloc:
glibc's malloc, which maps a block over 32 MB afresh every call: a whole-width gather of 32 MB or more
then takes 2x as long).

    python benchmarks/harness/paged-attention-forms.py --json_out=benchmarks/results/paged-attention-forms.json

Shapes default to the widened stories260K target of the vLLM side-by-side at C = 64 (4 KV heads of
32 lanes, 2 query heads each, 16-slot pages, float32). Forms:
- engine: `blockwise.attend` over `kv_cache.paged_view`, as the decode program runs it (the pages
  gathered through the block table and laid out head-major, then two batched dots);
- blocks<N>: the engine's online-softmax walk in blocks of N slots (the gathered block stays in cache);
- head_major_pool: pages stored [pages, kv_heads, page_size, d], so the gathered K/V need no transpose;
- multiply_reduce: scores and mix as elementwise products and sums (no dots, no transposed copy);
- block_diagonal: each query head against all KV heads' lanes as one dot per row (kv_heads x the
  multiply-adds, no transposed copy), its own head's block kept;
- rows<N>: the engine's form over N rows at a time (`lax.map`), so each chunk's gathered K/V stay in
  the core's cache between the gather and the dots;
- gather_only: the K and V pages gathered and summed, no attention (what any gathering form pays).
"""
import argparse
import time

from ab_common import add_output_flags, check_output, write_json


def forms(batch: int, context: int, tokens: int, kv_heads: int, group: int, dim: int, page: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eagle3_jax.cache import kv_cache
    from eagle3_jax.models import blockwise

    pages = context // page
    num_pages = batch * pages + 1
    rng = np.random.default_rng(0)
    pool_k = jnp.asarray(rng.standard_normal((1, num_pages, page, kv_heads, dim)), jnp.float32)
    pool_v = jnp.asarray(rng.standard_normal((1, num_pages, page, kv_heads, dim)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages))[: batch * pages].reshape(batch, pages), jnp.int32)
    lengths = jnp.asarray(rng.integers(context // 2, context - tokens + 1, batch), jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, tokens, kv_heads, group, dim)), jnp.float32)
    high = jax.lax.Precision.HIGHEST
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((tokens, tokens), bool)), (batch, tokens, tokens))
    visible = kv_cache.Visible(prefix=lengths, window=causal)
    mask = visible.mask(jnp.arange(context, dtype=jnp.int32))  # [B, T, S]

    def engine(size=None, rows=None):
        def run(q, pk, pv):
            if rows is not None:
                return row_chunks(q, pk, pv, rows)
            return attend(q, pk, pv, table, lengths, visible)

        def row_chunks(q, pk, pv, n):
            def one(args):
                q, table, lengths, window = args
                return attend(q, pk, pv, table, lengths, kv_cache.Visible(prefix=lengths, window=window))
            split = [a.reshape((batch // n, n) + a.shape[1:]) for a in (q, table, lengths, causal)]
            out = jax.lax.map(one, split)
            return out.reshape((batch,) + out.shape[2:])

        def attend(q, pk, pv, table, lengths, visible):
            cache = kv_cache.paged_view(pk, pv, table, lengths)

            def scores_of(k, v):
                return jnp.einsum("btkgd,bskd->bkgts", q, k, precision=high) * dim ** -0.5

            def mix(p, k, v):
                return jnp.einsum("bkgts,bskd->bkgtd", p, v, precision=high)

            if size is None:
                return blockwise.attend(cache, jnp.int32(0), visible, scores_of, mix, kv_heads * group)
            return blockwise.attend_partial(cache, jnp.int32(0), visible, scores_of, mix, size)[0]
        return run

    def softmax(scores, scores_mask):
        return jax.nn.softmax(jnp.where(scores_mask, scores, -1e30), axis=-1)

    def head_major_pool(q, pk, pv):
        def gather(pool):  # [1, pages, kv, page, d] -> [B, kv, S, d] by a gather placing kv first
            return pool[0][table].transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, context, dim)
        k, v = gather(pk), gather(pv)
        p = softmax(jnp.einsum("btkgd,bksd->bkgts", q, k, precision=high) * dim ** -0.5, mask[:, None, None])
        return jnp.einsum("bkgts,bksd->bkgtd", p, v, precision=high)

    def multiply_reduce(q, pk, pv):
        k = pk[0][table].reshape(batch, context, 1, kv_heads, 1, dim)
        v = pv[0][table].reshape(batch, context, 1, kv_heads, 1, dim)
        scores = (q[:, None] * k).sum(-1) * dim ** -0.5  # [B, S, T, kv, g]
        p = softmax(jnp.moveaxis(scores, 1, -1), mask[:, :, None, None])  # [B, T, kv, g, S]
        return (jnp.moveaxis(p, -1, 1)[..., None] * v).sum(1).transpose(0, 2, 3, 1, 4)  # [B, kv, g, T, d]

    def block_diagonal(q, pk, pv):
        k = pk[0][table].reshape(batch, context, kv_heads * dim)
        v = pv[0][table].reshape(batch, context, kv_heads * dim)
        eye = jnp.eye(kv_heads, dtype=q.dtype)
        wide = jnp.einsum("btkgd,kj->btkgjd", q, eye).reshape(batch, tokens * kv_heads * group, kv_heads * dim)
        scores = jnp.einsum("bqe,bse->bqs", wide, k, precision=high) * dim ** -0.5
        rows_mask = jnp.repeat(mask, kv_heads * group, axis=1)
        out = jnp.einsum("bqs,bse->bqe", softmax(scores, rows_mask), v, precision=high)
        return jnp.einsum("btkgjd,kj->bkgtd", out.reshape(batch, tokens, kv_heads, group, kv_heads, dim), eye)

    def gather_only(q, pk, pv):
        return pk[0][table].sum() + pv[0][table].sum()

    head_major = tuple(pool.transpose(0, 1, 3, 2, 4) for pool in (pool_k, pool_v))  # [1, pages, kv, page, d]
    runs = {"engine": (engine(), (pool_k, pool_v))}
    runs.update({f"blocks{n}": (engine(n), (pool_k, pool_v)) for n in (32, 64, 128) if n < context})
    runs.update({f"rows{n}": (engine(rows=n), (pool_k, pool_v)) for n in (8, 16) if batch % n == 0})
    runs.update({"head_major_pool": (head_major_pool, head_major),
                 "multiply_reduce": (multiply_reduce, (pool_k, pool_v)),
                 "block_diagonal": (block_diagonal, (pool_k, pool_v)),
                 "gather_only": (gather_only, (pool_k, pool_v))})
    return {name: (jax.jit(fn), (q,) + pools) for name, (fn, pools) in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="Rows (default: %(default)s).")
    parser.add_argument("--contexts", default="256",
                        help="Slots each row's table spans, comma-separated (default: %(default)s).")
    parser.add_argument("--tokens", default="1,4",
                        help="New tokens per row: 1 decode, 4 a chain-3 verify (default: %(default)s).")
    parser.add_argument("--kv_heads", type=int, default=4, help="KV heads (default: %(default)s).")
    parser.add_argument("--group", type=int, default=2, help="Query heads per KV head (default: %(default)s).")
    parser.add_argument("--head_dim", type=int, default=32, help="Lanes per head (default: %(default)s).")
    parser.add_argument("--page_size", type=int, default=16, help="Slots per page (default: %(default)s).")
    parser.add_argument("--rounds", type=int, default=30, help="Timed rounds (default: %(default)s).")
    parser.add_argument("--notcmalloc", action="store_true",
                        help="Time on glibc's malloc rather than the tcmalloc the engine's scripts run on.")
    add_output_flags(parser, "paged-attention-forms.json")
    args = parser.parse_args()
    check_output(args)
    from eagle3_jax.runtime import host_allocator

    host_allocator.use_tcmalloc(not args.notcmalloc)  # as serving runs: glibc maps blocks over 32 MB afresh each call
    import numpy as np

    rows = []
    for context in map(int, args.contexts.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            fns = forms(args.batch, context, tokens, args.kv_heads, args.group, args.head_dim, args.page_size)
            reference = np.asarray(fns["engine"][0](*fns["engine"][1]))
            times = {}
            for name, (fn, inputs) in fns.items():
                out = np.asarray(fn(*inputs))
                if name != "gather_only":
                    np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4, err_msg=name)
                times[name] = []
            order = list(fns)
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    fn, inputs = fns[name]
                    start = time.perf_counter()
                    fn(*inputs).block_until_ready()
                    times[name].append(time.perf_counter() - start)
            medians = {name: 1e3 * float(np.median(t[2:])) for name, t in times.items()}
            row = {"batch": args.batch, "context": context, "tokens": tokens, "ms": medians,
                   "vs_engine": {name: medians["engine"] / ms for name, ms in medians.items()}}
            rows.append(row)
            print(f"context {context}, {tokens} token(s): " + ", ".join(
                f"{name} {ms:.2f} ms ({row['vs_engine'][name]:.2f}x)" for name, ms in medians.items()), flush=True)
    write_json(args.json_out, {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "host_allocator": host_allocator.describe(not args.notcmalloc), "rows": rows})


if __name__ == "__main__":
    main()
