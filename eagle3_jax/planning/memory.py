"""AOT memory planner and roofline: what a configuration needs per device, before any weight exists.

`plan_memory` builds the real programs (the speculative step, the plain decode step, a prefill
chunk) over shape-only, sharded arguments (`jax.ShapeDtypeStruct` with NamedShardings: quantized
weights as QArrays of packed values + scales), compiles them ahead of time for the mesh, and reads
XLA's `memory_analysis()`: that is the truth about what fits, temps included. Beside it, the
analytic view: the weight and KV-cache bytes each device holds, how many KV tokens the rest of a
device's HBM would hold, and a roofline step time from the bytes one decode step reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import launch

from ..cache import kv_cache
from ..config.draft import DraftConfig, check_fits_target, parse_draft_config
from ..config.model import ModelConfig, load_model_config
from ..models.target import resolve_dtype, with_quant_options
from ..runtime.kernels import parse, resolve
from ..runtime.sharding import axis_size, leaf_partition_spec, mesh_context, param_axes, param_shardings, partition_spec
from ..sampling.sampler import MAX_SUPPRESSED_STOP_IDS, SamplingArrays
from ..scheduler.steps import plain_prefill, plain_step, spec_prefill
from ..spec_decode.propose import DraftRoot
from ..spec_decode.settings import SpecConfig
from ..spec_decode.step import spec_step
from ..weights.params import ParamSpec, abstract_leaf, abstract_params, draft_specs, qformat_for
from ..weights.quant import QArray

GB = 10**9  # vendors state HBM sizes in decimal GB: 256 GB = 238.4 GiB


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    hbm_bytes: int
    hbm_gbps: float  # peak HBM bandwidth, GB/s
    bf16_tflops: float  # peak dense bf16 matrix rate, TFLOP/s


# The vendors' data-sheet peaks (dense, without sparsity).
DEVICES = {
    "MI300X": Device("MI300X", 192 * GB, 5300.0, 1307.4),
    "MI325X": Device("MI325X", 256 * GB, 6000.0, 1307.4),
    "MI355X": Device("MI355X", 288 * GB, 8000.0, 2516.6),
    "H100": Device("H100", 80 * GB, 3350.0, 989.4),
    "H200": Device("H200", 141 * GB, 4800.0, 989.4),
}


@dataclasses.dataclass
class MemoryPlan:
    """Per-device figures (bytes) for one target (+ draft) on one mesh at one batch size."""

    mesh_shape: dict[str, int]
    batch: int
    max_len: int
    spec: SpecConfig | None
    argument_bytes: int  # XLA memory_analysis of the step program (speculative if a draft is given)
    temp_bytes: int
    output_bytes: int
    alias_bytes: int
    weight_bytes: int  # target (+ draft) weights this device holds
    kv_bytes: int  # target (+ draft) KV caches this device holds
    kv_bytes_per_token: int  # per device, one token of one sequence, target + draft
    step_read_bytes: int  # bytes one step reads on this device (roofline)
    programs: dict[str, dict[str, int]]  # memory_analysis of each compiled program
    path: str = "xla"  # what was compiled: "xla", or "<kernels> on <arch> (kernels shape-only)"
    kv_cache_dtype: str = "auto"

    @property
    def total_bytes(self) -> int:
        """Arguments + temps: what the step needs resident at its peak (outputs alias the donated caches)."""
        return self.argument_bytes + self.temp_bytes

    def fits(self, device: Device) -> bool:
        return self.total_bytes <= device.hbm_bytes

    def kv_tokens_left(self, device: Device) -> int:
        """Extra KV tokens (summed over sequences) the device's remaining HBM would hold."""
        return max(0, (device.hbm_bytes - self.total_bytes) // max(self.kv_bytes_per_token, 1))

    def step_ms(self, device: Device) -> float:
        """Roofline time of one step: bytes read / peak bandwidth."""
        return self.step_read_bytes / (device.hbm_gbps * 1e6)

    def tpot_ms(self, device: Device, tau: float = 1.0) -> float:
        """Roofline time per output token per sequence for a mean acceptance length tau."""
        return self.step_ms(device) / tau

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["spec"] = None if self.spec is None else dataclasses.asdict(self.spec)
        out["total_bytes"] = self.total_bytes
        return out


# ---- inputs -----------------------------------------------------------------------------------------


def _target_config(target) -> ModelConfig:
    if isinstance(target, ModelConfig):
        return target
    if hasattr(target, "config") and isinstance(target.config, ModelConfig):
        return target.config
    return load_model_config(target)


def _draft_config(draft) -> DraftConfig | None:
    if draft is None or isinstance(draft, DraftConfig):
        return draft
    if hasattr(draft, "config") and isinstance(draft.config, DraftConfig):
        return draft.config
    path = os.fspath(draft)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return parse_draft_config(json.load(f))


def _apply_quant(cfg: ModelConfig, quant: str | None, fp8_format: str = "e4m3fn") -> ModelConfig:
    """quant: None = as the config says; "dequantize" = floats; "w4a8" = int4 with int8 activations.
    fp8_format: the on-device float8 flavour (e4m3fnuz is gfx942's)."""
    if quant is None:
        return with_quant_options(cfg, fp8_format=fp8_format)
    if quant not in ("dequantize", "w4a8"):
        raise ValueError(f"quant {quant!r} is not supported; use None (as the config says), 'dequantize' or 'w4a8'")
    return with_quant_options(cfg, dequantize=quant == "dequantize", w4a8=quant == "w4a8", fp8_format=fp8_format)


# ---- shapes with shardings ------------------------------------------------------------------------------


def _with_sharding(tree, shardings):
    def one(leaf, sharding):
        if isinstance(leaf, QArray):
            return QArray(jax.ShapeDtypeStruct(leaf.values.shape, leaf.values.dtype, sharding=sharding.values),
                          jax.ShapeDtypeStruct(leaf.scales.shape, leaf.scales.dtype, sharding=sharding.scales),
                          leaf.qformat)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(one, tree, shardings, is_leaf=lambda x: isinstance(x, QArray))


def float8_as_bytes(tree):
    """FP8 weights' values declared as their raw bytes (uint8; quant.float8_view reads them as
    float8 where they are used): XLA:CPU has no float8 arithmetic and widens every float8 stack
    whole, ahead of the layer loop, where a GPU widens one layer's slice inside it."""
    def one(leaf):
        if isinstance(leaf, QArray) and jnp.issubdtype(leaf.values.dtype, jnp.floating):
            v = leaf.values
            return dataclasses.replace(leaf, values=jax.ShapeDtypeStruct(v.shape, jnp.uint8, sharding=v.sharding))
        return leaf

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, QArray))


