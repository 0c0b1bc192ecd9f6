"""The one-shot GPU check of `scripts/gpu_check.py`: the Triton kernels and the target steps they
serve, timed against XLA, and the demo pair's greedy outputs through each, in one JSON record.

`run_check` runs the parts a `CheckPlan` names, in PARTS' order, handing each part's value to a
record (`CheckRecord`) as it grows, so a part cut short loses only itself:

- kernels: on a GPU first the two ceilings measured (`kernel_timing.measure_ceilings`), then the
  attention and MoE rows (`attention_timing`, `moe_timing`) at fixed shapes, Kimi-K2.5's per-device
  ones or small ones, each with fractions of the measured ceilings added.
- steps: decode (T = 1) and verify (T > 1) steps of the target forward with the kernels and with
  XLA at (batch, T) pairs. Kimi-K2.5 does not fit one GPU, so the model is cut to its dense layers
  plus one MoE layer (all 384 int4 experts) over an 8K cache, with random weights made on the
  device; small: kimi-mini cut the same way over 64 slots. A row counts the bytes a step must read.
- demo: the bundled kimi-mini pair under each kernels choice and dtype: the greedy outputs of each
  speculation setting (Engine.generate over GREEDY_PROMPTS) and their ms per token. In float32
  every output must equal its dtype's first row.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import time
import types
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import launch

from ..cache import kv_cache
from ..config.model import ModelConfig, one_moe_layer, parse_model_config
from ..engine import Engine
from ..models.draft import load_draft
from ..models.target import forward, load_target, resolve_dtype
from ..planning.memory import DEVICES, Device
from ..sampling.sampler import SamplingParams
from ..spec_decode import SpecConfig
from ..text.tokenizer import load_tokenizer
from ..weights.params import abstract_params
from .attention_timing import AttentionShapes, attention_rows, attention_shapes
from .kernel_timing import Echo, ceilings_line, measure_ceilings, with_measured_fractions
from .moe_timing import MoeShapes, expert_weights, moe_rows, moe_shapes
from .step_accounting import median_ms

PARTS = ("kernels", "steps", "demo")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIMI_CONFIG = os.path.join(ROOT, "tests", "data", "kimi-k2.5.config.json")
DEMO_PAIR = os.path.join(ROOT, "checkpoints", "kimi-mini"), os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3")
GREEDY_PROMPTS = ("Once upon a time", "The little dog")
DEMO_SPECS = ("none", "chain:3:1:4", "tree:5:4:16")

# The kernels part's shapes, by the flag of scripts/bench_kernels.py that names each (the check
# refuses those flags): Kimi-K2.5 per device (MLA with 64 heads, latent 512 + rope 64; 48 of 384
# int4 experts, top-8, 7168 -> 2048 -> 7168), and small ones that run interpreted on a CPU.
KIMI_KERNEL_SHAPES = dict(kind="mla", heads=64, latent=512, rope=64, batches=["1", "64"], tokens=["1", "4"],
                          contexts=["8192"], hidden=7168, moe_inter=2048, experts=384, local_experts=48, topk=8,
                          moe_format="int4", moe_tokens=["1", "4", "64", "256"], repeats=20, num_splits=0,
                          page_size=16, dtype="bfloat16")
SMALL_KERNEL_SHAPES = dict(KIMI_KERNEL_SHAPES, heads=4, latent=32, rope=16, batches=["2"], contexts=["40"], hidden=64,
                           moe_inter=64, experts=16, local_experts=4, topk=2, moe_tokens=["1", "8"], repeats=1)
FIXED_SHAPE_FLAGS = tuple(KIMI_KERNEL_SHAPES)

Record = Callable[[str, Any], None]  # (part, its value so far)
# The target's step as the steps part times it: the cache donated, as the scheduler runs it
STEP = jax.jit(forward, static_argnames=("cfg",), donate_argnames=("cache",))


@dataclasses.dataclass(frozen=True)
class CheckPlan:
    """What one run of the check does: its parts, in order, and each part's settings."""

    parts: tuple[str, ...]
    small: bool
    device: Device  # whose data-sheet peaks the fractions are of
    interpret: bool  # the kernels under Triton's interpreter (a CPU host)
    launches: tuple[str, ...] = ()  # attention launches timed beside the launch table's
    step_shapes: tuple[tuple[int, int], ...] = ()  # (batch, T)
    step_repeats: int = 20
    greedy_tokens: int = 64
    demo_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    demo_kernels: tuple[str, ...] = ("xla", "triton")
    demo_specs: tuple[str, ...] = DEMO_SPECS


