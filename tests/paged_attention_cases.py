"""What the attention kernels' tests share: paged pools with a block table over rows of given
lengths, and the tolerance a kernel's (out, lse) meets against the XLA reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def pools_and_table(rng, heads: int, dims: list[int], *, page: int, lengths: list[int], num_pages: int,
                    layers: int = 2, width: int = 6):
    """Random float32 pools [layers, num_pages, page, heads, d] (one per `dims`), a block table of
    `width` pages per row holding pages only below each row's length (page 0: unused), the lengths."""
    pools = [rng.standard_normal((layers, num_pages, page, heads, d)).astype(np.float32) for d in dims]
    order = rng.permutation(np.arange(1, num_pages))[: len(lengths) * width].reshape(len(lengths), width)
    table = np.where(np.arange(width)[None, :] * page < np.asarray(lengths)[:, None], order, 0)
    return pools, table.astype(np.int32), np.asarray(lengths, np.int32)


def close(got, want, dtype):
    # float32: 1e-5 here and on a GPU, where every kernel dot is HIGHEST (IEEE float32, not the
    # TF32 / xf32 a default-precision float32 dot becomes on sm_90 and gfx942); bfloat16: 3e-2.
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    (out, lse), (ref_out, ref_lse) = got, want
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=tol, rtol=tol)
    finite = np.isfinite(np.asarray(ref_lse))
    assert (np.isfinite(np.asarray(lse)) == finite).all()
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=tol, rtol=tol)
