"""Training data for an EAGLE-3 draft, made by the target itself.

The pipeline (as in SpecForge / the EAGLE-3 paper: the draft learns the target's own outputs):

1. `load_prompts` reads prompts (GSM8K, MT-Bench / Spec-Bench, ShareGPT, plain text) and
   `eagle3_jax.text.chat_template.render_prompts` wraps each in the model's chat template;
2. `regenerate` has the target answer every prompt (greedy and/or sampled), giving `Example`s
   whose `loss_mask` marks the response tokens;
3. `pack` lays the examples into fixed-length rows, several to a row where they fit, each's
   positions counting from 0 (no token sees another example's);
4. the teacher signals come from one causal target forward per batch (`teacher_batch`): the
   draft's three feature layers (`aux`), the final hidden state its LM head reads (the logits
   over the draft vocabulary are recomputed from it in the loss: `teacher_head`) and the
   full-vocabulary argmax. They are either computed once and stored ("offline":
   feature_store.py) or on the fly ("online": `online_batches`). Both modes share `run_teacher`
   and `batch_order`, so they yield the same batches in the same order.

Batches are dicts: tokens int32 [B, T], loss_mask bool [B, T], positions int32 [B, T] (each token's
position in its own sequence), aux [B, T, 3H] (target dtype), teacher_hidden [B, T, H] (target
dtype: the final-norm output, whose product with `teacher_head` is the teacher's logits over the
draft vocabulary), teacher_argmax int32 [B, T] (target-vocabulary ids).
`online_batches` yields the teacher's outputs as device arrays (on a target's mesh, where it
computed them) beside the host's tokens, mask and positions.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import kv_cache
from ..checkpoint.atomic import atomic_output
from ..engine import Engine
from ..models.layers import final_hidden, lm_head
from ..models.draft import Draft
from ..models.target import Target, forward_hidden
from ..runtime.sharding import mesh_context
from ..sampling.sampler import SamplingParams
from ..weights.quant import QArray, dequantize, linear
from . import run_record
from .placement import global_array



# ---- prompts --------------------------------------------------------------------------------------------


def _first_user_turn(conversation: list, where: str) -> str | None:
    """First human/user message of a ShareGPT (`from`/`value`) or chat (`role`/`content`) list."""
    if not isinstance(conversation, list):
        raise ValueError(f"{where}: expected a list of turns, got {type(conversation).__name__}")
    for turn in conversation:
        if not isinstance(turn, dict):
            continue
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if who in ("human", "user") and isinstance(text, str) and text.strip():
            return text
    return None


def _prompt_of(record, where: str) -> str | None:
    """The prompt of one dataset record (None = a record without a usable user turn: skipped)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "question" in record:  # GSM8K
        return str(record["question"])
    if "turns" in record:  # MT-Bench, Spec-Bench: the first turn
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        return str(turns[0])
    if "conversations" in record:  # ShareGPT
        return _first_user_turn(record["conversations"], where)
    if "messages" in record:  # OpenAI-style chat records
        return _first_user_turn(record["messages"], where)
    if "prompt" in record:
        return str(record["prompt"])
    raise ValueError(
        f"{where}: unknown record format with keys {sorted(record)[:8]}; expected GSM8K {{'question'}}, "
        "MT-Bench/Spec-Bench {'turns': [...]}, ShareGPT {'conversations': [{'from': 'human', 'value': ...}]}, "
        "{'messages': [{'role': 'user', 'content': ...}]} or {'prompt'}"
    )


def read_utf8(path: str | os.PathLike) -> str:
    """A text file's contents; a ValueError naming the file and the byte offset for binary (a NUL
    byte) or non-UTF-8 content, instead of a decoder traceback halfway through."""
    with open(path, "rb") as f:
        data = f.read()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{os.fspath(path)} is binary, not text (a NUL byte at offset {nul}); give a UTF-8 text file")
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # a BOM some editors write
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = start + e.start
        raise ValueError(f"{os.fspath(path)} is not UTF-8 text (byte 0x{data[offset]:02x} at offset {offset}); "
                         "convert it to UTF-8") from None


