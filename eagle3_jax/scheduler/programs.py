"""The scheduler's device side: the state its programs carry, the programs, and their cache.

Every program takes (target params, draft params, `DeviceState`, the batch's `BatchRows` (slots,
prompt lengths, sampling settings, block tables: slot_table.py), host arrays...), donates the state
and returns (outputs..., new state). Kinds:

- "prefill" / "plain_prefill": one prompt chunk per row, with / without the draft;
- "decode": one speculative step of a chain or tree (spec_decode/step.py);
- "store_decode": one target token per row, its (feature, token) pair kept for the draft
  (adaptive speculation, a step that does not speculate);
- "plain_decode": one target token per row, no draft arrays at all;
- "catch_up": the draft runs over the pairs it has not seen;
- "propose", "forward", "accept": a speculative step in three programs, for batches with a
  structured-output row: the draft's tree (its first level under each row's token bitmask); the
  target's pass over it (logits and features stay on the device), while which the host reads the
  tree and computes every node's bitmask from the row's grammar; then the rest of the step under
  those masks (spec_decode/step.py's `accept_step`). A multi-host leader, whose followers cannot
  take another process's device arrays, runs the last two as one, "verify";
- "one_forward", then "one_sample" / "store_sample": a one-token step ("plain_decode" /
  "store_decode") in two programs for such batches, the host filling the masks during the first.

Prefill and one-token programs take an optional bitmask per row (structured output) for the
token they sample; programs with masks are compiled apart from those without.

Prefill and decode programs also come in a variant that returns the logprobs of the tokens they
produce (`LogprobSettings`; three more outputs: each token's logprob, the top ids and their
logprobs), compiled only when a batch has a request that asks for them.

`Executor` owns the state and a bounded cache of compiled programs; the batching side
(core.py) decides what runs and hands it host arrays only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..cache import host_tier, kv_cache
from ..config.model import ModelConfig
from ..models.draft import Draft, DraftConfig
from ..models.target import Target, uses_fnuz
from ..runtime.sharding import data_shards, mesh_context, replicate, shard_pages, to_host
from ..sampling.logprobs import LogprobSettings, TokenLogprobs
from ..sampling.sampler import PenaltyHistory, count_tokens
from ..spec_decode.policy import SpeculationPolicy
from ..spec_decode.propose import DraftRoot, DraftTree, draft_extend, propose
from ..spec_decode.settings import SpecConfig
from ..spec_decode.step import accept_step, spec_step, verify_tree
from .program_cache import ProgramCache
from .slot_table import BatchRows, chunk_columns
from .steps import plain_forward, plain_prefill, plain_sample, plain_step, spec_prefill

DONATED = 2  # position of the DeviceState among a program's dynamic arguments


@struct.dataclass
class DeviceState:
    """What the step programs carry from step to step, on device (donated to each program).

    KV page pools of the target and the draft, and per state slot (one per running request, the
    last one scratch for padding rows): the committed cache length, the last emitted token (the
    next step's root), what penalties read (the output's token counts, the prompt's tokens) and,
    with a draft, the draft's output hidden from which the next step proposes. Keeping them on
    device lets the host launch a step before reading the previous one.
    """

    tk: jax.Array
    tv: jax.Array
    dk: jax.Array | None
    dv: jax.Array | None
    length: jax.Array  # [S + 1] int32
    last_token: jax.Array  # [S + 1] int32
    draft_hidden: jax.Array | None  # [S + 1, H]
    output_counts: jax.Array  # [S + 1, V] int32: each token's count in the output
    prompt_seen: jax.Array  # [S + 1, V] bool: the prompt's tokens
    # Adaptive speculation: (target feature, next token) pairs of steps that did not speculate,
    # which the draft has not seen yet (spec_decode/adaptive.py).
    gap: jax.Array | None = None  # [S + 1] int32
    gap_features: jax.Array | None = None  # [S + 1, max_gap, 3 * target hidden]
    gap_tokens: jax.Array | None = None  # [S + 1, max_gap] int32
    # What the pools' reads return (their compute dtypes; FP8 pages are dequantized to them).
    target_dtype: jnp.dtype | None = struct.field(pytree_node=False, default=None)
    draft_dtype: jnp.dtype | None = struct.field(pytree_node=False, default=None)
    data_shards: int = struct.field(pytree_node=False, default=1)  # pages and rows split over data (kv_cache)

    def target_cache(self, block_table, lengths) -> kv_cache.KVCache:
        return kv_cache.paged_view(self.tk, self.tv, block_table, lengths, self.target_dtype, self.data_shards)

    def draft_cache(self, block_table, lengths) -> kv_cache.KVCache:
        return kv_cache.paged_view(self.dk, self.dv, block_table, lengths, self.draft_dtype, self.data_shards)


def init_state(target: Target, draft: Draft | None, policy: SpeculationPolicy, num_pages: int, page_size: int,
               num_slots: int, kv_fp8=None) -> DeviceState:
    """KV page pools (target, draft; in float8 `kv_fp8` slots when given, see
    kv_cache.resolve_kv_dtype) and `num_slots` + 1 state slots, placed on the target's mesh."""
    tcfg, mesh = target.config, target.mesh
    tk, tv = kv_cache.init_pages(tcfg, num_pages, page_size, target.dtype, kv_fp8)
    dk = dv = hidden = None
    slots = num_slots + 1
    if draft is not None:
        dk, dv = kv_cache.init_pages(draft.config.layers, num_pages, page_size, draft.dtype, kv_fp8)
        hidden = np.zeros((slots, draft.config.hidden_size), draft.dtype)
    per_slot = {"length": np.zeros((slots,), np.int32), "last_token": np.zeros((slots,), np.int32),
                "draft_hidden": hidden, "output_counts": np.zeros((slots, tcfg.vocab_size), np.int32),
                "prompt_seen": np.zeros((slots, tcfg.vocab_size), bool)}
    if policy.stores_pairs:
        width = len(tcfg.aux_layer_ids) * tcfg.hidden_size
        per_slot.update(gap=np.zeros((slots,), np.int32),
                        gap_features=np.zeros((slots, policy.max_gap, width), target.dtype),
                        gap_tokens=np.zeros((slots, policy.max_gap), np.int32))
    if mesh is not None:
        tk, tv = shard_pages(tk, tv, tcfg, mesh)
        if dk is not None:
            dk, dv = shard_pages(dk, dv, draft.config.layers, mesh)
        per_slot = replicate(per_slot, mesh)
    else:
        per_slot = jax.tree.map(jnp.asarray, per_slot)
    return DeviceState(tk=tk, tv=tv, dk=dk, dv=dv, **per_slot, target_dtype=jnp.dtype(target.dtype),
                       draft_dtype=None if draft is None else jnp.dtype(draft.dtype), data_shards=data_shards(mesh))


# ---- programs ----------------------------------------------------------------------------------------


def _logprob_outputs(lp: TokenLogprobs | None) -> tuple:
    """A program's logprob outputs: none, or (token logprobs, top ids, top logprobs)."""
    return () if lp is None else (lp.token, lp.top_ids, lp.top)


def _history_with_chunk(state: DeviceState, owners, prompt_lens, tokens, lengths, n_valid) -> DeviceState:
    """The owners' penalty history with a prompt chunk added: prompt tokens to the prompt's set,
    tokens past the prompt (an output recomputed after preemption) to the output's counts; a chunk
    at length 0 starts the slot afresh."""
    fresh = (lengths == 0)[:, None]
    counts = state.output_counts.at[owners].set(jnp.where(fresh, 0, state.output_counts[owners]))
    seen = state.prompt_seen.at[owners].set(state.prompt_seen[owners] & ~fresh)
    t = tokens.shape[1]
    valid = jnp.arange(t)[None, :] < n_valid[:, None]
    in_prompt = lengths[:, None] + jnp.arange(t)[None, :] < prompt_lens[:, None]
    seen = seen.at[jnp.broadcast_to(owners[:, None], tokens.shape), tokens].max(valid & in_prompt)
    return state.replace(output_counts=count_tokens(counts, owners, tokens, valid & ~in_prompt), prompt_seen=seen)


def _prefill_program(tcfg: ModelConfig, dcfg: DraftConfig | None, shape: None, logprobs: LogprobSettings | None,
                     tparams: dict, dparams: dict | None, state: DeviceState, rows: BatchRows, chunks, masks=None):
    """One prompt chunk per row after its cached prefix -> (first token, [logprobs of each
    position's next token,] state). `chunks`: the rows' packed prefill arrays (slot_table.py:
    tokens, cache lengths, valid tokens, following token, output counts). `masks` [B, words]: the
    tokens each row's first token may be (structured output).

    Rows whose chunk ends the prompt store their length, first token (and draft root) in their
    state slot; the others write the scratch slot. Every row's chunk enters the penalty history
    of its request's slot (`rows.prompt_lens`: its prompt's length), and a first token its output
    counts. Prefill always uses the expanded MLA form, whatever the chunk length, so numerics do
    not depend on the batch's bucket.
    """
    tokens, lengths, n_valid, following, counter = chunk_columns(chunks)
    block_table, owners, prompt_lens, sp = rows.block_table, rows.slots, rows.prompt_lens, rows.sampling
    slots = jnp.where(following < 0, owners, state.length.shape[0] - 1)
    tcache = state.target_cache(block_table, lengths)
    length = state.length.at[slots].set(lengths + n_valid)
    state = _history_with_chunk(state, owners, prompt_lens, tokens, lengths, n_valid)
    history = PenaltyHistory(state.output_counts, state.prompt_seen, owners)
    counted = lambda first: count_tokens(state.output_counts, owners, first[:, None], (following < 0)[:, None])  # noqa: E731
    if state.gap is not None:  # the prefill extends the draft over the whole prompt
        state = state.replace(gap=state.gap.at[slots].set(0))
    if dcfg is None:
        first, _, tcache, lp = plain_prefill(tparams, tcfg, tcache, tokens, n_valid, sp, counter, following,
                                             absorb=False, logprobs=logprobs, history=history, masks=masks)
        return first, *_logprob_outputs(lp), state.replace(tk=tcache.k, tv=tcache.v, length=length,
                                                           last_token=state.last_token.at[slots].set(first),
                                                           output_counts=counted(first))
    first, tcache, dcache, root, lp = spec_prefill(tparams, tcfg, dparams, dcfg, tcache,
                                                   state.draft_cache(block_table, lengths), tokens, n_valid, sp, counter,
                                                   following, absorb=False, logprobs=logprobs, history=history,
                                                   masks=masks)
    return first, *_logprob_outputs(lp), state.replace(tk=tcache.k, tv=tcache.v, dk=dcache.k, dv=dcache.v, length=length,
                                                       output_counts=counted(first),
                                last_token=state.last_token.at[slots].set(root.token),
                                draft_hidden=state.draft_hidden.at[slots].set(root.hidden))


def slot_rows(state: DeviceState, slots, prompt_lens):
    """(committed lengths, sampling counters) of the rows in `slots` (padding rows: 0). A row's
    counter (tokens generated so far) is its committed length - prompt length + 1."""
    live = slots < state.length.shape[0] - 1  # padding rows use the scratch slot
    lengths = jnp.where(live, state.length[slots], 0)
    return lengths, jnp.where(live, lengths - prompt_lens + 1, 0)


def _one_token_step(tcfg: ModelConfig, logprobs: LogprobSettings | None, tparams: dict, state: DeviceState,
                    rows: BatchRows, masks=None):
    """One target token per row (`masks` [B, words]: among those allowed): (tokens [B, 1], counts
    [B], aux features [B, F], logprob outputs, state)."""
    slots = rows.slots
    lengths, counter = slot_rows(state, slots, rows.prompt_lens)
    nxt, aux, tcache, lp = plain_step(tparams, tcfg, state.target_cache(rows.block_table, lengths),
                                      state.last_token[slots], rows.sampling, counter, logprobs,
                                      PenaltyHistory(state.output_counts, state.prompt_seen, slots), masks)
    with jax.named_scope("state"):
        state = record_token(state.replace(tk=tcache.k, tv=tcache.v), slots, lengths, nxt)
    return nxt[:, None], jnp.ones_like(nxt), aux, _logprob_outputs(lp), state


def record_token(state: DeviceState, slots, lengths, nxt) -> DeviceState:
    """A one-token step's result into the rows' state slots: lengths, next roots and the token's
    count (what penalties read)."""
    count = jnp.ones_like(nxt)
    return state.replace(length=state.length.at[slots].set(lengths + count),
                         last_token=state.last_token.at[slots].set(nxt),
                         output_counts=count_tokens(state.output_counts, slots, nxt[:, None], count[:, None] > 0))


def _plain_decode_program(tcfg: ModelConfig, dcfg: None, shape: None, logprobs: LogprobSettings | None,
                          tparams: dict, dparams: None, state: DeviceState, rows: BatchRows, masks=None):
    """One target token per row from its state slot -> (tokens [B, 1], counts [B], [logprobs,] state)."""
    out, count, _, lp, state = _one_token_step(tcfg, logprobs, tparams, state, rows, masks)
    return out, count, *lp, state


def _store_decode_program(tcfg: ModelConfig, dcfg: DraftConfig, shape: None, logprobs: LogprobSettings | None,
                          tparams: dict, dparams: dict, state: DeviceState, rows: BatchRows, masks=None):
    """A step without speculation or draft work: one target token per row; the pair (its target
    feature, the sampled next token) waits in the row's gap buffer for the catch-up program."""
    out, count, aux, lp, state = _one_token_step(tcfg, logprobs, tparams, state, rows, masks)
    return out, count, *lp, store_pair(state, rows.slots, aux, out[:, 0])


def store_pair(state: DeviceState, slots, aux, token) -> DeviceState:
    """A (target feature, next token) pair into each row's gap buffer (< max_gap: the host has a
    full buffer caught up first)."""
    gap = state.gap[slots]
    return state.replace(gap=state.gap.at[slots].set(gap + 1),
                         gap_features=state.gap_features.at[slots, gap].set(aux.astype(state.gap_features.dtype)),
                         gap_tokens=state.gap_tokens.at[slots, gap].set(token))


def _one_forward_program(tcfg: ModelConfig, dcfg: None, shape: None, logprobs: None, tparams: dict, dparams: None,
                         state: DeviceState, rows: BatchRows):
    """The target's pass of a one-token step -> (logits [B, 1, V], features [B, F], state: the
    rows' last tokens' K/V written)."""
    lengths, _ = slot_rows(state, rows.slots, rows.prompt_lens)
    logits, aux, tcache = plain_forward(tparams, tcfg, state.target_cache(rows.block_table, lengths),
                                        state.last_token[rows.slots])
    return logits, aux, state.replace(tk=tcache.k, tv=tcache.v)


def _one_sample_program(tcfg: ModelConfig, dcfg: DraftConfig | None, shape: None, logprobs: LogprobSettings | None,
                        tparams: dict, dparams: dict | None, state: DeviceState, rows: BatchRows, logits, aux, masks):
    """The rest of a one-token step after "one_forward", each row's token among those its bitmask
    `masks` [B, words] allows -> as "plain_decode"; with the draft's state ("store_sample"), the
    pair kept for the catch-up as "store_decode" does."""
    slots = rows.slots
    lengths, counter = slot_rows(state, slots, rows.prompt_lens)
    nxt, lp = plain_sample(logits, rows.sampling, counter, logprobs,
                           PenaltyHistory(state.output_counts, state.prompt_seen, slots), masks)
    state = record_token(state, slots, lengths, nxt)
    if state.gap_tokens is not None:
        state = store_pair(state, slots, aux, nxt)
    return nxt[:, None], jnp.ones_like(nxt), *_logprob_outputs(lp), state


def _decode_program(tcfg: ModelConfig, dcfg: DraftConfig, shape: SpecConfig, logprobs: LogprobSettings | None,
                    tparams: dict, dparams: dict, state: DeviceState, rows: BatchRows):
    """One speculative step (`shape`) per row from its state slot -> (tokens [B, D+1] (-1
    padded), counts [B], [logprobs,] state)."""
    block_table, slots = rows.block_table, rows.slots
    lengths, counter = slot_rows(state, slots, rows.prompt_lens)
    root = DraftRoot(token=state.last_token[slots], hidden=state.draft_hidden[slots])
    out, count, tcache, dcache, root, _, lp = spec_step(tparams, tcfg, dparams, dcfg, shape,
                                                        state.target_cache(block_table, lengths),
                                                        state.draft_cache(block_table, lengths), root, rows.sampling,
                                                        counter,
                                                        logprobs, PenaltyHistory(state.output_counts, state.prompt_seen,
                                                                                 slots))
    with jax.named_scope("state"):
        state = advance_state(state, slots, lengths, out, count, tcache, dcache, root)
    return out, count, *_logprob_outputs(lp), state


def _propose_program(tcfg: ModelConfig, dcfg: DraftConfig, shape: SpecConfig, logprobs: None, tparams: dict,
                     dparams: dict, state: DeviceState, rows: BatchRows, masks):
    """The draft tree (`shape`) of each row from its state slot, its first level among the tokens
    the row's bitmask `masks` [B, words] allows -> (tree tokens [B, N], parents [B, N], state: the
    draft pages hold the frontier's scratch K/V, which "verify" overwrites)."""
    slots = rows.slots
    lengths, _ = slot_rows(state, slots, rows.prompt_lens)
    root = DraftRoot(token=state.last_token[slots], hidden=state.draft_hidden[slots])
    tree, dcache = propose(dparams, dcfg, state.draft_cache(rows.block_table, lengths), root, shape, masks)
    return tree.tokens, tree.parents, state.replace(dk=dcache.k, dv=dcache.v)


def _verify_program(tcfg: ModelConfig, dcfg: DraftConfig, shape: SpecConfig, logprobs: LogprobSettings | None,
                    tparams: dict, dparams: dict, state: DeviceState, rows: BatchRows, tokens, parents, masks):
    """"forward" then "accept" as one program (a multi-host leader's form) -> as "decode"."""
    logits, aux, state = _forward_program(tcfg, dcfg, shape, None, tparams, dparams, state, rows, tokens, parents)
    return _accept_program(tcfg, dcfg, shape, logprobs, tparams, dparams, state, rows, tokens, parents, logits, aux,
                           masks)


def _forward_program(tcfg: ModelConfig, dcfg: DraftConfig, shape: SpecConfig, logprobs: None, tparams: dict,
                     dparams: dict, state: DeviceState, rows: BatchRows, tokens, parents):
    """The target's pass over each row's tree (from "propose") -> (logits [B, N, V], features
    [B, N, F], state: the nodes' K/V written past each row's committed length)."""
    lengths, _ = slot_rows(state, rows.slots, rows.prompt_lens)
    logits, aux, tcache, _, _ = verify_tree(tparams, tcfg, state.target_cache(rows.block_table, lengths),
                                            DraftTree(tokens=tokens, parents=parents))
    return logits, aux, state.replace(tk=tcache.k, tv=tcache.v)


def _accept_program(tcfg: ModelConfig, dcfg: DraftConfig, shape: SpecConfig, logprobs: LogprobSettings | None,
                    tparams: dict, dparams: dict, state: DeviceState, rows: BatchRows, tokens, parents, logits, aux,
                    masks):
    """The rest of a speculative step after "forward" (its `logits`, `aux`), each node judged among
    the tokens its bitmask `masks` [B, N, words] allows -> as "decode"."""
    block_table, slots, sp = rows.block_table, rows.slots, rows.sampling
    lengths, counter = slot_rows(state, slots, rows.prompt_lens)
    history = PenaltyHistory(state.output_counts, state.prompt_seen, slots)
    out, count, tcache, dcache, root, _, lp = accept_step(dparams, dcfg, shape.max_accept,
                                                          state.target_cache(block_table, lengths),
                                                          state.draft_cache(block_table, lengths),
                                                          DraftTree(tokens=tokens, parents=parents), logits, aux, sp,
                                                          counter, logprobs, history, masks)
    with jax.named_scope("state"):
        state = advance_state(state, slots, lengths, out, count, tcache, dcache, root)
    return out, count, *_logprob_outputs(lp), state


def advance_state(state: DeviceState, slots, lengths, out, count, tcache, dcache, root: DraftRoot) -> DeviceState:
    """A speculative step's results into the rows' state slots: caches, lengths, next roots and the
    emitted tokens' counts (what penalties read)."""
    emitted = jnp.arange(out.shape[1])[None, :] < count[:, None]
    return state.replace(
        tk=tcache.k, tv=tcache.v, dk=dcache.k, dv=dcache.v, length=state.length.at[slots].set(lengths + count),
        last_token=state.last_token.at[slots].set(root.token), draft_hidden=state.draft_hidden.at[slots].set(root.hidden),
        output_counts=count_tokens(state.output_counts, slots, out, emitted))


def _catch_up_program(tcfg: ModelConfig, dcfg: DraftConfig, shape: None, logprobs: None, tparams: dict,
                      dparams: dict, state: DeviceState, rows: BatchRows) -> tuple[DeviceState]:
    """Extend the draft over each row's stored (feature, token) pairs: from its cache at length -
    gap, in one draft pass; rows without pairs keep their draft hidden. Slots written past a row's
    pairs lie beyond its committed length (in its own pages, the scratch page, or past the table,
    where writes are dropped), so they need no room reserved."""
    slots = rows.slots
    live = slots < state.length.shape[0] - 1
    lengths = jnp.where(live, state.length[slots], 0)
    gap = jnp.where(live, state.gap[slots], 0)
    _, hidden, dcache = draft_extend(dparams, dcfg, state.draft_cache(rows.block_table, lengths - gap),
                                     state.gap_features[slots], state.gap_tokens[slots], gap)
    hidden = jnp.where((gap > 0)[:, None], hidden, state.draft_hidden[slots])
    return (state.replace(dk=dcache.k, dv=dcache.v, draft_hidden=state.draft_hidden.at[slots].set(hidden),
                          gap=state.gap.at[slots].set(0)),)


PROGRAMS = {"prefill": _prefill_program, "plain_prefill": _prefill_program, "decode": _decode_program,
            "store_decode": _store_decode_program, "plain_decode": _plain_decode_program,
            "catch_up": _catch_up_program, "propose": _propose_program, "verify": _verify_program,
            "forward": _forward_program, "accept": _accept_program, "one_forward": _one_forward_program,
            "one_sample": _one_sample_program, "store_sample": _one_sample_program}
# Programs that run without the draft get the state without these arrays (fewer to dispatch; the
# gap counts stay: a plain prefill zeroes its slot's).
_PLAIN = ("plain_prefill", "plain_decode", "one_forward", "one_sample")
_DRAFT_STATE = ("dk", "dv", "draft_hidden", "gap_features", "gap_tokens")


def _with_fields(state: DeviceState, fields: dict) -> DeviceState:
    """What `state.replace(**fields)` returns, without going through __init__: done twice for every
    plain step of a scheduler with a draft, where replace took 5 us of a few dozen a step
    (DeviceState's __init__ checks and derives nothing, so a copy of its dict is the same state)."""
    new = object.__new__(DeviceState)
    new.__dict__.update(state.__dict__, **fields)
    return new


class Executor:
    """The device side of one scheduler: its `DeviceState` and compiled programs."""

    def __init__(self, target: Target, draft: Draft | None, policy: SpeculationPolicy, num_pages: int,
                 page_size: int, num_slots: int, max_compiled_programs: int, kv_cache_dtype: str = "auto"):
        # The programs run the target capturing the hidden states the draft reads.
        target = target if draft is None else target.capturing(draft.aux_layer_ids)
        self.target, self.draft, self.kv_cache_dtype = target, draft, kv_cache_dtype
        kv_fp8 = kv_cache.resolve_kv_dtype(kv_cache_dtype, uses_fnuz("auto"))
        self.state = init_state(target, draft, policy, num_pages, page_size, num_slots, kv_fp8)
        self.programs = ProgramCache(max_compiled_programs, donated=DONATED)
        self._host_is_device = jax.tree.leaves(target.params)[0].devices().pop().platform == "cpu"
        self.host_pages: host_tier.HostPagePool | None = None

    def execute(self, kind: str, shape: SpecConfig | None, rows: BatchRows, *args,
                logprobs: LogprobSettings | None = None, masks: np.ndarray | None = None) -> list[jax.Array]:
        """Launch the `kind` program (for "decode", of speculation `shape`; with `logprobs`, the
        variant that returns them; with `masks`, the token bitmasks of structured output) over
        `rows` and the state; returns its outputs as device arrays, not waited for. The cache key
        is the kind, the shape, the logprob settings, the rows' key (their shape, the sampling settings
        some row uses: sampling.BatchFeatures), whether there are masks and the other arrays' shapes."""
        with_draft = self.draft is not None and kind not in _PLAIN
        dcfg, dparams = (self.draft.config, self.draft.params) if with_draft else (None, None)
        key = (kind, shape, logprobs, rows.key, np.shape(args[0]) if args else None, np.shape(masks))
        if masks is not None:
            args = (*args, masks)
        state, held = self.state, {}
        if self.draft is not None and not with_draft:
            held = {name: getattr(state, name) for name in _DRAFT_STATE}
            state = _with_fields(state, dict.fromkeys(_DRAFT_STATE))
        with mesh_context(self.target.mesh):
            *outs, state = self.programs.run(PROGRAMS[kind], (self.target.config, dcfg, shape, logprobs), key,
                                             self.target.params,
                                             dparams, state, rows, *args)
        self.state = _with_fields(state, held) if held else state
        return outs

    # ---- the host tier of the prefix cache (cache/host_tier.py) -------------------------------------
    def enable_host_tier(self, gib: float, shards: int) -> int:
        """Keep up to `gib` GiB of evicted pages in host memory (capped by what the machine has,
        said in a warning); returns the host slots per data shard."""
        pools = self._pools()
        per_shard = host_tier.host_slots_for(gib, host_tier.page_bytes(pools), host_tier.available_host_bytes()) // shards
        self.host_pages = host_tier.HostPagePool(pools, per_shard * shards) if per_shard else None
        return per_shard

    def _pools(self) -> tuple:
        s = self.state
        return s.tk, s.tv, s.dk, s.dv

    def save_pages(self, pages: list[int], slots: list[int]) -> None:
        """Copy device `pages` (target and draft pools) to the host tier's `slots`."""
        with mesh_context(self.target.mesh):
            self.host_pages.save(self._pools(), pages, slots)

    def restore_pages(self, slots: list[int], pages: list[int]) -> None:
        """Copy the host tier's `slots` into device `pages`, ahead of every program launched later."""
        with mesh_context(self.target.mesh):
            tk, tv, dk, dv = self.host_pages.restore(self._pools(), slots, pages)
        self.state = self.state.replace(tk=tk, tv=tv, dk=dk, dv=dv)

    def prefetch(self, outputs: list[jax.Array]) -> None:
        """Start copying `outputs`, which the host reads later, to the host now: queued behind the
        program that computes them, the copy is done by the time the host reads them (after its
        next launch), instead of starting then. A CPU device's arrays are host memory already."""
        if self._host_is_device:
            return
        for output in outputs:
            if output.is_fully_addressable:  # a multi-host batch is gathered by the read itself
                output.copy_to_host_async()

    def read(self, outputs: list[jax.Array]) -> list[np.ndarray]:
        """The outputs' values. Every output is read, in order, on every process: reading a batch
        split over a multi-host `data` axis is a collective (sharding.to_host)."""
        with mesh_context(self.target.mesh):
            return [to_host(o) for o in outputs]
