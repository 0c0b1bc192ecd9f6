"""Benchmark workloads: which prompts are sent and how many tokens each request generates.

Two kinds, both with a fixed output length and ignore-EOS semantics (requests carry no stop
tokens), so plain and speculative decoding generate exactly the same number of tokens:

- random: InferenceX's fixed-shape serving tests. Every prompt has exactly `input_len` token ids
  drawn uniformly (seeded) from the tokenizer's vocabulary minus its special ids; shapes `1k1k`
  (1024 in / 1024 out), `1k8k` and `8k1k`, multiplied by `scale` so they fit a CPU (scale 1/16:
  64/64, 64/512, 512/64).
- datasets: `mt_bench`, `gsm8k`, `sharegpt`, `spec_bench` (files under the repository's `data/`).
  The first user turn of each record is wrapped in the target's chat template and tokenized with
  its `tokenizer.json`; prompts that leave no room for `output_len` tokens within `max_seq_len`
  are skipped (and counted), as vLLM's ShareGPT loader drops over-long prompts.
- multi-turn chat: `mt_bench_multiturn`, the requests of two-turn chat sessions: each MT-Bench
  question's first turn, and its second turn after the conversation so far (the first turn and
  the target's own greedy answer to it, generated when the workload is built), both through the
  chat template. Second turns share their first turn's tokens (a prefix cache sees them).
- agentic trace: `agentic`, the requests of agent sessions whose context grows every turn: a GSM8K
  question as the task, then turn after turn the conversation so far, the target's own greedy
  answer to the last turn and a tool result (text of about `tool_tokens` tokens from ShareGPT's
  prompts), as an agent loop sends it back; all answers generated when the workload is built.
  Its requests are played in turn order (every session's first turn, then every second turn, ...),
  each turn's prompt starting with the previous turn's prompt and answer, so a prefix cache serves
  all but the newest answer and tool result.

`Workload.prompts(num, seed, stream)` draws a reproducible list of prompts: the same (num, seed,
stream) always gives the same token ids. Streams separate the measured prompts (0) from the
warm-up prompts (1) of one seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable

import numpy as np

from ..sampling.sampler import SamplingParams
from ..scheduler import Scheduler
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer, encode_rendered, load_tokenizer, tokenize_prompts
from ..train.data import load_prompts, read_utf8

# InferenceX / SemiAnalysis fixed serving shapes: (input tokens, output tokens).
SHAPES: dict[str, tuple[int, int]] = {"1k1k": (1024, 1024), "1k8k": (1024, 8192), "8k1k": (8192, 1024)}

DATASETS: dict[str, str] = {
    "mt_bench": os.path.join("mt_bench", "question.jsonl"),
    "gsm8k": os.path.join("gsm8k", "test.jsonl"),
    "sharegpt": os.path.join("sharegpt", "ShareGPT_V3_filtered_500.json"),
    "spec_bench": os.path.join("spec_bench", "question.jsonl"),
}

# Multi-turn workloads: name -> the dataset whose records' `turns` they play as chat sessions.
MULTITURN: dict[str, str] = {"mt_bench_multiturn": "mt_bench", "agentic": "gsm8k"}
AGENT_SYSTEM = "You are an agent. Work on the task step by step; the user sends back each tool's result."

# The repository's data/ folder (beside the package in a source checkout or editable install).
DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")

MEASURED, WARMUP = 0, 1  # prompt streams


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
    """A source of prompts plus the fixed number of tokens every request generates.

    Random workloads set `input_len` and `token_pool` (the ids prompts are drawn from); dataset
    workloads set `pool` (the tokenized prompts that fit). `info` describes the workload for
    reports (shape, scale, dataset sizes, skipped prompts).
    """

    name: str
    output_len: int
    info: dict
    input_len: int | None = None
    token_pool: np.ndarray | None = None
    pool: tuple[tuple[int, ...], ...] | None = None
    ordered: bool = False  # the pool is played in its order (a trace), not shuffled


    def prompts(self, num: int, seed: int, stream: int = MEASURED) -> list[list[int]]:
        """`num` prompts (lists of token ids), reproducible from (seed, stream).

        Random workloads draw fresh ids; dataset workloads take the prompt pool in a seeded
        random order, cycling through it again when `num` exceeds its size.
        """
        if not isinstance(num, (int, np.integer)) or num < 0:
            raise ValueError(f"number of prompts must be an integer >= 0; got {num!r}")
        rng = np.random.default_rng([int(seed), int(stream)])
        if self.pool is not None:
            order = np.arange(len(self.pool)) if self.ordered else rng.permutation(len(self.pool))
            return [list(self.pool[order[i % len(order)]]) for i in range(num)]
        assert self.token_pool is not None and self.input_len is not None
        ids = rng.choice(self.token_pool, size=(num, self.input_len))
        return [[int(t) for t in row] for row in ids]

    @property
    def max_prompt_len(self) -> int:
        return self.input_len if self.pool is None else max(len(p) for p in self.pool)

    @property
    def max_total_len(self) -> int:
        """Longest prompt plus the output length: the sequence length the workload needs."""
        return self.max_prompt_len + self.output_len


def scaled_shape(shape: str, scale: float = 1.0) -> tuple[int, int]:
    """(input_len, output_len) of an InferenceX shape times `scale`, rounded, at least 1 each."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if not (isinstance(scale, (int, float)) and 0 < scale <= 1e6):
        raise ValueError(f"scale must be a positive number (1.0 = the full shape); got {scale!r}")
    return tuple(max(1, round(n * scale)) for n in SHAPES[shape])  # type: ignore[return-value]


