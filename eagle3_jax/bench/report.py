"""Benchmark reports: a JSON dump of everything, a markdown table in the AMD blog's shape, plots.

The table has one row per concurrency:

    | concurrency | no-spec tok/s | EAGLE-3 chain:3:1:4 tok/s (speedup) | ... | no-spec TPOT (ms) | ...
      ... | chain:3:1:4 tau | ...

Figures are means over the seeds of a run; a speculative setting's speedup is its mean output
tokens/s over the no-spec mean at the same concurrency. The plots show output tokens/s and mean
TPOT against concurrency, one line per speculation setting.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
import types
from typing import Sequence

from ..checkpoint.atomic import atomic_output, check_output
from ..runtime import host_allocator
from ..runtime.extras import require
from .metrics import mean_or_none, speedup

_ROW_KEYS = {  # aggregated figure -> how to read it from a cell's metrics
    "output_throughput": lambda m: m["output_throughput"],
    "output_throughput_per_device": lambda m: m["output_throughput_per_device"],
    "request_throughput": lambda m: m["request_throughput"],
    "ttft_ms_mean": lambda m: m["ttft_ms"]["mean"],
    "tpot_ms_mean": lambda m: m["tpot_ms"]["mean"],
    "itl_ms_mean": lambda m: m["itl_ms"]["mean"],
    "e2e_latency_ms_mean": lambda m: m["e2e_latency_ms"]["mean"],
    "tau": lambda m: m.get("acceptance", {}).get("tau"),
    "prefix_cache_hit_rate": lambda m: m.get("prefix_cache_hit_rate"),  # None without the prefix cache
}


# A cell is timed over its wall time, which includes the ramp-up (clients starting) and the tail (fewer
# than C requests left): each client should send several requests one after another, and the mean
# needs enough requests to be more than noise.
MIN_REQUESTS_PER_CLIENT = 5
MIN_REQUESTS = 10  # vLLM bench's default at concurrency 1


def requests_needed(concurrency: int) -> int:
    """The fewest measured requests that time a cell at `concurrency`."""
    return max(MIN_REQUESTS_PER_CLIENT * int(concurrency), MIN_REQUESTS)


def too_few_requests(num_requests: int | None, concurrency: int) -> int | None:
    """The request count to suggest when `num_requests` is too few to time a cell (None when enough)."""
    need = requests_needed(concurrency)
    return need if num_requests is not None and num_requests < need else None


def machine_info() -> dict:
    """Platform, CPU count, Python and JAX versions, JAX backend and devices, the host allocator."""
    import jax

    devices = jax.devices()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind if devices else None,
        "host_allocator": host_allocator.describe(),
    }


def aggregate(cells: Sequence[dict]) -> list[dict]:
    """One row per (setting, concurrency): figures averaged over seeds, speedup of the means."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for c in cells:
        groups.setdefault((c["setting"], c["concurrency"]), []).append(c)
    # Rows by concurrency, then settings in first-run order (cells may run in rotating order).
    order = {s: i for i, s in enumerate(dict.fromkeys(c["setting"] for c in cells))}
    rows = []
    for (setting, conc), group in sorted(groups.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])):
        row = {"setting": setting, "label": group[0]["label"], "concurrency": conc,
               "seeds": [c["seed"] for c in group]}
        row.update({k: mean_or_none(get(c["metrics"]) for c in group) for k, get in _ROW_KEYS.items()})
        flags = [c.get("identical_to_no_spec") for c in group]
        row["identical_to_no_spec"] = None if any(f is None for f in flags) else all(flags)
        counts = [c["metrics"].get("num_requests") for c in group if c["metrics"].get("num_requests") is not None]
        row["num_requests"] = min(counts) if counts else None
        row["too_few_requests"] = too_few_requests(row["num_requests"], conc)  # the count to suggest instead
        rows.append(row)
    base = {r["concurrency"]: r["output_throughput"] for r in rows if r["setting"] == "none"}
    for r in rows:
        r["speedup"] = speedup(r["output_throughput"], base.get(r["concurrency"]))
    return rows


