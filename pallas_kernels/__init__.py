"""Pallas kernels (Triton lowering: the path that runs on ROCm and CUDA), each beside its pure-jnp
reference: `attention.paged_prefix_attention` (decode / verify attention over paged KV) and
`moe.grouped_matmul` (rows sorted by expert times float or int4 expert weights)."""
