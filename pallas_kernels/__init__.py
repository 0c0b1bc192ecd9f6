"""The GPU kernels, as `triton.jit` kernels launched through `jax_triton` on a GPU and through
Triton's interpreter on a CPU host (`triton_call.py`), each beside its contract and XLA reference:
- paged prefix attention for decode and verify (`triton_attention.paged_prefix_attention`; the
  contract, KV splits, merges and the reference in `attention.py`);
- grouped matmuls for routed experts over float, int4, MXFP4, FP8 or W4A8 weights
  (`triton_moe.grouped_matmul` / `grouped_swiglu`; the tile plan, layout checks and references in
  `moe.py`).
`eagle3_jax/runtime/kernels.py` decides which ops the engine runs through them. `launch.py` holds
the launch parameters per architecture; `isa.py` compiles a captured launch to GPU machine code
(AMDGCN, PTX) on any host, for the compile gate."""