def build_report(cells: Sequence[dict], *, settings: Sequence[str], workload: dict, config: dict,
                 argv: Sequence[str] | None = None, mode: str = "in-process", extra: dict | None = None) -> dict:
    """Everything about a run: command line, date, machine, workload, configuration, cells, rows."""
    return {
        "command": " ".join(argv if argv is not None else sys.argv),
        "argv": list(argv if argv is not None else sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine_info(),
        "mode": mode,
        "settings": list(settings),
        "workload": workload,
        "config": config,
        **(extra or {}),
        "rows": aggregate(cells),
        "cells": list(cells),
    }


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _row(rows: Sequence[dict], setting: str, conc: int) -> dict | None:
    return next((r for r in rows if r["setting"] == setting and r["concurrency"] == conc), None)


def markdown_table(report: dict) -> str:
    """The AMD-blog-shaped table: throughput (with speedup), then TPOT, then tau per setting."""
    rows = report["rows"]
    settings = report["settings"]
    labels = {r["setting"]: r["label"] for r in rows}
    has_base = "none" in settings
    spec_settings = [s for s in settings if s != "none"]
    short = {s: labels[s].replace("EAGLE-3 ", "") for s in settings}
    head = ["concurrency"]
    for s in settings:
        head.append(f"{labels[s]} tok/s" + (" (speedup)" if s != "none" and has_base else ""))
    head += [f"{short[s]} TPOT (ms)" for s in settings]
    head += [f"{short[s]} tau" for s in spec_settings]
    cached = [s for s in settings if any(r.get("prefix_cache_hit_rate") is not None for r in rows if r["setting"] == s)]
    head += [f"{short[s]} prefix hit rate" for s in cached]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for conc in sorted({r["concurrency"] for r in rows}):
        cells = [str(conc)]
        for s in settings:
            r = _row(rows, s, conc)
            text = _fmt(r and r["output_throughput"])
            if s != "none" and has_base and r is not None and r["speedup"] is not None:
                text += f" ({r['speedup']:.2f}x)"
            if r is not None and r.get("too_few_requests"):
                text += " *"
            cells.append(text)
        cells += [_fmt((_row(rows, s, conc) or {}).get("tpot_ms_mean"), 2) for s in settings]
        cells += [_fmt((_row(rows, s, conc) or {}).get("tau"), 2) for s in spec_settings]
        cells += [_fmt((_row(rows, s, conc) or {}).get("prefix_cache_hit_rate"), 2) for s in cached]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _describe_workload(w: dict) -> str:
    if w.get("kind") == "random":
        return (f"random tokens, shape {w['shape']} x {w['scale']:g} = {w['input_len']} in / {w['output_len']} out")
    if w.get("kind") == "dataset":
        return (f"{w['dataset']} ({w['num_prompts_fitting']} of {w['num_records']} prompts fit; "
                f"mean prompt {w['prompt_len_mean']:.0f} tokens), {w['output_len']} out")
    return str(w)


def _count(n: int | None, per_c: int, least: int | None = None) -> str:
    if n is not None:
        return str(n)
    return f"{per_c} x concurrency" + (f" (at least {least})" if least else "")


def _truncation(cfg: dict) -> str:
    """', top-p P, top-k K' for the settings a run's sampled requests kept (older records: none)."""
    parts = [f"top-p {cfg['top_p']}" if cfg.get("top_p", 1.0) != 1.0 else "",
             f"top-k {cfg['top_k']}" if cfg.get("top_k") else ""]
    return "".join(f", {p}" for p in parts if p)


def _compile_note(cells: Sequence[dict]) -> list[str]:
    """A line on cells re-measured because XLA compiled mid-measurement (none: no line)."""
    repeated = sum(c.get("measure_attempts", 1) > 1 for c in cells)
    dirty = sum(c.get("compiles_during_measurement", 0) > 0 for c in cells)
    if not repeated and not dirty:
        return []
    note = f"{repeated} of {len(cells)} cells were re-measured after a compile during measurement"
    return [note + (f"; {dirty} still compiled in their last pass (their figures include compile time)." if dirty
                    else "; every reported pass ran without compiling.")]


def _repeats_note(repeats: int) -> list[str]:
    """A line on repeated measured passes (one pass: no line)."""
    if repeats <= 1:
        return []
    return [f"Each cell is the median of {repeats} measured passes by output throughput (the lower median for an "
            "even count; every pass's throughput is in the JSON, `passes_output_throughput`)."]


def markdown(report: dict) -> str:
    """The report as markdown: what ran, where, when, then the table."""
    m, cfg = report["machine"], report["config"]
    flags = [r["identical_to_no_spec"] for r in report["rows"] if r["setting"] != "none"]
    ident = "n/a" if not flags or any(f is None for f in flags) else ("yes" if all(flags) else "NO")
    dtype = f"dtype {cfg['dtype']}; " if cfg.get("dtype") else ""  # unknown over HTTP: the server's
    where = "Machine" if report["mode"] == "in-process" else "Client machine"
    lines = [
        *([synthetic_note(cfg["synthetic_acceptance"])] if cfg.get("synthetic_acceptance") else []),
        f"Workload: {_describe_workload(report['workload'])}, ignore-EOS.",
        f"Requests per cell: {_count(cfg.get('num_prompts'), 10, cfg.get('min_prompts'))}, "
        f"after {_count(cfg.get('num_warmups'), 2, cfg.get('min_warmups'))} warm-ups; seeds {', '.join(map(str, cfg.get('seeds') or []))}; temperature {cfg.get('temperature')}{_truncation(cfg)}; "
        f"{dtype}{report['mode']}.",
        f"{where}: {m['jax_backend']} x{len(m['jax_devices'])} ({m['device_kind']}), {m['machine']}, "
        f"{m['cpu_count']} CPUs, JAX {m['jax']}. Date: {report['date']}.",
        f"Command: `{report['command']}`",
        f"Greedy outputs identical to no-spec: {ident}.",
        *_compile_note(report["cells"]),
        *_repeats_note(cfg.get("repeats", 1)),
        "",
        markdown_table(report),
        "",
        *too_few_notes(report["rows"]),
    ]
    return "\n".join(lines)


def synthetic_note(profile: Sequence[float]) -> str:
    """The header line of a report whose acceptance was forced."""
    rates = ", ".join(f"{x:g}" for x in profile)
    return (f"**Synthetic acceptance** ({rates} per draft position, tau {1 + sum(profile):.2f} when the draft "
            f"proposes {len(profile)} or more): verification was forced to accept, so these figures are the "
            f"speculative step's cost at that acceptance, and the outputs are not the target's.")


def too_few_notes(rows: Sequence[dict]) -> list[str]:
    """A footnote for the table's cells marked `*`: which ones were timed over too few requests, and the
    count to rerun them with."""
    short = {}
    for r in rows:
        if r.get("too_few_requests"):
            short.setdefault(r["concurrency"], (r["num_requests"], r["too_few_requests"]))
    if not short:
        return []
    cells = ", ".join(f"concurrency {c}: {n} requests" for c, (n, _) in sorted(short.items()))
    need = max(want for _, want in short.values())
    return [f"\\* too few requests to time ({cells}; fewer than {MIN_REQUESTS_PER_CLIENT} per concurrent client or "
            f"{MIN_REQUESTS} in all): the figures are mostly ramp-up and tail. Rerun with --num_prompts={need} "
            f"(or --min_prompts={need}).", ""]


def plot_title(report: dict) -> str:
    """Two lines naming what was measured: model (and server, over HTTP) and machine, then the workload."""
    cfg, m = report["config"], report["machine"]
    model = os.path.basename(os.path.normpath(cfg.get("target") or "?"))
    if cfg.get("draft"):
        model += " + " + os.path.basename(os.path.normpath(cfg["draft"]))
    devices = f"{m['jax_backend']} x{len(m['jax_devices'])}" + (f" ({m['device_kind']})" if m.get("device_kind") else "")
    where = devices if report["mode"] == "in-process" else f"{report['mode']}, client on {devices}"
    forced = cfg.get("synthetic_acceptance")
    note = f"; SYNTHETIC acceptance {','.join(f'{x:g}' for x in forced)}" if forced else ""
    return f"{model} on {where}, {m['cpu_count']} CPUs\n{_describe_workload(report['workload'])}{note}"


def pyplot() -> types.ModuleType:
    """matplotlib.pyplot, drawing to files only; MissingExtraError (naming the bench extra) without
    matplotlib. Scripts that plot at the end call it first, so a long run does not fail at its end."""
    matplotlib = require("matplotlib", "bench", "plotting benchmark results")
    matplotlib.use("Agg")  # files only: no display needed
    return importlib.import_module("matplotlib.pyplot")


def plot(report: dict, key: str, ylabel: str, path: str) -> None:
    """A PNG of row figure `key` against concurrency, one line per setting (log2 x axis)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    try:
        for s in report["settings"]:
            pts = sorted((r["concurrency"], r[key]) for r in report["rows"] if r["setting"] == s and r[key] is not None)
            if pts:
                label = next(r["label"] for r in report["rows"] if r["setting"] == s)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        concs = sorted({r["concurrency"] for r in report["rows"]})
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(plot_title(report), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def report_paths(out_dir: str | os.PathLike, name: str) -> dict[str, str]:
    """The files a report named `name` is written to in `out_dir`, by kind."""
    if not name or os.sep in name or name in (".", ".."):
        raise ValueError(f"report name must be a plain file stem; got {name!r}")
    out_dir = os.fspath(out_dir)
    return {k: os.path.join(out_dir, f"{name}{suffix}") for k, suffix in
            (("json", ".json"), ("md", ".md"), ("throughput", "_throughput.png"), ("tpot", "_tpot.png"))}


def check_report_paths(out_dir: str | os.PathLike, name: str, overwrite: bool = False) -> dict[str, str]:
    """`report_paths`, each checked as `checkpoint.atomic.check_output` does (before a run, so that
    an earlier report is not found in the way only at its end)."""
    paths = report_paths(out_dir, name)
    for path in paths.values():
        check_output(path, name="report file", overwrite=overwrite, is_file=True)
    return paths


def write_report(report: dict, out_dir: str | os.PathLike, name: str, overwrite: bool = False) -> dict[str, str]:
    """Write <name>.json, <name>.md, <name>_throughput.png and <name>_tpot.png; returns their paths.

    Existing files are replaced only with `overwrite`; each is written beside its place and swapped
    in complete (`checkpoint.atomic`), so an interrupted write leaves the old report readable."""
    paths = check_report_paths(out_dir, name, overwrite)
    os.makedirs(os.fspath(out_dir), exist_ok=True)
    with atomic_output(paths["json"], name="report file", overwrite=overwrite, is_file=True) as tmp:
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, allow_nan=False)
            f.write("\n")
    with atomic_output(paths["md"], name="report file", overwrite=overwrite, is_file=True) as tmp:
        with open(tmp, "w") as f:
            f.write(markdown(report))
    for key, figure, label in (("throughput", "output_throughput", "output tokens/s"),
                               ("tpot", "tpot_ms_mean", "mean TPOT (ms)")):
        with atomic_output(paths[key], name="report file", overwrite=overwrite, is_file=True) as tmp:
            plot(report, figure, label, tmp)
    return paths
