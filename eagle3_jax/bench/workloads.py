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

`Workload.prompts(num, seed, stream)` draws a reproducible list of prompts: the same (num, seed,
stream) always gives the same token ids. Streams separate the measured prompts (0) from the
warm-up prompts (1) of one seed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

import numpy as np

from ..tokenizer import Tokenizer, load_tokenizer
from ..train.data import load_prompts, render_prompt

# InferenceX / SemiAnalysis fixed serving shapes: (input tokens, output tokens).
SHAPES: dict[str, tuple[int, int]] = {"1k1k": (1024, 1024), "1k8k": (1024, 8192), "8k1k": (8192, 1024)}

DATASETS: dict[str, str] = {
    "mt_bench": os.path.join("mt_bench", "question.jsonl"),
    "gsm8k": os.path.join("gsm8k", "test.jsonl"),
    "sharegpt": os.path.join("sharegpt", "ShareGPT_V3_filtered_500.json"),
    "spec_bench": os.path.join("spec_bench", "question.jsonl"),
}

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

    def prompts(self, num: int, seed: int, stream: int = MEASURED) -> list[list[int]]:
        """`num` prompts (lists of token ids), reproducible from (seed, stream).

        Random workloads draw fresh ids; dataset workloads take the prompt pool in a seeded
        random order, cycling through it again when `num` exceeds its size.
        """
        if not isinstance(num, (int, np.integer)) or num < 0:
            raise ValueError(f"number of prompts must be an integer >= 0; got {num!r}")
        rng = np.random.default_rng([int(seed), int(stream)])
        if self.pool is not None:
            order = rng.permutation(len(self.pool))
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
    ids = {int(i) for i, tok in tokenizer.backend.get_added_tokens_decoder().items() if tok.special}
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


def encode_rendered(rendered: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids of a chat-template rendering, starting with BOS exactly once.

    Templates usually write the BOS text themselves, so the tokenizer's own special tokens are
    not added (as transformers' apply_chat_template does); BOS is prepended only when missing.
    """
    ids = tokenizer.encode(rendered, add_bos=False)
    if tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids.insert(0, int(tokenizer.bos_id))
    return ids


def tokenize_prompts(texts: Iterable[str], tokenizer_dir: str | os.PathLike, tokenizer: Tokenizer) -> list[list[int]]:
    """Each text as the user turn of the chat template (if any), tokenized (BOS exactly once)."""
    return [encode_rendered(render_prompt(t, tokenizer_dir), tokenizer) for t in texts]


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