def load_prompts(path: str | os.PathLike, limit: int | None = None) -> list[str]:
    """Prompts from a dataset file, in file order.

    `.jsonl`: one record per line (GSM8K `question`; MT-Bench / Spec-Bench first of `turns`;
    ShareGPT `conversations`, first `"from": "human"` turn; chat `messages`; `prompt`).
    `.json`: a list of such records (the ShareGPT release). `.txt`: one prompt per non-blank line.
    Records with no user turn (empty ShareGPT conversations) are skipped.
    """
    path = os.fspath(path)
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None; got {limit!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path} does not exist")
    ext = os.path.splitext(path)[1].lower()
    out: list[str] = []

    def add(p: str | None) -> bool:
        if p is not None and p.strip():
            out.append(p)
        return limit is not None and len(out) >= limit

    if limit == 0:
        return out
    text = read_utf8(path)
    if ext == ".txt":
        with io.StringIO(text) as f:
            for line in f:
                if add(line.strip() or None):
                    break
    elif ext == ".jsonl":
        with io.StringIO(text) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not valid JSON: {e}") from e
                if add(_prompt_of(record, f"{path}:{n}")):
                    break
    elif ext == ".json":
        with io.StringIO(text) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records (ShareGPT layout), got {type(data).__name__}")
        for n, record in enumerate(data):
            if add(_prompt_of(record, f"{path}[{n}]")):
                break
    else:
        raise ValueError(f"prompt file {path} has an unknown extension {ext!r}; use .jsonl, .json (ShareGPT) or .txt")
    return out


# ---- regeneration ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Example:
    """One training sequence: prompt + the target's response."""

    tokens: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n], True on the response tokens


def regenerate(target: Target, prompts: Sequence[Sequence[int]], *, max_tokens: int,
               temperatures: Sequence[float] = (0.0,), seed: int = 0, batch_size: int = 32,
               max_seq_len: int | None = None, stop_token_ids: Sequence[int] = (),
               draft: Draft | None = None) -> list[Example]:
    """Responses generated by the target itself (`e3.Engine`; with a `draft` for it, speculating: the
    target's tokens all the same, greedy or sampled).

    One response per (prompt, temperature), in prompt-major order: example k = prompt k // len(T),
    temperature T[k % len(T)]. Temperature 0 is greedy; sampled requests use seed `seed + k`.
    Responses include the stop token when one ends them. `max_seq_len` defaults to the longest
    prompt plus `max_tokens`.
    """
    temps = [float(t) for t in temperatures]
    if not temps:
        raise ValueError("temperatures must list at least one temperature (0.0 = greedy)")
    if not prompts:
        return []
    ids = [[int(t) for t in p] for p in prompts]
    if max_seq_len is None:
        max_seq_len = max(len(p) for p in ids) + int(max_tokens)
    engine = Engine(target, draft=draft, max_batch_size=int(batch_size), max_seq_len=int(max_seq_len))
    reqs, params = [], []
    for i, p in enumerate(ids):
        for j, t in enumerate(temps):
            k = i * len(temps) + j
            reqs.append(p)
            params.append(SamplingParams(temperature=t, max_tokens=int(max_tokens), seed=int(seed) + k,
                                         stop_token_ids=tuple(stop_token_ids)))
    outs = engine.generate(reqs, params)
    examples = []
    for p, out in zip(reqs, outs):
        tokens = np.asarray(list(p) + list(out.token_ids), np.int32)
        mask = np.zeros(tokens.shape, bool)
        mask[len(p):] = True
        examples.append(Example(tokens=tokens, loss_mask=mask))
    return examples


class StaleExamples(ValueError):
    """Regenerated examples kept for other generation settings or data."""


