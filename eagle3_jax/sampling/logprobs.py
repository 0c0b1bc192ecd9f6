"""Log-probabilities of chosen tokens and their top alternatives, on device and for the host.

A request asking for logprobs (`SamplingParams.logprobs`, `prompt_logprobs`) gets, for each token,
the target's log-probability of it and the `k` most likely tokens at that position. Which
distribution they are read from is one setting of the scheduler (`LogprobSettings.processed`):

- raw (the default, as vLLM's `raw_logprobs`): `log_softmax` of the target's logits, before
  anything a request's sampling settings change;
- processed (vLLM's `processed_logprobs`): of the distribution the token was drawn or judged
  from, after min_tokens' hold-back, penalties, temperature and, for a sampled request, top-k /
  top-p (tokens filtered out are -inf; a greedy request's token is judged from the whole
  distribution).

Under speculation each emitted token's logprob is read at the tree node that predicted it (the
accepted path's node before it, or the deepest accepted node for the bonus token): the same
position of the same context as a plain decode step reads it, so the values agree to rounding.
Prompt logprobs are always raw.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .sampler import SamplingArrays, processed_logits


@dataclasses.dataclass(frozen=True)
class LogprobSettings:
    """What logprob-computing programs compute (static: part of a program's compile key)."""

    k: int  # top alternatives per token (the scheduler's max_logprobs)
    processed: bool = False  # from the sampled distribution, not the raw logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenLogprobs:
    """Per position: the chosen token's logprob and the top-k (ids, logprobs), best first."""

    token: jax.Array  # [...] float32
    top_ids: jax.Array  # [..., k] int32
    top: jax.Array  # [..., k] float32


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> TokenLogprobs:
    """`logits` [..., V] and the tokens chosen there [...] (negative: none, read as 0) -> their
    log-softmax values and the top `k` of each position (ties broken by the lower token id)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top, ids = jax.lax.top_k(lp, k)
    return TokenLogprobs(chosen, ids.astype(jnp.int32), top)


# ---- host side --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's logprob and the top alternatives at its position, as a request's output holds it."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first; as many as the request asked for

    @staticmethod
    def rows(values: "HostLogprobs", row: int, positions, k: int) -> list["Logprob"]:
        """The Logprobs of `row` at `positions` of host arrays, `k` alternatives each."""
        token, ids, top = values
        return [Logprob(float(token[row, p]), tuple(zip(ids[row, p, :k].tolist(), top[row, p, :k].tolist())))
                for p in positions]


HostLogprobs = tuple  # (token [B, P], top_ids [B, P, K], top [B, P, K]) as numpy arrays


def emitted_logprobs(logits: jax.Array, judged: jax.Array, tokens: jax.Array, sp: SamplingArrays,
                     counter: jax.Array, logprobs: LogprobSettings) -> TokenLogprobs:
    """Logprobs of emitted tokens [B, P] from the raw logits [B, P, V] that predicted them, or,
    processed, from those logits as judged (penalised; token p is the row's generated token number
    counter + p)."""
    if logprobs.processed:
        logits = processed_logits(judged, sp, counter[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32))
    return token_logprobs(logits, tokens, logprobs.k)