def step_shapes(texts: Sequence[str] | None, small: bool) -> tuple[tuple[int, int], ...]:
    """(batch, T) pairs from batch:T texts, or the defaults; a ValueError naming --step_shapes."""
    if texts is None:
        return ((2, 1), (2, 4)) if small else ((1, 1), (1, 4), (64, 1), (64, 4))
    shapes = []
    for text in texts:
        batch, sep, t = text.partition(":")
        if not (sep and batch.isdigit() and t.isdigit() and int(batch) > 0 and 0 < int(t) <= 64):
            raise ValueError(f"--step_shapes: {text!r} is not batch:T (positive integers, T at most 64), e.g. 64:4")
        shapes.append((int(batch), int(t)))
    return tuple(shapes)


def check_plan(parts: Sequence[str], small: bool, device: Device, interpret: bool, *, launches: Sequence[str] = (),
               step_shape_texts: Sequence[str] | None = None, step_repeats: int | None = None,
               greedy_tokens: int | None = None, demo_dtypes: Sequence[str] | None = None,
               demo_kernels: Sequence[str] = ("xla", "triton"), demo_specs: Sequence[str] | None = None) -> CheckPlan:
    """The plan with each setting left None at its default: on a GPU 20 step repeats, 64 greedy
    tokens, float32 and bfloat16, every DEMO_SPECS setting; small 2 repeats, 3 tokens, float32 and
    the first two settings. A ValueError for --step_shapes that are not batch:T."""
    return CheckPlan(parts=tuple(parts), small=small, device=device, interpret=interpret, launches=tuple(launches),
                     step_shapes=step_shapes(step_shape_texts, small),
                     step_repeats=step_repeats or (2 if small else 20),
                     greedy_tokens=greedy_tokens or (3 if small else 64),
                     demo_dtypes=tuple(demo_dtypes or (("float32",) if small else ("float32", "bfloat16"))),
                     demo_kernels=tuple(demo_kernels), demo_specs=tuple(demo_specs or DEMO_SPECS[:2 if small else 3]))


def device_name(kind: str, default: str) -> str:
    """The DEVICES entry a JAX device kind names ("NVIDIA H200" -> "H200"), else `default`."""
    return next((name for name in DEVICES if name.lower() in kind.lower()), default)


def check_header(argv: Sequence[str], device_kind: str, plan: CheckPlan) -> dict:
    """The record's fields before any part: when, the command, the device and its peaks, JAX, the machine."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python scripts/gpu_check.py " + " ".join(argv[1:]), "device": device_kind,
        "peaks_from": plan.device.name, "hbm_peak_gbps": plan.device.hbm_gbps,
        "bf16_peak_tflops": plan.device.bf16_tflops, "backend": jax.default_backend(), "arch": launch.current_arch(),
        "interpret": plan.interpret, "small": plan.small, "jax": jax.__version__,
        "machine": f"{platform.machine()} x{os.cpu_count()}", "parts": list(plan.parts),
    }


class CheckRecord:
    """The check's one JSON: its header and each part's value as it stands, with the seconds since
    the record began; its text goes to `write` at every change (a later part cut short loses only
    itself)."""

    def __init__(self, header: dict, write: Callable[[str], None]) -> None:
        self.result = dict(header)
        self._write = write
        self._started = time.perf_counter()

    def __call__(self, part: str, value: Any) -> None:
        self.result[part] = value
        self.result["seconds"] = round(time.perf_counter() - self._started, 1)
        self._write(json.dumps(self.result, indent=1))


def kernel_shapes(small: bool, launches: Sequence[str] = ()) -> tuple[AttentionShapes, MoeShapes]:
    """The kernels part's attention and MoE shapes (KIMI_KERNEL_SHAPES, or SMALL_KERNEL_SHAPES)."""
    values = types.SimpleNamespace(**(SMALL_KERNEL_SHAPES if small else KIMI_KERNEL_SHAPES),
                                   kv_heads=8, head_dim=128,  # GQA's: unused by MLA
                                   attention_launches=list(launches))
    return attention_shapes(values), moe_shapes(values)


