import time, jax, jax.numpy as jnp
from pallas_kernels import triton_call, isa, launch
from pallas_kernels.triton_attention import paged_prefix_attention
sds = jax.ShapeDtypeStruct
def kimi(nh, t, batch=4, pages=512):
    return (sds((batch, 1, nh * t, 512), jnp.bfloat16), sds((batch, 1, nh * t, 64), jnp.bfloat16),
            sds((2, batch * pages, 16, 1, 512), jnp.bfloat16), sds((2, batch * pages, 16, 1, 64), jnp.bfloat16),
            sds((batch, pages), jnp.int32), sds((batch,), jnp.int32))
for arch in ("sm_90", "gfx942"):
  with launch.for_arch(arch):
    for nh, t in ((8, 1), (8, 4), (64, 4)):
        got = []
        with triton_call.capturing(got):
            jax.eval_shape(lambda q, q2, lat, rope, table, lengths: paged_prefix_attention(q, lat, None, 1, table, lengths, scale=0.1, q2=q2, k2_pool=rope), *kimi(nh, t))
        for l in got:
            t0 = time.time()
            r = isa.compile_launch(l, arch)
            c = dict(l.constexprs)
            print(arch, nh, t, "grid", l.grid, "BLOCK_M", c["BLOCK_M"], "TILE", c["TILE"], "warps", l.num_warps, "regs", r.registers, "spill", r.vgpr_spills, r.spill_store_bytes, "agpr", r.agprs, "occ", r.occupancy, "shared", r.shared_bytes, isa.check(r), f"{time.time()-t0:.1f}s", (r.error or "")[-600:])
