"""A stand-in for a scheduler's device: every step program answered at once, with random tokens.

What it is for: the scheduler's own host work per iteration (`scripts/bench_host.py
--stand_in_device`), apart from what a device on the host's own CPU adds to it. On a CPU device
the programs' threads share the host's cores and evict the host's caches between steps, so the
Python and the launches after them run cold (4-5x the warm time for the Python, about 20x for a
launch: benchmarks/notes/2026-11-28-host-time-r9.md). With the stand-in in place of the
compiled programs, a launch costs nothing, nothing runs beside the host and its caches stay warm,
as on a host whose device is an accelerator (the launches' own cost there, the runtime's
dispatch, is not in the figure; the host's work around them is).

The stand-in answers a prefill with a first token per row, and a decode step with 1 to D + 1
tokens per row (uniformly drawn; D the step's depth, 0 without speculation), all valid token ids.
It keeps no state and computes nothing, so its tokens mean nothing: it measures the host's
bookkeeping, never outputs. The programs of structured output and of logprobs are not stood in
for; asking for them raises.
"""

from __future__ import annotations

import numpy as np

from ..scheduler.programs import DONATED
from ..spec_decode.settings import shape_depth

ONE_TOKEN = ("plain_decode", "store_decode")  # a token per row, no speculation
PREFILL = ("prefill", "plain_prefill")


def stand_in_device(scheduler, seed: int = 0) -> None:
    """Replace `scheduler`'s compiled step programs with the stand-in (on this scheduler only, from
    now on). Only the programs: the host's work around them (the executor's arguments and state,
    the outputs' reads) runs as it does with a device."""
    programs = scheduler._executor.programs
    vocab, rng = scheduler.target.config.vocab_size, np.random.default_rng(seed)

    def run(fn, static: tuple, key: tuple, *args) -> tuple:
        # Executor.execute's key: (kind, shape, logprob settings, rows' key, first array's shape, masks' shape);
        # its arguments: the parameters, the state, then the rows.
        (kind, shape, logprobs, _, _, masks), state, rows = key, args[DONATED], args[DONATED + 1]
        if logprobs is not None or masks != ():
            raise ValueError("the stand-in device runs no logprob or structured-output program; leave those requests "
                             "out of a stand-in run")
        return (*_outputs(kind, shape, len(rows.ints), vocab, rng), state)

    programs.run = run


def _outputs(kind: str, shape, batch: int, vocab: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A `kind` program's outputs but its state: random first tokens of a prefill, none of a
    catch-up, 1 to D + 1 random tokens a row of a decode step (-1 padded, and their counts)."""
    if kind in PREFILL:
        return [rng.integers(0, vocab, batch, dtype=np.int32)]
    if kind == "catch_up":  # the draft's state only
        return []
    if kind != "decode" and kind not in ONE_TOKEN:
        raise ValueError(f"the stand-in device does not run {kind!r} programs")
    width = 1 + (0 if kind in ONE_TOKEN else shape_depth(shape))
    counts = rng.integers(1, width + 1, batch, dtype=np.int32)
    tokens = rng.integers(0, vocab, (batch, width), dtype=np.int32)
    tokens[np.arange(width)[None, :] >= counts[:, None]] = -1  # as a step pads its rows
    return [tokens, counts]
