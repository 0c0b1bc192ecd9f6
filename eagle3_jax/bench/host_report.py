"""scripts/bench_host.py's printed tables and JSON record.

- the main table: a row per (setting, num_seqs), its columns SCHEDULER_COLUMNS (the scheduler
  driven directly) or ENGINE_COLUMNS (--through_engine); a figure that is None shows as "-";
- `phases_table`: a phase per line, a column per row (--phases);
- `profile_tables`: the phases' cumulative ms per iteration and the top functions by own time,
  from the measured iterations' cProfiles (--profile);
- `host_time_record`: the JSON written to --json_out (command, date, machine, options, rows).

Each function returns the text; the script prints it.
"""

from __future__ import annotations

import datetime
import os
import platform
import pstats
import string
from typing import Mapping, Sequence

from .host_time import PHASES

# The printed tables' columns after spec and seqs: (header, format of the row's figures).
SCHEDULER_COLUMNS = (("host ms / iteration (median)", "{host_ms_per_iteration:.2f}"),
                     ("host ms (mean)", "{host_ms_mean:.2f}"),
                     ("of which launches (median)", "{launch_ms_per_iteration:.2f}"),
                     ("the rest: scheduler (median)", "{scheduler_ms_per_iteration:.2f}"),
                     ("host CPU ms (median)", "{host_cpu_ms_per_iteration:.2f}"),
                     ("launch floor ms", "{launch_floor_ms:.3f}"), ("cold floor ms", "{launch_floor_cold_ms:.3f}"),
                     ("a step's launch after its program ms", "{step_relaunch_ms:.3f}"),
                     ("device wait ms (median)", "{device_wait_ms_per_iteration:.2f}"),
                     ("tokens / iteration", "{tokens_per_iteration:.1f}"), ("iterations timed", "{iterations}"),
                     ("left out (compiled)", "{iterations_that_compiled}"))
ENGINE_COLUMNS = (("scheduler host ms / iteration (median)", "{host_ms_per_iteration:.2f}"),
                  ("engine thread outside step(): CPU ms (median)", "{engine_cpu_ms_outside_step:.3f}"),
                  ("wall ms (median)", "{engine_wall_ms_outside_step:.3f}"),
                  ("engine thread host ms / iteration (median)", "{engine_host_ms_per_iteration:.2f}"),
                  ("iterations timed", "{iterations}"), ("left out (compiled)", "{iterations_that_compiled}"))

Columns = Sequence[tuple[str, str]]


def table_header(columns: Columns) -> str:
    """The main table's header and separator lines."""
    return "| spec | seqs | " + " | ".join(header for header, _ in columns) + " |\n|---|---|" + "---|" * len(columns)


def table_row(columns: Columns, row: Mapping) -> str:
    """One row of the main table (`row` holds its `spec`, `num_seqs` and figures)."""
    return f"| {row['spec']} | {row['num_seqs']} | " + " | ".join(cell(template, row) for _, template in columns) + " |"


def cell(template: str, row: Mapping) -> str:
    """A table cell of `row`'s figures, "-" where one is missing (None)."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    return "-" if any(row[name] is None for name in names) else template.format(**row)


def phases_table(rows: Sequence[Mapping]) -> str:
    """The --phases table (after a blank line): a phase per line, a column per measured (spec, seqs)."""
    lines = ["", "| phase (host ms / iteration, median) | " + " | ".join(f"{r['spec']} x{r['num_seqs']}" for r in rows)
             + " |", "|---|" + "---|" * len(rows)]
    for label, *_ in PHASES:
        lines.append(f"| {label} | " + " | ".join(f"{r['phases_ms_per_iteration'][label]:.3f}" for r in rows) + " |")
    return "\n".join(lines)


def merged_stats(profiles: Sequence) -> dict:
    """The profiles' statistics added up: (file, line, function) -> (calls, primitive calls, own
    seconds, cumulative seconds, callers), as pstats keeps them."""
    merged = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        merged.add(profile)
    return merged.stats


def profile_tables(stats: Mapping, iterations: int, top: int) -> str:
    """The phases' cumulative ms per iteration (each PHASES method, by its file's suffix and name),
    then the `top` functions by own time (calls and ms per iteration), over `iterations`
    iterations' merged `stats`; between blank lines."""
    lines = ["", "| phase | ms / iteration (cumulative) |", "|---|---|"]
    for label, _, suffix, name in PHASES:
        total = sum(v[3] for (file, _, fn), v in stats.items() if fn == name and file.endswith(suffix))
        lines.append(f"| {label} | {1e3 * total / iterations:.3f} |")
    lines += ["", f"| function (top {top} by own time) | calls / iteration | own ms / iteration | cumulative ms |",
              "|---|---|---|---|"]
    for (file, line, name), (calls, _, own, cumulative, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{'/'.join(file.split('/')[-2:])}:{line}({name})"
        lines.append(f"| {where} | {calls / iterations:.1f} | {1e3 * own / iterations:.3f} | "
                     f"{1e3 * cumulative / iterations:.3f} |")
    return "\n".join(lines + [""])


def machine_line() -> str:
    """This host in one line: architecture, CPU cores, platform."""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}"


def host_time_record(rows: Sequence[dict], *, argv: Sequence[str], overlap: bool, detokenize: bool,
                     stop_string: str | None, through_engine: bool, stand_in_device: bool,
                     date: str | None = None, machine: str | None = None) -> dict:
    """The --json_out record: the command line (`python` and `argv`), the date (today by default),
    the machine (`machine_line()` by default), the options that shape the figures, and the rows."""
    return {"command": " ".join(["python", *argv]), "date": date or datetime.date.today().isoformat(),
            "machine": machine or machine_line(),
            "overlap": overlap, "detokenize": detokenize, "stop_string": stop_string,
            "through_engine": through_engine, "stand_in_device": stand_in_device, "rows": list(rows)}
