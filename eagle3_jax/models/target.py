"""The target model: a pure decoder-stack forward over the KV cache, and the `Target` handle.

`forward` runs every layer segment (a run of same-kind layers, see `ModelConfig.segments`) as one
`lax.scan`, so a 61-layer model compiles two layer bodies, not 61. The stacked cache rides in the
scan carry and each layer scatters only its new tokens into it, which keeps cache updates in place.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import kv_cache, spread
from ..checkpoint import is_orbax_dir, keeps_quantized, read_flat_params
from ..checkpoint.orbax_sharded import can_restore_sharded, restore_sharded
from ..config.model import ModelConfig, load_model_config
from ..runtime import kernels as kernels_lib
from ..runtime.sharding import mesh_context, shard_cache, shard_params
from ..weights import params as params_lib
from ..weights.lazy import LazyArray
from ..weights.quant import QArray
from . import invariant
from .attention import gqa_block, mla_block
from .layers import final_logits, rms_norm, swiglu
from .moe import moe_block

# Below this many new tokens per row, MLA uses the absorbed form (decode, verify); above, expanded.
ABSORB_MAX_TOKENS = 16


def _layer(p: dict, cfg: ModelConfig, kind: str, x: jax.Array, positions: jax.Array, cache: kv_cache.KVCache,
           layer: jax.Array, visible: kv_cache.Visible, absorb: bool) -> tuple[jax.Array, kv_cache.KVCache]:
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    if cfg.attention == "mla":
        attn, cache = mla_block(p, cfg, h, positions, cache, layer, visible, absorb)
    else:
        attn, cache = gqa_block(p, cfg, h, positions, cache, layer, visible)
    x = x + attn
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    if kind != "moe":
        return x + swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"]), cache
    # The experts' psum-scatter may sum a spread row's replicas in different orders: they agree here.
    return spread.agree(x + moe_block(p, cfg, h), cache.spread, cache.data_shards), cache


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: kv_cache.KVCache,
            tree_mask: jax.Array | None = None, absorb: bool | None = None, starts: jax.Array | None = None,
            ) -> tuple[jax.Array, jax.Array, kv_cache.KVCache]:
    """Run T new tokens per row through the target: float32 logits [B, T, V], aux features and the
    cache, as `forward_hidden` describes them."""
    x, aux, cache = forward_hidden(params, cfg, tokens, positions, cache, tree_mask, absorb, starts)
    logits = invariant.final_logits(params, cfg, x) if cfg.batch_invariant else final_logits(params, cfg, x)
    return logits, aux, cache


def forward_hidden(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: kv_cache.KVCache,
                   tree_mask: jax.Array | None = None, absorb: bool | None = None, starts: jax.Array | None = None,
                   ) -> tuple[jax.Array, jax.Array, kv_cache.KVCache]:
    """Run T new tokens per row through the target's layers, up to its final norm.

    tokens, positions: int [B, T] (positions are RoPE positions: for a draft tree, length + depth).
    tree_mask: bool [B, T, T], which new tokens each new token sees (None = causal).
    starts: int [B, T], the first cache slot each new token sees (sequences packed one after another
    in a row: its own sequence's first slot); None = every slot below it.
    Returns the last layer's residual [B, T, H] (float32 with `cfg.batch_invariant`, else the
    activation dtype; `layers.final_logits` makes the logits), aux features [B, T, len(aux_layer_ids)
    * H] (the residual stream entering each aux layer, concatenated in `cfg.aux_layer_ids` order),
    and the cache with the new tokens' K/V written at slots `lengths[b] + t` (lengths unchanged: see
    kv_cache.advance). With `cfg.batch_invariant` the layers run invariant.layer (absorbed MLA
    whatever `absorb` says).
    """
    b, t = tokens.shape
    if tree_mask is None:
        tree_mask = kv_cache.causal_mask(b, t)
    if cfg.batch_invariant:
        if starts is not None:
            raise ValueError("packed sequences (starts) run only without batch_invariant")
        anc = invariant.ancestor_slots(cache.lengths, tree_mask)

        def run_layer(p, kind, x, cache, layer):
            return invariant.layer(p, cfg, kind, x, positions, cache, layer, anc)
    else:
        absorb = t <= ABSORB_MAX_TOKENS if absorb is None else absorb
        visible = kv_cache.Visible(cache.lengths, tree_mask, start=starts)

        def run_layer(p, kind, x, cache, layer):
            return _layer(p, cfg, kind, x, positions, cache, layer, visible, absorb)

    x = params["embed"][tokens]
    act_dtype = x.dtype
    if cfg.batch_invariant:  # activations in float32: see invariant.py
        x = x.astype(jnp.float32)
    aux_ids = jnp.asarray(cfg.aux_layer_ids or (0,), jnp.int32)
    aux = jnp.zeros((len(aux_ids),) + x.shape, x.dtype)

    for (kind, start, stop), seg in zip(cfg.segments, params["segments"]):
        def body(carry, xs, kind=kind):
            x, cache, aux = carry
            p, layer = xs
            aux = jnp.where((aux_ids == layer)[:, None, None, None], x[None], aux)
            x, cache = run_layer(p, kind, x, cache, layer)
            return (x, cache, aux), None

        layers = jnp.arange(start, stop, dtype=jnp.int32)
        (x, cache, aux), _ = jax.lax.scan(body, (x, cache, aux), (seg, layers))

    aux = jnp.moveaxis(aux, 0, 2).reshape(b, t, -1) if cfg.aux_layer_ids else aux[:0].reshape(b, t, 0)
    return x, aux.astype(act_dtype), cache


# ---- the public handle ------------------------------------------------------------------------------


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
        return jnp.dtype(_DTYPES[dtype])
    return jnp.dtype(dtype)


def cast_flat(flat: dict, cfg: ModelConfig, dtype: jnp.dtype) -> dict:
    """Cast float tensors to the compute dtype; routers and their bias stay float32, quantized
    weights (QArray) stay as they are."""
    specs = params_lib.flat_specs(cfg)

    def cast(k, v):
        if isinstance(v, QArray):
            return v
        dt = np.float32 if specs[k].float32 else dtype
        return v.astype(dt) if isinstance(v, LazyArray) else np.asarray(v, dt)

    return {k: cast(k, v) for k, v in flat.items()}


FP8_FORMATS = ("auto", "e4m3fn", "e4m3fnuz")


def uses_fnuz(fp8_format: str) -> bool:
    """Whether float8 weights should be e4m3fnuz: "auto" = on gfx942 (MI300X / MI325X)."""
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format {fp8_format!r} is not supported; use one of {', '.join(FP8_FORMATS)}")
    if fp8_format != "auto":
        return fp8_format == "e4m3fnuz"
    device = jax.devices()[0]
    kind = f"{device.platform} {getattr(device, 'device_kind', '')}".lower()
    return device.platform == "rocm" and any(tag in kind for tag in ("gfx942", "mi300", "mi325"))


def with_quant_options(cfg: ModelConfig, dequantize: bool = False, w4a8: bool = False,
                       fp8_format: str = "auto") -> ModelConfig:
    """Apply the load-time quantization choices to a config (see QuantConfig's run-time fields)."""
    q = cfg.quant
    if q is None:
        if w4a8:
            raise ValueError("w4a8=True needs int4 weights, but this checkpoint is not quantized")
        return cfg
    if w4a8 and (q.method != "int4_pack" or dequantize):
        raise ValueError(f"w4a8=True runs int4 weights with int8 activations; this checkpoint is {q.method}"
                         + (" and dequantize=True" if dequantize else ""))
    fnuz = q.method in ("fp8_block", "fp8_channel") and uses_fnuz(fp8_format)
    return dataclasses.replace(cfg, quant=dataclasses.replace(
        q, resident=not dequantize, activations="int8" if w4a8 else "float", fnuz=fnuz))


@dataclasses.dataclass
class Target:
    """A loaded target model: config, params (stacked tree of jax.Array) and an optional mesh."""

    config: ModelConfig
    params: dict
    dtype: jnp.dtype
    mesh: jax.sharding.Mesh | None = None
    path: str | None = None

    def logits(self, token_ids, return_aux: bool = False, aux_layer_ids: Sequence[int] | None = None):
        """Full causal forward without a persistent cache.

        token_ids int [B, T] -> float32 np.ndarray [B, T, V]; with return_aux also the aux features
        [B, T, len(aux_layer_ids) * H] (float32) of `aux_layer_ids` (default: the config's; pass
        `draft.aux_layer_ids` for the features a draft reads).
        """
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be an integer array [batch, tokens]; got shape {ids.shape}, dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}); got range [{ids.min()}, {ids.max()}]")
        cfg = self.config if aux_layer_ids is None else self.config.with_aux_layers(tuple(aux_layer_ids))
        with mesh_context(self.mesh):
            logits, aux = _full_forward(self.params, cfg, jnp.asarray(ids, jnp.int32), self.dtype)
        logits = np.asarray(logits, np.float32)
        return (logits, np.asarray(aux, np.float32)) if return_aux else logits

    def capturing(self, aux_layer_ids: Sequence[int]) -> "Target":
        """This target capturing the hidden states `aux_layer_ids` for a draft: a view that shares
        the weights (self when it already captures them)."""
        ids = tuple(int(i) for i in aux_layer_ids)
        if ids == tuple(self.config.aux_layer_ids):
            return self
        return dataclasses.replace(self, config=self.config.with_aux_layers(ids))

    def init_cache(self, batch: int, max_len: int, kv_cache_dtype: str = "auto") -> kv_cache.KVCache:
        """A dense cache of `batch` rows of `max_len` slots ("fp8": float8 slots, see kv_cache)."""
        fp8 = kv_cache.resolve_kv_dtype(kv_cache_dtype, uses_fnuz("auto"))
        cache = kv_cache.init_cache(self.config, batch, max_len, self.dtype, fp8)
        return shard_cache(cache, self.config, self.mesh) if self.mesh is not None else cache


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _full_forward(params, cfg, ids, dtype):
    b, t = ids.shape
    cache = kv_cache.init_cache(cfg, b, t, dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, aux, _ = forward(params, cfg, ids, positions, cache)
    return logits, aux


def check_batch_invariant(batch_invariant: bool, kernels: str, mesh) -> str:
    """The kernels choice to load with, or a ValueError for what batch-invariant numerics cannot run."""
    if not batch_invariant:
        return kernels
    if mesh is not None:
        raise ValueError("batch_invariant=True runs on one device for now; load without a mesh, or drop "
                         "batch_invariant")
    if any(impl == "triton" for impl in kernels_lib.parse(kernels).values()):
        raise ValueError(f"batch_invariant=True runs its own XLA ops, not Triton kernels; use kernels='xla' "
                         f"(got {kernels!r})")
    return "xla"  # "auto" would pick kernels on a GPU; the invariant path uses none


def load_target(path: str | os.PathLike, dtype="bfloat16", mesh: jax.sharding.Mesh | None = None,
                aux_layer_ids: Sequence[int] | None = None, *, dequantize: bool = False, w4a8: bool = False,
                fp8_format: str = "auto", kernels: str = "xla", batch_invariant: bool = False) -> Target:
    """Load a target from an HF folder (safetensors) or an Orbax folder made by scripts/convert.py.

    Quantized weights (int4 pack-quantized experts, block FP8, MXFP4) stay quantized on device and
    are dequantized inside the ops that use them; `dtype` is the compute dtype and the dtype of the
    unquantized tensors. `dequantize=True` dequantizes everything to `dtype` on load instead;
    `w4a8=True` runs int4 weights with dynamic per-token int8 activations; `fp8_format` picks the
    on-device float8 flavour ("auto": e4m3fnuz on gfx942, e4m3fn elsewhere). With a `mesh` (see
    sharding.make_mesh) params are placed by the logical-axis rules and MoE layers run
    expert-parallel. `aux_layer_ids` overrides which hidden states are captured for a draft
    (default 2, L//2, L-3). `kernels`: "xla" (default), "triton" (decode / verify attention through
    the paged Triton kernel, routed experts through the grouped-matmul kernels; interpreted on CPU),
    "auto" (per op, the path measured faster on this GPU: on sm_90 the attention kernel, MLA and
    GQA, and, per step, the MoE kernels where `kernels.moe_kernel_pays`; XLA on CPU and on GPUs
    not yet measured) or one choice per op, e.g.
    "attention=triton,moe=xla" (see runtime/kernels.py; attention keeps XLA on a mesh).
    `batch_invariant=True` computes every token the same way whatever shares its pass
    (invariant.py): greedy speculative output then equals greedy plain
    decoding in bfloat16 too, at a cost in speed; it runs XLA ops on one device.
    """
    path = os.fspath(path)
    kernels = check_batch_invariant(batch_invariant, kernels, mesh)
    cfg = load_model_config(path)
    if cfg.quant is not None and is_orbax_dir(path) and not keeps_quantized(path):
        dequantize = True  # converted with dequantization: the folder holds float weights only
    cfg = dataclasses.replace(with_quant_options(cfg, dequantize, w4a8, fp8_format), kernels=kernels_lib.resolve(kernels),
                              batch_invariant=bool(batch_invariant))
    if aux_layer_ids is not None:
        cfg = cfg.with_aux_layers(tuple(aux_layer_ids))
    dt = resolve_dtype(dtype)
    if mesh is not None and is_orbax_dir(path):
        if can_restore_sharded(path, cfg):  # each process restores only its own shards
            return Target(config=cfg, params=restore_sharded(path, cfg, dt, mesh), dtype=dt, mesh=mesh, path=path)
    # On a mesh, HF tensors stay lazy until placed, so each process reads only its own shards.
    flat = cast_flat(read_flat_params(path, cfg, lazy=mesh is not None), cfg, dt)
    tree = params_lib.stack_flat(flat, cfg)
    del flat
    params = shard_params(tree, cfg, mesh) if mesh is not None else jax.tree.map(jnp.asarray, tree)
    return Target(config=cfg, params=params, dtype=dt, mesh=mesh, path=path)
