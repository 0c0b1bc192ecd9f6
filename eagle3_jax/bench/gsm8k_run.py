"""The runs `scripts/eval_gsm8k.py` makes of the GSM8K evaluation (`gsm8k`), from its options.

- `load_inputs`: the test problems and the few-shot examples, a DataError naming the flag at fault;
- `run_servers`: one run per server (`/v1/chat/completions`), each after an optional warm-up pass;
- `encode_prompts`, `fit_max_seq_len`: the in-process prompts (chat-templated, tokenized) and the
  schedulers' sequence length, checked against them;
- `run_settings`: one in-process run per speculation setting, each on a fresh scheduler;
- `in_process_config`, `report_config`: the report's `config`; `compile_notes`: the line per run
  that says how long its XLA compilations took.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Callable, Sequence

from .gsm8k import (
    DEFAULT_FEWSHOT_FILE,
    DEFAULT_TEST_FILE,
    STOP_STRINGS,
    DataError,
    Problem,
    RunOutput,
    fewshot_messages,
    generate_http,
    generate_in_process,
    load_problems,
    render_prompts,
)
from .runner import CompileCounter, make_scheduler
from .settings import SpecSetting

if TYPE_CHECKING:  # annotations only
    from jax.sharding import Mesh

    from ..models.draft import Draft
    from ..models.target import Target
    from ..text.tokenizer import Tokenizer

Runs = list[tuple[str, RunOutput]]  # (label, the run's output), the reference run first


class RunError(ValueError):
    """A run that cannot go on for a reason of the user's: no server answers at a URL, or a server
    refused or failed a request (e.g. a prompt over its max_seq_len)."""


def load_inputs(data: str | None, fewshot_file: str | None, limit: int | None,
                num_fewshot: int) -> tuple[list[Problem], list[Problem]]:
    """(the first `limit` test problems of `data`, the first `num_fewshot` worked examples of
    `fewshot_file`), each file by default the repository's. A file that cannot be read, or holds
    fewer examples than asked for, raises DataError naming the flag (--data, --fewshot_file)."""
    try:
        problems = load_problems(data or DEFAULT_TEST_FILE, limit)
    except DataError as e:
        raise DataError(f"--data: {e}") from None
    try:
        shots = load_problems(fewshot_file or DEFAULT_FEWSHOT_FILE, num_fewshot)
    except DataError as e:
        raise DataError(f"--fewshot_file: {e}") from None
    if len(shots) < num_fewshot:
        raise DataError(f"--num_fewshot={num_fewshot} but the few-shot file has only {len(shots)} examples; "
                        "lower --num_fewshot or pass a longer --fewshot_file")
    return problems, shots


def run_servers(problems: Sequence[Problem], shots: Sequence[Problem], urls: Sequence[str], labels: Sequence[str], *,
                multiturn: bool, max_tokens: int, concurrency: int, model: str | None, warmup: bool, progress: bool,
                echo: Callable[[str], None] = print) -> tuple[Runs, dict]:
    """(one run per server at `urls`, named by `labels` (by default the URLs), the report's config
    `mode`). With `warmup`, each server first answers the first `concurrency` questions untimed
    (a fresh server compiles its programs on its first requests). `echo` says which run starts.
    No server at a URL, or a request it refuses or fails, raises RunError."""
    conversations = [fewshot_messages(p.question, shots, multiturn=multiturn) for p in problems]
    runs = []
    for url, label in zip(urls, labels or urls):
        echo(f"{label}: {len(problems)} questions to {url} ...")
        ask = functools.partial(generate_http, url, max_tokens=max_tokens, concurrency=concurrency, model=model)
        try:
            if warmup:
                ask(conversations[:concurrency])
            out = ask(conversations, progress=progress, desc=label)
        except ConnectionError as e:
            raise RunError(str(e)) from None
        except RuntimeError as e:  # a refused request (e.g. a prompt over the server's max_seq_len) or a failed one
            raise RunError(f"{label}: {e}") from None
        runs.append((label, out))
    return runs, {"mode": "HTTP " + ", ".join(urls)}


def encode_prompts(problems: Sequence[Problem], shots: Sequence[Problem], tokenizer: Tokenizer,
                   render: Callable[[list[dict[str, str]]], str], *, multiturn: bool) -> list[list[int]]:
    """Each problem's few-shot conversation rendered by `render` (a chat template) and tokenized
    with BOS, as scripts/serve.py's chat endpoint does."""
    texts = render_prompts(problems, shots, multiturn=multiturn, render=render)
    return [tokenizer.encode(t, add_bos=True) for t in texts]


def check_prompt_lengths(lengths: Sequence[int], max_seq_len: int) -> None:
    """A ValueError unless every prompt leaves room for at least one answer token."""
    over = [n for n in lengths if n >= max_seq_len]
    if over:
        raise ValueError(f"{len(over)} of {len(lengths)} prompts have >= max_seq_len={max_seq_len} tokens (longest "
                         f"{max(lengths)}); lower --num_fewshot or raise --max_seq_len (up to what the model supports)")