def special_token_ids(tokenizer: Tokenizer) -> set[int]:
    """BOS, EOS and every added token the tokenizer marks special: ids random prompts never use."""
    ids = set(tokenizer.special_ids)
    ids.update(int(i) for i in tokenizer.eos_ids)
    if tokenizer.bos_id is not None:
        ids.add(int(tokenizer.bos_id))
    return ids


def safe_token_ids(vocab_size: int, exclude: Iterable[int] = ()) -> np.ndarray:
    """Ids in [0, vocab_size) minus `exclude`, as int64 (the pool random prompts draw from)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1; got {vocab_size}")
    ids = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.fromiter(exclude, np.int64))
    if ids.size == 0:
        raise ValueError(f"no token ids left in [0, {vocab_size}) after excluding the special ids")
    return ids


def check_fits(prompt_len: int, output_len: int, max_seq_len: int, what: str) -> None:
    """Raise ValueError when a prompt plus its output does not fit in max_seq_len."""
    if prompt_len + output_len > max_seq_len:
        raise ValueError(
            f"{what}: a {prompt_len}-token prompt plus {output_len} output tokens = {prompt_len + output_len} "
            f"exceeds the target's max_seq_len={max_seq_len}; lower --scale / --output_len or raise --max_seq_len "
            "(up to what the model supports)"
        )


def _check_output_len(output_len: int) -> int:
    if not isinstance(output_len, (int, np.integer)) or isinstance(output_len, bool) or output_len < 1:
        raise ValueError(f"output_len must be an integer >= 1; got {output_len!r}")
    return int(output_len)


def random_workload(shape: str, *, scale: float, vocab_size: int, special_ids: Iterable[int],
                    max_seq_len: int) -> Workload:
    """Fixed-shape random-token workload (`shape` one of SHAPES, lengths times `scale`).

    Token ids come uniformly from [0, vocab_size) minus `special_ids`. Raises ValueError when the
    scaled shape does not fit `max_seq_len`.
    """
    input_len, output_len = scaled_shape(shape, scale)
    check_fits(input_len, output_len, max_seq_len, f"random workload {shape} at scale {scale}")
    pool = safe_token_ids(vocab_size, special_ids)
    info = {"kind": "random", "shape": shape, "scale": scale, "input_len": input_len, "output_len": output_len,
            "vocab_size": vocab_size, "num_token_ids": int(pool.size)}
    return Workload(name=f"random-{shape}", output_len=output_len, info=info, input_len=input_len, token_pool=pool)


def random_workload_for(shape: str, *, scale: float, tokenizer: Tokenizer, model_vocab_size: int,
                        max_seq_len: int) -> Workload:
    """`random_workload` with the vocabulary both the tokenizer and the model know, minus specials."""
    vocab = min(int(model_vocab_size), tokenizer.vocab_size)
    return random_workload(shape, scale=scale, vocab_size=vocab, special_ids=special_token_ids(tokenizer),
                           max_seq_len=max_seq_len)


def dataset_path(name: str, data_dir: str | os.PathLike | None = None) -> str:
    """Path of a dataset workload's file; raises on an unknown name or a missing file."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset workload {name!r}; choose one of {', '.join(DATASETS)} (or random)")
    path = os.path.join(os.fspath(data_dir) if data_dir is not None else DEFAULT_DATA_DIR, DATASETS[name])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file {path} is missing; pass --data_dir pointing at the repository's data/")
    return path


def template_dir(tokenizer_path: str) -> str:
    """The folder a chat template is read from: the tokenizer folder, or the folder of a tokenizer file."""
    return tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)