def abstract_target(cfg: ModelConfig, dtype, mesh: Mesh) -> dict:
    params = abstract_params(cfg, dtype)
    return _with_sharding(params, param_shardings(params, cfg, mesh))


def abstract_draft(dcfg: DraftConfig, dtype, mesh: Mesh) -> dict:
    """The draft's param tree (as `draft._assemble` builds it), replicated, FP8 layers as QArrays."""
    replicated = NamedSharding(mesh, PartitionSpec())
    flat = draft_specs(dcfg, with_embed=True)
    fmt = None if dcfg.quant is None else qformat_for(dcfg.quant)

    def leaf(name: str, spec: ParamSpec):
        quantized = fmt is not None and name.startswith("layers.") and len(spec.shape) == 2
        return abstract_leaf(dataclasses.replace(spec, quant=fmt if quantized else None), dtype)

    tree = {k: leaf(k, flat[k]) for k in ("fc", "final_norm", "lm_head", "embed")}
    tree["layers"] = [{n.split(".", 2)[2]: leaf(n, s) for n, s in flat.items() if n.startswith(f"layers.{i}.")}
                      for i in range(dcfg.layers.num_layers)]
    if dcfg.has_draft_vocab:
        tree["d2t"] = jax.ShapeDtypeStruct((dcfg.draft_vocab_size,), jnp.int32)
    shardings = jax.tree.map(lambda x: replicated, tree)
    return _with_sharding(tree, shardings)


def abstract_cache(cfg: ModelConfig, batch: int, max_len: int, dtype, mesh: Mesh, fp8=None) -> kv_cache.KVCache:
    """The dense cache's shapes, sharded (float8 slots with their scales when `fp8`)."""
    shapes = jax.eval_shape(lambda: kv_cache.init_cache(cfg, batch, max_len, dtype, fp8))
    k_axes, v_axes = kv_cache.cache_axes(cfg)

    def put(sds, axes):
        if isinstance(sds, kv_cache.Fp8Slots):
            return kv_cache.Fp8Slots(put(sds.values, axes), put(sds.scales, axes[:-1] + (None,)))
        return jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=NamedSharding(mesh, partition_spec(axes, sds.shape, mesh)))

    return kv_cache.KVCache(k=put(shapes.k, k_axes), v=put(shapes.v, v_axes), lengths=put(shapes.lengths, ("batch",)),
                            compute_dtype=jnp.dtype(dtype))


