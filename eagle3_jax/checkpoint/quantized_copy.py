"""A quantized copy of a float target folder, in a real checkpoint layout (`scripts/quantize.py`):
the float weights read, the chosen linear modules encoded round-to-nearest (quantize.py), the
folder written as that format's checkpoint (hf_writer.py)."""

from __future__ import annotations

import json
import os

from ..config.model import load_model_config, parse_model_config
from ..weights.params import _hf_module, _is_linear, flat_specs
from .atomic import check_output
from .errors import CheckpointError
from .hf_writer import save_hf_target
from .loader import read_flat_params
from .quantize import METHODS, quantization_config

SCOPES = ("experts", "all")


def _ignored_modules(cfg, scope: str) -> tuple[str, ...]:
    """HF module names left in floats: the LM head always; with scope "experts" every linear
    module but the routed experts (Kimi-K2.5's int4 layout: attention, dense and shared MLPs float)."""
    specs = flat_specs(cfg)
    if scope == "experts" and not any(name.split(".")[-1].startswith("experts_") for name in specs):
        raise ValueError(f"{cfg.model_type} has no routed experts; quantize with scope='all'")
    module_of = _hf_module(cfg)
    keep = ["lm_head"]
    if scope == "experts":
        keep += [module_of(name) for name, spec in specs.items()
                 if _is_linear(name, spec) and name != "lm_head" and not name.split(".")[-1].startswith("experts_")]
    return tuple(keep)


def quantize_checkpoint(src: str, out: str, method: str = "int4_pack", group_size: int = 32,
                        scope: str = "experts", *, overwrite: bool = False) -> str:
    """Write a round-to-nearest quantized copy of the HF target folder `src` to `out` in the real
    checkpoint layout of `method` (its config.json gains the `quantization_config` such a
    checkpoint ships; tokenizer and other files are copied). `scope`: "experts" quantizes only
    the routed experts (as Kimi-K2.5 ships), "all" every linear weight but the LM head. An
    existing `out` is replaced only with `overwrite`; `out` equal to, inside or containing `src`
    never is (checked before anything is read)."""
    if method not in METHODS:
        raise ValueError(f"cannot quantize to {method!r}; supported: {', '.join(METHODS)}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}; got {scope!r}")
    check_output(out, name="out", overwrite=overwrite, inputs={"src": src})
    cfg = load_model_config(src)
    if cfg.quant is not None:
        raise CheckpointError(f"{src} is already quantized ({cfg.quant.method}); quantize a float checkpoint")
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = quantization_config(method, _ignored_modules(cfg, scope), group_size)
    qcfg = parse_model_config(raw)
    group = {"int4_pack": group_size, "mxfp4": 32}.get(method)
    for name, spec in flat_specs(qcfg).items():
        if spec.quant is not None and group and spec.shape[-2] % group:
            raise ValueError(f"{method} groups of {group} do not divide the input width {spec.shape[-2]} of {name}; "
                             "choose a group size that divides it")
    flat = read_flat_params(src, cfg, "float32")
    extra = {name: os.path.join(src, name) for name in sorted(os.listdir(src))
             if name != "config.json" and not name.endswith((".safetensors", ".safetensors.index.json"))
             and os.path.isfile(os.path.join(src, name))}
    return save_hf_target(out, flat, qcfg, raw, extra_files=extra, overwrite=overwrite, inputs={"src": src})