def save_examples(path: str | os.PathLike, examples: Sequence[Example], key: dict) -> Sequence[Example]:
    """Write `examples` (atomically; the folder made if missing) to the .npz `path`, with the `key`
    that made them (JSON-able); returns them."""
    with atomic_output(path, name="regenerated examples", overwrite=True, is_file=True) as tmp:
        with open(tmp, "wb") as f:  # a file object: np.savez would add .npz to the temporary's name
            np.savez(f, tokens=np.concatenate([np.zeros(0, np.int32)] + [np.asarray(e.tokens, np.int32) for e in examples]),
                     loss_mask=np.concatenate([np.zeros(0, bool)] + [np.asarray(e.loss_mask, bool) for e in examples]),
                     lengths=np.asarray([len(e.tokens) for e in examples], np.int64),
                     key=np.asarray(json.dumps(key, sort_keys=True)))
    return examples


def load_examples(path: str | os.PathLike, key: dict, defaults: dict | None = None) -> list[Example] | None:
    """The examples `save_examples` wrote to `path` with this `key`; None when there is no such file;
    StaleExamples naming the settings that differ when it was made with another key (a name in one
    key only counts as its entry in `defaults`: a flag added since ran as its default)."""
    if not os.path.isfile(path):
        return None
    with np.load(path) as f:
        differ = run_record.differences(json.loads(str(f["key"])), json.loads(json.dumps(key)), defaults)
        if differ:
            raise StaleExamples(f"{os.fspath(path)} holds responses regenerated with other settings ({', '.join(differ)}); "
                                "delete it or keep these elsewhere")
        ends = np.cumsum(f["lengths"])
        tokens, mask = np.split(f["tokens"], ends[:-1]), np.split(f["loss_mask"], ends[:-1])
    return [Example(tokens=t, loss_mask=m) for t, m in zip(tokens, mask)] if len(ends) else []