def _vec(batch: int, dtype, mesh: Mesh) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((batch,), dtype, sharding=NamedSharding(mesh, partition_spec(("batch",), (batch,), mesh)))


def _rows(batch: int, width: int, mesh: Mesh, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
    spec = partition_spec(("batch", None), (batch, width), mesh)
    return jax.ShapeDtypeStruct((batch, width), dtype, sharding=NamedSharding(mesh, spec))


def _sampling(batch: int, mesh: Mesh) -> SamplingArrays:
    return SamplingArrays(temperature=_vec(batch, jnp.float32, mesh), top_k=_vec(batch, jnp.int32, mesh),
                          top_p=_vec(batch, jnp.float32, mesh), seed=_vec(batch, jnp.uint32, mesh),
                          min_tokens=_vec(batch, jnp.int32, mesh), stop_ids=_rows(batch, MAX_SUPPRESSED_STOP_IDS, mesh))


# ---- analytic bytes ---------------------------------------------------------------------------------------


def _shard_count(spec, mesh: Mesh) -> int:
    return math.prod(axis_size(mesh, entry) for entry in spec)


def _leaf_device_bytes(leaf, axes, mesh: Mesh) -> int:
    spec = leaf_partition_spec(axes, leaf, mesh)
    if isinstance(leaf, QArray):
        return (leaf.values.size * leaf.values.dtype.itemsize // _shard_count(spec.values, mesh)
                + leaf.scales.size * leaf.scales.dtype.itemsize // _shard_count(spec.scales, mesh))
    return leaf.size * jnp.dtype(leaf.dtype).itemsize // _shard_count(spec, mesh)


def _leaf_bytes(leaf) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(leaf))


def _target_bytes(cfg: ModelConfig, params: dict, mesh: Mesh, tokens: int) -> tuple[int, int]:
    """(bytes held, bytes one step over `tokens` tokens reads) of the target's weights on one device.

    Routed experts are read only when chosen: a device holding E_l of E experts reads each with
    probability 1 - (1 - k/E)^tokens (uniform routing)."""
    sizes = jax.tree.map(lambda leaf, ax: _leaf_device_bytes(leaf, ax, mesh), params, param_axes(params, cfg, mesh),
                         is_leaf=lambda x: isinstance(x, QArray))
    touched = 1.0
    if cfg.num_experts:
        touched = 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** tokens
    held = read = 0
    for path, b in jax.tree_util.tree_flatten_with_path(sizes)[0]:
        name = str(getattr(path[-1], "key", ""))
        held += b
        read += int(b * touched) if name.startswith("experts_") else b
    return held, read


def _cache_device_bytes(cache: kv_cache.KVCache, mesh: Mesh) -> int:
    total = 0
    for x in jax.tree.leaves((cache.k, cache.v)):
        total += x.size * jnp.dtype(x.dtype).itemsize // _shard_count(x.sharding.spec, mesh)
    return total


# ---- the planner -------------------------------------------------------------------------------------------


def _analysis(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {"argument_bytes": int(m.argument_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes)}


@dataclasses.dataclass(frozen=True)
class AbstractSetup:
    """A configuration's configs and shape-only, sharded arguments (see `abstract_setup`)."""

    cfg: ModelConfig
    dcfg: DraftConfig | None
    spec: SpecConfig | None
    mesh: Mesh
    batch: int
    dtype: jnp.dtype
    tparams: dict
    tcache: kv_cache.KVCache
    dparams: dict | None
    dcache: kv_cache.KVCache | None


def abstract_setup(target, draft=None, mesh: Mesh | None = None, batch: int = 1, max_len: int = 2048,
                   spec: SpecConfig | None = None, quant: str | None = None, dtype="bfloat16",
                   kernels: str | None = None, fp8_format: str = "e4m3fn", kv_cache_dtype: str = "auto"
                   ) -> AbstractSetup:
    """Target (+ draft) configs with the draft's aux layers applied, and their params and caches
    as sharded ShapeDtypeStructs on `mesh` (default: one device). `kernels` (canonical per-op form,
    runtime/kernels.py) is what the programs run; default as the config says (XLA). The caches are
    float8 (in `fp8_format`'s flavour) with kv_cache_dtype="fp8"."""
    kv_fp8 = kv_cache.resolve_kv_dtype(kv_cache_dtype, fnuz=fp8_format == "e4m3fnuz")
    cfg = _apply_quant(_target_config(target), quant, fp8_format)
    dcfg = _draft_config(draft)
    if kernels is not None:
        cfg = dataclasses.replace(cfg, kernels=kernels)
    if dcfg is not None:
        check_fits_target(dcfg, cfg)
        if dcfg.aux_layer_ids is not None:
            cfg = cfg.with_aux_layers(dcfg.aux_layer_ids)
        dcfg = dataclasses.replace(dcfg, layers=dataclasses.replace(dcfg.layers, kernels=cfg.kernels))
        spec = spec or SpecConfig(3, 1, 4)
    else:
        spec = None
    if mesh is None:
        mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "tensor", "expert"))
    dt = resolve_dtype(dtype)
    dparams = dcache = None
    if dcfg is not None:
        dparams = abstract_draft(dcfg, dt, mesh)
        dcache = abstract_cache(dcfg.layers, batch, max_len, dt, mesh, kv_fp8)
    return AbstractSetup(cfg, dcfg, spec, mesh, batch, dt, abstract_target(cfg, dt, mesh),
                         abstract_cache(cfg, batch, max_len, dt, mesh, kv_fp8), dparams, dcache)


