"""One entry point for both checkpoint kinds: an HF safetensors folder or our Orbax folder."""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from ..config.model import ModelConfig
from .errors import CheckpointError
from .hf_loader import iter_hf_layers
from .orbax_io import MARKER, is_orbax_dir, iter_orbax_layers, looks_like_partial_orbax


def iter_flat_layers(
    path: str | os.PathLike, cfg: ModelConfig, dtype: str | np.dtype | None = None, lazy: bool = False
) -> Iterator[tuple[int | None, dict[str, np.ndarray]]]:
    """Yield (None, {embed, final_norm, lm_head?}) then (i, {`layers.{i}.*`: array}) for each
    layer, so callers can place a model on devices holding one layer on the host at a time.

    The whole checkpoint is validated against `cfg` before this returns. Arrays are in our flat
    layout (matrices [in, out], experts stacked), in the stored float dtype (dequantized weights:
    float32; spec.float32 params: float32) unless `dtype` ("float32" / "bfloat16" / "float16")
    casts everything but the float32 params. With `lazy`, an HF folder's tensors come as
    `LazyArray`s (read block by block when placed: each process reads only its own shards);
    Orbax folders are read whole.
    """
    p = os.fspath(path)
    if is_orbax_dir(p):
        return iter_orbax_layers(p, cfg, dtype)
    if looks_like_partial_orbax(p):
        raise CheckpointError(
            f"{p} is an incomplete Orbax conversion (no {MARKER}): the conversion was interrupted. "
            "Delete it and re-run scripts/convert.py"
        )
    return iter_hf_layers(p, cfg, dtype, lazy)


def read_flat_params(
    path: str | os.PathLike, cfg: ModelConfig, dtype: str | np.dtype | None = None, lazy: bool = False
) -> dict[str, np.ndarray]:
    """All parameters of `cfg` from an HF folder or our Orbax folder, in the flat layout of
    `params.flat_specs(cfg)` (see `iter_flat_layers` for dtypes)."""
    flat: dict[str, np.ndarray] = {}
    for _, tensors in iter_flat_layers(path, cfg, dtype, lazy):
        flat.update(tensors)
    return flat
