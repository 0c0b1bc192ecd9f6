"""What `scripts/bench.py` decides around a serving benchmark's run, from its options.

- checks of the choices that go together (`check_server_choices`, `check_workload_choice`,
  `check_synthetic_acceptance`), each raising ValueError with the line the user sees;
- `load_workload`: the random, dataset or multi-turn workload (a multi-turn one has the target
  answer its first turns, so it loads the target and hands it back);
- `default_name`: the outputs' file stem; `too_few_requests_warning`: the line that names the
  cells with too few measured requests to time;
- `run_record_config` and `in_process_config`: the report's `config`, common to both modes and
  of an in-process run;
- `run_over_http` and `run_in_process`: the cells, by `http_client.run_http_benchmark` against a
  server or `runner.run_benchmark` in-process (the models loaded first), with the mode and config
  the report records.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Callable, Sequence

from .http_client import run_http_benchmark
from .report import MIN_REQUESTS, MIN_REQUESTS_PER_CLIENT, too_few_requests
from .runner import RunConfig, run_benchmark
from .settings import SpecSetting
from .workloads import DATASETS, MULTITURN, Workload, dataset_workload, multiturn_workload, random_workload_for

if TYPE_CHECKING:  # annotations only
    from jax.sharding import Mesh

    from ..models.draft import Draft
    from ..models.target import Target
    from ..text.tokenizer import Tokenizer


def check_server_choices(settings: Sequence[SpecSetting], base_url: str | None, in_process_mesh: bool) -> None:
    """Against a server (`base_url`) the one setting it runs is named, and no in-process mesh
    (`--mesh`, `--distributed`) is asked for: the server has its own."""
    if base_url and len(settings) != 1:
        raise ValueError("with --base_url, --spec names the one setting the server runs (e.g. --spec=chain:3:1:4)")
    if base_url and in_process_mesh:
        raise ValueError("--mesh and --distributed are for the in-process model; with --base_url the server "
                         "has its own (scripts/serve.py --mesh)")


def check_workload_choice(workload: str, base_url: str | None) -> None:
    """`workload` is `random`, a dataset or a multi-turn workload; a multi-turn one runs in-process
    only (the target answers its first turns)."""
    if workload != "random" and workload not in {**DATASETS, **MULTITURN}:
        raise ValueError(f"--workload must be random or one of {', '.join([*DATASETS, *MULTITURN])}; "
                         f"got {workload!r}")
    if workload in MULTITURN and base_url:
        raise ValueError(f"--workload={workload} has the target answer its sessions' turns in-process; "
                         "drop --base_url (or use a single-turn dataset against the server)")


def check_synthetic_acceptance(cfg: RunConfig, settings: Sequence[SpecSetting]) -> None:
    """A forced acceptance needs a speculative setting to force it on."""
    if cfg.synthetic_acceptance is not None and all(s.spec is None for s in settings):
        raise ValueError("--synthetic_acceptance forces a speculative step's acceptance: add a speculative "
                         "--spec (e.g. --spec=none,chain:3:1:4)")


def load_workload(kind: str, *, shape: str, scale: float, output_len: int, data_dir: str | None,
                  tokenizer: Tokenizer, template_dir: str, model_vocab_size: int, max_seq_len: int,
                  load_target: Callable[[], Target]) -> tuple[Workload, Target | None]:
    """(the workload, the target when loading it needed one, else None): `random` prompts of an
    InferenceX `shape` times `scale`, a multi-turn workload (the target, from `load_target()`,
    answers its first turns), or a dataset's first turns; each chat-templated from `template_dir`
    and fitting `max_seq_len`. Raises ValueError (or the loaders' own errors) for inputs that do
    not fit or cannot be read."""
    if kind == "random":
        return random_workload_for(shape, scale=scale, tokenizer=tokenizer, model_vocab_size=model_vocab_size,
                                   max_seq_len=max_seq_len), None
    if kind in MULTITURN:
        target = load_target()
        return multiturn_workload(kind, target=target, tokenizer_dir=template_dir, output_len=output_len,
                                  max_seq_len=max_seq_len, data_dir=data_dir, tokenizer=tokenizer), target
    return dataset_workload(kind, tokenizer_dir=template_dir, output_len=output_len, max_seq_len=max_seq_len,
                            data_dir=data_dir, tokenizer=tokenizer), None


def default_name(target: str, workload: Workload, over_http: bool = False) -> str:
    """The outputs' file stem: `<target>_<shape>_x<scale>` of a random workload,
    `<target>_<dataset>_out<output_len>` of the others; runs against a server end in `_http`, so
    they keep in-process results."""
    stem = os.path.basename(os.path.normpath(target))
    if workload.info.get("kind") == "random":
        name = f"{stem}_{workload.name}_x{workload.info['scale']:g}"
    else:
        name = f"{stem}_{workload.name}_out{workload.output_len}"
    return name + ("_http" if over_http else "")


def too_few_requests_warning(cfg: RunConfig) -> str | None:
    """The warning for the cells whose measured requests are too few to time, with the count to
    give; None when every cell has enough."""
    short = {c: cfg.prompts_for(c) for c in cfg.concurrencies if too_few_requests(cfg.prompts_for(c), c)}
    if not short:
        return None
    need = max(too_few_requests(n, c) for c, n in short.items())
    cells = ", ".join(f"{n} at concurrency {c}" for c, n in short.items())
    return (f"too few requests to time ({cells}; fewer than {MIN_REQUESTS_PER_CLIENT} per concurrent client or "
            f"{MIN_REQUESTS} in all): those cells are marked * in the report; give --num_prompts={need} (or "
            f"--min_prompts={need}) to time them")


def run_record_config(cfg: RunConfig, *, dtype: str, limit: int, page_size: int | None, prefill_chunk: int | None,
                      target: str) -> dict:
    """The report's `config` of every run: the grid and counts (`cfg`), the dtype, the sequence
    length limit the workload was fitted to, the page and chunk sizes, the target folder."""
    return {**dataclasses.asdict(cfg), "dtype": dtype, "max_seq_len_limit": limit, "page_size": page_size,
            "prefill_chunk": prefill_chunk, "target": target}


def in_process_config(target: Target, mesh: Mesh | None, *, draft: str | None, scheduler_max_seq_len: int,
                      overlap: bool, prefix_caching: bool, kv_cache_dtype: str = "auto",
                      host_kv_cache_gb: float = 0.0) -> dict:
    """The report's `config` entries of an in-process run: the mesh's shape, the target's kernels
    and batch invariance, the draft folder (None without a speculative setting), the schedulers'
    sequence length, overlap, prefix caching (and its host tier's GiB) and KV cache dtype."""
    return {"mesh": None if mesh is None else list(mesh.devices.shape), "kernels": target.config.kernels,
            "batch_invariant": target.config.batch_invariant, "draft": draft,
            "scheduler_max_seq_len": scheduler_max_seq_len, "overlap": overlap, "prefix_caching": prefix_caching,
            "kv_cache_dtype": kv_cache_dtype, "host_kv_cache_gb": host_kv_cache_gb}


@dataclasses.dataclass(frozen=True)
class BenchRun:
    """A run's cells, its mode as the report names it, and the report's `config`."""

    cells: list[dict]
    mode: str
    config: dict


def run_over_http(base_url: str, setting: SpecSetting, workload: Workload, cfg: RunConfig, config: dict, *,
                  model: str | None, num_devices: int | None) -> BenchRun:
    """The cells against the server at `base_url` (which runs `setting`; `num_devices` behind it,
    1 by default); the dtype is the server's business, so `config` records none. A server that
    does not answer raises ConnectionError."""
    cells = run_http_benchmark(base_url, setting, workload, cfg, model=model, num_devices=num_devices or 1)
    return BenchRun(cells, f"HTTP {base_url}", {**config, "dtype": None})


def run_in_process(settings: Sequence[SpecSetting], workload: Workload, cfg: RunConfig, config: dict, *,
                   target: Target | None, load_target: Callable[[], Target], load_draft: Callable[[Target], Draft],
                   draft_path: str, mesh: Mesh | None, max_seq_len: int | None, page_size: int | None,
                   prefill_chunk: int | None, num_devices: int | None, overlap: bool,
                   prefix_caching: bool, kv_cache_dtype: str = "auto", num_pages: int | None = None,
                   host_kv_cache_gb: float = 0.0) -> BenchRun:
    """The cells in this process: the target (`target`, or `load_target()` when None) and, for a
    speculative setting, the draft (`load_draft(target)`); schedulers of `max_seq_len` tokens (by
    default the workload's longest prompt plus output) and `num_pages` KV pages (None: the
    scheduler's default)."""
    target = target if target is not None else load_target()
    needs_draft = any(s.spec is not None for s in settings)
    draft = load_draft(target) if needs_draft else None
    sched_len = max_seq_len or workload.max_total_len
    config = {**config, **in_process_config(target, mesh, draft=draft_path if needs_draft else None,
                                             scheduler_max_seq_len=sched_len, overlap=overlap,
                                             prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype,
                                             host_kv_cache_gb=host_kv_cache_gb),
              "num_pages": num_pages}
    cells = run_benchmark(target, draft, settings, workload, cfg, max_seq_len=sched_len, page_size=page_size,
                          prefill_chunk=prefill_chunk, num_devices=num_devices, overlap=overlap,
                          prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype, num_pages=num_pages,
                          host_kv_cache_gb=host_kv_cache_gb)
    return BenchRun(cells, "in-process", config)