def fit_max_seq_len(lengths: Sequence[int], max_tokens: int, max_seq_len: int | None,
                    max_position: int) -> tuple[int, str | None]:
    """(the schedulers' sequence length, a note or None): `max_seq_len`, by default the longest
    prompt plus `max_tokens` within the model's `max_position`. Every prompt must leave room for an
    answer token (else ValueError); the note counts the prompts that leave fewer than `max_tokens`
    (the scheduler cuts their budget to the room left, as scripts/serve.py does)."""
    max_seq_len = max_seq_len or min(max(lengths) + max_tokens, max_position)
    check_prompt_lengths(lengths, max_seq_len)
    short = sum(n + max_tokens > max_seq_len for n in lengths)
    note = None
    if short:
        note = (f"note: {short} of {len(lengths)} prompts leave fewer than --max_tokens={max_tokens} tokens "
                f"within max_seq_len={max_seq_len}; their answers end there")
    return max_seq_len, note


def run_settings(target: Target, draft: Draft | None, tokenizer: Tokenizer, settings: Sequence[SpecSetting],
                 prompts: Sequence[Sequence[int]], *, max_seq_len: int, max_tokens: int, concurrency: int,
                 page_size: int | None, prefill_chunk: int | None, warmup: bool, progress: bool,
                 echo: Callable[[str], None] = print) -> Runs:
    """One greedy run over `prompts` per setting, in order, each on its own scheduler (`concurrency`
    requests in flight) dropped before the next (one KV pool at a time); stopped by the target's
    and the tokenizer's EOS ids or a stop string. With `warmup` the first `concurrency` prompts run
    once untimed (most programs compile). Each run's `info` records its setting and the XLA
    compilations during the timed run (count, seconds)."""
    stop_ids = tuple(dict.fromkeys([*target.config.eos_token_ids, *tokenizer.eos_ids]))
    runs = []
    for s in settings:
        sched = make_scheduler(target, draft, s, max_num_seqs=concurrency, max_seq_len=max_seq_len,
                               page_size=page_size, prefill_chunk=prefill_chunk)
        if warmup:
            generate_in_process(sched, tokenizer, prompts[:concurrency], max_tokens=max_tokens,
                                stop_token_ids=stop_ids, concurrency=concurrency)
        echo(f"{s.label}: {len(prompts)} questions ...")
        with CompileCounter() as compiles:
            out = generate_in_process(sched, tokenizer, prompts, max_tokens=max_tokens, stop_token_ids=stop_ids,
                                      concurrency=concurrency, progress=progress, desc=s.label)
        out.info.update({"setting": s.name, "compiles": compiles.count, "compile_s": compiles.seconds})
        runs.append((s.label, out))
        del sched  # one scheduler's KV pool at a time
    return runs


def in_process_config(target: Target, mesh: Mesh | None, *, target_path: str, draft_path: str | None, dtype: str,
                      max_seq_len: int, prompt_tokens_max: int) -> dict:
    """The report's `config` of an in-process run: the model folders (the draft's None without a
    speculative setting), dtype, sequence length, longest prompt, the mesh's shape, the target's
    kernels and batch invariance."""
    return {"mode": "in-process", "target": target_path, "draft": draft_path, "dtype": dtype,
            "max_seq_len": max_seq_len, "prompt_tokens_max": prompt_tokens_max,
            "mesh": None if mesh is None else list(mesh.devices.shape), "kernels": target.config.kernels,
            "batch_invariant": target.config.batch_invariant}


def report_config(config: dict, problems: Sequence[Problem], shots: Sequence[Problem], *, multiturn: bool,
                  max_tokens: int, concurrency: int, data: str | None, fewshot_file: str | None,
                  argv: Sequence[str]) -> dict:
    """`config` (the mode's) with what every run shares: the question and shot counts, the prompt
    form, the answer budget, concurrency, stop strings, the data files (the repository's, relative
    to the working folder, when not given) and the command line."""
    return {**config, "num_questions": len(problems), "num_fewshot": len(shots), "fewshot_as_multiturn": multiturn,
            "max_tokens": max_tokens, "concurrency": concurrency, "stop_strings": list(STOP_STRINGS),
            "data": data or os.path.relpath(DEFAULT_TEST_FILE),
            "fewshot_file": fewshot_file or os.path.relpath(DEFAULT_FEWSHOT_FILE), "argv": list(argv)}


def compile_notes(report: dict) -> list[str]:
    """A line for each run that compiled XLA programs while timed: how long they took of its wall
    time, and its tokens/s without them (the engine thread waits for a compile, so its time adds up
    with the rest)."""
    lines = []
    for row in report["runs"]:
        if row.get("compiles"):
            rest = row["wall_s"] - row["compile_s"]
            lines.append(f"{row['label']}: {row['compiles']} XLA compilations took {row['compile_s']:.1f} s of its "
                         f"{row['wall_s']:.1f} s" + (f" ({row['num_output_tokens'] / rest:.1f} tok/s without them)"
                                                      if rest > 0 else ""))
    return lines