def trace_programs(setup: AbstractSetup, prefill_chunk: int = 256,
                   programs: Sequence[str] = ("step", "decode", "prefill")) -> dict[str, jax.stages.Traced]:
    """The engine's programs over `setup`'s shapes, traced (call under `mesh_context(setup.mesh)`):
    "spec_step" (with a draft), "decode" (the plain step; always without a draft) and "prefill"
    (one chunk of `prefill_chunk` tokens per row, in the expanded MLA form the scheduler's prefill
    uses), as `programs` asks."""
    cfg, dcfg, mesh, batch = setup.cfg, setup.dcfg, setup.mesh, setup.batch
    sp = _sampling(batch, mesh)
    vec = _vec(batch, jnp.int32, mesh)
    chunk = _rows(batch, prefill_chunk, mesh)
    traced: dict[str, jax.stages.Traced] = {}
    if dcfg is not None:
        root = DraftRoot(token=vec, hidden=_rows(batch, dcfg.hidden_size, mesh, setup.dtype))
        static = ("tcfg", "dcfg", "spec")
        if "step" in programs:
            step = jax.jit(spec_step, static_argnames=static, donate_argnames=("tcache", "dcache"))
            traced["spec_step"] = step.trace(setup.tparams, cfg, setup.dparams, dcfg, setup.spec, setup.tcache,
                                             setup.dcache, root, sp, vec)
        if "prefill" in programs:
            prefill = jax.jit(spec_prefill, static_argnames=static[:2] + ("absorb",),
                              donate_argnames=("tcache", "dcache"))
            traced["prefill"] = prefill.trace(setup.tparams, cfg, setup.dparams, dcfg, setup.tcache, setup.dcache,
                                              chunk, vec, sp, vec, absorb=False)
    elif "prefill" in programs:
        prefill = jax.jit(plain_prefill, static_argnames=("tcfg", "absorb"), donate_argnames=("tcache",))
        traced["prefill"] = prefill.trace(setup.tparams, cfg, setup.tcache, chunk, vec, sp, vec, absorb=False)
    if "decode" in programs or dcfg is None:
        decode = jax.jit(plain_step, static_argnames=("tcfg",), donate_argnames=("tcache",))
        traced["decode"] = decode.trace(setup.tparams, cfg, setup.tcache, vec, sp, vec)
    return traced


def planned_kernels(kernels: str, arch: str | None) -> str | None:
    """What a plan compiles: None for the XLA path, else `kernels` resolved as on `arch`'s GPU (a
    ValueError for an arch the launch table does not know: kernels are planned for a GPU)."""
    if all(impl == "xla" for impl in parse(kernels).values()):
        return None
    if arch not in launch.ARCHS:
        raise ValueError(f"planning the Triton kernels needs the GPU they run on: arch={arch!r}; use one of "
                         f"{', '.join(launch.ARCHS)}")
    return resolve(kernels, on_gpu=True, arch=arch)


def compiled_as_on_gpu(planned: str | None, arch: str | None) -> contextlib.ExitStack:
    """Compile as a GPU holds a program: KV writes in place and, with `planned` kernels, each
    kernel standing in as an op of its exact output shapes for `arch` (see `plan_memory`)."""
    stand_ins = contextlib.ExitStack()
    stand_ins.enter_context(launch.scatters_in_place())
    if planned:
        stand_ins.enter_context(launch.for_arch(arch))
        stand_ins.enter_context(launch.shape_only())
    return stand_ins