def pack(examples: Sequence[Example], seq_len: int, min_rows: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Examples -> (tokens int32 [N, seq_len], loss_mask bool [N, seq_len], positions int32 [N, seq_len]).

    Whole examples laid one after another in rows of `seq_len`, each's positions counting from 0: a
    position 0 starts a sequence, and no token sees another sequence's (the teacher's forward and the
    training-time test both bound attention at the sequence's first slot). Longest first, each into
    the row with the most room that holds it, a new row only when none does, and at least `min_rows`
    rows while there are examples for them (a batch's worth): few rows, evenly filled. A row's unused
    end is token 0 / mask False, counted as a sequence of its own. Longer examples keep their first
    `seq_len` tokens.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1; got {seq_len}")
    kept = []
    for i, ex in enumerate(examples):
        t, m = np.asarray(ex.tokens), np.asarray(ex.loss_mask, bool)
        if t.shape != m.shape or t.ndim != 1:
            raise ValueError(f"example {i}: tokens {t.shape} and loss_mask {m.shape} must be 1-D of the same length")
        kept.append((t[:seq_len], m[:seq_len]))
    rows: list[list[int]] = [[] for _ in range(min(min_rows, len(kept)))]  # the examples in each row
    free = [seq_len] * len(rows)  # each row's unused length
    for i in sorted(range(len(kept)), key=lambda i: -len(kept[i][0])):  # stable: equal lengths in given order
        need = len(kept[i][0])
        row = int(np.argmax(free)) if free and max(free) >= need else None  # the first of the roomiest
        if row is None:
            rows.append([])
            free.append(seq_len)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= need
    tokens = np.zeros((len(rows), seq_len), np.int32)
    mask = np.zeros((len(rows), seq_len), bool)
    positions = np.zeros((len(rows), seq_len), np.int32)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            t, m = kept[i]
            tokens[r, at:at + len(t)], mask[r, at:at + len(t)] = t, m
            positions[r, at:at + len(t)] = np.arange(len(t))
            at += len(t)
        positions[r, at:] = np.arange(seq_len - at)
    return tokens, mask, positions


def row_positions(tokens: np.ndarray) -> np.ndarray:
    """The positions of rows that each hold one sequence: 0, 1, ... along every row."""
    return np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape).copy()


# ---- teacher signals -----------------------------------------------------------------------------------------


# Tokens per teacher forward pass: a sequence longer than this runs as a scan of passes over a KV
# cache (as the scheduler's prefill chunks a prompt), so no pass's temporaries (the MoE's routed
# tokens, the expanded attention's scores) grow with the whole sequence.
TEACHER_CHUNK = 2048


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "chunk"))
def teacher_forward(params, cfg, ids, dtype, chunk: int = TEACHER_CHUNK, positions=None):
    """The teacher's signals over `ids` int32 [B, T] at `positions` [B, T] (sequences packed in rows;
    None: one per row) (see teacher_batch): one causal target forward, each token seeing only its own
    sequence (from its slot less its position on), in passes of `chunk` tokens over a KV cache when T
    is longer (the last pass padded at the end, which no earlier position sees)."""
    b, t = ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    chunk = min(chunk, t)
    passes = -(-t // chunk)
    cache = kv_cache.init_cache(cfg, b, passes * chunk, dtype)

    def one_pass(cache, part):
        part, positions = part
        slots = cache.lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        x, aux, cache = forward_hidden(params, cfg, part, positions, cache, starts=slots - positions)
        hidden = final_hidden(params, cfg, x)
        logits = linear(hidden, lm_head(params, cfg), out_dtype=jnp.float32)  # as forward's: only for the argmax
        return kv_cache.advance(cache, jnp.full((b,), chunk, jnp.int32)), {
            "aux": aux, "teacher_hidden": hidden, "teacher_argmax": jnp.argmax(logits, axis=-1).astype(jnp.int32)}

    if passes == 1:
        return one_pass(cache, (ids, positions))[1]
    parts = [jnp.pad(x, ((0, 0), (0, passes * chunk - t))).reshape(b, passes, chunk).swapaxes(0, 1)
             for x in (ids, positions)]  # the padding at positions 0: sequences of their own
    _, out = jax.lax.scan(one_pass, cache, parts)  # each [passes, B, chunk, ...]
    return {k: v.swapaxes(0, 1).reshape(b, passes * chunk, *v.shape[3:])[:, :t] for k, v in out.items()}


def teacher_head(target: Target, draft_ids) -> jax.Array:
    """The target's LM head at the draft vocabulary's ids [H, Vd], in its dtype (a quantized head
    dequantized): a batch's `teacher_hidden` @ it is the teacher's logits over the draft vocabulary,
    as the target computes them (ttt.ttt_loss takes it as `teacher_head`)."""
    d = _check_draft_ids(draft_ids, target.config.vocab_size)
    head = lm_head(target.params, target.config)
    if isinstance(head, QArray):
        head = dequantize(head, target.dtype)
    with mesh_context(target.mesh):
        return jax.jit(lambda w: jnp.take(w, jnp.asarray(d), axis=1))(head)


def run_teacher(target: Target, rows, positions) -> dict:
    """The teacher over `rows` at `positions` (int32 [B, T], host) where the target's weights are: on
    its mesh the rows split over `data` (whole on every device when B does not divide), the forward
    sharded as serving shards it; the outputs stay on the devices."""
    mesh = target.mesh
    if mesh is None:
        rows, positions = jnp.asarray(rows), jnp.asarray(positions)
    else:
        split = "data" if len(rows) % mesh.shape["data"] == 0 else None
        where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(split))
        rows, positions = global_array(rows, where), global_array(positions, where)
    with mesh_context(mesh):
        return teacher_forward(target.params, target.config, rows, target.dtype, positions=positions)


def _check_draft_ids(draft_ids, vocab: int) -> np.ndarray:
    d = np.asarray(draft_ids)
    if d.ndim != 1 or d.size == 0 or not np.issubdtype(d.dtype, np.integer):
        raise ValueError(f"draft_ids must be a non-empty 1-D integer array (DraftVocab.draft_ids); got shape {d.shape}")
    if d.min() < 0 or d.max() >= vocab:
        raise ValueError(f"draft_ids must lie in [0, {vocab}); got range [{d.min()}, {d.max()}]")
    return d.astype(np.int32)