def kernel_part(plan: CheckPlan, record: Record, echo: Echo) -> list[dict]:
    """The kernels part: the measured ceilings (off a CPU) and the attention and MoE rows, each
    recorded ("ceilings", "kernels") as it comes."""
    measured = None if plan.interpret else measure_ceilings()
    if measured:
        echo(ceilings_line(measured))
    record("ceilings", measured)
    attention, moe = kernel_shapes(plan.small, plan.launches)
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(with_measured_fractions(row, measured))
        record("kernels", rows)

    attention_rows(attention, plan.device, plan.interpret, add, echo)
    moe_rows(moe, expert_weights(moe), plan.device, plan.interpret, add, echo)
    return rows


def random_params(cfg: ModelConfig, dtype: Any) -> dict:
    """The target's parameter tree with random values made on the device (packed ints as random
    bytes, float8 as finite random bytes, floats as N(0, 0.02))."""
    leaves, tree = jax.tree.flatten(abstract_params(cfg, dtype))

    def make(key, shape, dt):
        if jnp.issubdtype(dt, jnp.floating) and dt.itemsize == 1:
            return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8) & 0x76, dt)
        if jnp.issubdtype(dt, jnp.integer):
            return jax.random.bits(key, shape, jnp.uint8).astype(dt)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dt)

    keys = jax.random.split(jax.random.key(0), len(leaves))
    made = [jax.jit(make, static_argnums=(1, 2))(k, leaf.shape, jnp.dtype(leaf.dtype)) for k, leaf in zip(keys, leaves)]
    return jax.tree.unflatten(tree, made)


def step_bytes(params: Any, cfg: ModelConfig, batch: int, t: int, context: int) -> float:
    """Bytes a step must read: every weight but the embedding table (a gather of `batch` x `t` rows),
    the routed experts as a share of those `batch` x `t` tokens are expected to hit, the K/V prefix
    (bf16)."""
    total = 0.0
    tokens = batch * t
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if "['embed']" in name:
            continue
        share = 1.0
        if "experts_" in name:
            e, k = cfg.num_experts, cfg.num_experts_per_tok
            share = 1.0 - (1.0 - k / e) ** tokens  # expected share of experts hit at least once
        total += share * leaf.nbytes
    per_slot = (cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attention == "mla"
                else 2 * cfg.num_kv_heads * cfg.head_dim)
    return total + cfg.num_layers * batch * context * per_slot * 2


def step_model(small: bool) -> tuple[ModelConfig, int, str]:
    """The steps part's target config, its context and its name: Kimi-K2.5 cut to its dense layers
    and one MoE layer over 8192 slots, or (small) kimi-mini cut the same way over 64."""
    path, context = (os.path.join(DEMO_PAIR[0], "config.json"), 64) if small else (KIMI_CONFIG, 8192)
    with open(path) as f:
        cfg = parse_model_config(one_moe_layer(json.load(f)))
    return cfg, context, "kimi-mini" if small else os.path.basename(KIMI_CONFIG)


def step_line(row: dict) -> str:
    return (f"| {row['batch']} | {row['tokens']} | {row['kernel_ms']:.3f} | {row['xla_ms']:.3f} | "
            f"{row['xla_ms'] / row['kernel_ms']:.2f}x | {row['bytes_read'] / 1e6:.0f} | "
            f"{100 * row['peak_fraction']:.1f} | {100 * row['xla_peak_fraction']:.1f} |")


def step_ms(params: dict, cfg: ModelConfig, batch: int, t: int, context: int, dtype: Any, repeats: int) -> float:
    """Median ms of a step of `t` new tokens per row (causal among themselves) after `context - t`
    committed slots, launched back to back (the step, not the launch's round trip)."""
    # context + 16: a dense cache whose length is a whole number of the kernel's 16-slot tiles
    cache = kv_cache.advance(kv_cache.init_cache(cfg, batch, context + 16, dtype),
                             jnp.full((batch,), context - t, jnp.int32))
    tokens = jnp.zeros((batch, t), jnp.int32)
    positions = (context - t) + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))
    state = {"cache": cache}  # the donated cache comes back from every call

    def one():
        logits, _, state["cache"] = STEP(params, cfg, tokens, positions, state["cache"], chain)
        return logits

    return median_ms(one, repeats)


