"""Checkpoints: HF safetensors reading (int4 pack / fp8 block dequantization) and our Orbax format."""

from .errors import CheckpointError
from .hf_loader import iter_hf_layers, plan_hf
from .loader import iter_flat_layers, read_flat_params
from .orbax_io import is_orbax_dir, iter_orbax_layers, keeps_quantized, save_orbax
from .quant import dequant_fp8_block, dequant_int4_pack, fp8_e4m3fn_to_fnuz
from .safetensors_io import open_hf_checkpoint

__all__ = [
    "CheckpointError",
    "dequant_fp8_block",
    "dequant_int4_pack",
    "fp8_e4m3fn_to_fnuz",
    "is_orbax_dir",
    "iter_flat_layers",
    "iter_hf_layers",
    "iter_orbax_layers",
    "keeps_quantized",
    "open_hf_checkpoint",
    "plan_hf",
    "read_flat_params",
    "save_orbax",
]
