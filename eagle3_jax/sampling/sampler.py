"""Sampling parameters and on-device token sampling with per-request PRNG keys.

A request's key for its n-th generated token is `fold_in(PRNGKey(seed), n)`, so a seeded request
samples the same tokens whatever else shares its batch.

Penalties (vLLM's): `repetition_penalty` divides positive logits and multiplies negative ones of
every token seen in the prompt or the output; `frequency_penalty` subtracts the token's count in
the output and `presence_penalty` a constant from every token the output holds. They change the
distribution a request samples from (greedy rows too), before min_tokens' hold-back, temperature
and top-k / top-p; `PenaltyHistory` is what they read.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..structured.constraints import Constraint


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (vLLM semantics; temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    max_tokens: int = 64
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded text (needs a tokenizer)
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before it
    min_tokens: int = 0  # tokens generated before a stop token or stop string may end the request
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted from every token the output holds
    frequency_penalty: float = 0.0  # in [-2, 2]: times the token's count in the output, subtracted
    repetition_penalty: float = 1.0  # > 0: on tokens seen in the prompt or the output (1 = off)
    logprobs: int | None = None  # each generated token's logprob and this many top alternatives (None: off)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (None: off)
    # Benchmarking only: verification accepts draft positions 1, 2, ... with these unconditional
    # probabilities (non-increasing, in [0, 1]) whatever the target says; the output is then not
    # the target's. None: the real, lossless rule.
    synthetic_acceptance: tuple[float, ...] | None = None
    # What the output must match (a JSON schema, a regex, a choice, a grammar: structured.Constraint),
    # applied to the target's distribution at every token; needs a tokenizer. None: anything.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if not (isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it); got {self.top_k!r}")
        if not (isinstance(self.max_tokens, (int, np.integer)) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1; got {self.max_tokens!r}")
        if not (isinstance(self.seed, (int, np.integer)) and 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32); got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not (isinstance(stop, (tuple, list)) and all(isinstance(x, str) and x for x in stop)):
            raise ValueError(f"stop must be a non-empty string or a sequence of them; got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(dict.fromkeys(stop)))
        if not (isinstance(self.min_tokens, (int, np.integer)) and 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]; got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and -2 <= value <= 2):
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off); got {value!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and not isinstance(self.repetition_penalty, bool)
                and 0 < self.repetition_penalty and np.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off); got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                                          and value >= 0):
                raise ValueError(f"{name} must be None or an integer >= 0 (the top alternatives per token); "
                                 f"got {value!r}")
        if self.synthetic_acceptance is not None:
            object.__setattr__(self, "synthetic_acceptance", check_acceptance_profile(self.synthetic_acceptance))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint (eagle3_jax.Constraint.json_schema(...), .regex(...), "
                             f".choice(...), .grammar(...)); got {type(self.constraint).__name__}")
        if self.constraint is not None and self.synthetic_acceptance is not None:
            raise ValueError("synthetic_acceptance forces tokens whatever the target says, so it cannot keep a "
                             "constraint; drop one of them")
        if self.min_tokens and len(self.stop_token_ids) > MAX_SUPPRESSED_STOP_IDS:
            raise ValueError(f"min_tokens holds back at most {MAX_SUPPRESSED_STOP_IDS} stop token ids; this request "
                             f"has {len(self.stop_token_ids)}")


MAX_SUPPRESSED_STOP_IDS = 16  # stop token ids a request with min_tokens keeps out of its first tokens
MAX_SYNTHETIC_POSITIONS = 16  # draft positions a synthetic acceptance profile may cover


def check_acceptance_profile(profile) -> tuple[float, ...]:
    """A synthetic acceptance profile as a tuple: entry d is the probability that a step accepts at
    least d + 1 draft tokens, so the entries lie in [0, 1] and do not increase."""
    try:
        values = tuple(float(x) for x in profile)
    except (TypeError, ValueError):
        raise ValueError(f"synthetic_acceptance must be a sequence of numbers; got {profile!r}") from None
    if not 1 <= len(values) <= MAX_SYNTHETIC_POSITIONS:
        raise ValueError(f"synthetic_acceptance needs 1 to {MAX_SYNTHETIC_POSITIONS} per-position rates; "
                         f"got {len(values)}")
    if not all(0 <= x <= 1 for x in values):
        raise ValueError(f"synthetic_acceptance rates must lie in [0, 1]; got {list(values)}")
    if any(b > a for a, b in zip(values, values[1:])):
        raise ValueError(f"synthetic_acceptance rates are unconditional (rate d: a step accepts at least d + 1 draft "
                         f"tokens), so they cannot increase; got {list(values)}")
    return values


@dataclasses.dataclass(frozen=True)
class BatchFeatures:
    """Which sampling settings some row of a batch uses, as the host knows them. A program branches
    on these in Python, each combination compiling its own program, never on device values: on a
    GPU, XLA runs a device-side branch (`lax.cond`) by copying its predicate to the host and
    blocking the launching thread until the device gets there, so the launch of a step would wait
    for the step's own work up to the branch, and the host could not prepare the next step
    meanwhile. Settings a batch does not use cost its program nothing."""

    sampled: bool = True  # some row samples (temperature > 0); else argmax alone
    holds_back: bool = True  # some row holds its stop ids back (min_tokens > 0)
    penalized: bool = True  # some row has a repetition, frequency or presence penalty
    synthetic: bool = False  # some row has a synthetic acceptance profile
    # Some sampled row keeps only its top-k or top-p tokens; else no vocabulary sort (the costly
    # part of sampling: a sort per row and position, where temperature alone is one division).
    truncated: bool = True

    @staticmethod
    def bits_of(params: SamplingParams) -> int:
        """One request's features as bits (a batch's: the OR of its rows'; `from_bits` reads them)."""
        penalized = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
        sampled = params.temperature > 0
        truncated = sampled and (params.top_k > 0 or params.top_p < 1)
        return (sampled | (params.min_tokens > 0) << 1 | penalized << 2
                | (params.synthetic_acceptance is not None) << 3 | truncated << 4)

    @staticmethod
    @functools.cache
    def from_bits(bits: int) -> "BatchFeatures":
        return BatchFeatures(bool(bits & 1), bool(bits & 2), bool(bits & 4), bool(bits & 8), bool(bits & 16))

    @staticmethod
    def of(params: Sequence[SamplingParams]) -> "BatchFeatures":
        """The features of a batch of requests' settings."""
        return BatchFeatures.from_bits(functools.reduce(operator.or_, map(BatchFeatures.bits_of, params), 0))