def dataset_workload(name: str, *, tokenizer_dir: str | os.PathLike, output_len: int, max_seq_len: int,
                     data_dir: str | os.PathLike | None = None, tokenizer: Tokenizer | None = None,
                     limit: int | None = None) -> Workload:
    """Prompts of a dataset (first user turns), chat-templated and tokenized, `output_len` tokens out.

    Prompts longer than `max_seq_len - output_len` are skipped and counted in `info`; raises
    ValueError when none fits. `limit` reads only the first records of the file.
    """
    output_len = _check_output_len(output_len)
    path = dataset_path(name, data_dir)
    tok = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
    ids = tokenize_prompts(load_prompts(path, limit), tokenizer_dir, tok)
    if not ids:
        raise ValueError(f"dataset {name} ({path}) has no prompts")
    fits = tuple(tuple(p) for p in ids if len(p) + output_len <= max_seq_len)
    if not fits:
        check_fits(min(len(p) for p in ids), output_len, max_seq_len, f"dataset {name}: even its shortest prompt")
    lens = [len(p) for p in fits]
    info = {"kind": "dataset", "dataset": name, "path": os.path.relpath(path), "output_len": output_len,
            "num_records": len(ids), "num_prompts_fitting": len(fits), "num_skipped_too_long": len(ids) - len(fits),
            "prompt_len_mean": float(np.mean(lens)), "prompt_len_max": int(max(lens))}
    return Workload(name=name, output_len=output_len, info=info, pool=fits)


def load_turns(path: str | os.PathLike, limit: int | None = None) -> list[list[str]]:
    """The user turns of each record of an MT-Bench-style `.jsonl` file (`{"turns": [...]}`), in
    file order; records with fewer than two turns are skipped."""
    sessions = []
    for n, line in enumerate(read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line).get("turns")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{os.fspath(path)}:{n} is not a JSON object: {e}") from None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, str) and t.strip() for t in turns[:2]):
            sessions.append(turns[:2])
        if limit is not None and len(sessions) >= limit:
            break
    return sessions


def multiturn_workload(name: str, *, target, tokenizer_dir: str | os.PathLike, output_len: int, max_seq_len: int,
                       data_dir: str | os.PathLike | None = None, tokenizer: Tokenizer | None = None,
                       limit: int | None = None, max_num_seqs: int = 16) -> Workload:
    """Two-turn chat sessions of a dataset as one pool of requests: every first turn, and every
    second turn after the first and the target's own answer to it.

    The answers are generated here, greedy, by plain decoding with `target` (up to `output_len`
    tokens, stopping at the tokenizer's end-of-sequence ids), so the second turns carry the
    history a chat client would send back. Raises ValueError when the target's tokenizer has no
    chat template (roles would be lost) or when no second turn fits `max_seq_len`.
    """
    if name not in MULTITURN:
        raise ValueError(f"unknown multi-turn workload {name!r}; choose one of {', '.join(MULTITURN)}")
    if name == "agentic":
        return agentic_workload(target=target, tokenizer_dir=tokenizer_dir, output_len=output_len,
                                max_seq_len=max_seq_len, data_dir=data_dir, tokenizer=tokenizer,
                                max_num_seqs=max_num_seqs)
    output_len = _check_output_len(output_len)
    template = ChatTemplate.from_dir(tokenizer_dir)
    if template.source is None and not template.named:  # named ones without a default: render says which
        raise ValueError(f"{name} needs a chat template to render a conversation; {os.fspath(tokenizer_dir)} has none")
    path = dataset_path(MULTITURN[name], data_dir)
    tok = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
    render = lambda messages: encode_rendered(template.render(messages), tok)  # noqa: E731
    sessions = load_turns(path, limit)
    if not sessions:
        raise ValueError(f"dataset {name} ({path}) has no record with two user turns")
    firsts = [render([{"role": "user", "content": t[0]}]) for t in sessions]
    # A session is played only if its second turn can fit: first turn + answer + second turn + output.
    kept = [(t, p) for t, p in zip(sessions, firsts) if len(p) + 2 * output_len <= max_seq_len]
    if not kept:
        check_fits(min(map(len, firsts)), 2 * output_len, max_seq_len, f"dataset {name}: even its shortest session")
    answerer = Scheduler(target, max_num_seqs=max_num_seqs, max_seq_len=max_seq_len)
    outs = answerer.generate([p for _, p in kept], SamplingParams(max_tokens=output_len, stop_token_ids=tok.eos_ids))
    del answerer
    seconds = [render([{"role": "user", "content": t[0]},
                       {"role": "assistant", "content": tok.decode_continuation(p, o.token_ids)},
                       {"role": "user", "content": t[1]}]) for (t, p), o in zip(kept, outs)]
    seconds = [tuple(p) for p in seconds if len(p) + output_len <= max_seq_len]
    fits = [tuple(p) for _, p in kept] + seconds  # every kept first turn fits (checked above)
    num_seconds = len(seconds)
    if not num_seconds:
        raise ValueError(f"dataset {name}: no second turn fits max_seq_len={max_seq_len} with {output_len} tokens "
                         "out; lower the output length")
    lens = [len(p) for p in fits]
    info = {"kind": "dataset", "dataset": name, "path": os.path.relpath(path), "output_len": output_len,
            "num_records": 2 * len(sessions), "num_prompts_fitting": len(fits),
            "num_skipped_too_long": 2 * len(sessions) - len(fits), "num_second_turns": num_seconds,
            "prompt_len_mean": float(np.mean(lens)), "prompt_len_max": int(max(lens))}
    return Workload(name=name, output_len=output_len, info=info, pool=tuple(fits))


