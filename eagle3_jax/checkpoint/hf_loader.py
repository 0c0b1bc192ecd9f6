"""HF safetensors folder -> our flat parameter layout, validated up front, one layer at a time.

Loading runs in two phases. *Planning* reads only headers (plus the tiny int4 `weight_shape`
tensors): it folds quantization companions into their weights, maps every key (weights/keymap.py),
and checks the result against `params.flat_specs(cfg)` -- missing, unexpected, duplicate,
mis-shaped and non-float tensors are all reported together in one `CheckpointError`, before any
large read. *Materializing* then decodes, dequantizes, transposes and stacks one layer at a time,
so a caller that consumes `iter_hf_layers` holds a single layer in memory.

Quantization is detected per tensor from the companions present (`<w>.weight_scale_inv` -> fp8
block; `<w>.weight_packed` + `weight_scale` + `weight_shape` -> int4 pack; uint8 `<w>.weight` +
`weight_scale` -> MXFP4; float8 `<w>.weight` + `weight_scale` -> per-channel FP8), and must agree
with config.json's quantization_config. A parameter whose spec is quantized (`ParamSpec.quant`,
from the config's method and ignore list) is built as a host `QArray` in the checkpoint's own
bytes (transposed to our [in, out] orientation, int32 words viewed as bytes); one that is not is
dequantized to float32 as before, which is also what `QuantConfig.resident=False` asks for.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import re
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

from ..config.model import ModelConfig
from ..weights import keymap
from ..weights.lazy import LazyArray
from ..weights.params import ParamSpec, flat_specs
from ..weights.quant import QArray, QFormat
from . import quant
from .errors import CheckpointError
from .safetensors_io import HFCheckpoint, open_hf_checkpoint

FLOAT_DTYPES = frozenset(np.dtype(d) for d in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))
FP8_DTYPES = frozenset(np.dtype(d) for d in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))
OUTPUT_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
GLOBAL_NAMES = ("embed", "final_norm", "lm_head")
_MAX_REPORTED = 25
_COMPANIONS = (("_scale_inv", "scale_inv"), ("_packed", "packed"), ("_scale", "scale"), ("_shape", "shape"))
_LAYER_NAME_RE = re.compile(r"^layers\.(\d+)\.")

logger = logging.getLogger(__name__)


def resolve_dtype(dtype: str | np.dtype | type | None) -> np.dtype | None:
    """None, or one of float32 / bfloat16 / float16 (by name or numpy dtype)."""
    if dtype is None:
        return None
    try:
        d = np.dtype(dtype) if not isinstance(dtype, str) else OUTPUT_DTYPES[dtype]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {', '.join(OUTPUT_DTYPES)} or None") from e
    if d not in OUTPUT_DTYPES.values():
        raise CheckpointError(f"dtype {d} is not supported; use one of {', '.join(OUTPUT_DTYPES)} or None")
    return d


def layer_of(flat_name: str) -> int | None:
    """Layer index of a flat name (`layers.3.q_proj` -> 3); None for embed / final_norm / lm_head."""
    m = _LAYER_NAME_RE.match(flat_name)
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class Stored:
    """One logical weight in the checkpoint, after folding its quantization companions."""

    key: str  # logical key, e.g. "...mlp.experts.3.up_proj.weight" (may not exist for int4)
    kind: str  # "plain" | "fp8_block" | "int4_pack" | "mxfp4" | "fp8_channel" (the QuantConfig method names)
    parts: Mapping[str, str]  # role ("weight", "scale_inv", "packed", "scale", "shape") -> real key
    shape: tuple[int, ...]  # decoded shape, HF orientation
    dtype: np.dtype  # decoded dtype: the stored float dtype, or float32 when dequantized

    @property
    def shown_key(self) -> str:
        """The real key to name in messages (int4 weights have no `.weight` tensor)."""
        return self.parts.get("weight") or self.parts.get("packed") or self.key


@dataclasses.dataclass
class Assembly:
    """How one flat parameter is built: one tensor, per-expert tensors, or a fused expert tensor."""

    name: str
    spec: ParamSpec
    single: tuple[Stored, keymap.Target] | None = None
    experts: dict[int, tuple[Stored, keymap.Target]] = dataclasses.field(default_factory=dict)
    fused: tuple[Stored, keymap.Target] | None = None

    def sources(self) -> list[tuple[Stored, keymap.Target]]:
        out = [s for s in (self.single, self.fused) if s is not None]
        return out + [self.experts[e] for e in sorted(self.experts)]


@dataclasses.dataclass
class Plan:
    """A validated loading plan: every flat parameter of `cfg` and where it comes from."""

    ckpt: HFCheckpoint
    cfg: ModelConfig
    assemblies: dict[str, Assembly]

    def groups(self) -> list[tuple[int | None, list[str]]]:
        """Flat names grouped for loading: (None, globals) then (i, layer i's names) in order."""
        by_layer: dict[int | None, list[str]] = {}
        for name in self.assemblies:
            by_layer.setdefault(layer_of(name), []).append(name)
        order = [None] + list(range(self.cfg.num_layers))
        return [(i, by_layer[i]) for i in order if i in by_layer]


# ---- planning -------------------------------------------------------------------------------


def _split_companion(key: str) -> tuple[str, str]:
    """(logical weight key, role) of a raw key; companions end in `.weight_<suffix>`."""
    for suffix, role in _COMPANIONS:
        if key.endswith(".weight" + suffix):
            return key[: -len(suffix)], role
    return key, "weight"


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _stored(ckpt: HFCheckpoint, cfg: ModelConfig, base: str, parts: dict[str, str], problems: list[str]) -> Stored | None:
    """Classify one logical weight and check its parts' dtypes and shapes; None (and a problem
    recorded) when it cannot be decoded."""
    roles = set(parts)
    info = {r: ckpt.infos[k] for r, k in parts.items()}
    if roles == {"weight"}:
        dt = info["weight"].dtype
        if dt in FP8_DTYPES:
            problems.append(
                f"tensor {parts['weight']!r} is {dt} but has no {base}_scale_inv companion; block-fp8 weights need "
                "their scales -- re-download the shard that holds it"
            )
            return None
        if dt not in FLOAT_DTYPES:
            problems.append(
                f"tensor {parts['weight']!r} has dtype {dt}, but a float tensor (float32 / bfloat16 / float16, or a "
                "quantized weight with its scale companions) is expected; the checkpoint is corrupt or not a "
                f"{cfg.model_type} checkpoint"
            )
            return None
        return Stored(base, "plain", parts, info["weight"].shape, dt)
    if roles == {"weight", "scale_inv"}:
        q = cfg.quant
        if q is None or q.method != "fp8_block":
            problems.append(
                f"tensor {parts['scale_inv']!r} is a block-fp8 scale, but config.json has no fp8 quantization_config "
                "(quant_method 'fp8', weight_block_size [128, 128]); use the config.json shipped with these weights"
            )
            return None
        w, s = info["weight"], info["scale_inv"]
        want = quant.fp8_scale_shape(w.shape, q.block_size) if len(w.shape) == 2 else None
        if w.dtype not in FP8_DTYPES or len(w.shape) != 2:
            problems.append(f"tensor {parts['weight']!r} has a weight_scale_inv but is {w.dtype} {_fmt(w.shape)}, not a 2-D float8 matrix")
            return None
        if s.dtype not in FLOAT_DTYPES or s.shape != want:
            problems.append(
                f"tensor {parts['scale_inv']!r} is {s.dtype} {_fmt(s.shape)} but a {_fmt(w.shape)} weight with "
                f"{q.block_size[0]}x{q.block_size[1]} blocks needs float {_fmt(want)}; the shard is corrupt"
            )
            return None
        return Stored(base, "fp8_block", parts, w.shape, np.dtype(np.float32))
    if roles == {"weight", "scale"}:
        return _stored_weight_and_scale(cfg, base, parts, info, problems)
    if roles == {"packed", "scale", "shape"}:
        q = cfg.quant
        if q is None or q.method != "int4_pack":
            problems.append(
                f"tensor {parts['packed']!r} is int4 pack-quantized, but config.json has no compressed-tensors "
                "pack-quantized quantization_config; use the config.json shipped with these weights"
            )
            return None
        shp = info["shape"]
        if shp.dtype.kind not in "iu" or shp.shape != (2,):
            problems.append(f"tensor {parts['shape']!r} is {shp.dtype} {_fmt(shp.shape)}, expected an int [2] (out, in)")
            return None
        rows, cols = (int(v) for v in np.asarray(ckpt.read(parts["shape"])))
        want_p, want_s = quant.int4_packed_shape((rows, cols), q.group_size)
        p, s = info["packed"], info["scale"]
        if p.dtype != np.dtype(np.int32) or p.shape != want_p:
            problems.append(
                f"tensor {parts['packed']!r} is {p.dtype} {_fmt(p.shape)} but weight_shape {_fmt((rows, cols))} needs "
                f"int32 {_fmt(want_p)}; the shard is corrupt"
            )
            return None
        if s.dtype not in FLOAT_DTYPES or s.shape != want_s:
            problems.append(
                f"tensor {parts['scale']!r} is {s.dtype} {_fmt(s.shape)} but weight_shape {_fmt((rows, cols))} with "
                f"group {q.group_size} needs float {_fmt(want_s)}; check quantization_config.group_size"
            )
            return None
        return Stored(base, "int4_pack", parts, (rows, cols), np.dtype(np.float32))
    hint = ""
    if "packed" in roles:
        hint = " (int4 pack-quantized weights need weight_packed, weight_scale and weight_shape)"
    elif "scale_inv" in roles:
        hint = " (block-fp8 weights need weight and weight_scale_inv)"
    problems.append(
        f"tensor {base!r} comes as parts {sorted(parts)}, which is not a supported storage{hint}; supported: a plain "
        "float weight, block fp8 (weight + weight_scale_inv), int4 pack-quantized (weight_packed + weight_scale + "
        "weight_shape). Re-download the missing part or use a supported export"
    )
    return None


def _stored_weight_and_scale(cfg: ModelConfig, base: str, parts: dict[str, str], info: dict, problems: list[str]) -> Stored | None:
    """AMD Quark layouts: MXFP4 (uint8 weight [out, in/2] + e8m0 uint8 weight_scale [out, in/32]) or
    per-channel FP8 (float8 weight [out, in] + float weight_scale [out] or [out, 1])."""
    q = cfg.quant
    w, s = info["weight"], info["scale"]
    if q is None or q.method not in ("mxfp4", "fp8_channel"):
        problems.append(
            f"tensor {parts['scale']!r} is a weight scale, but config.json has no quark MXFP4 / ptpc_fp8 quantization_config; "
            "use the config.json shipped with these weights"
        )
        return None
    if q.method == "mxfp4":
        if w.dtype != np.dtype(np.uint8) or len(w.shape) != 2:
            problems.append(f"tensor {parts['weight']!r} is {w.dtype} {_fmt(w.shape)}; MXFP4 weights are uint8 [out, in/2]")
            return None
        rows, cols = w.shape[0], 2 * w.shape[1]
        want = (rows, math.ceil(cols / 32))
        if s.dtype != np.dtype(np.uint8) or s.shape != want:
            problems.append(
                f"tensor {parts['scale']!r} is {s.dtype} {_fmt(s.shape)} but a {_fmt(w.shape)} MXFP4 weight needs e8m0 uint8 "
                f"{_fmt(want)} (one scale per 32 elements); the shard is corrupt or not MXFP4"
            )
            return None
        return Stored(base, "mxfp4", parts, (rows, cols), np.dtype(np.float32))
    if w.dtype not in FP8_DTYPES or len(w.shape) != 2:
        problems.append(f"tensor {parts['weight']!r} is {w.dtype} {_fmt(w.shape)}; per-channel FP8 weights are float8 [out, in]")
        return None
    if s.dtype not in FLOAT_DTYPES or s.shape not in ((w.shape[0],), (w.shape[0], 1)):
        problems.append(
            f"tensor {parts['scale']!r} is {s.dtype} {_fmt(s.shape)} but a {_fmt(w.shape)} per-channel FP8 weight needs float "
            f"[{w.shape[0]}] or [{w.shape[0]}, 1] (one scale per output row)"
        )
        return None
    return Stored(base, "fp8_channel", parts, w.shape, np.dtype(np.float32))


def _expected_hf_shape(spec: ParamSpec, target: keymap.Target) -> tuple[int, ...]:
    s = spec.shape
    if target.fused in ("gate", "up"):
        return (s[0], 2 * s[2], s[1])
    if target.fused == "down":
        return (s[0], s[2], s[1])
    if target.expert is not None:
        return tuple(reversed(s[1:]))
    return tuple(reversed(s)) if target.transpose else s


def _unexpected(key: str, cfg: ModelConfig) -> str:
    return (
        f"unexpected tensor {key!r}: it is not part of a {cfg.model_type} model with {cfg.num_layers} layers"
        + (f" and {cfg.num_experts} experts" if cfg.num_experts else "")
        + "; use the config.json shipped with these weights (num_hidden_layers, experts, first_k_dense_replace, "
        "q_lora_rank, tie_word_embeddings, key prefix) or remove the tensor from the checkpoint"
    )


def _place(asm: Assembly, stored: Stored, target: keymap.Target, problems: list[str]) -> None:
    def clash(other: Stored) -> None:
        problems.append(
            f"tensors {other.shown_key!r} and {stored.shown_key!r} both provide {asm.name}; the checkpoint mixes two "
            "layouts or holds a stale copy -- remove one"
        )

    if target.fused is not None:
        prior = asm.fused or asm.single or (next(iter(asm.experts.values())) if asm.experts else None)
        if prior is not None:
            return clash(prior[0])
        asm.fused = (stored, target)
    elif target.expert is not None:
        prior = asm.experts.get(target.expert) or asm.fused or asm.single
        if prior is not None:
            return clash(prior[0])
        asm.experts[target.expert] = (stored, target)
    else:
        if asm.single is not None:
            return clash(asm.single[0])
        asm.single = (stored, target)


def _check_complete(asm: Assembly, cfg: ModelConfig, problems: list[str]) -> None:
    if not asm.sources():
        problems.append(
            f"missing tensor {keymap.canonical_hf_key(asm.name, cfg)!r} (our {asm.name}); the checkpoint is incomplete "
            "or config.json does not belong to it -- re-download the checkpoint or use its own config.json"
        )
        return
    if asm.experts and asm.fused is None:
        layer = layer_of(asm.name)
        missing = [e for e in range(asm.spec.shape[0]) if e not in asm.experts]
        if missing:
            keys = ", ".join(repr(keymap.expert_hf_key(cfg, layer, asm.name.split(".")[-1], e)) for e in missing[:3])
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            problems.append(
                f"missing tensor {keys}{more}: {len(missing)} of {asm.spec.shape[0]} experts of {asm.name}; the "
                "checkpoint is incomplete or config.json's expert count is wrong"
            )
    _check_quantized(asm, cfg, problems)
    for stored, target in asm.sources():
        want = _expected_hf_shape(asm.spec, target)
        if stored.shape != want:
            problems.append(
                f"tensor {stored.shown_key!r} has shape {_fmt(stored.shape)} but config.json implies {_fmt(want)} for "
                f"{asm.name} (HF layout); use the config.json shipped with these weights"
            )
            return


KIND_OF_FORMAT = {"int4": "int4_pack", "mxfp4": "mxfp4", "fp8_block": "fp8_block", "fp8_channel": "fp8_channel"}
_KIND_WORDS = {"plain": "unquantized", "int4_pack": "int4 pack-quantized", "mxfp4": "MXFP4",
               "fp8_block": "block FP8", "fp8_channel": "per-channel FP8"}


def _check_quantized(asm: Assembly, cfg: ModelConfig, problems: list[str]) -> None:
    """A parameter the config says is quantized must come quantized, in that format, so it can stay
    packed on device (an unquantized spec accepts anything: it is dequantized)."""
    fmt = asm.spec.quant
    if fmt is None:
        return
    want = KIND_OF_FORMAT[fmt.fmt]
    for stored, target in asm.sources():
        if target.fused is not None:
            problems.append(f"tensor {stored.shown_key!r} is a fused expert tensor; it cannot stay quantized on device. "
                            "Load with dequantize=True")
            return
        if stored.kind != want:
            module = stored.key[: -len(".weight")] if stored.key.endswith(".weight") else stored.key
            problems.append(
                f"tensor {stored.shown_key!r} is stored {_KIND_WORDS[stored.kind]}, but config.json's quantization_config "
                f"({cfg.quant.method}) covers module {module!r}, so it should be {_KIND_WORDS[want]}; add the module to "
                "the config's ignore list (ignore / modules_to_not_convert / exclude), or load with dequantize=True"
            )
            return


_said: set[str] = set()


def _say_unserved(ckpt: HFCheckpoint, cfg: ModelConfig, keys: list[str]) -> None:
    """Once per folder: the multimodal parts of the checkpoint (Kimi-K2.5's vision tower and
    projector) are not read, only the text model is served."""
    if ckpt.folder in _said:
        return
    _said.add(ckpt.folder)
    size = sum(ckpt.infos[k].end - ckpt.infos[k].begin for k in keys)
    logger.warning("%s (%s): loading the text model only; its vision tower and projector (%d tensors, %.2f GB) are "
                   "not read, so requests with images or video are refused", ckpt.folder, cfg.model_type, len(keys),
                   size / 1e9)


def plan_hf(ckpt: HFCheckpoint, cfg: ModelConfig) -> Plan:
    """Validate the checkpoint against `cfg` from headers alone; raise one error listing all problems."""
    specs = flat_specs(cfg)
    grouped: dict[str, dict[str, str]] = {}
    for key in ckpt.keys():
        base, role = _split_companion(key)
        grouped.setdefault(base, {})[role] = key
    problems: list[str] = []
    assemblies = {name: Assembly(name, spec) for name, spec in specs.items()}
    unserved = [key for key in ckpt.keys() if keymap.strip_prefix(key, cfg) is None and key.startswith(
        keymap.SKIPPED_PREFIXES)]
    if unserved:
        _say_unserved(ckpt, cfg, unserved)
    for base in sorted(grouped):
        parts = grouped[base]
        targets = keymap.map_hf_key(base, cfg)
        if targets == keymap.SKIP:
            continue
        if targets is None or any(t.flat not in specs for t in targets):
            problems.append(_unexpected(sorted(parts.values())[0], cfg))
            continue
        try:
            stored = _stored(ckpt, cfg, base, parts, problems)
        except CheckpointError as e:  # e.g. a dtype tag this reader does not know
            problems.append(str(e))
            continue
        if stored is None:
            continue
        for t in targets:
            _place(assemblies[t.flat], stored, t, problems)
    for asm in assemblies.values():
        _check_complete(asm, cfg, problems)
    if problems:
        shown = problems[:_MAX_REPORTED]
        more = f"\n  ... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise CheckpointError(
            f"checkpoint {ckpt.folder} does not match its {cfg.model_type} config ({len(problems)} problem(s)):\n  - "
            + "\n  - ".join(shown)
            + more
        )
    return Plan(ckpt, cfg, assemblies)