def check_ids(ids: np.ndarray, vocab: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}); got range [{ids.min()}, {ids.max()}]")


def check_target(target: Target) -> None:
    if len(target.config.aux_layer_ids) != 3:
        raise ValueError(f"the target captures {len(target.config.aux_layer_ids)} feature layers; EAGLE-3 needs 3")


def teacher_batch(target: Target, tokens, positions=None) -> dict:
    """One causal target forward over `tokens` int [B, T] (jitted once per shape), at `positions`
    [B, T] (sequences packed in rows, `pack`; None: one per row).

    Returns device arrays: aux [B, T, 3H] (target dtype, the draft's feature layers),
    teacher_hidden [B, T, H] (target dtype: the final norm's output, which the LM head reads; @
    `teacher_head` gives the logits over a draft vocabulary), teacher_argmax int32 [B, T] (argmax
    over the full target vocabulary).
    """
    check_target(target)
    ids = np.asarray(tokens)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"tokens must be an integer array [batch, tokens]; got shape {ids.shape}, dtype {ids.dtype}")
    check_ids(ids, target.config.vocab_size)
    positions = check_positions(ids, positions)
    return run_teacher(target, ids.astype(np.int32), positions)


def batch_order(n: int, batch_size: int, *, seed: int, epoch: int, drop_last: bool = True) -> list[np.ndarray]:
    """Row indices of each batch of an epoch: `default_rng(seed * 1000003 + epoch).permutation(n)` cut
    into batches of `batch_size` (the short last batch dropped with `drop_last`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    perm = np.random.default_rng(int(seed) * 1000003 + int(epoch)).permutation(int(n))
    stop = (n // batch_size) * batch_size if drop_last else n
    return [perm[i:i + batch_size] for i in range(0, stop, batch_size)]


def check_rows(tokens, loss_mask) -> tuple[np.ndarray, np.ndarray]:
    tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask)
    if tokens.ndim != 2 or loss_mask.shape != tokens.shape:
        raise ValueError(f"tokens and loss_mask must both be [N, T]; got {tokens.shape} and {loss_mask.shape}")
    return tokens.astype(np.int32), loss_mask.astype(bool)


def check_positions(tokens: np.ndarray, positions) -> np.ndarray:
    """`positions` of packed rows as int32 (`row_positions` for None): a ValueError unless each row
    counts 0, 1, ... through each of its sequences (a sequence starts at 0)."""
    if positions is None:
        return row_positions(tokens)
    p = np.asarray(positions)
    if p.shape != tokens.shape or not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"positions must be integers shaped like the tokens {tokens.shape}; got {p.dtype} {p.shape}")
    counts_on = (p[:, 1:] == p[:, :-1] + 1) | (p[:, 1:] == 0)
    if p.size and not (np.all(p[:, 0] == 0) and np.all(counts_on)):
        raise ValueError("positions must count 0, 1, ... through each sequence of a row (pack's positions)")
    return p.astype(np.int32)


def online_batches(target: Target, tokens, loss_mask, batch_size: int, *, seed: int, epoch: int,
                   drop_last: bool = True, positions=None) -> Iterator[dict]:
    """"Online" mode: the batches of `FeatureStore.batches` (same order, same values), with the
    teacher computed on the fly (`positions`: of packed rows, None for one sequence per row). The
    next batch's forward is dispatched before a batch is yielded."""
    tokens, loss_mask = check_rows(tokens, loss_mask)
    positions = check_positions(tokens, positions)
    check_target(target)
    check_ids(tokens, target.config.vocab_size)

    def make(idx):
        rows = tokens[idx]
        out = {"tokens": rows, "loss_mask": loss_mask[idx], "positions": positions[idx]}
        out.update(run_teacher(target, rows, positions[idx]))
        return out

    pending = None
    for idx in batch_order(len(tokens), batch_size, seed=seed, epoch=epoch, drop_last=drop_last):
        nxt = make(idx)
        if pending is not None:
            yield pending
        pending = nxt
    if pending is not None:
        yield pending