def step_part(plan: CheckPlan, record: Record, echo: Echo) -> list[dict]:
    """Decode and verify steps at the plan's (batch, T) pairs, kernels against XLA; each row
    recorded ("steps") once the kernels' step is timed (XLA's fields None until its own is), so a
    time limit during XLA's compile keeps the kernels' half."""
    cfg, context, name = step_model(plan.small)
    dtype = resolve_dtype("bfloat16")
    params = random_params(cfg, dtype)
    peak = plan.device.hbm_gbps
    where = "Triton's interpreter: timings are not meaningful" if plan.interpret else jax.devices()[0].device_kind
    echo(f"\ntarget steps: {cfg.num_layers} layers of {name}, {where}")
    echo("| batch | T | kernels ms | XLA ms | speedup | MB read | kernels % of peak | XLA % of peak |")
    echo("|---|---|---|---|---|---|---|---|")
    rows: list[dict] = []
    for batch, t in plan.step_shapes:
        read = step_bytes(params, cfg, batch, t, context)
        row = dict(op="step", batch=batch, tokens=t, context=context, bytes_read=read, kernel_ms=None, xla_ms=None,
                   peak_fraction=None, xla_peak_fraction=None)
        rows.append(row)
        for impl, ms_key, fraction_key in (("triton", "kernel_ms", "peak_fraction"),
                                           ("xla", "xla_ms", "xla_peak_fraction")):
            run_cfg = dataclasses.replace(cfg, kernels=f"attention={impl},moe={impl}")
            ms = step_ms(params, run_cfg, batch, t, context, dtype, plan.step_repeats)
            row.update({ms_key: ms, fraction_key: read / (ms * 1e6) / peak})
            record("steps", rows)
        echo(step_line(row))
    return rows


def _timed_generate(engine: Engine, prompts: list, sp: SamplingParams) -> tuple[list[list[int]], float, int]:
    """The outputs' token ids, the seconds of a second pass (the first compiles) and its steps."""
    engine.generate(prompts, sp)  # compile
    start = time.perf_counter()
    outs = engine.generate(prompts, sp)
    wall = time.perf_counter() - start
    return [o.token_ids for o in outs], wall, sum(len(o.metrics["accept_lengths"]) for o in outs)


def demo_part(plan: CheckPlan, record: Record, echo: Echo) -> dict:
    """The kimi-mini pair under each of the plan's kernels choices and dtypes: greedy outputs and ms
    per token of each speculation setting; recorded ("demo") after every row. Its `equal`: every
    float32 output equals its dtype's first row."""
    tokenizer = load_tokenizer(DEMO_PAIR[0])
    prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=plan.greedy_tokens)
    rows: list[dict] = []
    part = {"tokens": plan.greedy_tokens, "prompts": len(prompts), "rows": rows, "equal": True}
    echo(f"\ndemo pair, greedy, {plan.greedy_tokens} tokens x {len(prompts)} prompts (Engine.generate, one batch)")
    echo("| dtype | kernels | setting | ms / token | tokens / step | == the dtype's first row |")
    echo("|---|---|---|---|---|---|")
    for dtype in plan.demo_dtypes:
        reference = None
        for kernels in plan.demo_kernels:
            target = load_target(DEMO_PAIR[0], dtype=dtype, kernels=kernels)
            draft = load_draft(DEMO_PAIR[1], target=target, dtype=dtype)
            for name in plan.demo_specs:
                spec = SpecConfig.parse(name)
                engine = Engine(target, draft if spec is not None else None, spec, max_batch_size=len(prompts),
                                max_seq_len=256)
                tokens, wall, steps = _timed_generate(engine, prompts, sp)
                reference = tokens if reference is None else reference
                emitted = sum(len(t) for t in tokens)
                row = dict(dtype=dtype, kernels=kernels, spec=name, tokens=tokens, equal_first=tokens == reference,
                           ms_per_token=1e3 * wall / emitted, tokens_per_step=(emitted - len(tokens)) / max(steps, 1))
                rows.append(row)
                part["equal"] = all(r["equal_first"] for r in rows if r["dtype"] == "float32")
                record("demo", part)
                echo(f"| {dtype} | {kernels} | {name} | {row['ms_per_token']:.3f} | {row['tokens_per_step']:.2f} | "
                     f"{row['equal_first']} |")
    return part


def run_check(plan: CheckPlan, record: Record, echo: Echo) -> list[str]:
    """The plan's parts, in PARTS' order; what failed (a kernel that differs from XLA, a float32
    demo output that differs from its dtype's first row), sorted, once each."""
    failed = []
    if "kernels" in plan.parts:
        rows = kernel_part(plan, record, echo)
        failed += [f"{r['op']} kernel differs from XLA" for r in rows if r["equal"] is False]
    if "steps" in plan.parts:
        step_part(plan, record, echo)
    if "demo" in plan.parts:
        if not demo_part(plan, record, echo)["equal"]:
            failed.append("a float32 demo output differs from its dtype's first row (plain greedy decoding)")
    return sorted(set(failed))
