"""Pallas kernels (Triton lowering: the path that runs on ROCm and CUDA), each beside its reference:
`attention.paged_prefix_attention` (decode / verify attention over paged KV) and `moe.grouped_matmul`
/ `moe.grouped_swiglu` (rows sorted by expert times float, int4, MXFP4, FP8 or W4A8 expert weights).
`eagle3_jax/runtime/kernels.py` decides which ops use them."""
