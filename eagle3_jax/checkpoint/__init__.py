"""Checkpoints: HF safetensors reading (int4 pack / fp8 block dequantization) and our Orbax format."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.exports import lazy_exports

# each public name and the module that defines it, imported on first use (runtime/exports.py)
_WHERE = {
    "CheckpointError": ".errors",
    "dequant_fp8_block": ".quant",
    "dequant_int4_pack": ".quant",
    "fp8_e4m3fn_to_fnuz": ".quant",
    "is_orbax_dir": ".orbax_io",
    "iter_flat_layers": ".loader",
    "iter_hf_layers": ".hf_loader",
    "iter_orbax_layers": ".orbax_io",
    "keeps_quantized": ".orbax_io",
    "open_hf_checkpoint": ".safetensors_io",
    "plan_hf": ".hf_loader",
    "read_flat_params": ".loader",
    "save_orbax": ".orbax_io",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

if TYPE_CHECKING:  # the same names for type checkers and the structure test
    from .errors import CheckpointError
    from .hf_loader import iter_hf_layers, plan_hf
    from .loader import iter_flat_layers, read_flat_params
    from .orbax_io import is_orbax_dir, iter_orbax_layers, keeps_quantized, save_orbax
    from .quant import dequant_fp8_block, dequant_int4_pack, fp8_e4m3fn_to_fnuz
    from .safetensors_io import open_hf_checkpoint