def tool_results(path: str | os.PathLike, count: int, tokens: int, tokenizer: Tokenizer) -> list[str]:
    """`count` tool results of about `tokens` tokens each: ShareGPT prompts in file order, joined
    and cut at the token count (cycling through the file when it runs out)."""
    texts = load_prompts(path)
    if not texts:
        raise ValueError(f"{os.fspath(path)} holds no conversation text for tool results")
    results, i = [], 0
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < tokens:
            ids += tokenizer.encode(texts[i % len(texts)] + "\n")
            i += 1
        results.append(tokenizer.decode(ids[:tokens]))
    return results


def agentic_workload(*, target, tokenizer_dir: str | os.PathLike, output_len: int, max_seq_len: int,
                     data_dir: str | os.PathLike | None = None, tokenizer: Tokenizer | None = None,
                     sessions: int = 8, turns: int = 4, tool_tokens: int = 384, max_num_seqs: int = 16) -> Workload:
    """`sessions` agent sessions of up to `turns` turns (see the module doc), the target's answers
    generated here, greedy, by plain decoding (up to `output_len` tokens, stopping at the
    tokenizer's end-of-sequence ids). A session stops growing at the first turn that would not fit
    `max_seq_len` with `output_len` tokens out. Raises ValueError without a chat template or when
    no session's first turn fits."""
    output_len = _check_output_len(output_len)
    template = ChatTemplate.from_dir(tokenizer_dir)
    if template.source is None and not template.named:
        raise ValueError(f"agentic needs a chat template to render a conversation; {os.fspath(tokenizer_dir)} has none")
    tok = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
    render = lambda messages: encode_rendered(template.render(messages), tok)  # noqa: E731
    tasks = load_prompts(dataset_path("gsm8k", data_dir))[:sessions]
    results = iter(tool_results(dataset_path("sharegpt", data_dir), sessions * turns, tool_tokens, tok))
    chats = [[{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": t}] for t in tasks]
    rounds: list[list[tuple[int, ...]]] = []
    answerer = Scheduler(target, max_num_seqs=max_num_seqs, max_seq_len=max_seq_len)
    for turn in range(turns):
        prompts = {i: render(chat) for i, chat in enumerate(chats) if chat is not None}
        live = {i: p for i, p in prompts.items() if len(p) + output_len <= max_seq_len}
        if not live:
            break
        rounds.append([tuple(p) for p in live.values()])
        chats = [chat if i in live else None for i, chat in enumerate(chats)]
        if turn + 1 == turns:
            break
        outs = answerer.generate(list(live.values()), SamplingParams(max_tokens=output_len, stop_token_ids=tok.eos_ids))
        for (i, prompt), out in zip(live.items(), outs):
            chats[i] = chats[i] + [{"role": "assistant", "content": tok.decode_continuation(prompt, out.token_ids)},
                                   {"role": "user", "content": "Tool result:\n" + next(results)}]
    del answerer
    if not rounds:
        check_fits(min(len(render(c)) for c in chats if c is not None), output_len, max_seq_len,
                   "agentic: even its shortest first turn")
    pool = tuple(p for round_ in rounds for p in round_)
    lens = [len(p) for p in pool]
    info = {"kind": "agentic", "dataset": "agentic", "output_len": output_len, "sessions": len(tasks),
            "turns": len(rounds), "tool_tokens": tool_tokens, "num_prompts_fitting": len(pool),
            "prompt_len_by_turn": [float(np.mean([len(p) for p in r])) for r in rounds],
            "prompt_len_mean": float(np.mean(lens)), "prompt_len_max": int(max(lens))}
    return Workload(name="agentic", output_len=output_len, info=info, pool=pool, ordered=True)