GREEDY_BATCH = BatchFeatures(sampled=False, holds_back=False, penalized=False, truncated=False)  # padding rows'
SAMPLED_BATCH = BatchFeatures(sampled=True, holds_back=False, penalized=False, truncated=False)  # temperature alone
TRUNCATED_BATCH = BatchFeatures(sampled=True, holds_back=False, penalized=False)  # a sampled row with top-k / top-p


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """SamplingParams of a batch as device arrays (rows of padding are greedy).

    `min_tokens` and `stop_ids` (None: no request holds stop tokens back) keep a row's stop token
    ids out of its distribution while it has generated fewer than min_tokens tokens; the penalties
    are None when no row has one, `top_k` and `top_p` when no sampled row truncates its
    distribution, and `sampled` (static) is False when every row is greedy (the program then only
    takes the argmax): see `BatchFeatures`.
    """

    temperature: jax.Array  # [B] float32
    top_k: jax.Array | None  # [B] int32; None (with top_p) when no sampled row keeps a top-k or top-p
    top_p: jax.Array | None  # [B] float32
    seed: jax.Array  # [B] uint32
    min_tokens: jax.Array | None = None  # [B] int32
    stop_ids: jax.Array | None = None  # [B, MAX_SUPPRESSED_STOP_IDS] int32, -1 padded
    presence_penalty: jax.Array | None = None  # [B] float32
    frequency_penalty: jax.Array | None = None  # [B] float32
    repetition_penalty: jax.Array | None = None  # [B] float32
    # [B, MAX_SYNTHETIC_POSITIONS] float32: synthetic acceptance profiles, 0 past a profile's end
    # and -1 on rows without one; None when no row of the batch has one.
    accept_profile: jax.Array | None = None
    sampled: bool = dataclasses.field(default=True, metadata=dict(static=True))  # some row samples

    @staticmethod
    def from_params(params: Sequence[SamplingParams], batch: int) -> "SamplingArrays":
        """`params` padded with greedy rows to `batch`, as host arrays (the jitted step takes them as
        they are); only the settings some row uses (`BatchFeatures`). The packed rows' encoding,
        read back."""
        params = list(params) + [SamplingParams()] * (batch - len(params))
        ints, floats = (np.stack(column) for column in zip(*map(packed_settings, params)))
        return unpack_settings(ints, floats, BatchFeatures.of(params))


