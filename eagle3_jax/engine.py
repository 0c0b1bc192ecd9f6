"""The generation engine: request validation, batching, and the jitted prefill / step programs.

Requests run in waves of up to `max_batch_size`. Shapes are bucketed (batch and cache length to
powers of two, prompt length to a power of two >= 16) so a handful of programs serve every wave.
Each decode step is one jitted program with the caches donated: without a draft, a forward over
one token per row -> sample -> commit; with an EAGLE-3 draft, spec/step.py's draft expand ->
verify -> accept -> commit -> draft extend, emitting 1..max_accept+1 tokens per row. The host reads a
step's tokens while the next step already runs on the device, so device work never waits on
stop-token checks.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import kv_cache
from .config import ModelConfig
from .draft import Draft, with_target_kernels
from .sampling import SamplingArrays, SamplingParams, sample
from .sharding import mesh_context, to_host
from .spec.adaptive import AutoSpec
from .spec.step import spec_prefill, spec_step
from .spec.tree import SpecConfig
from .target import Target, forward

MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass
class RequestOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) | "length" (max_tokens or max_seq_len)
    metrics: dict


def check_speculation(target: Target, draft: Draft | None,
                      spec: SpecConfig | AutoSpec | None) -> SpecConfig | AutoSpec | None:
    """The speculation a (target, draft) pair runs with (default SpecConfig() with a draft); raises on a mismatch."""
    if spec is not None and draft is None:
        raise ValueError("a SpecConfig needs a draft: pass draft=e3.load_draft(...), or drop spec for plain decoding")
    if draft is None:
        return None
    if not isinstance(draft, Draft):
        raise TypeError(f"draft must be an eagle3_jax Draft (from e3.load_draft); got {type(draft).__name__}")
    spec = spec or SpecConfig()
    if not isinstance(spec, (SpecConfig, AutoSpec)):
        raise TypeError(f"spec must be an e3.SpecConfig or e3.SpecConfig.auto(...); got {type(spec).__name__}")
    shapes = spec.shapes if isinstance(spec, AutoSpec) else (spec,)
    topk = max(s.topk for s in shapes)
    if topk > draft.config.draft_vocab_size:
        raise ValueError(f"SpecConfig.topk={topk} exceeds the draft vocabulary ({draft.config.draft_vocab_size})")
    if tuple(target.config.aux_layer_ids) != tuple(draft.aux_layer_ids):
        raise ValueError(
            f"the target captures hidden states {target.config.aux_layer_ids} but the draft reads "
            f"{draft.aux_layer_ids}; load the draft with e3.load_draft(path, target=target)"
        )
    return spec


def check_request(vocab_size: int, max_seq_len: int, prompt: Sequence[int], sampling: SamplingParams,
                  index: int = 0) -> list[int]:
    """A request's prompt as a list of ints, after checking it and its sampling; raises ValueError."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling[{index}] must be a SamplingParams, got {type(sampling).__name__}")
    try:
        ids = [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise ValueError(f"prompt {index} must be a sequence of integer token ids") from None
    if not ids:
        raise ValueError(f"prompt {index} is empty; give at least one token (e.g. BOS)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt {index} has token ids outside [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_seq_len:
        raise ValueError(
            f"prompt {index} has {len(ids)} tokens, which leaves no room to generate within max_seq_len="
            f"{max_seq_len}; shorten the prompt or raise max_seq_len"
        )
    return ids


def bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at hi."""
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _prefill(params, cfg: ModelConfig, cache: kv_cache.KVCache, tokens, prompt_lens, sp: SamplingArrays):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _, cache = forward(params, cfg, tokens, positions, cache)
    last = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    first = sample(last, sp, jnp.zeros((b,), jnp.int32))
    return first, kv_cache.advance(cache, prompt_lens)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _decode(params, cfg: ModelConfig, cache: kv_cache.KVCache, tokens, counter, sp: SamplingArrays):
    positions = cache.lengths[:, None]
    logits, _, cache = forward(params, cfg, tokens[:, None], positions, cache)
    nxt = sample(logits[:, 0], sp, counter)
    return nxt, kv_cache.advance(cache, jnp.ones_like(cache.lengths)), counter + 1


_spec_prefill = jax.jit(spec_prefill, static_argnames=("tcfg", "dcfg"), donate_argnames=("tcache", "dcache"))
_spec_step = jax.jit(spec_step, static_argnames=("tcfg", "dcfg", "spec"), donate_argnames=("tcache", "dcache"))


class Engine:
    """Batched generation over a target: EAGLE-3 speculation with a draft, plain decoding without."""

    def __init__(self, target: Target, draft: Draft | None = None, spec: SpecConfig | None = None,
                 max_batch_size: int = 8, max_seq_len: int = 2048):
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"max_batch_size must be >= 1 and max_seq_len >= 2; got {max_batch_size}, {max_seq_len}")
        spec = check_speculation(target, draft, spec)
        if isinstance(spec, AutoSpec):
            raise ValueError("adaptive speculation (SpecConfig.auto) runs in e3.Scheduler, which picks a shape per "
                             "step; the Engine runs one fixed shape: pass an e3.SpecConfig")
        self.target = target
        self.draft = None if draft is None else with_target_kernels(draft, target)
        self.spec = spec
        self.max_batch_size = int(max_batch_size)
        self.max_seq_len = int(max_seq_len)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a list of token ids); returns outputs in prompt order."""
        if sampling is None:
            sampling = SamplingParams()
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        sampling = list(sampling)
        if len(sampling) != len(prompts):
            raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
        vocab = self.target.config.vocab_size
        prompts = [check_request(vocab, self.max_seq_len, p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, sampling))]
        outs: list[RequestOutput] = []
        with mesh_context(self.target.mesh):
            for start in range(0, len(prompts), self.max_batch_size):
                stop = start + self.max_batch_size
                outs.extend(self._run_wave(prompts[start:stop], sampling[start:stop]))
        return outs

    # ---- programs ------------------------------------------------------------------------------
    def _lookahead(self) -> int:
        """Cache slots a step may write past the committed length (tree nodes, draft scratch)."""
        if self.spec is None:
            return 1
        return self.spec.num_draft_tokens + (self.spec.num_steps - 1) * self.spec.topk + self.spec.max_accept + 1

    def _start(self, tokens, plens, sp, cache_len):
        """Prefill; returns (first tokens [B] on device, program state)."""
        cfg, params = self.target.config, self.target.params
        batch = tokens.shape[0]
        tcache = self.target.init_cache(batch, cache_len)
        if self.draft is None:
            first, tcache = _prefill(params, cfg, tcache, tokens, plens, sp)
            return first, (tcache, first, jnp.ones((batch,), jnp.int32))
        d = self.draft
        dcache = kv_cache.init_cache(d.config.layers, batch, cache_len, d.dtype)
        first, tcache, dcache, root = _spec_prefill(params, cfg, d.params, d.config, tcache, dcache, tokens, plens, sp)
        return first, (tcache, dcache, root, jnp.ones((batch,), jnp.int32))

    def _step(self, state, sp):
        """One decode step; returns ((tokens [B, D+1], counts [B]) on device, new state)."""
        cfg, params = self.target.config, self.target.params
        if self.draft is None:
            cache, tok, counter = state
            nxt, cache, counter = _decode(params, cfg, cache, tok, counter, sp)
            return (nxt[:, None], jnp.ones_like(counter)), (cache, nxt, counter)
        tcache, dcache, root, counter = state
        d = self.draft
        out, count, tcache, dcache, root, counter = _spec_step(params, cfg, d.params, d.config, self.spec,
                                                               tcache, dcache, root, sp, counter)
        return (out, count), (tcache, dcache, root, counter)

    # ---- one wave ------------------------------------------------------------------------------
    def _run_wave(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[RequestOutput]:
        t0 = time.perf_counter()
        n = len(prompts)
        lens = [len(p) for p in prompts]
        budgets = [min(sp.max_tokens, self.max_seq_len - ln) for sp, ln in zip(sampling, lens)]
        batch = bucket(n, 1, self.max_batch_size)
        prompt_len = bucket(max(lens), MIN_PROMPT_BUCKET, self.max_seq_len)
        need = max(ln + b for ln, b in zip(lens, budgets)) + self._lookahead()
        cache_len = max(bucket(need, MIN_PROMPT_BUCKET, 1 << 62), prompt_len)

        tokens = np.zeros((batch, prompt_len), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        plens = np.ones((batch,), np.int32)
        plens[:n] = lens
        sp = SamplingArrays.from_params(sampling, batch)

        first, state = self._start(jnp.asarray(tokens), jnp.asarray(plens), sp, cache_len)
        chunk = (first[:, None], jnp.ones((batch,), jnp.int32))
        records = [_Record() for _ in range(n)]
        is_prefill = True
        while True:
            # Launch the next step before reading this one's tokens (async dispatch overlaps them).
            next_chunk, state = self._step(state, sp)
            out, counts = to_host(chunk[0]), to_host(chunk[1])
            now = time.perf_counter()
            for i, rec in enumerate(records):
                if not rec.finish:
                    rec.take(out[i, : counts[i]], int(counts[i]), now, is_prefill, sampling[i], budgets[i])
            if all(rec.finish for rec in records):
                break
            chunk, is_prefill = next_chunk, False
        return [rec.output(t0, self) for rec in records]


class _Record:
    """Host-side bookkeeping of one request."""

    def __init__(self):
        self.ids: list[int] = []
        self.arrival: list[float] = []
        self.accept_lengths: list[int] = []
        self.finish = ""

    def take(self, tokens, count: int, now: float, is_prefill: bool, sp: SamplingParams, budget: int) -> None:
        if not is_prefill:
            self.accept_lengths.append(count)
        for tok in tokens:
            self.ids.append(int(tok))
            self.arrival.append(now)
            if int(tok) in sp.stop_token_ids:
                self.finish = "stop"
            elif len(self.ids) >= budget:
                self.finish = "length"
            if self.finish:
                return

    def output(self, t0: float, engine: "Engine") -> RequestOutput:
        steps = len(self.accept_lengths)
        spec = engine.spec
        depth = spec.max_accept if spec else 0
        per_position = [
            float(np.mean([a - 1 >= d for a in self.accept_lengths])) if steps else 0.0 for d in range(1, depth + 1)
        ]
        draft_passes = steps * spec.num_steps if spec else 0
        return RequestOutput(
            token_ids=self.ids,
            finish_reason=self.finish,
            metrics={
                "mean_accept_length": float(np.mean(self.accept_lengths)) if steps else 1.0,
                "accept_lengths": list(self.accept_lengths),
                "per_position_acceptance": per_position,
                "num_target_passes": steps + 1,
                "num_draft_passes": draft_passes,
                "ttft_s": self.arrival[0] - t0,
                "itl_s": [float(x) for x in np.diff(self.arrival)],
                "num_output_tokens": len(self.ids),
                "e2e_latency_s": self.arrival[-1] - t0,
            },
        )
