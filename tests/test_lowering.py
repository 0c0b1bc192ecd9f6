"""Deviceless lowering of the target's prefill and decode programs for ROCm and CUDA.

`jax.jit(f).trace(*args).lower(lowering_platforms=(p,))` (`jax.stages.Traced.lower`, checked on jax 0.10.2) lowers
to StableHLO for a platform without needing its device or plugin, which catches lowering failures
(unsupported ops, dtype combinations) in CPU CI. All arguments are `jax.ShapeDtypeStruct`, so no
weights are materialised, which is also what lets the full-size real configs lower here.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import pytest

e3 = pytest.importorskip("eagle3_jax")
from eagle3_jax.cache import kv_cache  # noqa: E402
from eagle3_jax.config.model import load_model_config, parse_model_config  # noqa: E402
from eagle3_jax.models import target as tgt  # noqa: E402
from eagle3_jax.weights import params as params_lib  # noqa: E402

PLATFORMS = ("rocm", "cuda")
TEST_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def abstract_params(cfg, dtype) -> dict:
    """The stacked param tree as ShapeDtypeStructs (float32 where the spec says so)."""
    def sds(spec, lead=()):
        return jax.ShapeDtypeStruct(lead + spec.shape, jnp.float32 if spec.float32 else dtype)

    flat = params_lib.flat_specs(cfg)
    tree = {k: sds(flat[k]) for k in ("embed", "final_norm", "lm_head") if k in flat}
    tree["segments"] = tuple(
        {name: sds(spec, (stop - start,)) for name, spec in params_lib.layer_specs(cfg, kind).items()}
        for kind, start, stop in cfg.segments
    )
    return tree


def lower_forward(cfg, batch: int, t: int, max_len: int, dtype, absorb: bool, platform: str) -> str:
    params = abstract_params(cfg, dtype)
    cache = jax.eval_shape(lambda: kv_cache.init_cache(cfg, batch, max_len, dtype))
    tokens = jax.ShapeDtypeStruct((batch, t), jnp.int32)
    positions = jax.ShapeDtypeStruct((batch, t), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, t, t), jnp.bool_)
    jf = jax.jit(tgt.forward, static_argnames=("cfg", "absorb"))
    traced = jf.trace(params, cfg, tokens, positions, cache, mask, absorb=absorb)
    lowered = traced.lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    assert isinstance(text, str) and text.strip()
    assert "func.func public @main" in text and "stablehlo." in text
    return text


def tiny_cfg(name):
    """A tiny config of the reference models' (tests/hf_models.py: needs torch and transformers)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import hf_models as H

    spec = H.CONFIGS[name]
    cfg_cls, _ = H._classes(spec["family"])
    raw = cfg_cls(**spec["kwargs"]).to_dict()
    return parse_model_config(raw)


TINY = ["llama_llama3_gqa4", "dsv3_yarn_qlora", "minimax_partial_rotary"]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", TINY)
def test_lower_tiny(name, platform):
    pytest.importorskip("transformers")
    cfg = tiny_cfg(name)
    for dtype in (jnp.bfloat16,):
        lower_forward(cfg, batch=2, t=16, max_len=64, dtype=dtype, absorb=False, platform=platform)  # prefill
        lower_forward(cfg, batch=2, t=1, max_len=64, dtype=dtype, absorb=True, platform=platform)  # decode
        if cfg.attention == "mla":
            lower_forward(cfg, batch=2, t=1, max_len=64, dtype=dtype, absorb=False, platform=platform)


@pytest.mark.parametrize("name", TINY)
def test_abstract_params_match_loaded(name, jax_target):
    """The abstract tree used above has exactly the loaded params' structure, shapes and dtypes."""
    target = jax_target(name, dtype="bfloat16")
    want = jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), target.params)
    got = jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), abstract_params(target.config, jnp.bfloat16))
    assert got == want


REAL = ["kimi-k2.5.config.json", "deepseek-v3.config.json", "minimax-m2.5.config.json", "llama-3.1-8b-instruct.config.json"]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("fname", REAL)
def test_lower_real(fname, platform):
    path = os.path.join(TEST_DATA, fname)
    if not os.path.exists(path):
        pytest.skip(f"{path} not present")
    cfg = load_model_config(path)
    t0 = time.perf_counter()
    text = lower_forward(cfg, batch=1, t=1, max_len=64, dtype=jnp.bfloat16, absorb=True, platform=platform)
    # The full-size embedding table is an argument of the program (shapes only, nothing allocated).
    assert f"tensor<{cfg.vocab_size}x{cfg.hidden_size}xbf16>" in text
    # A short prefill too (expanded MLA); batch 1, 16 tokens.
    lower_forward(cfg, batch=1, t=16, max_len=64, dtype=jnp.bfloat16, absorb=False, platform=platform)
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("name", TINY)
def test_every_model_dot_states_full_precision(name):
    """On GPUs a default-precision float32 dot runs as TF32 / xf32: every dot of the model's
    programs (prefill, decode; both MLA forms) states HIGHEST, so float32 runs are float32 there."""
    pytest.importorskip("transformers")
    cfg = tiny_cfg(name)
    texts = [lower_forward(cfg, batch=2, t=t, max_len=64, dtype=jnp.float32, absorb=absorb, platform="cuda")
             for t, absorb in ((16, False), (1, True), (1, False))]
    dots = [line for text in texts for line in text.splitlines() if "dot_general" in line or "ragged_dot" in line]
    assert dots
    unstated = [line.strip()[:160] for line in dots if "HIGHEST" not in line]
    assert not unstated, unstated[:5]