# A batch's SamplingArrays packed as two host arrays (two leaves of a jitted call instead of ten):
# int32 columns [top_k, seed's bits, min_tokens, stop ids held back (-1 padded)] and float32
# columns [temperature, top_p, presence, frequency, repetition, accept profile (-1: none)].
PACKED_INTS = 3 + MAX_SUPPRESSED_STOP_IDS
PACKED_FLOATS = 5 + MAX_SYNTHETIC_POSITIONS
GREEDY_INTS = np.concatenate([np.zeros(3, np.int32), np.full(MAX_SUPPRESSED_STOP_IDS, -1, np.int32)])
GREEDY_FLOATS = np.concatenate([np.asarray([0.0, 1.0, 0.0, 0.0, 1.0], np.float32),
                                np.full(MAX_SYNTHETIC_POSITIONS, -1.0, np.float32)])


def packed_settings(params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """One request's row of the packed columns (ints, floats); `unpack_settings` reads them back."""
    ints, floats = GREEDY_INTS.copy(), GREEDY_FLOATS.copy()
    ints[:3] = params.top_k, np.uint32(params.seed).view(np.int32), params.min_tokens
    if params.min_tokens:
        ints[3: 3 + len(params.stop_token_ids)] = params.stop_token_ids
    floats[:5] = (params.temperature, params.top_p, params.presence_penalty, params.frequency_penalty,
                  params.repetition_penalty)
    if params.synthetic_acceptance is not None:
        floats[5:] = 0.0
        floats[5: 5 + len(params.synthetic_acceptance)] = params.synthetic_acceptance
    return ints, floats


def unpack_settings(ints, floats, features: BatchFeatures = BatchFeatures()) -> SamplingArrays:
    """The SamplingArrays of packed columns [B, PACKED_INTS] / [B, PACKED_FLOATS] (host or traced),
    with the settings `features` says some row uses (the others None, `sampled` False when no row
    samples; the default: all but synthetic profiles)."""
    seed = ints[:, 1].view(np.uint32) if isinstance(ints, np.ndarray) else jax.lax.bitcast_convert_type(
        ints[:, 1], jnp.uint32)
    holds_back, penalized = features.holds_back, features.penalized
    truncated = features.truncated
    return SamplingArrays(temperature=floats[:, 0], top_k=ints[:, 0] if truncated else None,
                          top_p=floats[:, 1] if truncated else None, seed=seed,
                          min_tokens=ints[:, 2] if holds_back else None,
                          stop_ids=ints[:, 3:PACKED_INTS] if holds_back else None,
                          presence_penalty=floats[:, 2] if penalized else None,
                          frequency_penalty=floats[:, 3] if penalized else None,
                          repetition_penalty=floats[:, 4] if penalized else None,
                          accept_profile=floats[:, 5:PACKED_FLOATS] if features.synthetic else None,
                          sampled=features.sampled)


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array | None,
                    top_p: jax.Array | None) -> jax.Array:
    """Temperature-scaled logits [B, V] with tokens outside a sampled row's top-k / top-p set to -inf.

    softmax of the result is the distribution a request samples from. Rows with temperature 0
    are returned unscaled and whole (callers take their argmax). `top_k` and `top_p` None: no row
    truncates, and no vocabulary is sorted. A row that keeps every token (top-k 0, top-p 1) gets
    the same bits either way, so its draws do not depend on its batch.
    """
    sampled = temperature > 0
    t = jnp.where(sampled, temperature, 1.0)[:, None]
    scaled = logits.astype(jnp.float32) / t
    if top_k is None and top_p is None:
        return scaled
    v = logits.shape[-1]
    order = jnp.argsort(-scaled, axis=-1, stable=True)  # ties broken by token id
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top-p 1 keeps every token, even where rounding brings the mass before the tail to 1.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    keep |= ~sampled[:, None]
    keep_orig = jnp.zeros_like(keep).at[jnp.arange(logits.shape[0])[:, None], order].set(keep)
    return jnp.where(keep_orig, scaled, -jnp.inf)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyHistory:
    """What a batch's penalties read: per sequence slot, the output's token counts and the prompt's
    tokens, and each row's slot (gathered only when some row has a penalty)."""

    output_counts: jax.Array  # [S, V] int32
    prompt_seen: jax.Array  # [S, V] bool
    rows: jax.Array  # [B] int32: each batch row's slot


