"""The GPU kernels, each beside its reference: Pallas kernels (Triton lowering: the path that runs on
ROCm and CUDA) `attention.paged_prefix_attention` (decode / verify attention over paged KV) and
`moe.grouped_matmul` / `moe.grouped_swiglu` (rows sorted by expert times float, int4, MXFP4, FP8 or
W4A8 expert weights), which the engine calls (`eagle3_jax/runtime/kernels.py` decides which ops
use them); and their move to `triton.jit` kernels launched through `jax_triton`
(`triton_call.py`): `triton_attention.paged_prefix_attention` and `triton_moe.grouped_matmul` /
`triton_moe.grouped_swiglu` (K steps of several scale groups, split-K), not yet called by the
engine. `launch.py` holds the launch parameters per architecture, `isa.py` compiles either kind
to GPU machine code on any host."""
