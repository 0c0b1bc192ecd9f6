"""The generation engine: request validation, batching, and the jitted prefill / decode programs.

Requests run in waves of up to `max_batch_size`. Shapes are bucketed (batch and cache length to
powers of two, prompt length to a power of two >= 16) so a handful of programs serve every wave.
Each decode step is one jitted program (forward over one token per row -> sample -> commit) with
the cache donated. The host reads a step's tokens while the next step already runs on the device,
so device work never waits on stop-token checks.
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
from .sampling import SamplingArrays, SamplingParams, sample
from .target import Target, forward

MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass
class RequestOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) | "length" (max_tokens or max_seq_len)
    metrics: dict


def _bucket(n: int, lo: int, hi: int) -> int:
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


class Engine:
    """Batched generation over a target (plain autoregressive decoding when draft is None)."""

    def __init__(self, target: Target, draft=None, spec=None, max_batch_size: int = 8, max_seq_len: int = 2048):
        if draft is not None or spec is not None:
            raise ValueError("speculative decoding (draft / spec) is not available in this version; pass draft=None")
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"max_batch_size must be >= 1 and max_seq_len >= 2; got {max_batch_size}, {max_seq_len}")
        self.target = target
        self.max_batch_size = int(max_batch_size)
        self.max_seq_len = int(max_seq_len)

    # ---- validation ----------------------------------------------------------------------------
    def _check_prompt(self, i: int, prompt: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt]
        vocab = self.target.config.vocab_size
        if not ids:
            raise ValueError(f"prompt {i} is empty; give at least one token (e.g. BOS)")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, which leaves no room to generate within max_seq_len="
                f"{self.max_seq_len}; shorten the prompt or raise max_seq_len"
            )
        return ids

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a list of token ids); returns outputs in prompt order."""
        prompts = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        if sampling is None:
            sampling = SamplingParams()
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        sampling = list(sampling)
        if len(sampling) != len(prompts):
            raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
        for i, sp in enumerate(sampling):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling[{i}] must be a SamplingParams, got {type(sp).__name__}")
        outs: list[RequestOutput] = []
        for start in range(0, len(prompts), self.max_batch_size):
            stop = start + self.max_batch_size
            outs.extend(self._run_wave(prompts[start:stop], sampling[start:stop]))
        return outs

    # ---- one wave ------------------------------------------------------------------------------
    def _run_wave(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[RequestOutput]:
        t0 = time.perf_counter()
        n = len(prompts)
        lens = [len(p) for p in prompts]
        budgets = [min(sp.max_tokens, self.max_seq_len - ln) for sp, ln in zip(sampling, lens)]
        batch = _bucket(n, 1, self.max_batch_size)
        prompt_len = _bucket(max(lens), MIN_PROMPT_BUCKET, self.max_seq_len)
        cache_len = _bucket(max(ln + b for ln, b in zip(lens, budgets)), MIN_PROMPT_BUCKET, self.max_seq_len)
        cache_len = max(cache_len, prompt_len)

        tokens = np.zeros((batch, prompt_len), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        plens = np.ones((batch,), np.int32)
        plens[:n] = lens
        sp = SamplingArrays.from_params(sampling, batch)
        cfg, params = self.target.config, self.target.params
        cache = self.target.init_cache(batch, cache_len)

        tok, cache = _prefill(params, cfg, cache, jnp.asarray(tokens), jnp.asarray(plens), sp)
        counter = jnp.ones((batch,), jnp.int32)
        generated: list[list[int]] = [[] for _ in range(n)]
        arrival: list[list[float]] = [[] for _ in range(n)]
        finish = [""] * n
        passes = 1
        while True:
            # Launch the next step before reading this one's tokens (async dispatch overlaps them).
            nxt, cache, counter = _decode(params, cfg, cache, tok, counter, sp)
            host = np.asarray(tok)
            now = time.perf_counter()
            for i in range(n):
                if finish[i]:
                    continue
                generated[i].append(int(host[i]))
                arrival[i].append(now)
                if host[i] in sampling[i].stop_token_ids:
                    finish[i] = "stop"
                elif len(generated[i]) >= budgets[i]:
                    finish[i] = "length"
            if all(finish):
                break
            tok = nxt
            passes += 1
        return [self._output(generated[i], finish[i], arrival[i], t0, passes) for i in range(n)]

    @staticmethod
    def _output(ids: list[int], finish: str, arrival: list[float], t0: float, passes: int) -> RequestOutput:
        steps = len(ids)
        return RequestOutput(
            token_ids=ids,
            finish_reason=finish,
            metrics={
                "mean_accept_length": 1.0,
                "accept_lengths": [1] * steps,
                "num_target_passes": steps,
                "num_draft_passes": 0,
                "ttft_s": arrival[0] - t0,
                "itl_s": list(np.diff(arrival)),
                "num_output_tokens": steps,
                "e2e_latency_s": arrival[-1] - t0,
                "wave_target_passes": passes,
            },
        )
