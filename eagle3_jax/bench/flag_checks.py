"""The benchmark scripts' checks of their flag values, without JAX.

`scripts/bench.py`, `scripts/bench_host.py` and `scripts/eval_gsm8k.py` call these before they
load JAX (this module imports nothing but the standard library), so a mistake in a flag's value
answers at once. Each check raises ValueError with the line the user sees; the scripts turn it
into their usage error (`eagle3_jax.cli.script.usage_errors`).
"""

from __future__ import annotations

import os
from typing import Sequence


def int_list(values: Sequence[str], flag: str, lo: int) -> tuple[int, ...]:
    """A list flag's values as integers: at least one, each >= `lo`, none twice (`--concurrency`,
    `--seeds` of scripts/bench.py)."""
    try:
        out = tuple(int(v) for v in values)
    except ValueError:
        raise ValueError(f"--{flag} must be a comma-separated list of integers; got {','.join(values)!r}") from None
    if not out or any(v < lo for v in out):
        raise ValueError(f"--{flag} needs integers >= {lo}; got {','.join(values)!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"--{flag} lists a value more than once: {','.join(values)!r}")
    return out


def rates(values: Sequence[str] | None) -> tuple[float, ...] | None:
    """`--synthetic_acceptance`'s values as numbers (None when the flag is not given); their range
    and order are SamplingParams' to check."""
    if values is None:
        return None
    try:
        return tuple(float(v) for v in values)
    except ValueError:
        raise ValueError(f"--synthetic_acceptance must be comma-separated numbers; got {','.join(values)!r}") from None


def check_file_stem(name: str | None) -> None:
    """`--name` of scripts/bench.py is a file stem: not empty, no folder, not `.` or `..` (None:
    not given, the default name applies)."""
    if name is not None and (not name or os.sep in name or name in (".", "..")):
        raise ValueError(f"--name is a file stem (no folders; --out_dir picks the folder); got {name!r}")


def num_seqs(values: Sequence[str]) -> list[int]:
    """scripts/bench_host.py's `--num_seqs`: integers >= 1, at least one (repeats allowed: each is a row)."""
    try:
        sizes = [int(n) for n in values]
    except ValueError:
        raise ValueError(f"--num_seqs must be comma-separated integers; got {','.join(values)!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError("--num_seqs needs integers >= 1")
    return sizes


def check_token_range(min_tokens: int, max_tokens: int) -> None:
    """scripts/bench_host.py draws each request's length in [--min_tokens, --max_tokens]."""
    if min_tokens > max_tokens:
        raise ValueError(f"--min_tokens ({min_tokens}) exceeds --max_tokens ({max_tokens})")


def check_host_modes(*, through_engine: bool, phases: bool, profile: int, stop_string: str | None,
                     detokenize: bool) -> None:
    """scripts/bench_host.py's flags that go together: --phases and --profile time the scheduler
    driven directly (not --through_engine); --stop_string needs --detokenize."""
    if through_engine and (phases or profile):
        raise ValueError("--phases and --profile time the scheduler's own loop: leave them out with --through_engine")
    if stop_string is not None and not detokenize:
        raise ValueError("--stop_string needs --detokenize (stop strings are matched on the decoded text)")


def check_gsm8k_sources(*, base_url: Sequence[str], labels: Sequence[str], spec_given: bool, mesh: object,
                        distributed: bool, target: str | None, draft: str | None, chat_template: str | None) -> None:
    """scripts/eval_gsm8k.py answers with servers (`base_url`, named by `labels`) or an in-process
    `target`: the flags of the other kind are refused, and one of the two must be given.
    `spec_given`: whether --spec was on the command line (a server runs its own speculation)."""
    if base_url:
        if spec_given:
            raise ValueError("with --base_url each server runs its own speculation; drop --spec and name the runs "
                             "with --labels")
        if mesh or distributed:
            raise ValueError("--mesh and --distributed are for the in-process model; a server has its own "
                             "(scripts/serve.py --mesh)")
        if labels and len(labels) != len(base_url):
            raise ValueError(f"--labels names {len(labels)} runs but --base_url lists {len(base_url)}")
        if len(set(base_url)) != len(base_url):
            raise ValueError("--base_url lists a server more than once")
        if target is not None or draft is not None:
            raise ValueError("--target and --draft are for in-process runs; with --base_url the servers hold the "
                             "models (drop them, or drop --base_url)")
        if chat_template is not None:
            raise ValueError("--chat_template is for in-process runs; a server applies its own (scripts/serve.py "
                             "--chat_template)")
    elif target is None:
        raise ValueError("give --target (a model folder, for an in-process run) or --base_url (a running server)")
    elif labels:
        raise ValueError("--labels names --base_url runs; in-process runs are named by --spec")