# ---- materializing --------------------------------------------------------------------------


def _decode(ckpt: HFCheckpoint, cfg: ModelConfig, stored: Stored) -> np.ndarray:
    """The weight in HF orientation: a read-only memory-mapped view for plain tensors, a fresh
    float32 array for dequantized ones."""
    p = stored.parts
    try:
        if stored.kind == "plain":
            return ckpt.read(p["weight"])
        if stored.kind == "fp8_block":
            return quant.dequant_fp8_block(ckpt.read(p["weight"]), ckpt.read(p["scale_inv"]), cfg.quant.block_size)
        if stored.kind == "mxfp4":
            return quant.dequant_mxfp4(ckpt.read(p["weight"]), ckpt.read(p["scale"]))
        if stored.kind == "fp8_channel":
            return quant.dequant_fp8_channel(ckpt.read(p["weight"]), ckpt.read(p["scale"]))
        return quant.dequant_int4_pack(ckpt.read(p["packed"]), ckpt.read(p["scale"]), stored.shape, cfg.quant.group_size)
    except ValueError as e:  # shapes were checked in planning; this guards corrupt data paths
        raise CheckpointError(f"cannot decode tensor {stored.shown_key!r}: {e}") from e


def _exact_cast(arr: np.ndarray, dtype: np.dtype, key: str) -> np.ndarray:
    out = np.asarray(arr).astype(dtype)
    if out.dtype != arr.dtype and not np.array_equal(out.astype(np.float32), np.asarray(arr, np.float32), equal_nan=True):
        raise CheckpointError(
            f"tensor {key!r} ({arr.dtype}) is not exactly representable in {np.dtype(dtype).name}, the dtype its quantized "
            "format keeps scales in; load with dequantize=True"
        )
    return out