def plan_memory(target, draft=None, mesh: Mesh | None = None, batch: int = 1, max_len: int = 2048,
                spec: SpecConfig | None = None, quant: str | None = None, dtype="bfloat16",
                prefill_chunk: int = 256, programs: Sequence[str] = ("step", "decode", "prefill"),
                kernels: str = "xla", arch: str | None = None, kv_cache_dtype: str = "auto",
                fp8_format: str = "e4m3fn") -> MemoryPlan:
    """Compile the programs for `target` (+ `draft`) on `mesh` from shapes alone and report per device.

    target / draft: an HF or converted folder, a bare config.json path, a config, or a loaded
    Target / Draft (only its config is used). quant: None (as the config says), "dequantize" or
    "w4a8". spec: the speculation shape (default chain 3/1/4 when a draft is given). The numbers
    come from the speculative step when a draft is given, else from the plain decode step.
    kv_cache_dtype: "auto" (the compute dtype) or "fp8" (float8 KV with its scales, as
    `Engine(kv_cache_dtype="fp8")` keeps it). fp8_format: the float8 flavour of FP8 weights and
    of an FP8 cache ("e4m3fnuz" on gfx942, the same bytes).

    On a mesh each figure is one device's: with a `data` axis the cache's rows are split over it,
    so `kv_bytes` is this device's share.

    kernels: "xla" plans the XLA path (its MoE dequantizes FP8 / int4 experts to bf16 before the
    dot, so their temps count). "triton" (or per op, as `load_target` takes it, resolved as on
    the GPU: attention keeps XLA on a mesh that splits it) plans the program a GPU runs with the
    Triton kernels, for `arch` (a key of `pallas_kernels.launch.ARCHS`, e.g. "gfx942"; required,
    since this host has no such GPU): each kernel stands in as an opaque op of its exact output
    shapes (`launch.shape_only`), so the plan counts the kernels' outputs and no dequantized
    weight copies. `MemoryPlan.path` says which path a plan is for.

    Either way the programs are compiled as a GPU holds them, where XLA:CPU would hold more: KV
    cache writes count as in place (`launch.scatters_in_place`; XLA:CPU copies a bfloat16 cache
    through the bitcasts of its bit-level writes, `kv_cache._on_bits`) and FP8 weights are declared as their bytes
    (`float8_as_bytes`; XLA:CPU widens whole float8 stacks ahead of the layer loop).
    """
    planned = planned_kernels(kernels, arch)
    setup = abstract_setup(target, draft, mesh, batch, max_len, spec, quant, dtype, kernels=planned,
                           fp8_format=fp8_format, kv_cache_dtype=kv_cache_dtype)
    cfg, dcfg, spec, mesh = setup.cfg, setup.dcfg, setup.spec, setup.mesh
    setup = dataclasses.replace(setup, tparams=float8_as_bytes(setup.tparams),
                                dparams=float8_as_bytes(setup.dparams))
    tparams, tcache, dparams, dcache = setup.tparams, setup.tcache, setup.dparams, setup.dcache
    with compiled_as_on_gpu(planned, arch), mesh_context(mesh):
        traced = trace_programs(setup, prefill_chunk, programs)
        results = {name: _analysis(t.lower().compile()) for name, t in traced.items()}

    main = results["spec_step"] if "spec_step" in results else results["decode"]
    tokens = batch * (spec.num_draft_tokens if spec else 1)
    weight_held, weight_read = _target_bytes(cfg, tparams, mesh, tokens)
    kv = _cache_device_bytes(tcache, mesh)
    if dcfg is not None:
        draft_bytes = _leaf_bytes(dparams)
        weight_held += draft_bytes
        weight_read += draft_bytes * spec.num_steps
        kv += _cache_device_bytes(dcache, mesh)
    kv_per_token = max(1, kv // (batch * max_len))
    return MemoryPlan(
        mesh_shape=dict(mesh.shape), batch=batch, max_len=max_len, spec=spec,
        argument_bytes=main["argument_bytes"], temp_bytes=main["temp_bytes"], output_bytes=main["output_bytes"],
        alias_bytes=main["alias_bytes"], weight_bytes=weight_held, kv_bytes=kv, kv_bytes_per_token=kv_per_token,
        step_read_bytes=weight_read + kv, programs=results,
        path=f"{planned} on {arch} (kernels shape-only)" if planned else "xla", kv_cache_dtype=kv_cache_dtype,
    )