def apply_penalties(logits: jax.Array, sp: SamplingArrays, history: PenaltyHistory | None,
                    extra_counts=None) -> jax.Array:
    """`logits` [B, ..., V] with each row's penalties applied (vLLM's order: repetition, then
    frequency, then presence) when the batch has them (`sp`'s penalties not None; a row without one
    keeps its logits bit for bit). `extra_counts()` [B, ..., V] (computed only then) adds tokens to
    the output's counts per position: a draft tree's ancestors, which the output holds at that node
    if it is accepted."""
    if history is None or sp.repetition_penalty is None:
        return logits
    b, v = logits.shape[0], logits.shape[-1]
    per_row = (b,) + (1,) * (logits.ndim - 1)
    counts = history.output_counts[history.rows].reshape((b,) + (1,) * (logits.ndim - 2) + (v,))
    if extra_counts is not None:
        counts = counts + extra_counts()
    seen = history.prompt_seen[history.rows].reshape((b,) + (1,) * (logits.ndim - 2) + (v,)) | (counts > 0)
    rep = sp.repetition_penalty.reshape(per_row)
    z = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    z = z - sp.frequency_penalty.reshape(per_row) * counts - sp.presence_penalty.reshape(per_row) * (counts > 0)
    return z.astype(logits.dtype)


def count_tokens(counts: jax.Array, rows: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """`counts` [S, V] with each row's valid tokens [B, T] added at `rows` [B]."""
    rows = jnp.broadcast_to(rows[:, None], tokens.shape)
    return counts.at[rows, jnp.maximum(tokens, 0)].add(valid.astype(counts.dtype))


def hold_back_stops(logits: jax.Array, sp: SamplingArrays, generated: jax.Array) -> jax.Array:
    """`logits` [B, ..., V] with each row's stop token ids at -inf where `generated` [B, ...] (the
    tokens a row generated before the one these logits predict) is below its min_tokens, when the
    batch holds stop ids back (`sp.min_tokens` not None; a row with min_tokens 0 is unchanged)."""
    if sp.min_tokens is None:
        return logits
    b, v = logits.shape[0], logits.shape[-1]
    rows = jnp.arange(b)[:, None]
    real = (sp.stop_ids >= 0).astype(jnp.int32)  # padding (-1) adds nothing at token 0
    stop = jnp.zeros((b, v), jnp.int32).at[rows, jnp.clip(sp.stop_ids, 0, v - 1)].max(real) > 0
    early = (generated < sp.min_tokens.reshape((b,) + (1,) * (generated.ndim - 1)))[..., None]
    stop = stop.reshape((b,) + (1,) * (logits.ndim - 2) + (v,))
    return jnp.where(early & stop, -jnp.inf, logits)


def allowed_tokens(masks: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Token bitmasks [..., words] int32 (bit t % 32 of word t // 32) -> bool [..., K]: whether
    each of `token_ids` [K] is allowed."""
    return ((masks[..., token_ids >> 5] >> (token_ids & 31)) & 1).astype(bool)


def apply_token_masks(logits: jax.Array, masks: jax.Array | None) -> jax.Array:
    """`logits` [B, ..., V] at -inf where the bitmasks `masks` [B, ..., words] (structured output:
    the tokens a row's grammar allows at each position) clear a token's bit; None: unchanged."""
    if masks is None:
        return logits
    allowed = allowed_tokens(masks, jnp.arange(logits.shape[-1], dtype=jnp.int32))
    return jnp.where(allowed, logits, -jnp.inf).astype(logits.dtype)


def processed_logits(logits: jax.Array, sp: SamplingArrays, generated: jax.Array) -> jax.Array:
    """Logits [B, P, V] at P positions per row -> what each row samples from there: stop tokens held
    back below min_tokens (`generated` [B, P]: tokens generated before each position's), then
    temperature and top-k / top-p (`filtered_logits`)."""
    return filtered_per_position(hold_back_stops(logits, sp, generated), sp)


def filtered_per_position(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
    """`filtered_logits` of logits [B, P, V], each row's settings applied at all its P positions."""
    b, p, v = logits.shape
    per_position = lambda a: None if a is None else jnp.repeat(a, p)  # noqa: E731
    return filtered_logits(logits.reshape(b * p, v), per_position(sp.temperature), per_position(sp.top_k),
                           per_position(sp.top_p)).reshape(b, p, v)


def request_keys(seed: jax.Array, counter: jax.Array) -> jax.Array:
    """Per-row PRNG keys: fold_in(PRNGKey(seed[b]), counter[b])."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seed, counter)


def sample(logits: jax.Array, sp: SamplingArrays, counter: jax.Array) -> jax.Array:
    """Next token per row [B] int32 from logits [B, V] (penalties applied by the caller): argmax
    where temperature is 0, else a seeded draw (`counter`: tokens generated so far; stop tokens are
    held back below min_tokens)."""
    logits = hold_back_stops(logits, sp, counter)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sp.sampled:  # no draw where no row samples
        return greedy
    filtered = filtered_logits(logits, sp.temperature, sp.top_k, sp.top_p)
    drawn = jax.vmap(jax.random.categorical)(request_keys(sp.seed, counter), filtered).astype(jnp.int32)
    return jnp.where(sp.temperature > 0, drawn, greedy)