def _exact_cast_block(key: str, dtype: np.dtype):
    return lambda block: _exact_cast(block, dtype, key)


def _lazy_quantized(ckpt: HFCheckpoint, stored: Stored, fmt: QFormat) -> QArray:
    """One stored quantized weight as a QArray of LazyArrays in our [in, out] orientation, bytes
    unchanged (except the documented fnuz conversion), read block by block."""
    p = stored.parts
    rows, cols = stored.shape
    scale_fn = None
    if stored.kind == "int4_pack":
        values = quant.int4_words_to_bytes(ckpt.read(p["packed"]))[:, : cols // 2]
        scales = ckpt.read(p["scale"])
        scale_fn = _exact_cast_block(p["scale"], np.dtype(fmt.scale_dtype))
    elif stored.kind == "mxfp4":
        values, scales = ckpt.read(p["weight"]), ckpt.read(p["scale"])
    elif stored.kind == "fp8_block":
        values, scales = ckpt.read(p["weight"]), ckpt.read(p["scale_inv"])
    else:  # fp8_channel: one scale per output row
        values, scales = ckpt.read(p["weight"]), ckpt.read(p["scale"]).reshape(rows, 1)
    value_fn = None
    scale_dtype = np.dtype(fmt.scale_dtype) if stored.kind == "int4_pack" else scales.dtype
    if stored.kind in ("fp8_block", "fp8_channel"):
        if values.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
            raise CheckpointError(f"tensor {stored.shown_key!r} is {values.dtype}; quantized FP8 stays on device as e4m3fn "
                                  "(or fnuz) only. Load with dequantize=True")
        scale_dtype = np.dtype(np.float32)
        if fmt.fnuz:
            value_fn, scale_fn = quant.fnuz_values, lambda block: np.asarray(block, np.float32) * 2
    value_dtype = np.dtype(ml_dtypes.float8_e4m3fnuz) if value_fn is not None else values.dtype
    return QArray(LazyArray.of(values.T, value_dtype, value_fn), LazyArray.of(scales.T, scale_dtype, scale_fn), fmt)


def _lazy_build_quantized(plan: Plan, asm: Assembly) -> QArray:
    fmt = asm.spec.quant
    if asm.single is not None:
        return _lazy_quantized(plan.ckpt, asm.single[0], fmt)
    parts = [_lazy_quantized(plan.ckpt, asm.experts[e][0], fmt) for e in range(asm.spec.shape[0])]
    return QArray(LazyArray.stack([q.values for q in parts]), LazyArray.stack([q.scales for q in parts]), fmt)


def _materialized(q: QArray) -> QArray:
    return QArray(np.asarray(q.values), np.asarray(q.scales), q.qformat)


def _out_dtype(asm: Assembly, dtype: np.dtype | None) -> np.dtype:
    if asm.spec.float32:
        return np.dtype(np.float32)
    if dtype is not None:
        return dtype
    kinds = {s.dtype for s, _ in asm.sources()}
    return kinds.pop() if len(kinds) == 1 else np.dtype(np.float32)


def _fused_slice(arr: np.ndarray, which: str) -> np.ndarray:
    """[E, 2I, H] gate/up halves or [E, H, I] down, transposed to our [E, in, out]."""
    if which == "gate":
        arr = arr[:, : arr.shape[1] // 2]
    elif which == "up":
        arr = arr[:, arr.shape[1] // 2 :]
    return arr.transpose(0, 2, 1)


def _max_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def lazy_param(plan: Plan, name: str, dtype: np.dtype | None = None) -> LazyArray | QArray:
    """One flat parameter in our layout as a LazyArray (a QArray of two when quantized): nothing is
    read until a block is asked for. Weights stored quantized but loaded dequantized are decoded
    here, whole."""
    asm = plan.assemblies[name]
    if asm.spec.quant is not None:
        return _lazy_build_quantized(plan, asm)
    out_dtype = _out_dtype(asm, dtype)
    ckpt, cfg = plan.ckpt, plan.cfg
    if asm.single is not None:
        stored, target = asm.single
        arr = _decode(ckpt, cfg, stored)
        return LazyArray.of(arr.T if target.transpose else arr, out_dtype)
    if asm.fused is not None:
        stored, target = asm.fused
        return LazyArray.of(_fused_slice(_decode(ckpt, cfg, stored), target.fused), out_dtype)
    return LazyArray.stack([LazyArray.of(_decode(ckpt, cfg, asm.experts[e][0]).T, out_dtype)
                            for e in range(asm.spec.shape[0])])


def build_param(plan: Plan, name: str, dtype: np.dtype | None = None) -> np.ndarray | QArray:
    """Materialize one flat parameter as a fresh C-contiguous array in our layout (a host QArray
    when its spec is quantized)."""
    asm = plan.assemblies[name]
    if asm.spec.quant is not None:
        return _materialized(_lazy_build_quantized(plan, asm))
    out_dtype = _out_dtype(asm, dtype)
    ckpt, cfg = plan.ckpt, plan.cfg
    if asm.single is not None:
        stored, target = asm.single
        arr = _decode(ckpt, cfg, stored)
        return np.array(arr.T if target.transpose else arr, dtype=out_dtype, order="C", copy=True)
    if asm.fused is not None:
        stored, target = asm.fused
        return np.array(_fused_slice(_decode(ckpt, cfg, stored), target.fused), dtype=out_dtype, order="C", copy=True)
    out = np.empty(asm.spec.shape, dtype=out_dtype)

    def fill(e: int) -> None:
        out[e] = _decode(ckpt, cfg, asm.experts[e][0]).T

    with concurrent.futures.ThreadPoolExecutor(_max_workers()) as pool:
        list(pool.map(fill, range(asm.spec.shape[0])))
    return out


def iter_hf_layers(
    path: str | os.PathLike, cfg: ModelConfig, dtype: str | np.dtype | None = None, lazy: bool = False
) -> Iterator[tuple[int | None, dict[str, np.ndarray]]]:
    """Validate the HF folder, then yield (None, {embed, final_norm, lm_head?}) and (i, layer i's
    `layers.{i}.*` tensors) in order. Validation happens before the first yield. With `lazy`, the
    tensors are LazyArrays (read block by block when placed on devices)."""
    plan = plan_hf(open_hf_checkpoint(path), cfg)
    out_dtype = resolve_dtype(dtype)
    return _materialize(plan, out_dtype, lazy_param if lazy else build_param)


def _materialize(plan: Plan, dtype: np.dtype | None, build) -> Iterator[tuple[int | None, dict[str, np.ndarray]]]:
    for layer, names in plan.groups():
        yield layer, {n: build(plan, n, dtype) for n in names}
